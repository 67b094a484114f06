"""Step D3 (docs/PIPELINE.md): the coordinator invokes one adapter, then applies one outer validation policy."""

from __future__ import annotations

from typing import Any

import pytest

from operate_sidecar.server.core import (
    ActionParam,
    ChatParam,
    ParseParam,
    RunParam,
    UnparsedResponse,
    ValidationFailed,
    operate,
)

from .support import NO_REPAIR, Answer, call, make_branch, reply

pytestmark = pytest.mark.anyio


class RecordingMiddle:
    """A real Middle: records how it was called and returns a fixed value."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.calls: list[tuple[tuple, dict]] = []

    async def __call__(self, branch, instruction, chat_param, parse_param, clear_messages=False, *,
                       skip_validation=False):
        self.calls.append(((branch, instruction, chat_param, parse_param, clear_messages),
                           {"skip_validation": skip_validation}))
        return self.value


class Provider:
    def __init__(self) -> None:
        self.seen: list[list] = []

    async def writeback(self, branch, responses):
        self.seen.append(list(responses))


async def test_caller_middle_wins_without_wrapping(record):
    """D3: a caller-supplied middle wins; its value is the coordinator's result, unwrapped."""
    value = {"answer": 1}
    mid = RecordingMiddle(value)
    b, m = make_branch([], tools=(record,))
    out = await b.operate(instruction="hello", middle=mid)
    assert out is value
    assert m.calls == 0
    (args, _), = mid.calls
    assert args[0] is b and args[1] == "hello"
    assert isinstance(args[2], ChatParam) and isinstance(args[3], ParseParam)


async def test_default_middle_is_communicate_for_api_models():
    """D3: without a middle, a ChatParam and non-CLI model select communicate."""
    b, m = make_branch(["text"])
    assert await b.operate(instruction="x") == "text"
    assert m.requests[0].purpose == "chat"


async def test_default_middle_is_run_and_collect_for_cli_models():
    """D3: a CLI-backed branch.chat_model selects run_and_collect."""
    b, m = make_branch(["text"], cli=True)
    assert await b.operate(instruction="x") == "text"
    assert m.requests[0].purpose == "run"


async def test_default_middle_is_run_and_collect_for_run_param(tmp_path):
    """D3: a RunParam selects run_and_collect even for a non-CLI model."""
    b, m = make_branch(["text"])
    assert await b.operate(instruction="x", persist_dir=str(tmp_path)) == "text"
    assert m.requests[0].purpose == "run"


async def test_direct_operate_with_chat_param_and_cli_branch_model_selects_run_and_collect():
    """D3: RunParam *or* a CLI-backed branch.chat_model selects run_and_collect."""
    b, m = make_branch(["text"], cli=True)
    await operate(b, "x", ChatParam())
    assert m.requests[0].purpose == "run"


async def test_middle_awaited_exactly_once_even_when_parse_fails():
    """D3: the selected Middle is awaited exactly once; the coordinator does not retry it."""
    mid = RecordingMiddle(UnparsedResponse("garbage"))
    b, _ = make_branch([])
    out = await b.operate(instruction="x", response_format=Answer, middle=mid)
    assert out == "garbage"
    assert len(mid.calls) == 1


async def test_clear_messages_positional_and_skip_validation_keyword():
    """D3: clear_messages is passed positionally and skip_validation by keyword."""
    mid = RecordingMiddle("raw")
    b, _ = make_branch([])
    await b.operate(instruction="x", middle=mid, clear_messages=True, skip_validation=True)
    (args, kw), = mid.calls
    assert len(args) == 5 and args[4] is True
    assert kw == {"skip_validation": True}


async def test_skip_validation_returns_raw_result_before_everything(record):
    """D3: skip_validation=True returns the adapter's result: no instance check, no actions, no writeback."""
    value = {"answer": "not an int", "action_requests": [call(x=1)]}
    mid = RecordingMiddle(value)
    b, _ = make_branch([], tools=(record,))
    prov = Provider()
    b.providers.append(prov)
    out = await b.operate(instruction="x", response_format=Answer, actions=True, handle_validation="raise",
                          skip_validation=True, middle=mid)
    assert out is value
    assert "action_responses" not in value
    assert not record.ran and prov.seen == []


async def test_mismatch_return_value_returns_result_unchanged(record):
    """D3: handle_validation="return_value" returns the mismatching result unchanged, before
    its action requests are looked at."""
    value = {"answer": 1, "action_requests": [call(x=1)]}
    b, _ = make_branch([], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True, middle=RecordingMiddle(value))
    assert out is value and value == {"answer": 1, "action_requests": [call(x=1)]}
    assert not record.ran


async def test_mismatch_return_none_returns_none():
    """D3: handle_validation="return_none" returns None on a mismatch."""
    b, _ = make_branch(["not json", "still not json"])
    out = await b.operate(instruction="x", response_format=Answer, handle_validation="return_none",
                          parse_call_params=NO_REPAIR)
    assert out is None


async def test_mismatch_raise_names_expected_model_and_truncates_repr():
    """D3: "raise" raises a ValueError naming the expected model with at most 200 chars of repr(result)."""
    long_text = "Z" * 150 + "Q" * 400
    b, _ = make_branch([long_text, "still not json"])
    with pytest.raises(ValidationFailed) as ei:
        await b.operate(instruction="x", response_format=Answer, handle_validation="raise",
                        parse_call_params=NO_REPAIR)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.expected == "Answer" and "Answer" in str(err)
    r = repr(err.received)
    assert r[:200] in str(err)
    assert r[:201] not in str(err)
    assert str(err).count("Q") == 49  # quote + 150 Z + 49 Q = the first 200 characters


@pytest.mark.parametrize("policy", ["return_value", "return_none", "raise"])
async def test_mismatch_returns_before_actions(record, policy):
    """D3 / Consequences: a mismatch is handled before actions even when the mapping has action_requests."""
    value = {"answer": 1, "action_requests": [call(x=1)]}
    b, _ = make_branch([], tools=(record,))
    prov = Provider()
    b.providers.append(prov)
    kw = dict(instruction="x", response_format=Answer, actions=True, handle_validation=policy,
              middle=RecordingMiddle(value))
    if policy == "raise":
        with pytest.raises(ValidationFailed):
            await b.operate(**kw)
    else:
        out = await b.operate(**kw)
        assert out is (value if policy == "return_value" else None)
    assert not record.ran
    assert "action_responses" not in value
    assert prov.seen == []
    assert not any(m.kind.startswith("action") for m in b.messages)


async def test_without_caller_model_generated_model_is_returned_and_inspected(record):
    """D3: with no caller model class, a generated action model is returned and its requests inspected."""
    b, _ = make_branch([reply(None, call(x=2))], tools=(record,))
    out = await b.operate(instruction="x", actions=True, handle_validation="raise")
    assert type(out).__name__ == "OperativeResponse"
    assert record.calls == [{"x": 2, "note": ""}]
    assert out.action_responses[0].output == {"doubled": 4}


async def test_without_caller_model_mismatch_policy_does_not_apply():
    """D3: the outer type policy is relative to the caller's base model only (none here: "raise" does not raise)."""
    b, _ = make_branch(["just prose"])
    out = await b.operate(instruction="x", reason=True, handle_validation="raise")
    assert out == "just prose"


async def test_invoke_actions_false_returns_before_request_inspection(record):
    """D3: invoke_actions=False returns the validated result before action inspection: a valid
    result carrying a request, with an ActionParam prepared, is returned as is (the D1 facade
    gate is bypassed, so only the coordinator's gate stands between the request and the tool)."""
    class Valid:
        async def __call__(self, branch, instruction, chat_param, parse_param, clear_messages=False, *,
                           skip_validation=False):
            return chat_param.response_format.model_validate({"answer": 1, "action_requests": [call(x=1)]})

    b, _ = make_branch([], tools=(record,))
    out = await operate(b, "x", ChatParam(response_format=Answer), action_param=ActionParam(),
                        invoke_actions=False, middle=Valid())
    assert isinstance(out, Answer) and out.action_responses is None
    assert not record.ran
    # the same call with the gate open runs the tool: the gate is what held it
    out = await operate(b, "x", ChatParam(response_format=Answer), action_param=ActionParam(), middle=Valid())
    assert record.calls == [{"x": 1, "note": ""}]


async def test_invoke_actions_false_is_a_gate_independent_of_action_param(record):
    """D3: invoke_actions=False gates even when an ActionParam was prepared (direct coordinator call)."""
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    out = await operate(b, "x", ChatParam(response_format=Answer), action_param=ActionParam(),
                        invoke_actions=False)
    assert [r.function for r in out.action_requests] == ["record"]
    assert out.action_responses is None
    assert not record.ran


async def test_valid_result_proceeds_to_actions(record):
    """D3: a result that is an instance of the caller model continues into D4 action inspection."""
    b, _ = make_branch([reply(1, call(x=3))], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert isinstance(out, Answer) and out.answer == 1
    assert record.calls == [{"x": 3, "note": ""}]


async def test_cli_run_without_text_is_a_mismatch_under_return_value():
    """D3: a CLI run with no text yields None, returned unchanged under return_value."""
    b, _ = make_branch([""], cli=True)
    assert await b.operate(instruction="x", response_format=Answer) is None


async def test_run_param_type_is_what_the_middle_receives(tmp_path):
    """D3: the prepared RunParam reaches the adapter unchanged in kind."""
    mid = RecordingMiddle("raw")
    b, _ = make_branch([])
    await b.operate(instruction="x", middle=mid, snapshot_dir=str(tmp_path))
    (args, _), = mid.calls
    assert isinstance(args[2], RunParam) and args[2].snapshot_dir == str(tmp_path)


async def test_message_persistence_is_adapter_owned():
    """D3: the coordinator records no messages itself; persistence belongs to the adapter."""
    b, _ = make_branch([])
    out = await b.operate(instruction="x", response_format=Answer, middle=RecordingMiddle(Answer(answer=1)))
    assert out == Answer(answer=1)
    assert len(b.messages) == 0
