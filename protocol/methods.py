"""Method names of docs/PROTOCOL.md (exact wire strings)."""

__all__ = [
    "INITIALIZE", "INITIALIZED", "PING", "SHUTDOWN", "EXIT",
    "CREATE_BRANCH", "FORK_BRANCH", "DELETE_BRANCH", "LIST_BRANCHES", "BRANCH_MESSAGES",
    "LIST_TOOLS", "AUTHORIZE_TOOL", "REGISTER_CLIENT_TOOLS", "OPERATE",
    "REQUEST_TOOL_PERMISSION", "INVOKE_CLIENT_TOOL", "FS_READ_TEXT_FILE", "FS_WRITE_TEXT_FILE",
    "PROGRESS", "TOOL_EVENT", "LOG_MESSAGE", "CANCEL_REQUEST",
    "SERVER_REQUESTS", "CLIENT_NOTIFICATIONS", "SERVER_NOTIFICATIONS", "CLIENT_REQUESTS",
    "ALLOWED_BEFORE_INITIALIZE", "ALLOWED_AFTER_SHUTDOWN",
]

# client -> server requests (§2-§5)
INITIALIZE = "initialize"
PING = "ping"
SHUTDOWN = "shutdown"
CREATE_BRANCH = "createBranch"
FORK_BRANCH = "forkBranch"
DELETE_BRANCH = "deleteBranch"
LIST_BRANCHES = "listBranches"
BRANCH_MESSAGES = "branchMessages"
LIST_TOOLS = "listTools"
AUTHORIZE_TOOL = "authorizeTool"
REGISTER_CLIENT_TOOLS = "registerClientTools"
OPERATE = "operate"

# client -> server notifications
INITIALIZED = "initialized"
EXIT = "exit"
CANCEL_REQUEST = "$/cancelRequest"

# server -> client requests (§4)
REQUEST_TOOL_PERMISSION = "requestToolPermission"
INVOKE_CLIENT_TOOL = "invokeClientTool"
FS_READ_TEXT_FILE = "fs/readTextFile"    # with initialize capabilities.fs
FS_WRITE_TEXT_FILE = "fs/writeTextFile"

# server -> client notifications (§6)
PROGRESS = "$/progress"
TOOL_EVENT = "toolEvent"
LOG_MESSAGE = "window/logMessage"

#: Every request method the server serves (``initialize`` result ``capabilities.methods``).
SERVER_REQUESTS: tuple[str, ...] = (
    INITIALIZE, PING, SHUTDOWN,
    CREATE_BRANCH, FORK_BRANCH, DELETE_BRANCH, LIST_BRANCHES, BRANCH_MESSAGES,
    LIST_TOOLS, AUTHORIZE_TOOL, REGISTER_CLIENT_TOOLS,
    OPERATE,
)
CLIENT_NOTIFICATIONS: tuple[str, ...] = (INITIALIZED, EXIT, CANCEL_REQUEST)
#: ``initialize`` result ``capabilities.notifications``.
SERVER_NOTIFICATIONS: tuple[str, ...] = (PROGRESS, TOOL_EVENT, LOG_MESSAGE)
CLIENT_REQUESTS: tuple[str, ...] = (REQUEST_TOOL_PERMISSION, INVOKE_CLIENT_TOOL, FS_READ_TEXT_FILE,
                                    FS_WRITE_TEXT_FILE)

#: Requests answered before ``initialize`` (others get -32002).
ALLOWED_BEFORE_INITIALIZE: frozenset[str] = frozenset({INITIALIZE, PING})
#: Requests answered after ``shutdown`` (others get -32600).
ALLOWED_AFTER_SHUTDOWN: frozenset[str] = frozenset({PING})
