"""Tool governance as data (docs/PROTOCOL.md §4). The core asks ``branch.authorizer``;
this module answers from the policy in force and, for ``ask``, from the client.

Policy in force: the branch's decision, else the server-wide decision, else
``settings.toolPolicy``, else the default (``allow`` for client tools, Python
tools and tools annotated read-only, ``ask`` otherwise).

A branch also has a permission *mode* (``MODES``), applied before the policy in force:
``ask`` (the default: the policy decides), ``read-only`` (a tool not annotated read-only is
denied, whatever its policy) and ``auto-edit`` (the builtin tools that change workspace
files run without asking unless their policy is ``deny``; everything else as in ``ask``).
The ACP front end offers it as the session's mode; it is saved with the branch.

A permission request for a tool that can preview its calls (the file-changing builtin
tools, ``server.tools.file_tools.PreviewTool``) carries ``preview`` (a diff computed without
writing). When the preview cannot be made (edits that do not apply, a path outside the
workspace, bad arguments), nobody is asked: the call is let through to fail at once with
that error, which the tool kept for the call (it never re-plans it, so it cannot write)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from .port import ClientRequestError

log = logging.getLogger(__name__)

PERMISSION_OPTIONS = ["allow_once", "allow_always", "deny_once", "deny_always"]
#: permission modes of a branch (see the module docstring); ``ask`` is the default
MODES = ("ask", "auto-edit", "read-only")
#: the reason a call denied by the ``read-only`` mode gives
READ_ONLY_DENIAL = "denied: the branch is in read-only mode"


def default_decision(tool: Any) -> str:
    if tool is None:
        return "ask"
    if getattr(tool, "source", None) in ("client", "python") or getattr(tool, "read_only", False):
        return "allow"
    return "ask"


def edits_workspace_files(tool: Any) -> bool:
    """A builtin tool that changes files in the workspace (what ``auto-edit`` lets run)."""
    from operate_sidecar.server.tools.file_tools import FILE_CHANGING

    return getattr(tool, "source", None) == "builtin" and getattr(tool, "name", None) in FILE_CHANGING


class Governance:
    def __init__(self, *, settings_policy: dict[str, str], timeout_ms: float, can_ask: Callable[[], bool],
                 ask_client: Callable[[str, dict, float], Awaitable[Any]],
                 on_branch_change: Callable[[str], None] | None = None) -> None:
        self.settings_policy = dict(settings_policy)
        self.timeout_s = float(timeout_ms) / 1000.0
        self.server_wide: dict[str, str] = {}
        self.branch: dict[str, dict[str, str]] = {}
        #: branch id -> permission mode, when not ``ask``
        self.modes: dict[str, str] = {}
        self._can_ask = can_ask
        self._ask_client = ask_client
        self._on_branch_change = on_branch_change

    # ------------------------------------------------------------ policy data
    def policy_for(self, tool: Any, branch_id: str | None = None) -> str:
        name = tool if isinstance(tool, str) else getattr(tool, "name", None)
        if branch_id is not None:
            d = self.branch.get(branch_id, {}).get(name)
            if d is not None:
                return d
        d = self.server_wide.get(name)
        if d is not None:
            return d
        d = self.settings_policy.get(name)
        if d is not None:
            return d
        return default_decision(None if isinstance(tool, str) else tool)

    def set(self, tool: str, decision: str, branch_id: str | None = None) -> None:
        if branch_id is None:
            self.server_wide[tool] = decision
        else:
            self.branch.setdefault(branch_id, {})[tool] = decision
            if self._on_branch_change is not None:
                self._on_branch_change(branch_id)

    def mode_of(self, branch_id: str | None) -> str:
        return self.modes.get(branch_id, "ask") if branch_id is not None else "ask"

    def set_mode(self, branch_id: str, mode: str, *, notify: bool = True) -> None:
        """Set a branch's permission mode (one of ``MODES``; ``ValueError`` otherwise)."""
        if mode not in MODES:
            raise ValueError(f"unknown permission mode {mode!r}; one of {', '.join(MODES)}")
        if mode == "ask":
            self.modes.pop(branch_id, None)
        else:
            self.modes[branch_id] = mode
        if notify and self._on_branch_change is not None:
            self._on_branch_change(branch_id)

    def copy_branch(self, src: str, dst: str) -> None:
        if src in self.branch:
            self.branch[dst] = dict(self.branch[src])
        if src in self.modes:
            self.modes[dst] = self.modes[src]

    def forget_branch(self, branch_id: str) -> None:
        self.branch.pop(branch_id, None)
        self.modes.pop(branch_id, None)

    # ------------------------------------------------------------ the authorizer
    async def authorize(self, inv: Any) -> Any:
        from operate_sidecar.server.core.act import AuthorizationResult

        decision = self.policy_for(inv.tool if inv.tool is not None else inv.function, inv.branch_id)
        mode = self.mode_of(inv.branch_id)
        if mode == "read-only" and not getattr(inv.tool, "read_only", False):
            return AuthorizationResult(False, READ_ONLY_DENIAL)
        if mode == "auto-edit" and decision != "deny" and edits_workspace_files(inv.tool):
            return AuthorizationResult(True)
        if decision == "allow":
            return AuthorizationResult(True)
        if decision == "deny":
            return AuthorizationResult(False, "denied by policy")
        if not self._can_ask():
            return AuthorizationResult(False, "policy is ask and the client cannot be asked")
        params = {"branchId": inv.branch_id, "callId": inv.call_id, "tool": inv.function,
                  "arguments": inv.arguments, "options": list(PERMISSION_OPTIONS)}
        preview = getattr(inv.tool, "preview", None)
        if preview is not None:
            # the change the call would make, computed without writing; a call that cannot
            # apply is never put to the user: it goes on to fail at once with its own error
            from operate_sidecar.server.core.tools import ToolCallContext

            try:
                inv.tool.validate_arguments(inv.arguments)
                params["preview"] = await preview(inv.arguments, ToolCallContext(inv.branch_id, inv.call_id))
            except Exception:
                return AuthorizationResult(True)
        result = AuthorizationResult(False, "permission request was not answered")
        try:
            result = await self._ask(inv, params)
            return result
        finally:
            if not result.allowed and preview is not None:
                inv.tool.forget(inv.call_id)

    async def _ask(self, inv: Any, params: dict) -> Any:
        from operate_sidecar.server.core.act import AuthorizationResult

        try:
            answer = await self._ask_client("requestToolPermission", params, self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return AuthorizationResult(False, "permission request timed out")
        except ClientRequestError as e:
            return AuthorizationResult(False, f"permission request failed: {e.message}")
        except Exception as e:  # noqa: BLE001 - a fault of the front end asking: this call is denied, the turn goes on
            # (raised on, it failed the whole operate, the ACP prompt with -32603, for one call)
            log.warning("the permission request for %s failed", inv.function, exc_info=True)
            return AuthorizationResult(False, f"permission request failed: {type(e).__name__}: {e}")
        choice = answer.get("decision") if isinstance(answer, dict) else None
        if choice == "allow_once":
            return AuthorizationResult(True)
        if choice == "allow_always":
            self.set(inv.function, "allow", inv.branch_id)
            return AuthorizationResult(True)
        if choice == "deny_always":
            self.set(inv.function, "deny", inv.branch_id)
            return AuthorizationResult(False, "denied by the user")
        if choice == "deny_once":
            return AuthorizationResult(False, "denied by the user")
        # denied, quoting what came (bounded): its decision, or the whole answer when that is not an object
        # with one (a bare "allow_once", a list, an object that misspells the key)
        came = _quoted(choice if isinstance(answer, dict) and "decision" in answer else answer)
        return AuthorizationResult(False, f"invalid permission answer {came if len(came) <= 80 else came[:80] + '...'}")


def _quoted(value: Any) -> str:
    """``repr(value)`` (a client's answer: any JSON), shortened as it is written: three levels
    deep at most, and no string or number longer than the 80 characters a reason quotes (and a
    little more), so that an answer nested hundreds of levels deep (``repr`` raised
    RecursionError, which ended the operate) or megabytes long costs no more than its first
    characters."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel = 3
    short.maxstring = short.maxlong = short.maxother = 200
    return short.repr(value)
