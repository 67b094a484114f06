"""JSON-RPC error codes (docs/PROTOCOL.md) for the start-up fast path, and the service's
error types for the native front end.

The codes are the same values as ``protocol.errors`` (pinned by tests/rpc/test_catalog.py);
not imported from there because that package costs more than answering initialize. The
error class and constructors (``RpcError``, ``invalid_params``, ``branch_not_found``,
``state_not_saved``) and ``map_exception`` are the service's (``server.service.errors``),
re-exported here on first use so that importing this module stays free."""

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

_SERVICE_NAMES = frozenset({"RpcError", "invalid_params", "branch_not_found", "state_not_saved", "map_exception"})


def __getattr__(name: str) -> Any:
    if name in _SERVICE_NAMES:
        from operate_sidecar.server.service import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
