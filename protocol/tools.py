"""PROTOCOL.md §4: tools, governance, and the server -> client requests."""

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
class RequestToolPermissionParams:
    branch_id: str
    call_id: str
    tool: str
    arguments: JsonObject
    options: list[PermissionOption]


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
