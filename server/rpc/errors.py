"""JSON-RPC error codes (PROTOCOL §8) and the one exception the RPC layer raises
to answer a request with an error."""

from __future__ import annotations

from typing import Any

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
NOT_INITIALIZED = -32002
REQUEST_CANCELLED = -32800
VALIDATION_FAILED = -32010
MODEL_ERROR = -32011
BRANCH_NOT_FOUND = -32012

try:  # prefer the protocol package's constants once it provides them
    from protocol import errors as _p  # type: ignore

    PARSE_ERROR = getattr(_p, "PARSE_ERROR", PARSE_ERROR)
    INVALID_REQUEST = getattr(_p, "INVALID_REQUEST", INVALID_REQUEST)
    METHOD_NOT_FOUND = getattr(_p, "METHOD_NOT_FOUND", METHOD_NOT_FOUND)
    INVALID_PARAMS = getattr(_p, "INVALID_PARAMS", INVALID_PARAMS)
    INTERNAL_ERROR = getattr(_p, "INTERNAL_ERROR", INTERNAL_ERROR)
    NOT_INITIALIZED = getattr(_p, "NOT_INITIALIZED", NOT_INITIALIZED)
    REQUEST_CANCELLED = getattr(_p, "REQUEST_CANCELLED", REQUEST_CANCELLED)
    VALIDATION_FAILED = getattr(_p, "VALIDATION_FAILED", VALIDATION_FAILED)
    MODEL_ERROR = getattr(_p, "MODEL_ERROR", MODEL_ERROR)
    BRANCH_NOT_FOUND = getattr(_p, "BRANCH_NOT_FOUND", BRANCH_NOT_FOUND)
except Exception:  # pragma: no cover - protocol/ not there yet
    pass


class RpcError(Exception):
    """Answer the current request with ``{code, message, data?}``."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_dict(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err


def invalid_params(message: str, data: Any = None) -> RpcError:
    return RpcError(INVALID_PARAMS, message, data)


def branch_not_found(branch_id: Any) -> RpcError:
    return RpcError(BRANCH_NOT_FOUND, f"branch not found: {branch_id}", {"branchId": branch_id})
