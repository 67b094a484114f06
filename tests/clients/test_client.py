"""clients/python/client.py: the stdlib scripted-session client."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from operate_sidecar.clients.python.client import NoAnswer, RpcError, SidecarClient  # noqa: E402

FAKE = textwrap.dedent('''
    import json, sys
    out = sys.stdout.buffer
    def send(obj, extra=b""):
        body = json.dumps(obj).encode()
        out.write(b"Content-Length: %d\\r\\n" % len(body) + extra + b"\\r\\n" + body); out.flush()
    def read():
        n = int(sys.stdin.buffer.readline().split(b":")[1]); sys.stdin.buffer.readline()
        return json.loads(sys.stdin.buffer.read(n))
    mode = sys.argv[1]
    req = read()
    if mode == "ask":
        send({"jsonrpc": "2.0", "id": "s1", "method": "unknownToClient", "params": {}})
        send({"jsonrpc": "2.0", "id": "s2", "method": "known", "params": {"x": 1}})
        answers = [read(), read()]
        send({"jsonrpc": "2.0", "method": "note", "params": {"n": 1}})
        send({"jsonrpc": "2.0", "id": req["id"], "result": answers})
    elif mode == "garbage":
        out.write(b"hello from a stray print\\n"); out.flush()
    elif mode == "headers":
        send({"jsonrpc": "2.0", "id": req["id"], "result": "ok"}, b"Content-Type: application/json\\r\\n")
    elif mode == "error":
        send({"jsonrpc": "2.0", "id": req["id"], "error": {"code": -32010, "message": "m", "data": {"d": 1}}})
    elif mode == "echo":  # answers every request with its params, until stdin ends
        while True:
            send({"jsonrpc": "2.0", "id": req["id"], "result": req.get("params")})
            req = read()
    elif mode == "deaf":  # closes its input, then answers: it reads nothing more, and stays
        import os, time
        os.close(0)
        send({"jsonrpc": "2.0", "id": req["id"], "result": "deaf now"})
        time.sleep(120)
    elif mode == "notify":  # a notification, then the answer
        send({"jsonrpc": "2.0", "method": "note", "params": {"n": 1}})
        send({"jsonrpc": "2.0", "id": req["id"], "result": "answered"})
    sys.stdin.buffer.read()
''')


def fake(mode: str, **kw) -> SidecarClient:
    return SidecarClient(argv=[sys.executable, "-c", FAKE, mode], **kw)


def test_server_requests_are_answered_on_a_worker_and_unknown_ones_get_method_not_found():
    c = fake("ask")
    notes = []
    c.on_notification("note", notes.append)
    c.on_request("known", lambda p: {"echo": p})
    answers = c.request("go", {}, timeout=10)
    by_id = {a["id"]: a for a in answers}
    assert by_id["s1"]["error"]["code"] == -32601
    assert by_id["s2"]["result"] == {"echo": {"x": 1}}
    assert c.wait_for(lambda n: ("note", {"n": 1}) in n, 10) and notes == [{"n": 1}]
    c.kill()


def test_error_responses_raise_rpc_error_with_code_message_data():
    c = fake("error")
    with pytest.raises(RpcError) as ei:
        c.request("x", timeout=10)
    assert (ei.value.code, ei.value.message, ei.value.data) == (-32010, "m", {"d": 1})
    c.kill()


def test_strict_mode_reports_anything_but_exact_frames():
    c = fake("garbage")
    with pytest.raises(RpcError) as ei:  # the reader stops; waiting requests fail at once
        c.request("x", timeout=10)
    assert ei.value.code == -32099
    assert c.stream_errors and "stray print" in c.stream_errors[0]
    c.kill()
    c2 = fake("headers")
    with pytest.raises(RpcError):
        c2.request("x", timeout=10)
    assert "Content-Type" in c2.stream_errors[0]
    c2.kill()
    c3 = fake("headers", strict=False)
    assert c3.request("x", timeout=10) == "ok"
    c3.kill()


def test_an_answer_json_cannot_hold_is_sent_as_an_error_not_left_unanswered():
    """A handler whose result JSON cannot hold (a set, NaN, a cycle) still answers the server: with
    -32603 saying so (it was never answered, so the server waited for its time-out)."""
    c = fake("ask")
    cycle: dict = {}
    cycle["self"] = cycle
    c.on_request("known", lambda p: {"bad": float("nan")})
    c.on_request("unknownToClient", lambda p: {"bad": {1, 2}})
    answers = c.request("go", {}, timeout=10)
    by_id = {a["id"]: a for a in answers}
    for msg_id, what in (("s1", "set"), ("s2", "Out of range float")):
        err = by_id[msg_id]["error"]
        assert err["code"] == -32603 and "is not JSON" in err["message"] and what in err["message"], err
        assert "result" not in by_id[msg_id]
    c.kill()
    c = fake("ask")
    c.on_request("known", lambda p: cycle)
    c.on_request("unknownToClient", lambda p: (_ for _ in ()).throw(RpcError(-32000, "no", {1})))
    by_id = {a["id"]: a for a in c.request("go", {}, timeout=10)}
    assert "Circular reference" in by_id["s2"]["error"]["message"]
    assert by_id["s1"]["error"]["code"] == -32603 and "is not JSON" in by_id["s1"]["error"]["message"]
    c.kill()


def test_params_json_cannot_hold_are_refused_before_anything_is_sent():
    """NaN in params used to be written as the bare token NaN: the server answered -32700 with id null
    and the request waited for its whole time-out."""
    c = fake("echo")
    with pytest.raises(ValueError):
        c.request("x", {"temperature": float("nan")}, timeout=10)
    with pytest.raises(TypeError):
        c.request("x", {"tags": {1, 2}}, timeout=10)
    with pytest.raises(ValueError):
        c.notify("note", {"x": float("inf")})
    assert c.request("y", {"ok": "é"}, timeout=10) == {"ok": "é"}  # nothing half-sent: still in sync
    assert c._pending == {}
    c.kill()


def test_once_the_output_is_unreadable_every_request_fails_at_once():
    """After a stray line on stdout the reader stops: a later request is answered -32099 at once
    (it waited for its whole time-out, nobody reading its answer)."""
    c = fake("garbage")
    with pytest.raises(RpcError):
        c.request("x", timeout=10)
    for _ in range(2):
        with pytest.raises(RpcError) as ei:
            c.request("again", timeout=10)
        assert ei.value.code == -32099 and "stray print" in ei.value.message, ei.value
    assert c._pending == {}
    assert c.proc.poll() is None  # the process is still there: only its stream is lost
    c.close(timeout=10)
    assert c.proc.poll() is not None


def test_close_ends_the_servers_input_so_one_that_ignores_exit_ends_without_being_killed():
    """``close()`` sends shutdown and exit, then ends the server's input: a server that did not
    take them (here one whose output went bad, which reads its input to the end) ends there,
    with its own exit code; it used to be waited for in full, then killed (-9)."""
    c = fake("garbage")
    with pytest.raises(RpcError):
        c.request("x", timeout=10)
    assert c.close(timeout=10) == 0


def test_a_server_that_reads_no_more_fails_requests_and_notifications_with_no_answer():
    """A server whose input is closed (it exited, or closed it) fails a request with NoAnswer
    (-32099), as the docstring says; it raised BrokenPipeError from the write (ValueError after
    close()). A notification, and data sent raw, raise NoAnswer too."""
    c = fake("deaf")
    try:
        assert c.request("go", timeout=10) == "deaf now"  # its input is closed by now
        with pytest.raises(NoAnswer) as ei:
            c.request("again", timeout=10)
        assert ei.value.code == -32099 and "not sent" in ei.value.message, ei.value
        with pytest.raises(NoAnswer):
            c.request_async("async").result(10)
        with pytest.raises(NoAnswer) as ei:
            c.notify("note", {"n": 1})
        assert "notification note not sent" in ei.value.message, ei.value
        with pytest.raises(NoAnswer):
            c.send_raw(b"Content-Length: 2\r\n\r\n{}")
        assert c._pending == {}
    finally:
        c.kill()
        c.wait(10)


def test_after_close_requests_and_notifications_fail_with_no_answer():
    c = fake("echo")
    assert c.request("x", {"a": 1}, timeout=10) == {"a": 1}
    c.close(timeout=10)
    with pytest.raises(NoAnswer):
        c.request("ping", timeout=10)
    with pytest.raises(NoAnswer) as ei:
        c.notify("note")
    assert "the client closed the server's input" in ei.value.message, ei.value


def _wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def test_expect_never_takes_an_earlier_answer_of_the_same_id_from_unmatched():
    """expect() is called before send_raw(); an answer nobody waited for stays in ``unmatched``.
    A later expect() of the same id waits for the new answer: the one in ``unmatched`` may answer
    an earlier request that reused the id (a fuzzer's bodies all say id 0)."""
    c = fake("echo")
    try:
        body = json.dumps({"jsonrpc": "2.0", "id": "raw", "method": "m", "params": {"n": 1}}).encode()
        c.send_raw(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert _wait_until(lambda: len(c.unmatched) == 1), c.unmatched  # nobody waited: kept there
        pending = c.expect("raw")
        body = json.dumps({"jsonrpc": "2.0", "id": "raw", "method": "m", "params": {"n": 2}}).encode()
        c.send_raw(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert pending.result(5) == {"n": 2}
        assert [m["result"] for m in c.unmatched] == [{"n": 1}]
    finally:
        c.kill()


def test_an_id_still_waiting_for_its_answer_is_refused_and_fresh_ids_skip_it():
    """A second request with the id of one still waiting used to replace it: the one answer settled the
    second, and the first waited for its time-out with its answer lost. It is refused, naming the id,
    before anything is sent; the first still gets its answer. A fresh id skips ids chosen by hand."""
    c = fake("echo")
    try:
        first = c.expect("job")
        with pytest.raises(ValueError, match="request id 'job' is still waiting for its answer"):
            c.request_async("ping", {"n": 2}, msg_id="job")
        with pytest.raises(ValueError, match="'job'"):
            c.request("ping", {"n": 2}, timeout=10, msg_id="job")
        with pytest.raises(ValueError, match="'job'"):
            c.expect("job")
        body = json.dumps({"jsonrpc": "2.0", "id": "job", "method": "m", "params": {"n": 1}}).encode()
        c.send_raw(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert first.result(10) == {"n": 1}
        assert c.unmatched == []  # nothing else was sent
        assert c.request("ping", {"n": 3}, timeout=10, msg_id="job") == {"n": 3}  # answered: free again
        last = c.request_async("ping", {"n": 4})
        assert last.result(10) == {"n": 4}
        taken = [c.expect(last.id + 1), c.expect(last.id + 2)]  # the next fresh ids, chosen by hand
        fresh = c.request_async("ping", {"n": 5})
        assert fresh.id == last.id + 3 and fresh.result(10) == {"n": 5}
        assert not any(p.done() for p in taken) and c.unmatched == []
    finally:
        c.kill()


def _denied_reasons(tmp_path: Path, answers: list) -> list[str]:
    """The real server asking ``requestToolPermission`` for a ``write_file`` once per answer, the
    client answering each of ``answers`` in turn: every call denied, nothing written; the reasons."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    call = {"json": {"action_requests": [{"function": "write_file", "arguments": {"path": "a.txt", "content": "b"}}]}}
    given = iter(answers)
    with SidecarClient(env=env, cwd=str(ROOT)) as c:
        c.on_request("requestToolPermission", lambda p: next(given))
        c.request("initialize", {"capabilities": {"toolPermission": True}, "workspaceFolders": [str(tmp_path)],
                                 "settings": {"models": {"s": {"provider": "scripted",
                                                               "responses": [call] * len(answers)}}}},
                  timeout=30)
        branch = c.request("createBranch", {"chatModel": "s"}, timeout=30)["branchId"]
        reasons = []
        for _ in answers:
            out = c.request("operate", {"branchId": branch, "instruction": "go", "actions": True}, timeout=30)
            (resp,) = out["result"]["action_responses"]
            assert resp["output"]["error"] == "denied by governance gate", resp
            reasons.append(resp["output"]["reason"])
        assert not (tmp_path / "a.txt").exists()
        assert c.close() == 0
    return reasons


def test_a_permission_answer_that_is_not_an_object_is_a_deny_quoting_what_came_with_the_real_server(tmp_path):
    """A handler that answers requestToolPermission with the bare decision ("allow_once", not
    {"decision": "allow_once"}) is denied; the reason used to say ``None``, it quotes what came (bounded)."""
    reasons = _denied_reasons(tmp_path, ["allow_once", ["x" * 200], {"decison": "allow_once"}, {"decision": "allow"}])
    assert reasons == ["invalid permission answer 'allow_once'",
                       "invalid permission answer " + repr(["x" * 200])[:80] + "...",
                       "invalid permission answer {'decison': 'allow_once'}",
                       "invalid permission answer 'allow'"], reasons


def test_a_permission_answer_nested_deep_is_a_deny_quoting_its_first_levels_with_the_real_server(tmp_path):
    """A permission answer was quoted by ``repr`` of all of it, then cut: an answer nested 950 lists
    deep was written out whole (and raised RecursionError where the stack was deeper:
    tests/service/test_governance_answers.py), a megabyte one too. The call is denied quoting the
    answer's first levels, or its first 80 characters, and the operate goes on."""
    deep: list = []
    for _ in range(950):  # (as deep as the server's reader parses at its shallow stack)
        deep = [deep]
    reasons = _denied_reasons(tmp_path, [deep, {"decision": ["y" * 1_000_000]}])
    assert reasons == ["invalid permission answer [[[[...]]]]",
                       "invalid permission answer " + repr(["y" * 200])[:80] + "..."], reasons


def test_waiting_for_an_answer_inside_a_notification_callback_fails_at_once():
    """Notification callbacks run on the reader thread: request() there used to block that thread
    (and with it every answer) until its time-out. It raises at once; request_async works."""
    c = fake("notify")
    seen: list = []

    def callback(params):
        try:
            c.request("nested", timeout=10)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            seen.append(e)

    c.on_notification("note", callback)
    assert c.request("go", timeout=10) == "answered"
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError) and "request_async" in str(seen[0]), seen
    c.kill()


def test_a_client_tool_answer_json_cannot_hold_is_a_prompt_tool_error_with_the_real_server():
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    call = {"json": {"action_requests": [{"function": "ctool", "arguments": {}}]}}
    with SidecarClient(env=env, cwd=str(ROOT)) as c:
        c.request("initialize", {"capabilities": {"clientTools": True}, "settings": {
            "toolTimeoutMs": 600000, "models": {"s": {"provider": "scripted", "responses": [call]}}}}, timeout=30)
        c.request("registerClientTools", {"tools": [{"name": "ctool", "description": "d",
                                                     "inputSchema": {"type": "object"}}]}, timeout=30)
        c.on_request("invokeClientTool", lambda p: {"output": {"when": {1, 2}}})
        branch = c.request("createBranch", {"chatModel": "s"}, timeout=30)["branchId"]
        out = c.request("operate", {"branchId": branch, "instruction": "go", "actions": True}, timeout=30)
        (resp,) = out["result"]["action_responses"]
        assert "is not JSON" in resp["output"]["error"], resp
        assert c.close() == 0


def test_close_returns_the_exit_code_of_the_real_server():
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with SidecarClient(env=env, cwd=str(ROOT)) as c:
        assert c.request("ping", timeout=20) == {}
        c.request("initialize", {"settings": {"models": {"s": {"provider": "scripted", "responses": []}}}},
                  timeout=20)
        assert c.close() == 0


# ---------------------------------------------------------------- a server under a wrapper that forks
sys.path.insert(0, str(ROOT / "tests"))
import wedge_tools  # noqa: E402

_SERVER_WRITING_ITS_PID = ('import os, sys; open(sys.argv[1], "w").write(str(os.getpid())); '
                           'os.execv(sys.executable, [sys.executable, "-m", "operate_sidecar.server"])')
posix_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists() or sys.platform == "win32",
                                reason="process sessions, and /proc to see which processes live")


def forked(pidfile: Path) -> SidecarClient:
    """The real server under ``sh -c "...; exit $?"``: the shell forks it (no exec) and waits,
    as ``sh -c "operate-sidecar ..."`` or ``uv run operate-sidecar`` do."""
    return SidecarClient(argv=["sh", "-c", '"$0" -c "$1" "$2"; exit $?', sys.executable, _SERVER_WRITING_ITS_PID,
                               str(pidfile)], env=wedge_tools.server_env(), cwd=str(ROOT))


@posix_proc
def test_kill_ends_the_server_under_a_wrapper_that_forked_it(tmp_path, monkeypatch):
    """Every group of the session is killed, the wrapper's first: signalled after the server's,
    a wrapper could see its child die and exit by itself (137, not killed by the signal: close()
    once returned that under load)."""
    c = forked(tmp_path / "pid")
    c.request("initialize", {"settings": {"models": {"s": {"provider": "scripted", "responses": []}}}}, timeout=30)
    c.request("createBranch", timeout=30)  # the core is loaded: the server leads a process group of its own
    server = int((tmp_path / "pid").read_text())
    server_group = os.getpgid(server)
    assert server != c.proc.pid and server_group != os.getpgid(c.proc.pid)
    signalled: list[int] = []
    real_killpg = os.killpg

    def killpg(pgid: int, sig: int) -> None:  # the real signal, and whom it was for
        signalled.append(pgid)
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", killpg)
    c.kill()
    assert c.wait(10) == -signal.SIGKILL
    assert signalled[0] == c.proc.pid and server_group in signalled, signalled
    assert wedge_tools.gone(server), "the server outlived kill()"


@posix_proc
def test_close_kills_a_server_that_answers_nothing_with_the_wrapper_that_forked_it(tmp_path):
    trigger = str(tmp_path / "wedge")
    c = forked(tmp_path / "pid")
    c.request("initialize", {"settings": wedge_tools.settings(trigger)}, timeout=30)
    branch = c.request("createBranch", timeout=30)["branchId"]
    out = c.request("operate", {"branchId": branch, "instruction": "arm", "actions": True}, timeout=30)
    assert out["result"]["action_responses"][0]["output"] == "armed", out
    server = wedge_tools.pull(trigger)  # its loop is blocked: no shutdown, exit or end of input is taken
    t0 = time.monotonic()
    assert c.close(timeout=2) == -signal.SIGKILL
    assert time.monotonic() - t0 < 15  # 2 s for shutdown, 2 s for the exit: a hang check, not a speed target
    assert c.ending == "the server did not answer shutdown within 2 s; killed it and every process of its session"
    assert wedge_tools.gone(server), "the server outlived close()"


def test_close_input_ends_the_real_server_with_no_signal():
    c = SidecarClient(env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    assert c.request("ping", timeout=20) == {}
    c.close_input()
    assert c.wait(20) == 1  # its input ended before shutdown: code 1, not a signal


def test_close_in_a_notification_callback_shuts_the_server_down():
    """close() in a notification callback (on the thread that reads the answers) sends shutdown and
    exit without waiting there for the answer: the server exits by itself (0). It raised the
    RuntimeError about waiting in a callback, and the server was SIGKILLed."""
    c = SidecarClient(env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    try:
        c.request("initialize", {"settings": {"models": {"m": {"provider": "scripted", "responses": [
            {"text": "a", "delayMs": 300}]}}}}, timeout=30)
        branch = c.request("createBranch", timeout=30)["branchId"]
        closed: list = []

        def on_progress(params):
            if params["value"]["kind"] == "begin" and not closed:
                try:
                    closed.append(c.close(timeout=10))
                except Exception as e:  # noqa: BLE001 - recorded for the assertion
                    closed.append(e)

        c.on_notification("$/progress", on_progress)
        try:
            c.request("operate", {"branchId": branch, "instruction": "x", "skipValidation": True,
                                  "workDoneToken": 1}, timeout=30)
        except NoAnswer:  # (the server may end before its answer is read)
            pass
        assert closed == [0] and c.ending is None, (closed, c.ending)
        assert c.wait(10) == 0
    finally:
        c.kill()


@posix_proc
def test_a_request_the_server_does_not_read_times_out_and_close_still_ends_it(tmp_path):
    """A request larger than the pipe, to a server that reads nothing (its loop is blocked), waited
    for ever in the write, whatever its time-out, and close() waited behind it. The write is bounded
    by the request's time-out, a frame not begun is not sent at all, and close() kills the server
    after its bounded waits."""
    trigger = str(tmp_path / "wedge")
    c = SidecarClient(env=wedge_tools.server_env(), cwd=str(ROOT))
    try:
        c.request("initialize", {"settings": wedge_tools.settings(trigger)}, timeout=30)
        branch = c.request("createBranch", timeout=30)["branchId"]
        out = c.request("operate", {"branchId": branch, "instruction": "arm", "actions": True}, timeout=30)
        assert out["result"]["action_responses"][0]["output"] == "armed", out
        server = wedge_tools.pull(trigger)
        got: dict = {}

        def run(name, call):
            try:
                got[name] = call()
            except Exception as e:  # noqa: BLE001 - recorded for the assertion
                got[name] = e

        big = threading.Thread(target=run, args=("big", lambda: c.request(
            "createBranch", {"system": "x" * (4 << 20)}, timeout=2)), daemon=True)
        big.start()
        big.join(20)  # a hang check (the wedge lasts 30 s), not a speed target
        assert not big.is_alive(), "the request's write ignored its time-out"
        assert isinstance(got["big"], TimeoutError) and "not written in full" in str(got["big"]), got
        with pytest.raises(TimeoutError, match="not sent within"):  # queued behind it, and taken back
            c.request("ping", timeout=0.5)
        with pytest.raises(TimeoutError, match="notification note not sent within"):
            c.notify("note", timeout=0.5)
        closer = threading.Thread(target=run, args=("close", lambda: c.close(timeout=2)), daemon=True)
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), "close() waited behind the write"
        assert got["close"] == -signal.SIGKILL, got
        assert c.ending == "the server did not answer shutdown within 2 s; killed it and every process of its session"
        assert wedge_tools.gone(server), "the server outlived close()"
    finally:
        c.kill()
