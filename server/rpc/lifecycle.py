"""Exit hooks: callables run once when the server stops (stdin EOF, ``exit``,
parent death), after in-flight work was cancelled. The state layer registers
its flush here. Hooks may be sync or async; failures are logged."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

_hooks: list[Callable[[], Any]] = []


def register_exit_hook(fn: Callable[[], Any]) -> Callable[[], Any]:
    _hooks.append(fn)
    return fn


async def run_exit_hooks() -> None:
    while _hooks:
        fn = _hooks.pop()
        try:
            out = fn()
            if inspect.isawaitable(out):
                await out
        except Exception:
            log.exception("exit hook %r failed", fn)
