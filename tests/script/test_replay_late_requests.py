"""A server-to-client request that comes after a script's last step was reported (as the session
ends): one that no ``respond`` line answers, or that one answers with what it did not offer, fails
the replay as it fails a step it comes during. Real servers over real pipes; every wait bounded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay import ANSWER, PERM, given_once_substituted, replay, scripted, write_script  # noqa: E402

from operate_sidecar.server.script.runner import Runner, format_report, parse_script  # noqa: E402

OFFERED = "allow_once, allow_always, deny_once, deny_always"


def leaving_mid_operate(respond: dict | None) -> list[dict]:
    """A session whose client, after a first operate, sent a second one, then ``shutdown`` and
    ``exit`` without waiting for either answer (as an editor closing mid-turn does; ``--record``
    writes them ``"answered": false``). The server finishes that operate before it answers
    ``shutdown`` (a bounded wait, half a second): its model, a twentieth of a second later (so
    after the script's last step), asks for get_weather, policy ``ask``, so the server asks
    requestToolPermission as the session ends. (The first operate loads what an operate needs,
    so that the second one asks within that bound.)"""
    ask = {"json": {"answer": "4", "action_requests": [{"function": "get_weather", "arguments": {"city": "Lima"}}]},
           "delayMs": 50}
    op = {"branchId": "${b}", "instruction": "weather?", "responseFormat": ANSWER, "actions": True}
    steps = [{"request": "initialize", "params": {"capabilities": PERM, "settings": {
                 "models": {"m": scripted({"json": {"answer": "3"}}, ask)},
                 "toolModules": ["operate_sidecar.clients.python.demo_tools"], "toolPolicy": {"get_weather": "ask"}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": op, "expect": {"result": {"result": {"answer": "3"}}}}]
    if respond and respond["result"].get("decision") == "allow":  # a decision the protocol does not know:
        respond = {**respond, "result": given_once_substituted(steps[0], respond["result"])}  # known once run
    steps += [respond] if respond else []
    steps += [{"request": "operate", "params": op, "answered": False},
              {"request": "shutdown", "answered": False},
              {"notify": "exit"}]
    return steps


@pytest.mark.parametrize("respond, problem", [
    ({"respond": "requestToolPermission", "result": {"decision": "allow"}},
     'after the last step, line 4 answered requestToolPermission (tool get_weather) with decision "allow", not one '
     f'of the decisions it offered: {OFFERED}; the server took it as a deny (to deny, answer "deny_once" or an '
     'error)'),
    (None,
     "and no respond line answers it, so it was refused (-32601); add a line "
     '{"respond": "requestToolPermission", "result": ...} before the request that leads to it'),
])
def test_a_server_request_answered_wrongly_or_not_at_all_as_the_session_ends_fails_the_replay(
        tmp_path, respond, problem):
    """The server asked for permission once the script's steps had all run (and passed): the
    wrong answer (or the refusal) was judged by no step, and the replay passed, exit 0. Now the
    end of the session fails, naming the request and what was wrong, and the replay exits 1."""
    steps = leaving_mid_operate(respond)
    out = replay(write_script(tmp_path / "late.jsonl", steps))
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    last = len(steps)
    assert [ln.split(":")[0] for ln in lines[:last]] == [f"PASS line {n}" for n in range(1, last + 1)], out.stdout
    (fail,) = [ln for ln in lines if ln.startswith("FAIL")]
    assert fail.startswith(f"FAIL the end of the session (after line {last}): "), out.stdout
    if respond is None:
        assert fail.startswith(f"FAIL the end of the session (after line {last}): the server asked "
                               'requestToolPermission {"arguments": {"city": "Lima"}, "branchId": '), fail
        assert '"tool": "get_weather"} after the last step ' in fail, fail
    assert fail.endswith(problem), fail
    assert lines[-1] == f"the end of the session failed (late.jsonl), after all {last} steps passed", out.stdout


def test_the_report_of_a_runner_says_a_late_server_request_failed_the_end_with_the_steps_that_failed(tmp_path):
    """In-process (what the pytest plugin shows): the failing end is listed after the steps, and
    the summary counts the script's steps apart from it."""
    steps = leaving_mid_operate({"respond": "requestToolPermission", "result": {"decision": "allow"}})
    steps.insert(3, {"request": "listBranches", "expect": {"result": {"branches": []}}})  # fails: one branch
    runner = Runner(parse_script(json.dumps(s) for s in steps), step_timeout=30)
    assert not runner.run()
    report = format_report(runner, "late.jsonl").splitlines()
    assert report[3].startswith("FAIL line 4: request listBranches: "), report
    assert report[-2].startswith("FAIL the end of the session (after line 8): after the last step, line 5 "
                                 'answered requestToolPermission (tool get_weather) with decision "allow"'), report
    assert report[-1] == ("1 of 8 steps failed in late.jsonl, and the end of the session; "
                          "first: line 4: request listBranches"), report
    assert [r.ok for r in runner.failed] == [False, False]


def test_a_script_that_ends_as_its_server_answers_as_offered_passes(tmp_path):
    """The same session, its permission answered as offered: nothing is said of the end."""
    steps = leaving_mid_operate({"respond": "requestToolPermission", "result": {"decision": "allow_once"}})
    out = replay(write_script(tmp_path / "ok.jsonl", steps))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == f"all {len(steps)} steps passed (ok.jsonl)", out.stdout
    assert "end of the session" not in out.stdout, out.stdout
