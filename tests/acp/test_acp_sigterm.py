"""``operate-sidecar --acp`` stopped by a signal (SIGTERM, SIGINT, SIGHUP: editors commonly
SIGTERM their agent): the connection ends as at the end of the input, over real pipes. Each
request in flight is answered -32800 saying the agent was asked to stop, none dropped, a
shown tool call with no final status ends ``failed`` before that answer, and the process
exits 0; a request the client sends after the signal is answered -32800 too (an invalid one
-32600, as ever). A second signal stops the agent without waiting for its close. The signal
used to cancel the connection at once: the prompt was never answered."""

from __future__ import annotations

import json
import os
import signal

import pytest

from acp_support import (TIMEOUT, Logged, agent_env, open_session, prompt, reply, req, scripted, turn_order,
                         write_config)

#: a tool that ignores every cancellation (it waits its time out whatever comes): the agent's
#: stop is then still under way, bounded, for a while after the signal (the requests in flight
#: are given ``EXIT_GRACE_S``, the agent's close its own few seconds)
STUBBORN = '''
import asyncio


async def stubborn(seconds: float) -> str:
    """Wait ``seconds``, whatever cancels it."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            pass
    return "done"
'''


def _start(tmp_path, ws, *responses, env: dict[str, str] | None = None, **settings) -> tuple[Logged, str]:
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(*responses)}, **settings})
    a = Logged(config, tmp_path, env, "--log-level", "info")
    return a, open_session(a, ws)


def _stubborn_env(tmp_path) -> dict[str, str]:
    (tmp_path / "stubborn_tools.py").write_text(STUBBORN)
    env = agent_env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    return env


def _stopping(tmp_path, ws, seconds: int) -> Logged:
    """An agent whose turn (prompt 10) runs a tool that ignores cancellation for ``seconds``, sent
    SIGTERM while it runs, once its stop has begun (logged)."""
    a, sid = _start(tmp_path, ws, reply("", [("stubborn", {"seconds": seconds})]), reply("done"),
                    env=_stubborn_env(tmp_path), toolModules=["stubborn_tools"], toolPolicy={"stubborn": "allow"})
    try:
        a.send(prompt(10, sid))
        a.until(lambda: any(u.get("status") == "in_progress" for u in a.updates()), "the tool running")
        a.proc.send_signal(signal.SIGTERM)
        a.logged("stopping (SIGTERM)")
    except BaseException:
        a.close()
        raise
    return a


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.parametrize("case", ["asked", "running"])
def test_a_signal_mid_turn_answers_the_prompt_minus_32800_after_its_calls_end_failed(tmp_path, ws, sig, case):
    """A signal while a call of the turn is asked about (``write_file``, ask mode) or runs (a
    ten-minute tool): the call shown ends ``failed``, then the prompt is answered -32800 with a
    message saying the agent was asked to stop, and the process exits 0. It exited 0 with the
    prompt never answered."""
    call = ("write_file", {"path": "a.txt", "content": "x\n"}) if case == "asked" else ("slow", {"seconds": 600})
    a, sid = _start(tmp_path, ws, reply("", [call]), reply("done"), toolModules=["acp_fixture_tools"])
    try:
        a.send(prompt(10, sid))
        if case == "asked":
            a.request_seen("session/request_permission")
        else:
            a.until(lambda: any(u.get("status") == "in_progress" for u in a.updates()), "the tool running")
        a.proc.send_signal(sig)
        assert a.proc.wait(TIMEOUT) == 0
        a.until(lambda: a.ended, "the end of the agent's output")
        first = "pending" if case == "asked" else "in_progress"
        assert turn_order(a, 10) == [("tool_call", first), ("tool_call_update", "failed"), ("answer", -32800)], a.seen
        error = a.answer(10)["error"]
        assert error["message"] == f"session/prompt cancelled: the agent was asked to stop ({sig.name}) " \
                                   "before its answer", error
        assert error["data"] == {"method": "session/prompt"}
    finally:
        a.close()
    assert "Traceback" not in a.stderr(), a.stderr()


def test_a_signal_while_requests_wait_for_the_model_answers_each_of_them(tmp_path, ws):
    """Two sessions' prompts waiting on a ten-minute model, then SIGTERM: both are answered
    -32800, none dropped, and the process exits 0 without waiting for the model."""
    a, sid = _start(tmp_path, ws, reply("too late", delayMs=600_000), reply("too late", delayMs=600_000))
    try:
        a.send(req(3, "session/new", cwd=str(ws), mcpServers=[]))
        other = a.answer(3)["result"]["sessionId"]
        a.send(prompt(10, sid), prompt(11, other))  # (in flight at the signal, or read after it: -32800 either way)
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(TIMEOUT) == 0
        a.until(lambda: a.ended, "the end of the agent's output")
        for msg_id in (10, 11):
            error = a.answer(msg_id, timeout=0)["error"]
            assert error["code"] == -32800 and "asked to stop (SIGTERM)" in error["message"], error
    finally:
        a.close()


def test_a_request_sent_after_the_signal_is_answered_minus_32800_not_served_or_dropped(tmp_path, ws):
    """The client writes on after SIGTERM, while the agent's stop is still under way (a tool
    that does not stop at once holds it up, bounded): its request is answered -32800 at once,
    as the requests in flight are, and the process still exits 0."""
    a = _stopping(tmp_path, ws, 30)
    try:
        a.send(req(11, "session/new", cwd=str(ws), mcpServers=[]))
        late = a.answer(11)
        assert late.get("error", {}).get("code") == -32800, late
        assert late["error"]["message"] == "session/new cancelled: the agent was asked to stop (SIGTERM) " \
                                           "before its answer"
        assert late["error"]["data"] == {"method": "session/new"}  # as a request in flight is answered
        assert a.answer(10)["error"]["code"] == -32800
        assert a.proc.wait(TIMEOUT) == 0
    finally:
        a.close()


def test_a_message_sent_after_the_signal_is_screened_as_ever_before_the_minus_32800(tmp_path, ws):
    """After SIGTERM, while the stop is under way: a request whose method is not a string is
    answered -32600 with its id (it is no request), one whose id is NaN -32600 with id null
    (NaN is no JSON: echoed, a strict client would refuse the whole line), and a message with
    ``"method": null`` and a result is an answer (the SDK's test), not a request: it is not
    answered. They were all answered -32800, the NaN echoed as it came."""
    a = _stopping(tmp_path, ws, 30)
    try:
        a.send({"jsonrpc": "2.0", "id": 12, "method": 7, "params": {}},
               {"jsonrpc": "2.0", "id": float("nan"), "method": "session/new", "params": {}},
               {"jsonrpc": "2.0", "id": 13, "method": None, "result": {}},
               req(14, "session/list"))
        assert a.answer(14)["error"]["code"] == -32800  # (after the three before it)
        assert a.answer(12)["error"]["code"] == -32600, a.seen
        a.until(lambda: any(m.get("id", 0) is None and "error" in m for m in a.seen), "the NaN's answer")
        assert a.proc.wait(TIMEOUT) == 0
        a.until(lambda: a.ended, "the end of the agent's output")
    finally:
        a.close()
    nulls = [m["error"]["code"] for m in a.seen if "id" in m and m["id"] is None]
    assert nulls == [-32600], a.seen
    assert 13 not in [m.get("id") for m in a.seen], a.seen
    for m in a.seen:  # every line the agent wrote is JSON (a NaN read back would not write out)
        json.dumps(m, allow_nan=False)


def test_a_request_whose_id_is_nan_is_answered_minus_32600_with_id_null(tmp_path, ws):
    """A request whose id is NaN (or an infinity: Python's JSON reader takes them, JSON has no
    such numbers) is no JSON-RPC request: answered -32600 with id null, in a line of JSON. It
    was served, its answer echoing ``"id": NaN``, which a strict client refuses whole."""
    a, sid = _start(tmp_path, ws, reply("done"))
    try:
        a.send({"jsonrpc": "2.0", "id": float("nan"), "method": "session/list", "params": {}},
               {"jsonrpc": "2.0", "id": float("-inf"), "method": "session/list", "params": {}},
               req(3, "session/list"))
        a.answer(3)
        a.until(lambda: len([m for m in a.seen if "id" in m and m["id"] is None]) >= 2, "two answers, id null")
    finally:
        a.close()
    nulls = [m for m in a.seen if "id" in m and m["id"] is None]
    assert [m["error"]["code"] for m in nulls] == [-32600, -32600], a.seen
    assert all("its id is nan" in m["error"]["message"] or "its id is -inf" in m["error"]["message"]
               for m in nulls), nulls
    for m in a.seen:
        json.dumps(m, allow_nan=False)


def test_a_second_signal_while_the_first_is_served_stops_the_agent_at_once(tmp_path, ws):
    """A second signal during the first's stop (held up by a tool that ignores every
    cancellation: the first alone takes ``EXIT_GRACE_S`` for the requests in flight, then the
    agent's close its few seconds): the agent's close is not waited for (logged), and the
    process exits 0, with no traceback. It waited for all of the first's. (This used to bound
    the exit by the clock, ``EXIT_GRACE_S`` + 1 s: the times are bench/'s.)"""
    a = _stopping(tmp_path, ws, 60)
    try:
        a.logged("stopping (SIGTERM): answering")
        a.proc.send_signal(signal.SIGINT)
        assert a.proc.wait(TIMEOUT) == 0
        a.logged("stopping (SIGINT)")
        a.logged("exiting without waiting for the agent to close")
    finally:
        a.close()
    assert "Traceback" not in a.stderr(), a.stderr()
