"""deleteBranch while an operate runs on the branch (docs/PROTOCOL.md §3, §7, §8): the operate
ends at once by the cancel's path (a pending permission request is cancelled towards the
client, no further tool starts, the model call is cancelled) and answers -32012; nothing of it
is kept, in memory or on disk."""

from __future__ import annotations

import threading
import time

import pytest

from .support import TIMEOUT, RpcError, scripted

#: how long an operate cut off by a delete may take to answer (its model would take 60 s)
PROMPT = 10.0


def branch_not_found(pending, timeout: float = PROMPT) -> RpcError:
    with pytest.raises(RpcError) as ei:
        pending.result(timeout)
    assert ei.value.code == -32012, ei.value
    return ei.value


def test_delete_during_the_model_call_ends_the_operate_with_branch_not_found(sidecar):
    sidecar.init(models={"s": scripted({"text": "late", "delayMs": 60000}, "next")})
    bid = sidecar.branch()
    p = sidecar.request_async("operate", {"branchId": bid, "instruction": "wait", "workDoneToken": "t"})
    assert sidecar.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)  # the model call started
    started = time.monotonic()
    assert sidecar.request("deleteBranch", {"branchId": bid}) == {}
    err = branch_not_found(p)
    assert time.monotonic() - started < PROMPT
    assert bid in err.message
    values = [v["value"] for v in sidecar.of("$/progress")]
    assert values[-1]["kind"] == "end" and values[-1]["message"] == "failed"  # it answered an error
    assert bid not in [b["branchId"] for b in sidecar.request("listBranches")["branches"]]
    assert sidecar.error_of("branchMessages", {"branchId": bid}).code == -32012
    other = sidecar.branch()  # the server goes on: the next reply is the next model turn
    assert sidecar.request("operate", {"branchId": other, "instruction": "x"})["result"] == "next"


def test_delete_while_asking_permission_cancels_the_request_and_starts_no_tool(sidecar):
    calls = {"json": {"action_requests": [{"function": "echo_tool", "arguments": {"text": "x"}}]}}
    sidecar.init(models={"s": scripted(calls, "after")}, toolModules=["slow_tools"],
                 toolPolicy={"echo_tool": "ask"}, capabilities={"toolPermission": True})
    asked, release = threading.Event(), threading.Event()
    ids: list = []

    def ask(params):
        ids.append(params["callId"])
        asked.set()
        release.wait(TIMEOUT)
        return {"decision": "allow_once"}

    sidecar.on_request("requestToolPermission", ask)
    bid = sidecar.branch()
    p = sidecar.request_async("operate", {"branchId": bid, "instruction": "x", "actions": True})
    try:
        assert asked.wait(TIMEOUT)
        assert sidecar.request("deleteBranch", {"branchId": bid}) == {}
        branch_not_found(p)
        # the server no longer needs the answer: it says so, as for a cancelled operate
        assert sidecar.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    finally:
        release.set()  # the client allows it late: nothing runs
    assert sidecar.request("ping") == {}
    assert not [e for e in sidecar.of("toolEvent") if e["event"] in ("pre", "post")]
    assert len(ids) == 1


def test_delete_during_a_tool_starts_no_more_tools(sidecar):
    calls = {"json": {"action_requests": [{"function": "slow_tool", "arguments": {"seconds": 30}},
                                          {"function": "echo_tool", "arguments": {"text": "never"}}]}}
    sidecar.init(models={"s": scripted(calls, "after")}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    p = sidecar.request_async("operate", {"branchId": bid, "instruction": "x", "actions": True,
                                          "actionStrategy": "sequential"})
    assert sidecar.wait_for(lambda n: any(m == "toolEvent" and e["event"] == "pre" for m, e in n), TIMEOUT)
    assert sidecar.request("deleteBranch", {"branchId": bid}) == {}
    branch_not_found(p)
    events = sidecar.of("toolEvent")
    assert [e["tool"] for e in events if e["event"] == "pre"] == ["slow_tool"]
    assert [(e["tool"], e["event"], e["error"]) for e in events if e["event"] != "pre"] == [
        ("slow_tool", "error", "cancelled")]
    other = sidecar.branch()  # the model was not asked again after the tool (no second turn)
    assert sidecar.request("operate", {"branchId": other, "instruction": "x"})["result"] == "after"


def test_a_branch_deleted_during_its_operate_stays_deleted_after_a_restart(spawn, tmp_path):
    state = str(tmp_path / "state")
    c = spawn()
    c.init(models={"s": scripted("first", {"text": "late", "delayMs": 60000})}, stateDir=state)
    bid = c.branch(name="doomed")
    kept = c.branch(name="kept")
    assert c.request("operate", {"branchId": bid, "instruction": "one"})["result"] == "first"
    p = c.request_async("operate", {"branchId": bid, "instruction": "two", "workDoneToken": "t"})
    assert c.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)
    assert c.request("deleteBranch", {"branchId": bid}) == {}
    branch_not_found(p)
    listed = c.request("listBranches")["branches"]
    assert [b["branchId"] for b in listed] == [kept]
    assert c.close(TIMEOUT) == 0
    c2 = spawn()
    c2.init(models={"s": scripted("x")}, stateDir=state)
    assert [b["branchId"] for b in c2.request("listBranches")["branches"]] == [kept]
    assert c2.error_of("branchMessages", {"branchId": bid}).code == -32012


def test_a_fork_taken_while_the_operate_runs_and_then_deleting_the_source(sidecar):
    """The fork copies the branch as it was before the running operate; deleting the source
    afterwards ends that operate and leaves the fork as it was."""
    sidecar.init(models={"s": scripted("one", {"text": "late", "delayMs": 60000}, "forked")})
    bid = sidecar.branch(system="sys")
    sidecar.request("operate", {"branchId": bid, "instruction": "one"})
    before = sidecar.messages(bid)
    p = sidecar.request_async("operate", {"branchId": bid, "instruction": "two", "workDoneToken": "t"})
    assert sidecar.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)
    fork = sidecar.request("forkBranch", {"branchId": bid})["branchId"]
    assert [m["content"] for m in sidecar.messages(fork)] == [m["content"] for m in before]
    assert sidecar.request("deleteBranch", {"branchId": bid}) == {}
    branch_not_found(p)
    assert [m["content"] for m in sidecar.messages(fork)] == [m["content"] for m in before]
    assert sidecar.request("operate", {"branchId": fork, "instruction": "x"})["result"] == "forked"


def test_delete_ends_an_operate_waiting_for_a_slot_that_another_branch_holds(sidecar):
    """With maxConcurrentOperates 1 and another branch's operate running, an operate waiting for
    the slot is ended by its branch's delete (-32012) at once, as a cancel ends it: it waited for
    the other branch's operate to free the slot, then answered."""
    sidecar.init(models={"s": scripted({"text": "late", "delayMs": 60000}, "unused")}, maxConcurrentOperates=1)
    b1, b2 = sidecar.branch(), sidecar.branch()
    p1 = sidecar.request_async("operate", {"branchId": b1, "instruction": "hold", "workDoneToken": "t1"})
    assert sidecar.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)  # b1 holds the slot
    p2 = sidecar.request_async("operate", {"branchId": b2, "instruction": "wait", "workDoneToken": "t2"})
    assert sidecar.request("deleteBranch", {"branchId": b2}) == {}
    assert b2 in branch_not_found(p2).message
    assert not p1.done()                                  # (not once b1's operate freed the slot)
    assert not [v for v in sidecar.of("$/progress") if v["token"] == "t2"]  # it never started
    sidecar.cancel(p1.id)
    with pytest.raises(RpcError) as ei:
        p1.result(TIMEOUT)
    assert ei.value.code == -32800
    assert [b["branchId"] for b in sidecar.request("listBranches")["branches"]] == [b1]
