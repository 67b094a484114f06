"""safe_fs and the workspace tools' one read path and one write path: confined to the root,
never following a symlink swapped in after the check, bounded while reading, never blocking
on a FIFO."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

import pytest

from operate_sidecar.server.tools import WorkspacePathError, WorkspaceTools, safe_fs


def test_write_text_atomic_creates_dirs_replaces_and_keeps_the_mode(tmp_path):
    assert safe_fs.write_text_atomic(tmp_path, "a/b/c.txt", "one\n") is True
    os.chmod(tmp_path / "a/b/c.txt", 0o640)
    assert safe_fs.write_text_atomic(tmp_path, "a/b/c.txt", "two\n") is False
    assert (tmp_path / "a/b/c.txt").read_text() == "two\n"
    assert (tmp_path / "a/b/c.txt").stat().st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path / "a/b")) == ["c.txt"]          # no temporary file left


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd"])
def test_paths_leaving_the_root_are_refused(tmp_path, rel):
    with pytest.raises(safe_fs.UnsafePathError):
        safe_fs.write_text_atomic(tmp_path, rel, "x")


def test_a_symlinked_directory_component_is_never_followed(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "f.txt").write_text("outside\n")
    os.symlink(outside, root / "d")
    with pytest.raises(safe_fs.UnsafePathError):
        safe_fs.write_text_atomic(root, "d/f.txt", "pwned")
    with pytest.raises(safe_fs.UnsafePathError):
        safe_fs.read_text(root, "d/f.txt")
    assert (outside / "f.txt").read_text() == "outside\n"


def test_a_symlink_at_the_final_name_is_replaced_not_followed(tmp_path):
    root, target = tmp_path / "root", tmp_path / "target.txt"
    root.mkdir()
    target.write_text("keep\n")
    os.symlink(target, root / "link.txt")
    safe_fs.write_text_atomic(root, "link.txt", "new\n")
    assert target.read_text() == "keep\n" and not (root / "link.txt").is_symlink()
    with pytest.raises(safe_fs.UnsafePathError):
        os.symlink(target, root / "link2.txt")
        safe_fs.read_text(root, "link2.txt")


def test_reads_are_capped_while_reading_and_fifos_are_refused_without_blocking(tmp_path):
    (tmp_path / "big.txt").write_bytes(b"x" * 10_000)
    assert safe_fs.read_bytes(tmp_path, "big.txt", 100) == (b"x" * 100, True)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(safe_fs.NotRegularFileError):
        safe_fs.read_bytes(tmp_path, "fifo", 100)


def test_write_file_cannot_be_raced_out_of_the_workspace(tmp_path):
    """A directory swapped for a symlink to the outside between write_file's check and its
    open used to put files outside the workspace (61 in the probe). Now every write lands
    inside or fails."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    tools = WorkspaceTools([ws])
    stop = threading.Event()

    def swapper():
        d, parked = ws / "d", ws / "d-real"
        parked.mkdir()
        while not stop.is_set():
            try:
                if d.is_symlink():
                    os.unlink(d)
                elif d.is_dir():                      # made by a writer meanwhile
                    shutil.rmtree(d)
                os.rename(parked, d)                  # d → the real directory
                time.sleep(0.0002)
                os.rename(d, parked)
                os.symlink(outside, d)                # d → a symlink to the outside
                time.sleep(0.0002)
            except OSError:
                pass

    t = threading.Thread(target=swapper, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads as finely as two processes would
    t.start()
    try:
        deadline = time.monotonic() + 3.0
        n = 0
        while time.monotonic() < deadline:
            n += 1
            try:
                tools.write_file(f"d/f{n}.txt", "x")
            except (WorkspacePathError, OSError):
                pass
    finally:
        stop.set()
        t.join(10)
        sys.setswitchinterval(interval)
    assert n > 100
    assert os.listdir(outside) == [], f"{len(os.listdir(outside))} files written outside the workspace"


def test_the_read_and_write_paths_are_the_safe_ones(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    tools = WorkspaceTools([ws])
    assert tools._write_text("a/b.txt", "hello\n") is True
    assert tools._read_text("a/b.txt") == "hello\n"
    assert tools._write_text(tools.resolve("a/b.txt"), "again\n") is False
    os.mkfifo(ws / "a" / "pipe")
    with pytest.raises(WorkspacePathError, match="not a file"):
        tools._read_text("a/pipe")
