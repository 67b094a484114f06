"""What a responseFormat / fieldModels schema becomes (``server.service.schemas``): the JSON
Schema forms the model builder (json-schema-to-pydantic) gets wrong are written in forms it
enforces, or refused naming where, so that a reply is held to the schema the client wrote."""

from __future__ import annotations

import pytest

from operate_sidecar.server.service.schemas import SchemaCache


def _accepts(schema_a: object, values: list) -> list[bool]:
    """Which of ``values`` a reply ``{"a": value}`` may hold under ``{"properties": {"a": schema_a}}``."""
    model = SchemaCache().model_for({"type": "object", "title": "T", "properties": {"a": schema_a},
                                     "$defs": {"Colour": {"type": "string", "enum": ["red", "green"]},
                                               "Named": {"type": "object", "properties": {"n": {"type": "string"}},
                                                         "required": ["n"]}}})
    out = []
    for v in values:
        try:
            model.model_validate({"a": v})
            out.append(True)
        except Exception:  # noqa: BLE001 - pydantic's ValidationError
            out.append(False)
    return out


@pytest.mark.parametrize("schema_a, values, expected", [
    # a described reference, as pydantic 1 and other generators write it (no value fitted it)
    ({"allOf": [{"$ref": "#/$defs/Colour"}], "description": "the colour"}, ["red", "blue", 1], [True, False, False]),
    ({"allOf": [{"$ref": "#/$defs/Named"}], "description": "who"}, [{"n": "x"}, {}, "x"], [True, False, False]),
    # keywords added to a type through allOf (no value fitted it)
    ({"type": "string", "allOf": [{"minLength": 2}]}, ["ab", "a", 5], [True, False, False]),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}, {}]}, [3, 2, 3.5], [True, False, False]),
    # object parts are merged as before
    ({"allOf": [{"type": "object", "properties": {"p": {"type": "string"}}},
                {"type": "object", "properties": {"q": {"type": "integer"}}}]},
     [{"p": "x", "q": 1}, {"p": 1}], [True, False]),
    # true: any value (it broke the build with an AttributeError), in every place a schema goes
    (True, ["x", 1, None, [1], {"k": 1}], [True] * 5),
    ({"anyOf": [True, {"type": "string"}]}, ["x", 1], [True, True]),
    ({"type": "array", "items": True}, [[1, "x"], "x"], [True, False]),
    # "items": false is only the empty array (any array passed)
    ({"type": "array", "items": False}, [[], [1]], [True, False]),
    # what the builder does not enforce, held by the whole schema's check: uniqueItems (made a set:
    # objects never fitted and repeats were dropped), min/maxProperties, a map's value schema
    ({"type": "array", "uniqueItems": True}, [[1, 2], [1, 1]], [True, False]),
    ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, [[{"k": 1}, {"k": 2}], [{"k": 1}, {"k": 1}]],
     [True, False]),
    ({"type": "object", "minProperties": 1, "maxProperties": 2}, [{"k": 1}, {}, {"i": 1, "j": 2, "k": 3}],
     [True, False, False]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{"k": 1}, {"k": "x"}], [True, False]),
    ({"type": "array", "items": {"type": "object", "properties": {"p": {"type": "array", "uniqueItems": True}}}},
     [[{"p": [1, 2]}], [{"p": [2, 2]}]], [True, False]),
    # oneOf is exactly one of its parts (the builder's union took a value fitting two)
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, [1.5, 1], [True, False]),
    # a field left out is not checked against its schema (its default, null, is the model's)
    ({"type": "object", "properties": {"p": {"type": "string"}, "q": {"type": "string"}}, "required": ["p"]},
     [{"p": "x"}, {"q": "x"}], [True, False]),
])
def test_a_schema_the_builder_got_wrong_holds_a_reply_to_what_it_says(schema_a, values, expected):
    assert _accepts(schema_a, values) == expected


@pytest.mark.parametrize("schema_a, path, words", [
    (False, "/properties/a", "false, which no value matches"),
    ({"oneOf": [False, {"type": "string"}]}, "/properties/a/oneOf/0", "false, which no value matches"),
    ({"$ref": "#"}, "/properties/a/$ref", "'#/$defs/<name>'"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "/properties/a/allOf/1/type", "sets 'type' differently"),
    # valid JSON Schema the builder failed on with its exception's name and no path
    ({"type": "string", "enum": []}, "/properties/a/enum", "an empty enum at /properties/a allows no value"),
    ({"$ref": "#/$defs/Nope"}, "/properties/a/$ref", "'#/$defs/Nope' at /properties/a points at nothing"),
    ({"type": "array", "items": {"$ref": "#/properties/b"}}, "/properties/a/items/$ref", "points at nothing"),
])
def test_a_schema_the_builder_cannot_take_is_refused_in_one_line_naming_where(schema_a, path, words):
    from operate_sidecar.server.service.errors import RpcError

    with pytest.raises(RpcError) as e:
        SchemaCache().model_for({"type": "object", "title": "T", "properties": {"a": schema_a}})
    assert e.value.code == -32602 and e.value.data["path"] == path, e.value.data
    assert words in e.value.message and "\n" not in e.value.message, e.value.message


def test_field_models_take_the_same_schemas():
    from pydantic import TypeAdapter, ValidationError

    spec = SchemaCache().spec_for({"name": "c", "schema": {"allOf": [{"type": "string"}, {"maxLength": 1}]}})
    adapter = TypeAdapter(spec.annotation)
    assert adapter.validate_python("x") == "x"
    with pytest.raises(ValidationError):
        adapter.validate_python("xy")


def test_the_whole_schemas_check_covers_only_the_clients_fields_of_a_derived_type():
    """The pipeline derives types from the model (an ``actions`` operate adds the tool fields):
    ``additionalProperties: false`` holds the client's fields, not those."""
    from pydantic import create_model

    model = SchemaCache().model_for({"type": "object", "title": "T", "additionalProperties": False,
                                     "properties": {"a": {"type": "array", "uniqueItems": True}}})
    derived = create_model("TResponse", __base__=model, action_required=(bool, False))
    assert derived.model_validate({"a": [1], "action_required": True}).action_required is True
    with pytest.raises(ValueError, match="non-unique"):
        derived.model_validate({"a": [1, 1]})


def test_a_reply_refused_by_the_whole_schemas_check_names_where():
    from pydantic import ValidationError

    model = SchemaCache().model_for({"type": "object", "title": "T", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    with pytest.raises(ValidationError) as e:
        model.model_validate({"tags": ["x", "x"]})
    assert "not a value of the schema at /tags" in str(e.value) and "non-unique" in str(e.value)


def test_a_schema_the_builder_holds_by_itself_is_not_checked_twice():
    """The whole schema's check (~30 us a reply) is added only where the schema uses a keyword
    the builder does not hold a reply to."""
    held = {"type": "object", "title": "T", "required": ["a"], "properties": {
        "a": {"type": "string", "pattern": "^x", "description": "d"},
        "b": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"const": "n"}]}, "maxItems": 3},
        "c": {"type": "object", "additionalProperties": False, "properties": {"d": {"enum": [1, 2]}}, "x-ui": 1}}}
    assert "held_to_schema" not in SchemaCache().model_for(held).__pydantic_decorators__.model_validators
    for extra in ({"uniqueItems": True}, {"minItems": 1, "uniqueItems": False}):
        schema = {**held, "properties": {**held["properties"], "b": {**held["properties"]["b"], **extra}}}
        assert "held_to_schema" in SchemaCache().model_for(schema).__pydantic_decorators__.model_validators


@pytest.mark.parametrize("properties, path, words", [
    ({"n": {"type": "integer", "default": "x"}}, "/properties/n/default", "'x' is not of type 'integer'"),
    ({"c": {"$ref": "#/$defs/Colour", "default": "blue"}}, "/properties/c/default", "'blue' is not one of"),
    ({"k": {"type": "object", "properties": {"z": {"type": "array", "items": {"type": "integer"}, "default": [1, "a"]}}}},
     "/properties/k/properties/z/default", "schema at /1: 'a' is not of type 'integer'"),
    ({"s": {"type": "string", "pattern": "^a+$", "default": "b"}}, "/properties/s/default", "does not match"),
])
def test_a_property_default_that_breaks_its_schema_is_refused(properties, path, words):
    """The built model puts a property's default, unchecked, into a reply that leaves it out."""
    from operate_sidecar.server.service.errors import RpcError

    with pytest.raises(RpcError) as e:
        SchemaCache().model_for({"type": "object", "title": "T", "properties": properties,
                                 "$defs": {"Colour": {"type": "string", "enum": ["red", "green"]}}})
    assert e.value.code == -32602 and e.value.data == {"path": path}, e.value.data
    assert words in e.value.message and "\n" not in e.value.message, e.value.message


def test_a_property_default_that_fits_its_schema_or_is_null_is_the_value_of_a_property_left_out():
    model = SchemaCache().model_for({"type": "object", "title": "T", "properties": {
        "n": {"type": "integer", "default": 3}, "s": {"type": "string", "default": None},
        "c": {"$ref": "#/$defs/Colour", "default": "red"}},
        "$defs": {"Colour": {"type": "string", "enum": ["red", "green"]}}})
    assert model.model_validate({}).model_dump(mode="json") == {"n": 3, "s": None, "c": "red"}


def test_a_field_models_property_default_that_breaks_its_schema_is_refused_the_same_way():
    from operate_sidecar.server.service.errors import RpcError

    with pytest.raises(RpcError) as e:
        SchemaCache().spec_for({"name": "c", "schema": {"type": "object", "properties": {
            "n": {"type": "integer", "default": "x"}}}})
    assert e.value.code == -32602 and e.value.data == {"path": "/properties/n/default"}, e.value.data
    assert e.value.message.startswith("fieldModels[0].schema: the default at /properties/n/default"), e.value.message
