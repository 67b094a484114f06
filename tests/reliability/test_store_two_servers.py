"""Two servers on one ``stateDir`` (two editor windows with the plugins' default state dir):
both keep working, each sees the branches the other committed, and operates from both on the
same branch each land whole (one operate's messages are never split by the other's), with
nothing acknowledged lost after both are killed."""

from __future__ import annotations

import threading

from .support import TIMEOUT, assert_consistent, scripted

N = 12  # operates per server on the shared branch


def _start(spawn, state: str, tag: str):
    c = spawn()
    c.init(models={"m": scripted(*[{"text": f"{tag}-reply-{i}", "delayMs": 20 * (i % 3)} for i in range(4 * N)])},
           defaultModel="m", stateDir=state)
    return c


def _ids(c) -> set[str]:
    return {b["branchId"] for b in c.request("listBranches", {}, timeout=TIMEOUT)["branches"]}


def _check_groups(msgs: list[dict], acked: list[str]) -> None:
    """Every acknowledged instruction is there once, directly followed by its own answer."""
    pos = {m["content"]["instruction"]: i for i, m in enumerate(msgs) if m["kind"] == "instruction"}
    for ins in acked:
        assert ins in pos, f"acknowledged operate lost: {ins}"
        nxt = msgs[pos[ins] + 1]
        assert nxt["kind"] == "assistant_response", (ins, nxt)
        assert nxt["content"]["text"].startswith(ins.split("-")[0] + "-reply-"), (ins, nxt)
    assert len(pos) == sum(1 for m in msgs if m["kind"] == "instruction")  # no duplicates
    assert_consistent(msgs)


def test_two_servers_on_one_state_dir_share_branches_and_lose_nothing(spawn, tmp_path):
    state = str(tmp_path / "state")
    a, b = _start(spawn, state, "a"), _start(spawn, state, "b")
    ba = a.branch(name="from-a")
    assert ba in _ids(b)                                          # b sees a's branch
    bb = b.branch(name="from-b")
    assert bb in _ids(a)                                          # and a sees b's
    acked: dict[str, list[str]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def run(c, tag: str) -> None:
        try:
            for i in range(N):
                ins = f"{tag}-{i}"
                c.request("operate", {"branchId": ba, "instruction": ins}, timeout=TIMEOUT)
                acked[tag].append(ins)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(a, "a")), threading.Thread(target=run, args=(b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 4)
    assert not errors, errors
    assert len(acked["a"]) == len(acked["b"]) == N
    everything = acked["a"] + acked["b"]
    for c in (a, b):                                              # both processes hold the whole branch
        _check_groups(c.messages(ba), everything)
    assert a.messages(ba) == b.messages(ba)
    tags = [m["content"]["instruction"][0] for m in a.messages(ba) if m["kind"] == "instruction"]
    assert sum(x != y for x, y in zip(tags, tags[1:])) >= 2, tags   # the two really ran at the same time
    b.request("deleteBranch", {"branchId": bb}, timeout=TIMEOUT)
    assert bb not in _ids(a)                                      # a sees the delete
    for c in (a, b):
        c.kill()
        c.wait(TIMEOUT)
    r = _start(spawn, state, "r")
    assert _ids(r) == {ba}
    msgs = r.messages(ba)
    _check_groups(msgs, everything)
    assert len(msgs) == 2 * len(everything)
    r.close()
