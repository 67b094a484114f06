"""The client's file system (``capabilities.fs``) confined as the disk is: right before the
editor is asked to read or write a path (``fs/readTextFile`` / ``fs/writeTextFile``), the path
is walked again from the workspace root without following a symlink, and the editor is never
asked about a path that now goes through one (a directory swapped while the user was asked, or
while the editor answered the read before the write), nor about a directory, a FIFO or a socket.
Driven through the real server over real pipes, with an editor that serves the disk and
follows links, as an editor does for a file it has no buffer of."""

from __future__ import annotations

import os
import shutil
import socket
import threading
from pathlib import Path

from rpc.support import RpcError  # tests/ is on sys.path
from tools.wire_support import call, output
from tools.wire_support import start as wire_start

FS = {"fs": True, "toolPermission": True}


def start(c, ws, *responses, policy="allow"):
    """The server on ``ws``, its client serving files (``FS``)."""
    return wire_start(c, ws, *responses, caps=FS, policy=policy)


class DiskEditor:
    """An editor serving fs/* from the disk by path (links followed, as open(2) follows them);
    ``on_read(path, n)`` runs before the n-th read (from 1) is answered."""

    def __init__(self, on_read=None) -> None:
        self.on_read = on_read
        self.reads: list[str] = []
        self.writes: list[str] = []
        self.lock = threading.Lock()

    def read(self, p):
        with self.lock:
            self.reads.append(p["path"])
            n = len(self.reads)
        if self.on_read is not None:
            self.on_read(p["path"], n)
        try:
            with open(p["path"], encoding="utf-8") as f:
                return {"text": f.read()}
        except FileNotFoundError:
            raise RpcError(-32002, f"no such file: {p['path']}") from None

    def write(self, p):
        with self.lock:
            self.writes.append(p["path"])
        with open(p["path"], "w", encoding="utf-8") as f:
            f.write(p["text"])
        return {}

    def attach(self, c) -> "DiskEditor":
        c.on_request("fs/readTextFile", self.read)
        c.on_request("fs/writeTextFile", self.write)
        return self


def swap_for_link(d: Path, target: Path) -> None:
    """``d``, a directory, becomes a symlink to ``target``."""
    shutil.rmtree(d)
    os.symlink(target, d)


def test_a_folder_swapped_for_a_symlink_while_the_user_is_asked_is_never_written_through_by_the_client(
        sidecar, tmp_path):
    """The path was confined when the change was previewed, never again: ``sub`` swapped for a
    symlink to a folder outside while the user was asked, the editor was sent
    ``fs/writeTextFile`` for ``<ws>/sub/new.txt``, followed the link, and the file was made
    outside (the call said ``completed``). The disk's write refused the same race; so does
    the client's now, before the editor is asked anything."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f.txt").write_text("v = 1\n")
    outside.mkdir()
    (outside / "f.txt").write_text("v = 1\n")                                  # the same text: a read passes
    editor = DiskEditor().attach(sidecar)
    asked = []

    def user(p):
        asked.append(p)
        if not os.path.islink(ws / "sub"):
            swap_for_link(ws / "sub", outside)
        return {"decision": "allow_once"}

    sidecar.on_request("requestToolPermission", user)
    bid = start(sidecar, ws, call("write_file", path="sub/new.txt", content="ESCAPED\n"),
                call("edit_file", path="sub/f.txt", edits=[{"oldText": "1", "newText": "2"}]), policy="ask")
    assert output(sidecar, bid)["error"] == "'sub/new.txt': 'sub' is a symlink or not a directory; nothing written"
    # the edit's preview read the file inside; the user's answer swapped the folder again
    os.unlink(ws / "sub")
    (ws / "sub").mkdir()
    (ws / "sub" / "f.txt").write_text("v = 1\n")
    assert output(sidecar, bid)["error"] == "'sub/f.txt': 'sub' is a symlink or not a directory; nothing written"
    assert len(asked) == 2 and editor.writes == []
    assert editor.reads == [str(ws / "sub" / "new.txt"), str(ws / "sub" / "f.txt")]  # the previews' only
    assert sorted(os.listdir(outside)) == ["f.txt"] and (outside / "f.txt").read_text() == "v = 1\n"


def test_a_folder_swapped_while_the_client_answers_the_read_before_the_write_is_never_written_through(
        sidecar, tmp_path):
    """The write is checked on its own: the folder swapped while the editor answered the read
    made just before the write (holding the same text outside, so the read passes) is refused
    at the write, and the editor is not asked to write."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f.txt").write_text("v = 1\n")
    outside.mkdir()
    (outside / "f.txt").write_text("v = 1\n")

    def on_read(path, n):
        if n == 2:  # the call's read of the file just before its write (the first made the change)
            swap_for_link(ws / "sub", outside)

    editor = DiskEditor(on_read).attach(sidecar)
    bid = start(sidecar, ws, call("edit_file", path="sub/f.txt", edits=[{"oldText": "1", "newText": "2"}]))
    assert output(sidecar, bid)["error"] == "'sub/f.txt': 'sub' is a symlink or not a directory; nothing written"
    assert len(editor.reads) == 2 and editor.writes == []
    assert (outside / "f.txt").read_text() == "v = 1\n"


def test_a_fifo_a_socket_or_a_directory_is_never_handed_to_the_client(sidecar, tmp_path):
    """A FIFO was sent to the editor's ``fs/readTextFile`` (twice for one ``write_file``): an
    editor reading it blocks, and the call timed out instead of failing as the disk's does
    ("'fifo' is not a file"). Whatever the disk holds at the path that is not a regular file is
    refused as the disk's tools refuse it, and the editor is not asked; a path with nothing on
    the disk still is (the editor may hold an unsaved buffer of it)."""
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    os.mkfifo(ws / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(ws)  # bound by a relative name: a socket's path is limited to 107 bytes
    try:
        sock.bind("sock")
    finally:
        os.chdir(cwd)
    edits = [{"oldText": "a", "newText": "b"}]
    cases = [(call("read_file", path="fifo"), "'fifo' is not a file"),
             (call("write_file", path="fifo", content="x"), "'fifo' is not a file"),
             (call("edit_file", path="fifo", edits=edits), "'fifo' is not a file"),
             (call("read_file", path="sock"), "'sock' is not a file"),
             (call("write_file", path="sock", content="x"), "'sock' is not a file"),
             (call("read_file", path="sub"), "'sub' is not a file"),
             (call("read_file", path=""), "'.' is not a file"),
             (call("write_file", path="sub", content="x"), "'sub' is a directory"),
             (call("edit_file", path="sub", edits=edits), "'sub' is a directory")]
    served = []

    def read(p):
        served.append(p["path"])
        return {"text": "unsaved\n"}

    sidecar.on_request("fs/readTextFile", read)
    sidecar.on_request("fs/writeTextFile", lambda p: served.append(p["path"]) or {})
    try:
        bid = start(sidecar, ws, *[c for c, _ in cases], call("read_file", path="buffer.txt"))
        for _, error in cases:
            assert output(sidecar, bid)["error"] == error
        assert served == []
        assert output(sidecar, bid)["content"] == "unsaved\n"                  # no file on disk: asked
        assert served == [str(ws / "buffer.txt")]
    finally:
        sock.close()
