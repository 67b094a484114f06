"""Session scripts at their edges: sessions whose client cancelled during a permission prompt,
let one time out or answered it wrongly, recorded in a folder reached through a symlink; a
literal "*"; how a server ends after the script's own exit; Ctrl+C twice; lines that would
break the loader; what a failure names. Real servers over real pipes where it is end to end."""

from __future__ import annotations

import contextlib
import json
import threading
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from operate_sidecar.clients.python.client import RpcError, SidecarClient
from operate_sidecar.server.script.matcher import Mismatch, first_mismatch, notification_miss
from operate_sidecar.server.script.runner import INTERRUPT_GRACE_S, MAX_TIMEOUT_MS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import wedge_tools  # noqa: E402

TIMEOUT = 120
PY = sys.executable
WRITE = {"json": {"action_requests": [{"function": "write_file", "arguments": {"path": "n.txt", "content": "x"}}]}}


def record(path: Path, session, cwd: Path | None = None, env: dict | None = None) -> None:
    argv = [PY, "-m", "operate_sidecar.server", "--record", str(path)]
    with SidecarClient(argv=argv, cwd=str(cwd) if cwd else None, env=env, stderr=subprocess.DEVNULL) as c:
        session(c)
        assert c.close() == 0


def replay(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "operate_sidecar.server", "replay", *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd)


def lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def ask_to_write(ws: Path, *responses, **settings) -> dict:
    return {"capabilities": {"toolPermission": True}, "workspaceFolders": [str(ws)],
            "settings": {"models": {"m": {"provider": "scripted", "responses": [WRITE, *responses]}},
                         "toolPolicy": {"write_file": "ask"}, **settings}}


def server_cancelled(c: SidecarClient) -> bool:
    """Wait until the server withdrew its request to the client ($/cancelRequest)."""
    return c.wait_for(lambda notes: any(m == "$/cancelRequest" for m, _ in notes), timeout=30)


def test_a_cancel_that_came_while_a_permission_prompt_was_open_replays_as_recorded(tmp_path):
    rec, ws, fresh = tmp_path / "cancelperm.jsonl", tmp_path / "ws", tmp_path / "fresh"
    ws.mkdir(), fresh.mkdir()

    def session(c: SidecarClient) -> None:
        c.request("initialize", ask_to_write(ws, "later"), timeout=60)

        def permission(_params):  # the user cancels while the prompt is open; the prompt answers afterwards
            c.cancel(op.id)
            withdrawn.append(server_cancelled(c))  # (asserted below: an assert here only fails the answer)
            asked.set()
            return {"decision": "allow_once"}

        withdrawn: list[bool] = []
        asked = threading.Event()

        c.on_request("requestToolPermission", permission)
        bid = c.request("createBranch")["branchId"]
        op = c.request_async("operate", {"branchId": bid, "instruction": "w", "actions": True, "workDoneToken": "k"})
        with pytest.raises(RpcError) as cancelled:
            op.result(30)
        assert cancelled.value.code == -32800
        assert asked.wait(30) and withdrawn == [True]
        assert c.request("operate", {"branchId": bid, "instruction": "again", "skipValidation": True},
                         timeout=30)["result"] == "later"

    record(rec, session, cwd=ws)
    steps = lines(rec)
    operate = next(s for s in steps if s.get("request") == "operate")
    assert operate["cancelAfterServerRequests"] == 1
    assert [s for s in steps if "respond" in s] == [{"respond": "requestToolPermission", "match": {
        "tool": "write_file", "arguments": {"path": "n.txt", "content": "x"}}, "unanswered": True}]
    out = replay(rec, cwd=fresh)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (fresh / "n.txt").exists()


def test_a_permission_prompt_that_timed_out_replays_unanswered(tmp_path):
    rec, ws, fresh = tmp_path / "timedout.jsonl", tmp_path / "ws", tmp_path / "fresh"
    ws.mkdir(), fresh.mkdir()

    def session(c: SidecarClient) -> None:
        c.request("initialize", ask_to_write(ws, "next", permissionTimeoutMs=300), timeout=60)
        # the user answers once the server has given up waiting (it denied the call)
        c.on_request("requestToolPermission", lambda _p: server_cancelled(c) and {"decision": "allow_once"})
        bid = c.request("createBranch")["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "w", "actions": True}, timeout=60)
        assert out["result"]["action_responses"][0]["output"]["reason"] == "permission request timed out"
        assert c.request("operate", {"branchId": bid, "instruction": "again", "skipValidation": True},
                         timeout=30)["result"] == "next"

    record(rec, session, cwd=ws)
    assert [s.get("unanswered") for s in lines(rec) if "respond" in s] == [True]
    out = replay(rec, cwd=fresh)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "leaves it unanswered" in out.stdout


def test_what_a_faulty_client_sent_is_recorded_raw_and_replays(tmp_path):
    rec, ws = tmp_path / "faulty.jsonl", tmp_path / "ws"
    ws.mkdir()
    tool = {"name": "lookup", "description": "d", "inputSchema": {"type": "object",
                                                                   "properties": {"key": {"type": "string"}}}}
    lookup = {"json": {"action_requests": [{"function": "lookup", "arguments": {"key": "a"}}]}}

    def session(c: SidecarClient) -> None:
        init = ask_to_write(ws, lookup)
        init["capabilities"]["clientTools"] = True
        c.request("initialize", init, timeout=60)
        c.request("registerClientTools", {"tools": [tool]})
        c.on_request("requestToolPermission", lambda _p: {"decision": "allow"})   # not one of the options
        c.on_request("invokeClientTool", lambda _p: {"result": "A"})              # not {"output": ...}
        bid = c.request("createBranch")["branchId"]
        for _ in range(2):
            c.request("operate", {"branchId": bid, "instruction": "w", "actions": True}, timeout=60)
        with pytest.raises(RpcError):
            c.request("listBranches", "oops")                                    # params not an object

    record(rec, session, cwd=ws)
    raw = [s for s in lines(rec) if s.get("raw")]
    assert [s.get("request") or s.get("respond") for s in raw] == [
        "requestToolPermission", "invokeClientTool", "listBranches"]
    out = replay(rec, cwd=ws)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (ws / "n.txt").exists()   # taken as a deny, as when recorded


def test_a_literal_star_is_recorded_escaped_and_matches_only_a_star(tmp_path):
    assert first_mismatch("$*", "anything") is not None and first_mismatch("$*", "*") is None
    assert first_mismatch("$$*", "$*") is None and first_mismatch("*", "anything") is None
    rec = tmp_path / "star.jsonl"

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": {"m": {"provider": "scripted", "responses": ["*", "$*"]}}}},
                  timeout=60)
        bid = c.request("createBranch")["branchId"]
        for _ in range(2):
            c.request("operate", {"branchId": bid, "instruction": "x", "skipValidation": True}, timeout=30)

    record(rec, session)
    assert [s["expect"]["result"]["result"] for s in lines(rec) if s.get("request") == "operate"] == ["$*", "$$*"]
    assert replay(rec).returncode == 0
    changed = rec.read_text().replace('"responses": ["*", "$*"]', '"responses": ["not a star", "$*"]')
    (tmp_path / "changed.jsonl").write_text(changed)
    out = replay(tmp_path / "changed.jsonl")
    assert out.returncode == 1 and 'expected "*", got "not a star"' in out.stdout, out.stdout


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_a_session_recorded_in_a_folder_reached_through_a_symlink_writes_both_paths_as_cwd(tmp_path):
    real, fresh, rec = tmp_path / "real", tmp_path / "fresh", tmp_path / "sym.jsonl"
    (real / "ws").mkdir(parents=True), fresh.mkdir()
    (tmp_path / "link").symlink_to(real)
    logical = tmp_path / "link" / "ws"   # the path the editor (and $PWD) name it by

    def session(c: SidecarClient) -> None:
        init = {"workspaceFolders": [str(logical)], "settings": {
            "models": {"m": {"provider": "scripted", "responses": [WRITE]}}, "toolPolicy": {"write_file": "allow"}}}
        c.request("initialize", init, timeout=60)
        bid = c.request("createBranch")["branchId"]
        c.request("operate", {"branchId": bid, "instruction": "w", "actions": True}, timeout=60)

    record(rec, session, cwd=logical, env={**os.environ, "PWD": str(logical)})
    assert str(tmp_path) not in rec.read_text()
    (real / "ws" / "n.txt").unlink()
    out = replay(rec, cwd=fresh)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (fresh / "n.txt").read_text() == "x" and not (real / "ws" / "n.txt").exists()


OWN_END = [{"request": "initialize"}, {"request": "shutdown", "expect": {"result": None}}, {"notify": "exit"}]


@pytest.mark.parametrize("steps, exit_code, problem", [
    (OWN_END, "$?", None),
    (OWN_END, "3", "after the script's exit (line 3), the server exited with code 3 (expected 0: exit after shutdown)"),
    ([OWN_END[0], OWN_END[2]], "$?", None),   # exit without shutdown: 1, as the protocol says
])
def test_how_the_server_ends_after_the_scripts_own_exit_is_judged(tmp_path, steps, exit_code, problem):
    script = tmp_path / "own.jsonl"
    script.write_text("".join(json.dumps(s) + "\n" for s in steps))
    wrapper = ["sh", "-c", f'"$0" -m operate_sidecar.server; exit {exit_code}', PY]   # the real server under it
    out = replay(script, "--", *wrapper)
    if problem is None:
        assert out.returncode == 0, out.stdout + out.stderr
    else:
        assert out.returncode == 1 and f"FAIL the end of the session (after line 3): {problem}" in out.stdout, \
            out.stdout
        assert "the end of the session failed (own.jsonl), after all 3 steps passed" in out.stdout


IGNORES_SIGTERM = textwrap.dedent('''
    import json, os, signal, sys
    signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1] + ".term", "w").close())  # and goes on
    open(sys.argv[1], "w").write(str(os.getpid()))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        line = inp.readline()
        if not line:
            signal.pause()
        n = int(line.split(b":")[1]); inp.readline()
        msg = json.loads(inp.read(n))
        if msg.get("method") == "initialize":  # and nothing else: the next step waits
            body = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": {}}).encode()
            out.write(b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body); out.flush()
''')


@contextlib.contextmanager
def _replay_waiting_on_a_server_ignoring_sigterm(tmp_path):
    """A replay (in a session of its own) whose server, ``IGNORES_SIGTERM``, answered its
    ``initialize`` and leaves its ``ping`` waiting: yields (the replay's process, the server's
    pid, the replay's output file, the server's pid file). On the way out the replay is killed
    if it still runs, and the server if it is still alive."""
    script = tmp_path / "s.jsonl"
    script.write_text(json.dumps({"request": "initialize"}) + "\n" + json.dumps({"request": "ping"}) + "\n")
    pidfile, log = tmp_path / "pid", tmp_path / "out"
    with open(log, "wb") as sink:
        replay_ = subprocess.Popen([PY, "-m", "operate_sidecar.server", "replay", str(script), "--",
                                    PY, "-c", IGNORES_SIGTERM, str(pidfile)],
                                   stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    server_pid = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while "PASS line 1" not in log.read_text():  # the ping is waiting
            assert replay_.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        server_pid = int(pidfile.read_text())
        yield replay_, server_pid, log, pidfile
    finally:
        if replay_.poll() is None:
            os.killpg(replay_.pid, signal.SIGKILL)
            replay_.wait(TIMEOUT)
        if server_pid and not wedge_tools.gone(server_pid, 0):
            os.kill(server_pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process sessions, and /proc to see which live")
def test_ctrl_c_twice_still_kills_a_server_that_ignores_sigterm(tmp_path):
    with _replay_waiting_on_a_server_ignoring_sigterm(tmp_path) as (replay_, server_pid, log, pidfile):
        os.killpg(replay_.pid, signal.SIGINT)
        term = Path(str(pidfile) + ".term")
        deadline = time.monotonic() + TIMEOUT
        while not term.exists():  # the replay sent SIGTERM: it is in its grace before SIGKILL
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        os.killpg(replay_.pid, signal.SIGINT)  # the user presses Ctrl+C again
        code = replay_.wait(TIMEOUT)
        assert code == 130, log.read_text()
        assert wedge_tools.gone(server_pid), "the server outlived the replay interrupted twice"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process sessions, and /proc to see which live")
def test_the_client_kills_its_server_when_interrupted_during_the_grace_after_sigterm(tmp_path, monkeypatch):
    from operate_sidecar.clients.python import client as client_module

    pidfile = tmp_path / "pid"
    c = SidecarClient(argv=[PY, "-c", IGNORES_SIGTERM, str(pidfile)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT
    while not pidfile.exists() or not pidfile.read_text():  # its SIGTERM handler is installed
        assert c.proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)

    def second_ctrl_c(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(client_module.time, "sleep", second_ctrl_c)  # arrives while it waits out the grace
    try:
        with pytest.raises(KeyboardInterrupt):
            c.terminate(INTERRUPT_GRACE_S)
    finally:
        monkeypatch.undo()
        alive = not wedge_tools.gone(c.proc.pid)
        c.kill()
    assert not alive, "the server outlived the interrupted terminate()"


BREAKING_LINES = [
    ('{"expectNotification": "x", "timeoutMs": 1e300}',
     f"timeoutMs must be a positive number of milliseconds, at most {MAX_TIMEOUT_MS} (one day), got 1e+300"),
    ('{"request": "ping", "params": {"x": NaN}}', "not JSON: NaN is not a JSON number"),
    ('{"request": "ping", "params": {"x": -Infinity}}', "not JSON: -Infinity is not a JSON number"),
    ('{"request": "ping", "params": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"request": "ping", "params": ' + "[" * 500 + "]" * 500 + "}", "nested too deeply"),
]


@pytest.mark.parametrize("text, problem", BREAKING_LINES,
                         ids=["huge-timeout", "nan", "infinity", "deep-100000", "deep-500"])
def test_a_line_that_would_break_the_loader_is_a_malformed_script(tmp_path, text, problem):
    script = tmp_path / "bad.jsonl"
    script.write_text('{"request": "initialize"}\n' + text + "\n")
    out = replay(script)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith(f"operate-sidecar replay: {script}:2: ") and problem in out.stderr, out.stderr


def test_the_pytest_plugin_says_what_and_where_for_such_a_line(tmp_path):
    for i, (text, _) in enumerate(BREAKING_LINES):
        (tmp_path / f"bad{i}.jsonl").write_text('{"request": "initialize"}\n' + text + "\n")
    (tmp_path / "test_scripts.py").write_text(textwrap.dedent(f'''
        import pytest

        @pytest.mark.parametrize("i", range({len(BREAKING_LINES)}))
        def test_script(sidecar_script, i):
            sidecar_script(f"bad{{i}}.jsonl")
    '''))
    out = subprocess.run([PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:randomly", str(tmp_path)],
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert f"{len(BREAKING_LINES)} failed" in out.stdout, out.stdout[-3000:]
    assert "Traceback" not in out.stdout and "Error:" not in out.stdout.replace("ScriptError", ""), out.stdout[-3000:]
    for i, (_, problem) in enumerate(BREAKING_LINES):
        assert f"sidecar_script: {tmp_path / f'bad{i}.jsonl'}:2: " in out.stdout, out.stdout[-3000:]


def test_a_missed_notification_names_the_candidate_that_matched_most(tmp_path):
    pattern = {"event": "post", "args": "a", "result": "HELLO"}
    near, far = {"event": "post", "args": "a", "result": "hello"}, {"event": "post", "args": "b", "result": "bye"}
    assert "at $.params.result: expected \"HELLO\", got \"hello\"" in notification_miss(
        pattern, [(near, None), (far, None)])
    # end to end: two reads, the step means the first (its file's text differs in case only)
    (tmp_path / "a.txt").write_text("hello\n"), (tmp_path / "b.txt").write_text("bye\n")
    reads = {"json": {"summary": "s", "action_requests": [
        {"function": "read_file", "arguments": {"path": p}} for p in ("a.txt", "b.txt")]}}
    form = {"title": "R", "type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    steps = [{"request": "initialize", "params": {"workspaceFolders": ["${cwd}"], "settings": {
                 "models": {"m": {"provider": "scripted", "responses": [reads]}}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "read", "actions": True,
                                               "actionStrategy": "sequential", "responseFormat": form}},
             {"expectNotification": "toolEvent", "timeoutMs": 1000, "match": {
                 "event": "post", "tool": "read_file", "argsSummary": '{"path":"a.txt"}',
                 "resultSummary": '{"path":"a.txt","offset":1,"lines":1,"content":"HELLO\\n","nextOffset":null,'
                                  '"truncated":false}'}}]
    script = tmp_path / "nearest.jsonl"
    script.write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = replay(script, cwd=tmp_path)
    fail = next((ln for ln in out.stdout.splitlines() if ln.startswith("FAIL line 4")), out.stdout)
    assert "nearest at $.params.resultSummary" in fail and '\\"content\\":\\"hello\\\\n\\"' in fail, fail


def test_a_difference_past_the_cut_off_is_shown_with_what_surrounds_it(tmp_path):
    mm = Mismatch("$.result", "A" * 300 + " END.", "A" * 300 + " end.")
    expected, got = mm.describe().split(": expected ")[1].split(", got ")
    assert expected.startswith("…") and expected.endswith(' END."') and got.startswith("…") and got.endswith(' end."')
    assert len(expected) <= 160 and len(got) <= 160
    middle = Mismatch("$.x", "B" * 200 + "x" + "B" * 200, "B" * 200 + "y" + "B" * 200).describe()
    assert middle.count("…") == 4 and "Bx" in middle and "By" in middle
    # end to end: a long answer that differs at its end
    steps = [{"request": "initialize", "params": {"settings": {"models": {"m": {
                 "provider": "scripted", "responses": ["A" * 300 + " end."]}}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": {"branchId": "${b}", "instruction": "x", "skipValidation": True},
              "expect": {"result": {"result": "A" * 300 + " END."}}}]
    script = tmp_path / "long.jsonl"
    script.write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = replay(script)
    assert out.returncode == 1 and ' END.", got …' in out.stdout and out.stdout.count(' end."') == 1, out.stdout


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_replay_stopped_by_sigterm_or_sighup_ends_its_server_too(tmp_path, sig, code):
    """A CI job's time-out (``timeout``, SIGTERM) or a closed terminal (SIGHUP) reaches the replay,
    not its server (in a session of its own): the replay ends it as on Ctrl+C (SIGTERM, then
    SIGKILL 2 s later: this one ignores SIGTERM) and exits 128 + the signal. A wedged server
    was left running, its parent gone."""
    with _replay_waiting_on_a_server_ignoring_sigterm(tmp_path) as (replay_, server_pid, log, _):
        replay_.send_signal(sig)  # to the replay alone, as `timeout` sends it
        got = replay_.wait(TIMEOUT)
        out = log.read_text()
        assert got == code, out
        assert f"stopped by {signal.Signals(sig).name} after 1 step(s)" in out and "Traceback" not in out, out
        assert wedge_tools.gone(server_pid), "the server outlived the replay"


def test_a_lone_surrogate_is_recorded_replayed_and_reported_without_a_traceback(tmp_path):
    """A client writing JSON as JavaScript does sends a string cut in the middle of an emoji as
    a lone surrogate escape (``"\\ud83d"``): valid JSON, which the server serves. ``--record``
    could not encode it: the server stopped answering and the recording was lost; ``replay``
    could not send it, nor print a report line holding one (a traceback each)."""
    rec = tmp_path / "s.jsonl"
    settings = {"settings": {"models": {"m": {"provider": "scripted", "responses": ["ok"]}}}}

    def session(c):
        c.request("initialize", settings, timeout=30)
        branch = c.request("createBranch", {}, timeout=30)["branchId"]
        assert c.request("operate", {"branchId": branch, "instruction": "cut emoji: \ud83d"}, timeout=30)["result"] == "ok"

    record(rec, session)
    assert '"cut emoji: \\ud83d"' in rec.read_text()  # its escape: the line is UTF-8
    r = replay(rec)
    assert r.returncode == 0, r.stdout + r.stderr
    # a script's expectation holding one: the failure is reported, the half shown as its escape
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request": "initialize"}\n{"request": "ping", "expect": {"result": {"x": "\\udfff"}}}\n')
    r = replay(bad)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert 'FAIL line 2' in r.stdout and '\\udfff' in r.stdout, r.stdout


def test_a_report_whose_reader_left_ends_the_replay_quietly_with_its_code(tmp_path):
    """``replay … | head -1``: the rest of the report has no reader; the replay goes on to its
    end (the server ended as usual) and its exit code, without a BrokenPipeError traceback."""
    script = tmp_path / "s.jsonl"
    script.write_text("".join(json.dumps(s) + "\n" for s in [{"request": "initialize"}, *[{"request": "ping"}] * 30]))
    p = subprocess.Popen([PY, "-m", "operate_sidecar.server", "replay", str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().startswith(b"PASS line 1")
        p.stdout.close()  # the reader leaves
        err = p.stderr.read().decode()
        assert p.wait(TIMEOUT) == 0, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(TIMEOUT)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_respond_error_without_a_message_is_a_malformed_script(tmp_path):
    script = tmp_path / "s.jsonl"
    script.write_text('{"request": "initialize"}\n{"respond": "requestToolPermission", "error": {"code": 1}}\n')
    r = replay(script)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.strip() == (f"operate-sidecar replay: {script}:2: a respond error is a JSON-RPC error, "
                                '{"code": integer, "message": "text", "data"?: any}, got {"code": 1}'), r.stderr
