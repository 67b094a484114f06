"""``maxRounds``: a loop of whole operates on one branch (end to end over real pipes)."""

from __future__ import annotations

import pytest

from operate_sidecar.server.service.rounds import CONTINUATION

from .support import TIMEOUT, RpcError, scripted

ECHO = {"json": {"action_requests": [{"function": "echo_tool", "arguments": {"text": "a"}}]}}
FAIL = {"json": {"action_requests": [{"function": "failing_tool", "arguments": {"x": 1}}]}}
DONE = {"json": {"action_requests": []}}
ZERO_CALL = {"inputTokens": 0, "outputTokens": 0, "contextTokens": 0}


def start(c, *responses, **settings):
    c.init(models={"s": scripted(*responses)}, toolModules=["slow_tools"], **settings)
    return c.branch()


def operate(c, bid, **extra):
    return c.request("operate", {"branchId": bid, "instruction": "do it", "actions": True, **extra},
                     timeout=TIMEOUT)


def instructions(c, bid):
    return [m["content"]["instruction"] for m in c.messages(bid) if m["kind"] == "instruction"]


def test_default_is_exactly_one_operate(sidecar):
    bid = start(sidecar, ECHO, "unused")
    out = operate(sidecar, bid)
    assert out["rounds"] == 1 and out["usage"]["modelCalls"] == 1
    assert instructions(sidecar, bid) == ["do it"]
    assert operate(sidecar, bid, actions=False)["result"] == "unused"  # the 2nd reply was never consumed


def test_stops_after_a_round_that_runs_no_tool(sidecar):
    bid = start(sidecar, ECHO, {"json": {"action_requests": [], "note": "finished"}}, "unused")
    out = operate(sidecar, bid, maxRounds=5, context={"big": "ctx"})
    assert out["rounds"] == 2
    assert out["result"]["action_requests"] == [] and not out["result"].get("action_responses")  # round 2's
    assert instructions(sidecar, bid) == ["do it", CONTINUATION]
    ins = [m["content"] for m in sidecar.messages(bid) if m["kind"] == "instruction"]
    assert ins[0]["context"] == {"big": "ctx"} and ins[1]["context"] is None      # context is not repeated
    assert ins[1]["toolSchemas"] == ins[0]["toolSchemas"]                          # same parameters
    assert out["usage"] == dict(ZERO_CALL, modelCalls=2)                           # usage sums the rounds


def test_stops_at_the_bound(sidecar):
    bid = start(sidecar, ECHO, ECHO, ECHO, "left over")
    out = operate(sidecar, bid, maxRounds=2)
    assert out["rounds"] == 2 and out["result"]["action_responses"][0]["output"] == "echo:a"
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "post", "pre", "post"]
    assert operate(sidecar, bid, maxRounds=1)["rounds"] == 1                        # the 3rd reply
    assert operate(sidecar, bid, actions=False)["result"] == "left over"


def test_stops_when_the_only_call_was_denied(sidecar):
    bid = start(sidecar, ECHO, ECHO, ECHO, toolPolicy={"echo_tool": "deny"})
    out = operate(sidecar, bid, maxRounds=3)
    assert out["rounds"] == 1
    assert out["result"]["action_responses"][0]["output"]["error"] == "denied by governance gate"
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["denied"]


def test_a_tool_that_ran_and_failed_gives_the_model_another_round(sidecar):
    bid = start(sidecar, FAIL, DONE)
    out = operate(sidecar, bid, maxRounds=4)
    assert out["rounds"] == 2
    # the failure reached the model: it is the action response before the continuation instruction
    msgs = sidecar.messages(bid)
    i = [m["kind"] for m in msgs].index("instruction", 2)
    assert msgs[i - 1]["kind"] == "action_response" and msgs[i - 1]["content"]["output"]["error"] == "tool exploded"


def test_the_native_wire_runs_every_round_of_the_same_failing_call(sidecar):
    # without repeatLimit the rule stays "until a round runs no tool or maxRounds rounds are done"
    bid = start(sidecar, FAIL, FAIL, FAIL, FAIL, FAIL, DONE)
    out = operate(sidecar, bid, maxRounds=5)
    assert out["rounds"] == 5 and "repeated" not in out
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "error"] * 5


def test_repeat_limit_stops_the_rounds_after_that_many_of_the_same_failing_calls(sidecar):
    """``repeatLimit`` N: the rounds stop after N rounds in a row that each made the same calls
    and got the same error from all of them (the model would be shown the same results again);
    the result says so (``repeated``) and holds the last round."""
    bid = start(sidecar, FAIL, FAIL, FAIL, FAIL, FAIL, DONE)
    out = operate(sidecar, bid, maxRounds=5, repeatLimit=3)
    assert out["rounds"] == 3 and out["repeated"] is True
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "error"] * 3
    assert out["result"]["action_responses"][0]["output"]["error"] == "tool exploded"
    assert len(instructions(sidecar, bid)) == 3  # three rounds recorded, no fourth


def test_repeat_limit_counts_the_same_failure_in_a_row_only(sidecar):
    # a round whose call succeeded (or differed) starts the count again; a loop that ends by
    # itself never says repeated
    bid = start(sidecar, FAIL, FAIL, ECHO, FAIL, FAIL, DONE)
    out = operate(sidecar, bid, maxRounds=8, repeatLimit=3)
    assert out["rounds"] == 6 and "repeated" not in out


def test_repeat_limit_must_be_a_positive_integer(sidecar):
    bid = start(sidecar, "x")
    for bad in (0, -1, 1.5, "2", True):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "q", "maxRounds": 3, "repeatLimit": bad})
        assert err.code == -32602 and "repeatLimit" in err.message, bad


def test_one_progress_begin_and_end_span_all_rounds(sidecar):
    bid = start(sidecar, ECHO, ECHO, DONE)
    out = operate(sidecar, bid, maxRounds=3, workDoneToken="tok")
    assert out["rounds"] == 3
    values = [p["value"] for p in sidecar.of("$/progress") if p["token"] == "tok"]
    kinds = [v["kind"] for v in values]
    assert kinds.count("begin") == 1 and kinds.count("end") == 1 and kinds[0] == "begin" and kinds[-1] == "end"
    assert [v["message"] for v in values if v["kind"] == "report" and v["phase"] == "request"] == \
        ["calling s"] * 3
    assert values[-1]["usage"] == out["usage"] == dict(ZERO_CALL, modelCalls=3)


def test_clear_messages_applies_to_the_first_round_only(sidecar):
    bid = start(sidecar, "first", ECHO, DONE)
    operate(sidecar, bid, actions=False)
    out = operate(sidecar, bid, maxRounds=3, clearMessages=True)
    assert out["rounds"] == 2
    assert instructions(sidecar, bid) == ["do it", CONTINUATION]   # round 2 kept round 1


def test_cancel_mid_loop_leaves_the_branch_consistent(sidecar):
    slow = {"json": {"action_requests": [{"function": "slow_tool", "arguments": {"seconds": 0.2}}]}}
    bid = start(sidecar, slow, {"text": "never", "delayMs": 60000})
    pending = sidecar.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True,
                                                "maxRounds": 5, "workDoneToken": 1})
    # round 2's model call started (its "request" report): cancel there
    assert sidecar.wait_for(lambda n: sum(1 for m, p in n if m == "$/progress"
                                          and p["value"].get("phase") == "request") >= 2, TIMEOUT)
    sidecar.cancel(pending.id)
    with pytest.raises(RpcError) as ei:
        pending.result(TIMEOUT)
    assert ei.value.code == -32800
    msgs = sidecar.messages(bid)
    calls = {m["content"]["callId"] for m in msgs if m["kind"] == "action_request"}
    answered = {m["content"]["callId"] for m in msgs if m["kind"] == "action_response"}
    assert calls and calls == answered
    assert [m["kind"] for m in msgs][-2:] == ["action_request", "action_response"]  # round 2 recorded nothing
    end = [p["value"] for p in sidecar.of("$/progress")][-1]
    assert end["kind"] == "end" and end["message"] == "cancelled" and end["usage"]["modelCalls"] == 2


def test_max_rounds_must_be_a_positive_integer(sidecar):
    bid = start(sidecar, "x")
    for bad in (0, -1, 1.5, "2", True, None):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "q", "maxRounds": bad})
        assert err.code == -32602 and "maxRounds" in err.message, bad


def test_read_then_edit_in_one_call_with_a_scripted_model(sidecar, tmp_path):
    """The two-round session the embedded 135M model cannot do reliably (see
    tests/models/test_models_local.py), scripted: round 1 reads, round 2 edits (previewed,
    allowed), round 3 answers without a tool."""
    (tmp_path / "greeting.txt").write_text("Hello wrld\n")
    read = {"json": {"action_requests": [{"function": "read_file", "arguments": {"path": "greeting.txt"}}]}}
    fix = {"json": {"action_requests": [{"function": "edit_file", "arguments": {
        "path": "greeting.txt", "edits": [{"oldText": "wrld", "newText": "world"}]}}]}}
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)], "capabilities": {"toolPermission": True},
                                   "settings": {"models": {"s": scripted(read, fix, DONE)}}}, timeout=TIMEOUT)
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    bid = sidecar.branch()
    out = sidecar.request("operate", {"branchId": bid, "instruction": "fix the typo in greeting.txt",
                                      "actions": True, "tools": ["read_file", "edit_file"], "maxRounds": 4},
                          timeout=TIMEOUT)
    assert out["rounds"] == 3 and out["usage"]["modelCalls"] == 3
    assert (tmp_path / "greeting.txt").read_text() == "Hello world\n"
    assert [p["tool"] for p in asked] == ["edit_file"]                      # read_file is allowed by default
    assert asked[0]["preview"]["diff"].endswith("-Hello wrld\n+Hello world\n")
    outputs = [m["content"]["output"] for m in sidecar.messages(bid) if m["kind"] == "action_response"]
    assert outputs[0]["content"] == "Hello wrld\n" and outputs[1]["added"] == 1


def test_a_malformed_call_is_that_calls_tool_error_and_the_next_round_corrects_it(sidecar):
    """Arguments that are not an object, or a name that is not a string, are that call's tool
    error (the model is answered, so the next round can correct it); the reply's other calls run.
    It made the whole reply unparsed: no call ran, the loop ended with the raw JSON as its text."""
    bad = {"json": {"action_requests": [{"function": "echo_tool", "arguments": ["a"]},
                                        {"function": 7, "arguments": {}},
                                        {"function": "echo_tool", "arguments": {"text": "ok"}}]}}
    bid = start(sidecar, bad, ECHO, DONE)
    out = operate(sidecar, bid, maxRounds=5)
    assert out["rounds"] == 3 and out["kind"] == "model"
    first = [m["content"]["output"] for m in sidecar.messages(bid) if m["kind"] == "action_response"][:3]
    assert first[0]["error"] == "arguments for echo_tool must be an object, got list"
    assert first[1]["error"] == "Tool 7 is not registered." and first[2] == "echo:ok"
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "error", "pre", "error", "pre", "post",
                                                            "pre", "post"]
