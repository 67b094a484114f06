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


def _reap(proc: subprocess.Popen) -> None:
    """A test's server, killed if it is still running (bounded), its output pipe closed."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(TIMEOUT)
    proc.stdout.close()


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
        _reap(proc)


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
        _reap(proc)


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
        _reap(proc)


@pytest.mark.parametrize("exit_like, answer", [
    ({"jsonrpc": "2.0", "id": "x", "method": "exit"}, ("x", -32601)),  # a request: "method not found"
    ({"method": "exit"}, (None, -32600)),                              # no "jsonrpc": "2.0"
], ids=["request", "no-jsonrpc"])
def test_an_exit_the_server_does_not_obey_does_not_release_the_input_held_from_a_client_that_reads_nothing(
        tmp_path, exit_like, answer):
    """A body named ``exit`` that the server answers instead of obeying (a request, or one
    without ``"jsonrpc": "2.0"``) is held as any request is: the requests after it are held
    too, and once more than the hold's 4 MiB wait, input is no longer read (before, it released
    the hold for good: every later request was taken and answered into a buffer that grew
    without bound). Once the client reads, every request is answered, in order."""
    err = tmp_path / "stderr.txt"
    proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(err, "wb"),
                            env=server_env(), cwd=str(ROOT))
    # enough pings for answers over the 8 MiB high-water mark; what is left (under 2 MiB) is held
    first, more = 160_000, 80_000  # then over 5 MiB more: past the hold's 4 MiB

    def pings(start: int, stop: int) -> bytes:
        return b"".join(_frame({"jsonrpc": "2.0", "id": i, "method": "ping"}) for i in range(start, stop))

    later = _frame(exit_like) + pings(first + 1, first + more + 1)

    def write(blob: bytes) -> None:
        try:
            proc.stdin.write(blob)
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    try:
        writer = threading.Thread(target=write, daemon=True, args=(
            _frame({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}) + pings(1, first + 1),))
        writer.start()
        assert _stderr_has(err, "not reading the server's output", proc), err.read_text()
        writer.join(TIMEOUT)
        assert not writer.is_alive()  # all of it read: answered or held
        writer = threading.Thread(target=write, daemon=True, args=(later,))
        writer.start()
        assert _stderr_has(err, "reading no more input until it does", proc), err.read_text()[-2000:]
        # the client reads again: every answer arrives, the pings' in order
        answers = [_read_frame(proc.stdout) for _ in range(first + more + 2)]
        assert answers[0]["id"] == 0 and "result" in answers[0]
        others = [(a["id"], a["error"]["code"]) for a in answers[1:] if "error" in a]
        assert others == [answer], others
        assert [a["id"] for a in answers[1:] if "result" in a] == list(range(1, first + more + 1))
        writer.join(TIMEOUT)
        assert not writer.is_alive()
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": "end", "method": "shutdown"})
                         + _frame({"jsonrpc": "2.0", "method": "exit"}))
        proc.stdin.flush()
        assert _read_frame(proc.stdout) == {"jsonrpc": "2.0", "id": "end", "result": None}
        assert proc.wait(TIMEOUT) == 0
    finally:
        _reap(proc)


def test_input_held_from_the_middle_of_a_frame_is_handed_on_whole_and_its_scan_logs_nothing(caplog):
    """The client stops reading while one of its frames is half read: the hold's scan starts in
    the middle of it, drops what it cannot use without a warning (the connection, which is
    handed every byte, is the one that reports on the stream), and finds its way to the next
    frame."""
    from operate_sidecar.server.rpc.run import InputHold

    fed: list[bytes] = []
    ended: list[bool] = []
    hold = InputHold(fed.append, lambda: ended.append(True))
    pretty = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}, indent=1).encode()  # lines in the body
    stream = (b"Content-Length: %d\r\n\r\n" % len(pretty) + pretty
              + b"".join(_frame({"jsonrpc": "2.0", "id": i, "method": "ping"}) for i in (2, 3))
              + _frame({"jsonrpc": "2.0", "method": "exit"}) + _frame({"jsonrpc": "2.0", "id": 4, "method": "ping"}))
    cut = stream.index(b'"jsonrpc"')  # in the first body, before its lines
    caplog.set_level("DEBUG")
    hold.on_data(stream[:cut])
    hold.pause()
    rest = stream[cut:]
    exit_at = rest.index(b'"method": "exit"')
    hold.on_data(rest[:exit_at])
    assert b"".join(fed) == stream[:cut]  # held
    hold.on_data(rest[exit_at:])
    assert b"".join(fed) == stream  # the exit was found: everything is handed on
    assert not ended
    assert [r.getMessage() for r in caplog.records if r.name.endswith(".framing")] == []
