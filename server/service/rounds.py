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

A caller may also pass ``repeat_limit`` L (not on the native wire, whose rule is the one above;
the ACP front end passes :data:`REPEAT_LIMIT`): the rounds then also stop once L rounds in a row
each ran the same calls (the same tools with the same arguments), every one of which failed
the same way. A model that repeats a failed call with nothing changed is in a loop: the next
round would show it the same results again (a small local model was seen to call
``list_dir("list_dir")`` eight rounds running). A failure is an output with an ``error``.
Transport-free: no wire, no provider; cancellation between or inside rounds is the core's
(every recorded call keeps its response), so the branch stays consistent.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, NamedTuple

__all__ = ["CONTINUATION", "REPEAT_LIMIT", "Rounds", "run_rounds"]

#: The instruction of every round after the first (fixed; documented on the wire too).
CONTINUATION = ("Continue the same task. The results of the tools you called are above. If the task needs "
                "more tool calls, make them now; if it is done, give your final answer and call no tool.")


#: how many rounds in a row of the same failed calls end the rounds, for a caller that asks
REPEAT_LIMIT = 3


class Rounds(NamedTuple):
    """What :func:`run_rounds` ran: the last round's result, how many rounds ran, and whether
    they stopped because the same calls failed the same way ``repeat_limit`` rounds in a row."""

    result: Any
    count: int
    repeated: bool = False


async def run_rounds(branch: Any, max_rounds: int, prepare: Callable[[int], dict[str, Any]],
                     operate: Callable[..., Awaitable[Any]], *, repeat_limit: int = 0) -> Rounds:
    """Run ``operate(branch, **prepare(k))`` for rounds k = 1, 2, ... as described above."""
    if max_rounds <= 1:
        return Rounds(await operate(branch, **prepare(1)), 1)
    ran = [0]

    def count(event: Any) -> None:
        if getattr(event.type, "value", event.type) == "pre" and event.branch_id == str(branch.id):
            ran[0] += 1

    unsubscribe = branch.hooks.subscribe(count)
    try:
        k, last, same = 0, None, 0
        while True:
            k += 1
            before, start, generation = ran[0], len(branch.messages), branch.messages.generation
            result = await operate(branch, **prepare(k))
            if k >= max_rounds or ran[0] == before:
                return Rounds(result, k)
            if repeat_limit > 0:
                if branch.messages.generation != generation:  # round 1 cleared the branch first
                    start = 0
                failed = _failed_calls(branch.messages[start:])
                same = 0 if failed is None else same + 1 if failed == last else 1
                last = failed
                if same >= repeat_limit:
                    return Rounds(result, k, True)
    finally:
        unsubscribe()


def _failed_calls(messages: Any) -> tuple[str, ...] | None:
    """The calls a round made, each as the JSON text of its tool, arguments and output, sorted
    (the order of concurrent calls is not the model's), when every one of them failed; None
    when the round made none or one of them did not fail."""
    out = []
    for m in messages:
        if m.kind != "action_response":
            continue
        c = m.content
        output = c.get("output")
        if not (isinstance(output, dict) and "error" in output):
            return None
        try:
            out.append(json.dumps([c.get("function"), c.get("arguments"), output], sort_keys=True, default=repr))
        except (TypeError, ValueError, RecursionError):  # an output JSON cannot hold: never the same
            return None
    return tuple(sorted(out)) or None
