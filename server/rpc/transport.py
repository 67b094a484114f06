"""The connection: frames in, JSON-RPC validation, lifecycle gate, frames out.

This module is the fast path and imports nothing heavy: it answers ``ping``,
``initialize``, ``shutdown``, ``exit``, every framing/JSON/lifecycle error and
``-32601`` by itself. Everything else goes to the *app* (``server.rpc.server``:
the pygls ``JsonRPCServer`` with the methods), which is imported on a
background thread as soon as ``initialize`` has been answered, so the
initialize path never waits for (or competes for the GIL with) pygls or
lsprotocol. Messages that need the app before it is loaded wait in an ordered
backlog. The core (pydantic, the pipeline) is loaded only once a request needs
it: by the same background pass when one is already waiting, else by the app.

Its tables (method names, lifecycle gates, ``initialize`` fields) are copies of
what ``operate_sidecar.protocol`` declares, kept here because importing that
package costs more than answering ``initialize``; tests/rpc/test_catalog.py pins
each of them to the protocol.
"""

from __future__ import annotations

import asyncio
import json
import linecache
import logging
import os
import sys
import threading
import traceback
from typing import Any, Callable

from .. import redaction
from . import errors as E
from . import settings as S
from .framing import FrameParser, looks_like_answer, peek_id
from .stdio import Wire

log = logging.getLogger("operate_sidecar.server.rpc")

PROTOCOL_VERSION = 1
SERVER_NAME = "operate-sidecar"

#: every request method served (initialize result ``capabilities.methods``)
REQUEST_METHODS: tuple[str, ...] = (
    "initialize", "ping", "shutdown",
    "createBranch", "forkBranch", "deleteBranch", "listBranches", "branchMessages",
    "listTools", "authorizeTool", "registerClientTools",
    "operate",
)
#: notifications the server sends (``capabilities.notifications``)
SERVER_NOTIFICATIONS: tuple[str, ...] = ("$/progress", "toolEvent", "window/logMessage")
#: the requests this connection answers itself; the app serves the rest of REQUEST_METHODS
CONNECTION_METHODS: tuple[str, ...] = ("initialize", "ping", "shutdown")
#: requests answered before ``initialize`` (others: -32002) and after ``shutdown`` (others: -32600)
BEFORE_INITIALIZE = frozenset({"initialize", "ping"})
AFTER_SHUTDOWN = frozenset({"ping"})
_APP_METHODS = frozenset(REQUEST_METHODS) - frozenset(CONNECTION_METHODS)

#: imported by the background loader before the app takes requests. The core (pydantic,
#: the Operative models) is not: ``server.rpc.server`` loads it on a worker thread when the
#: first request that needs it arrives, so a spawned-but-unused sidecar stays small.
PRELOAD = ("operate_sidecar.protocol",)

#: ``exit`` while the ``shutdown`` answer still waits for the requests before it (see
#: ``server.SHUTDOWN_WAIT_S``): the process exits once it is out, or after this long at most
EXIT_WAIT_S = 10.0

#: the end of stdin, queued behind the messages that wait for the app
_EOF: dict = {"$eof": True}

_INIT_KEYS = frozenset({"protocolVersion", "clientInfo", "processId", "capabilities", "workspaceFolders",
                        "settings"})
#: the capabilities this server knows (booleans); others a client announces are ignored
_CAPABILITY_KEYS = frozenset({"toolPermission", "clientTools", "fs", "thoughts"})


def _json_default(o: Any) -> Any:
    dump = getattr(o, "model_dump", None)
    if dump is not None:
        return dump(mode="json")
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, bytes):
        return o.decode("utf-8", "replace")
    return str(o)


def dumps(obj: Any) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_json_default)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (legal as JSON escapes): send them escaped, as received
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False,
                          default=_json_default).encode("ascii")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_decoder = json.JSONDecoder(parse_constant=_reject_constant)


def _valid_id(v: Any) -> bool:
    t = type(v)
    return t is int or t is str


class Encoded:
    """A request's result as JSON text already, masked by its maker (``server.encode_page``);
    ``Connection.send_encoded_result`` sends it."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body


class Connection:
    """One client connection over the guarded stdio pipes."""

    def __init__(self, wire: Wire, *, base_settings: dict[str, Any], version: str, debug: bool = False,
                 client_pid: int | None = None) -> None:
        self.wire = wire
        self.version = version
        self.debug = debug
        self.base_settings = base_settings
        self.settings: dict[str, Any] = S.finalize(S.merge(S.DEFAULTS, base_settings))  # registers secrets too
        self.client_pid = client_pid
        self.client_capabilities: dict[str, Any] = {}
        self.client_info: dict[str, Any] = {}
        self.workspace_folders: list[str] = []
        self.initialized = False
        self.shutdown_requested = False
        self._shutdown_id: Any = None        # a shutdown not answered yet: it waits for earlier requests
        self._shutdown_waits = False
        self._exit_requested = False
        self.exit_code: int | None = None
        self._stopped = asyncio.Event()
        self.parser = FrameParser(self._on_body, self._on_oversize, self.settings["maxMessageBytes"])
        self.app: Any = None                 # server.rpc.server.SidecarServer once loaded
        self._app_error: BaseException | None = None
        self._backlog: list[dict] | None = []   # None once the app is loaded (or failed)
        self.on_initialized: list[Callable[["Connection"], None]] = []
        self.recorder: Any = None            # server.script.recorder.Recorder under --record
        self._core_wanted = threading.Event()  # an app request waits: load the core in the same pass
        self.loads_core = False              # the loader thread imports the core (read by the app)
        self._ping_head = b'{"jsonrpc":"2.0","id":'
        wire.on_broken = lambda: self.stop(1 if not self.shutdown_requested else 0)

    # ------------------------------------------------------------------ output
    def send(self, msg: dict) -> None:
        try:
            if msg.get("method") == "fs/writeTextFile" and redaction.has_secrets():
                # the text the client is asked to write goes as the tool wrote it (as a write to
                # the disk does): masked, the user's buffer would differ from what the tool reports
                self.wire.send_bytes(redaction.redact_keeping(msg, "text", dumps))
                return
            body = dumps(msg)
        except (TypeError, ValueError, RecursionError) as e:
            if "id" in msg and "method" not in msg:
                body = dumps({"jsonrpc": "2.0", "id": msg["id"],
                              "error": {"code": E.INTERNAL_ERROR, "message": f"result is not JSON: {e}"}})
            else:
                log.error("dropping a %s message that is not JSON: %s", msg.get("method"), e)
                return
        if redaction.has_secrets():  # the last net: no known secret value leaves the process
            body = redaction.redact_bytes(body, keep_id=True)  # (the frame stays valid JSON, its id as it was)
        self.wire.send_bytes(body)

    def send_result(self, msg_id: Any, result: Any) -> None:
        self.send({"jsonrpc": "2.0", "id": msg_id, "result": result})

    def send_encoded_result(self, msg_id: Any, result: Encoded) -> None:
        """An answer whose result is JSON text already: an ``Encoded`` (a large page of messages,
        made a slice at a time by ``server.encode_page``), sent as it is. It is not masked here:
        its maker masked it (``redaction.redact_bytes``, as ``send`` masks a frame), which only
        an ``Encoded`` promises; plain bytes are refused."""
        if not isinstance(result, Encoded):
            raise TypeError(f"send_encoded_result takes an Encoded, not {type(result).__name__}")
        self.wire.send_bytes(b'{"jsonrpc":"2.0","id":' + dumps(msg_id) + b',"result":' + result.body + b"}")

    def send_error(self, msg_id: Any, code: int, message: str, data: Any = None) -> None:
        err: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            err["data"] = data
        self.send({"jsonrpc": "2.0", "id": msg_id, "error": err})

    def notify(self, method: str, params: Any) -> None:
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    def log_message(self, type_: int, message: str) -> None:
        """``window/logMessage`` (1 error, 2 warning, 3 info, 4 log); also logged to stderr."""
        log.log({1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO}.get(type_, logging.DEBUG), "%s", message)
        if self.initialized and not self.wire.closed:
            self.notify("window/logMessage", {"type": type_, "message": message})

    # ------------------------------------------------------------------ input
    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
        except Exception:  # never let a bug in one message kill the reader
            log.exception("error while handling input")

    def on_eof(self) -> None:
        if self._backlog and self.exit_code is None:
            # the messages before the end wait for the app (loading): the end comes after them,
            # so that a shutdown and exit among them are obeyed (bounded: the app may not load)
            self._backlog.append(_EOF)
            asyncio.get_running_loop().call_later(EXIT_WAIT_S, self.stop, 1)
            return
        if self._shutdown_waits:  # after shutdown, EOF is an exit: the shutdown answer comes first (bounded)
            self._notification("exit", {})
            return
        if self.exit_code is None:
            log.info("stdin closed; exiting")
        self.stop(0 if self.shutdown_requested else 1)

    def _on_oversize(self, head: bytes, size: int) -> None:
        msg_id = peek_id(head)
        if not _valid_id(msg_id):
            msg_id = None
        limit = self.parser.max_bytes
        if looks_like_answer(head):
            # the client's answer to a request of ours (a huge fs/readTextFile text, say): never
            # answered (an error under its id would answer the client's own request of that id);
            # the request it answers fails at once, as if the client had answered this error
            log.warning("dropped an answer of the client of %d bytes (id %r): larger than maxMessageBytes (%d)",
                        size, msg_id, limit)
            if msg_id is not None:
                self._ordered({"jsonrpc": "2.0", "id": msg_id, "error": {
                    "code": E.INVALID_REQUEST,
                    "message": f"the client's answer of {size} bytes is larger than maxMessageBytes ({limit})"}},
                    needs_app=True)
            return
        log.warning("skipped a message of %d bytes: larger than maxMessageBytes (%d)", size, limit)
        self.send_error(msg_id, E.INVALID_REQUEST,
                        f"message of {size} bytes exceeds maxMessageBytes ({limit}); skipped")

    def _on_body(self, body: bytes) -> None:
        if self.recorder is not None:
            self.recorder.incoming(body)
        try:
            msg = _decoder.decode(body.decode("utf-8"))  # strict UTF-8; no NaN/Infinity
        except ValueError as e:  # includes UnicodeDecodeError
            self.send_error(None, E.PARSE_ERROR, f"parse error: {e}")
            return
        except RecursionError:
            msg_id = peek_id(body[:65536])
            self.send_error(msg_id if _valid_id(msg_id) else None, E.PARSE_ERROR, "parse error: JSON nested too deeply")
            return
        if type(msg) is not dict:
            what = "a batch (array)" if type(msg) is list else f"a JSON {type(msg).__name__}"
            self.send_error(None, E.INVALID_REQUEST,
                            f"invalid request: expected a request or notification object, got {what}")
            return
        method = msg.get("method")
        if method == "ping" and "id" in msg and _valid_id(msg["id"]) and msg.get("jsonrpc") == "2.0" \
                and not msg.get("params"):
            # fast path: no allocation beyond the frame, allowed in every state (through the
            # last net when a secret is known, which keeps the id: the client chose it)
            body = self._ping_head + dumps(msg["id"]) + b',"result":{}}'
            self.wire.send_bytes(redaction.redact_bytes(body, keep_id=True) if redaction.has_secrets() else body)
            return
        self._route(msg)

    def _route(self, msg: dict) -> None:
        method = msg.get("method")
        if method is None:
            self._answer(msg)
            return
        if msg.get("jsonrpc") != "2.0":
            self._invalid(msg, 'invalid request: "jsonrpc" must be "2.0"')
            return
        if type(method) is not str:
            self._invalid(msg, 'invalid request: "method" must be a string')
            return
        if "id" in msg and not _valid_id(msg["id"]):
            self.send_error(None, E.INVALID_REQUEST, 'invalid request: "id" must be an integer or a string')
            return
        params = msg.get("params")
        if params is None or params == []:  # omitted, null or an empty by-position list: {}
            msg["params"] = {}
        elif type(params) is not dict:
            if "id" in msg:
                self.send_error(msg["id"], E.INVALID_PARAMS, "invalid params: params must be an object")
                return
            if method != "exit":  # (a notification cannot be answered; exit is obeyed whatever it holds)
                return
            msg["params"] = {}
        if "id" in msg:
            needs_app = method in _APP_METHODS
            if needs_app and self.app is None and self.initialized:
                self._core_wanted.set()
            self._ordered(msg, needs_app=needs_app)
        else:
            self._ordered(msg, needs_app=method == "$/cancelRequest")

    def _answer(self, msg: dict) -> None:
        """A body with no method: the client's answer to a request of ours, or no message. Never
        answered under its id: an error there would answer the client's own request of that id;
        a well-formed answer whose id is null, a list or an object is not answered at all.
        A malformed one with an id (no ``jsonrpc``, neither ``result`` nor ``error``) is
        ``-32600`` with ``id: null``, and the request of ours it answers fails at once, as if the
        client had answered that error (it would wait for its time-out)."""
        msg_id = msg.get("id")
        has_answer = "result" in msg or "error" in msg
        if not _valid_id(msg_id):  # (null, a list or an object is no id of a request of ours)
            if msg.get("jsonrpc") == "2.0" and has_answer and "id" in msg:
                # an answer is never answered: one with id null is how a client says it could
                # not read something the server sent
                log.warning("an answer of the client with id %s answers no request of the server: %s",
                            json.dumps(msg_id)[:80], str(msg.get("error", ""))[:200])
                return
            self.send_error(None, E.INVALID_REQUEST, "invalid request: no method")
            return
        if msg.get("jsonrpc") == "2.0" and has_answer:
            self._ordered(msg, needs_app=True)
            return
        why = 'an answer needs "jsonrpc": "2.0"' if has_answer else 'an answer holds "result" or "error"'
        log.warning("a malformed answer of the client (id %r): %s", msg_id, why)
        self.send_error(None, E.INVALID_REQUEST, f"invalid request: no method, and not an answer: {why}")
        self._ordered({"jsonrpc": "2.0", "id": msg_id, "error": {
            "code": E.INVALID_REQUEST, "message": f"the client's answer is malformed: {why}"}}, needs_app=True)

    def _invalid(self, msg: dict, message: str) -> None:
        msg_id = msg.get("id")
        self.send_error(msg_id if _valid_id(msg_id) else None, E.INVALID_REQUEST, message)

    def _ordered(self, msg: dict, *, needs_app: bool) -> None:
        """Keep arrival order while the app loads: once anything waits, everything
        after it waits too (pings excepted, they are answered on arrival)."""
        if self._backlog is not None and (self._backlog or (needs_app and self.initialized)):
            self._backlog.append(msg)
            return
        self._handle(msg)

    def _handle(self, msg: dict) -> None:
        if msg is _EOF:
            self.on_eof()
            return
        method = msg.get("method")
        if method is None:
            if self.app is not None:
                self.app.handle_response(msg)
            return
        if "id" not in msg:
            self._notification(method, msg["params"])
            return
        msg_id = msg["id"]
        if method in ("ping", "shutdown") and msg["params"]:  # they take no params
            unknown = list(msg["params"])
            self.send_error(msg_id, E.INVALID_PARAMS,
                            f"invalid params: unknown field{'s' if len(unknown) > 1 else ''}: "
                            + ", ".join(json.dumps(k) for k in unknown), {"unknownFields": unknown})
        elif method == "ping":
            self.send_result(msg_id, {})
        elif self.shutdown_requested and method not in AFTER_SHUTDOWN:
            self.send_error(msg_id, E.INVALID_REQUEST, f"server is shut down; {method} refused")
        elif method == "initialize":
            self._initialize(msg_id, msg["params"])
        elif not self.initialized and method not in BEFORE_INITIALIZE:
            self.send_error(msg_id, E.NOT_INITIALIZED, f"server not initialized; send initialize before {method}")
        elif method == "shutdown":
            self.shutdown_requested = True
            # the requests received before it are answered first (the ones waiting for the core
            # load are served without the warm-up; running ones are waited for a bounded time)
            self._shutdown_id, self._shutdown_waits = msg_id, True
            if self.app is None or not self.app.after_earlier(self._answer_shutdown):
                self._answer_shutdown()
        elif method not in _APP_METHODS:
            self.send_error(msg_id, E.METHOD_NOT_FOUND, f"method not found: {method}")
        elif self.app is None:
            self.send_error(msg_id, E.INTERNAL_ERROR, f"server failed to start: {self._app_error}")
        else:
            self.app.handle_request(msg_id, method, msg["params"])

    def _answer_shutdown(self) -> None:
        if not self._shutdown_waits:
            return
        self._shutdown_waits = False
        if self.app is not None:
            self.app.on_shutdown()
        self.send_result(self._shutdown_id, None)
        if self._exit_requested:
            self.stop(0)

    def _notification(self, method: str, params: dict) -> None:
        if method == "exit":
            if self._shutdown_waits:  # exit sent before the shutdown answer: it comes first (bounded)
                if self._exit_requested:
                    return
                self._exit_requested = True
                asyncio.get_running_loop().call_later(EXIT_WAIT_S, self.stop, 0)
                return
            self.stop(0 if self.shutdown_requested else 1)
        elif method == "$/cancelRequest":
            msg_id = params.get("id")
            if not _valid_id(msg_id):  # true is not the id 1, nor 2.0 the id 2; a list cannot be one
                log.debug("ignoring $/cancelRequest for %r: not a request id", msg_id)
            elif self.app is not None:
                self.app.cancel_request(msg_id)
        elif method == "initialized" or method.startswith("$/"):
            pass
        else:
            log.debug("ignoring notification %s", method)

    # ------------------------------------------------------------------ lifecycle
    def _initialize(self, msg_id: Any, params: dict) -> None:
        if self.initialized:
            self.send_error(msg_id, E.INVALID_REQUEST, "initialize was already called")
            return
        unknown = [k for k in params if k not in _INIT_KEYS]
        if unknown:
            self.send_error(msg_id, E.INVALID_PARAMS,
                            f"invalid params: unknown field{'s' if len(unknown) > 1 else ''}: "
                            + ", ".join(json.dumps(k) for k in unknown), {"unknownFields": unknown})
            return
        pv = params.get("protocolVersion")
        if pv is not None and type(pv) is not int:
            self.send_error(msg_id, E.INVALID_PARAMS, f"invalid params: protocolVersion must be an integer, not {pv!r}")
            return
        if pv is not None and pv != PROTOCOL_VERSION:
            self.send_error(msg_id, E.INVALID_PARAMS, f"unsupported protocolVersion {pv!r}; this server speaks 1")
            return
        pid = params.get("processId")
        caps = params.get("capabilities")
        folders = params.get("workspaceFolders")
        user = params.get("settings")
        problems = []
        info = params.get("clientInfo")
        if info is not None and (type(info) is not dict or type(info.get("name")) is not str
                                 or type(info.get("version", "")) is not str):
            problems.append("clientInfo must be an object with a name (and a version) that are strings")
        if pid is not None and type(pid) is not int:
            problems.append("processId must be an integer")
        if caps is not None and type(caps) is not dict:
            problems.append("capabilities must be an object")
        elif caps:
            wrong = [k for k in _CAPABILITY_KEYS if k in caps and type(caps[k]) is not bool]
            if wrong:
                problems.append("capabilities." + ", capabilities.".join(sorted(wrong)) + " must be booleans")
        if folders is not None and (type(folders) is not list or not all(type(f) is str for f in folders)):
            problems.append("workspaceFolders must be a list of paths")
        if user is not None and type(user) is not dict:
            problems.append("settings must be an object")
        if problems:
            self.send_error(msg_id, E.INVALID_PARAMS, "invalid params: " + "; ".join(problems))
            return
        try:
            S.check_depth(user)  # before anything walks it recursively
            merged = S.merge(S.merge(S.DEFAULTS, self.base_settings), user)
            unknown_s = [k for k in (user or {}) if k not in S.DEFAULTS]
            if unknown_s:
                raise S.SettingsError("unknown settings field(s): " + ", ".join(unknown_s))
            settings = S.finalize(merged)
        except (S.SettingsError, TypeError, ValueError, AttributeError) as e:
            self.send_error(msg_id, E.INVALID_PARAMS, f"invalid params: settings: {e}")
            return
        except RecursionError:
            self.send_error(msg_id, E.INVALID_PARAMS, "invalid params: settings: nested too deeply")
            return
        self.settings = settings  # S.finalize registered its secret values for redaction
        self.parser.max_bytes = int(settings["maxMessageBytes"])
        self.client_capabilities = dict(caps or {})
        self.client_info = dict(params.get("clientInfo") or {})
        self.workspace_folders = list(folders or [])
        if pid is not None and self.client_pid is None:
            self.client_pid = pid
        self.initialized = True
        self.send_result(msg_id, {
            "protocolVersion": PROTOCOL_VERSION,
            "serverInfo": {"name": SERVER_NAME, "version": self.version},
            "capabilities": {
                "methods": list(REQUEST_METHODS),
                "notifications": list(SERVER_NOTIFICATIONS),
                "models": list(settings["models"]),
                "stateDir": settings.get("stateDir"),
            },
        })
        for cb in self.on_initialized:
            cb(self)
        if self.app is not None:
            self.app.on_initialized()

    def stop(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
        self._stopped.set()

    async def wait_stopped(self) -> int:
        await self._stopped.wait()
        return self.exit_code if self.exit_code is not None else 1

    # ------------------------------------------------------------------ app loading
    def start_app_loader(self, loop: asyncio.AbstractEventLoop) -> None:
        def load() -> None:
            from .. import codecache  # (here, not at the top: the initialize path imports nothing it does not use)

            mod, error = None, None
            try:
                codecache.install()  # before the first attrs class: lsprotocol's ~550 compile from it
                from . import server as mod  # pygls, lsprotocol ... off the critical path
                import importlib

                # what every app request needs; the loop thread imports none of these until
                # the app is signalled loaded, so there is no cross-thread import race
                for name in PRELOAD:
                    importlib.import_module(name)
                # attrs keeps the generated source of every class it builds in linecache, for
                # debuggers: ~1,000 lsprotocol classes' worth (1.7 MiB) we never display. The
                # core, loaded later, reuses the freed memory.
                linecache.clearcache()
            except BaseException as e:  # pragma: no cover - broken install
                error = e
            # a request that needs the core already waits (the editor's first createBranch
            # right after initialize): go on to the core in this pass instead of handing
            # over to a worker thread once pygls is up. Otherwise the core waits for a
            # request, so that an idle sidecar stays small.
            chain = error is None and self._core_wanted.is_set()
            self.loads_core = chain  # read on the loop thread by the app, created after this
            try:
                loop.call_soon_threadsafe(self._app_loaded, mod, error)
            except RuntimeError:  # the loop is already closed: the process is exiting
                return
            if not chain:
                codecache.save_soon()  # what pygls and protocol/ compiled (the core saves its own)
                return
            ok = mod.CoreLoader.load()  # logs its own failure; the replayed requests then fail -32603
            linecache.clearcache()
            try:
                loop.call_soon_threadsafe(self._core_loaded, loop, ok)
            except RuntimeError:
                return

        limit_malloc_arenas()
        threading.Thread(target=load, name="app-loader", daemon=True).start()

    def _core_loaded(self, loop: asyncio.AbstractEventLoop, ok: bool) -> None:
        if self.app is not None:
            self.app.core.loaded_elsewhere(loop, ok)

    def _app_loaded(self, mod: Any, error: BaseException | None) -> None:
        if self._backlog is None:
            return
        if error is not None:
            self._app_error = error
            log.error("could not load the server: %s", "".join(traceback.format_exception(error)))
        else:
            try:
                self.app = mod.SidecarServer(self)
                if self.initialized:
                    self.app.on_initialized()
                if self.shutdown_requested:
                    self.app.on_shutdown()
            except Exception as e:
                self._app_error = e
                log.exception("could not start the server")
        backlog, self._backlog = self._backlog, None
        for msg in backlog:
            try:
                self._handle(msg)
            except Exception:
                log.exception("error while handling a queued message")

    async def aclose(self, timeout: float = 3.0) -> None:
        # requests still queued for the app (stopped before it was loaded) never started: they
        # are cancelled and said so, a shutdown among them answered; none is left unanswered
        backlog, self._backlog = self._backlog or [], None
        for msg in backlog:
            if "id" in msg and "method" in msg:
                if msg["method"] == "shutdown" and not msg["params"]:
                    self.send_result(msg["id"], None)
                else:
                    self.send_error(msg["id"], E.REQUEST_CANCELLED, "request cancelled")
        if self.app is not None:
            try:
                await self.app.aclose(timeout)  # (a shutdown waiting for the core's requests is answered)
            except Exception:
                log.exception("error while closing")
        if self._shutdown_waits:
            self._shutdown_waits = False
            self.send_result(self._shutdown_id, None)


def limit_malloc_arenas() -> None:
    """glibc gives each new thread its own malloc arena; the app loader, the core loader and
    the tool workers each hold one (about 2 MiB resident after loading) for no benefit under
    the GIL. Cap them at one, as ``MALLOC_ARENA_MAX=1`` would, unless the environment sets
    ``MALLOC_ARENA_MAX`` itself. Called once, after the ``initialize`` answer is out."""
    if sys.platform != "linux" or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return
        import ctypes

        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, ValueError, AttributeError):
        pass
