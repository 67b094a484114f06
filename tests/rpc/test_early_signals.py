"""A signal that comes while the server starts, before its loop runs (docs/PROTOCOL.md §2): it
is recorded from the first lines of ``main`` and taken once the loop runs, as if it came then
(after the input the client had sent by then): the exit of a signal (1, no ``shutdown``), the
requests read by then answered, no traceback. Never the process killed by the signal, nor a
KeyboardInterrupt traceback, with a request it was sent left unanswered.

The moment is made certain, not guessed: ``--config`` names a FIFO, which the server opens
and reads while it starts (before its front end, its loop and the heavy imports), so the test
knows the server is there, sends the signal (and the client's requests), and only then lets
the start go on by writing the configuration."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from .support import ROOT, SERVER, TIMEOUT, server_env


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _frames(data: bytes) -> list[dict]:
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        n = int(head.split(b":")[1])
        out.append(json.loads(rest[:n]))
        data = rest[n:]
    return out


def open_fifo_once_read(fifo: str, proc: subprocess.Popen) -> int:
    """The FIFO's write end, once the server has it open to read (bounded wait)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # (no reader yet)
                raise
        assert proc.poll() is None, f"the server exited ({proc.returncode}) before reading its config"
        assert time.monotonic() < deadline, "the server did not open its config"
        time.sleep(0.01)


def run_to_end(proc: subprocess.Popen) -> tuple[bytes, int]:
    """All the server writes to stdout, and its exit code, its stdin left open (bounded)."""
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        code = proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server still runs {TIMEOUT} s after the signal") from None
    reader.join(TIMEOUT)
    assert out, "the server's stdout did not end"
    return out[0], code


def signalled_while_starting(tmp_path, sig: signal.Signals, requests: list[dict], before: bool,
                             acp: bool = False) -> tuple[bytes, int, str]:
    """Start a server (``--acp``: the ACP one) and, while it reads its config, send it ``sig``
    and then ``requests`` (``before``: the requests first); then let it start. Returns what it
    wrote on stdout, its exit code and its stderr."""
    fifo = str(tmp_path / "settings.toml")
    os.mkfifo(fifo)
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as sink:
        proc = subprocess.Popen(SERVER + ["--config", fifo] + (["--acp"] if acp else []), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=sink, env=server_env(), cwd=str(ROOT))
    try:
        config = open_fifo_once_read(fifo, proc)
        data = b"".join((json.dumps(r).encode() + b"\n") if acp else _frame(r) for r in requests)

        def send() -> None:
            proc.stdin.write(data)
            proc.stdin.flush()

        if before:
            send()
        proc.send_signal(sig)  # the server is still starting: no loop runs yet
        if not before:
            send()
        os.close(config)  # an empty config: the start goes on
        out, code = run_to_end(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdin.close()
        proc.stdout.close()
    return out, code, err.read_text(errors="replace")


SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_the_server_starts_with_no_request_sent_ends_it_as_a_signal_does(tmp_path, sig):
    out, code, err = signalled_while_starting(tmp_path, sig, [], before=False)
    assert code == 1, err
    assert out == b""
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.parametrize("before", [True, False], ids=["requests-then-signal", "signal-then-requests"])
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_the_server_starts_answers_the_requests_sent_then_exits_1(tmp_path, sig, before):
    """The requests the client sent while the server started (before the signal or right after)
    are read first, the loop taking the signal after them: ``initialize`` is answered, the
    request behind it too (its result, or -32800 as the server stops), none dropped."""
    requests = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
                {"jsonrpc": "2.0", "id": 2, "method": "listBranches", "params": {}}]
    out, code, err = signalled_while_starting(tmp_path, sig, requests, before)
    assert code == 1, err
    answers = {m["id"]: m for m in _frames(out) if "id" in m}
    assert answers[1]["result"]["protocolVersion"] == 1, answers
    assert "result" in answers[2] or answers[2]["error"]["code"] == -32800, answers
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def _started_on_a_config_nobody_writes(tmp_path, extra: list[str] = ()) -> tuple[subprocess.Popen, int]:
    """A server reading its ``--config`` FIFO (which the test has open to write), and that FIFO."""
    fifo = str(tmp_path / "settings.toml")
    os.mkfifo(fifo)
    proc = subprocess.Popen(SERVER + ["--config", fifo, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=server_env(), cwd=str(ROOT))
    return proc, open_fifo_once_read(fifo, proc)


def _ended(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=TIMEOUT)
        raise AssertionError(f"the server still runs {TIMEOUT} s after the signal") from None
    return proc.returncode, err.decode(errors="replace")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_second_signal_stops_a_server_stuck_starting(tmp_path, sig):
    """Its start does not end (nobody writes the config): the first signal is held for the loop
    that never comes; a second one stops the process as it would have without the server's
    handling (SIGTERM and SIGHUP kill it, SIGINT raises KeyboardInterrupt)."""
    proc, config = _started_on_a_config_nobody_writes(tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:  # (one is not enough: the same signal twice before the first is taken is one)
            proc.send_signal(sig)
            try:
                proc.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "the signals did not stop the server stuck starting"
        code, err = _ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        os.close(config)
    if sig == signal.SIGINT:
        assert code != 0 and "KeyboardInterrupt" in err, (code, err)
    else:
        assert code == -sig, (code, err)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_while_the_server_starts_is_not_dropped_when_it_does_not_serve(tmp_path, sig):
    """A bad config: the server exits 2 without serving. The signal that came meanwhile is not
    dropped: it ends the process, as it would have without the server's handling."""
    proc, config = _started_on_a_config_nobody_writes(tmp_path)
    try:
        proc.send_signal(sig)
        os.write(config, b"this is not toml = = =\n")
        os.close(config)
        config = -1
        code, err = _ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        if config >= 0:
            os.close(config)
    assert "bad configuration" in err, err
    assert code == -sig, (code, err)


HAND_OVER = r'''
import asyncio, os, signal, sys, threading
from operate_sidecar.server.__main__ import EarlySignals
from operate_sidecar.server import signals
from operate_sidecar.server.rpc.run import take_signals

early = EarlySignals()
loop = asyncio.new_event_loop()
taken = []
def handler(sig):
    taken.append(sig)
    loop.stop()

# a thread already running (as a tool's) takes a SIGTERM as the main thread hands the signals over
go, done = threading.Event(), threading.Event()
def kill():
    go.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    done.set()
threading.Thread(target=kill, daemon=True).start()

real = signals.install_signal_handlers
def install_signal_handlers(*args, **kwargs):
    go.set()
    assert done.wait(%(timeout)s)
    real(*args, **kwargs)

import operate_sidecar.server.rpc.run as run
run.install_signal_handlers = install_signal_handlers
take_signals(loop, handler, with_signal=True, early=early)
loop.call_later(%(timeout)s, loop.stop)
loop.run_forever()
for _ in range(10):  # (a second time would be seen by now)
    loop.call_soon(loop.stop)
    loop.run_forever()
print([int(s) for s in taken], signals._before_loop[signal.SIGTERM] == signal.SIG_DFL)
'''


def test_a_signal_while_the_loop_takes_the_signals_over_is_taken_once_never_fatal(tmp_path):
    """The loop's handlers go straight over the start-up's: a SIGTERM taken by another thread
    meanwhile neither kills the process (the disposition from before, SIG_DFL) nor is lost; the
    loop takes it once. A child forked later gets the disposition from before, not the
    start-up's recorder."""
    proc = subprocess.run([*SERVER[:1], "-c", HAND_OVER % {"timeout": TIMEOUT}], capture_output=True,
                          env=server_env(), cwd=str(ROOT), timeout=TIMEOUT * 2)
    assert proc.returncode == 0, (proc.returncode, proc.stderr.decode(errors="replace"))
    assert proc.stdout.decode().split() == [f"[{int(signal.SIGTERM)}]", "True"], proc.stdout


WITHOUT = r'''
import signal, sys
del signal.SIGHUP, signal.pthread_sigmask
from operate_sidecar.server.__main__ import main
sys.exit(main(["--version"]))
'''


def test_version_runs_where_the_platform_lacks_sighup_and_signal_masks():
    """(as on Windows): --version and --help ask nothing of the signals the loop would take."""
    proc = subprocess.run([*SERVER[:1], "-c", WITHOUT], capture_output=True, env=server_env(), cwd=str(ROOT),
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stdout.decode().startswith("operate-sidecar"), proc.stdout
