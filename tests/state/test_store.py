"""The SQLite state store: every committed change comes back, one transaction per change, a
failed transaction leaves nothing behind, other processes' commits are seen, a damaged file is
moved aside, a 0.1 JSONL journal is imported once without losing a readable record."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest

from operate_sidecar.server.core import Branch
from operate_sidecar.server.core.messages import MessageLog
from operate_sidecar.server.state import DB_FILE, StateNotSaved, StateStore


def _branch(store: StateStore, n: int = 0, *, name: str = "b", created: float = 1) -> Branch:
    b = Branch(system="sys", name=name)
    store.attach(b, {"name": name, "createdAt": created})
    for i in range(n):
        b.messages.add("instruction", {"instruction": f"q{i}"})
    return b


def _group(b: Branch, n: int) -> None:
    b.messages.add("instruction", {"instruction": f"q{n}"})
    req = b.messages.add("action_request", {"callId": f"c{n}", "function": "f", "arguments": {}})
    b.messages.add("action_response", {"callId": f"c{n}", "requestId": req.id, "function": "f",
                                       "arguments": {}, "output": n})


def _ids(lb) -> list[str]:
    return [m.id for m in lb.messages]


def _damage(path) -> None:
    """Flips bytes in every page of the database file at ``path`` but the first."""
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        for off in range(4096, size, 4096):
            fh.seek(off)
            data = fh.read(16)
            fh.seek(off)
            fh.write(bytes(x ^ 0xA5 for x in data))


def _refused(store: StateStore, b: Branch) -> None:
    """A change to ``b`` and its deletion are refused: the database is not the one opened."""
    _group(b, 1)
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        store.flush({b.id})
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        store.delete(b.id)


def _reload(tmp_path) -> dict:
    return {lb.id: lb for lb in StateStore(str(tmp_path)).load()}


def test_settings_are_wal_and_synchronous_full(tmp_path):
    s = StateStore(str(tmp_path))
    assert s.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.conn.execute("PRAGMA synchronous").fetchone()[0] == 2          # FULL
    assert s.conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000


def test_committed_messages_come_back_in_order_oldest_branch_first(tmp_path):
    s = StateStore(str(tmp_path))
    a = _branch(s, 3, name="a", created=2)
    b = _branch(s, 1, name="b", created=1)
    s.flush()
    loaded = StateStore(str(tmp_path)).load()
    assert [lb.id for lb in loaded] == [b.id, a.id]
    assert _ids(loaded[1]) == [m.id for m in a.messages] and loaded[1].meta["name"] == "a"


def test_uncommitted_messages_are_not_on_disk(tmp_path):
    s = StateStore(str(tmp_path))
    b = _branch(s, 2)
    s.flush()
    b.messages.add("instruction", {"instruction": "late"})
    assert s.dirty()
    assert len(_reload(tmp_path)[b.id].messages) == 3


def test_flush_can_be_limited_to_some_branches(tmp_path):
    s = StateStore(str(tmp_path))
    a, b = _branch(s, name="a"), _branch(s, name="b")
    s.flush()
    _group(a, 1)
    _group(b, 1)                                       # b's operate is still running
    s.flush({a.id})
    assert s.dirty({b.id}) and not s.dirty({a.id})
    got = _reload(tmp_path)
    assert len(got[a.id].messages) == 4 and len(got[b.id].messages) == 1


def test_a_meta_only_flush_leaves_a_running_group_pending(tmp_path):
    """authorizeTool mid-operate: the policy is committed alone, the operate's messages so far
    stay pending and later go out whole."""
    s = StateStore(str(tmp_path))
    b = _branch(s)
    s.flush()
    before = [m.id for m in b.messages]
    b.messages.add("instruction", {"instruction": "q1"})        # the operate has started
    s.update_meta(b.id, {"policy": {"f": "deny"}})
    s.flush({b.id}, messages=False)
    assert not s.dirty({b.id}, messages=False) and s.dirty({b.id})
    lb = _reload(tmp_path)[b.id]
    assert _ids(lb) == before and lb.meta["policy"] == {"f": "deny"}
    b.messages.add("assistant_response", {"text": "a"})
    s.flush({b.id})
    lb = _reload(tmp_path)[b.id]
    assert _ids(lb) == [m.id for m in b.messages] and lb.meta["policy"] == {"f": "deny"}


def test_clear_keeps_only_system_after_reload(tmp_path):
    s = StateStore(str(tmp_path))
    b = _branch(s, 3)
    s.flush()
    b.messages.clear()
    b.messages.add("instruction", {"instruction": "fresh"})
    s.flush()
    assert [m.kind for m in _reload(tmp_path)[b.id].messages] == ["system", "instruction"]


def test_delete_removes_the_branch(tmp_path):
    s = StateStore(str(tmp_path))
    b = _branch(s, 1)
    s.flush()
    s.delete(b.id)
    assert StateStore(str(tmp_path)).load() == []


def test_adopted_branch_keeps_recording(tmp_path):
    s = StateStore(str(tmp_path))
    b = _branch(s, 1)
    s.flush()
    s2 = StateStore(str(tmp_path))
    lb = s2.load()[0]
    b2 = Branch(id=lb.id, messages=MessageLog(lb.messages))
    s2.adopt(b2, lb.meta)
    b2.messages.add("instruction", {"instruction": "more"})
    s2.flush()
    assert len(_reload(tmp_path)[b.id].messages) == len(b.messages) + 1


def test_a_failed_transaction_writes_nothing_and_reverts_the_meta(tmp_path):
    """The group is not written in part: the failure comes after some rows were inserted."""
    s = StateStore(str(tmp_path))
    b = _branch(s, 1)
    s.flush()
    s.conn.execute("CREATE TRIGGER boom BEFORE INSERT ON messages WHEN NEW.record LIKE '%q-fail%' "
                   "BEGIN SELECT RAISE(ABORT, 'injected failure'); END")
    b.messages.add("instruction", {"instruction": "ok-before"})
    b.messages.add("instruction", {"instruction": "q-fail"})
    s.update_meta(b.id, {"policy": {"f": "allow"}})
    with pytest.raises(StateNotSaved) as ei:
        s.flush({b.id})
    assert ei.value.branch_ids == [b.id]
    assert not s.dirty({b.id})                                 # the pending group was dropped
    assert s.committed_meta(b.id).get("policy") is None
    lb = _reload(tmp_path)[b.id]
    assert len(lb.messages) == 2 and "policy" not in lb.meta   # system + q0, nothing of the group
    s.conn.execute("DROP TRIGGER boom")
    b.messages.items[:] = b.messages.items[:2]                  # the server puts the branch back
    b.messages.add("instruction", {"instruction": "next"})
    s.flush({b.id})
    assert [m.content.get("instruction") for m in _reload(tmp_path)[b.id].messages][1:] == ["q0", "next"]


def test_lone_surrogates_are_stored_and_come_back_as_they_came(tmp_path):
    """JSON may carry a lone surrogate ("\\ud800", from a client or a model); it is no UTF-8
    text, so SQLite cannot take it as it is: the record is stored escaped and reads back equal
    (it failed the whole commit, and every later one of the branch, with its title in the meta)."""
    s = StateStore(str(tmp_path))
    b = _branch(s, 1)
    s.flush()
    b.messages.add("instruction", {"instruction": "hi \ud800 there \udfff, and é"})
    s.update_meta(b.id, {"client": {"title": "hi \ud800"}})
    s.flush({b.id})
    lb = _reload(tmp_path)[b.id]
    assert lb.messages[-1].content["instruction"] == "hi \ud800 there \udfff, and é"
    assert lb.meta["client"] == {"title": "hi \ud800"}
    b.messages.add("instruction", {"instruction": "é, next"})  # a plain one after it: stored as UTF-8
    s.flush({b.id})
    assert _reload(tmp_path)[b.id].messages[-1].content["instruction"] == "é, next"
    assert "é, next" in s.conn.execute("SELECT record FROM messages ORDER BY seq DESC LIMIT 1").fetchone()[0]


def test_a_stored_value_that_is_not_utf8_hides_nothing_else(tmp_path):
    """A damaged byte (not UTF-8, while PRAGMA quick_check still says ok) in one message and
    in another branch's meta: every branch loads, the damaged message with U+FFFD in place of
    the byte, the meta as unreadable; before, SQLite's decoding failed the whole load and the
    server served no branch at all."""
    s = StateStore(str(tmp_path))
    a = _branch(s, 2, name="a", created=1)
    b = _branch(s, 1, name="b", created=2)
    c = _branch(s, 1, name="c", created=3)
    s.flush()
    raw = sqlite3.connect(os.path.join(str(tmp_path), DB_FILE))
    (rec,), = raw.execute("SELECT record FROM messages WHERE branch_id=? AND seq=3", (a.id,)).fetchall()
    assert '"q1"' in rec
    damaged = rec.encode().replace(b'"q1"', b'"q\xff1"')
    raw.execute("UPDATE messages SET record=CAST(? AS TEXT) WHERE branch_id=? AND seq=3", (damaged, a.id))
    raw.execute("UPDATE branches SET meta=CAST(? AS TEXT) WHERE id=?", (b'{"name": "\xfe"}', b.id))
    raw.commit()
    assert raw.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    raw.close()
    loaded = _reload(tmp_path)
    assert set(loaded) == {a.id, b.id, c.id}
    assert [m.content.get("instruction") for m in loaded[a.id].messages][1:] == ["q0", "q\ufffd1"]
    assert loaded[b.id].meta == {} and len(loaded[b.id].messages) == 2
    assert loaded[c.id].meta["name"] == "c" and len(loaded[c.id].messages) == 2


def test_any_failure_of_a_commit_is_state_not_saved_and_reverts_the_meta(tmp_path, monkeypatch):
    """Not only SQLite's and the file system's errors: whatever fails a commit, the caller is
    told the state was not saved (-32013 on the wire) and the meta in memory is the committed one."""
    s = StateStore(str(tmp_path))
    b = _branch(s, 1)
    s.flush()
    b.messages.add("instruction", {"instruction": "q1"})
    s.update_meta(b.id, {"policy": {"f": "allow"}})
    import operate_sidecar.server.state.store as store

    def broken(obj):
        raise ValueError("cannot serialize")

    monkeypatch.setattr(store, "_dumps", broken)
    with pytest.raises(StateNotSaved):
        s.flush({b.id})
    assert s.committed_meta(b.id).get("policy") is None
    assert not s.dirty({b.id})                                 # the pending meta change was dropped
    assert len(_reload(tmp_path)[b.id].messages) == 2


def test_a_new_branch_whose_insert_fails_is_not_on_disk(tmp_path):
    s = StateStore(str(tmp_path))
    s.conn.execute("CREATE TRIGGER boom BEFORE INSERT ON messages BEGIN SELECT RAISE(ABORT, 'x'); END")
    b = _branch(s, 1)
    with pytest.raises(StateNotSaved):
        s.flush({b.id})
    s.forget(b.id)
    assert not s.dirty()
    assert StateStore(str(tmp_path)).load() == []


def test_two_stores_see_each_others_commits_and_appends_land_whole(tmp_path):
    a, b = StateStore(str(tmp_path)), StateStore(str(tmp_path))
    b.load()
    ba = _branch(a, 1, name="shared")
    a.flush()
    new, removed = b.poll()
    assert [lb.id for lb in new] == [ba.id] and removed == []
    bb = Branch(id=ba.id, messages=MessageLog(new[0].messages))
    b.adopt(bb, new[0].meta)
    assert b.poll() is None                                    # nothing new: one cheap query
    _group(ba, 1)                                              # both append to the same branch
    _group(bb, 2)
    a.flush()
    reloaded = b.flush()                                       # b sees a's commit came first
    assert [lb.id for lb in reloaded] == [ba.id]
    order = [m.content.get("instruction") or m.kind for m in reloaded[0].messages]
    assert order == ["system", "q0", "q1", "action_request", "action_response",
                     "q2", "action_request", "action_response"]
    changed, _ = a.poll()                                      # a takes in b's group: an append
    assert changed[0].incremental and len(changed[0].messages) == 3
    b.delete(ba.id)
    assert a.poll() == ([], [ba.id])


def test_two_stores_changing_one_branchs_info_keep_both_changes(tmp_path):
    """Two processes change different fields of a branch's info (and its policy): each commit
    applies its own changes over the other's, field by field; neither clobbers the other."""
    a, b = StateStore(str(tmp_path)), StateStore(str(tmp_path))
    ba = _branch(a, name="shared")
    a.update_meta(ba.id, {"client": {"cwd": "/w", "title": None}, "mode": "ask"})
    a.flush()
    [lb] = b.load()
    b.adopt(Branch(id=ba.id, messages=MessageLog(lb.messages)), lb.meta)
    a.update_meta(ba.id, {"client": {"cwd": "/w", "title": "from a"}})
    a.flush()
    b.update_meta(ba.id, {"client": {"cwd": "/w", "title": None, "model": "m"}, "mode": "read-only",
                          "policy": {"f": "deny"}})
    [reloaded] = b.flush()                                     # b's commit found a's: merged, re-read
    want = {"cwd": "/w", "title": "from a", "model": "m"}
    assert reloaded.meta["client"] == want and reloaded.meta["mode"] == "read-only"
    assert _reload(tmp_path)[ba.id].meta["client"] == want


def test_a_damaged_database_is_moved_aside_and_a_fresh_one_used(tmp_path):
    s = StateStore(str(tmp_path))
    _branch(s, 50)
    s.flush()
    s.close()
    path = os.path.join(str(tmp_path), DB_FILE)
    _damage(path)
    s2 = StateStore(str(tmp_path))
    assert any("damaged" in p for p in s2.problems), s2.problems
    aside = [f for f in os.listdir(str(tmp_path)) if ".damaged-" in f]
    assert aside, os.listdir(str(tmp_path))
    assert s2.conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    c = _branch(s2, 1, name="after")
    s2.flush()
    assert c.id in _reload(tmp_path)


def test_a_salvage_cut_short_by_a_crash_is_finished_at_the_next_open(tmp_path, monkeypatch):
    """The process dies while it copies what a damaged database still yields (a SIGKILL at
    start; a large database takes seconds). The fresh database, holding part of it, passed the
    next start's check: every branch not copied yet was silently gone (it is still in the file
    kept aside), and nobody was told."""
    import shutil

    s = StateStore(str(tmp_path / "a"))
    for k in range(5):
        _branch(s, 200, name=f"b{k}", created=k)
    s.flush()
    s.close()
    path = tmp_path / "a" / DB_FILE
    with open(path, "r+b") as fh:                               # one damaged page: the rest is readable
        fh.seek(os.path.getsize(path) - 4096)
        fh.write(b"\xa5" * 64)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    whole = {lb.id for lb in StateStore(str(tmp_path / "b")).load()}  # what an uninterrupted salvage keeps
    assert len(whole) >= 4

    def killed(self, aside, conn):
        raise SystemExit("killed mid-salvage")

    monkeypatch.setattr(StateStore, "_salvage", killed)
    with pytest.raises(SystemExit):
        StateStore(str(tmp_path / "a"))
    monkeypatch.undo()
    again = StateStore(str(tmp_path / "a"))
    assert {lb.id for lb in again.load()} == whole
    assert any("damaged" in p for p in again.problems), again.problems
    again.close()
    assert {lb.id for lb in StateStore(str(tmp_path / "a")).load()} == whole
    assert not StateStore(str(tmp_path / "a")).problems         # finished once, not at every open


def test_a_file_that_is_no_database_is_moved_aside(tmp_path):
    with open(os.path.join(str(tmp_path), DB_FILE), "wb") as fh:
        fh.write(os.urandom(8192))
    s = StateStore(str(tmp_path))
    assert any("damaged" in p for p in s.problems)
    assert s.load() == []


def test_a_truncated_database_is_detected(tmp_path):
    s = StateStore(str(tmp_path))
    _branch(s, 300)
    s.flush()
    s.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s.close()
    path = os.path.join(str(tmp_path), DB_FILE)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)
    s2 = StateStore(str(tmp_path))
    assert any("damaged" in p for p in s2.problems), s2.problems


# ---------------------------------------------------------------- the 0.1 JSONL journal

def _write_jsonl(tmp_path, bid: str, lines: list) -> None:
    d = tmp_path / "branches"
    d.mkdir(exist_ok=True)
    with open(d / f"{bid}.log", "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def _msg(i: int, s: int) -> dict:
    return {"s": s, "t": "msg", "m": {"id": f"m{i}", "kind": "instruction", "sender": None, "recipient": None,
                                      "created_at": 1.0 + i, "content": {"instruction": f"q{i}"}}}


def test_a_jsonl_journal_is_imported_once_keeping_records_after_a_damaged_line(tmp_path):
    _write_jsonl(tmp_path, "b1", [
        {"s": 1, "t": "meta", "meta": {"name": "old", "createdAt": "not-a-number", "policy": {"f": "deny"}}},
        _msg(1, 2),
        '{"s": 3, "t": "msg", "m": {"id": "m2", "ki',          # a damaged line in the middle
        {"s": 4, "t": "batch", "r": [_msg(3, 4), {"s": 5, "t": "msg", "m": {"bad": 1}},
                                     _msg(4, 6)]},
        _msg(5, 7),
        '{"s": 8, "t": "msg"',                                  # a torn tail
    ])
    s = StateStore(str(tmp_path))
    assert any("imported" in p and "3 unreadable" in p for p in s.problems), s.problems
    lb = {b.id: b for b in s.load()}["b1"]
    assert [m.id for m in lb.messages] == ["m1", "m3", "m4", "m5"]
    assert lb.meta["name"] == "old" and lb.meta["policy"] == {"f": "deny"}
    assert os.path.isdir(tmp_path / "branches.imported-0.1") and not os.path.exists(tmp_path / "branches")
    s.delete("b1")
    s.close()
    os.rename(tmp_path / "branches.imported-0.1", tmp_path / "branches")  # even if the rename had failed:
    assert StateStore(str(tmp_path)).load() == []                         # imported once, never again


def test_a_jsonl_snapshot_and_stale_log_are_not_doubled(tmp_path):
    d = tmp_path / "branches"
    d.mkdir()
    (d / "b2.snap").write_text(json.dumps({"s": 3, "meta": {"name": "s", "createdAt": 1},
                                           "messages": [_msg(1, 2)["m"], _msg(2, 3)["m"]]}))
    _write_jsonl(tmp_path, "b2", [_msg(1, 2), _msg(2, 3), _msg(3, 4)])
    lb = StateStore(str(tmp_path)).load()[0]
    assert [m.id for m in lb.messages] == ["m1", "m2", "m3"]


def test_an_unopenable_state_dir_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        StateStore(str(blocker / "state"))


def test_sqlite_rows_are_one_per_message(tmp_path):
    s = StateStore(str(tmp_path))
    b = _branch(s, 2)
    s.flush()
    db = sqlite3.connect(os.path.join(str(tmp_path), DB_FILE))
    assert db.execute("SELECT COUNT(*) FROM messages WHERE branch_id=?", (b.id,)).fetchone()[0] == 3


def test_one_wrong_shaped_record_hides_nothing_else(tmp_path):
    """A bad message row loses that message only; a bad meta loses the name, not the branch."""
    s = StateStore(str(tmp_path))
    a, b = _branch(s, 3, name="a"), _branch(s, 1, name="b")
    s.flush()
    s.conn.execute("UPDATE messages SET record='{\"not\": \"a message\"}' WHERE branch_id=? AND seq=2", (a.id,))
    s.conn.execute("UPDATE branches SET meta='not json', created_at=-1 WHERE id=?", (b.id,))
    got = _reload(tmp_path)
    assert [m.id for m in got[a.id].messages] == [m.id for m in a.messages if m is not a.messages[1]]
    assert [m.id for m in got[b.id].messages] == [m.id for m in b.messages] and got[b.id].meta == {}


def test_the_error_code_is_the_same_in_the_protocol_package_and_the_server():
    from operate_sidecar.protocol import errors as perr
    from operate_sidecar.server.rpc import errors as E

    assert perr.STATE_NOT_SAVED == E.STATE_NOT_SAVED == perr.ERROR_CODES["StateNotSaved"] == -32013
    assert E.state_not_saved("x").to_dict() == {"code": -32013, "message": "state could not be saved: x"}


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_deleted_or_replaced_under_the_store_refuses_every_change(tmp_path, how):
    """The open connection would go on writing to a file nobody reads again (deleted: an unlinked
    inode; replaced: the old file, set aside), every commit acknowledged and lost on restart."""
    s = StateStore(str(tmp_path))
    a = _branch(s, 1, name="a")
    s.flush()
    db = tmp_path / DB_FILE
    for suffix in ("", "-wal", "-shm"):
        f = tmp_path / (DB_FILE + suffix)
        if f.exists():
            if how == "deleted":
                f.unlink()
            else:
                f.rename(tmp_path / ("aside" + suffix))
    if how == "replaced":
        other = StateStore(str(tmp_path))  # a fresh database where the old one was
        other.close()
        assert db.exists()
    b = _branch(s, 1, name="b")
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        s.flush({b.id})
    _refused(s, a)
    s.close()
    assert _reload(tmp_path) == {}  # nothing was claimed saved that is not there


def test_a_write_ahead_log_left_without_its_database_is_kept_aside_and_reported(tmp_path):
    """The database file gone (deleted by hand, a backup restored without it) but its -wal not:
    SQLite would discard that log silently, and with it what it holds; it is set aside and said."""
    s = StateStore(str(tmp_path))
    _branch(s, 1, name="a")
    s.flush()
    wal = tmp_path / (DB_FILE + "-wal")
    held = wal.read_bytes()  # as a crash leaves it: the commit is in the log, not yet in the file
    assert held
    s.close()
    (tmp_path / DB_FILE).unlink()
    wal.write_bytes(held)
    again = StateStore(str(tmp_path))
    try:
        assert len(again.problems) == 1 and "missing but its write-ahead log was not" in again.problems[0]
        kept = [f for f in tmp_path.iterdir() if f.name.startswith(DB_FILE + ".orphan-") and f.name.endswith("-wal")]
        assert len(kept) == 1 and kept[0].read_bytes() == held and str(kept[0]) in again.problems[0]
    finally:
        again.close()


def _linked_state(tmp_path):
    """``state/state.sqlite3``, a relative link to ``elsewhere/real.sqlite3`` (not made yet)."""
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir()
    elsewhere.mkdir()
    (state / DB_FILE).symlink_to(os.path.join("..", "elsewhere", "real.sqlite3"))
    return state, elsewhere


def test_a_write_ahead_log_left_without_the_file_a_linked_database_leads_to_is_kept_aside_beside_it(tmp_path):
    """``state.sqlite3`` a link to a file in another folder, that file gone but its ``-wal``
    (beside it) not: the log was looked for beside the link, not found, and SQLite discarded it
    silently as it made the fresh database where the link leads (nothing said). It is set aside
    beside the file, and said; the link is kept, the fresh database made where it leads."""
    state, elsewhere = _linked_state(tmp_path)
    s = StateStore(str(state))
    _branch(s, 1, name="a")
    s.flush()
    wal = elsewhere / "real.sqlite3-wal"
    held = wal.read_bytes()  # as a crash leaves it: the commit is in the log, not yet in the file
    assert held
    s.close()
    (elsewhere / "real.sqlite3").unlink()
    wal.write_bytes(held)
    again = StateStore(str(state))
    try:
        assert len(again.problems) == 1 and "missing but its write-ahead log was not" in again.problems[0]
        kept = [f for f in elsewhere.iterdir() if f.name.startswith("real.sqlite3.orphan-") and f.name.endswith("-wal")]
        assert len(kept) == 1 and kept[0].read_bytes() == held and str(kept[0]) in again.problems[0]
        assert (state / DB_FILE).is_symlink() and (elsewhere / "real.sqlite3").is_file()
        assert sorted(os.listdir(state)) == [DB_FILE]
    finally:
        again.close()


def test_a_damaged_database_a_link_leads_to_is_kept_aside_beside_it_and_the_link_kept(tmp_path):
    """``state.sqlite3`` a link to a file on another disk, say, that file damaged: the link
    itself was moved aside as the damaged file, the damaged file and its ``-wal`` left where they
    were, and the fresh database made as a plain file in the state directory (the user's link
    silently gone). The file and its ``-wal`` and ``-shm`` are set aside beside it, the fresh
    database is made where the link leads, and the branch whose row only the ``-wal`` held
    comes back from them."""
    state, elsewhere = _linked_state(tmp_path)
    s = StateStore(str(state))
    early = _branch(s, 50, name="early")
    s.flush()
    s.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")        # early in the file, then late in the -wal only
    late = _branch(s, 3, name="late")
    s.flush()
    real = elsewhere / "real.sqlite3"
    held = {sfx: (elsewhere / ("real.sqlite3" + sfx)).read_bytes() for sfx in ("-wal", "-shm")}
    assert held["-wal"]
    s.close()
    for sfx, data in held.items():                           # as a crash leaves them
        (elsewhere / ("real.sqlite3" + sfx)).write_bytes(data)
    _damage(real)
    again = StateStore(str(state))
    try:
        assert len(again.problems) == 1 and "is damaged" in again.problems[0], again.problems
        assert os.readlink(state / DB_FILE) == os.path.join("..", "elsewhere", "real.sqlite3")
        assert sorted(os.listdir(state)) == [DB_FILE]
        aside = [f for f in elsewhere.iterdir() if f.name.startswith("real.sqlite3.damaged-")
                 and not f.name.endswith(("-wal", "-shm"))]
        assert len(aside) == 1 and str(aside[0]) in again.problems[0]
        assert (elsewhere / (aside[0].name + "-wal")).exists() and (elsewhere / (aside[0].name + "-shm")).exists()
        assert real.is_file() and again.conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        loaded = {lb.id: lb for lb in again.load()}
        assert late.id in loaded  # its row only in the -wal, set aside with the file
        after = _branch(again, 1, name="after")
        again.flush()
    finally:
        again.close()
    assert {early.id, late.id, after.id} >= set(_reload(state)) >= {late.id, after.id}


def test_a_state_directory_reached_through_a_linked_folder_names_its_wal_as_its_own(tmp_path):
    """The state directory given through a link to a folder (``state.sqlite3`` itself a plain
    file): its ``-wal`` deleted under the store, the refusal says "its -wal", as for any plain
    file, not the resolved path of a link ``state.sqlite3`` it is not."""
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    s = StateStore(str(tmp_path / "via"))
    a = _branch(s, 1, name="a")
    s.flush()
    (tmp_path / "real" / (DB_FILE + "-wal")).unlink()
    said = s.refusal() or ""
    assert f"{tmp_path / 'via' / DB_FILE} (or its -wal) was deleted or replaced" in said, said
    _group(a, 1)
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        s.flush({a.id})
    s.close()


def test_a_write_ahead_log_deleted_under_the_store_refuses_every_change(tmp_path):
    """Only ``state.sqlite3-wal`` deleted (a clean-up of "stale" files while the server runs):
    the connection went on appending commits to the unlinked log, each acknowledged, none in a
    file a restart reads (after a SIGKILL the branch and every operate were gone)."""
    s = StateStore(str(tmp_path))
    a = _branch(s, 1, name="a")
    s.flush()
    (tmp_path / (DB_FILE + "-wal")).unlink()
    _group(a, 1)
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        s.flush({a.id})
    b = _branch(s, 1, name="b")
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        s.flush({b.id})
    with pytest.raises(StateNotSaved, match="deleted or replaced"):
        s.delete(a.id)
    s.close()


@pytest.mark.parametrize("how", ["wal-deleted", "wal-deleted-relative-link", "link-re-pointed"])
def test_a_database_that_is_a_link_to_a_file_elsewhere_refuses_every_change_once_its_wal_or_link_changes(
        tmp_path, how):
    """``state.sqlite3`` a link to a file in another folder (by its full path, or a relative
    one): SQLite keeps the ``-wal`` beside that file, not beside the link. That ``-wal`` deleted
    (the store looked for one beside the link, found none either way, and acknowledged commits a
    restart never saw): every change is refused, as for a plain file, naming that ``-wal``. The
    link pointed at another file (a restart reads that one) guards what was already so: the file
    ``state.sqlite3`` leads to changed, every change is refused."""
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir()
    elsewhere.mkdir()
    (state / DB_FILE).symlink_to("../elsewhere/real.sqlite3" if how == "wal-deleted-relative-link"
                                 else elsewhere / "real.sqlite3")
    s = StateStore(str(state))
    a = _branch(s, 1, name="a")
    s.flush()
    wal = elsewhere / "real.sqlite3-wal"
    assert wal.exists() and not (state / (DB_FILE + "-wal")).exists()
    assert s.refusal() is None
    if how == "link-re-pointed":
        other = StateStore(str(tmp_path / "other"))  # a database of its own, the link pointed at it
        other.close()
        link = state / "link.tmp"
        link.symlink_to(tmp_path / "other" / DB_FILE)
        link.replace(state / DB_FILE)
    else:
        wal.unlink()
    said = s.refusal() or ""
    assert "deleted or replaced" in said, said
    if how != "link-re-pointed":
        assert os.path.realpath(wal) in said, said  # where that -wal is
    _refused(s, a)
    s.close()


def test_a_jsonl_line_nested_too_deeply_is_skipped_and_nan_becomes_a_string(tmp_path):
    """A damaged line of 100,000 '[' raised RecursionError, which made the whole state directory
    unusable (every change refused); a NaN 0.1 wrote for a float was imported as a number, and
    every branchMessages of the branch failed -32603 (the wire cannot carry it)."""
    nan = {"s": 2, "t": "msg", "m": {"id": "m1", "kind": "action_response", "created_at": 1.0, "content": {
        "callId": "c", "requestId": "r", "function": "f", "arguments": {}, "output": {"v": float("nan"),
                                                                                   "w": [float("-inf")]}}}}
    _write_jsonl(tmp_path, "b1", [{"s": 1, "t": "meta", "meta": {"name": "old", "createdAt": 1}}, nan,
                                  "[" * 100_000, _msg(5, 3)])
    s = StateStore(str(tmp_path))
    assert any("imported" in p and "1 unreadable" in p for p in s.problems), s.problems
    lb = {b.id: b for b in s.load()}["b1"]
    assert [m.id for m in lb.messages] == ["m1", "m5"]
    assert lb.messages[0].content["output"] == {"v": "NaN", "w": ["-Infinity"]}


def test_a_nan_stored_by_an_earlier_version_is_read_as_a_string(tmp_path):
    s = StateStore(str(tmp_path))
    b = _branch(s, 1)
    s.flush()
    s.conn.execute("UPDATE messages SET record=replace(record, '\"q0\"', 'NaN') WHERE branch_id=?", (b.id,))
    s.close()
    [lb] = StateStore(str(tmp_path)).load()
    assert [m.content for m in lb.messages if m.kind == "instruction"] == [{"instruction": "NaN"}]
    json.dumps([m.to_record() for m in lb.messages], allow_nan=False)  # the wire can carry it


def test_a_store_that_cannot_stat_its_file_says_the_replacement_check_is_off(tmp_path, monkeypatch, caplog):
    """When the file cannot be stat-ed at open, the deleted-or-replaced check (_check_file) is off
    for the whole process: that was silent. It is now one warning; the store still works."""
    import logging

    monkeypatch.setattr(StateStore, "_identity", lambda self: None)
    with caplog.at_level(logging.WARNING, logger="operate_sidecar.server.state.store"):
        store = StateStore(str(tmp_path))
    assert [r.getMessage() for r in caplog.records if "cannot stat" in r.getMessage()] == [
        f"state: cannot stat {store.path}; a database deleted or replaced while the server runs will not be noticed"]
    b = _branch(store, 1)
    store.flush()
    assert _ids(_reload(tmp_path)[b.id]) == [m.id for m in b.messages]


def test_a_jsonl_record_no_number_can_hold_is_skipped_and_the_rest_imported(tmp_path):
    """``"s": 1e999`` (OverflowError) and a createdAt of 400 digits made the whole state directory
    unusable (every change refused); now that record is skipped and a bad createdAt only orders
    its branch first (docs/SECURITY.md G3)."""
    _write_jsonl(tmp_path, "b1", [{"s": 1, "t": "meta", "meta": {"name": "late", "createdAt": 5}}, _msg(1, 2),
                                  '{"s": 1e999, "t": "msg", "m": {"id": "z"}}', _msg(2, 3)])
    _write_jsonl(tmp_path, "b2", ['{"s": 1, "t": "meta", "meta": {"name": "huge", "createdAt": 1' + "0" * 400 + "}}",
                                  _msg(1, 2)])
    _write_jsonl(tmp_path, "b3", ['{"s": 1, "t": "meta", "meta": {"name": "inf", "createdAt": 1e999}}', _msg(1, 2)])
    s = StateStore(str(tmp_path))
    assert any("imported" in p and "1 unreadable" in p for p in s.problems), s.problems
    assert not any("unusable" in p for p in s.problems), s.problems
    loaded = s.load()
    assert [b.id for b in loaded][-1] == "b1"  # the bad createdAt ones first
    by_id = {b.id: b for b in loaded}
    assert [m.id for m in by_id["b1"].messages] == ["m1", "m2"]
    assert [m.id for m in by_id["b2"].messages] == ["m1"] and [m.id for m in by_id["b3"].messages] == ["m1"]
    s.attach(Branch(system="sys", name="new"), {"name": "new", "createdAt": 6})  # the store takes changes
    s.flush()
    json.dumps([b.meta for b in loaded], allow_nan=False)


def test_a_jsonl_message_of_an_unknown_kind_is_skipped_and_a_bad_time_is_the_one_before(tmp_path):
    """A message of a kind this version does not know, or with a created_at no date can hold
    (1e999, 400 digits, a string), was imported and failed every branchMessages of its branch
    -32603; now the first is skipped and the others keep the time of the message before."""
    def msg(i: int, s: int, **m) -> str:
        return json.dumps({"s": s, "t": "msg", "m": dict(_msg(i, s)["m"], **m)})

    _write_jsonl(tmp_path, "b1", [
        {"s": 1, "t": "meta", "meta": {"name": "old", "createdAt": 1}}, _msg(1, 2),
        msg(2, 3, kind="weird"),
        msg(3, 4).replace('"created_at": 4.0', '"created_at": 1e999'),
        msg(4, 5).replace('"created_at": 5.0', '"created_at": 1' + "0" * 400),
        msg(5, 6, created_at="NaN"), msg(6, 7, created_at=-1e300), _msg(7, 8)])
    s = StateStore(str(tmp_path))
    assert any("imported" in p and "1 unreadable" in p for p in s.problems), s.problems
    [lb] = s.load()
    assert [m.id for m in lb.messages] == ["m1", "m3", "m4", "m5", "m6", "m7"]
    assert [m.created_at for m in lb.messages] == [2.0, 2.0, 2.0, 2.0, 2.0, 8.0]
    [m.to_dict() for m in lb.messages]  # what branchMessages sends: no OverflowError, no KeyError


def test_jsonl_records_repeating_a_message_id_import_it_once(tmp_path):
    """Records with ``"s": 0`` (no sequence number to tell them already read) and the same
    message id were imported as so many copies of that message."""
    _write_jsonl(tmp_path, "b1", [{"s": 1, "t": "meta", "meta": {"name": "old", "createdAt": 1}}, _msg(1, 2),
                                  _msg(1, 0), _msg(1, 0), _msg(2, 0)])
    [lb] = StateStore(str(tmp_path)).load()
    assert [m.id for m in lb.messages] == ["m1", "m2"]


def test_load_turns_the_collector_off_meanwhile_and_freezes_nothing(tmp_path):
    """``load`` only turns cyclic garbage collection off while it reads, and back on: it froze
    everything alive when it ended (``gc.freeze``, process-wide and for good), so garbage cycles
    of the oldest generation then were never freed, and each load froze more."""
    import gc
    import weakref

    s = StateStore(str(tmp_path))
    _branch(s, 2)
    s.flush()

    class Cycle:
        me: object = None

    c = Cycle()
    c.me = c
    gone = weakref.ref(c)
    gc.collect()  # it survives into the oldest generation ...
    del c  # ... where only a full collection frees it
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    try:
        for _ in range(2):
            assert len(s.load()) == 1
        assert gc.isenabled() == enabled
        assert gc.get_freeze_count() == frozen
        gc.collect()
        assert gone() is None, "a garbage cycle was frozen by the load"
    finally:
        if gc.get_freeze_count() != frozen:
            gc.unfreeze()
        s.close()


def test_no_collection_turns_the_collector_back_on_when_the_last_open_scope_ends():
    """A restore keeps the collector off from its read (entered on a worker thread) to its last
    branch built (left on the event loop): scopes overlap without nesting (``load``'s own, a
    second restore's), and the collector comes back on when the last one ends, not the first."""
    import gc

    from operate_sidecar.server.state import no_collection

    was = gc.isenabled()
    gc.enable()  # (whatever this process had: the test needs it on to see it turned off)
    first, second = no_collection(), no_collection()
    first.__enter__()
    try:
        second.__enter__()
        try:
            first.__exit__(None, None, None)
            assert not gc.isenabled(), "the first scope to end turned the collector on under the other"
        finally:
            second.__exit__(None, None, None)
        assert gc.isenabled()
    finally:
        if not was:
            gc.disable()
