"""How `operate-sidecar replay` ends its server: a wrapper that forks rather than execs, a server
that does not answer `shutdown`, Ctrl+C. Real servers over real pipes; a server "that does not
answer" is the real one with its event loop blocked by a tool (tests/wedge_tools.py). The times
asserted are hang checks (the replay used to take 20 s, or leave the server running), not speed
targets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import wedge_tools  # noqa: E402

from operate_sidecar.server.script.runner import Runner, format_report, parse_script  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists() or os.name != "posix",
                                reason="process sessions, and /proc to see which processes live")

TIMEOUT = 60
HANG = 15.0  # seconds: a hang check, under the 20 s the end of a replay used to take (it takes ~4 s)
PY = sys.executable
#: a wrapper that forks the server and waits for it (no exec), as `sh -c "operate-sidecar ..."` or
#: `uv run operate-sidecar` do; it reports the server's exit code on its stderr
WRAPPER = ["sh", "-c", '"$0" -m operate_sidecar.server --log-level error; echo "wrapper: server exited $?" >&2; exit 7',
           PY]


def wedged_steps(trigger: Path) -> list[str]:
    steps = [{"request": "initialize", "params": {"clientInfo": {"name": "t"},
                                                 "settings": wedge_tools.settings(str(trigger))}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "arm", "actions": True},
              "expect": {"result": {"result": {"action_responses": [{"output": "armed"}]}}}}]
    return [json.dumps(s) for s in steps]


def run_wedged(tmp_path: Path, argv: list[str] | None) -> tuple[Runner, int, float]:
    """Replay a session that passes; once its last step passed, the server's loop blocks (it
    answers nothing more). Returns the runner, the server's pid and the seconds from the block
    to the replay's return."""
    trigger = tmp_path / "wedge"
    seen: dict[str, float] = {}

    def on_result(res) -> None:
        if res.step.line == 3 and res.ok:
            seen["pid"] = wedge_tools.pull(str(trigger))
            seen["blocked"] = time.monotonic()

    # the steps get TIMEOUT (a first createBranch under a loaded parallel run took over 3 s); the
    # shutdown at the end is then waited for SHUTDOWN_WAIT_S (5 s), the replay's own bound
    runner = Runner(parse_script(wedged_steps(trigger)), argv, step_timeout=TIMEOUT, env=wedge_tools.server_env(),
                    on_result=on_result)
    runner.run()
    assert "blocked" in seen, format_report(runner)  # the steps passed, so the server's loop was blocked
    elapsed = time.monotonic() - seen["blocked"]
    assert not runner.failed, format_report(runner)
    return runner, int(seen["pid"]), elapsed


def test_a_wrapper_that_forks_is_ended_with_the_server_under_it(tmp_path):
    runner, server_pid, elapsed = run_wedged(tmp_path, WRAPPER)
    wrapper_pid = runner.client.proc.pid
    assert server_pid != wrapper_pid  # the wrapper forked: the server is its child, not itself
    assert wedge_tools.gone(server_pid), f"the server {server_pid} outlived the replay"
    assert not wedge_tools.alive(wrapper_pid)
    assert elapsed < HANG, f"the replay took {elapsed:.1f} s to end a server that answers nothing"
    assert runner.ending == ("the server did not answer shutdown within 5 s; "
                             "killed it and every process of its session")


def test_a_server_that_does_not_answer_shutdown_is_killed_soon_and_the_report_says_so(tmp_path):
    runner, server_pid, elapsed = run_wedged(tmp_path, None)
    assert elapsed < HANG, f"the replay waited {elapsed:.1f} s for a server that answers nothing"
    assert runner.client.proc.returncode == -signal.SIGKILL
    assert wedge_tools.gone(server_pid)
    report = format_report(runner)
    assert report.splitlines()[-2:] == [
        "all 3 steps passed in script",
        "note: the server did not answer shutdown within 5 s; killed it and every process of its session"]


def test_a_wrapper_and_a_server_that_exit_normally_are_not_signalled(tmp_path):
    script = [{"request": "initialize", "params": {"clientInfo": {"name": "t"}}},
              {"request": "createBranch"}, {"request": "ping"}]
    runner = Runner(parse_script(json.dumps(s) for s in script), WRAPPER, step_timeout=30)
    assert runner.run(), format_report(runner)
    assert runner.ending is None
    assert runner.client.proc.returncode == 7  # the wrapper's own exit, not a signal
    assert "wrapper: server exited 0" in runner.stderr_tail  # shutdown + exit: code 0


def test_a_script_that_shuts_the_server_down_itself_is_judged_and_left_to_exit(tmp_path):
    script = [{"request": "initialize"}, {"request": "shutdown", "expect": {"result": None}}, {"notify": "exit"}]
    runner = Runner(parse_script(json.dumps(s) for s in script), WRAPPER, step_timeout=TIMEOUT)
    # the steps pass and the server under the wrapper exits 0; the wrapper's own exit 7 is how the
    # command shut down, which such a script checks: it fails the end of the session
    assert not runner.run()
    assert [r.ok for r in runner.results] == [True, True, True, False], format_report(runner)
    assert "the server exited with code 7 (expected 0: exit after shutdown)" in runner.results[-1].detail
    assert runner.ending is None
    assert "wrapper: server exited 0" in runner.stderr_tail
    bad = [{"request": "initialize"}, {"request": "shutdown", "expect": {"result": {"no": 1}}}, {"notify": "exit"}]
    runner = Runner(parse_script(json.dumps(s) for s in bad), WRAPPER, step_timeout=TIMEOUT)
    assert not runner.run()
    assert [r.ok for r in runner.results] == [True, False, True, False]


NEVER_SHUTS_DOWN = textwrap.dedent('''
    import json, os, sys, time
    open(sys.argv[1], "w").write(str(os.getpid()))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        line = inp.readline()
        if not line:
            time.sleep(60)  # ignores the end of its input too
            break
        n = int(line.split(b":")[1]); inp.readline()
        msg = json.loads(inp.read(n))
        if "id" in msg and msg.get("method") != "shutdown":
            body = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": {}}).encode()
            out.write(b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body); out.flush()
''')


def test_the_command_line_says_the_server_did_not_answer_shutdown_and_ends_soon(tmp_path):
    script = tmp_path / "s.jsonl"
    script.write_text(json.dumps({"request": "ping"}) + "\n")
    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    out = subprocess.run([PY, "-m", "operate_sidecar.server", "replay", "--timeout", "2", str(script), "--",
                          "sh", "-c", '"$0" -c "$1" "$2"; exit $?', PY, NEVER_SHUTS_DOWN, str(pidfile)],
                         capture_output=True, text=True, timeout=TIMEOUT)
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stdout + out.stderr  # every step passed: the note does not fail it
    assert out.stdout.splitlines()[-2:] == [
        "note: the server did not answer shutdown within 2 s; killed it and every process of its session",
        "all 1 steps passed (s.jsonl)"]
    assert elapsed < HANG
    assert wedge_tools.gone(int(pidfile.read_text()))


def test_ctrl_c_ends_the_server_it_no_longer_shares_the_terminals_job_with(tmp_path):
    """A terminal's Ctrl+C goes to the replay's process group only: the server (in a session of
    its own) must be ended by the replay."""
    steps = [{"request": "initialize", "params": {"settings": {"models": {"m": {
                 "provider": "scripted", "responses": [{"text": "late", "delayMs": 60000}]}}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "wait", "skipValidation": True}}]
    script = tmp_path / "s.jsonl"
    script.write_text("".join(json.dumps(s) + "\n" for s in steps))
    pidfile, out = tmp_path / "pid", tmp_path / "out"
    server = ('import os, sys; open(sys.argv[1], "w").write(str(os.getpid())); '
              'os.execv(sys.executable, [sys.executable, "-m", "operate_sidecar.server"])')
    with open(out, "wb") as sink:
        replay = subprocess.Popen([PY, "-m", "operate_sidecar.server", "replay", str(script), "--",
                                   "sh", "-c", '"$0" -c "$1" "$2"; exit $?', PY, server, str(pidfile)],
                                  stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while "PASS line 2" not in out.read_text():  # the operate is being sent: the model waits 60 s
            assert replay.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        server_pid = int(pidfile.read_text())
        os.killpg(replay.pid, signal.SIGINT)  # what Ctrl+C does: the replay's whole foreground job
        t0 = time.monotonic()
        code = replay.wait(TIMEOUT)
        elapsed = time.monotonic() - t0
    finally:
        if replay.poll() is None:
            os.killpg(replay.pid, signal.SIGKILL)
            replay.wait(TIMEOUT)
    text = out.read_text()
    assert code == 130, text
    assert "operate-sidecar replay: interrupted after 2 step(s)" in text
    assert "Traceback" not in text
    assert elapsed < HANG
    assert wedge_tools.gone(server_pid), "the server outlived the interrupted replay"
