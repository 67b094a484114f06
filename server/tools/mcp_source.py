"""MCP servers as a tool source (settings ``mcpServers``).

Each configured server ``{"command": [exe, *args], "env"?: {..}}`` is spawned as a
subprocess speaking MCP over stdio (the ``mcp`` SDK's ``stdio_client`` and
``ClientSession``). Its stdin/stdout are the MCP pipes; its stderr is relayed line by
line, prefixed ``[mcp <name>]``, to our stderr (never stdout, which is the wire), secrets
redacted from every line, and the last lines of it are quoted when the server fails to
start. ``env`` is merged over the SDK's small safe default environment (``HOME``,
``PATH``, ``SHELL``, ``TERM``, ``USER``, ``LOGNAME``), not over our whole environment.

Tools (source ``mcp``):

- Named after the MCP tool, plainly. When two configured servers offer the same tool
  name, or the name is already taken (``reserved``: builtin/python/client tools), every
  clashing tool is named ``<server>__<tool>`` instead (the server name with characters
  outside ``[A-Za-z0-9_-]`` replaced by ``_``). The MCP side is always called with the
  server's own name for the tool.
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
concurrently in a task group it owns and stops them when its block exits (or, with its
``stop`` event, as soon as that is set, starts included).

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

import json
import logging
import os
import re
import signal
import sys
from collections import Counter, deque
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Collection, Iterable, Mapping, TextIO

from .. import __version__
from ..core.errors import exception_text
from ..core.tools import Tool, ToolCallContext
from ..redaction import redact
from .errors import ToolCallError, ToolSourceError

if TYPE_CHECKING:
    import mcp_types
    from anyio.abc import TaskGroup

log = logging.getLogger(__name__)

__all__ = ["McpToolSource", "McpTools", "open_mcp_sources", "DEFAULT_START_TIMEOUT"]

DEFAULT_START_TIMEOUT = 30.0
_STDERR_TAIL_LINES = 20
_MAX_LIST_PAGES = 100
_CONFIG_KEYS = frozenset({"command", "env"})
#: a started server stopped: seconds it has to exit on its own (its stdin closed) before SIGTERM
_STOP_GRACE = 1.5
#: seconds between SIGTERM and SIGKILL (to the server's whole process group)
_KILL_GRACE = 1.0
#: the longest a started server's stop takes: its grace, SIGTERM, SIGKILL and the wait after
STOP_BOUND_S = _STOP_GRACE + 2 * _KILL_GRACE
_POLL_S = 0.02


class _Stopped(Exception):
    """The source was stopped (closed, or its host is exiting) before its server had started."""


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
                 errlog: TextIO | None = None, on_lost: Callable[[str], None] | None = None) -> None:
        """``on_lost(why)``: called once the server, started, stops though nothing asked it to."""
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
        self._session: Any = None
        self._remote: list[mcp_types.Tool] = []
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
        ``start_timeout`` seconds. The caller may bound or cancel ``start`` with its own
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
            raise ToolSourceError(self._start_failure(failure)) from failure

    def _lost(self, why: str) -> None:
        tail = [line for line in self._stderr_tail if line.strip()]
        if tail:
            why += "\nstderr (last lines):\n" + "\n".join(tail[-10:])
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
            params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env)
            self._streams = await stack.enter_async_context(stdio_client(params, errlog=err_file))  # type: ignore[arg-type]
        finally:
            err_file.close()  # the child holds its own copy; EOF reaches the relay when it exits
        # no await between the spawn and the reaper: a cancellation here would leave the server
        return _ServerGroup.find(self.name, inode)

    async def _handshake_and_serve(self, stack: AsyncExitStack, on_started: Any) -> BaseException | None:
        import anyio
        from mcp import ClientSession
        from mcp_types import Implementation, PaginatedRequestParams

        read, write = self._streams
        self._streams = None
        # the SDK ends its session quietly when the server's stdout does (its pending requests
        # fail): the stream is relayed, so that its end is seen here
        ended = anyio.Event()
        relay_tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(relay_tg.cancel_scope.cancel)  # unwound before the group is left
        self._unread.clear()  # (of this start, not an earlier one's)
        read = await relay_tg.start(_relay_until_end, read, ended, self._unread)
        session = await stack.enter_async_context(ClientSession(
            read, write, client_info=Implementation(name="operate-sidecar", version=__version__)))
        remote: list[Any] = []
        with anyio.CancelScope() as handshake:
            self._handshake = handshake
            if self._stop.is_set():
                handshake.cancel()
            try:
                with anyio.fail_after(self.start_timeout):
                    await session.initialize()
                    cursor: str | None = None
                    for _ in range(_MAX_LIST_PAGES):
                        page = await session.list_tools(
                            params=PaginatedRequestParams(cursor=cursor) if cursor else None)
                        remote.extend(page.tools)
                        cursor = page.next_cursor
                        if not cursor:
                            break
            except Exception as e:
                return e
        self._handshake = None
        if handshake.cancelled_caught or self._stop.is_set():
            return _Stopped()
        self._remote = remote
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

    def tools(self, prefixed: Collection[str] = ()) -> list[Tool]:
        """The server's tools as :class:`Tool` s; names in ``prefixed`` become ``<server>__<name>``."""
        if self._session is None:
            raise ToolSourceError(f"MCP server {self.name!r} is not started")
        prefix = re.sub(r"[^A-Za-z0-9_-]", "_", self.name)
        return [self._tool(r, f"{prefix}__{r.name}" if r.name in prefixed else r.name) for r in self._remote]

    # -- internals -------------------------------------------------------------

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
            raise ToolCallError(f"MCP server {self.name!r}, tool {remote_name!r}: {_describe(e)}") from e
        if result.is_error:
            raise ToolCallError(_joined_text(result.content) or f"tool {remote_name!r} failed")
        return _result_value(result, output_schema)

    async def _relay_stderr(self, fd: int, done: Any) -> None:
        """Copy the server's stderr to ours, line by line, keeping a short tail."""
        import anyio

        os.set_blocking(fd, False)
        pending = b""
        try:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._emit_stderr(line)
                if len(pending) > 65536:  # a very long line: cut at its last blank (not through a key)
                    cut = max(pending.rfind(b" "), pending.rfind(b"\t")) + 1 or len(pending)
                    self._emit_stderr(pending[:cut])
                    pending = pending[cut:]
        except OSError:
            pass
        finally:
            if pending:
                self._emit_stderr(pending)
            done.set()

    def _emit_stderr(self, raw: bytes) -> None:
        # secrets out before the line is kept or written (SECURITY.md G6): the registered values
        # and key-shaped tokens, as the log filter does for our own lines
        line = redact(raw.decode("utf-8", "replace").rstrip("\r"), patterns=True)
        self._stderr_tail.append(line)
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
        msg = f"MCP server {self.name!r} failed to start ({' '.join(self.command)}): {reason}"
        tail = [line for line in self._stderr_tail if line.strip()]
        if tail:
            msg += "\nstderr (last lines):\n" + "\n".join(tail[-10:])
        return msg


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
                           lost: Callable[[str, str], None] | None = None) -> AsyncIterator[McpTools]:
    """Start every server in ``config`` (``{name: {"command": [..], "env"?: {..}}}``) and
    yield all their tools (an :class:`McpTools`: its ``origin`` says which server offers each,
    under which name of its own); stop the servers when the block exits.

    Servers start concurrently, each in a task of a task group owned by this context
    manager. If any fails to start, the others are stopped (or their starts cancelled)
    and the failure is raised as :class:`ToolSourceError` naming the server. ``reserved``
    names (tools from other sources) force the ``<server>__`` prefix, as do clashes
    between servers. An exception raised in the block propagates unchanged (not wrapped
    in an exception group).

    ``stop`` (an event: ``wait()`` and ``is_set()``), once set, stops the servers still
    starting at once (their start is abandoned, and the block gets no tools); the host
    sets it when it exits, so that a server hanging in its handshake is not waited for.

    ``lost(name, why)`` is called when a server, started, stops on its own (it exited, crashed,
    was killed): its tools fail from then on, and the others run on; the block goes on until
    its host leaves it.
    """
    if not config:
        yield McpTools()
        return
    if not isinstance(config, Mapping):
        raise ToolSourceError(f"mcpServers must be an object of name → {{command, env}}, got {type(config).__name__}")
    sources = [_source_from_config(name, spec, start_timeout=start_timeout, call_timeout=call_timeout,
                                   errlog=errlog, on_lost=_bound(lost, name)) for name, spec in config.items()]

    import anyio

    failures: list[ToolSourceError] = []
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
                    except ToolSourceError as e:
                        failures.append(e)
                        starters.cancel_scope.cancel()  # no point waiting for the others

                for source in sources:
                    starters.start_soon(start_one, source, name=f"start mcp server {source.name}")
            watch.cancel_scope.cancel()
        if stopped:
            failures.clear()  # stopped on purpose: nothing failed
        try:
            if stopped:
                yield McpTools()
            elif not failures:
                try:
                    yield _named_tools(sources, reserved)
                except Exception as e:  # re-raised below, outside the task group, unwrapped
                    body_error = e
        finally:
            await _close_all(sources)
    if failures:
        raise failures[0]
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
    one's name as offered -> (its server, the server's own name for it)."""

    def __init__(self, tools: Iterable[Tool] = (), origin: dict[str, tuple[str, str]] | None = None) -> None:
        super().__init__(tools)
        self.origin: dict[str, tuple[str, str]] = origin or {}


def _named_tools(sources: list[McpToolSource], reserved: Collection[str]) -> McpTools:
    counts = Counter(n for s in sources for n in s.tool_names())
    taken = set(reserved)
    clashing = {n for n, c in counts.items() if c > 1 or n in taken}
    tools = McpTools()
    for s in sources:
        for remote, t in zip(s.tool_names(), s.tools(prefixed=clashing)):
            tools.append(t)
            tools.origin[t.name] = (s.name, remote)
    seen: set[str] = set()
    for t in tools:
        if t.name in seen or (t.name not in counts and t.name in taken):
            raise ToolSourceError(f"MCP tool name {t.name!r} is taken twice even with the server prefix")
        seen.add(t.name)
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
    return "not a JSON-RPC message: " + json.dumps(first.get("input"), default=str)[:200]


def _describe(e: BaseException) -> str:
    text = exception_text(e).strip()
    if not text:
        return type(e).__name__
    return text if len(text) <= 500 else text[:500] + "…"


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
