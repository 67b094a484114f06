"""``maxRounds`` at its edges (end to end over real pipes): a save that becomes known to fail
between rounds, a cancel while a permission request is pending, and what ``repeatLimit``
counts (docs/PROTOCOL.md §3, §4, §7, §11)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from .support import TIMEOUT, RpcError, scripted

TOOLS = ["slow_tools", "rounds_tools"]
DONE = {"json": {"action_requests": []}}
DENIED = "denied by governance gate"


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


def pending_error(pending) -> RpcError:
    with pytest.raises(RpcError) as ei:
        pending.result(TIMEOUT)
    return ei.value


def replace_database(state: str) -> None:
    """Replace the state database (and its -wal) with a copy of itself, as a backup restore
    would: the same records in other files, which the running server no longer writes to."""
    names = [n for n in os.listdir(state) if n in ("state.sqlite3", "state.sqlite3-wal")]
    assert "state.sqlite3" in names
    for name in names:
        shutil.copy2(os.path.join(state, name), os.path.join(state, name + ".copy"))
    for name in names:
        os.replace(os.path.join(state, name + ".copy"), os.path.join(state, name))


def test_a_save_known_to_fail_ends_the_rounds_before_the_next_model_call_and_tool(spawn, tmp_path):
    """The database is replaced while round 1's tool runs: round 2's model is never called and
    its tool never runs (docs/PROTOCOL.md §3: refused before the model is called or any tool
    runs); the operate answers -32013 and nothing of it is kept, in memory as after a restart."""
    state, opened, mark = str(tmp_path / "state"), str(tmp_path / "open"), str(tmp_path / "round2")
    c = spawn()
    c.init(models={"s": scripted(call("gate", path=opened), call("touch", path=mark), DONE)},
           toolModules=TOOLS, stateDir=state)
    bid = c.branch(system="sys")
    before = c.messages(bid)
    pending = c.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True, "maxRounds": 4,
                                          "workDoneToken": "t"})
    assert c.wait_for(lambda n: any(m == "toolEvent" and e["event"] == "pre" for m, e in n), TIMEOUT)
    replace_database(state)
    open(opened, "w").close()  # round 1's tool ends
    err = pending_error(pending)
    assert err.code == -32013 and err.data == {"branchId": bid}
    assert "deleted or replaced" in err.message
    assert not os.path.exists(mark)                                   # round 2's tool never ran
    assert [(e["event"], e["tool"]) for e in c.of("toolEvent")] == [("pre", "gate"), ("post", "gate")]
    values = [p["value"] for p in c.of("$/progress") if p["token"] == "t"]
    assert [v["message"] for v in values if v.get("phase") == "request"] == ["calling s"]  # one model call
    assert values[-1]["kind"] == "end" and values[-1]["message"] == "failed"
    assert values[-1]["usage"]["modelCalls"] == 1
    assert c.messages(bid) == before                                  # the branch is as it was before it
    assert c.close() == 0
    c2 = spawn()
    c2.init(models={"s": scripted("x")}, toolModules=TOOLS, stateDir=state)
    assert c2.messages(bid) == before                                 # and so is what a restart reads


@pytest.mark.parametrize("rounds", [1, 3])
def test_a_cancel_while_a_permission_request_is_pending_records_the_call_as_denied(spawn, tmp_path, rounds):
    """docs/PROTOCOL.md §7: the cancel answers the pending permission request as deny; the call
    whose callId the client was shown is recorded as a denied call (§4: an action_request +
    action_response pair, reason "cancelled") and gets its one ``denied`` toolEvent (§6), in the
    first round as in a later one, and the branch read after a restart is the same."""
    state, mark = str(tmp_path / "state"), str(tmp_path / "touched")
    replies = [call("touch", path=mark)] if rounds == 1 else [call("echo_tool", text="a"), call("touch", path=mark), DONE]
    c = spawn()
    c.init(models={"s": scripted(*replies)}, toolModules=TOOLS, toolPolicy={"touch": "ask"},
           capabilities={"toolPermission": True}, stateDir=state)
    asked, release, ids = threading.Event(), threading.Event(), []

    def ask(params):
        ids.append(params["callId"])
        asked.set()
        release.wait(TIMEOUT)
        return {"decision": "allow_once"}  # too late: the operate was cancelled

    c.on_request("requestToolPermission", ask)
    bid = c.branch(system="sys")
    pending = c.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True,
                                          "maxRounds": rounds})
    try:
        assert asked.wait(TIMEOUT)
        c.cancel(pending.id)
        assert pending_error(pending).code == -32800
        assert c.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    finally:
        release.set()
    (call_id,) = ids
    events = [e for e in c.of("toolEvent") if e["callId"] == call_id]
    assert [(e["event"], e["tool"], e["error"]) for e in events] == [("denied", "touch", "cancelled")]
    msgs = c.messages(bid)
    pair = [m for m in msgs if m["content"].get("callId") == call_id]
    assert [m["kind"] for m in pair] == ["action_request", "action_response"]
    assert pair[1]["content"]["output"] == {"error": DENIED, "function": "touch", "reason": "cancelled"}
    assert [m["kind"] for m in msgs][-3:] == ["assistant_response", "action_request", "action_response"]
    requests = [m["content"]["callId"] for m in msgs if m["kind"] == "action_request"]
    responses = [m["content"]["callId"] for m in msgs if m["kind"] == "action_response"]
    assert requests == responses and len(requests) == rounds // 3 + 1
    assert not os.path.exists(mark)                                   # the tool never ran
    assert c.request("ping") == {}
    assert c.close() == 0
    c2 = spawn()
    c2.init(models={"s": scripted("x")}, toolModules=TOOLS, stateDir=state)
    assert c2.messages(bid) == msgs


def test_a_successful_output_with_an_error_field_is_no_failure_for_repeat_limit(sidecar):
    """A call failed when its toolEvent is ``error`` (or ``denied``), never because its output
    has an ``error`` key: ``{"error": null, ...}`` from a tool that succeeded ("post") does not
    count toward ``repeatLimit`` (docs/PROTOCOL.md §11)."""
    look = call("lookup", key="a")
    sidecar.init(models={"s": scripted(look, look, look, DONE)}, toolModules=TOOLS)
    bid = sidecar.branch()
    out = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True, "maxRounds": 5,
                                      "repeatLimit": 2}, timeout=TIMEOUT)
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "post"] * 3
    assert out["rounds"] == 4 and "repeated" not in out


@pytest.mark.parametrize(("max_rounds", "limit"), [(3, 3), (2, 2), (1, 1)])
def test_repeated_is_said_when_the_limit_is_reached_on_the_last_allowed_round(sidecar, max_rounds, limit):
    """docs/PROTOCOL.md §11: after ``repeatLimit`` rounds in a row of the same failing calls the
    result is the last of them with ``repeated: true``, also when ``maxRounds`` ends there too."""
    fail = call("failing_tool", x=1)
    sidecar.init(models={"s": scripted(*[fail] * 4)}, toolModules=TOOLS)
    bid = sidecar.branch()
    out = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True,
                                      "maxRounds": max_rounds, "repeatLimit": limit}, timeout=TIMEOUT)
    assert out["rounds"] == max_rounds and out["repeated"] is True
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "error"] * max_rounds


def test_the_limit_not_reached_on_the_last_allowed_round_says_nothing(sidecar):
    fail = call("failing_tool", x=1)
    sidecar.init(models={"s": scripted(*[fail] * 4)}, toolModules=TOOLS)
    bid = sidecar.branch()
    out = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True,
                                      "maxRounds": 2, "repeatLimit": 3}, timeout=TIMEOUT)
    assert out["rounds"] == 2 and "repeated" not in out


@pytest.mark.parametrize("field", ["maxRounds", "repeatLimit"])
def test_a_bad_bound_is_named_once(sidecar, field):
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "q", field: 0})
    assert err.code == -32602
    assert err.message == f"invalid params: {field}: must be an integer of at least 1"
