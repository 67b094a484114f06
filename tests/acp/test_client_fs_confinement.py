"""The editor's file system (``fs`` capability) over ACP, confined as the disk is: the path of
a tool's ``fs/read_text_file`` / ``fs/write_text_file`` is walked again from the session's
folder right before the editor is asked, no symlink followed, and a FIFO is never handed to it."""

from __future__ import annotations

import asyncio
import os
import shutil

from acp.schema import ReadTextFileResponse, WriteTextFileResponse
from acp_support import RecordingClient, bounded, cfg, reply, run, sdk_prompt, spawn

import acp


class DiskEditor(RecordingClient):
    """An editor serving fs/* from the disk by path (links followed, as Zed does for a file it
    has no buffer of); ``on_ask`` runs when the user is asked (for anything else on the machine)."""

    def __init__(self, on_ask=None) -> None:
        super().__init__("allow_once")
        self.on_ask = on_ask
        self.reads: list[str] = []

    async def request_permission(self, session_id, tool_call, options, **kw):
        if self.on_ask is not None:
            self.on_ask()
        return await super().request_permission(session_id, tool_call, options, **kw)

    async def read_text_file(self, session_id, path, line=None, limit=None, **kw):
        self.reads.append(path)
        if not os.path.exists(path):
            raise acp.RequestError.resource_not_found(path)
        with open(path, encoding="utf-8") as f:
            return ReadTextFileResponse(content=f.read())

    async def write_text_file(self, session_id, path, content, **kw):
        self.writes.append((path, content))
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        return WriteTextFileResponse()


def final(c: RecordingClient):
    return [u for u in c.of("tool_call_update") if u.status in ("completed", "failed")]


def test_a_folder_swapped_for_a_symlink_while_the_user_is_asked_is_never_written_through_by_the_editor(tmp_path):
    """``write_file sub/new.txt`` in ask mode; while the user is asked, ``sub`` becomes a symlink
    to a folder outside; the user allows. The server sent ``fs/write_text_file`` for
    ``<ws>/sub/new.txt``, the editor followed the link, ``outside/new.txt`` was made and the call
    said ``completed``. Now the call fails as the same race over the disk does, and the editor
    is not asked to write."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "sub").mkdir(parents=True)
    outside.mkdir()

    def swap():
        shutil.rmtree(ws / "sub")
        os.symlink(outside, ws / "sub")

    async def main():
        c = DiskEditor(swap)
        config = cfg(tmp_path, reply("", [("write_file", {"path": "sub/new.txt", "content": "ESCAPED\n"})]),
                     reply("ok"))
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await sdk_prompt(conn, sid)
        [done] = final(c)
        assert done.status == "failed", done
        assert done.raw_output["error"] == "'sub/new.txt': 'sub' is a symlink or not a directory; nothing written"
        assert c.writes == [] and os.listdir(outside) == [] and len(c.permissions) == 1

    run(main())


class BlockingEditor(DiskEditor):
    """An editor whose read of a FIFO blocks (what ``open(fifo).read()`` does in its worker)."""

    async def read_text_file(self, session_id, path, line=None, limit=None, **kw):
        self.reads.append(path)
        await asyncio.Event().wait()


def test_a_fifo_is_refused_as_the_disk_refuses_it_and_never_handed_to_the_editor(tmp_path):
    """A FIFO in the workspace was sent to the editor's ``fs/read_text_file`` for a ``write_file``
    (the turn waited ``toolTimeoutMs`` per read, then said "tool write_file timed out"). It is
    refused at once, as over the disk ("'fifo' is not a file"), and the editor is never asked."""
    ws = tmp_path / "ws"
    ws.mkdir()
    os.mkfifo(ws / "fifo")

    async def main():
        c = BlockingEditor()
        config = cfg(tmp_path, reply("", [("write_file", {"path": "fifo", "content": "x"})]), reply("ok"),
                     reply("", [("read_file", {"path": "fifo"})]), reply("ok"), toolTimeoutMs=5000)
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            await sdk_prompt(conn, sid)
            await sdk_prompt(conn, sid)
        assert [(u.status, u.raw_output["error"]) for u in final(c)] == [("failed", "'fifo' is not a file")] * 2
        assert c.reads == [] and c.writes == []

    run(main())
