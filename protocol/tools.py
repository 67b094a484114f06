"""docs/PROTOCOL.md §4: tools, governance, and the server -> client requests."""

from typing import Literal

from ._base import JsonObject, JsonSchema, JsonValue, wire
from .lifecycle import Decision

ToolSource = Literal["builtin", "python", "mcp", "client"]
PermissionOption = Literal["allow_once", "allow_always", "deny_once", "deny_always"]
PERMISSION_OPTIONS: list[str] = ["allow_once", "allow_always", "deny_once", "deny_always"]


@wire
class ListToolsParams:
    branch_id: str | None = None


@wire
class ToolInfo:
    """``policy`` is the decision in force (for the branch when ``listTools`` named one)."""
    name: str
    description: str
    input_schema: JsonSchema
    source: ToolSource
    policy: Decision


@wire
class ListToolsResult:
    tools: list[ToolInfo]


@wire
class AuthorizeToolParams:
    tool: str
    decision: Decision
    branch_id: str | None = None


@wire
class AuthorizeToolResult:
    """``branch_id`` is null when the server-wide decision was set."""
    tool: str
    decision: Decision
    branch_id: str | None


@wire
class ClientToolSpec:
    name: str
    description: str
    input_schema: JsonSchema


@wire
class RegisterClientToolsParams:
    tools: list[ClientToolSpec]


@wire
class RegisterClientToolsResult:
    registered: list[str]


# --- server -> client ---------------------------------------------------------------------

@wire
class DiffPreview:
    """What a file-changing builtin call would do, computed without writing. ``old_text`` is
    null for a file that does not exist yet; ``diff`` is a unified diff."""
    kind: Literal["diff"] = "diff"
    path: str
    old_text: str | None
    new_text: str
    diff: str


@wire
class RequestToolPermissionParams:
    """``preview`` is present for file-changing builtin tools (``write_file``, ``edit_file``)."""
    branch_id: str
    call_id: str
    tool: str
    arguments: JsonObject
    options: list[PermissionOption]
    preview: DiffPreview | None = None


@wire
class RequestToolPermissionResult:
    decision: PermissionOption


@wire
class InvokeClientToolParams:
    branch_id: str
    call_id: str
    tool: str
    arguments: JsonObject


@wire
class InvokeClientToolResult:
    output: JsonValue


@wire
class ReadTextFileParams:
    """``fs/readTextFile``: ``path`` is absolute and inside a workspace folder."""
    branch_id: str
    call_id: str
    path: str


@wire
class ReadTextFileResult:
    text: str


@wire
class WriteTextFileParams:
    """``fs/writeTextFile``: replace (or create) the file's text, e.g. in the editor's buffer."""
    branch_id: str
    call_id: str
    path: str
    text: str
