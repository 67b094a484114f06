"""``operate-sidecar --acp``: serve the Agent Client Protocol on stdio until stdin's EOF,
a signal or the client's death; returns the exit code (0 on EOF).

stdout is the wire: the native front end's guard (``server.rpc.stdio.guard_stdio``) moves
the real stdout to a private descriptor and points fd 1 at stderr before anything else
runs, so ``print()`` in a tool or a child process's output can never reach the stream.
asyncio streams are then opened on the private descriptors (pipes, or a regular file or
/dev/null, which ``server.rpc.stdio`` reads on a thread or writes at once), the input bounded by
``maxMessageBytes`` per line; the SDK's connection does the framing and the JSON-RPC."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import sys
from typing import Any

from operate_sidecar.server import redaction

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
    from operate_sidecar.server.rpc.stdio import open_read_transport, open_write_transport

    loop = asyncio.get_running_loop()
    # a pipe, a socket or a terminal is watched by the loop; a regular file or /dev/null (stdin
    # or stdout redirected to one) is read to its end on a thread, or written at once
    w_transport, w_protocol = await open_write_transport(
        wire_out, lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()))
    writer = RedactingWriter(w_transport, w_protocol, None, loop)
    reader = asyncio.StreamReader(limit=limit + 1)
    bound = LineBound(reader, writer, limit, drains)  # before the first byte: the input may end at once
    await open_read_transport(wire_in, lambda: asyncio.StreamReaderProtocol(reader))
    return reader, writer, bound


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
    tool wrote, and the client's file must hold it, as a file written to the disk does."""

    _WRITE = b'"fs/write_text_file"'

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._partial = b""  # the bytes of a line not yet ended, held while secrets are known

    def write(self, data: Any) -> None:
        if not self._partial and not redaction.has_secrets():
            super().write(unicode_only(data))
            return
        data = self._partial + bytes(data)
        end = data.rfind(b"\n") + 1
        self._partial = data[end:]
        if end:
            super().write(unicode_only(self._redacted(data[:end])))

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
        self._flush_partial()
        await super().drain()

    def write_eof(self) -> None:
        self._flush_partial()
        super().write_eof()

    def close(self) -> None:
        try:
            self._flush_partial()
        except Exception:  # the transport is gone: nothing more can be sent
            pass
        super().close()


class LineBound:
    """``maxMessageBytes`` for ACP's newline-delimited input, in front of the SDK's reader: a
    line longer than the bound is dropped as it streams in (never buffered whole) and answered
    with -32600 (its ``id`` when its first bytes show one); the stream stays in sync at the
    next newline. An answer of the client's (to ``fs/read_text_file``, say) that is too long
    fails the request it answers, at once, with that -32600; the client is sent nothing.

    It also screens each whole line, cheaply (no parse), for what the SDK cannot take: the
    SDK's connection assumes every line is a JSON object, and stops serving on any other JSON
    value. A line whose first and last non-blank bytes are ``{`` and ``}`` goes to the SDK (a
    blank one is dropped, as the SDK would); any other line is parsed here and answered with
    id null: not JSON (or not UTF-8) -32700, JSON but not an object -32600 (an array too:
    ACP has no batches); the rare one that is an object all the same (behind a UTF-8 BOM)
    goes to the SDK. A line that passes the screen but that the SDK cannot parse is answered
    -32700 through ``NotificationNotices``, which sees the SDK's log record of it."""

    HEAD = 4096

    def __init__(self, reader: Any, writer: Any, limit: int, drains: bool = False) -> None:
        self.limit = limit
        #: the real connection's: at the input's end the SDK is fed ``END_OF_INPUT`` first, which
        #: it dispatches after every line before it, and whose handler (installed by
        #: ``explain_invalid_params``) answers the requests still in flight, then calls ``end_input``
        self.drains = drains
        self.ending = False  # the input ended, and ``END_OF_INPUT`` was fed
        self._feed = reader.feed_data
        self._writer = writer
        self._held = bytearray()  # the current line's bytes, while it may still be too long
        self._skipping = False
        self._head = b""
        self._size = 0  # the current line's length so far
        self.on_eof: Any = None  # called at the input's end
        self._ended = False
        self._feed_eof = reader.feed_eof
        reader.feed_data = self.feed_data  # the SDK's protocol feeds the reader through this
        reader.feed_eof = self.feed_eof

    def feed_eof(self) -> None:
        if self.ending:  # (the protocol says it twice: at the EOF and as the pipe closes)
            return
        if self.drains:
            self.ending = True
            self._feed(END_OF_INPUT_LINE)
            # (should the SDK not dispatch it, the input still ends)
            asyncio.get_running_loop().call_later(EXIT_GRACE_S + 1.0, self.end_input)
            return
        self.end_input()

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
            if not self._skipping:
                if len(self._held) + len(part) - (1 if nl >= 0 else 0) > self.limit:
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
            self._feed(line)
            return
        text = line.strip()  # the same blanks the SDK strips
        if not text:
            return
        if text[:1] == b"{" and text[-1:] == b"}":
            self._feed(line)
            return
        import json

        try:
            value = json.loads(text)
        except Exception as e:  # not JSON, not UTF-8, or nested past the parser's depth
            self.parse_error(e)
            return
        if isinstance(value, dict):  # an object behind a BOM, say: the SDK parses it alike
            self._feed(line)
            return
        what = {list: "an array (ACP has no batches)", str: "a string", bool: "a boolean",
                type(None): "null"}.get(type(value), "a number")
        log.warning("dropped a line that is not a JSON-RPC message: %s", what)
        self.answer(None, -32600, f"Invalid Request: a message must be a JSON object, not {what}")

    def parse_error(self, exc: BaseException | None = None) -> None:
        """A line that is not JSON: one WARNING line and -32700, id null; the stream goes on."""
        log.warning("dropped a line that is not valid JSON%s", f" ({_brief(exc)})" if exc is not None else "")
        self.answer(None, -32700, "Parse error: the line is not valid JSON")

    def answer(self, msg_id: Any, code: int, message: str) -> None:
        """An error answer written at once, as one whole line (the SDK's writes are too)."""
        frame = {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}
        try:
            import json

            self._writer.write((json.dumps(frame) + "\n").encode())
        except Exception:  # the client is gone
            pass

    def _reject(self) -> None:
        from operate_sidecar.server.rpc.framing import looks_like_answer, peek_id

        msg_id = peek_id(self._head)
        msg_id = msg_id if isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool) else None
        answer = looks_like_answer(self._head)
        size, self._size = self._size, 0
        self._head = b""
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

                self._feed((json.dumps(frame) + "\n").encode())
            return
        log.warning("dropped a message longer than maxMessageBytes (%d bytes)", self.limit)
        self.answer(msg_id, -32600, f"message larger than maxMessageBytes ({self.limit} bytes)")


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
#: the notification ``LineBound`` feeds the SDK at the input's end (an extension method's
#: name; a client's own, before its input ended, is ignored as any extension notification is)
END_OF_INPUT = "_operate_sidecar/end_of_input"
END_OF_INPUT_LINE = b'{"jsonrpc": "2.0", "method": "' + END_OF_INPUT.encode() + b'"}\n'


def explain_invalid_params(conn: Any) -> None:
    """Requests whose params fail the schema (a missing ``cwd``, a prompt that is not a list)
    are answered by the SDK with -32602 and the bare message "Invalid params", pydantic's
    details in ``data`` only; an editor shows the message. On ``conn`` (an
    ``AgentSideConnection``, from the agent's ``on_connect``) such an answer gets a message
    naming the method and each field with what is wrong (at most three), its ``data`` as the
    SDK makes it; both agents install it (``OperateAgent`` and ``Unconfigured``). A
    notification's failure is left to the SDK (``NotificationNotices``). On the real connection
    it also answers the requests still being served when the input ends: the SDK would cancel
    them unanswered as it closes; each is cancelled and answered -32800 first
    (``answer_in_flight``, once ``END_OF_INPUT`` is dispatched). With an SDK laid out
    otherwise, its own answers stay (and the input ends ``EXIT_GRACE_S`` + 1 s after its EOF)."""
    inner_conn = getattr(conn, "_conn", None)
    handler = getattr(inner_conn, "_handler", None)
    if handler is None or getattr(handler, "explains_invalid_params", False):
        return
    from acp.exceptions import RequestError
    from pydantic import ValidationError

    from .agent import DROPPED, dropped_items

    wire = WIRE.get()  # the real connection's (not the warm-up's): its END_OF_INPUT is served here
    inflight: set[asyncio.Task] = set()  # the requests being served
    ended: set[asyncio.Task] = set()     # those cancelled because the input ended

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
            raise RequestError(-32800, f"{method} cancelled: the client's input ended before its answer",
                               {"method": method}) from None
        finally:
            if me is not None:
                inflight.discard(me)
                ended.discard(me)

    async def answer_in_flight() -> None:
        """The input ended (every line before it dispatched): each request still being served
        is cancelled and answered -32800, none dropped (as in the native front end), within
        ``EXIT_GRACE_S``."""
        tasks = [t for t in inflight if not t.done()]
        for t in tasks:
            ended.add(t)
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=EXIT_GRACE_S)

    explained.explains_invalid_params = True  # type: ignore[attr-defined]
    inner_conn._handler = explained  # type: ignore[union-attr]


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
                    client_pid: int | None = None, fds: tuple[int, int], config_error: str | None = None) -> int:
    """Serve until stdin's EOF, a signal or the client's death; with ``config_error`` (the bad
    configuration's line) every request is answered with it (``Unconfigured``), then exit 2."""
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
    stopping = asyncio.Event()  # stdin's EOF, a signal or the client's death

    def stop() -> None:
        stopping.set()
        main.cancel()

    bound.on_eof = stopping.set
    from operate_sidecar.server.signals import install_signal_handlers

    install_signal_handlers(loop, stop)
    watchdog = None
    if client_pid is not None:
        from operate_sidecar.server.rpc.watchdog import watch_parent

        watchdog = loop.create_task(watch_parent(client_pid, stop))
    bounded = loop.create_task(_bound_exit(main, stopping))
    try:
        await main
    except asyncio.CancelledError:
        log.info("stopping")
    except Exception:
        log.exception("the ACP connection failed")
    bounded.cancel()
    if watchdog is not None:
        watchdog.cancel()
    await agent.aclose()
    return 0 if config_error is None else 2


async def _bound_exit(main: asyncio.Task, stopping: asyncio.Event) -> None:
    """The SDK's connection closes by writing out what it queued, shielded from cancellation:
    a client that no longer reads stdout would hold the process forever (SIGTERM, stdin's EOF
    and the client's death all ignored). Once stopping, the connection gets ``EXIT_GRACE_S``,
    then is cancelled again, which ends its wait; what the client did not read is dropped."""
    await stopping.wait()
    done, _ = await asyncio.wait({main}, timeout=EXIT_GRACE_S)
    if not done:
        log.warning("the client is not reading the agent's output; exiting without writing the rest")
        main.cancel()


def run(*, base_settings: dict[str, Any], version: str, debug: bool, client_pid: int | None,
        config_error: str | None = None) -> int:
    """Serve ACP on stdio; ``config_error`` (the line a bad configuration wrote on stderr) is the
    answer to every request instead (``Unconfigured``), and the exit code is 2."""
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
                                                 client_pid=client_pid, fds=fds, config_error=config_error))
    except KeyboardInterrupt:
        return 1
