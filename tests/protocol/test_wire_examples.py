"""Every message of docs/PROTOCOL.md structures from an example and unstructures back to it."""

import json
from pathlib import Path

import pytest

from operate_sidecar import protocol
from operate_sidecar.protocol import catalog, structure, unstructure

from protocol_examples import EXAMPLES, PROGRESS_VALUES

SCHEMA = json.loads((Path(protocol.__file__).with_name("schema.json")).read_text())


def _type_of(method: str, part: str):
    return catalog.params_type(method) if part == "params" else catalog.result_type(method)


def _all_methods():
    return (list(catalog.REQUESTS) + list(catalog.SERVER_TO_CLIENT_REQUESTS)
            + list(catalog.NOTIFICATIONS) + list(catalog.SERVER_NOTIFICATIONS))


def test_every_method_has_examples():
    expected = set()
    for method in _all_methods():
        expected.add((method, "params"))
        if method in catalog.REQUESTS or method in catalog.SERVER_TO_CLIENT_REQUESTS:
            expected.add((method, "result"))
    assert expected == set(EXAMPLES)


@pytest.mark.parametrize("key", sorted(k for k, v in EXAMPLES.items() if v is not None), ids=str)
def test_example_structures_and_round_trips(key):
    method, part = key
    obj = structure(_type_of(method, part), EXAMPLES[key])
    assert type(obj) is _type_of(method, part)
    assert unstructure(obj) == EXAMPLES[key]


def test_shutdown_result_is_null():
    assert catalog.result_type("shutdown") is None
    assert SCHEMA["methods"]["shutdown"]["result"] == {"type": "null"}


@pytest.mark.parametrize("value", PROGRESS_VALUES, ids=lambda v: v["kind"] + "-" + v["message"])
def test_progress_values_structure_by_kind(value):
    params = structure(protocol.ProgressParams, {"token": 7, "value": value})
    expected = {"begin": protocol.WorkDoneProgressBegin, "report": protocol.WorkDoneProgressReport,
                "end": protocol.WorkDoneProgressEnd}[value["kind"]]
    assert type(params.value) is expected
    assert unstructure(params) == {"token": 7, "value": value}


def test_message_content_class_follows_kind():
    result = structure(protocol.BranchMessagesResult, EXAMPLES[("branchMessages", "result")])
    assert [type(m.content) for m in result.messages] == [
        protocol.SystemContent, protocol.InstructionContent, protocol.AssistantResponseContent,
        protocol.ActionRequestContent, protocol.ActionResponseContent]


def test_model_configs_structure_by_provider():
    models = structure(protocol.InitializeParams, EXAMPLES[("initialize", "params")]).settings.models
    assert {k: type(v) for k, v in models.items()} == {
        "small": protocol.LocalModelConfig, "gpt": protocol.OpenAIModelConfig,
        "claude": protocol.CliModelConfig, "test": protocol.ScriptedModelConfig}
    assert models["test"].responses[0] == "plain text"
    assert models["test"].responses[1] == protocol.ScriptedEntry(json={"answer": 4}, delay_ms=5)


def test_examples_are_valid_against_schema_json():
    jsonschema = pytest.importorskip("jsonschema")
    for (method, part), value in EXAMPLES.items():
        table = SCHEMA["methods"] if method in SCHEMA["methods"] else SCHEMA["notifications"]
        sub = {"$defs": SCHEMA["$defs"], **table[method][part]}
        jsonschema.Draft202012Validator(sub).validate(value)


def test_schema_json_rejects_what_structure_rejects():
    jsonschema = pytest.importorskip("jsonschema")
    sub = {"$defs": SCHEMA["$defs"], **SCHEMA["methods"]["operate"]["params"]}
    validator = jsonschema.Draft202012Validator(sub)
    for bad in ({"branchId": "b", "bogus": 1}, {"branchId": "b", "actionStrategy": "parallel"},
                {"branchId": "b", "chatModel": {"provider": "openai"}}, {}):
        assert not validator.is_valid(bad), bad
        with pytest.raises(protocol.ParamsError):
            structure(protocol.OperateParams, bad)
