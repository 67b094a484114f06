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

import os
import signal
import subprocess
import time

import pytest

from process_support import open_fifo_once_read, signalled_while_starting

from .support import ROOT, SERVER, TIMEOUT, frame, server_env, unframe


def _signalled_while_starting(tmp_path, sig: signal.Signals, requests: list[dict],
                              before: bool) -> tuple[bytes, int, str]:
    """Start a server and, while it reads its config, send it ``sig`` and then ``requests``
    (``before``: the requests first); then let it start. Returns what it wrote on stdout, its
    exit code and its stderr."""
    return signalled_while_starting(SERVER, tmp_path, sig, b"".join(frame(r) for r in requests), before,
                                    env=server_env(), cwd=str(ROOT), timeout=TIMEOUT)


SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_the_server_starts_with_no_request_sent_ends_it_as_a_signal_does(tmp_path, sig):
    out, code, err = _signalled_while_starting(tmp_path, sig, [], before=False)
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
    out, code, err = _signalled_while_starting(tmp_path, sig, requests, before)
    assert code == 1, err
    answers = {m["id"]: m for m in unframe(out) if "id" in m}
    assert answers[1]["result"]["protocolVersion"] == 1, answers
    assert "result" in answers[2] or answers[2]["error"]["code"] == -32800, answers
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def _started_on_a_config_nobody_writes(tmp_path, extra: list[str] = ()) -> tuple[subprocess.Popen, int]:
    """A server reading its ``--config`` FIFO (which the test has open to write), and that FIFO."""
    fifo = str(tmp_path / "settings.toml")
    os.mkfifo(fifo)
    proc = subprocess.Popen(SERVER + ["--config", fifo, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=server_env(), cwd=str(ROOT))
    return proc, open_fifo_once_read(fifo, proc, TIMEOUT)


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
