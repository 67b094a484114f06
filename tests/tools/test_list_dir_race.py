"""list_dir and search_text cannot be raced into listing a folder outside the workspace.

``list_dir`` resolved the path, then listed it by name (``os.scandir(path)``), and search_text's
walk (``os.walk``) listed each subdirectory by name: a directory swapped for a symlink to an
outside folder in between was followed, and the outside names came back (docs/SECURITY.md G8).
Each test runs a real race: a thread (or, over the wire, the test process against the server's)
swaps a workspace directory for a symlink to an outside folder and back, over and over, while
the tools list it; no outside name may ever appear.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from rpc.support import TIMEOUT, scripted  # tests/ is on sys.path

from operate_sidecar.server.tools import builtin
from operate_sidecar.server.tools.builtin import SKIP_DIRS, WorkspaceTools
from operate_sidecar.server.tools.errors import WorkspacePathError

#: how long each in-process race runs at least (it stops early only on a leak), and at most
#: while it has not yet seen MIN_RACE swaps and calls (a loaded machine runs fewer a second)
RACE_SECONDS = 2.0
RACE_MOST_SECONDS = 60.0
MIN_RACE = 20
OUTSIDE_NAMES = [f"OUTSIDE_ONLY_{i}.txt" for i in range(20)]


def outside_folder(tmp_path: Path) -> Path:
    """A folder next to the workspace, full of names that must never be listed, all of them
    holding the text searched for (plus a link back to a workspace file, so that an outside
    name could even come back as a match)."""
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    for name in OUTSIDE_NAMES:
        (out / name).write_text("needle\n")
        (out / "sub" / name).write_text("needle\n")
    os.symlink(tmp_path / "ws" / "top.txt", out / "OUTSIDE_link.txt")
    return out


def leaked(text: str) -> bool:
    return "OUTSIDE_" in text


@contextlib.contextmanager
def swapping(d: Path, outside: Path) -> Iterator[list[int]]:
    """While inside the block, a thread swaps the directory ``d`` for a symlink to ``outside``
    and back, as fast as it can; yields a one-item list counting the swaps."""
    parked = d.with_name(d.name + "-real")
    stop = threading.Event()
    swaps = [0]

    def run() -> None:
        while not stop.is_set():
            try:
                os.rename(d, parked)
                os.symlink(outside, d)
                os.unlink(d)
                os.rename(parked, d)
                swaps[0] += 1
            except OSError:  # pragma: no cover - nothing else touches d
                pass

    t = threading.Thread(target=run, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads as finely as two processes would
    t.start()
    try:
        yield swaps
    finally:
        stop.set()
        t.join(10)
        sys.setswitchinterval(interval)
    assert not t.is_alive()
    assert d.is_dir() and not d.is_symlink()


class Race:
    """A race's clock: it runs for RACE_SECONDS at least (it stops early only on a leak), then
    on until enough of it has run (a loaded machine runs fewer swaps and calls a second), for
    RACE_MOST_SECONDS at most."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def goes_on(self, leaked: bool, enough: bool) -> bool:
        if leaked:
            return False
        elapsed = time.monotonic() - self.start
        return elapsed < RACE_SECONDS or (not enough and elapsed < RACE_MOST_SECONDS)


def test_list_dir_cannot_be_raced_into_listing_a_folder_outside(tmp_path):
    """The directory listed, or one on its way (``d/sub``), swapped for a symlink after
    ``resolve``: the listing is the workspace's directory, or the call fails; never the outside
    folder (the probe saw it within a second)."""
    ws = tmp_path / "ws"
    (ws / "d" / "sub").mkdir(parents=True)
    (ws / "top.txt").write_text("needle\n")
    (ws / "d" / "inside.txt").write_text("x")
    (ws / "d" / "sub" / "inside_sub.txt").write_text("x")
    outside = outside_folder(tmp_path)
    tools = WorkspaceTools([ws])
    seen = {"d": 0, "d/sub": 0}
    refused = calls = 0
    leaks: list[dict] = []
    with swapping(ws / "d", outside) as swaps:
        race = Race()  # enough: both ways too, refused and listed between the swaps
        while race.goes_on(bool(leaks), swaps[0] >= MIN_RACE and calls >= MIN_RACE and refused > 0
                           and all(seen.values())):
            for path, expected in (("d", ["inside.txt", "sub"]), ("d/sub", ["inside_sub.txt"])):
                calls += 1
                try:
                    out = tools.list_dir(path)
                except (WorkspacePathError, OSError):
                    refused += 1
                    continue
                if leaked(json.dumps(out)):
                    leaks.append(out)
                else:
                    assert [e["name"] for e in out["entries"]] == expected
                    seen[path] += 1
    assert not leaks, f"listed outside the workspace: {leaks[:1]}"
    assert swaps[0] >= MIN_RACE and calls >= MIN_RACE
    assert refused and all(seen.values()), (refused, seen)  # the race was run, both ways


def test_search_text_cannot_be_raced_into_walking_a_folder_outside(tmp_path):
    """A subdirectory swapped for a symlink while search_text walks the tree (``a/d`` under
    ``.``), or the directory searched itself (``a/d``): the walk never lists the outside
    folder. By path, ``os.walk`` listed it, and its subfolder: their names came out of the
    walk (``a/d/sub/OUTSIDE_ONLY_0.txt``) and were counted as skipped files (their reads,
    re-walked from the root, failed)."""
    ws = tmp_path / "ws"
    (ws / "a" / "d" / "sub").mkdir(parents=True)
    (ws / "top.txt").write_text("needle\n")
    outside = outside_folder(tmp_path)
    tools = WorkspaceTools([ws])
    calls = 0
    leaks: list[object] = []
    with swapping(ws / "a" / "d", outside) as swaps:
        race = Race()
        while race.goes_on(bool(leaks), swaps[0] >= MIN_RACE and calls >= MIN_RACE):
            for path, found in ((".", ["top.txt"]), ("a/d", [])):
                calls += 1
                try:
                    real = tools.resolve(path)
                    walked = [str(p) for p in tools._walk_files(real) if p is not None]
                    out = tools.search_text("needle", path)
                except (WorkspacePathError, OSError):  # resolved while "a/d" was the symlink, or away
                    continue
                # the names the walk gave, then what search_text tells: nothing was skipped in
                # a workspace where every file is readable, and outside files were skipped
                leaks += [name for name in walked if leaked(name)]
                if leaked(json.dumps(out)) or out["filesSkipped"] or out["filesSearched"] != len(found):
                    leaks.append(out)
                else:
                    assert [m["path"] for m in out["matches"]] == found
    assert not leaks, f"walked outside the workspace: {leaks[:3]}"
    assert swaps[0] >= MIN_RACE and calls >= MIN_RACE


def test_list_dir_and_search_text_stay_inside_over_the_wire(sidecar, tmp_path):
    """The same race against the real server: this process swaps the directory while the
    server's tools list and search it, 200 calls an operate."""
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "top.txt").write_text("needle\n")
    (ws / "d" / "inside.txt").write_text("x")
    outside = outside_folder(tmp_path)
    calls = []
    for i in range(100):
        calls.append({"function": "list_dir", "arguments": {"path": "./" * i + "d"}})
        calls.append({"function": "search_text", "arguments": {"pattern": "needle", "path": "./" * i + "."}})
    reply = {"json": {"action_requests": calls}}
    sidecar.request("initialize", {"workspaceFolders": [str(ws)], "settings": {
        "models": {"s": scripted(*[reply] * 5)}, "defaultModel": "s", "maxToolOutputChars": 1_000_000}},
        timeout=TIMEOUT)
    bid = sidecar.branch()
    listed = 0
    outputs: list[str] = []
    with swapping(ws / "d", outside):
        for _ in range(5):
            res = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True,
                                              "actionStrategy": "sequential"}, timeout=120)
            outs = [json.dumps(r["output"]) for r in res["result"]["action_responses"]]
            assert len(outs) == len(calls)
            outputs += outs
            listed += sum('"inside.txt"' in o for o in outs)
            if any(leaked(o) for o in outs):
                break
    bad = [o for o in outputs if leaked(o)]
    assert not bad, f"{len(bad)} outputs name what is outside the workspace: {bad[0][:300]}"
    assert listed  # the directory was listed between the swaps, too


# -- the listing and the walk are the ones they were -------------------------------------

def old_list_dir(tools: WorkspaceTools, path: str) -> dict:
    """list_dir as it was, by path (the output the descriptor listing must keep)."""
    import heapq

    real = tools.resolve(path)
    entries = []
    with os.scandir(real) as it:
        items = heapq.nsmallest(tools.max_list_entries + 1, it, key=lambda e: e.name)
    for entry in items[: tools.max_list_entries]:
        item: dict = {"name": entry.name}
        if entry.is_symlink():
            item["type"] = "symlink"
        elif entry.is_dir():
            item["type"] = "dir"
        elif entry.is_file():
            item["type"] = "file"
            item["size"] = entry.stat().st_size
        else:
            item["type"] = "other"
        entries.append(item)
    return {"path": tools.display(real), "entries": entries, "truncated": len(items) > tools.max_list_entries}


def old_walk_files(tools: WorkspaceTools, start: Path) -> list[Path | None]:
    """search_text's walk as it was, by path with ``os.walk`` (the order the new one keeps)."""
    if start.is_file():
        return [start]
    out: list[Path | None] = []
    for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
        out.append(None)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath, name)
            if p.is_symlink():
                target = Path(os.path.realpath(p))
                if tools._root_of(target) is None or not target.is_file():
                    out.append(None)
                    continue
            out.append(p)
    return out


def varied_tree(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    for d in ("src/pkg/deep", "src/node_modules/x", ".git/objects", "docs", "empty", ".hidden"):
        (ws / d).mkdir(parents=True)
    for name, text in {"README.md": "needle\n", ".env": "needle=1\n", "src/a.py": "x = 1\n" * 50,
                       "src/pkg/b.py": "needle\n", "src/pkg/deep/c.txt": "", "src/node_modules/x/n.js": "needle",
                       ".git/objects/o": "needle", "docs/z.md": "needle\n", ".hidden/h": "h", "B.txt": "b",
                       "a b.txt": "spaces"}.items():
        (ws / name).write_text(text)
    (ws / "bin.dat").write_bytes(b"\x00\x01needle")
    os.mkfifo(ws / "pipe")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "o.txt").write_text("needle\n")
    os.symlink("src/pkg", ws / "link_to_dir")
    os.symlink("README.md", ws / "link_to_file")
    os.symlink(outside / "o.txt", ws / "link_outside")
    os.symlink(outside, ws / "src" / "link_outside_dir")
    os.symlink("nowhere", ws / "broken")
    return ws


@pytest.mark.parametrize("path", [".", "src", "src/pkg", "link_to_dir", ".hidden", "empty"])
def test_list_dir_output_is_what_listing_by_path_gave(tmp_path, path):
    ws = varied_tree(tmp_path)
    tools = WorkspaceTools([ws])
    assert tools.list_dir(path) == old_list_dir(tools, path)
    small = WorkspaceTools([ws], max_list_entries=3)
    assert small.list_dir(path) == old_list_dir(small, path)


def test_list_dir_entry_types_and_errors(tmp_path):
    ws = varied_tree(tmp_path)
    out = WorkspaceTools([ws]).list_dir(".")
    types = {e["name"]: (e["type"], e.get("size")) for e in out["entries"]}
    assert types["src"] == ("dir", None) and types["README.md"] == ("file", 7) and types["pipe"] == ("other", None)
    assert {types[n][0] for n in ("link_to_dir", "link_to_file", "link_outside", "broken")} == {"symlink"}
    tools = WorkspaceTools([ws])
    with pytest.raises(WorkspacePathError, match="does not exist"):
        tools.list_dir("missing")
    with pytest.raises(WorkspacePathError, match="is not a directory"):
        tools.list_dir("README.md")
    with pytest.raises(WorkspacePathError, match="outside the workspace"):
        tools.list_dir("src/link_outside_dir")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("start", [".", "src", "README.md", "link_to_dir", "empty"])
def test_the_search_walk_is_the_one_os_walk_made(tmp_path, start):
    ws = varied_tree(tmp_path)
    tools = WorkspaceTools([ws])
    real = tools.resolve(start)
    before = open_fds()
    assert list(tools._walk_files(real)) == old_walk_files(tools, real)
    assert open_fds() == before


def test_a_deep_tree_is_walked_whole_holding_few_descriptors(tmp_path):
    """Deeper than the descriptors held (one per level, ``_HELD_DIRS``), a directory is opened
    from the root again; the walk is still os.walk's, and a walk stopped half-way (the
    caller's budget) leaves no descriptor open."""
    ws = tmp_path / "ws"
    d = ws
    for i in range(builtin._HELD_DIRS * 2 + 5):
        d = d / f"l{i}"
        (d / "side").mkdir(parents=True)
        (d / "side" / "f.txt").write_text("needle\n")
        (d / "f.txt").write_text("needle\n")
    tools = WorkspaceTools([ws])
    most = 0
    before = open_fds()
    walked = []
    for p in tools._walk_files(ws):
        most = max(most, open_fds() - before)
        walked.append(p)
    assert walked == old_walk_files(tools, ws)
    assert most <= builtin._HELD_DIRS + 1 and open_fds() == before
    gen = tools._walk_files(ws)
    for _ in range(builtin._HELD_DIRS * 3):
        next(gen)
    assert open_fds() > before
    gen.close()
    assert open_fds() == before
    out = tools.search_text("needle", ".", max_results=1000)
    assert out["filesSearched"] == len([p for p in walked if p is not None]) and not out["filesSkipped"]


@pytest.mark.parametrize("stop", ["max_results", "max_search_entries"])
def test_search_text_stopped_early_closes_its_walk(tmp_path, monkeypatch, stop):
    """search_text that stops half-way (its results or its budget are used up) closes the walk
    then: the walk's directory descriptors (one a level) were left open until the garbage
    collector freed the walk, so while anything still held it (here: the test, as a traceback
    or another interpreter's collector would), they stayed open."""
    ws = tmp_path / "ws"
    d = ws
    for i in range(10):
        d = d / f"l{i}"
        d.mkdir(parents=True)
        (d / "f.txt").write_text("needle\n")
    tools = WorkspaceTools([ws], **({"max_search_entries": 8} if stop == "max_search_entries" else {}))
    walks: list = []

    def kept_walk(start: Path):
        walk = WorkspaceTools._walk_files(tools, start)
        walks.append(walk)
        return walk

    monkeypatch.setattr(tools, "_walk_files", kept_walk)
    before = open_fds()
    out = tools.search_text("needle", ".", max_results=3 if stop == "max_results" else 100)
    assert out["truncated"] is True and len(walks) == 1
    assert open_fds() == before and walks[0].gi_frame is None  # closed, not merely unreferenced
