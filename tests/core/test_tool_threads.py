"""Sync Python tools run on a bounded pool that whoever runs operates passes into the core
(``tools.tool_executor``; the service passes its own, see tests/service/test_service_tool_threads.py),
else on the core's default pool of ``TOOL_THREADS`` threads. A caller is always answered: a
job the pool dropped on shutdown is ``ToolThreadsClosed``, never a wait. Every wait is bounded."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import anyio
import pytest

from operate_sidecar.server.core import tools as T
from operate_sidecar.server.core.tools import Tool, ToolCallContext, ToolThreadsClosed, tool_executor

from tool_gate import Gate

pytestmark = pytest.mark.anyio

WAIT = 10  # seconds


def ctx(call_id: str = "c") -> ToolCallContext:
    return ToolCallContext(branch_id="b", call_id=call_id)


async def test_sync_tools_run_on_the_executor_passed_in():
    def where() -> str:
        return threading.current_thread().name

    pool = ThreadPoolExecutor(1, thread_name_prefix="passed-in")
    token = tool_executor.set(pool)
    try:
        with anyio.fail_after(WAIT):
            assert (await Tool.from_function(where).call({}, ctx())).startswith("passed-in")
    finally:
        tool_executor.reset(token)
        pool.shutdown(wait=False)
    with anyio.fail_after(WAIT):  # unset: the default pool
        assert (await Tool.from_function(where).call({}, ctx())).startswith("tool-worker")


async def test_the_default_pool_is_bounded(monkeypatch):
    """N+k concurrent slow sync tools on the default pool: never more than N at once."""
    n, k = 2, 3
    monkeypatch.setattr(T, "TOOL_THREADS", n)
    monkeypatch.setattr(T, "_DEFAULT_POOL", None)  # a fresh default pool of n threads for this test
    gate = Gate()
    slow = Tool.from_function(gate.slow)
    results: list[str] = []

    async def one(i: int) -> None:
        results.append(await slow.call({"i": i}, ctx(str(i))))

    try:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for i in range(n + k):
                    tg.start_soon(one, i)
                await gate.until(lambda: gate.started >= n, f"{n} tools to start")
                await anyio.sleep(0.3)  # room for an (n+1)th to start if the pool let it
                assert (gate.running, gate.started) == (n, n)
                gate.release.set()
        assert sorted(results) == sorted(f"done {i}" for i in range(n + k)) and gate.peak == n
    finally:
        gate.release.set()
        if T._DEFAULT_POOL is not None:
            T._DEFAULT_POOL.shutdown(wait=False)


async def test_shutdown_answers_a_queued_call_and_refuses_later_ones_a_running_tool_finishes():
    gate = Gate()
    ran = threading.Event()

    def queued() -> str:
        ran.set()
        return "ran"

    slow, queued_tool = Tool.from_function(gate.slow), Tool.from_function(queued)
    pool = ThreadPoolExecutor(1, thread_name_prefix="closing")
    token = tool_executor.set(pool)
    outcomes: dict[str, object] = {}

    async def call(name: str, tool: Tool) -> None:
        try:
            outcomes[name] = await tool.call({}, ctx(name))
        except Exception as e:  # noqa: BLE001 - what the caller was answered
            outcomes[name] = e

    try:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "slow", slow)
                await gate.until(lambda: gate.started == 1, "the slow tool to hold the one worker")
                tg.start_soon(call, "queued", queued_tool)
                await anyio.sleep(0.1)
                pool.shutdown(wait=False, cancel_futures=True)
                await gate.until(lambda: "queued" in outcomes, "the queued call to be answered")
                assert isinstance(outcomes["queued"], ToolThreadsClosed), outcomes
                assert "slow" not in outcomes  # still running, its caller still waiting
                with pytest.raises(ToolThreadsClosed, match="queued not run"):
                    await queued_tool.call({}, ctx("later"))
                gate.release.set()
        assert outcomes["slow"] == "done 0" and not ran.is_set()
    finally:
        gate.release.set()
        tool_executor.reset(token)
        pool.shutdown(wait=False)


async def test_a_cancelled_call_is_answered_at_once_and_a_queued_one_never_runs():
    """Cancel (a time-out is one) answers the caller at once though the thread runs on; a call
    that gave up while queued is dropped: it does not run when a worker frees up."""
    gate = Gate()
    ran = threading.Event()

    def queued() -> str:
        ran.set()
        return "ran"

    pool = ThreadPoolExecutor(1, thread_name_prefix="abandon")
    token = tool_executor.set(pool)
    try:
        slow = Tool.from_function(gate.slow)
        with anyio.fail_after(WAIT):
            with anyio.move_on_after(0.2) as hung:
                await slow.call({}, ctx("slow"))
            assert hung.cancelled_caught and gate.running == 1
            with anyio.move_on_after(0.2) as waited:
                await Tool.from_function(queued).call({}, ctx("queued"))
            assert waited.cancelled_caught
            gate.release.set()
            await gate.until(lambda: gate.running == 0, "the slow tool to end")
            assert await anyio.to_thread.run_sync(pool.submit(lambda: "free").result, WAIT) == "free"
        assert not ran.is_set()
    finally:
        gate.release.set()
        tool_executor.reset(token)
        pool.shutdown(wait=False)
