"""operate over the wire (docs/PROTOCOL.md §5, docs/PIPELINE.md D1–D4), $/progress, error codes."""

from __future__ import annotations

import json

from .support import ANSWER_SCHEMA, TIMEOUT, RpcError, scripted


def op(c, bid, **params):
    return c.request("operate", {"branchId": bid, **params}, timeout=TIMEOUT)


def test_result_envelope_kinds(sidecar):
    sidecar.init(models={"s": scripted({"json": {"answer": "42"}}, "plain text", {"json": {"answer": "raw"}},
                                        *["not json at all"] * 8)})
    bid = sidecar.branch()
    zero = {"inputTokens": 0, "outputTokens": 0, "contextTokens": 0, "modelCalls": 1}  # scripted reports zeros
    assert op(sidecar, bid, instruction="q", responseFormat=ANSWER_SCHEMA) == \
        {"result": {"answer": "42"}, "kind": "model", "model": "AnswerResponse", "usage": zero, "rounds": 1}
    assert op(sidecar, bid, instruction="q") == {"result": "plain text", "kind": "text", "model": None,
                                                 "usage": zero, "rounds": 1}
    out = op(sidecar, bid, instruction="q", responseFormat=ANSWER_SCHEMA, skipValidation=True)
    assert {k: out[k] for k in ("result", "kind", "model")} == {"result": '{"answer": "raw"}', "kind": "text",
                                                                "model": None}
    out = op(sidecar, bid, instruction="q", responseFormat=ANSWER_SCHEMA, handleValidation="return_none",
             parseOptions={"retryAttempts": 0, "retryInitialDelay": 0})
    assert {k: out[k] for k in ("result", "kind", "model")} == {"result": None, "kind": "none", "model": None}


def test_response_schema_sent_is_recorded_and_excludes_action_responses(sidecar):
    sidecar.init(models={"s": scripted({"json": {"answer": "a", "action_requests": [],
                                                 "action_responses": [{"function": "fake", "output": 1}]}})},
                 toolModules=["slow_tools"])
    bid = sidecar.branch()
    out = op(sidecar, bid, instruction="q", responseFormat=ANSWER_SCHEMA, actions=True, tools=["echo_tool"])
    assert out["kind"] == "model" and not out["result"].get("action_responses")
    ins = [m for m in sidecar.messages(bid) if m["kind"] == "instruction"][0]["content"]
    assert "action_responses" not in ins["responseSchema"]["properties"]
    assert "action_requests" in ins["responseSchema"]["properties"]
    assert [t["function"]["name"] for t in ins["toolSchemas"]] == ["echo_tool"]


def test_unknown_top_level_fields_are_named(sidecar):
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseModel": {}, "bogus": 1})
    assert err.code == -32602 and "responseModel" in err.message and "bogus" in err.message


def test_removed_model_option_names_point_to_the_wire_fields(sidecar):
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    for key, hint in (("request_model", "responseFormat"), ("operativeModel", "responseFormat"),
                      ("imodel", "chatModel")):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "modelOptions": {key: 1}})
        assert err.code == -32602 and key in err.message and hint in err.message
    # pipeline names are not provider options, the positional ones (the branch) included
    for key in ("middle", "operative", "skip_validation", "sender", "branch"):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "modelOptions": {key: 1}})
        assert err.code == -32602 and key in err.message
    assert op(sidecar, bid, instruction="x")["result"] == "x"  # nothing consumed the scripted reply


def test_unregistered_tool_is_refused_before_any_model_call(sidecar):
    sidecar.init(models={"s": scripted("first reply")}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "actions": True,
                                       "tools": ["echo_tool", "no_such_tool"]})
    assert err.code == -32602 and "no_such_tool" in err.message
    assert sidecar.messages(bid) == []
    assert op(sidecar, bid, instruction="x")["result"] == "first reply"


def test_unsupported_schema_keyword_is_named(sidecar):
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    schema = {"title": "T", "type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": schema})
    assert err.code == -32602 and "not" in err.message and "/properties/a" in err.message


def test_a_schema_that_is_not_valid_json_schema_is_invalid_params_naming_where(sidecar):
    """Checked against the metaschema before anything is built: a malformed schema is the
    client's mistake (-32602 with the path), never an internal error, and never a model that
    quietly enforces something else (``"required": "ab"`` is not a list of names)."""
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    for schema, at in (({"type": "object", "properties": "nope"}, "/properties"),
                       ({"type": "object", "properties": {"a": None}}, "/properties/a"),
                       ({"type": "object", "properties": {"a": {"type": 5}}}, "/properties/a/type"),
                       ({"type": "object", "properties": {"a": {"type": "string"}}, "required": "ab"}, "/required"),
                       ({"type": "object", "properties": {"a": {"type": "array", "items": [{}]}}},
                        "/properties/a/items"),
                       ({"type": "object", "properties": {"a": {"$ref": 5}}}, "/properties/a/$ref"),
                       ({"type": "object", "title": 5}, "/title"),
                       ({"type": "object", "properties": {"a": {"type": "string", "minLength": "x"}}},
                        "/properties/a/minLength")):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": schema})
        assert err.code == -32602 and "not a valid JSON Schema" in err.message and err.data["path"] == at, (schema, err)
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x",
                                       "fieldModels": [{"name": "score", "schema": {"type": "integer", "minimum": "0"}}]})
    assert err.code == -32602 and "fieldModels[0].schema" in err.message and err.data["path"] == "/minimum"
    assert sidecar.messages(bid) == []
    assert op(sidecar, bid, instruction="x")["result"] == "x"  # nothing consumed the scripted reply


def test_parse_options_out_of_bounds_are_invalid_params_naming_the_field(sidecar):
    """Each parse retry is a model call: retryAttempts is bounded (10**9 with no delay froze the
    server), and no delay, back-off or period is negative."""
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    for options, field in (({"retryAttempts": 101}, "retryAttempts"), ({"retryAttempts": -1}, "retryAttempts"),
                           ({"retryInitialDelay": -1}, "retryInitialDelay"), ({"retryBackoff": -0.5}, "retryBackoff"),
                           ({"throttlePeriod": -1}, "throttlePeriod"), ({"maxConcurrent": 0}, "maxConcurrent")):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "parseOptions": options})
        assert err.code == -32602 and f"parseOptions.{field}" in err.message, (options, err)
        assert "parseOptions.parseOptions" not in err.message
    assert op(sidecar, bid, instruction="x", parseOptions={"retryAttempts": 100, "retryInitialDelay": 0})["result"] == "x"


def test_a_persist_dir_that_cannot_be_a_directory_is_invalid_params_before_any_effect(sidecar, tmp_path):
    """persistDir / snapshotDir are the caller's paths: one that is a file (or under one) is
    -32602 naming it, with nothing recorded and no model called (it was -32603 with a
    traceback, after the instruction was already in the branch)."""
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    afile = tmp_path / "afile"
    afile.write_text("x")
    for dirs in ({"persistDir": str(afile)}, {"persistDir": str(tmp_path / "pd"), "snapshotDir": str(afile / "sub")}):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "streamPersist": True, **dirs})
        assert err.code == -32602 and str(afile) in err.message, (dirs, err)
    assert sidecar.messages(bid) == [] and "Traceback" not in sidecar.stderr_text()
    assert op(sidecar, bid, instruction="x")["result"] == "x"


def test_field_names_pydantic_reserves_are_invalid_params(sidecar):
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    for params in ({"fieldModels": [{"name": "model_config", "schema": {}}]},
                   {"fieldModels": [{"name": "_private", "schema": {"type": "string"}}]},
                   {"responseFormat": {"type": "object", "properties": {"model_fields": {"type": "string"}}}},
                   {"responseFormat": {"type": "object", "properties": {"a": {
                       "type": "object", "properties": {"model_dump": {"type": "string"}}}}}}):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", **params})
        assert err.code == -32602 and "reserved" in err.message, params


def test_validation_failed_raise_is_32010_and_runs_no_tool(sidecar):
    bad = {"json": {"wrong": "shape", "action_requests": [{"function": "echo_tool", "arguments": {"text": "x"}}]}}
    sidecar.init(models={"s": scripted(bad, bad, bad, bad, bad)}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": ANSWER_SCHEMA,
                                       "handleValidation": "raise", "actions": True,
                                       "parseOptions": {"retryAttempts": 0, "retryInitialDelay": 0}})
    assert err.code == -32010
    assert err.data["expected"] in ("Answer", "AnswerResponse") and err.data["expected"] in err.message
    assert isinstance(err.data["received"], (str, dict)) and len(str(err.data["received"])) <= 200
    assert sidecar.of("toolEvent") == []
    assert not [m for m in sidecar.messages(bid) if m["kind"].startswith("action")]


def test_a_reply_is_held_to_the_whole_response_format_with_actions_too(sidecar):
    """Keywords the model builder does not enforce (here ``uniqueItems``, which it made a set
    that dropped the repeat, and ``maxProperties``) hold the reply: a reply breaking one is a
    validation failure (-32010 under ``raise``, no tool run) naming where; one that keeps them is
    the result, and an ``actions`` operate's tool fields are not the client's fields
    (``additionalProperties: false``), so its tool runs. (Where the reply breaks the schema is
    named in the validation error the repair turn is sent: ``tests/service/test_response_schemas.py``.)
    The schema the model is shown keeps ``uniqueItems``."""
    schema = {"type": "object", "title": "Tags", "additionalProperties": False, "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "extra": {"type": "object", "maxProperties": 1}}}
    bad = {"json": {"tags": ["x", "x"], "action_requests": [{"function": "echo_tool", "arguments": {"text": "x"}}]}}
    good = {"json": {"tags": ["x", "y"], "extra": {"k": 1}, "action_required": True,
                     "action_requests": [{"function": "echo_tool", "arguments": {"text": "hi"}}]}}
    many = {"json": {"tags": [], "extra": {"i": 1, "j": 2}}}
    sidecar.init(models={"s": scripted(bad, bad, many, many, bad, bad, good)}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    no_retry = {"retryAttempts": 0, "retryInitialDelay": 0}
    for _ in range(2):  # each reply, and its repair turn's, breaks the schema
        out = op(sidecar, bid, instruction="x", responseFormat=schema, actions=True, handleValidation="return_none",
                 parseOptions=no_retry)
        assert out["kind"] == "none" and out["usage"]["modelCalls"] == 2, out
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": schema,
                                       "handleValidation": "raise", "actions": True, "parseOptions": no_retry})
    assert err.code == -32010 and err.data["expected"] == "Tags", err
    assert sidecar.of("toolEvent") == []
    out = op(sidecar, bid, instruction="x", responseFormat=schema, actions=True)
    assert out["result"]["tags"] == ["x", "y"] and out["result"]["extra"] == {"k": 1}, out
    assert [r["output"] for r in out["result"]["action_responses"]] == ["echo:hi"], out
    shown = [m for m in sidecar.messages(bid) if m["kind"] == "instruction"][-1]["content"]["responseSchema"]
    assert shown["properties"]["tags"]["uniqueItems"] is True and "x-" not in json.dumps(shown), shown


def test_model_failure_is_32011(sidecar):
    sidecar.init(models={"s": scripted({"error": "provider down"})})
    bid = sidecar.branch()
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x"})
    assert err.code == -32011 and "provider down" in err.message
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x"})  # exhausted script
    assert err.code == -32011


def test_progress_notifications_precede_the_response_in_order(sidecar):
    sidecar.init(models={"s": scripted({"text": "streamed reply text", "chunks": 4})})
    bid = sidecar.branch()
    out = op(sidecar, bid, instruction="x", workDoneToken="tok-1")
    assert out["result"] == "streamed reply text"
    prog = sidecar.of("$/progress")  # the reader records notifications before it resolves the response
    assert all(p["token"] == "tok-1" for p in prog)
    values = [p["value"] for p in prog]
    assert values[0] == {"kind": "begin", "title": "operate", "message": "communicate"}
    assert values[-1]["kind"] == "end"
    reports = values[1:-1]
    assert all(v["kind"] == "report" and v["phase"] in ("request", "stream", "parse", "actions") for v in reports)
    assert "".join(v.get("delta", "") for v in reports if v["phase"] == "stream") == "streamed reply text"
    assert len([v for v in reports if "delta" in v]) == 4


def test_a_client_that_shows_thoughts_gets_their_text_redacted_in_thinking_reports(spawn):
    """``capabilities.thoughts``: after the stretch's "thinking" report, the thoughts' text comes
    in "thinking" reports with ``thought``, before the reply's deltas, a secret in them masked;
    a client that did not announce it gets the one report and no text."""
    key = "think-SECRET-0123456789"
    entry = {"thinking": f"Plan: use {key} quietly.", "text": "Done.", "chunks": 2}
    seen = {}
    for shows in (True, False):
        c = spawn(env={"THINK_TOKEN": key})
        c.init(models={"s": scripted(entry)}, secretEnv=["THINK_TOKEN"],
               capabilities={"thoughts": True} if shows else None)
        bid = c.branch()
        out = op(c, bid, instruction="x", workDoneToken="t")
        assert out["result"] == "Done."
        reports = [p["value"] for p in c.of("$/progress") if p["value"]["kind"] == "report"]
        seen[shows] = reports
        thinking = [i for i, v in enumerate(reports) if v["message"] == "thinking"]
        first_delta = min(i for i, v in enumerate(reports) if "delta" in v)
        assert thinking and max(thinking) < first_delta, reports
        assert reports[thinking[0]] == {"kind": "report", "message": "thinking", "phase": "stream"}
        assert "".join(reports[i]["delta"] for i in range(len(reports)) if "delta" in reports[i]) == "Done."
        assert key not in json.dumps(reports) and key not in json.dumps(c.messages(bid))
    thoughts = "".join(v.get("thought", "") for v in seen[True])
    assert thoughts == "Plan: use [REDACTED] quietly.", seen[True]
    assert all("thought" not in v for v in seen[False]) and len(seen[False]) < len(seen[True])


def test_progress_for_a_cli_model_says_run_and_collect_and_no_progress_without_token(sidecar):
    sidecar.init(models={"c": scripted("cli says hi", "again", cli=True)})
    bid = sidecar.branch()
    assert op(sidecar, bid, instruction="x", workDoneToken=0)["result"] == "cli says hi"
    assert sidecar.of("$/progress")[0] == {"token": 0, "value": {"kind": "begin", "title": "operate",
                                                                  "message": "run_and_collect"}}
    n = len(sidecar.notifications)
    op(sidecar, bid, instruction="x")
    assert len(sidecar.notifications) == n


def test_instruct_action_strategy_decides_when_the_wire_omits_it(sidecar):
    calls = {"json": {"action_requests": [{"function": "slow_tool", "arguments": {"seconds": 0.3}},
                                          {"function": "echo_tool", "arguments": {"text": "b"}}]}}
    sidecar.init(models={"s": scripted(calls, calls)}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    op(sidecar, bid, instruct={"instruction": "x", "actions": True, "actionStrategy": "sequential"})
    seq_events = [(e["tool"], e["event"]) for e in sidecar.of("toolEvent")]
    assert seq_events == [("slow_tool", "pre"), ("slow_tool", "post"), ("echo_tool", "pre"), ("echo_tool", "post")]
    sidecar.notifications.clear()
    op(sidecar, bid, instruct={"instruction": "x", "actions": True})  # concurrent: both start before either ends
    conc = [(e["tool"], e["event"]) for e in sidecar.of("toolEvent")]
    assert conc[:2] in ([("slow_tool", "pre"), ("echo_tool", "pre")], [("echo_tool", "pre"), ("slow_tool", "pre")])


def test_field_models_add_generated_fields(sidecar):
    sidecar.init(models={"s": scripted({"json": {"answer": "a", "score": 3, "tags": ["x"]}})})
    bid = sidecar.branch()
    out = op(sidecar, bid, instruction="x", responseFormat=ANSWER_SCHEMA, fieldModels=[
        {"name": "score", "schema": {"type": "integer", "maximum": 5}, "description": "a score"},
        {"name": "tags", "schema": {"type": "array", "items": {"type": "string"}}, "default": []}])
    assert out["kind"] == "model" and out["result"]["score"] == 3 and out["result"]["tags"] == ["x"]
    ins = [m for m in sidecar.messages(bid) if m["kind"] == "instruction"][0]["content"]
    assert {"answer", "score", "tags"} <= set(ins["responseSchema"]["properties"])


def test_reason_and_loose_instruction_context(sidecar):
    sidecar.init(models={"s": scripted({"json": {"answer": "a", "reason": {"title": "t", "content": "c",
                                                                           "confidence_score": 0.9}}})})
    bid = sidecar.branch()
    out = op(sidecar, bid, instruction="x", guidance="be brief", context={"k": 1}, reason=True,
             responseFormat=ANSWER_SCHEMA)
    assert out["result"]["reason"]["title"] == "t"
    ins = [m for m in sidecar.messages(bid) if m["kind"] == "instruction"][0]["content"]
    assert ins["guidance"] == "be brief" and ins["context"] == {"k": 1}


def test_named_and_inline_chat_model_per_call(sidecar):
    sidecar.init(models={"a": scripted("from a"), "b": scripted("from b")}, defaultModel="a")
    bid = sidecar.branch()
    assert op(sidecar, bid, instruction="x", chatModel="b")["result"] == "from b"
    assert op(sidecar, bid, instruction="x", chatModel={"provider": "scripted", "responses": ["inline"]})[
        "result"] == "inline"
    assert op(sidecar, bid, instruction="x")["result"] == "from a"
    assert sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "chatModel": "zzz"}).code == -32602


def test_operates_on_one_branch_run_in_arrival_order(sidecar):
    sidecar.init(models={"s": scripted({"text": "first", "delayMs": 400}, "second")})
    bid = sidecar.branch()
    p1 = sidecar.request_async("operate", {"branchId": bid, "instruction": "one"})
    p2 = sidecar.request_async("operate", {"branchId": bid, "instruction": "two"})
    r2 = p2.result(TIMEOUT)
    assert p1.done()  # the first (slow) one was answered before the second
    assert p1.result(TIMEOUT)["result"] == "first" and r2["result"] == "second"
    texts = [m["content"].get("instruction") for m in sidecar.messages(bid) if m["kind"] == "instruction"]
    assert texts == ["one", "two"]


def test_operates_on_different_branches_run_concurrently(sidecar):
    sidecar.init(models={"slow": scripted({"text": "slow", "delayMs": 60000}), "fast": scripted("fast")})
    b1, b2 = sidecar.branch(chatModel="slow"), sidecar.branch(chatModel="fast")
    p1 = sidecar.request_async("operate", {"branchId": b1, "instruction": "wait"})
    assert sidecar.request("operate", {"branchId": b2, "instruction": "go"}, timeout=TIMEOUT)["result"] == "fast"
    assert not p1.done()  # still running while the other branch answered
    sidecar.cancel(p1.id)
    try:
        p1.result(TIMEOUT)
        raise AssertionError("expected cancellation")
    except RpcError as e:
        assert e.code == -32800


def _jsonl_program(tmp_path, name: str, *events) -> dict:
    """A real CLI-backed model (profile ``jsonl``): a script printing ``events``, one a line."""
    import json
    import sys

    script = tmp_path / f"{name}.py"
    script.write_text("import json, sys\nsys.stdin.read()\n"
                      f"for e in json.loads({json.dumps(json.dumps(list(events)))}):\n    print(json.dumps(e))\n")
    return {"provider": "cli", "profile": "jsonl", "command": [sys.executable, str(script)]}


def _calls_and_answers(sidecar, bid) -> list[tuple]:
    msgs = sidecar.messages(bid)
    by_id = {m["id"]: m for m in msgs}
    return [(by_id[m["content"]["requestId"]]["content"]["callId"], m["content"]["callId"],
             by_id[m["content"]["requestId"]]["content"]["arguments"], m["content"]["output"])
            for m in msgs if m["kind"] == "action_response"]


def test_a_cli_run_that_uses_a_tool_id_twice_answers_each_call(sidecar, tmp_path):
    """A run naming two tool uses with one id: each request gets its own response, in order,
    and one callId names one call (the second use of an id, in this run or an earlier one, gets
    a suffix); the first request was left unanswered and the second got the first's result."""
    run = _jsonl_program(tmp_path, "twice",
                         {"type": "tool_use", "id": "1", "name": "bash", "input": {"c": "a"}},
                         {"type": "tool_use", "id": "1", "name": "bash", "input": {"c": "b"}},
                         {"type": "tool_result", "id": "1", "output": "A"},
                         {"type": "tool_result", "id": "1", "output": "B"},
                         {"type": "tool_use", "id": "2", "name": "bash", "input": {"c": "c"}},
                         {"type": "text", "text": "done"})
    sidecar.init(models={"c": run})
    bid = sidecar.branch(chatModel="c")
    assert op(sidecar, bid, instruction="go")["result"] == "done"
    assert op(sidecar, bid, instruction="again")["result"] == "done"  # the same ids in a second run
    pairs = _calls_and_answers(sidecar, bid)
    assert [(p[1], p[2], p[3]) for p in pairs] == [
        ("1", {"c": "a"}, "A"), ("1#2", {"c": "b"}, "B"),
        ("2", {"c": "c"}, {"error": "no result reported by the run", "function": "bash"}),
        ("1#3", {"c": "a"}, "A"), ("1#4", {"c": "b"}, "B"),
        ("2#2", {"c": "c"}, {"error": "no result reported by the run", "function": "bash"})]
    assert all(request_id == response_id for request_id, response_id, _, _ in pairs)
    requests = [m["content"]["callId"] for m in sidecar.messages(bid) if m["kind"] == "action_request"]
    assert len(set(requests)) == len(requests) == 6


def test_a_cli_runs_tool_results_are_bounded_like_a_tools_output(sidecar, tmp_path):
    """What a CLI run's own tools returned is recorded like a pipeline tool's output: bounded by
    maxToolOutputChars (it was kept whole); a failure's error is a text (one with no output was
    the text "null")."""
    run = _jsonl_program(tmp_path, "outputs",
                         {"type": "tool_use", "id": "big", "name": "cat", "input": {}},
                         {"type": "tool_result", "id": "big", "output": "z" * 5000},
                         {"type": "tool_use", "id": "none", "name": "touch", "input": {}},
                         {"type": "tool_result", "id": "none"},
                         {"type": "tool_use", "id": "fail", "name": "rm", "input": {}},
                         {"type": "tool_result", "id": "fail", "is_error": True, "output": "e" * 5000},
                         {"type": "tool_use", "id": "quiet", "name": "rm", "input": {}},
                         {"type": "tool_result", "id": "quiet", "is_error": True},
                         {"type": "text", "text": "done"})
    sidecar.init(models={"c": run}, maxToolOutputChars=100)
    bid = sidecar.branch(chatModel="c")
    assert op(sidecar, bid, instruction="go")["result"] == "done"
    outputs = [p[3] for p in _calls_and_answers(sidecar, bid)]
    assert outputs[0] == {"truncated": True, "originalChars": 5002, "preview": '"' + "z" * 99}
    assert outputs[1] is None                                     # no output, as a Python tool returning None
    assert outputs[2] == {"error": "e" * 100 + "…(truncated: 5000 characters)", "function": "rm"}
    assert outputs[3] == {"error": "the tool failed", "function": "rm"}


def test_a_failing_tools_error_is_bounded_like_its_output(spawn, tmp_path):
    """maxToolOutputChars bounds a tool's output whether it returned or raised: the error text
    (and the arguments the error output repeats) are cut; a 300,000-character exception message
    was recorded, answered and saved whole."""
    (tmp_path / "loud_tools.py").write_text(
        "def loud_fail(text: str) -> str:\n    \"\"\"Raise with a long message.\"\"\"\n"
        "    raise ValueError('x' * 300000)\n")
    c = spawn(paths=(tmp_path,))
    call = {"json": {"action_requests": [{"function": "loud_fail", "arguments": {"text": "a" * 3000}}]}}
    c.init(models={"s": scripted(call)}, toolModules=["loud_tools"], maxToolOutputChars=1000)
    bid = c.branch()
    out = op(c, bid, instruction="go", actions=True)["result"]["action_responses"][0]["output"]
    assert out["error"] == "x" * 1000 + "…(truncated: 300000 characters)" and out["function"] == "loud_fail"
    assert out["arguments"] == {"truncated": True, "originalChars": 3012, "preview": '{"text": "' + "a" * 990}
    recorded = [m["content"]["output"] for m in c.messages(bid) if m["kind"] == "action_response"]
    assert recorded == [out]
    assert [e["event"] for e in c.of("toolEvent")] == ["pre", "error"]


def test_a_field_model_taking_an_action_fields_name_is_invalid_params_before_any_model_call(sidecar):
    """fieldModels named like a field actions add would replace it: the calls read from it
    could not run. Refused (-32602, naming it) before the model is called; it was -32603 after
    the model's reply was recorded."""
    calls = {"json": {"action_requests": ["echo_tool"]}}
    sidecar.init(models={"s": scripted(calls, "plain")}, toolModules=["slow_tools"])
    bid = sidecar.branch()
    strings = {"type": "array", "items": {"type": "string"}}
    for name in ("action_requests", "action_responses", "action_required"):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "actions": True,
                                           "fieldModels": [{"name": name, "schema": strings}]})
        assert err.code == -32602 and repr(name) in err.message, (name, err.message)
    assert sidecar.messages(bid) == [] and sidecar.of("toolEvent") == []
    # without actions the name is the caller's own field
    out = op(sidecar, bid, instruction="x", fieldModels=[{"name": "action_requests", "schema": strings}])
    assert out["result"] == {"action_requests": ["echo_tool"]} and out["kind"] == "model"


def test_a_pattern_the_linear_time_validator_cannot_run_is_invalid_params_in_one_line_naming_it(sidecar):
    """A reply is checked against the schema's patterns in linear time (pydantic-core's engine),
    so a pattern with look-around or a backreference cannot be used: -32602 naming the pattern,
    where it is and why, in one line (it was pydantic's multi-line build error), before any model
    call, in a responseFormat and in a fieldModels schema alike. A pattern that backtracks
    catastrophically in Python's ``re`` is taken, and a long reply is checked against it at once."""
    sidecar.init(models={"s": scripted({"json": {"s": "a" * 5000 + "!"}}, {"json": {"s": "aaa"}})})
    bid = sidecar.branch()
    for pattern, why in (("(?=a)a+", "look-around"), ("(a)\\1", "backreferences")):
        schema = {"type": "object", "title": "T", "properties": {"w": {"type": "array", "items": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}}}}
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": schema})
        assert err.code == -32602 and "\n" not in err.message, err
        assert repr(pattern) in err.message and why in err.message and "linear time" in err.message, err
        assert err.data == {"path": "/properties/w/items/properties/s/pattern", "pattern": pattern}, err
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x",
                                           "fieldModels": [{"name": "c", "schema": {"type": "string",
                                                                                    "pattern": pattern}}]})
        assert err.code == -32602 and "fieldModels[0].schema" in err.message and "\n" not in err.message, err
    assert sidecar.messages(bid) == []
    schema = {"type": "object", "title": "T", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
              "required": ["s"]}
    out = op(sidecar, bid, instruction="x", responseFormat=schema)
    # 5,000 a's and a '!' do not match (checked at once): the repair turn's reply is the result
    assert out["result"] == {"s": "aaa"} and out["usage"]["modelCalls"] == 2, out


def test_a_response_format_property_the_pipeline_generates_is_invalid_params_before_any_model_call(sidecar):
    """A responseFormat property named reason (reason on) or like an action field (actions on)
    was silently replaced by the generated field: the caller's schema was not the one asked
    for. Refused (-32602, data.path at the property) before the model is called; without the
    flag the property is the caller's own."""
    sidecar.init(models={"s": scripted({"json": {"reason": "mine", "action_required": "yes"}})},
                 toolModules=["slow_tools"])
    bid = sidecar.branch()
    for name, flags in (("reason", {"reason": True}), ("action_requests", {"actions": True}),
                        ("action_responses", {"actions": True}), ("action_required", {"actions": True})):
        fmt = {"title": "Mine", "type": "object", "properties": {name: {"type": "string"}}}
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": fmt, **flags})
        assert err.code == -32602 and repr(name) in err.message, (name, err.message)
        assert err.data == {"path": f"/properties/{name}", "field": name}
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "actions": True, "fieldModels": [
        {"name": "ok", "schema": {"type": "string"}}, {"name": "action_required", "schema": {"type": "string"}}]})
    assert err.code == -32602 and err.data == {"path": "fieldModels[1].name", "field": "action_required"}
    assert sidecar.messages(bid) == [] and sidecar.of("toolEvent") == []
    fmt = {"title": "Mine", "type": "object", "properties": {"reason": {"type": "string"},
                                                           "action_required": {"type": "string"}}}
    out = op(sidecar, bid, instruction="x", responseFormat=fmt)
    assert out["result"] == {"reason": "mine", "action_required": "yes"} and out["kind"] == "model"


def test_a_long_reply_is_parsed_off_the_event_loop(sidecar):
    """Scanning and repairing a long reply is pure Python: on the event loop it held ping and
    cancel for as long as it took (seconds for a cut-off 250,000-character object). A ping
    sent once the parse has begun is answered before the parse ends (before the reformat
    turn that follows a parse that fails)."""
    reply = '{"other": "' + "z" * 250_000  # cut off: only json-repair reads it; no answer in it
    sidecar.init(models={"s": scripted(reply, {"json": {"answer": "reformatted"}})})
    bid = sidecar.branch()
    pings, answered_before_repair = [], []

    def on_progress(p):
        phase, message = p["value"].get("phase"), p["value"].get("message", "")
        if phase == "parse" and message == "parsing reply" and not pings:
            pings.append(sidecar.request_async("ping"))
        elif phase == "parse" and message.startswith("repair attempt"):
            answered_before_repair.append(bool(pings) and pings[0].done())

    sidecar.on_notification("$/progress", on_progress)
    out = op(sidecar, bid, instruction="x", responseFormat=ANSWER_SCHEMA, workDoneToken="t",
             parseOptions={"retryAttempts": 0, "retryInitialDelay": 0})
    assert out["result"] == {"answer": "reformatted"}
    assert answered_before_repair == [True], "the ping waited for the parse"
    assert pings[0].result(TIMEOUT) == {}


def test_clear_messages_clears_nothing_when_the_operate_fails_before_its_reply(sidecar, tmp_path):
    """clearMessages empties the branch together with recording the new turn: a model failure
    (-32011) or an unusable persistDir (-32602) leaves the branch as it was (both emptied it);
    a successful one empties it, and the model is sent only what is left (the system message)."""
    sidecar.init(models={"s": scripted("first", {"error": "provider down"}, "cleared"), "c": scripted(cli=True)})
    bid = sidecar.branch(system="be brief")
    op(sidecar, bid, instruction="one")
    before = sidecar.messages(bid)
    assert [m["kind"] for m in before] == ["system", "instruction", "assistant_response"]
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "two", "clearMessages": True})
    assert err.code == -32011 and sidecar.messages(bid) == before
    (tmp_path / "a_file").write_text("x")
    # (/proc: a directory nobody can create a file in, root included; it was -32603 after the
    # branch was cleared and the instruction recorded)
    for params in ({"streamPersist": True, "persistDir": str(tmp_path / "a_file")},
                   {"chatModel": "c", "streamPersist": True, "snapshotDir": str(tmp_path / "a_file")},
                   {"streamPersist": True, "persistDir": "/proc"},
                   {"streamPersist": True, "persistDir": str(tmp_path / "runs"), "snapshotDir": "/proc"}):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "two", "clearMessages": True, **params})
        assert err.code == -32602 and sidecar.messages(bid) == before, params
        assert "cannot be used" in err.message, err.message
    assert op(sidecar, bid, instruction="three", clearMessages=True)["result"] == "cleared"
    assert [(m["kind"], m["content"].get("instruction")) for m in sidecar.messages(bid)] == [
        ("system", None), ("instruction", "three"), ("assistant_response", None)]


def test_a_reply_nested_deeper_than_the_json_parser_goes_holds_no_json(sidecar):
    """A reply of deeply nested brackets (or JSON deeper than Python's parser recurses) is a reply
    with no JSON: unparsed text under return_value, a repair turn with a responseFormat. It was
    -32603 (RecursionError) after the reply was recorded."""
    deep_call = ('{"action_requests": [{"function": "echo_tool", "arguments": {"text": '
                 + "[" * 990 + "]" * 990 + "}}]}")
    deep_object = '{"answer": ' * 3000 + '"x"' + "}" * 3000
    sidecar.init(models={"s": scripted("[" * 5000, deep_call, deep_object, {"json": {"answer": "repaired"}})},
                 toolModules=["slow_tools"])
    bid = sidecar.branch()
    for text in ("[" * 5000, deep_call):
        out = op(sidecar, bid, instruction="x", actions=True)
        assert out["kind"] == "text" and out["result"] == text
    out = op(sidecar, bid, instruction="x", responseFormat=ANSWER_SCHEMA,
             parseOptions={"retryAttempts": 0, "retryInitialDelay": 0})
    assert out["result"] == {"answer": "repaired"} and out["usage"]["modelCalls"] == 2
    assert sidecar.of("toolEvent") == []


def test_a_field_models_default_must_be_a_value_of_its_schema_and_null_makes_it_optional(sidecar):
    """fieldModels[i].default is the result's value when the reply leaves the field out: one that
    is not a value of the field's schema is -32602 naming where (it was returned as is, in a
    result of kind "model"). A null default makes the field optional: left out or null, it is
    null (without a responseFormat both made the reply unparsed text)."""
    sidecar.init(models={"s": scripted({"json": {}}, {"json": {"c": None}}, {"json": {"c": 2.5}})})
    bid = sidecar.branch()
    for schema, default, path in (({"type": "integer"}, "abc", "/"), ({"type": "number", "minimum": 0}, -1, "/"),
                                  ({"type": "object", "properties": {"k": {"type": "integer"}}}, {"k": "x"}, "/k")):
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x",
                                           "fieldModels": [{"name": "c", "schema": schema, "default": default}]})
        assert err.code == -32602 and "fieldModels[0].default" in err.message and err.data["path"] == path
    assert sidecar.messages(bid) == []
    optional = [{"name": "c", "schema": {"type": "number"}, "default": None}]
    for expected in (None, None, 2.5):
        out = op(sidecar, bid, instruction="x", fieldModels=optional)
        assert out["kind"] == "model" and out["result"] == {"c": expected}
    shown = [m for m in sidecar.messages(bid) if m["kind"] == "instruction"][0]["content"]["responseSchema"]
    assert shown["properties"]["c"]["default"] is None
