"""A `session/cancel` that arrives while the turn's messages are being saved is too late to stop
it (docs/PROTOCOL.md §13, §7): the turn is saved whole, and `session/load` replays it; the
prompt is still answered `cancelled`, as ACP says a cancelled prompt must be. When that save
fails nothing is kept, and the answer is `cancelled` too. One that came before the save began is
answered `cancelled`, even when the turn's rounds then ended as they would have (a tool that
swallowed its cancellation). Real agent processes over real pipes; a
fixture tool module (``save_gate_tools``) holds the turn's save at its start until the cancel
has reached the agent, so the cancel lands during the save every time (without a cancel the
save fails: the test cannot pass by accident)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from acp_support import TIMEOUT, Raw, agent_env, cancel, open_session, prompt, reply, req, scripted, write_config

GATE = "save_gate_tools"


def _config(tmp_path, *responses) -> str:
    return write_config(tmp_path / "settings.toml", {"models": {"s": scripted(*responses)},
                                                     "stateDir": str(tmp_path / "state"), "toolModules": [GATE],
                                                     "toolPolicy": {"swallow_cancel": "allow"}})


def _cancelled_while_saved(tmp_path, ws, config: str, **env: str) -> tuple[str, dict]:
    """An agent on ``config`` (``env``: more for the gate) sent a prompt (``the question``), and
    ``session/cancel`` once the turn's save has begun (held by the gate until the cancel comes):
    the session's id and the prompt's answer."""
    marker = tmp_path / "saving"
    a = Raw(config, agent_env(SAVE_GATE_MARKER=str(marker), **env))
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "the question"))
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():  # the turn's save has begun, and waits for the cancel
            assert time.monotonic() < deadline, "the turn's save did not begin"
            time.sleep(0.01)
        a.send(cancel(sid))
        return sid, a.answer(3)
    finally:
        a.close()


@contextlib.contextmanager
def _loaded_again(config: str, sid: str, ws) -> Iterator[Raw]:
    """A restart on the same state directory: a new agent, initialized, that loaded ``sid``."""
    b = Raw(config)
    try:
        b.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        b.answer(1)
        b.send(req(2, "session/load", sessionId=sid, cwd=str(ws), mcpServers=[]))
        assert "result" in b.answer(2)
        yield b
    finally:
        b.close()


def test_a_cancel_while_the_turn_is_saved_answers_cancelled_and_the_turn_is_kept(tmp_path, ws):
    """Too late to stop the turn, which is saved whole; the answer is ``cancelled`` all the same
    (ACP: a prompt a ``session/cancel`` came for MUST be answered so)."""
    config = _config(tmp_path, reply("the answer"))
    sid, answer = _cancelled_while_saved(tmp_path, ws, config)
    assert answer.get("result", {}).get("stopReason") == "cancelled", str(answer)[:300]

    with _loaded_again(config, sid, ws) as b:  # the turn was kept, and is replayed
        shown = [u["content"]["text"] for u in b.updates() if u["sessionUpdate"] == "user_message_chunk"]
        assert shown == ["the question"]
        assert b.text() == "the answer"


def test_a_cancel_while_the_turn_is_saved_then_a_failed_save_answers_cancelled_and_keeps_nothing(tmp_path, ws):
    """The save the cancel came during fails: nothing of the turn is kept (the branch is as it
    was before it), and the answer is ``cancelled``, which tells the client just that."""
    config = _config(tmp_path, reply("the answer"))
    sid, answer = _cancelled_while_saved(tmp_path, ws, config, SAVE_GATE_FAIL="1")
    assert answer.get("result", {}).get("stopReason") == "cancelled", str(answer)[:300]

    with _loaded_again(config, sid, ws) as b:
        assert [u for u in b.updates() if u["sessionUpdate"] == "user_message_chunk"] == []
        assert b.text() == ""


def test_a_turn_cancelled_before_its_save_is_answered_cancelled_though_its_rounds_ended(tmp_path, ws):
    """The cancel reached a tool that swallowed it: the rounds went on and ended as they would
    have, and the turn was saved; the cancel still came before the save, so the answer is
    ``cancelled``, as the client that sent it expects."""
    config = _config(tmp_path, reply("", [("swallow_cancel", {"seconds": 60})]), reply("done anyway"))
    a = Raw(config)
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "go"))
        a.until(lambda: any(m.get("method") == "session/update"
                            and m["params"]["update"].get("sessionUpdate") in ("tool_call", "tool_call_update")
                            and m["params"]["update"].get("status") == "in_progress" for m in a.seen),
                "the tool runs")
        a.send(cancel(sid))
        answer = a.answer(3)
        assert answer.get("result", {}).get("stopReason") == "cancelled", str(answer)[:300]
    finally:
        a.close()
