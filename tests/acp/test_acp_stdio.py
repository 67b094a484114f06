"""``operate-sidecar --acp`` on a stdin or stdout that is not a pipe: a regular file or
/dev/null. The event loop cannot watch those (epoll refuses them, asyncio's pipe transports
refuse a regular file): stdin is read to its end like a pipe, stdout is written at once, and
stdout still carries ACP lines only."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from acp_support import TIMEOUT, agent_env, prompt, reply, scripted, start, turn_order, write_config

AGENT = [sys.executable, "-m", "operate_sidecar.server", "--acp"]


def _init(msg_id: int) -> dict:
    return {"jsonrpc": "2.0", "id": msg_id, "method": "initialize", "params": {"protocolVersion": 1}}


def _lines(*msgs: dict) -> bytes:
    return b"".join(json.dumps(m).encode() + b"\n" for m in msgs)


def _config(tmp_path, *responses, **settings) -> str:
    return write_config(tmp_path / "settings.toml", {"models": {"s": scripted(*responses)}, **settings})


def test_stdin_of_dev_null_is_the_end_of_input_not_a_traceback_and_a_hang(tmp_path):
    # (epoll refused /dev/null: a traceback from the loop, then the agent waited forever)
    out = subprocess.run(AGENT + ["--config", _config(tmp_path, "x")], stdin=subprocess.DEVNULL,
                         capture_output=True, env=agent_env(), timeout=TIMEOUT)
    assert out.returncode == 0 and out.stdout == b""
    assert b"Traceback" not in out.stderr and b"PermissionError" not in out.stderr, out.stderr.decode()


def test_a_session_in_a_regular_file_is_served_to_its_end_and_written_to_a_regular_file(tmp_path):
    # (stdin: "Pipe transport is for pipes/sockets only"; stdout: "Pipe transport is only for
    # pipes, sockets and character devices"; each a traceback and exit 1)
    script = tmp_path / "session.ndjson"
    script.write_bytes(_lines(_init(1), {"jsonrpc": "2.0", "id": 2, "method": "no/such"}, _init(3)) + b"[1]\n")
    answers = tmp_path / "answers.ndjson"
    with open(script, "rb") as stdin, open(answers, "wb") as stdout:
        out = subprocess.run(AGENT + ["--config", _config(tmp_path, "x")], stdin=stdin, stdout=stdout,
                             stderr=subprocess.PIPE, env=agent_env(), timeout=TIMEOUT)
    err = out.stderr.decode()
    assert out.returncode == 0 and "Traceback" not in err, err
    got = {a["id"]: a for a in map(json.loads, answers.read_bytes().splitlines())}
    assert got[1]["result"]["protocolVersion"] == 1 and got[3]["result"]["protocolVersion"] == 1
    assert got[2]["error"]["code"] == -32601 and got[None]["error"]["code"] == -32600
    assert len(got) == 4


def test_stdout_of_dev_null_serves_the_session_without_a_traceback(tmp_path):
    script = tmp_path / "session.ndjson"
    script.write_bytes(_lines(_init(1)))
    with open(script, "rb") as stdin:
        out = subprocess.run(AGENT + ["--config", _config(tmp_path, "x")], stdin=stdin, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=agent_env(), timeout=TIMEOUT)
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr.decode()


def _wait_for_answer(path, msg_id: int, proc: subprocess.Popen) -> dict:
    """The answer of ``msg_id`` once the agent has written it to the file ``path`` (a file
    cannot be waited on: it is looked at until the answer is there, within TIMEOUT)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for line in path.read_bytes().splitlines():
            msg = json.loads(line)  # every line is a whole ACP message: the agent writes whole lines
            if msg.get("id") == msg_id and "method" not in msg:
                return msg
        assert proc.poll() is None, f"the agent exited ({proc.returncode}) before answering {msg_id}"
        time.sleep(0.05)
    raise AssertionError(f"no answer to {msg_id} in {TIMEOUT} s")


@contextlib.contextmanager
def _agent_writing_to(answers, config: str):
    """The agent on a stdin pipe, its stdout the file ``answers``; killed if the test left it
    running, its stderr pipe closed."""
    with open(answers, "wb") as stdout:
        proc = subprocess.Popen(AGENT + ["--config", config], stdin=subprocess.PIPE, stdout=stdout,
                                stderr=subprocess.PIPE, env=agent_env())
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_a_whole_turn_written_to_a_regular_file_stdout_keeps_it_to_acp_lines_only(tmp_path, ws):
    """A client that logs the agent's output to a file: a prompt turn with a tool that prints to
    fd 1 and runs a child that does. The guard still sends those to stderr; the file holds the
    turn's updates and answers, each a whole JSON-RPC line."""
    config = _config(tmp_path, reply("", [("noisy", {"text": "quiet"})]), reply("still here"),
                     toolModules=["acp_fixture_tools"])
    answers = tmp_path / "answers.ndjson"
    with _agent_writing_to(answers, config) as proc:
        def send(msg: dict) -> None:
            proc.stdin.write(_lines(msg))
            proc.stdin.flush()

        send(_init(0))
        assert _wait_for_answer(answers, 0, proc)["result"]["protocolVersion"] == 1
        send({"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": str(ws), "mcpServers": []}})
        sid = _wait_for_answer(answers, 1, proc)["result"]["sessionId"]
        send({"jsonrpc": "2.0", "id": 2, "method": "session/prompt",
              "params": {"sessionId": sid, "prompt": [{"type": "text", "text": "go"}]}})
        assert _wait_for_answer(answers, 2, proc)["result"]["stopReason"] == "end_turn"
        proc.stdin.close()
        assert proc.wait(TIMEOUT) == 0
        err = proc.stderr.read().decode()
    msgs = [json.loads(line) for line in answers.read_bytes().splitlines()]
    assert all(m.get("jsonrpc") == "2.0" for m in msgs)
    updates = [m["params"]["update"] for m in msgs if m.get("method") == "session/update"]
    assert [u["rawOutput"] for u in updates if u["sessionUpdate"] == "tool_call_update" and "rawOutput" in u] \
        == ["quiet"]
    assert "".join(u["content"]["text"] for u in updates if u["sessionUpdate"] == "agent_message_chunk") \
        == "still here"
    assert "not a protocol frame" in err and '"method": "bogus"' in err and "Traceback" not in err


def test_requests_still_running_when_the_input_ends_are_answered_not_dropped(tmp_path, ws):
    """The input ends while a prompt turn waits for its model (and, read from a file, while a
    ``session/new`` waits for the core): the SDK would cancel them unanswered as it closes; each
    is answered -32800 (as the native front end answers what it never finished), and the
    process still exits promptly."""
    config = _config(tmp_path, reply("too late", delayMs=60_000))
    answers = tmp_path / "answers.ndjson"
    with _agent_writing_to(answers, config) as proc:
        proc.stdin.write(_lines(_init(0), {"jsonrpc": "2.0", "id": 1, "method": "session/new",
                                           "params": {"cwd": str(ws), "mcpServers": []}}))
        proc.stdin.flush()
        sid = _wait_for_answer(answers, 1, proc)["result"]["sessionId"]
        proc.stdin.write(_lines({"jsonrpc": "2.0", "id": 2, "method": "session/prompt",
                                 "params": {"sessionId": sid, "prompt": [{"type": "text", "text": "go"}]}}))
        proc.stdin.close()  # at once: the prompt is still waiting for its model
        started = time.monotonic()
        assert proc.wait(TIMEOUT) == 0
        assert time.monotonic() - started < 10  # (the model would take 60 s)
        err = proc.stderr.read().decode()
    got = {m.get("id"): m for m in map(json.loads, answers.read_bytes().splitlines())}
    assert got[2]["error"]["code"] == -32800, got
    assert "session/prompt cancelled: the client's input ended" in got[2]["error"]["message"]
    assert "Traceback" not in err, err

    script = tmp_path / "session.ndjson"
    script.write_bytes(_lines(_init(0), {"jsonrpc": "2.0", "id": 1, "method": "session/new",
                                         "params": {"cwd": str(ws), "mcpServers": []}}))
    with open(script, "rb") as stdin:
        out = subprocess.run(AGENT + ["--config", config], stdin=stdin, capture_output=True, env=agent_env(),
                             timeout=TIMEOUT)
    got = {m.get("id"): m for m in map(json.loads, out.stdout.splitlines())}
    assert out.returncode == 0 and sorted(got) == [0, 1], out.stdout  # each request answered
    assert "result" in got[1] or got[1]["error"]["code"] == -32800, got[1]


def test_a_closed_stdin_is_an_empty_input_and_a_closed_stdout_no_traceback(tmp_path):
    config = _config(tmp_path, "x")
    closed_in = subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh", *AGENT, "--config", config], capture_output=True,
                               env=agent_env(), timeout=TIMEOUT)
    assert closed_in.returncode == 0 and closed_in.stdout == b""
    assert b"Traceback" not in closed_in.stderr, closed_in.stderr.decode()
    closed_out = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *AGENT, "--config", config],
                                input=_lines(_init(1)), stderr=subprocess.PIPE, env=agent_env(), timeout=TIMEOUT)
    assert closed_out.returncode == 0 and b"Traceback" not in closed_out.stderr, closed_out.stderr.decode()
    assert b"stdout is closed" in closed_out.stderr


def test_only_lone_surrogate_escapes_are_replaced_on_the_way_out():
    """``unicode_only`` on what ``json.dumps`` writes: a pair stays whole, an escaped backslash
    before ``udce9`` is text, a lone half of either kind becomes U+FFFD."""
    from operate_sidecar.server.acp.run import unicode_only

    cases = {"caf\udce9": "caf\ufffd", "\U0001F600": "\U0001F600", "a\\udce9": "a\\udce9",
             "x\\\udce9": "x\\\ufffd", "\ud800 \udfff\ud83d": "\ufffd \ufffd\ufffd",
             "\ud83d\ude00\udc00": "\U0001F600\ufffd", "plain \\ text": "plain \\ text"}
    for text, shown in cases.items():
        out = unicode_only(json.dumps({"t": text}).encode() + b"\n")
        assert json.loads(out)["t"] == shown and out.decode("ascii").endswith("}\n"), (text, out)


@pytest.mark.parametrize("case", ["asked", "running"])
def test_the_input_ending_mid_turn_ends_its_shown_calls_before_the_turns_answer(tmp_path, ws, case):
    """The input ends while a call of the turn is asked about (``write_file``, ask mode) or runs
    (a minute-long tool): the call shown to the editor ends ``failed``, and before the prompt's
    -32800 answer (every update of a turn before its answer, as session/cancel has it). The asked
    call got no final status at all; the running one's ``failed`` came after the answer."""
    call = ("write_file", {"path": "a.txt", "content": "x\n"}) if case == "asked" else ("slow", {"seconds": 60})
    a, sid = start(tmp_path, ws, reply("", [call]), reply("done"), toolModules=["acp_fixture_tools"])
    try:
        a.send(prompt(10, sid))
        if case == "asked":
            a.request_seen("session/request_permission")
        else:
            a.until(lambda: any(u.get("status") == "in_progress" for u in a.updates()), "the tool running")
        a.proc.stdin.close()
        assert a.proc.wait(TIMEOUT) == 0
        a.until(lambda: a.ended, "the end of the agent's output")
        order = turn_order(a, 10)
        first = "pending" if case == "asked" else "in_progress"
        assert order == [("tool_call", first), ("tool_call_update", "failed"), ("answer", -32800)], order
    finally:
        a.close()


def test_a_tool_s_forked_child_that_sigterms_itself_does_not_stop_the_agent(tmp_path, ws):
    """A child forked by a tool keeps no tie to the agent's signal handling: the SIGTERM it
    sends itself is its own (server/signals.py), so the turn ends and the agent serves on."""
    env = agent_env()  # (the native front end's forking tools: tests/rpc/fixtures)
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).parents[1] / "rpc" / "fixtures")
    a, sid = start(tmp_path, ws, reply("", [("fork_self_term", {})]), reply("done"), reply("again"),
                   toolModules=["forking_tools"], toolPolicy={"fork_self_term": "allow"}, env=env)
    try:
        a.send(prompt(3, sid))
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        outputs = [u.get("rawOutput") for u in a.updates()
                   if u["sessionUpdate"] == "tool_call_update" and u.get("status") == "completed"]
        assert len(outputs) == 1 and isinstance(outputs[0], list)
        a.send(prompt(4, sid))
        assert a.answer(4)["result"]["stopReason"] == "end_turn"
        assert a.proc.poll() is None
    finally:
        a.close()
    assert a.proc.returncode == 0


@pytest.mark.parametrize("stdin_is", ["pipe", "file"])
def test_a_last_line_without_its_newline_is_served_not_dropped(tmp_path, stdin_is):
    """Newline-delimited JSON lets the input's last line end without a newline (a scripted
    client's ``printf '%s' …``): it is taken as a line, so a request there is answered, a line
    that is not JSON is answered -32700 and one over ``maxMessageBytes`` -32600 with its id, as
    anywhere else (it was dropped without a word)."""
    config = _config(tmp_path, "x", maxMessageBytes=10_000)
    again = json.dumps(_init(2)).encode()  # (answered at once: a request that waits for the core is answered -32800)
    big = json.dumps({"jsonrpc": "2.0", "id": 3, "method": "session/list", "params": {"x": "a" * 20_000}}).encode()
    for last, expect in ((again, {0: "result", 2: "result"}), (b'{"jsonrpc": "2.0", "id": 4, "meth',
                                                                 {0: "result", None: -32700}),
                         (big, {0: "result", 3: -32600})):
        data = _lines(_init(0)) + last
        if stdin_is == "file":
            script = tmp_path / "session.ndjson"
            script.write_bytes(data)
            with open(script, "rb") as stdin:
                out = subprocess.run(AGENT + ["--config", config], stdin=stdin, capture_output=True,
                                     env=agent_env(), timeout=TIMEOUT)
        else:
            out = subprocess.run(AGENT + ["--config", config], input=data, capture_output=True, env=agent_env(),
                                 timeout=TIMEOUT)
        got = {m.get("id"): ("result" if "result" in m else m["error"]["code"])
               for m in map(json.loads, out.stdout.splitlines())}
        assert out.returncode == 0 and got == expect, (last[:40], got, out.stderr.decode()[-2000:])
        assert b"Traceback" not in out.stderr
