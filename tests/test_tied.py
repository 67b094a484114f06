"""tests/tied.py: what a test starts in a tied process group does not outlive the test process,
even when that process is killed (a pytest worker that crashes), and a command that times out
takes what it started with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tied import run_tied
from wedge_tools import gone

HERE = Path(__file__).resolve().parent
WAIT_S = 20


def test_a_tied_server_dies_with_the_process_that_started_it_when_that_one_is_killed():
    """The worker's stand-in starts a server that never ends by itself (with a child of its own)
    and is then SIGKILLed, as a crashed worker: both are gone within seconds."""
    code = (
        "import os, signal, subprocess, sys, time\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from tied import popen_tied\n"
        "p, tie = popen_tied([sys.executable, '-c', 'import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(300)\"]); "
        "print(c.pid, flush=True); time.sleep(300)'], stdout=subprocess.PIPE, text=True)\n"
        "print(p.pid, p.stdout.readline().strip(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    worker = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S)
    assert worker.returncode == -9, worker.stderr
    server, grandchild = (int(x) for x in worker.stdout.split())
    try:
        assert gone(server, WAIT_S), "the server outlived the killed process that started it"
        assert gone(grandchild, WAIT_S), "the server's own child outlived it"
    finally:
        for pid in (server, grandchild):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_run_tied_kills_what_a_timed_out_command_started_and_keeps_its_output(tmp_path):
    """``subprocess.run`` kills only the process it started on a time-out; ``run_tied`` kills
    the group, so the background child is gone too, and the output so far is kept."""
    pidfile = tmp_path / "pid"
    script = (f"sleep 300 & echo $! > {pidfile}; echo started; "
              "sleep 300")
    with pytest.raises(subprocess.TimeoutExpired) as got:
        run_tied(["sh", "-c", script], 1.5, text=True)
    assert "started" in str(got.value.stdout)
    assert gone(int(pidfile.read_text()), WAIT_S), "the timed-out command's background child lived on"


def test_run_tied_returns_as_subprocess_run_does_and_kills_what_the_command_left_running(tmp_path):
    pidfile = tmp_path / "pid"
    p = run_tied(["sh", "-c", f"sleep 300 >/dev/null 2>&1 & echo $! > {pidfile}; echo out; echo err >&2; exit 3"], WAIT_S, text=True)
    assert (p.returncode, p.stdout, p.stderr) == (3, "out\n", "err\n")
    assert gone(int(pidfile.read_text()), WAIT_S), "what the command left running outlived it"
