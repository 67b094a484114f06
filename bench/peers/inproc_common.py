"""Scenario definitions shared by the in-process operate benchmarks.

Imported by bench/peers/lionagi_inproc.py (lionagi venv) and bench/ours_inproc.py
(project venv), so both runtimes see the same instruction, schema, replies and
tool.  Only stdlib + pydantic here.
"""

import json
import statistics
import sys
import time

from pydantic import BaseModel

INSTRUCTION = "Add 2 and 3, then report the answer."
PLAIN_REPLY = "The answer is 5."


class Answer(BaseModel):
    """A small structured reply."""

    answer: str
    confidence: float


STRUCTURED_REPLY = json.dumps({"answer": "5", "confidence": 0.9})
ACTION_REPLY = json.dumps({
    "answer": "5",
    "confidence": 0.9,
    "action_required": True,
    "action_requests": [{"function": "add", "arguments": {"a": 2, "b": 3}}],
})


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def aadd(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


aadd.__name__ = aadd.__qualname__ = "add"  # same tool name as the sync one, so ACTION_REPLY calls it

# history scenario: message counts at which plain operate is measured
HISTORY_SIZES = (0, 400, 1000)


def summarize(samples_s: list[float]) -> dict:
    ms = sorted(x * 1000.0 for x in samples_s)
    n = len(ms)
    return {
        "n": n,
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(n - 1, int(round(0.99 * (n - 1))))],
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "mean_ms": statistics.fmean(ms),
    }


def argv_int(flag: str, default: int) -> int:
    if flag in sys.argv:
        return int(sys.argv[sys.argv.index(flag) + 1])
    return default


async def timed(coro_factory, n: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        await coro_factory()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await coro_factory()
        out.append(time.perf_counter() - t0)
    return out
