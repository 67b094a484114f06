"""D2–D4: the ``operate()`` coordinator.

prepared params → publish selected tool schemas → build the request/response
Operative when needed → select one Middle → await it exactly once →
skip_validation returns raw → caller-model mismatch policy → invoke_actions
gate → action inspection, ``act()``, writeback, enrichment.
Every return before the action phase has no tool side effect.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from . import progress
from .act import act
from .errors import FieldNameClash, ValidationFailed
from .operative import Operative, Step, request_info, specs_from_field_models
from .params import ActionParam, ChatParam, ParseParam, RunParam
from .middle import communicate, run_and_collect

log = logging.getLogger(__name__)

RECEIVED_LIMIT = 200
#: the fields actions add to the structure (D2); a field model may not take their names
ACTION_FIELDS = ("action_required", "action_requests", "action_responses")


def caller_model_class(response_format: Any) -> type[BaseModel] | None:
    if isinstance(response_format, type) and issubclass(response_format, BaseModel):
        return response_format
    if isinstance(response_format, BaseModel):
        return type(response_format)
    return None


def mismatch_error(model_class: type[BaseModel], result: Any) -> ValidationFailed:
    """The error of a reply that does not parse into ``model_class``, quoting the first
    RECEIVED_LIMIT characters of it, the known secrets masked before the cut (docs/SECURITY.md
    G6: a cut never leaves part of one)."""
    from ..redaction import redact_cut  # (standard library only)

    received = redact_cut(repr(result), RECEIVED_LIMIT)
    return ValidationFailed(
        f"Failed to parse model response into {model_class.__name__!r}. Received (truncated): {received}",
        expected=model_class.__name__,
        received=result,
    )


def _requests_of(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return getattr(result, "action_requests", None)
    if isinstance(result, dict):
        return result.get("action_requests")
    return None


async def _writeback(branch: Any, responses: list) -> None:
    for provider in list(getattr(branch, "providers", ()) or ()):
        hook = getattr(provider, "writeback", None)
        if hook is None:
            continue
        try:
            await hook(branch, responses)
        except Exception:
            log.warning("context provider writeback failed", exc_info=True)


async def operate(
    branch: Any,
    instruction: Any,
    chat_param: ChatParam,
    action_param: ActionParam | None = None,
    parse_param: ParseParam | None = None,
    handle_validation: str = "return_value",
    invoke_actions: bool = True,
    skip_validation: bool = False,
    clear_messages: bool = False,
    reason: bool = False,
    field_models: list | None = None,
    operative: Operative | None = None,
    middle: Any = None,
) -> BaseModel | dict | str | None:
    return await _operate(branch, instruction, chat_param, action_param, parse_param, handle_validation,
                          invoke_actions, skip_validation, clear_messages, reason, field_models, operative, middle)


def _setup(branch: Any, chat_param: ChatParam, action_param: ActionParam | None, parse_param: ParseParam | None,
           reason: bool, field_models: list | None, operative: Operative | None
           ) -> tuple[ChatParam, ParseParam, type[BaseModel] | None, Operative | None]:
    """Steps before the model call: the chat and parse contexts, the caller's model class and
    the request/response Operative. No effect: nothing is sent, recorded or run."""
    _cctx = chat_param
    if parse_param is not None:
        _pctx = parse_param.with_updates(handle_validation="return_value")
    else:
        _pctx = ParseParam(response_format=chat_param.response_format, imodel=branch.parse_model,
                           handle_validation="return_value")

    # D2: publish the selected tools' schemas (unknown names fail here, before any model call)
    if action_param is not None:
        # only an absent selector means "all tools"; an empty selection publishes none (and act denies all)
        selector = True if action_param.tools is None else action_param.tools
        schemas = branch.tools.get_tool_schema(tools=selector)
        _cctx = _cctx.with_updates(tool_schemas=schemas["tools"])

    model_class = caller_model_class(_cctx.response_format)
    fields_dict = specs_from_field_models(field_models)  # TypeError for a bad entry, before the model call
    if operative is None:  # (a caller's own Operative is used as it is)
        _check_generated_names(model_class, field_models, reason=bool(reason), actions=action_param is not None)

    if operative is None and (model_class or action_param or fields_dict or reason):
        operative = Step.request_operative(base_type=model_class, reason=bool(reason), actions=bool(action_param),
                                           fields=fields_dict)
        operative = Step.respond_operative(operative)
        _cctx = _cctx.with_updates(response_format=operative.response_type)
        _pctx = _pctx.with_updates(response_format=operative.response_type)

    return _cctx, _pctx, model_class, operative


def _check_generated_names(model_class: type[BaseModel] | None, field_models: list | None, *, reason: bool,
                           actions: bool) -> None:
    """A field of the caller's named like one the pipeline generates would be replaced by it
    (the generated structure extends the caller's model, then adds ``reason`` and the action
    fields): the caller's schema would silently not be the one asked for, and calls read from
    a field model named ``action_requests`` could not run. Refused before any model call."""
    generated = (("reason",) if reason else ()) + (ACTION_FIELDS if actions else ())
    if not generated:
        return
    # (a type the pipeline generated already has these fields: its own, not the caller's)
    own = list(model_class.model_fields) if model_class is not None and request_info(model_class) is None else []
    for name in generated:
        if name in own:
            raise FieldNameClash(f"responseFormat: property {name!r} would be replaced by the {name!r} field "
                                 f"that {'reason' if name == 'reason' else 'actions'}: true adds; give it another name",
                                 path=f"/properties/{name}", field=name)
    if actions:
        for i, fm in enumerate(field_models or ()):
            name = getattr(fm, "name", None)
            if name in ACTION_FIELDS:
                raise FieldNameClash(f"a field model named {name!r} would replace what actions add "
                                     f"({', '.join(ACTION_FIELDS)}); give it another name",
                                     path=f"fieldModels[{i}].name", field=name)


def prime(branch: Any, instruction: Any, chat_param: ChatParam, action_param: ActionParam | None = None,
          parse_param: ParseParam | None = None, reason: bool = False, field_models: list | None = None,
          operative: Operative | None = None, **_: Any) -> None:
    """Build now what an ``operate`` with these prepared params builds on its first use (its
    Operative types and the response schema the model is shown, narrowed to the published
    tools; both are cached), with no model call, no message and no tool: the steps of
    ``_operate`` before its Middle, and the request schema the Middle renders. Lets a front end
    that knows a session's params ahead make its first operate cost what a later one does."""
    from .render import request_schema_of

    cctx, _, _, _ = _setup(branch, chat_param, action_param, parse_param, reason, field_models, operative)
    request_schema_of(cctx.response_format, cctx.tool_schemas)


async def _operate(branch: Any, instruction: Any, chat_param: ChatParam, action_param: ActionParam | None,
                   parse_param: ParseParam | None, handle_validation: str, invoke_actions: bool,
                   skip_validation: bool, clear_messages: bool, reason: bool, field_models: list | None,
                   operative: Operative | None, middle: Any) -> Any:
    _cctx, _pctx, model_class, operative = _setup(branch, chat_param, action_param, parse_param, reason,
                                                  field_models, operative)

    if middle is None:
        model = _cctx.imodel or branch.chat_model
        middle = run_and_collect if isinstance(_cctx, RunParam) or getattr(model, "is_cli", False) else communicate

    result = await middle(branch, instruction, _cctx, _pctx, clear_messages, skip_validation=skip_validation)

    if skip_validation:  # R1: raw mode — no type check, no actions
        return result

    if model_class is not None and not isinstance(result, model_class):  # R2: caller-model mismatch
        if handle_validation == "return_none":
            return None
        if handle_validation == "raise":
            raise mismatch_error(model_class, result)
        return result

    if not invoke_actions:  # R3: the second action gate
        return result

    requests = _requests_of(result)
    if action_param is None or requests is None:
        return result

    progress.report("running tools", "actions")
    responses = await act(branch, requests, action_param)
    responses = [r for r in responses if r is not None]
    if not responses:
        return result
    await _writeback(branch, responses)

    if isinstance(result, BaseModel):
        if "action_responses" in type(result).model_fields:
            if type(result).model_config.get("frozen"):
                # a frozen caller model: enrich a copy instead of failing after the tools ran
                result = result.model_copy(update={"action_responses": responses})
            else:
                result.action_responses = responses  # type: ignore[attr-defined]
        elif operative is not None:
            result = operative.response_type.model_validate({**result.model_dump(), "action_responses": responses})
        if operative is not None:
            operative.response_model = result
        return result
    if isinstance(result, dict):
        result["action_responses"] = responses
    return result
