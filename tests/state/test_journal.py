"""The branch journal: every flushed message comes back, torn tails are cut,
compaction keeps the same state, clears and deletes are honoured."""

from __future__ import annotations

import json
import os

from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import Journal


def _branch_with(journal: Journal, n: int, *, system: str | None = "sys") -> Branch:
    b = Branch(system=system, name="b")
    journal.attach(b, {"name": "b", "createdAt": 1})
    for i in range(n):
        b.messages.add("instruction", {"instruction": f"q{i}"})
    return b


def _log_path(tmp_path, b: Branch) -> str:
    return os.path.join(str(tmp_path), "branches", f"{b.id}.log")


def _flushed(tmp_path, n: int) -> tuple[Journal, Branch, str, int]:
    """A journal with a branch of ``n`` instructions, flushed: (journal, branch, log path, log size)."""
    j = Journal(str(tmp_path))
    b = _branch_with(j, n)
    j.flush()
    path = _log_path(tmp_path, b)
    return j, b, path, os.path.getsize(path)


def test_flushed_messages_come_back_in_order(tmp_path):
    j = Journal(str(tmp_path))
    b = _branch_with(j, 5)
    j.flush()
    loaded = Journal(str(tmp_path)).load()
    assert [lb.id for lb in loaded] == [b.id]
    assert [m.id for m in loaded[0].messages] == [m.id for m in b.messages]
    assert loaded[0].meta["name"] == "b"


def test_unflushed_records_are_not_on_disk(tmp_path):
    j = Journal(str(tmp_path))
    b = _branch_with(j, 2)
    j.flush()
    b.messages.add("instruction", {"instruction": "late"})
    assert j.dirty()
    loaded = Journal(str(tmp_path)).load()
    assert len(loaded[0].messages) == 3  # system + 2, not the unflushed one


def test_torn_tail_is_dropped_and_cut_off(tmp_path):
    j, b, path, size = _flushed(tmp_path, 3)
    with open(path, "ab") as fh:
        fh.write(b'{"s": 99, "t": "msg", "m": {"id": "x", "ki')
    loaded = Journal(str(tmp_path)).load()
    assert len(loaded[0].messages) == 4
    assert os.path.getsize(path) == size


def test_compaction_snapshot_then_log_replay(tmp_path):
    j = Journal(str(tmp_path), compact_after=4)
    b = _branch_with(j, 6)
    j.flush()  # > 4 records: compacted
    assert os.path.exists(os.path.join(str(tmp_path), "branches", f"{b.id}.snap"))
    b.messages.add("instruction", {"instruction": "after"})
    j.flush()
    loaded = Journal(str(tmp_path)).load()
    assert [m.content.get("instruction") for m in loaded[0].messages][-1] == "after"
    assert [m.id for m in loaded[0].messages] == [m.id for m in b.messages]


def test_stale_log_after_snapshot_is_not_replayed_twice(tmp_path):
    """A crash between writing the snapshot and emptying the log leaves records
    the snapshot already holds; sequence numbers keep them from doubling."""
    j = Journal(str(tmp_path), compact_after=10_000)
    b = _branch_with(j, 3)
    j.flush()
    path = _log_path(tmp_path, b)
    with open(path, encoding="utf-8") as fh:
        old_log = fh.read()
    j.compact(b.id)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(old_log)
    loaded = Journal(str(tmp_path)).load()
    assert len(loaded[0].messages) == len(b.messages)


def test_clear_keeps_only_system_after_reload(tmp_path):
    j = Journal(str(tmp_path))
    b = _branch_with(j, 3)
    b.messages.clear()
    b.messages.add("instruction", {"instruction": "fresh"})
    j.flush()
    loaded = Journal(str(tmp_path)).load()
    assert [m.kind for m in loaded[0].messages] == ["system", "instruction"]


def test_delete_removes_the_branch(tmp_path):
    j = Journal(str(tmp_path))
    b = _branch_with(j, 1)
    j.flush()
    j.delete(b.id)
    assert Journal(str(tmp_path)).load() == []


def test_adopted_branch_keeps_journaling(tmp_path):
    j = Journal(str(tmp_path))
    b = _branch_with(j, 1)
    j.flush()
    j2 = Journal(str(tmp_path))
    lb = j2.load()[0]
    from operate_sidecar.server.core.messages import MessageLog

    b2 = Branch(id=lb.id, messages=MessageLog(lb.messages))
    j2.adopt(b2, lb.meta)
    b2.messages.add("instruction", {"instruction": "more"})
    j2.flush()
    again = Journal(str(tmp_path)).load()[0]
    assert len(again.messages) == len(b.messages) + 1
    assert json.loads(json.dumps(again.meta)) == {"name": "b", "createdAt": 1}


def test_update_meta_is_written_by_a_meta_only_flush(tmp_path):
    j = Journal(str(tmp_path))
    b = _branch_with(j, 1)
    j.flush()
    b.messages.add("instruction", {"instruction": "pending"})
    j.update_meta(b.id, {"policy": {"t": "deny"}})
    j.flush(messages=False)
    loaded = Journal(str(tmp_path)).load()[0]
    assert loaded.meta == {"name": "b", "createdAt": 1, "policy": {"t": "deny"}}
    assert len(loaded.messages) == 2                               # the pending instruction is not on disk
    assert not j.dirty(messages=False) and j.dirty()


def test_meta_only_flush_of_an_unchanged_branch_writes_nothing(tmp_path):
    j, b, path, size = _flushed(tmp_path, 1)
    b.messages.add("instruction", {"instruction": "pending"})
    assert not j.dirty(messages=False)
    j.flush(messages=False)
    assert os.path.getsize(path) == size


def test_stale_log_after_snapshot_with_meta_lines_is_not_replayed_twice(tmp_path):
    j = Journal(str(tmp_path), compact_after=10_000)
    b = _branch_with(j, 2)
    j.flush()
    j.update_meta(b.id, {"policy": {"t": "deny"}})
    j.flush(messages=False)
    path = _log_path(tmp_path, b)
    with open(path, encoding="utf-8") as fh:
        old_log = fh.read()
    j.compact(b.id)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(old_log)                                          # a crash before the log was emptied
    j2 = Journal(str(tmp_path))
    lb = j2.load()[0]
    assert len(lb.messages) == len(b.messages) and lb.meta["policy"] == {"t": "deny"}
    from operate_sidecar.server.core.messages import MessageLog

    b2 = Branch(id=lb.id, messages=MessageLog(lb.messages))
    j2.adopt(b2, lb.meta)
    j2.update_meta(b2.id, {"policy": {"t": "allow"}})
    b2.messages.add("instruction", {"instruction": "more"})
    j2.flush()                                                     # sequence numbers continue past both
    again = Journal(str(tmp_path)).load()[0]
    assert len(again.messages) == len(b.messages) + 1 and again.meta["policy"] == {"t": "allow"}
