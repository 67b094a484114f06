"""Fault injection on the state store, over real pipes against the real server: a full disk
(``RLIMIT_FSIZE`` set on the running server), a state directory that turns unwritable
mid-session, a database damaged between runs, a state directory that cannot be opened, a 0.1
JSONL journal, and the restore of 100,000 messages (the event loop keeps answering).

In each: every acknowledged change survives a SIGKILL and restart, and a change that could not
be saved is answered -32013 and is absent from memory too (memory and disk agree)."""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import time

from operate_sidecar.server.core import Branch
from operate_sidecar.server.state import DB_FILE, StateStore

from .support import TIMEOUT, RpcError, scripted

STATE_NOT_SAVED = -32013


def _start(spawn, state: str, n: int = 40):
    c = spawn()
    c.init(models={"m": scripted(*[{"text": f"reply-{i}"} for i in range(n)])}, defaultModel="m", stateDir=state)
    return c


def _instructions(c, bid: str) -> list[str]:
    return [m["content"]["instruction"] for m in c.messages(bid) if m["kind"] == "instruction"]


def _operate(c, bid: str, ins: str) -> bool:
    """True when acknowledged; False when refused because the state could not be saved."""
    try:
        c.request("operate", {"branchId": bid, "instruction": ins}, timeout=TIMEOUT)
        return True
    except RpcError as e:
        assert e.code == STATE_NOT_SAVED, e
        assert "state could not be saved" in e.message, e.message
        return False


def _branch_ids(c) -> set[str]:
    return {b["branchId"] for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"]}


def _calls(c, bid: str) -> int:
    """The branch's usage total of model calls, as listBranches reports it."""
    [b] = [b for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"] if b["branchId"] == bid]
    return b["usage"]["modelCalls"]


def _restart(c, spawn, state: str):
    c.kill()
    c.wait(TIMEOUT)
    return _start(spawn, state)


def test_disk_full_refuses_the_change_keeps_memory_and_disk_equal_and_loses_nothing(spawn, tmp_path):
    state = str(tmp_path / "state")
    c = _start(spawn, state)
    bid = c.branch(name="b")
    assert _operate(c, bid, "before")
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.prlimit(c.proc.pid, resource.RLIMIT_FSIZE, (1, hard))      # the disk is full for the server
    try:
        assert not _operate(c, bid, "while-full")
        assert _instructions(c, bid) == ["before"]                      # the refused operate left nothing
        assert _calls(c, bid) == 1                                       # not even in the branch's usage totals
        with_err = c.error_of("createBranch", {"name": "full"})
        assert with_err.code == STATE_NOT_SAVED
        assert len(_branch_ids(c)) == 1                                  # the branch was not created
        err = c.error_of("authorizeTool", {"tool": "read_file", "decision": "deny", "branchId": bid})
        assert err.code in (STATE_NOT_SAVED, -32602)                     # -32602: no such tool here
    finally:
        resource.prlimit(c.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))  # the space comes back
    assert _operate(c, bid, "after-1") and _operate(c, bid, "after-2")
    r = _restart(c, spawn, state)
    assert _instructions(r, bid) == ["before", "after-1", "after-2"]   # every acknowledged operate, in order
    assert _calls(r, bid) == 3                                          # the totals saved are the acknowledged ones
    assert [m["kind"] for m in r.messages(bid)] == ["instruction", "assistant_response"] * 3
    r.close()


def _dirs(path: str) -> list[str]:
    return [root for root, _, _ in os.walk(path)]


def _lock_dir(path: str) -> str:
    """No entry can be created, renamed or removed in ``path`` or any directory under it.
    Returns how (for ``_unlock_dir``): mode 0500 when not root; as root (permission bits do
    not bind root) the immutable attribute, or where the filesystem has none, a read-only
    bind mount of ``path`` (the server's open files keep their descriptors)."""
    if os.geteuid() != 0:
        for d in _dirs(path):
            os.chmod(d, 0o500)
        return "chmod"
    done = []
    for d in _dirs(path):
        if subprocess.run(["chattr", "+i", d], capture_output=True, timeout=TIMEOUT).returncode != 0:
            for x in done:
                subprocess.run(["chattr", "-i", x], timeout=TIMEOUT)
            break
        done.append(d)
    else:
        return "chattr"
    for cmd in (["mount", "--bind", path, path], ["mount", "-o", "remount,ro,bind", path]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 0, f"cannot make {path} unwritable as root (chattr +i, then a read-only " \
                                    f"bind mount, failed): {out.stderr}"
    return "mount"


def _unlock_dir(path: str, how: str) -> None:
    if how == "mount":
        subprocess.run(["umount", "-l", path], timeout=TIMEOUT)  # lazy: a server may hold files open there
        return
    for d in _dirs(path):
        if how == "chattr":
            subprocess.run(["chattr", "-i", d], check=False, timeout=TIMEOUT)
        else:
            os.chmod(d, 0o700)


def test_an_unwritable_state_dir_mid_session_loses_nothing_acknowledged(spawn, tmp_path):
    state = str(tmp_path / "state")
    c = _start(spawn, state)
    bid = c.branch(name="b")
    acked = ["before"] if _operate(c, bid, "before") else []
    branches = {bid}
    how = _lock_dir(state)
    try:
        for i in range(3):
            if _operate(c, bid, f"locked-{i}"):
                acked.append(f"locked-{i}")
            assert _instructions(c, bid) == acked                        # memory holds what was acknowledged
            try:
                branches.add(c.branch(name=f"new-{i}"))
            except RpcError as e:
                assert e.code == STATE_NOT_SAVED, e
            assert _branch_ids(c) == branches                            # a refused branch does not exist
        c = _restart(c, spawn, state)                                    # SIGKILL and restart, still unwritable
        assert _branch_ids(c) == branches and _instructions(c, bid) == acked
        if _operate(c, bid, "locked-after-restart"):
            acked.append("locked-after-restart")
    finally:
        _unlock_dir(state, how)
    r = _restart(c, spawn, state)
    assert _branch_ids(r) == branches and _instructions(r, bid) == acked
    assert _operate(r, bid, "writable-again")
    r.close()


def test_a_cleanly_closed_database_in_an_unwritable_dir_is_served_read_only(spawn, tmp_path):
    """After a clean stop only the database file is left (no -wal, no -shm). SQLite cannot read
    a WAL database read-only where it cannot create its -shm: every acknowledged branch was
    invisible (-32012) and the directory called unusable. Its branches are served read-only."""
    state = str(tmp_path / "state")
    c = _start(spawn, state)
    bid = c.branch(name="kept")
    assert _operate(c, bid, "acknowledged")
    assert c.close() == 0
    assert sorted(os.listdir(state)) == [DB_FILE]
    how = _lock_dir(state)
    try:
        r = _start(spawn, state)
        assert _branch_ids(r) == {bid} and _instructions(r, bid) == ["acknowledged"]
        assert r.error_of("createBranch", {"name": "x"}).code == STATE_NOT_SAVED
        assert not _operate(r, bid, "refused") and _instructions(r, bid) == ["acknowledged"]
        assert [p for p in r.of("window/logMessage") if "read-only" in p["message"]], r.of("window/logMessage")
        r.close()
    finally:
        _unlock_dir(state, how)


def test_an_operate_that_cannot_be_saved_still_ends_its_progress(spawn, tmp_path):
    """The save comes after the rounds, before the answer: when it fails (-32013; here a
    trigger in the database refuses every message row) or the operate is cancelled during it,
    the one $/progress end still comes, before the answer (it was skipped: begin and reports,
    then the error)."""
    state = str(tmp_path / "state")
    c = _start(spawn, state)
    bid = c.branch(name="b")
    raw = sqlite3.connect(os.path.join(state, DB_FILE))
    raw.execute("CREATE TRIGGER boom BEFORE INSERT ON messages BEGIN SELECT RAISE(ABORT, 'injected failure'); END")
    raw.commit()
    raw.close()
    try:
        c.request("operate", {"branchId": bid, "instruction": "x", "workDoneToken": "tok"}, timeout=TIMEOUT)
        raise AssertionError("saved despite the trigger")
    except RpcError as e:
        assert e.code == STATE_NOT_SAVED, e
    kinds = [(p["value"]["kind"], p["value"].get("message")) for p in c.of("$/progress") if p["token"] == "tok"]
    assert kinds[0][0] == "begin" and kinds[-1] == ("end", "failed") and [k for k, _ in kinds].count("end") == 1
    assert c.messages(bid) == []  # and the branch is as it was
    c.close()


def _flip_pages(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        for off in range(4096, size, 4096):        # every page header but the first page's
            fh.seek(off)
            data = fh.read(16)
            fh.seek(off)
            fh.write(bytes(x ^ 0xA5 for x in data))


def test_a_database_damaged_between_runs_is_reported_kept_aside_and_replaced(spawn, tmp_path):
    state = str(tmp_path / "state")
    c = _start(spawn, state)
    bid = c.branch(name="b")
    for i in range(3):
        assert _operate(c, bid, f"op-{i}")
    assert c.close() == 0                                                # clean stop: all in the main file
    _flip_pages(os.path.join(state, DB_FILE))
    r = _start(spawn, state)
    r.request("listBranches", {}, timeout=TIMEOUT)
    logs = [p for p in r.of("window/logMessage") if p["type"] == 1 and "damaged" in p["message"]]
    assert logs, r.of("window/logMessage")
    assert "damaged" in r.stderr_text()
    aside = [f for f in os.listdir(state) if f.startswith(DB_FILE + ".damaged-") and not f.endswith(("-wal", "-shm"))]
    assert aside and aside[0] in logs[0]["message"]                    # kept, and named in the report
    nb = r.branch(name="after")                                          # the server keeps serving, durably
    assert _operate(r, nb, "after-damage")
    r2 = _restart(r, spawn, state)
    assert _instructions(r2, nb) == ["after-damage"]
    assert not [p for p in r2.of("window/logMessage") if "damaged" in p["message"]]
    r2.close()


def test_an_unusable_state_dir_refuses_changes_instead_of_going_memory_only(spawn, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = _start(spawn, str(blocker / "state"))
    err = c.error_of("createBranch", {"name": "x"})
    assert err.code == STATE_NOT_SAVED and "unusable" in err.message
    assert _branch_ids(c) == set()
    assert [p for p in c.of("window/logMessage") if p["type"] == 1 and "unusable" in p["message"]]
    c.close()
    assert "Traceback" not in c.stderr_text(), c.stderr_text()           # said in one line, not a traceback


def test_a_database_damaged_while_the_server_runs_refuses_changes_in_one_line_each(spawn, tmp_path):
    """The file's header overwritten while the server runs: every change is refused (-32013),
    memory keeps what was acknowledged, and each failure is one line on stderr. Every later
    request logged a whole traceback (the look for other processes' commits failing)."""
    state = str(tmp_path / "state")
    c = _start(spawn, state)
    bid = c.branch(name="b")
    assert _operate(c, bid, "before")
    raw = sqlite3.connect(os.path.join(state, DB_FILE))
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")                       # everything in the main file ...
    raw.close()
    with open(os.path.join(state, DB_FILE), "r+b") as fh:
        fh.write(b"garbage!" * 512)                                      # ... whose first page is gone
    assert not _operate(c, bid, "after")
    assert c.error_of("createBranch", {"name": "x"}).code == STATE_NOT_SAVED
    assert _branch_ids(c) == {bid} and _instructions(c, bid) == ["before"]
    errors = [line for line in c.stderr_text().splitlines() if " ERROR " in line]
    assert errors and "Traceback" not in c.stderr_text(), c.stderr_text()
    c.close()


def _stderr_until(c, text: str) -> str:
    """The server's stderr once it holds ``text`` (bounded: fails after ``TIMEOUT`` s)."""
    deadline = time.monotonic() + TIMEOUT
    while text not in (err := c.stderr_text()):
        assert time.monotonic() < deadline, f"not on stderr within {TIMEOUT} s: {text!r}\n{err[-3000:]}"
        time.sleep(0.05)
    return err


def test_a_damaged_page_met_while_giving_space_back_is_one_line(spawn, tmp_path):
    """A page damaged on disk while the server runs, met only by the thread that gives the pages
    of a deleted branch back: the delete is acknowledged, and the failure is one warning line.
    It was a whole traceback (a damaged page is SQLite's ``DatabaseError``, not the
    ``OperationalError`` that was caught), after every later delete too (said once here:
    tests/state/test_store_space.py)."""
    state = str(tmp_path / "state")
    s = StateStore(state)
    ids = []
    for name, n in (("A", 30_000), ("B", 10_000)):
        b = Branch(system="sys", name=name)
        s.attach(b, {"name": name, "createdAt": 1})
        for i in range(n):
            b.messages.add("instruction", {"instruction": f"q{i}"})
        ids.append(b.id)
    s.flush()
    s.close()                                                            # everything in the main file
    c = spawn()
    c.init(models={"m": scripted("ok")}, defaultModel="m", stateDir=state)
    assert _branch_ids(c) == set(ids)                                    # read while it was whole
    path = os.path.join(state, DB_FILE)
    with open(path, "r+b") as fh:                                        # the file's last page (B's) garbled
        fh.seek(os.path.getsize(path) - 4096)
        fh.write(b"\xff" * 16)
    other = sqlite3.connect(path, isolation_level=None)                  # another process commits: the
    other.execute("INSERT OR REPLACE INTO info(key, value) VALUES ('probe', 'x')")  # server reads from disk again
    other.close()
    c.request("deleteBranch", {"branchId": ids[0]}, timeout=TIMEOUT)     # acknowledged; its pages freed
    err = _stderr_until(c, "could not give the free space")
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "could not give the free space" in line]
    assert len(said) == 1 and " WARNING " in said[0] and "malformed" in said[0], said
    assert ids[0] not in _branch_ids(c)
    c.close()


def test_a_jsonl_journal_from_0_1_is_imported_over_the_wire(spawn, tmp_path):
    state = tmp_path / "state"
    (state / "branches").mkdir(parents=True)
    recs = [{"s": 1, "t": "meta", "meta": {"name": "old", "createdAt": 1}}]
    for i in range(4):
        recs.append({"s": i + 2, "t": "msg", "m": {"id": f"m{i}", "kind": "instruction", "sender": "user",
                                                   "recipient": None, "created_at": 1.0,
                                                   "content": {"instruction": f"q{i}"}}})
    lines = [json.dumps(r) for r in recs]
    lines.insert(2, '{"s": 99, "t": "msg", "m": {"id"')                 # one damaged line in the middle
    (state / "branches" / "old1.log").write_text("\n".join(lines) + "\n")
    c = _start(spawn, str(state))
    assert _branch_ids(c) == {"old1"}
    assert _instructions(c, "old1") == ["q0", "q1", "q2", "q3"]           # the records after it are kept
    assert _operate(c, "old1", "new")
    r = _restart(c, spawn, str(state))
    assert _instructions(r, "old1") == ["q0", "q1", "q2", "q3", "new"]   # imported once, not twice
    r.close()


def test_ping_is_answered_while_100000_messages_are_restored(spawn, tmp_path):
    state = str(tmp_path / "state")
    s = StateStore(state)
    b = Branch(system="sys", name="big")
    s.attach(b, {"name": "big", "createdAt": 1})
    for i in range(100_000):
        b.messages.add("instruction", {"instruction": f"q{i}"})
    s.flush()
    s.close()
    c = _start(spawn, state)
    c.request("listTools", {}, timeout=TIMEOUT)                          # the server is fully loaded
    pending = c.request_async("listBranches", {})                       # starts the restore
    answered_during = 0
    while not pending.done():
        c.request("ping", timeout=TIMEOUT)
        if not pending.done():
            answered_during += 1
    # a loop blocked by the restore answers only the few pings read before the restore began
    # (3 when measured); a restore off the loop answers them throughout (thousands when measured)
    assert answered_during >= 20, f"only {answered_during} pings answered while the branches were restored"
    assert pending.result(60)["branches"][0]["messageCount"] == 100_001
    c.close()


def test_a_change_cancelled_while_it_is_being_saved_answers_what_happened_and_memory_equals_disk(spawn, tmp_path):
    """createBranch, forkBranch, deleteBranch and authorizeTool cancelled while their commit
    waits for the database (another process holds its write lock): each is saved to its end and
    answers its real outcome. Cancelled, the delete went on on disk while memory kept the branch
    (its next operate was acknowledged and saved nowhere), and the new branches stayed in
    memory, unsaved, behind a -32800."""
    state = str(tmp_path / "state")
    c = spawn()
    c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
        "models": {"m": scripted("reply")}, "defaultModel": "m", "stateDir": state}}, timeout=TIMEOUT)
    gone, kept = c.branch(name="gone"), c.branch(name="kept")

    def cancelled_while_saved(method: str, params: dict):
        """``method`` sent while another process holds the database's write lock (its commit
        waits: busy timeout 10 s), then cancelled; its outcome once the lock is free. One change
        at a time: a second one sent meanwhile would wait behind the first's commit before it
        began anything (a cancel then stops it before any effect: -32800, rightly)."""
        holder = sqlite3.connect(os.path.join(state, DB_FILE), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            pending = c.request_async(method, params)
            # served after the change's first step, which runs up to its commit (waiting for the lock)
            assert c.request("listTools", {})["tools"]
            c.cancel(pending.id)
            assert c.request("ping") == {}  # answered in order: the cancel has arrived
        finally:
            holder.execute("COMMIT")
            holder.close()
        return pending.result(TIMEOUT)

    deleted = cancelled_while_saved("deleteBranch", {"branchId": gone})
    created = cancelled_while_saved("createBranch", {"name": "new"})
    forked = cancelled_while_saved("forkBranch", {"branchId": kept})
    authorized = cancelled_while_saved("authorizeTool", {"tool": "write_file", "decision": "deny", "branchId": kept})
    assert deleted == {} and authorized["decision"] == "deny"
    mem = {b["branchId"]: b["name"] for b in c.request("listBranches", {})["branches"]}
    assert mem == {kept: "kept", created["branchId"]: "new", forked["branchId"]: "kept"}
    assert c.request("listTools", {"branchId": kept})["tools"] and [
        t["policy"] for t in c.request("listTools", {"branchId": kept})["tools"] if t["name"] == "write_file"] == ["deny"]
    c.kill()
    c.wait(TIMEOUT)
    c = spawn()
    c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {"stateDir": state}}, timeout=TIMEOUT)
    assert {b["branchId"]: b["name"] for b in c.request("listBranches", {})["branches"]} == mem
    assert [t["policy"] for t in c.request("listTools", {"branchId": kept})["tools"] if t["name"] == "write_file"] \
        == ["deny"]


def test_an_operate_whose_save_is_bound_to_fail_is_refused_before_its_model_and_tools_run(spawn, tmp_path):
    """The state database deleted while the server runs: every change is refused until a restart.
    An operate then called its model and ran its tools (a file written) and only its save
    failed; it is now refused before either, and the branch is as it was."""
    ws, state = tmp_path / "ws", tmp_path / "state"
    ws.mkdir()
    call = {"json": {"action_requests": [{"function": "write_file", "arguments": {"path": "x.txt", "content": "x"}}]}}
    c = spawn()
    c.request("initialize", {"workspaceFolders": [str(ws)], "settings": {
        "models": {"m": scripted({"text": "first"}, call, call)}, "defaultModel": "m", "stateDir": str(state),
        "toolPolicy": {"write_file": "allow"}}}, timeout=TIMEOUT)
    bid = c.branch()
    assert _operate(c, bid, "first")
    for name in os.listdir(state):
        if name.startswith(DB_FILE):
            os.remove(state / name)
    for _ in range(2):
        try:
            c.request("operate", {"branchId": bid, "instruction": "write", "actions": True}, timeout=TIMEOUT)
            raise AssertionError("the operate was answered")
        except RpcError as e:
            assert e.code == STATE_NOT_SAVED and "was not run" in e.message and "deleted or replaced" in e.message, e
        assert not (ws / "x.txt").exists()                               # no tool ran
    assert _calls(c, bid) == 1 and _instructions(c, bid) == ["first"]   # no model call; the branch as it was
