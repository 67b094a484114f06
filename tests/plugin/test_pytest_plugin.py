"""The pytest plugin, used the way another project uses it: a separate temporary project
whose tests use the ``sidecar`` fixture and ``sidecar_script``, run by pytest in a subprocess
(the plugin is found through its ``pytest11`` entry point, nothing is imported by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TIMEOUT = 240

CONFTEST_FREE_TESTS = '''
import pytest

REPORT = {"title": "Report", "type": "object", "properties": {"summary": {"type": "string"}},
          "required": ["summary"]}
WEATHER = {"json": {"summary": "sunny",
                    "action_requests": [{"function": "get_weather", "arguments": {"city": "Lima"}}]}}
SETTINGS = {"models": {"m": {"provider": "scripted", "responses": [WEATHER]}},
            "toolModules": ["operate_sidecar.clients.python.demo_tools"], "toolPolicy": {"get_weather": "ask"}}


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, capabilities={"toolPermission": True})
async def test_extension_flow(sidecar):
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p["tool"]) or {"decision": "allow_once"})
    branch = (await sidecar.request("createBranch", {"system": "facts"}))["branchId"]
    out = await sidecar.request("operate", {"branchId": branch, "instruction": "weather?", "actions": True,
                                            "responseFormat": REPORT, "workDoneToken": 7})
    assert out["result"]["summary"] == "sunny"
    assert out["result"]["action_responses"][0]["output"]["city"] == "Lima"
    post = await sidecar.wait_for_notification("toolEvent", {"event": "post", "tool": "get_weather"})
    assert post["branchId"] == branch and asked == ["get_weather"]
    await sidecar.wait_for_notification("$/progress", {"token": 7, "value": {"kind": "end"}})
    sidecar.notify("$/cancelRequest", {"id": 12345})
    assert await sidecar.request("ping") == {}


@pytest.mark.asyncio
@pytest.mark.parametrize("sidecar_options", [{"settings": {"models": {"a": {"provider": "scripted"}}}},
                                             {"settings": {"models": {"b": {"provider": "scripted"}}}}],
                         indirect=True)
async def test_settings_by_parametrization(sidecar, sidecar_options):
    assert sidecar.initialize_result["capabilities"]["models"] == list(sidecar_options["settings"]["models"])
    await sidecar.stop()
    assert sidecar.returncode == 0 and "Traceback" not in sidecar.stderr_text()


def test_session_script_passes(sidecar_script):
    sidecar_script("good.jsonl")


def test_session_script_with_a_wrong_expectation(sidecar_script):
    sidecar_script("wrong.jsonl")


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, capabilities={"toolPermission": True})
async def test_waiting_for_a_notification_that_does_not_match(sidecar):
    sidecar.respond("requestToolPermission", {"decision": "deny_once"})
    branch = (await sidecar.request("createBranch"))["branchId"]
    await sidecar.request("operate", {"branchId": branch, "instruction": "weather?", "actions": True,
                                      "responseFormat": REPORT})
    await sidecar.wait_for_notification("toolEvent", {"event": "post"}, timeout=0.5)
'''


def script(*steps: dict) -> str:
    return "".join(json.dumps(s) + "\n" for s in steps)


INIT = {"request": "initialize", "params": {"settings": {"models": {"m": {"provider": "scripted",
                                                                         "responses": ["plain text"]}}}}}
GOOD = script(INIT, {"request": "createBranch", "save": {"b": "branchId"}},
              {"request": "operate", "params": {"branchId": "${b}", "instruction": "hi", "skipValidation": True},
               "expect": {"result": {"kind": "text", "result": "plain text"}}})
WRONG = script(INIT, {"request": "createBranch", "save": {"b": "branchId"}},
               {"request": "operate", "params": {"branchId": "${b}", "instruction": "hi", "skipValidation": True},
                "expect": {"result": {"kind": "text", "result": "other text"}}})


def make_project(root: Path) -> Path:
    root.mkdir()
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [project]
        name = "my-extension-tests"
        version = "0"
        [tool.pytest.ini_options]
        asyncio_default_fixture_loop_scope = "function"
        """))
    (root / "test_extension.py").write_text(CONFTEST_FREE_TESTS)
    (root / "good.jsonl").write_text(GOOD)
    (root / "wrong.jsonl").write_text(WRONG)
    return root


def run_pytest(project: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """pytest on ``project`` in a subprocess (with ``env`` added to the environment)."""
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout=120",
                           "-o", "console_output_style=classic", *args],
                          cwd=project, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **env} if env else None)


def run_tests_file(tmp_path: Path, name: str, source: str, *args: str) -> str:
    """Write ``source`` as ``name`` into a fresh project, run pytest on that file alone (with
    ``-rA`` and ``args``) and return all it printed."""
    project = make_project(tmp_path / "ext")
    (project / name).write_text(source)
    out = run_pytest(project, "-rA", *args, name)
    return out.stdout + out.stderr


def test_a_project_uses_the_fixture_and_script_helper_and_failures_read_well(tmp_path):
    project = make_project(tmp_path / "ext")
    out = run_pytest(project, "-rA")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "2 failed, 4 passed" in text, text
    assert "PASSED test_extension.py::test_settings_by_parametrization[sidecar_options1]" in text
    assert "PASSED test_extension.py::test_extension_flow" in text
    assert "PASSED test_extension.py::test_session_script_passes" in text
    # the wrong expectation: the step, the JSON path and both values, not a traceback of the runner
    assert 'FAIL line 3: request operate: at $.result.result: expected "other text", got "plain text"' in text
    assert "1 of 3 steps failed in " in text and "/ext/wrong.jsonl; first: line 3: request operate" in text
    # a notification that never matches: the nearest miss, with its path
    assert ('TimeoutError: no toolEvent notification matching {"event": "post"} within 0.5 s; '
            '1 unmatched, nearest at $.params.event: expected "post", got "denied"') in text, text


def test_a_script_beside_the_test_file_is_found_when_pytest_runs_from_elsewhere(tmp_path):
    """``sidecar_script("good.jsonl")`` names the file beside the test, whatever the working
    directory (it was looked up from the working directory only: run from the project's parent,
    the script was "not found")."""
    make_project(tmp_path / "ext")
    out = run_pytest(tmp_path, "ext/test_extension.py::test_session_script_passes", "-rA")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "PASSED ext/test_extension.py::test_session_script_passes" in text, text


def test_the_fixture_is_offered_by_the_installed_plugin(tmp_path):
    project = make_project(tmp_path / "ext")
    out = run_pytest(project, "--fixtures")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sidecar -- " in out.stdout and "sidecar_script -- " in out.stdout and "operate_sidecar" in out.stdout


DEAD_SIDECAR_TESTS = '''
import os
import signal

import pytest


@pytest.mark.asyncio
@pytest.mark.sidecar(args=["--no-such-flag"])
async def test_bad_server_args(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout=60)
async def test_sidecar_killed_while_waiting(sidecar):
    os.kill(sidecar._server.pid, signal.SIGKILL)
    await sidecar.wait_for_notification("toolEvent")


@pytest.mark.asyncio
async def test_no_notification_of_a_method(sidecar):
    await sidecar.wait_for_notification("toolEvent", timeout=0.3)
'''


def test_a_sidecar_that_fails_to_start_or_dies_is_reported_at_once_with_its_stderr(tmp_path):
    text = run_tests_file(tmp_path, "test_dead.py", DEAD_SIDECAR_TESTS, "--durations=0", "--durations-min=0")
    assert "2 failed, 1 error" in text, text
    # start-up failed: the server's own words (argparse's), not only its exit code
    assert "the sidecar exited (code 2)" in text and "unrecognized arguments: --no-such-flag" in text, text
    assert ("the sidecar did not start and initialize with {'args': ['--no-such-flag']}:\nSidecarExited: request "
            "initialize not answered: the sidecar exited (code 2)\nsidecar stderr (last lines):\n  usage: ") in text, text
    # killed while a test waits for a notification: a RuntimeError at once, not a time-out after 60 s
    assert ("SidecarExited: no matching toolEvent notification came: the sidecar exited (code -9, killed by "
            "SIGKILL)") in text, text
    (line,) = [ln for ln in text.splitlines() if ln.endswith("call     test_dead.py::test_sidecar_killed_while_waiting")]
    assert float(line.split("s", 1)[0]) < 30, line
    assert "TimeoutError: no toolEvent notification matching any params within 0.3 s" in text, text


REFUSING_SIDECAR_TESTS = '''
import pytest


@pytest.mark.asyncio
@pytest.mark.sidecar(settings={"models": {"m": {"provider": "nope"}}})
async def test_settings_refused(sidecar):
    pass


@pytest.mark.asyncio
async def test_shuts_the_sidecar_down_itself(sidecar):
    assert await sidecar.request("shutdown") is None
'''


def test_a_sidecar_that_refuses_initialize_or_was_shut_down_by_the_test_is_stopped_at_once(tmp_path):
    """Its teardown's shutdown is refused (not initialized, or shut down already): it still sends
    exit, so the sidecar exits at once instead of being killed after 10 s."""
    text = run_tests_file(tmp_path, "test_refused.py", REFUSING_SIDECAR_TESTS, "--durations=0", "--durations-min=0")
    assert "1 passed, 1 error" in text, text
    assert "SidecarError: initialize failed with -32602" in text and "unknown provider 'nope'" in text, text
    # the test's settings are wrong: said in words with the options, not as a traceback through
    # pytest-asyncio and the fixture's source
    assert ("the sidecar did not start and initialize with {'settings': {'models': {'m': {'provider': 'nope'}}}}:\n"
            "SidecarError: initialize failed with -32602") in text, text
    assert "pytest_asyncio" not in text and "pytest_plugin.py" not in text and "Traceback" not in text, text
    timed = [ln for ln in text.splitlines() if "test_refused.py::" in ln and ln.split("s", 1)[0][:1].isdigit()]
    assert len(timed) >= 4, text
    for line in timed:
        assert float(line.split("s", 1)[0]) < 5, line


CRASH_TOOLS = '''
import os
import sys


def crash(reason: str) -> str:
    """Crash the sidecar.

    Args:
        reason: why
    """
    sys.stderr.write(f"crash_tools: giving up because {reason}\\n")
    sys.stderr.flush()
    os._exit(3)
'''

CRASHING_SIDECAR_TESTS = '''
import asyncio
import os
import signal

import pytest

CRASH = {"json": {"action_requests": [{"function": "crash", "arguments": {"reason": "the disk is full"}}]}}
SETTINGS = {"models": {"m": {"provider": "scripted", "responses": [CRASH]}}, "toolModules": ["crash_tools"],
            "toolPolicy": {"crash": "allow"}}


async def crash(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    await sidecar.request("operate", {"branchId": branch, "instruction": "go", "actions": True})


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, timeout=60)
async def test_crashes_while_a_request_runs(sidecar):
    await crash(sidecar)


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, timeout=60)
async def test_requests_after_the_crash(sidecar):
    with pytest.raises(RuntimeError):
        await crash(sidecar)
    await sidecar.request("ping")


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, timeout=60)
async def test_notifies_after_the_crash(sidecar):
    with pytest.raises(RuntimeError):
        await crash(sidecar)
    sidecar.notify("$/cancelRequest", {"id": 1})


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, timeout=60)
async def test_waits_for_a_notification_after_the_crash(sidecar):
    with pytest.raises(RuntimeError):
        await crash(sidecar)
    await sidecar.wait_for_notification("toolEvent", {"event": "post"})


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout=60)
async def test_killed_then_requests(sidecar):
    os.kill(sidecar._server.pid, signal.SIGKILL)
    await sidecar._server.wait()
    await sidecar.request("ping")


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout=60)
async def test_killed_while_a_request_runs(sidecar):
    ping = asyncio.ensure_future(sidecar.request("ping"))
    os.kill(sidecar._server.pid, signal.SIGKILL)
    await ping


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout=60)
async def test_exited_then_notifies(sidecar):
    await sidecar.request("shutdown")
    sidecar.notify("exit")
    await sidecar._server.wait()
    sidecar.notify("exit")
'''


def test_a_sidecar_that_died_fails_requests_and_notifications_at_once_naming_the_method_exit_and_stderr(tmp_path):
    """A request in flight or sent after the sidecar exited, a notification sent after it and a
    wait for a notification: one SidecarExited (a RuntimeError) each, naming the method, the exit
    code or signal, and the tail of the sidecar's stderr; at once, never after the 60 s time-out
    (a request to a dead sidecar waited it out; one in flight raised pygls's bare RuntimeError)."""
    project = make_project(tmp_path / "ext")
    (project / "crash_tools.py").write_text(CRASH_TOOLS)
    (project / "test_crash.py").write_text(CRASHING_SIDECAR_TESTS)
    out = run_pytest(project, "-rA", "--durations=0", "--durations-min=0", "test_crash.py")
    text = out.stdout + out.stderr
    assert "7 failed" in text, text
    stderr = "\nE       sidecar stderr (last lines):\nE         crash_tools: giving up because the disk is full\n"
    for test, error in [
            ("test_crashes_while_a_request_runs", "request operate not answered: the sidecar exited (code 3)" + stderr),
            ("test_requests_after_the_crash", "request ping not sent: the sidecar exited (code 3)" + stderr),
            ("test_notifies_after_the_crash",
             "notification $/cancelRequest not sent: the sidecar exited (code 3)" + stderr),
            ("test_waits_for_a_notification_after_the_crash",
             "no matching toolEvent notification came: the sidecar exited (code 3)" + stderr),
            ("test_killed_then_requests",
             "request ping not sent: the sidecar exited (code -9, killed by SIGKILL)\nE       sidecar stderr:"),
            ("test_killed_while_a_request_runs",
             "request ping not answered: the sidecar exited (code -9, killed by SIGKILL)\nE       sidecar stderr:"),
            ("test_exited_then_notifies", "notification exit not sent: the sidecar exited (code 0)")]:
        section = text.split(f"_ {test} _", 1)[1].split("\n___", 1)[0]
        assert f"SidecarExited: {error}" in section, section
        assert "asyncio/tasks.py" not in section and "pygls" not in section, section
    timed = [ln for ln in text.splitlines() if "test_crash.py::" in ln and ln.split("s", 1)[0][:1].isdigit()]
    assert len(timed) >= 7, text
    for line in timed:
        assert float(line.split("s", 1)[0]) < 10, line


HANDLER_BUG_TESTS = '''
import pytest

ASK = {"json": {"summary": "x", "action_requests": [{"function": "get_weather", "arguments": {"city": "Lima"}}]}}
SETTINGS = {"models": {"m": {"provider": "scripted", "responses": [ASK]}},
            "toolModules": ["operate_sidecar.clients.python.demo_tools"], "toolPolicy": {"get_weather": "ask"}}
REPORT = {"title": "Report", "type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}


async def denial(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    out = await sidecar.request("operate", {"branchId": branch, "instruction": "weather?", "actions": True,
                                            "responseFormat": REPORT})
    return out["result"]["action_responses"][0]["output"]["reason"]


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, capabilities={"toolPermission": True}, timeout=60)
async def test_handler_raises(sidecar):
    def answer(params):
        raise ValueError("my handler bug")
    sidecar.on_request("requestToolPermission", answer)
    reason = await denial(sidecar)
    assert reason == "permission request failed: the test's requestToolPermission handler raised ValueError: my handler bug"


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, capabilities={"toolPermission": True}, timeout=60)
async def test_async_handler_raises(sidecar):
    async def answer(params):
        return params["no such key"]
    sidecar.on_request("requestToolPermission", answer)
    assert "handler raised KeyError" in await denial(sidecar)


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, capabilities={"toolPermission": True}, timeout=60)
async def test_handler_returns_no_json(sidecar):
    sidecar.respond("requestToolPermission", {"decision": {"allow_once"}})
    assert "handler returned a value that is not JSON" in await denial(sidecar)


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout=60)
async def test_request_params_no_json(sidecar):
    await sidecar.request("createBranch", {"system": {"a set"}})


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout=60)
async def test_notification_params_no_json(sidecar):
    sidecar.notify("$/cancelRequest", {"id": float("nan")})
'''


def test_a_failing_handler_fails_the_test_and_no_json_is_refused_before_anything_waits(tmp_path):
    """An on_request handler that raises or returns what is not JSON: the sidecar is answered
    -32603 (a value that is not JSON was answered nothing: the sidecar's request, and the test's
    operate, waited out their time-outs) and the test fails at teardown with the handler's error
    (it passed, the bug only in a captured log). Params that are not JSON raise at once (they were
    sent nothing: the request waited out its time-out, the notification was lost)."""
    text = run_tests_file(tmp_path, "test_handlers.py", HANDLER_BUG_TESTS, "--durations=0", "--durations-min=0")
    assert "2 failed, 3 passed, 3 errors" in text, text
    assert ("HandlerFailed: on_request handler for requestToolPermission: ValueError: my handler bug; the sidecar "
            "was answered -32603") in text, text
    assert 'raise ValueError("my handler bug")' in text, text  # the handler's own traceback
    assert "HandlerFailed: on_request handler for requestToolPermission: KeyError: 'no such key'" in text, text
    assert ("HandlerFailed: on_request handler for requestToolPermission: TypeError: returned a value that is not "
            "JSON (Object of type set is not JSON serializable)") in text, text
    assert "TypeError: request createBranch: params are not JSON (Object of type set is not JSON serializable)" \
        in text, text
    assert "ValueError: notification $/cancelRequest: params are not JSON (Out of range float values" in text, text
    timed = [ln for ln in text.splitlines() if "test_handlers.py::" in ln and ln.split("s", 1)[0][:1].isdigit()]
    assert len(timed) >= 10, text
    for line in timed:
        assert float(line.split("s", 1)[0]) < 10, line


BAD_OPTIONS_TESTS = '''
import os

import pytest


@pytest.mark.asyncio
@pytest.mark.sidecar(args="--debug")
async def test_args_a_string(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout="abc")
async def test_timeout_a_string(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.sidecar(env=["A=1"])
async def test_env_a_list(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.sidecar(settings="models.toml")
async def test_settings_a_string(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.sidecar(setings={})
async def test_unknown_option(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.sidecar({"settings": {}})
async def test_positional_options(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.parametrize("sidecar_options", ["--debug"], indirect=True)
async def test_parametrized_with_no_dict(sidecar):
    pass


def test_no_sidecar_left_running():
    children = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                with open(f"/proc/{stat}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                children.append(stat)
    assert children == []
'''


def test_marker_options_of_the_wrong_type_are_refused_by_name_before_a_sidecar_starts(tmp_path):
    """args as a string (it was split into one-letter flags), timeout not a number (a ValueError
    after the sidecar started, which then ran on unstopped), env not a dict, settings not a dict,
    positional marker arguments (silently ignored) and an indirect parametrization that is not a
    dict (ignored): the set-up fails naming the option, and no sidecar left running."""
    text = run_tests_file(tmp_path, "test_options.py", BAD_OPTIONS_TESTS)
    assert "1 passed, 7 errors" in text, text
    for message in ["args must be a list of strings (server flags), got '--debug'",
                    "timeout must be a number of seconds above 0, got 'abc'",
                    "env must be a dict of strings to strings, got ['A=1']",
                    "settings must be a dict, got 'models.toml'",
                    "unknown option(s) setings (did you mean settings?)",
                    "options are keywords (settings=..., args=[...]), got positional ({'settings': {}},)",
                    "sidecar options must be a dict of keywords, got str"]:
        assert message in text, message + "\n" + text
    assert text.count(" - Failed: side") == 7, text  # the message alone, no traceback
    assert "pytest_asyncio" not in text and "def _check_options" not in text, text
    assert "PASSED test_options.py::test_no_sidecar_left_running" in text, text


SCRIPT_MISTAKE_TESTS = '''
def test_script_missing(sidecar_script):
    sidecar_script("no_such.jsonl")


def test_script_misspelt_step(sidecar_script):
    sidecar_script("misspelt.jsonl")


def test_script_not_recorded(sidecar_script):
    sidecar_script("good.jsonl", scripted=True)
'''


def test_a_script_that_is_missing_or_malformed_fails_with_what_and_where_and_no_traceback(tmp_path):
    """``sidecar_script`` on a file that does not exist, a misspelt step kind, ``scripted=True``
    on a script that is no recording: the test fails with the replay's own words (the file and
    line; where the missing script was looked for), not a traceback through the plugin and the
    runner (``FileNotFoundError`` naming only the relative path; ``ScriptError`` from deep in
    ``parse_script``)."""
    project = make_project(tmp_path / "ext")
    (project / "misspelt.jsonl").write_text(script(INIT) + '{"reqest": "createBranch"}\n')
    (project / "test_scripts.py").write_text(SCRIPT_MISTAKE_TESTS)
    out = run_pytest(tmp_path, "-rA", "ext/test_scripts.py")  # from the project's parent
    text = out.stdout + out.stderr
    assert "3 failed" in text, text
    assert (f"sidecar_script: no session script 'no_such.jsonl' beside the test file ({project}) nor in the "
            f"working directory ({tmp_path})") in text, text
    assert (f"sidecar_script: {project}/misspelt.jsonl:2: a step has exactly one of request, notify, "
            "expectNotification, respond, await (found none; its key(s): reqest)") in text, text
    assert (f"sidecar_script: {project}/good.jsonl: the script holds no recorded model turns, no recordedModels line "
            "(record it with --record)") in text, text
    assert text.count(" - Failed: side") == 3, text  # the message alone
    assert "def parse_script" not in text and "runner.py" not in text and "During handling" not in text, text


MISSPELT_OPTION_TESTS = '''
import pytest


@pytest.mark.asyncio
@pytest.mark.sidecar(setings={}, timout=5)
async def test_marker_misspelt(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.sidecar(verbose=True)
async def test_marker_unknown(sidecar):
    pass


@pytest.mark.asyncio
@pytest.mark.parametrize("sidecar_options", [{"capabilites": {"toolPermission": True}}], indirect=True)
async def test_parametrized_misspelt(sidecar):
    pass


def test_script_misspelt_option(sidecar_script):
    sidecar_script("good.jsonl", step_timout=5)


def test_script_unknown_option(sidecar_script):
    sidecar_script("good.jsonl", verbose=True)
'''


def test_misspelt_marker_and_fixture_options_are_named_with_the_name_they_are_closest_to(tmp_path):
    """A misspelt option of the marker, of an indirect parametrization or of ``sidecar_script`` was
    named with the whole list of options (the marker's) or as a TypeError from deep in the plugin
    (``sidecar_script``), while a misspelt step field in a script got "did you mean": all of them get
    it now, from the same helper, and the known names when nothing is close."""
    text = run_tests_file(tmp_path, "test_misspelt.py", MISSPELT_OPTION_TESTS)
    assert "2 failed, 3 errors" in text, text
    for message in ["sidecar marker: unknown option(s) setings (did you mean settings?), timout (did you mean "
                    "timeout?)\n",
                    "sidecar marker: unknown option(s) verbose; known: args, capabilities, client_info, env, "
                    "initialize, settings, timeout, workspace_folders\n",
                    "sidecar marker: unknown option(s) capabilites (did you mean capabilities?)\n",
                    "sidecar_script: unknown option(s) step_timout (did you mean step_timeout?)\n",
                    "sidecar_script: unknown option(s) verbose; known: cwd, env, scripted, server, step_timeout\n"]:
        assert message in text, message + "\n" + text
    assert text.count(" - Failed") == 5 and "TypeError" not in text and "def run(" not in text, text  # no traceback


LATE_ANSWER_TESTS = '''
import asyncio

import pytest

SLOW = {"models": {"m": {"provider": "scripted", "responses": [{"delayMs": 1500, "text": "late"},
                                                                {"delayMs": 1500, "error": "late too"}]}}}


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SLOW, timeout=60)
async def test_answers_after_the_time_out(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    for _ in range(2):
        with pytest.raises(TimeoutError, match=r"no answer to operate within 0.3 s; to wait longer, pass timeout=S "
                                               r"to this call, or give the client a longer timeout [(]the sidecar "
                                               r"marker's timeout=S[)]$"):
            await sidecar.request("operate", {"branchId": branch, "instruction": "hi", "skipValidation": True},
                                  timeout=0.3)
    await asyncio.sleep(3)  # both answers (a result, an error) come while the test still runs
    assert await sidecar.request("ping") == {}
'''


def test_an_answer_that_comes_after_its_request_timed_out_is_dropped_quietly(tmp_path):
    """A request that timed out, then answered (a result or an error): the test goes on, and no
    traceback is logged (pygls set the answer on the future the time-out had cancelled:
    ``InvalidStateError`` logged with its traceback as "Unable to handle message")."""
    text = run_tests_file(tmp_path, "test_late.py", LATE_ANSWER_TESTS, "-o", "log_level=DEBUG")
    assert "1 passed" in text, text
    assert "Traceback" not in text and "InvalidStateError" not in text and "never retrieved" not in text, text


CANCEL_ON_TIME_OUT_TESTS = '''
import pytest

SLOW = {"models": {"m": {"provider": "scripted", "responses": [{"delayMs": 60000, "text": "never"},
                                                                {"text": "next"}]}}}


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SLOW, timeout=60)
async def test_a_timed_out_request_is_cancelled(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    op = {"branchId": branch, "instruction": "hi", "skipValidation": True}
    with pytest.raises(TimeoutError):
        await sidecar.request("operate", op, timeout=0.5)
    # the branch is free at once: the first operate no longer holds it for its minute
    assert (await sidecar.request("operate", op, timeout=20))["result"] == "next"
'''


def test_a_request_that_timed_out_is_cancelled_on_the_sidecar(tmp_path):
    """A request the test client gave up on (its time-out) is cancelled on the sidecar
    (``$/cancelRequest``), not left running: an operate that timed out frees its branch."""
    text = run_tests_file(tmp_path, "test_cancel.py", CANCEL_ON_TIME_OUT_TESTS)
    assert "1 passed" in text, text


SYNC_TEST_TESTS = '''
def test_forgot_async(sidecar):
    sidecar.request("operate", {"branchId": "nope"})  # a coroutine nobody runs: checks nothing
'''


def test_a_plain_def_test_that_takes_the_async_fixture_fails_saying_why(tmp_path):
    """A sync test that takes ``sidecar`` made its requests as coroutines nobody ran, and passed
    having checked nothing; it fails at set-up, saying to make the test ``async def``."""
    text = run_tests_file(tmp_path, "test_sync.py", SYNC_TEST_TESTS)
    assert "1 error" in text and "the sidecar fixture is async: make the test `async def`" in text, text
    assert "test_forgot_async" in text and "passed" not in text, text


SCRIPT_ENV_TESTS = '''
import os
import sys

CHECK = '[ "$OUTER_FLAG/$MY_FLAG" = outer/mine ] || { echo "got $OUTER_FLAG/$MY_FLAG" >&2; exit 9; }; exec "$0" -m operate_sidecar.server'


def test_script_with_env(sidecar_script):
    os.environ["OUTER_FLAG"] = "outer"
    sidecar_script("good.jsonl", env={"MY_FLAG": "mine"}, server=["sh", "-c", CHECK, sys.executable])
'''


def test_a_script_run_with_env_keeps_the_environment_as_the_marker_does(tmp_path):
    """``sidecar_script(..., env={...})`` adds to the test's environment, as the marker's ``env``
    does (it replaced it: a server started with nothing but those variables, no PATH nor HOME)."""
    text = run_tests_file(tmp_path, "test_env.py", SCRIPT_ENV_TESTS)
    assert "1 passed" in text, text


def test_a_project_that_turns_warnings_into_errors_passes(tmp_path):
    """``filterwarnings = ["error"]`` (a strict project's setting): the fixture and the script
    helper leave no file open (the sidecar's stderr file, the server's output pipe of a script
    run), so no ResourceWarning fails a later test as PytestUnraisableExceptionWarning."""
    project = make_project(tmp_path / "ext")
    out = run_pytest(project, "-rA", "-W", "error",
                     "test_extension.py::test_extension_flow", "test_extension.py::test_session_script_passes",
                     "test_extension.py::test_settings_by_parametrization")
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "4 passed" in text, text
    assert "ResourceWarning" not in text, text


HINT_TESTS = '''
import pytest

SETTINGS = {"models": {"m": {"provider": "scripted", "responses": [{"json": {"summary": "sunny", "action_requests": [
    {"function": "get_weather", "arguments": {"city": "Lima"}}]}}]}},
    "toolModules": ["operate_sidecar.clients.python.demo_tools"]}


def test_script_too_slow(sidecar_script):
    sidecar_script("slow.jsonl", step_timeout=0.3)


def test_script_missing_absolute(sidecar_script, tmp_path):
    sidecar_script(tmp_path / "nowhere" / "session.jsonl")


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS)
async def test_waits_twice_for_one_notification(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    await sidecar.request("operate", {"branchId": branch, "instruction": "weather?", "actions": True,
                                      "responseFormat": {"type": "object", "properties": {"summary": {"type": "string"}}}})
    await sidecar.wait_for_notification("toolEvent", {"event": "post"}, timeout=10)
    await sidecar.wait_for_notification("toolEvent", {"event": "post"}, timeout=0.5)
'''

SLOW = script({**INIT, "params": {"settings": {"models": {"m": {"provider": "scripted", "responses": [
                  {"text": "slow", "delayMs": 30000}]}}}}, "timeoutMs": 20000},
              {"request": "createBranch", "save": {"b": "branchId"}, "timeoutMs": 20000},
              {"request": "operate", "params": {"branchId": "${b}", "instruction": "hi", "skipValidation": True}})


def test_a_time_out_a_missing_script_and_a_notification_already_waited_for_say_what_to_do(tmp_path):
    """In a test, as on the command line: a request step that timed out names the fixture's
    ``step_timeout=`` (not the command line's --timeout), an absolute script path that does not
    exist is said in words (it was "[Errno 2] No such file or directory"), and a wait for a
    notification an earlier wait already returned says so (it was "no toolEvent notification
    matching ... within 0.5 s" alone)."""
    project = make_project(tmp_path / "ext")
    (project / "slow.jsonl").write_text(SLOW)
    (project / "test_hints.py").write_text(HINT_TESTS)
    out = run_pytest(project, "-rA", "test_hints.py")
    text = out.stdout + out.stderr
    assert "3 failed" in text, text
    assert ('FAIL line 3: request operate: no answer within 0.3 s, so it was cancelled ($/cancelRequest); to wait '
            'longer, give the step a "timeoutMs" (milliseconds) or pass step_timeout=S') in text, text
    assert "sidecar_script: no session script '" in text and "/nowhere/session.jsonl'" in text, text
    assert "Errno" not in text, text
    assert ('TimeoutError: no toolEvent notification matching {"event": "post"} within 0.5 s; 1 unmatched, nearest at '
            '$.params.event: expected "post", got "pre"; 1 that matches arrived but was matched by an earlier '
            "wait_for_notification; to wait longer, pass timeout=S to this call, or give the client a longer "
            "timeout (the sidecar marker's timeout=S)\n") in text, text


def test_a_project_configured_as_the_readme_says_gets_no_deprecation_warning(tmp_path):
    """pytest-asyncio warns (PytestDeprecationWarning) in every project that leaves
    asyncio_default_fixture_loop_scope unset; the README gives the line to set, and with it a new
    project's sidecar test runs without the warning."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Testing your extension against the sidecar\n", 1)[1].split("\n## ", 1)[0]
    assert "```toml\n" in section, "the README's testing section gives no pytest configuration"
    config = section.split("```toml\n", 1)[1].split("```", 1)[0]
    project = tmp_path / "new"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "new"\nversion = "0"\n\n' + config)
    (project / "test_new.py").write_text(textwrap.dedent('''\
        import pytest


        @pytest.mark.asyncio
        async def test_ping(sidecar):
            assert await sidecar.request("ping") == {}
        '''))
    out = run_pytest(project, "-W", "error::DeprecationWarning")
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "1 passed" in text, text
    assert "asyncio_default_fixture_loop_scope" not in text and "Warning" not in text, text


SCRIPT_OPTION_TYPE_TESTS = '''
def test_server_a_string(sidecar_script):
    sidecar_script("good.jsonl", server="operate-sidecar --log-level error")


def test_env_not_strings(sidecar_script):
    sidecar_script("good.jsonl", env={"X": 1})


def test_step_timeout_zero(sidecar_script):
    sidecar_script("good.jsonl", step_timeout=0)


def test_server_flags_only(sidecar_script):
    sidecar_script("good.jsonl", server=["--log-level", "error"])
'''


def test_sidecar_script_options_of_the_wrong_type_are_refused_by_name(tmp_path):
    """As the marker's options are: ``server="operate-sidecar ..."`` was started letter by letter
    ("No such file or directory: 'o'"), ``env={"X": 1}`` failed with a TypeError from deep in
    ``os``, ``step_timeout=0`` ran with the default time-out; flags without the command (as for the
    marker's ``args``) said only "No such file or directory: '--log-level'"."""
    text = run_tests_file(tmp_path, "test_types.py", SCRIPT_OPTION_TYPE_TESTS)
    assert "4 failed" in text, text
    for message in [
            "sidecar_script: server must be a list of strings, the command and its arguments, got "
            "'operate-sidecar --log-level error'; for this sidecar with flags: server_command('--config', "
            "'settings.toml')\n",
            "sidecar_script: env must be a dict of strings to strings (added to the environment), got {'X': 1}\n",
            "sidecar_script: step_timeout must be a positive number of seconds, got 0\n",
            "sidecar_script: cannot start the server '--log-level error': [Errno 2] No such file or directory: "
            "'--log-level'; the server command starts with its program, then its flags: operate-sidecar --config "
            "settings.toml after --, or server_command('--config', 'settings.toml') from operate_sidecar.testing "
            "in a test\n"]:
        assert message in text, message + "\n" + text
    assert text.count(" - Failed") == 4 and "TypeError" not in text and "def run(" not in text, text


def test_the_readme_names_every_keyword_of_sidecar_script():
    """``cwd=`` was taken (and listed by a misspelt keyword's message) but not in the README."""
    import inspect

    from operate_sidecar.testing import run_session_script

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Testing your extension against the sidecar\n", 1)[1].split("\n## ", 1)[0]
    keywords = [n for n, p in inspect.signature(run_session_script).parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert keywords and [k for k in keywords if f"`{k}=" not in section] == [], keywords


LATE_REQUEST_TESTS = '''
def test_script_whose_server_asks_as_it_ends(sidecar_script):
    sidecar_script("late.jsonl")
'''


def test_a_server_request_answered_wrongly_as_the_script_ends_fails_the_test(tmp_path):
    """The server asked for permission once the script's last step had passed (its client had
    left mid-operate: ``shutdown`` and ``exit`` unanswered), and the script answered with a
    decision the request did not offer: no step judged it, and the test passed. Now it fails with
    the report, the end of the session naming the request and what was wrong."""
    ask = {"json": {"answer": "4", "action_requests": [{"function": "get_weather", "arguments": {"city": "Lima"}}]},
           "delayMs": 50}
    op = {"branchId": "${b}", "instruction": "weather?", "actions": True, "responseFormat": {
        "title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}
    # the decision, one the protocol does not know, is the name of a spare model saved from the answer to
    # initialize: written in the script it would be refused when the script loads
    late = script({"request": "initialize", "params": {"capabilities": {"toolPermission": True}, "settings": {
                      "models": {"m": {"provider": "scripted", "responses": [{"json": {"answer": "3"}}, ask]},
                                 "allow": {"provider": "scripted", "responses": []}},
                      "toolModules": ["operate_sidecar.clients.python.demo_tools"],
                      "toolPolicy": {"get_weather": "ask"}}}, "save": {"given": "capabilities.models.1"}},
                  {"request": "createBranch", "save": {"b": "branchId"}},
                  {"request": "operate", "params": op, "expect": {"result": {"result": {"answer": "3"}}}},
                  {"respond": "requestToolPermission", "result": {"decision": "${given}"}},
                  {"request": "operate", "params": op, "answered": False},
                  {"request": "shutdown", "answered": False},
                  {"notify": "exit"})
    project = make_project(tmp_path / "ext")
    (project / "late.jsonl").write_text(late)
    (project / "test_late.py").write_text(LATE_REQUEST_TESTS)
    out = run_pytest(project, "-rA", "test_late.py")
    text = (out.stdout + out.stderr).replace(str(project) + "/", "")
    assert "1 failed" in text, text
    assert ('FAIL the end of the session (after line 7): after the last step, line 4 answered requestToolPermission '
            '(tool get_weather) with decision "allow", not one of the decisions it offered: allow_once, allow_always, '
            'deny_once, deny_always; the server took it as a deny (to deny, answer "deny_once" or an error)') in text, text
    assert "the end of the session failed in late.jsonl, after all 7 steps passed" in text, text


LOOP_SCOPE_TESTS = '''
import asyncio

import pytest
import pytest_asyncio

SETTINGS = {"models": {"m": {"provider": "scripted", "responses": ["one", "two", "three", "four"]}}}


async def chat(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    out = await sidecar.request("operate", {"branchId": branch, "instruction": "hi", "skipValidation": True,
                                            "workDoneToken": 1})
    await sidecar.wait_for_notification("$/progress", {"token": 1, "value": {"kind": "end"}})
    return out["result"]


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, timeout=20)
async def test_default_loop(sidecar):
    assert await chat(sidecar) == "one"


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SETTINGS, timeout=20)
async def test_default_loop_again(sidecar):
    assert await chat(sidecar) == "one"


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.sidecar(settings=SETTINGS, timeout=20)
async def test_module_loop(sidecar):
    assert await chat(sidecar) == "one"


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.sidecar(settings=SETTINGS, timeout=20)
async def test_session_loop(sidecar):
    assert asyncio.get_running_loop() is sidecar._loop
    assert await chat(sidecar) == "one"


@pytest.mark.asyncio(loop_scope="class")
class TestInAClassLoop:
    @pytest.mark.sidecar(settings=SETTINGS, timeout=20)
    async def test_class_loop(self, sidecar):
        assert await chat(sidecar) == "one"


@pytest_asyncio.fixture(loop_scope="module")
async def branch_on_the_module_loop(sidecar):
    return (await sidecar.request("createBranch"))["branchId"]


@pytest.mark.asyncio
@pytest.mark.sidecar(timeout=20)
async def test_a_fixture_of_mine_on_another_loop(branch_on_the_module_loop):
    pass
'''


@pytest.mark.parametrize("ini", [
    'asyncio_default_fixture_loop_scope = "function"',
    'asyncio_default_fixture_loop_scope = "module"',
    'asyncio_default_fixture_loop_scope = "session"',
    'asyncio_default_fixture_loop_scope = "session"\nasyncio_default_test_loop_scope = "module"',
])
def test_the_fixture_runs_on_the_tests_loop_whatever_the_loop_scopes(tmp_path, ini):
    """The sidecar is started on the loop the test runs in: with a fixture loop scope of module or
    session, or a test marked ``loop_scope="module"``, it was started on another loop, which does
    not run while the test does, so every request of the test timed out. A fixture of the test's
    own that uses it on another loop fails at once, naming the settings (not a time-out)."""
    project = make_project(tmp_path / "ext")
    (project / "pyproject.toml").write_text(f"[tool.pytest.ini_options]\n{ini}\n")
    (project / "test_loops.py").write_text(LOOP_SCOPE_TESTS)
    out = run_pytest(project, "-rA", "test_loops.py")
    text = out.stdout + out.stderr
    if "asyncio_default_test_loop_scope" in ini:  # every test on the module's loop: that fixture's too
        assert out.returncode == 0 and "6 passed" in text, text
        return
    assert "5 passed, 1 error" in text, text
    assert ("request createBranch: the sidecar client was started on another event loop than this one, and reads "
            "the sidecar's answers only while its own loop runs") in text, text
    assert "asyncio_default_fixture_loop_scope" in text and "TimeoutError" not in text, text


CANCEL_THE_AWAITING_TASK_TESTS = '''
import asyncio

import pytest

SLOW = {"models": {"m": {"provider": "scripted", "responses": [{"delayMs": 60000, "text": "never"},
                                                                {"text": "next"}]}}}


async def operate(sidecar, branch, token=None, **kw):
    params = {"branchId": branch, "instruction": "hi", "skipValidation": True}
    if token is not None:
        params["workDoneToken"] = token
    return await sidecar.request("operate", params, **kw)


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SLOW, timeout=60)
async def test_task_cancel(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    task = asyncio.ensure_future(operate(sidecar, branch, token=1))
    await sidecar.wait_for_notification("$/progress", {"token": 1, "value": {"kind": "begin"}})
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await operate(sidecar, branch, timeout=20))["result"] == "next"


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SLOW, timeout=60)
async def test_wait_for(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(operate(sidecar, branch), 0.5)
    assert (await operate(sidecar, branch, timeout=20))["result"] == "next"
'''


def test_cancelling_the_task_that_awaits_a_request_cancels_it_on_the_sidecar(tmp_path):
    """``task.cancel()``, or ``asyncio.wait_for`` around ``sidecar.request(...)``, sent no
    ``$/cancelRequest`` (the client's future is shielded): the operate ran on, holding its branch,
    and the next operate on it waited its minute. It is cancelled on the sidecar."""
    text = run_tests_file(tmp_path, "test_task_cancel.py", CANCEL_THE_AWAITING_TASK_TESTS)
    assert "2 passed" in text, text


SCRIPT_CWD_AND_SCRIPTED_TYPE_TESTS = '''
def test_cwd_a_number(sidecar_script):
    sidecar_script("good.jsonl", cwd=5)


def test_scripted_a_string(sidecar_script):
    sidecar_script("good.jsonl", scripted="yes")


def test_cwd_a_path(sidecar_script, tmp_path):
    sidecar_script("good.jsonl", cwd=tmp_path, scripted=False)
'''


def test_sidecar_script_cwd_and_scripted_of_the_wrong_type_are_refused_by_name(tmp_path):
    """``cwd=5`` failed with a TypeError traceback from deep in the start of the server."""
    text = run_tests_file(tmp_path, "test_cwd_types.py", SCRIPT_CWD_AND_SCRIPTED_TYPE_TESTS)
    assert "2 failed, 1 passed" in text, text
    for message in ["sidecar_script: cwd must be a folder's path (a str or a pathlib.Path), got 5\n",
                    "sidecar_script: scripted must be True or False, got 'yes'\n"]:
        assert message in text, message + "\n" + text
    assert text.count(" - Failed") == 2 and "TypeError" not in text and "def run(" not in text, text
