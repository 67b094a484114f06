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


def guard_stdio() -> tuple[int, int]:
    """Return ``(wire_in_fd, wire_out_fd)``; fd 0 → /dev/null, fd 1 → stderr."""
    try:
        sys.stdout.flush()
    except Exception:
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

    __slots__ = ("_f", "_lock", "closed", "on_broken", "_loop", "_loop_thread", "_deferred")

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

    def send_bytes(self, body: bytes) -> None:
        if self.closed:
            return
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
