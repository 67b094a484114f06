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

Before each round after the first, ``before`` (the caller's, optional: awaited with the
round's number) runs, then ``stop`` (the caller's, optional) is asked: true ends the rounds
there, before that round's model is called or any of its tools runs, with the round before's
result. The service waits in ``before`` for the lists of MCP tools said to have changed (the
round is offered the tools as they are when it begins), and stops so when the operate's save
is already known to fail: its save then answers -32013 and puts the branch back, as round 1
would have been refused (docs/PROTOCOL.md §3, §11). ``stop`` is asked after ``before``, so a
refusal that arises while ``before`` waits still ends the rounds before any effect.

A caller may also pass ``repeat_limit`` L (the native wire's ``repeatLimit``; the ACP front end
passes :data:`REPEAT_LIMIT`): the rounds then also stop once L rounds in a row each ran the
same calls (the same tools with the same arguments), every one of which failed the same way.
A model that repeats a failed call with nothing changed is in a loop: the next round would
show it the same results again (a small local model was seen to call ``list_dir("list_dir")``
eight rounds running). The count is made after every round that ran a tool, the last one
allowed by N included: a round that reaches L says ``repeated`` whether or not N also ends the
rounds there. A call failed when its outcome hook event was not ``post`` (``error``: the tool
raised, or its arguments or name were refused; ``denied``): the core's own decision, the one
that sends the ``post`` or ``error`` toolEvent, never a guess from the output's shape (a tool
may return ``{"error": null, ...}`` and have succeeded). Transport-free: no wire, no provider;
cancellation between or inside rounds is the core's (every recorded call keeps its response),
so the branch stays consistent.
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
                     operate: Callable[..., Awaitable[Any]], *, repeat_limit: int = 0,
                     stop: Callable[[], bool] | None = None,
                     before: Callable[[int], Awaitable[None]] | None = None) -> Rounds:
    """Run ``operate(branch, **prepare(k))`` for rounds k = 1, 2, ... as described above."""
    if max_rounds <= 1 and repeat_limit <= 0:
        return Rounds(await operate(branch, **prepare(1)), 1)
    # imported here, not at the top: the ACP front end imports this module before the core is loaded
    from ..core.hooks import HookEventType

    outcomes = (HookEventType.TOOL_POST, HookEventType.TOOL_ERROR, HookEventType.TOOL_DENIED)
    bid = str(branch.id)
    ran = [0]
    failed: dict[str, bool] = {}  # this round's calls by callId: whether each failed

    def count(event: Any) -> None:
        if event.branch_id != bid:
            return
        if event.type == HookEventType.TOOL_PRE:
            ran[0] += 1
        elif event.type in outcomes:  # the call's outcome, as the core decided it
            failed[event.call_id] = event.type != HookEventType.TOOL_POST

    unsubscribe = branch.hooks.subscribe(count)
    try:
        k, last, same, result = 0, None, 0, None
        while True:
            if k and before is not None:
                await before(k + 1)
            if k and stop is not None and stop():
                return Rounds(result, k)
            k += 1
            ran_before, start, generation = ran[0], len(branch.messages), branch.messages.generation
            failed.clear()
            result = await operate(branch, **prepare(k))
            if ran[0] == ran_before:
                return Rounds(result, k)
            if repeat_limit > 0:
                if branch.messages.generation != generation:  # round 1 cleared the branch first
                    start = 0
                calls = _failed_calls(branch.messages[start:], failed)
                same = 0 if calls is None else same + 1 if calls == last else 1
                last = calls
                if same >= repeat_limit:
                    return Rounds(result, k, True)
            if k >= max_rounds:
                return Rounds(result, k)
    finally:
        unsubscribe()


def _failed_calls(messages: Any, failed: dict[str, bool]) -> tuple[str, ...] | None:
    """The calls a round made, each as the JSON text of its tool, arguments and output, sorted
    (the order of concurrent calls is not the model's), when every one of them failed
    (``failed``: each call's outcome hook event was not ``post``); None when the round made
    none or one of them did not fail."""
    out = []
    for m in messages:
        if m.kind != "action_response":
            continue
        c = m.content
        if not failed.get(c.get("callId")):
            return None
        try:
            out.append(json.dumps([c.get("function"), c.get("arguments"), c.get("output")], sort_keys=True,
                                  default=repr))
        except (TypeError, ValueError, RecursionError):  # an output JSON cannot hold: never the same
            return None
    return tuple(sorted(out)) or None
