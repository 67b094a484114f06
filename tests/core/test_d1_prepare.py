"""Step D1 (docs/PIPELINE.md): prepare_operate_kw() normalizes the public call into typed parameters."""

from __future__ import annotations

import pytest

from operate_sidecar.server.core import (
    DEFAULT_PARSE_ALCALL,
    ActionParam,
    AlcallParams,
    Branch,
    ChatParam,
    FieldModel,
    Instruct,
    ParseParam,
    RemovedArgumentError,
    RunParam,
    Spec,
    Step,
    make_parse_param,
    prepare_operate_kw,
)
from operate_sidecar.server.core.params import default_persist_dir
from operate_sidecar.server.models.scripted import ScriptedModel

from .support import NO_REPAIR, Answer, make_branch, reply

pytestmark = pytest.mark.anyio


def branch_with(cli: bool = False) -> Branch:
    return Branch(chat_model=ScriptedModel("chat", [], cli=cli), parse_model=ScriptedModel("parse", []))


def test_returned_mapping_has_the_fixed_shape():
    """D1: the returned mapping has one fixed shape."""
    out = prepare_operate_kw(branch_with(), instruction="hi")
    assert set(out) == {"instruction", "chat_param", "parse_param", "action_param", "handle_validation",
                        "invoke_actions", "skip_validation", "clear_messages", "operative", "middle",
                        "field_models", "reason"}
    assert out["instruction"] == "hi"
    assert isinstance(out["chat_param"], ChatParam)


def test_chat_model_defaults_to_branch_chat_model():
    """D1: chat_model defaults to branch.chat_model."""
    b = branch_with()
    assert prepare_operate_kw(b, instruction="x")["chat_param"].imodel is b.chat_model
    other = ScriptedModel("other", [])
    assert prepare_operate_kw(b, instruction="x", chat_model=other)["chat_param"].imodel is other


def test_parse_model_defaults_to_selected_chat_model_not_branch_parse_model():
    """D1: parse_model defaults to the selected chat model, not independently to branch.parse_model."""
    b = branch_with()
    selected = ScriptedModel("selected", [])
    out = prepare_operate_kw(b, instruction="x", chat_model=selected, response_format=Answer)
    assert out["parse_param"].imodel is selected
    assert out["parse_param"].imodel is not b.parse_model
    explicit = ScriptedModel("p", [])
    assert prepare_operate_kw(b, instruction="x", response_format=Answer,
                              parse_model=explicit)["parse_param"].imodel is explicit


def test_mapping_instruct_is_validated_into_instruct():
    """D1: a mapping passed as instruct is validated into Instruct."""
    out = prepare_operate_kw(branch_with(), instruct={"instruction": "do", "guidance": "g", "context": {"k": 1},
                                                      "reason": True})
    assert out["instruction"] == "do"
    assert out["chat_param"].guidance == "g"
    assert out["chat_param"].context == {"k": 1}
    assert out["reason"] is True


def test_mapping_instruct_with_invalid_strategy_is_rejected():
    """D1: validation of a mapping instruct uses Instruct's Literal strategy."""
    with pytest.raises(ValueError):
        prepare_operate_kw(branch_with(), instruct={"instruction": "do", "action_strategy": "batch"})


def test_loose_arguments_build_the_instruct_when_none_is_supplied():
    """D1: without instruct, one is built from the loose instruction, guidance and context."""
    out = prepare_operate_kw(branch_with(), instruction="loose", guidance="lg", context=["c"])
    assert out["instruction"] == "loose"
    assert (out["chat_param"].guidance, out["chat_param"].context) == ("lg", ["c"])


def test_explicit_reason_sets_instruct_reason():
    """D1: explicit reason=True sets instruct.reason = True (returned as "reason")."""
    assert prepare_operate_kw(branch_with(), instruction="x")["reason"] is None
    assert prepare_operate_kw(branch_with(), instruction="x", reason=True)["reason"] is True
    assert prepare_operate_kw(branch_with(), instruct=Instruct(instruction="x", reason=True))["reason"] is True


def test_explicit_actions_enable_actions_and_copy_truthy_strategy():
    """D1: actions=True sets instruct.actions and copies a truthy action_strategy into it."""
    out = prepare_operate_kw(branch_with(), instruction="x", actions=True, action_strategy="sequential")
    assert isinstance(out["action_param"], ActionParam)
    assert out["action_param"].strategy == "sequential"


def test_caller_instruct_is_copied_never_mutated():
    """D1 (project choice): the caller's Instruct is copied, never mutated by reason/actions."""
    ins = Instruct(instruction="x")
    prepare_operate_kw(branch_with(), instruct=ins, reason=True, actions=True, action_strategy="sequential")
    assert ins.reason is None and ins.actions is None and ins.action_strategy is None


@pytest.mark.parametrize("kw, cli", [
    ({}, True),
    ({"stream_persist": True}, False),
    ({"persist_dir": "/tmp/p"}, False),
    ({"snapshot_dir": "/tmp/s"}, False),
])
def test_run_param_selected_for_cli_stream_persist_or_dirs(kw, cli):
    """D1: RunParam is selected when the model is CLI-backed, stream_persist is true, or a dir is not None."""
    out = prepare_operate_kw(branch_with(cli=cli), instruction="x", **kw)
    assert isinstance(out["chat_param"], RunParam)


def test_chat_param_selected_otherwise():
    """D1: otherwise the preparer builds ChatParam (not RunParam)."""
    out = prepare_operate_kw(branch_with(), instruction="x", stream_persist=False, persist_dir=None,
                             snapshot_dir=None)
    assert type(out["chat_param"]) is ChatParam


def test_cli_chat_model_argument_selects_run_param():
    """D1: the *selected* model decides: a per-call CLI chat_model selects RunParam."""
    out = prepare_operate_kw(branch_with(), instruction="x", chat_model=ScriptedModel("c", [], cli=True))
    assert isinstance(out["chat_param"], RunParam)


def test_run_param_copies_stream_persist_even_when_false_and_dirs_only_when_given():
    """D1: RunParam.stream_persist is copied even when false; dirs override defaults only when non-None."""
    out = prepare_operate_kw(branch_with(cli=True), instruction="x", stream_persist=False)
    rp = out["chat_param"]
    assert rp.stream_persist is False
    assert rp.persist_dir == default_persist_dir()
    assert rp.snapshot_dir is None
    rp2 = prepare_operate_kw(branch_with(), instruction="x", persist_dir="/tmp/pd", snapshot_dir="/tmp/sd")["chat_param"]
    assert (rp2.stream_persist, rp2.persist_dir, rp2.snapshot_dir) == (False, "/tmp/pd", "/tmp/sd")


def test_response_format_is_copied_into_chat_param():
    """D1: response_format is copied into the chat/run parameter."""
    assert prepare_operate_kw(branch_with(), instruction="x", response_format=Answer)["chat_param"].response_format \
        is Answer
    assert prepare_operate_kw(branch_with(cli=True), instruction="x",
                              response_format=Answer)["chat_param"].response_format is Answer


@pytest.mark.parametrize("fmt, skip, expected", [(Answer, False, True), (Answer, True, False), (None, False, False)])
def test_parse_param_only_with_response_format_and_not_skipped(fmt, skip, expected):
    """D1: a ParseParam is created only when a response format exists and validation is not skipped."""
    out = prepare_operate_kw(branch_with(), instruction="x", response_format=fmt, skip_validation=skip,
                             handle_validation="return_none")
    assert (out["parse_param"] is not None) is expected
    if expected:
        pp = out["parse_param"]
        assert isinstance(pp, ParseParam) and pp.response_format is Answer
        assert pp.handle_validation == "return_none"


@pytest.mark.parametrize("invoke, instruct_actions, loose_actions, expected", [
    (True, None, False, False),
    (True, True, False, True),
    (True, None, True, True),
    (False, True, True, False),
])
def test_action_param_creation_rule(invoke, instruct_actions, loose_actions, expected):
    """D1: ActionParam exists only when invoke_actions and (instruct.actions or actions)."""
    out = prepare_operate_kw(branch_with(), instruct=Instruct(instruction="x", actions=instruct_actions),
                             actions=loose_actions, invoke_actions=invoke)
    assert (out["action_param"] is not None) is expected


@pytest.mark.parametrize("loose, embedded, expected", [
    ("sequential", None, "sequential"),
    ("concurrent", "sequential", "concurrent"),
    (None, "sequential", "sequential"),
    (None, None, "concurrent"),
    ("", None, "concurrent"),
])
def test_action_strategy_expression(loose, embedded, expected):
    """D1: strategy = action_strategy or instruct.action_strategy or "concurrent"."""
    out = prepare_operate_kw(branch_with(), instruct=Instruct(instruction="x", actions=True,
                                                              action_strategy=embedded),
                             action_strategy=loose)
    assert out["action_param"].strategy == expected


def test_action_param_always_suppresses_errors_and_defaults_call_params():
    """D1/D4: the ActionParam always uses suppress_errors=True; default call params set output_dropna=True."""
    out = prepare_operate_kw(branch_with(), instruction="x", actions=True, tools=["a"], verbose_action=True)
    ap = out["action_param"]
    assert ap.suppress_errors is True
    assert ap.tools == ["a"] and ap.verbose_action is True
    assert ap.action_call_params == AlcallParams(output_dropna=True)
    custom = AlcallParams(max_concurrent=2)
    assert prepare_operate_kw(branch_with(), instruction="x", actions=True,
                              call_params=custom)["action_param"].action_call_params is custom


def test_public_tool_schemas_copied_into_initial_chat_param():
    """D1: public tool_schemas are copied into the initial chat/run parameter."""
    schemas = [{"type": "function", "function": {"name": "caller"}}]
    assert prepare_operate_kw(branch_with(), instruction="x", tool_schemas=schemas)["chat_param"].tool_schemas \
        == schemas


@pytest.mark.parametrize("name, hint", [("request_model", "response_format="),
                                        ("operative_model", "response_format="),
                                        ("imodel", "chat_model=")])
def test_removed_kwargs_are_rejected_with_guidance(name, hint):
    """D1: request_model, operative_model and imodel are rejected as removed names with guidance."""
    with pytest.raises(RemovedArgumentError) as ei:
        prepare_operate_kw(branch_with(), instruction="x", **{name: object()})
    assert isinstance(ei.value, TypeError)
    assert name in str(ei.value) and hint in str(ei.value)


async def test_removed_kwargs_rejected_at_facade_before_any_model_call():
    """D1: the facade rejects removed names before the model is called."""
    b, m = make_branch([reply(1)])
    with pytest.raises(TypeError):
        await b.operate(instruction="x", imodel=m)
    assert m.calls == 0


def test_remaining_kwargs_become_model_options():
    """D1: remaining **kwargs become model invocation options."""
    out = prepare_operate_kw(branch_with(), instruction="x", temperature=0.3, max_tokens=7)
    assert out["chat_param"].imodel_kw == {"temperature": 0.3, "max_tokens": 7}


async def test_model_options_reach_the_provider_request():
    """D1: the model invocation options are what the provider receives."""
    b, m = make_branch(["plain"])
    await b.operate(instruction="x", temperature=0.3)
    assert m.requests[0].options == {"temperature": 0.3}


def test_caller_operative_is_discarded():
    """D1: a caller-supplied operative is discarded by setting the returned value to None."""
    op = Step.request_operative(name="Mine", reason=True)
    assert prepare_operate_kw(branch_with(), instruction="x", operative=op)["operative"] is None


async def test_field_models_entries_other_than_fieldmodel_or_spec_raise_typeerror():
    """D1: field_models entries other than FieldModel or Spec raise TypeError (before the model call)."""
    b, m = make_branch([reply(1)])
    with pytest.raises(TypeError, match="Expected FieldModel or Spec"):
        await b.operate(instruction="x", field_models=[{"name": "bad"}])
    assert m.calls == 0


async def test_field_models_fieldmodel_and_spec_enter_generated_fields():
    """D1/D2: FieldModel and Spec entries are converted and added by name."""
    b, m = make_branch([{"json": {"score": 3, "label": "ok"}}])
    out = await b.operate(instruction="x", field_models=[FieldModel("score", int), Spec("label", str)])
    assert (out.score, out.label) == (3, "ok")
    assert {"score", "label"} <= set(m.requests[0].response_schema["properties"])


async def test_field_models_with_empty_name_are_dropped():
    """D1: entries whose resulting Spec.name is empty do not enter the generated field map."""
    b, m = make_branch([{"json": {"score": 3}}])
    out = await b.operate(instruction="x", field_models=[Spec("", int), FieldModel("", str), Spec("score", int)])
    assert set(type(out).model_fields) == {"score"}
    assert set(m.requests[0].response_schema["properties"]) == {"score"}


def test_default_parse_alcall_params_values():
    """D1: make_parse_param()'s default AlcallParams(1, 1.85, 3, 1, 1)."""
    pp = make_parse_param(Answer, None)
    assert pp.alcall_params == AlcallParams(retry_initial_delay=1, retry_backoff=1.85, retry_attempts=3,
                                            max_concurrent=1, throttle_period=1)
    assert pp.alcall_params is DEFAULT_PARSE_ALCALL
    assert prepare_operate_kw(branch_with(), instruction="x", response_format=Answer)["parse_param"].alcall_params \
        == DEFAULT_PARSE_ALCALL


def test_parse_call_params_replace_the_defaults_per_call():
    """D1 (project extension, docs/PIPELINE.md "What the wire fixes"): parse_call_params replaces the defaults."""
    out = prepare_operate_kw(branch_with(), instruction="x", response_format=Answer, parse_call_params=NO_REPAIR)
    assert out["parse_param"].alcall_params is NO_REPAIR


def test_coordinator_flags_are_passed_through():
    """D1: handle_validation, invoke_actions, skip_validation, clear_messages, middle, field_models are returned."""
    fms = [Spec("a", int)]

    async def mid(*a, **k):  # pragma: no cover - never awaited here
        return None

    out = prepare_operate_kw(branch_with(), instruction="x", handle_validation="raise", invoke_actions=False,
                             skip_validation=True, clear_messages=True, middle=mid, field_models=fms)
    assert (out["handle_validation"], out["invoke_actions"], out["skip_validation"], out["clear_messages"]) == \
        ("raise", False, True, True)
    assert out["middle"] is mid and out["field_models"] is fms


def test_unknown_handle_validation_is_a_configuration_error():
    """D1/D3 (project choice): an unknown handle_validation value is rejected up front."""
    with pytest.raises(ValueError):
        prepare_operate_kw(branch_with(), instruction="x", handle_validation="ignore")


def test_blank_instruction_becomes_none():
    """D1: Instruct.instruction is str | None; blank strings normalize to None."""
    assert prepare_operate_kw(branch_with(), instruction="   ")["instruction"] is None
