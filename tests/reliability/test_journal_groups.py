"""The journal writes each flush's records of a branch as one line (issue 5 §1): a crash
mid-write loses a whole group (e.g. one operate's messages) or nothing, never half of it;
a flush can be limited to the branches the caller is answering for."""

from __future__ import annotations

import json
import os

from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import Journal


def _ids(loaded) -> list[str]:
    return [m.id for m in loaded[0].messages]


def _group(b: Branch, n: int) -> None:
    b.messages.add("instruction", {"instruction": f"q{n}"})
    req = b.messages.add("action_request", {"callId": f"c{n}", "function": "f", "arguments": {}})
    b.messages.add("action_response", {"callId": f"c{n}", "requestId": req.id, "function": "f", "arguments": {},
                                       "output": n})


def test_one_flush_of_a_branch_is_one_line(tmp_path):
    j = Journal(str(tmp_path))
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1})
    _group(b, 1)
    j.flush()
    path = os.path.join(str(tmp_path), "branches", f"{b.id}.log")
    lines = open(path, encoding="utf-8").read().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["t"] == "batch"
    assert _ids(Journal(str(tmp_path)).load()) == [m.id for m in b.messages]


def test_a_torn_group_is_dropped_whole(tmp_path):
    j = Journal(str(tmp_path))
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1})
    j.flush()
    before = [m.id for m in b.messages]
    _group(b, 2)
    j.flush()
    path = os.path.join(str(tmp_path), "branches", f"{b.id}.log")
    data = open(path, "rb").read()
    for cut in (1, 40, len(data.splitlines(keepends=True)[-1]) - 1):  # the last line torn anywhere
        with open(path, "wb") as fh:
            fh.write(data[:-cut])
        loaded = Journal(str(tmp_path)).load()
        assert _ids(loaded) == before                  # no instruction or action_request without its response


def test_flush_can_be_limited_to_some_branches(tmp_path):
    j = Journal(str(tmp_path))
    a, b = Branch(name="a"), Branch(name="b")
    j.attach(a, {"name": "a", "createdAt": 1})
    j.attach(b, {"name": "b", "createdAt": 2})
    j.flush()
    _group(a, 1)
    _group(b, 1)                                       # b's operate is still running
    j.flush({a.id})
    assert j.dirty({b.id}) and not j.dirty({a.id})
    loaded = {lb.id: lb for lb in Journal(str(tmp_path)).load()}
    assert len(loaded[a.id].messages) == 3 and len(loaded[b.id].messages) == 0


def test_a_batch_after_a_snapshot_is_not_replayed_twice(tmp_path):
    j = Journal(str(tmp_path), compact_after=4)
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1})
    _group(b, 1)
    j.flush()                                          # 5 records ≥ 4: snapshot, empty log
    _group(b, 2)
    j.flush()
    assert _ids(Journal(str(tmp_path)).load()) == [m.id for m in b.messages]


def _lines(tmp_path, b: Branch) -> list[dict]:
    path = os.path.join(str(tmp_path), "branches", f"{b.id}.log")
    return [json.loads(line) for line in open(path, encoding="utf-8").read().splitlines()]


def test_a_meta_only_flush_leaves_a_running_group_pending(tmp_path):
    """authorizeTool mid-operate: the policy is written on its own line, the operate's messages
    recorded so far stay pending and later go out whole, and replay keeps both."""
    j = Journal(str(tmp_path))
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1, "policy": {}})
    j.flush()
    before = [m.id for m in b.messages]
    b.messages.add("instruction", {"instruction": "q1"})        # the operate has started
    j.update_meta(b.id, {"policy": {"f": "deny"}})                # authorizeTool on b
    assert j.dirty({b.id}, messages=False)
    j.flush({b.id}, messages=False)
    assert not j.dirty({b.id}, messages=False) and j.dirty({b.id})
    last = _lines(tmp_path, b)[-1]
    assert last["t"] == "meta" and last["meta"]["policy"] == {"f": "deny"}
    loaded = Journal(str(tmp_path)).load()[0]
    assert [m.id for m in loaded.messages] == before and loaded.meta["policy"] == {"f": "deny"}
    req = b.messages.add("action_request", {"callId": "c1", "function": "f", "arguments": {}})
    b.messages.add("action_response", {"callId": "c1", "requestId": req.id, "function": "f", "arguments": {},
                                       "output": 1})
    j.flush({b.id})                                               # the operate's own flush
    assert _lines(tmp_path, b)[-1]["t"] == "batch" and len(_lines(tmp_path, b)[-1]["r"]) == 3
    loaded = Journal(str(tmp_path)).load()[0]
    assert [m.id for m in loaded.messages] == [m.id for m in b.messages]   # not skipped by sequence number
    assert loaded.meta == {"name": "b", "createdAt": 1, "policy": {"f": "deny"}}


def test_sequence_numbers_follow_the_file(tmp_path):
    j = Journal(str(tmp_path))
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1})
    j.flush()
    _group(b, 1)
    j.update_meta(b.id, {"policy": {"f": "allow"}})
    j.flush(messages=False)
    j.update_meta(b.id, {"policy": {"f": "ask"}})
    j.flush()
    seqs = []
    for line in _lines(tmp_path, b):
        seqs += [r["s"] for r in line["r"]] if line["t"] == "batch" else [line["s"]]
        assert line["s"] == seqs[-1]
    assert seqs == list(range(1, len(seqs) + 1))
    assert _lines(tmp_path, b)[-1]["r"][0]["t"] == "meta"         # a changed meta heads the group


def test_a_meta_change_during_a_group_goes_out_with_it(tmp_path):
    """allow_always mid-operate: the meta joins the operate's own line (nothing extra is written)."""
    j = Journal(str(tmp_path))
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1})
    j.flush()
    n = len(_lines(tmp_path, b))
    b.messages.add("instruction", {"instruction": "q"})
    j.update_meta(b.id, {"policy": {"f": "allow"}})
    b.messages.add("assistant_response", {"text": "a"})
    j.flush({b.id})
    lines = _lines(tmp_path, b)
    assert len(lines) == n + 1 and [r["t"] for r in lines[-1]["r"]] == ["meta", "msg", "msg"]
    loaded = Journal(str(tmp_path)).load()[0]
    assert loaded.meta["policy"] == {"f": "allow"} and len(loaded.messages) == 3


def test_a_torn_meta_line_loses_only_the_meta(tmp_path):
    j = Journal(str(tmp_path))
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1, "policy": {}})
    _group(b, 1)
    j.flush()
    j.update_meta(b.id, {"policy": {"f": "deny"}})
    j.flush(messages=False)
    path = os.path.join(str(tmp_path), "branches", f"{b.id}.log")
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[:-5])
    loaded = Journal(str(tmp_path)).load()[0]
    assert _ids([loaded]) == [m.id for m in b.messages] and loaded.meta["policy"] == {}


def test_compaction_waits_for_a_pending_group_and_keeps_the_meta(tmp_path):
    j = Journal(str(tmp_path), compact_after=3)
    b = Branch(system="sys", name="b")
    j.attach(b, {"name": "b", "createdAt": 1})
    j.flush()                                                     # 2 records
    b.messages.add("instruction", {"instruction": "q"})           # an operate is running
    j.update_meta(b.id, {"policy": {"f": "deny"}})
    j.flush(messages=False)                                       # 3 records, but a group is pending
    snap = os.path.join(str(tmp_path), "branches", f"{b.id}.snap")
    assert not os.path.exists(snap)
    b.messages.add("assistant_response", {"text": "a"})
    j.flush()                                                     # now compacted
    assert os.path.exists(snap)
    assert os.path.getsize(os.path.join(str(tmp_path), "branches", f"{b.id}.log")) == 0
    j.update_meta(b.id, {"policy": {"f": "allow"}})
    j.flush(messages=False)                                       # after the snapshot: replayed
    loaded = Journal(str(tmp_path)).load()[0]
    assert _ids([loaded]) == [m.id for m in b.messages] and loaded.meta["policy"] == {"f": "allow"}
