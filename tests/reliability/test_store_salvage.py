"""The rebuild of a damaged state database keeps what can still be read, branch by branch.

It used to read every branch row at once: one row SQLite could not read (its page, or the
overflow page its settings spill onto, damaged) made the rebuild keep no branch at all, though
the other rows and every message could still be read. Each test damages a real database file
the way a torn write or a bad sector does (a page overwritten) and checks what the rebuild keeps:
every readable row with its messages; a branch whose row is lost but whose messages are not,
with its messages and empty settings; no hole in a branch's history that SQLite or loading
notices; a branch the rebuild cannot write told, and copied at the next start."""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import subprocess
import sys

from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import DB_FILE, StateStore

from .support import TIMEOUT, scripted

PAGE = 4096  # SQLite's default page size, the store's


def _page_of(path: str, marker: bytes) -> int:
    """The number (from 0) of the page of ``path`` that holds ``marker``; it is there once."""
    with open(path, "rb") as fh:
        data = fh.read()
    assert data.count(marker) == 1, marker
    return data.index(marker) // PAGE


def _overwrite(path: str, page: int, content: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(page * PAGE)
        fh.write(content)


def _readable_rows(path: str) -> tuple[int, int]:
    """(branch rows still read one by one, as text, branch ids listed), read straight from the file."""
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        ids = [r[0] for r in ro.execute("SELECT id FROM branches")]
        good = 0
        for bid in ids:
            try:
                ro.execute("SELECT meta FROM branches WHERE id=?", (bid,)).fetchall()
                good += 1
            except sqlite3.DatabaseError:
                pass
        return good, len(ids)
    finally:
        ro.close()


def _store_with(state: str, n: int, pad: int, messages: int = 3) -> dict[str, Branch]:
    """``n`` branches named ``name-<k>-`` and ``pad`` bytes more, with ``messages`` each, on disk."""
    s = StateStore(state)
    out = {}
    for k in range(n):
        name = f"name-{k:02d}-" + "".join(f"{k:02d}{i:04d}." for i in range(pad // 7))
        b = Branch(system="sys", name=name)
        s.attach(b, {"name": name, "createdAt": 1000.0 + k})
        for i in range(messages):
            b.messages.add("instruction", {"instruction": f"b{k}-q{i}"})
        out[name] = b
    s.flush()
    s.close()
    return out


def _instructions(lb) -> list[str]:
    return [m.content["instruction"] for m in lb.messages if m.kind == "instruction"]


def test_one_unreadable_branch_row_costs_only_that_branchs_settings_over_the_wire(spawn, tmp_path):
    """Ten branches whose names spill onto an overflow page each, three operates each, the
    server stopped cleanly; branch 3's overflow page then holds garbage (0xFF). Nine rows and
    every message are still readable: the restarted server kept no branch at all ("0 branches,
    0 messages"). Now it serves all ten, branch 3 with its operates and without its settings,
    which it can go on using."""
    state = str(tmp_path / "state")
    c = spawn()
    c.init(models={"m": scripted(*[{"text": f"reply-{i}"} for i in range(40)])}, defaultModel="m", stateDir=state)
    names, bids = {}, []
    for k in range(10):
        name = f"branch-{k}-" + "".join(f"{k}{i:05d}." for i in range(800))   # ~6 KB: overflows a page
        bid = c.branch(name=name)
        for j in range(3):
            c.request("operate", {"branchId": bid, "instruction": f"op {k}.{j}"}, timeout=TIMEOUT)
        names[bid] = name
        bids.append(bid)
    assert c.close() == 0                                       # clean stop: everything in the main file
    path = os.path.join(state, DB_FILE)
    _overwrite(path, _page_of(path, b"300700."), b"\xff" * PAGE)  # deep in branch 3's name: its overflow page
    assert _readable_rows(path) == (9, 10)

    r = spawn()
    r.init(models={"m": scripted(*[{"text": f"again-{i}"} for i in range(5)])}, defaultModel="m", stateDir=state)
    got = {b["branchId"]: b for b in r.request("listBranches", {}, timeout=TIMEOUT)["branches"]}
    assert set(got) == set(bids)
    for k, bid in enumerate(bids):
        assert [m["content"]["instruction"] for m in r.messages(bid) if m["kind"] == "instruction"] == \
            [f"op {k}.{j}" for j in range(3)]
        assert got[bid].get("name") == (None if k == 3 else names[bid])
    [log] = [p["message"] for p in r.of("window/logMessage") if "damaged" in p["message"]]
    assert "(10 branches, 60 messages; 1 of those branches without their settings" in log, log
    r.request("operate", {"branchId": bids[3], "instruction": "after"}, timeout=TIMEOUT)  # still in use
    assert r.close() == 0
    r2 = spawn()
    r2.init(models={"m": scripted({"text": "x"})}, defaultModel="m", stateDir=state)
    assert [m["content"]["instruction"] for m in r2.messages(bids[3]) if m["kind"] == "instruction"] == \
        [f"op 3.{j}" for j in range(3)] + ["after"]
    assert len(r2.request("listBranches", {}, timeout=TIMEOUT)["branches"]) == 10
    assert not [p for p in r2.of("window/logMessage") if "damaged" in p["message"]]
    r2.close()


def test_a_damaged_page_of_branch_rows_keeps_every_branch_whose_messages_can_be_read(tmp_path):
    """A page of the branch table overwritten with random bytes (t13 of a crash probe: 11 of 30
    rows and all 300 messages still readable; the rebuild kept none). The branches on other
    pages come back whole; those whose row was on the damaged page come back with all their
    messages and empty settings (as loading gives a branch whose settings cannot be read)."""
    state = str(tmp_path)
    branches = _store_with(state, 40, 600)
    path = os.path.join(state, DB_FILE)
    page = _page_of(path, b"name-20-")
    with open(path, "rb") as fh:
        fh.seek(page * PAGE)
        assert fh.read(1) == b"\x0d"                             # a leaf page of the branch table
    _overwrite(path, page, random.Random(13).randbytes(PAGE))
    good, listed = _readable_rows(path)
    assert listed == 40 and 0 < good < 40

    s = StateStore(state)
    loaded = {lb.id: lb for lb in s.load()}
    assert set(loaded) == {b.id for b in branches.values()}
    bare = 0
    for name, b in branches.items():
        lb = loaded[b.id]
        assert _instructions(lb) == [m.content["instruction"] for m in b.messages if m.kind == "instruction"]
        if lb.meta:
            assert lb.meta["name"] == name
        else:
            bare += 1
    assert bare == 40 - good
    assert any(f"(40 branches, 160 messages; {bare} of those branches without their settings" in p
               for p in s.problems), s.problems


def test_branches_whose_row_and_index_entry_are_both_lost_are_found_by_their_messages(tmp_path):
    """The page of the branches' index and a page of their rows both damaged: no listing of
    the branches gets past the damage from one end, and the branches on the damaged page of
    rows are named nowhere but in their messages. Every branch comes back, and only those
    whose row was on the damaged page come back without their settings."""
    state = str(tmp_path)
    branches = _store_with(state, 40, 600)
    path = os.path.join(state, DB_FILE)
    raw = sqlite3.connect(path)
    [(index_page,)] = raw.execute("SELECT rootpage FROM sqlite_master WHERE name='sqlite_autoindex_branches_1'")
    raw.close()
    with open(path, "rb") as fh:
        fh.seek((index_page - 1) * PAGE)
        assert fh.read(1) == b"\x0a"                             # the whole index: one leaf page
    _overwrite(path, index_page - 1, random.Random(5).randbytes(PAGE))
    rows_page = _page_of(path, b"name-20-")
    with open(path, "rb") as fh:
        fh.seek(rows_page * PAGE)
        lost = fh.read(PAGE).count(b'"name":"name-')             # the rows on it (each fits in the page)
    _overwrite(path, rows_page, random.Random(6).randbytes(PAGE))
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    for sql in ("SELECT id FROM branches", "SELECT id, meta FROM branches NOT INDEXED"):
        try:
            ro.execute(sql).fetchall()
            raise AssertionError(f"{sql} read everything")
        except sqlite3.DatabaseError:
            pass
    ro.close()

    s = StateStore(state)
    loaded = {lb.id: lb for lb in s.load()}
    assert set(loaded) == {b.id for b in branches.values()}
    for name, b in branches.items():
        assert _instructions(loaded[b.id]) == [f"b{int(name[5:7])}-q{i}" for i in range(3)]
        assert loaded[b.id].meta.get("name") in (name, None)
    assert 0 < sum(1 for lb in loaded.values() if not lb.meta) == lost  # every other row read past the damage


def test_a_message_sqlite_reads_but_that_is_no_message_ends_its_branchs_copy_there(tmp_path):
    """The overflow page of one message in the middle of a branch overwritten with other text
    (a misdirected write): SQLite reads the record, but it is no message any more, and loading
    skips it. Copied as read, the branch had a hole (a later answer without its question); it
    now keeps its messages up to that one, and every other branch whole."""
    state = str(tmp_path)
    s = StateStore(state)
    kept = Branch(system="sys", name="kept")
    s.attach(kept, {"name": "kept", "createdAt": 1.0})
    for i in range(4):
        kept.messages.add("instruction", {"instruction": f"k{i}"})
    cut = Branch(system="sys", name="cut")
    s.attach(cut, {"name": "cut", "createdAt": 2.0})
    for i in range(6):
        text = f"c{i}" + ("".join(f"<{i}:{j:05d}>" for j in range(300)) if i == 2 else "")  # ~3 KB: overflows
        cut.messages.add("instruction", {"instruction": text})
    s.flush()
    s.close()
    path = os.path.join(state, DB_FILE)
    _overwrite(path, _page_of(path, b"<2:00290>"), b"A" * PAGE)
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert len(ro.execute("SELECT record FROM messages WHERE branch_id=?", (cut.id,)).fetchall()) == 7
    assert ro.execute("PRAGMA quick_check").fetchone()[0] != "ok"
    ro.close()

    s2 = StateStore(state)
    loaded = {lb.id: lb for lb in s2.load()}
    assert _instructions(loaded[kept.id]) == ["k0", "k1", "k2", "k3"]
    assert _instructions(loaded[cut.id]) == ["c0", "c1"]
    assert loaded[cut.id].meta["name"] == "cut"
    assert any("(2 branches, 8 messages)" in p for p in s2.problems), s2.problems


def _write_null(path: str, branch_id: str, seq: int) -> None:
    """Message ``seq`` of ``branch_id`` reads its ``msg_id`` as NULL, as a damaged page can make it
    read: the column is NOT NULL, so SQLite is told otherwise for this one write
    (``writable_schema``), then told again; ``quick_check`` finds it."""
    for before, after, change in (("msg_id TEXT NOT NULL", "msg_id TEXT", None),
                                  ("msg_id TEXT,", "msg_id TEXT NOT NULL,",
                                   ("UPDATE messages SET msg_id=NULL WHERE branch_id=? AND seq=?", (branch_id, seq)))):
        raw = sqlite3.connect(path, isolation_level=None)
        if change:
            raw.execute(*change)
        raw.execute("PRAGMA writable_schema=ON")
        [(version,)] = raw.execute("PRAGMA schema_version")
        raw.execute("UPDATE sqlite_master SET sql=replace(sql, ?, ?) WHERE name='messages'", (before, after))
        raw.execute(f"PRAGMA schema_version={version + 1}")
        raw.close()


def test_a_message_whose_msg_id_is_not_its_records_ends_its_branchs_copy_there(tmp_path):
    """One message's ``msg_id`` reads as NULL, another's as the id of a later message (damaged
    pages SQLite still reads). The NULL one was skipped by the copy (its insert fails, and
    ``INSERT OR IGNORE`` ignores that), leaving a hole: questions 0, 1 and 3, and a report of 4;
    the other was copied as read, and a later clear, which keeps messages by ``msg_id``, would
    keep the wrong ones. Each branch now ends before its bad message, and the report counts
    what the fresh database holds."""
    state = str(tmp_path)
    s = StateStore(state)
    made = {}
    for name in ("nulled", "swapped"):
        b = Branch(system="sys", name=name)
        s.attach(b, {"name": name, "createdAt": 1.0 if name == "nulled" else 2.0})
        for i in range(4):
            b.messages.add("instruction", {"instruction": f"{name}-{i}"})
        made[name] = b
    s.flush()
    s.close()
    path = os.path.join(state, DB_FILE)
    _write_null(path, made["nulled"].id, 4)                     # seq 1 is the system message: question 2
    raw = sqlite3.connect(path, isolation_level=None)
    later = made["swapped"].messages.items[4].id
    raw.execute("UPDATE messages SET msg_id=? WHERE branch_id=? AND seq=3", (later, made["swapped"].id))
    raw.close()

    s2 = StateStore(state)
    loaded = {lb.id: lb for lb in s2.load()}
    assert _instructions(loaded[made["nulled"].id]) == ["nulled-0", "nulled-1"]
    assert _instructions(loaded[made["swapped"].id]) == ["swapped-0"]
    assert loaded[made["swapped"].id].meta["name"] == "swapped"
    assert any("(2 branches, 5 messages)" in p for p in s2.problems), s2.problems   # 3 + 2, system ones too
    stored = s2.conn.execute("SELECT msg_id, record FROM messages").fetchall()
    assert stored and all(json.loads(record)["id"] == mid for mid, record in stored)
    s2.close()


def test_a_lost_branch_row_whose_first_message_has_a_huge_time_is_rebuilt_once(tmp_path):
    """A branch whose row is lost takes its creation time from its first message; that record's
    ``created_at`` read as a number of 400 digits (a damaged page SQLite still reads), which no
    float holds. Converting it raised OverflowError out of the rebuild, after the fresh database
    was marked as being rebuilt: that start failed, and so did every later one. The branch is
    now kept, created at 0, and the next start has nothing left to do."""
    state = str(tmp_path)
    branches = _store_with(state, 40, 600)
    path = os.path.join(state, DB_FILE)
    victim = branches[next(n for n in branches if n.startswith("name-20-"))]
    raw = sqlite3.connect(path, isolation_level=None)
    [(record,)] = raw.execute("SELECT record FROM messages WHERE branch_id=? AND seq=1", (victim.id,))
    raw.execute("UPDATE messages SET record=? WHERE branch_id=? AND seq=1",
                (json.dumps({**json.loads(record), "created_at": 10 ** 400}), victim.id))
    raw.close()
    _overwrite(path, _page_of(path, b"name-20-"), random.Random(13).randbytes(PAGE))

    s = StateStore(state)
    loaded = {lb.id: lb for lb in s.load()}
    assert set(loaded) == {b.id for b in branches.values()}
    assert loaded[victim.id].meta == {}
    assert _instructions(loaded[victim.id]) == [f"b20-q{i}" for i in range(3)]
    assert s.conn.execute("SELECT created_at FROM branches WHERE id=?", (victim.id,)).fetchone() == (0.0,)
    assert any("(40 branches, 160 messages;" in p for p in s.problems), s.problems
    s.close()
    again = StateStore(state)
    assert again.problems == []
    assert len(again.load()) == 40
    again.close()


_FULL_DISK_OPEN = """
import json, resource, sys
from operate_sidecar.server.state import StateStore
state, limit, gone = sys.argv[1], int(sys.argv[2]), sys.argv[3]
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))   # the disk is full past this (SIGXFSZ: ignored)
s = StateStore(state)
loaded = sorted(lb.id for lb in s.load())
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))    # the space comes back; the server goes on
s.delete(gone)                                             # and its user deletes a rebuilt branch
s.close()
print(json.dumps({"problems": s.problems, "loaded": loaded}))
"""


def test_a_branch_the_rebuild_cannot_write_is_told_and_copied_at_the_next_start(tmp_path):
    """The disk fills up during the rebuild: the branch with a 2 MB message cannot be written,
    the small ones after it can. That branch used to be dropped without a word (its write's
    error ignored) and the rebuild marked done: it was gone for good, with "7 branches" told.
    Now the report says a branch could not be written; the mark stays, naming that branch
    only, and the next start copies it (and only it: a rebuilt branch deleted meanwhile stays
    deleted), then has nothing left to do."""
    state = str(tmp_path / "state")
    s = StateStore(state)
    made = []
    for k in range(8):                                          # one commit each: the rows in this order
        b = Branch(system="sys", name=f"b{k}")
        s.attach(b, {"name": f"b{k}", "createdAt": float(k)})
        b.messages.add("instruction", {"instruction": f"q{k}" + ("x" * 2_000_000 if k == 3 else "")})
        s.flush()
        made.append(b)
    s.close()
    path = os.path.join(state, DB_FILE)
    raw = sqlite3.connect(path)
    [(index_page,)] = raw.execute("SELECT rootpage FROM sqlite_master WHERE name='sqlite_autoindex_branches_1'")
    raw.close()
    _overwrite(path, index_page - 1, random.Random(7).randbytes(PAGE))  # the rows and messages are all readable

    out = subprocess.run([sys.executable, "-c", _FULL_DISK_OPEN, state, str(512 * 1024), made[5].id],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    first = json.loads(out.stdout)
    assert first["loaded"] == sorted(b.id for k, b in enumerate(made) if k != 3)
    [told] = [p for p in first["problems"] if "damaged" in p]
    assert re.search(r"\(7 branches, 14 messages; 1 more branches could not be written \([^)]+\), and are "
                     r"copied at the next start\)", told), told

    again = StateStore(state)
    assert {lb.id: _instructions(lb) for lb in again.load()} == \
        {b.id: [m.content["instruction"] for m in b.messages if m.kind == "instruction"]
         for k, b in enumerate(made) if k != 5}
    assert [p for p in again.problems if "without 1 branches that could not be written then; tried again now "
            "(1 branches, 2 messages)" in p], again.problems
    again.close()
    last = StateStore(state)
    assert last.problems == [] and len(last.load()) == 7
    last.close()
