"""JSON-RPC error codes of docs/PROTOCOL.md §8 and the exceptions that carry them."""

from typing import Any

__all__ = [
    "PARSE_ERROR", "INVALID_REQUEST", "METHOD_NOT_FOUND", "INVALID_PARAMS", "INTERNAL_ERROR",
    "SERVER_NOT_INITIALIZED", "REQUEST_CANCELLED", "VALIDATION_FAILED", "MODEL_ERROR",
    "BRANCH_NOT_FOUND", "STATE_NOT_SAVED", "ERROR_CODES", "RpcError", "ParamsError",
]

PARSE_ERROR = -32700             # body is not JSON (answered with id null)
INVALID_REQUEST = -32600         # JSON but not a request/notification; oversized body; after shutdown
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602          # unknown fields (named), wrong types, unknown tool, removed names
INTERNAL_ERROR = -32603          # no traceback unless --debug
SERVER_NOT_INITIALIZED = -32002  # a request other than initialize/ping before initialize
REQUEST_CANCELLED = -32800       # $/cancelRequest
VALIDATION_FAILED = -32010       # operate handleValidation "raise" on a mismatch
MODEL_ERROR = -32011             # model/provider failure, secrets redacted
BRANCH_NOT_FOUND = -32012        # unknown branchId
STATE_NOT_SAVED = -32013         # state could not be saved (stateDir): the change was not applied

ERROR_CODES: dict[str, int] = {
    "ParseError": PARSE_ERROR,
    "InvalidRequest": INVALID_REQUEST,
    "MethodNotFound": METHOD_NOT_FOUND,
    "InvalidParams": INVALID_PARAMS,
    "InternalError": INTERNAL_ERROR,
    "ServerNotInitialized": SERVER_NOT_INITIALIZED,
    "RequestCancelled": REQUEST_CANCELLED,
    "ValidationFailed": VALIDATION_FAILED,
    "ModelError": MODEL_ERROR,
    "BranchNotFound": BRANCH_NOT_FOUND,
    "StateNotSaved": STATE_NOT_SAVED,
}


class RpcError(Exception):
    """An error answer: ``{"code", "message", "data"?}``. Raise it from a handler."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_dict(self) -> dict[str, Any]:
        """The JSON-RPC ``error`` member (``data`` only when not None)."""
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code}, {self.message!r}, {self.data!r})"


def _render_path(path: tuple) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class ParamsError(RpcError):
    """Invalid params (-32602). ``path`` locates the bad value (wire names, list indices);
    ``unknown_fields`` lists every unknown key found, as dotted wire paths (top-level ones
    are bare names: ``["foo"]``, nested ones ``["instruct.foo"]``)."""

    def __init__(self, message: str, unknown_fields: list[str] | None = None,
                 path: tuple = ()) -> None:
        self.detail = message
        self.path = tuple(path)
        self.unknown_fields = list(unknown_fields or [])
        where = _render_path(self.path)
        full = f"{where}: {message}" if where else message
        data = {"unknownFields": self.unknown_fields} if self.unknown_fields else None
        super().__init__(INVALID_PARAMS, f"invalid params: {full}", data)

    def at(self, *outer: str | int) -> "ParamsError":
        """The same error seen from an enclosing object (path and unknown names prefixed)."""
        prefix = _render_path(tuple(outer))
        unknown = [_join(prefix, u) for u in self.unknown_fields]
        return ParamsError(self.detail, unknown, tuple(outer) + self.path)


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    return prefix + name if name.startswith("[") else f"{prefix}.{name}"
