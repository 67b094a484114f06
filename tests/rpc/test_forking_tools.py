"""A tool that forks (``os.fork``, ``multiprocessing.Pool``) leaves the server alone: a SIGTERM
its child gets is the child's, not the server's (server/signals.py ``_untie_forked_child``)."""

from __future__ import annotations

import os
import time

from .support import TIMEOUT, scripted


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


def gone(pid: int) -> bool:
    """True once ``pid`` is no live process (bounded wait: the server reaps its children)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def operate(c) -> list:
    res = c.request("operate", {"branchId": c.branch(), "instruction": "go", "actions": True}, timeout=TIMEOUT)
    return [r["output"] for r in res["result"]["action_responses"]]


def test_a_forked_child_that_sigterms_itself_does_not_stop_the_server(sidecar):
    sidecar.init(models={"s": scripted(call("fork_self_term"))}, toolModules=["forking_tools"])
    [pids] = operate(sidecar)
    assert sidecar.proc.poll() is None and sidecar.request("ping") == {}
    assert all(gone(p) for p in pids)
    assert sidecar.close() == 0


def test_a_multiprocessing_pool_in_a_tool_does_not_stop_the_server(sidecar):
    sidecar.init(models={"s": scripted(call("pool_squares", n=4), call("pool_squares", n=3))},
                 toolModules=["forking_tools"])
    [first] = operate(sidecar)
    [second] = operate(sidecar)
    assert first["squares"] == [0, 1, 4, 9] and second["squares"] == [0, 1, 4]
    assert sidecar.proc.poll() is None and sidecar.request("ping") == {}
    assert all(gone(p) for p in first["pids"] + second["pids"])
    assert sidecar.close() == 0


def test_a_child_sent_sigterm_before_it_ran_does_not_stop_the_server(sidecar):
    """A child SIGTERMed before it was scheduled took the signal with the server's handler (the
    after-fork hook had not run yet), which wrote it to the wake-up fd it shares with the server:
    the server stopped. The signals are blocked across the fork (server/signals.py)."""
    sidecar.init(models={"s": scripted(call("fork_and_term_at_once"))}, toolModules=["forking_tools"])
    [pids] = operate(sidecar)
    assert len(pids) == 20
    assert sidecar.proc.poll() is None and sidecar.request("ping") == {}
    assert sidecar.close() == 0
