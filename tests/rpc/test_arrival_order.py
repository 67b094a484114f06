"""Operates run in arrival order (docs/PROTOCOL.md §2, §5): on one branch one at a time, and
waiting for one of ``maxConcurrentOperates`` slots, in the order they arrived, however long
each one's parameters take to read (a response format not seen before is built on a worker
thread, one seen before is cached: the later operate was ready first, and ran first)."""

from __future__ import annotations

import itertools

from .support import TIMEOUT, scripted

_titles = itertools.count()


def fresh_format() -> dict:
    """A response format the server has not seen (its model is built, off the event loop)."""
    props = {f"f{i}": {"type": "string", "description": f"field {i}"} for i in range(40)}
    return {"title": f"Fresh{next(_titles)}", "type": "object", "properties": {"q": {"type": "string"}, **props}}


def instructions(sidecar, bid: str) -> list[str]:
    return [m["content"]["instruction"] for m in sidecar.request("branchMessages", {"branchId": bid})["messages"]
            if m["kind"] == "instruction"]


def test_operates_on_one_branch_run_in_arrival_order_whatever_their_parameters_cost(sidecar):
    sidecar.init(models={"s": scripted(*[{"json": {"q": "x"}}] * 41)})
    bid = sidecar.branch()
    sidecar.request("operate", {"branchId": bid, "instruction": "warm", "skipValidation": True}, timeout=TIMEOUT)
    sent = []
    for i in range(20):  # every other one with a format to build, sent back to back
        params = {"branchId": bid, "instruction": f"op {i}"}
        params.update({"responseFormat": fresh_format()} if i % 2 == 0 else {"skipValidation": True})
        sent.append(sidecar.request_async("operate", params))
    for pending in sent:
        pending.result(timeout=TIMEOUT)
    assert instructions(sidecar, bid) == ["warm", *(f"op {i}" for i in range(20))]


def test_operates_waiting_for_a_slot_get_it_in_arrival_order(sidecar):
    """One slot, held by a slow operate; A (a format to build, on branch 2) arrives before B (a
    format already built, on branch 3): A takes the slot first, so the model's first reply
    after the slow one is A's. (A's format is built in milliseconds: the slow reply's 5 s
    leave it waiting for the slot well before the slot frees, as the rule needs: an operate
    still reading its parameters when a slot frees does not hold it.)"""
    seen = {"title": "Seen", "type": "object", "properties": {"q": {"type": "string"}}}
    sidecar.init(models={"s": scripted({"json": {"q": "warm"}}, {"text": "slow", "delayMs": 5000},
                                       {"json": {"q": "first"}}, {"json": {"q": "second"}})},
                 maxConcurrentOperates=1)
    b1, b2, b3 = (sidecar.branch() for _ in range(3))
    sidecar.request("operate", {"branchId": b1, "instruction": "warm", "responseFormat": seen}, timeout=TIMEOUT)
    slow = sidecar.request_async("operate", {"branchId": b1, "instruction": "slow", "skipValidation": True})
    a = sidecar.request_async("operate", {"branchId": b2, "instruction": "A", "responseFormat": fresh_format()})
    b = sidecar.request_async("operate", {"branchId": b3, "instruction": "B", "responseFormat": seen})
    slow.result(timeout=TIMEOUT)
    assert a.result(timeout=TIMEOUT)["result"]["q"] == "first"
    assert b.result(timeout=TIMEOUT)["result"]["q"] == "second"
