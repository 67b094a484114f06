"""The service owns the threads its sync Python tools run on: a pool of at most
``service.TOOL_THREADS`` threads, made on first need, passed into the core for its operates,
and shut down by ``aclose`` (queued calls answered without running, later calls refused, no
new thread). A tool that outlives its time-out answers its caller at once and holds one
worker; the others keep serving, and when every worker is held a fresh pool does (a bounded
number of times). Every wait here is bounded."""

import asyncio
import threading

import pytest

from operate_sidecar.server.core.tools import Tool
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service import service as service_mod
from operate_sidecar.server.service.service import Service

from service_support import Port
from tool_gate import WAIT, Gate


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


def test_the_bound_holds_n_plus_k_slow_sync_tools_never_run_more_than_n_at_once(monkeypatch):
    n, k = 3, 4
    monkeypatch.setattr(service_mod, "TOOL_THREADS", n)
    gate = Gate()

    async def main() -> None:
        svc, bid = await make_service(gate.slow, responses=[calls(*["slow"] * (n + k))])
        try:
            task = asyncio.ensure_future(operate(svc, bid))
            await gate.until(lambda: gate.started >= n, f"{n} tools to start")
            await asyncio.sleep(0.3)  # room for an (n+1)th to start if the pool let it
            assert gate.running == n and gate.started == n, (gate.running, gate.started)
            gate.release.set()
            out = await task
            assert outputs(out) == [f"done {i}" for i in range(n + k)]
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
            await gate.until(lambda: gate.started == 1, "the slow tool to hold the one worker")
            await asyncio.sleep(0.1)  # the second call is queued behind it by now
            before = tool_threads()
            await asyncio.wait_for(svc.aclose(), WAIT)  # the slow tool is still running
            gate.release.set()
            out = await task
            slow_out, queued_out = outputs(out)
            assert slow_out == "done 0"  # a running tool finishes; its caller was still waiting
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


@pytest.mark.parametrize("workers", [2, 1])
def test_a_hung_tool_past_its_timeout_answers_at_once_and_later_calls_still_run(monkeypatch, workers):
    """A tool past its time-out is answered at its time-out and holds its worker (threads cannot
    be stopped). With a worker left (2), later calls run on it; with none (1), the held pool is
    retired and a fresh one takes them, so a tool that never returns does not starve the other
    sync tools, and the held thread ends when its tool returns."""
    monkeypatch.setattr(service_mod, "TOOL_THREADS", workers)
    gate = Gate()

    def quick(i: int = 0) -> str:
        return "quick"

    async def main() -> None:
        svc, bid = await make_service(gate.slow, quick, tool_timeout_ms=200,
                                      responses=[calls("slow"), calls("quick"), calls("quick")])
        try:
            (hung,) = outputs(await operate(svc, bid))
            assert "timed out after 0.2 s" in hung["error"], hung
            # answered at its time-out, not when the thread ends: the tool still runs, its
            # thread holding a worker
            assert gate.running == 1 and gate.finished == 0
            for _ in range(2):  # on the other worker, or on the fresh pool
                assert outputs(await operate(svc, bid)) == ["quick"]
            assert gate.running == 1 and gate.finished == 0
            if workers == 1:
                held = tool_threads()
                gate.release.set()
                await gate.until(lambda: gate.finished == 1, "the hung tool to end")
                await gate.until(lambda: len(tool_threads()) < len(held), "the retired pool's thread to end")
        finally:
            gate.release.set()
            await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())


def test_past_the_retired_pools_bound_a_sync_call_fails_on_its_own_timeout_and_never_runs(monkeypatch):
    """Fresh pools are bounded too (``core.tools.MAX_RETIRED_POOLS`` held pools at once): past
    that, the next sync call waits in the queue, its own time-out running from the call, and is
    answered with the usual time-out error (not a hang). Given up, it never runs later."""
    from operate_sidecar.server.core import tools as core_tools

    monkeypatch.setattr(service_mod, "TOOL_THREADS", 1)
    monkeypatch.setattr(core_tools, "MAX_RETIRED_POOLS", 1)
    gate = Gate()
    ran = threading.Event()

    def quick(i: int = 0) -> str:
        ran.set()
        return "quick"

    async def main() -> None:
        svc, bid = await make_service(gate.slow, quick, tool_timeout_ms=200,
                                      responses=[calls("slow"), calls("slow"), calls("quick")])
        try:
            for held in (1, 2):  # the first held pool is retired; the second is the last allowed
                (hung,) = outputs(await operate(svc, bid))
                assert "timed out" in hung["error"] and gate.running == held
            (waited,) = outputs(await operate(svc, bid))
            assert "timed out after 0.2 s" in waited["error"], waited
            assert gate.running == 2 and gate.finished == 0  # answered while both workers are held
            gate.release.set()
            await gate.until(lambda: gate.finished == 2, "the hung tools to end")
            await asyncio.sleep(0.2)  # a worker is free: a call still queued would run now
            assert not ran.is_set()
        finally:
            gate.release.set()
            await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())
