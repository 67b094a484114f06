"""The pipeline's consequences (docs/PIPELINE.md): each bullet that states observable behaviour."""

from __future__ import annotations

import json
from typing import Any

import pytest

from operate_sidecar.server.core import DENIED, ActionParam, ChatParam, Step, ValidationFailed, operate

from .support import NO_REPAIR, Answer, call, kinds, make_branch, reply

pytestmark = pytest.mark.anyio


class MappingMiddle:
    """A contributor's adapter: satisfies Middle only, executes nothing itself."""

    def __init__(self, value: dict) -> None:
        self.value = value
        self.awaited = 0

    async def __call__(self, branch, instruction, chat_param, parse_param, clear_messages=False, *,
                       skip_validation=False) -> Any:
        self.awaited += 1
        branch.messages.add("instruction", {"instruction": instruction, "guidance": None, "context": None,
                                            "responseSchema": None, "toolSchemas": chat_param.tool_schemas})
        return self.value


@pytest.mark.parametrize("cli", [False, True], ids=["api", "cli"])
async def test_api_and_cli_share_schema_authorization_and_enrichment(cli, record, other):
    """Consequences: API and CLI adapters share one generated schema, authorization path and enrichment."""
    b, m = make_branch([reply(1, call("record", x=1), call("other"))], cli=cli, tools=(record, other))

    async def deny_other(inv):
        return inv.function != "other"

    b.authorizer = deny_other
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert m.requests[0].purpose == ("run" if cli else "chat")
    assert m.requests[0].schema_name == "AnswerRequest"
    assert "action_responses" not in m.requests[0].response_schema["properties"]
    assert type(out).__name__ == "AnswerResponse"
    assert [r.output for r in out.action_responses] == [{"doubled": 2}, {"error": DENIED, "function": "other"}]
    assert not other.ran


@pytest.mark.parametrize("cli", [False, True], ids=["api", "cli"])
async def test_api_and_cli_share_validation_policy(cli, record):
    """Consequences: the same mismatch policy applies for API and CLI adapters."""
    b, _ = make_branch(["prose only", "still prose"], cli=cli, tools=(record,))
    with pytest.raises(ValidationFailed):
        await b.operate(instruction="x", response_format=Answer, actions=True, handle_validation="raise",
                        parse_call_params=NO_REPAIR)
    assert not record.ran


async def test_model_sees_only_request_side_and_responses_attach_after_execution(record):
    """Consequences: the model sees only action requests; runtime action responses attach after execution."""
    b, m = make_branch([reply(1, call(x=1))], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    sent = json.dumps({"messages": m.requests[0].messages, "schema": m.requests[0].response_schema})
    assert "action_requests" in sent and "action_responses" not in sent
    assert out.action_responses[0].output == {"doubled": 2}
    assert kinds(b) == ["instruction", "assistant_response", "action_request", "action_response"]


async def test_text_resembling_a_call_has_no_side_effect(record):
    """Consequences: returning text that resembles a call causes no tool side effect."""
    b, _ = make_branch(['I will now call record with {"x": 1}. record(x=1)'], tools=(record,))
    out = await b.operate(instruction="x", actions=True)
    assert not record.ran
    assert getattr(out, "action_responses", None) is None
    assert not any(k.startswith("action") for k in kinds(b))


async def test_action_requests_without_action_param_have_no_side_effect(record):
    """Consequences: action_requests returned when no ActionParam exists cause no tool side effect."""
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer)  # actions not enabled
    assert isinstance(out, Answer) and not record.ran
    value = {"action_requests": [call(x=1)]}
    out = await b.operate(instruction="x", middle=MappingMiddle(value))
    assert out is value and not record.ran


@pytest.mark.parametrize("policy", ["return_value", "return_none", "raise"])
async def test_mismatch_policy_prevents_side_effects(policy, record):
    """Consequences: a caller-model mismatch returns or raises before action execution."""
    bad = {"json": {"answer": {"not": "an int"}, "action_requests": [call(x=1)]}}
    b, m = make_branch([bad, bad], tools=(record,))
    kw = dict(instruction="x", response_format=Answer, actions=True, handle_validation=policy,
              parse_call_params=NO_REPAIR)
    if policy == "raise":
        with pytest.raises(ValidationFailed):
            await b.operate(**kw)
    else:
        out = await b.operate(**kw)
        assert out is None if policy == "return_none" else isinstance(out, str)
    assert m.calls == 2  # the reply and one repair turn
    assert not record.ran


class ValidMiddle:
    """An adapter whose result is always a *valid* instance of the generated response type,
    carrying an action request: only the coordinator's gates can keep the tool from running."""

    async def __call__(self, branch, instruction, chat_param, parse_param, clear_messages=False, *,
                       skip_validation=False) -> Any:
        return chat_param.response_format.model_validate({"answer": 1, "action_requests": [call(x=1)]})


@pytest.mark.parametrize("path", ["skip_validation", "mismatch_return_value", "mismatch_return_none",
                                  "mismatch_raise", "invoke_actions_false", "no_requests"])
async def test_every_early_return_path_has_no_side_effect(path, record):
    """Consequences: every return path before D4 is free of tool side effects (and of action messages).

    The adapter result reaches the coordinator already valid and carrying a request (or, for the
    mismatch paths, a mapping that carries one), with an ActionParam prepared: each case is kept
    from running the tool by its own gate alone (removing that gate makes it run; see the
    positive control below)."""
    b, _ = make_branch([], tools=(record,))
    kw: dict[str, Any] = dict(action_param=ActionParam(), middle=ValidMiddle())
    if path == "skip_validation":
        kw["skip_validation"] = True
    elif path.startswith("mismatch_"):
        kw["middle"] = MappingMiddle({"answer": "not an int", "action_requests": [call(x=1)]})
        kw["handle_validation"] = path.removeprefix("mismatch_")
    elif path == "invoke_actions_false":
        kw["invoke_actions"] = False
    elif path == "no_requests":
        kw["middle"] = MappingMiddle({"answer": 1})
    if path == "mismatch_raise":
        with pytest.raises(ValidationFailed):
            await operate(b, "x", ChatParam(response_format=Answer), **kw)
    else:
        await operate(b, "x", ChatParam(response_format=Answer), **kw)
    assert not record.ran
    assert not any(k.startswith("action") for k in kinds(b))


async def test_early_return_positive_control_runs_the_tool(record):
    """The same set-up with no gate closed reaches D4: the tool runs once."""
    b, _ = make_branch([], tools=(record,))
    out = await operate(b, "x", ChatParam(response_format=Answer), action_param=ActionParam(), middle=ValidMiddle())
    assert record.calls == [{"x": 1, "note": ""}]
    assert out.action_responses[0].output == {"doubled": 2}


@pytest.mark.parametrize("path", ["skip_validation", "mismatch", "invoke_actions_false", "no_action_param",
                                  "no_requests"])
async def test_every_early_return_path_through_the_facade_has_no_side_effect(path, record):
    """The same paths driven through Branch.operate and the scripted model (end to end in the core)."""
    entries = {
        "skip_validation": reply(1, call(x=1)),
        "mismatch": reply("nope", call(x=1)),
        "invoke_actions_false": reply(1, call(x=1)),
        "no_action_param": reply(1, call(x=1)),
        "no_requests": reply(1),
    }
    kw: dict[str, Any] = dict(instruction="x", response_format=Answer, actions=True, parse_call_params=NO_REPAIR)
    if path == "skip_validation":
        kw["skip_validation"] = True
    elif path == "invoke_actions_false":
        kw["invoke_actions"] = False
    elif path == "no_action_param":
        kw["actions"] = False
    b, _ = make_branch([entries[path], entries[path]], tools=(record,))
    await b.operate(**kw)
    assert not record.ran
    assert not any(k.startswith("action") for k in kinds(b))


async def test_adapter_contributors_only_satisfy_middle_and_share_governance(record):
    """Consequences: a new adapter need only satisfy Middle; act() still authorizes, hooks and records."""
    events: list[str] = []
    b, _ = make_branch([], tools=(record,))
    b.hooks.subscribe(lambda e: events.append(e.type.value))

    async def deny(inv):
        return False

    b.authorizer = deny
    mid = MappingMiddle({"action_requests": [call(x=1)]})
    out = await b.operate(instruction="x", actions=True, middle=mid)
    assert mid.awaited == 1
    assert not record.ran
    assert out["action_responses"][0].output["error"] == DENIED
    assert events == ["denied"]
    assert kinds(b) == ["instruction", "action_request", "action_response"]


async def test_adapter_results_execute_once_through_act(record):
    """Consequences: outer action execution happens once, in the coordinator, not in the adapter."""
    b, _ = make_branch([], tools=(record,))
    mid = MappingMiddle({"action_requests": [call(x=3)]})
    await operate(b, "x", ChatParam(), action_param=ActionParam(), middle=mid)
    assert record.calls == [{"x": 3, "note": ""}]


def test_generated_field_exclusion_matches_enrichment_target():
    """Consequences: request exclusion and response enrichment concern the same generated field."""
    op = Step.respond_operative(Step.request_operative(base_type=Answer, actions=True))
    runtime_only = set(op.response_type.model_fields) - set(op.request_type.model_fields)
    assert runtime_only == set(op.request_exclude) == {"action_responses"}


def test_generated_schema_and_returned_type_are_coupled():
    """Consequences (D2 reversal cost): the returned type is a materialized superset of the request and caller model."""
    op = Step.respond_operative(Step.request_operative(base_type=Answer, actions=True, reason=True))
    assert issubclass(op.response_type, op.request_type)
    assert issubclass(op.request_type, Answer)
    assert set(op.request_type.model_fields) < set(op.response_type.model_fields)
