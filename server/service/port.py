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

Everything here is typing, one exception class and how to read a client's error answer to a
file read: importing this module costs nothing at start-up.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class ClientRequestError(Exception):
    """The client answered a server→client request with an error (raised by a port's
    ``request_client``)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


#: error codes of a client's answer that say why a read failed, and it is not "no such file"
_OTHER_FAILURE_CODES = frozenset({-32600, -32601, -32700, -32800})
_RESOURCE_NOT_FOUND = -32002
_NOT_FOUND_TEXT = re.compile(r"no such file|not[ _-]?found|\benoent\b|does ?n[o']t exist|non-?existent|"
                             r"os error 2\b|cannot find the (?:file|path)", re.IGNORECASE)


def client_says_not_found(err: Any, real: Path | str) -> bool:
    """Whether a client's error answer to ``fs/readTextFile`` of ``real`` means "no such file":
    the code -32002 ("Resource not found", as ACP's and MCP's clients answer), or a message (or
    ``data``) that says so: "No such file or directory" (Neovim's answer, with -32602), ENOENT,
    FileNotFound / EntryNotFound, "not found", "does not exist", "nonexistent" (VS Code's, with
    -32603)... The path itself is left out of the text first (a folder named "not found" says
    nothing). An answer whose code says something else never means it: -32600 (the answer was
    over ``maxMessageBytes``), -32601 (the client serves no such method), -32700, -32800."""
    code = getattr(err, "code", None)
    if code in _OTHER_FAILURE_CODES:
        return False
    if code == _RESOURCE_NOT_FOUND:
        return True
    data = getattr(err, "data", None)
    parts = [str(getattr(err, "message", None) or err)]
    if isinstance(data, str):
        parts.append(data)
    elif isinstance(data, dict):
        parts.extend(str(v) for k, v in data.items() if k not in ("uri", "path") and isinstance(v, (str, int)))
    text = " ".join(parts).replace(str(real), " ")
    return _NOT_FOUND_TEXT.search(text) is not None


def client_error_reason(err: Any) -> str:
    """A client's error answer as a tool error's reason: its message, and its ``data`` when
    that is text the message does not hold (an ACP client's "Internal error" says why there),
    its first 500 characters, masked before that cut (docs/SECURITY.md G6)."""
    message = str(getattr(err, "message", None) or err)
    data = getattr(err, "data", None)
    if isinstance(data, str) and data.strip() and data not in message:
        from ..redaction import redact_cut  # (standard library only)

        message = f"{message} ({redact_cut(data, 500)})"
    return message


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
    #
    # def thought(self, token: Any, text: str) -> None:
    #     A reasoning model's thoughts (the provider's ``thinking`` chunks: ``reasoning_content``
    #     of an OpenAI-compatible server, a CLI model's thinking blocks), streamed, redacted, in
    #     order with the operate's ``$/progress`` of that ``token``. Not part of the reply and
    #     never recorded. For a front end that shows them (the ACP one: ``agent_thought_chunk``);
    #     without it, the native wire sends them as ``thinking`` reports with ``thought`` to a
    #     client that announced ``capabilities.thoughts`` (``WireProgress``), else nothing but the
    #     stretch's one "thinking" report.
    #
    # def log_branch_problem(self, type_: int, message: str) -> None:   (on ``conn``)
    #     Instead of ``log_message``, a warning that concerns some branches only: a stored
    #     branch's model not configured, an MCP server a session passed
    #     (``Service.add_branch_mcp_servers``) failed or had its tools offered under other names.
    #     The service keeps it for those branches (``Service.branch_problems``), so a front end
    #     can tell those sessions only.
    #
    # def log_problem_over(self, message: str) -> None:   (on ``conn``)
    #     A warning logged before is over (the MCP server it was about is started again, or no
    #     branch holds it any more): the same message logged later is a new occurrence, which a
    #     front end that tells each warning once (the ACP one) tells again.


__all__ = ["ClientInfo", "ClientPort", "ClientRequestError", "client_error_reason", "client_says_not_found"]
