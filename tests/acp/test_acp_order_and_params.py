"""What a plain newline-delimited JSON client may send that the SDK's own client never does:
requests on one session in one write, without waiting for each answer (they take effect in the
order they were read), a request without ``params``, a second ``initialize``, an answer whose
id is of another type than the request's; over real pipes to the real agent."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from acp_support import (MCP_SERVER, ROOT, TIMEOUT, Logged, Raw, agent_env, cancel, open_session, prompt, reply, req,
                         run, scripted, until, write_config)


def _stored_session(tmp_path: Path, ws: Path) -> tuple[Path, str]:
    """A state directory holding one session with one turn, made by an agent that has exited."""
    state = tmp_path / "state"
    a = Raw(write_config(tmp_path / "first.toml", {"models": {"s": scripted(reply("first answer"))}}),
            None, "--state-dir", str(state))
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "first"))
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
    finally:
        a.close()
    return state, sid


def _restarted(tmp_path: Path, state: Path, text: str, env: dict[str, str] | None = None, **settings) -> Raw:
    """An agent on the state directory ``state`` (its model answering ``text``), initialized
    (request 1)."""
    b = Raw(write_config(tmp_path / "second.toml", {"models": {"s": scripted(reply(text))}, **settings}),
            env, "--state-dir", str(state))
    try:
        b.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        b.answer(1)
    except BaseException:
        b.close()
        raise
    return b


def _ran(a: Raw, msg_id: int, text: str) -> None:
    """Prompt ``msg_id`` was answered ``end_turn``, its reply ``text`` the last one shown."""
    answer = a.answer(msg_id)
    assert answer.get("result", {}).get("stopReason") == "end_turn", answer
    assert a.text().endswith(text), a.text()


def _take_up(method: str, msg_id: int, sid: str, ws: Path) -> dict:
    return req(msg_id, method, sessionId=sid, cwd=str(ws), mcpServers=[])


def _answered(a: Raw) -> list:
    """The ids of the answers the agent wrote, in the order it wrote them."""
    with a._cond:
        return [m["id"] for m in a.seen if "id" in m and "method" not in m]


@pytest.mark.parametrize("method", ["session/load", "session/resume"])
def test_a_prompt_sent_with_the_load_that_takes_a_stored_session_up_runs_on_it(tmp_path, ws, method):
    """A restarted agent got the load (or resume) and the prompt in one write: the prompt was
    checked while the load was still under way, and refused -32602 "not loaded here: session/load
    or session/resume it first", although the load was read first and succeeded."""
    state, sid = _stored_session(tmp_path, ws)
    b = _restarted(tmp_path, state, "second answer")
    try:
        b.send(_take_up(method, 2, sid, ws), prompt(3, sid, "second"))
        assert "result" in b.answer(2), b.answer(2)
        _ran(b, 3, "second answer")
    finally:
        b.close()


def test_a_prompt_and_a_cancel_sent_with_the_load_the_prompt_is_answered_cancelled(tmp_path, ws):
    """The cancel was read after the prompt, which waited for the load: it cancels that prompt,
    which never reaches the model; the next prompt runs."""
    state, sid = _stored_session(tmp_path, ws)
    b = _restarted(tmp_path, state, "second answer")
    try:
        b.send(_take_up("session/load", 2, sid, ws), prompt(3, sid, "cancelled one"), cancel(sid))
        assert "result" in b.answer(2)
        assert b.answer(3).get("result", {}).get("stopReason") == "cancelled", b.answer(3)
        b.send(prompt(4, sid, "next"))
        _ran(b, 4, "second answer")
    finally:
        b.close()


def test_a_load_sent_with_the_close_takes_the_session_up_after_the_close_has_freed_it(tmp_path, ws):
    """The close waits for the turn it cancelled; the load read after it was done first, then the
    close freed the session, and the next prompt was refused -32602 though the load came last."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(
        reply("", [("write_file", {"path": "n.txt", "content": "x"})]), reply("after the load"))}})
    a = Raw(config, None, "--state-dir", str(tmp_path / "state"))
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "write"))
        a.request_seen("session/request_permission")              # (never answered: the turn runs on)
        a.send(req(4, "session/close", sessionId=sid), _take_up("session/load", 5, sid, ws))
        assert a.answer(3)["result"]["stopReason"] == "cancelled"
        assert a.answer(4)["result"] == {} and "result" in a.answer(5), (a.answer(4), a.answer(5))
        assert _answered(a)[-3:] == [3, 4, 5]                      # the load took effect after the close
        a.send(prompt(6, sid, "after the load"))
        _ran(a, 6, "after the load")
    finally:
        a.close()


def test_a_prompt_read_after_the_close_is_refused_and_one_after_a_load_read_after_that_runs(tmp_path, ws):
    """close, prompt, load, prompt in one write: each in its turn."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("r0"), reply("r1"))}})
    a = Raw(config, None, "--state-dir", str(tmp_path / "state"))
    try:
        sid = open_session(a, ws)
        a.send(req(3, "session/close", sessionId=sid), prompt(4, sid, "refused"),
               _take_up("session/resume", 5, sid, ws), prompt(6, sid, "runs"))
        assert a.answer(3)["result"] == {}
        assert a.answer(4)["error"]["code"] == -32602 and "is not loaded here" in a.answer(4)["error"]["message"]
        assert "result" in a.answer(5)
        assert a.answer(6)["result"]["stopReason"] == "end_turn" and a.text() == "r0"
    finally:
        a.close()


def test_a_request_on_the_source_read_after_a_fork_is_answered_while_the_new_session_is_set_up(tmp_path, ws):
    """The fork held the source session's place among its requests until the new session was
    set up: its tools built (here a ``toolModules`` module whose import waits for a gate, as a
    first warm-up can take long) and primed, so a mode change on the source sent with it waited
    as long. Now only the fork itself does (docs/PROTOCOL.md §13): the mode change is answered
    while the new session's tools are still being built, and the fork's answer follows."""
    state, sid = _stored_session(tmp_path, ws)
    gate = tmp_path / "gate"
    started = Path(str(gate) + ".started")
    env = agent_env(GATED_IMPORT_GATE=str(gate))
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests" / "tools" / "fixtures")
    b = _restarted(tmp_path, state, "x", env, toolModules=["gated_import_tools"])
    try:
        b.send(req(2, "session/fork", sessionId=sid, cwd=str(ws), mcpServers=[]),
               req(3, "session/set_mode", sessionId=sid, modeId="read-only"))
        assert b.answer(3).get("result") == {}, b.answer(3)
        run(until(started.exists, "the tool module's import"))     # the new session's tools: being built
        assert 2 not in _answered(b)                                # (it waits for the gate)
        gate.touch()
        forked = b.answer(2)["result"]["sessionId"]
        assert forked != sid and _answered(b)[-2:] == [3, 2]
    finally:
        gate.touch()
        b.close()


@pytest.mark.parametrize("params", ["absent", None])
def test_session_list_without_params_lists_the_sessions(tmp_path, ws, params):
    """ACP lets ``params`` be left out or null, and ``session/list`` has no required field: it
    was answered -32602. A method with a required field still is."""
    a = Raw(write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}}),
            None, "--state-dir", str(tmp_path / "state"))
    try:
        sid = open_session(a, ws)
        for msg_id, method in ((3, "session/list"), (4, "session/prompt"), (5, "session/new")):
            msg = {"jsonrpc": "2.0", "id": msg_id, "method": method}
            if params is None:
                msg["params"] = None
            a.send(msg)
        listed = a.answer(3)
        assert [s["sessionId"] for s in listed.get("result", {}).get("sessions", [])] == [sid], listed
        for msg_id, method in ((4, "session/prompt"), (5, "session/new")):
            error = a.answer(msg_id)["error"]
            assert error["code"] == -32602 and f"invalid params for {method}" in error["message"], error
    finally:
        a.close()


def test_an_initialize_without_fs_after_one_with_it_reads_the_disk_not_the_client(tmp_path, ws):
    """The first initialize said the client serves files, a second said nothing of it: the file
    tools went on reading through ``fs/read_text_file`` (the tools of a session made before the
    second initialize included)."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(
        reply("", [("read_file", {"path": "a.txt"})]), reply("read 1"),
        reply("", [("read_file", {"path": "a.txt"})]), reply("read 2"),
        reply("", [("read_file", {"path": "a.txt"})]), reply("read 3"))}})
    a = Raw(config)
    try:
        sid = open_session(a, ws, fs=True)
        a.send(prompt(3, sid, "read it"))
        read = a.request_seen("fs/read_text_file")
        a.send({"jsonrpc": "2.0", "id": read["id"], "result": {"content": "the client's buffer\n"}})
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        a.send(req(4, "initialize", protocolVersion=1, clientCapabilities={"fs": {"readTextFile": True}}))
        a.answer(4)                                                # (no write: not served through the client)
        a.send(prompt(5, sid, "read it again"))
        assert a.answer(5)["result"]["stopReason"] == "end_turn"
        a.send(req(6, "initialize", protocolVersion=1, clientCapabilities={}))
        a.answer(6)
        a.send(req(7, "session/new", cwd=str(ws), mcpServers=[]))
        other = a.answer(7)["result"]["sessionId"]
        a.send(prompt(8, other, "read it in a new session"))
        assert a.answer(8)["result"]["stopReason"] == "end_turn"
        with a._cond:
            reads = [m for m in a.seen if m.get("method") == "fs/read_text_file"]
            outputs = [json.dumps(u.get("rawOutput")) for u in a.updates()
                       if u.get("sessionUpdate") == "tool_call_update" and u.get("status") == "completed"]
        assert len(reads) == 1, reads
        assert len(outputs) == 3 and "the client's buffer" in outputs[0], outputs
        assert all("old text" in o for o in outputs[1:]), outputs
    finally:
        a.close()


def test_an_answer_whose_id_is_a_string_for_a_number_is_said_on_stderr_and_not_taken(tmp_path, ws):
    """The editor answered the permission request id 0 with ``"id": "0"``: nothing was said, even
    with --debug, and the turn waited the whole ``permissionTimeoutMs``. It is still not that
    request's answer (ids are typed): here the answer with the right id rejects the write."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(
        reply("", [("write_file", {"path": "n.txt", "content": "x"})]), reply("done"))}})
    a = Logged(config, tmp_path)
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "write"))
        asked = a.request_seen("session/request_permission")
        assert asked["id"] == 0
        options = {o["kind"]: o["optionId"] for o in asked["params"]["options"]}

        def answer(msg_id: object, kind: str) -> dict:
            return {"jsonrpc": "2.0", "id": msg_id,
                    "result": {"outcome": {"outcome": "selected", "optionId": options[kind]}}}

        a.send(answer("0", "allow_once"), answer(99, "allow_once"), answer(0, "reject_once"))
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        assert not (ws / "n.txt").exists()                         # the string id's "allow" was not taken
    finally:
        a.close()
    lines = a.stderr().splitlines()
    assert [line for line in lines if "WARNING" in line and 'answer id "0" (a string) matches no request; '
            "request 0 (a number) is waiting" in line], lines
    assert [line for line in lines if "WARNING" in line and "answer id 99 (a number) matches no request the agent "
            "sent" in line], lines


def test_two_mcp_servers_of_one_name_in_one_session_new_are_warned_about_as_this_sessions(tmp_path, ws):
    """The second one's warning said it "differs ... from the one another session started",
    though this session passed both."""
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(reply("x"))}})

    def fx(tag: str) -> dict:
        return {"name": "fx", "command": sys.executable, "args": [MCP_SERVER, tag],
                "env": [{"name": "MCP_FIXTURE_TAG", "value": tag}]}

    a = Logged(config, tmp_path)
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        a.answer(1)
        a.send(req(2, "session/new", cwd=str(ws), mcpServers=[fx("one"), fx("two")]))
        assert "result" in a.answer(2, timeout=TIMEOUT)
    finally:
        a.close()
    warned = [line for line in a.stderr().splitlines() if "MCP server 'fx'" in line and "started as 'fx-2'" in line]
    assert len(warned) == 1, warned
    assert "from another one this session passed under that name" in warned[0], warned
    assert "another session" not in warned[0], warned
