"""Tracebacks Python itself prints on stderr (docs/SECURITY.md, Secrets): an exception a tool's own
thread does not catch, one raised in a ``__del__``, reach the server's stderr through the same
secret-masking filter as its log lines, not as Python's default hooks write them."""

from __future__ import annotations

import os
from pathlib import Path

from .support import TIMEOUT, scripted, server_env

KEY = "strayKeyM3n4B5v6C7x8Z9a0Q1w2"
KEY_ENV = "STRAY_TRACEBACK_KEY"

TOOLS = '''
import os
import threading


class Leaky:
    """An object whose finalizer fails with the secret in its message."""

    def __init__(self, secret: str) -> None:
        self.secret = secret

    def __del__(self) -> None:
        raise RuntimeError("finalizer lost " + self.secret)


def leak(name: str) -> str:
    """Raise the value of an environment variable in a thread of its own and in a __del__."""
    secret = os.environ.get(name, "")

    def work() -> None:
        raise RuntimeError("thread lost " + secret)

    t = threading.Thread(target=work, name="tool-worker")
    t.start()
    t.join(10)
    Leaky(secret)  # dropped at once: its __del__ raises where nothing can catch it
    return "left"
'''


def test_a_tools_thread_and_finalizer_tracebacks_reach_stderr_masked(spawn, tmp_path: Path):
    (tmp_path / "stray_tools.py").write_text(TOOLS)
    c = spawn(env={"PYTHONPATH": str(tmp_path) + os.pathsep + server_env()["PYTHONPATH"], KEY_ENV: KEY})
    c.init(models={"s": scripted({"json": {"action_requests": [{"function": "leak", "arguments": {"name": KEY_ENV}}]}},
                                 "done")},
           toolModules=["stray_tools"], secretEnv=[KEY_ENV])
    out = c.request("operate", {"branchId": c.branch(), "instruction": "go", "actions": True}, timeout=TIMEOUT)
    assert out["result"]["action_responses"][0]["output"] == "left"
    assert c.close() == 0
    err = c.stderr_text()
    assert KEY not in err, err[-3000:]
    assert "Exception in thread tool-worker" in err and "RuntimeError: thread lost [REDACTED]" in err, err[-3000:]
    assert "Exception ignored in: <function Leaky.__del__" in err, err[-3000:]
    assert "RuntimeError: finalizer lost [REDACTED]" in err, err[-3000:]
