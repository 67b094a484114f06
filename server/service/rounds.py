"""Rounds: ``operate`` with ``maxRounds`` N > 1 is a short agent loop over the core's
``operate`` (each round is one whole core operate, with its own validation, governance and
fail-before-effect; nothing here changes what one operate does).

Round 1 is the caller's operate. After a round in which at least one tool ran (its ``pre``
hook event fired: governance let it through, whether it then succeeded or failed, a call
whose arguments the tool's schema refused or whose tool is unknown included, so that the
next round can correct it; a denied call did not run), another round runs on the same
branch with the same parameters, except that

- the instruction is :data:`CONTINUATION` (the tool results of the round before reach the
  model with it, as the pipeline renders them),
- the caller's ``context`` is not repeated (it is already in the branch's history), and
- ``clearMessages`` applies to round 1 only (a later round must see the earlier ones),

until a round runs no tool or N rounds are done. The result is the last round's.
Transport-free: no wire, no provider; cancellation between or inside rounds is the core's
(every recorded call keeps its response), so the branch stays consistent.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

__all__ = ["CONTINUATION", "run_rounds"]

#: The instruction of every round after the first (fixed; documented on the wire too).
CONTINUATION = ("Continue the same task. The results of the tools you called are above. If the task needs "
                "more tool calls, make them now; if it is done, give your final answer and call no tool.")


async def run_rounds(branch: Any, max_rounds: int, prepare: Callable[[int], dict[str, Any]],
                     operate: Callable[..., Awaitable[Any]]) -> tuple[Any, int]:
    """Run ``operate(branch, **prepare(k))`` for rounds k = 1, 2, ... as described above;
    returns (the last round's result, the number of rounds run)."""
    if max_rounds <= 1:
        return await operate(branch, **prepare(1)), 1
    ran = [0]

    def count(event: Any) -> None:
        if getattr(event.type, "value", event.type) == "pre" and event.branch_id == str(branch.id):
            ran[0] += 1

    unsubscribe = branch.hooks.subscribe(count)
    try:
        k = 0
        while True:
            k += 1
            before = ran[0]
            result = await operate(branch, **prepare(k))
            if k >= max_rounds or ran[0] == before:
                return result, k
    finally:
        unsubscribe()
