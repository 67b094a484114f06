"""The errors the service raises and how any exception becomes an error answer.

``RpcError`` is the protocol's own (``protocol.errors``): raising one answers the current
request with ``{code, message, data?}``, whichever front end carries it (the native front
end sends it as is; the ACP front end as an ACP error with the same code). The codes are
the protocol's. :func:`map_exception` maps everything else a service call may raise (core,
provider and configuration errors) to ``(code, message, data)``; both front ends use it.
A bound of the settings that is reached (``LimitReached``) is stated by the service; what the
client can do about it is worded by each front end in its own methods (``map_exception``'s
``remedies``), since the service knows no wire."""

from __future__ import annotations

import json
import traceback
from typing import Any, Mapping

from operate_sidecar.protocol.errors import (BRANCH_NOT_FOUND, INTERNAL_ERROR, INVALID_PARAMS, MODEL_ERROR,
                                             STATE_NOT_SAVED, VALIDATION_FAILED, RpcError)

__all__ = ["RpcError", "LimitReached", "invalid_params", "branch_not_found", "state_not_saved", "map_exception",
           "truncate_received"]

#: characters of a reply that failed validation shown back in the error's ``data.received``
RECEIVED_LIMIT = 200


def invalid_params(message: str, data: Any = None) -> RpcError:
    return RpcError(INVALID_PARAMS, message, data)


class LimitReached(RpcError):
    """-32602: a request would go past a bound of the settings (``maxBranches``,
    ``maxMessagesPerBranch``): ``data.limit`` names the setting, ``data.value`` is its value.
    ``fact`` says what was reached; ``message`` adds the one way out every client has (raise
    the setting). A front end words the others in its own methods (``map_exception``'s
    ``remedies``: the setting → what to do, then raising it is said)."""

    def __init__(self, fact: str, data: dict[str, Any]) -> None:
        self.fact = fact
        self.limit = str(data["limit"])
        super().__init__(INVALID_PARAMS, f"{fact}; raise settings.{self.limit}", data)

    def worded(self, remedies: Mapping[str, str] | None) -> str:
        """The message with the front end's way out (``remedies[limit]``) before raising the setting."""
        remedy = (remedies or {}).get(self.limit)
        return f"{self.fact}; {remedy} or raise settings.{self.limit}" if remedy else self.message


def branch_not_found(branch_id: Any) -> RpcError:
    return RpcError(BRANCH_NOT_FOUND, f"branch not found: {branch_id}", {"branchId": branch_id})


def state_not_saved(message: str, data: Any = None) -> RpcError:
    return RpcError(STATE_NOT_SAVED, f"state could not be saved: {message}", data)


def truncate_received(value: Any, limit: int = RECEIVED_LIMIT) -> Any:
    """A reply that failed validation, for the error's ``data.received``: as it is when its JSON
    text is at most ``limit`` characters (the wire's last net masks the known secrets in it),
    else the first ``limit`` characters of its text, the known secrets masked before the cut
    (docs/SECURITY.md G6: a cut never leaves part of one)."""
    from operate_sidecar.server.redaction import redact_cut

    dump = getattr(value, "model_dump", None)
    if dump is not None:
        try:
            value = dump(mode="json")
        except Exception:
            value = repr(value)
    if isinstance(value, str):
        return redact_cut(value, limit)
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return redact_cut(repr(value), limit)
    return value if len(text) <= limit else redact_cut(text, limit)


def _short(e: BaseException) -> str:
    """The type and the first line (at most 300 characters) of an unexpected exception, for a
    -32603 message: the known secrets masked before either cut (a secret of several lines is
    masked whole, one straddling the 300th character too)."""
    from operate_sidecar.server.core.errors import exception_text
    from operate_sidecar.server.redaction import redact

    said = redact(exception_text(e)).strip()
    text = said.splitlines()[0] if said else ""
    text = text[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def map_exception(e: BaseException, debug: bool = False,
                  remedies: Mapping[str, str] | None = None) -> tuple[int, str, Any]:
    """An exception raised by a service call → ``(code, message, data)``. Unexpected ones are
    -32603 without a traceback unless ``debug``. ``remedies``: the front end's words for what
    its client can do when a bound is reached (``LimitReached``), by the setting's name."""
    if isinstance(e, LimitReached):
        return e.code, e.worded(remedies), e.data
    code = getattr(e, "code", None)
    if isinstance(e, RpcError) or (type(code) is int and hasattr(e, "message") and hasattr(e, "to_dict")):
        return e.code, e.message, getattr(e, "data", None)  # type: ignore[attr-defined]
    from operate_sidecar.server.core import errors as ce

    if isinstance(e, ce.ValidationFailed):
        return VALIDATION_FAILED, str(e), {"expected": e.expected, "received": truncate_received(e.received)}
    if isinstance(e, ce.ModelRefused):  # the model declined: its explanation, for the client to show
        return MODEL_ERROR, str(e), {"refusal": e.refusal}
    if isinstance(e, ce.ModelError):
        return MODEL_ERROR, str(e) or "model error", None
    if isinstance(e, ce.FieldNameClash):  # where the caller named the field, and which
        return INVALID_PARAMS, f"invalid params: {e}", {"path": e.path, "field": e.field}
    if isinstance(e, (ce.RemovedArgumentError, ce.ConfigurationError, ce.ToolNotRegistered,
                      ce.ToolArgumentError)):
        return INVALID_PARAMS, f"invalid params: {e}", None
    from operate_sidecar.server.models import ModelConfigError

    if isinstance(e, ModelConfigError):
        return INVALID_PARAMS, f"invalid params: {e}", None
    data = {"traceback": traceback.format_exception(type(e), e, e.__traceback__)} if debug else None
    return INTERNAL_ERROR, f"internal error: {_short(e)}", data
