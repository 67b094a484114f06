"""What the test files that drive real processes share: the small programs they write, a CLI
model's run cancelled once its program has said its pids, whether a process runs, the processes
of a run found by a marker in their environment (every process the run starts inherits it), and
a server sent a signal while it starts (held reading its ``--config`` FIFO)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import anyio


def script(folder: Path, name: str, body: str) -> str:
    """A small program written by the test: ``body`` (dedented) as ``folder/name``; its path."""
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return str(path)


async def cancel_once_said(model: Any, request: Any, said: list[int], timeout: float,
                           before_cancel: Callable[[], None] | None = None) -> None:
    """Run ``model`` (a ``provider: cli`` one) on ``request`` until its program says numbers (a
    text chunk: pids, an inode), kept in ``said``; then call ``before_cancel`` and cancel the run
    as an operate's cancel does. All within ``timeout`` seconds."""
    got = anyio.Event()

    async def consume() -> None:
        async for chunk in model.stream(request):
            if chunk.type == "text":
                said.extend(int(x) for x in chunk.text.split())
                got.set()

    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await got.wait()
            if before_cancel is not None:
                before_cancel()
            tg.cancel_scope.cancel()


def alive(pid: int) -> bool:
    """The process runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def marked_processes(mark: str) -> dict[int, str]:
    """Every live process (not a zombie) whose environment holds ``mark`` (a ``NAME=value`` entry,
    or part of one): pid -> command line, in the order of ``/proc``."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if mark.encode() not in (d / "environ").read_bytes():
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def open_fifo_once_read(fifo: str, proc: subprocess.Popen, timeout: float, who: str = "the server") -> int:
    """The FIFO's write end, once ``proc`` (``who``) has it open to read (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # (no reader yet)
                raise
        assert proc.poll() is None, f"{who} exited ({proc.returncode}) before reading its config"
        assert time.monotonic() < deadline, f"{who} did not open its config"
        time.sleep(0.01)


def signalled_while_starting(argv: list[str], tmp_path: Path, sig: signal.Signals, data: bytes, before: bool, *,
                             env: dict[str, str], cwd: str, timeout: float,
                             who: str = "the server") -> tuple[bytes, int, str]:
    """Start ``argv --config FIFO`` and, while it reads that config, send it ``sig`` and then
    ``data`` on its stdin (``before``: the data first), its stdin left open; then let the start
    go on (an empty config). Returns what it wrote on stdout, its exit code and its stderr."""
    fifo = str(tmp_path / "settings.toml")
    os.mkfifo(fifo)
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as sink:
        proc = subprocess.Popen([*argv, "--config", fifo], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=sink, env=env, cwd=cwd)
    try:
        config = open_fifo_once_read(fifo, proc, timeout, who)

        def send() -> None:
            proc.stdin.write(data)
            proc.stdin.flush()

        if before:
            send()
        proc.send_signal(sig)  # still starting: no loop runs yet
        if not before:
            send()
        os.close(config)  # an empty config: the start goes on
        out: list[bytes] = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{who} still runs {timeout} s after the signal") from None
        reader.join(timeout)
        assert out, f"{who}'s stdout did not end"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout)
        proc.stdin.close()
        proc.stdout.close()
    return out[0], code, err.read_text(errors="replace")
