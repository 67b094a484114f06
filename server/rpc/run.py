"""Run the server on the process's stdio until ``exit``, stdin EOF or the
client's death; returns the exit code (0 after ``shutdown``, else 1)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..signals import install_signal_handlers
from .stdio import Wire, attach_reader, guard_stdio
from .transport import Connection
from .watchdog import watch_parent

log = logging.getLogger("operate_sidecar.server.rpc")

#: on the way out, how long the answers still buffered wait for a client that is not reading
DRAIN_S = 2.0


async def serve(*, base_settings: dict[str, Any] | None = None, version: str = "0", debug: bool = False,
                client_pid: int | None = None, fds: tuple[int, int] | None = None, recorder: Any = None) -> int:
    wire_in, wire_out = fds if fds is not None else guard_stdio()
    loop = asyncio.get_running_loop()
    wire = Wire(wire_out)
    conn = Connection(wire, base_settings=base_settings or {}, version=version, debug=debug,
                      client_pid=client_pid)
    if recorder is not None:  # --record: sees every frame body and model turn (server.script.recorder)
        recorder.attach(conn, wire)
    reader = await attach_reader(wire_in, conn.feed, conn.on_eof)
    # a client that stops reading: no more requests are taken until it reads again (Wire)
    wire.on_pause, wire.on_resume = reader.pause, reader.resume
    # pygls, lsprotocol, protocol/ and the core load on a background thread once initialize
    # is answered: nothing competes with the initialize path for the GIL.
    conn.on_initialized.append(lambda c: c.start_app_loader(loop))
    watchdog: list[asyncio.Task] = []

    def start_watchdog(c: Connection) -> None:
        if c.client_pid is not None and not watchdog:
            watchdog.append(loop.create_task(watch_parent(c.client_pid, lambda: c.stop(1))))

    install_signal_handlers(loop, lambda: conn.stop(0 if conn.shutdown_requested else 1))
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
