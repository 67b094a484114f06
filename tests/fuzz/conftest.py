"""Fuzz fixtures: the per-module server lives in each test module (module scope);
this file only reports how many inputs each fuzz test generated."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_support import COUNTS, OUTCOMES  # noqa: E402


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    terminalreporter.section("fuzz inputs generated")
    for name, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{n:7d}  {name}")
    terminalreporter.write_line(f"{sum(COUNTS.values()):7d}  total")
    if OUTCOMES:
        terminalreporter.write_line("answers to fuzzed params (method, result or error code):")
        terminalreporter.write_line("  " + ", ".join(f"{k}: {v}" for k, v in sorted(OUTCOMES.items())))
