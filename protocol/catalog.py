"""Which types each method carries: ``REQUESTS[method] = (params type, result type)``,
``NOTIFICATIONS[method] = params type``. ``None`` as a result type means the result is null.

``REQUESTS`` is also what the native server serves: it registers one handler per entry (by
the method's name), advertises the keys in ``initialize`` and answers anything else -32601;
a request added here without a handler fails the server's tests."""

from . import methods as m
from .branches import (BranchIdResult, BranchMessagesParams, BranchMessagesResult, BranchParams,
                       CreateBranchParams, ListBranchesResult)
from .lifecycle import Empty, ExitParams, InitializedParams, InitializeParams, InitializeResult
from .notifications import CancelParams, LogMessageParams, ProgressParams, ToolEventParams
from .operate import OperateParams, OperateResult
from .tools import (AuthorizeToolParams, AuthorizeToolResult, InvokeClientToolParams,
                    InvokeClientToolResult, ListToolsParams, ListToolsResult,
                    RegisterClientToolsParams, RegisterClientToolsResult,
                    ReadTextFileParams, ReadTextFileResult, RequestToolPermissionParams,
                    RequestToolPermissionResult, WriteTextFileParams)

__all__ = ["REQUESTS", "SERVER_TO_CLIENT_REQUESTS", "NOTIFICATIONS", "SERVER_NOTIFICATIONS",
           "params_type", "result_type"]

#: client -> server requests: method -> (params, result)
REQUESTS: dict[str, tuple[type, type | None]] = {
    m.INITIALIZE: (InitializeParams, InitializeResult),
    m.PING: (Empty, Empty),
    m.SHUTDOWN: (Empty, None),
    m.CREATE_BRANCH: (CreateBranchParams, BranchIdResult),
    m.FORK_BRANCH: (BranchParams, BranchIdResult),
    m.DELETE_BRANCH: (BranchParams, Empty),
    m.LIST_BRANCHES: (Empty, ListBranchesResult),
    m.BRANCH_MESSAGES: (BranchMessagesParams, BranchMessagesResult),
    m.LIST_TOOLS: (ListToolsParams, ListToolsResult),
    m.AUTHORIZE_TOOL: (AuthorizeToolParams, AuthorizeToolResult),
    m.REGISTER_CLIENT_TOOLS: (RegisterClientToolsParams, RegisterClientToolsResult),
    m.OPERATE: (OperateParams, OperateResult),
}
#: server -> client requests
SERVER_TO_CLIENT_REQUESTS: dict[str, tuple[type, type | None]] = {
    m.REQUEST_TOOL_PERMISSION: (RequestToolPermissionParams, RequestToolPermissionResult),
    m.INVOKE_CLIENT_TOOL: (InvokeClientToolParams, InvokeClientToolResult),
    m.FS_READ_TEXT_FILE: (ReadTextFileParams, ReadTextFileResult),
    m.FS_WRITE_TEXT_FILE: (WriteTextFileParams, Empty),
}
#: client -> server notifications
NOTIFICATIONS: dict[str, type] = {
    m.INITIALIZED: InitializedParams,
    m.EXIT: ExitParams,
    m.CANCEL_REQUEST: CancelParams,
}
#: server -> client notifications
SERVER_NOTIFICATIONS: dict[str, type] = {
    m.PROGRESS: ProgressParams,
    m.TOOL_EVENT: ToolEventParams,
    m.LOG_MESSAGE: LogMessageParams,
}

assert tuple(REQUESTS) == m.SERVER_REQUESTS
assert tuple(NOTIFICATIONS) == m.CLIENT_NOTIFICATIONS
assert tuple(SERVER_NOTIFICATIONS) == m.SERVER_NOTIFICATIONS


def params_type(method: str) -> type | None:
    """The params type of any method (either direction), or None if unknown."""
    for table in (REQUESTS, SERVER_TO_CLIENT_REQUESTS):
        if method in table:
            return table[method][0]
    return NOTIFICATIONS.get(method) or SERVER_NOTIFICATIONS.get(method)


def result_type(method: str) -> type | None:
    """The result type of a request method (None: the result is null, or unknown method)."""
    entry = REQUESTS.get(method) or SERVER_TO_CLIENT_REQUESTS.get(method)
    return entry[1] if entry else None
