"""The ``scripted`` provider: deterministic replay (docs/PROTOCOL.md §2).

Each invocation (chat, parse repair, CLI run) consumes the next entry of the
config's ``responses``. An entry is a string (the text) or an object with
``text``, ``json`` (serialized as the text), ``delayMs`` (a cancellable wait
before answering), ``chunks`` (stream the text in that many deltas) and
``error`` (the invocation fails, after streaming its ``thinking`` and text if
it has any: a model that failed mid-reply, as ``--record`` writes one) and
``refusal`` (the model declined, as OpenAI's ``refusal`` or a ``content_filter``
stop: the invocation fails as that refusal, the text its ``data.refusal`` and
ACP's ``refusal`` stop reason; its message is ``error`` when given). An
exhausted list fails with a model error.
``"cli": true`` makes the model CLI-backed. Its entries may hold ``events``
instead of ``text``: a CLI run's text, ``tool_use`` and ``tool_result`` events,
in order, as the ``jsonl`` profile writes them (what ``--record`` writes for a
run that made its own tool calls), streamed as that profile streams them (an
``error`` then fails the invocation after them, as the run failed after them).
It is a product feature: other runtimes test their integration against it.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, AsyncIterator

import anyio

from operate_sidecar.server.core.errors import ModelError, ModelRefused
from operate_sidecar.server.core.imodel import BaseModelProvider, ModelRequest, StreamChunk

from .config import ModelConfigError, check_model_config, entry_problem

REQUEST_LOG_LIMIT = 100
def _failure(entry: dict, name: str) -> ModelError | None:
    """The model error an entry ends with (its ``refusal`` or its ``error``), or None."""
    if entry.get("refusal") is not None:
        refusal = str(entry["refusal"])
        message = entry.get("error")
        return ModelRefused(str(message) if message is not None else f"model {name!r} declined the request: {refusal}",
                            refusal=refusal)
    if entry.get("error") is not None:
        return ModelError(str(entry["error"]))
    return None


def _check_entry(i: int, entry: Any, name: str = "scripted") -> Any:
    problem = entry_problem(entry, f"responses[{i}]")
    if problem:
        raise ModelConfigError(f"scripted model {name!r}: {problem}")
    return entry


class ScriptedModel(BaseModelProvider):
    def __init__(self, name: str, responses: list[Any], *, cli: bool = False,
                 timeout_s: float | None = None) -> None:
        self.name = name
        self.is_cli = cli
        self.timeout_s = timeout_s
        self._queue: deque[Any] = deque(_check_entry(i, e, name) for i, e in enumerate(responses))
        self.requests: deque[ModelRequest] = deque(maxlen=REQUEST_LOG_LIMIT)
        self.calls = 0

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "ScriptedModel":
        check_model_config(config, f"model config {name!r}", "scripted")
        return cls(name, config.get("responses") or [], cli=bool(config.get("cli")), timeout_s=config.get("timeoutS"))

    @property
    def remaining(self) -> int:
        return len(self._queue)

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:  # type: ignore[override]
        self.calls += 1
        self.requests.append(request)
        if not self._queue:
            raise ModelError(f"scripted model {self.name!r} has no responses left")
        entry = self._queue.popleft()
        if isinstance(entry, str):
            text, delay, chunks = entry, 0.0, 1
        else:
            delay = float(entry.get("delayMs", 0)) / 1000.0
            chunks = int(entry.get("chunks", 1))
            if "json" in entry:
                text = json.dumps(entry["json"], ensure_ascii=False)
            else:
                text = str(entry.get("text", ""))
        if delay:
            await anyio.sleep(delay)
        events = None if isinstance(entry, str) else entry.get("events")
        failure = None if isinstance(entry, str) else _failure(entry, self.name)
        thinking = None if isinstance(entry, str) else entry.get("thinking")
        if thinking:  # a reasoning model's thoughts, before its reply
            yield StreamChunk(type="thinking", text=thinking)
        if events is not None:  # a CLI run's events as the jsonl profile reads them, then its end (or its failure)
            from .cli import JsonlParser

            parser = JsonlParser()
            for event in events:
                for chunk in parser.event(event):
                    yield chunk
            if failure is not None:
                raise failure
            yield StreamChunk(type="result", model=self.name, usage={"prompt_tokens": 0, "completion_tokens": 0})
            return
        if chunks <= 1 or len(text) <= 1:
            if text:
                yield StreamChunk(type="text", text=text)
        else:
            n = min(chunks, len(text))
            size, extra = divmod(len(text), n)
            pos = 0
            for i in range(n):
                step = size + (1 if i < extra else 0)
                yield StreamChunk(type="text", text=text[pos: pos + step])
                pos += step
        if failure is not None:  # after what it streamed, as a reply cut short (a stream lost, an error event)
            raise failure
        yield StreamChunk(type="result", model=self.name, usage={"prompt_tokens": 0, "completion_tokens": 0})

