"""ACP sessions kept by the service in the state store: two ``--acp`` servers on one state
directory both see every session (and apply each other's permission mode), a session change
that cannot be saved is refused with -32013 and not applied, and the session file of older
versions is imported once. Real server processes, real pipes, the ACP SDK's own client."""

from __future__ import annotations

import asyncio
import json
import os
import resource

import acp
import pytest

from acp_support import RecordingClient, bounded, reply, run, scripted, spawn, write_config
from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import StateStore

STATE_NOT_SAVED = -32013


def cfg(tmp_path, name, *responses):
    return write_config(tmp_path / f"{name}.toml", {"models": {"s": scripted(*responses)}})


def prompt(conn, sid, text="go"):
    return bounded(conn.prompt(session_id=sid, prompt=[acp.text_block(text)]))


def listed(sessions):
    return sorted((s.session_id, s.title, s.cwd) for s in sessions)


def current(options):
    return {o.id: o.current_value for o in options}


def test_two_servers_on_one_state_dir_each_list_both_sessions(tmp_path, ws):
    async def main():
        state = str(tmp_path / "state")
        write = reply("", [("write_file", {"path": "a.txt", "content": "from b\n"})])
        ca, cb = RecordingClient("allow_once"), RecordingClient("allow_once")
        async with spawn(ca, cfg(tmp_path, "a", reply("a says hi")), state_dir=state) as (a, _), \
                spawn(cb, cfg(tmp_path, "b", reply("b says hi"), write, reply("done")), state_dir=state) as (b, _):
            sa = (await bounded(a.new_session(cwd=str(ws)))).session_id
            sb = (await bounded(b.new_session(cwd=str(ws)))).session_id
            await asyncio.gather(prompt(a, sa, "first from a"), prompt(b, sb, "first from b"))
            want = sorted([(sa, "first from a", str(ws)), (sb, "first from b", str(ws))])
            assert listed((await bounded(a.list_sessions())).sessions) == want
            assert listed((await bounded(b.list_sessions(cwd=str(ws)))).sessions) == want
            # a mode set in one process is the session's in the other, and applied there by its service
            await bounded(a.set_config_option(config_id="mode", session_id=sa, value="read-only"))
            loaded = await bounded(b.load_session(cwd=str(ws), session_id=sa))
            assert current(loaded.config_options)["mode"] == "read-only"
            assert loaded.modes.current_mode_id == "read-only"
            await prompt(b, sa, "write it")
            assert cb.permissions == [] and (ws / "a.txt").read_text() == "old text\n"
            assert "read-only" in cb.of("tool_call_update")[-1].raw_output["reason"]
        assert not os.path.exists(os.path.join(state, "acp-sessions.json"))  # nothing outside the store

    run(main())


def test_a_session_not_loaded_in_this_process_is_refused_a_prompt_until_it_is_loaded(tmp_path, ws):
    """A session made by an earlier run, prompted without ``session/load``, had no folders in
    this process: its tools reached every session's folders (here the other session's secret,
    by a path relative to that session's cwd). It is -32602 until it is loaded; then its tools
    reach its own folder only."""
    async def main():
        state = str(tmp_path / "state")
        other = tmp_path / "other"
        other.mkdir()
        (other / "secret.txt").write_text("the other session's\n")
        async with spawn(RecordingClient(), cfg(tmp_path, "a", "x"), state_dir=state) as (a, _):
            sid = (await bounded(a.new_session(cwd=str(ws)))).session_id
        c = RecordingClient()
        config = cfg(tmp_path, "b", reply("", [("read_file", {"path": "secret.txt"})]), reply("done"))
        async with spawn(c, config, state_dir=state) as (b, _):
            await bounded(b.new_session(cwd=str(other)))
            with pytest.raises(acp.RequestError) as e:
                await prompt(b, sid)
            assert e.value.code == -32602 and "session/load" in str(e.value.data)
            assert c.of("tool_call") == []
            await bounded(b.load_session(cwd=str(ws), session_id=sid))
            assert (await prompt(b, sid)).stop_reason == "end_turn"
            done = c.of("tool_call_update")[-1]
            assert done.status == "failed" and "the other session's" not in json.dumps(done.raw_output)

    run(main())


def test_a_session_change_that_cannot_be_saved_is_refused_and_not_applied(tmp_path, ws):
    async def main():
        state = str(tmp_path / "state")
        config = cfg(tmp_path, "s", reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("ok"))
        c = RecordingClient("allow_once")
        async with spawn(c, config, state_dir=state) as (conn, proc):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1, hard))  # the disk is full for the server
            try:
                with pytest.raises(acp.RequestError) as e:
                    await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="read-only"))
                assert e.value.code == STATE_NOT_SAVED
                with pytest.raises(acp.RequestError) as e:
                    await bounded(conn.set_session_mode(mode_id="auto-edit", session_id=sid))
                assert e.value.code == STATE_NOT_SAVED
                with pytest.raises(acp.RequestError) as e:
                    await bounded(conn.new_session(cwd=str(ws)))
                assert e.value.code == STATE_NOT_SAVED
            finally:
                resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (hard, hard))  # the space comes back
            assert [s.session_id for s in (await bounded(conn.list_sessions())).sessions] == [sid]
            loaded = await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert current(loaded.config_options)["mode"] == "ask"     # memory is what is on disk
            await prompt(conn, sid)                                     # and the service applies that
            assert len(c.permissions) == 1 and (ws / "a.txt").read_text() == "new\n"
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="read-only"))
        async with spawn(RecordingClient(), config, state_dir=state) as (conn, _):
            loaded = await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert current(loaded.config_options)["mode"] == "read-only"

    run(main())


def test_the_session_file_of_older_versions_is_imported_once(tmp_path, ws):
    async def main():
        state = tmp_path / "state"
        store = StateStore(str(state))                 # a branch saved by an older version
        b = Branch(system="sys", name="old")
        store.attach(b, {"name": "old", "createdAt": 1})
        b.messages.add("instruction", {"instruction": "old question"})
        store.flush()
        store.close()
        legacy = state / "acp-sessions.json"
        legacy.write_text(json.dumps({
            b.id: {"cwd": str(ws), "title": "old question", "updatedAt": "2024-01-01T00:00:00+00:00",
                   "model": "s", "mode": "auto-edit"},
            "deleted-session": {"cwd": str(ws), "title": "gone", "updatedAt": None, "model": "s", "mode": "ask"}}))
        config = cfg(tmp_path, "s", "x")
        for _ in range(2):                             # imported, then read from the store alone
            async with spawn(RecordingClient(), config, state_dir=str(state)) as (conn, _):
                sessions = (await bounded(conn.list_sessions(cwd=str(ws)))).sessions
                assert listed(sessions) == [(b.id, "old question", str(ws))]
                assert sessions[0].updated_at == "2024-01-01T00:00:00+00:00"
                loaded = await bounded(conn.load_session(cwd=str(ws), session_id=b.id))
                assert current(loaded.config_options) == {"model": "s", "mode": "auto-edit"}
            assert not legacy.exists() and (state / "acp-sessions.json.imported").exists()

    run(main())
