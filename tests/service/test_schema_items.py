"""A reply is held to the whole ``responseFormat`` (docs/PROTOCOL.md §5), the constraints inside
an array's ``items``, a map's value schema (``additionalProperties``), an ``anyOf``'s parts and
what a ``$ref`` names included: the model builder (json-schema-to-pydantic) holds only the
types there, and ``server.service.schemas`` finds, location by location in the built model,
what it does not hold, to have the reply checked against the whole schema. The schema the
model is shown (a local model's grammar is made from it) keeps those constraints too. A schema
the built model holds whole gets no second check."""

from __future__ import annotations

import asyncio

import pytest

from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.errors import map_exception
from operate_sidecar.server.service.schemas import SchemaCache
from operate_sidecar.server.service.service import Service

from service_support import Port

WAIT = 60  # seconds: every wait here is bounded

DEFS = {"Short": {"type": "string", "maxLength": 3},
        "Reason": {"type": "array", "items": {"type": "string", "minLength": 2}}}

#: (a property's schema, a value that breaks it, one that keeps it)
NOT_HELD_BY_THE_BUILDER = [
    ({"type": "array", "items": {"type": "string", "maxLength": 3}}, ["waytoolong", "b"], ["abc", "b"]),
    ({"type": "array", "items": {"type": "string", "pattern": "^[a-z]$"}}, ["ABC"], ["a"]),
    ({"type": "array", "items": {"type": "integer", "maximum": 5}}, [99], [5]),
    ({"type": "array", "items": {"type": "array", "items": {"type": "number", "minimum": 0}}}, [[1, -1]], [[1, 0]]),
    ({"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"const": "n"}]}}, [-1], [0, "n"]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"a": "not-an-int"}, {"a": 1}),
    ({"type": "object", "additionalProperties": {"type": "string", "maxLength": 2}}, {"a": "abc"}, {"a": "ab"}),
    ({"type": "object", "additionalProperties": False}, {"a": 1}, {}),
    ({"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]}, "abc", "ab"),
    ({"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}, 0, 1),
    ({"$ref": "#/$defs/Short"}, "abcd", "abc"),
    ({"type": "array", "items": {"$ref": "#/$defs/Short"}}, ["abcd"], ["abc"]),
    # a null type beside an enum without null: the builder's nullable literal takes null
    ({"type": ["string", "null"], "enum": ["x", "y"]}, None, "x"),
]
IDS = ["items-maxLength", "items-pattern", "items-maximum", "items-of-items", "items-anyOf-part", "map-type",
       "map-maxLength", "map-false", "anyOf-part", "anyOf-null-part", "ref", "items-ref", "nullable-enum"]


def _schema(prop: object) -> dict:
    return {"type": "object", "title": "R", "properties": {"v": prop}, "required": ["v"], "$defs": DEFS}


def _takes(model: type, value: object) -> bool:
    try:
        model.model_validate({"v": value})
        return True
    except ValueError:  # pydantic's ValidationError
        return False


def _checked_whole(model: type) -> bool:
    return "held_to_schema" in model.__pydantic_decorators__.model_validators


@pytest.mark.parametrize("prop, bad, good", NOT_HELD_BY_THE_BUILDER, ids=IDS)
def test_a_constraint_the_builder_drops_holds_the_reply(prop, bad, good):
    model = SchemaCache().model_for(_schema(prop))
    assert _checked_whole(model)
    assert (_takes(model, bad), _takes(model, good)) == (False, True)


def _as_field(case: tuple) -> bool:
    """A case a field model is held to the same way: no ``$ref``, and no null refused (a field's
    null is not checked: a null default may make any field take it)."""
    return "$ref" not in str(case[0]) and case[1] is not None


@pytest.mark.parametrize("prop, bad, good", [c for c in NOT_HELD_BY_THE_BUILDER if _as_field(c)],
                         ids=[i for i, c in zip(IDS, NOT_HELD_BY_THE_BUILDER) if _as_field(c)])
def test_a_field_models_schema_holds_the_value_the_same_way_and_shows_the_constraint(prop, bad, good):
    from pydantic import TypeAdapter

    from operate_sidecar.server.core.operative import Step
    from operate_sidecar.server.core.render import request_schema_of

    spec = SchemaCache().spec_for({"name": "v", "schema": prop})
    adapter = TypeAdapter(spec.annotation)
    assert adapter.validate_python(good) == good
    with pytest.raises(ValueError):
        adapter.validate_python(bad)
    shown, _, _ = request_schema_of(Step.request_operative(fields={"v": spec}).response_type)
    assert shown["properties"]["v"] == {**prop, "title": "V"}


@pytest.mark.parametrize("prop", [
    {"type": "string", "pattern": "^x", "maxLength": 4, "minLength": 0, "description": "d"},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}},
    {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"const": "n"}]}},
    {"type": "array", "items": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}},
                                "required": ["q"]}},
    {"type": ["string", "null"], "maxLength": 3},
    {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    {"type": "integer", "minimum": 0, "exclusiveMaximum": 10, "multipleOf": 2},
    {"type": "object", "additionalProperties": False, "properties": {"d": {"enum": [1, 2]}}, "x-ui": 1},
    {"type": "object", "additionalProperties": True},
    {"$ref": "#/$defs/Colour"},
    {"$ref": "#/$defs/Node"},
], ids=["string", "array", "items-enum", "items-anyOf", "items-object", "nullable", "anyOf-null", "integer",
        "object", "map-any", "ref-enum", "ref-recursive"])
def test_a_schema_the_builder_holds_whole_gets_no_second_check(prop):
    """The fast path: the whole schema's check (tens of microseconds a reply) only where needed."""
    schema = {"type": "object", "title": "R", "properties": {"v": prop}, "$defs": {
        "Colour": {"type": "string", "enum": ["red", "green"]},
        "Node": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9},
                                                  "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}}
    assert not _checked_whole(SchemaCache().model_for(schema))


def test_the_schema_shown_with_the_pipelines_fields_keeps_the_clients_and_both_definitions():
    """An ``actions`` operate with ``reason``: the pipeline's own fields and definitions stay,
    and a client's definition with the name of one of them (``Reason``) is renamed."""
    from jsonschema import Draft202012Validator

    from operate_sidecar.server.core.operative import Step
    from operate_sidecar.server.core.render import request_schema_of

    schema = {"type": "object", "title": "R", "$defs": DEFS, "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "uniqueItems": True},
        "why": {"$ref": "#/$defs/Reason"}}}
    model = SchemaCache().model_for(schema)
    operative = Step.request_operative(base_type=model, reason=True, actions=True)
    shown, _, _ = request_schema_of(operative.response_type)
    assert shown["properties"]["tags"] == schema["properties"]["tags"]
    assert shown["properties"]["why"] == {"$ref": "#/$defs/Reason_1"}
    assert shown["$defs"]["Reason_1"] == DEFS["Reason"] and "confidence_score" in shown["$defs"]["Reason"]["properties"]
    assert {"reason", "action_requests"} <= set(shown["properties"])
    Draft202012Validator.check_schema(shown)
    fits = {"tags": ["a"], "why": ["ab"], "reason": {"title": "t"}, "action_requests": [{"function": "f"}]}
    assert not list(Draft202012Validator(shown).iter_errors(fits))
    assert list(Draft202012Validator(shown).iter_errors({**fits, "why": ["a"]}))


def test_over_the_service_a_reply_breaking_a_constraint_inside_is_refused_and_the_provider_is_shown_it(tmp_path):
    """Through the service, with a scripted model: a reply breaking the schema is -32010 under
    ``handleValidation: "raise"`` (it was a result of kind "model"), one keeping it is the result,
    and the schema the provider was sent holds the client's property (and its definitions); a
    local model's grammar is made from that schema, bounded as ``bound_schema`` bounds it."""
    from operate_sidecar.server.models._common import bound_schema

    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": []}},
                                               "defaultModel": "s", "stateDir": str(tmp_path / "state")}))
    no_retry = {"retryAttempts": 0, "retryInitialDelay": 0}

    async def main() -> None:
        svc = Service(Port(settings))
        try:
            for i, (prop, bad, good) in enumerate(NOT_HELD_BY_THE_BUILDER):
                bid = (await svc.createBranch({}))["branchId"]
                params = {"branchId": bid, "instruction": "x", "responseFormat": _schema(prop)}
                breaking = {"provider": "scripted", "responses": [{"json": {"v": bad}}] * 2}
                with pytest.raises(Exception) as e:
                    await asyncio.wait_for(svc.operate({**params, "chatModel": breaking, "handleValidation": "raise",
                                                        "parseOptions": no_retry}), WAIT)
                assert map_exception(e.value)[0] == -32010, (IDS[i], e.value)
                keeping = {"provider": "scripted", "responses": [{"json": {"v": good}}]}
                out = await asyncio.wait_for(svc.operate({**params, "chatModel": keeping}), WAIT)
                assert (out["kind"], out["result"]) == ("model", {"v": good}), (IDS[i], out)
                [request] = svc.resolve_model(keeping).requests
                sent = request.response_schema
                assert sent["properties"]["v"] == prop, (IDS[i], sent)
                if "$ref" in str(prop):
                    assert sent["$defs"]["Short"] == DEFS["Short"], (IDS[i], sent)
                if i == 0:  # (a local model's grammar: strings no longer than the client's 3, not 200)
                    assert bound_schema(sent)["properties"]["v"]["items"]["maxLength"] == 3
        finally:
            await svc.aclose()

    asyncio.run(main())
