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

#: the signals whose handling the server's loop takes over (SIGHUP where the platform has it)
HANDLED_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None)
#: the dispositions those signals had before the loop took them; a forked child gets them back
_before_loop: dict[int, Any] = {}
_fork_hook_installed = False


def _block_for_fork() -> None:
    """Before a fork, in the forking thread: the handled signals are held back, so the child
    starts with them blocked. A child not scheduled until after a SIGTERM was sent to it (a
    ``Pool.terminate`` of a worker that had not run yet, on a loaded machine) would otherwise
    take it before ``_untie_forked_child`` ran, with the loop's handler, which writes it to the
    wake-up fd the child still shares with the server: the server then stopped."""
    if _before_loop:
        signal.pthread_sigmask(signal.SIG_BLOCK, _before_loop)


def _unblock_after_fork() -> None:
    """After a fork, in the parent's forking thread: the signals as they were."""
    if _before_loop:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _before_loop)


def _untie_forked_child() -> None:
    """In a forked child: the handled signals' dispositions from before the loop took them,
    and no signal wake-up fd; then the signals unblocked (one sent meanwhile is taken now,
    as the child's own)."""
    if not _before_loop:
        return
    try:
        signal.set_wakeup_fd(-1)
        for sig, disposition in _before_loop.items():
            signal.signal(sig, disposition)
    except (ValueError, OSError):  # pragma: no cover - the child cannot change them: leave as is
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _before_loop)


def install_signal_handlers(loop: asyncio.AbstractEventLoop, handler: Any, with_signal: bool = False,
                            before: dict[int, Any] | None = None) -> None:
    """``handler`` runs on the loop for SIGTERM, SIGINT and SIGHUP (``with_signal``: called with
    the signal's number); children forked later get the dispositions from before back
    (``_untie_forked_child``): ``before``'s, when something held them meanwhile (the start-up's
    recorder, ``server.__main__.EarlySignals``), else the ones the loop replaces."""
    global _fork_hook_installed
    for sig in HANDLED_SIGNALS:
        try:
            previous = signal.getsignal(sig)
            loop.add_signal_handler(sig, handler, *((sig,) if with_signal else ()))
        except (NotImplementedError, RuntimeError, ValueError):  # pragma: no cover - not the main thread
            continue
        if before is not None and sig in before:
            previous = before[sig]
        _before_loop.setdefault(sig, signal.SIG_DFL if previous is None else previous)
    if _before_loop and not _fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_block_for_fork, after_in_parent=_unblock_after_fork,
                            after_in_child=_untie_forked_child)
        _fork_hook_installed = True
