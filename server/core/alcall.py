"""``alcall``: apply an async function to many inputs with retries, back-off,
bounded concurrency, throttling and dropping of ``None`` results (anyio)."""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable, Sequence

import anyio


async def _with_retries(func: Callable[[Any], Awaitable[Any]], item: Any, *, retry_attempts: int,
                        retry_initial_delay: float, retry_backoff: float,
                        retry_timeout: float | None) -> Any:
    delay = retry_initial_delay
    attempt = 0
    while True:
        try:
            if retry_timeout:
                with anyio.fail_after(retry_timeout):
                    return await func(item)
            return await func(item)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception:
            if attempt >= retry_attempts:
                raise
        attempt += 1
        # always a checkpoint: with no delay, a func that fails at once must still let the
        # event loop serve others (and a cancel reach this task) between attempts
        await anyio.sleep(delay if delay > 0 else 0)
        delay = delay * retry_backoff if delay else 0


async def alcall(
    inputs: Sequence[Any] | Any,
    func: Callable[[Any], Awaitable[Any]],
    *,
    retry_attempts: int = 0,
    retry_initial_delay: float = 0,
    retry_backoff: float = 1,
    retry_timeout: float | None = None,
    max_concurrent: int | None = None,
    throttle_period: float | None = None,
    delay_before_start: float = 0,
    output_dropna: bool = False,
) -> list[Any]:
    """Results come back in input order. The first failure (after retries)
    cancels the rest and is raised unwrapped."""
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if delay_before_start:
        await anyio.sleep(delay_before_start)
    results: list[Any] = [None] * len(items)
    kw = dict(retry_attempts=retry_attempts, retry_initial_delay=retry_initial_delay,
              retry_backoff=retry_backoff, retry_timeout=retry_timeout)

    if len(items) == 1:
        results[0] = await _with_retries(func, items[0], **kw)
    else:
        limiter = anyio.CapacityLimiter(max_concurrent) if max_concurrent else None
        next_start = [0.0]

        async def run(i: int, item: Any) -> None:
            if throttle_period:
                now = anyio.current_time()
                start = max(now, next_start[0])
                next_start[0] = start + throttle_period
                if start > now:
                    await anyio.sleep(start - now)
            if limiter is not None:
                async with limiter:
                    results[i] = await _with_retries(func, item, **kw)
            else:
                results[i] = await _with_retries(func, item, **kw)

        try:
            async with anyio.create_task_group() as tg:
                for i, item in enumerate(items):
                    tg.start_soon(run, i, item)
        except BaseExceptionGroup as eg:  # noqa: F821 - py3.11 builtin
            raise _first(eg) from None

    if output_dropna:
        return [r for r in results if r is not None and not (isinstance(r, float) and math.isnan(r))]
    return results


def _first(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup):  # noqa: F821
        eg = eg.exceptions[0]
    return eg
