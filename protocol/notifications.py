"""docs/PROTOCOL.md §6 notifications (server -> client) and §7 cancellation."""

from typing import Literal

from ._base import Id, wire
from .operate import Usage

ProgressPhase = Literal["request", "stream", "parse", "actions"]
ProgressEndMessage = Literal["completed", "failed", "cancelled"]
ToolEventKind = Literal["pre", "post", "error", "denied"]
MessageType = Literal[1, 2, 3, 4]  # Error, Warning, Info, Log


@wire
class WorkDoneProgressBegin:
    kind: Literal["begin"] = "begin"
    title: Literal["operate"] = "operate"
    message: Literal["communicate", "run_and_collect"]


@wire
class WorkDoneProgressReport:
    """``delta`` carries streamed model text, in order; ``thought``, a reasoning model's thoughts
    (message ``thinking``), only to a client that announced ``capabilities.thoughts``."""
    kind: Literal["report"] = "report"
    message: str
    phase: ProgressPhase
    delta: str | None = None
    thought: str | None = None


@wire
class WorkDoneProgressEnd:
    """``usage``: the same as the operate result's (all rounds), always sent."""
    kind: Literal["end"] = "end"
    message: ProgressEndMessage
    usage: Usage


ProgressValue = WorkDoneProgressBegin | WorkDoneProgressReport | WorkDoneProgressEnd


@wire
class ProgressParams:
    """``$/progress`` for an operate that carried ``workDoneToken``."""
    token: Id
    value: ProgressValue


@wire
class ToolEventParams:
    """``toolEvent``: summaries are at most 200 characters; ``seq`` increases by one per event."""
    seq: int
    branch_id: str
    call_id: str
    event: ToolEventKind
    tool: str
    args_summary: str
    result_summary: str | None = None
    error: str | None = None
    duration_ms: float | None = None


@wire
class LogMessageParams:
    """``window/logMessage``."""
    type: MessageType
    message: str


@wire
class CancelParams:
    """``$/cancelRequest``."""
    id: Id
