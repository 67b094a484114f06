"""Processes a test starts that would not end by themselves if the test process died: a
``llama_cpp.server``, the VS Code harness with its code-server and browser, npm and node. Each
runs in a process group of its own, tied to the test process by the sidecar's own reaper
(``server/reaper.py``): when a pytest worker crashes or is killed, the reaper kills the group,
so nothing is left running (before, a worker that died left its ``llama_cpp.server`` children
serving for ever). Closing the tie on purpose kills the group too."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from operate_sidecar.server.reaper import start_reaper

REAPER_EXIT_S = 10


class Tie:
    """The reaper of one process group, and the pipe end that keeps it waiting."""

    def __init__(self, pgid: int) -> None:
        started = start_reaper(pgid)
        if started is None:  # no sh here: the test would run with nothing to clean up after a crash
            raise RuntimeError(f"cannot start a reaper for process group {pgid}")
        self.reaper, self._w = started

    def close(self) -> None:
        """Kill whatever of the group is left (the reaper does, once its pipe ends) and wait for it."""
        if self._w >= 0:
            os.close(self._w)
            self._w = -1
        try:
            self.reaper.wait(timeout=REAPER_EXIT_S)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
            self.reaper.wait(timeout=REAPER_EXIT_S)


def popen_tied(argv: list[str], **kw: Any) -> tuple[subprocess.Popen, Tie]:
    """``subprocess.Popen`` in a new session (so its own process group), tied to this process."""
    proc = subprocess.Popen(argv, start_new_session=True, **kw)
    try:
        return proc, Tie(proc.pid)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def run_tied(argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, timeout=timeout, capture_output=True, ...)`` in a process group of
    its own, tied to this process: on a time-out the whole group is killed (``subprocess.run``
    kills only the process it started, and what that started lived on) and ``TimeoutExpired``
    carries the output so far; on any ending, what the command left running is killed."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    proc, tie = popen_tied(argv, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        try:  # the output so far; a process that left the group may still hold the pipes
            e.stdout, e.stderr = proc.communicate(timeout=REAPER_EXIT_S)
        except subprocess.TimeoutExpired:
            pass
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        tie.close()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
