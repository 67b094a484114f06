"""The Middles (the adapters step D3 of docs/PIPELINE.md calls): communicate and run_and_collect."""

from __future__ import annotations

import json
import os
from typing import Any, AsyncIterator, Callable

import anyio
import pytest

from operate_sidecar.server.core import (
    BaseModelProvider,
    ChatParam,
    ModelError,
    ModelRequest,
    ParseParam,
    RunParam,
    StreamChunk,
    communicate,
    run_and_collect,
)
from operate_sidecar.server.models.scripted import ScriptedModel

from .support import NO_REPAIR, Answer, RecordingTool, kinds, make_branch

pytestmark = pytest.mark.anyio


class AgentModel(BaseModelProvider):
    """A tiny CLI-like iModel: streams a fixed list of chunks; ``probe`` runs after chunk ``probe_at``."""

    def __init__(self, chunks: list[StreamChunk], *, cli: bool = True, probe: Callable[[], Any] | None = None,
                 probe_at: int = 0) -> None:
        self.name = "agent"
        self.is_cli = cli
        self.chunks = chunks
        self.probe = probe
        self.probe_at = probe_at
        self.probed: list[Any] = []
        self.requests: list[ModelRequest] = []

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:  # type: ignore[override]
        self.requests.append(request)
        for i, c in enumerate(self.chunks):
            yield c
            if self.probe is not None and i == self.probe_at:
                self.probed.append(self.probe())


def text(t: str) -> StreamChunk:
    return StreamChunk(type="text", text=t)


# ---------------------------------------------------------------- communicate

async def test_communicate_records_instruction_and_reply_after_the_call():
    """communicate: one model call; instruction and reply are recorded together after it succeeds."""
    b, m = make_branch(["hello"])
    out = await communicate(b, "hi", ChatParam(sender="user", recipient=b.id), None)
    assert out == "hello" and m.calls == 1
    assert kinds(b) == ["instruction", "assistant_response"]
    assert b.messages[0].content["instruction"] == "hi"
    assert b.messages[1].content == {"text": "hello", "model": "scripted",
                                     "usage": {"prompt_tokens": 0, "completion_tokens": 0}}


async def test_communicate_model_failure_records_nothing():
    """communicate: a failed model call raises ModelError and records no message."""
    b, _ = make_branch([{"error": "down"}])
    with pytest.raises(ModelError):
        await communicate(b, "hi", ChatParam(), None)
    assert len(b.messages) == 0


async def test_communicate_clear_messages_keeps_system():
    """D3/communicate: clear_messages empties the branch but keeps the system message."""
    b, _ = make_branch(["one", "two"], system="be brief")
    await communicate(b, "first", ChatParam(), None)
    await communicate(b, "second", ChatParam(), None, True)
    assert kinds(b) == ["system", "instruction", "assistant_response"]
    assert b.messages[1].content["instruction"] == "second"


async def test_communicate_skip_validation_returns_raw_text():
    """D3: skip_validation makes the adapter return the raw text without parsing."""
    b, _ = make_branch(['{"answer": 1}'])
    out = await communicate(b, "x", ChatParam(response_format=Answer),
                            ParseParam(response_format=Answer), skip_validation=True)
    assert out == '{"answer": 1}'


async def test_communicate_parses_into_response_format():
    """communicate: with a parse param and response format the reply is parsed."""
    b, _ = make_branch(['{"answer": 1}'])
    out = await communicate(b, "x", ChatParam(response_format=Answer), ParseParam(response_format=Answer))
    assert out == Answer(answer=1)


async def test_communicate_history_is_sent_to_the_model():
    """communicate: the branch history (system, earlier turns) is rendered into the request."""
    b, m = make_branch(["a1", "a2"], system="SYS")
    await communicate(b, "q1", ChatParam(), None)
    await communicate(b, "q2", ChatParam(), None)
    msgs = m.requests[1].messages
    assert [x["role"] for x in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == "SYS" and "q1" in msgs[1]["content"] and msgs[2]["content"] == "a1"
    assert "q2" in msgs[3]["content"]


# ---------------------------------------------------------------- run_and_collect

async def test_run_and_collect_records_instruction_at_its_first_tool_use_or_with_its_reply():
    """run_and_collect: the instruction is recorded when the run records something: at its first
    tool use (a real effect, recorded as it happens), else with its reply at the end."""
    b, _ = make_branch([])
    model = AgentModel([text("hi")], probe=lambda: kinds(b), probe_at=0)
    out = await run_and_collect(b, "go", RunParam(imodel=model), None)
    assert out == "hi"
    assert model.probed == [[]]
    assert kinds(b) == ["instruction", "assistant_response"]
    b2, _ = make_branch([])
    model = AgentModel([text("let me look"), StreamChunk(type="tool_use", id="t", name="grep", input={})],
                       probe=lambda: kinds(b2), probe_at=1)
    await run_and_collect(b2, "go", RunParam(imodel=model), None)
    assert model.probed == [["instruction", "assistant_response", "action_request"]]


async def test_run_and_collect_accepts_any_imodel():
    """Project choice: run_and_collect accepts a non-CLI iModel (promoting ChatParam to RunParam)."""
    b, m = make_branch(["plain"])
    assert await run_and_collect(b, "go", ChatParam(), None) == "plain"
    assert m.requests[0].purpose == "run"


async def test_cli_tool_use_recorded_as_messages_not_re_executed():
    """run_and_collect / D4: CLI tool_use/tool_result are recorded as messages and not re-executed."""
    shell = RecordingTool("shell")
    b, _ = make_branch([], tools=(shell,))
    model = AgentModel([
        text("Let me look."),
        StreamChunk(type="tool_use", id="t1", name="shell", input={"x": 1}),
        StreamChunk(type="tool_result", id="t1", output="file.txt"),
        text("Found it."),
        StreamChunk(type="result", usage={"out": 3}, model="agent-1"),
    ])
    out = await b.operate(instruction="go", chat_model=model, actions=True)
    assert not shell.ran
    assert kinds(b) == ["instruction", "assistant_response", "action_request", "action_response",
                        "assistant_response"]
    req, resp = b.messages[2], b.messages[3]
    assert req.content == {"callId": "t1", "function": "shell", "arguments": {"x": 1}}
    assert resp.content["requestId"] == req.id and resp.content["output"] == "file.txt"
    assert b.messages[4].content["model"] == "agent-1" and b.messages[4].content["usage"] == {"out": 3}
    assert getattr(out, "action_responses", None) is None


async def test_cli_tool_error_result_recorded_as_error_mapping():
    """run_and_collect / docs/PROTOCOL.md §5: a failed CLI tool result is recorded as {"error", "function"}."""
    b, _ = make_branch([])
    model = AgentModel([StreamChunk(type="tool_use", id="t", name="grep", input={}),
                        StreamChunk(type="tool_result", id="t", output="no such file", is_error=True),
                        text("done")])
    await run_and_collect(b, "go", RunParam(imodel=model), None)
    assert b.messages[2].content["output"] == {"error": "no such file", "function": "grep"}


async def test_cli_unmatched_tool_result_is_skipped_and_open_tool_use_is_answered():
    """run_and_collect: unmatched results are skipped; a tool_use without a result still gets a response."""
    b, _ = make_branch([])
    model = AgentModel([StreamChunk(type="tool_result", id="ghost", output="?"),
                        StreamChunk(type="tool_use", id="t", name="grep", input={}),
                        text("done")])
    await run_and_collect(b, "go", RunParam(imodel=model), None)
    assert kinds(b) == ["instruction", "action_request", "assistant_response", "action_response"]
    assert b.messages[3].content["output"]["error"]
    assert b.messages[3].content["requestId"] == b.messages[1].id


async def test_run_and_collect_joins_texts_and_returns_none_without_text():
    """run_and_collect: assistant texts are joined with a blank line; no text returns None."""
    b, _ = make_branch([])
    model = AgentModel([text("a"), StreamChunk(type="tool_use", id="t", name="n", input={}),
                        StreamChunk(type="tool_result", id="t", output=1), text("b")])
    assert await run_and_collect(b, "go", RunParam(imodel=model), None) == "a\n\nb"
    b2, _ = make_branch([])
    assert await run_and_collect(b2, "go", RunParam(imodel=AgentModel([])), None) is None


async def test_run_and_collect_error_chunk_raises_model_error():
    """run_and_collect: an in-stream error raises ModelError."""
    b, _ = make_branch([])
    with pytest.raises(ModelError, match="quota"):
        await run_and_collect(b, "go", RunParam(imodel=AgentModel([StreamChunk(type="error", text="quota")])), None)


@pytest.mark.parametrize("adapter", ["communicate", "run_and_collect"])
async def test_clear_messages_repair_turn_is_shown_the_cleared_branch_and_the_call(adapter):
    """clear_messages with a repair turn: the branch is cleared only once the reply is parsed, yet
    the repair turn is shown the conversation as it will be then: the system message, the
    instruction and the reply it reformats, not the turns the clear removes."""
    b, _ = make_branch(["one", "not json"], system="SYS")
    await communicate(b, "first", ChatParam(), None)
    repairer = ScriptedModel("repairer", [{"json": {"answer": 3}}])
    parse_param = ParseParam(response_format=Answer, imodel=repairer, alcall_params=NO_REPAIR)
    if adapter == "communicate":
        out = await communicate(b, "second", ChatParam(response_format=Answer), parse_param, True)
    else:
        out = await run_and_collect(b, "second", RunParam(imodel=AgentModel([text("not json")]),
                                                          response_format=Answer), parse_param, True)
    assert out == Answer(answer=3)
    assert kinds(b) == ["system", "instruction", "assistant_response"]
    shown = repairer.requests[0].messages
    assert [m["role"] for m in shown[:3]] == ["system", "user", "assistant"], shown
    assert shown[0]["content"] == "SYS" and "second" in shown[1]["content"] and shown[2]["content"] == "not json"
    assert "first" not in json.dumps(shown) and "one" not in json.dumps(shown), shown


async def test_a_cli_run_that_used_tools_under_clear_messages_then_failed():
    """clear_messages, a run that used a tool, then failed: its tool use, a real effect, stays
    recorded, after the instruction and the text before it, with its result, on the branch
    cleared as the call asked (the clear is part of recording the instruction); the reply begun
    after it is not recorded."""
    b, _ = make_branch(["one"], system="SYS")
    await communicate(b, "first", ChatParam(), None)
    model = AgentModel([text("let me look"), StreamChunk(type="tool_use", id="t", name="ls", input={}),
                        StreamChunk(type="tool_result", id="t", output="a.txt"), text("HALF a reply"),
                        StreamChunk(type="error", text="crashed")])
    with pytest.raises(ModelError, match="crashed"):
        await run_and_collect(b, "go", RunParam(imodel=model), None, True)
    assert kinds(b) == ["system", "instruction", "assistant_response", "action_request", "action_response"]
    assert b.messages[1].content["instruction"] == "go" and b.messages[2].content["text"] == "let me look"
    assert b.messages[4].content["output"] == "a.txt"
    assert "first" not in json.dumps([m.to_dict() for m in b.messages], default=str)
    assert "HALF" not in json.dumps([m.to_dict() for m in b.messages], default=str)


async def test_per_call_model_is_not_written_back_to_branch():
    """run_and_collect: a per-call model never replaces branch.chat_model."""
    b, m = make_branch([])
    await run_and_collect(b, "go", RunParam(imodel=AgentModel([text("x")])), None)
    assert b.chat_model is m


async def test_stream_persist_buffers_chunks_while_streaming(tmp_path):
    """run_and_collect: stream_persist appends live chunks to persist_dir/<id>.buffer.jsonl."""
    b, _ = make_branch([])
    buf = tmp_path / f"{b.id}.buffer.jsonl"

    def probe():
        return [json.loads(line) for line in buf.read_text().splitlines()] if buf.exists() else None

    model = AgentModel([text("one"), text("two")], probe=probe, probe_at=1)
    await run_and_collect(b, "go", RunParam(imodel=model, stream_persist=True, persist_dir=str(tmp_path)), None)
    assert model.probed == [[{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]]


async def test_stream_persist_snapshots_atomically_before_and_after(tmp_path):
    """run_and_collect: an atomic snapshot of branch.to_dict() is written before streaming and re-written after."""
    persist, snaps = tmp_path / "runs", tmp_path / "snaps"
    b, _ = make_branch([])
    snap = snaps / f"{b.id}.json"

    def probe():
        return [m["kind"] for m in json.loads(snap.read_text())["messages"]]

    model = AgentModel([text("answer")], probe=probe, probe_at=0)
    await run_and_collect(b, "go", RunParam(imodel=model, stream_persist=True, persist_dir=str(persist),
                                            snapshot_dir=str(snaps)), None)
    assert model.probed == [[]]  # the snapshot taken before streaming: the branch as it was
    final = json.loads(snap.read_text())
    assert final == json.loads(json.dumps(b.to_dict()))
    assert [m["kind"] for m in final["messages"]] == ["instruction", "assistant_response"]
    assert [p.name for p in snaps.iterdir()] == [snap.name]  # no temp files left


async def test_stream_persist_removes_buffer_at_the_end_even_on_failure(tmp_path):
    """run_and_collect: the buffer is removed at the end, also when the stream fails (and the
    snapshot then is the branch as it was: a failed call records nothing of its reply)."""
    b, _ = make_branch([])
    await run_and_collect(b, "go", RunParam(imodel=AgentModel([text("x")]), stream_persist=True,
                                            persist_dir=str(tmp_path)), None)
    assert os.listdir(tmp_path) == [f"{b.id}.json"]
    b2, _ = make_branch([])
    bad = AgentModel([text("partial"), StreamChunk(type="error", text="died")])
    with pytest.raises(ModelError):
        await run_and_collect(b2, "go", RunParam(imodel=bad, stream_persist=True, persist_dir=str(tmp_path)), None)
    assert not (tmp_path / f"{b2.id}.buffer.jsonl").exists()
    snap = json.loads((tmp_path / f"{b2.id}.json").read_text())
    assert [m["kind"] for m in snap["messages"]] == [] == kinds(b2)


async def test_stream_persist_through_operate(tmp_path):
    """D1/D3: operate(stream_persist=True, persist_dir=...) selects RunParam and persists the run."""
    b, _ = make_branch(['{"answer": 5}'])
    out = await b.operate(instruction="x", response_format=Answer, stream_persist=True, persist_dir=str(tmp_path))
    assert out.answer == 5
    assert os.listdir(tmp_path) == [f"{b.id}.json"]


class BlockingAgent(AgentModel):
    """Yields its chunks, then blocks until cancelled (a CLI run that hangs mid-tool)."""

    def __init__(self, chunks):
        super().__init__(chunks)
        self.blocked = anyio.Event()

    async def stream(self, request):  # type: ignore[override]
        for c in self.chunks:
            yield c
        self.blocked.set()
        await anyio.sleep_forever()


async def test_cancelled_run_answers_open_tool_use_and_cleans_persistence(tmp_path):
    """docs/PROTOCOL.md §7: a cancelled run leaves every action_request answered and removes the stream buffer."""
    b, _ = make_branch([])
    model = BlockingAgent([text("working"), StreamChunk(type="tool_use", id="t", name="bash", input={"c": 1})])
    param = RunParam(imodel=model, stream_persist=True, persist_dir=str(tmp_path))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_and_collect, b, "go", param, None)
            await model.blocked.wait()
            tg.cancel_scope.cancel()
    assert kinds(b) == ["instruction", "assistant_response", "action_request", "action_response"]
    assert b.messages[3].content["requestId"] == b.messages[2].id
    assert "error" in b.messages[3].content["output"]
    assert os.listdir(tmp_path) == [f"{b.id}.json"]


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def begin(self, message):
        self.events.append(("begin", message))

    def report(self, message, phase, delta=None):
        self.events.append(("report", phase, delta))


async def test_progress_reports_stream_deltas_in_order():
    """docs/PROTOCOL.md §6 (core side): begin with the adapter name, stream deltas in order; the core never
    ends the progress (the caller who installed the sink does: a request may run several operates)."""
    from operate_sidecar.server.core import current_progress

    b, _ = make_branch([{"text": "abcdef", "chunks": 3}])
    sink = Sink()
    token = current_progress.set(sink)
    try:
        await b.operate(instruction="x")
    finally:
        current_progress.reset(token)
    assert sink.events[0] == ("begin", "communicate")
    assert [e[2] for e in sink.events if e[0] == "report" and e[1] == "stream"] == ["ab", "cd", "ef"]
    assert sink.events[-1][0] == "report"


async def test_tool_results_reach_the_next_model_round(record):
    """D4 / docs/PROTOCOL.md §5: recorded action responses are shown to the model in the next round."""
    from .support import call, reply

    b, m = make_branch([reply(1, call(x=21)), "thanks"], tools=(record,))
    await b.operate(instruction="first", response_format=Answer, actions=True)
    await b.operate(instruction="second")
    last_user = m.requests[1].messages[-1]
    assert last_user["role"] == "user"
    assert '"doubled": 42' in last_user["content"] and "second" in last_user["content"]
