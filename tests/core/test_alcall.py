"""alcall / AlcallParams: the callable behind D1's parse defaults and D4's concurrent strategy."""

from __future__ import annotations

import anyio
import pytest

from operate_sidecar.server.core import AlcallParams, alcall

pytestmark = pytest.mark.anyio


async def test_results_come_back_in_input_order():
    """D4: concurrent results are returned in input order, whatever the completion order."""
    done: list[int] = []

    async def f(i: int) -> int:
        for _ in range(5 - i):  # earlier inputs yield more often, so later ones finish first
            await anyio.sleep(0)
        done.append(i)
        return i * 10

    assert await alcall([0, 1, 2, 3], f) == [0, 10, 20, 30]
    assert done != [0, 1, 2, 3]


async def test_retry_attempts_retries_then_succeeds():
    """D1: retry_attempts=N allows N retries after the first failure."""
    tries = []

    async def f(x):
        tries.append(x)
        if len(tries) < 3:
            raise RuntimeError("flaky")
        return "ok"

    assert await alcall([1], f, retry_attempts=2) == ["ok"]
    assert len(tries) == 3


async def test_retries_exhausted_raise_the_last_error_unwrapped():
    """alcall: after the retries the original exception is raised (not an exception group)."""
    tries = []

    async def f(x):
        tries.append(x)
        raise KeyError("always")

    with pytest.raises(KeyError):
        await alcall([1], f, retry_attempts=1)
    assert len(tries) == 2


async def test_first_failure_among_many_is_raised_unwrapped_and_cancels_the_rest():
    """alcall: with several inputs the first failure cancels the others and is raised unwrapped."""
    cancelled = []

    async def f(x):
        if x == "bad":
            raise ValueError("bad input")
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(x)
            raise

    with anyio.fail_after(10):
        with pytest.raises(ValueError, match="bad input"):
            await alcall(["a", "bad", "b"], f)
    assert sorted(cancelled) == ["a", "b"]


async def test_output_dropna_drops_none():
    """D4: output_dropna=True (the default action params) drops None results."""
    async def f(x):
        return None if x % 2 else x

    assert await alcall([0, 1, 2, 3], f, output_dropna=True) == [0, 2]
    assert await alcall([0, 1, 2, 3], f) == [0, None, 2, None]


async def test_max_concurrent_bounds_tasks_in_flight():
    """D1/D4: max_concurrent bounds how many calls run at once (max_concurrent=1 serializes parsing)."""
    in_flight = [0]
    peak = [0]

    async def f(x):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        for _ in range(3):
            await anyio.sleep(0)
        in_flight[0] -= 1
        return x

    await alcall(list(range(6)), f, max_concurrent=2)
    assert peak[0] == 2
    peak[0] = 0
    await alcall(list(range(6)), f, max_concurrent=1)
    assert peak[0] == 1


async def test_retry_timeout_bounds_each_attempt():
    """alcall: retry_timeout makes an attempt that never finishes fail with TimeoutError."""
    async def hang(x):
        await anyio.sleep_forever()

    with anyio.fail_after(10):
        with pytest.raises(TimeoutError):
            await alcall([1], hang, retry_timeout=0.01)


async def test_non_list_input_is_a_single_item():
    """alcall: a non-sequence input is treated as one item."""
    async def f(x):
        return x

    assert await alcall("abc", f) == ["abc"]


async def test_alcall_params_is_the_callable_with_its_settings():
    """D1/D4: an AlcallParams object is callable and applies its own settings."""
    async def f(x):
        return None if x == 1 else x

    assert await AlcallParams(output_dropna=True)([0, 1, 2], f) == [0, 2]
    assert AlcallParams().to_dict() == {"retry_attempts": 0, "retry_initial_delay": 0, "retry_backoff": 1,
                                        "retry_timeout": None, "max_concurrent": None, "throttle_period": None,
                                        "delay_before_start": 0, "output_dropna": False}


async def test_cancellation_is_not_retried():
    """alcall: cancellation propagates and is never treated as a retryable failure."""
    tries = []
    started = anyio.Event()

    async def f(x):
        tries.append(x)
        started.set()
        await anyio.sleep_forever()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: alcall([1], f, retry_attempts=5))
            await started.wait()
            tg.cancel_scope.cancel()
    assert tries == [1]


async def test_retries_with_no_delay_still_let_other_tasks_run_and_can_be_cancelled():
    """A func that fails at once, retried with no delay, yields between attempts: other tasks
    run meanwhile and a cancel reaches it (it looped without a checkpoint and froze the event
    loop: ping unanswered, the cancel never honoured)."""
    attempts, ticks = [0], [0]

    async def fails(_: int) -> None:
        attempts[0] += 1
        raise ValueError("no")

    async def ticker() -> None:
        while True:
            ticks[0] += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        with anyio.move_on_after(5) as scope:
            with pytest.raises(ValueError):
                await alcall([0], fails, retry_attempts=2000, retry_initial_delay=0)
        assert not scope.cancelled_caught and attempts[0] == 2001 and ticks[0] >= 1000
        with anyio.move_on_after(0.05) as scope:  # cancelled mid-retries, long before the end
            await alcall([0], fails, retry_attempts=10**9, retry_initial_delay=0)
        assert scope.cancelled_caught
        tg.cancel_scope.cancel()
