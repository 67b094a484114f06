"""The service owns the threads its sync Python tools run on: a pool of at most
``service.TOOL_THREADS`` threads, created with the service, passed into the core for its
operates, and shut down by ``aclose`` (queued calls answered without running, later calls
refused, no new thread). A tool that outlives its time-out answers its caller at once and
holds one worker; the others keep serving. Every wait here is bounded."""

import asyncio
import threading
import time

from operate_sidecar.server.core.tools import Tool
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service import service as service_mod
from operate_sidecar.server.service.service import Service

WAIT = 30  # seconds: the bound of every wait


class Port:
    """A ClientPort with no client behind it."""

    def __init__(self, settings: dict) -> None:
        self.conn = self
        self.settings = settings
        self.client_capabilities: dict = {}
        self.workspace_folders: list = []
        self.logged: list[str] = []

    def log_message(self, type_: int, message: str) -> None:
        self.logged.append(message)

    def notify(self, method: str, params: object) -> None:
        pass

    async def request_client(self, method: str, params: object, timeout: float | None) -> object:
        raise RuntimeError("no client")


def calls(*functions: str) -> dict:
    """A scripted model turn asking for these tool calls, run together (the default strategy);
    each call gets its own ``i`` (identical requests are made once)."""
    return {"json": {"action_requests": [{"function": f, "arguments": {"i": i}} for i, f in enumerate(functions)]}}


def outputs(out: dict) -> list:
    return [r["output"] for r in out["result"]["action_responses"]]


def tool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tool-worker")}


async def make_service(*tools, responses: list, tool_timeout_ms: int = 120_000) -> tuple[Service, str]:
    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": responses}},
                                               "defaultModel": "s", "toolTimeoutMs": tool_timeout_ms}))
    svc = Service(Port(settings))
    svc._core()
    for fn in tools:
        svc.registry.register(Tool.from_function(fn, read_only=True))
    bid = (await svc.createBranch({}))["branchId"]
    return svc, bid


async def operate(svc: Service, bid: str) -> dict:
    return await asyncio.wait_for(svc.operate({"branchId": bid, "instruction": "call", "actions": True}), WAIT)


class Gate:
    """Sync tools that block on one event and count how many run at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.started = 0
        self.finished = 0

    def slow(self, i: int = 0) -> str:
        with self.lock:
            self.running += 1
            self.started += 1
            self.peak = max(self.peak, self.running)
        try:
            self.release.wait(WAIT)
            return "done"
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1

    async def wait_for(self, predicate, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)


def test_the_bound_holds_n_plus_k_slow_sync_tools_never_run_more_than_n_at_once(monkeypatch):
    n, k = 3, 4
    monkeypatch.setattr(service_mod, "TOOL_THREADS", n)
    gate = Gate()

    async def main() -> None:
        svc, bid = await make_service(gate.slow, responses=[calls(*["slow"] * (n + k))])
        try:
            task = asyncio.ensure_future(operate(svc, bid))
            await gate.wait_for(lambda: gate.started >= n, f"{n} tools to start")
            await asyncio.sleep(0.3)  # room for an (n+1)th to start if the pool let it
            assert gate.running == n and gate.started == n, (gate.running, gate.started)
            gate.release.set()
            out = await task
            assert outputs(out) == ["done"] * (n + k)
            assert gate.peak == n and gate.finished == n + k
        finally:
            gate.release.set()
            await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())


def test_closing_the_service_shuts_its_pool_queued_calls_are_answered_and_no_thread_starts(monkeypatch):
    monkeypatch.setattr(service_mod, "TOOL_THREADS", 1)
    gate = Gate()
    queued_ran = threading.Event()

    def queued(i: int = 0) -> str:
        queued_ran.set()
        return "ran"

    def later(i: int = 0) -> str:
        return "ran"

    async def main() -> None:
        svc, bid = await make_service(gate.slow, queued, later,
                                      responses=[calls("slow", "queued"), calls("later")])
        try:
            task = asyncio.ensure_future(operate(svc, bid))
            await gate.wait_for(lambda: gate.started == 1, "the slow tool to hold the one worker")
            await asyncio.sleep(0.1)  # the second call is queued behind it by now
            before = tool_threads()
            await asyncio.wait_for(svc.aclose(), WAIT)  # the slow tool is still running
            gate.release.set()
            out = await task
            slow_out, queued_out = outputs(out)
            assert slow_out == "done"  # a running tool finishes; its caller was still waiting
            assert "not run: the tool threads are shut down" in queued_out["error"], queued_out
            assert not queued_ran.is_set()
            # after close: a sync tool call is refused at once and no worker thread starts
            (later_out,) = outputs(await operate(svc, bid))
            assert "not run: the tool threads are shut down" in later_out["error"], later_out
            assert tool_threads() <= before, tool_threads() - before
            assert not queued_ran.is_set()
        finally:
            gate.release.set()

    asyncio.run(main())


def test_a_hung_tool_past_its_timeout_answers_at_once_and_later_calls_run_while_workers_remain(monkeypatch):
    monkeypatch.setattr(service_mod, "TOOL_THREADS", 2)
    gate = Gate()

    def quick(i: int = 0) -> str:
        return "quick"

    async def main() -> None:
        svc, bid = await make_service(gate.slow, quick, tool_timeout_ms=200,
                                      responses=[calls("slow"), calls("quick"), calls("quick")])
        try:
            t0 = time.monotonic()
            (hung,) = outputs(await operate(svc, bid))
            assert "timed out after 0.2 s" in hung["error"], hung
            assert time.monotonic() - t0 < 5  # answered at its time-out, not when the thread ends
            assert gate.running == 1  # the tool still runs: its thread holds one of the two workers
            for _ in range(2):  # later calls run on the other worker, each at once
                t1 = time.monotonic()
                assert outputs(await operate(svc, bid)) == ["quick"]
                assert time.monotonic() - t1 < 5
            assert gate.running == 1 and gate.finished == 0
        finally:
            gate.release.set()
            await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())


def test_with_every_worker_held_a_sync_call_fails_on_its_own_timeout_and_never_runs(monkeypatch):
    """The bound's trade-off: a tool past its time-out holds its worker; with all held, the next
    sync call waits in the queue, its own time-out running from the call, and it is answered
    with the usual time-out error (not a hang). Given up, it never runs later."""
    monkeypatch.setattr(service_mod, "TOOL_THREADS", 1)
    gate = Gate()
    ran = threading.Event()

    def quick(i: int = 0) -> str:
        ran.set()
        return "quick"

    async def main() -> None:
        svc, bid = await make_service(gate.slow, quick, tool_timeout_ms=200,
                                      responses=[calls("slow"), calls("quick")])
        try:
            (hung,) = outputs(await operate(svc, bid))
            assert "timed out" in hung["error"] and gate.running == 1
            t0 = time.monotonic()
            (waited,) = outputs(await operate(svc, bid))
            assert "timed out after 0.2 s" in waited["error"], waited
            assert time.monotonic() - t0 < 5
            gate.release.set()
            await gate.wait_for(lambda: gate.finished == 1, "the hung tool to end")
            await asyncio.sleep(0.2)  # a worker is free: a call still queued would run now
            assert not ran.is_set()
        finally:
            gate.release.set()
            await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())
