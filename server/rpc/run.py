"""Run the server on the process's stdio until ``exit``, stdin EOF, a signal, the
client's death or its end of stdout going; returns the exit code (0 after ``shutdown``,
else 1)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..signals import install_signal_handlers
from .stdio import Wire, attach_reader, guard_stdio
from .transport import Connection, _decoder, _valid_id
from .watchdog import watch_parent

log = logging.getLogger("operate_sidecar.server.rpc")

#: on the way out, how long the answers still buffered wait for a client that is not reading
DRAIN_S = 2.0


class InputHold:
    """Between the reader and the connection: while the client does not read the server's
    output (``pause``), its input is held, not handled (no more work while the answers pile
    up), up to ``HOLD_MAX`` bytes, after which reading stops for real. An ``exit`` among what
    is held, or the end of input, still ends the server (docs/PROTOCOL.md §1-2): what was
    held is then handled first, in order (a ``shutdown`` before the ``exit`` counts), and the
    process exits within its drain bound. Only what the connection obeys as an exit counts
    (a notification: ``"jsonrpc": "2.0"``, no ``id``); an ``exit`` request, or one without
    ``"jsonrpc"``, is held as any request is, and what comes after an exit is held again
    while the client still reads nothing. ``resume`` hands the held input on, in order. A
    ``shutdown`` among what is held is noted (``shutdown_held``): a client that sent it and then
    closed stdout is done, not gone (``serve``)."""

    HOLD_MAX = 4 << 20
    #: whose output the warning names (the ACP front end's ``HeldInput``: the agent's)
    OUTPUT = "the server's output"

    def __init__(self, feed: Any, on_eof: Any) -> None:
        self._feed, self._on_eof = feed, on_eof
        self.reader: Any = None
        self.held = bytearray()
        self._scan: Any = None     # while paused: a frame parser over the held bytes, spots an exit
        self._exit = False         # an exit frame was among them
        #: a shutdown request is among the bytes held now (not handed on yet)
        self.shutdown_held = False
        self._stopped = False      # reading stopped for real (HOLD_MAX reached)

    def on_data(self, data: bytes) -> None:
        if self._scan is None:
            self._feed(data)
            return
        self.held += data
        self._scan.feed(data)
        if self._exit:
            # handed on now; the scan goes on (in step with the frames) over what comes next
            self._exit = False
            self._hand_on()
        elif len(self.held) > self.HOLD_MAX and not self._stopped:
            self._stopped = True
            log.warning("the client sent over %d bytes while not reading %s; "
                        "reading no more input until it does", self.HOLD_MAX, self.OUTPUT)
            self.reader.pause()

    def on_eof(self) -> None:
        self._scan = None
        self._hand_on()
        self._on_eof()

    def _scanned(self, body: bytes) -> None:
        if b'"exit"' in body and _obeyed_exit(body):
            self._exit = True
        elif b'"shutdown"' in body and _shutdown_request(body):
            self.shutdown_held = True

    def pause(self) -> None:
        if self._scan is None:
            self._scan = self._scanner()

    def _scanner(self) -> Any:
        """What reads the held bytes as they come (its ``feed``), to spot an exit among them."""
        from .framing import FrameParser

        # it starts wherever the input is: a frame begun before is skipped by the scan (never
        # by the connection, which is handed every held byte as it came), without a word
        return FrameParser(self._scanned, max_bytes=1 << 20, quiet=True)

    def resume(self) -> None:
        self._scan = None
        self._hand_on()

    def _hand_on(self) -> None:
        held, self.held = bytes(self.held), bytearray()
        self.shutdown_held = False  # (the connection has it now)
        if held:
            self._feed(held)
        if self._stopped:
            self._stopped = False
            self.reader.resume()


def _message(body: bytes) -> Any:
    """The body decoded as the connection decodes it (``Connection._route``); None if it is not JSON."""
    try:
        return _decoder.decode(body.decode("utf-8"))
    except (ValueError, RecursionError):
        return None


def _obeyed_exit(body: bytes) -> bool:
    """Whether the connection obeys this body as ``exit``: one JSON object with
    ``"jsonrpc": "2.0"``, ``"method": "exit"`` and no ``id`` (a request named exit is answered
    -32601; without ``jsonrpc`` it is -32600)."""
    msg = _message(body)
    return type(msg) is dict and msg.get("method") == "exit" and msg.get("jsonrpc") == "2.0" and "id" not in msg


def _shutdown_request(body: bytes) -> bool:
    """Whether this body is a ``shutdown`` request the connection obeys: ``"jsonrpc": "2.0"``,
    a valid id, no params (``{}`` and ``[]`` are none)."""
    msg = _message(body)
    return (type(msg) is dict and msg.get("method") == "shutdown" and msg.get("jsonrpc") == "2.0"
            and "id" in msg and _valid_id(msg["id"]) and msg.get("params") in (None, {}, []))


def take_signals(loop: asyncio.AbstractEventLoop, handler: Any, *, with_signal: bool = False,
                 early: Any = None) -> None:
    """The loop's handlers for SIGTERM, SIGINT and SIGHUP (``install_signal_handlers``). With
    ``early`` (``server.__main__.EarlySignals``, which recorded them since the process began),
    they are handed over: a signal that came before is taken now, as if it came now, after
    the input already sent (the loop reads that first); a child forked later gets the
    dispositions from before ``early`` took them."""
    def install(before: dict[int, Any] | None = None) -> None:
        install_signal_handlers(loop, handler, with_signal=with_signal, before=before)

    if early is None:
        install()
    else:
        early.hand_over(install)


async def serve(*, base_settings: dict[str, Any] | None = None, version: str = "0", debug: bool = False,
                client_pid: int | None = None, fds: tuple[int, int] | None = None, recorder: Any = None,
                early: Any = None) -> int:
    wire_in, wire_out = fds if fds is not None else guard_stdio()
    loop = asyncio.get_running_loop()
    wire = Wire(wire_out)
    conn = Connection(wire, base_settings=base_settings or {}, version=version, debug=debug,
                      client_pid=client_pid)
    if recorder is not None:  # --record: sees every frame body and model turn (server.script.recorder)
        recorder.attach(conn, wire)
    hold = InputHold(conn.feed, conn.on_eof)
    # a client that closes stdout after shutdown or exit (or as the server stops) is done, not
    # gone: its shutdown may still be held (InputHold), unread by the connection; its exit, never
    # held, was handed on as it came (the end is judged after the input read with it: Wire._on_gone)
    wire.expected_end = lambda: conn.shutdown_requested or conn.exit_code is not None or hold.shutdown_held
    wire.on_broken = lambda: conn.stop(0 if conn.shutdown_requested or hold.shutdown_held else 1)
    reader = hold.reader = await attach_reader(wire_in, hold.on_data, hold.on_eof)
    # a client that stops reading: no more requests are taken until it reads again (Wire), but
    # its exit and its end of input still are (InputHold)
    wire.on_pause, wire.on_resume = hold.pause, hold.resume
    # pygls, lsprotocol, protocol/ and the core load on a background thread once initialize
    # is answered: nothing competes with the initialize path for the GIL.
    conn.on_initialized.append(lambda c: c.start_app_loader(loop))
    watchdog: list[asyncio.Task] = []

    def start_watchdog(c: Connection) -> None:
        if c.client_pid is not None and not watchdog:
            watchdog.append(loop.create_task(watch_parent(c.client_pid, lambda: c.stop(1))))

    # (a signal that came while the process started is taken now: ``early``)
    take_signals(loop, lambda: conn.stop(0 if conn.shutdown_requested else 1), early=early)
    start_watchdog(conn)
    conn.on_initialized.append(start_watchdog)
    code = await conn.wait_stopped()
    reader.close()
    for t in watchdog:
        t.cancel()
    await conn.aclose()
    # the last answers (a cancelled operate's -32800 ...) reach a client that reads; one that
    # does not is waited for DRAIN_S at most
    if not await wire.drain(DRAIN_S) and not wire.closed:
        log.warning("the client did not read the server's last %d bytes; exiting without them", wire.pending)
    wire.close()
    if recorder is not None:
        recorder.close()
    return code
