"""A long branch (tens of thousands of messages) forked, or read in one large ``branchMessages``
page, holds up no other request: the fork's copy is made on a worker thread, the page is made
and encoded a slice at a time (a fork of 100,000 messages held every request up for 2.5 s, a
page of them for 1.1 s). The fork is still on disk before its answer."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from operate_sidecar.server import redaction
from operate_sidecar.server.core import Branch
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.rpc.server import encode_page
from operate_sidecar.server.rpc.transport import Connection, Encoded, dumps
from operate_sidecar.server.service.service import Service
from operate_sidecar.server.state import StateStore
from operate_sidecar.server.state import store as store_module

from .support import TIMEOUT, scripted

#: messages of the long branch
LONG = 50_000


def _long_branch(state: str) -> str:
    """A stored branch of ``LONG`` messages (prompts and replies), written by the real store."""
    s = StateStore(state)
    b = Branch(name="long")
    s.attach(b, {"name": "long", "createdAt": 1})
    for i in range(LONG // 2):
        b.messages.add("instruction", {"instruction": f"prompt {i}"}, sender="user")
        b.messages.add("assistant_response", {"text": f"reply {i}"})
    s.flush()
    s.close()
    return b.id


def _started(spawn, state: str):
    c = spawn()
    c.init(models={"m": scripted("r")}, defaultModel="m", stateDir=state)
    c.request("listBranches", {}, timeout=TIMEOUT * 3)  # the store restored
    return c


def test_a_fork_of_a_long_branch_lets_other_requests_through_and_is_saved(spawn, tmp_path):
    state = str(tmp_path / "state")
    src = _long_branch(state)
    c = _started(spawn, state)
    fork = c.request_async("forkBranch", {"branchId": src})
    listed = c.request("listBranches", {}, timeout=TIMEOUT)["branches"]
    # served while the fork was built: answered before it, and the fork not there yet
    assert not fork.done() and [b["branchId"] for b in listed] == [src]
    fid = fork.result(TIMEOUT * 3)["branchId"]
    counts = {b["branchId"]: b["messageCount"] for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"]}
    assert counts == {src: LONG, fid: LONG}
    page = c.request("branchMessages", {"branchId": fid, "offset": LONG - 2, "limit": 5}, timeout=TIMEOUT)
    assert [m["content"] for m in page["messages"]] == [{"instruction": f"prompt {LONG // 2 - 1}"},
                                                        {"text": f"reply {LONG // 2 - 1}"}]
    c.close()
    again = _started(spawn, state)                                      # on disk before its answer
    counts = {b["branchId"]: b["messageCount"] for b in again.request("listBranches", {}, timeout=TIMEOUT)["branches"]}
    assert counts == {src: LONG, fid: LONG}


def test_a_large_page_of_messages_lets_other_requests_through(spawn, tmp_path):
    state = str(tmp_path / "state")
    src = _long_branch(state)
    c = _started(spawn, state)
    page = c.request_async("branchMessages", {"branchId": src, "limit": LONG})
    listed = c.request("listBranches", {}, timeout=TIMEOUT)["branches"]
    assert not page.done() and len(listed) == 1                          # answered while the page was made
    got = page.result(TIMEOUT * 3)
    assert got["total"] == LONG and len(got["messages"]) == LONG
    assert got["messages"][0]["content"]["instruction"] == "prompt 0"
    assert got["messages"][-1]["content"]["text"] == f"reply {LONG // 2 - 1}"
    assert len({m["id"] for m in got["messages"]}) == LONG


def test_a_branch_created_during_a_long_fork_is_answered_before_the_fork(spawn, tmp_path):
    """``createBranch`` takes the store's lock (its ``attach``) while the fork's worker thread
    makes the fork's records: those are made outside the lock, so it does not wait for them."""
    state = str(tmp_path / "state")
    src = _long_branch(state)
    c = _started(spawn, state)
    fork = c.request_async("forkBranch", {"branchId": src})
    made = c.request("createBranch", {}, timeout=TIMEOUT)["branchId"]
    assert not fork.done()                                               # answered before the fork
    fid = fork.result(TIMEOUT * 3)["branchId"]
    counts = {b["branchId"]: b["messageCount"] for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"]}
    assert counts == {src: LONG, fid: LONG, made: 0}


def test_a_branch_attached_on_a_worker_thread_makes_its_records_outside_the_store_lock(tmp_path, monkeypatch):
    """Made deterministic: the fork's first record is held up (on its worker thread) until the
    loop's thread has recorded a message of another branch, which takes the store's lock: it
    must get it while the records are made (held for them, the two would wait for each other
    until the time-out)."""
    s = StateStore(str(tmp_path / "state"))
    other = Branch(name="other")
    s.attach(other, {"name": "other"})
    fork = Branch(name="fork")
    for i in range(3):
        fork.messages.add("instruction", {"instruction": f"prompt {i}"}, sender="user")
    making, recorded, waited = threading.Event(), threading.Event(), []
    dumps = store_module._dumps

    def held_up(obj: Any) -> str:
        if threading.current_thread() is not threading.main_thread() and not making.is_set():
            making.set()
            waited.append(recorded.wait(5))  # (False: the lock was held meanwhile)
        return dumps(obj)

    monkeypatch.setattr(store_module, "_dumps", held_up)
    worker = threading.Thread(target=s.attach, args=(fork, {"name": "fork"}))
    worker.start()
    assert making.wait(TIMEOUT)
    other.messages.add("instruction", {"instruction": "meanwhile"})      # takes the store's lock
    recorded.set()
    worker.join(TIMEOUT)
    assert not worker.is_alive() and waited == [True]
    assert s.dirty([fork.id]) and s.dirty([other.id])
    s.flush()
    s.close()


def test_a_fork_in_flight_counts_towards_max_branches(spawn, tmp_path):
    state = str(tmp_path / "state")
    src = _long_branch(state)
    c = spawn()
    c.init(models={"m": scripted("r")}, defaultModel="m", stateDir=state, maxBranches=2)
    c.request("listBranches", {}, timeout=TIMEOUT * 3)
    fork = c.request_async("forkBranch", {"branchId": src})
    with pytest.raises(Exception) as e:                                  # the fork takes the last room
        c.request("createBranch", {}, timeout=TIMEOUT)
    assert not fork.done()                                               # refused while it was in flight
    assert getattr(e.value, "code", None) == -32602 and "maxBranches" in str(e.value), e.value
    fid = fork.result(TIMEOUT * 3)["branchId"]
    assert sorted(b["branchId"] for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"]) == sorted([src, fid])


class _Port:
    """A ``ClientPort`` with no client behind it."""

    def __init__(self, settings: dict) -> None:
        self.conn = self
        self.settings = settings
        self.client_capabilities: dict = {}
        self.workspace_folders: list[str] = []

    def log_message(self, type_: int, message: str) -> None:
        pass

    def notify(self, method: str, params: Any) -> None:
        pass

    async def request_client(self, method: str, params: Any, timeout: float | None) -> Any:
        raise RuntimeError("no client")


def test_a_fork_that_fails_once_recorded_leaves_nothing_on_disk(tmp_path):
    """A fork whose ``attach`` fails after it recorded the new branch: the fork is not made, and
    no later flush (the one on stop here) saves the half-made branch."""
    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": scripted()}, "defaultModel": "s",
                                               "stateDir": str(tmp_path / "state")}))

    async def main() -> None:
        svc = Service(_Port(settings))
        src = (await svc.createBranch({}, prime_first=False))["branchId"]
        attach = svc.journal.attach

        def failing(branch: Any, meta: dict, **kw: Any) -> None:  # on the fork's worker thread
            attach(branch, meta, **kw)                                     # recorded, then a failure
            raise OSError("no room left")

        svc.journal.attach = failing
        with pytest.raises(OSError):
            await svc.forkBranch({"branchId": src})
        svc.journal.attach = attach
        assert [b["branchId"] for b in (await svc.listBranches({}))["branches"]] == [src]
        await svc.aclose()                                                 # flushes everything pending

        again = Service(_Port(settings))                                   # a restart on the same stateDir
        await again.restore()
        assert [b["branchId"] for b in (await again.listBranches({}))["branches"]] == [src]
        await again.aclose()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT * 3))


def test_a_page_made_a_slice_at_a_time_is_masked_as_one_frame_is():
    """``encode_page`` masks every slice and the fields besides the messages (the wire sends its
    text as it is): what goes out is what the wire's masking of the whole answer would send."""
    secret = "sk-long-page-" + "q7x" * 8
    redaction.remember_secret(secret)
    messages = [{"id": f"m{i}", "content": {"text": f"before {secret} after {i}"}} for i in range(2500)]
    result = {"messages": messages, "total": 2500, "note": f"see {secret}"}
    page = asyncio.run(encode_page(result))
    framed = b'{"jsonrpc":"2.0","id":7,"result":' + page.body + b"}"
    whole = redaction.redact_bytes(dumps({"jsonrpc": "2.0", "id": 7, "result": result}), keep_id=True)
    assert secret.encode() not in framed and json.loads(framed) == json.loads(whole)
    with pytest.raises(TypeError):                                       # unmasked bytes are refused
        Connection.send_encoded_result(None, 7, page.body)  # type: ignore[arg-type]
    assert isinstance(page, Encoded)


async def _turns_meanwhile(work: Any) -> tuple[int, Any]:
    """The turns a concurrent task gets while ``work`` (awaited) runs, and what it gave: none
    when it never yields to the loop."""
    turns, done = 0, False

    async def count() -> None:
        nonlocal turns
        while not done:
            await asyncio.sleep(0)
            turns += 1

    counter = asyncio.create_task(count())
    await asyncio.sleep(0)  # (the counter started)
    before = turns
    try:
        out = await work
        return turns - before, out
    finally:
        done = True
        await counter


#: messages of a page split into slices (``PAGE_SLICE``: 1000 at a time)
SLICED = 5_000


def test_encode_page_yields_to_the_loop_between_its_slices():
    """Told apart without timing: a task running meanwhile gets turns while a page of ``SLICED``
    messages is encoded (none if it were encoded at once)."""
    result = {"messages": [{"id": f"m{i}", "content": {"text": f"reply {i}"}} for i in range(SLICED)],
              "total": SLICED}
    turns, page = asyncio.run(_turns_meanwhile(encode_page(result)))
    assert turns > 0 and json.loads(page.body) == result


def test_a_page_of_messages_is_made_yielding_to_the_loop_between_its_slices():
    """Told apart without timing: a task running meanwhile gets turns while the service makes a
    page of ``SLICED`` messages (none if it were made at once); one of a single message gives it
    none (nothing else in ``branchMessages`` yields here)."""
    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": scripted()}, "defaultModel": "s"}))

    async def main() -> None:
        svc = Service(_Port(settings))
        bid = (await svc.createBranch({}, prime_first=False))["branchId"]
        messages = svc.branch(bid).messages
        for i in range(SLICED):
            messages.add("instruction", {"instruction": f"prompt {i}"}, sender="user")
        turns, one = await _turns_meanwhile(svc.branchMessages({"branchId": bid, "limit": 1}))
        assert turns == 0 and len(one["messages"]) == 1
        turns, page = await _turns_meanwhile(svc.branchMessages({"branchId": bid, "limit": SLICED}))
        assert turns > 0 and len(page["messages"]) == SLICED and page["total"] == SLICED
        await svc.aclose()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT * 3))
