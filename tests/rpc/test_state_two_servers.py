"""Two real servers on one ``stateDir`` (README: "Several servers may share one ``stateDir``"):
a damaged database found by both is rebuilt once, by one of them, and nothing acknowledged is
lost; operates from both on one branch both count in its usage totals; an operate on a branch
the other server deleted meanwhile says the branch is gone."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time

from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import DB_FILE, StateStore

from .support import TIMEOUT, RpcError, scripted, wait_log

STATE_NOT_SAVED = -32013


def _start(spawn, state: str, *replies, log_level: str = "warning"):
    c = spawn("--log-level", log_level)
    c.init(models={"m": scripted(*(replies or ("r",)))}, defaultModel="m", stateDir=state)
    return c


def _ids(c) -> set[str]:
    return {b["branchId"] for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"]}


def _aside(state: str) -> list[str]:
    return sorted(f for f in os.listdir(state) if ".damaged-" in f and not f.endswith(("-wal", "-shm")))


def _damaged_store(state: str, n: int) -> None:
    """A database of ``n`` branches of two messages, with one damaged page."""
    s = StateStore(state)
    b = Branch(system="sys", name="seed")
    s.attach(b, {"name": "seed", "createdAt": 1})
    b.messages.add("instruction", {"instruction": "q"})
    s.flush()
    s.close()
    path = os.path.join(state, DB_FILE)
    con = sqlite3.connect(path)
    meta, created = con.execute("SELECT meta, created_at FROM branches").fetchone()
    rows = con.execute("SELECT seq, msg_id, record FROM messages").fetchall()
    with con:
        for j in range(n - 1):
            bid = f"c{j:06d}"
            con.execute("INSERT INTO branches VALUES (?,?,?,1,0)", (bid, meta, created + j))
            con.executemany("INSERT INTO messages VALUES (?,?,?,?)", [(bid, q, f"{m}-{j}", r) for q, m, r in rows])
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    with open(path, "r+b") as fh:                               # one damaged page: the rest is readable
        fh.seek(os.path.getsize(path) - 4096)
        fh.write(b"\xa5" * 64)


def test_a_server_started_while_another_rebuilds_the_damaged_database_waits_and_loses_nothing(spawn, tmp_path):
    """Server A found the database damaged, set it aside and copies what it can into a fresh
    file (one transaction per branch: seconds for a large one). Server B, started meanwhile,
    took A's fresh file for a rebuild a stopped server had left, copied along into it and told
    its user "... when the server stopped; finished now"; started a moment earlier, it found the
    damage too and set A's half-filled file aside as damaged (A's connection then wrote to the
    file moved aside: every later change A acknowledged was lost). B now waits for A's rebuild
    and uses the rebuilt file. (The test holds the fresh file's write lock a moment, so that A's
    rebuild is surely still running when B opens the store.)"""
    state = str(tmp_path / "state")
    path = os.path.join(state, DB_FILE)
    _damaged_store(state, 3000)
    a, b = _start(spawn, state), _start(spawn, state, log_level="info")
    for c in (a, b):
        c.request("listTools", {}, timeout=TIMEOUT)             # loaded: the store opens right at the first need
    pending = a.request_async("listBranches", {})               # A checks, sets the file aside, rebuilds

    def rebuilding() -> bool:
        if not _aside(state) or not os.path.exists(path):
            return False
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
                return con.execute("SELECT value FROM info WHERE key='salvaging'").fetchone() is not None
        except sqlite3.Error:
            return False

    deadline = time.monotonic() + TIMEOUT
    while not rebuilding() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert rebuilding(), "server A did not start rebuilding the damaged database"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")                           # A's next copied branch waits (busy timeout 10 s)
    try:
        assert holder.execute("SELECT value FROM info WHERE key='salvaging'").fetchone() is not None, \
            "server A's rebuild ended before the test could hold it"
        seen = b.request_async("listBranches", {})              # B opens while A rebuilds ...
        assert wait_log(b, "waiting for it", 8.0), b.stderr_text()[-2000:]   # ... and waits for it
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    kept = {x["branchId"] for x in pending.result(TIMEOUT)["branches"]}
    assert len(kept) >= 2900
    assert {x["branchId"] for x in seen.result(TIMEOUT)["branches"]} == kept   # the whole rebuild
    told_a = [p["message"] for m, p in a.notifications if m == "window/logMessage"]
    told_b = [p["message"] for m, p in b.notifications if m == "window/logMessage"]
    assert len([t for t in told_a if "is damaged" in t]) == 1, told_a
    assert not [t for t in told_b if "rebuilt" in t or "stopped" in t or "damaged" in t], told_b
    assert len(_aside(state)) == 1                              # set aside once
    new_a, new_b = a.branch(name="after-a"), b.branch(name="after-b")
    assert {new_a, new_b} <= _ids(a) and {new_a, new_b} <= _ids(b)
    for c in (a, b):
        c.kill()
        c.wait(TIMEOUT)
    r = _start(spawn, state)
    assert _ids(r) == kept | {new_a, new_b}                     # every acknowledged branch
    r.close()


def test_operates_from_two_servers_on_one_branch_both_count_in_its_usage(spawn, tmp_path):
    """B's operate on the branch is saved while A's runs: A's save found the branch changed
    and wrote its own totals whole (the branch counted one operate of the two)."""
    state = str(tmp_path / "state")
    a = _start(spawn, state, {"text": "A-reply", "delayMs": 1500})
    b = _start(spawn, state, "B-reply")
    bid = a.branch(system="sys")
    pending = a.request_async("operate", {"branchId": bid, "instruction": "A-task", "workDoneToken": "t"})
    assert a.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)   # A's model call runs
    assert b.request("operate", {"branchId": bid, "instruction": "B-task"}, timeout=TIMEOUT)["result"] == "B-reply"
    assert pending.result(TIMEOUT)["result"] == "A-reply"

    def usage(c) -> dict:
        [br] = c.request("listBranches", {}, timeout=TIMEOUT)["branches"]
        return br["usage"]

    assert usage(a)["modelCalls"] == usage(b)["modelCalls"] == 2
    a.close()
    b.close()
    r = _start(spawn, state)
    assert usage(r)["modelCalls"] == 2
    r.close()


def test_an_operate_on_a_branch_another_server_deleted_says_the_branch_is_gone(spawn, tmp_path):
    """Its save fails (-32013): the answer said "the branch is as it was before it", though
    the branch no longer existed (the next request on it is -32012)."""
    state = str(tmp_path / "state")
    a = _start(spawn, state, {"text": "late", "delayMs": 1500})
    b = _start(spawn, state)
    bid = a.branch(name="x")
    pending = a.request_async("operate", {"branchId": bid, "instruction": "runs", "workDoneToken": "t"})
    assert a.wait_for(lambda n: any(m == "$/progress" for m, _ in n), TIMEOUT)   # A's model call runs
    assert b.request("deleteBranch", {"branchId": bid}, timeout=TIMEOUT) == {}
    try:
        pending.result(TIMEOUT)
        raise AssertionError("the operate on a deleted branch was acknowledged")
    except RpcError as e:
        assert e.code == STATE_NOT_SAVED, e
        assert "deleted by another process" in e.message and "the branch no longer exists" in e.message, e.message
        assert "as it was before" not in e.message
    assert a.error_of("branchMessages", {"branchId": bid}).code == -32012
    a.close()
    # another server's delete is no fault of this one: a warning, not an ERROR line (log watchers flag those)
    said = [line for line in a.stderr_text().splitlines() if "could not save branch" in line]
    assert said and all("WARNING" in line and "ERROR" not in line for line in said), said
    b.close()
