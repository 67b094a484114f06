"""docs/PROTOCOL.md §3: branches and their messages."""

from typing import Literal

import attrs

from ._base import JsonObject, JsonSchema, JsonValue, wire
from .lifecycle import Model
from .operate import Usage

MessageKind = Literal["system", "instruction", "assistant_response", "action_request", "action_response"]
MessageRole = Literal["system", "user", "assistant", "action"]


@wire
class CreateBranchParams:
    system: str | None = None
    chat_model: Model | None = None
    parse_model: Model | None = None
    name: str | None = None


@wire
class BranchIdResult:
    """Result of ``createBranch`` and ``forkBranch``."""
    branch_id: str


@wire
class BranchParams:
    """Params of ``forkBranch`` and ``deleteBranch``."""
    branch_id: str


@wire
class BranchInfo:
    branch_id: str
    name: str | None
    message_count: int
    chat_model: str | None
    usage: Usage  # totals of the operates run on the branch (always sent)


@wire
class ListBranchesResult:
    branches: list[BranchInfo]


@wire
class BranchMessagesParams:
    branch_id: str
    offset: int = 0
    limit: int = 1000


# --- message contents, one per kind -------------------------------------------------------

@wire
class SystemContent:
    text: str


@wire
class InstructionContent:
    """``response_schema`` is the JSON Schema actually sent to the model (null if none)."""
    instruction: JsonValue
    guidance: JsonValue
    context: JsonValue
    response_schema: JsonSchema | None
    tool_schemas: list[JsonObject] | None


@wire
class AssistantResponseContent:
    text: str | None
    model: str | None
    usage: JsonObject | None


@wire
class ActionRequestContent:
    call_id: str
    function: str
    arguments: JsonObject


@wire
class ActionResponseContent:
    """``output`` is never null: a failed or denied call holds ``{"error": ..., "function": ...}``."""
    call_id: str
    request_id: str
    function: str
    arguments: JsonObject
    output: JsonValue


CONTENT_BY_KIND: dict[str, type] = {
    "system": SystemContent,
    "instruction": InstructionContent,
    "assistant_response": AssistantResponseContent,
    "action_request": ActionRequestContent,
    "action_response": ActionResponseContent,
}
MessageContent = (SystemContent | InstructionContent | AssistantResponseContent
                  | ActionRequestContent | ActionResponseContent)


@wire
class Message:
    """One branch message, oldest first. ``content``'s shape is chosen by ``kind``."""
    id: str
    kind: MessageKind
    role: MessageRole
    sender: str | None
    recipient: str | None
    created_at: str  # ISO 8601, UTC
    content: MessageContent = attrs.field(metadata={"by": ("kind", CONTENT_BY_KIND)})


@wire
class BranchMessagesResult:
    messages: list[Message]
    total: int
