"""MCP servers as a tool source (settings ``mcpServers``).

Each configured server ``{"command": [exe, *args], "env"?: {..}}`` is spawned as a
subprocess speaking MCP over stdio (the ``mcp`` SDK's ``stdio_client`` and
``ClientSession``). Its stdin/stdout are the MCP pipes; its stderr is relayed line by
line, prefixed ``[mcp <name>]``, to our stderr (never stdout, which is the wire), and the
last lines of it are quoted when the server fails to start. ``env`` is merged over the
SDK's small safe default environment (``HOME``, ``PATH``, ``SHELL``, ``TERM``, ``USER``,
``LOGNAME``), not over our whole environment.

Tools (source ``mcp``):

- Named after the MCP tool, plainly. When two configured servers offer the same tool
  name, or the name is already taken (``reserved``: builtin/python/client tools), every
  clashing tool is named ``<server>__<tool>`` instead (the server name with characters
  outside ``[A-Za-z0-9_-]`` replaced by ``_``). The MCP side is always called with the
  server's own name for the tool.
- ``inputSchema`` is the server's, ``description`` its description (else title, name).
- ``annotations.readOnlyHint: true`` makes the tool ``read_only`` (so the default policy
  allows it, PROTOCOL §4); anything else is not read-only.
- A call returns the result's structured content when there is some (the SDK's
  ``{"result": x}`` wrapper of a primitive return is unwrapped to ``x``), else the text
  content blocks joined with newlines, else a list of the content blocks (binary data
  summarised as ``{"type", "mimeType", "bytes"}``). An ``isError`` result raises
  :class:`ToolCallError` with the error text; so does a protocol error or a lost
  connection (the message names the server).

Lifetime is structured: use ``async with McpToolSource(...) as source`` (or ``start()``
and ``aclose()`` from the same task), or :func:`open_mcp_sources`, which starts all
configured servers concurrently in a task group it owns and stops them on exit.

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

from ..core.tools import Tool, ToolCallContext
from .errors import ToolCallError, ToolSourceError

if TYPE_CHECKING:
    import mcp_types

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
        self._stack: AsyncExitStack | None = None
        self._session: Any = None
        self._remote: list[mcp_types.Tool] = []
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)

    def __repr__(self) -> str:
        state = "running" if self._session is not None else "stopped"
        return f"McpToolSource({self.name!r}, {self.command!r}, {state})"

    async def __aenter__(self) -> "McpToolSource":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def running(self) -> bool:
        return self._session is not None

    def tool_names(self) -> list[str]:
        """The server's own names for its tools (after :meth:`start`)."""
        return [t.name for t in self._remote]

    async def start(self) -> None:
        """Spawn the server, initialize the session and list its tools.

        Raises :class:`ToolSourceError` naming the server (with the reason and the tail of
        its stderr) when it cannot be spawned, exits, or does not answer within
        ``start_timeout`` seconds. Call :meth:`aclose` from the same task.
        """
        if self._stack is not None:
            raise ToolSourceError(f"MCP server {self.name!r} is already started")
        import anyio
        from mcp import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp_types import Implementation, PaginatedRequestParams

        stack = AsyncExitStack()
        self._stack = stack
        try:
            relay_tg = await stack.enter_async_context(anyio.create_task_group())
            read_fd, write_fd = os.pipe()
            relay_done = anyio.Event()
            relay_tg.start_soon(self._relay_stderr, read_fd, relay_done)
            stack.push_async_callback(self._stop_relay, relay_tg, relay_done)
            params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env)
            err_file = os.fdopen(write_fd, "wb", buffering=0)
            try:
                read, write = await stack.enter_async_context(stdio_client(params, errlog=err_file))  # type: ignore[arg-type]
            finally:
                err_file.close()  # the child holds its own copy; EOF reaches the relay when it exits
            session = await stack.enter_async_context(ClientSession(
                read, write, client_info=Implementation(name="operate-sidecar", version="0.1.0")))
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
            self._stack = None
            with anyio.CancelScope(shield=True):
                try:
                    await stack.aclose()
                except Exception:  # the original failure is the one worth reporting
                    log.debug("MCP server %r: error while cleaning up a failed start", self.name, exc_info=True)
            raise ToolSourceError(self._start_failure(e)) from e
        except BaseException:
            self._stack = None
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._session = session
        self._remote = remote
        log.info("MCP server %r started with %d tools", self.name, len(remote))

    async def aclose(self) -> None:
        """Stop the server (close its stdin, then terminate it if it lingers)."""
        stack, self._stack = self._stack, None
        self._session = None
        if stack is not None:
            import anyio

            with anyio.CancelScope(shield=True):
                await stack.aclose()

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
                if len(pending) > 65536:
                    self._emit_stderr(pending)
                    pending = b""
        except OSError:
            pass
        finally:
            if pending:
                self._emit_stderr(pending)
            os.close(fd)
            done.set()

    def _emit_stderr(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
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

    failures: dict[str, ToolSourceError] = {}
    body_error: Exception | None = None
    stop = anyio.Event()

    async def run(source: McpToolSource, ready: Any) -> None:
        try:
            await source.start()
        except ToolSourceError as e:
            failures[source.name] = e
            tg.cancel_scope.cancel()  # stop the other starts now rather than wait them out
            return
        finally:
            ready.set()
        try:
            await stop.wait()
        finally:
            await source.aclose()

    async with anyio.create_task_group() as tg:
        readiness = []
        for source in sources:
            ready = anyio.Event()
            readiness.append(ready)
            tg.start_soon(run, source, ready, name=f"mcp server {source.name}")
        for ready in readiness:  # each start is bounded by its own start_timeout
            await ready.wait()
        if not failures:
            try:
                tools = _named_tools(sources, reserved)
                yield tools
            except Exception as e:  # re-raised below, outside the task group
                body_error = e
            finally:
                stop.set()
    if failures:
        raise next(failures[s.name] for s in sources if s.name in failures)
    if body_error is not None:
        raise body_error


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
