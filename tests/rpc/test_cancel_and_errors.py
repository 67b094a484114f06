"""Cancellation (docs/PROTOCOL.md §7) and internal errors (-32603)."""

from __future__ import annotations

import pytest

from .support import TIMEOUT, RpcError, scripted


def cancelled(pending) -> RpcError:
    with pytest.raises(RpcError) as ei:
        pending.result(TIMEOUT)
    return ei.value


def test_cancel_during_the_model_call(sidecar):
    sidecar.init(models={"s": scripted({"text": "late", "delayMs": 60000}, "next")})
    bid = sidecar.branch()
    p = sidecar.request_async("operate", {"branchId": bid, "instruction": "wait", "workDoneToken": "t"})
    assert sidecar.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)  # the model call started
    sidecar.cancel(p.id)
    err = cancelled(p)
    assert err.code == -32800
    values = [v["value"] for v in sidecar.of("$/progress")]
    assert values[0]["kind"] == "begin" and values[-1]["kind"] == "end" and values[-1]["message"] == "cancelled"
    # the branch is usable and consistent afterwards
    assert sidecar.request("operate", {"branchId": bid, "instruction": "again"})["result"] == "next"


def test_cancel_during_a_tool_keeps_the_branch_consistent_and_starts_no_more_tools(sidecar):
    calls = {"json": {"action_requests": [{"function": "slow_tool", "arguments": {"seconds": 30}},
                                          {"function": "echo_tool", "arguments": {"text": "never"}}]}}
    sidecar.init(models={"s": scripted(calls)}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    p = sidecar.request_async("operate", {"branchId": bid, "instruction": "x", "actions": True,
                                          "actionStrategy": "sequential"})
    assert sidecar.wait_for(lambda n: any(m == "toolEvent" and e["event"] == "pre" for m, e in n), TIMEOUT)
    assert sidecar.request("ping") == {}                 # a blocking tool does not starve the reader
    assert sidecar.request("listBranches")["branches"]   # nor the other methods
    sidecar.cancel(p.id)
    assert cancelled(p).code == -32800
    msgs = sidecar.messages(bid)
    reqs = [m for m in msgs if m["kind"] == "action_request"]
    resps = [m for m in msgs if m["kind"] == "action_response"]
    assert [r["content"]["function"] for r in reqs] == ["slow_tool"]          # echo_tool never started
    assert [r["content"]["callId"] for r in resps] == [reqs[0]["content"]["callId"]]
    assert resps[0]["content"]["output"]["error"] == "cancelled"
    assert all(e["tool"] != "echo_tool" for e in sidecar.of("toolEvent"))


def test_cancel_while_waiting_for_permission_denies_and_cancels_the_client_request(sidecar):
    calls = {"json": {"action_requests": [{"function": "echo_tool", "arguments": {"text": "x"}}]}}
    sidecar.init(models={"s": scripted(calls)}, toolModules=["slow_tools"], toolPolicy={"echo_tool": "ask"},
                 capabilities={"toolPermission": True})
    import threading

    asked, release = threading.Event(), threading.Event()
    sidecar.on_request("requestToolPermission", lambda p: (asked.set(), release.wait(TIMEOUT),
                                                           {"decision": "allow_once"})[2])
    bid = sidecar.branch()
    p = sidecar.request_async("operate", {"branchId": bid, "instruction": "x", "actions": True})
    assert asked.wait(TIMEOUT)
    sidecar.cancel(p.id)
    assert cancelled(p).code == -32800
    assert sidecar.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    release.set()
    assert not [e for e in sidecar.of("toolEvent") if e["event"] in ("pre", "post")]
    assert sidecar.request("ping") == {}


def test_cancel_of_unknown_or_finished_request_is_ignored(sidecar):
    """Cancelling a request that really ran and was answered (and ids never sent) changes
    nothing: no second answer for it, the branch keeps exactly what the operate recorded, and
    the next request on it runs."""
    sidecar.init(models={"s": scripted("first", "second")})
    bid = sidecar.branch()
    done = sidecar.request_async("operate", {"branchId": bid, "instruction": "one"})
    assert done.result(TIMEOUT)["result"] == "first"
    before = sidecar.request("branchMessages", {"branchId": bid})["messages"]
    sidecar.cancel(done.id)                 # finished: must be ignored
    sidecar.cancel(12345)                   # never sent
    sidecar.cancel("nope")
    # app requests are handled in order after the cancels: by their answers the cancels are done
    assert sidecar.request("branchMessages", {"branchId": bid})["messages"] == before
    assert sidecar.request("operate", {"branchId": bid, "instruction": "two"})["result"] == "second"
    assert sidecar.request("ping") == {}
    stray = [m for m in sidecar.unmatched if m.get("id") in (done.id, 12345, "nope")]
    assert stray == [], stray


def test_a_cancel_whose_id_is_no_request_id_cancels_nothing_and_logs_no_traceback(sidecar):
    """Ids are integers or strings, compared as such: true is not the id 1, 2.0 not the id 2,
    and a list or an object (unhashable) is no id at all (it logged a TypeError traceback)."""
    sidecar.init(models={"s": scripted({"text": "one", "delayMs": 1500}, {"text": "two", "delayMs": 1500})})
    bid = sidecar.branch()
    first = sidecar.request_async("operate", {"branchId": bid, "instruction": "a"}, msg_id=1)
    second = sidecar.request_async("operate", {"branchId": bid, "instruction": "b"}, msg_id=2)
    for bad in (True, 1.0, 2.0, [1], {"id": 1}, None):
        sidecar.notify("$/cancelRequest", {"id": bad})
    sidecar.notify("$/cancelRequest", {})
    assert first.result(TIMEOUT)["result"] == "one"
    assert second.result(TIMEOUT)["result"] == "two"
    assert "Traceback" not in sidecar.stderr_text()


def test_internal_error_has_no_traceback(sidecar):
    sidecar.init(models={"s": scripted("x")}, toolModules=["boom_patch"])
    sidecar.request("listTools", {})  # loads the tool module that breaks branch lookup
    err = sidecar.error_of("branchMessages", {"branchId": "b"})
    assert err.code == -32603 and "boom" in err.message
    assert err.data is None or "traceback" not in str(err.data)
    assert "Traceback" not in err.message and len(err.message) < 400
    assert sidecar.request("ping") == {}


def test_internal_error_has_a_traceback_with_debug(spawn):
    c = spawn("--debug")
    c.init(models={"s": scripted("x")}, toolModules=["boom_patch"])
    c.request("listTools", {})
    err = c.error_of("branchMessages", {"branchId": "b"})
    assert err.code == -32603 and "traceback" in err.data
    assert any("boom_patch" in line for line in err.data["traceback"])


def test_broken_tool_module_is_reported_with_window_log_message(sidecar):
    sidecar.init(models={"s": scripted("x")}, toolModules=["no_such_module_xyz", "slow_tools"])
    names = [t["name"] for t in sidecar.request("listTools", {})["tools"]]
    assert "echo_tool" in names
    logs = sidecar.of("window/logMessage")
    assert logs and logs[0]["type"] == 2 and "no_such_module_xyz" in logs[0]["message"]


def test_a_client_answer_that_comes_with_the_cancel_does_not_lose_the_cancel():
    """``request_client`` with a time-out: the client's answer (a permission deny) and the
    cancel of the request waiting for it (the user stopped the turn) land in one turn of the
    loop; the cancel wins and the client is told, where ``asyncio.wait_for`` on 3.11 returned
    the answer and the turn went on."""
    import asyncio
    import itertools
    from types import SimpleNamespace

    from operate_sidecar.server.rpc.server import SidecarProtocol

    sent: list = []
    conn = SimpleNamespace(send=sent.append, notify=lambda method, params: sent.append((method, params)))
    proto = SimpleNamespace(_out_ids=itertools.count(1), _outgoing={}, _server=SimpleNamespace(conn=conn))

    async def main():
        task = asyncio.ensure_future(SidecarProtocol.request_client(proto, "requestToolPermission", {}, 30.0))
        for _ in range(3):
            await asyncio.sleep(0)
        (msg_id, fut), = proto._outgoing.items()
        fut.set_result({"decision": "deny_once"})   # the answer...
        task.cancel()                                 # ...and the stop, before the request's task runs again
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5)
        assert ("$/cancelRequest", {"id": msg_id}) in sent

    asyncio.run(main())
