"""What the file tools refuse, and how they say it: anything that is not a regular file (a
FIFO, a socket, a device) is never opened, not even to look at its type (opening a device acts
on it: a terminal, a tape), and a read or write the file system refuses is said in words,
naming the path as the tools show it, never as ``[Errno N] ...: '<absolute path>'``."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import sys

import pytest
from rpc.support import Sidecar, spawner  # tests/ is on sys.path
from tools.wire_support import call, output, start

from operate_sidecar.server.tools import WorkspacePathError, WorkspaceTools, safe_fs

#: inotify, and the errors' numbers, are Linux's
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux only")

IN_OPEN = 0x20


class OpenWatch:
    """Whether a file was opened, by anyone, since the watch began (inotify's ``IN_OPEN``)."""

    def __init__(self, path: os.PathLike[str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path), IN_OPEN) < 0:
            pytest.skip(f"no inotify here: {os.strerror(ctypes.get_errno())}")

    def opened(self) -> bool:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return False
        return any(struct.unpack_from("iIII", data, i)[1] & IN_OPEN for i in range(0, len(data), 16))

    def close(self) -> None:
        os.close(self.fd)


@contextlib.contextmanager
def watched(path):
    w = OpenWatch(path)
    try:
        yield w
    finally:
        w.close()


def bind_socket(d, name: str) -> socket.socket:
    """A Unix socket ``name`` in the folder ``d`` (bound by a relative name: a socket's path is
    limited to 107 bytes)."""
    s = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(d)
    try:
        s.bind(name)
    finally:
        os.chdir(cwd)
    return s


def test_a_fifo_or_a_device_is_never_opened_to_be_refused(tmp_path):
    """``open_regular`` opened the name (``O_NONBLOCK``) and only then looked at what it was:
    a FIFO or a device was opened before it was refused, and opening some devices has effects
    (a terminal, a tape). The type is now looked at first (``fstatat``, no link followed)."""
    os.mkfifo(tmp_path / "fifo")
    nodes = ["fifo"]
    if os.geteuid() == 0:  # a device node (/dev/null's numbers: opening it is harmless)
        with contextlib.suppress(OSError):
            os.mknod(tmp_path / "null", 0o666 | 0o020000, os.makedev(1, 3))
            nodes.append("null")
    tools = WorkspaceTools([tmp_path])
    for name in nodes:
        with watched(tmp_path / name) as w:
            with pytest.raises(safe_fs.NotRegularFileError):
                safe_fs.open_regular(tmp_path, name)
            with pytest.raises(WorkspacePathError, match=f"^'{name}' is not a file$"):
                tools.read_file(name)
            with pytest.raises(WorkspacePathError, match=f"^'{name}' is not a file$"):
                tools.edit_file(name, [{"oldText": "a", "newText": "b"}])
            assert tools.search_text("x")["filesSkipped"] >= 1
            assert not w.opened(), f"{name} was opened"
            os.close(os.open(tmp_path / name, os.O_RDONLY | os.O_NONBLOCK))  # the watch sees an open
            assert w.opened()


def test_a_symlink_at_the_name_is_refused_before_it_is_opened(tmp_path):
    (tmp_path / "real.txt").write_text("x\n")
    os.symlink("real.txt", tmp_path / "link.txt")
    with watched(tmp_path / "real.txt") as w:
        with pytest.raises(safe_fs.UnsafePathError, match="'link.txt' is a symlink"):
            safe_fs.open_regular(tmp_path, "link.txt")
        assert not w.opened()


def test_a_refused_read_or_write_says_why_in_words_with_the_workspace_path(sidecar, tmp_path):
    """"[Errno 36] File name too long: '/…/ws/nnn…'" (the absolute path), "[Errno 6] No such
    device or address: 'sock'": now the path as the tools show it, why in words, and, for a
    write, that nothing was written."""
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    sock = bind_socket(ws, "sock")
    long = "n" * 300                                                          # NAME_MAX is 255
    too_long = "a name in the path is longer than the file system allows"
    cases = [(call("read_file", path=long), f"'{long}': {too_long}"),
             (call("write_file", path=long, content="x"), f"'{long}': {too_long}; nothing written"),
             (call("edit_file", path=f"sub/{long}", edits=[{"oldText": "a", "newText": "b"}]),
              f"'sub/{long}': {too_long}; nothing written"),
             (call("list_dir", path=long), f"'{long}': {too_long}"),
             (call("search_text", pattern="x", path=long), f"'{long}': {too_long}"),
             (call("read_file", path="sock"), "'sock' is not a file"),
             (call("edit_file", path="sock", edits=[{"oldText": "a", "newText": "b"}]), "'sock' is not a file")]
    try:
        bid = start(sidecar, ws, *[c for c, _ in cases])
        for _, error in cases:
            assert output(sidecar, bid)["error"] == error
    finally:
        sock.close()
    assert sorted(os.listdir(ws)) == ["sock", "sub"] and os.listdir(ws / "sub") == []
    assert str(ws) not in sidecar.stderr_text() and "Errno" not in sidecar.stderr_text()


def test_a_write_past_the_file_size_limit_says_so_and_that_nothing_was_written(tmp_path, monkeypatch):
    """A write the file system cuts off (``EFBIG``: the server runs under a limit on the size of
    the files it writes, set with ``prlimit`` on the server alone) said "[Errno 27] File too
    large"; the old file stays whole, no temporary file or folder is left, and the server goes on."""
    from rpc import support

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("orig\n")
    big = "x" * 100_000 + "\n"
    monkeypatch.setattr(support, "SERVER", ["prlimit", "--fsize=50000", "--", *support.SERVER])
    with spawner(lambda _i, *a, **kw: Sidecar(*a, **kw)) as make:
        c = make()
        bid = start(c, ws, call("write_file", path="a.txt", content=big),
                    call("write_file", path="d1/d2/big.txt", content=big),
                    call("edit_file", path="a.txt", edits=[{"oldText": "orig", "newText": big}]),
                    call("write_file", path="a.txt", content="small\n"))
        too_large = "the file would be larger than the file system (or a limit set on this process) allows"
        assert output(c, bid)["error"] == f"'a.txt': {too_large}; nothing written"
        assert output(c, bid)["error"] == f"'d1/d2/big.txt': {too_large}; nothing written"
        assert output(c, bid)["error"] == f"'a.txt': {too_large}; nothing written"
        assert sorted(os.listdir(ws)) == ["a.txt"] and (ws / "a.txt").read_text() == "orig\n"
        assert output(c, bid)["created"] is False and (ws / "a.txt").read_text() == "small\n"
        assert "Errno" not in c.stderr_text()
