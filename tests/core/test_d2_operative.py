"""Step D2 (docs/PIPELINE.md): one generated Operative separates model-request and runtime-response fields."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from operate_sidecar.server.core import (
    ActionRequestModel,
    ActionResponseModel,
    ChatParam,
    Reason,
    Spec,
    Step,
    ToolNotRegistered,
    operate,
)

from .support import NO_REPAIR, Answer, call, make_branch, reply

pytestmark = pytest.mark.anyio


async def test_caller_model_class_from_basemodel_subclass():
    """D2: a BaseModel subclass response format is the caller model class (its mismatch policy applies)."""
    b, _ = make_branch(["not json", "still not json"])
    with pytest.raises(ValueError, match="Answer"):
        await b.operate(instruction="x", response_format=Answer, handle_validation="raise",
                        parse_call_params=NO_REPAIR)


async def test_caller_model_class_from_basemodel_instance_type():
    """D2: a BaseModel instance response format contributes its type as the caller model class."""
    b, m = make_branch([reply(5)])
    out = await b.operate(instruction="x", response_format=Answer(answer=0))
    assert isinstance(out, Answer) and out.answer == 5
    assert m.requests[0].schema_name == "AnswerRequest"


async def test_dict_response_format_reaches_adapter_but_is_not_a_model_class():
    """D2: a dictionary response format is passed to adapters but does not become model_class."""
    schema = {"title": "Thing", "type": "object", "properties": {"answer": {"type": "integer"}}}
    b, m = make_branch(["this is not json at all"])
    out = await b.operate(instruction="x", response_format=schema, handle_validation="raise",
                          parse_call_params=NO_REPAIR)
    assert m.requests[0].response_schema == schema  # passed to the adapter
    assert isinstance(out, str)  # no outer instance check: "raise" did not raise


async def test_no_operative_without_base_actions_fields_or_reason():
    """D2: with none of base class, actions, field specs, reason, no Operative is built: raw text comes back."""
    b, m = make_branch(['{"answer": 1}'])
    out = await b.operate(instruction="x")
    assert out == '{"answer": 1}'
    assert m.requests[0].response_schema is None


@pytest.mark.parametrize("kw, expected_fields", [
    ({"response_format": Answer}, {"answer"}),
    ({"actions": True}, {"action_required", "action_requests", "action_responses"}),
    ({"field_models": [Spec("score", int)]}, {"score"}),
    ({"reason": True}, {"reason"}),
])
async def test_operative_constructed_for_each_trigger(kw, expected_fields):
    """D2: an Operative is constructed when a base class, actions, named field specs, or reasoning is present."""
    b, m = make_branch([{"json": {"answer": 1, "score": 2}}])
    out = await b.operate(instruction="x", **kw)
    assert isinstance(out, BaseModel)
    assert set(type(out).model_fields) == expected_fields
    assert type(out).__name__.endswith("Response")


def test_reason_adds_nullable_reason_field():
    """D2: reason=True adds the nullable Reason field."""
    op = Step.respond_operative(Step.request_operative(reason=True))
    f = op.response_type.model_fields["reason"]
    assert not f.is_required()
    assert op.response_type().reason is None
    assert op.response_type(reason={"title": "t", "content": "c", "confidence_score": 0.5}).reason == \
        Reason(title="t", content="c", confidence_score=0.5)


def test_actions_add_action_required_requests_and_responses():
    """D2: actions=True adds action_required, action_requests and action_responses (nullable/listable)."""
    op = Step.respond_operative(Step.request_operative(actions=True))
    rt = op.response_type
    inst = rt()
    assert (inst.action_required, inst.action_requests, inst.action_responses) == (None, None, None)
    full = rt(action_required=True, action_requests=[{"function": "f", "arguments": {"a": 1}}],
              action_responses=[{"function": "f", "arguments": {}, "output": 1}])
    assert full.action_requests == [ActionRequestModel(function="f", arguments={"a": 1})]
    assert full.action_responses == [ActionResponseModel(function="f", arguments={}, output=1)]


def test_named_field_specs_added_by_name():
    """D2: named field specs are added by name."""
    op = Step.respond_operative(Step.request_operative(fields={"score": Spec("score", int),
                                                               "tags": Spec("tags", str, listable=True,
                                                                            nullable=True)}))
    assert set(op.response_type.model_fields) == {"score", "tags"}
    assert op.response_type(score=1, tags=["a"]).tags == ["a"]


def test_request_operative_excludes_action_responses_from_request():
    """D2: request_exclude={"action_responses"} when actions are present; the response model has all specs."""
    op = Step.request_operative(base_type=Answer, actions=True, reason=True)
    assert op.request_exclude == frozenset({"action_responses"})
    op = Step.respond_operative(op)
    assert "action_responses" not in op.request_type.model_fields
    assert {"answer", "reason", "action_required", "action_requests"} <= set(op.request_type.model_fields)
    assert "action_responses" in op.response_type.model_fields
    assert issubclass(op.response_type, op.request_type) and issubclass(op.request_type, Answer)
    assert Step.request_operative(reason=True).request_exclude == frozenset()


def test_respond_operative_additional_fields_join_the_response():
    """D2: Step.respond_operative() materializes the response model from all specs (plus additional_fields)."""
    op = Step.respond_operative(Step.request_operative(base_type=Answer), {"extra": Spec("extra", str,
                                                                                          nullable=True)})
    assert "extra" in op.response_type.model_fields


def test_generated_names_from_base_type():
    """D2: names come from the base type with Request/Response suffixes (AnswerRequest/AnswerResponse)."""
    op = Step.respond_operative(Step.request_operative(base_type=Answer, actions=True))
    assert (op.request_type.__name__, op.response_type.__name__) == ("AnswerRequest", "AnswerResponse")


def test_generated_names_fallback_to_operative():
    """D2: without a name or base type the name is "Operative"."""
    op = Step.respond_operative(Step.request_operative(reason=True))
    assert (op.request_type.__name__, op.response_type.__name__) == ("OperativeRequest", "OperativeResponse")


def test_generated_names_from_explicit_name():
    """D2: an explicit name wins over the base type name."""
    op = Step.respond_operative(Step.request_operative(name="Plan", base_type=Answer))
    assert (op.request_type.__name__, op.response_type.__name__) == ("PlanRequest", "PlanResponse")


def test_only_pydantic_adapter_ships():
    """D2: the only shipped adapter is "pydantic"."""
    assert Step.request_operative().adapter == "pydantic"
    with pytest.raises(ValueError):
        Step.request_operative(adapter="msgspec")


def test_operative_max_retries_defaults_to_three():
    """D2: Operative.max_retries defaults to 3."""
    assert Step.request_operative().max_retries == 3


async def test_request_schema_sent_to_model_excludes_action_responses(record):
    """D2 / DESIGN: the provider request schema never contains action_responses."""
    b, m = make_branch([reply(1)], tools=(record,))
    await b.operate(instruction="x", response_format=Answer, actions=True)
    req = m.requests[0]
    assert req.schema_name == "AnswerRequest"
    assert "action_requests" in req.response_schema["properties"]
    assert "action_responses" not in json.dumps(req.response_schema)
    assert "action_responses" not in json.dumps(req.messages)
    ins = next(msg for msg in b.messages if msg.kind == "instruction")
    assert ins.content["responseSchema"] == req.response_schema


async def test_invented_action_responses_are_discarded_without_requests(record):
    """D2 / DESIGN: action_responses the model invents never reach the result."""
    fake = [{"function": "record", "arguments": {"x": 1}, "output": "FABRICATED"}]
    b, _ = make_branch([reply(1, action_responses=fake)], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert out.action_responses is None
    assert not record.ran


async def test_invented_action_responses_replaced_by_real_tool_results(record):
    """D2 / docs/PROTOCOL.md §5: action_responses holds only what tools returned."""
    fake = [{"function": "record", "arguments": {"x": 1}, "output": "FABRICATED"},
            {"function": "ghost", "arguments": {}, "output": 99}]
    b, _ = make_branch([reply(1, call(x=4), action_responses=fake)], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert [r.output for r in out.action_responses] == [{"doubled": 8}]


async def test_generated_response_type_targets_both_rendering_and_parsing(record):
    """D2: the generated type replaces the chat and parse response formats (same superset model)."""
    b, m = make_branch(["no json here", reply(2, call(x=1))], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True, parse_call_params=NO_REPAIR)
    chat_req, repair_req = m.requests[0], m.requests[1]
    assert repair_req.purpose == "parse"
    assert chat_req.schema_name == repair_req.schema_name == "AnswerRequest"
    assert type(out).__name__ == "AnswerResponse" and isinstance(out, Answer)


async def test_tool_schemas_published_for_selected_tools(record, other):
    """D2: with an ActionParam the coordinator publishes the selected tools' schemas."""
    b, m = make_branch([reply(1)], tools=(record, other))
    await b.operate(instruction="x", response_format=Answer, actions=True, tools=["other"])
    assert [s["function"]["name"] for s in m.requests[0].tool_schemas] == ["other"]


async def test_all_tool_schemas_published_without_selector(record, other):
    """D2: without a selector all registered tools are published, as a list (the {"tools": ...} wrapper unwrapped)."""
    b, m = make_branch([reply(1)], tools=(record, other))
    await b.operate(instruction="x", response_format=Answer, actions=True)
    schemas = m.requests[0].tool_schemas
    assert isinstance(schemas, list)
    assert sorted(s["function"]["name"] for s in schemas) == ["other", "record"]
    ins = next(msg for msg in b.messages if msg.kind == "instruction")
    assert ins.content["toolSchemas"] == schemas


async def test_published_tool_schemas_replace_caller_tool_schemas(record):
    """D1/D2: caller tool_schemas are replaced by the selected branch tools whenever an ActionParam exists."""
    caller = [{"type": "function", "function": {"name": "caller_only", "parameters": {}}}]
    b, m = make_branch([reply(1)], tools=(record,))
    await b.operate(instruction="x", response_format=Answer, actions=True, tool_schemas=caller)
    assert [s["function"]["name"] for s in m.requests[0].tool_schemas] == ["record"]


async def test_caller_tool_schemas_kept_without_action_param(record):
    """D2: without an ActionParam the caller's tool_schemas are the effective ones."""
    caller = [{"type": "function", "function": {"name": "caller_only", "parameters": {}}}]
    b, m = make_branch([reply(1)], tools=(record,))
    await b.operate(instruction="x", response_format=Answer, tool_schemas=caller)
    assert m.requests[0].tool_schemas == caller


async def test_unknown_tool_in_selection_raises_before_any_model_call(record):
    """D2: get_tool_schema for an unregistered name raises before the model is called."""
    b, m = make_branch([reply(1)], tools=(record,))
    with pytest.raises(ToolNotRegistered):
        await b.operate(instruction="x", response_format=Answer, actions=True, tools=["nope"])
    assert m.calls == 0
    assert len(b.messages) == 0


async def test_direct_operate_builds_operative_from_chat_param():
    """D2: the coordinator (operate()) builds the Operative itself from chat_param.response_format."""
    b, m = make_branch([reply(3)])
    out = await operate(b, "x", ChatParam(response_format=Answer, imodel=b.chat_model))
    assert type(out).__name__ == "AnswerResponse" and out.answer == 3


async def test_empty_tool_selection_publishes_no_schemas_and_denies(record):
    """D2: only an absent selector means all tools; an empty selection publishes none and runs none."""
    b, m = make_branch([reply(1, call(x=1))], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True, tools=[])
    assert not m.requests[0].tool_schemas
    assert not record.ran
    assert out.action_responses[0].output["error"] == "denied by governance gate"


def test_field_order_follows_the_reference_and_later_entries_override():
    """Reference (st:21-165): reason, then action_required/action_requests/action_responses, then
    the caller's fields, in that order; a caller field with the same name overrides."""
    op = Step.respond_operative(Step.request_operative(
        reason=True, actions=True, fields={"answer": Spec("answer", str), "reason": Spec("reason", str)}))
    # the response type extends the request type, so the runtime-only field comes last there
    assert list(op.response_type.model_fields) == ["reason", "action_required", "action_requests", "answer",
                                                   "action_responses"]
    assert op.response_type.model_fields["reason"].annotation is str
    schema_props = list(op.request_type.model_json_schema()["properties"])
    assert schema_props == ["reason", "action_required", "action_requests", "answer"]


def test_repeated_action_requests_are_kept_once_and_explicit_nulls_normalised():
    """Reference: action_requests dedupes (same function and arguments, first-seen order) and an
    explicit null becomes []; action_required null becomes False. Absent fields stay None."""
    rt = Step.respond_operative(Step.request_operative(actions=True)).response_type
    got = rt(action_requests=[{"function": "f", "arguments": {"a": 1, "b": 2}},
                              {"function": "g", "arguments": {}},
                              {"function": "f", "arguments": {"b": 2, "a": 1}},
                              {"function": "f", "arguments": {"a": 2}}])
    assert [(r.function, r.arguments) for r in got.action_requests] == [("f", {"a": 1, "b": 2}), ("g", {}),
                                                                       ("f", {"a": 2})]
    nulls = rt(action_required=None, action_requests=None)
    assert (nulls.action_required, nulls.action_requests) == (False, [])
    assert (rt().action_required, rt().action_requests) == (None, None)


@pytest.mark.parametrize("given, kept", [(0.87654, 0.877), ("0.5", 0.5), (0, 0.0), (1, 1.0), (1.5, -1.0),
                                         (-0.1, -1.0), ("high", -1.0), (None, None)])
def test_reason_confidence_score_is_a_rounded_fraction_or_minus_one(given, kept):
    """Reference: confidence_score goes through to_num(0..1, precision=3); invalid → -1."""
    assert Reason(confidence_score=given).confidence_score == kept


async def test_a_repeated_tool_call_runs_once(record):
    """A model that repeats the same call in one reply (small local models do) gets one run."""
    same = call("record", x=2)
    b, _ = make_branch([reply(1, same, call("record", x=3), same, same)], tools=(record,))
    out = await b.operate(instruction="go", response_format=Answer, actions=True)
    assert record.calls == [{"x": 2, "note": ""}, {"x": 3, "note": ""}]
    assert [r.output for r in out.action_responses] == [{"doubled": 4}, {"doubled": 6}]


def test_generated_types_are_cached_within_a_bound_and_evicted_ones_are_freed():
    """The generated types are cached (the same spec builds once), least recently used out past
    ``CACHE_LIMIT``: every distinct response format was kept for the life of the process (about
    80 KB each: 3,000 formats held 250 MB), its types never freed."""
    import gc
    import weakref

    from pydantic import create_model

    from operate_sidecar.server.core import operative as operative_module

    def generated(i: int) -> type[BaseModel]:
        base = create_model(f"Distinct{i}", a=(str, ...))
        return Step.respond_operative(Step.request_operative(base_type=base, actions=True)).response_type

    first = generated(0)
    kept = generated(1)
    watched = weakref.ref(first)
    del first
    limit = operative_module.CACHE_LIMIT
    for i in range(2, limit + 10):
        if i % 100 == 0:  # used now and then: a recently used entry stays
            assert Step.respond_operative(Step.request_operative(base_type=kept.__mro__[2], actions=True)
                                          ).response_type is kept
        generated(i)
    assert len(operative_module._cache) <= limit
    gc.collect()
    assert watched() is None  # the least recently used entry went, and nothing else held its types
    assert Step.respond_operative(Step.request_operative(base_type=kept.__mro__[2], actions=True)
                                  ).response_type is kept
