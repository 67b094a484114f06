"""The iModel protocol: what the pipeline needs from a model provider.

Providers live in ``server/models``; core only sees this narrow interface.
A provider streams :class:`StreamChunk` values; ``invoke`` collects them.
Failures are raised as :class:`server.core.errors.ModelError` with a message
that is safe to show (secrets redacted). Cancellation is anyio cancellation:
providers must stop their work (kill a subprocess, abort a request) when the
surrounding scope is cancelled.
"""

from __future__ import annotations

from contextlib import aclosing, asynccontextmanager, contextmanager
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
class iModel(Protocol):  # noqa: N801 - the ADR's name
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


@asynccontextmanager
async def open_stream(model: Any, request: ModelRequest) -> AsyncIterator[AsyncIterator[StreamChunk]]:
    """``model.stream(request)`` under the model's deadline (:func:`model_deadline`),
    closed on exit however the caller leaves it."""
    with model_deadline(model):
        async with aclosing(model.stream(request)) as stream:
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
