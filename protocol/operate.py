"""docs/PROTOCOL.md §5: ``operate`` params and its result envelope."""

from typing import Literal

from ._base import OMITTED, Id, JsonObject, JsonSchema, JsonValue, Omitted, wire
from .errors import ParamsError
from .lifecycle import Model

ActionStrategy = Literal["concurrent", "sequential"]
HandleValidation = Literal["return_value", "return_none", "raise"]
ResultKind = Literal["model", "dict", "text", "none"]

# modelOptions keys removed from the facade (docs/PIPELINE.md D1), with the wire field to use instead.
REMOVED_MODEL_OPTIONS: dict[str, str] = {
    "request_model": "responseFormat", "requestModel": "responseFormat",
    "operative_model": "responseFormat", "operativeModel": "responseFormat",
    "imodel": "chatModel", "iModel": "chatModel",
}


@wire
class Instruct:
    """The structured instruction. ``action_strategy`` None = not given."""
    instruction: str | None = None
    guidance: JsonValue = None
    context: JsonValue = None
    reason: bool | None = None
    actions: bool | None = None
    action_strategy: ActionStrategy | None = None


@wire
class FieldModel:
    """An extra generated field. ``default`` is ``OMITTED`` when not given (then the field is
    required); an explicit null is a default of None."""
    name: str
    schema: JsonSchema
    description: str | None = None
    default: JsonValue | Omitted = OMITTED


#: parse-repair retries an operate may ask for (each one is a model call)
MAX_RETRY_ATTEMPTS = 100


@wire
class ParseOptions:
    """Structured-parse retry settings (the pipeline's D1 defaults, docs/PIPELINE.md)."""
    retry_attempts: int = 3
    retry_initial_delay: float = 1
    retry_backoff: float = 1.85
    max_concurrent: int = 1
    throttle_period: float = 1

    def __wire_check__(self) -> None:
        if not 0 <= self.retry_attempts <= MAX_RETRY_ATTEMPTS:
            raise ParamsError(f"retryAttempts must be an integer from 0 to {MAX_RETRY_ATTEMPTS}",
                              path=("retryAttempts",))
        for name, value in (("retryInitialDelay", self.retry_initial_delay), ("retryBackoff", self.retry_backoff),
                            ("throttlePeriod", self.throttle_period)):
            if value < 0:
                raise ParamsError(f"{name} must not be negative", path=(name,))
        if self.max_concurrent < 1:
            raise ParamsError("maxConcurrent must be at least 1", path=("maxConcurrent",))


@wire
class OperateParams:
    """``operate``. Optional fields are None when omitted (an explicit null is rejected),
    except those with a protocol or pipeline default. ``action_strategy is None`` means "not given":
    ``instruct.action_strategy`` then decides, else ``concurrent``."""
    branch_id: str
    instruct: Instruct | None = None
    instruction: str | None = None
    guidance: JsonValue = None
    context: JsonValue = None
    chat_model: Model | None = None
    parse_model: Model | None = None
    response_format: JsonSchema | None = None
    field_models: list[FieldModel] | None = None
    reason: bool = False
    actions: bool = False
    invoke_actions: bool = True
    tools: list[str] | Literal[True] | None = None
    action_strategy: ActionStrategy | None = None
    verbose_action: bool = False
    handle_validation: HandleValidation = "return_value"
    skip_validation: bool = False
    clear_messages: bool = False
    stream_persist: bool = False
    persist_dir: str | None = None
    snapshot_dir: str | None = None
    parse_options: ParseOptions | None = None
    model_options: JsonObject | None = None
    work_done_token: Id | None = None
    max_rounds: int | None = None  # None = 1; N > 1: another round after each round in which a tool ran
    # None = off; N >= 1: the rounds stop after N in a row that each made the same calls, all failing the same way
    repeat_limit: int | None = None

    def __wire_check__(self) -> None:
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ParamsError("must be an integer of at least 1", path=("maxRounds",))
        if self.repeat_limit is not None and self.repeat_limit < 1:
            raise ParamsError("must be an integer of at least 1", path=("repeatLimit",))
        for key in self.model_options or ():
            if key in REMOVED_MODEL_OPTIONS:
                raise ParamsError(
                    f"{key!r} was removed; use {REMOVED_MODEL_OPTIONS[key]!r} instead "
                    "(responseFormat for the response type, chatModel for the model)",
                    path=("modelOptions", key))


@wire
class Usage:
    """Token usage summed over model calls (chat and parse repair; every round). A count the
    provider does not report is null; ``context_tokens`` is the input size of the last chat call."""
    input_tokens: int | None
    output_tokens: int | None
    context_tokens: int | None
    model_calls: int


@wire
class OperateResult:
    """``model`` is the class name when ``kind`` is ``model``, else null. ``rounds``: how many
    rounds ran (1 unless ``maxRounds`` > 1); ``result`` is the last round's. ``usage`` and ``rounds``
    are always sent; ``repeated`` (true) only when ``repeatLimit`` stopped the rounds."""
    result: JsonValue
    kind: ResultKind
    model: str | None
    usage: Usage
    rounds: int
    repeated: bool | None = None


@wire
class ValidationFailedData:
    """``error.data`` of -32010: ``received`` is the received value, truncated."""
    expected: str
    received: JsonValue
