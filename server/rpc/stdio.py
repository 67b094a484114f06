"""Process-level stdio hardening and the raw wire.

``guard_stdio()`` must run before anything else writes: it moves the real
stdout to a private file descriptor used only for protocol frames, points fd 1
at stderr (so ``print()`` in tools and the output of child processes land on
stderr) and points fd 0 at /dev/null (so child processes never read the
protocol stream). ``Wire`` writes whole frames (a burst in one loop iteration
in one ``write``);
``attach_reader`` feeds stdin bytes to a callback on the event loop without a
thread hop when stdin is a pipe, socket or tty.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import stat
import sys
import threading
from typing import Callable

from .framing import encode_frame

log = logging.getLogger(__name__)


_WIRE_IS_TTY = False
_GUARDED = False   # guard_stdio() ran: this process is the sidecar, not a host embedding it


def guard_stdio() -> tuple[int, int]:
    """Return ``(wire_in_fd, wire_out_fd)``; fd 0 → /dev/null, fd 1 → stderr."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    global _WIRE_IS_TTY, _GUARDED
    _GUARDED = True
    try:
        _WIRE_IS_TTY = os.isatty(0)
    except OSError:
        pass
    wire_out = os.dup(1)          # dup() makes non-inheritable fds: children never see them
    wire_in = os.dup(0)
    os.dup2(2, 1)                 # anything written to fd 1 (print, children) goes to stderr
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)           # children and stray input() read /dev/null, not the protocol
    os.close(devnull)
    sys.stdout = sys.stderr
    try:
        sys.stdin = open(os.devnull, "r")
    except OSError:
        pass
    return wire_in, wire_out


class Wire:
    """The protocol output: exactly ``Content-Length: N\\r\\n\\r\\n<utf-8 json>``,
    safe to call from any thread. The first message in an event-loop iteration is
    flushed at once (no added latency); further messages written on the loop thread
    in the same iteration (a burst of ``$/progress`` deltas, several answers) are
    flushed together at the end of it, one ``write`` instead of one per message.
    Order is kept (one buffer); messages from other threads flush at once."""

    __slots__ = ("_f", "_lock", "closed", "on_broken", "_loop", "_loop_thread", "_deferred", "tap")

    def __init__(self, fd: int, on_broken: Callable[[], None] | None = None) -> None:
        self._f = io.BufferedWriter(io.FileIO(fd, "wb", closefd=True), buffer_size=1 << 16)
        self._lock = threading.Lock()
        self.closed = False
        self.on_broken = on_broken
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._loop_thread = threading.get_ident()
        self._deferred = False  # a flush is scheduled at the end of this loop iteration
        self.tap: Callable[[bytes], None] | None = None  # sees every body sent (``--record``)

    def send_bytes(self, body: bytes) -> None:
        if self.closed:
            return
        if self.tap is not None:
            self.tap(body)
        frame = encode_frame(body)
        try:
            with self._lock:
                self._f.write(frame)
                on_loop = self._loop is not None and threading.get_ident() == self._loop_thread
                if on_loop and self._deferred:
                    return
                self._f.flush()
                if on_loop:
                    try:
                        self._loop.call_soon(self._flush_deferred)  # type: ignore[union-attr]
                        self._deferred = True
                    except RuntimeError:  # the loop is closed: every message flushes at once
                        self._loop = None
        except (BrokenPipeError, ConnectionResetError, ValueError, OSError) as e:
            self._broken(e)

    def _flush_deferred(self) -> None:
        try:
            with self._lock:
                self._deferred = False
                if not self.closed:
                    self._f.flush()
        except (BrokenPipeError, ConnectionResetError, ValueError, OSError) as e:
            self._broken(e)

    def _broken(self, e: BaseException) -> None:
        if not self.closed:
            log.warning("the client's end of stdout is gone (%s)", type(e).__name__)
            self.closed = True
            if self.on_broken is not None:
                self.on_broken()

    def close(self) -> None:
        self.closed = True
        try:
            with self._lock:
                self._f.close()
        except Exception:
            pass


class _ReadProtocol(asyncio.Protocol):
    def __init__(self, on_data: Callable[[bytes], None], on_eof: Callable[[], None]) -> None:
        self._on_data = on_data
        self._on_eof = on_eof

    def data_received(self, data: bytes) -> None:
        self._on_data(data)

    def eof_received(self) -> bool:
        self._on_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_eof()


async def attach_reader(fd: int, on_data: Callable[[bytes], None], on_eof: Callable[[], None]) -> Callable[[], None]:
    """Read ``fd`` on the running loop; returns a ``close()`` callable.
    ``on_eof`` may be called more than once."""
    loop = asyncio.get_running_loop()
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode):
        pipe = os.fdopen(fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(lambda: _ReadProtocol(on_data, on_eof), pipe)
        return transport.close
    # a regular file (``server < script``): the loop cannot poll it, read it on a thread
    stop = threading.Event()

    def pump() -> None:
        try:
            while not stop.is_set():
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                loop.call_soon_threadsafe(on_data, chunk)
        except OSError:
            pass
        try:
            loop.call_soon_threadsafe(on_eof)
        except RuntimeError:
            pass

    threading.Thread(target=pump, name="stdin-reader", daemon=True).start()
    return stop.set


# -- children die with the sidecar ------------------------------------------------

_REAPER: "subprocess.Popen[bytes] | None" = None  # noqa: F821
_REAPER_PIPE: int | None = None

def bind_children_to_process(wire_in: int | None = None) -> bool:
    """Make every process a tool starts (and their children) die with the sidecar.

    The sidecar becomes the leader of a process group of its own (children inherit the
    group), and a tiny reaper process in a session of its own waits for the sidecar to be
    gone, then SIGKILLs that group: tools' children and grandchildren cannot outlive it,
    even when the sidecar is SIGKILLed. CLI models run in groups of their own with
    ``PR_SET_PDEATHSIG`` (``server.models.cli``). Skipped when the wire is a terminal (job
    control) or the group cannot be made. Idempotent; returns whether the reaper runs."""
    global _REAPER, _REAPER_PIPE
    if _REAPER is not None and _REAPER.poll() is None:
        return True
    if not _GUARDED or sys.platform == "win32" or not hasattr(os, "setpgid"):
        return False
    try:
        if _WIRE_IS_TTY or (wire_in is not None and os.isatty(wire_in)):
            return False
        if os.getpgrp() != os.getpid():
            os.setpgid(0, 0)
    except OSError as e:
        log.debug("cannot lead a process group (%s); children may outlive the sidecar", e)
        return False
    from operate_sidecar.server.reaper import start_reaper

    started = start_reaper(os.getpid())  # tools' children never hold the pipe's write end
    if started is None:
        return False
    _REAPER, _REAPER_PIPE = started
    return True
