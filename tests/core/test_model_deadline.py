"""Per-model time-outs (``timeoutS``): a model call that outlives its model's
time-out fails as a ModelError naming the model, for chat, CLI runs and
parse repair alike, and nothing is recorded for the failed chat turn."""

from __future__ import annotations

import anyio
import pytest
from pydantic import BaseModel

from operate_sidecar.server.core import AlcallParams, Branch, ModelError
from operate_sidecar.server.models.scripted import ScriptedModel

pytestmark = pytest.mark.anyio


class Answer(BaseModel):
    answer: str


async def test_chat_call_past_timeout_is_a_model_error():
    model = ScriptedModel("slow", [{"text": "late", "delayMs": 5000}], timeout_s=0.05)
    branch = Branch(chat_model=model)
    with anyio.fail_after(5):
        with pytest.raises(ModelError, match="'slow' timed out after 0.05 s"):
            await branch.operate(instruction="q")
    assert len(branch.messages) == 0


async def test_cli_run_past_timeout_is_a_model_error():
    model = ScriptedModel("slowcli", [{"text": "late", "delayMs": 5000}], cli=True, timeout_s=0.05)
    branch = Branch(chat_model=model)
    with anyio.fail_after(5):
        with pytest.raises(ModelError, match="timed out"):
            await branch.operate(instruction="q")
    assert len(branch.messages) == 0  # a failed call records nothing, a CLI run's too


async def test_repair_turn_past_timeout_degrades_to_unparsed():
    chat = ScriptedModel("chat", ["not json"])
    parser = ScriptedModel("parser", [{"json": {"answer": "x"}, "delayMs": 5000}], timeout_s=0.05)
    branch = Branch(chat_model=chat)
    with anyio.fail_after(5):
        out = await branch.operate(instruction="q", response_format=Answer, parse_model=parser,
                                   parse_call_params=AlcallParams(retry_attempts=0))
    assert out == "not json" and not isinstance(out, Answer)


async def test_call_within_timeout_succeeds():
    model = ScriptedModel("ok", [{"text": "fine", "delayMs": 1}], timeout_s=5)
    assert await Branch(chat_model=model).operate(instruction="q") == "fine"
