"""Tool hook events (D4): TOOL_PRE, then TOOL_POST or TOOL_ERROR; plus
TOOL_DENIED for governance denials (observability only)."""

from __future__ import annotations

import json
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

    def __post_init__(self) -> None:
        # the summaries are JSON text; an error given as a ``summarize`` is its plain text
        if isinstance(self.args_summary, Summary):
            self.args_summary = str.__str__(self.args_summary)
        if isinstance(self.result_summary, Summary):
            self.result_summary = str.__str__(self.result_summary)
        if isinstance(self.error, Summary):
            self.error = self.error.plain


HookHandler = Callable[[HookEvent], Awaitable[None] | None]


class Summary(str):
    """What :func:`summarize` answers: the value's compact JSON text cut to the bound (a
    ``toolEvent``'s ``argsSummary``, ``resultSummary``), that also knows the plain text of a
    string value cut the same way (``plain``; what an ``error`` carries)."""

    plain: str


def _json_text(value: Any) -> str:
    """Compact JSON (non-ASCII kept) of ``value``; a value JSON cannot hold as it is in the
    form tool outputs get (``act.json_output``: NaN as ``"NaN"``, bytes as text ...)."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        from .act import json_output

        return json.dumps(json_output(value)[0], ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except Exception:  # noqa: BLE001 - a summary never fails a call: its text as a JSON string
        return json.dumps(_plain(value), ensure_ascii=False)


def _plain(value: Any) -> str:
    try:
        return value if isinstance(value, str) else str(value)
    except Exception:  # noqa: BLE001
        return f"<{type(value).__name__}>"


def summarize(value: Any, limit: int = SUMMARY_LIMIT) -> Summary:
    """``value`` as compact JSON text (non-ASCII kept, a string quoted), cut to ``limit``
    characters (no ellipsis appended; a cut text is no longer valid JSON). ``.plain``: a
    string value as it is, cut the same way (the JSON text for any other value)."""
    if isinstance(value, str):  # only the first characters can reach the cut
        text = json.dumps(value[:limit], ensure_ascii=False)
    else:
        text = _json_text(value)
    out = Summary(text[:limit])
    out.plain = value[:limit] if isinstance(value, str) else str.__str__(out)
    return out


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
