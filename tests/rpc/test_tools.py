"""Tools and governance (docs/PROTOCOL.md §4), both server→client requests, toolEvent."""

from __future__ import annotations

import json
import threading
import time

import pytest

from .support import TIMEOUT, RpcError, scripted, wait_log

CALL_ECHO = {"json": {"action_requests": [{"function": "echo_tool", "arguments": {"text": "a"}}]}}
PERM = {"toolPermission": True}


def echo_operate(c, bid, **extra):
    return c.request("operate", {"branchId": bid, "instruction": "call", "actions": True, **extra},
                     timeout=TIMEOUT)


def outputs(result):
    return [r["output"] for r in result["result"]["action_responses"]]


DENIED = {"error": "denied by governance gate", "function": "echo_tool"}


def test_list_tools_shows_source_schema_and_policy_in_force(sidecar, tmp_path):
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
        "models": {"s": scripted("x")}, "toolModules": ["slow_tools"], "toolPolicy": {"slow_tool": "deny"}}})
    bid = sidecar.branch()
    tools = {t["name"]: t for t in sidecar.request("listTools", {})["tools"]}
    assert tools["echo_tool"]["source"] == "python" and tools["echo_tool"]["policy"] == "allow"
    assert tools["echo_tool"]["inputSchema"]["properties"]["text"]["type"] == "string"
    assert tools["slow_tool"]["policy"] == "deny"                       # settings.toolPolicy
    assert tools["read_file"]["source"] == "builtin" and tools["read_file"]["policy"] == "allow"  # read-only
    assert tools["write_file"]["policy"] == "ask"                        # default for the rest
    assert set(tools["echo_tool"]) == {"name", "description", "inputSchema", "source", "policy"}
    # server-wide decision beats settings; branch decision beats server-wide
    assert sidecar.request("authorizeTool", {"tool": "slow_tool", "decision": "ask"}) == \
        {"tool": "slow_tool", "decision": "ask", "branchId": None}
    assert sidecar.request("authorizeTool", {"tool": "slow_tool", "decision": "allow", "branchId": bid}) == \
        {"tool": "slow_tool", "decision": "allow", "branchId": bid}
    server_wide = {t["name"]: t["policy"] for t in sidecar.request("listTools", {})["tools"]}
    on_branch = {t["name"]: t["policy"] for t in sidecar.request("listTools", {"branchId": bid})["tools"]}
    assert server_wide["slow_tool"] == "ask" and on_branch["slow_tool"] == "allow"
    fork = sidecar.request("forkBranch", {"branchId": bid})["branchId"]   # policy copied
    assert {t["name"]: t["policy"] for t in sidecar.request("listTools", {"branchId": fork})["tools"]}[
        "slow_tool"] == "allow"


def test_authorize_unknown_tool_is_invalid_params(sidecar):
    sidecar.init(models={"s": scripted("x")})
    err = sidecar.error_of("authorizeTool", {"tool": "nope", "decision": "allow"})
    assert err.code == -32602 and "nope" in err.message
    assert sidecar.error_of("authorizeTool", {"tool": "nope", "decision": "maybe"}).code == -32602


def test_denied_call_is_never_invoked_and_recorded(sidecar):
    sidecar.init(models={"s": scripted(CALL_ECHO)}, toolModules=["slow_tools"], toolPolicy={"echo_tool": "deny"})
    bid = sidecar.branch()
    out = echo_operate(sidecar, bid)
    assert outputs(out) == [dict(DENIED, reason="denied by policy")]
    kinds = [m["kind"] for m in sidecar.messages(bid)]
    assert kinds[-2:] == ["action_request", "action_response"]
    events = sidecar.of("toolEvent")
    assert [e["event"] for e in events] == ["denied"]


def test_ask_without_the_capability_means_deny(sidecar):
    sidecar.init(models={"s": scripted(CALL_ECHO)}, toolModules=["slow_tools"], toolPolicy={"echo_tool": "ask"})
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    out = echo_operate(sidecar, sidecar.branch())
    assert outputs(out)[0]["error"] == "denied by governance gate" and asked == []


def test_ask_allow_once_invokes_and_asks_again(sidecar):
    sidecar.init(models={"s": scripted(CALL_ECHO, CALL_ECHO)}, capabilities=PERM, toolModules=["slow_tools"],
                 toolPolicy={"echo_tool": "ask"})
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    bid = sidecar.branch()
    assert outputs(echo_operate(sidecar, bid)) == ["echo:a"]
    assert outputs(echo_operate(sidecar, bid)) == ["echo:a"]
    assert len(asked) == 2
    p = asked[0]
    assert p["branchId"] == bid and p["tool"] == "echo_tool" and p["arguments"] == {"text": "a"}
    assert p["options"] == ["allow_once", "allow_always", "deny_once", "deny_always"]
    # one callId everywhere: permission request, toolEvents, messages
    msgs = [m for m in sidecar.messages(bid) if m["kind"] == "action_request"]
    assert msgs[0]["content"]["callId"] == p["callId"]
    ev = [e for e in sidecar.of("toolEvent") if e["callId"] == p["callId"]]
    assert [e["event"] for e in ev] == ["pre", "post"]


def test_allow_always_and_deny_always_become_the_branch_decision(sidecar):
    sidecar.init(models={"s": scripted(CALL_ECHO, CALL_ECHO, CALL_ECHO, CALL_ECHO)}, capabilities=PERM,
                 toolModules=["slow_tools"], toolPolicy={"echo_tool": "ask"})
    answers = iter(["allow_always", "deny_always"])
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": next(answers)})
    b1, b2 = sidecar.branch(), sidecar.branch()
    assert outputs(echo_operate(sidecar, b1)) == ["echo:a"]
    assert outputs(echo_operate(sidecar, b1)) == ["echo:a"]          # not asked again
    assert outputs(echo_operate(sidecar, b2))[0]["error"] == "denied by governance gate"
    assert outputs(echo_operate(sidecar, b2))[0]["error"] == "denied by governance gate"
    assert len(asked) == 2
    pol = lambda b: {t["name"]: t["policy"] for t in sidecar.request("listTools", {"branchId": b})["tools"]}
    assert pol(b1)["echo_tool"] == "allow" and pol(b2)["echo_tool"] == "deny"


def test_permission_error_response_means_deny(sidecar):
    sidecar.init(models={"s": scripted(CALL_ECHO)}, capabilities=PERM, toolModules=["slow_tools"],
                 toolPolicy={"echo_tool": "ask"})

    def refuse(p):
        raise RpcError(-32603, "user closed the dialog")

    sidecar.on_request("requestToolPermission", refuse)
    out = outputs(echo_operate(sidecar, sidecar.branch()))
    assert out[0]["error"] == "denied by governance gate" and "closed the dialog" in out[0]["reason"]


def test_unanswered_permission_request_times_out_to_deny(sidecar):
    sidecar.init(models={"s": scripted(CALL_ECHO)}, capabilities=PERM, toolModules=["slow_tools"],
                 toolPolicy={"echo_tool": "ask"}, permissionTimeoutMs=300)
    never = threading.Event()
    sidecar.on_request("requestToolPermission", lambda p: never.wait(TIMEOUT) and None)
    out = outputs(echo_operate(sidecar, sidecar.branch()))
    assert out[0]["error"] == "denied by governance gate" and "timed out" in out[0]["reason"]
    # the server told the client to stop waiting
    assert sidecar.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    never.set()


def test_register_client_tools_and_invoke_them(sidecar):
    sidecar.init(models={"s": scripted({"json": {"action_requests": [
        {"function": "editor_selection", "arguments": {"uri": "file:///a"}},
        {"function": "editor_fail", "arguments": {}}]}})}, capabilities={"clientTools": True})
    spec = {"name": "editor_selection", "description": "The selection.",
            "inputSchema": {"type": "object", "properties": {"uri": {"type": "string"}}, "required": ["uri"]}}
    fail = {"name": "editor_fail", "description": "Fails.", "inputSchema": {"type": "object", "properties": {}}}
    assert sidecar.request("registerClientTools", {"tools": [spec, fail]}) == \
        {"registered": ["editor_selection", "editor_fail"]}
    err = sidecar.error_of("registerClientTools", {"tools": [spec]})
    assert err.code == -32602 and "editor_selection" in err.message
    # an inputSchema that is not valid JSON Schema is refused where it is wrong, and nothing of
    # that call is registered (its valid tool neither)
    bad = {"name": "editor_bad", "description": "Bad.", "inputSchema": {"type": "object", "properties": {"uri": {"type": 5}}}}
    good = {"name": "editor_good", "description": "Good.", "inputSchema": {"type": "object", "properties": {}}}
    err = sidecar.error_of("registerClientTools", {"tools": [good, bad]})
    assert err.code == -32602 and "editor_bad" in err.message and err.data["path"] == "/properties/uri/type"
    calls = []
    sidecar.on_request("invokeClientTool", lambda p: calls.append(p) or {"output": {"text": "selected"}})

    def fail_handler(p):
        raise RpcError(-32000, "editor refused")

    handlers = {"editor_selection": lambda p: calls.append(p) or {"output": {"text": "selected"}},
                "editor_fail": fail_handler}
    sidecar.on_request("invokeClientTool", lambda p: handlers[p["tool"]](p))
    bid = sidecar.branch()
    tools = {t["name"]: t for t in sidecar.request("listTools", {"branchId": bid})["tools"]}
    assert tools["editor_selection"]["source"] == "client" and tools["editor_selection"]["policy"] == "allow"
    assert "editor_bad" not in tools and "editor_good" not in tools
    out = sidecar.request("operate", {"branchId": bid, "instruction": "x", "actions": True,
                                      "actionStrategy": "sequential"})
    res = outputs(out)
    assert res[0] == {"text": "selected"}
    assert res[1]["error"] == "editor refused" and res[1]["function"] == "editor_fail"
    assert calls[0]["branchId"] == bid and calls[0]["tool"] == "editor_selection"
    assert calls[0]["arguments"] == {"uri": "file:///a"} and calls[0]["callId"]
    events = sidecar.of("toolEvent")
    assert [(e["tool"], e["event"]) for e in events] == [("editor_selection", "pre"), ("editor_selection", "post"),
                                                          ("editor_fail", "pre"), ("editor_fail", "error")]


def test_two_registrations_of_one_name_in_flight_at_once_register_it_once(sidecar):
    """The schema check awaits a worker thread; the name check follows it with no await before
    registering, so of two calls racing for one name exactly one registers it and the other is
    told the name is taken (not an internal error from the registry)."""
    sidecar.init(models={"s": scripted("x")}, capabilities={"clientTools": True})
    for i in range(5):
        name = f"editor_twice_{i}"
        spec = {"name": name, "description": "Once.", "inputSchema": {"type": "object", "properties": {}}}
        pending = [sidecar.request_async("registerClientTools", {"tools": [spec]}) for _ in range(2)]
        outcomes = []
        for p in pending:
            try:
                outcomes.append(p.result(timeout=TIMEOUT))
            except RpcError as e:
                outcomes.append((e.code, e.data))
        assert sorted(outcomes, key=str) == sorted([{"registered": [name]}, (-32602, {"taken": [name]})], key=str)
        assert [t["name"] for t in sidecar.request("listTools", {})["tools"]].count(name) == 1


def test_tool_events_have_increasing_seq_and_bounded_summaries(sidecar):
    long_text = "z" * 500
    sidecar.init(models={"s": scripted({"json": {"action_requests": [
        {"function": "echo_tool", "arguments": {"text": long_text}},
        {"function": "failing_tool", "arguments": {"x": 1}}]}})}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    sidecar.request("operate", {"branchId": bid, "instruction": "x", "actions": True,
                                "actionStrategy": "sequential"})
    ev = sidecar.of("toolEvent")
    assert [e["seq"] for e in ev] == list(range(ev[0]["seq"], ev[0]["seq"] + len(ev)))
    assert [(e["tool"], e["event"]) for e in ev] == [("echo_tool", "pre"), ("echo_tool", "post"),
                                                      ("failing_tool", "pre"), ("failing_tool", "error")]
    assert all(len(e["argsSummary"]) <= 200 for e in ev)
    assert len(ev[1]["resultSummary"]) <= 200 and ev[1]["durationMs"] >= 0
    assert "tool exploded" in ev[3]["error"]
    assert all(e["branchId"] == bid for e in ev)


def test_mcp_server_tools_are_listed_governed_and_callable(sidecar):
    import sys

    from .support import ROOT

    server = str(ROOT / "tests" / "tools" / "fixtures" / "mcp_server.py")
    sidecar.init(models={"s": scripted({"json": {"action_requests": [
        {"function": "add", "arguments": {"a": 2, "b": 3}}, {"function": "echo", "arguments": {"text": "hi"}}]}})},
        mcpServers={"fx": {"command": [sys.executable, server, "fx"]}})
    tools = {t["name"]: t for t in sidecar.request("listTools", {}, timeout=60)["tools"]}
    assert tools["add"]["source"] == "mcp" and tools["add"]["policy"] == "ask"     # default for the rest
    assert tools["echo"]["policy"] == "allow"                                         # read-only annotation
    sidecar.request("authorizeTool", {"tool": "add", "decision": "allow"})
    out = sidecar.request("operate", {"branchId": sidecar.branch(), "instruction": "x", "actions": True,
                                      "actionStrategy": "sequential"}, timeout=60)
    assert [str(o) for o in outputs(out)] == ["5", "hi"]
    assert sidecar.close() == 0


def test_tool_outputs_json_cannot_hold_never_break_the_operate_the_branch_or_the_store(spawn, tmp_path):
    """§4, §5, §8: outputs that are not JSON (NaN, non-UTF-8 bytes, a tuple key) are made JSON
    before they are recorded; one that contains itself or holds an object with no JSON form is
    that call's tool error. The operate answers, the branch goes on, and the store reloads it."""
    odd = ["nan_output", "bytes_output", "tuple_key_output", "self_ref_output", "object_output"]
    calls = {"json": {"action_requests": [{"function": f, "arguments": {}} for f in odd]}}
    settings = {"stateDir": str(tmp_path), "toolModules": ["odd_outputs"]}
    c = spawn()
    c.init(models={"s": scripted(calls, "next turn")}, **settings)
    bid = c.branch()
    out = outputs(c.request("operate", {"branchId": bid, "instruction": "call", "actions": True,
                                        "actionStrategy": "sequential"}, timeout=TIMEOUT))
    assert out[:3] == [{"n": "NaN", "i": "Infinity"}, {"b": "\ufffd\x00"}, {"(1, 2)": "t"}]
    assert "contains itself" in out[3]["error"] and out[3]["function"] == "self_ref_output"
    assert "object at $['o']" in out[4]["error"] and out[4]["function"] == "object_output"
    assert c.request("operate", {"branchId": bid, "instruction": "again"}, timeout=TIMEOUT)["result"] == "next turn"
    recorded = [m["content"]["output"] for m in c.messages(bid) if m["kind"] == "action_response"]
    assert recorded == out
    assert c.close() == 0
    c2 = spawn()
    c2.init(models={"s": scripted("x")}, **settings)
    assert [m["content"]["output"] for m in c2.messages(bid) if m["kind"] == "action_response"] == out


def _wait_path(path, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.exists()


def test_a_tool_module_slow_to_import_never_freezes_the_server(spawn, tmp_path):
    """SECURITY.md G7: toolModules are imported off the event loop. While one blocks at import,
    ping and other requests are answered and a cancelled listTools does not stop the loading;
    the modules then register in their order, a broken one reported as before."""
    gate = tmp_path / "gate"
    c = spawn(env={"BLOCKING_IMPORT_GATE": str(gate)})
    c.init(models={"s": scripted("x")}, toolModules=["blocking_import", "no_such_module_xyz", "slow_tools"])
    first = c.request_async("listTools", {})
    assert _wait_path(tmp_path / "gate.started")
    started = time.monotonic()
    assert c.request("ping", {}, timeout=5) == {}
    c.branch()
    assert time.monotonic() - started < 5 and not first.done()
    c.cancel(first.id)
    with pytest.raises(RpcError) as ei:
        first.result(5)
    assert ei.value.code == -32800
    gate.touch()
    names = [t["name"] for t in c.request("listTools", {}, timeout=TIMEOUT)["tools"]]
    assert names.index("late_tool") < names.index("echo_tool")
    logs = c.of("window/logMessage")
    assert any("no_such_module_xyz" in m["message"] for m in logs)
    assert c.close() == 0


def test_shutdown_is_answered_while_a_tool_module_blocks_at_import(spawn, tmp_path):
    """SECURITY.md G7: shutdown does not wait for a tool module's import."""
    c = spawn(env={"BLOCKING_IMPORT_GATE": str(tmp_path / "gate")})  # never released (bounded: 15 s)
    c.init(models={"s": scripted("x")}, toolModules=["blocking_import"])
    c.request_async("listTools", {})
    assert _wait_path(tmp_path / "gate.started")
    started = time.monotonic()
    assert c.close(timeout=5) == 0
    assert time.monotonic() - started < 2.5  # the service's tasks get 3 s to stop: the import none


def test_mcp_server_stderr_reaches_ours_redacted(spawn):
    """SECURITY.md G6: every line an MCP server writes to its stderr is relayed with the secrets
    (here a secretEnv value the server prints) redacted."""
    import sys

    from .support import ROOT, wait_log

    key = "svc-token-SECRET-0123456789"
    server = str(ROOT / "tests" / "tools" / "fixtures" / "mcp_server.py")
    c = spawn(env={"SVC_TOKEN": key})
    c.init(models={"s": scripted({"json": {"action_requests": [
        {"function": "echo", "arguments": {"text": f"relay-marker {key}"}}]}})},
        secretEnv=["SVC_TOKEN"], mcpServers={"fx": {"command": [sys.executable, server, "fx"]}})
    out = c.request("operate", {"branchId": c.branch(), "instruction": "x", "actions": True}, timeout=60)
    assert outputs(out) == ["relay-marker [REDACTED]"]
    assert wait_log(c, "relay-marker")
    assert c.close() == 0
    err = c.stderr_text()
    assert key not in err
    assert "[mcp fx] echo called with 'relay-marker [REDACTED]'" in err


def test_tool_event_summaries_are_json_text(sidecar):
    """argsSummary and resultSummary are compact JSON (non-ASCII kept) a client can parse when
    they are not cut at 200 characters; error stays plain text. (They were Python reprs:
    ``{'text': 'héllo'}``, ``{'n': nan}``.)"""
    sidecar.init(models={"s": scripted({"json": {"action_requests": [
        {"function": "echo_tool", "arguments": {"text": "héllo \"there\"\n"}},
        {"function": "nan_output", "arguments": {}},
        {"function": "echo_tool", "arguments": {"text": "ü" * 300}},
        {"function": "failing_tool", "arguments": {"x": 1}}]}})}, toolModules=["slow_tools", "odd_outputs"])
    bid = sidecar.branch()
    sidecar.request("operate", {"branchId": bid, "instruction": "x", "actions": True,
                                "actionStrategy": "sequential"})
    ev = sidecar.of("toolEvent")
    assert [(e["tool"], e["event"]) for e in ev] == [
        ("echo_tool", "pre"), ("echo_tool", "post"), ("nan_output", "pre"), ("nan_output", "post"),
        ("echo_tool", "pre"), ("echo_tool", "post"), ("failing_tool", "pre"), ("failing_tool", "error")]
    assert ev[0]["argsSummary"] == '{"text":"héllo \\"there\\"\\n"}'
    assert json.loads(ev[1]["argsSummary"]) == {"text": "héllo \"there\"\n"}
    assert json.loads(ev[1]["resultSummary"]) == "echo:héllo \"there\"\n"
    assert ev[2]["argsSummary"] == "{}"
    assert json.loads(ev[3]["resultSummary"]) == {"n": "NaN", "i": "Infinity"}  # as the output is recorded
    cut = ev[4]["argsSummary"]  # cut at 200 characters: not JSON any more, but its start is
    assert len(cut) == 200 and cut == '{"text":"' + "ü" * 191
    assert ev[5]["resultSummary"] == '"echo:' + "ü" * 194
    assert json.loads(ev[6]["argsSummary"]) == {"x": 1}
    assert "tool exploded" in ev[7]["error"] and not ev[7]["error"].startswith('"')


def test_tool_names_taken_across_sources_are_reported_naming_both_sources(sidecar, tmp_path):
    """Every source's tools share one namespace. An MCP server's tool whose name a Python tool
    or another configured MCP server has is offered as ``<server>__<tool>`` and a warning
    (``window/logMessage`` and stderr) names the tool and both sources; a client tool taking a
    name answers -32602 naming who has it."""
    import sys
    from pathlib import Path

    gated = str(Path(__file__).resolve().parents[1] / "service" / "fixtures" / "gated_mcp_server.py")
    gate = tmp_path / "open"
    gate.touch()  # the servers start at once

    def server(name, *tools):
        return {"command": [sys.executable, gated, name, str(gate), *tools]}

    sidecar.init(models={"s": scripted("x")}, capabilities={"clientTools": True}, toolModules=["slow_tools"],
                 mcpServers={"a": server("a", "echo_tool", "one"), "b": server("b", "one", "two")})
    tools = {t["name"]: t["source"] for t in sidecar.request("listTools", {}, timeout=TIMEOUT)["tools"]}
    assert {n: s for n, s in tools.items() if n not in ("slow_tool", "failing_tool")} == {
        "echo_tool": "python", "a__echo_tool": "mcp", "a__one": "mcp", "b__one": "mcp", "two": "mcp"}, tools
    said = [m["message"] for m in sidecar.of("window/logMessage")]
    a = [m for m in said if m.startswith("MCP server 'a':")]
    b = [m for m in said if m.startswith("MCP server 'b':")]
    assert a == ["MCP server 'a': its tool 'echo_tool' is offered as 'a__echo_tool' (module 'slow_tools' offers "
                 "'echo_tool'); its tool 'one' is offered as 'a__one' (MCP server 'b' offers 'one' too)"], said
    assert b == ["MCP server 'b': its tool 'one' is offered as 'b__one' (MCP server 'a' offers 'one' too)"], said
    assert all(wait_log(sidecar, m) for m in a + b), sidecar.stderr_text()
    spec = {"description": "Mine.", "inputSchema": {"type": "object", "properties": {}}}
    err = sidecar.error_of("registerClientTools", {"tools": [{"name": "mine", **spec}, {"name": "two", **spec},
                                                             {"name": "echo_tool", **spec}]})
    assert err.code == -32602 and err.data == {"taken": ["two", "echo_tool"]}, err
    assert "two (by MCP server 'b')" in err.message and "echo_tool (by module 'slow_tools')" in err.message
    assert "mine" not in {t["name"] for t in sidecar.request("listTools", {})["tools"]}  # none of the call's


def test_a_tool_policy_entry_naming_no_tool_is_told_with_the_closest_name(sidecar):
    """``settings.toolPolicy`` names tools as listTools lists them: an entry naming no tool (a
    typo) decides nothing, so once the tool sources are loaded a warning names it and the closest
    tool name; a builtin tool named before a workspace folder offers it, and a real tool, are
    not warned about."""
    sidecar.init(models={"s": scripted("x")}, toolModules=["slow_tools"],
                 toolPolicy={"echo_tol": "deny", "write_file": "ask", "slow_tool": "deny", "qqq": "allow"})
    sidecar.request("listTools", {}, timeout=TIMEOUT)
    said = [m["message"] for m in sidecar.of("window/logMessage") if "toolPolicy" in m["message"]]
    assert said == [
        "settings.toolPolicy names 'echo_tol', which none of the configured tool sources offers (did you mean "
        "'echo_tool'?): the entry decides nothing until a tool of that name is offered (a tool is named as "
        "listTools lists it)",
        "settings.toolPolicy names 'qqq', which none of the configured tool sources offers: the entry decides "
        "nothing until a tool of that name is offered (a tool is named as listTools lists it)"], said
    assert wait_log(sidecar, said[0]), sidecar.stderr_text()
    sidecar.request("listTools", {}, timeout=TIMEOUT)  # told once
    assert len([m for m in sidecar.of("window/logMessage") if "toolPolicy" in m["message"]]) == 2


@pytest.mark.parametrize("call", [{"function": None, "arguments": {"a": 1}}, {"arguments": {"a": 1}}])
def test_a_call_naming_no_tool_is_one_tool_error_named_alike_everywhere(sidecar, call):
    """A reply's call whose ``function`` is null or missing: a tool error saying the call names
    no tool, its name "" in the answer, the recorded messages and the tool events alike (the
    events said "None", Python's word for null, and the answer "")."""
    sidecar.init(models={"s": scripted({"json": {"action_requests": [call]}})})
    bid = sidecar.branch()
    res = echo_operate(sidecar, bid)
    [resp] = res["result"]["action_responses"]
    assert resp["function"] == "" and resp["output"]["error"] == "The call names no tool (no function)."
    assert resp["output"]["function"] == ""
    events = sidecar.of("toolEvent")
    assert [(e["event"], e["tool"]) for e in events] == [("pre", ""), ("error", "")], events
    recorded = [m["content"]["function"] for m in sidecar.request("branchMessages", {"branchId": bid})["messages"]
                if m["kind"] in ("action_request", "action_response")]
    assert recorded == ["", ""], recorded


def test_an_mcp_tool_whose_name_no_model_could_call_or_that_shows_as_another_is_not_offered(sidecar):
    """MCP tool names are held to the rule a client's tools are (empty, whitespace, control or
    invisible format characters, over 128 characters): ``write_file\\u200b``, read-only, was
    offered (allowed) and ran, shown everywhere as ``write_file``. Not offered now, with one
    warning naming them; the good ones are."""
    import sys

    from .support import FIXTURES

    names = ["", "a b", "x" * 300, "write_file\u200b", "line\nbreak", "\u202eelif_etirw", "ok"]
    sidecar.init(models={"s": scripted({"json": {"action_requests": [{"function": "write_file\u200b", "arguments": {}}]}})},
                 mcpServers={"n": {"command": [sys.executable, str(FIXTURES / "named_mcp_server.py"), json.dumps(names)]}})
    offered = [t["name"] for t in sidecar.request("listTools", {}, timeout=60)["tools"] if t["source"] == "mcp"]
    assert offered == ["ok"], offered
    out = outputs(sidecar.request("operate", {"branchId": sidecar.branch(), "instruction": "x", "actions": True},
                                  timeout=60))
    assert "not registered" in out[0]["error"], out
    assert wait_log(sidecar, "lists tool names no model could call, or that would show as another name")
    assert "'write_file\\u200b' (holds an invisible format character" in sidecar.stderr_text()


def test_an_mcp_server_that_died_in_a_call_is_started_again_for_an_operate_sent_the_moment_it_answered(sidecar):
    """The call that lost its server waits for the server's end to be taken before its error is
    given: an operate sent the moment the one before answered met the server that went for
    ~30 ms more (``is not running``) instead of starting it again."""
    import sys

    from .support import FIXTURES

    def calls(name):
        return {"json": {"action_requests": [{"function": name, "arguments": {}}]}}

    sidecar.init(models={"s": scripted(calls("crash"), *[calls("ok")] * 3)},
                 mcpServers={"c": {"command": [sys.executable, str(FIXTURES / "named_mcp_server.py"),
                                               json.dumps(["crash", "ok"])]}},
                 toolPolicy={"crash": "allow", "ok": "allow"})
    bid = sidecar.branch()

    def operate():
        return outputs(sidecar.request("operate", {"branchId": bid, "instruction": "x", "actions": True}, timeout=60))

    assert "Connection closed" in operate()[0]["error"]
    assert [operate(), operate(), operate()] == [["called ok"]] * 3
