"""D1's typed parameters: Instruct and the frozen Chat/Run/Parse/Action params."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from .alcall import alcall

HandleValidation = Literal["raise", "return_value", "return_none"]
HANDLE_VALIDATION_VALUES = ("raise", "return_value", "return_none")
ActionStrategy = Literal["sequential", "concurrent"]


class HashableModel(BaseModel):
    model_config = ConfigDict(frozen=False, arbitrary_types_allowed=True)

    def __hash__(self) -> int:  # a value hash: models with equal fields hash alike
        return hash(self.model_dump_json())


class Instruct(HashableModel):
    instruction: str | None = None
    guidance: Any = None
    context: Any = None
    reason: bool | None = None
    actions: bool | None = None
    action_strategy: ActionStrategy | None = None

    @field_validator("instruction", mode="before")
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            return None
        return v


class MorphParam:
    """Frozen parameter objects; ``with_updates`` returns a changed copy."""

    def with_updates(self, **kw: Any):  # type: ignore[no-untyped-def]
        return dataclasses.replace(self, **kw)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@dataclass(slots=True, frozen=True)
class AlcallParams(MorphParam):
    retry_attempts: int = 0
    retry_initial_delay: float = 0
    retry_backoff: float = 1
    retry_timeout: float | None = None
    max_concurrent: int | None = None
    throttle_period: float | None = None
    delay_before_start: float = 0
    output_dropna: bool = False

    async def __call__(self, inputs: Any, func: Any) -> list[Any]:
        return await alcall(inputs, func, **self.to_dict())


@dataclass(slots=True, frozen=True)
class FuzzyMatchKeysParams(MorphParam):
    similarity_threshold: float = 0.85
    handle_unmatched: Literal["ignore", "force", "raise"] = "ignore"


@dataclass(slots=True, frozen=True)
class ChatParam(MorphParam):
    guidance: Any = None
    context: Any = None
    sender: str | None = None
    recipient: str | None = None
    response_format: Any = None
    progression: Any = None
    tool_schemas: list[dict] | None = None
    images: list | None = None
    image_detail: str | None = None
    plain_content: str | None = None
    include_token_usage_to_model: bool = False
    imodel: Any = None
    imodel_kw: dict[str, Any] = dataclasses.field(default_factory=dict)


def default_persist_dir() -> str:
    base = os.environ.get("OPERATE_SIDECAR_HOME") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "operate-sidecar")
    return os.path.join(base, "runs")


@dataclass(slots=True, frozen=True)
class RunParam(ChatParam):
    stream_persist: bool = False
    persist_dir: str = dataclasses.field(default_factory=default_persist_dir)
    snapshot_dir: str | None = None


@dataclass(slots=True, frozen=True)
class ParseParam(MorphParam):
    response_format: Any = None
    imodel: Any = None
    imodel_kw: dict[str, Any] = dataclasses.field(default_factory=dict)
    handle_validation: HandleValidation = "return_value"
    alcall_params: AlcallParams | None = None
    fuzzy_match_params: FuzzyMatchKeysParams | None = None


@dataclass(slots=True, frozen=True)
class ActionParam(MorphParam):
    action_call_params: AlcallParams | None = None
    tools: Any = None
    strategy: ActionStrategy = "concurrent"
    suppress_errors: bool = True
    verbose_action: bool = False


# D1: the inherited structured-parse defaults (no recorded rationale; settable per call).
DEFAULT_PARSE_ALCALL = AlcallParams(
    retry_initial_delay=1,
    retry_backoff=1.85,
    retry_attempts=3,
    max_concurrent=1,
    throttle_period=1,
)

DEFAULT_ACTION_ALCALL = AlcallParams(output_dropna=True)


def make_parse_param(response_format: Any, parse_model: Any, *, handle_validation: HandleValidation = "return_value",
                     alcall_params: AlcallParams | None = None) -> ParseParam:
    return ParseParam(
        response_format=response_format,
        imodel=parse_model,
        imodel_kw={},
        handle_validation=handle_validation,
        alcall_params=alcall_params or DEFAULT_PARSE_ALCALL,
        fuzzy_match_params=FuzzyMatchKeysParams(),
    )
