"""``AcpPort``: the service's ``ClientPort`` (``server.service.port``) spoken in ACP.

Native name (what the service sends)        ACP (what the editor sees)
- ``$/progress`` report ``delta``            ``agent_message_chunk`` (the reply's user text)
- ``$/progress`` report ``repair attempt N`` ``agent_thought_chunk`` (why the reply takes longer)
- ``thought`` (a reasoning model's thoughts) ``agent_thought_chunk`` (the thoughts, as they stream)
- ``$/progress`` ``end`` ``usage``           kept for the turn's ``usage_update`` / ``usage``
- ``toolEvent`` pre / post / error / denied  ``tool_call`` / ``tool_call_update`` (kind,
                                             locations, raw input and output, ``diff`` content)
- ``requestToolPermission``                  ``session/request_permission``; the options
                                             allow_once / allow_always / deny_once / deny_always
                                             are the kinds allow_once / allow_always /
                                             reject_once / reject_always
- ``fs/readTextFile`` / ``fs/writeTextFile`` ``fs/read_text_file`` / ``fs/write_text_file``
- ``invokeClientTool``                       refused (ACP clients register no tools)
- ``window/logMessage`` / ``log_message``    stderr, and an error or warning (type 1, 2) also as
                                             a notice: a short ``agent_message_chunk`` at the start
                                             of the next turn of each session it concerns, once
                                             per occurrence (ACP has no log notification; editors
                                             hide stderr); ``log_problem_over`` ends an occurrence
- ``tool_decided`` (a decided call)          what the editor is shown: title, kind, locations
                                             (none for a path that is no file name: a NUL, half
                                             a surrogate pair)

The ``diff`` of a builtin file edit is the file tool's own, never the file read here: the
permission request's ``preview`` (what an allowed call writes, or it fails), else (a call
allowed without asking) the change the tool reports it made, once it ran. A call that ran
and failed changed nothing: its last update has no diff, its error instead.

Each session's updates go out through an ordered outbox of its own, so they reach the client
in the order the service made them; ``flush(session_id)`` waits until every update queued for
that session is written (a prompt's answer, a permission request and a load's answer are sent
only after their session's updates), never for another session's: a long ``session/load``
replay holds up no other session's answers. A replay yields to the loop as it goes, and its
session's live updates (a turn running on it) follow it whole (``AcpPort.replaying``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator

from acp import (RequestError, text_block, tool_content, tool_diff_content, update_agent_message_text,
                 update_agent_thought_text)
from acp.schema import (ContentToolCallContent, PermissionOption, TextContentBlock, ToolCallLocation, ToolCallProgress,
                        ToolCallStart, ToolCallUpdate)
from pydantic import ValidationError

from operate_sidecar.server.service.port import ClientRequestError

from .reply import ReplyText, plan_of

log = logging.getLogger("operate_sidecar.server.acp")

#: native permission option → (ACP option kind, label)
PERMISSION_KINDS = {
    "allow_once": ("allow_once", "Allow once"),
    "allow_always": ("allow_always", "Always allow"),
    "deny_once": ("reject_once", "Reject"),
    "deny_always": ("reject_always", "Always reject"),
}
#: builtin tool → ACP tool kind; others are guessed from the name, else "other"
TOOL_KINDS = {"read_file": "read", "list_dir": "read", "search_text": "search", "write_file": "edit",
              "edit_file": "edit", "delete_file": "delete", "move_file": "move"}
_GUESS = (("search", "search"), ("grep", "search"), ("find", "search"), ("fetch", "fetch"), ("http", "fetch"),
          ("url", "fetch"), ("exec", "execute"), ("shell", "execute"), ("command", "execute"), ("run", "execute"),
          ("read", "read"), ("write", "edit"), ("edit", "edit"), ("delete", "delete"), ("move", "move"))
TEXT_CONTENT_LIMIT = 4000        # characters of a tool's output shown as its text content
DIFF_FILE_LIMIT = 2 * 1024 * 1024  # larger files get no diff content
UINT32_MAX = 2**32 - 1            # a location's line is a uint32 in the schema
NOTICE_LINE_LIMIT = 400           # characters of a warning's first line shown in a notice
NOTICES_KEPT = 50                 # server-wide warnings kept for sessions' next turns (then the oldest go)
REFUSED_WRITE_LIMIT = 4000        # characters of a refused write_file's proposed text shown on session/load
REPLAY_AHEAD = 1000               # updates of a replay queued ahead of the client's reading (``AcpPort.room``)

#: builtin tool → the verb of its title, as editors title their own agents' calls ("Read src/app.py")
TOOL_VERBS = {"read_file": "Read", "list_dir": "List", "search_text": "Search", "write_file": "Write",
              "edit_file": "Edit"}


def tool_title(tool: str, args: dict[str, Any]) -> str:
    """A call's title: short human text, the path as the model gave it. A builtin tool is its
    verb and what it works on ("Read src/app.py", "Search 'TODO' in src", "List ."); another
    tool is its name and the ``path`` or ``pattern`` argument it has, if any."""
    path = args.get("path") if isinstance(args.get("path"), str) else None
    pattern = args.get("pattern") if isinstance(args.get("pattern"), str) else None
    verb = TOOL_VERBS.get(tool)
    if verb is None:
        what = path or (repr(pattern) if pattern is not None else "")
        return f"{tool} {what}" if what else tool
    if tool == "search_text":
        if pattern is None:
            return verb
        return f"{verb} {pattern!r}" + (f" in {path}" if path and path != "." else "")
    if tool == "list_dir":
        return f"{verb} {path or '.'}"
    offset = args.get("offset") if tool == "read_file" else None
    where = f" (from line {offset})" if type(offset) is int and offset > 1 else ""
    return f"{verb} {path}{where}" if path else verb


def _log(type_: int, message: str) -> None:
    log.log({1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO}.get(type_, logging.DEBUG), "%s", message)


def notice_line(type_: int, message: str) -> str:
    """One warning as the editor shows it before the turn's reply: a markdown quote, its
    first line (the rest, an MCP server's stderr, stays in the log) and what to do."""
    first, _, rest = message.strip().partition("\n")
    if len(first) > NOTICE_LINE_LIMIT:
        first = first[:NOTICE_LINE_LIMIT - 1] + "…"
    first = first.rstrip(".")
    if first.startswith("MCP server") and " unavailable: " in first:
        todo = (" Its tools are not available in this session: check the server's command, arguments and "
                "environment in the editor's MCP server settings.")
    else:
        todo = ""
    more = " The agent's log (stderr) has the details." if rest.strip() else ""
    return f"> ⚠ **{'Error' if type_ == 1 else 'Warning'}:** {first}.{todo}{more}\n\n"


def changes_files(tool: str) -> bool:
    """Whether ``tool`` is a builtin file-changing tool (``file_tools.FILE_CHANGING``): the
    calls shown with a ``diff``. Asked once a call is made, so the core is loaded."""
    from operate_sidecar.server.tools.file_tools import FILE_CHANGING

    return tool in FILE_CHANGING


def tool_kind(name: str) -> str:
    k = TOOL_KINDS.get(name)
    if k is not None:
        return k
    low = name.lower()
    for part, kind in _GUESS:
        if part in low:
            return kind
    return "other"


@dataclass
class CallInfo:
    """What the editor is shown about one tool call (``callId``)."""

    session_id: str
    tool: str
    kind: str
    title: str
    raw_input: Any = None
    locations: list[Any] = field(default_factory=list)
    content: list[Any] = field(default_factory=list)
    started: bool = False    # the ``tool_call`` went out
    running: bool = False    # its ``in_progress`` went out (it runs)
    finished: bool = False   # a completed / failed status went out


@dataclass
class Turn:
    """The prompt turn running on a session."""

    reply: ReplyText = field(default_factory=ReplyText)
    usage: Any = None
    shown: bool = False  # user text went out in this turn (the next reply's text starts a new paragraph)
    plan: Any = None     # the plan last sent in this turn (a plan update goes out when it changes)

    def text(self, text: str) -> str:
        """``text`` of the current reply as it is shown: replies after the first are set apart."""
        if text and self.shown and self.reply.emitted == text:
            text = "\n\n" + text
        self.shown = self.shown or bool(text)
        return text


class _Outbox:
    """One session's updates on their way out: queued (``items``), written by ``pump`` one at a
    time; held during a replay (``held``) but those of the task replaying (``replayer``); ``idle``
    once none is queued, being written or held. Kept while its session is served (a reply's
    stream of chunks reuses it), freed once it is idle after ``release`` (``released``)."""

    __slots__ = ("items", "held", "replayer", "pump", "idle", "roomy", "released")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.held: list[Any] | None = None
        self.replayer: asyncio.Task | None = None
        self.pump: asyncio.Task | None = None
        self.idle = asyncio.Event()
        self.roomy: asyncio.Future | None = None  # a replay waiting for the queue to shrink
        self.released = False  # its session was closed or deleted: freed once idle (``_settle``)


class AcpPort:
    """The ``ClientPort`` of the ACP front end; ``conn`` is the port itself (``ClientInfo``)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.conn = self
        self.settings = settings
        #: native names: ``toolPermission`` always (ACP clients must answer request_permission),
        #: ``fs`` when the client reads and writes text files
        self.client_capabilities: dict[str, Any] = {"toolPermission": True}
        self.workspace_folders: list[str] = []
        #: each session has its own folders (its cwd first): the service confines a session's
        #: tools to them (``Service.set_branch_folders``); ``branch_folders`` reads them back
        self.folders_per_branch = True
        self.branch_folders: Callable[[str], list[str] | None] = lambda _sid: None
        self.client: Any = None          # the SDK's AgentSideConnection, set on connect
        self.turns: dict[str, Turn] = {}
        self.calls: dict[str, CallInfo] = {}
        self.branch_messages: Callable[[str], Any] = lambda _sid: ()
        self.cancel_turn: Callable[[str], None] = lambda _sid: None
        self._boxes: dict[str, _Outbox] = {}  # per session: its queued updates (``send``)
        self._warned_write_fallback = False
        #: notices: the errors and warnings (type 1, 2) a session's user is told at the start of
        #: its next turn (``notices_for``). ``notice_gen`` counts them: a turn of a session whose
        #: ``noticed`` is that count has nothing to tell (the one check on a warm prompt)
        self.notice_gen = 0
        self.noticed: dict[str, int] = {}
        self.notices: dict[str, int] = {}                       # server-wide: message -> type
        self.session_notices: dict[str, list[tuple[int, str]]] = {}  # one session's own
        #: a warning is told once per occurrence: message -> the number of its current one; a
        #: message said again is the same occurrence until the service says it is over
        #: (``log_problem_over``: in ``_over``), then it is a new one, told again
        self._occurrence: dict[str, int] = {}
        self._occurrences = 0
        self._over: set[str] = set()
        self._said: dict[str, dict[str, int]] = {}  # session -> message -> the occurrence it was told

    # ------------------------------------------------------------------ ClientInfo
    def log_message(self, type_: int, message: str) -> None:
        """stderr; an error or warning is also told to every session at its next turn."""
        _log(type_, message)
        if type_ not in (1, 2):
            return
        if self._occur(message) or message not in self.notices:  # (a new one is the newest)
            self.notices.pop(message, None)
            self.notices[message] = type_
            if len(self.notices) > NOTICES_KEPT:
                del self.notices[next(iter(self.notices))]
        self.notice_gen += 1

    def log_branch_problem(self, type_: int, message: str) -> None:
        """A warning that concerns some sessions only: stderr, and told to those sessions (the
        service keeps it for them: ``notices_for``'s ``problems``)."""
        _log(type_, message)
        if type_ in (1, 2):
            self._occur(message)
            self.notice_gen += 1

    def log_problem_over(self, message: str) -> None:
        """A warning told before is over (the MCP server it was about is started again, or no
        session holds it any more): the same message logged from now on is a new occurrence,
        told again to every session it concerns, those told the last one too. Nothing to tell
        now (no turn checks more for it)."""
        if message in self._occurrence:
            self._over.add(message)

    def _occur(self, message: str) -> bool:
        """``message`` logged: a new occurrence (True) unless its current one is not over."""
        if message in self._occurrence and message not in self._over:
            return False
        self._over.discard(message)
        self._occurrences += 1
        self._occurrence[message] = self._occurrences
        return True

    def tell(self, session_id: str, type_: int, message: str) -> None:
        """A warning for one session's user, at its next turn (not logged here)."""
        self.session_notices.setdefault(session_id, []).append((type_, message))
        self.notice_gen += 1

    def notices_for(self, session_id: str, problems: Callable[[str], list[str]]) -> str | None:
        """The notice a turn of the session starts with: the warnings it was not told yet (its
        own, those about the MCP servers it passed, the server-wide ones), as markdown; None when
        there are none. Each occurrence of a warning is told once per session (``_occur``).
        Called when ``noticed`` is behind."""
        self.noticed[session_id] = self.notice_gen
        said = self._said.setdefault(session_id, {})
        new: list[tuple[int, str]] = []
        for type_, message in (*self.session_notices.pop(session_id, ()),
                               *((2, m) for m in problems(session_id)), *((t, m) for m, t in self.notices.items())):
            occurrence = self._occurrence.get(message, 0)
            if said.get(message) != occurrence:
                said[message] = occurrence
                new.append((type_, message))
        return "".join(notice_line(t, m) for t, m in new) or None

    def forget_session(self, session_id: str) -> None:
        """A deleted session's notices, what it was told and its outbox (``session/delete``)."""
        self.noticed.pop(session_id, None)
        self._said.pop(session_id, None)
        self.session_notices.pop(session_id, None)
        self.release(session_id)

    # ------------------------------------------------------------------ the outboxes
    def send(self, session_id: str, update: Any) -> None:
        """Queue one session update (a model, or a callable making one when its turn comes). While
        the session's history is replayed (``replaying``), an update the replaying task did not
        make (its running turn's, or one of a task started during the replay) waits for the
        replay's end."""
        box = self._boxes.get(session_id)
        if box is None:
            box = self._boxes[session_id] = _Outbox()
        box.idle.clear()
        if box.held is not None and asyncio.current_task() is not box.replayer:
            box.held.append(update)
            return
        box.items.append(update)
        if box.pump is None:
            box.pump = asyncio.get_running_loop().create_task(self._run_pump(session_id, box), name="acp-outbox")

    async def flush(self, session_id: str) -> None:
        """Wait until every update queued for the session is written, and its replay, if one is
        under way, has ended and been written too. Another session's updates are not waited
        for: one session's long replay holds up no other's answers."""
        box = self._boxes.get(session_id)
        if box is not None:
            await box.idle.wait()

    def release(self, session_id: str) -> None:
        """The session's outbox freed (its session closed or deleted): now when it is idle, else
        once it is (what it still has queued goes out first)."""
        box = self._boxes.get(session_id)
        if box is not None:
            box.released = True
            self._settle(session_id, box)

    async def room(self, session_id: str) -> None:
        """Let the loop run, and wait while more than ``REPLAY_AHEAD`` updates of the session
        are queued (a replay goes no faster than the client reads)."""
        box = self._boxes.get(session_id)
        if box is None or len(box.items) <= REPLAY_AHEAD:
            await asyncio.sleep(0)
            return
        box.roomy = asyncio.get_running_loop().create_future()
        try:
            await box.roomy
        finally:
            box.roomy = None

    @contextlib.contextmanager
    def replaying(self, session_id: str) -> Iterator[None]:
        """A replay of the session's history (``session/load``) as one run of its updates: those
        this task sends go out in order, while the session's others (a turn running on it, a
        task started meanwhile: it is the task that counts, not what it inherited) are held
        until the replay ends, then follow it; ``flush(session_id)`` waits for the end. Other
        sessions' updates go out meanwhile."""
        box = self._boxes.get(session_id)
        if box is None:
            box = self._boxes[session_id] = _Outbox()
        assert box.held is None, "one replay at a time per session (``OperateAgent._in_order``)"
        box.held = []
        box.replayer = asyncio.current_task()
        box.idle.clear()
        try:
            yield
        finally:
            held, box.held, box.replayer = box.held, None, None
            for update in held:
                self.send(session_id, update)
            self._settle(session_id, box)

    def _settle(self, session_id: str, box: "_Outbox") -> None:
        """The session's outbox with nothing queued, written or held: its flushes end (and, once
        released, it is freed)."""
        if box.pump is None and not box.items and box.held is None:
            box.idle.set()
            if box.released and self._boxes.get(session_id) is box:
                del self._boxes[session_id]

    async def _run_pump(self, session_id: str, box: "_Outbox") -> None:
        """Write the session's queued updates, in order, one at a time (the SDK's writer takes
        every session's and every answer in turn: no session's run of updates holds up another's
        answer for more than one line)."""
        try:
            while box.items:
                update = box.items.popleft()
                if box.roomy is not None and len(box.items) <= REPLAY_AHEAD // 2 and not box.roomy.done():
                    box.roomy.set_result(None)
                try:
                    if callable(update):
                        update = update()
                    if update is not None and self.client is not None:
                        await self.client.session_update(session_id=session_id, update=update)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a closed connection: nothing to tell
                    log.debug("session update not sent: %s", e)
        finally:
            box.pump = None
            self._settle(session_id, box)

    async def aclose(self) -> None:
        for box in list(self._boxes.values()):
            if box.pump is not None:
                box.pump.cancel()
                try:
                    await box.pump
                except BaseException:
                    pass
            box.items.clear()
            box.held = box.replayer = None
            box.idle.set()
            if box.roomy is not None and not box.roomy.done():
                box.roomy.set_result(None)
        self._boxes.clear()

    # ------------------------------------------------------------------ notifications
    def notify(self, method: str, params: Any) -> None:
        if method == "toolEvent":
            self._tool_event(params)
        elif method == "$/progress":
            self._progress(params)
        elif method == "window/logMessage":
            self.log_message(params.get("type", 4), str(params.get("message")))

    def _progress(self, params: dict) -> None:
        sid = params.get("token")
        turn = self.turns.get(sid) if isinstance(sid, str) else None
        if turn is None:
            return
        value = params.get("value") or {}
        kind, phase = value.get("kind"), value.get("phase")
        if kind == "report" and phase == "request":  # a new model call: a new reply to read
            turn.reply = ReplyText()
        elif kind == "report" and phase == "parse":
            from operate_sidecar.server.core.progress import REPAIR_ATTEMPT  # loaded: a turn runs

            message = str(value.get("message") or "")
            if message.startswith(REPAIR_ATTEMPT):  # the reply did not parse: a repair turn, seconds of silence
                n = message[len(REPAIR_ATTEMPT):].strip()
                self.send(sid, update_agent_thought_text(
                    f"The reply was not in the expected format; asking the model to correct it (attempt {n}).\n"))
            else:  # the reply is whole: its plan, before its tools run
                self.send_plan(sid, turn, turn.reply.raw)
        elif kind == "report" and phase == "stream" and value.get("delta"):
            text = turn.text(turn.reply.feed(value["delta"]))
            if text:
                self.send(sid, update_agent_message_text(text))
        elif kind == "end" and value.get("usage") is not None:
            turn.usage = value["usage"]

    def thought(self, token: Any, text: str) -> None:
        """A reasoning model's thoughts in a turn (``WireProgress.think``), shown as the editor
        shows an agent's thinking."""
        if isinstance(token, str) and token in self.turns and text:
            self.send(token, update_agent_thought_text(text))

    def send_plan(self, sid: str, turn: Turn, reply: Any) -> None:
        """An ACP ``plan`` update when ``reply`` (a reply text or a result) reports a plan that
        differs from the one last sent in this turn."""
        entries = plan_of(reply) if reply else None
        if entries is None or entries == turn.plan:
            return
        turn.plan = entries
        from acp import plan_entry, update_plan

        self.send(sid, update_plan([plan_entry(e["content"], priority=e["priority"], status=e["status"])
                                    for e in entries]))

    def _tool_event(self, p: dict) -> None:
        sid, call_id, event, tool = p.get("branchId"), p.get("callId"), p.get("event"), str(p.get("tool"))
        info = self.calls.get(call_id)
        if info is None:
            info = self.calls[call_id] = CallInfo(sid, tool, tool_kind(tool), tool)
        if event == "pre":
            info.running = True
            if not info.started:
                info.started = True
                self.send(sid, lambda: self._start(call_id, info, "in_progress"))
            else:
                self.send(sid, ToolCallProgress(session_update="tool_call_update", tool_call_id=call_id,
                                                status="in_progress"))
            return
        status = "completed" if event == "post" else "failed"

        def finish() -> Any:
            response = self._message(sid, call_id, "action_response")
            if status == "completed" and not info.content:  # not previewed: the change it made
                info.content = self._changed(info, response)
            return self._finish(call_id, info, status, None if response is None else response.get("output"),
                                p.get("error"), ran=event == "error")

        if not info.started:  # denied before it started (never asked, or not selected)
            info.started = True
            self.send(sid, lambda: self._start(call_id, info, "pending"))
        info.finished = True
        self.send(sid, finish)
        self.calls.pop(call_id, None)

    def end_calls(self, session_id: str) -> None:
        """The end of a turn: a call of the session that the editor was shown but that got no
        final status (the turn was cancelled while the editor was asked about it: nothing ran)
        is ``failed`` now, as a call cancelled while running is; one never shown is dropped."""
        for call_id, info in list(self.calls.items()):
            if info.session_id == session_id:
                del self.calls[call_id]
                if info.started:
                    self.send(session_id, self._finish(call_id, info, "failed", None, "cancelled"))

    @staticmethod
    def _finish(call_id: str, info: CallInfo, status: str, output: Any, error: Any = None, *,
                ran: bool = False) -> ToolCallProgress:
        """The call's last ``tool_call_update``: its status, raw output, and content (the diff
        of a builtin file edit; the output as text, but for a completed file edit that has its
        diff; for a failed call, its error in words: ``_failure``). ``ran``: the call was let
        through and failed (its ``error`` event): it changed nothing, so the diff it was
        previewed with is not shown with it (a denied call keeps it: what was refused)."""
        content = [x for x in info.content if not (ran and status == "failed" and x.type == "diff")]
        if output is not None and not (status == "completed" and changes_files(info.tool) and content):
            content.append(_text_content(_failure(output) if status == "failed" else output))
        return ToolCallProgress(session_update="tool_call_update", tool_call_id=call_id, status=status,
                                raw_output=output if output is not None else {"error": error},
                                content=content or None)

    def _start(self, call_id: str, info: CallInfo, status: str) -> ToolCallStart:
        if info.raw_input is None:  # not seen by the authorizer: the recorded request has it
            req = self._message(info.session_id, call_id, "action_request")
            if req is not None:
                info.raw_input = req.get("arguments")
        return ToolCallStart(session_update="tool_call", tool_call_id=call_id, title=info.title, kind=info.kind,
                             status=status, raw_input=info.raw_input, locations=info.locations or None,
                             content=info.content or None)

    def _message(self, sid: str, call_id: str, kind: str) -> dict | None:
        msgs = self.branch_messages(sid)
        for m in reversed(list(msgs)[-200:]):
            content = getattr(m, "content", None)
            if getattr(m, "kind", None) == kind and isinstance(content, dict) and content.get("callId") == call_id:
                return content
        return None

    def _changed(self, info: CallInfo, response: dict | None) -> list[Any]:
        """``diff`` content of a builtin file edit that ran without a preview (allowed without
        asking): the change the tool reports it made (its recorded output, ``recorded_diff``,
        as ``session/load`` shows it), never the file read here, which may have changed since
        (another call of the reply), or be another file by now (a symlink swapped in). None
        when its text is larger than ``DIFF_FILE_LIMIT``, or its output was cut (no diff in it)."""
        if not changes_files(info.tool) or not info.locations or not isinstance(response, dict) \
                or not isinstance(response.get("arguments"), dict):
            return []
        content = recorded_diff(info.locations[0].path, response["arguments"], response.get("output"))
        if any(_too_large(x.new_text) or isinstance(x.old_text, str) and _too_large(x.old_text)
               for x in content if x.type == "diff"):
            return []
        return content

    # ------------------------------------------------------------------ what a call is
    def describe(self, session_id: str, call_id: str, tool: str, arguments: Any) -> CallInfo:
        """Record (once) what the editor is told about a call, before it is asked or run."""
        info = self.calls.get(call_id)
        if info is None:
            info = self.calls[call_id] = self.call_info(session_id, tool, arguments)
        return info

    def call_info(self, session_id: str, tool: str, arguments: Any, at: str | None = None) -> CallInfo:
        """What the editor is told about a call: title, kind, locations, raw input. ``at``: a
        recorded call's folder (see :meth:`replay_call`)."""
        args = arguments if isinstance(arguments, dict) else {}
        path = args.get("path") if isinstance(args.get("path"), str) else None
        real = self._path_of(path, session_id, at) if path else None
        info = CallInfo(session_id, tool, tool_kind(tool), tool_title(tool, args), raw_input=arguments)
        if real:
            line = args.get("offset") if tool == "read_file" else None
            if type(line) is not int or not 0 <= line <= UINT32_MAX:  # the schema's uint32, or none
                line = None
            info.locations = [ToolCallLocation(path=real, line=line)]
        return info

    async def tool_decided(self, p: dict) -> None:
        """The service decided a call (``ClientPort.tool_decided``): record what the editor is
        shown about it (an edit's diff is the tool's: its preview, or the change it made)."""
        self.describe(p["branchId"], p["callId"], str(p.get("tool")), p.get("arguments"))

    def resolve(self, path: str, session_id: str | None = None, folders: list[str] | None = None) -> str | None:
        """An absolute path inside the session's folders (or ``folders``; a relative one is
        taken from the first), else None; None too for a path that is no file name (a NUL,
        half a surrogate pair: the tool refuses it) or that cannot be resolved (a link
        swapped meanwhile): the call is shown without a location."""
        folders = folders or (self.branch_folders(session_id) if session_id is not None else None) \
            or self.workspace_folders
        if not folders:
            return None
        try:
            real = os.path.realpath(path if os.path.isabs(path) else os.path.join(folders[0], path))
            for root in folders:
                r = os.path.realpath(root)
                if real == r or real.startswith(r.rstrip(os.sep) + os.sep):
                    return real
        except (ValueError, OSError):  # UnicodeEncodeError is a ValueError
            pass
        return None

    def _edited(self, info: CallInfo, arguments: Any, at: str | None = None) -> str | None:
        """The file a builtin file-changing call (``write_file``, ``edit_file``) changes, inside the
        session's folders, when it gets a diff. Another tool never does, whatever its kind: one
        guessed ``edit`` from its name (``write_note``) may append, or change another file."""
        if not changes_files(info.tool) or info.content or not isinstance(arguments, dict):
            return None
        path = arguments.get("path")
        return self._path_of(path, info.session_id, at) if isinstance(path, str) else None

    def _path_of(self, path: str, session_id: str, at: str | None) -> str | None:
        """A call's path as an absolute one inside the session's folders (:meth:`resolve`), else
        None; for a call recorded in the folder ``at``, a relative path is taken from there, and
        one inside ``at`` is shown (as it was live; never read or written)."""
        if at is None:
            return self.resolve(path, session_id)
        return self.resolve(path, folders=[at, *(self.branch_folders(session_id) or ())])

    # ------------------------------------------------------------------ a recorded call (session/load)
    def replay_call(self, session_id: str, call_id: str, response: dict,
                    at: str | None = None) -> tuple[ToolCallStart, ToolCallProgress]:
        """A recorded call (its ``action_response``) as the editor was shown it: its ``tool_call``
        (title, kind, locations, raw input, diff) and its last ``tool_call_update``. The diff (or
        what a refused write proposed) is what the branch holds (``recorded_diff``): a file is
        never read for it. ``at``: the folder the session was in when the call ran (a session
        loaded in another folder shows its calls where they were made, not under the new one)."""
        args, output = response.get("arguments"), response.get("output")
        info = self.call_info(session_id, str(response.get("function")), args, at)
        real = self._edited(info, args, at)
        if real is not None:
            info.content = recorded_diff(real, args, output)
        failed = isinstance(output, dict) and "error" in output
        return self._start(call_id, info, "pending"), self._finish(call_id, info, "failed" if failed else "completed",
                                                                   output)

    def running_calls(self, session_id: str, shown: Collection[str]) -> list[ToolCallStart]:
        """The calls of the turn running on the session that the editor was shown and that have
        no outcome yet (asked about, or running), but for those in ``shown``, as ``tool_call``
        updates again for a client that loads the session meanwhile: the updates of them that
        follow then name calls it knows."""
        return [self._start(call_id, info, "in_progress" if info.running else "pending")
                for call_id, info in list(self.calls.items())
                if info.session_id == session_id and info.started and not info.finished and call_id not in shown]

    # ------------------------------------------------------------------ client requests
    async def request_client(self, method: str, params: Any, timeout: float | None) -> Any:
        if self.client is None:
            raise ClientRequestError(-32603, "no client connection")
        if method == "requestToolPermission":
            call = self._ask(params)
        elif method == "fs/readTextFile":
            call = self._read(params)
        elif method == "fs/writeTextFile":
            call = self._write(params)
        else:
            raise ClientRequestError(-32601, f"{method} is not available over the Agent Client Protocol")
        try:
            if timeout is None:
                return await call
            async with asyncio.timeout(timeout):  # no inner task: a cancel is never lost to a late answer
                return await call
        except RequestError as e:
            raise ClientRequestError(e.code, str(e), getattr(e, "data", None)) from None
        except ConnectionError as e:
            raise ClientRequestError(-32603, f"client connection lost: {e}") from None
        except ValidationError as e:  # the client's result is not the schema's: taken as an error answer
            if not str(e.title).endswith("Response"):  # one of our own requests' models: a fault here
                raise
            fields = "; ".join(f"{'.'.join(map(str, d.get('loc', ()))) or 'result'}: {d.get('msg', '')}"
                               for d in e.errors()[:3])
            log.warning("the client's answer to %s is not valid (%s): taken as an error", method, fields)
            raise ClientRequestError(-32603, f"invalid answer from the client ({fields})") from None

    async def _read(self, p: dict) -> dict:
        # what the session was shown so far goes first (the reply's text, the call this read is
        # for), as before a permission request: not held up by the client's answer to this one
        await self.flush(p["branchId"])
        r = await self.client.read_text_file(session_id=p["branchId"], path=p["path"])
        return {"text": r.content}

    async def _write(self, p: dict) -> Any:
        """The editor's raw result (``{}`` when the SDK cannot give it): whether it is a write
        done is for ``ClientFiles`` to decide (``write_failed``, the check the native front end
        makes too); one that is not is logged here, with what the editor answered. What the
        session was shown so far goes first (``_read``)."""
        await self.flush(p["branchId"])
        conn = getattr(self.client, "_conn", None)  # the SDK's connection, which answers the raw result
        if not hasattr(conn, "send_request"):
            if not self._warned_write_fallback:  # an SDK without it: its typed call, which takes any answer for success
                self._warned_write_fallback = True
                log.warning("the ACP SDK's connection has no send_request: fs/write_text_file answers are "
                            "not checked (an editor's failed write answered with a non-object is taken as written)")
            await self.client.write_text_file(session_id=p["branchId"], path=p["path"], content=p["text"])
            return {}
        from acp.schema import WriteTextFileRequest
        from acp.utils import serialize_params

        from operate_sidecar.server.tools.file_tools import write_failed

        # the SDK takes any result that is not an object for success: an editor that answers a
        # failed write with a string (avante does) would have it reported written. The raw result
        # goes back, as the native front end's does, for the file tools' one check of it
        result = await conn.send_request("fs/write_text_file", serialize_params(
            WriteTextFileRequest(session_id=p["branchId"], path=p["path"], content=p["text"])))
        shown = write_failed(result)
        if shown is not None:
            log.warning("the client's answer to fs/writeTextFile is not a write done (result: %s): "
                        "taken as a failed write", shown)
        return result

    async def _ask(self, p: dict) -> dict:
        sid, call_id = p["branchId"], p["callId"]
        info = self.describe(sid, call_id, str(p.get("tool")), p.get("arguments"))
        preview = p.get("preview")
        if isinstance(preview, dict) and preview.get("kind") == "diff" and isinstance(preview.get("newText"), str):
            old = preview.get("oldText")
            if not (_too_large(preview["newText"]) or isinstance(old, str) and _too_large(old)):
                path = self.resolve(str(preview.get("path")), sid) or str(preview.get("path"))
                info.content = [tool_diff_content(path, preview["newText"], old)]
        if not info.started:
            info.started = True
            self.send(sid, self._start(call_id, info, "pending"))
        await self.flush(sid)
        options = [PermissionOption(option_id=o, name=PERMISSION_KINDS[o][1], kind=PERMISSION_KINDS[o][0])
                   for o in p.get("options") or PERMISSION_KINDS if o in PERMISSION_KINDS]
        answer = await self.client.request_permission(
            session_id=sid, options=options,
            tool_call=ToolCallUpdate(tool_call_id=call_id, title=info.title, kind=info.kind, status="pending",
                                     raw_input=info.raw_input, locations=info.locations or None,
                                     content=info.content or None))
        outcome = answer.outcome
        offered = [o.option_id for o in options]
        if getattr(outcome, "outcome", None) == "selected":
            if outcome.option_id in offered:
                return {"decision": outcome.option_id}
            # deny, as on a time-out or a cancel; but never silently: an editor that answers
            # with ids of its own would see every call denied and not know why
            log.warning("the client's answer to session/request_permission selected the option %r, which was not "
                        "offered (offered: %s): taken as a reject", outcome.option_id, ", ".join(offered))
        elif getattr(outcome, "outcome", None) == "cancelled":  # the client cancelled the turn: nothing runs
            self.cancel_turn(sid)
            raise asyncio.CancelledError()
        return {"decision": "deny_once"}


def _too_large(text: str) -> bool:
    return len(text) > DIFF_FILE_LIMIT or len(text.encode("utf-8", "surrogatepass")) > DIFF_FILE_LIMIT


def _failure(output: Any) -> Any:
    """What a failed call's content says: its error (and the reason it was denied), not the
    whole output object, which repeats the call's name and arguments (``rawOutput`` keeps it)."""
    if not isinstance(output, dict) or not isinstance(output.get("error"), str):
        return output
    reason = output.get("reason")
    return output["error"] + (f" ({reason})" if isinstance(reason, str) and reason else "")


def _text_content(output: Any) -> ContentToolCallContent:
    text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False, default=str, indent=1)
    if len(text) > TEXT_CONTENT_LIMIT:
        text = text[:TEXT_CONTENT_LIMIT] + "…"
    return ContentToolCallContent(type="content", content=TextContentBlock(type="text", text=text))


def recorded_diff(path: str, arguments: dict, output: Any) -> list[Any]:
    """``diff`` content of a recorded edit call, from what its messages hold, never from the file
    as it is now: a ``write_file`` has its whole new text (``content``) and the unified ``diff``
    of its output, which gives the whole old text back (none: the file was created); any other
    call that ran has that diff, one content per hunk (the changed lines with their context).
    A denied call has its edits' ``oldText`` / ``newText``. A denied ``write_file`` has no old
    text on record, so no diff (a diff with no old text would tell the editor the file was
    created): its content is a text block saying the write was refused, with the text it
    proposed (``refused_write``). A call that failed has none: it changed nothing."""
    from operate_sidecar.server.core.act import DENIED

    diff = output.get("diff") if isinstance(output, dict) else None
    new = arguments.get("content")
    if isinstance(diff, str):
        hunks = _hunks(diff)
        created = diff.startswith("--- /dev/null")
        old = None if created or not isinstance(new, str) else _unpatch(new, hunks)
        if isinstance(new, str) and (created or old is not None):
            return [tool_diff_content(path, new, old)]
        return [tool_diff_content(path, "".join(b), "".join(a)) for _, a, b in hunks]
    if isinstance(output, dict) and output.get("error") == DENIED and isinstance(arguments.get("edits"), list):
        return [tool_diff_content(path, e["newText"], e["oldText"]) for e in arguments["edits"]
                if isinstance(e, dict) and isinstance(e.get("oldText"), str) and isinstance(e.get("newText"), str)]
    if isinstance(output, dict) and output.get("error") == DENIED and isinstance(new, str):
        return [refused_write(new)]
    return []


def refused_write(text: str) -> ContentToolCallContent:
    """A refused ``write_file`` as ``session/load`` shows it: that the write was refused and the
    text it proposed, in a code fence (longer than any run of backticks in it), at most
    ``REFUSED_WRITE_LIMIT`` characters (cut at a line end if one is in its second half), then how much
    was left out. Live, the user was shown a diff against the file as it was then; that old
    text is not on record, and the file as it is now is not it."""
    said = "The write was refused: nothing was written."
    if not text:
        return tool_content(text_block(f"{said} The proposed text was empty."))
    shown, rest = text, ""
    if len(text) > REFUSED_WRITE_LIMIT:
        cut = text.rfind("\n", REFUSED_WRITE_LIMIT // 2, REFUSED_WRITE_LIMIT) + 1 or REFUSED_WRITE_LIMIT
        shown, rest = text[:cut], text[cut:]
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", shown)), default=0))
    block = shown if shown.endswith("\n") else shown + "\n"
    body = (f"{said} The proposed text ({_count(len(text.splitlines()), 'line')}, {_count(len(text), 'character')}):"
            f"\n\n{fence}\n{block}{fence}")
    if rest:
        body += (f"\n\n[cut: {_count(len(rest), 'more character')} "
                 f"({_count(len(rest.splitlines()), 'more line')}) not shown]")
    return tool_content(text_block(body))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _hunks(diff: str) -> list[tuple[int, list[str], list[str]]]:
    """The hunks of a unified diff (``server.tools.edits.unified_diff``): (0-based index of the
    hunk in the new text, its old lines, its new lines), line ends kept. Its lines end at ``\n``
    only, as the diff was written (``server.tools.edits.split_lines``): a form feed, a lone
    ``\r``, U+2028 or ``\x1e`` is part of its line (``str.splitlines`` would cut the line there,
    and the piece after it, which starts with no `` ``, ``-`` or ``+``, would be lost)."""
    from operate_sidecar.server.tools.edits import split_lines

    hunks: list[tuple[int, list[str], list[str]]] = []
    sides: tuple[list[str], ...] = ()
    for line in split_lines(diff):
        if line.startswith("@@"):
            try:
                start, _, count = line.split()[2][1:].partition(",")
                at = int(start) - (1 if count != "0" else 0)
            except (IndexError, ValueError):
                return []
            hunks.append((at, [], []))
            sides = ()
        elif not hunks:  # the ---/+++ header
            continue
        elif line.startswith("\\"):  # "\ No newline at end of file": the line before has none
            for side in sides:
                side[-1] = side[-1][:-1]  # the "\n" the marker was put after
        else:
            _, a, b = hunks[-1]
            sides = {" ": (a, b), "-": (a,), "+": (b,)}.get(line[:1], ())
            for side in sides:
                side.append(line[1:])
    return hunks


def _unpatch(new: str, hunks: list[tuple[int, list[str], list[str]]]) -> str | None:
    """The old text of a diff from the whole new text, or None when the hunks do not match it.
    Its lines end at ``\n`` only, as the diff's do (``_hunks``)."""
    from operate_sidecar.server.tools.edits import split_lines

    lines = split_lines(new)
    out: list[str] = []
    at = 0
    for start, a, b in hunks:
        if start < at or lines[start:start + len(b)] != b:
            return None
        out += lines[at:start] + a
        at = start + len(b)
    return "".join(out + lines[at:])
