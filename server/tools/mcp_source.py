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
concurrently in a task group it owns and stops them when its block exits.

The ``mcp`` SDK is imported only when a server is started, never at import time.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections import Counter, deque
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Collection, Mapping, TextIO

from .. import __version__
from ..core.tools import Tool, ToolCallContext
from ..redaction import redact
from .errors import ToolCallError, ToolSourceError

if TYPE_CHECKING:
    import mcp_types
    from anyio.abc import TaskGroup

log = logging.getLogger(__name__)

__all__ = ["McpToolSource", "open_mcp_sources", "DEFAULT_START_TIMEOUT"]

DEFAULT_START_TIMEOUT = 30.0
_STDERR_TAIL_LINES = 20
_MAX_LIST_PAGES = 100
_CONFIG_KEYS = frozenset({"command", "env"})


class McpToolSource:
    """One MCP server spawned over stdio and the tools it offers."""

    def __init__(self, name: str, command: list[str], env: Mapping[str, str] | None = None, *,
                 start_timeout: float = DEFAULT_START_TIMEOUT, call_timeout: float | None = None,
                 errlog: TextIO | None = None) -> None:
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
        self._session: Any = None
        self._remote: list[mcp_types.Tool] = []
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._stop: Any = None  # anyio.Event: ask the serving task to stop
        self._done: Any = None  # anyio.Event: the serving task has finished
        self._own_tg: AsyncExitStack | None = None  # holds the task group of ``async with source``

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

    async def aclose(self) -> None:
        """Stop the server (close its stdin, then terminate it if it lingers) and wait
        for it to be gone. The SDK bounds every step of the shutdown."""
        stop, done = self._stop, self._done
        if stop is None:
            return
        stop.set()
        await done.wait()
        self._stop = self._done = None

    async def _serve(self, *, task_status: Any) -> None:
        """The serving task: relay stderr, run the session until asked to stop."""
        import anyio

        started = False
        failure: BaseException | None = None

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
                log.error("MCP server %r stopped unexpectedly: %s", self.name, _describe(e))
            else:
                failure = failure or e
        finally:
            self._session = None
            if self._done is not None:
                self._done.set()
        if failure is not None and not started:
            raise ToolSourceError(self._start_failure(failure)) from failure

    async def _run_session(self, write_fd: int, on_started: Any) -> BaseException | None:
        """Run stdio_client + ClientSession; return the start failure instead of raising it
        (raising through the SDK's task groups would wrap it in exception groups)."""
        import anyio
        from mcp import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp_types import Implementation, PaginatedRequestParams

        err_file = os.fdopen(write_fd, "wb", buffering=0)
        async with AsyncExitStack() as stack:
            try:
                params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env)
                read, write = await stack.enter_async_context(stdio_client(params, errlog=err_file))  # type: ignore[arg-type]
            except Exception as e:
                return e
            finally:
                err_file.close()  # the child holds its own copy; EOF reaches the relay when it exits
            session = await stack.enter_async_context(ClientSession(
                read, write, client_info=Implementation(name="operate-sidecar", version=__version__)))
            try:
                with anyio.fail_after(self.start_timeout):
                    await session.initialize()
                    remote: list[Any] = []
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
            self._remote = remote
            self._session = session
            on_started()
            await self._stop.wait()
            self._session = None
        return None

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
        elif isinstance(e, FileNotFoundError):
            reason = f"command not found: {self.command[0]}"
        else:
            reason = _describe(e)
        msg = f"MCP server {self.name!r} failed to start ({' '.join(self.command)}): {reason}"
        tail = [line for line in self._stderr_tail if line.strip()]
        if tail:
            msg += "\nstderr (last lines):\n" + "\n".join(tail[-10:])
        return msg


@asynccontextmanager
async def open_mcp_sources(config: Mapping[str, Mapping[str, Any]] | None, *, reserved: Collection[str] = (),
                           start_timeout: float = DEFAULT_START_TIMEOUT, call_timeout: float | None = None,
                           errlog: TextIO | None = None) -> AsyncIterator[list[Tool]]:
    """Start every server in ``config`` (``{name: {"command": [..], "env"?: {..}}}``) and
    yield all their tools; stop the servers when the block exits.

    Servers start concurrently, each in a task of a task group owned by this context
    manager. If any fails to start, the others are stopped (or their starts cancelled)
    and the failure is raised as :class:`ToolSourceError` naming the server. ``reserved``
    names (tools from other sources) force the ``<server>__`` prefix, as do clashes
    between servers. An exception raised in the block propagates unchanged (not wrapped
    in an exception group).
    """
    if not config:
        yield []
        return
    if not isinstance(config, Mapping):
        raise ToolSourceError(f"mcpServers must be an object of name → {{command, env}}, got {type(config).__name__}")
    sources = [_source_from_config(name, spec, start_timeout=start_timeout, call_timeout=call_timeout,
                                   errlog=errlog) for name, spec in config.items()]

    import anyio

    failures: list[ToolSourceError] = []
    body_error: Exception | None = None

    async with anyio.create_task_group() as tg:  # owns every serving task
        async with anyio.create_task_group() as starters:

            async def start_one(source: McpToolSource) -> None:
                try:
                    await source.start(tg)  # bounded by the source's start_timeout
                except ToolSourceError as e:
                    failures.append(e)
                    starters.cancel_scope.cancel()  # no point waiting for the others

            for source in sources:
                starters.start_soon(start_one, source, name=f"start mcp server {source.name}")
        try:
            if not failures:
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


def _named_tools(sources: list[McpToolSource], reserved: Collection[str]) -> list[Tool]:
    counts = Counter(n for s in sources for n in s.tool_names())
    taken = set(reserved)
    clashing = {n for n, c in counts.items() if c > 1 or n in taken}
    tools = [t for s in sources for t in s.tools(prefixed=clashing)]
    seen: set[str] = set()
    for t in tools:
        if t.name in seen or (t.name not in counts and t.name in taken):
            raise ToolSourceError(f"MCP tool name {t.name!r} is taken twice even with the server prefix")
        seen.add(t.name)
    return tools


def _describe(e: BaseException) -> str:
    text = str(e).strip()
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
