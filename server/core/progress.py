"""Progress reporting without a transport: a context variable holds the sink
of the operate call being run (the service installs one per request that
carried a ``workDoneToken``). Sinks are synchronous and must be cheap. The core
begins and reports; whoever installed the sink ends it (one request may run
several operates)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol


class ProgressSink(Protocol):
    """``begin`` and ``report`` (``delta``: a piece of the model's reply text). A sink may also
    have ``think(text)``: the model's thoughts (``thinking`` chunks), which are not the reply
    and are never recorded; the core passes them to a sink that has it."""

    def begin(self, message: str) -> None: ...

    def report(self, message: str, phase: str, delta: str | None = None) -> None: ...


#: the ``parse`` report's message before each repair turn (``REPAIR_ATTEMPT 2``): a front end
#: may tell its user why the reply is taking longer
REPAIR_ATTEMPT = "repair attempt"

current_progress: ContextVar[ProgressSink | None] = ContextVar("current_progress", default=None)


def report(message: str, phase: str, delta: str | None = None) -> None:
    sink = current_progress.get()
    if sink is not None:
        sink.report(message, phase, delta)
