"""A synchronous, stdlib-only client for operate-sidecar (docs/PROTOCOL.md).

Spawns the server, writes ``Content-Length`` framed JSON-RPC to its stdin on a
writer thread and reads frames from its stdout on a reader thread. Server→client
requests run on a worker thread, so a handler may itself call
:meth:`SidecarClient.request`. A server that stops reading its input blocks no
caller for longer than its time-out (the frames are written in order by the
writer thread; one not begun when its caller stops waiting is not sent), and a
server that is gone fails every request with :class:`NoAnswer`.

    with SidecarClient() as c:
        c.request("initialize", {"settings": {...}})
        c.on_notification("toolEvent", print)
        print(c.request("operate", {"branchId": b, "instruction": "hi"}))
"""

from __future__ import annotations

import collections
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

__all__ = ["SidecarClient", "RpcError", "NoAnswer", "StreamError"]

_HEADER = re.compile(rb"Content-Length: (\d+)\r\n")


class RpcError(Exception):
    """An error response: ``code``, ``message``, ``data``."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.data = code, message, data


class NoAnswer(RpcError):
    """The client's own -32099 for a request the server can no longer answer: its output closed
    (it is exiting) or is unreadable; ``message`` says which. Not an answer of the server's."""


def _no_answer(reason: str) -> dict:
    return {"error": {"code": -32099, "message": reason}, "noAnswer": True}


class StreamError(Exception):
    """The server's stdout carried something other than a protocol frame."""


#: POSIX: the server starts in a session of its own, and killing it kills every process of that
#: session. A wrapper that forks rather than execs (``sh -c "operate-sidecar ..."`` without
#: ``exec``, ``uv run operate-sidecar``) is only the process this client started; the server runs
#: under it (and leads a process group of its own once it has loaded), in the same session.
_SESSIONS = os.name == "posix" and hasattr(os, "killpg")


def _session_groups(sid: int) -> set[int]:
    """The process groups of the live (not zombie) processes of session ``sid``, read from
    ``/proc`` (Linux); empty where that cannot be read."""
    groups: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return groups
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # state ppid pgrp session ...
        try:
            if len(fields) > 3 and fields[0] != b"Z" and int(fields[3]) == sid:
                groups.add(int(fields[2]))
        except ValueError:
            continue
    return groups


def _encode(msg: dict) -> bytes:
    """One message as a UTF-8 JSON body; ValueError/TypeError for what JSON cannot hold (NaN included:
    the server would answer it -32700 with id null, so the request it belonged to would never be answered)."""
    text = json.dumps(msg, ensure_ascii=False, allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (half an emoji): valid JSON as its escape, which the server takes
        return json.dumps(msg, allow_nan=False).encode("ascii")


class _Write:
    """One frame for the writer thread (``data`` None: close the stream after the frames before it)."""

    __slots__ = ("data", "started", "done", "error", "on_fail")

    def __init__(self, data: bytes | None, on_fail: Callable[[str], None] | None = None) -> None:
        self.data = data
        self.started = False          # the writer has taken it: it is written in full, or the stream fails
        self.done = threading.Event()
        self.error: str | None = None  # why it was not written
        self.on_fail = on_fail


class _Writer:
    """Writes the server's input on a thread of its own, frame after frame in the order they came, so
    that a server that does not read its input blocks no caller: a caller waits for its frame a
    bounded time, and the stream stays framed when it stops waiting (a frame not begun can be taken
    back, one begun is finished). The thread ends when it has nothing to write for a while (and is
    started again by the next frame), or for good once the stream is closed or fails."""

    IDLE_S = 1.0

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._queue: collections.deque[_Write] = collections.deque()
        self._cond = threading.Condition()
        self._running = False
        self.stopped: str | None = None  # why nothing more is written

    def put(self, data: bytes | None, on_fail: Callable[[str], None] | None = None) -> _Write:
        """Queue ``data`` (None: the end of the input); failed at once when the stream is gone."""
        item = _Write(data, on_fail)
        with self._cond:
            if self.stopped is None:
                self._queue.append(item)
                if self._running:
                    self._cond.notify()
                else:
                    threading.Thread(target=self._run, name="sidecar-writer", daemon=True).start()
                    self._running = True
                return item
        item.error = self.stopped
        if data is not None and on_fail is not None:
            on_fail(item.error)
        item.done.set()
        return item

    def take_back(self, item: _Write) -> bool:
        """Remove a frame the writer has not begun; True when it was removed (it is never sent)."""
        with self._cond:
            if item.started or item not in self._queue:
                return False
            self._queue.remove(item)
        item.error = "taken back before it was sent"
        item.done.set()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if not self._cond.wait(self.IDLE_S) and not self._queue:
                        self._running = False
                        return
                item = self._queue.popleft()
                item.started = True
            if item.data is None:
                self._stop("the client closed the server's input", item)
                return
            try:
                view = memoryview(item.data)
                while view:
                    view = view[self._stream.write(view):]
                self._stream.flush()
            except ValueError:  # closed here, not through close_input()
                self._stop("the server's input is closed", item)
                return
            except OSError as e:  # the server is gone (its end of the pipe is closed)
                self._stop(f"the server no longer reads its input (it has exited): {e}", item)
                return
            item.data = b""  # (its handle may be kept a long time: not the data)
            item.done.set()

    def _stop(self, reason: str, item: _Write) -> None:
        """Close the stream; ``item`` (a failed frame, or the end of the input) and every frame
        queued after it are not written."""
        try:
            self._stream.close()
        except (OSError, ValueError):
            pass
        with self._cond:
            self.stopped = reason
            self._running = False
            failed = [item, *self._queue]
            self._queue.clear()
        for it in failed:
            if it.data is not None:
                it.error = reason
                if it.on_fail is not None:
                    it.on_fail(reason)
            it.done.set()


class _Pending:
    def __init__(self, msg_id: Any, reader: threading.Thread | None = None) -> None:
        self.id = msg_id
        self._done = threading.Event()
        self._msg: dict | None = None
        self._reader = reader
        self._write: _Write | None = None  # its frame, while the writer has it

    def _set(self, msg: dict) -> None:
        self._msg = msg
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float = 30.0) -> Any:
        if not self._done.is_set() and threading.current_thread() is self._reader:
            raise RuntimeError(f"request {self.id!r}: waiting for an answer inside a notification callback would "
                               "block until the time-out (callbacks run on the thread that reads the answers); "
                               "use request_async() there and wait for it elsewhere")
        if not self._done.wait(timeout):
            write = self._write
            if write is not None and not write.done.is_set():
                raise TimeoutError(f"no response to request {self.id!r} within {timeout}s; it is not written "
                                   "in full yet: the server is not reading its input")
            raise TimeoutError(f"no response to request {self.id!r} within {timeout}s")
        msg = self._msg or {}
        if msg.get("noAnswer"):
            raise NoAnswer(-32099, msg["error"]["message"])
        if "error" in msg:
            err = msg["error"] or {}
            raise RpcError(err.get("code", 0), err.get("message", ""), err.get("data"))
        return msg.get("result")


class SidecarClient:
    def __init__(self, argv: list[str] | None = None, env: dict[str, str] | None = None,
                 cwd: str | None = None, stderr: Any = None, strict: bool = True) -> None:
        """``strict``: every frame must be exactly ``Content-Length: N\\r\\n\\r\\n`` (what
        operate-sidecar writes); anything else on stdout is a :class:`StreamError`."""
        self.strict = strict
        argv = argv or [sys.executable, "-m", "operate_sidecar.server"]
        # POSIX: a session of its own (see _SESSIONS), so that kill() reaches the server under a
        # wrapper too. It no longer gets a terminal's Ctrl+C: close() and kill() end it.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                     env=env, cwd=cwd, bufsize=0, start_new_session=_SESSIONS)
        self._out = io.BufferedReader(self.proc.stdout, 1 << 16)
        #: after :meth:`close`: how the server ended when that was not clean, else None
        self.ending: str | None = None
        self._ids = itertools.count(1)
        self._writer = _Writer(self.proc.stdin)  # the only one that writes the server's input
        self._plock = threading.Lock()   # guards _pending, _closed and unmatched
        self._pending: dict[Any, _Pending] = {}
        self._closed: str | None = None  # why the reader stopped (then nothing will be answered)
        self._notif_handlers: dict[str, list[Callable[[Any], None]]] = {}
        self._req_handlers: dict[str, Callable[[Any], Any]] = {}
        self._cond = threading.Condition()
        self.notifications: list[tuple[str, Any]] = []  # every notification, in arrival order
        self.stream_errors: list[str] = []              # anything on stdout that was not a frame
        self.unmatched: list[dict] = []                 # responses nobody waited for (e.g. id null)
        self._answering = 0  # server-to-client requests read and not answered yet (under _cond)
        self._reader = threading.Thread(target=self._read_loop, name="sidecar-reader", daemon=True)
        self._reader.start()

    # -- sending -------------------------------------------------------------
    def _write(self, data: bytes, what: str, timeout: float) -> None:
        """Write ``data`` within ``timeout`` s: :class:`NoAnswer` when the server's input is gone
        (it exited, or :meth:`close` closed it), TimeoutError when the server does not read it in
        time (not sent at all when the writer had not begun it; else it is finished later)."""
        item = self._writer.put(data)
        if not item.done.wait(timeout):
            if self._writer.take_back(item):
                raise TimeoutError(f"{what} not sent within {timeout}s: the server is not reading its input")
            if not item.done.is_set():
                raise TimeoutError(f"{what} not written in full within {timeout}s: the server is not reading "
                                   "its input (the rest is written once it reads)")
        if item.error is not None:
            raise NoAnswer(-32099, f"{what} not sent: {item.error}")

    def send_raw(self, data: bytes, timeout: float = 30.0) -> None:
        """Write ``data`` as it is, waiting at most ``timeout`` s for the server to take it;
        raises as :meth:`notify` does."""
        self._write(data, "the data", timeout)

    def _frame(self, body: bytes) -> bytes:
        return b"Content-Length: %d\r\n\r\n" % len(body) + body

    def _register(self, msg_id: Any, fresh: bool = False) -> _Pending:
        """Wait for the answer to ``msg_id`` (``fresh``: to a new id, one no pending request has). An id
        still waited for is refused with ValueError: its answer would settle only one of the two, and the
        other would wait for its time-out, that answer lost to it."""
        with self._plock:
            if fresh:
                msg_id = next(self._ids)
                while msg_id in self._pending:  # (an id the caller chose for a request still waiting)
                    msg_id = next(self._ids)
            elif msg_id in self._pending:
                raise ValueError(f"request id {msg_id!r} is still waiting for its answer: a second request "
                                 "with it would lose one of the two answers; use another id")
            pending = _Pending(msg_id, self._reader)
            closed = self._closed
            if closed is None:
                self._pending[msg_id] = pending
        if closed is not None:  # the reader has stopped: nothing can answer it, fail it now
            pending._set(_no_answer(closed))
        return pending

    def _forget(self, pending: _Pending) -> None:
        """No answer is waited for ``pending`` any more (its request was never sent)."""
        with self._plock:
            if self._pending.get(pending.id) is pending:
                del self._pending[pending.id]

    def _not_sent(self, pending: _Pending, reason: str) -> None:
        """The writer could not write ``pending``'s request: nothing will answer it."""
        self._forget(pending)
        pending._set(_no_answer(f"request {pending.id!r} not sent: {reason}"))

    def request_async(self, method: str, params: Any = None, msg_id: Any = None) -> _Pending:
        """Send a request; returns a handle with ``.id`` and ``.result(timeout)``. It does not wait for
        the request to be written: ``.result`` raises :class:`NoAnswer` when it could not be (the
        server has exited, or the client was closed). Params JSON cannot hold (NaN, a set, ...)
        raise ValueError/TypeError here, before anything is sent; so does a ``msg_id`` a request
        still waiting for its answer has (ValueError)."""
        pending = self._register(msg_id, fresh=msg_id is None)
        msg = {"jsonrpc": "2.0", "id": pending.id, "method": method}
        if params is not None:
            msg["params"] = params
        try:
            body = _encode(msg)
        except (ValueError, TypeError):
            self._forget(pending)
            raise
        if not pending.done():  # (the reader has stopped: nothing would read its answer)
            pending._write = self._writer.put(self._frame(body), lambda reason: self._not_sent(pending, reason))
        return pending

    def expect(self, msg_id: Any) -> _Pending:
        """The response to ``msg_id`` of a request you send with :meth:`send_raw`: call it *before*
        sending. An answer that comes while nobody waits for its id goes to :attr:`unmatched` and
        stays there: a later ``expect`` of the same id never takes it (it may be the answer to an
        earlier request that reused the id). An id still waited for is refused (ValueError), as in
        :meth:`request_async`."""
        return self._register(msg_id)

    def request(self, method: str, params: Any = None, timeout: float = 30.0, msg_id: Any = None) -> Any:
        """Send a request and wait at most ``timeout`` s for its answer (writing it included); raises
        :class:`RpcError` for an error answer, :class:`NoAnswer` (an RpcError, -32099) when the server
        cannot answer (it has exited, its output ended or is unreadable, or the client was closed),
        TimeoutError when no answer came in time (a request the server never read is then not sent);
        ValueError, before anything is sent, as :meth:`request_async` does."""
        pending = self.request_async(method, params, msg_id)
        try:
            return pending.result(timeout)
        except TimeoutError:
            if pending._write is not None and self._writer.take_back(pending._write):
                self._forget(pending)
                raise TimeoutError(f"request {pending.id!r} ({method}) not sent within {timeout}s: the server "
                                   "is not reading its input") from None
            raise

    def notify(self, method: str, params: Any = None, timeout: float = 30.0) -> None:
        """Send a notification, waiting at most ``timeout`` s for the server to take it. Raises
        :class:`NoAnswer` (-32099) when it cannot be sent (the server has exited, or the client
        was closed), TimeoutError when the server does not read it in time (it is then not sent,
        or, begun, finished once the server reads)."""
        msg = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self._write(self._frame(_encode(msg)), f"notification {method}", timeout)

    def cancel(self, msg_id: Any, timeout: float = 30.0) -> None:
        self.notify("$/cancelRequest", {"id": msg_id}, timeout)

    # -- handlers ------------------------------------------------------------
    def on_notification(self, method: str, callback: Callable[[Any], None]) -> None:
        self._notif_handlers.setdefault(method, []).append(callback)

    def on_request(self, method: str, handler: Callable[[Any], Any]) -> None:
        """``handler(params) -> result``; raise :class:`RpcError` to answer with an error."""
        self._req_handlers[method] = handler

    def wait_for(self, predicate: Callable[[list[tuple[str, Any]]], bool], timeout: float = 10.0) -> bool:
        """Wait until ``predicate(self.notifications)`` holds."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.notifications), timeout)

    # -- reading -------------------------------------------------------------
    def _read_frame(self) -> bytes | None:
        length = None
        while True:
            line = self._out.readline()
            if not line:
                return None
            if line == b"\r\n" and length is not None:
                break
            m = _HEADER.fullmatch(line)
            if m and length is None:
                length = int(m.group(1))
                continue
            if self.strict or b":" not in line:
                self.stream_errors.append(line.decode("utf-8", "replace"))
                raise StreamError(f"not a protocol frame: {line[:200]!r}")
            name, _, value = line.partition(b":")  # lenient: other headers are skipped
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = self._out.read(length)
        return body if len(body) == length else None

    def _read_loop(self) -> None:
        reason = "the server closed its output"
        try:
            while True:
                body = self._read_frame()
                if body is None:
                    break
                self._dispatch(json.loads(body))
        except Exception as e:  # a corrupt stream: record it and stop reading
            if not isinstance(e, StreamError):
                self.stream_errors.append(repr(e))
            reason = f"the server's output is no longer readable, so nothing can be answered: {e}"
        finally:
            try:  # read to its end (or unreadable): nothing reads it again
                self._out.close()
            except (OSError, ValueError):
                pass
            with self._plock:  # from now on a request fails at once (_register)
                self._closed = reason
                waiting = list(self._pending.values())
                self._pending.clear()
            for pending in waiting:  # nobody will answer these now
                pending._set(_no_answer(reason))
            with self._cond:
                self._cond.notify_all()

    def _dispatch(self, msg: dict) -> None:
        if "method" in msg and "id" in msg:
            with self._cond:
                self._answering += 1
            try:
                threading.Thread(target=self._answer, args=(msg,), daemon=True).start()
            except BaseException:  # no thread to answer it
                self._answered_one()
                raise
        elif "method" in msg:
            with self._cond:
                self.notifications.append((msg["method"], msg.get("params")))
                self._cond.notify_all()
            for cb in self._notif_handlers.get(msg["method"], ()):
                try:
                    cb(msg.get("params"))
                except Exception as e:  # a faulty callback must not stop the reader
                    print(f"notification handler for {msg['method']} failed: {e!r}", file=sys.stderr)
        else:
            with self._plock:
                pending = self._pending.pop(msg.get("id"), None)
                if pending is None:
                    self.unmatched.append(msg)
            if pending is None:
                with self._cond:
                    self._cond.notify_all()
            else:
                pending._set(msg)

    def _answer(self, msg: dict) -> None:
        try:
            self._answer_now(msg)
        finally:
            self._answered_one()

    def _answered_one(self) -> None:
        with self._cond:
            self._answering -= 1
            self._cond.notify_all()

    def _answer_now(self, msg: dict) -> None:
        handler = self._req_handlers.get(msg["method"])
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": msg["id"]}
        try:
            if handler is None:
                raise RpcError(-32601, f"method not found: {msg['method']}")
            reply["result"] = handler(msg.get("params"))
        except RpcError as e:
            reply["error"] = {"code": e.code, "message": e.message}
            if e.data is not None:
                reply["error"]["data"] = e.data
        except Exception as e:
            reply["error"] = {"code": -32603, "message": str(e)}
        try:
            body = _encode(reply)
        except (TypeError, ValueError) as e:  # the server must still get an answer, or it waits for one
            reply.pop("result", None)
            reply["error"] = {"code": -32603, "message": f"the client's answer to {msg['method']} is not JSON: {e}"}
            body = _encode(reply)
        self._writer.put(self._frame(body))  # not waited for: a server that is gone is not answered

    # -- lifecycle -----------------------------------------------------------
    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def wait_answered(self, timeout: float = 1.0) -> bool:
        """Wait (at most ``timeout`` s) until the server's output has been read to its end and
        every server-to-client request read from it has been answered (its handler returned or
        raised); True when both are so. For after :meth:`close`: a request the server sent as it
        ended has then been handled."""
        deadline = time.monotonic() + timeout
        self._reader.join(timeout)
        with self._cond:
            return self._cond.wait_for(lambda: self._answering <= 0 and not self._reader.is_alive(),
                                       max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 10.0, *, shutdown: bool = True, answer_within: float | None = None,
              unanswered_grace: float | None = None) -> int:
        """shutdown + exit, then the end of the server's input; returns the exit code. The answer
        to ``shutdown`` is waited for ``answer_within`` s (default ``timeout``); a server that does
        not answer gets ``exit`` all the same and is killed (:meth:`kill`: with every process of its
        session) if it has not exited ``unanswered_grace`` s (default ``timeout``) after the end of
        its input; one that answered, ``timeout`` s after. ``shutdown=False``: the end of its input
        alone. :attr:`ending` then says how it ended when that was not clean (None when it exited
        by itself). Interrupted (Ctrl+C), it kills the server and re-raises. These bounds hold
        whatever the server reads: nothing here waits for a write (``exit`` and the end of the
        input follow the frames already queued, and a server killed takes no more). Called in a
        notification callback (on the thread that reads the answers), it sends shutdown and exit
        without waiting for the answer to shutdown, then waits for the server to exit as above."""
        self.ending = None
        try:
            grace = timeout
            if shutdown and self.proc.poll() is None:
                wait = timeout if answer_within is None else answer_within
                if threading.current_thread() is self._reader:  # its answer is read once the callback returns
                    self.request_async("shutdown")
                else:
                    try:
                        self.request("shutdown", None, timeout=wait)
                    except TimeoutError:
                        self.ending = f"the server did not answer shutdown within {wait:g} s"
                        grace = timeout if unanswered_grace is None else unanswered_grace
                    except RpcError:
                        pass  # an error answer, or none possible (NoAnswer): exit anyway
                self._writer.put(self._frame(_encode({"jsonrpc": "2.0", "method": "exit"})))
            self.close_input()  # the end of its input: a server that did not take ``exit`` ends on that
            try:
                return self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                if self.ending is None:
                    self.ending = f"the server did not exit within {grace:g} s of the end of its input"
                self.ending += "; killed it and every process of its session" if _SESSIONS else "; killed it"
                self.kill()
                return self.proc.wait(timeout)
        except BaseException:  # interrupted: nothing is left running
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the server. On POSIX, every process of the session it was started in goes too:
        a wrapper that forked it (``sh -c`` without ``exec``, ``uv run``), the server under it and
        the children it started in its session; a process that started a session of its own
        (``setsid``) is not reached. Elsewhere only the process this client started is killed."""
        if _SESSIONS:
            self._signal_session(signal.SIGKILL)
        elif self.proc.poll() is None:
            self.proc.kill()

    def terminate(self, grace: float = 2.0) -> int | None:
        """SIGTERM the server (on POSIX every process of its session, as a terminal's Ctrl+C reaches
        a whole job), then :meth:`kill` what is left of it after ``grace`` seconds; returns the
        exit code of the process this client started."""
        try:
            if _SESSIONS:
                self._signal_session(signal.SIGTERM)
            elif self.proc.poll() is None:
                self.proc.terminate()
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:  # the process started, and (POSIX) what its session holds
                if self.proc.poll() is not None and not (_SESSIONS and _session_groups(self.proc.pid)):
                    return self.proc.returncode
                time.sleep(0.02)
        except BaseException:  # interrupted during the grace (a second Ctrl+C): nothing is left running
            self.kill()
            raise
        self.kill()
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed
            return None

    def _signal_session(self, sig: int) -> None:
        """``sig`` to every process group of the server's session (POSIX)."""
        pid = self.proc.pid
        # while this client has not reaped it, the pid (the group's and the session's id) is not
        # another process's; after, only the processes /proc shows in that session are signalled
        targets = {pid} if self.proc.returncode is None else set()
        for _ in range(3 if sig == signal.SIGKILL else 1):  # again for a process that changed its group meanwhile
            targets |= _session_groups(pid)
            if not targets:
                break
            # the group of the process started here first: a wrapper that forked the server (``sh -c``
            # without ``exec``) signalled after it could see its child die and exit by itself (137)
            for pgid in sorted(targets, key=lambda g: g != pid):
                try:
                    os.killpg(pgid, sig)
                except OSError:  # gone meanwhile
                    pass
            targets = set()

    def close_input(self) -> None:
        """Close the server's stdin (the end of its input: the server exits on it), once the frames
        sent before are written (at once when none is waiting); not waited for. Nothing can be sent
        after it: a request fails with :class:`NoAnswer`."""
        self._writer.put(None)

    def __enter__(self) -> "SidecarClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.close()
        else:
            self.close_input()


if __name__ == "__main__":  # tiny smoke run: python -m clients.python.client
    with SidecarClient(env=dict(os.environ)) as c:
        print(json.dumps(c.request("initialize", {"clientInfo": {"name": "smoke"}}), indent=2))
        print(c.request("ping"))
