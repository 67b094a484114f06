"""`operate-sidecar replay`: session scripts run against a real server process over real pipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from operate_sidecar.server.script.matcher import (describe_mismatches, escape, first_mismatch, get_path, mismatches,
                                                   substitute)
from operate_sidecar.server.script.runner import Runner, parse_script

TIMEOUT = 120
ANSWER = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
PERM = {"toolPermission": True}


def write_script(path: Path, steps: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
    return path


def replay(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "operate_sidecar.server", "replay", *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)


def scripted(*responses) -> dict:
    return {"provider": "scripted", "responses": list(responses)}


def session(answer_expected: str = "42") -> list[dict]:
    return [
        {"request": "initialize", "params": {"clientInfo": {"name": "t"},
                                             "settings": {"models": {"m": scripted({"json": {"answer": "42"}})}}},
         "expect": {"result": {"protocolVersion": 1, "capabilities": {"models": ["m"]}}}},
        {"notify": "initialized"},
        {"request": "createBranch", "params": {"system": "be brief", "name": "first"}, "save": {"b": "branchId"}},
        {"request": "operate", "params": {"branchId": "${b}", "instruction": "answer", "responseFormat": ANSWER,
                                          "workDoneToken": "w1"},
         "expect": {"result": {"kind": "model", "result": {"answer": answer_expected}}}},
        {"expectNotification": "$/progress", "match": {"token": "w1", "value": {"kind": "end"}}, "timeoutMs": 5000},
        {"request": "listBranches", "expect": {"result": {"branches": [{"branchId": "${b}", "name": "first"}]}}},
        {"request": "deleteBranch", "params": {"branchId": "nope"}, "expect": {"error": {"code": -32012}}},
    ]


def test_a_correct_script_passes_every_step_and_exits_0(tmp_path):
    out = replay(write_script(tmp_path / "ok.jsonl", session()))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:-1]] == ["PASS"] * 7
    assert lines[3].startswith("PASS line 4: request operate")
    assert lines[-1] == "all 7 steps passed (ok.jsonl)"


def test_one_wrong_expectation_fails_naming_the_step_and_the_smallest_difference(tmp_path):
    out = replay(write_script(tmp_path / "bad.jsonl", session(answer_expected="41")))
    assert out.returncode == 1
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails == ['FAIL line 4: request operate: at $.result.result.answer: expected "41", got "42"']
    assert "1 of 7 steps failed (bad.jsonl); first: line 4: request operate" in out.stdout
    # the other steps still ran and passed: ${b} was saved before the failure
    assert out.stdout.count("PASS ") == 6


def test_a_missing_notification_fails_with_the_nearest_candidate(tmp_path):
    steps = session()[:5]
    steps[4] = {"expectNotification": "$/progress", "match": {"token": "w1", "value": {"kind": "end", "message": "nope"}},
                "timeoutMs": 300}
    out = replay(write_script(tmp_path / "n.jsonl", steps))
    assert out.returncode == 1
    (fail,) = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    # (its operate was answered: all its progress had come, so the step did not wait out its 0.3 s)
    assert fail.startswith("FAIL line 5: expectNotification $/progress: no matching $/progress before its request "
                           "was answered;"), fail
    assert 'nearest at $.params.value.message: expected "nope", got "' in fail


def test_standing_answers_to_permission_requests_hold_until_replaced(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    write = {"json": {"action_requests": [{"function": "write_file", "arguments": {"path": "n.txt", "content": "hi\n"}}]}}
    op = {"branchId": "${b}", "instruction": "write it", "actions": True}
    steps = [
        {"request": "initialize", "params": {"capabilities": PERM, "workspaceFolders": [str(ws)],
                                             "settings": {"models": {"m": scripted(write, write, write)},
                                                          "toolPolicy": {"write_file": "ask"}}}},
        {"request": "createBranch", "save": {"b": "branchId"}},
        {"respond": "requestToolPermission", "result": {"decision": "deny_once"}},
        {"request": "operate", "params": op,
         "expect": {"result": {"result": {"action_responses": [{"output": {"error": "denied by governance gate"}}]}}}},
        {"expectNotification": "toolEvent", "match": {"event": "denied", "tool": "write_file"}},
        {"request": "operate", "params": op,   # the standing answer still holds
         "expect": {"result": {"result": {"action_responses": [{"output": {"error": "denied by governance gate"}}]}}}},
        {"respond": "requestToolPermission", "result": {"decision": "allow_once"}},
        {"request": "operate", "params": op,
         "expect": {"result": {"result": {"action_responses": [{"output": {"created": True, "path": "n.txt"}}]}}}},
        {"expectNotification": "toolEvent", "match": {"event": "post", "tool": "write_file"}},
    ]
    out = replay(write_script(tmp_path / "perm.jsonl", steps))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (ws / "n.txt").read_text() == "hi\n"


def test_replay_against_another_server_command_after_double_dash(tmp_path):
    steps = [{"request": "initialize", "expect": {"result": {"serverInfo": {"name": "operate-sidecar"}}}},
             {"request": "initialize", "expect": {"error": {"code": -32600}}}]
    script = write_script(tmp_path / "s.jsonl", steps)
    out = replay(script, "--", sys.executable, "-m", "operate_sidecar.server", "--log-level", "error")
    assert out.returncode == 0, out.stdout + out.stderr
    bad = replay(script, "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert bad.returncode == 1 and "FAIL line 1: request initialize" in bad.stdout
    missing = replay(script, "--", str(tmp_path / "no-such-server"))
    assert missing.returncode == 2 and "cannot start the server" in missing.stderr


def test_a_malformed_script_is_refused_before_anything_runs(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"request": "ping"}\n{"request": "ping", "expect": {"result": {}}, "typo": 1}\n')
    out = replay(p)
    assert out.returncode == 2
    assert "m.jsonl:2: unknown field(s) for a request step: typo" in out.stderr


# ------------------------------------------------------------------ the matcher, in process
@pytest.mark.parametrize("pattern, value, where", [
    ({"a": 1}, {"a": 1, "b": 2}, None),                                 # objects are subsets
    ({"a": "*"}, {}, None),                                              # "*" matches a missing key
    ([1, {"x": "*"}], [1, {"x": [3]}], None),
    ({"a": [1, 2]}, {"a": [1, 2, 3]}, ("$.a[2]", "expected 2 items, got 3")),   # arrays element-wise
    ({"a": {"b": [{"c": "x"}]}}, {"a": {"b": [{"c": "y"}]}}, ("$.a.b[0].c", "")),
    ({"a": 1}, {"a": True}, ("$.a", "expected a number, got a boolean")),
    ({"a b": 1}, {}, ('$["a b"]', "")),
])
def test_matcher_reports_the_path_of_the_first_difference(pattern, value, where):
    mm = first_mismatch(pattern, value)
    if where is None:
        assert mm is None
    else:
        assert mm is not None and (mm.path, mm.why) == where


def test_saved_values_substitute_whole_values_and_inside_strings():
    saved = {"b": "abc", "n": {"k": 1}}
    assert substitute({"x": "${b}", "y": ["${n}"], "z": "id=${b}"}, saved) == {"x": "abc", "y": [{"k": 1}], "z": "id=abc"}
    assert get_path({"branches": [{"branchId": "q"}]}, "branches.0.branchId") == "q"
    with pytest.raises(KeyError, match=r"\$\{missing\} was never saved"):
        substitute("${missing}", saved)


def test_the_repository_example_script_passes(tmp_path):
    example = Path(__file__).resolve().parent / "example.jsonl"
    out = replay(example, env={**os.environ})
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_readme_example_script_passes(tmp_path):
    import re

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```jsonl\n(.*?)```", text, re.S)
    assert block, "README.md has no jsonl session script example"
    out = replay(write_script(tmp_path / "readme.jsonl", [json.loads(ln) for ln in block.group(1).splitlines()]))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("text", ["${HOME}/bin", "$${x}", "a ${b} $${c} $$$${d} $ $$ x$", "${", "$${"])
def test_dollar_dollar_brace_is_a_literal_dollar_brace_and_escape_round_trips(text):
    assert substitute(escape(text), {"b": "nope"}) == text
    assert substitute({"s": "$${b} and ${b}", "whole": "$${b}"}, {"b": 1}) == {"s": "${b} and 1", "whole": "${b}"}


def test_a_step_with_a_literal_dollar_brace_replays(tmp_path):
    steps = [{"request": "initialize"},
             {"request": "createBranch", "params": {"name": "shell $${USER}"}, "save": {"b": "branchId"}},
             {"request": "listBranches", "expect": {"result": {"branches": [{"branchId": "${b}",
                                                                             "name": "shell $${USER}"}]}}}]
    out = replay(write_script(tmp_path / "d.jsonl", steps))
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_longer_array_names_the_extra_item_not_an_internal_object():
    mm = first_mismatch({"a": [1]}, {"a": [1, {"x": 2}]})
    assert mm is not None and mm.describe() == 'at $.a[1]: expected (nothing), got {"x": 2} (expected 1 items, got 2)'


def test_every_difference_is_described_in_the_patterns_order_with_short_values():
    found = list(mismatches({"b": 1, "a": {"c": [1, 2]}, "d": "x" * 100, "e": "*", "f": 1},
                            {"a": {"c": [1, 3, 4]}, "b": True, "d": "y", "e": None}))
    assert [m.path for m in found] == ["$.b", "$.a.c[1]", "$.a.c[2]", "$.d", "$.f"]
    assert first_mismatch({"b": 1, "a": {"c": [1, 2]}}, {"a": {"c": [1, 3, 4]}, "b": True}) == found[0]
    assert describe_mismatches(found) == (
        "5 differences: at $.b: expected 1, got true (expected a number, got a boolean); at $.a.c[1]: expected 2, "
        "got 3; at $.a.c[2]: expected (nothing), got 4 (expected 2 items, got 3); at $.d: expected "
        f'"{"x" * 58}…, got "y"; at $.f: expected 1, got (missing)')
    assert describe_mismatches(found[:1]) == found[0].describe()  # one difference: as before
    assert describe_mismatches(found, shown=2).endswith("; at $.a.c[1]: expected 2, got 3; and 3 more")


def test_an_answer_that_differs_in_several_places_lists_its_differences_the_first_five_then_how_many_more(tmp_path):
    """Only the first difference was shown, so a wrong expectation took one replay per wrong value:
    every difference is listed (JSON path, expected, got) in the expectation's order, the first five,
    then how many more."""
    branch = {"branchId": "${b}", "name": "second", "messageCount": 1, "chatModel": "*", "usage": {"modelCalls": 2}}
    steps = [{"request": "initialize"},
             {"request": "createBranch", "params": {"name": "first"}, "save": {"b": "branchId"}},
             {"request": "listBranches", "expect": {"result": {"branches": [branch]}}},
             {"request": "listBranches", "expect": {"result": {"branches": [{
                 **branch, "chatModel": "m", "usage": {"inputTokens": 1, "outputTokens": 2, "modelCalls": 3},
                 "archived": True}]}}}]
    out = replay(write_script(tmp_path / "many.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    at = "at $.result.branches[0]."
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails == [
        f'FAIL line 3: request listBranches: 3 differences: {at}name: expected "second", got "first"; '
        f"{at}messageCount: expected 1, got 0; {at}usage.modelCalls: expected 2, got 0",
        f'FAIL line 4: request listBranches: 7 differences: {at}name: expected "second", got "first"; '
        f'{at}messageCount: expected 1, got 0; {at}chatModel: expected "m", got "local"; '
        f"{at}usage.inputTokens: expected 1, got 0; {at}usage.outputTokens: expected 2, got 0; and 2 more"], out.stdout


def test_a_notification_that_does_not_come_in_time_says_how_to_wait_longer_as_a_request_does(tmp_path):
    """An expectNotification that timed out named the nearest miss but not how to wait longer (a
    timed-out request did): it names the same time-out to raise, its "timeoutMs" or --timeout (only
    when that was shorter than the 10 s an expectNotification waits at most); a wait cut short
    because an earlier step failed says so instead (raising its time-out would not help)."""
    steps = [{"request": "initialize", "params": {"settings": {"models": {"m": scripted("hi")}}}, "timeoutMs": 20000},
             {"request": "createBranch", "save": {"b": "branchId"}, "timeoutMs": 20000},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "x", "skipValidation": True,
                                               "workDoneToken": "w"}, "timeoutMs": 20000},
             # (no token: it might come from anywhere, so it is waited for; with "w" it fails once the operate
             # is answered, as it cannot come any more)
             {"expectNotification": "$/progress", "match": {"value": {"kind": "nope"}}},
             {"expectNotification": "toolEvent", "timeoutMs": 200},
             {"expectNotification": "toolEvent", "timeoutMs": 5000}]
    out = replay("--timeout", "0.3", write_script(tmp_path / "late.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 3, out.stdout
    assert fails[0].startswith("FAIL line 4: expectNotification $/progress: no matching $/progress within 0.3 s; ")
    assert 'unmatched, nearest at $.params.value.kind: expected "nope", got "' in fails[0], fails[0]
    assert fails[0].endswith('"; to wait longer, give the step a "timeoutMs" (milliseconds) or run with --timeout S'), \
        fails[0]
    assert fails[1:] == [
        "FAIL line 5: expectNotification toolEvent: no toolEvent notification within 0.2 s (expected any params); "
        'to wait longer, raise the "timeoutMs" (200)',
        "FAIL line 6: expectNotification toolEvent: no toolEvent notification within 1 s (expected any params); "
        "it waited 1 s only, as an earlier step failed (the session went another way)"], out.stdout
    # with the default --timeout (60 s) an expectNotification without timeoutMs waits 10 s: only its
    # timeoutMs gives it longer
    runner = Runner(parse_script([json.dumps(steps[3])]))
    assert runner._wait_longer(runner.script.steps[0], 10) == \
        'to wait longer, give the step a "timeoutMs" (milliseconds)'


def test_failure_messages_read_well_for_extra_items_and_notifications_with_any_params(tmp_path):
    steps = [{"request": "initialize"},
             {"request": "createBranch"},
             {"request": "listBranches", "expect": {"result": {"branches": []}}},
             {"expectNotification": "toolEvent", "timeoutMs": 200}]
    out = replay(write_script(tmp_path / "x.jsonl", steps))
    assert out.returncode == 1
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 2 and "object at 0x" not in out.stdout, out.stdout
    assert fails[0].startswith("FAIL line 3: request listBranches: at $.result.branches[0]: expected (nothing), "
                               'got {"branchId": ')
    assert fails[0].endswith("(expected 0 items, got 1)")
    assert fails[1] == "FAIL line 4: expectNotification toolEvent: no toolEvent notification within 0.2 s " \
                       '(expected any params); to wait longer, raise the "timeoutMs" (200)'


def test_a_request_cancelled_after_its_model_call_started_is_cancelled_only_then(tmp_path):
    """cancelAfterModelCalls: the cancel waits until the server has started the request's model
    call; the request gets a workDoneToken of the replay's own, whose $/progress no step sees."""
    slow = scripted({"text": "never seen", "delayMs": 30000}, "done")
    steps = [{"request": "initialize", "params": {"settings": {"models": {"slow": slow}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "x", "skipValidation": True},
              "id": "op", "wait": False, "cancelAfterModelCalls": 1, "expect": {"error": {"code": -32800}}},
             {"notify": "$/cancelRequest", "params": {"id": "op"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "y", "skipValidation": True},
              "expect": {"result": {"result": "done"}}, "timeoutMs": 20000},
             {"expectNotification": "$/progress", "timeoutMs": 300}]
    out = replay(write_script(tmp_path / "c.jsonl", steps))
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails == ["FAIL line 6: expectNotification $/progress: no $/progress notification within 0.3 s "
                     '(expected any params); to wait longer, raise the "timeoutMs" (300)'], out.stdout + out.stderr
    bad = write_script(tmp_path / "b.jsonl", [{**steps[2], "id": None, "cancelAfterModelCalls": 0}])
    out = replay(bad)
    assert out.returncode == 2 and "b.jsonl:1: cancelAfterModelCalls must be a positive integer" in out.stderr


def test_a_script_that_is_not_utf8_is_refused_naming_the_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"request": "initialize"}\n{"request": "createBranch", "params": {"name": "caf\xe9"}}\n')
    out = replay(p)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "latin1.jsonl:2: not UTF-8 text" in out.stderr and not out.stdout


@pytest.mark.parametrize("seconds", ["0", "-1", "nan"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(tmp_path, seconds):
    out = replay(f"--timeout={seconds}", write_script(tmp_path / "ok.jsonl", session()[:1]))
    assert out.returncode == 2 and not out.stdout
    assert "argument --timeout: must be a positive number of seconds" in out.stderr


def test_an_unknown_step_kind_is_named(tmp_path):
    p = tmp_path / "k.jsonl"
    p.write_text('{"request": "ping"}\n{"bogus": "ping", "params": {}}\n')
    out = replay(p)
    assert out.returncode == 2
    assert ("k.jsonl:2: a step has exactly one of request, notify, expectNotification, respond, await "
            "(found none; its key(s): bogus, params)") in out.stderr


def test_help_texts_name_replay_and_its_server_argv():
    main = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "--help"], capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert main.returncode == 0 and "operate-sidecar replay" in main.stdout
    assert "SQLite" in main.stdout and "journal" not in main.stdout
    sub = replay("--help")
    assert sub.returncode == 0
    assert sub.stdout.startswith("usage: operate-sidecar replay ") and "[-- SERVER ARGV...]" in sub.stdout


def test_a_script_saved_by_a_windows_editor_replays(tmp_path):
    """A UTF-8 byte-order mark (Notepad, PowerShell's ``Out-File -Encoding utf8``), CRLF line
    ends and non-ASCII text: the script runs (the mark was "line 1: not JSON: Unexpected UTF-8
    BOM"); a text that is not UTF-8 after the mark is still refused naming its line."""
    steps = session()
    steps[2]["params"]["name"] = "première ☃"
    steps[5]["expect"]["result"]["branches"][0]["name"] = "première ☃"
    p = tmp_path / "windows.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(s, ensure_ascii=False) + "\r\n" for s in steps).encode())
    out = replay(p)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "all 7 steps passed (windows.jsonl)"
    p.write_bytes(b'\xef\xbb\xbf{"request": "initialize"}\r\n{"request": "ping", "id": "caf\xe9"}\r\n')
    out = replay(p)
    assert out.returncode == 2 and "windows.jsonl:2: not UTF-8 text" in out.stderr, out.stderr


def test_a_request_reusing_the_id_of_one_still_in_flight_is_refused_before_anything_runs(tmp_path):
    """Two requests in flight with one id (a line copied without changing its ``id``): refused
    naming both lines (the server was sent both; the first never got its answer, and its step
    failed "no answer" only after the whole time-out)."""
    p = tmp_path / "dup.jsonl"
    p.write_text('{"request": "initialize"}\n{"request": "ping", "id": 1, "wait": false}\n'
                 '{"request": "ping", "id": 1}\n')
    out = replay("--timeout", "30", p)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert ("dup.jsonl:3: id 1 is the id of the request of line 2, still in flight (not awaited yet); "
            "give this one another id") in out.stderr, out.stderr


def test_a_server_that_dies_during_a_request_fails_its_step_even_when_an_error_is_expected(tmp_path):
    """The server killed while it works on a request: the step fails saying so (it passed when it
    expected an error, matched by the client's own "the server closed its output" -32099, and
    failed otherwise as if the server had answered that error)."""
    die = {"provider": "cli", "profile": "jsonl",
           "command": [sys.executable, "-c", "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"]}
    op = {"branchId": "${b}", "instruction": "x", "skipValidation": True}
    steps = [{"request": "initialize", "params": {"settings": {"models": {"die": die}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": op, "expect": {"error": {"code": "*"}}},
             {"request": "listBranches"}]
    out = replay(write_script(tmp_path / "die.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails == ["FAIL line 3: request operate: the server exited (code -9) without answering",
                     "FAIL line 4: request listBranches: the server has exited (code -9)"], out.stdout


def weather_asked() -> tuple[dict, list[dict]]:
    """An operate whose model calls get_weather twice (policy ``ask``: a permission request each
    time), and the steps up to it: initialize with permissions, createBranch saved as ``b``."""
    ask = {"json": {"answer": "4", "action_requests": [{"function": "get_weather", "arguments": {"city": "Lima"}}]}}
    op = {"branchId": "${b}", "instruction": "weather?", "responseFormat": ANSWER, "actions": True}
    return op, [{"request": "initialize", "params": {"capabilities": PERM, "settings": {
                    "models": {"m": scripted(ask, ask)}, "toolModules": ["operate_sidecar.clients.python.demo_tools"],
                    "toolPolicy": {"get_weather": "ask"}}}},
                {"request": "createBranch", "save": {"b": "branchId"}}]


def test_a_server_request_the_script_does_not_answer_fails_the_step_it_came_during(tmp_path):
    """A permission request with no ``respond`` line (or none whose ``match`` fits) was answered
    -32601 in silence: the tool was refused and the script passed all the same when its ``expect``
    did not look at the tool's output. Now the step it came during fails, naming the request and
    the line to add."""
    op, steps = weather_asked()
    steps += [{"request": "operate", "params": op, "expect": {"result": {"result": {"answer": "4"}}}},
              {"respond": "requestToolPermission", "match": {"tool": "other"}, "result": {"decision": "allow_once"}},
              {"request": "operate", "params": op, "expect": {"result": {"result": {"answer": "4"}}}},
              {"request": "listBranches"}]
    out = replay(write_script(tmp_path / "ask.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 2, out.stdout
    assert fails[0].startswith('FAIL line 3: request operate: the server asked requestToolPermission {"arguments": '
                               '{"city": "Lima"}, "branchId": '), fails[0]
    assert fails[0].endswith('"tool": "get_weather"} and no respond line answers it, so it was refused (-32601); '
                             'add a line {"respond": "requestToolPermission", "result": ...} before line 3'), fails[0]
    assert fails[1].startswith("FAIL line 5: request operate: the server asked requestToolPermission "), fails[1]
    assert ("and no respond line's match fits it (nearest: line 4's, at $.params.tool: expected \"other\", got "
            "\"get_weather\"), so it was refused (-32601); fix the match of line 4, or add a line") in fails[1], fails[1]
    assert "2 of 6 steps failed (ask.jsonl); first: line 3: request operate" in out.stdout


@pytest.mark.parametrize("text, problem", [
    ('{\n  "request": "initialize"\n}\n',
     "x.jsonl:1: not JSON: the line ends inside a JSON value; each step must be one whole JSON object on one line "
     "(JSON Lines: a pretty-printed, multi-line object is not; write each step with json.dumps(), or jq -c)"),
    ('[{"request": "initialize"}, {"request": "ping"}]\n',
     'x.jsonl:1: a step must be a JSON object, got [{"request": "initialize"}, {"request": "ping"}]; a JSON array '
     "of steps is not a script: write each step on a line of its own"),
    ('{"request": "initialize"}\n# then ping\n{"request": "ping"}\n',
     "x.jsonl:2: not JSON: a session script has no comments (JSON Lines: one JSON object per line, nothing else)"),
    ('{"request": "initialize"},\n{"request": "ping"}\n',
     "x.jsonl:1: not JSON: a comma after the step; JSON Lines have nothing between the lines' objects"),
    ("{'request': 'initialize'}\n", "x.jsonl:1: not JSON: Expecting property name enclosed in double quotes at column 2"),
    ("", "x.jsonl: no steps: a session script has at least one step (one JSON object per line)"),
    ('\n{"recordedModels": {}}\n', "x.jsonl: no steps: a session script has at least one step"),
])
def test_a_file_that_is_not_a_json_lines_script_is_refused_saying_what_to_write(tmp_path, text, problem):
    """The usual ways a hand-written script is not JSON Lines, each in words (a pretty-printed step
    was "line 1: not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char
    1)"); a script with no step is refused (it passed "all 0 steps", having checked nothing)."""
    p = tmp_path / "x.jsonl"
    p.write_text(text)
    out = replay(p)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert problem in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_request_not_answered_in_time_is_cancelled_and_says_how_to_give_it_longer(tmp_path):
    """A request that timed out said only "no answer within 3 s" (not which time-out to raise) and
    was left running on the server (it held the branch, and delayed the end of the replay). Now
    it is cancelled with $/cancelRequest, and the failure names the time-out to raise: the step's
    own timeoutMs, the await's, or --timeout. The last operate, on the same branch (operates on
    a branch run one at a time), gets its answer only because the three before it were cancelled
    (each would have run 30 s)."""
    slow = {"text": "slow", "delayMs": 30000}
    models = {"slow": scripted(slow, slow, slow), "quick": scripted("done")}

    def op(model: str, **step) -> dict:
        return {"request": "operate", "params": {"branchId": "${b}", "instruction": "x", "skipValidation": True,
                                                 "chatModel": model}, **step}

    steps = [{"request": "initialize", "params": {"settings": {"models": models}}, "timeoutMs": 20000},
             {"request": "createBranch", "save": {"b": "branchId"}, "timeoutMs": 20000},
             op("slow"),
             op("slow", timeoutMs=300),
             op("slow", id="w", wait=False),
             {"await": "w", "timeoutMs": 300},
             op("quick", expect={"result": {"result": "done"}}, timeoutMs=20000)]
    out = replay("--timeout", "0.3", write_script(tmp_path / "slow.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    cancelled = "so it was cancelled ($/cancelRequest); to wait longer,"
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails == [f'FAIL line 3: request operate: no answer within 0.3 s, {cancelled} give the step a "timeoutMs" '
                     "(milliseconds) or run with --timeout S",
                     f'FAIL line 4: request operate: no answer within 0.3 s, {cancelled} raise the "timeoutMs" (300)',
                     f'FAIL line 5: request operate: no answer within 0.3 s, {cancelled} raise the "timeoutMs" (300) '
                     "of line 6",
                     'FAIL line 6: await "w": line 5 failed'], out.stdout
    assert "PASS line 7: request operate: result matched" in out.stdout, out.stdout


def test_a_notification_matched_by_earlier_steps_is_named_when_a_later_step_waits_for_it(tmp_path):
    """"no toolEvent notification within 0.3 s" was all a step said when the notifications it
    waited for had come but earlier steps had matched them: it names them (with the lines of
    the steps that matched them), and when none of them matches, the nearest one's first
    difference."""
    call = {"json": {"answer": "4", "action_requests": [{"function": "get_weather", "arguments": {"city": "Lima"}}]}}
    steps = [{"request": "initialize", "params": {"settings": {
                 "models": {"m": scripted(call)}, "toolModules": ["operate_sidecar.clients.python.demo_tools"]}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "weather?", "responseFormat": ANSWER,
                                               "actions": True, "workDoneToken": "w"}},
             {"expectNotification": "toolEvent", "match": {"event": "pre"}},
             {"expectNotification": "toolEvent", "match": {"event": "post"}},
             {"expectNotification": "toolEvent", "match": {"event": "post"}, "timeoutMs": 300},
             {"expectNotification": "toolEvent", "timeoutMs": 300},
             {"expectNotification": "toolEvent", "match": {"event": "denied"}, "timeoutMs": 300},
             {"expectNotification": "$/progress", "match": {"token": "w", "value": {"kind": "end"}}},
             {"expectNotification": "$/progress", "match": {"value": {"kind": "end"}}, "timeoutMs": 300}]
    out = replay(write_script(tmp_path / "n.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    longer = '; to wait longer, raise the "timeoutMs" (300)'
    assert fails[:3] == [
        'FAIL line 6: expectNotification toolEvent: no toolEvent notification within 0.3 s (expected {"event": "post"}); '
        "1 that matches arrived but was matched by an earlier step (line 5)" + longer,
        "FAIL line 7: expectNotification toolEvent: no toolEvent notification within 0.3 s (expected any params); "
        "2 arrived, all matched by earlier steps (lines 4, 5)" + longer,
        "FAIL line 8: expectNotification toolEvent: no toolEvent notification within 0.3 s (expected "
        '{"event": "denied"}); 2 arrived, all matched by earlier steps (lines 4, 5); nearest at $.params.event: '
        'expected "denied", got "post"' + longer], out.stdout
    assert len(fails) == 4 and fails[3].startswith("FAIL line 10: expectNotification $/progress: no matching "
                                                   "$/progress within 0.3 s; "), out.stdout
    assert fails[3].endswith("; 1 that matches arrived but was matched by an earlier step (line 9)" + longer), fails[3]
    assert "unmatched, nearest at $.params.value.kind: expected \"end\", got " in fails[3], fails[3]


@pytest.mark.parametrize("text, problem", [
    ('{"reqest": "initialize"}\n', "a step has exactly one of request, notify, expectNotification, respond, await "
                                   "(found none; its key(s): reqest); did you mean request?"),
    ('{"expectNotificaton": "toolEvent", "match": {}}\n', "a step has exactly one of request, notify, expectNotification, "
     "respond, await (found none; its key(s): expectNotificaton, match); did you mean expectNotification?"),
    ('{"request": "initialize", "expcet": {}, "timeout": 3, "typo": 1}\n',
     "unknown field(s) for a request step: expcet (did you mean expect?), timeout (did you mean timeoutMs?), typo"),
    ('{"respond": "requestToolPermission", "reslt": {}}\n',
     "unknown field(s) for a respond step: reslt (did you mean result?)"),
])
def test_a_misspelt_step_kind_or_field_is_named_with_the_name_it_is_closest_to(tmp_path, text, problem):
    p = tmp_path / "x.jsonl"
    p.write_text(text)
    out = replay(p)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert f"x.jsonl:1: {problem}" in out.stderr, out.stderr


def test_a_missing_or_unreadable_script_is_said_in_words_with_where_it_was_looked_for(tmp_path):
    """It was "[Errno 2] No such file or directory: 'missing.jsonl'"; the path as given, where a
    relative one is (from the working directory), and exit 2."""
    (tmp_path / "sub").mkdir()
    for given, problem in [
            ("missing.jsonl", f"no session script 'missing.jsonl' ({tmp_path}/missing.jsonl: a relative path is "
                              f"from the working directory, {tmp_path})"),
            (f"{tmp_path}/no/x.jsonl", f"no session script '{tmp_path}/no/x.jsonl'"),
            ("sub", f"cannot read the session script 'sub' ({tmp_path}/sub: a relative path is from the working "
                    f"directory, {tmp_path}): it is a directory, not a file")]:
        out = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "replay", given], cwd=tmp_path,
                             capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
        assert out.stderr == f"operate-sidecar replay: {problem}\n", out.stderr


@pytest.mark.parametrize("lines, problem", [
    (['{"request": "initialize"}', '{"request": "createBranch", "save": {"branch": "branchId"}}',
      '{"request": "deleteBranch", "params": {"branchId": "${brnach}"}}'],
     'x.jsonl:3: ${brnach} is not saved by an earlier line (did you mean ${branch}?); names it may use: branch, cwd '
     '(a step\'s "save" names a value; $${brnach} is the text ${brnach} itself)'),
    (['{"request": "deleteBranch", "params": {"branchId": "id-${b}"}}',
      '{"request": "createBranch", "save": {"b": "branchId"}}'],
     "x.jsonl:1: ${b} is not saved by an earlier line; names it may use: cwd (a step's \"save\" names a value; "
     "$${b} is the text ${b} itself)"),
])
def test_a_reference_no_earlier_line_saves_is_refused_before_anything_runs(tmp_path, lines, problem):
    """A misspelt ``${name}`` (or one saved only on a later line) was found only while the server
    ran, as "${brnach} was never saved" with no hint: now the script is refused at once, with the
    name it is closest to and the names the line may use."""
    p = tmp_path / "x.jsonl"
    p.write_text("\n".join(lines) + "\n")
    out = replay(p)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert out.stderr.startswith("operate-sidecar replay: ") and out.stderr.endswith(f"/{problem}\n"), out.stderr


@pytest.mark.parametrize("error", ['"no"', '{"code": "x", "message": "m"}', '{"code": -1, "mesage": "m"}',
                                   '{"message": "m"}'])
def test_a_respond_error_that_is_not_a_json_rpc_error_is_refused_before_anything_runs(tmp_path, error):
    """``{"respond": ..., "error": "no"}`` passed and answered the server some other error than
    written (and a code that is not a number broke the answering thread): refused now, saying what
    an error is."""
    p = tmp_path / "x.jsonl"
    p.write_text('{"respond": "requestToolPermission", "error": ' + error + '}\n')
    out = replay(p)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert ('x.jsonl:1: a respond error is a JSON-RPC error, {"code": integer, "message": "text", "data"?: any}, got '
            in out.stderr), out.stderr


def test_a_value_not_saved_because_its_step_failed_names_that_step(tmp_path):
    """It said "${b} was never saved" alone, though the line that saves it had failed just above."""
    p = write_script(tmp_path / "x.jsonl", [
        {"request": "initialize"},
        {"request": "createBranch", "save": {"b": "branch_id"}},
        {"request": "deleteBranch", "params": {"branchId": "${b}"}}])
    out = replay(p)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL line 2: request createBranch: save b: $ has no 'branch_id'" in out.stdout, out.stdout
    assert "FAIL line 3: request deleteBranch: ${b} was never saved: line 2, which saves it, failed\n" in out.stdout


def test_server_flags_after_double_dash_without_the_command_say_how_to_write_it(tmp_path):
    """``replay s.jsonl -- --config settings.toml`` said only "No such file or directory:
    '--config'"."""
    script = write_script(tmp_path / "s.jsonl", [{"request": "initialize"}])
    out = replay(script, "--", "--config", "settings.toml")
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert ("cannot start the server '--config settings.toml': [Errno 2] No such file or directory: '--config'; "
            "the server command starts with its program, then its flags: operate-sidecar --config settings.toml "
            "after --, or server_command('--config', 'settings.toml') from operate_sidecar.testing in a test\n"
            in out.stderr), out.stderr


def test_a_working_directory_that_does_not_exist_is_named_not_the_server_command(tmp_path):
    """``run_session_script(..., cwd=missing)`` said "cannot start the server '.../python -m
    operate_sidecar.server': [Errno 2] No such file or directory: '<cwd>'", as if the server were
    missing."""
    from operate_sidecar.server.script.runner import ServerStartError
    from operate_sidecar.testing import run_session_script

    script = write_script(tmp_path / "s.jsonl", [{"request": "initialize"}])
    with pytest.raises(ServerStartError) as e:
        run_session_script(script, cwd=str(tmp_path / "gone"))
    assert str(e.value) == (f"cannot start the server in '{tmp_path}/gone': no such directory (the working "
                            "directory given for the server)"), e.value


@pytest.mark.parametrize("step, problem", [
    ({"expectNotification": "toolEvent", "match": 5},
     "match must be a JSON object, a pattern for the notification's params (the keys it names must match; "
     "leave match out for any params), got 5"),
    ({"expectNotification": "toolEvent", "match": "pre"},
     "match must be a JSON object, a pattern for the notification's params (the keys it names must match; "
     'leave match out for any params), got "pre"'),
    ({"expectNotification": "toolEvent", "match": [{"event": "pre"}]},
     "match must be a JSON object, a pattern for the notification's params (the keys it names must match; "
     'leave match out for any params), got [{"event": "pre"}]'),
    ({"expectNotification": "toolEvent", "match": None},
     "match must be a JSON object, a pattern for the notification's params (the keys it names must match; "
     "leave match out for any params), got null"),
    ({"respond": "requestToolPermission", "match": "get_weather", "result": {"decision": "allow_once"}},
     "match must be a JSON object, a pattern for the request's params (the keys it names must match; "
     'leave match out to answer every requestToolPermission), got "get_weather"'),
    ({"respond": "requestToolPermission", "result": "allow_once"},
     'a respond result must be a JSON object, the result the client answers with (requestToolPermission: '
     '{"decision": "allow_once"}), got "allow_once"'),
    ({"request": "listBranches", "params": 5},
     "params must be a JSON object, the request's named parameters (leave params out for none), got 5"),
    ({"notify": "initialized", "params": "x"},
     'params must be a JSON object, the notification\'s named parameters (leave params out for none), got "x"'),
    ({"request": "deleteBranch", "params": {"branchId": "nope"}, "expect": {"error": -32012}},
     'expect\'s error must be a JSON object, a pattern for the error answer ({"code": -32012}; "*" for any '
     "error), got -32012"),
    ({"request": "ping", "id": [1]}, "id must be a string or an integer (the request's JSON-RPC id), got [1]"),
    ({"request": "ping", "id": True}, "id must be a string or an integer (the request's JSON-RPC id), got true"),
    ({"request": "ping", "id": 1, "wait": "no"}, 'wait must be true or false, got "no"'),
    ({"request": "createBranch", "save": {"my branch": "branchId"}},
     "save names a value that a later ${name} refers to: letters, digits, _, . and -, starting with a letter "
     "or _, got 'my branch'"),
])
def test_a_step_field_of_the_wrong_type_is_refused_before_anything_runs(tmp_path, step, problem):
    """``"match": 5`` (a string, a list) was accepted and could only time out: no notification's
    params are 5. Every field the protocol says is an object (``match``, ``params``, a respond's
    ``result``, an expected ``error``), an ``id``, ``wait`` and the names ``save`` gives are
    checked when the script loads, as the other malformed lines are: exit 2, the line named."""
    p = write_script(tmp_path / "x.jsonl", [{"request": "initialize"}, step])
    out = replay(p)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert out.stderr == f"operate-sidecar replay: {p}:2: {problem}\n", out.stderr


PERMISSION_SHAPE = '{"decision": one of "allow_always", "allow_once", "deny_always", "deny_once"}'


@pytest.mark.parametrize("step, problem", [
    ({"respond": "fs/readTextFile", "result": {"content": "hello"}},
     'a respond result for fs/readTextFile must be {"text": string}, as docs/PROTOCOL.md declares it, got '
     '{"content": "hello"}: result.content: unknown field; result.text: missing'),
    ({"respond": "fs/readTextFile", "match": {"path": "${cwd}/a.txt"}, "result": {"text": 3}},
     'a respond result for fs/readTextFile must be {"text": string}, as docs/PROTOCOL.md declares it, got '
     '{"text": 3}: result.text: expected string, got integer 3'),
    ({"respond": "fs/readTextFile", "result": None},
     'a respond result for fs/readTextFile must be {"text": string}, as docs/PROTOCOL.md declares it, got null: '
     'result.text: missing'),
    ({"respond": "fs/writeTextFile", "result": "done"},
     'a respond result must be a JSON object, the result the client answers with (requestToolPermission: '
     '{"decision": "allow_once"}), got "done"'),
    ({"respond": "invokeClientTool", "match": {"tool": "lookup"}, "result": {"result": {"rows": 2}}},
     'a respond result for invokeClientTool must be {"output": any JSON value}, as docs/PROTOCOL.md declares it, '
     'got {"result": {"rows": 2}}: result.result: unknown field; result.output: missing'),
    ({"respond": "requestToolPermission", "result": {"decision": "allow"}},
     f'a respond result for requestToolPermission must be {PERMISSION_SHAPE}, as docs/PROTOCOL.md declares it, got '
     '{"decision": "allow"}: result.decision: expected one of "allow_always", "allow_once", "deny_always", '
     '"deny_once", got string "allow"'),
    ({"respond": "requestToolPermission", "result": {"decison": "allow_once"}},
     f'a respond result for requestToolPermission must be {PERMISSION_SHAPE}, as docs/PROTOCOL.md declares it, got '
     '{"decison": "allow_once"}: result.decison: unknown field (did you mean decision?); result.decision: missing'),
    ({"respond": "requestToolPermission", "result": {"allow": True}},
     f'a respond result for requestToolPermission must be {PERMISSION_SHAPE}, as docs/PROTOCOL.md declares it, got '
     '{"allow": true}: result.allow: unknown field; result.decision: missing'),
    ({"respond": "requestToolPermission", "result": {"decision": "$${d}"}},  # $${ is the text ${: no reference
     f'a respond result for requestToolPermission must be {PERMISSION_SHAPE}, as docs/PROTOCOL.md declares it, got '
     '{"decision": "$${d}"}: result.decision: expected one of "allow_always", "allow_once", "deny_always", '
     '"deny_once", got string "${d}"'),
])
def test_a_respond_result_of_another_shape_than_the_protocol_declares_is_refused_before_anything_runs(
        tmp_path, step, problem):
    """``{"respond": "fs/readTextFile", "result": {"content": ...}}`` was sent as written: the
    server took it as a failed read (a tool error), and the script tested that path while its
    author meant a read. Every respond result is now held, when the script loads, to the result
    protocol/ declares for that request: exit 2, the line, the field and the shape named."""
    p = write_script(tmp_path / "x.jsonl", [{"request": "initialize"}, step])
    out = replay(p)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert out.stderr == f"operate-sidecar replay: {p}:2: {problem}\n", out.stderr


def test_a_respond_result_is_checked_only_where_no_saved_value_stands():
    """What a ``${name}`` will be is known only once its line runs: a lone ``"${name}"`` may be
    of any type, a longer string is a string. A result that fits, the null a client answers
    fs/writeTextFile with (as --record writes it), a field the server ignores beside the ones it
    needs (a client's answer recorded as it came), and an error answer are taken."""
    script = parse_script([json.dumps(s) for s in [
        {"request": "initialize", "save": {"caps": "capabilities", "v": "protocolVersion"}},
        {"respond": "requestToolPermission", "result": {"decision": "${v}"}},
        {"respond": "requestToolPermission", "match": {"tool": "x"}, "result": {"decision": "allow_${v}"}},
        {"respond": "requestToolPermission", "match": {"tool": "y"}, "result": "${caps}"},
        {"respond": "requestToolPermission", "match": {"tool": "z"}, "result": {"decision": "deny_always"}},
        {"respond": "fs/readTextFile", "result": {"text": "${v}"}},
        {"respond": "fs/readTextFile", "match": {"path": "${cwd}/a"}, "result": {"text": "at ${cwd}: $${x}"}},
        {"respond": "invokeClientTool", "result": {"output": "${caps}"}},
        {"respond": "invokeClientTool", "match": {"tool": "n"}, "result": {"output": None}},
        {"respond": "fs/writeTextFile", "result": {}},
        {"respond": "fs/writeTextFile", "match": {"path": "${cwd}/a"}, "result": None},
        {"respond": "fs/writeTextFile", "match": {"path": "${cwd}/c"}, "result": {"written": True}},
        {"respond": "fs/writeTextFile", "match": {"path": "${cwd}/b"}, "error": {"code": -32000, "message": "no"}}]])
    assert [s.kind for s in script.steps] == ["request"] + ["respond"] * 12


def test_every_request_the_replay_answers_has_its_result_declared_in_protocol():
    """The shapes are protocol/'s own (its method table and declarations), not a copy: each
    server-to-client request a respond line answers has one, and a result it does not declare
    is refused naming the field."""
    from operate_sidecar.protocol import SERVER_TO_CLIENT_REQUESTS
    from operate_sidecar.protocol.methods import CLIENT_REQUESTS
    from operate_sidecar.server.script.runner import ScriptError

    from operate_sidecar.protocol.convert import wire_fields

    assert set(CLIENT_REQUESTS) == set(SERVER_TO_CLIENT_REQUESTS)
    for method in CLIENT_REQUESTS:
        required = [f.key for f in wire_fields(SERVER_TO_CLIENT_REQUESTS[method][1]) if f.required]
        if not required:  # (fs/writeTextFile: {}) a field the server ignores is taken
            assert parse_script([json.dumps({"respond": method, "result": {"surely": 1}})], "x").steps
            continue
        with pytest.raises(ScriptError, match=rf"^x:1: a respond result for {method} must be {{.*, as docs/PROTOCOL.md "
                                               rf"declares it, got {{\"surely\": 1}}: result.surely: unknown field; "
                                               rf"result.{required[0]}: missing"):
            parse_script([json.dumps({"respond": method, "result": {"surely": 1}})], "x")


def test_patterns_that_match_anything_and_whole_references_are_still_taken():
    """``"*"`` is a pattern (any value), and ``"${name}"`` alone is the saved value itself (any
    JSON type): both stand where an object is asked for."""
    script = parse_script([json.dumps(s) for s in [
        {"request": "initialize", "save": {"caps": "capabilities", "v": "protocolVersion"}},
        {"expectNotification": "toolEvent", "match": "*"},
        {"respond": "requestToolPermission", "match": "*", "result": {"decision": "deny_once"}},
        {"request": "deleteBranch", "params": {"branchId": "x"}, "expect": {"error": "*"}},
        {"notify": "initialized", "params": "${caps}"},
        {"respond": "fs/readTextFile", "match": "${caps}", "result": "${caps}"},
        {"request": "ping", "id": "a-1", "wait": False},
        {"await": "a-1"},
        {"request": "listBranches", "params": [1], "expect": {"error": {"code": -32602}}},  # JSON-RPC allows it
        {"respond": "fs/writeTextFile", "result": None}]])  # as --record writes a client's null result
    assert [s.kind for s in script.steps] == ["request", "expectNotification", "respond", "request", "notify",
                                              "respond", "request", "await", "request", "respond"]


def test_a_whole_reference_that_is_not_an_object_where_one_is_asked_for_fails_its_step(tmp_path):
    """The load-time check cannot know what ``"${v}"`` will be: the step itself says it, once substituted."""
    p = write_script(tmp_path / "x.jsonl", [
        {"request": "initialize", "save": {"v": "protocolVersion"}},
        {"notify": "initialized", "params": "${v}"},
        {"request": "listBranches"}])
    out = replay(p)
    assert out.returncode == 1, out.stdout + out.stderr
    assert ("FAIL line 2: notify initialized: params must be a JSON object, the notification's named parameters "
            "(leave params out for none), got 1 (the value of ${v})\n") in out.stdout, out.stdout
    assert "PASS line 3: request listBranches" in out.stdout, out.stdout


def given_once_substituted(initialize: dict, answer: dict | str) -> dict | str:
    """``answer`` as a respond line gives it once its ``${name}`` is substituted: a decision the
    protocol does not know, written in the script, is refused when the script loads; given by a
    saved value it is known only when the line runs. The value is the name of a spare model
    that ``initialize`` configures, saved from its answer (``capabilities.models``, in the
    order configured); a whole answer (a string) is the saved value of that path itself."""
    if isinstance(answer, str):  # "capabilities": the saved object itself
        initialize["save"] = {**initialize.get("save", {}), "given": answer}
        return "${given}"
    settings = initialize["params"]["settings"]
    settings["models"] = {**settings["models"], answer["decision"]: scripted()}
    initialize["save"] = {**initialize.get("save", {}), "given": f"capabilities.models.{len(settings['models']) - 1}"}
    return {**answer, "decision": "${given}"}


@pytest.mark.parametrize("answer, said", [
    ({"decision": "allow"}, 'decision "allow"'),
    ({"decision": "ALLOW_ONCE"}, 'decision "ALLOW_ONCE"'),
    ("capabilities", 'no decision ({"methods": ["initialize", "ping", "shutdown", "createBranc…)'),
])
def test_a_permission_answer_the_request_did_not_offer_fails_the_step_it_came_during(tmp_path, answer, said):
    """``{"decision": "allow"}`` passed in silence: the server took it as a deny ("invalid
    permission answer") and a script whose ``expect`` did not look at the tool's output tested the
    deny path while its author meant allow. Now the step that was running fails, naming the
    decision given, those offered and the respond line that gave it. (Written in the script such
    an answer is refused when it loads; a ``${name}`` is known only when its line runs.)"""
    op, steps = weather_asked()
    steps += [{"respond": "requestToolPermission", "result": given_once_substituted(steps[0], answer)},
              {"request": "operate", "params": op, "expect": {"result": {"result": {"answer": "4"}}}},
              {"respond": "requestToolPermission", "result": {"decision": "allow_once"}},
              {"request": "operate", "params": op, "expect": {"result": {"result": {"answer": "4", "action_responses": [
                  {"output": {"city": "Lima"}}]}}}}]
    out = replay(write_script(tmp_path / "perm.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails == [
        f'FAIL line 4: request operate: line 3 answered requestToolPermission (tool get_weather) with {said}, '
        'not one of the decisions it offered: allow_once, allow_always, deny_once, deny_always; the server took '
        'it as a deny (to deny, answer "deny_once" or an error)'], out.stdout
    assert "PASS line 6: request operate" in out.stdout, out.stdout


def test_any_script_text_loads_or_is_refused_with_a_script_error_naming_its_line():
    """Whatever a script file holds (JSON or not, steps of every kind with fields of any type,
    references, saved names), loading it gives its steps or a ScriptError (``file:line: ...``,
    what the command line prints), never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from operate_sidecar.server.script.runner import _STEP_KEYS, STEP_KINDS, ScriptError

    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8) | \
        st.sampled_from(["*", "${a}", "${cwd}", "$${x}", "x ${a} y", "${", "requestToolPermission",
                         "fs/readTextFile", "operate", "result.branchId", ""])
    values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(
        st.sampled_from(["result", "error", "decision", "text", "code", "message", "output", "x"]) | st.text(max_size=4),
        ch, max_size=3), max_leaves=8)
    keys = sorted({k for ks in _STEP_KEYS.values() for k in ks} | {"recordedModels", "extra"})
    steps = st.tuples(st.sampled_from(STEP_KINDS), values, st.dictionaries(st.sampled_from(keys), values, max_size=4)).map(
        lambda t: {t[0]: t[1], **t[2]})  # a step of one kind (or of two, when the fields name another)
    lines = st.lists(st.one_of(steps.map(json.dumps), values.map(json.dumps), st.text(max_size=20)), max_size=6)

    @settings(max_examples=400, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(lines)
    def load(texts):
        try:
            parse_script(texts, "s.jsonl")
        except ScriptError as e:
            assert str(e).startswith("s.jsonl"), e

    load()
