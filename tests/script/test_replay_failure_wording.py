"""What a failing replay says, as a reader of the report meets it: requests named by their
script lines (never by the JSON-RPC ids the replay gave them), JSON types with their articles,
a malformed ``recordedModels`` line refused when the script loads, with file and line, and a
``--scripted`` replay of a script with no recording naming the file. Real servers over real pipes
where it is end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay import replay, scripted, write_script  # noqa: E402

from operate_sidecar.server.script.matcher import first_mismatch  # noqa: E402
from operate_sidecar.server.script.runner import ScriptError, parse_script  # noqa: E402


def fails(out) -> list[str]:
    return [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]


@pytest.mark.parametrize("kind", ["$/progress", "toolEvent"])
def test_a_notification_that_can_no_longer_come_names_the_requests_it_waited_on_by_their_lines(tmp_path, kind):
    """It said ``the request whose workDoneToken it names (3) was answered without it``: 3 was the
    JSON-RPC id the replay gave the operate, which stood on line 4 (a respond line before it).
    Every other message points at a script line; so does this one now."""
    steps = [{"request": "initialize", "params": {"settings": {"models": {"m": scripted("one", "two")}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"respond": "requestToolPermission", "result": {"decision": "deny_once"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "x", "skipValidation": True,
                                               "workDoneToken": "t"}}]
    if kind == "$/progress":
        steps.append({"expectNotification": "$/progress", "match": {"token": "t", "value": {"kind": "nope"}}})
        why = "the request whose workDoneToken it names (the operate on line 4) was answered without it"
    else:  # two operates on the branch, each answered with a result
        steps += [{"request": "operate", "params": {"branchId": "${b}", "instruction": "y", "skipValidation": True}},
                  {"expectNotification": "toolEvent", "match": {"branchId": "${b}", "event": "never"}}]
        why = "the operates on the branch it names (lines 4, 5) were answered without it"
    out = replay("--quiet", write_script(tmp_path / "s.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    (failed,) = fails(out)
    assert failed.startswith(f"FAIL line {len(steps)}: expectNotification {kind}: no "), failed
    assert failed.endswith(f"; it cannot come any more: {why}"), failed


def test_a_cancel_that_waited_in_vain_for_its_requests_model_calls_names_the_request_by_its_line(tmp_path):
    """A recorded cancel (``cancelAfterModelCalls``) whose request had not started as many model
    calls in time names that request by its line, its id (the script's own) beside it."""
    # (the set-up steps get room of their own: on a loaded machine the first createBranch,
    # which loads the core, took over the 1 s the cancel below is given)
    steps = [{"request": "initialize", "timeoutMs": 60000, "params": {"settings": {"models": {"m": scripted(
                 {"text": "slow", "delayMs": 20000})}}}},
             {"request": "createBranch", "timeoutMs": 60000, "save": {"b": "branchId"}},
             {"respond": "requestToolPermission", "result": {"decision": "deny_once"}},
             {"request": "operate", "id": 7, "wait": False, "cancelAfterModelCalls": 2,
              "params": {"branchId": "${b}", "instruction": "x", "skipValidation": True},
              "expect": {"error": {"code": -32800}}},
             {"notify": "$/cancelRequest", "params": {"id": 7}}]
    out = replay("--timeout", "1", write_script(tmp_path / "c.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    assert fails(out) == ["FAIL line 5: notify $/cancelRequest: the request of line 4 (id 7) had started 1 of the 2 "
                          "model invocation(s) it had started when recorded within 1 s; cancelled anyway"], out.stdout


@pytest.mark.parametrize("pattern, value, why", [
    ("x", {}, "expected a string, got an object"),
    ({"a": 1}, [1], "expected an object, got an array"),
    ([1], "s", "expected an array, got a string"),
    ("x", None, "expected a string, got null"),
    (None, 1, "expected null, got a number"),
    ({}, True, "expected an object, got a boolean"),
])
def test_a_difference_of_type_names_both_types_with_their_articles(pattern, value, why):
    """It said ``expected a string, got a object`` (and ``expected an object, got string``)."""
    mm = first_mismatch(pattern, value)
    assert mm is not None and mm.why == why


def test_a_difference_of_type_reads_well_in_the_replay(tmp_path):
    out = replay(write_script(tmp_path / "t.jsonl", [{"request": "ping", "expect": {"result": "pong"}}]))
    assert out.returncode == 1, out.stdout + out.stderr
    assert fails(out) == ['FAIL line 1: request ping: at $.result: expected "pong", got {} '
                          "(expected a string, got an object)"], out.stdout


INIT = {"request": "initialize", "params": {"settings": {"models": {"m": scripted("live")}}}}


def test_a_malformed_recorded_model_turn_is_refused_when_the_script_loads_naming_file_line_and_turn(tmp_path):
    """A ``recordedModels`` turn with ``txt`` for ``text`` loaded; under ``--scripted``
    ``initialize`` failed -32602 naming ``responses[2]`` (which model, which line?) and every
    later step failed with it. It is refused before anything runs, as any malformed field is."""
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in [
        INIT, {"request": "createBranch"},
        {"recordedModels": {"m": {"responses": ["a", {"text": "b"}, {"txt": "c"}]}}}]))
    for args in (["--scripted", path], [path]):
        out = replay(*args)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stdout == "", out.stdout
        assert out.stderr.startswith(f"operate-sidecar replay: {path}:3: recordedModels.m.responses[2]: "
                                     "unknown field 'txt' (accepts: "), out.stderr


@pytest.mark.parametrize("recorded, problem", [
    (["a"], 'recordedModels.m must be an object, {"responses": [the model\'s turns], "cli"?: true, '
            '"inline"?: {...}}, got ["a"]'),
    ({"respones": ["a"]}, "recordedModels.m: unknown field(s) respones (did you mean responses?)"),
    ({"responses": "a"}, "recordedModels.m.responses must be a list, not a string"),
    ({"responses": [{"delayMs": -1}]}, "recordedModels.m.responses[0].delayMs must be "),
    ({"responses": [{"events": []}]}, "recordedModels.m.responses[0].events is a CLI run's: the model needs "
                                      '"cli": true'),
    ({"responses": [], "cli": "yes"}, "recordedModels.m.cli must be a boolean"),
    ({"responses": [], "inline": "m"}, 'recordedModels.m.inline must be an object, the model spec given inline, '
                                       'got "m"'),
])
def test_every_field_of_a_recorded_model_is_checked_when_the_script_loads(recorded, problem):
    lines = [json.dumps(INIT), json.dumps({"recordedModels": {"m": recorded}})]
    with pytest.raises(ScriptError) as info:
        parse_script(lines, "x.jsonl")
    assert str(info.value).startswith(f"x.jsonl:2: {problem}"), info.value


def test_a_recording_as_record_writes_it_still_loads():
    """Turns of every kind ``--record`` writes, ``${cwd}`` in their text, an inline model, a CLI
    run's events: all taken; a lone ``"${name}"`` stands for any value."""
    recorded = {"m": {"responses": ["plain ${cwd}", {"text": "part", "error": "cut"}, {"json": {"a": 1}},
                                    {"text": "x", "delayMs": "${slow}"}, "${turn}"]},
                "c": {"responses": [{"events": [{"type": "text", "text": "hi"}]}], "cli": True},
                "i": {"responses": ["x"], "inline": {"provider": "openai", "model": "gpt"}}}
    script = parse_script([json.dumps(INIT), json.dumps({"recordedModels": recorded})], "x.jsonl")
    assert script.recorded_models == recorded


def test_scripted_on_a_script_with_no_recording_names_the_file(tmp_path):
    path = write_script(tmp_path / "plain.jsonl", [INIT])
    out = replay("--scripted", path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == (f"operate-sidecar replay: {path}: the script holds no recorded model turns, no "
                          "recordedModels line (record it with --record)\n"), out.stderr


@pytest.mark.parametrize("recorded", [
    {"responses": "${all}"},
    {"responses": ["a"], "cli": "${c}"},
    {"responses": [{"events": [{"type": "text", "text": "hi"}]}], "cli": "${c}"},
    {"responses": [{"text": "x", "events": "${run}", "chunks": "${n}"}], "cli": True},
    {"responses": [{"events": ["${event}", {"type": "${kind}", "text": 1},
                               {"type": "tool_use", "id": "${id}", "name": "${n}", "input": "${args}"},
                               {"type": "tool_result", "id": "t", "output": "${out}", "is_error": "${bad}"},
                               {"type": "text", "text": "${said}"}]}], "cli": True},
])
def test_a_lone_reference_is_taken_wherever_it_stands_in_a_recorded_model(recorded):
    """A lone ``"${name}"`` stands for any value, known only once substituted: as ``responses``
    (it was refused: ``responses must be a list, not a string``), as ``cli``, as a CLI run's
    events, as an event, an event's type (what the event holds depends on it), a tool call's
    ``input``, a result's ``is_error``: each was checked as the string it is written as."""
    script = parse_script([json.dumps(INIT), json.dumps({"recordedModels": {"m": recorded}})], "x.jsonl")
    assert script.recorded_models == {"m": recorded}


@pytest.mark.parametrize("recorded, problem", [
    ({"responses": [{"txt": "${t}"}]}, "recordedModels.m.responses[0]: unknown field 'txt'"),
    ({"responses": [{"events": [{"type": "text", "txt": "${t}"}]}], "cli": True},
     "recordedModels.m.responses[0].events[0]: unknown field 'txt'"),
    ({"responses": [{"events": [{"type": "tool_use", "input": "${a}", "is_error": True}]}], "cli": True},
     "recordedModels.m.responses[0].events[0]: unknown field 'is_error'"),
    ({"responses": "${all}", "cli": "yes"}, "recordedModels.m.cli must be a boolean"),
])
def test_what_is_written_beside_a_lone_reference_is_still_checked(recorded, problem):
    with pytest.raises(ScriptError) as info:
        parse_script([json.dumps(INIT), json.dumps({"recordedModels": {"m": recorded}})], "x.jsonl")
    assert str(info.value).startswith(f"x.jsonl:2: {problem}"), info.value


def test_a_lone_reference_as_responses_or_cli_is_put_in_as_written_to_be_substituted():
    """``replay --scripted`` puts a lone ``"${all}"`` in as it is (the request that carries the
    model substitutes it); it made a list of its characters, ``["$", "{", ...]``."""
    from operate_sidecar.server.script.runner import scripted_models

    named, inline = scripted_models({"m": {"responses": "${all}", "cli": "${c}"},
                                     "i": {"responses": "${turns}", "inline": {"provider": "openai", "model": "g"}}})
    assert named == {"m": {"provider": "scripted", "responses": "${all}", "cli": "${c}"}}
    assert list(inline.values()) == [{"provider": "scripted", "responses": "${turns}"}]


def test_a_request_no_respond_match_fits_names_the_nearest_line_and_where_it_parted(tmp_path):
    """A typo in a respond line's match (``write_fiel``): the report said only that no match fit,
    with the request's params cut before the field that differed, and told the reader to add the
    line they had. It names the line whose match came nearest and the difference."""
    write = {"json": {"action_requests": [{"function": "write_file", "arguments": {"path": "n.txt", "content": "x"}}]}}
    ws = tmp_path / "ws"
    ws.mkdir()
    steps = [{"request": "initialize", "params": {"capabilities": {"toolPermission": True}, "workspaceFolders": [str(ws)],
                                                  "settings": {"models": {"m": scripted(write)},
                                                               "toolPolicy": {"write_file": "ask"}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"respond": "requestToolPermission", "match": {"tool": "read_file"}, "result": {"decision": "deny_once"}},
             {"respond": "requestToolPermission", "match": {"tool": "write_fiel"}, "result": {"decision": "allow_once"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "w", "actions": True}}]
    out = replay(write_script(tmp_path / "s.jsonl", steps))
    [line] = fails(out)
    assert line.startswith("FAIL line 5: request operate: the server asked requestToolPermission"), line
    assert ("no respond line's match fits it (nearest: line 4's, at $.params.tool: expected \"write_fiel\", "
            "got \"write_file\")") in line, line
    assert "fix the match of line 4, or add a line" in line, line
    assert not (ws / "n.txt").exists()


@pytest.mark.parametrize("step, problem", [
    ({"respond": "requestToolPermision", "result": {"decision": "allow_once"}},
     'respond "requestToolPermision": the server sends no such request; did you mean requestToolPermission?'),
    ({"expectNotification": "toolEvnt"},
     'expectNotification "toolEvnt": the server sends no such notification; did you mean toolEvent?'),
])
def test_a_misspelt_method_the_server_sends_is_refused_when_the_script_loads(step, problem):
    """Such a respond line was a standing answer nothing asked for (PASS), and such a wait ran out
    its whole time-out, neither saying why; a name far from every known one is a method of some
    other server (after ``--``), left alone."""
    with pytest.raises(ScriptError) as e:
        parse_script([json.dumps({"request": "initialize"}), json.dumps(step)], "s.jsonl")
    assert str(e.value) == f"s.jsonl:2: {problem}"
    far = {**step, next(iter(step)): "myServer/somethingElse"}
    assert len(parse_script([json.dumps(far)], "s.jsonl").steps) == 1
