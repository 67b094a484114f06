"""Bounds settable in settings (docs/PROTOCOL.md §2 "Settings"): maxMessageBytes,
maxToolOutputChars, maxConcurrentOperates (waits, FIFO), maxBranches, maxMessagesPerBranch."""

from __future__ import annotations

import json

import pytest

from operate_sidecar.server.rpc import settings as S

from .support import TIMEOUT, RpcError, calls, frame_body, outputs, scripted


def test_defaults_are_documented_values():
    """The defaults in force are the ones protocol/README.md's Bounds table documents."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "protocol" / "README.md").read_text()
    documented = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| `(\w+)` \| (\d+) \|", readme, re.M)}
    in_force = {
        "maxMessageBytes": S.DEFAULT_MAX_MESSAGE_BYTES,
        "toolTimeoutMs": S.DEFAULT_TOOL_TIMEOUT_MS,
        "maxToolOutputChars": S.DEFAULT_MAX_TOOL_OUTPUT_CHARS,
        "maxConcurrentOperates": S.DEFAULT_MAX_CONCURRENT_OPERATES,
        "maxBranches": S.DEFAULT_MAX_BRANCHES,
        "maxMessagesPerBranch": S.DEFAULT_MAX_MESSAGES_PER_BRANCH,
    }
    assert {k: documented.get(k) for k in in_force} == in_force
    assert S.DEFAULTS["maxConcurrentOperates"] >= 100  # 100 operates in flight must not queue (a benchmark target)


def test_a_bound_must_be_a_positive_integer(sidecar):
    keys = ["toolTimeoutMs", "maxToolOutputChars", "maxConcurrentOperates", "maxBranches", "maxMessagesPerBranch"]
    for key in keys:
        for bad in (0, -1, 1.5, "10", True, None):
            err = sidecar.error_of("initialize", {"settings": {key: bad}})
            assert err.code == -32602 and key in err.message, (key, bad)
    assert sidecar.init(models={"s": scripted("x")}, **{k: 5 for k in keys})["protocolVersion"] == 1


def test_max_message_bytes_skips_the_body_and_keeps_the_stream_in_sync(sidecar):
    sidecar.init(models={"s": scripted("x")}, maxMessageBytes=2000)
    body = json.dumps({"jsonrpc": "2.0", "id": 41, "method": "listBranches", "params": {}, "pad": "p" * 5000}).encode()
    pending = sidecar.expect(41)
    sidecar.send_raw(frame_body(body))
    with pytest.raises(RpcError) as ei:
        pending.result(TIMEOUT)
    assert ei.value.code == -32600 and "maxMessageBytes" in ei.value.message
    assert sidecar.request("listBranches", {}) == {"branches": []}   # the next frame is read intact


def test_max_tool_output_chars_keeps_a_preview(sidecar):
    sidecar.init(models={"s": scripted(calls(("big_tool", {"chars": 5000})), calls(("big_tool", {"chars": 10})))},
                 toolModules=["recording_tools"], maxToolOutputChars=100)
    bid = sidecar.branch()
    [o] = outputs(sidecar.request("operate", {"branchId": bid, "instruction": "x", "actions": True}))
    assert o["truncated"] is True and o["originalChars"] == 5002 and o["preview"] == '"' + "x" * 99
    stored = [m["content"]["output"] for m in sidecar.messages(bid) if m["kind"] == "action_response"]
    assert stored == [o]                                             # the branch keeps the bounded form
    [small] = outputs(sidecar.request("operate", {"branchId": bid, "instruction": "y", "actions": True}))
    assert small == "x" * 10


def test_max_concurrent_operates_makes_further_operates_wait_in_fifo_order(sidecar):
    sidecar.init(models={"slow": scripted({"text": "slow", "delayMs": 60000}), "b": scripted("B"),
                         "c": scripted("C")}, maxConcurrentOperates=1)
    a, b, c = sidecar.branch(chatModel="slow"), sidecar.branch(chatModel="b"), sidecar.branch(chatModel="c")
    pa = sidecar.request_async("operate", {"branchId": a, "instruction": "x", "workDoneToken": "A"})
    assert sidecar.wait_for(lambda n: any(m == "$/progress" and p["token"] == "A" for m, p in n), TIMEOUT)
    pb = sidecar.request_async("operate", {"branchId": b, "instruction": "x", "workDoneToken": "B"})
    pc = sidecar.request_async("operate", {"branchId": c, "instruction": "x", "workDoneToken": "C"})
    assert sidecar.request("listTools", {})["tools"] == []           # the server keeps serving meanwhile
    sidecar.cancel(pa.id)                                            # frees the only slot
    with pytest.raises(RpcError) as ei:
        pa.result(TIMEOUT)
    assert ei.value.code == -32800
    assert pb.result(TIMEOUT)["result"] == "B" and pc.result(TIMEOUT)["result"] == "C"
    events = [(p["token"], p["value"]["kind"]) for p in sidecar.of("$/progress") if p["value"]["kind"] != "report"]
    assert events == [("A", "begin"), ("A", "end"), ("B", "begin"), ("B", "end"), ("C", "begin"), ("C", "end")]


def test_a_waiting_operate_can_be_cancelled(sidecar):
    sidecar.init(models={"slow": scripted({"text": "slow", "delayMs": 60000}), "b": scripted("B")},
                 maxConcurrentOperates=1)
    a, b = sidecar.branch(chatModel="slow"), sidecar.branch(chatModel="b")
    pa = sidecar.request_async("operate", {"branchId": a, "instruction": "x", "workDoneToken": "A"})
    assert sidecar.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)
    pb = sidecar.request_async("operate", {"branchId": b, "instruction": "x"})
    sidecar.cancel(pb.id)
    with pytest.raises(RpcError) as ei:
        pb.result(TIMEOUT)
    assert ei.value.code == -32800
    assert [m["kind"] for m in sidecar.messages(b)] == []            # it never started
    sidecar.cancel(pa.id)
    assert sidecar.request("operate", {"branchId": b, "instruction": "again"})["result"] == "B"


def test_max_branches_is_a_clear_invalid_params_error(sidecar):
    sidecar.init(models={"s": scripted("x")}, maxBranches=2)
    first = sidecar.branch()
    sidecar.branch()
    for method, params in (("createBranch", {}), ("forkBranch", {"branchId": first})):
        err = sidecar.error_of(method, params)
        assert err.code == -32602 and "maxBranches" in err.message and "deleteBranch" in err.message
        assert err.data["limit"] == "maxBranches"
    sidecar.request("deleteBranch", {"branchId": first})
    assert sidecar.branch()


def test_max_messages_per_branch_is_a_clear_invalid_params_error(sidecar):
    sidecar.init(models={"s": scripted("one", "two", "three")}, maxMessagesPerBranch=3)
    bid = sidecar.branch(system="sys")                                # 1 message
    assert sidecar.request("operate", {"branchId": bid, "instruction": "a"})["result"] == "one"  # 3 messages
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "b"})
    assert err.code == -32602 and "maxMessagesPerBranch" in err.message
    assert "clearMessages" in err.message and "createBranch" in err.message
    assert err.data["limit"] == "maxMessagesPerBranch" and err.data["branchId"] == bid
    assert len(sidecar.messages(bid)) == 3                           # nothing was added
    out = sidecar.request("operate", {"branchId": bid, "instruction": "c", "clearMessages": True})
    assert out["result"] == "two"                                    # clearing is the way out
    fresh = sidecar.branch()                                         # so is a new branch (a fork copies all)
    assert sidecar.request("operate", {"branchId": fresh, "instruction": "d"})["result"] == "three"


@pytest.mark.parametrize("key", ["maxMessageBytes", "permissionTimeoutMs"])
@pytest.mark.parametrize("bad", [0, 0.5, -1, 1.5, "10", True])
def test_every_bound_including_max_message_bytes_is_a_positive_integer(sidecar, key, bad):
    """``maxMessageBytes`` 0 or 0.5 used to be accepted, after which every frame (ping too) was
    refused: all bounds are positive integers, else -32602 naming the setting."""
    err = sidecar.error_of("initialize", {"settings": {key: bad}})
    assert err.code == -32602 and key in err.message
    assert sidecar.request("ping", timeout=TIMEOUT) == {}


def test_settings_nested_900_deep_are_answered_at_once_with_32602(sidecar):
    deep: dict = {}
    node = deep
    for _ in range(900):
        node["x"] = {}
        node = node["x"]
    err = sidecar.error_of("initialize", {"settings": {"models": {"s": {"provider": "scripted", "responses": ["x"],
                                                                       "deep": deep}}}}, timeout=10)
    assert err.code == -32602 and "deep" in err.message
    assert sidecar.init(models={"s": scripted("x")})["protocolVersion"] == 1   # the server is fine


def test_an_absurd_content_length_is_answered_at_once_and_the_stream_resyncs(sidecar):
    """A Content-Length of 10^22 can never arrive: -32600 at once (not after waiting for 10^22
    bytes), then the next frame is read normally."""
    sidecar.init(models={"s": scripted("x")})
    body = json.dumps({"jsonrpc": "2.0", "id": 77, "method": "listBranches", "params": {}}).encode()
    pending = sidecar.expect(77)
    sidecar.send_raw(b"Content-Length: 10000000000000000000000\r\n\r\n" + body)
    with pytest.raises(RpcError) as ei:
        pending.result(10)
    assert ei.value.code == -32600 and "maxMessageBytes" in ei.value.message
    assert sidecar.request("listBranches", {}, timeout=10) == {"branches": []}


def test_an_oversize_body_is_answered_before_it_has_all_arrived(sidecar):
    """The answer to an oversize request does not wait for the rest of its body: the head
    (where the id is) is enough."""
    sidecar.init(models={"s": scripted("x")}, maxMessageBytes=100_000)
    head = b'{"jsonrpc":"2.0","id":78,"method":"listBranches","params":{},"pad":"' + b"p" * 70_000
    pending = sidecar.expect(78)
    sidecar.send_raw(b"Content-Length: 1000000\r\n\r\n" + head)      # 1 MB announced, 70 KB sent
    with pytest.raises(RpcError) as ei:
        pending.result(10)
    assert ei.value.code == -32600


@pytest.mark.parametrize("spec, fragment", [
    ("npx server", "must be an object"),
    ({"command": "npx server"}, "command must be a non-empty list"),
    ({"command": []}, "command must be a non-empty list"),
    ({"command": ["x"], "env": {"A": 1}}, "env must be an object of strings"),
    ({"command": ["x"], "args": ["y"]}, "unknown field"),
])
def test_a_wrong_shaped_mcp_server_entry_is_refused_at_initialize(sidecar, spec, fragment):
    """Reported at initialize (-32602 naming the server), not at first use."""
    err = sidecar.error_of("initialize", {"settings": {"mcpServers": {"files": spec}}})
    assert err.code == -32602 and "mcpServers.files" in err.message and fragment in err.message
    assert sidecar.init(models={"s": scripted("x")})["protocolVersion"] == 1


def test_standard_library_tool_modules_are_refused_at_initialize(sidecar):
    err = sidecar.error_of("initialize", {"settings": {"toolModules": ["recording_tools", "os", "subprocess",
                                                                       "shutil"]}})
    assert err.code == -32602 and "standard library" in err.message and "'subprocess'" in err.message
    sidecar.init(models={"s": scripted("x")}, toolModules=["recording_tools"])
    names = {t["name"] for t in sidecar.request("listTools", {}, timeout=TIMEOUT)["tools"]}
    assert "record_tool" in names and not names & {"popen", "getoutput", "rmtree", "getenv", "system"}
