"""The state database gives disk space back: the pages of deleted branches are returned to the
filesystem soon after the delete (``auto_vacuum=INCREMENTAL``, ``PRAGMA incremental_vacuum`` on
a thread of the store), a database made before that (``auto_vacuum=0``) is converted once at
open when most of it is free pages (not when it is too large or the disk has no room for the
copy), another connection on the file does not break that open, and the ``-wal`` file is cut
back after a large write (``PRAGMA journal_size_limit``, a truncating checkpoint) and after the
conversion. Another server holding the write lock holds up none of this server's reads while
the store waits to give space back, and ``close`` ends that wait. Sizes are read as SQLite's
page counts (``PRAGMA``), never timed; every wait is bounded."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import time

import pytest
from rpc.support import TIMEOUT, Sidecar, scripted, spawner  # tests/ is on sys.path

from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import DB_FILE, StateStore
from operate_sidecar.server.state import store as store_module

KIB = 1 << 10
MIB = 1 << 20


@pytest.fixture
def spawn():
    with spawner(lambda _i, *args, **kw: Sidecar(*args, **kw)) as make:
        yield make


def _pragmas(path: str) -> dict[str, int]:
    """auto_vacuum, page_count, freelist_count and page_size of the database, read on a
    connection of its own (closed again: it holds nothing)."""
    con = sqlite3.connect(path, timeout=TIMEOUT)
    try:
        return {p: con.execute(f"PRAGMA {p}").fetchone()[0]
                for p in ("auto_vacuum", "page_count", "freelist_count", "page_size")}
    finally:
        con.close()


def _until(predicate, timeout: float = TIMEOUT, what: str = "") -> None:
    """Wait until ``predicate()`` holds (bounded: fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _server(spawn, state: str, responses: int) -> Sidecar:
    c = spawn()
    c.init(models={"m": scripted(*["ok"] * responses)}, defaultModel="m", stateDir=state)
    return c


def _branch(store: StateStore, instruction: str, name: str = "b") -> Branch:
    b = Branch(system="sys", name=name)
    store.attach(b, {"name": name, "createdAt": time.time()})
    b.messages.add("instruction", {"instruction": instruction})
    return b


def _old_database(state: str, *, big: int = 24, keep: str = "kept", kept_bytes: int = 5) -> tuple[str, list[str]]:
    """A database as the store made it before it gave space back (``auto_vacuum=0``): ``big``
    branches of 512 KiB each, committed and deleted, and one branch of ``kept_bytes`` kept.
    Returns the kept branch's id and its message ids."""
    os.makedirs(state, exist_ok=True)
    path = os.path.join(state, DB_FILE)
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA auto_vacuum=NONE")
    con.execute("PRAGMA journal_mode=WAL")
    con.executescript(store_module._SCHEMA)
    con.close()
    s = StateStore(state)
    kept = _branch(s, "small" if kept_bytes == 5 else "k" * kept_bytes, name=keep)
    doomed = [_branch(s, "x" * (512 * KIB)) for _ in range(big)]
    s.flush()
    for b in doomed:
        s.delete(b.id)
    s.close()
    p = _pragmas(path)
    assert p["auto_vacuum"] == 0 and p["freelist_count"] * 2 > p["page_count"], p
    assert p["freelist_count"] * p["page_size"] > store_module.CONVERT_MIN_FREE_BYTES, p
    return kept.id, [m.id for m in kept.messages]


def test_deleted_branches_give_their_pages_back_over_the_wire(spawn, tmp_path):
    """Branches of 512 KiB each, then all deleted: the server gives their pages back (the page
    count falls to a few pages, no free ones left) while it runs, and the file on disk is that
    small after it stops, and after a restart too."""
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    c = _server(spawn, state, 40)
    ids = [c.branch() for _ in range(24)]
    for bid in ids:
        c.request("operate", {"branchId": bid, "instruction": "x" * (512 * KIB)}, timeout=TIMEOUT)
    full = _pragmas(path)
    assert full["auto_vacuum"] == 2                                   # made able to give pages back
    assert full["page_count"] * full["page_size"] > 12 * MIB, full
    for bid in ids:
        c.request("deleteBranch", {"branchId": bid}, timeout=TIMEOUT)
    assert c.request("listBranches", {}, timeout=TIMEOUT)["branches"] == []
    _until(lambda: _pragmas(path)["page_count"] < 64, what="the deleted branches' pages given back")
    assert _pragmas(path)["freelist_count"] == 0
    keep = c.branch(name="after")                                     # the store works on
    c.request("operate", {"branchId": keep, "instruction": "hello"}, timeout=TIMEOUT)
    assert c.close() == 0
    assert os.path.getsize(path) < 64 * full["page_size"]
    r = _server(spawn, state, 2)
    assert [b["branchId"] for b in r.request("listBranches", {}, timeout=TIMEOUT)["branches"]] == [keep]
    assert [m["kind"] for m in r.messages(keep)][-2:] == ["instruction", "assistant_response"]
    assert r.close() == 0
    assert os.path.getsize(path) < 64 * full["page_size"]


def test_an_old_database_with_mostly_free_pages_is_converted_at_open(spawn, tmp_path):
    """A database made with ``auto_vacuum=0`` whose pages are mostly free (12 MiB of deleted
    branches) is converted when the server opens it: ``auto_vacuum=INCREMENTAL``, no free
    pages, the file small; the branch it held is served whole, and later deletes give their
    pages back."""
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    kept, kept_msgs = _old_database(state)
    before = _pragmas(path)
    c = _server(spawn, state, 4)
    assert [b["branchId"] for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"]] == [kept]
    assert [m["id"] for m in c.messages(kept)] == kept_msgs
    after = _pragmas(path)
    assert after["auto_vacuum"] == 2 and after["freelist_count"] == 0, after
    assert after["page_count"] < before["page_count"] // 4, (before, after)
    assert os.path.getsize(path) < before["page_count"] * before["page_size"] // 4  # cut on disk, not just counted
    extra = c.branch()
    c.request("operate", {"branchId": extra, "instruction": "y" * (2 * MIB)}, timeout=TIMEOUT)
    grown = _pragmas(path)["page_count"]
    c.request("deleteBranch", {"branchId": extra}, timeout=TIMEOUT)
    _until(lambda: _pragmas(path)["page_count"] < grown - 256, what="a later delete's pages given back")
    assert c.close() == 0


def test_another_server_writing_at_open_leaves_the_conversion_for_a_later_start(tmp_path, monkeypatch):
    """Another connection holds the write lock while the store opens (another server in the
    middle of a commit): the conversion is skipped (the file stays as it was), the open does not
    fail, and the store serves and commits once that writer is done; the next open converts."""
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    kept, kept_msgs = _old_database(state)
    other = sqlite3.connect(path, isolation_level=None, timeout=TIMEOUT)
    connect = StateStore._connect

    def connect_then_other_writes(self):
        conn = connect(self)
        other.execute("BEGIN IMMEDIATE")   # taken once the store has connected: its conversion comes next
        return conn

    monkeypatch.setattr(StateStore, "_connect", connect_then_other_writes)
    s = StateStore(state)
    monkeypatch.setattr(StateStore, "_connect", connect)
    assert s.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0            # left as it was
    assert s.conn.execute("PRAGMA freelist_count").fetchone()[0] > 0
    other.execute("ROLLBACK")
    other.close()
    assert [(lb.id, [m.id for m in lb.messages]) for lb in s.load()] == [(kept, kept_msgs)]
    added = _branch(s, "after the other writer", name="added")
    s.flush()
    s.close()
    again = StateStore(state)                                                  # a later start converts
    assert again.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    assert again.conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
    assert sorted(lb.id for lb in again.load()) == sorted([kept, added.id])
    again.close()


def test_a_reader_on_the_file_keeps_its_view_through_the_conversion(tmp_path):
    """Another connection reading the file when the store opens (another server loading its
    branches) does not stop the conversion and keeps reading what it read; afterwards it reads
    the same branches from the converted file. The copy that its read kept in the ``-wal`` is
    checkpointed once the reader is done, with no commit after it: the file is cut to its pages
    while the store runs, not left at its old size until it closes."""
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    kept, _ = _old_database(state)
    reader = sqlite3.connect(path, isolation_level=None, timeout=TIMEOUT)
    reader.execute("BEGIN")
    assert reader.execute("SELECT id FROM branches").fetchall() == [(kept,)]
    s = StateStore(state)
    assert s.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    assert reader.execute("SELECT id FROM branches").fetchall() == [(kept,)]
    reader.execute("COMMIT")
    assert reader.execute("SELECT id FROM branches").fetchall() == [(kept,)]
    assert reader.execute("PRAGMA freelist_count").fetchone()[0] == 0
    reader.close()
    pages = s.conn.execute("PRAGMA page_count").fetchone()[0] * s.conn.execute("PRAGMA page_size").fetchone()[0]
    assert pages < MIB
    _until(lambda: os.path.getsize(path) <= pages and os.path.getsize(path + "-wal") == 0,
           what="the converted file checkpointed and cut to its pages")
    s.close()


def test_the_wal_is_cut_back_after_a_large_write(tmp_path, monkeypatch):
    """A 40 MiB commit grows the ``-wal`` to 40 MiB; once it is checkpointed it is cut back to
    ``JOURNAL_SIZE_LIMIT`` at most, even while another connection read from the file during the
    commit (no truncating checkpoint could run then): the next commits cut it. That is
    ``journal_size_limit``'s doing alone: the tidying's truncating checkpoint is turned off here
    (its own test follows). Everything committed comes back."""
    monkeypatch.setattr(StateStore, "_tidy_soon", lambda self: None)
    state = str(tmp_path / "state")
    wal = os.path.join(state, DB_FILE) + "-wal"
    s = StateStore(state)
    reader = sqlite3.connect(os.path.join(state, DB_FILE), isolation_level=None, timeout=TIMEOUT)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM branches").fetchone()     # holds the log: nothing checkpointed past it
    big = _branch(s, "x" * (40 * MIB), name="big")
    s.flush()
    assert os.path.getsize(wal) > 40 * MIB
    reader.execute("COMMIT")
    reader.close()
    small = []
    for i in range(4):                                             # a commit restarts the log, the next cuts it
        small.append(_branch(s, f"small {i}", name=f"s{i}"))
        s.flush()
    _until(lambda: os.path.getsize(wal) <= store_module.JOURNAL_SIZE_LIMIT, what="the -wal cut back")
    assert s.conn.execute("PRAGMA journal_size_limit").fetchone()[0] == store_module.JOURNAL_SIZE_LIMIT
    s.close()
    loaded = {lb.id: lb for lb in StateStore(state).load()}
    assert set(loaded) == {big.id, *(b.id for b in small)}
    assert loaded[big.id].messages[-1].content["instruction"] == "x" * (40 * MIB)


def test_the_wal_is_cut_back_while_the_server_is_idle_after_a_large_operate(spawn, tmp_path):
    """After one 40 MiB operate and nothing else, the ``-wal`` does not stay 40 MiB for as long
    as the server runs: it is cut back (a truncating checkpoint after the commit)."""
    state = str(tmp_path / "state")
    wal = os.path.join(state, DB_FILE) + "-wal"
    c = _server(spawn, state, 2)
    bid = c.branch()
    c.request("operate", {"branchId": bid, "instruction": "x" * (40 * MIB)}, timeout=TIMEOUT * 3)
    _until(lambda: os.path.getsize(wal) <= store_module.JOURNAL_SIZE_LIMIT, what="the -wal cut back")
    assert [m["kind"] for m in c.messages(bid)][-2:] == ["instruction", "assistant_response"]
    assert c.close() == 0


def test_the_wal_is_cut_to_nothing_after_a_large_write_once_its_reader_is_done(tmp_path, monkeypatch):
    """After a 40 MiB commit and nothing after it, the store itself cuts the ``-wal`` to nothing
    (a truncating checkpoint on its tidying thread; ``journal_size_limit`` alone waits for a
    later write). While another connection reads from the file that checkpoint cannot run: it
    is tried again, and goes through once the reader is done, with no commit after it."""
    state = str(tmp_path / "state")
    wal = os.path.join(state, DB_FILE) + "-wal"
    s = StateStore(state)
    reader = sqlite3.connect(os.path.join(state, DB_FILE), isolation_level=None, timeout=TIMEOUT)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM branches").fetchone()     # holds the log: no truncating checkpoint
    refused = threading.Event()
    pause = StateStore._tidy_pause

    def noted(self, seconds):
        refused.set()
        return pause(self, seconds)

    monkeypatch.setattr(StateStore, "_tidy_pause", noted)
    big = _branch(s, "x" * (40 * MIB), name="big")
    s.flush()
    assert refused.wait(TIMEOUT), "the checkpoint was not tried"
    assert os.path.getsize(wal) > 40 * MIB                          # the reader was in its way
    reader.execute("COMMIT")
    reader.close()
    _until(lambda: os.path.getsize(wal) == 0, what="the -wal cut to nothing")
    s.close()
    again = StateStore(state)
    assert [lb.id for lb in again.load()] == [big.id]
    again.close()


def test_the_wal_beside_the_file_a_linked_database_leads_to_is_cut_after_a_large_write(tmp_path):
    """``state.sqlite3`` a link to a file in another folder, whose ``-wal`` SQLite keeps beside
    that file: after a 24 MiB commit and nothing after it, that ``-wal`` is cut to nothing as
    a plain file's is (the store looked for the ``-wal`` beside the link, found none, and left
    the log at 24 MiB)."""
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir()
    elsewhere.mkdir()
    (state / DB_FILE).symlink_to(elsewhere / "real.sqlite3")
    wal = elsewhere / "real.sqlite3-wal"
    s = StateStore(str(state))
    big = _branch(s, "x" * (24 * MIB), name="big")
    s.flush()
    _until(lambda: wal.stat().st_size == 0, what="the -wal cut to nothing")
    s.close()
    again = StateStore(str(state))
    assert [lb.id for lb in again.load()] == [big.id]
    again.close()


def test_a_damaged_page_met_while_giving_space_back_is_said_in_one_line_once(tmp_path, monkeypatch, caplog):
    """A page damaged on disk under the open store, met by the tidying only (the delete before it
    went through): one warning, no traceback (a damaged page is SQLite's ``DatabaseError``, which
    the tidying let through), and not said again while it fails the same way: it is tried again
    after every later delete, and after every commit while the ``-wal`` is large. The checkpoint
    after it still cuts a ``-wal`` grown past its limit (the failure ended the tidying before it,
    leaving the log as large as it was)."""
    monkeypatch.setattr(StateStore, "_tidy_soon", lambda self: None)  # tidied below, on this thread
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    s = StateStore(state)
    doomed, kept = Branch(system="sys", name="doomed"), Branch(system="sys", name="kept")
    for b, n in ((doomed, 3000), (kept, 1000)):
        s.attach(b, {"name": b.name, "createdAt": 1})
        for i in range(n):
            b.messages.add("instruction", {"instruction": f"q{i}"})
    s.flush()
    s.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")                # everything in the main file
    with open(path, "r+b") as fh:                                    # its last page (kept's) garbled
        fh.seek(os.path.getsize(path) - 4096)
        fh.write(b"\xff" * 16)
    other = sqlite3.connect(path, isolation_level=None)              # another connection commits: the
    other.execute("INSERT OR REPLACE INTO info(key, value) VALUES ('probe', 'x')")  # store reads from disk
    other.close()
    s.delete(doomed.id)                                              # its pages freed
    monkeypatch.setattr(store_module, "JOURNAL_SIZE_LIMIT", 0)       # the -wal left counts as grown past it
    assert os.path.getsize(path + "-wal") > 0
    caplog.set_level(logging.DEBUG, logger="operate_sidecar.server.state.store")
    s._tidy()
    assert os.path.getsize(path + "-wal") == 0                       # cut all the same
    s._tidy()
    said = [r for r in caplog.records if "free space" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG], [r.getMessage() for r in said]
    assert not any(r.exc_info for r in caplog.records)
    assert "malformed" in said[0].getMessage() and "tried again after each later delete" in said[0].getMessage()
    s.close()


def test_converting_an_old_database_leaves_no_large_wal(tmp_path):
    """The conversion writes its copy (20 MiB of data here, more than ``JOURNAL_SIZE_LIMIT``)
    through the ``-wal``: once the store is open the log is cut back, not left as large as the
    database."""
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    kept, kept_msgs = _old_database(state, big=48, kept_bytes=20 * MIB)
    s = StateStore(state)
    assert s.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    assert os.path.getsize(path + "-wal") <= store_module.JOURNAL_SIZE_LIMIT
    assert [(lb.id, [m.id for m in lb.messages]) for lb in s.load()] == [(kept, kept_msgs)]
    s.close()


def _left_as_it_was(state: str, kept: str, kept_msgs: list[str]) -> None:
    """The store opens the old database without converting it, and serves it."""
    s = StateStore(state)
    assert s.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    assert s.conn.execute("PRAGMA freelist_count").fetchone()[0] > 0
    assert [(lb.id, [m.id for m in lb.messages]) for lb in s.load()] == [(kept, kept_msgs)]
    s.close()


def _sqlite_temp(tmp_path, monkeypatch) -> str:
    """A folder of its own for SQLite's temporary files (``SQLITE_TMPDIR``)."""
    temp = str(tmp_path / "sqlite-tmp")
    os.mkdir(temp)
    monkeypatch.setenv("SQLITE_TMPDIR", temp)
    return temp


def _left_as_it_was_without_room_in(full: str, state: str, kept: str, kept_msgs: list[str], monkeypatch,
                                    caplog) -> None:
    """The disk of folder ``full`` (an absolute path) has 1 MiB free: the old database is left
    as it was, and a warning says it was not compacted, naming ``full``."""
    usage = shutil.disk_usage

    def disk_usage(folder):
        got = usage(folder)
        return got._replace(free=MIB) if os.path.abspath(folder) == full else got

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with caplog.at_level(logging.WARNING, logger=store_module.log.name):
        _left_as_it_was(state, kept, kept_msgs)
    assert [r.getMessage() for r in caplog.records if "not compacted" in r.getMessage()
            and full in r.getMessage()], caplog.text


def test_an_old_database_holding_too_much_data_is_not_converted(tmp_path, monkeypatch, caplog):
    """Over ``CONVERT_MAX_BYTES`` of data (the bound made tiny here) the conversion, which holds
    the write lock while it copies, is not done at start: said in one line, with how to do it
    by hand, and the database is served as it was."""
    state = str(tmp_path / "state")
    kept, kept_msgs = _old_database(state)
    monkeypatch.setattr(store_module, "CONVERT_MAX_BYTES", 4 * KIB)
    with caplog.at_level(logging.WARNING, logger=store_module.log.name):
        _left_as_it_was(state, kept, kept_msgs)
    assert [r.getMessage() for r in caplog.records if "too large to compact" in r.getMessage()
            and "PRAGMA auto_vacuum=INCREMENTAL; VACUUM" in r.getMessage()], caplog.text


@pytest.mark.parametrize("short", ["state directory", "SQLite's temporary folder"])
def test_no_room_for_the_copy_leaves_an_old_database_as_it_is(tmp_path, monkeypatch, caplog, short):
    """``VACUUM`` builds its copy in SQLite's temporary folder (``SQLITE_TMPDIR`` here), then
    writes it through the ``-wal`` beside the database: when either disk has no room for it the
    database is not converted (said, naming the folder), and is served as it was."""
    state = str(tmp_path / "state")
    kept, kept_msgs = _old_database(state)
    temp = _sqlite_temp(tmp_path, monkeypatch)
    full = os.path.abspath(state if short == "state directory" else temp)
    _left_as_it_was_without_room_in(full, state, kept, kept_msgs, monkeypatch, caplog)


def test_no_room_beside_the_file_a_linked_database_leads_to_leaves_it_as_it_is(tmp_path, monkeypatch, caplog):
    """``state.sqlite3`` a link to an old database in another folder (another disk, say):
    ``VACUUM`` writes its copy through the ``-wal`` beside that file, so that folder's disk is
    the one that needs the room. The state directory's was looked at instead (the database
    converted on a disk without room for it); now the database is left as it was, and the
    folder said."""
    state, elsewhere = str(tmp_path / "state"), str(tmp_path / "elsewhere")
    kept, kept_msgs = _old_database(state)
    os.mkdir(elsewhere)
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(os.path.join(state, DB_FILE + suffix)):
            os.replace(os.path.join(state, DB_FILE + suffix), os.path.join(elsewhere, "real.sqlite3" + suffix))
    os.symlink(os.path.join(elsewhere, "real.sqlite3"), os.path.join(state, DB_FILE))
    _sqlite_temp(tmp_path, monkeypatch)
    _left_as_it_was_without_room_in(elsewhere, state, kept, kept_msgs, monkeypatch, caplog)


def test_a_tidy_waiting_for_another_servers_write_holds_up_nothing_of_this_server(tmp_path, monkeypatch):
    """Another server holds the write lock when the store starts giving a delete's pages back:
    the tidying waits for it (one wait, made longer than every bound here) without holding the
    store's connection, so this server's reads (``poll``, ``load``, ``unchanged``) go on
    meanwhile; ``close`` ends that wait at once; the file is whole, and the next start gives the
    pages back."""
    monkeypatch.setattr(store_module, "TIDY_RETRY_S", (TIMEOUT * 4,))
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    s = StateStore(state)
    kept = _branch(s, "kept", name="kept")
    doomed = [_branch(s, "x" * (512 * KIB)) for _ in range(16)]
    s.flush()
    tidy_soon = StateStore._tidy_soon
    monkeypatch.setattr(StateStore, "_tidy_soon", lambda self: None)   # held back until the other writes
    for b in doomed:
        s.delete(b.id)
    monkeypatch.setattr(StateStore, "_tidy_soon", tidy_soon)
    assert s.poll() is None
    other = sqlite3.connect(path, isolation_level=None, timeout=TIMEOUT)
    other.execute("BEGIN IMMEDIATE")                                   # another server's commit under way
    stepping, waiting = threading.Event(), threading.Event()
    check_file, pause = StateStore._check_file, StateStore._tidy_pause

    def step(self):                                                    # a step of the tidying begins
        stepping.set()
        return check_file(self)

    def noted(self, seconds):                                          # it waits for the other server
        waiting.set()
        return pause(self, seconds)

    monkeypatch.setattr(StateStore, "_check_file", step)
    monkeypatch.setattr(StateStore, "_tidy_pause", noted)
    s._tidy_soon()
    assert stepping.wait(TIMEOUT), "the tidying did not start"
    done: list = []

    def reads():
        done.extend([s.poll(), [lb.id for lb in s.load()], s.unchanged()])

    reading = threading.Thread(target=reads, daemon=True)
    reading.start()
    reading.join(TIMEOUT)
    assert done == [None, [kept.id], True]                             # while the tidying waits
    assert waiting.wait(TIMEOUT) and _pragmas(path)["freelist_count"] > 0
    other.execute("ROLLBACK")
    other.close()
    closing = threading.Thread(target=s.close, daemon=True)
    closing.start()
    closing.join(TIMEOUT)
    assert not closing.is_alive()                                      # not after the tidying's wait
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    again = StateStore(state)
    _until(lambda: _pragmas(path)["freelist_count"] == 0, what="the pages given back after the restart")
    assert [lb.id for lb in again.load()] == [kept.id]
    again.close()


def test_closing_the_store_during_a_tidy_leaves_the_file_whole(tmp_path, monkeypatch):
    """``close`` while the tidying is half way through a large delete (between two of its steps,
    held there): the tidying stops there, the close returns without waiting for the rest, the
    file is whole (``integrity_check``, every kept branch loads) and the next start gives the
    rest back."""
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    s = StateStore(state)
    kept = [_branch(s, f"kept {i}", name=f"k{i}") for i in range(3)]
    doomed = [_branch(s, "x" * MIB) for _ in range(16)]                # 16 MiB: four steps
    s.flush()
    tidy_soon = StateStore._tidy_soon
    monkeypatch.setattr(StateStore, "_tidy_soon", lambda self: None)
    for b in doomed:
        s.delete(b.id)
    monkeypatch.setattr(StateStore, "_tidy_soon", tidy_soon)
    stepped = threading.Event()
    pause = StateStore._tidy_pause

    def held(self, seconds):
        stepped.set()
        return pause(self, TIMEOUT * 4)                                # until the close

    monkeypatch.setattr(StateStore, "_tidy_pause", held)
    before = _pragmas(path)["freelist_count"]
    s._tidy_soon()
    assert stepped.wait(TIMEOUT), "the tidying made no step"
    closing = threading.Thread(target=s.close, daemon=True)
    closing.start()
    closing.join(TIMEOUT)
    assert not closing.is_alive()
    p = _pragmas(path)
    assert 0 < p["freelist_count"] < before, (before, p)               # one step given back, the rest not
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    monkeypatch.setattr(StateStore, "_tidy_pause", pause)
    again = StateStore(state)
    _until(lambda: _pragmas(path)["freelist_count"] == 0, what="the rest given back after the restart")
    assert [lb.id for lb in again.load()] == [b.id for b in kept]
    again.close()


def test_busy_is_told_by_sqlites_primary_code_extended_codes_too():
    """Another connection in the way is ``SQLITE_BUSY`` (5) or ``SQLITE_LOCKED`` (6), also as an
    extended code (``SQLITE_BUSY_RECOVERY`` 261, ``SQLITE_BUSY_SNAPSHOT`` 517,
    ``SQLITE_LOCKED_SHAREDCACHE`` 262): the tidying and the conversion try again later then,
    rather than giving up with a warning; other errors are not taken for it."""
    def error(code):
        e = sqlite3.OperationalError("x")
        if code is not None:
            e.sqlite_errorcode = code
        return e

    assert all(store_module._is_busy(error(code)) for code in (5, 6, 261, 517, 262))
    assert not any(store_module._is_busy(error(code)) for code in (1, 8, 11, 13, 266, None))
