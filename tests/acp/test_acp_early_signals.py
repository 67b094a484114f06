"""``operate-sidecar --acp`` sent a signal while it starts, before its loop runs (the SDK's and
the core's imports take a good part of a second): the signal is recorded from the first lines
of ``main`` and taken once the connection is set up, as if it came then, after the lines the
client had sent by then (docs/PROTOCOL.md §13): exit code 0, each request read answered (its
result, or -32800 saying the agent was asked to stop), none dropped, no traceback. The
process used to be killed by the signal (-15), or to print a KeyboardInterrupt traceback,
with the client's ``initialize`` never answered.

The moment is made certain: ``--config`` names a FIFO, which the agent reads while it starts
(before the SDK, the loop and the signal handlers), so the test sends the signal and its
lines while it is there, then lets it go on by writing the configuration."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from acp_support import AGENT, TIMEOUT, agent_env

SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def _open_fifo_once_read(fifo: str, proc: subprocess.Popen) -> int:
    """The FIFO's write end, once the agent has it open to read (bounded wait)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # (no reader yet)
                raise
        assert proc.poll() is None, f"the agent exited ({proc.returncode}) before reading its config"
        assert time.monotonic() < deadline, "the agent did not open its config"
        time.sleep(0.01)


def _signalled_while_starting(tmp_path, sig: signal.Signals, lines: list[dict],
                              before: bool) -> tuple[list[dict], int, str]:
    """Start the agent and, while it reads its config, send it ``sig`` and then ``lines``
    (``before``: the lines first), its stdin left open; then let it start. Returns the
    messages it wrote, its exit code and its stderr."""
    fifo = str(tmp_path / "settings.toml")
    os.mkfifo(fifo)
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as sink:
        proc = subprocess.Popen(AGENT + ["--config", fifo], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=sink, env=agent_env(), cwd=str(tmp_path))
    try:
        config = _open_fifo_once_read(fifo, proc)
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)

        def send() -> None:
            proc.stdin.write(data)
            proc.stdin.flush()

        if before:
            send()
        proc.send_signal(sig)  # the agent is still starting: no loop runs yet
        if not before:
            send()
        os.close(config)  # an empty config: the start goes on
        out: list[bytes] = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        try:
            code = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent still runs {TIMEOUT} s after the signal") from None
        reader.join(TIMEOUT)
        assert out, "the agent's stdout did not end"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdin.close()
        proc.stdout.close()
    return [json.loads(line) for line in out[0].splitlines()], code, err.read_text(errors="replace")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_the_agent_starts_with_nothing_sent_ends_it_with_exit_0(tmp_path, sig):
    msgs, code, err = _signalled_while_starting(tmp_path, sig, [], before=False)
    assert code == 0, err
    assert msgs == []
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.parametrize("before", [True, False], ids=["lines-then-signal", "signal-then-lines"])
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_the_agent_starts_answers_the_requests_sent_then_exits_0(tmp_path, sig, before):
    lines = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
             {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": str(tmp_path), "mcpServers": []}}]
    msgs, code, err = _signalled_while_starting(tmp_path, sig, lines, before)
    assert code == 0, err
    answers = {m["id"]: m for m in msgs if "id" in m and "method" not in m}
    assert sorted(answers) == [1, 2], msgs  # none dropped
    for msg_id, method in ((1, "initialize"), (2, "session/new")):
        answer = answers[msg_id]
        if "error" in answer:  # in flight as the signal was taken
            assert answer["error"]["code"] == -32800, answer
            assert f"the agent was asked to stop ({sig.name})" in answer["error"]["message"], answer
            assert answer["error"]["data"] == {"method": method}, answer
        elif msg_id == 1:
            assert answer["result"]["protocolVersion"] == 1, answer
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
