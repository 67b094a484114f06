"""A sync tool that blocks until released and counts how many run at once, for the tests of
the bounded pool sync tools run on (tests/core/test_tool_threads.py and
tests/service/test_service_tool_threads.py). Every wait is bounded."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

WAIT = 30  # seconds: the bound of every wait


class Gate:
    """``slow(i)`` blocks until ``release`` is set (at most ``WAIT``), then answers ``"done {i}"``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.peak = self.started = self.finished = 0

    def slow(self, i: int = 0) -> str:
        with self.lock:
            self.running += 1
            self.started += 1
            self.peak = max(self.peak, self.running)
        try:
            self.release.wait(WAIT)
            return f"done {i}"
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)
