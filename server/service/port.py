"""The interface between the service (branches, governance, tools, models, the store:
``server.service.service.Service``) and whichever front end talks to the client.

The service never touches a wire. It reaches its client only through a ``ClientPort``,
which each front end implements in its own protocol's terms:

- the native front end (``server.rpc``: Content-Length framed JSON-RPC) passes its
  ``SidecarServer``; names and params go out unchanged;
- the Agent Client Protocol front end (``server.acp``) passes an ``AcpPort``, which
  translates the same native names into ACP (``requestToolPermission`` becomes
  ``session/request_permission``, ``toolEvent`` becomes ``tool_call`` /
  ``tool_call_update``, ``$/progress`` deltas become ``agent_message_chunk`` ...).

Everything here is typing and one exception class: importing this module costs nothing at start-up.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class ClientRequestError(Exception):
    """The client answered a server→client request with an error (raised by a port's
    ``request_client``)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


@runtime_checkable
class ClientInfo(Protocol):
    """What the service may read about its client (``port.conn``)."""

    #: The merged, validated settings in force (defaults ← flags ← config file ← client).
    #: Read-only for the service: keys as in ``server.rpc.settings.DEFAULTS``.
    settings: dict[str, Any]

    #: What the client can do, in native names: ``toolPermission`` (may be asked
    #: ``requestToolPermission``), ``clientTools`` (serves ``invokeClientTool``) and
    #: ``fs`` (serves ``fs/readTextFile`` / ``fs/writeTextFile``). Missing means no.
    client_capabilities: dict[str, Any]

    #: Absolute paths of the folders the builtin workspace tools are confined to. A front end
    #: whose sessions each have their own folders (ACP: a session's ``cwd``) also sets
    #: ``folders_per_branch = True`` and gives each branch its folders
    #: (``Service.set_branch_folders``); its operates are then confined to those.
    workspace_folders: list[str]

    def log_message(self, type_: int, message: str) -> None:
        """Tell the user something (1 error, 2 warning, 3 info, 4 log). Always logged to
        stderr; a front end forwards it to the client when its protocol can show it."""


@runtime_checkable
class ClientPort(Protocol):
    """How the service talks to its client. Implementations: the native front end's
    ``server.rpc.server.SidecarServer`` and ``server.acp.port.AcpPort``."""

    #: The client's settings, capabilities and folders, and its log channel.
    conn: ClientInfo

    def notify(self, method: str, params: Any) -> None:
        """Send a notification, by native name, without waiting: ``toolEvent`` (one per tool
        hook event, in order), ``$/progress`` (``begin`` / ``report`` with streamed ``delta``
        text / ``end``, for an operate that carried a ``workDoneToken``). Notifications of
        one operate are delivered in the order they were made and before its answer."""

    async def request_client(self, method: str, params: Any, timeout: float | None) -> Any:
        """Ask the client, by native name, and return its answer (the native result shape):

        - ``requestToolPermission`` ``{branchId, callId, tool, arguments, options, preview?}``
          → ``{decision: "allow_once" | "allow_always" | "deny_once" | "deny_always"}``;
        - ``invokeClientTool`` ``{branchId, callId, tool, arguments}`` → ``{output}``;
        - ``fs/readTextFile`` ``{branchId, callId, path}`` → ``{text}``;
        - ``fs/writeTextFile`` ``{branchId, callId, path, text}`` → ``{}``.

        An error answer (or a method the client cannot serve) raises
        ``ClientRequestError``; no answer within ``timeout`` seconds
        raises ``TimeoutError``; cancelling the awaiting task withdraws the request."""

    # Optional (looked up with ``getattr``; the native front end has none):
    #
    # async def tool_decided(self, params: dict) -> None:
    #     Awaited once governance has decided a tool call, before an allowed call runs:
    #     ``{branchId, callId, tool, arguments, allowed}``. For a front end that shows calls
    #     (the ACP one records the title, locations and diff the editor is shown). It cannot
    #     change the decision; an error it raises is logged.


__all__ = ["ClientInfo", "ClientPort", "ClientRequestError"]
