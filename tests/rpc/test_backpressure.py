"""A client that stops reading stdout (docs/PROTOCOL.md §1-2): the server never blocks on the
pipe. What the client has not read waits in a bounded buffer, the server stops taking requests
while it is full and takes them again once the client reads; SIGTERM, the client's death, its
exit and its end of input are served meanwhile."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
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


#: a frame over ``_small_wire``'s high-water mark; with the few small frames these tests send
#: around it, well under the smallest pipe Linux makes (one 4 KiB page: what a user holding
#: very many pipes gets), so a pipe of any size takes them all without filling
OVER_HIGH = b'"' + b"x" * (2 << 10) + b'"'


def _small_wire(fd: int):
    """A ``Wire`` (made on the running loop) whose marks are small enough for any pipe to take a
    frame over the high one (``OVER_HIGH``) whole."""
    from operate_sidecar.server.rpc.stdio import Wire

    class Small(Wire):
        HIGH_WATER = 1 << 10
        LOW_WATER = 256

    return Small(fd)


def _pipe(size: str) -> tuple[int, int]:
    """A pipe as made, or cut to one page (what a user holding very many pipes gets)."""
    r, w = os.pipe()
    if size == "one-page-pipe":
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # rounded up to one page
    return r, w


@pytest.mark.parametrize("size", ["pipe-as-made", "one-page-pipe"])
@pytest.mark.parametrize("drainer", ["end-of-iteration", "other-thread"])
def test_a_frame_over_the_high_water_mark_written_whole_without_the_pipe_filling_resumes_input(drainer, size):
    """A frame over the high-water mark queued behind one already written in the same loop
    iteration pauses input; it then goes out whole at the end of the iteration (or with another
    thread's frame), the pipe never full, so the loop's writer callback never runs. Before, only
    that callback resumed input: the server read no more requests, for good, after a large
    ``branchMessages`` page sent while pings were answered."""
    r, w = _pipe(size)
    events: list[str] = []

    async def main() -> None:
        wire = _small_wire(w)
        wire.on_pause = lambda: events.append("pause")
        wire.on_resume = lambda: events.append("resume")
        wire.send_bytes(b'{"a":1}')          # written at once: the rest of this iteration waits for its end
        wire.send_bytes(OVER_HIGH)
        assert events == ["pause"] and wire.pending > wire.HIGH_WATER
        if drainer == "other-thread":
            t = threading.Thread(target=wire.send_bytes, args=(b'{"b":2}',))
            t.start()
            t.join(TIMEOUT)
            assert wire.pending == 0
        deadline = time.monotonic() + TIMEOUT
        while events == ["pause"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert wire.pending == 0
        assert events == ["pause", "resume"]
        wire.close()

    try:
        asyncio.run(main())
    finally:
        os.close(r)


def test_input_is_resumed_from_a_loop_callback_of_its_own_never_inside_a_send():
    """``on_resume`` hands the held input on to the parser, whose handler may send (a ping's
    answer, on the loop's thread). Paused, the buffer drained by another thread's write, then a
    send on the loop's thread (that handler's): ``on_resume`` ran inside that send, so the
    parser was fed again from the middle of its own handler (frames handed on twice, its buffer
    cut under it). It runs once, from a callback of the loop's own, outside every send."""
    r, w = os.pipe()
    sending = [False]                        # a send on the loop's thread is under way
    resumed: list[bool] = []                 # for each on_resume: was it inside that send?

    async def main() -> None:
        wire = _small_wire(w)
        wire.on_pause = lambda: None
        wire.on_resume = lambda: resumed.append(sending[0])
        wire.send_bytes(b'{"a":1}')          # written at once: the next frame waits for the iteration's end
        wire.send_bytes(OVER_HIGH)           # paused
        t = threading.Thread(target=wire.send_bytes, args=(b'{"b":2}',))
        t.start()                            # writes everything, the pipe having room
        t.join(TIMEOUT)
        assert wire.pending == 0 and resumed == []
        sending[0] = True                    # as a ping's answer from the parser's handler
        wire.send_bytes(b'{"c":3}')
        sending[0] = False
        deadline = time.monotonic() + TIMEOUT
        while not resumed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)               # one more iteration: a second on_resume would come now
        assert resumed == [False]
        wire.close()

    try:
        asyncio.run(main())
    finally:
        os.close(r)


def test_two_pages_over_the_high_water_mark_answered_together_to_a_fast_client_leave_requests_taken(tmp_path):
    """Over the wire: two ``branchMessages`` pages of over 8 MiB each, asked for together, are
    answered in the same loop iteration; the second, queued behind the first, pauses input. The
    server's stdout is a regular file, a client that takes everything at once: the pages go out
    whole, the pipe never full. Input is taken again: a ping sent after them is answered (before,
    the server read no more requests, for good)."""
    from operate_sidecar.server.core import Branch
    from operate_sidecar.server.state import StateStore

    state = tmp_path / "state"
    store = StateStore(str(state))
    branch = Branch(system="sys", name="big")
    store.attach(branch, {"name": "big", "createdAt": 1})
    for _ in range(10_000):  # about 1 KB each: a page of all of them is over 10 MB
        branch.messages.add("instruction", {"instruction": "q" * 1000})
    store.flush()
    store.close()
    out, err = tmp_path / "stdout", tmp_path / "stderr.txt"
    proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=open(out, "wb"), stderr=open(err, "wb"),
                            env=server_env(), cwd=str(ROOT))

    def answered(msg_id: str) -> bool:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if b'"id":"%s"' % msg_id.encode() in out.read_bytes():
                return True
            time.sleep(0.05)
        return False

    try:
        page = {"branchId": branch.id, "limit": 20_000}
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": "init", "method": "initialize",
                                 "params": {"settings": {"stateDir": str(state)}}})
                         + _frame({"jsonrpc": "2.0", "id": "load", "method": "branchMessages",
                                   "params": {"branchId": branch.id, "limit": 1}}))
        proc.stdin.flush()
        assert answered("load"), err.read_text()[-2000:]
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": "p1", "method": "branchMessages", "params": page})
                         + _frame({"jsonrpc": "2.0", "id": "p2", "method": "branchMessages", "params": page}))
        proc.stdin.flush()
        assert _stderr_has(err, "not reading the server's output", proc), err.read_text()[-2000:]
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": "after", "method": "ping"}))
        proc.stdin.flush()
        assert answered("after"), err.read_text()[-2000:]
        assert answered("p1") and answered("p2")
        proc.stdin.close()
        assert proc.wait(TIMEOUT) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
