"""Exit when the client process dies (``processId`` / ``--client-process-id``).

A process id is an integer from 1 to :data:`MAX_PID` (a ``pid_t``). The command line refuses
any other; an ``initialize`` ``processId`` outside that range names no process that can be
watched (0 and negative numbers name process groups to kill(2), and 2^31 or more cannot be
asked about at all): it is ignored, with a warning in the log, and the server runs on until
the end of its input, as without one (docs/PROTOCOL.md §2)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

log = logging.getLogger(__name__)

#: the largest process id: a ``pid_t`` is a signed 32-bit integer
MAX_PID = 2**31 - 1


def valid_pid(pid: object) -> bool:
    """Whether ``pid`` is a process id that can be watched (an integer from 1 to ``MAX_PID``)."""
    return type(pid) is int and 1 <= pid <= MAX_PID


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not). Never raises: a value that is no
    process id (:func:`valid_pid`) is no live process."""
    if not valid_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    try:  # a zombie (dead, not yet reaped) still answers kill(0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


async def watch_parent(pid: int, on_dead: Callable[[], None], interval: float = 1.0) -> None:
    """Call ``on_dead`` once process ``pid`` is gone (checked every ``interval`` seconds). A
    ``pid`` that is no process id is not watched: one warning says so."""
    if not valid_pid(pid):
        log.warning("processId %r is not a process id (an integer from 1 to %d); the client process is not "
                    "watched: the server exits at the end of its input", pid, MAX_PID)
        return
    while True:
        if not process_alive(pid):
            log.warning("client process %d is gone; exiting", pid)
            on_dead()
            return
        await asyncio.sleep(interval)
