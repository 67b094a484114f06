"""``operate-sidecar --acp`` sent a signal while it starts, before its loop runs (the SDK's and
the core's imports take a good part of a second): the signal is recorded from the first lines
of ``main`` and taken once the connection is set up, as if it came then, after the lines the
client had sent by then (docs/PROTOCOL.md §13): exit code 0, each request read answered (its
result, or -32800 saying the agent was asked to stop), none dropped, no traceback. The
process used to be killed by the signal (-15), or to print a KeyboardInterrupt traceback,
with the client's ``initialize`` never answered.

The moment is made certain: ``--config`` names a FIFO, which the agent reads while it starts
(before the SDK, the loop and the signal handlers), so the test sends the signal and its
lines while it is there, then lets it go on by writing the configuration."""

from __future__ import annotations

import json
import signal

import pytest

from acp_support import AGENT, TIMEOUT, agent_env
from process_support import signalled_while_starting

SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def _signalled_while_starting(tmp_path, sig: signal.Signals, lines: list[dict],
                              before: bool) -> tuple[list[dict], int, str]:
    """Start the agent and, while it reads its config, send it ``sig`` and then ``lines``
    (``before``: the lines first), its stdin left open; then let it start. Returns the
    messages it wrote, its exit code and its stderr."""
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    out, code, err = signalled_while_starting(AGENT, tmp_path, sig, data, before, env=agent_env(), cwd=str(tmp_path),
                                              timeout=TIMEOUT, who="the agent")
    return [json.loads(line) for line in out.splitlines()], code, err


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_the_agent_starts_with_nothing_sent_ends_it_with_exit_0(tmp_path, sig):
    msgs, code, err = _signalled_while_starting(tmp_path, sig, [], before=False)
    assert code == 0, err
    assert msgs == []
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.parametrize("before", [True, False], ids=["lines-then-signal", "signal-then-lines"])
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_the_agent_starts_answers_the_requests_sent_then_exits_0(tmp_path, sig, before):
    lines = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
             {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": str(tmp_path), "mcpServers": []}}]
    msgs, code, err = _signalled_while_starting(tmp_path, sig, lines, before)
    assert code == 0, err
    answers = {m["id"]: m for m in msgs if "id" in m and "method" not in m}
    assert sorted(answers) == [1, 2], msgs  # none dropped
    for msg_id, method in ((1, "initialize"), (2, "session/new")):
        answer = answers[msg_id]
        if "error" in answer:  # in flight as the signal was taken
            assert answer["error"]["code"] == -32800, answer
            assert f"the agent was asked to stop ({sig.name})" in answer["error"]["message"], answer
            assert answer["error"]["data"] == {"method": method}, answer
        elif msg_id == 1:
            assert answer["result"]["protocolVersion"] == 1, answer
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
