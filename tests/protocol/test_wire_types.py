"""The converter: camelCase names, strictness, missing params, omission semantics."""

import sys

import pytest

from operate_sidecar import protocol
from operate_sidecar.protocol import (OMITTED, Empty, FieldModel, Instruct, OperateParams, ParamsError, Settings,
                      structure, unstructure)


def test_python_snake_case_becomes_camel_case_on_the_wire():
    params = OperateParams(branch_id="b", work_done_token="t", invoke_actions=False,
                           instruct=Instruct(action_strategy="sequential"))
    wire = unstructure(params)
    assert wire["branchId"] == "b"
    assert wire["workDoneToken"] == "t"
    assert wire["invokeActions"] is False
    assert wire["instruct"] == {"actionStrategy": "sequential"}
    assert not any("_" in k for k in wire)


def test_camel_case_round_trip():
    wire = {"branchId": "b", "parseOptions": {"retryAttempts": 1, "retryInitialDelay": 0.5,
                                              "retryBackoff": 1.85, "maxConcurrent": 1, "throttlePeriod": 1}}
    params = structure(OperateParams, wire)
    assert params.parse_options.retry_attempts == 1
    assert params.parse_options.retry_initial_delay == 0.5
    assert structure(OperateParams, unstructure(params)) == params


def test_unknown_top_level_fields_are_all_named():
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, {"branchId": "b", "request_model": 1, "temprature": 0.2})
    err = info.value
    assert err.code == -32602
    assert err.unknown_fields == ["request_model", "temprature"]
    assert '"request_model"' in err.message and '"temprature"' in err.message
    assert err.to_dict()["data"] == {"unknownFields": ["request_model", "temprature"]}


def test_snake_case_keys_are_unknown_on_the_wire():
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, {"branch_id": "b"})
    assert info.value.unknown_fields == ["branch_id"]


def test_unknown_nested_field_is_named_with_its_path():
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, {"branchId": "b", "fieldModels": [{"name": "x", "schema": {}, "typ": 1}]})
    assert info.value.unknown_fields == ["fieldModels[0].typ"]


def test_unknown_client_capabilities_are_ignored():
    params = structure(protocol.InitializeParams, {"capabilities": {"toolPermission": True, "future": 1},
                                                   "clientInfo": {"name": "nvim", "extra": 2}})
    assert params.capabilities.tool_permission is True
    assert params.client_info.name == "nvim"


@pytest.mark.parametrize("value, path, expected", [
    ({"branchId": 3}, "branchId", "expected string, got integer 3"),
    ({"branchId": "b", "reason": 1}, "reason", "expected boolean, got integer 1"),
    ({"branchId": "b", "instruct": {"actionStrategy": "parallel"}}, "instruct.actionStrategy",
     'expected one of "concurrent", "sequential", got string "parallel"'),
    ({"branchId": "b", "tools": "all"}, "tools", 'expected array or true, got string "all"'),
    ({"branchId": "b", "tools": ["a", 2]}, "tools[1]", "expected string, got integer 2"),
    ({"branchId": "b", "parseOptions": {"retryAttempts": "3"}}, "parseOptions.retryAttempts",
     'expected integer, got string "3"'),
    ({"branchId": "b", "chatModel": {"provider": "cli", "profile": "llm", "command": "llm"}},
     "chatModel.command", 'expected array, got string "llm"'),
    ({"branchId": "b", "chatModel": {"provider": "gemini"}}, "chatModel.provider",
     'expected one of "cli", "local", "openai", "scripted", got string "gemini"'),
    ({"branchId": "b", "responseFormat": []}, "responseFormat", "expected object, got array"),
])
def test_wrong_type_message_names_the_field_path(value, path, expected):
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, value)
    assert info.value.message == f"invalid params: {path}: {expected}"


def test_no_coercion_of_bool_to_int_or_float():
    with pytest.raises(ParamsError):
        structure(protocol.BranchMessagesParams, {"branchId": "b", "limit": True})
    with pytest.raises(ParamsError):
        structure(protocol.ToolEventParams, {"seq": 1, "branchId": "b", "callId": "c", "event": "pre",
                                             "tool": "t", "argsSummary": "", "durationMs": False})


def test_missing_required_field_is_named():
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, {})
    assert info.value.message == "invalid params: branchId: missing required field"


@pytest.mark.parametrize("missing", [None, [], {}])
def test_missing_params_mean_empty_object(missing):
    assert structure(Empty, missing) == Empty()
    assert structure(protocol.ListToolsParams, missing) == protocol.ListToolsParams()


def test_positional_params_are_rejected():
    with pytest.raises(ParamsError) as info:
        structure(protocol.BranchParams, ["b1"])
    assert info.value.message == "invalid params: expected an object, got array"


def test_empty_params_reject_any_field():
    with pytest.raises(ParamsError) as info:
        structure(Empty, {"x": 1})
    assert info.value.unknown_fields == ["x"]


def test_omitted_action_strategy_is_none():
    params = structure(OperateParams, {"branchId": "b", "instruct": {"actions": True}})
    assert params.action_strategy is None
    assert params.instruct.action_strategy is None
    assert "actionStrategy" not in unstructure(params)


def test_given_action_strategy_is_kept_even_when_it_is_the_default():
    params = structure(OperateParams, {"branchId": "b", "actionStrategy": "concurrent"})
    assert params.action_strategy == "concurrent"
    assert unstructure(params)["actionStrategy"] == "concurrent"


def test_explicit_null_is_rejected_for_non_nullable_optional_field():
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, {"branchId": "b", "actionStrategy": None})
    assert "actionStrategy" in info.value.message and "got null" in info.value.message


def test_free_form_json_fields_stay_plain_json():
    context = {"nested": [1, "two", None, {"three": 3.0}], "snake_key": True}
    params = structure(OperateParams, {"branchId": "b", "context": context, "guidance": ["g"],
                                       "modelOptions": {"top_p": 0.5},
                                       "responseFormat": {"type": "object", "additionalProperties": False}})
    assert params.context == context
    assert params.guidance == ["g"]
    assert params.model_options == {"top_p": 0.5}
    assert params.response_format == {"type": "object", "additionalProperties": False}
    assert unstructure(params)["context"] == context


def test_state_dir_null_differs_from_omitted():
    assert structure(Settings, {}).state_dir is OMITTED
    assert structure(Settings, {"stateDir": None}).state_dir is None
    assert "stateDir" not in unstructure(Settings())
    assert unstructure(Settings(state_dir=None)) == {"stateDir": None}


def test_field_model_default_null_differs_from_omitted():
    without = structure(FieldModel, {"name": "x", "schema": {}})
    with_null = structure(FieldModel, {"name": "x", "schema": {}, "default": None})
    assert without.default is OMITTED and not protocol.is_omitted(with_null.default)
    assert with_null.default is None
    assert unstructure(with_null) == {"name": "x", "schema": {}, "default": None}
    assert unstructure(without) == {"name": "x", "schema": {}}


def test_required_nullable_fields_are_written_as_null():
    usage = protocol.Usage(input_tokens=None, output_tokens=None, context_tokens=None, model_calls=0)
    result = protocol.OperateResult(result=None, kind="none", model=None, usage=usage, rounds=1)
    assert unstructure(result) == {"result": None, "kind": "none", "model": None, "rounds": 1, "usage": {
        "inputTokens": None, "outputTokens": None, "contextTokens": None, "modelCalls": 0}}


def test_ids_are_opaque_int_or_str():
    assert structure(protocol.CancelParams, {"id": 0}).id == 0
    assert structure(protocol.CancelParams, {"id": "0"}).id == "0"
    with pytest.raises(ParamsError):
        structure(protocol.CancelParams, {"id": 1.5})
    assert structure(OperateParams, {"branchId": "b", "workDoneToken": 0}).work_done_token == 0


@pytest.mark.parametrize("key, use", [("request_model", "responseFormat"), ("operativeModel", "responseFormat"),
                                      ("imodel", "chatModel")])
def test_removed_model_options_name_their_replacement(key, use):
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, {"branchId": "b", "modelOptions": {key: "x"}})
    assert f"modelOptions.{key}" in info.value.message
    assert repr(use) in info.value.message


def test_tools_true_means_all_and_false_is_rejected():
    assert structure(OperateParams, {"branchId": "b", "tools": True}).tools is True
    with pytest.raises(ParamsError):
        structure(OperateParams, {"branchId": "b", "tools": False})


def test_defaults_of_operate_follow_the_protocol():
    p = structure(OperateParams, {"branchId": "b"})
    assert (p.invoke_actions, p.handle_validation, p.skip_validation, p.reason, p.actions) == \
        (True, "return_value", False, False, False)
    assert protocol.ParseOptions() == protocol.ParseOptions(
        retry_attempts=3, retry_initial_delay=1, retry_backoff=1.85, max_concurrent=1, throttle_period=1)


def test_structure_hooks_are_cached():
    assert protocol.converter.get_structure_hook(OperateParams) is protocol.converter.get_structure_hook(OperateParams)


def test_tag_fields_are_required_on_the_wire_but_defaulted_in_python():
    assert protocol.LocalModelConfig().provider == "local"
    with pytest.raises(ParamsError) as info:
        structure(protocol.LocalModelConfig, {"path": "/m.gguf"})
    assert info.value.message == "invalid params: provider: missing required field"
    with pytest.raises(ParamsError) as info:
        structure(OperateParams, {"branchId": "b", "chatModel": {"model": "gpt"}})
    assert info.value.message == "invalid params: chatModel.provider: missing required field"


def test_message_content_must_match_its_kind():
    message = {"id": "m", "kind": "system", "role": "system", "sender": None, "recipient": None,
               "createdAt": "2026-12-02T10:00:00+00:00",
               "content": {"callId": "c", "function": "f", "arguments": {}}}
    with pytest.raises(ParamsError) as info:
        structure(protocol.Message, message)
    assert info.value.unknown_fields == ["content.callId", "content.function", "content.arguments"]


@pytest.mark.parametrize("params, where", [
    ({"branchId": "b", "maxRounds": 10**400}, "maxRounds"),
    ({"branchId": "b", "parseOptions": {"retryInitialDelay": -10**309}}, "parseOptions.retryInitialDelay"),
    ({"branchId": "b", "chatModel": {"provider": "scripted", "responses": ["x"], "timeoutS": 10**400}},
     "chatModel.timeoutS"),
    ({"branchId": "b", "chatModel": {"provider": "scripted", "responses": [{"delayMs": 10**309}]}},
     "chatModel.responses[0].delayMs"),
])
def test_integers_beyond_a_doubles_range_are_invalid_params(params, where):
    """Python takes any integer; converting it to seconds or a time-out then overflowed (-32603)."""
    with pytest.raises(ParamsError) as ei:
        structure(OperateParams, params)
    assert ei.value.message.startswith(f"invalid params: {where}: expected a number within a double's range")


def test_the_largest_integer_a_double_holds_is_accepted():
    big = int(sys.float_info.max)
    assert structure(OperateParams, {"branchId": "b", "maxRounds": big}).max_rounds == big
    assert structure(protocol.ParseOptions, {"retryBackoff": big}).retry_backoff == big
