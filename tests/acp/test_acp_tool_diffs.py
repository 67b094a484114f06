"""The ``diff`` a tool call is shown with: read without ever holding up the agent (a FIFO in
the workspace, a client that never answers ``fs/read_text_file``), and made for the builtin
file-changing tools only (``write_file`` / ``edit_file``), live and on ``session/load``."""

from __future__ import annotations

import asyncio
import os

import acp
from acp_support import RecordingClient, bounded, reply, run, scripted, spawn, until, write_config


def cfg(tmp_path, *responses, **settings):
    return write_config(tmp_path / "settings.toml", {"models": {"s": scripted(*responses)}, **settings})


def start_prompt(conn, sid, text="go"):
    return asyncio.ensure_future(conn.prompt(session_id=sid, prompt=[acp.text_block(text)]))


def test_a_fifo_in_the_workspace_is_refused_and_never_freezes_the_agent(tmp_path, ws):
    """``write_file`` / ``edit_file`` of a FIFO: the diff's read of the old text opened it for a
    blocking read on the event loop, which waited for a writer for ever (no answer, no
    session/cancel, no other request served). Now the file is not read (it is not a regular
    file): the call is shown without a diff, the tool refuses it, and the agent serves the rest."""
    os.mkfifo(ws / "pipe")

    async def main():
        c = RecordingClient()
        edit = {"path": "pipe", "edits": [{"oldText": "a", "newText": "b"}]}
        config = cfg(tmp_path, reply("", [("write_file", {"path": "pipe", "content": "x\n"})]), reply("done"),
                     reply("", [("edit_file", edit), ("slow", {"seconds": 60})]), reply("never reached"),
                     toolModules=["acp_fixture_tools"])
        async with spawn(c, config) as (conn, proc):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            # auto-edit: the edit is not asked about; it fails (a FIFO is no file) and shows no diff
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            res = await bounded(start_prompt(conn, sid), 30)
            assert res.stop_reason == "end_turn"
            [failed] = c.of("tool_call_update")
            assert failed.status == "failed" and "is not a file" in failed.raw_output["error"], failed
            assert not [x for x in failed.content or () if x.type == "diff"]

            turn = start_prompt(conn, sid)  # the edit of the FIFO, and a tool that runs a minute
            await until(lambda: any(u.title.startswith("slow") for u in c.of("tool_call")), "the slow call shown")
            assert [s.session_id for s in (await bounded(conn.list_sessions(), 10)).sessions] == [sid]
            await conn.cancel(session_id=sid)
            assert (await bounded(turn, 10)).stop_reason == "cancelled"
            assert [u.status for u in c.of("tool_call_update") if u.status in ("completed", "failed")] \
                == ["failed"] * 3
            assert not c.permissions

    run(main())


class NeverReads(RecordingClient):
    """An editor that never answers ``fs/read_text_file``."""

    async def read_text_file(self, session_id: str, path: str, line=None, limit=None, **kw):
        await asyncio.sleep(3600)


def test_a_client_that_never_answers_the_diffs_read_holds_the_turn_no_longer_than_the_tool_time_out(tmp_path, ws):
    """An editor that never answers the tool's read of the old text (``fs/read_text_file``)
    holds the turn no longer than ``toolTimeoutMs``: the call fails saying the client did not
    answer (docs/PROTOCOL.md §10), is shown without a diff (the port reads nothing itself: a
    diff is the tool's preview or the change it made), and the turn goes on."""
    async def main():
        c = NeverReads()
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("done"),
                     toolTimeoutMs=1000)
        async with spawn(c, config, fs=True) as (conn, proc):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            assert (await bounded(start_prompt(conn, sid), 30)).stop_reason == "end_turn"
            [start] = c.of("tool_call")
            assert start.title == "Write a.txt" and not start.content
            [done] = c.of("tool_call_update")[-1:]
            # (its read: "the client did not answer fs/readTextFile ...", ended a little before the
            # call's own time-out, or on a loaded machine that time-out's "timed out")
            error = done.raw_output["error"]
            assert done.status == "failed" and ("did not answer" in error or "timed out" in error), done
            assert c.text() == "done"

    run(main())


def test_a_tool_guessed_to_edit_shows_its_output_not_a_diff_live_and_on_load(tmp_path, ws):
    """A Python tool named ``write_note`` (kind guessed ``edit`` from its name) that appends to
    the file its ``path`` names: it was shown a diff replacing the whole file with its
    ``content``, in the permission request and as its completed content (its real output
    dropped). Diffs are for the builtin ``write_file`` / ``edit_file``; it keeps its kind and
    shows its output, live and on ``session/load`` alike."""
    target = str(ws / "a.txt")

    async def main():
        c = RecordingClient("allow_once")
        config = cfg(tmp_path, reply("", [("write_note", {"path": target, "content": "extra line\n"})]),
                     reply("done"), toolModules=["acp_fixture_tools"], toolPolicy={"write_note": "ask"})
        async with spawn(c, config) as (conn, proc):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await bounded(start_prompt(conn, sid))).stop_reason == "end_turn"
            assert (ws / "a.txt").read_text() == "old text\nextra line\n"
            [(asked, _)] = c.permissions
            assert asked.kind == "edit" and not asked.content, asked.content
            [shown] = c.of("tool_call")
            assert shown.kind == "edit" and not shown.content
            live = c.of("tool_call_update")[-1]
            said = f"appended 11 characters to {target}"
            assert live.status == "completed" and [(x.type, x.content.text) for x in live.content] \
                == [("content", said)], live.content

            c.updates.clear()
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            [replayed_start] = c.of("tool_call")
            assert replayed_start.kind == "edit" and not replayed_start.content
            [replayed] = c.of("tool_call_update")
            assert replayed.status == "completed" and replayed.content == live.content

    run(main())
