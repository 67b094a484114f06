"""The Middle protocol and the two shipped adapters.

``communicate`` (API models): one model call, the instruction and reply are
recorded together after the call succeeds, then the reply is parsed.
``run_and_collect`` (CLI-backed models, or RunParam): the instruction is
recorded first, the model's stream is read as it runs, CLI-reported tool use
is recorded as action messages (never re-executed), ``stream_persist``
buffers chunks to ``persist_dir`` and snapshots the branch atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Protocol

import anyio

from . import progress
from .errors import ConfigurationError, ModelError
from .imodel import StreamChunk, open_stream
from .act import bound_output, bound_text
from .messages import Message, MessageLog, new_id
from .params import ChatParam, ParseParam, RunParam
from .parse import parse
from .render import instruction_content, render_request
from ..redaction import StreamRedactor, redact_value


class Middle(Protocol):
    async def __call__(self, branch: Any, instruction: Any, chat_param: ChatParam, parse_param: ParseParam | None,
                       clear_messages: bool = False, *, skip_validation: bool = False) -> Any: ...


def _instruction_message(branch: Any, instruction: Any, chat_param: ChatParam) -> Message:
    if isinstance(instruction, Message):
        return instruction
    content = instruction_content(instruction, chat_param.guidance, chat_param.context, chat_param.response_format,
                                  chat_param.tool_schemas)
    return Message(kind="instruction", content=content, sender=chat_param.sender, recipient=chat_param.recipient)


def _model_of(branch: Any, chat_param: ChatParam) -> Any:
    model = chat_param.imodel or branch.chat_model
    if model is None:
        raise ModelError("no chat model is configured for this branch")
    return model


class _Cleared:
    """What ``render_request`` reads of a branch (its messages), as they will be once
    ``clear_messages`` has emptied it: the system message only."""

    __slots__ = ("messages", "_render_state")

    def __init__(self, branch: Any) -> None:
        self.messages = MessageLog([m for m in branch.messages if m.kind == "system"][:1])
        self._render_state = None


def _take_text(chunk: StreamChunk, out: list[str], sink: Any) -> None:
    """A ``text`` chunk: collected into ``out`` and streamed to the progress sink."""
    if chunk.text:
        out.append(chunk.text)
        if sink is not None:
            sink.report("streaming", "stream", chunk.text)


def _take_thought(chunk: StreamChunk, sink: Any) -> None:
    """A ``thinking`` chunk (a reasoning model's thoughts, before or between its text): not part
    of the reply, never recorded; passed to a sink that shows thoughts (``think``), if any."""
    think = getattr(sink, "think", None)
    if chunk.text and think is not None:
        think(chunk.text)


def _end_text(sink: Any) -> None:
    """The model's text has ended, or pauses for a tool use: a sink that holds back the end of
    the streamed text (the wire's, which waits to see whether it begins a secret) sends it now."""
    end = getattr(sink, "end_text", None)
    if end is not None:
        end()


async def _parse_reply(branch: Any, text: Any, chat_param: ChatParam, parse_param: ParseParam | None) -> Any:
    if parse_param is not None and parse_param.response_format is not None and chat_param.response_format is not None:
        return await parse(branch, text, parse_param)
    return text


async def communicate(branch: Any, instruction: Any, chat_param: ChatParam, parse_param: ParseParam | None,
                      clear_messages: bool = False, *, skip_validation: bool = False) -> Any:
    sink = progress.current_progress.get()
    if sink is not None:
        sink.begin("communicate")
    model = _model_of(branch, chat_param)
    ins = _instruction_message(branch, instruction, chat_param)
    # clear_messages: the request is rendered from the branch as it will be once cleared, and
    # the branch is cleared only with the reply recorded (a failed model call clears nothing)
    request = render_request(_Cleared(branch) if clear_messages else branch, ins, chat_param.response_format,
                             chat_param.tool_schemas, chat_param.imodel_kw)
    if sink is not None:
        sink.report(f"calling {model.name}", "request")
    parts: list[str] = []
    usage = None
    model_name = model.name
    async with open_stream(model, request) as stream:
        async for chunk in stream:
            t = chunk.type
            if t == "text":
                _take_text(chunk, parts, sink)
            elif t == "thinking":
                _take_thought(chunk, sink)
            elif t == "result":
                usage = chunk.usage or usage
                model_name = chunk.model or model_name
            elif t == "error":
                raise ModelError(chunk.text or "model reported an error")
    _end_text(sink)
    text = "".join(parts)
    if clear_messages:
        branch.messages.clear()
    branch.messages.append(ins)
    branch.messages.add("assistant_response", {"text": text, "model": model_name, "usage": usage},
                        sender=branch.id, recipient=chat_param.sender)
    if skip_validation:
        return text
    return await _parse_reply(branch, text, chat_param, parse_param)


def _used_call_ids(branch: Any) -> set[str]:
    return {m.content.get("callId") for m in branch.messages if m.kind == "action_request"}


def _unique_call_id(run_id: str | None, used: set[str]) -> str:
    """The call id of a tool use a CLI run reported: the run's own id, unless the branch
    already has a call of that id (``used``: a run that repeats an id, or numbers its calls
    from 1 each time): then that id with a suffix, so that one call id names one call."""
    if not run_id:
        return new_id()
    call_id, n = run_id, 1
    while call_id in used:
        n += 1
        call_id = f"{run_id}#{n}"
    used.add(call_id)
    return call_id


def _run_tool_output(branch: Any, chunk: StreamChunk, req: Message) -> Any:
    """A CLI-run tool's result as recorded, like the output of a tool the pipeline ran: secrets
    out, bounded by ``max_tool_output_chars``; a failure is ``{"error", "function"}`` with a text."""
    limit = getattr(branch, "max_tool_output_chars", None)
    output = redact_value(chunk.output)
    if chunk.is_error:
        if isinstance(output, str) and output:
            text = output
        elif output is None or output == "":
            text = "the tool failed"
        else:
            text = json.dumps(output, ensure_ascii=False, default=str)
        return {"error": bound_text(text, limit), "function": req.content["function"]}
    return bound_output(output, limit)


class _Persist:
    """stream_persist: atomic snapshot before and after, a JSONL chunk buffer
    while streaming, the buffer removed at the end. Both are written with every known secret
    masked, like the state database: the snapshot through ``redact_value``, the buffer's text
    chunks as one text (a secret split across chunks is masked too; the few characters that
    could begin one are written with the next chunk, or at the end)."""

    def __init__(self, branch: Any, param: RunParam) -> None:
        self.branch = branch
        self.dir = param.persist_dir
        self.snap_dir = param.snapshot_dir or param.persist_dir
        for name, path in (("persist directory", self.dir), ("snapshot directory", self.snap_dir)):
            try:
                os.makedirs(path, exist_ok=True)
                # one the server cannot write to fails here, before any effect, not at the snapshot
                fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-", suffix=".tmp")
                os.close(fd)
                os.unlink(probe)
            except (OSError, TypeError, ValueError) as e:  # the caller's path: a file, a NUL, read-only ...
                raise ConfigurationError(f"the {name} {path!r} cannot be used: "
                                         f"{e.strerror or e if isinstance(e, OSError) else e}") from None
        self.buffer_path = os.path.join(self.dir, f"{branch.id}.buffer.jsonl")
        self.snapshot_path = os.path.join(self.snap_dir, f"{branch.id}.json")
        self._fh: Any = None
        self._text = StreamRedactor()  # the text chunks' pending tail

    def snapshot(self) -> None:
        data = json.dumps(redact_value(self.branch.to_dict()), ensure_ascii=False, allow_nan=False, default=str)
        fd, tmp = tempfile.mkstemp(dir=self.snap_dir, prefix=".snap-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.snapshot_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def open(self) -> None:
        self.snapshot()
        self._fh = open(self.buffer_path, "a", encoding="utf-8")

    def append(self, chunk: StreamChunk) -> None:
        rec = {k: getattr(chunk, k) for k in ("type", "text", "id", "name", "input", "output", "is_error", "usage")
               if getattr(chunk, k) not in (None, "", False)}
        if chunk.type == "text":
            rec["text"] = self._text.feed(chunk.text or "")
            if not rec["text"]:
                return  # all of it may begin a secret: written with the next chunk
        else:
            self._end_text()
        self._write(redact_value(rec))

    def _end_text(self) -> None:
        if self._text.pending:
            self._write({"type": "text", "text": self._text.flush()})

    def _write(self, rec: dict[str, Any]) -> None:
        self._fh.write(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._end_text()
            finally:
                self._fh.close()
                self._fh = None
        try:
            self.snapshot()
        finally:
            if os.path.exists(self.buffer_path):
                os.unlink(self.buffer_path)


async def run_and_collect(branch: Any, instruction: Any, chat_param: ChatParam, parse_param: ParseParam | None,
                          clear_messages: bool = False, *, skip_validation: bool = False) -> Any:
    sink = progress.current_progress.get()
    if sink is not None:
        sink.begin("run_and_collect")
    param = chat_param if isinstance(chat_param, RunParam) else RunParam(**chat_param.to_dict())
    model = _model_of(branch, param)  # per-call model: never written back to the branch
    persist = _Persist(branch, param) if param.stream_persist else None  # before any effect (the clear too)
    if clear_messages:
        branch.messages.clear()
    ins = _instruction_message(branch, instruction, param)
    request = render_request(branch, ins, param.response_format, param.tool_schemas, param.imodel_kw, purpose="run")
    branch.messages.append(ins)
    texts: list[str] = []
    buf: list[str] = []
    open_calls: dict[str, list[Message]] = {}  # the run's tool id -> its requests not yet answered
    used_ids: set[str] | None = None  # the branch's call ids (read at the run's first tool use)
    usage = None
    model_name = model.name

    def flush_text(final: bool = False) -> None:
        # the run's usage goes on its last reply; a run that ends on a tool result with no
        # text after it gets an empty one to carry it (its usage was on no message at all)
        if buf or (final and usage is not None):
            text = "".join(buf)
            buf.clear()
            if text:
                texts.append(text)
            branch.messages.add("assistant_response", {"text": text, "model": model_name,
                                                       "usage": usage if final else None},
                                sender=branch.id, recipient=param.sender)

    if sink is not None:
        sink.report(f"running {model.name}", "request")
    try:
        if persist is not None:
            persist.open()
        async with open_stream(model, request) as stream:
            async for chunk in stream:
                if persist is not None:
                    persist.append(chunk)
                t = chunk.type
                if t == "text":
                    _take_text(chunk, buf, sink)
                elif t == "thinking":
                    _take_thought(chunk, sink)
                elif t == "tool_use":
                    _end_text(sink)
                    flush_text()
                    if used_ids is None:
                        used_ids = _used_call_ids(branch)
                    call_id = _unique_call_id(chunk.id, used_ids)
                    req = branch.messages.add("action_request", {"callId": call_id, "function": chunk.name,
                                                                 "arguments": chunk.input or {}},
                                              sender=branch.id, recipient=param.sender)
                    # a result names the run's id: one used twice is answered in order
                    open_calls.setdefault(chunk.id or call_id, []).append(req)
                elif t == "tool_result":
                    waiting = open_calls.get(chunk.id) if chunk.id else None
                    if not waiting:
                        continue  # unmatched results are skipped
                    req = waiting.pop(0)
                    if not waiting:
                        del open_calls[chunk.id]
                    branch.messages.add("action_response", {"callId": req.content["callId"], "requestId": req.id,
                                                            "function": req.content["function"],
                                                            "arguments": req.content["arguments"],
                                                            "output": _run_tool_output(branch, chunk, req)},
                                        sender=branch.id, recipient=branch.id)
                elif t == "result":
                    usage = chunk.usage or usage
                    model_name = chunk.model or model_name
                elif t == "error":
                    raise ModelError(chunk.text or "model reported an error")
        _end_text(sink)
        flush_text(final=True)
    finally:
        with anyio.CancelScope(shield=True):
            flush_text()
            for req in [r for waiting in open_calls.values() for r in waiting]:
                branch.messages.add("action_response", {"callId": req.content["callId"], "requestId": req.id,
                                                        "function": req.content["function"],
                                                        "arguments": req.content["arguments"],
                                                        "output": {"error": "no result reported by the run",
                                                                   "function": req.content["function"]}},
                                    sender=branch.id, recipient=branch.id)
            if persist is not None:
                persist.close()
    if not texts:
        return None
    full = "\n\n".join(texts)
    if skip_validation:
        return full
    return await _parse_reply(branch, full, param, parse_param)
