"""Tools and the tool registry.

A :class:`Tool` has a name, a description, a JSON Schema for its arguments,
an async callable and a source (``builtin``, ``python``, ``mcp``, ``client``).
Python callables become tools whose input schema pydantic derives from the
signature, so ``int`` is ``integer`` and ``int | None`` works. Arguments are
validated before invocation against the tool's input schema (jsonschema, for every
source alike but the builtin tools, checked by their own models; a Python tool's are then
converted to the annotated types by pydantic); a mismatch raises :class:`ToolArgumentError`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Awaitable, Callable, Literal

from .errors import ToolArgumentError, ToolNotRegistered, exception_text

log = logging.getLogger(__name__)

ToolSource = Literal["builtin", "python", "mcp", "client"]


@dataclass(slots=True, frozen=True)
class ToolCallContext:
    branch_id: str
    call_id: str
    #: what the call has asked for that cannot be taken back and is not answered yet (a write
    #: sent to the client), in words: a call that times out meanwhile says it in its error
    pending: list[str] = field(default_factory=list, compare=False, repr=False)


ToolFunc = Callable[[dict[str, Any], ToolCallContext], Awaitable[Any]]


@dataclass(slots=True, eq=False)
class Tool:
    name: str
    description: str
    input_schema: dict[str, Any]
    func: ToolFunc
    source: ToolSource = "python"
    read_only: bool = False
    timeout: float | None = None
    _validator: Callable[[dict[str, Any]], dict[str, Any]] | None = field(default=None, repr=False)
    _openai_schema: dict[str, Any] | None = field(default=None, repr=False)

    def validate_arguments(self, arguments: Any) -> dict[str, Any]:
        """Return the validated arguments or raise ToolArgumentError."""
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments for {self.name} must be an object, got {type(arguments).__name__}")
        if self._validator is None:
            self._validator = _jsonschema_validator(self.input_schema)
        return self._validator(arguments)

    async def call(self, arguments: dict[str, Any], ctx: ToolCallContext) -> Any:
        return await self.func(arguments, ctx)

    def schema(self) -> dict[str, Any]:
        """OpenAI function-format schema shown to the model (cached)."""
        if self._openai_schema is None:
            self._openai_schema = {
                "type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.input_schema},
            }
        return self._openai_schema

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "inputSchema": self.input_schema,
                "source": self.source}

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                      source: ToolSource = "python", read_only: bool | None = None,
                      timeout: float | None = None) -> "Tool":
        return function_to_tool(fn, name=name, description=description, source=source, read_only=read_only,
                                timeout=timeout)


def tool(fn: Callable[..., Any] | None = None, *, read_only: bool = False, timeout: float | None = None,
         name: str | None = None):  # type: ignore[no-untyped-def]
    """Decorator marking a Python function's tool metadata (read-only, time-out, name)."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__tool_read_only__ = read_only  # type: ignore[attr-defined]
        f.__tool_timeout__ = timeout  # type: ignore[attr-defined]
        if name:
            f.__tool_name__ = name  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s+(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    summary_lines: list[str] = []
    params: dict[str, str] = {}
    in_args = False
    current: str | None = None
    for line in doc.splitlines():
        if _ARGS_HEADER.match(line):
            in_args = True
            continue
        if in_args:
            m = _ARG_LINE.match(line)
            if m:
                current = m.group(1).lstrip("*")
                params[current] = m.group(3).strip()
                continue
            if line.strip() and line.startswith((" ", "\t")) and current:
                params[current] += " " + line.strip()
                continue
            if not line.strip():
                continue
            in_args = False
            current = None
        if not params and not in_args:
            summary_lines.append(line)
    summary = " ".join(s.strip() for s in "\n".join(summary_lines).split("\n\n")[0].splitlines()).strip()
    return summary, params


#: (the function, the tool's name) → (its docstring's summary, its arguments model, that model's
#: JSON text): a function's signature is read once per process, however many tools are made from
#: it (each workspace's builtin tools are the same bound methods of another instance)
_ARGUMENT_MODELS: dict[tuple[Any, str], tuple[str, Any, str]] = {}


def _arguments_model(fn: Callable[..., Any], tool_name: str) -> tuple[str, Any, dict[str, Any]]:
    """(summary, arguments model, a fresh copy of its JSON Schema) for a function's tool."""
    import json

    key = (getattr(fn, "__func__", fn), tool_name)
    hit = _ARGUMENT_MODELS.get(key)
    if hit is None:
        from pydantic import ConfigDict, Field, create_model

        sig = inspect.signature(fn)
        summary, param_docs = _doc_parts(fn)
        hints = _type_hints(fn)
        fields: dict[str, Any] = {}
        for pname, p in sig.parameters.items():
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                continue
            ann = hints.get(pname, p.annotation)
            if ann is inspect.Parameter.empty:
                ann = Any
            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[pname] = (ann, Field(default, description=param_docs.get(pname) or None))
        model = create_model(f"{tool_name}_args", __config__=ConfigDict(extra="forbid"), **fields)
        schema = model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        schema.setdefault("properties", {})
        if len(_ARGUMENT_MODELS) >= 1024:  # bounded (functions made on the fly are new keys)
            _ARGUMENT_MODELS.clear()
        hit = _ARGUMENT_MODELS[key] = (summary, model, json.dumps(schema))
    return hit[0], hit[1], json.loads(hit[2])


def function_to_tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                     source: ToolSource = "python", read_only: bool | None = None,
                     timeout: float | None = None) -> Tool:
    from pydantic import ValidationError

    tool_name = name or getattr(fn, "__tool_name__", None) or fn.__name__
    summary, model, schema = _arguments_model(fn, tool_name)

    checks: list[Callable[[dict[str, Any]], dict[str, Any]]] = []  # the schema's check, made on first need

    def validate(arguments: dict[str, Any]) -> dict[str, Any]:
        # what the tool advertises is what it takes: the arguments are checked against its
        # inputSchema as an MCP or client tool's are (pydantic's lax mode alone took "3" for an
        # integer, "no" for a boolean); pydantic then converts them to the annotated types. The
        # builtin tools, whose models are written for the wire, are checked by their models alone:
        # jsonschema (40 ms to import) stays out of a start that only warms them
        if source != "builtin":
            if not checks:
                checks.append(_jsonschema_validator(schema))
            checks[0](arguments)
        try:
            inst = model.model_validate(arguments)
        except ValidationError as e:
            raise ToolArgumentError(_short_validation_error(tool_name, e)) from None
        return {k: getattr(inst, k) for k in inst.model_fields_set | _required(model)}

    is_async = inspect.iscoroutinefunction(fn)

    async def call(arguments: dict[str, Any], ctx: ToolCallContext) -> Any:
        if is_async:
            try:
                return await fn(**arguments)
            except (SystemExit, KeyboardInterrupt, GeneratorExit) as e:  # the tool's failure, not ours
                raise ToolProcessExit(e) from None
        return await run_sync_tool(fn, arguments)

    ro = read_only if read_only is not None else bool(getattr(fn, "__tool_read_only__", False))
    to = timeout if timeout is not None else getattr(fn, "__tool_timeout__", None)
    return Tool(name=tool_name, description=description or summary or tool_name, input_schema=schema,
                func=call, source=source, read_only=ro, timeout=to, _validator=validate)


#: how many sync tools run at once on the default pool (see ``run_sync_tool``); the service
#: bounds its own pool the same way (``service.TOOL_THREADS``)
TOOL_THREADS = 16
#: how many pools whose every worker is held by a tool past its time-out are kept at once
#: (``ToolThreads``): with the default size, at most 48 threads stuck in tools that never return
MAX_RETIRED_POOLS = 3

#: The executor sync Python tools run on, set by whoever runs operates: the service sets its
#: own ``ToolThreads``, created on first need and shut down by its ``aclose``. ``None`` (the
#: core used as a library, tests, the benchmark): a default ``ToolThreads`` of ``TOOL_THREADS``
#: threads shared by the process, made on first need (its idle threads end at interpreter exit).
#: Pool threads are not daemons: at a normal interpreter exit ``concurrent.futures`` waits for a
#: tool still running (the server leaves with ``os._exit``, so a hung tool never holds it).
tool_executor: ContextVar[Executor | None] = ContextVar("tool_executor", default=None)

_DEFAULT_POOL: Executor | None = None
_DEFAULT_LOCK = threading.Lock()


class ToolThreads(Executor):
    """The bounded pool sync tools run on: at most ``size`` tools at once, on a stdlib
    ``ThreadPoolExecutor`` of ``size`` threads, and a way past what a thread pool cannot
    survive on its own. Python cannot stop a thread, so a call abandoned while its tool runs
    (its time-out, a cancel) holds its worker until the tool returns (``run_sync_tool`` reports
    it with ``hold``). When every worker of the pool is held that way, the pool is retired
    (shut down without waiting: its threads end as their tools return, and a call still queued
    on it fails on its own time-out) and a fresh pool takes the next calls, so a few tools that
    never return do not starve every other sync tool. At most ``max_retired`` retired pools are
    kept at once (a pool is dropped when its held tools have all returned); past that, calls
    queue on the held pool as on any bounded pool and fail on their own time-out, which is
    logged."""

    def __init__(self, size: int, *, max_retired: int | None = None, thread_name_prefix: str = "tool-worker") -> None:
        self.size = size
        self.max_retired = MAX_RETIRED_POOLS if max_retired is None else max_retired
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        self._held: dict[Any, int] = {}  # pool → its calls abandoned while their tools run
        self._retired: set[Any] = set()
        self._closed = False
        self._warned = False

    def _new_pool(self) -> Any:
        from concurrent.futures import ThreadPoolExecutor

        return ThreadPoolExecutor(self.size, thread_name_prefix=self._prefix)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            pool = self._pool
        job = pool.submit(fn, *args, **kwargs)  # RuntimeError once shut down
        job.tool_pool = pool  # type: ignore[attr-defined]
        return job

    def hold(self, job: Any) -> None:
        """``job``'s caller gave up while its tool runs: its worker is held until it returns."""
        pool = getattr(job, "tool_pool", None)
        if pool is None:
            return
        retire = False
        with self._lock:
            self._held[pool] = held = self._held.get(pool, 0) + 1
            if pool is self._pool and held >= self.size and not self._closed:
                if len(self._retired) < self.max_retired:
                    retire = True
                    self._retired.add(pool)
                    self._pool = self._new_pool()
                elif not self._warned:
                    self._warned = True
                    log.warning("every sync tool thread is held by a tool past its time-out, and %d pools are "
                                "already held that way: sync tool calls wait, and fail on their own time-out",
                                len(self._retired))
        if retire:
            pool.shutdown(wait=False)
            log.warning("all %d sync tool threads are held by tools past their time-out: a fresh pool takes "
                        "the next calls (the held threads end when their tools return)", self.size)
        job.add_done_callback(partial(self._released, pool))

    def _released(self, pool: Any, _job: Any) -> None:
        with self._lock:
            left = self._held.get(pool, 0) - 1
            if left > 0:
                self._held[pool] = left
                return
            self._held.pop(pool, None)
            self._retired.discard(pool)  # shut down: its threads end once idle
            self._warned = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            pools = [self._pool, *self._retired]
        for pool in pools:
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def _default_pool() -> Executor:
    global _DEFAULT_POOL
    pool = _DEFAULT_POOL
    if pool is None:
        with _DEFAULT_LOCK:
            if _DEFAULT_POOL is None:
                _DEFAULT_POOL = ToolThreads(TOOL_THREADS)
            pool = _DEFAULT_POOL
    return pool


class ToolProcessExit(RuntimeError):
    """A tool raised ``SystemExit``, ``KeyboardInterrupt`` or another ``BaseException`` that
    is not an ``Exception`` (an argparse-based tool exits on bad input): it is that call's
    failure, never the process's. The message names what was raised."""

    def __init__(self, exc: BaseException) -> None:
        text = exception_text(exc)
        super().__init__(f"tool raised {type(exc).__name__}" + (f": {text}" if text else ""))


class ToolThreadsClosed(RuntimeError):
    """A sync tool was not run: its thread pool is shut down (the service is closing). Raised
    for a call made after the shutdown, and for a call still queued when it happened."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__(f"tool {getattr(fn, '__name__', 'tool')} not run: the tool threads are shut down")


def _settle(fut: Any, res: Any, exc: BaseException | None) -> None:
    if fut.done():  # abandoned (cancelled) meanwhile
        return
    if exc is None:
        fut.set_result(res)
    else:
        if isinstance(exc, StopIteration):  # a future cannot carry it
            exc = RuntimeError(f"tool raised StopIteration: {exc}")
        elif not isinstance(exc, Exception):  # awaited, SystemExit would stop the event loop
            exc = ToolProcessExit(exc)
        fut.set_exception(exc)


def _run_job(loop: Any, fut: Any, ctx: Any, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """On a pool thread: run the tool in the caller's context, hand the outcome to the loop."""
    if fut.done():  # the caller gave up before a worker took the job
        return
    res = exc = None
    try:
        res = ctx.run(fn, **kwargs)
    except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
        exc = e
    try:
        loop.call_soon_threadsafe(_settle, fut, res, exc)
    except RuntimeError:  # the loop is closed: nobody is waiting
        pass


def _on_job_done(loop: Any, fut: Any, fn: Callable[..., Any], job: Any) -> None:
    """A job cancelled by the pool's shutdown (``cancel_futures``) never ran: its caller is
    answered ``ToolThreadsClosed`` rather than left waiting. (A job the caller cancelled, or
    one that ran, has nothing to do here: ``fut`` is done or is being settled.)"""
    if job.cancelled() and not fut.done():
        try:
            loop.call_soon_threadsafe(_settle, fut, None, ToolThreadsClosed(fn))
        except RuntimeError:
            pass


async def run_sync_tool(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """Run a sync tool on a pool thread (``tool_executor``, else the default pool), in a copy
    of the caller's context (as anyio does). The pool is a ``ToolThreads`` (the stdlib
    ``ThreadPoolExecutor`` underneath), or any ``Executor`` passed in: one ``submit`` and one
    ``call_soon_threadsafe`` back per call (measured faster than ``anyio.to_thread.run_sync``
    with a ``CapacityLimiter``, whose limiter also lets an abandoned thread's slot go, so it
    would not bound threads). On cancel or time-out the call is abandoned: the awaiting task
    is answered at once, the thread finishes on its own and its result is dropped (the pool is
    told its worker is held: ``ToolThreads.hold``); a call cancelled before a worker took it
    never runs.
    Exceptions reach the caller; ``SystemExit`` and other ``BaseException``s as
    ``ToolProcessExit``."""
    import asyncio
    import contextvars

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio through anyio)
        import anyio.to_thread

        return await anyio.to_thread.run_sync(lambda: fn(**arguments), abandon_on_cancel=True)
    pool = tool_executor.get() or _default_pool()
    fut = loop.create_future()
    try:
        job = pool.submit(_run_job, loop, fut, contextvars.copy_context(), fn, arguments)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        raise ToolThreadsClosed(fn) from None
    job.add_done_callback(partial(_on_job_done, loop, fut, fn))
    try:
        return await fut
    finally:
        if not fut.done() or fut.cancelled():  # the caller gave up (cancel, time-out)
            fut.cancel()  # abandoned: a late result is dropped
            # a job still queued never runs; one running holds its worker until its tool returns
            if not job.cancel() and not job.done() and hasattr(pool, "hold"):
                pool.hold(job)


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(fn)
    except Exception:
        return {}


def _required(model: Any) -> set[str]:
    return {k for k, f in model.model_fields.items() if f.is_required()}


def _short_validation_error(name: str, e: Any) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "(arguments)"
        parts.append(f"{loc}: {err.get('msg')}")
    return f"invalid arguments for {name}: " + "; ".join(parts)


class _LinearRegex:
    """What jsonschema calls as ``re`` (``re.search`` only: ``pattern``, ``patternProperties``,
    ``additionalProperties``), on RE2: a tool's schema comes from an MCP server or the client,
    its arguments from the model, and Python's backtracking engine holds the GIL for hours on a
    pattern like ``(a+)+$`` (no ping, no cancel). A pattern RE2 cannot run (a lookaround, a
    backreference) counts as a match: such a ``pattern`` is left for the tool to check, and such a
    ``patternProperties`` pattern applies its schema to every property."""

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def _compiled(pattern: str) -> Any:
        import re2  # google-re2

        opts = re2.Options()
        opts.log_errors = False
        try:
            return re2.compile(pattern, options=opts)
        except Exception:  # re2.error: not RE2 syntax
            return None

    @classmethod
    def search(cls, pattern: str, string: str) -> Any:
        compiled = cls._compiled(pattern)
        return True if compiled is None else compiled.search(string)


def _linear_jsonschema() -> Any:
    import jsonschema
    from jsonschema import _keywords, _legacy_keywords, _utils

    for module in (_keywords, _legacy_keywords, _utils):  # (each calls re.search, nothing else of re)
        module.re = _LinearRegex  # type: ignore[attr-defined]
    return jsonschema


def linear_validator(schema: dict[str, Any]) -> Any:
    """A jsonschema validator of ``schema`` (its ``$schema``'s draft, else 2020-12) whose patterns
    run on RE2 (:class:`_LinearRegex`): for values a model wrote, a tool's arguments or a reply."""
    jsonschema = _linear_jsonschema()
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


async def off_the_loop(large: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: on a worker thread when the input is ``large`` (parsing, editing or diffing
    megabytes held the event loop, ``ping`` and cancel included), else at once (the common case
    pays no thread hop). A cancel abandons the thread's work."""
    if not large:
        return fn(*args)
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


def _jsonschema_validator(schema: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    import jsonschema
    from referencing.exceptions import Unresolvable

    validator = linear_validator(schema)

    def validate(arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            errors = sorted(validator.iter_errors(arguments), key=lambda er: list(er.path))
        except (jsonschema.exceptions.UnknownType, Unresolvable) as e:  # the schema, not the arguments
            what = f"unknown type {e.type!r}" if isinstance(e, jsonschema.exceptions.UnknownType) \
                else f"unresolvable $ref: {(exception_text(e).splitlines() or [''])[0][:200]}"
            raise ToolArgumentError(f"the tool's input schema cannot check arguments ({what})") from None
        if errors:
            msgs = [f"{'.'.join(str(p) for p in er.path) or '(arguments)'}: {er.message}" for er in errors[:5]]
            raise ToolArgumentError("invalid arguments: " + "; ".join(msgs))
        return arguments

    return validate


class ToolRegistry:
    """Name → Tool. Registration of a taken name fails unless ``update``."""

    __slots__ = ("_tools",)

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._tools.values())

    def register(self, item: Tool | Callable[..., Any], *, update: bool = False) -> Tool:
        t = item if isinstance(item, Tool) else Tool.from_function(item)
        if t.name in self._tools and not update:
            raise ValueError(f"Tool {t.name} is already registered.")
        self._tools[t.name] = t
        return t

    def unregister(self, name: str) -> None:
        self._tools.pop(name, None)

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise ToolNotRegistered(name) from None

    def names(self) -> list[str]:
        return list(self._tools)

    def resolve(self, selector: Any) -> list[Tool]:
        """Tools named by a selector: True/None = all; a name, Tool, callable or a list of them."""
        if selector is None or selector is True:
            return list(self._tools.values())
        items = selector if isinstance(selector, (list, tuple, set)) else [selector]
        out: list[Tool] = []
        for it in items:
            if isinstance(it, Tool):
                out.append(self._tools.get(it.name) or self.register(it))
            elif isinstance(it, str):
                out.append(self.get(it))
            elif callable(it):
                nm = getattr(it, "__tool_name__", None) or getattr(it, "__name__", None)
                out.append(self._tools[nm] if nm in self._tools else self.register(it))
            else:
                raise ValueError(f"cannot select a tool by {type(it).__name__}")
        return out

    def get_tool_schema(self, tools: Any = True) -> dict[str, Any]:
        """Step D2 (docs/PIPELINE.md): the schemas of the selected tools wrapped as ``{"tools": [...]}``."""
        return {"tools": [t.schema() for t in self.resolve(tools)]}
