"""The pipeline's seams (docs/PIPELINE.md "The seams": the three, and the D1 action_strategy one)."""

from __future__ import annotations

import inspect

import pytest

from operate_sidecar.server.core import Branch, Instruct, Step, operate, prepare_operate_kw

from .support import NO_REPAIR, Answer, call, interleaving_tools, make_branch, overlapped, reply

pytestmark = pytest.mark.anyio


def branch_for_strategy(responses):
    log, tools = interleaving_tools()
    b, m = make_branch(responses)
    for t in tools:
        b.tools.register(t)
    return log, b


async def test_seam_caller_operative_is_ignored():
    """Seam 1 (D1): a caller-supplied operative is accepted by Branch.operate() but has no effect."""
    mine = Step.respond_operative(Step.request_operative(name="Mine", base_type=Answer, reason=True))
    b, m = make_branch([reply(1)])
    out = await b.operate(instruction="x", response_format=Answer, operative=mine)
    assert type(out).__name__ == "AnswerResponse"
    assert m.requests[0].schema_name == "AnswerRequest"
    assert "reason" not in type(out).model_fields
    assert mine.response_model is None


def test_seam_no_structure_argument():
    """Seam 2: neither Branch.operate() nor prepare_operate_kw() has a dedicated structure argument."""
    assert "structure" not in inspect.signature(Branch.operate).parameters
    assert "structure" not in inspect.signature(prepare_operate_kw).parameters
    assert "structure" not in inspect.signature(operate).parameters


def test_seam_structure_keyword_is_just_a_model_option():
    """Seam 2: a structure= keyword is not a structure; it falls into the model invocation options."""
    b, _ = make_branch([])
    out = prepare_operate_kw(b, instruction="x", structure={"a": 1})
    assert out["chat_param"].imodel_kw == {"structure": {"a": 1}}
    assert out["chat_param"].response_format is None and out["parse_param"] is None


async def test_seam_skip_validation_disables_validation_and_action_phases(record):
    """Seam 3: skip_validation disables both parsing/validation and the action phase."""
    text = '{"answer": "not an int", "action_requests": [{"function": "record", "arguments": {"x": 1}}]}'
    b, m = make_branch([text, reply(1, call(x=1))], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True, handle_validation="raise",
                          skip_validation=True, parse_call_params=NO_REPAIR)
    assert out == text and type(out) is str  # raw text, no parse and no instance check
    assert m.calls == 1  # no repair turn: validation was skipped
    assert not record.ran  # no action phase


async def test_seam_skip_validation_disables_actions_even_when_reply_is_valid(record):
    """Seam 3: even a reply that would validate does not execute its action requests in raw mode."""
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True, skip_validation=True)
    assert isinstance(out, str) and not record.ran


async def test_seam_facade_default_strategy_shadows_instruct_strategy():
    """D1 seam: through Branch.operate the truthy "concurrent" default wins over Instruct(action_strategy=...)."""
    log, b = branch_for_strategy([{"json": {"action_requests": [call("first"), call("second")]}}])
    await b.operate(instruct=Instruct(instruction="x", actions=True, action_strategy="sequential"))
    assert overlapped(log)  # ran concurrently, not sequentially


def test_seam_facade_default_is_truthy_concurrent():
    """D1 seam: Branch.operate's action_strategy defaults to the truthy "concurrent"."""
    assert inspect.signature(Branch.operate).parameters["action_strategy"].default == "concurrent"


def test_facade_takes_the_preparers_parameter_list():
    """Branch.operate's parameters are prepare_operate_kw's (the list exists once), the branch as self."""
    facade, preparer = inspect.signature(Branch.operate).parameters, inspect.signature(prepare_operate_kw).parameters
    assert list(facade)[0] == "self" and list(facade)[1:] == list(preparer)[1:]


async def test_facade_none_means_the_default_and_other_names_reach_the_model_call():
    """Through Branch.operate a parameter of the preparer given as None takes its default (the truthy
    "concurrent" strategy, handle_validation's "return_value", not a refusal); another name, None
    included, reaches the model call's options as it is."""
    log, b = branch_for_strategy([{"json": {"action_requests": [call("first"), call("second")]}}])
    await b.operate(instruct=Instruct(instruction="x", actions=True, action_strategy="sequential"),
                    action_strategy=None, handle_validation=None, temperature=None, seed=7)
    assert overlapped(log)
    assert b.chat_model.requests[0].options == {"temperature": None, "seed": 7}


async def test_seam_direct_preparer_with_falsy_strategy_lets_instruct_decide():
    """D1 seam: a direct preparer call with a falsy strategy lets Instruct.action_strategy decide."""
    log, b = branch_for_strategy([{"json": {"action_requests": [call("first"), call("second")]}}])
    prepared = prepare_operate_kw(b, instruct=Instruct(instruction="x", actions=True, action_strategy="sequential"),
                                  action_strategy=None)
    assert prepared["action_param"].strategy == "sequential"
    await operate(b, **prepared)
    assert log == [("start", "first"), ("end", "first"), ("start", "second"), ("end", "second")]


async def test_seam_explicit_loose_sequential_selects_sequential():
    """D1 seam / Consequences: callers must pass action_strategy="sequential" at the branch boundary."""
    log, b = branch_for_strategy([{"json": {"action_requests": [call("first"), call("second")]}}])
    await b.operate(instruct=Instruct(instruction="x", actions=True), action_strategy="sequential")
    assert not overlapped(log)
