"""Several stores (servers) on one state directory: the check and rebuild of a damaged database
is one server's at a time (the others wait for it and use the rebuilt file, never set it aside
as damaged, and never take a rebuild still running for one a server left half done); a store's
connection is checked against the file it really opened; two stores adding to one branch's
usage totals both count; a commit on a branch another store deleted says it is gone.

Each store stands for a server process: ``flock`` locks belong to an open file, so two stores
in one process exclude each other as two processes do."""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading

import pytest

from operate_sidecar.server.core import Branch
from operate_sidecar.server.core.messages import MessageLog
from operate_sidecar.server.state import DB_FILE, StateNotSaved, StateStore
from operate_sidecar.server.state import store as store_module

TIMEOUT = 20.0


def _branch(store: StateStore, n: int = 0, *, name: str = "b", created: float = 1) -> Branch:
    b = Branch(system="sys", name=name)
    store.attach(b, {"name": name, "createdAt": created})
    for i in range(n):
        b.messages.add("instruction", {"instruction": f"q{i}"})
    return b


def _ids(state: str) -> set[str]:
    s = StateStore(state)
    try:
        return {lb.id for lb in s.load()}
    finally:
        s.close()


def _aside(state: str) -> list[str]:
    """The databases kept aside as damaged (without their -wal and -shm)."""
    return sorted(f for f in os.listdir(state) if ".damaged-" in f and not f.endswith(("-wal", "-shm")))


def _damage(path: str) -> None:
    """One damaged page near the end: the check fails, most branches can still be read."""
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) - 4096)
        fh.write(b"\xa5" * 64)


def _half_rebuilt(state: str, n: int = 6) -> tuple[str, set[str]]:
    """A state directory as a server leaves it while it rebuilds a damaged database: the
    damaged file kept aside, a fresh database marked as being rebuilt from it and holding the
    first of its branches. Returns (the file aside, every branch id it holds)."""
    s = StateStore(state)
    for k in range(n):
        _branch(s, 3, name=f"b{k}", created=k)
    s.flush()
    s.close()
    path = os.path.join(state, DB_FILE)
    aside = path + ".damaged-20250101T000000-1"
    os.replace(path, aside)
    whole = {r[0] for r in sqlite3.connect(aside).execute("SELECT id FROM branches")}
    StateStore(state).close()
    fresh = sqlite3.connect(path, isolation_level=None)
    fresh.execute("ATTACH DATABASE ? AS old", (aside,))
    fresh.execute("INSERT INTO branches SELECT * FROM old.branches ORDER BY created_at LIMIT 2")
    fresh.execute("INSERT INTO info(key, value) VALUES ('salvaging', ?)", (aside,))
    fresh.close()
    return aside, whole


def _finish_rebuild(state: str, aside: str) -> None:
    """What the rebuilding server does last: the rest copied, the mark taken away."""
    fresh = sqlite3.connect(os.path.join(state, DB_FILE), isolation_level=None)
    fresh.execute("ATTACH DATABASE ? AS old", (aside,))
    fresh.execute("BEGIN IMMEDIATE")
    fresh.execute("INSERT OR IGNORE INTO branches SELECT * FROM old.branches")
    fresh.execute("INSERT OR IGNORE INTO messages SELECT * FROM old.messages")
    fresh.execute("DELETE FROM info WHERE key='salvaging'")
    fresh.execute("COMMIT")
    fresh.close()


class _HeldLock:
    """The state directory's lock (a ``flock`` on the directory) held exclusively, as a server
    holds it while it rebuilds."""

    def __init__(self, state: str) -> None:
        self.fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def test_a_store_opened_while_another_rebuilds_the_database_waits_for_it_then_uses_the_rebuilt_file(
        tmp_path, caplog):
    """A second server started while the first rebuilds a damaged database found the fresh
    file marked, took the rebuild for one a stopped server had left, copied along into it at
    the same time and told its user "... when the server stopped; finished now" (no server had
    stopped). Now it waits for the rebuild to end and says nothing of the kind."""
    state = str(tmp_path)
    aside, whole = _half_rebuilt(state)
    caplog.set_level(logging.INFO, logger=store_module.__name__)
    seen = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for it" in record.getMessage():
                seen.set()

    handler = Seen()
    logging.getLogger(store_module.__name__).addHandler(handler)
    held = _HeldLock(state)
    opened: list = []

    def open_store() -> None:
        try:
            opened.append(StateStore(state))
        except BaseException as e:  # noqa: BLE001 - asserted below
            opened.append(e)
        finally:
            seen.set()

    t = threading.Thread(target=open_store)
    try:
        t.start()
        assert seen.wait(TIMEOUT)
        assert t.is_alive() and not opened, f"the store did not wait for the rebuild: {opened}"
        _finish_rebuild(state, aside)
    finally:
        held.release()
        t.join(TIMEOUT)
        logging.getLogger(store_module.__name__).removeHandler(handler)
    [s] = opened
    assert isinstance(s, StateStore), s
    assert s.problems == []                                    # nothing stopped, nothing to report
    assert {lb.id for lb in s.load()} == whole
    b = _branch(s, 1, name="after")
    s.flush()
    s.close()
    assert _ids(state) == whole | {b.id}
    assert _aside(state) == [os.path.basename(aside)]


def test_a_rebuild_left_half_done_by_a_server_that_stopped_is_finished_and_told_so(tmp_path):
    state = str(tmp_path)
    aside, whole = _half_rebuilt(state)
    s = StateStore(state)                                      # nobody holds the lock: the rebuilder is gone
    assert {lb.id for lb in s.load()} == whole
    [note] = s.problems
    assert "by a server that stopped before it was done; finished now" in note and aside in note
    s.close()


def test_a_store_waits_for_the_lock_only_so_long_and_then_never_moves_or_rebuilds_anything(tmp_path, monkeypatch):
    """Another server has held the lock for ``LOCK_WAIT_S`` (a very long rebuild): a database
    marked as being rebuilt is used as it is, said so (its other branches come in as they are
    copied, as another server's commits do); a damaged one is left to that server, and this
    store cannot be opened."""
    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 0.2)
    state = str(tmp_path / "rebuilding")
    os.makedirs(state)
    aside, whole = _half_rebuilt(state)
    held = _HeldLock(state)
    try:
        s = StateStore(state)
        assert len(s.load()) == 2                              # what is copied so far
        [note] = s.problems
        assert "is being rebuilt from the damaged" in note and "another server" in note, note
        assert "stopped" not in note
        other = StateStore(str(tmp_path / "rebuilding"))       # the mark is still there: not finished here
        assert other.conn.execute("SELECT value FROM info WHERE key='salvaging'").fetchone() == (aside,)
        other.close()
        _finish_rebuild(state, aside)                          # the other server ends its copy:
        assert s.poll() is not None                            # its branches come in
        assert {lb.id for lb in s.load()} == whole
        s.close()
    finally:
        held.release()

    state = str(tmp_path / "damaged")
    s = StateStore(state)
    _branch(s, 50)
    s.flush()
    s.close()
    _damage(os.path.join(state, DB_FILE))
    held = _HeldLock(state)
    try:
        with pytest.raises(sqlite3.OperationalError, match="another server has held"):
            StateStore(state)
        assert _aside(state) == []                             # nothing moved
    finally:
        held.release()


def test_a_store_refuses_changes_once_the_file_it_connected_to_is_moved_even_during_its_rebuild(tmp_path):
    """The file a store writes is the one its connection opened, taken when it connects: a
    second server used to move the first one's fresh, half-rebuilt file aside (as "damaged")
    and make another; the first, taking the file's identity only after its rebuild, took the
    second's file for its own and acknowledged every later change into the file moved aside."""
    state = str(tmp_path)
    s = StateStore(state)
    _branch(s, 20)
    s.flush()
    s.close()
    path = os.path.join(state, DB_FILE)
    _damage(path)

    class MovedDuringRebuild(StateStore):
        def _salvage(self, aside: str, conn: sqlite3.Connection) -> tuple[int, int]:
            counts = super()._salvage(aside, conn)
            for suffix in ("", "-wal", "-shm"):               # another server sets this fresh file aside
                if os.path.exists(path + suffix):
                    os.replace(path + suffix, f"{path}.damaged-other{suffix}")
            other = sqlite3.connect(path)                      # and makes a fresh one of its own
            other.execute("CREATE TABLE t(x)")
            other.close()
            return counts

    s = MovedDuringRebuild(state)
    _branch(s, 1, name="after")
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        s.flush()
    assert "deleted or replaced" in (s.refusal() or "")
    s.close()


def test_two_stores_adding_to_one_branchs_usage_both_count(tmp_path):
    """Two servers each run an operate on one branch at once and save the branch's usage
    totals: the second commit used to write its own totals whole (one operate was lost from
    the counts). Each total is now what is on disk plus what this store added; contextTokens
    (the last call's size, not a total) is the last writer's."""
    a, b = StateStore(str(tmp_path)), StateStore(str(tmp_path))
    ba = _branch(a, name="shared")
    a.update_meta(ba.id, {"usage": {"inputTokens": 10, "outputTokens": 1, "contextTokens": 10, "modelCalls": 1}})
    a.flush()
    [lb] = b.load()
    b.adopt(Branch(id=ba.id, messages=MessageLog(lb.messages)), lb.meta)
    b.update_meta(ba.id, {"usage": {"inputTokens": 30, "outputTokens": 3, "contextTokens": 20, "modelCalls": 2}})
    b.flush()
    a.update_meta(ba.id, {"usage": {"inputTokens": 15, "outputTokens": 2, "contextTokens": 5, "modelCalls": 3}})
    [reloaded] = a.flush()                                     # a's commit found b's: merged, re-read
    want = {"inputTokens": 35, "outputTokens": 4, "contextTokens": 5, "modelCalls": 4}
    assert reloaded.meta["usage"] == want
    assert {lb.id: lb for lb in StateStore(str(tmp_path)).load()}[ba.id].meta["usage"] == want
    # a total one side does not know (a provider that reported no count) stays unknown
    [lb] = [x for x in b.poll()[0] if x.id == ba.id]
    b.update_meta(ba.id, {"usage": {**want, "inputTokens": None, "modelCalls": 5}})
    b.flush()
    a.update_meta(ba.id, {"usage": {**want, "outputTokens": 6, "modelCalls": 5}})
    [reloaded] = a.flush()
    assert reloaded.meta["usage"] == {"inputTokens": None, "outputTokens": 6, "contextTokens": 5, "modelCalls": 6}


def test_a_commit_on_a_branch_another_store_deleted_says_it_was_deleted(tmp_path):
    a, b = StateStore(str(tmp_path)), StateStore(str(tmp_path))
    ba = _branch(a, 1)
    kept = _branch(a, 1, name="kept")
    a.flush()
    b.load()
    b.delete(ba.id)
    ba.messages.add("instruction", {"instruction": "late"})
    kept.messages.add("instruction", {"instruction": "fine"})
    with pytest.raises(StateNotSaved) as ei:
        a.flush()
    assert ei.value.branch_ids == [ba.id] and ei.value.deleted == [ba.id]
    assert "deleted by another process" in str(ei.value)
