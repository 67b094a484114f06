"""Exit when the client process dies (``processId`` / ``--client-process-id``)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

log = logging.getLogger(__name__)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    try:  # a zombie (dead, not yet reaped) still answers kill(0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


async def watch_parent(pid: int, on_dead: Callable[[], None], interval: float = 1.0) -> None:
    while True:
        if not process_alive(pid):
            log.warning("client process %d is gone; exiting", pid)
            on_dead()
            return
        await asyncio.sleep(interval)
