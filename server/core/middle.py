"""The Middle protocol and the two shipped adapters.

``communicate`` (API models): one model call, the reply is parsed (with any
repair turns), then the instruction and reply are recorded together.
``run_and_collect`` (CLI-backed models, or RunParam): the model's stream is read
as it runs; CLI-reported tool use is recorded as action messages as it happens
(never re-executed), each after the text the run wrote before it, the first
after the instruction, which it records; the reply (the text after the last
tool use) is recorded once parsed. ``stream_persist`` buffers chunks to
``persist_dir`` and snapshots the branch atomically.

Either way, a model call that fails, or is cancelled (during its repair turns
too), records no reply nor any fragment of one: fail before effect. A repair
turn that fails degrades to the unparsed reply (as a reply that does not parse
does), which is recorded. What a CLI run's tool uses did is real, so they stay
recorded after the instruction, each after the text the run wrote before it and
with its result (or an error saying the run reported none); a run that used no
tool leaves the branch as it was (not cleared by ``clear_messages`` either).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Protocol

import anyio

from . import progress
from .errors import ConfigurationError, ModelError, ParseError
from .imodel import StreamChunk, open_stream
from .act import bound_output, bound_text
from .messages import Message, new_id
from .params import ChatParam, ParseParam, RunParam
from .parse import parse
from .render import cleared, instruction_content, render_request, with_messages
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


async def _parse_reply(branch: Any, text: Any, chat_param: ChatParam, parse_param: ParseParam | None,
                       base: Any, pending: list[Message], record: Any) -> Any:
    """The reply parsed (with any repair turns), then ``record()`` called: a model call records
    only once its reply is parsed. The repair turns are part of the model call: one cancelled
    during them records nothing, and the branch is as it was before (docs/PIPELINE.md D3). A
    repair turn that fails (the parse model's error, its ``timeoutS``) degrades to the unparsed
    reply, as a reply that does not parse does, and that reply is recorded; one the caller's
    policy refuses (``handle_validation="raise"``) was still made: it is recorded, then the
    refusal raised. The repair turns are shown the conversation as it will be: ``base`` (the
    branch, or what remains of it once cleared) then ``pending``, the messages ``record``
    records."""
    if parse_param is not None and parse_param.response_format is not None and chat_param.response_format is not None:
        try:
            result = await parse(branch, text, parse_param, lambda: with_messages(base, pending))
        except ParseError:
            record()
            raise
        record()
        return result
    record()
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
    base = cleared(branch) if clear_messages else branch
    request = render_request(base, ins, chat_param.response_format, chat_param.tool_schemas, chat_param.imodel_kw)
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
    reply = Message(kind="assistant_response", content={"text": text, "model": model_name, "usage": usage},
                    sender=branch.id, recipient=chat_param.sender)

    def record() -> None:
        if clear_messages:
            branch.messages.clear()
        branch.messages.append(ins)
        branch.messages.append(reply)

    if skip_validation:
        record()
        return text
    return await _parse_reply(branch, text, chat_param, parse_param, base, [ins, reply], record)


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


def _run_tool_response(branch: Any, req: Message, output: Any) -> Message:
    """The response to a tool use a CLI run reported (``req``, its recorded request): ``output``,
    its result as recorded, or the error that the run reported none."""
    return Message(kind="action_response",
                   content={"callId": req.content["callId"], "requestId": req.id, "function": req.content["function"],
                            "arguments": req.content["arguments"], "output": output},
                   sender=branch.id, recipient=branch.id)


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
    ins = _instruction_message(branch, instruction, param)
    # clear_messages: the request is rendered from the branch as it will be once cleared, and the
    # branch is cleared only when the run records something (its first tool use, or its reply)
    base = cleared(branch) if clear_messages else branch
    request = render_request(base, ins, param.response_format, param.tool_schemas, param.imodel_kw, purpose="run")
    started = False  # whether the branch was cleared (clear_messages) and the instruction recorded
    texts: list[str] = []
    buf: list[str] = []
    open_calls: dict[str, list[Message]] = {}  # the run's tool id -> its requests not yet answered
    used_ids: set[str] | None = None  # the branch's call ids (read at the run's first tool use)
    usage = None
    model_name = model.name

    def start() -> None:
        # the run's first record: the instruction (after the clear), which the tool uses it
        # reports as they happen, or its reply, then follow
        nonlocal started
        if not started:
            started = True
            if clear_messages:
                branch.messages.clear()
            branch.messages.append(ins)

    def take_text(final: bool = False) -> Message | None:
        # the run's usage goes on its last reply; a run that ends on a tool result with no
        # text after it gets an empty one to carry it (its usage was on no message at all)
        if buf or (final and usage is not None):
            text = "".join(buf)
            buf.clear()
            if text:
                texts.append(text)
            return Message(kind="assistant_response", content={"text": text, "model": model_name,
                                                               "usage": usage if final else None},
                           sender=branch.id, recipient=param.sender)
        return None

    def unanswered() -> list[Message]:
        # a tool use the run reported no result of (it ended, failed or was stopped first)
        out = [_run_tool_response(branch, req, {"error": "no result reported by the run",
                                                "function": req.content["function"]})
               for waiting in open_calls.values() for req in waiting]
        open_calls.clear()
        return out

    reply: list[Message] = []  # the run's last text (after its last tool use), recorded with its result
    answers: list[Message] = []  # the responses of its tool uses left unanswered

    def record() -> None:
        start()
        for m in reply + answers:
            branch.messages.append(m)
        reply.clear()
        answers.clear()

    if sink is not None:
        sink.report(f"running {model.name}", "request")
    done = False
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
                    # a tool use is a real effect: the run is recorded from here on, as it goes
                    start()
                    before = take_text()
                    if before is not None:
                        branch.messages.append(before)
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
                    branch.messages.append(_run_tool_response(branch, req, _run_tool_output(branch, chunk, req)))
                elif t == "result":
                    usage = chunk.usage or usage
                    model_name = chunk.model or model_name
                elif t == "error":
                    raise ModelError(chunk.text or "model reported an error")
        _end_text(sink)
        last = take_text(final=True)
        reply.extend([last] if last is not None else [])
        answers.extend(unanswered())
        if not texts or skip_validation:
            record()
            result = "\n\n".join(texts) if texts else None
        else:
            pending = [*([] if started else [ins]), *reply, *answers]
            result = await _parse_reply(branch, "\n\n".join(texts), param, parse_param,
                                        branch if started else base, pending, record)
        done = True
    finally:
        with anyio.CancelScope(shield=True):
            if not done and started:
                # failed or cancelled (the model call, or its repair turns): the reply (the text
                # after the last tool use) is not recorded, nor any part of it; the tool uses the
                # run made, real effects, stay, each after the text the run wrote before it and
                # with its result (or the error that the run reported none). A run that used no
                # tool recorded nothing: the branch is as it was
                for m in answers + unanswered():
                    branch.messages.append(m)
            if persist is not None:
                persist.close()
    return result
