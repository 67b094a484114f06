"""The journal writes each flush's records of a branch as one line (issue 5 §1): a crash
mid-write loses a whole group (e.g. one operate's messages) or nothing, never half of it;
a flush can be limited to the branches the caller is answering for."""

from __future__ import annotations

import json
import os

from server.core import Branch
from server.state import Journal


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
