"""How `make demo` (clients/python/demo.py) ends when it does not end well: stopped at a terminal
(Ctrl-C), by `kill` (SIGTERM) or by a closed terminal (SIGHUP) it says so in one line, exits
128 + the signal's number and leaves nothing behind (no workspace, no server log, no server);
and the server's stderr goes to a file of the run's own, whatever the temporary folder holds."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import uuid
from pathlib import Path

import pytest
from process_support import marked_processes

from operate_sidecar.clients.python import demo
from operate_sidecar.clients.python.client import SidecarClient

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


class Terminal:
    """The demo at a terminal of its own (a pty: its controlling terminal, so Ctrl-C typed there
    reaches it as a terminal's does), its output read as it comes."""

    def __init__(self, env: dict[str, str]) -> None:
        self.leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
        # `setsid -c`: a session of its own, with this pty as its controlling terminal
        self.proc = subprocess.Popen([shutil.which("setsid") or "setsid", "-c", sys.executable, "-m",
                                      "operate_sidecar.clients.python.demo"],
                                     stdin=follower, stdout=follower, stderr=follower, cwd=ROOT, env=env)
        os.close(follower)
        self.out = b""
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.leader, 65536)
            except OSError:  # every end of the pty closed: the demo is gone
                data = b""
            with self.cond:
                self.out += data
                self.cond.notify_all()
            if not data:
                return

    def wait_for(self, pattern: bytes, timeout: float = 120) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: re.search(pattern, self.out), timeout):
                raise AssertionError(f"{pattern!r} not shown within {timeout} s:\n{self.text()}")

    def text(self) -> str:
        """The output without its terminal control sequences."""
        plain = re.sub(rb"\x1b\[[0-9;?]*[a-zA-Z]|\x1b\][^\x07]*\x07", b"", self.out)
        return plain.decode("utf-8", "replace").replace("\r", "")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.leader)


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM", "SIGHUP"])
def test_a_demo_stopped_during_its_operate_says_one_line_and_leaves_nothing(tmp_path, how):
    mark = f"DEMO_TEST_{uuid.uuid4().hex}"
    env = {**os.environ, "TMPDIR": str(tmp_path), mark: "1", "TERM": "xterm"}
    env.pop("FORCE_COLOR", None)
    term = Terminal(env)
    try:
        term.wait_for(rb"deltas: [1-9]")        # the local model is streaming its reply
        assert len(marked_processes(mark)) > 1, "no server running"   # (the demo itself, and its server)
        if how == "Ctrl-C":
            os.write(term.leader, b"\x03")      # typed at the terminal: SIGINT to its foreground job
        else:
            term.proc.send_signal(getattr(signal, how))
        code = term.proc.wait(60)
        with term.cond:                          # its last words
            term.cond.wait_for(lambda: b"demo interrupted" in term.out, 10)
        out = term.text()
    finally:
        term.close()
    signum = signal.SIGINT if how == "Ctrl-C" else getattr(signal, how)
    assert code == 128 + signum, (code, out)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    lines = [ln for ln in out.splitlines() if "demo interrupted" in ln]
    assert lines == [f"demo interrupted ({how}): the sidecar is stopped and the demo's files are removed"], out
    assert list(tmp_path.iterdir()) == []       # no workspace (greeting.py), no server log
    deadline = time.monotonic() + 10
    while marked_processes(mark) and time.monotonic() < deadline:  # the server was SIGKILLed
        time.sleep(0.05)
    assert marked_processes(mark) == {}


def dying_server(monkeypatch, message: str = "Traceback: llama model file not found") -> None:
    """The demo's server: one that writes ``message`` on stderr and exits at once."""
    def dying(argv, **kw):
        return SidecarClient([sys.executable, "-c", f"import sys; sys.stderr.write({message + chr(10)!r}); sys.exit(3)"], **kw)

    monkeypatch.setattr(demo, "SidecarClient", dying)


def named_log(out: str) -> Path:
    m = re.search(r"^the sidecar's whole stderr: (\S+)$", out, re.M)
    assert m, out
    return Path(m.group(1))


def test_each_run_logs_to_a_file_of_its_own_whatever_the_temporary_folder_holds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(demo.tempfile, "tempdir", None)
    # the name an earlier demo used, taken by something this user cannot write (another user's
    # file; here a folder): it is not this run's
    (tmp_path / "operate-sidecar-demo.stderr.log").mkdir()
    logs = []
    for i in range(2):
        dying_server(monkeypatch, f"run {i}: model file not found")
        assert demo.main() == 1
        out = capsys.readouterr().out
        assert "demo failed" in out and f"│ run {i}: model file not found" in out, out
        logs.append(named_log(out))
    # two runs, two files, each with its own server's words, kept (the demo failed) and named
    assert logs[0] != logs[1] and all(p.parent == tmp_path for p in logs), logs
    assert [p.read_text() for p in logs] == ["run 0: model file not found\n", "run 1: model file not found\n"]
    assert all(re.fullmatch(r"operate-sidecar-demo-\w+\.stderr\.log", p.name) for p in logs), logs
    assert oct(logs[0].stat().st_mode & 0o777) == "0o600"


def test_a_temporary_folder_that_does_not_exist_is_not_a_traceback(tmp_path, monkeypatch, capsys):
    # TMPDIR names a folder that is not there: the demo uses the next usable one, as tempfile does
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    monkeypatch.setattr(demo.tempfile, "tempdir", None)
    dying_server(monkeypatch)
    assert demo.main() == 1
    log = named_log(capsys.readouterr().out)
    try:
        assert log.is_file() and log.parent == Path(demo.tempfile.gettempdir())
    finally:
        log.unlink()


def test_no_usable_temporary_folder_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo.tempfile, "tempdir", str(tmp_path / "missing"))
    assert demo.main() == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo failed: ") and str(tmp_path / "missing") in lines[0], \
        captured
    assert "Traceback" not in captured.out + captured.err
