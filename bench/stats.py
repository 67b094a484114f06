"""Small statistics helpers (stdlib only)."""
from __future__ import annotations

import statistics


def pct(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..1)."""
    if not sorted_xs:
        return float("nan")
    k = min(len(sorted_xs) - 1, max(0, int(round(q * (len(sorted_xs) - 1)))))
    return sorted_xs[k]


def summary(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"n": len(s), "median": statistics.median(s), "p99": pct(s, 0.99),
            "min": s[0], "max": s[-1], "mean": statistics.fmean(s)}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b
