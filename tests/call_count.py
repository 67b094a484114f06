"""Counting the Python functions a piece of async work calls (``sys.setprofile``): how the
first-request tests (``tests/acp/test_startup.py``, ``tests/rpc/test_warm_up.py``) show that
a first request does no first-use work, with a count instead of a time (the times are in
``bench/``). The child processes those tests run import ``counted`` from here (``HERE`` on
their PYTHONPATH); the tests check the counts with ``assert_first_as_warm``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, Awaitable

HERE = str(Path(__file__).resolve().parent)

#: calls a first request may make beyond a warm one: the few per-session (per-branch) objects
#: made on first use (the ACP outbox and its pump, the branch lock, the tool pool: ~15 calls)
FIRST_USE_CALLS = 30


async def counted(aw: Awaitable[Any], timeout: float = 60.0) -> tuple[Any, int]:
    """(``aw``'s result, the Python functions called on this thread while it ran: the tasks it
    waits for included, as they run on the same event loop's thread). Bounded by ``timeout``."""
    n = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event == "call":
            n += 1

    sys.setprofile(profile)
    try:
        result = await asyncio.wait_for(aw, timeout)
    finally:
        sys.setprofile(None)
    return result, n


def assert_first_as_warm(counts: list[int], what: str) -> None:
    """``counts``: the first request's call count, then warm ones'. The warm count is stable,
    and the first makes at most ``FIRST_USE_CALLS`` more."""
    first, *warm = counts
    assert len(set(warm[1:])) == 1, warm  # a warm request's count is stable
    assert first - warm[-1] <= FIRST_USE_CALLS, \
        f"the first {what} made {first - warm[-1]} calls more than a warm one ({warm})"
