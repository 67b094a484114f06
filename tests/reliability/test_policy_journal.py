"""A policy change on a branch is committed on its own: ``authorizeTool`` with a
``branchId`` makes the new policy durable before it answers, but never writes the messages an
operate running on that branch has recorded so far. A SIGKILL after the policy change and
before the operate ends leaves that operate's group entirely absent and the policy present.

The operate is held mid-flight on purpose: its tool call waits on the test client (a client
tool whose ``invokeClientTool`` is not answered yet, or an ``ask`` tool whose
``requestToolPermission`` is not answered yet).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading

import pytest

from operate_sidecar.server.state import DB_FILE

from .support import TIMEOUT, CLIENT_TOOL, assert_consistent, calls, scripted

HOLD = 60.0  # a held handler gives up after this long (the test kills the server well before)

# variant -> (the tool the model asks for, its arguments, the server→client request that holds it)
VARIANTS = {
    "client_tool": ("client_probe", {"x": 1}, "invokeClientTool"),
    "permission": ("record_tool", {"n": 1}, "requestToolPermission"),
}


def _start(spawn, state: str, variant: str, responses: list):
    c = spawn()
    c.init(models={"m": scripted(*responses)}, defaultModel="m", stateDir=state, toolModules=["recording_tools"],
           toolPolicy={"record_tool": "ask"}, capabilities={"toolPermission": True, "clientTools": True})
    return c


def _hold(c, variant: str) -> tuple[threading.Event, threading.Event]:
    """Make the client hold the operate's tool call until ``release`` is set; ``reached`` is
    set when the held request arrives."""
    release, reached = threading.Event(), threading.Event()
    tool, _, method = VARIANTS[variant]

    def handler(params):
        reached.set()
        release.wait(HOLD)
        return {"output": {"ok": params["arguments"]}} if method == "invokeClientTool" else {"decision": "allow_once"}

    c.on_request(method, handler)
    if variant == "client_tool":
        assert c.request("registerClientTools", {"tools": [CLIENT_TOOL]}, timeout=TIMEOUT) == \
            {"registered": ["client_probe"]}
    return release, reached


def _policy(c, bid: str, tool: str) -> str:
    tools = c.request("listTools", {"branchId": bid}, timeout=TIMEOUT)["tools"]
    return next(t["policy"] for t in tools if t["name"] == tool)


def _on_disk(state: str, bid: str) -> tuple[dict, int]:
    """The branch's committed meta and message count, read from the database directly."""
    db = sqlite3.connect(os.path.join(state, DB_FILE))
    try:
        meta = json.loads(db.execute("SELECT meta FROM branches WHERE id=?", (bid,)).fetchone()[0])
        return meta, db.execute("SELECT COUNT(*) FROM messages WHERE branch_id=?", (bid,)).fetchone()[0]
    finally:
        db.close()


def _operate_mid_flight(spawn, tmp_path, variant: str):
    """A server on ``tmp_path/state`` with branch B (journaled, one finished operate) and a second
    operate on B held at its tool call. Returns (state dir, the held tool, client, B, pending
    operate, release event)."""
    state = str(tmp_path / "state")
    tool, args, _ = VARIANTS[variant]
    c = _start(spawn, state, variant, [{"text": "first"}, calls((tool, args))])
    release, reached = _hold(c, variant)
    bid = c.branch(system="sys", name="B")
    assert c.request("operate", {"branchId": bid, "instruction": "first"}, timeout=TIMEOUT)["result"] == "first"
    p = c.request_async("operate", {"branchId": bid, "instruction": "held", "actions": True})
    assert reached.wait(TIMEOUT), "the operate never reached its tool call"
    assert not p.done()
    return state, tool, c, bid, p, release


def _restart(spawn, state: str, variant: str):
    """A fresh server on ``state`` (its model answers "after"), the client tool registered again."""
    r = _start(spawn, state, variant, [{"text": "after"}])
    if variant == "client_tool":
        r.request("registerClientTools", {"tools": [CLIENT_TOOL]}, timeout=TIMEOUT)
    return r


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_policy_change_mid_operate_then_sigkill_keeps_the_group_whole(spawn, tmp_path, variant):
    state, tool, c, bid, p, release = _operate_mid_flight(spawn, tmp_path, variant)
    try:
        before = [m["id"] for m in c.messages(bid)]                 # the held operate has recorded messages
        assert any(m["kind"] == "instruction" and m["content"]["instruction"] == "held" for m in c.messages(bid))
        assert c.request("authorizeTool", {"tool": tool, "decision": "deny", "branchId": bid},
                         timeout=TIMEOUT) == {"tool": tool, "decision": "deny", "branchId": bid}
        c.kill()                                                    # SIGKILL before the operate ends
        c.wait(TIMEOUT)
    finally:
        release.set()

    r = _restart(spawn, state, variant)
    msgs = r.messages(bid)
    instructions = [m["content"]["instruction"] for m in msgs if m["kind"] == "instruction"]
    assert instructions == ["first"], f"part of the unfinished operate was journaled: {msgs}"
    assert [m["id"] for m in msgs] == before[:len(msgs)]
    assert [m["kind"] for m in msgs] == ["system", "instruction", "assistant_response"]
    assert _policy(r, bid, tool) == "deny"                          # the acknowledged policy survived
    assert r.request("operate", {"branchId": bid, "instruction": "next"}, timeout=TIMEOUT)["result"] == "after"
    r.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_policy_change_mid_operate_then_finish_journals_both(spawn, tmp_path, variant):
    state, tool, c, bid, p, release = _operate_mid_flight(spawn, tmp_path, variant)
    try:
        c.request("authorizeTool", {"tool": tool, "decision": "deny", "branchId": bid}, timeout=TIMEOUT)
        meta, n = _on_disk(state, bid)
        assert meta["policy"] == {tool: "deny"}        # committed alone: none of the held operate's messages
        assert n == 3, n                               # system, first instruction, its answer
    finally:
        release.set()
    out = p.result(TIMEOUT)
    assert out["kind"] == "model"
    live = c.messages(bid)
    c.kill()
    c.wait(TIMEOUT)

    r = _restart(spawn, state, variant)
    msgs = r.messages(bid)
    assert [m["id"] for m in msgs] == [m["id"] for m in live]       # the whole operate, in order
    assert_consistent(msgs)
    assert _policy(r, bid, tool) == "deny"
    r.close()


def test_policy_change_without_a_running_operate_is_durable(spawn, tmp_path):
    state = str(tmp_path / "state")
    c = _start(spawn, state, "permission", [{"text": "x"}])
    bid = c.branch(name="B")
    c.request("authorizeTool", {"tool": "record_tool", "decision": "allow", "branchId": bid}, timeout=TIMEOUT)
    c.request("authorizeTool", {"tool": "big_tool", "decision": "deny", "branchId": bid}, timeout=TIMEOUT)
    c.kill()
    c.wait(TIMEOUT)
    r = _start(spawn, state, "permission", [{"text": "x"}])
    assert _policy(r, bid, "record_tool") == "allow" and _policy(r, bid, "big_tool") == "deny"
    r.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fork_of_a_branch_mid_operate_copies_it_as_before_that_operate(spawn, tmp_path, variant):
    """forkBranch never copies half a turn: while an operate runs on the source, the fork is
    the source as it was before that operate (in memory and in the journal)."""
    state, _, c, bid, p, release = _operate_mid_flight(spawn, tmp_path, variant)
    mid = c.request("branchMessages", {"branchId": bid}, timeout=TIMEOUT)["messages"]
    assert any("held" in json.dumps(m) for m in mid)  # the running turn is already recorded
    fork = c.request("forkBranch", {"branchId": bid}, timeout=TIMEOUT)["branchId"]
    release.set()
    assert p.result(TIMEOUT)["kind"] == "model"
    after = c.request("branchMessages", {"branchId": bid}, timeout=TIMEOUT)["messages"]
    k = next(i for i, m in enumerate(after) if "held" in json.dumps(m))
    forked = c.request("branchMessages", {"branchId": fork}, timeout=TIMEOUT)["messages"]
    assert [m["role"] for m in forked] == [m["role"] for m in after[:k]] == ["system", "user", "assistant"]
    assert [json.dumps(m["content"], sort_keys=True) for m in forked] == \
        [json.dumps(m["content"], sort_keys=True) for m in after[:k]]
    c.close()
    # the journal holds the same fork
    c2 = spawn()
    c2.init(models={"m": scripted()}, defaultModel="m", stateDir=state, toolModules=["recording_tools"])
    reloaded = c2.request("branchMessages", {"branchId": fork}, timeout=TIMEOUT)["messages"]
    assert [json.dumps(m["content"], sort_keys=True) for m in reloaded] == \
        [json.dumps(m["content"], sort_keys=True) for m in forked]
