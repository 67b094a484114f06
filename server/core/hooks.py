"""Tool hook events (D4): TOOL_PRE, then TOOL_POST or TOOL_ERROR; plus
TOOL_DENIED for governance denials (observability only)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

SUMMARY_LIMIT = 200  # step D4 (docs/PIPELINE.md): observability bound, never truncates the real call


class HookEventType(str, Enum):
    TOOL_PRE = "pre"
    TOOL_POST = "post"
    TOOL_ERROR = "error"
    TOOL_DENIED = "denied"


@dataclass(slots=True)
class HookEvent:
    type: HookEventType
    branch_id: str
    call_id: str
    tool: str
    args_summary: str
    result_summary: str | None = None
    error: str | None = None
    duration_ms: float | None = None


HookHandler = Callable[[HookEvent], Awaitable[None] | None]


def summarize(value: Any, limit: int = SUMMARY_LIMIT) -> str:
    """``str(value)`` cut to ``limit`` characters (no ellipsis appended)."""
    text = value if isinstance(value, str) else str(value)
    return text[:limit]


class HookBus:
    """Ordered hook handlers. A TOOL_PRE handler that raises vetoes the call
    (the exception propagates); exceptions from other events are logged."""

    __slots__ = ("_handlers",)

    def __init__(self) -> None:
        self._handlers: list[HookHandler] = []

    def __bool__(self) -> bool:
        return bool(self._handlers)

    def subscribe(self, handler: HookHandler) -> Callable[[], None]:
        self._handlers.append(handler)

        def unsubscribe() -> None:
            if handler in self._handlers:
                self._handlers.remove(handler)

        return unsubscribe

    async def emit(self, event: HookEvent) -> None:
        for handler in list(self._handlers):
            try:
                out = handler(event)
                if out is not None and hasattr(out, "__await__"):
                    await out
            except Exception:
                if event.type is HookEventType.TOOL_PRE:
                    raise
                log.warning("hook handler failed for %s", event.type.value, exc_info=True)
