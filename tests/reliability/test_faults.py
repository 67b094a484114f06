"""Faults end to end (issue 5 §2): each one ends as the contract says and leaves the branch
consistent (every action_request has its action_response) and usable."""

from __future__ import annotations

import subprocess
import sys
import threading

from server.rpc.settings import DEFAULT_TOOL_TIMEOUT_MS

from .support import TIMEOUT, assert_consistent, calls, outputs, scripted


def act(c, bid, **extra):
    return c.request("operate", {"branchId": bid, "instruction": "go", "actions": True, **extra}, timeout=TIMEOUT)


def test_model_error_is_32011_and_the_branch_stays_usable(sidecar):
    sidecar.init(models={"s": scripted({"error": "upstream exploded"}, "after")})
    bid = sidecar.branch()
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x"})
    assert err.code == -32011 and "upstream exploded" in err.message
    assert_consistent(sidecar.messages(bid))
    assert sidecar.request("operate", {"branchId": bid, "instruction": "y"})["result"] == "after"


def test_model_timeout_is_32011(sidecar):
    sidecar.init(models={"s": scripted({"text": "too late", "delayMs": 60000}, "after", timeoutS=0.3)})
    bid = sidecar.branch()
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x"})
    assert err.code == -32011 and "timed out" in err.message
    assert_consistent(sidecar.messages(bid))
    assert sidecar.request("operate", {"branchId": bid, "instruction": "y"})["result"] == "after"


def test_a_raising_tool_gives_an_error_output_not_a_failed_operate(sidecar):
    sidecar.init(models={"s": scripted(calls(("raising_tool", {"x": 1})))}, toolModules=["recording_tools"])
    bid = sidecar.branch()
    out = act(sidecar, bid)
    [o] = outputs(out)
    assert o["function"] == "raising_tool" and "exploded on purpose" in o["error"]
    assert [i["tool"] for i in sidecar.invocations()] == ["raising_tool"]
    assert_consistent(sidecar.messages(bid))
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "error"]


def test_a_hanging_python_tool_hits_tool_timeout_ms(sidecar):
    sidecar.init(models={"s": scripted(calls(("hanging_tool", {"seconds": 30})), "after")},
                 toolModules=["recording_tools"], toolTimeoutMs=300)
    bid = sidecar.branch()
    [o] = outputs(act(sidecar, bid))
    assert o["function"] == "hanging_tool" and "timed out after 0.3 s" in o["error"]
    assert_consistent(sidecar.messages(bid))
    assert sidecar.request("operate", {"branchId": bid, "instruction": "y"})["result"] == "after"


def test_the_tool_decorator_timeout_wins_over_tool_timeout_ms(sidecar):
    # slow_tools.slow_tool has no timeout; tests/rpc/fixtures has none with one, so use the default:
    # the setting exists and defaults to 120 s
    assert DEFAULT_TOOL_TIMEOUT_MS == 120_000
    sidecar.init(models={"s": scripted(calls(("timed_tool", {"seconds": 30})))},
                 toolModules=["timed_tools"], toolTimeoutMs=60_000)
    bid = sidecar.branch()
    [o] = outputs(act(sidecar, bid))
    assert "timed out after 0.2 s" in o["error"]


def test_an_unanswered_client_tool_times_out_with_an_error_output(sidecar):
    sidecar.init(models={"s": scripted(calls(("client_probe", {"x": 1})), "after")}, toolTimeoutMs=300,
                 capabilities={"clientTools": True})
    release = threading.Event()
    sidecar.register_recording_client_tool(answer=lambda p: (release.wait(TIMEOUT), {"output": "late"})[1])
    bid = sidecar.branch()
    try:
        [o] = outputs(act(sidecar, bid))
    finally:
        release.set()
    assert o["function"] == "client_probe" and "timed out" in o["error"]
    assert len(sidecar.client_calls) == 1
    # the server withdrew its request
    assert sidecar.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    assert_consistent(sidecar.messages(bid))
    assert sidecar.request("operate", {"branchId": bid, "instruction": "y"})["result"] == "after"


def test_an_unanswered_permission_request_times_out_to_deny(sidecar):
    sidecar.init(models={"s": scripted(calls(("record_tool", {"n": 1})))}, toolModules=["recording_tools"],
                 toolPolicy={"record_tool": "ask"}, permissionTimeoutMs=300, capabilities={"toolPermission": True})
    release = threading.Event()
    asked = []
    sidecar.on_request("requestToolPermission",
                       lambda p: (asked.append(p), release.wait(TIMEOUT), {"decision": "allow_once"})[2])
    bid = sidecar.branch()
    try:
        [o] = outputs(act(sidecar, bid))
    finally:
        release.set()
    assert o == {"error": "denied by governance gate", "function": "record_tool",
                 "reason": "permission request timed out"}
    assert len(asked) == 1 and sidecar.invocations() == []
    assert_consistent(sidecar.messages(bid))


def test_client_vanishing_mid_operate_exits_promptly_and_the_journal_is_intact(spawn, tmp_path):
    state = str(tmp_path / "state")
    c = spawn()
    c.init(models={"s": scripted("first", calls(("hanging_tool", {"seconds": 30})))},
           toolModules=["recording_tools"], stateDir=state)
    bid = c.branch(name="kept")
    assert c.request("operate", {"branchId": bid, "instruction": "one"})["result"] == "first"
    c.request_async("operate", {"branchId": bid, "instruction": "two", "actions": True})
    assert c.wait_for(lambda n: any(m == "toolEvent" and e["event"] == "pre" for m, e in n), TIMEOUT)
    c.proc.stdin.close()                   # the client vanishes while the tool runs
    assert c.wait(TIMEOUT) == 1            # prompt exit, not after the 30 s tool
    c2 = spawn()
    c2.init(models={"s": scripted("third")}, stateDir=state, toolModules=["recording_tools"])
    assert [b["name"] for b in c2.request("listBranches")["branches"]] == ["kept"]
    msgs = c2.messages(bid)
    assert_consistent(msgs)
    assert [m["content"]["instruction"] for m in msgs if m["kind"] == "instruction"][0] == "one"
    cancelled = [m["content"]["output"] for m in msgs if m["kind"] == "action_response"]
    assert cancelled in ([], [{"error": "cancelled", "function": "hanging_tool"}])
    assert c2.request("operate", {"branchId": bid, "instruction": "three"})["result"] == "third"


def test_parent_death_makes_the_watchdog_exit(sidecar):
    parent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        sidecar.request("initialize", {"processId": parent.pid, "settings": {"models": {"s": scripted("x")}}})
        assert sidecar.request("ping") == {}
        parent.stdin.close()               # the helper exits on its own: the client process is gone
        parent.wait(TIMEOUT)
        assert sidecar.wait(TIMEOUT) == 1  # the watchdog stopped the server
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(TIMEOUT)
