"""``operate-sidecar --acp``: serve the Agent Client Protocol on stdio until stdin's EOF,
a signal or the client's death (or its end of stdout going); returns the exit code (0 on EOF).
A signal ends the connection as the EOF does: every request in flight is answered -32800
(``serve_acp``). A client that does not read its output is held as the native front end holds
it (``OutputBacklog``, ``HeldInput``).

stdout is the wire: the native front end's guard (``server.rpc.stdio.guard_stdio``) moves
the real stdout to a private descriptor and points fd 1 at stderr before anything else
runs, so ``print()`` in a tool or a child process's output can never reach the stream.
asyncio streams are then opened on the private descriptors (pipes, or a regular file or
/dev/null, which ``server.rpc.stdio`` reads on a thread or writes at once), the input bounded by
``maxMessageBytes`` per line; the SDK's connection does the framing and the JSON-RPC, each
message it parses screened first (``screen_messages``) for what the SDK would let a client turn
against the agent."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import re
import reprlib
import signal
import sys
from typing import Any

from operate_sidecar.server import redaction
from operate_sidecar.server.rpc.run import InputHold

log = logging.getLogger("operate_sidecar.server.acp")


async def _streams(wire_in: int, wire_out: int, limit: int) -> tuple[Any, Any]:
    """asyncio streams on the guarded descriptors (as the SDK's ``stdio_streams`` makes them
    on fd 0/1), the input bounded by ``LineBound`` before any byte arrives."""
    reader, writer, _ = await _bounded_streams(wire_in, wire_out, limit)
    return reader, writer


async def _bounded_streams(wire_in: int, wire_out: int, limit: int,
                           drains: bool = False) -> tuple[Any, Any, LineBound]:
    """``_streams`` and the ``LineBound`` in front of the reader (``drains``: the real
    connection's, see ``LineBound.drains``)."""
    from operate_sidecar.server.rpc.stdio import open_read_transport, open_write_transport, pollable, reader_of

    loop = asyncio.get_running_loop()
    # a pipe, a socket or a terminal is watched by the loop; a regular file or /dev/null (stdin
    # or stdout redirected to one) is read to its end on a thread, or written at once
    w_transport, w_protocol = await open_write_transport(wire_out, _WireProtocol)
    writer = w_protocol.writer = RedactingWriter(w_transport, w_protocol, None, loop)
    reader = asyncio.StreamReader(limit=limit + 1)
    bound = LineBound(reader, writer, limit, drains)  # before the first byte: the input may end at once
    writer.to_file = not pollable(wire_out)  # (a regular file, a device: ``open_write_transport``)
    r_transport, _ = await open_read_transport(wire_in, lambda: asyncio.StreamReaderProtocol(reader))
    bound.hold.reader = reader_of(r_transport)
    if drains:  # the real connection's: its input is held while the client does not read its output
        bound.backlog = writer.backlog = OutputBacklog(w_transport, bound.hold)
    return reader, writer, bound


class _WireProtocol(asyncio.StreamReaderProtocol):
    """The wire's write side: tells its writer (``RedactingWriter``) when the pipe has room
    again (``roomy``) and when the client's end of it is gone (``lost``)."""

    def __init__(self) -> None:
        super().__init__(asyncio.StreamReader())
        self.writer: RedactingWriter | None = None

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.writer is not None:
            self.writer.roomy()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.writer is not None:
            self.writer.lost(exc)


#: one JSON escape as ``json.dumps`` writes it (lower-case hex): a surrogate pair whole, else a
#: lone surrogate (group 1), else any other escape (``\\\\`` among them, so a backslash the text
#: holds is never read as the start of an escape)
_ESCAPE = re.compile(rb"\\(?:ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|(ud[89a-f][0-9a-f]{2})|.)")


def unicode_only(data: bytes) -> bytes:
    """``data`` (JSON lines) with each lone surrogate escape written as U+FFFD. A file name
    the file system holds as bytes that are not UTF-8 is a string with lone surrogates here
    (Python's ``surrogateescape``), which ``json.dumps`` writes as ``\\udcXX``: legal JSON
    text, but not Unicode, and strict readers (Rust's serde_json, which Zed uses) refuse the
    whole line, so a tool's result or a turn's answer would be lost. A path shown that way is
    one the client could not name anyway: ACP paths are text."""
    if b"\\ud" not in data:
        return data
    return _ESCAPE.sub(lambda m: b"\\ufffd" if m.group(1) else m.group(0), data)


class RedactingWriter(asyncio.StreamWriter):
    """The wire's writer: the last net before the client, as the native front end has
    (``server.rpc.transport``). Every line written has every known secret value masked in
    every form ``redaction.redact_bytes`` knows, whatever built the message: a tool call's
    ``rawInput`` and title made from arguments a model wrote, a tool's output, an error text;
    and is Unicode text (``unicode_only``).
    Lines are masked whole, however they are cut into ``write()`` calls: the bytes after the
    last newline wait for the rest of their line (a secret split across two writes is still
    masked), and go out as they are at ``drain()`` (the SDK drains after each message),
    ``write_eof()`` or ``close()``. With no secret registered, the bytes pass as they are.
    A line stays valid JSON (``redaction.redact_bytes``), and a message keeps its ``id`` as it
    was, whatever is masked (``keep_id``): an answer must carry the id of the request it
    answers. The ``content`` of an ``fs/write_text_file`` request goes as it is: it is what the
    tool wrote, and the client's file must hold it, as a file written to the disk does.

    Once the client's end of the wire is gone (``lost``: it closed its reader, or died), what is
    written is dropped and ``drain()`` returns at once: the SDK's writer never fails (its
    failures were tracebacks, and its close raised), and ``on_lost`` ends the connection. What
    waits to be written is counted by ``backlog`` (the real connection's, ``OutputBacklog``)."""

    _WRITE = b'"fs/write_text_file"'

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._partial = b""  # the bytes of a line not yet ended, held while secrets are known
        self.gone = False  # the client's end of the wire is gone (``lost``)
        self._closing = False  # closed here (its transport's loss is then no news)
        self.on_lost: Any = None  # called (with the error, or None) when the client's end goes
        self.backlog: OutputBacklog | None = None
        self.to_file = False  # stdout is a regular file or a device, not a pipe (a failed write is told by it)

    def write(self, data: Any) -> None:
        if self.gone or self.transport.is_closing():
            return
        if not self._partial and not redaction.has_secrets():
            super().write(unicode_only(data))
        else:
            data = self._partial + bytes(data)
            end = data.rfind(b"\n") + 1
            self._partial = data[end:]
            if end:
                super().write(unicode_only(self._redacted(data[:end])))
        if self.backlog is not None:
            self.backlog.check()

    def roomy(self) -> None:
        """The pipe took what waited in it, down to its low-water mark."""
        if self.backlog is not None:
            self.backlog.check()

    def lost(self, exc: BaseException | None) -> None:
        """The transport is closed: by ``close`` here, or because the client's end is gone."""
        if self._closing or self.gone:
            return
        self.gone = True
        self._partial = b""
        if self.on_lost is not None:
            self.on_lost(exc)

    def _flush_partial(self) -> None:
        if self._partial:
            data, self._partial = self._partial, b""
            super().write(unicode_only(self._redacted(data)))

    @classmethod
    def _redacted(cls, lines: bytes) -> bytes:
        """``redaction.redact_bytes`` of JSON lines, but for the ``content`` of an
        ``fs/write_text_file`` request."""
        if cls._WRITE not in lines:
            return redaction.redact_bytes(lines, keep_id=True)
        return b"\n".join(cls._redacted_line(line) for line in lines.split(b"\n"))

    @classmethod
    def _redacted_line(cls, line: bytes) -> bytes:
        if cls._WRITE in line:
            import json

            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                msg = None
            if isinstance(msg, dict) and msg.get("method") == "fs/write_text_file" and "id" in msg \
                    and isinstance(msg.get("params"), dict) and isinstance(msg["params"].get("content"), str):
                return redaction.redact_keeping(msg, "content", cls._compact)
        return redaction.redact_bytes(line, keep_id=True)

    @staticmethod
    def _compact(value: Any) -> bytes:
        import json

        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: escaped (``unicode_only`` writes it as U+FFFD)
            return json.dumps(value, separators=(",", ":")).encode("ascii")

    async def drain(self) -> None:
        if self.gone:
            return
        self._flush_partial()
        try:
            await super().drain()
        except ConnectionError:
            if not self.gone:  # (the transport's loss is told before a drain wakes up)
                raise

    async def flushed(self, timeout: float) -> bool:
        """Within ``timeout``, wait until the pipe took every byte written (the client read
        them): the SDK's writer waits only until the pipe transport's buffer is under its
        high-water mark (64 KiB), and an answer ``LineBound`` writes at once not even that, so
        what is still buffered as the process exits is lost (a half line, the last answers).
        True once nothing waits, or nothing can be sent any more (the client's end is gone)."""
        if self.gone or self.transport.is_closing():
            return True
        self.transport.set_write_buffer_limits(0)  # ``drain`` now waits until the buffer is empty
        try:
            await asyncio.wait_for(self.drain(), max(timeout, 0.0))
        except (asyncio.TimeoutError, ConnectionError):
            pass
        return self.gone or self.transport.get_write_buffer_size() == 0

    def write_eof(self) -> None:
        self._flush_partial()
        self._closing = True
        super().write_eof()

    def close(self) -> None:
        try:
            self._flush_partial()
        except Exception:  # the transport is gone: nothing more can be sent
            pass
        self._closing = True
        super().close()


class HeldInput(InputHold):
    """The native front end's ``InputHold`` on ACP's input (docs/PROTOCOL.md §13): while the
    client does not read the agent's output (``OutputBacklog``), what it sends is held, up to
    ``HOLD_MAX`` bytes, then no longer read; the end of the input hands what was held on first.
    No exit is looked for among what is held: ACP's connection ends at the input's end only."""

    OUTPUT = "the agent's output"

    def _scanner(self) -> Any:
        return _NoScan()


class _NoScan:
    def feed(self, data: bytes) -> None:
        pass


class OutputBacklog:
    """What the real connection has written and the client has not read yet: the messages the
    SDK's writer has queued (``count``) and what the pipe transport holds. As with the native
    front end's ``Wire`` (docs/PROTOCOL.md §1), once more than its ``HIGH_WATER`` (8 MiB) waits,
    no more requests are taken until the client reads again: its input is held (``hold``, up
    to 4 MiB, then no longer read) and the SDK dispatches nothing more of what it has read
    (``flowing``, waited for in ``screen_messages``); once the backlog is down to ``LOW_WATER``
    (1 MiB), both go on, the held input first, in order. All input is held alike, a
    ``session/cancel`` and the client's answer to a permission asked too: that answer waits
    until the client has read the output down to ``LOW_WATER``, as any message does.
    The session updates still in the outboxes (``AcpPort``) are not counted: they come from
    work already taken (a turn, a replay, which is paced by its own bound), and each outbox has
    one in the SDK's queue at a time. At the input's end (or a signal, ``release``) the SDK
    takes whatever comes, and the input is never held again: the connection is ending."""

    def __init__(self, transport: Any, hold: InputHold) -> None:
        from operate_sidecar.server.rpc.stdio import Wire

        self.high, self.low = Wire.HIGH_WATER, Wire.LOW_WATER
        self._transport = transport
        self.hold = hold
        self.queued = 0  # the bytes of the messages the SDK's writer has queued, not written yet
        self._sender: Any = None  # the SDK's writer, and the queue of its that is counted (``count``)
        self._queue: Any = None
        self.paused = False
        self.released = False
        self.flowing = asyncio.Event()  # clear while requests are not taken
        self.flowing.set()

    @property
    def size(self) -> int:
        if self._sender is not None and getattr(self._sender, "_queue", None) is not self._queue:
            # the SDK's writer has another queue now: what the counted one held is not counted
            # (it would hold the input for good), nor what the new one holds
            self._sender = self._queue = None
            self.queued = 0
        return self.queued + self._transport.get_write_buffer_size()

    def check(self) -> None:
        """Hold the input when too much waits; let it go on once little does. Once released
        (the connection is ending) the input is never held again: a request the client sends
        after a signal is answered at once (``LineBound._to_sdk``)."""
        if self.released:
            return
        size = self.size
        if not self.paused and size > self.high:
            self.paused = True
            self.flowing.clear()
            log.warning("the client is not reading the agent's output (%d bytes waiting); "
                        "taking no more of its input until it does", size)
            self.hold.pause()
        elif self.paused and size <= self.low:
            self.paused = False
            self.flowing.set()
            self.hold.resume()

    def release(self) -> None:
        """The input ended, or a signal came: what was held is handed on, and the SDK takes
        what comes from now on (the connection is ending, within its bounds)."""
        self.released = True
        self.paused = False
        self.flowing.set()
        self.hold.resume()

    def count(self, inner_conn: Any) -> None:
        """The messages the SDK's writer queues on ``inner_conn`` counted in, by their bytes, as
        its queue takes and hands them out. With an SDK laid out otherwise, only what the
        pipe transport holds is counted (the SDK's writer waits for it to drain, so the bound
        is never reached: nothing is held)."""
        sender = getattr(getattr(inner_conn, "_transport", None), "_sender", None)
        queue = getattr(sender, "_queue", None)
        if not isinstance(queue, asyncio.Queue) or getattr(queue, "counted", False) \
                or not callable(getattr(queue, "_put", None)) or not callable(getattr(queue, "_get", None)):
            return
        put, get = queue._put, queue._get

        def counted_put(item: Any) -> None:
            put(item)
            if self._queue is queue:
                self.queued += len(getattr(item, "payload", b""))
                self.check()

        def counted_get() -> Any:
            item = get()
            if self._queue is queue:  # (written now: ``RedactingWriter`` checks)
                self.queued -= len(getattr(item, "payload", b""))
            return item

        queue._put, queue._get = counted_put, counted_get  # type: ignore[method-assign]
        queue.counted = True  # type: ignore[attr-defined]
        self._sender, self._queue = sender, queue


class LineBound:
    """``maxMessageBytes`` for ACP's newline-delimited input, in front of the SDK's reader: a
    line longer than the bound is dropped as it streams in (never buffered whole: its first
    ``HEAD`` and last ``TAIL`` bytes are kept) and answered with -32600 (its ``id`` when its
    first bytes show one, else its last: a client may write the id after a large member,
    ``tail_id``); the stream stays in sync at the next newline. An answer of the client's (to
    ``fs/read_text_file``, say) that is too long fails the request it answers, at once, with
    that -32600, wherever its id is; the client is sent nothing.

    It also screens each whole line, cheaply (no parse), for what the SDK cannot take: the
    SDK's connection assumes every line is a JSON object, and stops serving on any other JSON
    value. A line whose first and last non-blank bytes are ``{`` and ``}`` goes to the SDK (a
    blank one is dropped, as the SDK would); any other line is parsed here and answered with
    id null: not JSON (or not UTF-8) -32700, JSON but not an object -32600 (an array too:
    ACP has no batches); the rare one that is an object all the same (behind a UTF-8 BOM)
    goes to the SDK. A line that passes the screen but that the SDK cannot parse is answered
    -32700 through ``NotificationNotices``, which sees the SDK's log record of it.

    The input reaches it through ``hold`` (``HeldInput``), which keeps it while the client does
    not read the agent's output (the real connection's ``backlog``)."""

    HEAD = 4096
    TAIL = 4096

    def __init__(self, reader: Any, writer: Any, limit: int, drains: bool = False) -> None:
        self.limit = limit
        #: the real connection's: at the input's end the SDK is fed ``END_OF_INPUT`` first, which
        #: it dispatches after every line before it, and whose handler (installed by
        #: ``explain_invalid_params``) answers the requests still in flight, then calls ``end_input``
        self.drains = drains
        self.ending = False  # the input ended (or a signal came: ``stop``), and ``END_OF_INPUT`` was fed
        #: why the requests in flight are answered -32800 (``explain_invalid_params``)
        self.reason = INPUT_ENDED
        self._feed = reader.feed_data
        self._writer = writer
        self._held = bytearray()  # the current line's bytes, while it may still be too long
        self._skipping = False
        self._head = b""
        self._tail = b""  # the last bytes of a line too long, at most ``TAIL``
        self._size = 0  # the current line's length so far
        self.on_eof: Any = None  # called at the input's end
        self._ended = False
        self._feed_eof = reader.feed_eof
        self.hold = HeldInput(self.feed_data, self.feed_eof)  # its ``reader``: the read transport's
        self.backlog: OutputBacklog | None = None
        reader.feed_data = self.hold.on_data  # the SDK's protocol feeds the reader through this
        reader.feed_eof = self.hold.on_eof

    def feed_eof(self) -> None:
        self._last_line()
        self._ending()

    def _last_line(self) -> None:
        """The input ended in the middle of a line: newline-delimited JSON lets the last line go
        without its newline (a client written as ``printf '%s' "$request" | agent``), so it is
        taken as a whole line, one too long refused as ever; before ``END_OF_INPUT``, so that a
        request in it is served or answered like the others. Only at the real end of the input:
        after a signal (``stop``) the client may still be writing that line."""
        if self._skipping:
            self._skipping = False
            self._reject()
        elif self._held:
            line = bytes(self._held) + b"\n"
            self._held.clear()
            self._head = b""
            self._size = 0
            self._line(line)

    def _ending(self) -> None:
        if self.ending:  # (the protocol says it twice: at the EOF and as the pipe closes)
            return
        if self.drains:
            self.ending = True
            if self.backlog is not None:
                self.backlog.release()
            self._feed(END_OF_INPUT_LINE)
            # (should the SDK not dispatch it, the input still ends)
            asyncio.get_running_loop().call_later(EXIT_GRACE_S + 1.0, self.end_input)
            return
        self.end_input()

    def stop(self, why: str) -> bool:
        """A signal (``why``: its name) asks the agent to stop: the connection ends as at the
        input's end (``feed_eof``), its requests in flight answered -32800 saying so, its shown
        calls ended ``failed``, what is queued written out, within the same bounds. The client
        may still write meanwhile: a request it sends from now on is answered -32800 at once
        (``_to_sdk``). False when the connection was already ending (its input ended, or an
        earlier signal): nothing is done."""
        if self.ending or not self.drains:
            return False
        self.reason = f"the agent was asked to stop ({why})"
        self._ending()
        return True

    @property
    def stopped(self) -> bool:
        """A signal asked the agent to stop (``stop``)."""
        return self.reason != INPUT_ENDED

    def end_input(self) -> None:
        """The connection's input ends (once)."""
        if self._ended:
            return
        self._ended = True
        self._feed_eof()
        if self.on_eof is not None:
            self.on_eof()

    def feed_data(self, data: bytes) -> None:
        while data:
            nl = data.find(b"\n")
            part, data = (data, b"") if nl < 0 else (data[:nl + 1], data[nl + 1:])
            self._size += len(part) - (1 if nl >= 0 else 0)  # the line's bytes so far, without its newline
            if len(self._head) < self.HEAD:
                self._head += part[:self.HEAD - len(self._head)]
            if self._skipping:  # the last bytes so far of a line too long (its id may be there only)
                self._tail = (self._tail + part[-self.TAIL:])[-self.TAIL:]
            else:
                if len(self._held) + len(part) - (1 if nl >= 0 else 0) > self.limit:
                    self._tail = (bytes(self._held[-self.TAIL:]) + part[-self.TAIL:])[-self.TAIL:]
                    self._held.clear()
                    self._skipping = True
                elif nl >= 0:  # a whole line within the bound: to the SDK, if it is an object
                    self._line(bytes(self._held) + part if self._held else part)
                    self._held.clear()
                    self._head = b""
                    self._size = 0
                    continue
                else:  # a partial line stays here until it ends or exceeds the bound
                    self._held += part
                    continue
            if nl >= 0:  # the end of a line that was too long
                self._skipping = False
                self._reject()

    def _line(self, line: bytes) -> None:
        """A whole line (with its newline): to the SDK when it looks like a JSON object."""
        if line[:1] == b"{" and line[-2:] == b"}\n":  # the usual shape: no copy, no scan
            self._to_sdk(line)
            return
        text = line.strip()  # the same blanks the SDK strips
        if not text:
            return
        if text[:1] == b"{" and text[-1:] == b"}":
            self._to_sdk(line)
            return
        import json

        try:
            value = json.loads(text)
        except Exception as e:  # not JSON, not UTF-8, or nested past the parser's depth
            self.parse_error(e)
            return
        if isinstance(value, dict):  # an object behind a BOM, say: the SDK parses it alike
            self._to_sdk(line)
            return
        what = {list: "an array (ACP has no batches)", str: "a string", bool: "a boolean",
                type(None): "null"}.get(type(value), "a number")
        log.warning("dropped a line that is not a JSON-RPC message: %s", what)
        self.answer(None, -32600, f"Invalid Request: a message must be a JSON object, not {what}")

    def _to_sdk(self, line: bytes) -> None:
        """A line (a JSON object) to the SDK. Once a signal stopped the agent (``stop``) the
        client may still write: the message is screened as the SDK's would be
        (``screen_message``: an invalid request answered -32600 as ever), then a request (a
        ``method`` that is not null, the SDK's test) is answered -32800 here, at once, as the
        requests in flight are (``cancelled``; fed after ``END_OF_INPUT``, it would be served
        after those were answered, and dropped as the connection closes); anything else (the
        client's answer to a request of ours, a notification) still goes to the SDK until the
        input ends, then is dropped."""
        if not self.stopped:
            self._feed(line)
            return
        import json

        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):  # the SDK would not parse it either
            msg = None
        if isinstance(msg, dict):
            msg, error = screen_message(msg)
            if error is not None:
                self.answer(error["id"], error["error"]["code"], error["error"]["message"])
            if msg is None:
                return
            if msg.get("method") is not None and "id" in msg:
                log.info("answered a request that came after the signal: %s", _SHOWN.repr(msg["method"]))
                self.answer(msg["id"], -32800, *cancelled(msg["method"], self.reason))
                return
        if not self._ended:
            self._feed(line)

    def parse_error(self, exc: BaseException | None = None) -> None:
        """A line that is not JSON: one WARNING line and -32700, id null; the stream goes on."""
        log.warning("dropped a line that is not valid JSON%s", f" ({_brief(exc)})" if exc is not None else "")
        self.answer(None, -32700, "Parse error: the line is not valid JSON")

    def answer(self, msg_id: Any, code: int, message: str, data: Any = None) -> None:
        """An error answer written at once, as one whole line (the SDK's writes are too); its
        ``data`` when not None."""
        frame = {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}
        if data is not None:
            frame["error"]["data"] = data
        try:
            import json

            self._writer.write((json.dumps(frame) + "\n").encode())
        except Exception:  # the client is gone
            pass

    def _reject(self) -> None:
        from operate_sidecar.server.rpc.framing import looks_like_answer, peek_id

        msg_id = peek_id(self._head)
        if msg_id is None:  # its id after a large member: ``{"result": {…}, "id": 3}``
            msg_id = tail_id(self._tail)
        msg_id = msg_id if isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool) else None
        answer = looks_like_answer(self._head)
        size, self._size = self._size, 0
        self._head = self._tail = b""
        if answer:
            # the client's answer to a request of ours (a huge fs/read_text_file content, say):
            # its request is failed at once, as if the client had answered this error; the
            # client is sent nothing (an error with that id would answer one of its own requests)
            log.warning("dropped an answer of the client of %d bytes (id %r): larger than maxMessageBytes (%d)",
                        size, msg_id, self.limit)
            if msg_id is not None:
                frame = {"jsonrpc": "2.0", "id": msg_id, "error": {
                    "code": -32600,
                    "message": f"the client's answer of {size} bytes is larger than maxMessageBytes ({self.limit})"}}
                import json

                if not self._ended:
                    self._feed((json.dumps(frame) + "\n").encode())
            return
        log.warning("dropped a message longer than maxMessageBytes (%d bytes)", self.limit)
        self.answer(msg_id, -32600, f"message larger than maxMessageBytes ({self.limit} bytes)")


def tail_id(tail: bytes) -> Any:
    """Best effort: the top-level ``"id"`` of a JSON object from its last bytes (``tail``, the
    object's end), when it is among the members after the last large one, else None. The
    bytes ``"id"`` are always a whole string (a quote inside a string is escaped); followed by
    a ``:``, a key. From the last such key on, those bytes with a ``{`` before them are an
    object of their own only when the key is at the top level (a nested one's object closes
    before the end, and what follows is then more than blanks): the last few of them are
    tried, each at most ``len(tail)`` bytes."""
    import json

    end, tries = len(tail), 0
    while tries < 8 and (at := tail.rfind(b'"id"', 0, end)) >= 0:
        end, tries = at, tries + 1
        try:
            value = json.loads(b"{" + tail[at:])
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict) and "id" in value:
            return value["id"]
    return None


def _brief(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


#: the real connection's ``LineBound``, set in ``serve_acp`` and so seen by the connection's
#: tasks only (not the warm-up's): where ``NotificationNotices`` answers a line the SDK
#: could not parse
WIRE: contextvars.ContextVar[LineBound | None] = contextvars.ContextVar("acp_wire", default=None)


class NotificationNotices(logging.Filter):
    """The SDK logs each notification it could not handle as an ERROR with a traceback, on the
    root logger. Two of those are the client's doing, not a fault here, and JSON-RPC has them
    ignored: a notification no route serves (a newer client's, say) and one whose params fail
    the schema. The first becomes a DEBUG line, the second a one-line WARNING that names the
    fields; anything else (a failure in a handler of ours) stays as the SDK logged it.

    The SDK also logs a line it could not parse as JSON (one that passed ``LineBound``'s
    screen) with a traceback, and answers nothing: that record becomes ``LineBound``'s
    one-line WARNING and its -32700 answer on the real connection (``WIRE``)."""

    PREFIX = "Unhandled error while handling notification"
    PARSE = "Error parsing JSON-RPC message"

    def __init__(self, debug: bool = False) -> None:
        super().__init__()
        self.debug = debug

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and record.msg == self.PARSE:
            wire = WIRE.get()
            if wire is None:  # not the client's connection: one line, no answer
                record.levelno, record.levelname = logging.WARNING, "WARNING"
                record.msg, record.args = "dropped a line that is not valid JSON (%s)", (_brief(exc),)
                record.exc_info, record.exc_text = None, None
                return True
            wire.parse_error(exc)  # logs its own line
            return False
        if exc is None or not (isinstance(record.msg, str) and record.msg.startswith(self.PREFIX)):
            return True
        from acp.exceptions import RequestError
        from pydantic import ValidationError

        method = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        if isinstance(exc, RequestError) and exc.code == -32601:
            if not self.debug:
                return False
            level, record.msg, record.args = logging.DEBUG, "ignored notification %s: no such method", (method,)
        elif isinstance(exc, ValidationError):
            fields = "; ".join(f"{'.'.join(map(str, e.get('loc', ()))) or 'params'}: {e.get('msg', '')}"
                               for e in exc.errors()[:3])
            level, record.msg, record.args = logging.WARNING, "ignored notification %s: invalid params (%s)", \
                (method, fields)
        else:
            return True
        record.levelno, record.levelname, record.name = level, logging.getLevelName(level), "acp"
        record.exc_info, record.exc_text = None, None
        return True


#: on the way out, the client has this long to read what is still queued for it (and the
#: requests in flight at the input's end this long to be answered, before that)
EXIT_GRACE_S = 2.0
#: the notification ``LineBound`` feeds the SDK at the input's end or on a signal (an extension
#: method's name; a client's own, before its input ended, is ignored as any extension notification is)
END_OF_INPUT = "_operate_sidecar/end_of_input"
END_OF_INPUT_LINE = b'{"jsonrpc": "2.0", "method": "' + END_OF_INPUT.encode() + b'"}\n'
#: why the requests in flight at the input's end are answered -32800 (``LineBound.reason``)
INPUT_ENDED = "the client's input ended"


def cancelled(method: str, reason: str) -> tuple[str, dict[str, Any]]:
    """The message and ``data`` of the -32800 that answers a request (``method``) the agent
    will not serve, because ``reason`` (the input ended, a signal came): the same whether it
    was in flight (``explain_invalid_params``) or came after a signal (``LineBound._to_sdk``)."""
    return f"{method} cancelled: {reason} before its answer", {"method": method}


def explain_invalid_params(conn: Any) -> None:
    """Requests whose params fail the schema (a missing ``cwd``, a prompt that is not a list)
    are answered by the SDK with -32602 and the bare message "Invalid params", pydantic's
    details in ``data`` only; an editor shows the message. On ``conn`` (an
    ``AgentSideConnection``, from the agent's ``on_connect``) such an answer gets a message
    naming the method and each field with what is wrong (at most three), its ``data`` as the
    SDK makes it; both agents install it (``OperateAgent`` and ``Unconfigured``). A
    notification's failure is left to the SDK (``NotificationNotices``). On the real connection
    it also answers the requests still being served when the input ends (or a signal stops the
    agent, ``LineBound.stop``): the SDK would cancel
    them unanswered as it closes; each is cancelled and answered -32800 first
    (``answer_in_flight``, once ``END_OF_INPUT`` is dispatched). Every message the
    connection receives is screened first (``screen_messages``). With an SDK laid out
    otherwise, its own answers stay (and the input ends ``EXIT_GRACE_S`` + 1 s after its EOF).
    On the real connection, what its writer queues is counted in the ``OutputBacklog``, and no
    message is taken while that holds the input (``screen_messages``)."""
    inner_conn = getattr(conn, "_conn", None)
    wire = WIRE.get()  # the real connection's (not the warm-up's): its END_OF_INPUT is served here
    backlog = wire.backlog if wire is not None else None
    if backlog is not None:
        backlog.count(inner_conn)
    screen_messages(inner_conn, backlog)
    handler = getattr(inner_conn, "_handler", None)
    if handler is None or getattr(handler, "explains_invalid_params", False):
        return
    from acp.exceptions import RequestError
    from pydantic import ValidationError

    from .agent import DROPPED, dropped_items

    inflight: set[asyncio.Task] = set()  # the requests being served
    ended: set[asyncio.Task] = set()     # those cancelled because the input ended (or a signal came)

    async def explained(method: str, params: Any, is_notification: bool) -> Any:
        if is_notification and method == END_OF_INPUT and wire is not None and wire.ending:
            await answer_in_flight()
            wire.end_input()
            return None
        me = None if is_notification else asyncio.current_task()
        if me is not None:
            inflight.add(me)
            DROPPED.set(dropped_items(method, params))  # what the SDK drops of its lists, told (``_add_mcp``)
        try:
            return await handler(method, params, is_notification)
        except ValidationError as exc:
            if is_notification:
                raise
            errors = exc.errors()
            fields = "; ".join(f"{'.'.join(map(str, e.get('loc', ()))) or 'params'}: {e.get('msg', '')}"
                               for e in errors[:3])
            more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
            raise RequestError(-32602, f"invalid params for {method}: {fields}{more}", {"errors": errors}) from None
        except asyncio.CancelledError:
            if me is None or me not in ended:
                raise
            me.uncancel()  # answered: the SDK sends the error below on this task
            raise RequestError(-32800, *cancelled(method, wire.reason if wire is not None else INPUT_ENDED)) from None
        finally:
            if me is not None:
                inflight.discard(me)
                ended.discard(me)

    async def answer_in_flight() -> None:
        """The input ended, or a signal came (every line before it dispatched): each request
        still being served is cancelled and answered -32800, none dropped (as in the native
        front end), within ``EXIT_GRACE_S``."""
        tasks = [t for t in inflight if not t.done()]
        for t in tasks:
            ended.add(t)
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=EXIT_GRACE_S)

    explained.explains_invalid_params = True  # type: ignore[attr-defined]
    inner_conn._handler = explained  # type: ignore[union-attr]


def screen_messages(inner_conn: Any, backlog: OutputBacklog | None = None) -> None:
    """Each message the SDK's connection ``inner_conn`` receives passes ``screen_message``
    first, as its transport hands it over (already parsed: nothing is parsed twice, and a key
    spelt with JSON escapes is seen as what it is); the answer to an invalid request goes out
    through that transport. While ``backlog`` holds the client's input, no message is taken
    (what the SDK has read already waits too), and each is taken on a loop turn of its own.
    With an SDK laid out otherwise, nothing is screened."""
    transport = getattr(inner_conn, "_transport", None)
    receive = getattr(transport, "receive", None)
    if receive is None or getattr(receive, "screened", False) or not callable(getattr(transport, "send", None)):
        return
    sending: set[asyncio.Task] = set()

    async def send(frame: dict) -> None:
        try:
            await transport.send(frame)
        except Exception:  # the client is gone
            pass

    async def screened() -> Any:
        while True:
            if backlog is not None:
                # one message at a time: those taken so far run (and answer) before the next is
                # taken, so a burst read at once is held as soon as its answers pile up, not
                # once every request of it is answered (a loop turn of its own only when the next
                # line is read already: else reading it is that turn)
                read = getattr(getattr(transport, "_reader", None), "_buffer", None)
                if read is None or b"\n" in read:
                    await asyncio.sleep(0)
                if not backlog.flowing.is_set():
                    await backlog.flowing.wait()
            message = await receive()
            if not isinstance(message, dict):  # the end of the input (None)
                return message
            message, error = screen_message(message)
            if error is not None:  # sent on its own: the input is not held up by the output
                task = asyncio.get_running_loop().create_task(send(error))
                sending.add(task)
                task.add_done_callback(sending.discard)
            if message is not None:
                if message.get("method") is None and "id" in message:  # an answer
                    unmatched_answer(inner_conn, message["id"])
                return message

    screened.screened = True  # type: ignore[attr-defined]
    transport.receive = screened


def _kind(value: Any) -> str:
    return "a string" if isinstance(value, str) else "null" if value is None else "a number"


def unmatched_answer(inner_conn: Any, msg_id: Any) -> None:
    """An answer of the client's whose ``id`` is no request the SDK's connection ``inner_conn``
    waits for is dropped by the SDK without a word, and the request it was meant for waits on
    (a permission for ``permissionTimeoutMs``): it is said on stderr, in one line. An answer
    to a request of ours that is no longer waited for (answered already, timed out, cancelled)
    is an info line; any other a warning naming the id, and the request of ours whose id looks
    the same but is of another type, when one waits (``"0"`` for ``0``: ids are typed, and the
    answer is not taken as that request's). With an SDK laid out otherwise, nothing is said."""
    pending = getattr(inner_conn, "_pending", None)
    if not isinstance(pending, dict) or msg_id in pending:
        return
    import json

    shown = json.dumps(msg_id)[:120]  # (a string with its quotes: ``"0"`` is not ``0``)
    sent = getattr(inner_conn, "_next_request_id", 0)
    if type(msg_id) is int and isinstance(sent, int) and 0 <= msg_id < sent:
        log.info("the client's answer to request %s came when it was no longer waited for (answered already, "
                 "timed out or cancelled): dropped", shown)
        return
    twin = next((k for k in pending if type(k) is not type(msg_id) and str(k) == str(msg_id)), None)
    if twin is not None:
        log.warning("the client's answer id %s (%s) matches no request; request %s (%s) is waiting: dropped (an "
                    "answer carries its request's id as it was sent)", shown, _kind(msg_id), twin, _kind(twin))
    else:
        log.warning("the client's answer id %s (%s) matches no request the agent sent: dropped", shown, _kind(msg_id))


#: the keys of a request's params that the SDK turns into its handler's keyword arguments,
#: over the validated ones: ``_meta`` (and ``field_meta``, its name in the SDK's models, which
#: take it too)
_META_KEYS = ("_meta", "field_meta")
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 120


#: the methods the agent serves, and the model of each one's params in the SDK's ``acp.schema``
#: (``session/set_config_option``: the one that has no ``type``)
_PARAMS_MODELS = {"initialize": "InitializeRequest", "authenticate": "AuthenticateRequest",
                  "session/new": "NewSessionRequest", "session/load": "LoadSessionRequest",
                  "session/list": "ListSessionsRequest", "session/resume": "ResumeSessionRequest",
                  "session/close": "CloseSessionRequest", "session/fork": "ForkSessionRequest",
                  "session/prompt": "PromptRequest", "session/set_mode": "SetSessionModeRequest",
                  "session/set_config_option": "SetSessionConfigOptionSelectRequest",
                  "session/cancel": "CancelNotification"}


@functools.cache
def _no_required_params() -> frozenset[str]:
    """The methods whose params have no required field in the SDK's schema (ACP 1.19:
    ``session/list`` alone), found once. ACP lets a request's ``params`` be left out or null
    (``ClientRequest``'s ``params`` may be null); the SDK validates null against the method's
    model and answers -32602, so for these it is taken as ``{}``, as a client leaving it out
    means. A method with a required field keeps its -32602 (``explain_invalid_params``)."""
    from acp import schema

    found = set()
    for method, name in _PARAMS_MODELS.items():
        fields = getattr(getattr(schema, name, None), "model_fields", None)
        if isinstance(fields, dict) and not any(f.is_required() for f in fields.values()):
            found.add(method)
    return frozenset(found)


def _valid_id(msg_id: Any) -> bool:
    """JSON-RPC's: a string, a number or null (not a boolean, which Python hashes as 0 or 1;
    not NaN or an infinity, which Python's JSON reader takes but which are no JSON: echoed in
    an answer, they would make a strict client refuse the whole line)."""
    return msg_id is None or type(msg_id) in (int, str) or (type(msg_id) is float and math.isfinite(msg_id))


def screen_message(message: dict) -> tuple[dict | None, dict | None]:
    """One message of the client's as the SDK is to take it (None: dropped), and the error
    answer to send for it (None: none), for what the SDK would do with it that a client can
    turn against the agent; at the cost of a key lookup or two per message.

    A request's or notification's ``params._meta`` is removed: the SDK passes its keys to the
    handler as keyword arguments, over the request's own params (``_meta: {"cwd": "/tmp"}``
    made ``session/new`` use /tmp, ``_meta: {"session_id": …}`` cancelled another session, and
    ``_meta: {"self": 1}`` was an internal error with a traceback), while ACP says its values
    are the client's own, to make no assumption about; this agent reads none. (A ``_meta``
    nested in a content block, say, stays: the SDK does not merge it.) A request without
    ``params``, or with null, whose method's params have no required field
    (``_no_required_params``: ``session/list``) gets ``{}``: the SDK refused it. A request whose
    ``method`` is not a string, or whose ``id`` is not a string, a number or null, is not a
    JSON-RPC request: it is answered -32600 (id null when its id is the bad part), with a
    one-line warning (the SDK answered it with that id, or -32603 and a traceback).

    An answer (no ``method``) that would stop the SDK's connection, the prompt waiting on it
    never answered and the agent exiting: one whose ``id`` is not a string, a number or null
    (an array: it answers nothing we sent) is dropped, and one whose ``error`` is not an
    object is made one (-32603, its message showing what came), with a one-line warning each;
    the request it answers then fails as on any error answer (a permission is denied, a write
    failed). (An answer whose id matches no request is said by ``unmatched_answer``.)"""
    method = message.get("method")
    if method is not None:  # a request or a notification: the SDK's test
        msg_id = message.get("id")
        if type(method) is not str or not _valid_id(msg_id):
            what = f"its id is {_SHOWN.repr(msg_id)}" if not _valid_id(msg_id) else \
                f"its method is {_SHOWN.repr(method)}"
            log.warning("dropped a message of the client that is not a JSON-RPC request: %s", what)
            return None, {"jsonrpc": "2.0", "id": msg_id if _valid_id(msg_id) else None, "error": {
                "code": -32600, "message": f"Invalid Request: {what} (a method is a string; an id a string, "
                                           "a number or null)"}}
        params = message.get("params")
        if type(params) is dict and ("_meta" in params or "field_meta" in params):
            message["params"] = {k: v for k, v in params.items() if k not in _META_KEYS}
        elif params is None and method in _no_required_params():  # (the SDK's models refuse None)
            message["params"] = {}
        return message, None
    if "id" not in message:
        return message, None
    msg_id = message["id"]
    if not _valid_id(msg_id):
        log.warning("dropped an answer of the client whose id is not a string, a number or null: %s",
                    _SHOWN.repr(msg_id))
        return None, None
    if "result" not in message and "error" in message and not isinstance(message["error"], dict):
        shown = _SHOWN.repr(message["error"])
        log.warning("the client's answer to request %s has an error that is not an object (%s): taken as an "
                    "error", _SHOWN.repr(msg_id), shown)
        message["error"] = {"code": -32603, "message": f"invalid error answer from the client (error: {shown})"}
    return message, None


def import_sdk() -> None:
    """Import the ACP SDK without two of pydantic's start-up costs, which are most of the time
    from spawn to the ``initialize`` answer. ``acp.schema`` declares about 270 models with
    ``use_attribute_docstrings``: pydantic finds and parses each class's source to turn its
    attribute docstrings into field descriptions, which only JSON Schema output shows and this
    agent never produces; and it builds every model's validator and serializer at once,
    while a session uses about twenty of them. During this one import the docstrings are not
    read and the builds are deferred to each model's first use (pydantic's ``defer_build``),
    which the warm-up reaches (``agent.warm_up``); validation and serialization are pydantic's
    own, unchanged. Both settings are restored right after, so no other model is affected.
    With a pydantic that lacks either hook, the SDK is imported as it is."""
    if "acp" in sys.modules:
        return
    try:
        from pydantic._internal import _config, _fields
    except ImportError:  # pragma: no cover - another pydantic layout
        import acp  # noqa: F401
        return
    docstrings = getattr(_fields, "_update_fields_from_docstrings", None)
    defaults = getattr(_config, "config_defaults", None)
    defer = isinstance(defaults, dict) and "defer_build" in defaults
    saved = defaults.get("defer_build") if defer else None  # type: ignore[union-attr]
    try:
        if callable(docstrings):
            _fields._update_fields_from_docstrings = _no_docstrings
        if defer:
            defaults["defer_build"] = True  # type: ignore[index]
        import acp  # noqa: F401
    finally:
        if callable(docstrings):
            _fields._update_fields_from_docstrings = docstrings
        if defer:
            defaults["defer_build"] = saved  # type: ignore[index]


def _no_docstrings(*args: Any, **kwargs: Any) -> None:
    return None


class Unconfigured:
    """The agent of a server whose configuration is bad (a ``--config`` file that is not TOML,
    a misspelt key): an editor shows an agent's answers, not its stderr, and a process that
    died before ``initialize`` reads there as "server exited". So the server stays up and
    answers ``initialize``, and every request after it, with an error whose message is the
    line written on stderr (-32603); notifications are ignored. A request whose params fail
    ACP's schema is answered as ``OperateAgent`` answers it (``explain_invalid_params``). It
    exits with code 2 at the end of the input, as the server does without ``--acp``."""

    #: the ACP requests (the SDK's handler names): each is answered with the error
    REQUESTS = frozenset({"initialize", "authenticate", "new_session", "load_session", "list_sessions",
                          "resume_session", "close_session", "fork_session", "prompt", "set_session_mode",
                          "set_config_option", "ext_method"})

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __getattr__(self, name: str) -> Any:
        if name not in self.REQUESTS:
            raise AttributeError(name)

        async def refuse(*args: Any, **kwargs: Any) -> Any:
            from acp import RequestError

            raise RequestError(-32603, self.reason)

        return refuse

    def on_connect(self, conn: Any) -> None:
        explain_invalid_params(conn)  # the SDK checks params before any method is called

    async def cancel(self, session_id: str, **kw: Any) -> None:
        pass

    async def ext_notification(self, method: str, params: Any) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def serve_acp(*, settings: dict[str, Any], version: str = "0", debug: bool = False,
                    client_pid: int | None = None, fds: tuple[int, int], config_error: str | None = None,
                    early: Any = None) -> int:
    """Serve until stdin's EOF, a signal or the client's death; with ``config_error`` (the bad
    configuration's line) every request is answered with it (``Unconfigured``), then exit 2.
    A signal (SIGTERM, SIGINT, SIGHUP) ends the connection as stdin's EOF does: every request
    in flight is answered -32800, none dropped (as in the native front end). A second one, or
    one once the input ended, stops within ``EXIT_GRACE_S``: the connection ends (what is still
    queued has what is left of those seconds to be read, then is dropped) and the agent's own
    close (``aclose``: its turns, tools and MCP servers stopped, each step bounded) is not
    waited for. The client's death cancels the connection at once, and so does the loss of its
    end of stdout (``wire_lost``). A signal that came while the process started (``early``,
    ``server.__main__.EarlySignals``) is taken once the connection is set up, as if it came
    then: after the lines the client had sent by then."""
    import acp

    from .agent import OperateAgent

    agent: Any = OperateAgent(settings, version=version, debug=debug) if config_error is None \
        else Unconfigured(config_error)
    limit = int(settings.get("maxMessageBytes") or 0) or 64 * 1024 * 1024
    reader, writer, bound = await _bounded_streams(fds[0], fds[1], limit, drains=True)
    loop = asyncio.get_running_loop()
    WIRE.set(bound)  # the connection's task gets a copy of this context
    # (the SDK routes session/close, /resume and /fork only with its unstable protocol on; the
    # first two are stable ACP now)
    main = loop.create_task(acp.run_agent(agent, writer, reader, stdio_buffer_limit_bytes=limit,
                                          use_unstable_protocol=True))
    # the input's end (stdin's EOF, or a first signal: once the requests in flight were answered),
    # another signal or the client's death
    stopping = asyncio.Event()
    hurry = asyncio.Event()  # a signal after the first (or after the input's end): nothing more is waited for

    def stop() -> None:
        """At once: the connection is cancelled (what it queued still has ``EXIT_GRACE_S``)."""
        stopping.set()
        main.cancel()

    def on_signal(sig: int) -> None:
        """SIGTERM, SIGINT or SIGHUP: the first ends the connection as the input's end does
        (``LineBound.stop``: every request in flight answered -32800, none dropped). Another,
        or one once the input ended: the connection ends now (still being served, it is
        cancelled; closing, it keeps what is left of its ``EXIT_GRACE_S``, ``_bound_exit``)
        and the agent's close is not waited for (``_close``)."""
        name = signal.Signals(sig).name
        if bound.stop(name):
            log.info("stopping (%s): answering the requests in flight", name)
            return
        log.info("stopping (%s)", name)
        hurry.set()
        if not stopping.is_set():
            stop()

    def wire_lost(exc: BaseException | None) -> None:
        """The client's end of stdout is gone (it closed it, or died): nothing the agent sends
        can reach it any more, so the connection ends at once, as at the client's death (its
        requests and turns cancelled, its tools and MCP servers stopped: ``_close``); what it
        writes is dropped meanwhile (``RedactingWriter``). Already ending, it ends as it was.
        A stdout that is a file (or a device) whose write failed, a full disk say, has said so
        in its own warning line (``open_write_transport``): no second one."""
        if writer.to_file:
            log.info("stopping: the agent's output cannot be written")
        else:
            log.warning("the client's end of stdout is gone%s: stopping", f" ({_brief(exc)})" if exc else "")
        if not stopping.is_set():
            stop()

    bound.on_eof = stopping.set
    writer.on_lost = wire_lost
    from operate_sidecar.server.rpc.run import take_signals

    take_signals(loop, on_signal, with_signal=True, early=early)
    watchdog = None
    if client_pid is not None:  # the client is gone: nothing it could read is worth waiting for
        from operate_sidecar.server.rpc.watchdog import watch_parent

        def client_died() -> None:
            writer.gone = True  # what is still queued is not waited for (``_bound_exit``)
            stop()

        watchdog = loop.create_task(watch_parent(client_pid, client_died))
    bounded = loop.create_task(_bound_exit(main, stopping, writer))
    try:
        await main
    except asyncio.CancelledError:
        log.info("stopping")
    except Exception:
        log.exception("the ACP connection failed")
    stopping.set()  # (the connection may end of itself: its last bytes get the same bound)
    await bounded  # what is still queued for the client, written out (or given up on)
    if watchdog is not None:
        watchdog.cancel()
    await _close(agent, hurry)
    return 0 if config_error is None else 2


async def _close(agent: Any, hurry: asyncio.Event) -> None:
    """``agent.aclose()`` (its turns, tools and MCP servers stopped, each step bounded, a few
    seconds at most), unless ``hurry`` is set first or meanwhile (a second signal): the process
    then exits without waiting for the rest."""
    closing = asyncio.ensure_future(agent.aclose())
    hurried = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait({closing, hurried}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
    if closing.done():
        closing.result()  # (a failure is the caller's, as it was)
    else:
        log.info("exiting without waiting for the agent to close")


async def _bound_exit(main: asyncio.Task, stopping: asyncio.Event, writer: RedactingWriter) -> None:
    """The SDK's connection closes by writing out what it queued, shielded from cancellation:
    a client that no longer reads stdout would hold the process forever (SIGTERM, stdin's EOF
    and the client's death all ignored). Once stopping, the connection gets ``EXIT_GRACE_S``,
    then is cancelled again, which ends its wait; what the client did not read is dropped (and,
    after a second signal, the requests it was still answering). Closed in time, what its
    writer left in the pipe's buffer (up to 64 KiB, a half line) and the answers written at
    once (``LineBound.answer``) get what is left of those seconds to be read
    (``RedactingWriter.flushed``): the process would exit without them."""
    await stopping.wait()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + EXIT_GRACE_S
    done, _ = await asyncio.wait({main}, timeout=EXIT_GRACE_S)
    if not done:
        log.warning("the connection did not close within %.0f s (the client is not reading the agent's output, "
                    "or a request does not stop); exiting without the rest", EXIT_GRACE_S)
        main.cancel()
        return
    if not await writer.flushed(deadline - loop.time()):
        log.warning("the client did not read the agent's last %d bytes within %.0f s; exiting without them",
                    writer.transport.get_write_buffer_size(), EXIT_GRACE_S)


def run(*, base_settings: dict[str, Any], version: str, debug: bool, client_pid: int | None,
        config_error: str | None = None, early: Any = None) -> int:
    """Serve ACP on stdio; ``config_error`` (the line a bad configuration wrote on stderr) is the
    answer to every request instead (``Unconfigured``), and the exit code is 2. ``early``: the
    signals recorded since the process began (``server.__main__.EarlySignals``), handed over to
    the loop once the connection is set up."""
    from operate_sidecar.server.rpc import settings as S
    from operate_sidecar.server.rpc.stdio import guard_stdio

    fds = guard_stdio()  # before anything can write to fd 1
    logging.getLogger().addFilter(NotificationNotices(debug))  # the SDK logs on the root logger
    import_sdk()
    settings = S.finalize(S.merge(S.DEFAULTS, base_settings)) if config_error is None else {}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(serve_acp(settings=settings, version=version, debug=debug,
                                                 client_pid=client_pid, fds=fds, config_error=config_error,
                                                 early=early))
    except KeyboardInterrupt:
        return 1
