"""The signals the sidecar's loop takes over (SIGTERM, SIGINT, SIGHUP: a polite kill still
cancels in-flight work and flushes journaled state), in both front ends, and what a child
forked by a tool gets back.

A child forked by a tool (``multiprocessing.Pool``, ``os.fork``) would keep the loop's signal
wake-up fd: a SIGTERM sent to the child (``Pool.terminate``) was then read by the server's loop
as its own, and stopped the server. The child gets the dispositions from before the loop took
them, and no wake-up fd."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

#: the signals whose handling the server's loop takes over
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: the dispositions those signals had before the loop took them; a forked child gets them back
_before_loop: dict[int, Any] = {}
_fork_hook_installed = False


def _untie_forked_child() -> None:
    """In a forked child: the handled signals' dispositions from before the loop took them,
    and no signal wake-up fd."""
    if not _before_loop:
        return
    try:
        signal.set_wakeup_fd(-1)
        for sig, disposition in _before_loop.items():
            signal.signal(sig, disposition)
    except (ValueError, OSError):  # pragma: no cover - the child cannot change them: leave as is
        pass


def install_signal_handlers(loop: asyncio.AbstractEventLoop, handler: Any) -> None:
    """``handler`` runs on the loop for SIGTERM, SIGINT and SIGHUP; children forked later
    get the dispositions from before back (``_untie_forked_child``)."""
    global _fork_hook_installed
    for sig in HANDLED_SIGNALS:
        try:
            previous = signal.getsignal(sig)
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError, ValueError):  # pragma: no cover - not the main thread
            continue
        _before_loop.setdefault(sig, signal.SIG_DFL if previous is None else previous)
    if _before_loop and not _fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_untie_forked_child)
        _fork_hook_installed = True
