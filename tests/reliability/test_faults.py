"""Faults end to end (issue 5 §2): each one ends as the contract says and leaves the branch
consistent (every action_request has its action_response) and usable.

The in-operate faults share one server (``faulty``): each test has its own branch and its own
scripted model. Client disappearance and parent death get a server each."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from operate_sidecar.server.rpc.settings import DEFAULT_TOOL_TIMEOUT_MS

from .support import TIMEOUT, Sidecar, assert_consistent, calls, outputs, scripted

MODELS = {
    "model_error": scripted({"error": "upstream exploded"}, "after"),
    "model_timeout": scripted({"text": "too late", "delayMs": 60000}, "after", timeoutS=0.3),
    "raising": scripted(calls(("raising_tool", {"x": 1}))),
    "hanging": scripted(calls(("hanging_tool", {"seconds": 30})), "after"),
    "decorated": scripted(calls(("timed_tool", {"seconds": 30}))),
    "client_silent": scripted(calls(("client_probe", {"x": 1})), "after"),
    "permission_silent": scripted(calls(("record_tool", {"n": 1}))),
}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    c = Sidecar(record=str(tmp_path_factory.mktemp("faults") / "record.jsonl"))
    c.release = threading.Event()          # lets the never-answering client handlers go at the end
    c.asked = []
    try:
        c.init(models=MODELS, toolModules=["recording_tools", "timed_tools"], toolTimeoutMs=300,
               permissionTimeoutMs=300, toolPolicy={"record_tool": "ask"},
               capabilities={"toolPermission": True, "clientTools": True})
        c.register_recording_client_tool(answer=lambda p: (c.release.wait(TIMEOUT), {"output": "late"})[1])
        c.on_request("requestToolPermission",
                     lambda p: (c.asked.append(p), c.release.wait(TIMEOUT), {"decision": "allow_once"})[2])
        yield c
    finally:
        c.release.set()
        c.kill()
        c.wait(TIMEOUT)
        c._close_pipes()


def act(c, bid, **extra):
    return c.request("operate", {"branchId": bid, "instruction": "go", "actions": True, **extra}, timeout=TIMEOUT)


def usable(c, bid):
    assert_consistent(c.messages(bid))
    assert c.request("operate", {"branchId": bid, "instruction": "again"}, timeout=TIMEOUT)["result"] == "after"


def test_model_error_is_32011_and_the_branch_stays_usable(faulty):
    bid = faulty.branch(chatModel="model_error")
    err = faulty.error_of("operate", {"branchId": bid, "instruction": "x"})
    assert err.code == -32011 and "upstream exploded" in err.message
    usable(faulty, bid)


def test_model_timeout_is_32011(faulty):
    bid = faulty.branch(chatModel="model_timeout")
    err = faulty.error_of("operate", {"branchId": bid, "instruction": "x"})
    assert err.code == -32011 and "timed out" in err.message
    usable(faulty, bid)


def test_a_raising_tool_gives_an_error_output_not_a_failed_operate(faulty):
    bid = faulty.branch(chatModel="raising")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "raising_tool" and "exploded on purpose" in o["error"]
    assert [i["tool"] for i in faulty.invocations()].count("raising_tool") == 1
    assert_consistent(faulty.messages(bid))
    assert [e["event"] for e in faulty.of("toolEvent") if e["branchId"] == bid] == ["pre", "error"]


def test_a_hanging_python_tool_hits_tool_timeout_ms(faulty):
    bid = faulty.branch(chatModel="hanging")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "hanging_tool" and "timed out after 0.3 s" in o["error"]
    usable(faulty, bid)


def test_the_tool_decorator_timeout_wins_over_tool_timeout_ms(faulty):
    assert DEFAULT_TOOL_TIMEOUT_MS == 120_000
    bid = faulty.branch(chatModel="decorated")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "timed_tool" and "timed out after 0.2 s" in o["error"]   # not the 0.3 s setting
    assert_consistent(faulty.messages(bid))


def test_an_unanswered_client_tool_times_out_with_an_error_output(faulty):
    bid = faulty.branch(chatModel="client_silent")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "client_probe" and "timed out" in o["error"]
    assert [p["branchId"] for p in faulty.client_calls].count(bid) == 1
    # the server withdrew its request
    assert faulty.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    usable(faulty, bid)


def test_an_unanswered_permission_request_times_out_to_deny(faulty):
    bid = faulty.branch(chatModel="permission_silent")
    [o] = outputs(act(faulty, bid))
    assert o == {"error": "denied by governance gate", "function": "record_tool",
                 "reason": "permission request timed out"}
    assert [p["branchId"] for p in faulty.asked] == [bid]
    assert "record_tool" not in [i["tool"] for i in faulty.invocations()]
    assert_consistent(faulty.messages(bid))


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
