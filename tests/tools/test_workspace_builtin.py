import os

import anyio
import jsonschema
import pytest

from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.tools import ToolSourceError, WorkspacePathError, WorkspaceTools

CTX = ToolCallContext(branch_id="b", call_id="c")


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text("import os\n\ndef main():\n    print('Hello')\n")
    (root / "README.md").write_text("# Title\nhello world\n")
    (root / "node_modules").mkdir()
    (root / "node_modules" / "dep.js").write_text("hello from a dependency\n")
    (root / "blob.bin").write_bytes(b"\x00\x01hello\x00")
    outside = tmp_path / "secret.txt"
    outside.write_text("top secret hello\n")
    return root


def tools_of(ws):
    return {t.name: t for t in ws.tools()}


def call(tool, args):
    async def main():
        with anyio.fail_after(10):
            return await tool.call(tool.validate_arguments(args), CTX)

    return anyio.run(main)


def test_tools_are_builtin_with_read_only_flags_and_valid_schemas(workspace):
    tools = tools_of(WorkspaceTools([workspace]))
    assert {n: t.read_only for n, t in tools.items()} == {
        "read_file": True, "list_dir": True, "search_text": True, "write_file": False, "edit_file": False}
    for t in tools.values():
        assert t.source == "builtin"
        jsonschema.Draft202012Validator.check_schema(t.input_schema)


def test_no_workspace_folder_gives_no_tools():
    assert WorkspaceTools([]).tools() == []


def test_a_root_that_is_not_a_directory_is_rejected(tmp_path):
    with pytest.raises(ToolSourceError, match="not a directory"):
        WorkspaceTools([tmp_path / "missing"])


def test_read_file_returns_lines_from_offset(workspace):
    tools = tools_of(WorkspaceTools([workspace]))
    out = call(tools["read_file"], {"path": "src/app.py", "offset": 3, "limit": 1})
    assert out["content"] == "def main():\n"
    assert out["path"] == "src/app.py" and out["nextOffset"] == 4 and out["lines"] == 1


def test_read_file_pages_by_whole_lines_and_cuts_only_a_line_longer_than_a_page(workspace):
    """A line that does not fit in what is left of a page starts the next one (it was cut, and
    the next page, at nextOffset, began after it: its rest was never shown; a blank line at a
    full page's end was counted and never shown). Only a page's first line, longer than a page,
    is cut."""
    (workspace / "big.txt").write_text("x" * 100 + "\n" + "y" * 100 + "\n")
    ws = WorkspaceTools([workspace], max_read_bytes=150)
    read = tools_of(ws)["read_file"]
    out = call(read, {"path": "big.txt"})
    assert (out["content"], out["truncated"], out["nextOffset"], out["lines"]) == ("x" * 100 + "\n", False, 2, 1)
    out = call(read, {"path": "big.txt", "offset": 2})
    assert (out["content"], out["truncated"], out["nextOffset"]) == ("y" * 100 + "\n", False, None)
    read = tools_of(WorkspaceTools([workspace], max_read_bytes=8))["read_file"]
    for text, expected in (("aaaa\nbbbbbbbbbb\ncccc\n", [("aaaa\n", False), ("bbbbbbbb", True), ("cccc\n", False)]),
                           ("aaaaaaa\n\nb\n", [("aaaaaaa\n", False), ("\nb\n", False)])):
        (workspace / "small.txt").write_text(text)
        pages, offset = [], 1
        while offset is not None:
            out = call(read, {"path": "small.txt", "offset": offset})
            pages.append((out["content"], out["truncated"]))
            offset = out["nextOffset"]
        assert pages == expected, pages
    (workspace / "many.txt").write_text("".join(f"{i:04d} " + "z" * 195 + "\n" for i in range(1400)))
    read = tools_of(WorkspaceTools([workspace], max_read_bytes=8192))["read_file"]
    text, offset = "", 1
    while offset is not None:
        out = call(read, {"path": "many.txt", "offset": offset})
        assert not out["truncated"]
        text, offset = text + out["content"], out["nextOffset"]
    assert text == (workspace / "many.txt").read_text()                  # (the pages, joined, are the file)


def test_read_file_refuses_binary_and_missing_files(workspace):
    ws = WorkspaceTools([workspace])
    with pytest.raises(WorkspacePathError, match="binary"):
        ws.read_file("blob.bin")
    with pytest.raises(WorkspacePathError, match="does not exist"):
        ws.read_file("nope.txt")


@pytest.mark.parametrize("path", ["../secret.txt", "src/../../secret.txt", "SECRET_ABS"])
def test_paths_outside_the_root_are_rejected(workspace, path):
    ws = WorkspaceTools([workspace])
    if path == "SECRET_ABS":
        path = str(workspace.parent / "secret.txt")
    with pytest.raises(WorkspacePathError, match="outside the workspace"):
        ws.read_file(path)


def test_a_name_listed_from_the_disk_round_trips_and_a_path_no_file_can_have_is_refused(workspace):
    """A name that is not UTF-8 on disk is listed with its bytes as \\udc80-\\udcff (as Python
    reads it) and found again by that name; a lone surrogate outside that range names no file."""
    with open(os.path.join(os.fsencode(workspace), b"\xff.txt"), "wb") as f:
        f.write(b"hello\n")
    ws = WorkspaceTools([workspace])
    names = [e["name"] for e in ws.list_dir(".")["entries"]]
    assert "\udcff.txt" in names
    assert ws.read_file("\udcff.txt")["content"] == "hello\n"
    for path in ("\ud800.txt", "a/\udfff"):
        with pytest.raises(WorkspacePathError, match="not a file name: character [0-9]+ is .*half of a surrogate"):
            ws.write_file(path, "x")
    assert sorted(os.listdir(os.fsencode(workspace))) == sorted([b"src", b"README.md", b"node_modules",
                                                                 b"blob.bin", b"\xff.txt"])


def test_symlink_escaping_the_root_is_rejected(workspace):
    os.symlink(workspace.parent / "secret.txt", workspace / "link.txt")
    os.symlink(workspace.parent, workspace / "updir")
    ws = WorkspaceTools([workspace])
    with pytest.raises(WorkspacePathError, match="outside"):
        ws.read_file("link.txt")
    with pytest.raises(WorkspacePathError, match="outside"):
        ws.write_file("updir/new.txt", "x")
    assert not (workspace.parent / "new.txt").exists()
    hits = ws.search_text("secret")["matches"]
    assert hits == []


def test_symlink_inside_the_root_is_followed(workspace):
    os.symlink(workspace / "README.md", workspace / "readme-link")
    assert "hello world" in WorkspaceTools([workspace]).read_file("readme-link")["content"]


def test_list_dir_lists_entries(workspace):
    out = call(tools_of(WorkspaceTools([workspace]))["list_dir"], {"path": "."})
    entries = {e["name"]: e for e in out["entries"]}
    assert entries["src"]["type"] == "dir"
    assert entries["README.md"] == {"name": "README.md", "type": "file", "size": 20}


def test_list_dir_caps_entries(workspace):
    out = WorkspaceTools([workspace], max_list_entries=2).list_dir(".")
    assert len(out["entries"]) == 2 and out["truncated"] is True


def test_search_text_finds_substrings_and_skips_binary_and_vendored(workspace):
    out = call(tools_of(WorkspaceTools([workspace]))["search_text"], {"pattern": "hello", "ignore_case": True})
    found = {(m["path"], m["line"]) for m in out["matches"]}
    assert found == {("README.md", 2), ("src/app.py", 4)}
    assert out["truncated"] is False


def test_search_text_regex_and_result_cap(workspace):
    ws = WorkspaceTools([workspace])
    out = ws.search_text(r"^(import|def) \w+", regex=True)
    assert [(m["path"], m["line"]) for m in out["matches"]] == [("src/app.py", 1), ("src/app.py", 3)]
    capped = ws.search_text(r"\w", regex=True, max_results=2)
    assert len(capped["matches"]) == 2 and capped["truncated"] is True
    with pytest.raises(WorkspacePathError, match="invalid regular expression"):
        ws.search_text("(", regex=True)


def test_write_file_creates_and_overwrites_inside_the_root(workspace):
    tools = tools_of(WorkspaceTools([workspace]))
    out = call(tools["write_file"], {"path": "new/dir/note.txt", "content": "hi\n"})
    assert {k: out[k] for k in ("path", "bytes", "created")} == {"path": "new/dir/note.txt", "bytes": 3,
                                                                   "created": True}
    assert (workspace / "new" / "dir" / "note.txt").read_text() == "hi\n"
    out = call(tools["write_file"], {"path": "new/dir/note.txt", "content": "bye\n"})
    assert out["created"] is False and (workspace / "new" / "dir" / "note.txt").read_text() == "bye\n"


def test_write_file_outside_the_root_is_rejected_and_writes_nothing(workspace):
    ws = WorkspaceTools([workspace])
    with pytest.raises(WorkspacePathError):
        ws.write_file("../escaped.txt", "x")
    assert not (workspace.parent / "escaped.txt").exists()


def test_write_file_size_cap(workspace):
    with pytest.raises(WorkspacePathError, match="limit"):
        WorkspaceTools([workspace], max_write_bytes=4).write_file("a.txt", "12345")


def test_second_root_is_addressed_by_its_folder_name(workspace, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello other\n")
    ws = WorkspaceTools([workspace, other])
    assert ws.read_file("other/notes.txt")["path"] == "other/notes.txt"
    assert ws.read_file(str(other / "notes.txt"))["content"] == "hello other\n"
    assert ("other/notes.txt", 1) in {(m["path"], m["line"]) for m in ws.search_text("hello", path="other")["matches"]}
