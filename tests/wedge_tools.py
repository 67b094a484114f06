"""A tool module that wedges the server's event loop on demand, for the tests of how a replay
and the stdlib client end a server that no longer answers (tests/script/test_replay_ending.py,
tests/clients/test_client.py): such a server answers neither ``shutdown`` nor the end of its
input nor SIGTERM/SIGHUP (its handlers run on the loop). Every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from process_support import alive

HERE = os.path.dirname(os.path.abspath(__file__))
WEDGE_S = 30  # how long the loop stays blocked (then the server goes on, and ends on its input's end)


async def wedge(trigger: str) -> str:
    """Arm the wedge: once the file ``trigger`` exists, the server's event loop blocks for
    ``WEDGE_S`` seconds, after writing this process's id to ``trigger + ".blocked"``."""
    loop = asyncio.get_running_loop()

    def block() -> None:
        with open(trigger + ".blocked", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(WEDGE_S)

    def watch() -> None:
        deadline = time.monotonic() + WEDGE_S
        while time.monotonic() < deadline:
            if os.path.exists(trigger):
                loop.call_soon_threadsafe(block)
                return
            time.sleep(0.02)

    threading.Thread(target=watch, name="wedge-watch", daemon=True).start()
    return "armed"


def settings(trigger: str) -> dict:
    """``initialize`` settings whose model's one turn calls ``wedge(trigger)``."""
    call = {"json": {"action_requests": [{"function": "wedge", "arguments": {"trigger": trigger}}]}}
    return {"models": {"m": {"provider": "scripted", "responses": [call]}},
            "toolModules": ["wedge_tools"], "toolPolicy": {"wedge": "allow"}}


def server_env() -> dict[str, str]:
    """This environment, with this module importable by the server."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    return env


def pull(trigger: str, timeout: float = 20.0) -> int:
    """Block the armed server's loop; returns the server's pid once its loop is blocked."""
    with open(trigger, "w") as f:
        f.write("go")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(trigger + ".blocked") as f:
                text = f.read()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"the server's loop did not block within {timeout} s")


def gone(pid: int, timeout: float = 5.0) -> bool:
    """Wait (at most ``timeout`` s) for the process to be gone."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
