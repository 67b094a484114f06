"""A client's answer (to a server → client request) larger than ``maxMessageBytes``, or
malformed, end to end over real pipes: the server's request it answers fails at once, and the
client is sent nothing under that id (an error there would answer a pending request of the
client's own with the same id)."""

from __future__ import annotations

import threading

import pytest

from .support import TIMEOUT, RpcError, frame, scripted

LIMIT = 100_000
HUGE = "x" * (3 * LIMIT)
#: the server's first request to the client has this id: the client's own request of the same
#: id must not be answered by anything the server says about the client's oversized answer
FIRST_OUT_ID = "sidecar-1"


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


def run(c, bid, **extra):
    # the client's own id is the server's first outgoing id on purpose
    res = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True, **extra},
                    timeout=TIMEOUT, msg_id=FIRST_OUT_ID)
    return [r["output"] for r in res["result"]["action_responses"]]


def assert_nothing_sent_for_it(c):
    assert c.unmatched == []
    assert c.request("ping", timeout=TIMEOUT) == {}                       # the stream is in sync
    assert c.unmatched == []
    assert "maxMessageBytes" in c.stderr_text()                           # one warning, on stderr


def test_an_oversized_fs_read_answer_fails_the_read_at_once(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("on disk\n")
    reads = []
    sidecar.on_request("fs/readTextFile", lambda p: reads.append(p) or {"text": HUGE})
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)], "capabilities": {"fs": True},
                                   "settings": {"models": {"s": scripted(call("read_file", path="m.py"))},
                                                "maxMessageBytes": LIMIT}}, timeout=TIMEOUT)
    bid = sidecar.branch()
    (out,) = run(sidecar, bid)                # the read's time-out is 60 s: not waited for
    assert len(reads) == 1
    assert "error" in out and "maxMessageBytes" in out["error"] and str(LIMIT) in out["error"], out
    assert_nothing_sent_for_it(sidecar)


def test_an_oversized_permission_answer_is_a_deny_at_once(sidecar):
    asked = []
    sidecar.on_request("requestToolPermission",
                       lambda p: asked.append(p) or {"decision": "allow_once", "note": HUGE})
    sidecar.init(models={"s": scripted(call("echo_tool", text="a"))}, capabilities={"toolPermission": True},
                 toolModules=["slow_tools"], toolPolicy={"echo_tool": "ask"}, maxMessageBytes=LIMIT)
    (out,) = run(sidecar, sidecar.branch())   # the permission time-out is 120 s: not waited for
    assert len(asked) == 1
    assert out["error"] == "denied by governance gate" and "maxMessageBytes" in out["reason"], out
    assert_nothing_sent_for_it(sidecar)


def test_an_oversized_client_tool_answer_is_that_calls_error(sidecar):
    sidecar.init(models={"s": scripted(call("editor_dump"))}, capabilities={"clientTools": True},
                 maxMessageBytes=LIMIT)
    spec = {"name": "editor_dump", "description": "Dumps.", "inputSchema": {"type": "object", "properties": {}}}
    sidecar.request("registerClientTools", {"tools": [spec]}, timeout=TIMEOUT)
    sidecar.on_request("invokeClientTool", lambda p: {"output": HUGE})
    (out,) = run(sidecar, sidecar.branch())   # a client tool waits toolTimeoutMs (120 s): not waited for
    assert out["function"] == "editor_dump" and "maxMessageBytes" in out["error"], out
    assert_nothing_sent_for_it(sidecar)


def test_an_oversized_request_is_still_answered_and_a_stray_answer_never(sidecar):
    sidecar.init(models={"s": scripted("x")}, maxMessageBytes=LIMIT)
    # a request: -32600 under its id, as before
    p = sidecar.expect("big")
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "big", "method": "createBranch", "params": {"name": HUGE}}))
    with pytest.raises(RpcError) as ei:
        p.result(TIMEOUT)
    assert ei.value.code == -32600 and str(LIMIT) in ei.value.message
    # an answer to no request of the server's (its id unknown, or none found in its head): nothing
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "nobody-asked", "result": {"x": HUGE}}))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "error": {"code": 1, "message": HUGE}, "id": 5}))
    sidecar.send_raw(frame({"result": {"x": HUGE}, "jsonrpc": "2.0", "id": 6}))
    assert sidecar.request("ping", timeout=TIMEOUT) == {}
    assert sidecar.unmatched == []
    assert sidecar.request("listBranches", timeout=TIMEOUT)["branches"] == []


@pytest.mark.parametrize("answer", [{"id": FIRST_OUT_ID, "result": {"decision": "allow_once"}},
                                    {"jsonrpc": "2.0", "id": FIRST_OUT_ID}],
                         ids=["no jsonrpc", "neither result nor error"])
def test_a_malformed_permission_answer_is_a_deny_at_once_and_no_answer_under_its_id(sidecar, answer):
    """The answer is -32600 with id null (it was -32600 under the server's request id, which the
    client's own operate had: that operate would have got it), and the request it answers fails
    at once (it waited for its time-out, 120 s)."""
    release = threading.Event()

    def ask(p):
        sidecar.send_raw(frame(answer))
        release.wait(60)  # (the proper answer after it comes too late to count)
        return {"decision": "allow_once"}

    sidecar.on_request("requestToolPermission", ask)
    sidecar.init(models={"s": scripted(call("echo_tool", text="a"))}, capabilities={"toolPermission": True},
                 toolModules=["slow_tools"], toolPolicy={"echo_tool": "ask"})
    try:
        (out,) = run(sidecar, sidecar.branch())
    finally:
        release.set()
    assert out["error"] == "denied by governance gate" and "malformed" in out["reason"], out
    assert [(m["id"], m["error"]["code"]) for m in sidecar.unmatched] == [(None, -32600)]
    assert sidecar.request("ping", timeout=TIMEOUT) == {}


def test_an_answer_whose_id_is_null_a_list_or_an_object_is_not_answered_and_logs_no_traceback(sidecar):
    """An answer is never answered (JSON-RPC): one with id null is how a client says it could not
    read what the server sent, and one whose id is a list or an object answers nothing either
    (it logged an ``unhashable`` traceback). A body with no method that is no answer still gets
    -32600 with id null."""
    sidecar.init(models={"s": scripted("x")})
    sidecar.branch()                                          # (the core is loaded)
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": [1], "result": {}}))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": {"a": 1}, "error": {"code": 1, "message": "x"}}))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "parse error"}}))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": [2]}))
    assert sidecar.request("ping", timeout=TIMEOUT) == {}
    assert [(m["id"], m["error"]["code"]) for m in sidecar.unmatched] == [(None, -32600)]
    assert "Traceback" not in sidecar.stderr_text() and "unhashable" not in sidecar.stderr_text()
