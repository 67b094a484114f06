"""The scripted provider: deterministic replay (docs/PROTOCOL.md §2)."""

from __future__ import annotations

import anyio
import pytest

from operate_sidecar.server.core import ModelError, ModelRequest
from operate_sidecar.server.models.scripted import ScriptedModel

from .support import Answer, make_branch

pytestmark = pytest.mark.anyio


def req(purpose: str = "chat") -> ModelRequest:
    return ModelRequest(messages=[{"role": "user", "content": "hi"}], purpose=purpose)  # type: ignore[arg-type]


async def chunks_of(model: ScriptedModel) -> list:
    return [c async for c in model.stream(req())]


async def test_entries_are_consumed_in_order():
    """docs/PROTOCOL.md §2: each invocation consumes the next entry, in order."""
    m = ScriptedModel("s", ["one", "two"])
    assert (await m.invoke(req())).text == "one"
    assert (await m.invoke(req())).text == "two"
    assert m.calls == 2 and m.remaining == 0


async def test_json_entry_is_serialized_as_text():
    """docs/PROTOCOL.md §2: "json" is serialized as the text."""
    m = ScriptedModel("s", [{"json": {"answer": 1, "s": "é"}}])
    assert (await m.invoke(req())).text == '{"answer": 1, "s": "é"}'


async def test_chunks_stream_the_text_in_that_many_deltas():
    """docs/PROTOCOL.md §2: "chunks" streams the text in that many deltas, then a result chunk."""
    m = ScriptedModel("s", [{"text": "abcdefg", "chunks": 3}])
    out = await chunks_of(m)
    texts = [c.text for c in out if c.type == "text"]
    assert len(texts) == 3 and "".join(texts) == "abcdefg"
    assert out[-1].type == "result" and out[-1].model == "s"


async def test_error_entry_fails_the_invocation():
    """docs/PROTOCOL.md §2: "error" makes the invocation fail with a model error."""
    m = ScriptedModel("s", [{"error": "rate limited"}, "after"])
    with pytest.raises(ModelError, match="rate limited"):
        await m.invoke(req())
    assert (await m.invoke(req())).text == "after"


async def test_exhausted_list_fails_with_model_error():
    """docs/PROTOCOL.md §2: an exhausted list fails the invocation with a model error."""
    m = ScriptedModel("s", [])
    with pytest.raises(ModelError, match="no responses left"):
        await m.invoke(req())
    assert m.calls == 1


async def test_delay_is_cancellable():
    """docs/PROTOCOL.md §2: "delayMs" waits before answering and the wait is cancellable."""
    m = ScriptedModel("s", [{"text": "late", "delayMs": 3_600_000}])
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(m.invoke, req())
            while m.calls == 0:
                await anyio.sleep(0)
            tg.cancel_scope.cancel()
    assert m.calls == 1 and m.remaining == 0


async def test_requests_are_recorded():
    """Scripted: the requests it received are kept for inspection."""
    m = ScriptedModel("s", ["a"])
    r = req("parse")
    await m.invoke(r)
    assert list(m.requests) == [r]


async def test_cli_flag_makes_model_cli_backed_and_selects_run_and_collect():
    """docs/PROTOCOL.md §2: "cli": true makes the model CLI-backed, so operate selects run_and_collect."""
    assert ScriptedModel.from_config("s", {"provider": "scripted", "responses": [], "cli": True}).is_cli
    b, m = make_branch(['{"answer": 2}'], cli=True)
    out = await b.operate(instruction="x", response_format=Answer)
    assert out.answer == 2 and m.requests[0].purpose == "run"


async def test_parse_repair_consumes_the_next_entry():
    """docs/PROTOCOL.md §2: parse repair turns consume entries like chat turns."""
    from .support import NO_REPAIR

    b, m = make_branch(["not json", '{"answer": 3}', "unused"])
    out = await b.operate(instruction="x", response_format=Answer, parse_call_params=NO_REPAIR)
    assert out.answer == 3 and m.remaining == 1


@pytest.mark.parametrize("config, message", [
    ({"provider": "scripted", "responses": [], "extra": 1}, "unknown field"),
    ({"provider": "scripted", "responses": "abc"}, "must be a list"),
    ({"provider": "scripted", "responses": [5]}, "must be a string or an object"),
    ({"provider": "scripted", "responses": [{"txt": "x"}]}, "unknown field"),
    ({"provider": "scripted", "responses": [{"delayMs": -1}]}, "delayMs"),
    ({"provider": "scripted", "responses": [{"chunks": 0}]}, "chunks"),
    ({"provider": "scripted", "responses": [{"chunks": True}]}, "chunks"),
    ({"provider": "scripted", "responses": [{"delayMs": True}]}, "delayMs"),
    ({"provider": "scripted", "responses": [{"text": 5}]}, "text must be a string"),
    ({"provider": "scripted", "responses": [{"error": {"code": 1}}]}, "error must be a string"),
])
def test_invalid_config_is_rejected(config, message):
    """docs/PROTOCOL.md §2: malformed scripted configs are rejected up front."""
    with pytest.raises(ValueError, match=message):
        ScriptedModel.from_config("s", config)


async def test_empty_text_yields_only_a_result_chunk():
    """Scripted: an empty text streams no text delta."""
    m = ScriptedModel("s", [""])
    out = await chunks_of(m)
    assert [c.type for c in out] == ["result"]


async def test_a_refusal_entry_fails_as_the_model_declining_and_an_error_only_as_a_model_error():
    """docs/PROTOCOL.md §2: ``refusal`` fails the invocation as a refusal (its text the error's
    ``data.refusal``) after streaming the entry's text; an ``error`` that merely reads like one
    is a plain model error."""
    from operate_sidecar.server.core.errors import ModelRefused

    m = ScriptedModel("s", [{"text": "some", "refusal": "not allowed"},
                            {"refusal": "no", "error": "stopped by the filter"},
                            {"error": "model 's' declined the request: not allowed"}])
    seen = []
    with pytest.raises(ModelRefused) as e:
        async for c in m.stream(req()):
            seen.append(c)
    assert [c.text for c in seen if c.type == "text"] == ["some"]
    assert e.value.refusal == "not allowed" and str(e.value) == "model 's' declined the request: not allowed"
    with pytest.raises(ModelRefused) as e:
        await m.invoke(req())
    assert e.value.refusal == "no" and str(e.value) == "stopped by the filter"
    with pytest.raises(ModelError) as e:
        await m.invoke(req())
    assert not isinstance(e.value, ModelRefused)
