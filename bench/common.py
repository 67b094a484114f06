"""What every part of the harness shares: which operate-sidecar it measures, how a section that
fails is recorded, and how a run stops on Ctrl-C or SIGTERM.

- ``ours_argv()``: the server every "ours" measure spawns, ``$OPERATE_SIDECAR_BIN`` if set, else
  ``.venv/bin/operate-sidecar``. A program that does not exist makes the measure unavailable
  (``Unavailable``, with the path in its reason): no section falls back to another server.
- ``pinned(argv, cpu)``: ``argv`` run on CPU ``cpu`` alone (``taskset -c``), when there is one
  and ``taskset`` is installed; ``argv`` as it is otherwise.
- ``attempt(fn)``: ``fn()``, or ``{"unavailable": "unavailable: <reason>"}`` when it raises, so
  that one section failing does not end the run.
- ``stop_by_raising()`` / ``stop_by_cancelling(task)``: the first SIGINT or SIGTERM stops the run
  (``KeyboardInterrupt`` in the main thread, or the main task cancelled); later ones are ignored,
  so that the cleanup that follows (servers closed or killed, temporary folders removed) runs
  to its end. ``exit_code()`` is then 128 + the signal's number (130, 143).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_BIN = ROOT / ".venv" / "bin" / "operate-sidecar"
BIN_ENV = "OPERATE_SIDECAR_BIN"


class Unavailable(Exception):
    """What a measure needs is missing; the message says what."""


def ours_bin() -> str:
    """The operate-sidecar program measured (not checked)."""
    return os.environ.get(BIN_ENV) or str(DEFAULT_BIN)


def ours_label() -> str:
    """How results name it: the override, when there is one, is part of the label."""
    return f"operate-sidecar [{BIN_ENV}={os.environ[BIN_ENV]}]" if os.environ.get(BIN_ENV) else "operate-sidecar"


def ours_argv() -> list[str]:
    """``[program]``, or ``Unavailable`` when it does not exist."""
    exe = ours_bin()
    if not os.path.exists(exe):
        how = f"{BIN_ENV}={exe}" if os.environ.get(BIN_ENV) else exe
        raise Unavailable(f"{how} not found")
    return [exe]


def pinned(argv: list[str], cpu: int | None) -> list[str]:
    """``argv`` run on CPU ``cpu`` alone (``taskset -c``): as it is when ``cpu`` is None or
    ``taskset`` is not installed."""
    if cpu is not None and shutil.which("taskset"):
        return ["taskset", "-c", str(cpu), *argv]
    return argv


def override_note(res: dict[str, Any]) -> str:
    """For a section's first line: which program was measured, when it is not the default."""
    label = res.get("ours") or ""
    return f"; measured: `{label}`" if BIN_ENV in label else ""


def reason(e: BaseException) -> str:
    if isinstance(e, Unavailable):
        return f"unavailable: {e}"
    return f"unavailable: {type(e).__name__}: {e}" if str(e) else f"unavailable: {type(e).__name__}"


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure makes the section unavailable
        return {"unavailable": reason(e)[:800]}


# ---------------------------------------------------------------- stopping
_stopped: dict[str, int | None] = {"signum": None}


def stopped_by() -> int | None:
    """The signal that stopped the run, if one did."""
    return _stopped["signum"]


def exit_code() -> int:
    return 128 + (_stopped["signum"] or signal.SIGINT)


def stop_by_raising() -> None:
    """Main thread, blocking code: the first SIGINT or SIGTERM raises ``KeyboardInterrupt``."""

    def handler(signum: int, frame: Any) -> None:
        _stopped["signum"] = signum
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def stop_by_cancelling(task: asyncio.Task) -> None:
    """In a running event loop: the first SIGINT or SIGTERM cancels ``task``."""
    loop = asyncio.get_running_loop()

    def handler(signum: int) -> None:
        if _stopped["signum"] is None:
            _stopped["signum"] = signum
            task.cancel()

    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, handler, s)


def say_stopped() -> None:
    name = signal.Signals(_stopped["signum"] or signal.SIGINT).name
    print(f">> stopped by {name}: servers closed, temporary folders removed, nothing more written",
          file=sys.stderr, flush=True)
