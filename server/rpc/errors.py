"""JSON-RPC error codes (docs/PROTOCOL.md) and the one exception the RPC layer raises
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
STATE_NOT_SAVED = -32013  # a change whose transaction failed: not applied, in memory or on disk

# The same values as protocol.errors (pinned by tests/rpc/test_catalog.py); not imported
# from there because that package costs more than answering initialize.


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


def state_not_saved(message: str, data: Any = None) -> RpcError:
    return RpcError(STATE_NOT_SAVED, f"state could not be saved: {message}", data)
