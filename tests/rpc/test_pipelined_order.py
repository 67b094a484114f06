"""Requests a client sends together (one write, not waiting for answers) take effect in the order
they were sent, with a state directory too: there each request that reads branches first takes in
what is stored (the restore, on the first, and other processes' commits since), and they waited
for that each on its own and went on in another order. Real servers over real pipes, real SQLite.

Seen: after a restart, ``[authorizeTool deny, operate]`` ran the tool the deny was acknowledged
for; three ``createBranch`` at a ``maxBranches`` of 2 refused the first and kept the two after it;
with another server committing on the same directory, a deny sent before an operate let the
tool run about one time in two."""

from __future__ import annotations

import pytest

from .support import TIMEOUT, RpcError, frame, scripted

CALL = {"json": {"action_requests": [{"function": "echo_tool", "arguments": {"text": "a"}}]}}


def _together(c, *reqs):
    """``reqs`` ((id, method, params) each) written at once; their pending answers."""
    pending = [c.expect(i) for i, _, _ in reqs]
    c.send_raw(b"".join(frame({"jsonrpc": "2.0", "id": i, "method": m, "params": p}) for i, m, p in reqs))
    return [p.result(TIMEOUT) for p in pending]


def _denied(c, branch, tag):
    """A deny of ``echo_tool`` on ``branch`` and an operate whose model calls it, sent together:
    the tool's output in the operate's result."""
    auth, op = _together(c, (f"auth-{tag}", "authorizeTool", {"tool": "echo_tool", "decision": "deny", "branchId": branch}),
                         (f"op-{tag}", "operate", {"branchId": branch, "instruction": "call it", "actions": True}))
    assert auth["decision"] == "deny"
    return op["result"]["action_responses"][0]["output"]


def test_a_deny_sent_with_an_operate_after_a_restart_governs_it(spawn, tmp_path):
    state = str(tmp_path / "state")
    first = spawn("--state-dir", state)
    first.init(models={"s": scripted()}, toolModules=["slow_tools"])
    branch = first.branch()
    first.close()
    c = spawn("--state-dir", state)
    c.init(models={"s": scripted(CALL)}, toolModules=["slow_tools"])
    out = _denied(c, branch, "restart")
    assert isinstance(out, dict) and out.get("reason") == "denied by policy", out
    assert not [e for e in c.of("toolEvent") if e["event"] == "post"]  # it never ran


def test_creates_sent_together_at_the_branch_limit_keep_the_first_ones(spawn, tmp_path):
    c = spawn("--state-dir", str(tmp_path / "state"))
    c.init(models={"s": scripted()}, maxBranches=2)
    names = ["first", "second", "third"]
    pending = [c.expect(n) for n in names]
    c.send_raw(b"".join(frame({"jsonrpc": "2.0", "id": n, "method": "createBranch", "params": {"name": n}})
                        for n in names))
    for p in pending[:2]:
        assert p.result(TIMEOUT)["branchId"]
    with pytest.raises(RpcError) as refused:
        pending[2].result(TIMEOUT)
    assert refused.value.code == -32602 and "maxBranches" in str(refused.value)
    listed = c.request("listBranches", {}, timeout=TIMEOUT)["branches"]
    assert [b["name"] for b in listed] == ["first", "second"]


def test_a_deny_sent_with_an_operate_governs_it_while_another_server_commits(spawn, tmp_path):
    state = str(tmp_path / "state")
    rounds = 6
    a = spawn("--state-dir", state)
    a.init(models={"s": scripted(*[CALL] * rounds)}, toolModules=["slow_tools"])
    branch = a.branch()
    b = spawn("--state-dir", state)
    b.init(models={"s": scripted()})
    for i in range(rounds):
        a.request("authorizeTool", {"tool": "echo_tool", "decision": "allow", "branchId": branch}, timeout=TIMEOUT)
        b.branch(name=f"other {i}")  # a commit that server A takes in before its next request
        out = _denied(a, branch, str(i))
        assert isinstance(out, dict) and out.get("reason") == "denied by policy", (i, out)


def test_requests_sent_after_a_delete_meet_it_done(spawn, tmp_path):
    """A delete is saved before it is applied (a delete that cannot be saved leaves the branch);
    a ``listBranches`` and a ``branchMessages`` sent with it, after it, were answered while its
    save ran, with the branch still there. They wait for it now, as a request after a
    ``createBranch`` meets the branch made."""
    state = str(tmp_path / "state")
    first = spawn("--state-dir", state)
    first.init(models={"s": scripted()})
    kept, gone = first.branch(name="kept"), first.branch(name="gone")
    first.close()
    c = spawn("--state-dir", state)
    c.init(models={"s": scripted()})
    for _ in range(2):  # after a restart (the restore), then warm
        pending = [c.expect(i) for i in ("del", "list", "messages")]
        c.send_raw(frame({"jsonrpc": "2.0", "id": "del", "method": "deleteBranch", "params": {"branchId": gone}})
                   + frame({"jsonrpc": "2.0", "id": "list", "method": "listBranches", "params": {}})
                   + frame({"jsonrpc": "2.0", "id": "messages", "method": "branchMessages", "params": {"branchId": gone}}))
        assert pending[0].result(TIMEOUT) == {}
        assert [b["branchId"] for b in pending[1].result(TIMEOUT)["branches"]] == [kept]
        with pytest.raises(RpcError) as e:
            pending[2].result(TIMEOUT)
        assert e.value.code == -32012
        gone = c.branch(name="gone again")
