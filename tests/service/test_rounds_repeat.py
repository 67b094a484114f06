"""``run_rounds``'s loop guard (``repeat_limit``), in process on a real branch, the real core
``operate``, the real scripted model and real tools: the rounds stop once the same calls
failed the same way that many rounds in a row, and only then."""

from __future__ import annotations

import importlib

import anyio
import pytest

from operate_sidecar.server.core import Branch, Tool
from operate_sidecar.server.core.prepare import prepare_operate_kw
from operate_sidecar.server.models.scripted import ScriptedModel
from operate_sidecar.server.service.rounds import run_rounds

core_operate = importlib.import_module("operate_sidecar.server.core.operate").operate  # (the module, not the function)


def _branch(*script: dict) -> tuple[Branch, list[str]]:
    ran: list[str] = []

    async def lookup(key: str) -> dict:
        """Look a key up.

        Args:
            key: what to look up.
        """
        ran.append(key)
        if key == "busy":  # fails another way each time: something changed
            raise RuntimeError(f"busy, attempt {ran.count(key)}")
        if key.startswith("missing"):
            raise KeyError(f"no key {key}")
        return {"value": key.upper()}

    branch = Branch(chat_model=ScriptedModel("s", list(script)))
    branch.tools.register(Tool.from_function(lookup, name="lookup"))
    return branch, ran


def _calls(*keys: str) -> dict:
    return {"json": {"action_requests": [{"function": "lookup", "arguments": {"key": k}} for k in keys]}}


async def _run(branch: Branch, max_rounds: int, repeat_limit: int):
    def prepare(k: int) -> dict:
        return prepare_operate_kw(branch, instruction="go" if k == 1 else "again", actions=True)

    with anyio.fail_after(30):
        return await run_rounds(branch, max_rounds, prepare, core_operate, repeat_limit=repeat_limit)


@pytest.mark.parametrize("script, rounds, repeated", [
    # the same failed call three rounds running: stopped after the third
    ([_calls("missing")] * 8, 3, True),
    # two failed calls, in another order in each round (concurrent calls have no order): the same
    ([_calls("missing1", "missing2"), _calls("missing2", "missing1")] * 4, 3, True),
    # the same call failing once more after a change: counted again from one
    ([_calls("missing"), _calls("missing"), _calls("missing2"), _calls("missing"), _calls("missing"),
      _calls("missing"), _calls("missing")], 6, True),
    # each round's failure is another call: every round runs
    ([_calls(f"missing{i}") for i in range(7)], 7, False),
    # the same call failing with another error each round: every round runs
    ([_calls("busy")] * 7, 7, False),
    # the same calls, one of which succeeds: not a loop of failures
    ([_calls("missing", "ok")] * 7, 7, False),
    # the same successful call: every round runs (the round bound ends it)
    ([_calls("ok")] * 7, 7, False),
])
def test_the_rounds_stop_after_repeat_limit_rounds_of_the_same_failed_calls(script, rounds, repeated):
    async def main():
        branch, ran = _branch(*script)
        out = await _run(branch, 7, 3)
        assert (out.count, out.repeated) == (rounds, repeated)
        assert len(ran) == sum(len(s["json"]["action_requests"]) for s in script[:rounds])  # each round's calls ran

    anyio.run(main)


def test_without_repeat_limit_every_round_runs():
    async def main():
        branch, _ = _branch(*[_calls("missing")] * 6)
        out = await _run(branch, 6, 0)
        assert (out.count, out.repeated) == (6, False)

    anyio.run(main)
