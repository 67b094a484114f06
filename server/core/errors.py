"""A small typed hierarchy of the pipeline's errors."""

from __future__ import annotations

from typing import Any


def exception_text(e: BaseException) -> str:
    """``str(e)``; when that raises (a tool's exception whose ``__str__`` is broken), its type's
    name and that its message could not be read: a tool's failure is its call's error, never the
    server's."""
    try:
        return str(e)
    except Exception:
        return f"{type(e).__name__} (its message could not be read)"


def exception_line(e: BaseException) -> str:
    """The first line of ``exception_text(e)`` with every registered secret masked first
    (``server.redaction``: a redaction is always made before a cut, so that a secret of several
    lines, whose first line alone is no registered value, is masked whole), or the type's name
    when it says nothing."""
    from ..redaction import redact  # (standard library only)

    text = redact(exception_text(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


class OperateError(Exception):
    """Base of every error the core raises on purpose."""


class ConfigurationError(OperateError, ValueError):
    """A parameter combination the pipeline cannot run (e.g. an unknown action strategy)."""


class FieldNameClash(ConfigurationError):
    """A field the caller named like one the pipeline generates (``reason``, the action
    fields): the generated field would replace it. ``path`` says where the caller named it
    (``/properties/reason`` in the responseFormat, ``fieldModels[0].name``); ``field`` is the
    name. A front end answers it as invalid params with both (``service.errors.map_exception``)."""

    def __init__(self, message: str, *, path: str, field: str) -> None:
        super().__init__(message)
        self.path = path
        self.field = field


class RemovedArgumentError(OperateError, TypeError):
    """A removed keyword (request_model, operative_model, imodel) was passed."""


class ModelError(OperateError):
    """A model/provider failure. The message must be safe to show: no secrets."""


class ReplyCut(ModelError):
    """A reply cut at the model's token limit that cannot be used as it is (its JSON is not
    whole, or it has no answer): nothing of it is parsed, run or recorded. ``stop_reason`` is
    ACP's word for it; ``fix`` says which setting bounded it and what to change, for a person
    (every provider that knows its limit says it its own way)."""

    stop_reason = "max_tokens"

    def __init__(self, message: str, *, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class ModelRefused(ModelError):
    """The provider reports that the model declined the request (OpenAI's ``refusal``, a
    ``content_filter`` stop): no reply to parse, nothing to run. ``refusal`` is the model's
    own explanation, or what stopped it."""

    def __init__(self, message: str, *, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal


class ValidationFailed(OperateError, ValueError):
    """D3: the returned value is not an instance of the caller's model and the
    policy is ``raise``. ``expected`` names the model; ``received`` is the value."""

    def __init__(self, message: str, *, expected: str, received: Any) -> None:
        super().__init__(message)
        self.expected = expected
        self.received = received


class ToolNotRegistered(OperateError, ValueError):
    """A tool name that is not in the registry."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Tool {name} is not registered." if name else "The call names no tool (no function).")
        self.name = name


class ToolArgumentError(OperateError, ValueError):
    """Tool arguments that do not satisfy the tool's input schema."""


class ToolTimeout(OperateError, TimeoutError):
    """A tool that did not finish within its time-out."""


class ParseError(OperateError, ValueError):
    """A reply that could not be turned into the requested model."""

    def __init__(self, message: str, *, kind: str = "extraction", validation_error: Any = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.validation_error = validation_error
