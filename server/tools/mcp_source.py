"""MCP servers as a tool source (settings ``mcpServers``).

Each configured server ``{"command": [exe, *args], "env"?: {..}}`` is spawned as a
subprocess speaking MCP over stdio (the ``mcp`` SDK's ``stdio_client`` and
``ClientSession``). Its stdin/stdout are the MCP pipes (a byte on its stdout that is not UTF-8
is read as U+FFFD: that line is no message, and is dropped with a log line, as any line that is
not one); its stderr is relayed line by line, prefixed ``[mcp <name>]``, to our stderr (never
stdout, which is the wire), secrets redacted from every line (a line too long to hold is relayed
in pieces, never cut through a secret or a key-shaped token), and its last lines (bounded) are
quoted when the server fails to start or stops. ``env`` is merged over the SDK's small safe
default environment (``HOME``, ``PATH``, ``SHELL``, ``TERM``, ``USER``, ``LOGNAME``), not over
our whole environment.

Tools (source ``mcp``):

- Read at each start of the server (``tools/list``, at most ``_MAX_LIST_PAGES`` pages: a
  warning says when there were more), and again when it says they changed
  (``notifications/tools/list_changed``): the source's ``on_tools_changed`` (``open_mcp_sources``'
  ``changed``) is called, and its host lists them again (:meth:`McpToolSource.list_again`,
  :meth:`McpTools.list_again`: the same bounds, the same warnings, names chosen by the same rules;
  a list that fails leaves the tools listed before). A name it lists twice is offered once (the
  first), with a warning. The session advertises no client capability (no sampling, elicitation
  or roots): the handler of the server's notifications is no capability.
- Named after the MCP tool, plainly. When two configured servers offer the same tool
  name, or the name is already taken (``reserved``: builtin/python/client tools), every
  clashing tool is named ``<server>__<tool>`` instead (the server name with characters
  outside ``[A-Za-z0-9_-]`` replaced by ``_``). A tool a server lists again, or lists when
  started again, keeps the name it had while no other tool has it (``kept``). The MCP side is
  always called with the server's own name for the tool.
- ``inputSchema`` is the server's, ``description`` its description (else title, name).
- ``annotations.readOnlyHint: true`` makes the tool ``read_only`` (so the default policy
  allows it, docs/PROTOCOL.md §4); anything else is not read-only.
- A call returns the result's structured content when there is some (the SDK's
  ``{"result": x}`` wrapper of a primitive return is unwrapped to ``x``), else the text
  content blocks joined with newlines, else a list of the content blocks (binary data
  summarised as ``{"type", "mimeType", "bytes"}``). An ``isError`` result raises
  :class:`ToolCallError` with the error text; so does a protocol error or a lost
  connection (the message names the server).

Lifetime is structured: ``await source.start(task_group)`` runs the server in a task of
the caller's task group and returns once its tools are listed; ``await source.aclose()``
stops it (as does cancelling the group). ``async with McpToolSource(...) as source`` does
both with a task group of its own. :func:`open_mcp_sources` starts all configured servers
concurrently, each on its own, in a task group it owns (one that fails to start is named, with
a :class:`StartTimedOut` when it did not answer in time, and the others' tools are offered) and stops them when its block exits (or, with its ``stop``
event, as soon as that is set, starts included).

A started server that stops on its own (it exits, crashes or is killed: the SDK's read stream
from its stdout ends, which the SDK itself tells no one) is over: a call running on it fails
at once with a :class:`ToolCallError` (``Connection closed``), later ones too (``not running``),
and the source's ``on_lost`` (``open_mcp_sources``' ``lost``) is called with why, so that its
host can unregister its tools and say so.

The SDK starts each server in a session (process group) of its own, out of reach of the
sidecar's own reaper, so each server's group gets one here (Linux: the server is found as
the child that holds its stderr pipe): a server still running when the sidecar dies, by
any means, is killed with everything it started in its group. A stopped source does not
wait on its server: one still in its handshake is terminated at once, a started one once
it has had ``_STOP_GRACE`` seconds to exit after its stdin closed; what ignores SIGTERM is
killed ``_KILL_GRACE`` seconds later.

The ``mcp`` SDK is imported only when a server is started, never at import time.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import signal
import sys
from collections import Counter, deque
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Collection, Iterable, Mapping, TextIO

from .. import __version__
from ..core.errors import exception_text
from ..core.tools import Tool, ToolCallContext
from ..redaction import _PATTERNS as KEY_PATTERNS
from ..redaction import StreamRedactor, redact, redact_cut
from .errors import ToolCallError, ToolSourceError

if TYPE_CHECKING:
    import mcp_types
    from anyio.abc import TaskGroup

log = logging.getLogger(__name__)

__all__ = ["McpToolSource", "McpTools", "open_mcp_sources", "DEFAULT_START_TIMEOUT", "StartTimedOut"]


def _start_timeout_from_env(default: float = 30.0) -> float:
    """``OPERATE_SIDECAR_MCP_START_TIMEOUT_S`` (seconds, > 0), else ``default``: for tests, whose
    servers that hang in their start (or in a later list of their tools) are given up on
    sooner; a value that is not such a number is ignored."""
    try:
        value = float(os.environ.get("OPERATE_SIDECAR_MCP_START_TIMEOUT_S") or default)
    except ValueError:
        return default
    return value if 0 < value < float("inf") else default


#: how long an MCP server's start (its handshake and first list of tools), and each later list of
#: its tools, may take: 30 s (``OPERATE_SIDECAR_MCP_START_TIMEOUT_S`` sets it, for tests)
DEFAULT_START_TIMEOUT = _start_timeout_from_env()
_STDERR_TAIL_LINES = 20
#: the stderr quoted in a warning (a server failed to start, or stopped): its last lines that are
#: not blank, each cut to ``_QUOTED_LINE_CHARS`` characters, all of them to ``_QUOTED_CHARS``
_QUOTED_LINES = 10
_QUOTED_LINE_CHARS = 1000
_QUOTED_CHARS = 4000
#: a stderr line longer than this many characters (its line break not yet come) is relayed in
#: pieces; the last ``_STDERR_OVERLAP`` characters stay for the next piece, so that a key-shaped
#: token shorter than that is masked whole
_STDERR_PIECE = 65536
_STDERR_OVERLAP = 8192
_MAX_LIST_PAGES = 100
_CONFIG_KEYS = frozenset({"command", "env"})
#: a started server stopped: seconds it has to exit on its own (its stdin closed) before SIGTERM
_STOP_GRACE = 1.5
#: seconds between SIGTERM and SIGKILL (to the server's whole process group)
_KILL_GRACE = 1.0
#: the longest a started server's stop takes: its grace, SIGTERM, SIGKILL and the wait after
STOP_BOUND_S = _STOP_GRACE + 2 * _KILL_GRACE
_POLL_S = 0.02


#: terminal escape sequences in a server's stderr line, each to its end: CSI (colours, cursor
#: moves), OSC, DCS, PM, APC (window title, clipboard: ``ESC ] 52``) and the two-character forms
_ESCAPE_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -/]*[0-~]?")
#: what is left of the control characters after those (C0 but the tab, DEL, C1)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _printable(line: str) -> str:
    """A server's stderr line as it may reach ours: written to a terminal (or an editor's log
    view), its escape sequences would act (recolour, move the cursor, retitle the window, set
    the clipboard): they are dropped; what a carriage return inside the line would have
    overwritten on a terminal is dropped too (a progress bar shows its last state); any other
    control character is shown as its escape (``\\x07``)."""
    if "\r" in line:
        line = line.rstrip("\r").rpartition("\r")[2]
    return _escaped(line)


def _escaped(text: str) -> str:
    """``text`` with its terminal escape sequences dropped and any other control character
    (a carriage return too) shown as its escape: for a message of ours quoting what a server
    was given (its command line), where nothing may be cut away."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", _ESCAPE_SEQUENCE.sub("", text))


class StartTimedOut(ToolSourceError):
    """The server did not start since it gave no answer to ``initialize``/``tools/list`` within
    the start time-out (it hangs, or what it wrote could not be read): its host may try it again
    without having a request wait for that try (a second time-out)."""


class _Stopped(Exception):
    """The source was stopped (closed, or its host is exiting) before its server had started."""


#: the MCP SDK's error code for a connection that closed (``mcp_types.CONNECTION_CLOSED``)
_CONNECTION_CLOSED = -32000
#: how long a call that lost its server waits for the server's end to be taken (``_call``)
_LOSS_WAIT_S = 2.0


class _Lost(Exception):
    """The server, started, ended its session (its stdout) though nothing asked it to."""


async def _relay_until_end(source: Any, ended: Any, unread: deque[str], *, task_status: Any) -> None:
    """Pass what ``source`` (the SDK's read stream) receives on to the stream given to
    ``task_status``, and close that one when ``source`` ends: then set ``ended``. A line of the
    server's that the SDK could not read reaches it as an exception, and its request is never
    answered: what it was is kept in ``unread``, for the time-out's message."""
    import anyio

    send, receive = anyio.create_memory_object_stream[Any](0)
    task_status.started(receive)
    try:
        async with send:
            async for item in source:
                if isinstance(item, Exception):
                    unread.append(_unread_text(item))
                await send.send(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return  # the session is gone (stopped on purpose)
    ended.set()


class McpToolSource:
    """One MCP server spawned over stdio and the tools it offers."""

    def __init__(self, name: str, command: list[str], env: Mapping[str, str] | None = None, *,
                 start_timeout: float = DEFAULT_START_TIMEOUT, call_timeout: float | None = None,
                 errlog: TextIO | None = None, on_lost: Callable[[str], None] | None = None,
                 on_tools_changed: Callable[[], None] | None = None) -> None:
        """``on_lost(why)``: called once the server, started, stops though nothing asked it to.
        ``on_tools_changed()``: called when the server says its tools changed
        (``notifications/tools/list_changed``), in the task that reads its messages: it must not
        block; its host then lists them again (:meth:`list_again`)."""
        if not isinstance(name, str) or not name:
            raise ToolSourceError(f"MCP server names must be non-empty strings, got {name!r}")
        if (not isinstance(command, (list, tuple)) or not command
                or not all(isinstance(c, str) and c for c in command)):
            raise ToolSourceError(f"MCP server {name!r}: command must be a non-empty list of strings, got {command!r}")
        if env is not None and (not isinstance(env, Mapping)
                                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ToolSourceError(f"MCP server {name!r}: env must be an object of strings, got {env!r}")
        self.name = name
        self.command = list(command)
        self.env = dict(env) if env is not None else None
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self._errlog = errlog
        self._on_lost = on_lost
        self._on_tools_changed = on_tools_changed
        self._session: Any = None
        self._remote: list[mcp_types.Tool] = []
        #: what its last list of tools (at its start, or :meth:`list_again`) found wrong (a tool name
        #: listed twice, a list of tools that never ended), for its host to tell
        self.warnings: list[str] = []
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._unread: deque[str] = deque(maxlen=1)  # the last message of the server's the SDK could not read
        self._stop: Any = None  # anyio.Event: ask the serving task to stop
        self._done: Any = None  # anyio.Event: the serving task has finished
        self._own_tg: AsyncExitStack | None = None  # holds the task group of ``async with source``
        self._handshake: Any = None  # anyio.CancelScope of initialize/tools/list: a stop cancels it
        self._streams: Any = None

    def __repr__(self) -> str:
        state = "running" if self._session is not None else "stopped"
        return f"McpToolSource({self.name!r}, {self.command!r}, {state})"

    async def __aenter__(self) -> "McpToolSource":
        """Start the server in a task group of its own (held open by an ``AsyncExitStack``
        until exit, in the same task); stop it on exit."""
        import anyio

        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        try:
            await self.start(tg)
        except BaseException:
            tg.cancel_scope.cancel()
            await stack.aclose()
            raise
        self._own_tg = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        stack, self._own_tg = self._own_tg, None
        try:
            await self.aclose()
        finally:
            if stack is not None:
                # The serving task has finished, so this exits at once; an exception from the
                # block is not passed in, so it propagates unwrapped.
                await stack.aclose()

    @property
    def running(self) -> bool:
        return self._session is not None

    def tool_names(self) -> list[str]:
        """The server's own names for its tools (after :meth:`start`)."""
        return [t.name for t in self._remote]

    async def start(self, task_group: "TaskGroup") -> None:
        """Spawn the server in a task of ``task_group`` (owned by the caller), initialize
        the session and list its tools; return once the tools are known.

        Raises :class:`ToolSourceError` naming the server (with the reason and the tail of
        its stderr) when it cannot be spawned, exits, or does not answer within
        ``start_timeout`` seconds (then :class:`StartTimedOut`, which is one). The caller may bound or cancel ``start`` with its own
        cancel scope. :meth:`aclose` stops the server; so does cancelling ``task_group``.
        """
        if self._stop is not None:
            raise ToolSourceError(f"MCP server {self.name!r} is already started")
        import anyio

        self._stop = anyio.Event()
        self._done = anyio.Event()
        try:
            await _import_sdk()
            await task_group.start(self._serve, name=f"mcp server {self.name}")
        except BaseException:
            self._stop = self._done = None
            raise
        log.info("MCP server %r started with %d tools", self.name, len(self._remote))

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._handshake is not None:  # a server still starting is not waited for
            self._handshake.cancel()

    async def aclose(self) -> None:
        """Stop the server (close its stdin, then terminate it if it lingers) and wait
        for it to be gone. The SDK bounds every step of the shutdown."""
        stop, done = self._stop, self._done
        if stop is None:
            return
        self._request_stop()
        await done.wait()
        self._stop = self._done = None

    async def _serve(self, *, task_status: Any) -> None:
        """The serving task: relay stderr, run the session until asked to stop."""
        import anyio

        started = False
        failure: BaseException | None = None
        lost: str | None = None

        def on_started() -> None:
            nonlocal started
            started = True
            task_status.started()

        try:
            read_fd, write_fd = os.pipe()
            try:
                async with anyio.create_task_group() as relay_tg:
                    relay_done = anyio.Event()
                    relay_tg.start_soon(self._relay_stderr, read_fd, relay_done)
                    try:
                        failure = await self._run_session(write_fd, on_started)
                    finally:
                        await self._stop_relay(relay_tg, relay_done)
            finally:
                os.close(read_fd)  # the relay task has finished: its group has exited
        except Exception as e:
            if started:  # a failure after the start: the tools fail from now on, the host goes on
                lost = _describe(e)
            else:
                failure = failure or e
        finally:
            self._session = None
            if self._done is not None:
                self._done.set()
        if started and isinstance(failure, _Lost):
            lost = "it exited or closed its output"
        if lost is not None and not (self._stop is not None and self._stop.is_set()):
            self._lost(lost)
        if failure is not None and not started:
            kind = StartTimedOut if isinstance(_cause(failure), TimeoutError) else ToolSourceError
            raise kind(self._start_failure(failure)) from failure

    def _lost(self, why: str) -> None:
        why += self._quoted_tail()
        log.error("MCP server %r stopped unexpectedly: %s", self.name, why)
        if self._on_lost is not None:
            self._on_lost(why)

    async def _run_session(self, write_fd: int, on_started: Any) -> BaseException | None:
        """Run stdio_client + ClientSession; return the start failure instead of raising it
        (raising through the SDK's task groups would wrap it in exception groups)."""
        import anyio

        group: _ServerGroup | None = None
        started = False

        def now_started() -> None:
            nonlocal started
            started = True
            on_started()

        try:
            async with anyio.create_task_group() as stopper:
                try:
                    async with AsyncExitStack() as stack:
                        try:
                            group = await self._spawn(stack, write_fd)
                        except Exception as e:
                            return e
                        # unwound before the SDK's own shutdown (which closes the server's stdin and
                        # waits): bound that wait, whether the handshake finished or not
                        stack.callback(lambda: group is not None and stopper.start_soon(
                            group.terminate, _STOP_GRACE if started else 0.0))
                        return await self._handshake_and_serve(stack, now_started)
                finally:
                    self._handshake = None
        finally:
            if group is not None:
                await group.release()

    async def _spawn(self, stack: AsyncExitStack, write_fd: int) -> "_ServerGroup | None":
        """Start the server (stdio_client); the process group it runs in, when it can be found."""
        from mcp.client.stdio import StdioServerParameters, stdio_client

        err_file = os.fdopen(write_fd, "wb", buffering=0)
        try:
            inode = os.fstat(write_fd).st_ino
            # a byte that is not UTF-8 on its stdout becomes U+FFFD (the SDK's default, "strict", ends
            # its reader at the first one and leaves every request on the session unanswered): the
            # line is then no JSON-RPC message, and dropped with a log line as any other such line
            params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env,
                                           encoding_error_handler="replace")
            self._streams = await stack.enter_async_context(stdio_client(params, errlog=err_file))  # type: ignore[arg-type]
        finally:
            err_file.close()  # the child holds its own copy; EOF reaches the relay when it exits
        # no await between the spawn and the reaper: a cancellation here would leave the server
        return _ServerGroup.find(self.name, inode)

    async def _handshake_and_serve(self, stack: AsyncExitStack, on_started: Any) -> BaseException | None:
        import anyio
        from mcp import ClientSession
        from mcp_types import Implementation

        read, write = self._streams
        self._streams = None
        # the SDK ends its session quietly when the server's stdout does (its pending requests
        # fail): the stream is relayed, so that its end is seen here
        ended = anyio.Event()
        relay_tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(relay_tg.cancel_scope.cancel)  # unwound before the group is left
        self._unread.clear()  # (of this start, not an earlier one's)
        read = await relay_tg.start(_relay_until_end, read, ended, self._unread)
        # (a ``message_handler`` is no client capability: the SDK advertises sampling, elicitation
        # and roots only for their own callbacks, which stay its refusing defaults)
        session = await stack.enter_async_context(ClientSession(
            read, write, message_handler=self._on_message,
            client_info=Implementation(name="operate-sidecar", version=__version__)))
        with anyio.CancelScope() as handshake:
            self._handshake = handshake
            if self._stop.is_set():
                handshake.cancel()
            try:
                with anyio.fail_after(self.start_timeout):
                    await session.initialize()
                    remote, cursor = await self._list_tools(session)
            except Exception as e:
                return e
        self._handshake = None
        if handshake.cancelled_caught or self._stop.is_set():
            return _Stopped()
        self._listed(remote, cursor)
        self._session = session
        on_started()
        async with anyio.create_task_group() as wait:
            async def until(event: Any) -> None:
                await event.wait()
                wait.cancel_scope.cancel()

            wait.start_soon(until, self._stop)
            wait.start_soon(until, ended)
        self._session = None
        return None if self._stop.is_set() else _Lost()

    async def list_again(self) -> None:
        """List the running server's tools again (its ``notifications/tools/list_changed`` said
        they changed), as its start lists them: at most ``_MAX_LIST_PAGES`` pages, within
        ``start_timeout`` seconds, a name listed twice offered once, :attr:`warnings` new. Raises
        :class:`ToolSourceError` (why, masked as a start failure is) when it is not running or
        the list fails (an error answer, no answer in time, the connection lost): the tools
        listed before are kept. A tool call running meanwhile goes on (the session is the same);
        :meth:`tools` gives the new list once this returns."""
        import anyio

        session = self._session
        if session is None:
            raise ToolSourceError(f"MCP server {self.name!r} is not running")
        try:
            with anyio.fail_after(self.start_timeout):
                remote, cursor = await self._list_tools(session)
        except Exception as e:
            reason = (f"no answer to tools/list within {self.start_timeout:g} s"
                      if isinstance(_cause(e), TimeoutError) else _describe(e))
            raise ToolSourceError(redact(_escaped(reason), patterns=True)) from e
        if self._session is not session:  # (it stopped meanwhile: nothing to offer)
            raise ToolSourceError(f"MCP server {self.name!r} is not running")
        self._listed(remote, cursor)

    def tools(self, prefixed: Collection[str] = ()) -> list[Tool]:
        """The server's tools as :class:`Tool` s; names in ``prefixed`` become ``<server>__<name>``."""
        if self._session is None:
            raise ToolSourceError(f"MCP server {self.name!r} is not started")
        return self._tools(prefixed)

    # -- internals -------------------------------------------------------------

    async def _on_message(self, message: Any) -> None:
        """The SDK's ``message_handler``: what the server notifies (and what its transport
        raises), in the task that reads its messages. ``notifications/tools/list_changed`` is
        passed on to ``on_tools_changed``, which only takes note (the host's list is made
        elsewhere, never here: the session's reader must go on, or no answer would come); the
        rest is left as the SDK's default leaves it."""
        from mcp_types import ToolListChangedNotification

        if not isinstance(message, ToolListChangedNotification):
            return
        log.info("MCP server %r says its tools changed", self.name)
        if self._on_tools_changed is not None:
            try:
                self._on_tools_changed()
            except Exception:  # (its host's fault: the session reads on)
                log.exception("MCP server %r: its tools' change could not be passed on", self.name)

    @staticmethod
    async def _list_tools(session: Any) -> tuple[list[Any], str | None]:
        """``tools/list``, page after page, at most ``_MAX_LIST_PAGES`` of them: the tools, and
        the next cursor of the last page read (None: there were no more)."""
        from mcp_types import PaginatedRequestParams

        remote: list[Any] = []
        cursor: str | None = None
        for _ in range(_MAX_LIST_PAGES):
            page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            remote.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return remote, cursor

    def _listed(self, remote: list[Any], cursor: str | None) -> None:
        """A list of tools read whole: the tools offered from now on, and its warnings."""
        self.warnings = []
        if cursor:
            self._warn(f"MCP server {self.name!r} listed its tools on more than {_MAX_LIST_PAGES} pages (each "
                       f"answer to tools/list gave a next cursor): the tools of the first {_MAX_LIST_PAGES} "
                       f"pages are offered, the rest are not")
        self._remote = self._first_of_each_name(self._callable(remote))

    def _tools(self, prefixed: Collection[str]) -> list[Tool]:
        prefix = re.sub(r"[^A-Za-z0-9_-]", "_", self.name)
        return [self._tool(r, f"{prefix}__{r.name}" if r.name in prefixed else r.name) for r in self._remote]

    def _warn(self, message: str) -> None:
        log.debug("%s", message)  # (its host tells it: ``open_mcp_sources``' ``warnings``)
        self.warnings.append(message)

    def _callable(self, remote: list[Any]) -> list[Any]:
        """The tools listed whose names a model can call and a prompt shows as they are
        (``server.tools.names``, the rule a client's tools are held to): one named
        ``write_file\u200b``, shown as ``write_file`` and allowed as read-only, was offered and
        ran. The others are named in a warning, and not offered."""
        from operate_sidecar.server.tools.names import name_problem

        kept, refused = [], []
        for r in remote:
            why = name_problem(r.name) if isinstance(r.name, str) else "is not a string"
            if why is None:
                kept.append(r)
            else:
                refused.append(f"{ascii(r.name)[:80]} ({why})")
        if refused:
            self._warn(f"MCP server {self.name!r} lists tool name{'s' if len(refused) > 1 else ''} no model could "
                       f"call, or that would show as another name: {'; '.join(refused[:5])}"
                       f"{f' and {len(refused) - 5} more' if len(refused) > 5 else ''}: not offered")
        return kept

    def _first_of_each_name(self, remote: list[Any]) -> list[Any]:
        """The tools listed, the first of each name only (a server listing a name twice could
        not be called by it): the others are named in a warning."""
        seen: dict[str, None] = {}
        twice: dict[str, None] = {}
        kept = []
        for r in remote:
            if r.name in seen:
                twice[r.name] = None
                continue
            seen[r.name] = None
            kept.append(r)
        if twice:
            names = ", ".join(map(repr, twice))
            self._warn(f"MCP server {self.name!r} lists the tool name{'s' if len(twice) > 1 else ''} {names} more "
                       f"than once: the first tool of that name is offered, the others are not")
        return kept

    def _tool(self, remote: "mcp_types.Tool", public_name: str) -> Tool:
        schema = dict(remote.input_schema or {})
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        annotations = remote.annotations
        read_only = bool(annotations is not None and annotations.read_only_hint)
        description = (remote.description or (annotations.title if annotations else None)
                       or remote.title or remote.name)
        remote_name = remote.name
        output_schema = remote.output_schema

        async def call(arguments: dict[str, Any], ctx: ToolCallContext) -> Any:
            return await self._call(remote_name, arguments, output_schema)

        return Tool(name=public_name, description=description, input_schema=schema, func=call, source="mcp",
                    read_only=read_only, timeout=self.call_timeout)

    async def _call(self, remote_name: str, arguments: dict[str, Any], output_schema: Any) -> Any:
        session = self._session
        if session is None:
            raise ToolCallError(f"MCP server {self.name!r} is not running")
        try:
            result = await session.call_tool(remote_name, arguments or {})
        except Exception as e:
            done = self._done
            if getattr(e, "code", None) == _CONNECTION_CLOSED and done is not None and self._session is session:
                # the server went: its end is taken before this call's error is given (its tools go, and it
                # is started again on the next request that needs them), so that the next round, or an
                # operate sent right after, does not meet the server that went and fail on it too
                import anyio

                with anyio.move_on_after(_LOSS_WAIT_S):
                    await done.wait()
            raise ToolCallError(f"MCP server {self.name!r}, tool {remote_name!r}: {_describe(e)}") from e
        if result.is_error:
            raise ToolCallError(_joined_text(result.content) or f"tool {remote_name!r} failed")
        return _result_value(result, output_schema)

    async def _relay_stderr(self, fd: int, done: Any) -> None:
        """Copy the server's stderr to ours, line by line, keeping a short tail. A line longer
        than ``_STDERR_PIECE`` characters is relayed in pieces as it comes (:class:`_LongLine`:
        never cut through a secret or a key-shaped token), so that its memory stays bounded."""
        import anyio

        os.set_blocking(fd, False)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")  # (a character may span two reads)
        line = _LongLine()
        try:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not chunk:
                    break
                *ends, rest = decoder.decode(chunk).split("\n")
                for end in ends:
                    self._emit_stderr(line.end(end))
                for piece in line.add(rest):
                    self._emit_stderr(piece)
        except OSError:
            pass
        finally:
            last = line.end(decoder.decode(b"", final=True))
            if last:
                self._emit_stderr(last)
            done.set()

    def _emit_stderr(self, text: str) -> None:
        # secrets out before the line is kept or written (SECURITY.md G6): the registered values
        # and key-shaped tokens, as the log filter does for our own lines
        line = redact(_printable(text), patterns=True)  # (a secret split by escape codes is whole once they are out)
        self._stderr_tail.append(line if len(line) <= _QUOTED_LINE_CHARS
                                 else f"{line[:_QUOTED_LINE_CHARS]}… ({len(line)} characters)")
        out = self._errlog if self._errlog is not None else sys.stderr
        try:
            out.write(f"[mcp {self.name}] {line}\n")
            out.flush()
        except (OSError, ValueError):
            pass

    @staticmethod
    async def _stop_relay(relay_tg: Any, done: Any) -> None:
        import anyio

        # The server has exited or been killed: drain what it wrote, but don't wait on a
        # grandchild that still holds the pipe open.
        with anyio.move_on_after(1.0):
            await done.wait()
        relay_tg.cancel_scope.cancel()

    def _start_failure(self, e: BaseException) -> str:
        """Why the server did not start, for its warning: the cause (an exception group the SDK's
        task groups made is looked into), its command line and the last lines of its stderr, both
        masked as the relayed stderr is (docs/SECURITY.md G6: a key passed as an argument too; the
        value of an option named like a secret, ``--token VALUE``, is a known secret from the
        moment the server is configured or passed: ``redaction.mcp_server_secrets``)."""
        e = _cause(e)
        if isinstance(e, TimeoutError):
            reason = f"no answer to initialize/tools/list within {self.start_timeout:g} s"
            if self._unread:
                reason += f" (a message it sent could not be read: {self._unread[-1]})"
        elif isinstance(e, _Stopped):
            reason = "stopped while starting"
        elif isinstance(e, FileNotFoundError):
            reason = f"command not found: {self.command[0]}"
        else:
            reason = _describe(e)
        msg = redact(_escaped(f"MCP server {self.name!r} failed to start ({' '.join(self.command)}): {reason}"),
                     patterns=True)
        return msg + self._quoted_tail()

    def _quoted_tail(self) -> str:
        """The last lines of the server's stderr that are not blank, for a warning: at most
        ``_QUOTED_LINES`` of them (each masked, and cut to ``_QUOTED_LINE_CHARS`` characters as it
        was kept), together at most ``_QUOTED_CHARS`` (the latest kept); "" when there are none."""
        lines = [line for line in self._stderr_tail if line.strip()][-_QUOTED_LINES:]
        kept: list[str] = []
        total = 0
        for line in reversed(lines):
            if kept and total + len(line) + 1 > _QUOTED_CHARS:
                break
            kept.append(line)
            total += len(line) + 1
        return "\nstderr (last lines):\n" + "\n".join(reversed(kept)) if kept else ""


class _LongLine:
    """The stderr line still coming (its line break not yet read): the registered secrets are
    masked in it as it comes (a :class:`StreamRedactor`, which holds back an end that may begin
    one); once it is longer than ``_STDERR_PIECE`` plus ``_STDERR_OVERLAP`` characters, its
    beginning is handed out as a piece (:meth:`add`), cut where the two sides are masked as the
    whole is (:func:`_cut_point`), so that no secret and no key-shaped token is cut in two."""

    __slots__ = ("_redactor", "_text")

    def __init__(self) -> None:
        self._redactor = StreamRedactor()
        self._text = ""  # (the registered secrets masked)

    def add(self, text: str) -> list[str]:
        """More of the line; the pieces of it that can be relayed now. When no cut keeps the
        masking as it is (a key-shaped token longer than ``_STDERR_OVERLAP`` runs across every
        place tried), the text held is masked whole first, as one piece would be, and cut then
        (:func:`_masked_whole`): the token is masked before any of it is relayed, and so is what
        still comes of it."""
        self._text += self._redactor.feed(text)
        pieces = []
        while len(self._text) > _STDERR_PIECE + _STDERR_OVERLAP:
            cut = _cut_point(self._text)
            if cut is None:
                self._text = _masked_whole(self._text)
                if len(self._text) <= _STDERR_PIECE + _STDERR_OVERLAP:
                    break
                cut = _cut_point(self._text)
                if cut is None:  # (all of it is masked but a token's first characters, at its end)
                    cut = len(self._text) - _STDERR_OVERLAP
            pieces.append(self._text[:cut])
            self._text = self._text[cut:]
        return pieces

    def end(self, text: str) -> str:
        """The rest of the line, which ends with ``text``; the next line begins."""
        whole = self._text + self._redactor.feed(text) + self._redactor.flush()
        self._text = ""
        return whole


def _cut_point(text: str) -> int | None:
    """Where to cut a long stderr line in the making: at its last blank before its last
    ``_STDERR_OVERLAP`` characters (else just before those), but never where a secret or a
    key-shaped token runs across the cut (the two sides, masked apart, differ from the whole
    masked): then at an earlier blank, or further back; None when every place tried has one
    running across it."""
    limit = len(text) - _STDERR_OVERLAP
    candidates: list[int] = []
    end = limit
    while len(candidates) < 4:
        blank = max(text.rfind(" ", 0, end), text.rfind("\t", 0, end))
        if blank <= 0:
            break
        candidates.append(blank + 1)
        end = blank
    candidates += [c for c in range(limit, limit // 2, -512) if c not in candidates][:16]
    whole = redact(text, patterns=True)
    for cut in candidates:
        if redact(text[:cut], patterns=True) + redact(text[cut:], patterns=True) == whole:
            return cut
    return None


#: the characters of a key-shaped token that :func:`_masked_whole` keeps for what comes next of it
_TOKEN_SEED = 1024


def _masked_whole(text: str) -> str:
    """A long stderr line in the making that no cut can split (:func:`_cut_point`), masked as one
    piece: all of it, but for a key-shaped token that runs to its end (the line may go on with
    more of it), whose first ``_TOKEN_SEED`` characters stay as they are, so that what comes next
    of it is masked with them, as the token whole would be."""
    whole = redact(text, patterns=True)
    start = _open_token(text)
    if start is None:
        return whole
    head, token, seed = redact(text[:start], patterns=True), redact(text[start:], patterns=True), \
        text[start:start + _TOKEN_SEED]
    if head + token != whole or redact(seed, patterns=True) != token:
        return whole  # (the token's start masks otherwise alone: what comes of it next is not held back)
    return head + seed


def _open_token(text: str) -> int | None:
    """Where the key-shaped token that ends ``text`` and could go on with more characters
    begins (the earliest, when several do), else None."""
    starts = []
    for pattern, _ in KEY_PATTERNS:
        last = None
        for last in pattern.finditer(text):
            pass
        if last is not None and last.end() == len(text):
            more = pattern.match(text[last.start():] + "A")
            if more is not None and more.end() > len(text) - last.start():
                starts.append(last.start())
    return min(starts, default=None)


class _ServerGroup:
    """The process group the SDK started an MCP server in (a session of its own), with a
    reaper that SIGKILLs the group once the sidecar is gone (exit, crash or SIGKILL alike)."""

    def __init__(self, name: str, pgid: int) -> None:
        self.name = name
        self.pgid = pgid
        self._reaper: Any = None
        self._reaper_fd: int | None = None
        from operate_sidecar.server.reaper import start_reaper

        started = start_reaper(pgid)
        if started is not None:
            self._reaper, self._reaper_fd = started

    @classmethod
    def find(cls, name: str, stderr_inode: int) -> "_ServerGroup | None":
        """The server just spawned: our child that leads its own group with its stderr on our pipe
        (Linux /proc; elsewhere None, and the SDK's own shutdown is all there is)."""
        if not sys.platform.startswith("linux"):
            return None
        me, target = os.getpid(), f"pipe:[{stderr_inode}]"
        for pid in _pids():
            stat = _stat(pid)
            if stat is None or stat[2] != me or stat[1] != pid:
                continue
            try:
                if os.readlink(f"/proc/{pid}/fd/2") == target:
                    return cls(name, pid)
            except OSError:
                continue
        log.debug("MCP server %r: its process was not found; it is stopped by the SDK only", name)
        return None

    def alive(self) -> bool:
        """Whether a member of the group still runs (zombies, waiting to be reaped, do not)."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return any((st := _stat(pid)) is not None and st[1] == self.pgid and st[0] not in "ZX" for pid in _pids())

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def _until_gone(self, timeout: float) -> bool:
        import anyio

        with anyio.move_on_after(timeout):
            while self.alive():
                await anyio.sleep(_POLL_S)
        return not self.alive()

    async def terminate(self, grace: float) -> None:
        """Give the group ``grace`` seconds to exit, then SIGTERM it, then SIGKILL what is left
        ``_KILL_GRACE`` seconds later. Runs to the end even when its caller is cancelled."""
        import anyio

        with anyio.CancelScope(shield=True):
            if grace > 0 and await self._until_gone(grace):
                return
            if not self.alive():
                return
            log.debug("MCP server %r: terminating its process group %d", self.name, self.pgid)
            self._signal(signal.SIGTERM)
            if await self._until_gone(_KILL_GRACE):
                return
            log.warning("MCP server %r did not exit on SIGTERM; killing its process group", self.name)
            self._signal(signal.SIGKILL)
            await self._until_gone(_KILL_GRACE)

    async def release(self) -> None:
        """The server is gone: let the reaper go (its last kill finds nothing)."""
        import anyio

        fd, self._reaper_fd = self._reaper_fd, None
        if fd is None:
            return
        os.close(fd)
        proc = self._reaper
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            while proc.poll() is None:
                await anyio.sleep(_POLL_S)


def _pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, parent) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[2]), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


@asynccontextmanager
async def open_mcp_sources(config: Mapping[str, Mapping[str, Any]] | None, *, reserved: Collection[str] = (),
                           start_timeout: float = DEFAULT_START_TIMEOUT, call_timeout: float | None = None,
                           errlog: TextIO | None = None, stop: Any = None,
                           lost: Callable[[str, str], None] | None = None,
                           changed: Callable[[str], None] | None = None,
                           kept: Mapping[str, Mapping[str, str]] | None = None,
                           registered: Collection[str] | None = None) -> AsyncIterator[McpTools]:
    """Start every server in ``config`` (``{name: {"command": [..], "env"?: {..}}}``) and
    yield the tools of those that started (an :class:`McpTools`: its ``origin`` says which server
    offers each, under which name of its own; its ``failed`` names each server that did not
    start, with the :class:`ToolSourceError` that says why; its ``warnings`` what else went
    wrong); stop the servers when the block exits.

    Servers start concurrently, each in a task of a task group owned by this context manager,
    each on its own: one that fails to start (its command not found, it exits, it does not
    answer within ``start_timeout``) is in ``failed``, and the others' tools are offered all the
    same (the block begins once every start has ended). ``reserved`` names (tools from other
    sources) force the ``<server>__`` prefix, as do clashes between servers; a tool whose name is
    still taken with the prefix (two server names that give the same prefix) is not offered, and
    a warning says so. A configuration of the wrong shape is raised as :class:`ToolSourceError`
    before any server starts. An exception raised in the block propagates unchanged (not wrapped
    in an exception group).

    ``stop`` (an event: ``wait()`` and ``is_set()``), once set, stops the servers still
    starting at once (their start is abandoned, and the block gets no tools); the host
    sets it when it exits, so that a server hanging in its handshake is not waited for.

    ``lost(name, why)`` is called when a server, started, stops on its own (it exited, crashed,
    was killed): its tools fail from then on, and the others run on; the block goes on until
    its host leaves it.

    ``changed(name)`` is called when a server says its tools changed
    (``notifications/tools/list_changed``; also while it starts, so the block may begin with
    one due), in the task reading its messages (it must not block): the host then lists them
    again with :meth:`McpTools.list_again` and names them with :meth:`McpTools.named`.

    ``kept`` (server -> its own name for a tool -> the name it was offered as before: servers
    started again) and ``registered`` (the names other sources' tools have now): a tool a server
    still lists keeps its name while no other tool has it (:func:`_named_tools`).
    """
    if not config:
        yield McpTools()
        return
    if not isinstance(config, Mapping):
        raise ToolSourceError(f"mcpServers must be an object of name → {{command, env}}, got {type(config).__name__}")
    sources = [_source_from_config(name, spec, start_timeout=start_timeout, call_timeout=call_timeout,
                                   errlog=errlog, on_lost=_bound(lost, name),
                                   on_tools_changed=None if changed is None else partial(changed, name))
               for name, spec in config.items()]

    import anyio

    failures: dict[str, ToolSourceError] = {}
    body_error: Exception | None = None
    stopped = False

    async with anyio.create_task_group() as tg:  # owns every serving task
        async with anyio.create_task_group() as watch:
            if stop is not None:

                async def stop_starts() -> None:
                    nonlocal stopped
                    await stop.wait()
                    stopped = True
                    for source in sources:
                        source._request_stop()

                watch.start_soon(stop_starts, name="stop mcp servers")
            async with anyio.create_task_group() as starters:

                async def start_one(source: McpToolSource) -> None:
                    if stopped:
                        return
                    try:
                        await source.start(tg)  # bounded by the source's start_timeout
                    except ToolSourceError as e:  # that one alone: the others start all the same
                        failures[source.name] = e

                for source in sources:
                    starters.start_soon(start_one, source, name=f"start mcp server {source.name}")
            watch.cancel_scope.cancel()
        try:
            if stopped:  # stopped on purpose: nothing failed, no tools
                yield McpTools()
            else:
                try:
                    tools = _named_tools([s for s in sources if s.name not in failures], reserved, kept, registered)
                    tools.failed = {s.name: failures[s.name] for s in sources if s.name in failures}
                    yield tools
                except Exception as e:  # re-raised below, outside the task group, unwrapped
                    body_error = e
        finally:
            await _close_all(sources)
    if body_error is not None:
        raise body_error


def _bound(lost: Callable[[str, str], None] | None, name: str) -> Callable[[str], None] | None:
    return None if lost is None else (lambda why: lost(name, why))


async def _close_all(sources: list[McpToolSource]) -> None:
    """Stop all started sources concurrently and wait for them."""
    for source in sources:
        source._request_stop()
    for source in sources:
        await source.aclose()


_sdk_imported = False


async def _import_sdk() -> None:
    """Import the mcp SDK (about 1–2 s cold) in a worker thread, so that the event loop
    (and with it the JSON-RPC server) keeps running while the first server starts."""
    global _sdk_imported
    if _sdk_imported:
        return
    import anyio.to_thread

    def load() -> None:
        import mcp  # noqa: F401
        import mcp.client.stdio  # noqa: F401
        import mcp_types  # noqa: F401

        logging.getLogger("mcp.client.stdio").addFilter(_one_line_for_an_unread_line)

    try:
        await anyio.to_thread.run_sync(load)
    except ImportError as e:
        raise ToolSourceError(f"MCP servers are configured but the mcp SDK is not installed "
                              f"(pip install 'operate-sidecar[mcp]'): {e}") from e
    _sdk_imported = True


def _source_from_config(name: str, spec: Any, **kw: Any) -> McpToolSource:
    if not isinstance(spec, Mapping):
        raise ToolSourceError(f"MCP server {name!r}: configuration must be an object with command and env, got {spec!r}")
    unknown = sorted(set(spec) - _CONFIG_KEYS)
    if unknown:
        raise ToolSourceError(f"MCP server {name!r}: unknown configuration keys {', '.join(unknown)}")
    if "command" not in spec:
        raise ToolSourceError(f"MCP server {name!r}: configuration has no command")
    return McpToolSource(name, spec["command"], spec.get("env"), **kw)


class McpTools(list):
    """The tools :func:`open_mcp_sources` yields (a list of :class:`Tool`); ``origin``: each
    one's name as offered -> (its server, the server's own name for it); ``failed``: each server
    that did not start -> why; ``warnings``: what else went wrong, one message each. The tools
    listed when the block began: one that lists its tools again (:meth:`list_again`) has them
    named by :meth:`named`, each time a new :class:`McpTools`. ``sources``: the servers that
    started (whose tools these are)."""

    def __init__(self, tools: Iterable[Tool] = (), origin: dict[str, tuple[str, str]] | None = None,
                 sources: Iterable["McpToolSource"] = ()) -> None:
        super().__init__(tools)
        self.origin: dict[str, tuple[str, str]] = origin or {}
        self.failed: dict[str, ToolSourceError] = {}
        self.warnings: list[str] = []
        self._sources: dict[str, McpToolSource] = {s.name: s for s in sources}  # by name

    def running(self, server: str) -> bool:
        """Whether ``server`` (one of the block's) started and runs still."""
        source = self._sources.get(server)
        return source is not None and source.running

    async def list_again(self, server: str) -> None:
        """List the tools of ``server`` (one of the block's, running) again
        (:meth:`McpToolSource.list_again`: :class:`ToolSourceError` when that fails, the tools
        listed before kept); :meth:`named` names them."""
        source = self._sources.get(server)
        if source is None:
            raise ToolSourceError(f"MCP server {server!r} is not running")
        await source.list_again()

    def named(self, server: str, reserved: Collection[str], kept: Mapping[str, str] | None = None,
              registered: Collection[str] | None = None) -> "McpTools":
        """The tools ``server`` lists now, named as at the start (:func:`_named_tools`): a tool it
        listed before keeps the name it had (``kept``: its own name -> that name) while no other
        tool has it (``registered``: the names other sources' tools have); a new one is named
        plainly, or ``<server>__<tool>`` when ``reserved`` (every name taken but by its own tools:
        the other sources', and the names its siblings' tools have of their own, which a start
        together would have found clashing) has the name; a name taken even so is left out, with
        a warning. ``warnings``: the server's, as a start gives them."""
        return _named_tools([self._sources[server]], reserved, {server: kept or {}}, registered)


def _named_tools(sources: list[McpToolSource], reserved: Collection[str],
                 kept: Mapping[str, Mapping[str, str]] | None = None,
                 registered: Collection[str] | None = None) -> McpTools:
    """The started ``sources``' tools, named: plainly, or ``<server>__<tool>`` where two of them
    offer the name or ``reserved`` has it. A name taken even so (the prefixes of two server names
    are the same, ``a b`` and ``a_b``; a server's tool is named like another's prefixed one) is
    offered once, by the first server: the other's tool is not offered, and a warning says so.
    ``kept`` (server -> its own name for a tool -> the name it was offered as before: a server
    listing its tools again, or started again): such a tool keeps that name while no other tool
    has it (``registered``: the names other sources' tools have; ``reserved`` when None), whatever
    ``reserved`` says; the rules above name the others (new tools). Linear in the tools (a
    server may list thousands, each list of them named while the event loop waits)."""
    kept = kept or {}
    registered = reserved if registered is None else registered
    counts = Counter(n for s in sources for n in s.tool_names())
    taken = set(reserved)
    clashing = {n for n, c in counts.items() if c > 1 or n in taken}
    keeps: dict[tuple[str, str], str] = {}  # (server, its own name) -> the name it keeps
    keeping: set[str] = set()  # the names kept (``keeps``' values)
    for s in sources:
        before_of = kept.get(s.name, {})
        for own in s.tool_names():
            before = before_of.get(own)
            if before is not None and before not in registered and before not in keeping:
                keeps[(s.name, own)] = before
                keeping.add(before)
    tools = McpTools(sources=sources)
    for s in sources:
        tools.warnings.extend(s.warnings)
        left_out: dict[str, list[str]] = {}  # who has the name -> "'tool' as 'name'"
        for r, t in zip(s._remote, s._tools(clashing)):
            remote = r.name
            keep = keeps.get((s.name, remote))
            if keep is not None and keep != t.name:
                t = s._tool(r, keep)
            holder = tools.origin.get(t.name)
            if holder is not None or (t.name not in counts and t.name in taken and keep is None) \
                    or (keep is None and t.name in keeping):
                by = f"MCP server {holder[0]!r}" if holder is not None else "another tool source"
                left_out.setdefault(by, []).append(f"{remote!r} as {t.name!r}")
                continue
            tools.append(t)
            tools.origin[t.name] = (s.name, remote)
        if left_out:
            tools.warnings.append(f"MCP server {s.name!r}: tools not offered, since their names are taken even with "
                                  f"the server's prefix: " + "; ".join(
                                      f"{', '.join(names)} ({by} offers {'a tool' if len(names) == 1 else 'tools'} "
                                      f"of {'that name' if len(names) == 1 else 'those names'})"
                                      for by, names in left_out.items()))
    return tools


def _one_line_for_an_unread_line(record: logging.LogRecord) -> bool:
    """The SDK logs a line of a server's that it cannot read with a traceback of its parser
    (``logger.exception``): the log says in one line what the line was instead (its request is
    never answered; the time-out that follows names it too)."""
    e = record.exc_info[1] if record.exc_info else None
    if isinstance(e, Exception) and str(record.msg).startswith("Failed to parse"):
        record.msg, record.args = "an MCP server wrote a line that could not be read, which is ignored: %s", (
            _unread_text(e),)
        record.exc_info = record.exc_text = None
    return True


def _unread_text(e: Exception) -> str:
    """What a line the SDK could not read was: not JSON (its parser's reason), or JSON that is no
    JSON-RPC message (its head)."""
    try:
        first = e.errors()[0]  # type: ignore[attr-defined]  # (a pydantic ValidationError)
    except Exception:
        return " ".join(_describe(e).split())
    if first.get("type") == "json_invalid":
        return str(first.get("msg"))
    return "not a JSON-RPC message: " + redact_cut(json.dumps(first.get("input"), default=str), 200, patterns=True)


def _cause(e: BaseException) -> BaseException:
    """What went wrong: ``e``, or, for an exception group (the SDK's task groups wrap what their
    tasks raised in one, which says only "unhandled errors in a TaskGroup"), the first exception
    in it that is not a cancellation (the first one if all are), looked into the same way."""
    for _ in range(100):  # (a group nested deeper than that is named as it is)
        if not isinstance(e, BaseExceptionGroup) or not e.exceptions:
            break
        import anyio

        cancelled = anyio.get_cancelled_exc_class()
        e = next((x for x in e.exceptions if not isinstance(x, cancelled)), e.exceptions[0])
    return e


def _describe(e: BaseException) -> str:
    """What went wrong (:func:`_cause`), at most 500 characters of it, masked as the relayed
    stderr is before it is cut (docs/SECURITY.md G6: a cut never leaves part of a secret)."""
    from ..redaction import redact_cut

    e = _cause(e)
    text = exception_text(e).strip()
    if not text:
        return type(e).__name__
    return redact_cut(text, 500, more="…", patterns=True)


def _joined_text(blocks: list[Any]) -> str:
    return "\n".join(b.text for b in blocks if getattr(b, "type", None) == "text")


def _result_value(result: Any, output_schema: Any) -> Any:
    structured = result.structured_content
    if structured is not None:
        props = (output_schema or {}).get("properties") if isinstance(output_schema, dict) else None
        if isinstance(structured, dict) and set(structured) == {"result"} and isinstance(props, dict) \
                and set(props) == {"result"}:
            return structured["result"]
        return structured
    blocks = list(result.content or [])
    if all(getattr(b, "type", None) == "text" for b in blocks):
        return "\n".join(b.text for b in blocks)
    return [_block_value(b) for b in blocks]


def _block_value(block: Any) -> Any:
    kind = getattr(block, "type", None)
    if kind == "text":
        return {"type": "text", "text": block.text}
    if kind in ("image", "audio"):
        return {"type": kind, "mimeType": block.mime_type, "bytes": len(block.data) * 3 // 4}
    data = block.model_dump(mode="json", by_alias=True, exclude_none=True)
    resource = data.get("resource")
    if isinstance(resource, dict) and "blob" in resource:
        resource["bytes"] = len(resource.pop("blob")) * 3 // 4
    return data
