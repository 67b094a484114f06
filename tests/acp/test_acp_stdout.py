"""``operate-sidecar --acp`` and a client that does not read the agent's output, or closes it
(docs/PROTOCOL.md §13). A client that sends requests but reads nothing is held, as the native
front end holds it (§1): once more than 8 MiB of output wait, the agent takes no more of its
input (up to 4 MiB is held, then nothing more is read: the client's pipe fills), and once it
reads again every request is answered. A client whose end of stdout is gone (closed, or the
client died) ends the connection: one warning line, exit 0, no traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import threading
import time

import pytest

from acp_support import AGENT, TIMEOUT, agent_env, prompt, reply, req, scripted, write_config

#: each flooding request's invalid ``mcpServers`` (answered -32602 with it: an answer about as large)
PAD = 32 * 1024
#: what a client that reads nothing may send before the agent stops reading: the 8 MiB of
#: answers, the 4 MiB held, what is in flight and the pipe, with room to spare
LIMIT = 40 << 20
#: what the agent logs once it reads no more input (``InputHold``)
NOT_READING = "reading no more input until it does"


class _Client:
    """The agent over pipes, from a client that reads its output only when the test asks
    (``read``, bounded): nothing is read behind the test's back. Its log goes to ``err``."""

    def __init__(self, config: str, err) -> None:
        self.err = err
        with open(err, "wb") as log:
            self.proc = subprocess.Popen(AGENT + ["--config", config], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=agent_env())
        self._buf = b""

    def send(self, *msgs: dict) -> None:
        self.proc.stdin.write(b"".join(json.dumps(m).encode() + b"\n" for m in msgs))
        self.proc.stdin.flush()

    def read(self, timeout: float = TIMEOUT) -> dict:
        """The agent's next message."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no message from the agent in {timeout} s"
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                assert chunk, "the agent's output ended"
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def until(self, check) -> dict:
        while True:
            msg = self.read()
            if check(msg):
                return msg

    def log(self) -> str:
        return self.err.read_text(errors="replace")

    def reap(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _initialized(c: _Client) -> None:
    c.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
    c.until(lambda m: m.get("id") == 1)


def _opened(c: _Client, ws) -> str:
    _initialized(c)
    c.send(req(2, "session/new", cwd=str(ws), mcpServers=[]))
    return c.until(lambda m: m.get("id") == 2)["result"]["sessionId"]


def _flood(c: _Client, start: int = 100) -> tuple[int, bytes]:
    """The client floods padded ``session/new`` requests (ids ``start`` + 1 on), reading nothing,
    until the agent reads no more of its input: (how many were begun, the unsent rest of the last)."""
    fd = c.proc.stdin.fileno()
    os.set_blocking(fd, False)
    sent, n, pending, held = 0, 0, b"", False
    deadline = time.monotonic() + 4 * TIMEOUT
    while not held:
        assert time.monotonic() < deadline, f"the agent neither read nor held the input ({sent} bytes sent)"
        if not pending:
            n += 1
            pending = json.dumps(req(start + n, "session/new", cwd="/", mcpServers="x" * PAD)).encode() + b"\n"
        try:
            k = os.write(fd, pending)
        except BlockingIOError:  # the pipe is full: the agent is busy, or reads no more
            held = NOT_READING in c.log()
            if not held:
                select.select([], [fd], [], 0.5)
            continue
        pending, sent = pending[k:], sent + k
        assert sent < LIMIT, f"the agent read {sent} bytes from a client that reads nothing"
    os.set_blocking(fd, True)
    return n, pending


def test_a_client_that_sends_but_does_not_read_is_held_then_every_request_is_answered(tmp_path):
    """The client floods requests (each answered with about as many bytes) and reads nothing:
    the agent stops taking its input (it says so, and the client's pipe stays full: a
    non-blocking write fails) before it has read ``LIMIT`` bytes (it read them all, its memory
    growing with the answers). Once the client reads again, every request is answered."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}})
    c = _Client(config, tmp_path / "agent.stderr")
    try:
        _initialized(c)
        n, pending = _flood(c)  # the client reads nothing
        assert "not reading the agent's output" in c.log()
        assert f"while not reading the agent's output; {NOT_READING}" in c.log()  # (not "the server's")
        # the client reads again: the rest of its last line and one more request go in as the
        # agent takes input again

        def rest() -> None:
            c.proc.stdin.write(pending + json.dumps(req(0, "session/list")).encode() + b"\n")
            c.proc.stdin.flush()

        writer = threading.Thread(target=rest, daemon=True)
        writer.start()
        answers: dict = {}
        while 0 not in answers:
            msg = c.read()
            if "id" in msg and "method" not in msg:
                answers[msg["id"]] = msg
        writer.join(TIMEOUT)
        assert not writer.is_alive()
        flood = sorted(k for k in answers if k > 100)
        assert flood == list(range(101, 101 + n)), (len(flood), n)
        assert {answers[k]["error"]["code"] for k in flood} == {-32602}
        assert "result" in answers[0]
        c.proc.stdin.close()
        assert c.proc.wait(TIMEOUT) == 0
        assert "Traceback" not in c.log(), c.log()[-3000:]
    finally:
        c.reap()


@pytest.mark.parametrize("closed", ["stdout", "both"])
@pytest.mark.parametrize("case", ["asked", "running"])
def test_a_client_whose_end_of_stdout_is_gone_ends_the_connection_in_one_line(tmp_path, ws, case, closed):
    """During a turn (a call asked about, or running for a minute) the client closes its end of
    the agent's stdout, and keeps its stdin open (``stdout``) or closes it too, as a client that
    dies does (``both``): the agent stops at once, as at the end of its input, exit 0, with one
    warning line and no traceback (the SDK's writer failed: tracebacks, and with stdin open the
    agent ran on, its output going nowhere, until its input ended)."""
    call = ("write_file", {"path": "a.txt", "content": "x\n"}) if case == "asked" else ("slow", {"seconds": 60})
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("", [call]), reply("done"))},
                                                      "toolModules": ["acp_fixture_tools"]})
    c = _Client(config, tmp_path / "agent.stderr")
    try:
        sid = _opened(c, ws)
        c.send(prompt(3, sid))
        if case == "asked":
            c.until(lambda m: m.get("method") == "session/request_permission")
        else:
            c.until(lambda m: m.get("method") == "session/update"
                    and m["params"]["update"].get("status") == "in_progress")
        c.proc.stdout.close()
        if closed == "both":
            c.proc.stdin.close()
        assert c.proc.wait(TIMEOUT) == 0
        log = c.log()
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        assert [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line] == \
            [line for line in log.splitlines() if "the client's end of stdout is gone" in line], log
        assert log.count("the client's end of stdout is gone") == 1, log
    finally:
        c.reap()


def _read_to_end(c: _Client) -> tuple[list[dict], bytes]:
    """Everything the agent writes until its stdout ends (bounded): its whole lines, parsed, and
    what follows the last newline (nothing, when every line came whole)."""
    fd = c.proc.stdout.fileno()
    buf = bytearray(c._buf)
    deadline = time.monotonic() + 4 * TIMEOUT
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "the agent's output did not end"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            buf += chunk
    *lines, rest = bytes(buf).split(b"\n")
    return [json.loads(line) for line in lines if line.strip()], rest


def _answers(msgs: list[dict]) -> dict:
    return {m["id"]: m for m in msgs if "id" in m and "method" not in m}


def test_every_answer_is_written_whole_before_the_agent_exits_on_the_end_of_its_input(tmp_path):
    """A client sends many requests (answered with about as many bytes) and closes its input,
    reading as fast as it can: every one is answered, every line whole, exit 0 (the agent
    exited with the pipe's last 4-64 KiB unwritten: the SDK's writer waits only until the pipe
    has room, not until it took everything)."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}})
    c = _Client(config, tmp_path / "agent.stderr")
    try:
        _initialized(c)

        def requests() -> None:
            for i in range(300):
                c.proc.stdin.write(json.dumps(req(101 + i, "session/new", cwd="/", mcpServers="x" * PAD)).encode()
                                   + b"\n")
            c.proc.stdin.close()

        writer = threading.Thread(target=requests, daemon=True)
        writer.start()
        msgs, rest = _read_to_end(c)
        writer.join(TIMEOUT)
        assert rest == b"", f"a half line of {len(rest)} bytes at the end"
        assert sorted(_answers(msgs)) == list(range(101, 401))
        assert c.proc.wait(TIMEOUT) == 0
    finally:
        c.reap()


def test_the_last_answers_wait_for_the_client_before_the_agent_exits(tmp_path):
    """The client sends requests whose answers (about 110 KiB in all) fit in the pipe and the
    agent's write buffer, closes its input, and reads only once the agent has exited or 1 s
    has passed: every answer comes, every line whole (the agent exited at once with what its
    write buffer still held, a half line and the last answers, unwritten)."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}})
    c = _Client(config, tmp_path / "agent.stderr")
    try:
        _initialized(c)
        c.send(*[req(101 + i, "session/new", cwd="/", mcpServers="x" * 3000) for i in range(35)])
        c.proc.stdin.close()
        try:
            c.proc.wait(1.0)  # (what it still holds must wait for the client to read it)
        except subprocess.TimeoutExpired:
            pass
        msgs, rest = _read_to_end(c)
        assert rest == b"", f"a half line of {len(rest)} bytes at the end"
        assert sorted(_answers(msgs)) == list(range(101, 136))
        assert c.proc.wait(TIMEOUT) == 0
    finally:
        c.reap()


@pytest.mark.parametrize("how", ["eof", "sigterm"])
def test_a_held_client_gets_every_answer_when_its_input_ends_or_the_agent_is_stopped(tmp_path, how):
    """The client floods requests, reading nothing, until the agent holds its input; then its
    input ends (the rest of its last request sent first), or the agent gets SIGTERM; the client
    reads everything: every request is answered (-32602: it was taken, what was held at the
    input's end too; -32800: in flight then, or held when the signal came), every line whole,
    exit 0 (on SIGTERM the agent exited with the pipe's last bytes, a half line, unwritten)."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}})
    c = _Client(config, tmp_path / "agent.stderr")
    try:
        _initialized(c)
        n, pending = _flood(c)
        if how == "eof":
            def rest() -> None:
                c.proc.stdin.write(pending)
                c.proc.stdin.close()

            writer = threading.Thread(target=rest, daemon=True)
            writer.start()
            expected = list(range(101, 101 + n))
        else:
            c.proc.send_signal(signal.SIGTERM)
            expected = list(range(101, 101 + n - (1 if pending else 0)))  # (the last one, if cut, never ends)
        msgs, rest_of_output = _read_to_end(c)
        assert rest_of_output == b"", f"a half line of {len(rest_of_output)} bytes at the end"
        answers = _answers(msgs)
        assert sorted(k for k in answers if k > 100) == expected
        codes = [answers[k]["error"]["code"] for k in expected]
        assert set(codes) <= {-32602, -32800}, set(codes)
        if how == "sigterm":
            assert -32800 in codes  # (the held ones)
        assert c.proc.wait(TIMEOUT) == 0
        assert "Traceback" not in c.log(), c.log()[-3000:]
    finally:
        c.reap()


def test_after_a_signal_the_input_is_read_again_while_the_client_still_reads_nothing(tmp_path):
    """The client floods requests, reading nothing, until the agent reads no more of its input;
    then the agent gets SIGTERM: from then on nothing is held (docs/PROTOCOL.md §13), so the
    agent reads its input again though the client has still read nothing (the rest of the last
    request and one more go in, where the pipe stayed full and the write failed as the agent
    exited), and the request sent after the signal is answered -32800."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}})
    c = _Client(config, tmp_path / "agent.stderr")
    try:
        _initialized(c)
        n, pending = _flood(c)
        c.proc.send_signal(signal.SIGTERM)
        late = 100 + n + 1
        data = pending + json.dumps(req(late, "session/list")).encode() + b"\n"
        fd = c.proc.stdin.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + TIMEOUT
        try:
            while data:  # the client still reads nothing meanwhile
                assert time.monotonic() < deadline, "the agent still reads nothing after the signal"
                try:
                    data = data[os.write(fd, data):]
                except BlockingIOError:
                    select.select([], [fd], [], 0.5)
        except BrokenPipeError:
            raise AssertionError("the agent exited without reading its input again") from None
        finally:
            os.set_blocking(fd, True)
        msgs, _ = _read_to_end(c)
        answers = _answers(msgs)
        assert answers[late]["error"]["code"] == -32800, answers[late]
        assert c.proc.wait(TIMEOUT) == 0
    finally:
        c.reap()


def test_a_permission_answer_sent_while_held_is_taken_once_the_client_reads(tmp_path, ws):
    """A prompt asks permission; the client floods requests, reading nothing, until the agent
    holds its input, then answers the permission and reads again: the prompt completes."""
    call = ("write_file", {"path": "a.txt", "content": "x\n"})
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("", [call]), reply("done"))}})
    c = _Client(config, tmp_path / "agent.stderr")
    try:
        sid = _opened(c, ws)
        c.send(prompt(3, sid))
        ask = c.until(lambda m: m.get("method") == "session/request_permission")
        _, pending = _flood(c, 1000)
        option = ask["params"]["options"][0]["optionId"]
        answer = {"jsonrpc": "2.0", "id": ask["id"], "result": {"outcome": {"outcome": "selected", "optionId": option}}}

        def rest() -> None:
            c.proc.stdin.write(pending + json.dumps(answer).encode() + b"\n")
            c.proc.stdin.flush()

        writer = threading.Thread(target=rest, daemon=True)
        writer.start()
        assert c.until(lambda m: m.get("id") == 3)["result"]["stopReason"] == "end_turn"
        writer.join(TIMEOUT)
        c.proc.stdin.close()
        assert c.proc.wait(TIMEOUT) == 0
    finally:
        c.reap()


def test_a_failed_write_to_a_stdout_that_is_a_file_is_told_in_one_line(tmp_path):
    """stdout is a device whose writes fail (/dev/full: a full disk): the agent stops at once,
    exit 0, with one warning line (it said it twice: its output cannot be written, and "the
    client's end of stdout is gone", which it is not)."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}})
    err = tmp_path / "agent.stderr"
    with open(err, "wb") as log, open("/dev/full", "wb") as full:
        proc = subprocess.Popen(AGENT + ["--config", config], stdin=subprocess.PIPE, stdout=full, stderr=log,
                                env=agent_env())
    try:
        proc.stdin.write(json.dumps(req(1, "initialize", protocolVersion=1, clientCapabilities={})).encode() + b"\n")
        proc.stdin.flush()
        assert proc.wait(TIMEOUT) == 0  # (its input still open)
        text = err.read_text(errors="replace")
        warnings = [line for line in text.splitlines() if "WARNING" in line or "ERROR" in line]
        assert len(warnings) == 1 and "the agent's output cannot be written" in warnings[0], text
        assert "Traceback" not in text, text
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _fill(writer) -> None:
    """More than 8 MiB of output for the client to read: the input is held until it reads."""
    writer.write(b'{"jsonrpc":"2.0","method":"pad","params":"' + b"x" * (9 << 20) + b'"}\n')


@contextlib.asynccontextmanager
async def _held_connection(taken: list):
    """In process, over real pipes: the real connection's streams (``_bounded_streams``) under
    the SDK's connection, screened (``screen_messages``), its handler noting each method taken,
    and a client that reads nothing: more than 8 MiB of output wait, so the input is held.
    (its writer, its bounded streams, the client's ends: input to write, output to read; all
    closed at the end)"""
    from acp.connection import Connection

    from operate_sidecar.server.acp.run import _bounded_streams, screen_messages

    r_in, client_in = os.pipe()
    client_out, w_out = os.pipe()
    reader, writer, bound = await _bounded_streams(r_in, w_out, 1 << 20, drains=True)

    async def handler(method: str, params, is_notification: bool):
        taken.append(method)

    conn = Connection(handler, writer, reader, listening=False)
    screen_messages(conn, bound.backlog)
    listening = asyncio.get_running_loop().create_task(conn.main_loop())
    try:
        _fill(writer)
        assert bound.backlog.paused
        yield writer, bound, client_in, client_out
    finally:
        listening.cancel()
        writer.close()
        os.close(client_in)
        os.close(client_out)


async def _read_out(client_out: int, bound, done) -> None:
    """The client reads the output until ``done()`` (bounded)."""
    os.set_blocking(client_out, False)
    deadline = time.monotonic() + TIMEOUT
    while not done():
        assert time.monotonic() < deadline
        try:
            os.read(client_out, 1 << 20)
        except BlockingIOError:
            await asyncio.sleep(0.01)


def _note(method: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "method": method}).encode() + b"\n"


def test_a_burst_the_sdk_has_read_is_not_taken_while_the_input_is_held():
    """Lines the SDK's reader already holds (read at once before the hold) are not taken while
    the client does not read: only once it reads again (else such a burst was all served, its
    answers piling up, whatever the hold)."""
    async def main() -> None:
        taken: list = []
        async with _held_connection(taken) as (writer, bound, client_in, client_out):
            for i in range(3):
                bound._feed(_note(f"x/{i}"))  # in the SDK's reader, as a burst read before the hold
            for _ in range(100):
                await asyncio.sleep(0)
            assert taken == []
            await _read_out(client_out, bound, lambda: len(taken) == 3)
            assert taken == ["x/0", "x/1", "x/2"]

    asyncio.run(main())


def test_once_released_the_input_is_never_held_again():
    """A signal (or the input's end) releases the input: however much output waits later, what
    the client sends is taken at once (a request after a signal is answered -32800 at once)."""
    async def main() -> None:
        taken: list = []
        async with _held_connection(taken) as (writer, bound, client_in, client_out):
            bound.backlog.release()
            await _read_out(client_out, bound, lambda: bound.backlog.size == 0)
            await asyncio.sleep(0)
            _fill(writer)
            os.write(client_in, _note("after"))
            deadline = time.monotonic() + TIMEOUT
            while taken != ["after"]:
                assert time.monotonic() < deadline, taken
                await asyncio.sleep(0.01)

    asyncio.run(main())
