"""D1: ``prepare_operate_kw`` normalizes the broad public call into typed params."""

from __future__ import annotations

from typing import Any

from .errors import ConfigurationError, RemovedArgumentError
from .params import (
    DEFAULT_ACTION_ALCALL,
    HANDLE_VALIDATION_VALUES,
    ActionParam,
    AlcallParams,
    ChatParam,
    Instruct,
    RunParam,
    make_parse_param,
)

REMOVED_KWARGS = {
    "request_model": "response_format=",
    "operative_model": "response_format=",
    "imodel": "chat_model=",
}


def reject_removed_kwargs(kwargs: dict[str, Any]) -> None:
    hits = [f"'{k}' (use {v})" for k, v in REMOVED_KWARGS.items() if k in kwargs]
    if hits:
        raise RemovedArgumentError("operate() no longer accepts " + ", ".join(hits))


def is_cli(model: Any) -> bool:
    return bool(getattr(model, "is_cli", False))


def prepare_operate_kw(
    branch: Any,
    *,
    instruct: Instruct | dict | None = None,
    instruction: Any = None,
    guidance: Any = None,
    context: Any = None,
    sender: Any = None,
    recipient: Any = None,
    progression: Any = None,
    chat_model: Any = None,
    invoke_actions: bool = True,
    tool_schemas: list[dict] | None = None,
    images: list | None = None,
    image_detail: str | None = None,
    parse_model: Any = None,
    skip_validation: bool = False,
    handle_validation: str = "return_value",
    tools: Any = None,
    operative: Any = None,
    response_format: Any = None,
    actions: bool = False,
    reason: bool = False,
    call_params: AlcallParams | None = None,
    action_strategy: str | None = "concurrent",
    verbose_action: bool = False,
    field_models: list | None = None,
    include_token_usage_to_model: bool = False,
    clear_messages: bool = False,
    stream_persist: bool = False,
    persist_dir: str | None = None,
    snapshot_dir: str | None = None,
    middle: Any = None,
    parse_call_params: AlcallParams | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Resolve the public call into ``chat_param`` (ChatParam or RunParam),
    ``parse_param``, ``action_param`` and coordinator flags (step D1 of docs/PIPELINE.md).

    ``parse_call_params`` is this project's extension: the structured-parse
    AlcallParams for this call (the wire's ``parseOptions``); omitted, the
    pipeline's defaults (1, 1.85, 3, 1, 1) apply.
    """
    reject_removed_kwargs(kwargs)
    if handle_validation not in HANDLE_VALIDATION_VALUES:
        raise ConfigurationError(
            f"handle_validation must be one of {', '.join(HANDLE_VALIDATION_VALUES)}, got {handle_validation!r}")

    chat_model = chat_model or branch.chat_model
    parse_model = parse_model or chat_model

    if isinstance(instruct, dict):
        instruct = Instruct.model_validate(instruct)
    if instruct is None:
        instruct = Instruct(instruction=instruction, guidance=guidance, context=context)
    else:
        # Never mutate the caller's object: the caller may reuse it.
        instruct = instruct.model_copy()

    if reason:
        instruct.reason = True
    if actions:
        instruct.actions = True
        if action_strategy:
            instruct.action_strategy = action_strategy  # type: ignore[assignment]

    use_run_param = is_cli(chat_model) or stream_persist or persist_dir is not None or snapshot_dir is not None
    chat_kw: dict[str, Any] = dict(
        guidance=instruct.guidance,
        context=instruct.context,
        sender=sender or getattr(branch, "user", None) or "user",
        recipient=recipient or branch.id,
        response_format=response_format,
        progression=progression,
        tool_schemas=tool_schemas,
        images=images,
        image_detail=image_detail,
        plain_content=None,
        include_token_usage_to_model=include_token_usage_to_model,
        imodel=chat_model,
        imodel_kw=dict(kwargs),
    )
    if use_run_param:
        run_kw: dict[str, Any] = {"stream_persist": bool(stream_persist)}
        if persist_dir is not None:
            run_kw["persist_dir"] = persist_dir
        if snapshot_dir is not None:
            run_kw["snapshot_dir"] = snapshot_dir
        chat_param: ChatParam = RunParam(**chat_kw, **run_kw)
    else:
        chat_param = ChatParam(**chat_kw)

    parse_param = None
    if response_format and not skip_validation:
        parse_param = make_parse_param(response_format, parse_model, handle_validation=handle_validation,  # type: ignore[arg-type]
                                       alcall_params=parse_call_params)

    action_param = None
    if invoke_actions and (instruct.actions or actions):
        strategy = action_strategy or instruct.action_strategy or "concurrent"
        action_param = ActionParam(
            action_call_params=call_params or DEFAULT_ACTION_ALCALL,
            tools=tools,
            strategy=strategy,  # type: ignore[arg-type]
            suppress_errors=True,
            verbose_action=verbose_action,
        )

    return {
        "instruction": instruct.instruction,
        "chat_param": chat_param,
        "parse_param": parse_param,
        "action_param": action_param,
        "handle_validation": handle_validation,
        "invoke_actions": invoke_actions,
        "skip_validation": skip_validation,
        "clear_messages": clear_messages,
        "operative": None,  # D1 seam: a caller-supplied operative is discarded.
        "middle": middle,
        "field_models": field_models,
        "reason": instruct.reason,
    }
