"""The client closes its end of stdout (or dies with it) while the server is idle or busy
without writing: the server notices at once, not only at its next write, and ends as after a
write that failed with EPIPE (docs/PROTOCOL.md §1): one warning line, exit code 1, its tools'
children stopped. A client that closes it once its ``shutdown`` is answered is done, not gone:
exit code 0, no warning. A FIFO the server's stdout has open for reading too (a shell's
``exec 3<>fifo``) is not watched: its unread output would look like its reader's end gone."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import struct
import subprocess
import termios
import threading
import time

import pytest

from process_support import alive

from .support import ROOT, SERVER, TIMEOUT, server_env

GONE = "the client's end of stdout is gone (BrokenPipeError)"

SLEEPER = '''
import os
import subprocess


def sleeper(path: str) -> str:
    """Start a child that sleeps, tell its pid in ``path``, wait for it."""
    child = subprocess.Popen(["sleep", "300"])
    with open(path + ".part", "w") as f:
        f.write(str(child.pid))
    os.replace(path + ".part", path)
    child.wait()
    return "woke"
'''


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _read_frame(f) -> dict:
    head = f.readline()  # the server writes exactly "Content-Length: N\r\n\r\n"
    assert head, "the server's output ended"
    assert f.readline() == b"\r\n"
    return json.loads(f.read(int(head.split(b":")[1])))


def _request(proc: subprocess.Popen, msg_id: int, method: str, params: dict | None = None) -> dict:
    proc.stdin.write(_frame({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params or {}}))
    proc.stdin.flush()
    while True:
        msg = _read_frame(proc.stdout)
        if msg.get("id") == msg_id and "method" not in msg:
            return msg


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def server(tmp_path):
    (tmp_path / "sleeper_tools.py").write_text(SLEEPER)
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as sink:
        proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink,
                                env=server_env(paths=(tmp_path,)), cwd=str(ROOT))
    proc.err = err  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _ends_as_after_epipe(proc: subprocess.Popen, code: int, warned: bool = True) -> str:
    """The server, its stdin still open, exits with ``code`` on its own, in one warning line
    (``warned``), or in none."""
    try:
        assert proc.wait(TIMEOUT) == code
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server still runs {TIMEOUT} s after its stdout was closed") from None
    text = proc.err.read_text(errors="replace")  # type: ignore[attr-defined]
    warnings = [line for line in text.splitlines() if "WARNING" in line or "ERROR" in line]
    if warned:
        assert len(warnings) == 1 and GONE in warnings[0], text
    else:
        assert warnings == [], text
    assert "Traceback" not in text, text
    return text


def test_an_idle_server_whose_stdout_the_client_closes_exits_at_once(server):
    assert _request(server, 1, "initialize")["result"]["protocolVersion"] == 1
    server.stdout.close()  # the client reads no more; it writes nothing more either
    _ends_as_after_epipe(server, 1)


def test_a_client_that_closes_stdout_once_shutdown_is_answered_ends_the_server_without_a_warning(server):
    """Its session is over (a client that then closes stdout before stdin, or both at once as
    it exits): exit code 0, as after ``exit``, and nothing said to look into."""
    assert _request(server, 1, "initialize")["result"]["protocolVersion"] == 1
    assert _request(server, 2, "shutdown")["result"] is None
    server.stdout.close()
    _ends_as_after_epipe(server, 0, warned=False)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_client_that_sent_shutdown_and_exit_then_closed_stdout_is_done_though_the_end_is_seen_first(server):
    """The end of stdout and the ``shutdown`` and ``exit`` sent before it are ready in the same
    loop step, the end first (both happen while the server is stopped with SIGSTOP: its loop finds
    them together, in that order): the client is done, exit code 0 and no warning. (The end was
    judged before the input read with it: a warning and exit code 1.)"""
    assert _request(server, 1, "initialize")["result"]["protocolVersion"] == 1
    server.send_signal(signal.SIGSTOP)
    try:
        _wait(lambda: _state(server.pid) == "T", "the server did not stop")
        server.stdout.close()  # first the end of stdout ...
        server.stdin.write(_frame({"jsonrpc": "2.0", "id": 2, "method": "shutdown"})
                           + _frame({"jsonrpc": "2.0", "method": "exit"}))  # ... then the input
        server.stdin.flush()
    finally:
        server.send_signal(signal.SIGCONT)
    _ends_as_after_epipe(server, 0, warned=False)


def test_a_client_that_sent_shutdown_while_its_input_was_held_then_closed_stdout_is_done(tmp_path):
    """A client that reads none of the server's output has its input held (docs/PROTOCOL.md §1);
    a ``shutdown`` among what is held, then stdout closed: the client is done, exit code 0 and no
    warning. (A warning and exit code 1: the shutdown was never read by the connection.)"""
    err = tmp_path / "stderr.txt"
    # answers over the 8 MiB the server buffers (about 10 MB), and what comes after them held:
    # under the 4 MiB held at most (about 2 MB), so the shutdown is read
    pings = 150_000
    blob = _frame({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}) + b"".join(
        _frame({"jsonrpc": "2.0", "id": i, "method": "ping"}) for i in range(1, pings + 1)) + _frame(
        {"jsonrpc": "2.0", "id": "bye", "method": "shutdown"})
    with open(err, "wb") as sink:
        proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink,
                                env=server_env(), cwd=str(ROOT))
    try:
        def write() -> None:
            proc.stdin.write(blob)
            proc.stdin.flush()

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        writer.join(TIMEOUT)  # the server reads it all, the last of it held
        assert not writer.is_alive(), "the server stopped reading before the shutdown"
        assert "not reading the server's output" in err.read_text(errors="replace")
        proc.stdout.close()
        assert proc.wait(TIMEOUT) == 0, err.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdin.close()
    text = err.read_text(errors="replace")
    assert GONE not in text and "Traceback" not in text, text


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe ``fd`` reads from."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_stdout_fifo_also_open_for_reading_is_not_taken_for_a_gone_client(tmp_path):
    """``exec 3<>fifo; operate-sidecar >&3``: the server's stdout is read-write, readable as long
    as its output is unread. The server answers, and serves on while the client reads later."""
    fifo = str(tmp_path / "out")
    os.mkfifo(fifo)
    both = os.open(fifo, os.O_RDWR)
    out = open(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK), "rb")
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as sink:
        proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=both, stderr=sink, env=server_env(),
                                cwd=str(ROOT))
    os.close(both)
    try:
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}))
        proc.stdin.flush()
        _wait(lambda: _unread(out.fileno()) > 0, "the server did not answer initialize")
        # its answers wait unread in the FIFO: the server still serves (pings are answered)
        for msg_id in (2, 3, 4):
            unread = _unread(out.fileno())
            proc.stdin.write(_frame({"jsonrpc": "2.0", "id": msg_id, "method": "ping", "params": {}}))
            proc.stdin.flush()
            _wait(lambda: _unread(out.fileno()) > unread or proc.poll() is not None, "a ping was not answered")
            assert proc.poll() is None, err.read_text(errors="replace")
        os.set_blocking(out.fileno(), True)  # (the server has it open to write: a read waits for it)
        assert [_read_frame(out)["id"] for _ in range(4)] == [1, 2, 3, 4]
        proc.stdin.close()  # the end of input ends it as ever
        assert proc.wait(TIMEOUT) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        out.close()
    text = err.read_text(errors="replace")
    assert "WARNING" not in text and "Traceback" not in text, text


def test_the_client_closing_stdout_while_a_tool_runs_stops_the_server_and_the_tools_children(server, tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    reply = {"json": {"action_requests": [{"function": "sleeper", "arguments": {"path": str(pid_file)}}]}}
    init = _request(server, 1, "initialize", {"settings": {
        "models": {"s": {"provider": "scripted", "responses": [reply]}}, "toolModules": ["sleeper_tools"]}})
    assert "result" in init, init
    branch = _request(server, 2, "createBranch")["result"]["branchId"]
    server.stdin.write(_frame({"jsonrpc": "2.0", "id": 3, "method": "operate",
                               "params": {"branchId": branch, "instruction": "sleep", "actions": True}}))
    server.stdin.flush()
    _wait(pid_file.exists, "the tool did not start its child")
    child = int(pid_file.read_text())
    assert alive(child)
    server.stdout.close()  # while the tool runs, nothing written: the server is waiting
    _ends_as_after_epipe(server, 1)
    _wait(lambda: not alive(child), "the tool's child outlived the server")


def test_a_write_pending_from_another_thread_is_not_armed_once_the_client_is_gone():
    """A thread's write leaves the pipe full and asks the loop for the writer callback; the loop
    sees the client's end gone (``Wire._on_gone``) before it gets to that request. The callback
    is then not registered: on a pipe with no reader it would be called again and again."""
    from operate_sidecar.server.rpc.stdio import Wire

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        wire = Wire(w)
        writer = threading.Thread(target=wire.send_bytes, args=(b'"' + b"a" * (1 << 20) + b'"',))
        writer.start()
        writer.join(TIMEOUT)  # (the loop waits meanwhile: what the thread asked of it is queued)
        assert wire.pending > 0, "the pipe took the whole frame"
        os.close(r)
        wire._on_gone()  # what the loop runs as it sees the reader's end gone
        for _ in range(5):
            await asyncio.sleep(0)
        registered = loop.remove_writer(w)
        wire.close()
        return registered

    assert asyncio.run(main()) is False
