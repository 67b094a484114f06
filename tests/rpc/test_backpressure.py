"""A client that stops reading stdout (docs/PROTOCOL.md §1-2): the server never blocks on the
pipe. What the client has not read waits in a bounded buffer, the server stops taking requests
while it is full and takes them again once the client reads; SIGTERM, the client's death, its
exit and its end of input are served meanwhile."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import pytest

from .support import ROOT, SERVER, TIMEOUT, server_env

#: ping answers (about 40 bytes each) well over the server's 8 MiB high-water mark
PINGS = 300_000


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _read_frame(f) -> dict | None:
    head = f.readline()  # the server writes exactly "Content-Length: N\r\n\r\n"
    if not head:
        return None
    assert f.readline() == b"\r\n"
    return json.loads(f.read(int(head.split(b":")[1])))


def _stderr_has(path, text: str, proc: subprocess.Popen) -> bool:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        with open(path, encoding="utf-8", errors="replace") as fh:
            if text in fh.read():
                return True
        time.sleep(0.05)
    return False


def _flooded_server(tmp_path) -> tuple[subprocess.Popen, threading.Thread, object]:
    """A server sent initialize and PINGS pings by a client that reads none of the answers,
    once the server said it stopped reading requests."""
    err = tmp_path / "stderr.txt"
    proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(err, "wb"),
                            env=server_env(), cwd=str(ROOT))
    blob = _frame({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}) + b"".join(
        _frame({"jsonrpc": "2.0", "id": i, "method": "ping"}) for i in range(1, PINGS + 1))

    def write() -> None:
        try:
            proc.stdin.write(blob)
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert _stderr_has(err, "not reading the server's output", proc), err.read_text()
    return proc, writer, err


def test_a_client_that_stops_reading_is_paused_not_a_frozen_server_and_sigterm_still_stops_it(tmp_path):
    proc, _writer, err = _flooded_server(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        # (it blocked in write() on the full pipe, SIGTERM and all, until the client read)
        assert proc.wait(TIMEOUT) == 1
        assert "did not read the server's last" in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()


def test_once_the_client_reads_again_every_answer_arrives_in_order_and_requests_are_taken_again(tmp_path):
    proc, writer, _err = _flooded_server(tmp_path)
    try:
        assert writer.is_alive()  # the server takes no more requests: the client's write waits
        first = _read_frame(proc.stdout)
        assert first["id"] == 0 and first["result"]["protocolVersion"] == 1
        for i in range(1, PINGS + 1):
            msg = _read_frame(proc.stdout)
            assert msg == {"jsonrpc": "2.0", "id": i, "result": {}}, (i, msg)
        writer.join(TIMEOUT)
        assert not writer.is_alive()
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": "after", "method": "shutdown"}))
        proc.stdin.flush()
        assert _read_frame(proc.stdout) == {"jsonrpc": "2.0", "id": "after", "result": None}
        proc.stdin.write(_frame({"jsonrpc": "2.0", "method": "exit"}))
        proc.stdin.flush()
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()


@pytest.mark.parametrize(("how", "code"), [("exit", 1), ("shutdown-exit", 0), ("eof", 1)])
def test_a_client_that_stops_reading_can_still_end_the_server_with_exit_or_end_of_input(tmp_path, how, code):
    """Operates stream more progress than the server buffers while the client reads nothing:
    the server stops taking requests, yet an ``exit`` (after a ``shutdown`` or not) or the end
    of input still ends it, within its drain bound, with the exit code they call for (it read
    no more input, so it never saw them: only a signal stopped it)."""
    err = tmp_path / "stderr.txt"
    proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(err, "wb"),
                            env=server_env(), cwd=str(ROOT))
    try:
        reply = {"text": "z" * 100_000, "chunks": 100}
        models = {"m": {"provider": "scripted", "responses": [reply] * 50}}
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                                 "params": {"settings": {"models": models, "defaultModel": "m"}}})
                         + _frame({"jsonrpc": "2.0", "id": 1, "method": "createBranch", "params": {}}))
        proc.stdin.flush()
        assert "result" in _read_frame(proc.stdout)
        branch = _read_frame(proc.stdout)["result"]["branchId"]
        # from here on the client reads nothing
        proc.stdin.write(b"".join(_frame({"jsonrpc": "2.0", "id": 10 + i, "method": "operate", "params": {
            "branchId": branch, "instruction": "go", "skipValidation": True, "workDoneToken": i}}) for i in range(40)))
        proc.stdin.flush()
        assert _stderr_has(err, "not reading the server's output", proc), err.read_text()
        if how != "eof":
            if how == "shutdown-exit":
                proc.stdin.write(_frame({"jsonrpc": "2.0", "id": 99, "method": "shutdown"}))
            proc.stdin.write(_frame({"jsonrpc": "2.0", "method": "exit"}))
            proc.stdin.flush()
        else:
            proc.stdin.close()
        assert proc.wait(TIMEOUT) == code, err.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()
