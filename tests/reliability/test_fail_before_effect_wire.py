"""Fail before effect, over the wire (docs/PIPELINE.md D3/D4; docs/SECURITY.md).

One real server; a client tool registered with ``registerClientTools`` records every
``invokeClientTool`` it receives. Every early ending of an operate invokes it zero times on
that branch; the positive control (everything allowed) invokes it exactly once. Each case runs
on its own branch with its own scripted model, so the cases are independent.
The in-process property test is tests/core/test_fail_before_effect.py.
"""

from __future__ import annotations


import pytest

from .support import TIMEOUT, RpcError, Sidecar, assert_consistent, calls, outputs, server_env  # noqa: F401

PROBE = calls(("client_probe", {"x": 7}))
ANSWER = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
NO_RETRY = {"retryAttempts": 0, "retryInitialDelay": 0}
MISMATCH = {"json": {"action_requests": [{"function": "client_probe", "arguments": {"x": 7}}], "answer": 5}}

MODELS = {
    "positive": [PROBE],
    "mismatch_return_value": [MISMATCH, MISMATCH],
    "mismatch_return_none": [MISMATCH, MISMATCH],
    "mismatch_raise": [MISMATCH, MISMATCH],
    "raw": [PROBE],
    "no_invoke": [PROBE],
    "no_actions": [PROBE],
    "policy_deny": [PROBE],
    "permission_denied": [PROBE],
    "not_selected": [PROBE],
    "cancel": [dict(PROBE, delayMs=60000)],
    "unknown_tool": [calls(("no_such_tool", {"x": 7}))],
    "bad_arguments": [calls(("client_probe", {"x": "seven"}))],
    "bad_arguments_shape": [calls(("client_probe", "not an object"))],
}


@pytest.fixture(scope="module")
def wire(tmp_path_factory):
    record = str(tmp_path_factory.mktemp("fbe") / "record.jsonl")
    c = Sidecar(record=record)
    try:
        c.init(models={k: {"provider": "scripted", "responses": v} for k, v in MODELS.items()},
               toolModules=["recording_tools"], capabilities={"toolPermission": True, "clientTools": True})
        c.register_recording_client_tool()
        c.permission_answers = {}
        c.on_request("requestToolPermission", lambda p: {"decision": c.permission_answers.get(p["branchId"], "deny_once")})
        yield c
    finally:
        c.kill()
        c.wait(TIMEOUT)
        c.close_input()


def run(c, model: str, **params):
    bid = c.branch(chatModel=model)
    base = {"branchId": bid, "instruction": "do it", "actions": True, "parseOptions": NO_RETRY}
    base.update(params)
    base = {k: v for k, v in base.items() if v is not None}
    try:
        out = c.request("operate", base, timeout=TIMEOUT)
    except RpcError as e:
        out = e
    return bid, out


def invoked(c, bid: str) -> int:
    return sum(1 for p in c.client_calls if p["branchId"] == bid)


def test_positive_control_invokes_exactly_once(wire):
    bid, out = run(wire, "positive")
    assert outputs(out) == [{"ok": {"x": 7}}]
    assert invoked(wire, bid) == 1
    assert_consistent(wire.messages(bid))


@pytest.mark.parametrize("policy", ["return_value", "return_none"])
def test_caller_model_mismatch_invokes_nothing(wire, policy):
    bid, out = run(wire, f"mismatch_{policy}", responseFormat=ANSWER, handleValidation=policy)
    assert not isinstance(out, RpcError), out
    if policy == "return_none":
        assert out["result"] is None
    assert invoked(wire, bid) == 0
    assert [m for m in wire.messages(bid) if m["kind"].startswith("action")] == []


def test_caller_model_mismatch_with_raise_is_32010_and_invokes_nothing(wire):
    bid, out = run(wire, "mismatch_raise", responseFormat=ANSWER, handleValidation="raise")
    assert isinstance(out, RpcError) and out.code == -32010
    assert invoked(wire, bid) == 0


def test_raw_mode_invokes_nothing(wire):
    bid, out = run(wire, "raw", skipValidation=True)
    assert out["kind"] == "text" and "client_probe" in out["result"]
    assert invoked(wire, bid) == 0


def test_invoke_actions_false_invokes_nothing(wire):
    bid, out = run(wire, "no_invoke", invokeActions=False)
    assert invoked(wire, bid) == 0
    assert [m for m in wire.messages(bid) if m["kind"].startswith("action")] == []


def test_actions_not_enabled_invokes_nothing(wire):
    bid, out = run(wire, "no_actions", actions=None)
    assert invoked(wire, bid) == 0
    assert [m for m in wire.messages(bid) if m["kind"].startswith("action")] == []


def test_policy_deny_invokes_nothing(wire):
    bid = wire.branch(chatModel="policy_deny")
    wire.request("authorizeTool", {"tool": "client_probe", "decision": "deny", "branchId": bid})
    out = wire.request("operate", {"branchId": bid, "instruction": "x", "actions": True}, timeout=TIMEOUT)
    assert outputs(out)[0]["error"] == "denied by governance gate"
    assert invoked(wire, bid) == 0
    assert_consistent(wire.messages(bid))


def test_permission_denied_invokes_nothing(wire):
    bid = wire.branch(chatModel="permission_denied")
    wire.request("authorizeTool", {"tool": "client_probe", "decision": "ask", "branchId": bid})
    wire.permission_answers[bid] = "deny_once"
    out = wire.request("operate", {"branchId": bid, "instruction": "x", "actions": True}, timeout=TIMEOUT)
    assert outputs(out)[0] == {"error": "denied by governance gate", "function": "client_probe",
                               "reason": "denied by the user"}
    assert invoked(wire, bid) == 0


def test_tool_outside_the_selection_invokes_nothing(wire):
    bid, out = run(wire, "not_selected", tools=["record_tool"])
    assert outputs(out)[0]["reason"] == "tool not selected for this call"
    assert invoked(wire, bid) == 0
    assert_consistent(wire.messages(bid))


def test_cancel_before_the_tool_starts_invokes_nothing(wire):
    bid = wire.branch(chatModel="cancel")
    p = wire.request_async("operate", {"branchId": bid, "instruction": "x", "actions": True, "workDoneToken": bid})
    assert wire.wait_for(lambda n: any(m == "$/progress" and e["token"] == bid for m, e in n), TIMEOUT)
    wire.cancel(p.id)
    with pytest.raises(RpcError) as ei:
        p.result(TIMEOUT)
    assert ei.value.code == -32800
    assert wire.request("ping") == {}
    assert invoked(wire, bid) == 0
    assert_consistent(wire.messages(bid))


def test_unknown_tool_requested_by_the_model_invokes_nothing(wire):
    bid, out = run(wire, "unknown_tool")
    [o] = outputs(out)
    assert o["function"] == "no_such_tool" and "error" in o
    assert invoked(wire, bid) == 0
    assert_consistent(wire.messages(bid))


def test_invalid_arguments_invoke_nothing(wire):
    bid, out = run(wire, "bad_arguments")
    [o] = outputs(out)
    assert o["function"] == "client_probe" and "invalid arguments" in o["error"]
    assert invoked(wire, bid) == 0
    assert_consistent(wire.messages(bid))


def test_arguments_that_are_not_an_object_invoke_nothing(wire):
    bid, out = run(wire, "bad_arguments_shape")  # that call is its own tool error, the tool never runs
    [o] = outputs(out)
    assert o["function"] == "client_probe" and "error" in o, o
    assert invoked(wire, bid) == 0
    assert_consistent(wire.messages(bid))
