"""The pygls 2.1.1 ``JsonRPCServer`` serving the native protocol (docs/PROTOCOL.md).

pygls is driven from our own reader (``transport.Connection``): messages
arrive here already framed, decoded as plain dicts and validated, so pygls's
stock reader (a thread-pool hop per read, case-sensitive headers, no -32700,
namedtuple params) is never used. What pygls provides is kept: feature
registration (``fm.feature``), handler execution and the in-flight request
table (``_execute_handler`` / ``_request_futures``), which ``$/cancelRequest``
cancels for real. Errors are mapped without tracebacks unless ``--debug``;
every frame goes out through ``Connection.send`` (exact framing).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import itertools
import logging
import sys
import threading
import time
from functools import partial
from typing import Any, Callable

import cattrs
from pygls.protocol.json_rpc import JsonRPCProtocol
from pygls.server import JsonRPCServer

from operate_sidecar.protocol import catalog

from operate_sidecar.server import codecache
from operate_sidecar.server.service.errors import map_exception
from operate_sidecar.server.service.port import ClientRequestError
from operate_sidecar.server.service.service import PAGE_SLICE, Service

from . import errors as E
from .transport import CONNECTION_METHODS, Encoded

log = logging.getLogger("operate_sidecar.server.rpc")

#: what a native client can do when a bound of the settings is reached, by the setting
#: (``service.errors.LimitReached``: the service states the bound; raising it is said after these)
REMEDIES = {"maxBranches": "delete branches you no longer need (deleteBranch)",
            "maxMessagesPerBranch": "start a new branch (createBranch), operate with clearMessages: true, "
                                    "delete it (deleteBranch)"}


def app_methods() -> tuple[str, ...]:
    """The client → server requests of the protocol's catalog that the app serves: all of
    them but the few the connection answers itself (``initialize``, ``ping``, ``shutdown``)."""
    return tuple(m for m in catalog.REQUESTS if m not in CONNECTION_METHODS)


def handler_name(method: str) -> str:
    """The ``Service`` method that serves a wire method: the same name (``createBranch``)."""
    return method


class SidecarProtocol(JsonRPCProtocol):
    """JsonRPCProtocol fed with validated dict messages by ``Connection``."""

    def __init__(self, server: "SidecarServer", converter: cattrs.Converter) -> None:
        super().__init__(server, converter)
        self._out_ids = itertools.count(1)
        self._outgoing: dict[str, asyncio.Future] = {}
        #: requests answered -32800 on the way out while their handler still ran (``answer_unfinished``)
        self._answered_unfinished: set[Any] = set()

    # ------------------------------------------------------------ client → server requests
    def handle_request(self, msg_id: Any, method: str, params: dict) -> None:
        handler = self.fm.features.get(method)
        conn = self._server.conn
        if handler is None:
            conn.send_error(msg_id, E.METHOD_NOT_FOUND, f"method not found: {method}")
            return
        core = self._server.core
        if msg_id in self._request_futures or (not core.loaded and core.deferred(msg_id)):
            conn.send_error(msg_id, E.INVALID_REQUEST, f"request id {msg_id!r} is already in flight")
            return
        if not core.loaded:  # first requests: wait (in order) for the core, off the loop thread
            core.defer(msg_id, partial(self.handle_request, msg_id, method, params))
            return
        ctx = contextvars.copy_context()
        ctx.run(self._execute_handler, msg_id, handler, partial(self._send_handler_result, msg_id=msg_id),
                args=(params,))

    def _send_handler_result(self, future: Any, *, msg_id: Any) -> None:
        if future in self._answered_unfinished:  # answered -32800 already: once only
            self._answered_unfinished.discard(future)
            return
        self._request_futures.pop(msg_id, None)
        conn = self._server.conn
        if future.cancelled():
            conn.send_error(msg_id, E.REQUEST_CANCELLED, "request cancelled")
            return
        exc = future.exception()
        if exc is None:
            result = future.result()
            if isinstance(result, Encoded):  # JSON text already, made a slice at a time
                conn.send_encoded_result(msg_id, result)
            else:
                conn.send_result(msg_id, result)
            return
        if isinstance(exc, asyncio.CancelledError):
            conn.send_error(msg_id, E.REQUEST_CANCELLED, "request cancelled")
            return
        code, message, data = map_exception(exc, self._server.debug, REMEDIES)
        if code == E.INTERNAL_ERROR:  # a bug: one line, its traceback too with --debug (docs/PROTOCOL.md §8)
            log.error("request %r failed: %s", msg_id, message, exc_info=exc if self._server.debug else None)
        conn.send_error(msg_id, code, message, data)

    def answer_unfinished(self) -> None:
        """On the way out: answer -32800 every request whose handler still runs (one that kept
        running though cancelled: a tool that swallows its cancellation); its handler's late
        end sends nothing more (docs/PROTOCOL.md §2: no request is left unanswered)."""
        for msg_id, future in list(self._request_futures.items()):
            if not isinstance(future, asyncio.Future) or future.done():
                continue
            del self._request_futures[msg_id]
            self._answered_unfinished.add(future)
            self._server.conn.send_error(msg_id, E.REQUEST_CANCELLED, "request cancelled")

    def cancel_request(self, msg_id: Any) -> None:
        if self._server.core.drop(msg_id):
            self._server.conn.send_error(msg_id, E.REQUEST_CANCELLED, "request cancelled")
            return
        future = self._request_futures.get(msg_id)
        if future is None:
            log.debug("cancel for unknown or finished request %r", msg_id)
            return
        future.cancel()

    # ------------------------------------------------------------ server → client
    def _send_data(self, data: Any) -> None:  # anything pygls itself would send
        if data is None:
            return
        if hasattr(data, "__attrs_attrs__"):
            data = self._converter.unstructure(data)
        self._server.conn.send(data)

    def notify(self, method: str, params: Any | None = None) -> None:
        self._server.conn.notify(method, params)

    async def request_client(self, method: str, params: Any, timeout: float | None) -> Any:
        """Send a request to the client and await its answer.
        An error answer raises ClientRequestError; ``timeout`` raises TimeoutError.
        Cancellation (or the timeout) sends ``$/cancelRequest`` to the client."""
        msg_id = f"sidecar-{next(self._out_ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._outgoing[msg_id] = fut
        conn = self._server.conn
        conn.send({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        try:
            if timeout is None:
                return await fut
            # not ``wait_for``: on 3.11 it returns an answer that came with a cancel and loses the
            # cancel (a turn stopped while the user's deny arrived would go on)
            async with asyncio.timeout(timeout):
                return await fut
        except (asyncio.CancelledError, asyncio.TimeoutError, TimeoutError):
            conn.notify("$/cancelRequest", {"id": msg_id})
            raise
        finally:
            self._outgoing.pop(msg_id, None)

    def handle_response(self, msg: dict) -> None:
        fut = self._outgoing.get(msg.get("id"))  # type: ignore[arg-type]
        if fut is None or fut.done():
            log.debug("response to unknown request %r", msg.get("id"))
            return
        err = msg.get("error")
        if err is not None:
            if not isinstance(err, dict):
                err = {"code": E.INTERNAL_ERROR, "message": str(err)}
            fut.set_exception(ClientRequestError(err.get("code", 0), str(err.get("message", "")), err.get("data")))
        else:
            fut.set_result(msg.get("result"))

    def cancel_outgoing(self) -> None:
        for fut in list(self._outgoing.values()):
            if not fut.done():
                fut.cancel()


#: what the methods need from the core and the providers, loaded on first use (see ``CoreLoader``).
#: The state store, the rounds loop and the workspace tools are the first operate's: loaded
#: here (~15 ms), the first operate right after a ``createBranch`` runs as fast as a warm one.
CORE_MODULES = ("operate_sidecar.server.core", "operate_sidecar.server.core.branch", "operate_sidecar.server.core.operate", "operate_sidecar.server.core.prepare",
                "operate_sidecar.server.core.tools", "operate_sidecar.server.models", "operate_sidecar.server.models.scripted",
                "operate_sidecar.server.state", "operate_sidecar.server.service.rounds",
                "operate_sidecar.server.tools.builtin", "operate_sidecar.server.tools.file_tools",
                "pydantic.type_adapter", "pydantic.dataclasses")  # the tools' JSON schemas need them (lazily)
#: imported later, without holding up a request (first responseFormat / toolModules use) ...
CORE_WARM = ("json_schema_to_pydantic", "operate_sidecar.server.tools.python_modules")
#: ... this long after the core: a background import competes for the GIL with whatever the
#: loop runs, and the editor's first operate often follows its first createBranch at once
WARM_DELAY_S = 0.5


#: ``shutdown`` waits this long at most for the requests received before it that are running
#: (an operate, a listTools importing a slow tool module): they are then left running, and the
#: ``exit`` cancels them (-32800). Requests that take no time are answered before the shutdown.
SHUTDOWN_WAIT_S = 0.5


class CoreLoader:
    """Imports the core once, off the event loop, when the first request needs it.

    Until then the sidecar holds only the transport, pygls and the wire types, so an
    idle editor sidecar stays small. Requests that arrive before the core is loaded are
    deferred in arrival order and replayed once it is; the event loop keeps serving
    meanwhile (``ping``, ``$/cancelRequest``, client responses). If the import fails,
    the replayed requests fail with the error (-32603) instead of waiting forever.

    Who imports: when a request that needs the app is already waiting while pygls loads,
    the connection's loader thread goes straight on to the core in the same pass
    (``external=True``; it calls :meth:`loaded_elsewhere` when done); otherwise the first
    request starts the import on a worker thread."""

    def __init__(self, external: bool = False) -> None:
        # (while the loader thread imports, sys.modules may hold the core half-initialized)
        self.loaded = not external and all(m in sys.modules for m in CORE_MODULES)
        self._deferred: list[tuple[Any, Callable[[], None]]] = []
        self._started = external
        self._warming: asyncio.Task | None = None  # a warm-up running (``warm``)
        self._later: asyncio.TimerHandle | None = None  # the later warm-up, scheduled
        self._stopped = False
        self._on_served: list[Callable[[], None]] = []  # run once what waited has been served

    def defer(self, msg_id: Any, replay: Callable[[], None]) -> None:
        self._deferred.append((msg_id, replay))
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, self.load).add_done_callback(
                lambda f: loop.call_soon(self._loaded, loop, not f.cancelled() and f.exception() is None
                                         and f.result()))

    def loaded_elsewhere(self, loop: asyncio.AbstractEventLoop, ok: bool) -> None:
        """The connection's loader thread has imported the core (``ok``) or failed (see ``load``)."""
        if not self.loaded:
            self._loaded(loop, ok)

    def waiting(self) -> bool:
        """Requests received wait for the core (they are served once it is in)."""
        return not self.loaded and bool(self._deferred)

    def after_served(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the requests waiting for the core have been served (at once if none wait)."""
        if self.waiting():
            self._on_served.append(fn)
        else:
            fn()

    def deferred(self, msg_id: Any) -> bool:
        return any(i == msg_id for i, _ in self._deferred)

    def drop(self, msg_id: Any) -> bool:
        for k, (i, _) in enumerate(self._deferred):
            if i == msg_id:
                del self._deferred[k]
                return True
        return False

    def _loaded(self, loop: asyncio.AbstractEventLoop, ok: bool) -> None:
        """The core is in (``ok``): warm the first-use paths (``warm.warm_up``), then serve what
        waited. After a failed import, what waited is served at once (and fails -32603)."""
        from .warm import LATER, warm_then

        def serve() -> None:
            self._replay()
            if ok and not self._stopped:
                self._later = loop.call_later(WARM_DELAY_S, warm_later)

        def warm_later() -> None:
            self._later = None
            loop.run_in_executor(None, self.warm)
            self._warming = loop.create_task(warm_then("warm-up", None, LATER))

        if not ok or self._stopped:  # (after shutdown nothing follows: serve what waits at once)
            serve()
            return
        self._warming = loop.create_task(warm_then("warm-up", serve))

    def stop(self) -> None:
        """No warm-up from now on (the server is closing)."""
        self._stopped = True
        if self._later is not None:
            self._later.cancel()
        if self._warming is not None:
            self._warming.cancel()

    def _replay(self) -> None:
        self.loaded = True
        deferred, self._deferred = self._deferred, []
        for _, replay in deferred:
            try:
                replay()
            except Exception:
                log.exception("error while handling a deferred request")
        self._served()

    def _served(self) -> None:
        done, self._on_served = self._on_served, []
        for fn in done:
            try:
                fn()
            except Exception:
                log.exception("error after the deferred requests were served")

    def abandon(self) -> list[Any]:
        """The server is closing before the core is in: the ids of the requests that waited
        (never started; their caller answers them), then what waited for them runs."""
        ids = [i for i, _ in self._deferred]
        self._deferred = []
        self._served()
        return ids

    @staticmethod
    def load() -> bool:
        t0 = time.perf_counter()
        try:
            for name in CORE_MODULES:
                importlib.import_module(name)
            from operate_sidecar.protocol import catalog, converter

            for params_type, _ in catalog.REQUESTS.values():  # build the params checkers now, not per first call
                converter.get_structure_hook(params_type)
            from operate_sidecar.server.core.prepare import prepare_operate_kw

            from operate_sidecar.server.service.service import _pipeline_names, passed_as_is

            from .stdio import bind_children_to_process

            _pipeline_names(prepare_operate_kw)  # operate's option names (inspect.signature), once
            passed_as_is(prepare_operate_kw)

            bind_children_to_process()  # the tools' reaper (a process spawn): here, not in the first operate
        except BaseException:
            log.exception("could not load the core")
            return False
        log.info("core loaded in %.0f ms (thread %s)", (time.perf_counter() - t0) * 1000,
                 threading.current_thread().name)
        codecache.save_soon()  # what was compiled up to here, when anything was new
        return True

    @staticmethod
    def warm() -> None:
        for name in CORE_WARM:  # optional; the first real use reports an error
            try:
                importlib.import_module(name)
            except BaseException:
                pass


#: the methods whose handler is the server's own (``SidecarServer``, same name): their answers are
#: encoded there, a slice at a time (``Encoded``)
_ENCODED_HANDLERS = {"branchMessages"}


async def encode_page(result: dict) -> Encoded:
    """A ``branchMessages`` result ``{messages, total}`` as JSON text, ``PAGE_SLICE`` messages
    at a time (as the service made them), yielding to the loop between slices; each slice, and
    the fields besides the messages, masked as the wire masks every frame
    (``redaction.redact_bytes``, on each as a JSON text of its own: a secret lies within one
    message's strings, never across two). The wire sends it as it is
    (``Connection.send_encoded_result``)."""
    from operate_sidecar.server import redaction

    from .transport import dumps

    def masked(text: bytes) -> bytes:
        return redaction.redact_bytes(text) if redaction.has_secrets() else text

    messages = result["messages"]
    parts: list[bytes] = []
    for i in range(0, len(messages), PAGE_SLICE):
        if i:
            await asyncio.sleep(0)
        parts.append(masked(dumps(messages[i:i + PAGE_SLICE]))[1:-1])  # the items, without the list's brackets
    extra = {k: v for k, v in result.items() if k != "messages"}
    rest = masked(dumps(extra))[1:-1]
    return Encoded(b'{"messages":[' + b",".join(parts) + b"]" + (b"," + rest if rest else b"") + b"}")


def _handler(bound: Any) -> Any:
    """A plain function around a bound method (pygls sets attributes on handlers)."""
    if asyncio.iscoroutinefunction(bound):
        async def handle(params: dict) -> Any:
            return await bound(params)
    else:
        def handle(params: dict) -> Any:
            return bound(params)
    handle.__name__ = handle.__qualname__ = bound.__name__
    return handle


class SidecarServer(JsonRPCServer):
    """The server object the transport hands every message that needs the app."""

    def __init__(self, conn: Any) -> None:
        super().__init__(SidecarProtocol, cattrs.Converter)
        self.conn = conn
        self.debug = bool(getattr(conn, "debug", False))
        self.service = Service(self)
        self.core = CoreLoader(external=bool(getattr(conn, "loads_core", False)))
        self._settling: asyncio.Task | None = None  # shutdown waiting for earlier requests
        # dispatch is the protocol's catalog: every request it declares (but the connection's
        # own) is registered with pygls by name; a method without a handler is not registered,
        # so it is answered -32601 and reported here (tests/rpc/test_catalog.py fails on it)
        for method in app_methods():
            bound = getattr(self, method, None) if method in _ENCODED_HANDLERS \
                else getattr(self.service, handler_name(method), None)
            if bound is None or not callable(bound):
                log.error("the protocol declares %s but the server has no handler for it", method)
                continue
            self.protocol.fm.feature(method)(_handler(bound))

    async def branchMessages(self, params: dict) -> Any:
        """The service's ``branchMessages``, its page encoded ``PAGE_SLICE`` messages at a time
        (``encode_page``) when it has more: a page of 100,000 messages encoded in one
        ``json.dumps`` held up every request for most of a second."""
        result = await self.service.branchMessages(params)
        if len(result["messages"]) <= PAGE_SLICE:
            return result
        return await encode_page(result)

    # ---------------------------------------------------------------- called by Connection
    def handle_request(self, msg_id: Any, method: str, params: dict) -> None:
        self.protocol.handle_request(msg_id, method, params)

    def handle_response(self, msg: dict) -> None:
        self.protocol.handle_response(msg)

    def cancel_request(self, msg_id: Any) -> None:
        self.protocol.cancel_request(msg_id)

    def on_initialized(self) -> None:
        pass

    def on_shutdown(self) -> None:
        self.core.stop()  # no warm-up: no request follows (and what waits for the core is served at once)
        self.service.flush_journal_sync()

    def _running(self) -> list[asyncio.Future]:
        # every request not answered yet: also one whose handler just ended (a cancel just taken)
        # while its answer, a done callback, still waits for its turn in the loop (the callback
        # removes it): shutdown is answered after it, not before
        return [f for f in self.protocol._request_futures.values() if isinstance(f, asyncio.Future)]

    def after_earlier(self, fn: Callable[[], None]) -> bool:
        """``shutdown``: when requests received before it are not answered yet, run ``fn()`` once
        they are (the ones waiting for the core are served first, without the warm-up; the running
        ones are waited for ``SHUTDOWN_WAIT_S`` at most, then left to ``exit``) and return True;
        else return False."""
        if not self.core.waiting() and not self._running():
            return False
        self.core.stop()  # no warm-up: serve what waits as soon as the core is in

        def served() -> None:
            running = self._running()
            if not running:
                fn()
                return

            async def settle() -> None:
                await asyncio.wait(running, timeout=SHUTDOWN_WAIT_S)
                fn()

            self._settling = asyncio.get_running_loop().create_task(settle())

        self.core.after_served(served)
        return True

    # ---------------------------------------------------------------- the service's ClientPort
    def notify(self, method: str, params: Any) -> None:
        self.conn.notify(method, params)

    async def request_client(self, method: str, params: Any, timeout: float | None) -> Any:
        return await self.protocol.request_client(method, params, timeout)

    async def aclose(self, timeout: float = 3.0) -> None:
        """Cancel in-flight work, wait for it (bounded), answer -32800 what is still running,
        stop tool sources, flush state."""
        self.core.stop()
        for msg_id in self.core.abandon():  # never started, waiting for the core: cancelled, and said so
            self.conn.send_error(msg_id, E.REQUEST_CANCELLED, "request cancelled")
        pending = [f for f in self.protocol._request_futures.values() if isinstance(f, asyncio.Future)]
        for f in pending:
            f.cancel()
        self.protocol.cancel_outgoing()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        self.protocol.answer_unfinished()  # still running past the wait: answered all the same
        await self.service.aclose()  # (no pygls thread pool: no handler is registered to run on one)
