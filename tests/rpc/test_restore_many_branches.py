"""The restore of a store of many branches keeps the server answering (README: "Branches are
restored on a worker thread on first use, so the server keeps answering meanwhile"): the
branches read on the worker thread were built on the event loop in one step, 12,000 of them
froze it for 0.8 to 2.7 s; they are built a slice at a time now."""

from __future__ import annotations

import json
import os
import sqlite3

from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import DB_FILE, StateStore

from .support import TIMEOUT, scripted

N = 12_000


def _many_branches(state: str, n: int) -> None:
    """``n`` stored branches of two messages each (one made by the store, cloned in SQL), and a
    0.1 journal of one more: its import note is told (``window/logMessage``) right before the
    restored branches are built, which tells the test that the building has begun."""
    s = StateStore(state)
    b = Branch(system="sys", name="seed")
    s.attach(b, {"name": "seed", "createdAt": 1})
    b.messages.add("instruction", {"instruction": "q"})
    s.flush()
    s.close()
    con = sqlite3.connect(os.path.join(state, DB_FILE))
    meta, created = con.execute("SELECT meta, created_at FROM branches").fetchone()
    rows = con.execute("SELECT seq, msg_id, record FROM messages").fetchall()
    with con:
        for j in range(n - 1):
            bid = f"c{j:06d}"
            con.execute("INSERT INTO branches VALUES (?,?,?,1,0)", (bid, meta, created + j))
            con.executemany("INSERT INTO messages VALUES (?,?,?,?)", [(bid, q, f"{m}-{j}", r) for q, m, r in rows])
    con.close()
    os.makedirs(os.path.join(state, "branches"))
    recs = [{"s": 1, "t": "meta", "meta": {"name": "old", "createdAt": 0}},
            {"s": 2, "t": "msg", "m": {"id": "m0", "kind": "instruction", "sender": "user", "recipient": None,
                                       "created_at": 1.0, "content": {"instruction": "q0"}}}]
    with open(os.path.join(state, "branches", "old1.log"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(r) for r in recs) + "\n")


def test_ping_is_answered_while_the_branches_of_a_large_store_are_built(spawn, tmp_path):
    state = str(tmp_path / "state")
    _many_branches(state, N)
    c = spawn()
    c.init(models={"m": scripted("r")}, defaultModel="m", stateDir=state)
    c.request("listTools", {}, timeout=TIMEOUT)                          # the server is fully loaded
    pending = c.request_async("listBranches", {})                       # starts the restore
    # the import note comes once the store is read, right before the branches are built
    assert c.wait_for(lambda n: any(m == "window/logMessage" and "0.1 journal" in p["message"] for m, p in n),
                      TIMEOUT * 3)
    answered_during = 0
    while not pending.done():
        c.request("ping", timeout=TIMEOUT)
        if not pending.done():
            answered_during += 1
    # built in one step, the ping sent meanwhile is answered after listBranches (its answer is
    # written first, in the step that ends the handler); built a slice at a time, in between
    assert answered_during >= 1, "no ping was answered while the restored branches were built"
    branches = pending.result(TIMEOUT)["branches"]
    assert len(branches) == N + 1                                       # and the journal's one
    assert {b["messageCount"] for b in branches if b["branchId"] != "old1"} == {2}
    c.close()
