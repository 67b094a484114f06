"""What the MCP-in-the-server test files share: a bounded wait on a condition and the warnings a
server sent (their ``make`` fixture is this folder's conftest.py's)."""

import time
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
WAIT = 60  # seconds: every wait here is bounded


def until(condition, what):
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"not seen in {WAIT} s: {what}"
        time.sleep(0.02)


def warnings(c, about=""):
    return [p["message"] for p in c.of("window/logMessage") if p.get("type") == 2 and about in p["message"]]
