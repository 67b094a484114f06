"""Branches (docs/PROTOCOL.md §3)."""

from __future__ import annotations

from .support import TIMEOUT, RpcError, scripted


def test_create_list_fork_delete(sidecar):
    sidecar.init(models={"a": scripted("one", "two"), "b": scripted("x")}, defaultModel="a")
    b1 = sidecar.branch(system="You are terse.", name="main")
    b2 = sidecar.branch(chatModel="b")
    listed = {b["branchId"]: b for b in sidecar.request("listBranches")["branches"]}
    none = {"inputTokens": 0, "outputTokens": 0, "contextTokens": None, "modelCalls": 0}  # no operate yet
    assert listed[b1] == {"branchId": b1, "name": "main", "messageCount": 1, "chatModel": "a", "usage": none}
    assert listed[b2] == {"branchId": b2, "name": None, "messageCount": 0, "chatModel": "b", "usage": none}
    sidecar.request("operate", {"branchId": b1, "instruction": "hello"})
    fork = sidecar.request("forkBranch", {"branchId": b1})["branchId"]
    assert fork not in (b1, b2)
    assert [m["id"] for m in sidecar.messages(fork)] == [m["id"] for m in sidecar.messages(b1)]
    sidecar.request("operate", {"branchId": fork, "instruction": "more"})
    assert len(sidecar.messages(fork)) == 5 and len(sidecar.messages(b1)) == 3
    assert sidecar.request("deleteBranch", {"branchId": b1}) == {}
    ids = [b["branchId"] for b in sidecar.request("listBranches")["branches"]]
    assert b1 not in ids and fork in ids
    assert sidecar.error_of("deleteBranch", {"branchId": b1}).code == -32012


def test_branch_messages_shape_and_paging(sidecar):
    sidecar.init(models={"s": scripted("r1", "r2")})
    bid = sidecar.branch(system="sys")
    sidecar.request("operate", {"branchId": bid, "instruction": "q1"})
    sidecar.request("operate", {"branchId": bid, "instruction": "q2"})
    full = sidecar.request("branchMessages", {"branchId": bid})
    assert full["total"] == 5
    kinds = [(m["kind"], m["role"]) for m in full["messages"]]
    assert kinds == [("system", "system"), ("instruction", "user"), ("assistant_response", "assistant"),
                     ("instruction", "user"), ("assistant_response", "assistant")]
    m = full["messages"][1]
    assert set(m) == {"id", "kind", "role", "sender", "recipient", "createdAt", "content"}
    assert m["content"]["instruction"] == "q1" and m["content"]["responseSchema"] is None
    assert full["messages"][2]["content"]["text"] == "r1"
    page = sidecar.request("branchMessages", {"branchId": bid, "offset": 1, "limit": 2})
    assert page["total"] == 5 and [x["id"] for x in page["messages"]] == [x["id"] for x in full["messages"][1:3]]
    assert sidecar.request("branchMessages", {"branchId": bid, "offset": 10})["messages"] == []


def test_unknown_branch_is_branch_not_found_everywhere(sidecar):
    sidecar.init(models={"s": scripted("x")})
    for method, params in (("forkBranch", {}), ("deleteBranch", {}), ("branchMessages", {}),
                           ("listTools", {}), ("operate", {"instruction": "x"}),
                           ("authorizeTool", {"tool": "x", "decision": "allow"})):
        err = sidecar.error_of(method, {"branchId": "nope", **params})
        assert err.code == -32012, (method, err)


def test_an_operate_queued_on_a_branch_deleted_meanwhile_is_branch_not_found(sidecar):
    """The second operate waits for the first (per-branch FIFO); the branch is deleted while
    it waits: when its turn comes it answers -32012 and calls no model (it ran on the deleted
    branch and answered success, its messages lost with the branch)."""
    sidecar.init(models={"s": scripted({"text": "running", "delayMs": 60000}, "queued-ran")})
    bid = sidecar.branch()
    first = sidecar.request_async("operate", {"branchId": bid, "instruction": "first", "workDoneToken": "t"})
    assert sidecar.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)  # the first is running
    second = sidecar.request_async("operate", {"branchId": bid, "instruction": "second"})
    assert sidecar.request("deleteBranch", {"branchId": bid}) == {}
    try:  # the running one ends too (tests/rpc/test_delete_running.py)
        first.result(timeout=TIMEOUT)
        raise AssertionError("the running operate answered a result on a deleted branch")
    except RpcError as e:
        assert e.code == -32012, e
    try:
        second.result(timeout=TIMEOUT)
        raise AssertionError("the queued operate ran on a deleted branch")
    except RpcError as e:
        assert e.code == -32012, e
    other = sidecar.branch()  # the second never took a model turn: the next reply is still there
    assert sidecar.request("operate", {"branchId": other, "instruction": "x"})["result"] == "queued-ran"


def test_bad_params_are_invalid_params(sidecar):
    sidecar.init(models={"s": scripted("x")})
    assert sidecar.error_of("createBranch", {"system": 5}).code == -32602
    assert sidecar.error_of("createBranch", {"chatModel": "nope"}).code == -32602
    assert sidecar.error_of("forkBranch", {}).code == -32602
    assert sidecar.error_of("listBranches", {"x": 1}).code == -32602


def test_inline_model_config_for_a_branch(sidecar):
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch(chatModel={"provider": "scripted", "responses": ["inline reply"]})
    assert sidecar.request("operate", {"branchId": bid, "instruction": "hi"})["result"] == "inline reply"


def test_state_dir_journals_branches_across_restarts(spawn, tmp_path):
    c = spawn()
    c.init(models={"s": scripted("persisted reply")}, stateDir=str(tmp_path), toolModules=["slow_tools"])
    bid = c.branch(system="sys", name="kept")
    c.request("operate", {"branchId": bid, "instruction": "remember"})
    fork = c.request("forkBranch", {"branchId": bid})["branchId"]
    c.request("authorizeTool", {"tool": "echo_tool", "decision": "deny", "branchId": fork})
    c.request("deleteBranch", {"branchId": c.branch(name="gone")})
    before = c.messages(bid)
    assert c.close() == 0
    c2 = spawn()
    c2.init(models={"s": scripted("x")}, stateDir=str(tmp_path), toolModules=["slow_tools"])
    listed = {b["branchId"]: b for b in c2.request("listBranches")["branches"]}
    assert set(listed) == {bid, fork} and listed[bid]["name"] == "kept"
    assert c2.messages(bid) == before and c2.messages(fork) == before
    pol = {t["name"]: t["policy"] for t in c2.request("listTools", {"branchId": fork})["tools"]}
    assert pol["echo_tool"] == "deny"
