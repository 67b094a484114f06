"""Process-level stdio hardening and the raw wire.

``guard_stdio()`` must run before anything else writes: it moves the real
stdout to a private file descriptor used only for protocol frames, points fd 1
at stderr (so ``print()`` in tools and the output of child processes land on
stderr) and points fd 0 at /dev/null (so child processes never read the
protocol stream). ``Wire`` writes whole frames (a burst in one loop iteration
in one ``write``) and notices at once the client closing its end of a pipe stdout;
``attach_reader`` feeds stdin bytes to a callback on the event loop without a
thread hop when stdin is a pipe, socket or tty (a regular file or /dev/null, which
the loop cannot poll, is read on a thread to its end); ``open_read_transport`` and
``open_write_transport`` do the same for asyncio protocols (the ACP front end).
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import stat
import sys
import threading
import time
from typing import Any, Callable

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
    _reopen_closed_std_fds()
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


def _reopen_closed_std_fds() -> None:
    """A standard descriptor the process was started without (``<&-``, ``>&-``, ``2>&-``) gets
    /dev/null, before anything else can take its number: a closed stdin is an empty input (the
    documented exit at once), a closed stdout discards what the server writes. (Left closed,
    the ``dup`` calls below took those numbers: a closed stdin made the server read its own
    stdout and hang, a closed stdout was a traceback.)"""
    for fd, flags in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        try:
            nul = os.open(os.devnull, flags)
        except OSError:
            continue
        if nul != fd:
            os.dup2(nul, fd)
            os.close(nul)
        if fd == 1:
            log.warning("stdout is closed: nothing the server answers reaches the client")


def _write_only(fd: int) -> bool:
    """Whether ``fd`` was opened for writing only (the loop may watch it for its reader going)."""
    try:
        import fcntl

        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
    except (ImportError, OSError):  # (no fcntl: no such watch either)
        return False


class Wire:
    """The protocol output: exactly ``Content-Length: N\\r\\n\\r\\n<utf-8 json>``,
    safe to call from any thread. The first message in an event-loop iteration is
    written at once (no added latency); further messages written on the loop thread
    in the same iteration (a burst of ``$/progress`` deltas, several answers) are
    written together at the end of it, one ``write`` instead of one per message.
    Order is kept (one buffer).

    When stdout is a pipe or a socket it is written without blocking: what the client
    has not read yet waits in the buffer and goes out as the pipe drains, so a client
    that stops reading never freezes the event loop (signals, the client's death and
    ``exit`` are still served). Once more than ``HIGH_WATER`` bytes wait, ``on_pause``
    is called (the server stops reading requests: memory stays bounded by what is
    already in flight), and ``on_resume`` once the buffer is down to ``LOW_WATER``, whichever
    write drained it (``_resume_if_drained``); both on the loop's thread, ``on_resume`` as a loop
    callback of its own (never inside a ``send_bytes``).

    When stdout is a pipe, the loop also watches it for the client closing its end (or dying)
    while nothing is being written: as asyncio's own write-pipe transport does, the write end
    is registered once for reading, which epoll reports (as an error event) only once the read
    end is gone. That ends the server as a failed write does (``_broken``: the same warning
    line, then ``on_broken``), at once, idle or not; nothing is done per message. Not for a
    socket (the client's own input on it would look the same), a terminal, a regular file, or
    a FIFO opened for reading too (``exec 3<>fifo``: its unread output makes it readable). When
    the end is expected (``expected_end``: the connection stopping, its ``shutdown`` answered,
    an ``exit`` read), the client closing it is a clean end: no warning, ``on_broken`` all the
    same."""

    HIGH_WATER = 8 << 20
    LOW_WATER = 1 << 20

    __slots__ = ("_fd", "_lock", "closed", "on_broken", "on_pause", "on_resume", "_loop", "_loop_thread",
                 "_deferred", "tap", "_buf", "_armed", "_paused", "_watched", "expected_end")

    def __init__(self, fd: int, on_broken: Callable[[], None] | None = None) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self.closed = False
        self.on_broken = on_broken
        self.on_pause: Callable[[], None] | None = None
        self.on_resume: Callable[[], None] | None = None
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._loop_thread = threading.get_ident()
        self._deferred = False  # a write is scheduled at the end of this loop iteration
        self.tap: Callable[[bytes], None] | None = None  # sees every body sent (``--record``)
        self._buf = bytearray()  # frames not written yet
        self._armed = False      # the loop calls ``_on_writable`` when the pipe has room
        self._paused = False     # ``on_pause`` was called and ``on_resume`` not yet
        self._watched = False    # the loop watches the pipe for its read end going (``_on_gone``)
        #: whether the client may close its end now without a warning (its session ended)
        self.expected_end: Callable[[], bool] | None = None
        try:
            mode = os.fstat(fd).st_mode
            if self._loop is not None and (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                os.set_blocking(fd, False)
        except OSError as e:
            log.debug("stdout stays blocking (writes may stall the loop while the reader is slow): %s", e)
            return
        if self._loop is not None and stat.S_ISFIFO(mode) and _write_only(fd):
            try:
                self._loop.add_reader(fd, self._on_gone)
                self._watched = True
            except (RuntimeError, ValueError, OSError) as e:
                log.debug("the client closing its end of stdout is noticed at the next write only: %s", e)

    def _on_gone(self) -> None:
        """The loop saw the pipe's read end closed (a pipe's write end is never readable
        otherwise): the client can be sent nothing more, as after a write that failed with
        EPIPE. The watch stops at once (the error event would otherwise be reported again and
        again); the client is judged one loop step later (``_gone``), once the input the loop
        found ready in the same step as the end is handled: a client that sent ``shutdown`` and
        ``exit`` and then closed stdout may have its input read after the end was seen."""
        self._disarm()
        try:
            self._loop.call_soon(self._gone)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed
            self._gone()

    def _gone(self) -> None:
        self._broken(BrokenPipeError())

    def _on_loop(self) -> bool:
        return self._loop is not None and threading.get_ident() == self._loop_thread

    def send_bytes(self, body: bytes) -> None:
        if self.closed:
            return
        if self.tap is not None:
            self.tap(body)
        frame = encode_frame(body)
        on_loop = self._on_loop()
        try:
            with self._lock:
                self._buf += frame
                if on_loop and (self._deferred or self._armed):
                    pass  # written at the end of this iteration, or when the pipe has room
                else:
                    self._write_locked()
                    if on_loop and not self._deferred:
                        try:
                            self._loop.call_soon(self._flush_deferred)  # type: ignore[union-attr]
                            self._deferred = True
                        except RuntimeError:  # the loop is closed: every message is written at once
                            self._loop = None
                pause = on_loop and not self._paused and len(self._buf) > self.HIGH_WATER
                if pause:
                    self._paused = True
        except (BrokenPipeError, ConnectionResetError, ValueError, OSError) as e:
            self._broken(e)
            return
        if pause and self.on_pause is not None:
            log.warning("the client is not reading the server's output (%d bytes waiting); "
                        "reading no more requests until it does", len(self._buf))
            self.on_pause()

    def _write_locked(self) -> None:
        """Write what the pipe takes now (all of it, blocking, when stdout is not a pipe); when
        some is left, ask the loop to call back once there is room (from any thread)."""
        buf = self._buf
        while buf:
            try:
                n = os.write(self._fd, buf)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            del buf[:n]
        if buf and not self._armed and self._loop is not None:
            self._armed = True
            if self._on_loop():
                self._loop.add_writer(self._fd, self._on_writable)
            else:
                self._loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        """On the loop, asked from another thread's write: the writer callback, unless the
        wire was disarmed or closed meanwhile (``_broken``: a callback on a closed descriptor
        would be called again and again)."""
        if self._armed and not self.closed:
            self._loop.add_writer(self._fd, self._on_writable)  # type: ignore[union-attr]

    def _flush_deferred(self) -> None:
        try:
            with self._lock:
                self._deferred = False
                if not self.closed and not self._armed:
                    self._write_locked()
        except (BrokenPipeError, ConnectionResetError, ValueError, OSError) as e:
            self._broken(e)
            return
        self._resume_if_drained()

    def _on_writable(self) -> None:
        try:
            with self._lock:
                if self.closed:  # (closed by another thread's failed write: its disarm is on its way)
                    self._disarm()
                    return
                self._write_locked_on_room()
        except (BrokenPipeError, ConnectionResetError, ValueError, OSError) as e:
            self._broken(e)
            return
        self._resume_if_drained()

    def _resume_if_drained(self) -> None:
        """On the loop's thread, after every write that may have drained the buffer: once it is
        down to ``LOW_WATER`` after a pause, ``on_resume``. Not only when the pipe had room again
        (``_on_writable``): a frame queued over ``HIGH_WATER`` behind one written in the same
        iteration may go out whole at the end of it (or with another thread's frame) while the
        client reads fast, the pipe never full, the writer callback never armed: input stayed
        paused for good. Called only from those two loop callbacks, never from ``send_bytes``:
        ``on_resume`` hands the held input on, whose handler may send (a ping's answer): run
        from that send, it would hand input on in the middle of the handler (frames handed on
        twice, the parser's buffer cut under it). None
        is missed so: a pause happens on the loop's thread with a flush at the end of the
        iteration or the writer callback pending, and while paused each of them leaves one
        pending until the buffer is down to ``LOW_WATER`` (another thread's write that drains
        it still leaves the pending one to resume). ``on_pause`` and ``on_resume`` alternate."""
        with self._lock:
            resume = self._paused and not self.closed and len(self._buf) <= self.LOW_WATER
            if resume:
                self._paused = False
        if resume and self.on_resume is not None:
            self.on_resume()

    def _write_locked_on_room(self) -> None:
        self._armed = False
        self._loop.remove_writer(self._fd)  # type: ignore[union-attr]
        self._write_locked()

    def _broken(self, e: BaseException) -> None:
        """The client can be sent nothing more: one warning line, what waits dropped,
        ``on_broken``. A client that sent ``shutdown`` or ``exit`` (``expected_end``), and then
        closed its ends (stdout first, say), or did so as the server stops, is done, not gone: an
        info line, whether the server saw its end idle (``_gone``) or at a write. From any thread
        (the loop's ``_gone`` while another writes too): the buffer is cleared under the lock,
        never under a write in progress."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._buf.clear()
        quiet = self.expected_end is not None and self.expected_end()
        if quiet:
            log.info("the client closed its end of stdout; exiting")
        else:
            log.warning("the client's end of stdout is gone (%s)", type(e).__name__)
        self._disarm()
        if self.on_broken is not None:
            self.on_broken()

    def _disarm(self) -> None:
        """The loop no longer watches the pipe: neither for room to write nor for its end (on
        the loop's thread: from another, a failed write there, it is asked to)."""
        if self._loop is None or not (self._armed or self._watched):
            return
        if not self._on_loop():
            try:
                self._loop.call_soon_threadsafe(self._disarm)
            except RuntimeError:  # the loop is closed: it watches nothing any more
                pass
            return
        if self._armed:
            self._armed = False
            try:
                self._loop.remove_writer(self._fd)
            except (RuntimeError, ValueError, OSError):
                pass
        if self._watched and self._loop is not None:
            self._watched = False
            try:
                self._loop.remove_reader(self._fd)
            except (RuntimeError, ValueError, OSError):
                pass

    @property
    def pending(self) -> int:
        """Bytes sent but not yet taken by the pipe."""
        return len(self._buf)

    async def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until everything sent is written; False when the
        client did not read it in time (:meth:`close` then drops it). Used once, on the way out."""
        deadline = time.monotonic() + timeout
        while self._buf and not self.closed:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return not self._buf

    def close(self) -> None:
        self.closed = True
        try:
            with self._lock:
                self._disarm()
                if self._buf:  # one last try, without waiting
                    try:
                        os.write(self._fd, self._buf)
                    except OSError:
                        pass
                    self._buf.clear()
                os.close(self._fd)
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


class Reader:
    """The handle :func:`attach_reader` returns: ``close()`` (also by calling it), and
    ``pause()`` / ``resume()`` (stop and restart taking input: back-pressure while the client
    does not read what the server writes). Call them on the event loop's thread."""

    def __init__(self, close: Callable[[], None], pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self.close, self.pause, self.resume = close, pause, resume

    def __call__(self) -> None:
        self.close()


async def attach_reader(fd: int, on_data: Callable[[bytes], None], on_eof: Callable[[], None]) -> Reader:
    """Read ``fd`` on the running loop; returns its :class:`Reader` handle.
    ``on_eof`` may be called more than once."""
    transport, _ = await open_read_transport(fd, lambda: _ReadProtocol(on_data, on_eof))
    return reader_of(transport)


def reader_of(transport: asyncio.ReadTransport) -> Reader:
    """The :class:`Reader` handle of a read transport (``open_read_transport``'s)."""

    def pause() -> None:
        if not transport.is_closing():
            transport.pause_reading()

    def resume() -> None:
        if not transport.is_closing():
            transport.resume_reading()

    return Reader(transport.close, pause, resume)


def pollable(fd: int) -> bool:
    """Whether the event loop can watch ``fd``: a pipe, a socket, a terminal; not a regular
    file (``server < script``) nor a device such as /dev/null, which epoll refuses."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return True
    if not stat.S_ISCHR(mode):
        return False
    probe = selectors.DefaultSelector()
    try:
        probe.register(fd, selectors.EVENT_READ)
    except (OSError, ValueError):
        return False
    finally:
        probe.close()
    return True


async def open_read_transport(fd: int, protocol_factory: Callable[[], asyncio.Protocol]) \
        -> tuple[asyncio.ReadTransport, asyncio.Protocol]:
    """``loop.connect_read_pipe`` on ``fd`` (which it then owns) when the loop can watch it;
    otherwise (a regular file, /dev/null) the same protocol is fed by a reading thread, to
    the end of the file, then end-of-input as a pipe's."""
    loop = asyncio.get_running_loop()
    if pollable(fd):
        return await loop.connect_read_pipe(protocol_factory, os.fdopen(fd, "rb", buffering=0))
    protocol = protocol_factory()
    return _ThreadReadTransport(loop, fd, protocol), protocol


async def open_write_transport(fd: int, protocol_factory: Callable[[], asyncio.BaseProtocol]) \
        -> tuple[asyncio.WriteTransport, asyncio.BaseProtocol]:
    """``loop.connect_write_pipe`` on ``fd`` (which it then owns) when ``fd`` is a pipe, a
    socket or a terminal; otherwise (a regular file, /dev/null: asyncio's pipe transport
    refuses a file, and such a file never makes a writer wait) each write is written whole
    at once, as the native ``Wire`` writes to such a stdout."""
    loop = asyncio.get_running_loop()
    if pollable(fd):
        return await loop.connect_write_pipe(protocol_factory, os.fdopen(fd, "wb", buffering=0))
    protocol = protocol_factory()
    return _FileWriteTransport(loop, fd, protocol), protocol


def _start_without_signals(thread: threading.Thread) -> None:
    """Start ``thread`` with SIGTERM, SIGINT and SIGHUP blocked in it (it inherits the mask):
    they go to the main thread, whose handlers take them. Taken on this thread while the main
    thread hands them from ``server.__main__.EarlySignals`` to the loop, one could be both
    recorded and written to the loop's wake-up fd: the loop would take it twice."""
    import signal

    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        thread.start()
        return
    held = mask(signal.SIG_BLOCK, [s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGINT", "SIGHUP"))
                                   if s is not None])
    try:
        thread.start()
    finally:
        mask(signal.SIG_SETMASK, held)


class _ThreadReadTransport(asyncio.ReadTransport):
    """Reads a descriptor the loop cannot poll on a thread, a few chunks ahead at most (so
    ``pause_reading`` takes hold at once and memory stays bounded), handing each chunk to the
    protocol on the loop; at the end of the file ``eof_received`` then ``connection_lost``."""

    CHUNK = 1 << 16
    AHEAD = 4

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self._loop, self._fd, self._protocol = loop, fd, protocol
        self._closing = False
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._slots = threading.Semaphore(self.AHEAD)
        loop.call_soon(protocol.connection_made, self)
        _start_without_signals(threading.Thread(target=self._pump, name="stdin-reader", daemon=True))

    def _pump(self) -> None:
        try:
            self._read_to_end()
        finally:
            try:
                os.close(self._fd)
            except OSError:
                pass

    def _read_to_end(self) -> None:
        try:
            while True:
                self._slots.acquire()
                self._running.wait()
                if self._stop.is_set():
                    return
                chunk = os.read(self._fd, self.CHUNK)
                if self._stop.is_set():
                    return
                if not chunk:
                    break
                self._loop.call_soon_threadsafe(self._deliver, chunk)
        except OSError:
            pass
        except RuntimeError:  # the loop is closed
            return
        try:
            self._loop.call_soon_threadsafe(self._at_eof)
        except RuntimeError:
            pass

    def _deliver(self, chunk: bytes) -> None:
        self._slots.release()
        if not self._closing:
            self._protocol.data_received(chunk)

    def _at_eof(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._protocol.eof_received()  # type: ignore[attr-defined]
        finally:
            self._protocol.connection_lost(None)

    def pause_reading(self) -> None:
        self._running.clear()

    def resume_reading(self) -> None:
        self._running.set()

    def is_reading(self) -> bool:
        return self._running.is_set() and not self._closing

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop.set()
        self._running.set()
        self._slots.release()
        self._loop.call_soon(self._protocol.connection_lost, None)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol  # type: ignore[assignment]


class _FileWriteTransport(asyncio.WriteTransport):
    """A stdout that is a regular file or /dev/null: each write goes out whole, at once (no
    buffer, so nothing is left to drain); a failed write (a full disk) is the connection's
    loss, as a broken pipe is. ``close`` closes the descriptor."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, protocol: asyncio.BaseProtocol) -> None:
        super().__init__()
        self._loop, self._fd, self._protocol = loop, fd, protocol
        self._closing = False
        loop.call_soon(protocol.connection_made, self)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        view = memoryview(data)
        try:
            while view:
                try:
                    n = os.write(self._fd, view)
                except InterruptedError:
                    continue
                view = view[n:]
        except OSError as e:
            log.warning("the agent's output cannot be written (%s)", e)
            self._close(e)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.close()

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 0, 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._close(None)

    def abort(self) -> None:
        self._close(None)

    def _close(self, exc: Exception | None) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon(self._lost, exc)

    def _lost(self, exc: Exception | None) -> None:
        try:
            self._protocol.connection_lost(exc)
        finally:
            try:
                os.close(self._fd)
            except OSError:
                pass

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol


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
