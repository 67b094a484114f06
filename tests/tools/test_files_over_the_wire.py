"""The builtin file tools at their edges, driven through the real server over real pipes with
the scripted model: line breaks other than ``\\n``, writes that fail half-way or are bound to,
read-only files, owners, durability, and searches and listings of large files and trees."""

from __future__ import annotations

import os
import subprocess
import tracemalloc

from rpc.support import TIMEOUT, Sidecar, scripted, spawner  # tests/ is on sys.path
from tools.wire_support import call, output, start

from operate_sidecar.server.tools import WorkspaceTools


# a form feed, a lone CR and U+2028 are inside their lines: only "\n" ends one (diff, git, read_file)
ODD = "def a():\n\x0c\n    x = 1  # page\x0cbreak\nold\rmac\rline\nsep\u2028inside\ntarget = 1\n"


def test_only_a_newline_ends_a_line_in_diffs_searches_and_reads(sidecar, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    f = ws / "odd.py"
    f.write_bytes(ODD.encode())
    bid = start(sidecar, ws, call("search_text", pattern="target"), call("read_file", path="odd.py", offset=6),
                call("edit_file", path="odd.py", edits=[{"oldText": "target = 1", "newText": "target = 2"}]))
    found = output(sidecar, bid)["matches"]
    assert [(m["path"], m["line"]) for m in found] == [("odd.py", 6)]        # splitlines said 10
    assert output(sidecar, bid)["content"] == "target = 1\n"                  # line 6 as read_file has it
    out = output(sidecar, bid)
    assert out["diff"].splitlines(keepends=True)[2] == "@@ -3,4 +3,4 @@\n"   # 4 lines of context and change
    assert out["diff"].count("\n") == 2 + 1 + 3 + 2 and (out["added"], out["removed"]) == (1, 1)
    # the diff is honest: git applies it to the old text and gets the new one
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "odd.py").write_bytes(ODD.encode())
    (repo / "p.diff").write_bytes(out["diff"].encode())
    done = subprocess.run(["git", "apply", "--unsafe-paths", "p.diff"], cwd=repo, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert (repo / "odd.py").read_bytes() == f.read_bytes() == ODD.replace("target = 1", "target = 2").encode()


def test_the_client_buffers_read_file_numbers_lines_as_the_disk_does(sidecar, tmp_path):
    path = str(tmp_path.resolve() / "odd.py")
    sidecar.on_request("fs/readTextFile", lambda p: {"text": ODD})
    bid = start(sidecar, tmp_path, call("read_file", path="odd.py", offset=6), caps={"fs": True})
    out = output(sidecar, bid)
    assert out["content"] == "target = 1\n" and out["path"] == "odd.py" and path.endswith(out["path"])


def test_a_read_file_page_fits_in_a_tool_output_from_the_disk_and_the_client_alike(tmp_path):
    """read_file's page is at most half of maxToolOutputChars bytes: a default page (256 KiB)
    was over the default output bound (100,000), so the model got a preview cut mid-line without
    its nextOffset. Pages from the client's buffers are the same, and a directory is not a file
    there either (the client was asked to read it)."""
    text = "".join(f"line {i:05d} \"quoted\" " + "w" * 40 + "\n" for i in range(3000))
    (tmp_path / "big.txt").write_text(text)
    (tmp_path / "src").mkdir()
    with spawner(lambda _i, *a, **kw: Sidecar(*a, **kw)) as make:
        for caps in ({}, {"fs": True}):
            c = make()
            asked = []
            c.on_request("fs/readTextFile", lambda p: asked.append(p["path"]) or {"text": text})
            bid = start(c, tmp_path, call("read_file", path="big.txt"), call("read_file", path="src"), caps=caps,
                        maxToolOutputChars=20_000)
            out = output(c, bid)
            assert "preview" not in out and out["nextOffset"] > 1 and not out["truncated"], str(out)[:300]
            assert len(out["content"].encode()) <= 10_000 and text.startswith(out["content"])
            assert output(c, bid)["error"] == "'src' is not a file"
            assert all(not p.endswith("/src") for p in asked), asked


def test_a_file_name_with_a_newline_is_quoted_in_the_diff_header(sidecar, tmp_path):
    """The header was split in two, and a deleted line was counted as one added."""
    (tmp_path / "nl\nname.txt").write_text("keep\ndrop\n")
    bid = start(sidecar, tmp_path, call("edit_file", path="nl\nname.txt", edits=[{"oldText": "drop\n", "newText": ""}]))
    out = output(sidecar, bid)
    assert out["diff"].split("\n")[:2] == ['--- "a/nl\\nname.txt"', '+++ "b/nl\\nname.txt"'], out["diff"]
    assert (out["added"], out["removed"]) == (0, 1)
    repo = tmp_path / "repo"                                              # (git reads the quoted name)
    repo.mkdir()
    (repo / "nl\nname.txt").write_text("keep\ndrop\n")
    (repo / "p.diff").write_text(out["diff"])
    done = subprocess.run(["git", "apply", "p.diff"], cwd=repo, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0 and (repo / "nl\nname.txt").read_text() == "keep\n", done.stderr


def test_a_write_that_fails_leaves_no_directory_or_temporary_file_behind(sidecar, tmp_path):
    (tmp_path / "keep").mkdir()
    too_long = "n" * 256                                                       # NAME_MAX is 255
    bid = start(sidecar, tmp_path, call("write_file", path=f"new/deep/{too_long}", content="x\n"),
                call("write_file", path=f"keep/sub/{too_long}", content="x\n"))
    assert "error" in output(sidecar, bid)
    assert "error" in output(sidecar, bid)
    assert sorted(os.listdir(tmp_path)) == ["keep"] and os.listdir(tmp_path / "keep") == []


def test_a_read_only_file_is_not_replaced(sidecar, tmp_path):
    f = tmp_path / "locked.txt"
    f.write_text("v = 1\n")
    f.chmod(0o444)
    bid = start(sidecar, tmp_path, call("edit_file", path="locked.txt", edits=[{"oldText": "1", "newText": "2"}]),
                call("write_file", path="locked.txt", content="gone\n"))
    for _ in range(2):
        assert output(sidecar, bid)["error"] == "'locked.txt' is read-only; nothing written"
    assert f.read_text() == "v = 1\n" and oct(f.stat().st_mode & 0o777) == "0o444"
    assert os.listdir(tmp_path) == ["locked.txt"]


def test_a_write_bound_to_fail_is_never_put_to_the_user(sidecar, tmp_path):
    locked = tmp_path / "locked.txt"
    locked.write_text("v = 1\n")
    locked.chmod(0o444)
    (tmp_path / "plain.txt").write_text("p\n")
    bid = start(sidecar, tmp_path, call("edit_file", path="locked.txt", edits=[{"oldText": "1", "newText": "2"}]),
                call("write_file", path="locked.txt", content="gone\n"),
                call("write_file", path="plain.txt/new.txt", content="x\n"),              # a file, not a folder
                policy="ask", caps={"toolPermission": True})
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    for _ in range(2):
        assert output(sidecar, bid)["error"] == "'locked.txt' is read-only; nothing written"
    assert output(sidecar, bid)["error"] == "'plain.txt/new.txt': 'plain.txt' is a symlink or not a directory; nothing written"
    assert asked == []                                                        # the user approved, then saw it fail
    assert locked.read_text() == "v = 1\n" and sorted(os.listdir(tmp_path)) == ["locked.txt", "plain.txt"]


def test_a_file_made_read_only_after_the_preview_is_still_refused_at_write_time(sidecar, tmp_path):
    f = tmp_path / "later.txt"
    f.write_text("v = 1\n")
    bid = start(sidecar, tmp_path, call("edit_file", path="later.txt", edits=[{"oldText": "1", "newText": "2"}]),
                policy="ask", caps={"toolPermission": True})
    sidecar.on_request("requestToolPermission", lambda p: f.chmod(0o444) or {"decision": "allow_once"})
    assert output(sidecar, bid)["error"] == "'later.txt' is read-only; nothing written"
    assert f.read_text() == "v = 1\n" and os.listdir(tmp_path) == ["later.txt"]


# wraps os.fsync and os.replace in the server process and logs each, once done, to $FSYNC_TRACE
TRACER = """
import os
_log = os.environ.get("FSYNC_TRACE")
if _log:
    _fsync, _replace = os.fsync, os.replace

    def _note(*parts):
        with open(_log, "a") as f:
            f.write("\\t".join(parts) + "\\n")

    def fsync(fd):
        _fsync(fd)
        _note("fsync", os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))

    def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        _replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        where = os.readlink(f"/proc/self/fd/{dst_dir_fd}") if dst_dir_fd is not None else ""
        _note("replace", os.path.join(where, dst))

    os.fsync, os.replace = fsync, replace
"""


def test_a_write_is_on_disk_with_its_directories_before_the_call_is_answered(tmp_path):
    ws = (tmp_path / "ws").resolve()
    ws.mkdir()
    (ws / "a.txt").write_text("v = 1\n")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(TRACER)
    log = tmp_path / "trace.log"
    with spawner(lambda _i, *a, **kw: Sidecar(*a, **kw)) as make:
        c = make(env={"FSYNC_TRACE": str(log)}, paths=(hook,))
        bid = start(c, ws, call("edit_file", path="a.txt", edits=[{"oldText": "1", "newText": "2"}]),
                    call("write_file", path="new/deep/b.txt", content="b\n"))
        assert "diff" in output(c, bid)
        steps = [tuple(line.split("\t")) for line in log.read_text().splitlines()]
        (tmp,) = [p for op, p in steps if op == "fsync" and p.endswith(".tmp")]
        # the text, then the name, then the directory holding the name: all before the answer
        assert steps == [("fsync", tmp), ("replace", str(ws / "a.txt")), ("fsync", str(ws))]
        assert os.path.dirname(tmp) == str(ws) and (ws / "a.txt").read_text() == "v = 2\n"
        log.unlink()
        assert output(c, bid)["created"] is True
        steps = [tuple(line.split("\t")) for line in log.read_text().splitlines()]
        assert steps[0][0] == "fsync" and steps[0][1].startswith(str(ws / "new" / "deep" / ".b.txt."))
        assert steps[1] == ("replace", str(ws / "new" / "deep" / "b.txt"))
        # every directory the write made has its entry on disk too
        assert sorted(steps[2:]) == [("fsync", str(ws)), ("fsync", str(ws / "new")), ("fsync", str(ws / "new" / "deep"))]


def test_list_dir_of_a_huge_directory_holds_only_what_it_returns(tmp_path):
    for i in range(20_000):
        os.close(os.open(tmp_path / f"f{(i * 7919) % 20_000:05}", os.O_CREAT | os.O_WRONLY, 0o644))
    ws = WorkspaceTools([tmp_path], max_list_entries=50)
    tracemalloc.start()
    try:
        out = ws.list_dir(".")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [e["name"] for e in out["entries"]] == [f"f{i:05}" for i in range(50)] and out["truncated"] is True
    assert peak < 256 * 1024                                                  # every entry, sorted: 4.8 MB
    whole = WorkspaceTools([tmp_path], max_list_entries=20_000).list_dir(".")
    assert len(whole["entries"]) == 20_000 and whole["truncated"] is False


def test_a_replaced_file_keeps_its_owner_group_and_mode(sidecar, tmp_path):
    f = tmp_path / "shared.txt"
    f.write_text("v = 1\n")
    if os.geteuid() == 0:
        uid, gid = 1234, 5678
    else:  # another group of ours, when we have one
        uid, gid = os.getuid(), sorted(set(os.getgroups()) - {os.getegid()} or {os.getegid()})[0]
    os.chown(f, uid, gid)
    f.chmod(0o640)
    bid = start(sidecar, tmp_path, call("edit_file", path="shared.txt", edits=[{"oldText": "1", "newText": "2"}]))
    assert "diff" in output(sidecar, bid)
    st = f.stat()
    assert f.read_text() == "v = 2\n" and (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, gid, 0o640)


def _bytes_read() -> int:
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


def test_search_text_skips_files_over_its_cap_by_size_and_counts_them(tmp_path):
    for i in range(40):
        with open(tmp_path / f"big{i}.bin", "wb") as f:
            f.truncate(3 * 1024 * 1024)                                         # over the 2 MiB cap
    (tmp_path / "small.txt").write_text("needle\n")
    ws = WorkspaceTools([tmp_path])
    before = _bytes_read()
    out = ws.search_text("needle")
    assert _bytes_read() - before < 1024 * 1024                                # read 80 MiB before
    assert out == {"matches": [{"path": "small.txt", "line": 1, "text": "needle"}], "truncated": False,
                   "filesSearched": 1, "filesSkipped": 40}


def test_search_text_bounds_the_walk_of_a_huge_tree(tmp_path):
    for i in range(300):
        (tmp_path / f"d{i:03}" / "e").mkdir(parents=True)                      # no files at all
    out = WorkspaceTools([tmp_path], max_search_entries=100).search_text("x")
    assert out["truncated"] is True and out["filesSearched"] == 0


def test_a_second_folder_named_like_a_folder_of_the_first_is_never_mixed_up_with_it(sidecar, tmp_path):
    first, second = tmp_path / "proj", tmp_path / "docs"
    (first / "docs").mkdir(parents=True)
    second.mkdir()
    (first / "docs" / "guide.md").write_text("first's guide\n")
    (first / "docs" / "same.md").write_text("first's same\n")
    (second / "same.md").write_text("second's same\n")
    (second / "only.md").write_text("second's only\n")
    sidecar.request("initialize", {"workspaceFolders": [str(first), str(second)], "settings": {
        "models": {"s": scripted(call("write_file", path="docs/new.md", content="new\n"),
                                 call("search_text", pattern="second's", path=str(second)))},
        "defaultModel": "s", "toolPolicy": {"write_file": "allow"}}}, timeout=TIMEOUT)
    bid = sidecar.branch()
    out = output(sidecar, bid)
    assert out["created"] is True and out["path"] == "docs/new.md"
    assert (first / "docs" / "new.md").read_text() == "new\n" and not (second / "new.md").exists()  # beside guide.md
    shown = sorted(m["path"] for m in output(sidecar, bid)["matches"])
    # "docs/same.md" is the first folder's file: the second's is shown by a path that leads to it
    assert shown == [str(second.resolve() / "same.md"), "docs/only.md"]
    ws = WorkspaceTools([first, second])
    assert [ws.read_file(p)["content"] for p in shown] == ["second's same\n", "second's only\n"]
