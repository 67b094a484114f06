"""Oversize bodies (docs/PROTOCOL.md §1): with a small ``maxMessageBytes`` set in
initialize, any body larger than it is skipped with a -32600 response (one whose head is a
client's answer: with none) and the stream stays in sync; a body at the limit is handled
normally. One server for the module."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frame_model import expect_for_body, header_block, json_values, non_json_bodies
from operate_sidecar.server.rpc.framing import looks_like_answer

from fuzz_support import FuzzServer, fuzz_server_fixture, profile, run_example, sane

LIMIT = 2048
INIT = {"clientInfo": {"name": "fuzz-oversize"},
        "settings": {"models": {"s": {"provider": "scripted", "responses": ["ok"] * 5}}, "maxMessageBytes": LIMIT}}

PROFILES = [pytest.param(profile("fast", 40), id="fast"),
            pytest.param(profile("stress", 1500), id="stress", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def server():
    yield from fuzz_server_fixture(FuzzServer(INIT, "oversize"))


@st.composite
def sized_bodies(draw):
    """(body, id or None): a request padded to a size around and above the limit, or junk bytes."""
    size = draw(st.integers(LIMIT - 3, LIMIT + 3) | st.integers(LIMIT + 1, 4 * LIMIT) | st.integers(LIMIT, 40 * LIMIT))
    if draw(st.booleans()):
        mid = draw(st.integers(-2**31, 2**31) | st.text(max_size=10))
        head = {"jsonrpc": "2.0", "id": mid, "method": "ping", "params": {"pad": ""}}
        extra = draw(st.dictionaries(st.text(max_size=4).filter(lambda k: k not in head), json_values, max_size=2))
        head.update(extra)
        base = json.dumps(head, ensure_ascii=False).encode()
        pad = max(0, size - len(base))
        head["params"]["pad"] = "x" * pad
        return json.dumps(head, ensure_ascii=False).encode(), mid
    junk = draw(non_json_bodies)
    return (junk * (size // max(1, len(junk)) + 1))[:size] if junk else b"x" * size, None


@pytest.mark.parametrize("prof", PROFILES)
def test_body_over_max_message_bytes_is_skipped_with_invalid_request(server, prof):
    @prof
    @given(sized_bodies(), st.data())
    def inner(body_id, data):
        body, mid = body_id
        junk = data.draw(header_block(len(body))) + body

        def check():
            c = server.c
            n0 = len(c.unmatched)
            pending = c.expect(mid) if mid is not None else None
            try:
                c.send_raw(junk)
                server.sync()
                new = c.unmatched[n0:]
                for m in new:
                    sane(m)
                if len(body) > LIMIT and looks_like_answer(body[:4096]):
                    # the head of a client's answer (junk cut from a response, repeated): skipped
                    # and never answered (docs/PROTOCOL.md §1; no request of ours has its id)
                    assert new == [], f"an answer of {len(body)} bytes was answered: {new}"
                elif len(body) > LIMIT:
                    # skipped: one -32600, with the request's id when it could be read, else null
                    got = ([pending._msg] if pending is not None and pending.done() else []) + new
                    assert len(got) == 1, f"expected one -32600 for a {len(body)}-byte body: {got}"
                    assert got[0]["error"]["code"] == -32600, got[0]
                    if mid is not None:
                        assert got[0].get("id") in (None, mid), got[0]
                    else:  # junk: the id is a best-effort peek at the head of the skipped bytes
                        assert got[0].get("id") is None or type(got[0]["id"]) in (int, str), got[0]
                elif mid is not None:  # read and answered: ping takes no params, so "pad" is refused by name
                    assert new == [] and pending.done() and pending._msg.get("error", {}).get("code") == -32602 \
                        and pending._msg["error"]["data"] == {"unknownFields": ["pad"]}, (new, pending._msg)
                else:
                    exp = expect_for_body(body)
                    assert len(new) == 1 and new[0]["error"]["code"] in exp.codes, (exp, new)
            finally:
                if mid is not None:
                    c._pending.pop(mid, None)

        run_example(server, "oversize", check)

    inner()
