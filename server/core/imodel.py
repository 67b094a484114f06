"""The iModel protocol: what the pipeline needs from a model provider.

Providers live in ``server/models``; core only sees this narrow interface.
A provider streams :class:`StreamChunk` values; ``invoke`` collects them.
Failures are raised as :class:`server.core.errors.ModelError` with a message
that is safe to show (secrets redacted). Cancellation is anyio cancellation:
providers must stop their work (kill a subprocess, abort a request) when the
surrounding scope is cancelled.
"""

from __future__ import annotations

import math
from contextlib import aclosing, asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Literal, Protocol, runtime_checkable

ChunkType = Literal["text", "thinking", "tool_use", "tool_result", "result", "error"]


@dataclass(slots=True)
class ModelRequest:
    """One model invocation.

    ``messages`` are OpenAI-style chat messages (``role`` is ``system``,
    ``user`` or ``assistant``; ``content`` is a string). ``response_schema``
    is the JSON Schema of the *request* model when a structured reply is
    wanted; providers with native structured output (JSON-Schema response
    formats, llama.cpp grammars) use it. ``purpose`` says why the model is
    called: ``chat`` (communicate), ``parse`` (a repair turn) or ``run``
    (run_and_collect on a CLI-backed model).
    """

    messages: list[dict[str, str]]
    response_schema: dict | None = None
    schema_name: str | None = None
    tool_schemas: list[dict] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    purpose: Literal["chat", "parse", "run"] = "chat"


@dataclass(slots=True)
class StreamChunk:
    """One event of a model stream.

    ``text``/``thinking``: ``text`` holds the delta. ``tool_use``: a tool the
    model (CLI agent) ran itself: ``id``, ``name``, ``input``.
    ``tool_result``: ``id`` of the tool_use it answers, ``output``,
    ``is_error``. ``result``: end of stream with ``usage``/``model``/
    ``session_id``. ``error``: a failure reported in-stream (``text`` is the
    message); consumers raise ModelError for it.
    """

    type: ChunkType
    text: str = ""
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    output: Any = None
    is_error: bool = False
    usage: dict | None = None
    model: str | None = None
    session_id: str | None = None


@dataclass(slots=True)
class ModelResponse:
    text: str
    model: str
    usage: dict | None = None


@runtime_checkable
class iModel(Protocol):  # noqa: N801 - the pipeline's name
    """A model provider. ``name`` is the configured name; ``is_cli`` marks
    CLI-backed models, for which operate selects ``run_and_collect``."""

    name: str
    is_cli: bool

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]: ...

    async def invoke(self, request: ModelRequest) -> ModelResponse: ...

    async def aclose(self) -> None: ...


@contextmanager
def model_deadline(model: Any) -> Iterator[None]:
    """Apply the model's ``timeout_s`` (per-model time-out) to the enclosed call;
    running out is a ModelError naming the model."""
    timeout = getattr(model, "timeout_s", None)
    if not timeout:
        yield
        return
    import anyio

    from .errors import ModelError

    try:
        with anyio.fail_after(timeout):
            yield
    except TimeoutError:
        raise ModelError(f"model {getattr(model, 'name', '?')!r} timed out after {timeout:g} s") from None


# -- usage ---------------------------------------------------------------------------------
# Every model call of the pipeline (communicate, run_and_collect and parse repair) opens its
# stream with ``open_stream``; when a caller installed a ``UsageMeter`` in ``current_usage``,
# each call is counted there, with the token counts its provider reported in its ``result``
# chunk. The pipeline itself never reads the meter: it is how a caller learns what it cost.

_INPUT_KEYS = ("prompt_tokens", "input_tokens", "inputTokens", "promptTokens")
_OUTPUT_KEYS = ("completion_tokens", "output_tokens", "outputTokens", "completionTokens")
_CACHE_INPUT_KEYS = ("cache_read_input_tokens", "cache_creation_input_tokens")  # Anthropic: not in input_tokens


def usage_counts(usage: Any) -> tuple[int | None, int | None]:
    """(input, output) tokens of a provider's usage record (OpenAI ``prompt_tokens`` /
    ``completion_tokens``, Anthropic/CLI ``input_tokens`` / ``output_tokens``, the latter plus
    cache reads and writes); None where it says nothing."""
    if not isinstance(usage, dict):
        return None, None

    def count(v: Any) -> int | None:
        """A token count: a finite non-negative number (NaN, Infinity, -1 are unknown: None)."""
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return v if v >= 0 else None
        if isinstance(v, float) and math.isfinite(v) and v >= 0:
            return int(v)
        return None

    def first(keys: tuple[str, ...]) -> int | None:
        for k in keys:
            v = count(usage.get(k))
            if v is not None:
                return v
        return None

    inp, out = first(_INPUT_KEYS), first(_OUTPUT_KEYS)
    if inp is not None and "input_tokens" in usage:
        inp += sum(count(usage.get(k)) or 0 for k in _CACHE_INPUT_KEYS)
    return inp, out


@dataclass(slots=True)
class UsageMeter:
    """Token totals over model calls: ``input_tokens``/``output_tokens`` summed over every call
    that reported (None: a call reported its end without that count, so the sum is unknown);
    ``context_tokens``: the input size of the last chat/run call; ``model_calls``: calls opened.
    A call that fails before its provider reports counts as a call and adds no tokens."""

    input_tokens: int | None = 0
    output_tokens: int | None = 0
    context_tokens: int | None = None
    model_calls: int = 0

    def opened(self) -> None:
        self.model_calls += 1

    def record(self, purpose: str, usage: Any) -> None:
        inp, out = usage_counts(usage)
        self.input_tokens = None if inp is None or self.input_tokens is None else self.input_tokens + inp
        self.output_tokens = None if out is None or self.output_tokens is None else self.output_tokens + out
        if purpose != "parse":
            self.context_tokens = inp

    def add(self, other: "UsageMeter") -> None:
        """Fold ``other`` (a later operate or round) into this one."""
        self.model_calls += other.model_calls
        self.input_tokens = None if None in (self.input_tokens, other.input_tokens) else \
            self.input_tokens + other.input_tokens  # type: ignore[operator]
        self.output_tokens = None if None in (self.output_tokens, other.output_tokens) else \
            self.output_tokens + other.output_tokens  # type: ignore[operator]
        if other.model_calls:
            self.context_tokens = other.context_tokens

    def to_wire(self) -> dict[str, Any]:
        return {"inputTokens": self.input_tokens, "outputTokens": self.output_tokens,
                "contextTokens": self.context_tokens, "modelCalls": self.model_calls}


current_usage: ContextVar[UsageMeter | None] = ContextVar("current_usage", default=None)


async def _metered(stream: AsyncIterator[StreamChunk], meter: UsageMeter, purpose: str) -> AsyncIterator[StreamChunk]:
    async with aclosing(stream):
        async for chunk in stream:
            if chunk.type == "result":
                meter.record(purpose, chunk.usage)
            yield chunk


@asynccontextmanager
async def open_stream(model: Any, request: ModelRequest) -> AsyncIterator[AsyncIterator[StreamChunk]]:
    """``model.stream(request)`` under the model's deadline (:func:`model_deadline`),
    closed on exit however the caller leaves it; counted in ``current_usage`` when set."""
    meter = current_usage.get()
    with model_deadline(model):
        if meter is None:
            async with aclosing(model.stream(request)) as stream:
                yield stream
            return
        meter.opened()
        async with aclosing(_metered(model.stream(request), meter, request.purpose)) as stream:
            yield stream


async def collect(model: iModel, request: ModelRequest) -> ModelResponse:
    """Default ``invoke``: drain ``stream`` into one response."""
    from .errors import ModelError

    parts: list[str] = []
    usage = None
    name = model.name
    async with open_stream(model, request) as stream:
        async for chunk in stream:
            if chunk.type == "text":
                parts.append(chunk.text)
            elif chunk.type == "result":
                usage = chunk.usage or usage
                name = chunk.model or name
            elif chunk.type == "error":
                raise ModelError(chunk.text or "model reported an error")
    return ModelResponse(text="".join(parts), model=name, usage=usage)


class BaseModelProvider:
    """Convenience base: subclasses implement ``stream``; ``invoke`` collects."""

    name: str = "model"
    is_cli: bool = False

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:  # pragma: no cover - abstract
        raise NotImplementedError

    async def invoke(self, request: ModelRequest) -> ModelResponse:
        return await collect(self, request)

    async def aclose(self) -> None:
        return None
