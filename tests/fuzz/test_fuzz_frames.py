"""Hostile frames (docs/PROTOCOL.md §1): one server process for the module; after every
junk input a well-formed ping with a fresh id must be answered (alive, in sync), stdout
must carry only frames, and the junk itself must get the answer docs/PROTOCOL.md §1 names:
-32700 with id null for a body that is not JSON, -32600 for JSON that is not a request
(batches included), the request's own answer otherwise."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_support import FuzzServer, SYNC_TIMEOUT, frame, fuzz_server_fixture, profile, run_example, sane
from frame_model import (EOL, MISSING, Expect, bad_header_block, expect_for_body, garbage_lines, garbage_prefix,
                         header_block,
                         non_json_bodies, non_request_bodies, request_bodies, request_shapes)

INIT = {"clientInfo": {"name": "fuzz-frames"},
        "settings": {"models": {"s": {"provider": "scripted", "responses": ["ok"] * 50}}}}

FAST = pytest.param(profile("fast", 40), id="fast")
STRESS = pytest.param(profile("stress", 1200), id="stress", marks=pytest.mark.slow)
PROFILES = [FAST, STRESS]


@pytest.fixture(scope="module")
def server():
    yield from fuzz_server_fixture(FuzzServer(INIT, "frames"))


# ---------------------------------------------------------------------- checks
def send_and_check(server: FuzzServer, data: bytes, expect: Expect | None) -> None:
    """Send junk bytes, then a ping; check the junk got exactly what ``expect`` says
    (None: framing junk, only sanity of whatever came back is checked)."""
    c = server.c
    n0 = len(c.unmatched)
    pending = None
    if expect is not None and expect.mode in ("id", "either"):
        pending = c.expect(expect.id)
    try:
        c.send_raw(data)
        server.sync()
        new = c.unmatched[n0:]
        for m in new:
            sane(m)
        if expect is None:
            return
        what = f"({expect.why}) for body {data[:300]!r}"
        if expect.mode == "none":
            assert new == [], f"no response expected {what}; got {new}"
        elif expect.mode == "null":
            assert len(new) == 1, f"expected one error with id null {what}; got {new}"
            assert new[0].get("id") is None and new[0].get("error", {}).get("code") in expect.codes, \
                f"expected {sorted(expect.codes)} with id null {what}; got {new[0]}"
        elif expect.mode == "either" and not pending.done():
            # transport errors are written before the ping's answer: a null-id error must be here
            assert len(new) == 1, f"expected one error (id echoed or null) {what}; got {new}"
            assert new[0].get("id") is None and new[0].get("error", {}).get("code") in expect.codes, \
                f"expected {sorted(expect.codes)} {what}; got {new[0]}"
        else:
            assert new == [], f"unexpected extra responses {what}: {new}"
            msg = server.response(pending, SYNC_TIMEOUT)
            sane(msg)
            if "result" in msg:
                assert expect.result_ok, f"expected an error {sorted(expect.codes)} {what}; got {msg}"
                if expect.result is not MISSING:
                    assert msg["result"] == expect.result, f"{what}: {msg}"
            else:
                assert msg["error"]["code"] in expect.codes, f"expected {sorted(expect.codes)} {what}; got {msg}"
    finally:
        if pending is not None:
            c._pending.pop(expect.id, None)


def run(server: FuzzServer, test: str, data: bytes, expect: Expect | None) -> None:
    # send_and_check already syncs; run_example syncs again (cheap) and handles deaths
    run_example(server, test, lambda: send_and_check(server, data, expect))


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("prof", PROFILES)
def test_header_variants_deliver_the_body_and_its_answer(server, prof):
    """Case variants of Content-Length, unknown and repeated headers, garbage lines before
    the headers (and glued to them): the body is delivered and answered as PROTOCOL says."""
    @prof
    @given(st.data())
    def inner(data):
        body = data.draw(request_bodies | non_request_bodies | non_json_bodies, label="body")
        junk = data.draw(garbage_prefix()) + data.draw(header_block(len(body))) + body
        run(server, "frames.header_variants", junk, expect_for_body(body))

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_lf_endings_missing_or_bad_lengths_keep_the_stream_in_sync(server, prof):
    """LF-only/mixed line endings, header blocks without a usable length (missing,
    negative, non-numeric) followed by a body: whatever happens, the next ping is answered."""
    @prof
    @given(st.data())
    def inner(data):
        body = data.draw(request_bodies | non_json_bodies, label="body").replace(b"\n", b" ")
        kind = data.draw(st.sampled_from(["lf", "bad"]))
        if kind == "lf":
            junk = data.draw(garbage_prefix(EOL)) + data.draw(header_block(len(body), EOL)) + body
        else:
            junk = data.draw(garbage_prefix(EOL)) + data.draw(bad_header_block()) + body
        run(server, "frames.lf_and_bad_lengths", junk, None)

    inner()


def fuzz_framed_bodies(server: FuzzServer, prof, bodies, test: str, codes: set[int] | None = None) -> None:
    """Each generated body in one well-formed frame, answered as ``expect_for_body`` says
    (and, when ``codes`` is given, the oracle names exactly those codes)."""
    @prof
    @given(bodies)
    def inner(body):
        exp = expect_for_body(body)
        if codes is not None:
            assert exp.codes == codes
        run(server, test, frame(body), exp)

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_non_json_body_gets_parse_error_with_null_id(server, prof):
    fuzz_framed_bodies(server, prof, non_json_bodies, "frames.non_json")


@pytest.mark.parametrize("prof", PROFILES)
def test_json_that_is_not_a_request_or_is_a_batch_gets_invalid_request(server, prof):
    fuzz_framed_bodies(server, prof, non_request_bodies, "frames.non_request", codes={-32600})


@pytest.mark.parametrize("prof", PROFILES)
def test_request_shaped_objects_get_the_protocol_answer(server, prof):
    """Objects missing jsonrpc/method/id, wrong types for id/method/params, unknown methods,
    response-shaped objects: -32600/-32601/-32602 or the answer, never silence or -32603."""
    @prof
    @given(request_shapes())
    def inner(msg):
        body = json.dumps(msg, ensure_ascii=False).encode()
        run(server, "frames.request_shapes", frame(body),
            expect_for_body(body))

    inner()


def deep(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "]" * depth
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    return "[" * depth + '{"a":' * 3 + "null" + "}" * 3 + "]" * depth


@pytest.mark.parametrize("prof", PROFILES)
def test_deeply_nested_json_is_answered_and_the_stream_stays_in_sync(server, prof):
    """Deep nesting is JSON too: a ping carrying it is answered (result, or an error naming the
    body), a deep top-level value gets an error with id null (-32600/-32700), never silence."""
    @prof
    @given(st.sampled_from([10, 500, 990, 1200, 3000, 20000]) | st.integers(1, 30000),
           st.sampled_from(["array", "object", "mixed"]), st.sampled_from(["top", "params", "id"]),
           st.integers(0, 2**31))
    def inner(depth, kind, where, n):
        value = deep(depth, kind)
        mid = f"deep-{n}"
        if where == "top":
            body = value.encode()
            exp = Expect("null", frozenset({-32600, -32700}), why=f"deep top-level {kind} x{depth}")
        elif where == "params":
            body = ('{"jsonrpc":"2.0","id":"%s","method":"ping","params":{"x":%s}}' % (mid, value)).encode()
            exp = Expect("either", frozenset({-32600, -32700, -32602}), mid, result_ok=True,
                         why=f"ping with deep params {kind} x{depth}")
        else:  # the nesting comes before the id: the id cannot be found cheaply
            body = ('{"jsonrpc":"2.0","params":{"x":%s},"method":"ping","id":"%s"}' % (value, mid)).encode()
            exp = Expect("either", frozenset({-32600, -32700, -32602}), mid, result_ok=True,
                         why=f"ping with deep params before its id {kind} x{depth}")
        run(server, "frames.deep", frame(body), exp)

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_very_long_strings_in_every_position(server, prof):
    @prof
    @given(st.text(min_size=1, max_size=8), st.sampled_from([1000, 70000, 1 << 20]),
           st.sampled_from(["id", "method", "params", "key", "jsonrpc"]), st.integers(0, 2**31))
    def inner(unit, size, where, n):
        long = (unit * (size // len(unit) + 1))[:size]
        msg: dict = {"jsonrpc": "2.0", "id": f"long-{n}", "method": "ping"}
        if where == "id":
            msg["id"] = long
        elif where == "method":
            msg["method"] = long
        elif where == "params":
            msg["params"] = {"x": long}
        elif where == "key":
            msg[long] = 1
        else:
            msg["jsonrpc"] = long
        if msg["method"] in ("exit", "shutdown"):
            return
        body = json.dumps(msg, ensure_ascii=False).encode()
        run(server, "frames.long_strings", frame(body), expect_for_body(body))

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_length_shorter_or_longer_than_the_body_recovers(server, prof):
    """A length shorter than the body: the prefix is the message and the rest is garbage
    before the next frame. A length longer than the body: it runs into the next frame,
    which is lost; the frame after it is read. Either way the ping after is answered."""
    @prof
    @given(st.data())
    def inner(data):
        body = data.draw(request_bodies | non_request_bodies, label="body")
        if data.draw(st.booleans(), label="shorter") and len(body) > 0:
            n = data.draw(st.integers(0, len(body) - 1), label="length")
            junk = b"Content-Length: %d\r\n\r\n" % n + body
            exp = expect_for_body(body[:n])
            if exp.mode in ("id", "either"):  # a prefix of a request that parses: cannot happen for objects
                exp = None
        else:
            lost = json.dumps({"jsonrpc": "2.0", "id": "lost", "method": "ping"}).encode()
            nxt = frame(lost)
            k = data.draw(st.integers(1, len(nxt) - 1), label="overshoot")
            junk = b"Content-Length: %d\r\n\r\n" % (len(body) + k) + body + nxt
            exp = expect_for_body(body + nxt[:k])
        run(server, "frames.length_mismatch", junk, exp)

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_a_stream_of_mixed_junk_frames_in_one_write(server, prof):
    """Several junk frames in one write (the reader sees them in one chunk): every one is
    answered as PROTOCOL says, in order, and the stream stays in sync."""
    @prof
    @given(st.lists(non_json_bodies | non_request_bodies, min_size=2, max_size=8))
    def inner(bodies):
        def body():
            c = server.c
            n0 = len(c.unmatched)
            c.send_raw(b"".join(frame(b) for b in bodies))
            server.sync()
            new = c.unmatched[n0:]
            for m in new:
                sane(m)
            want = [min(expect_for_body(b).codes) for b in bodies]
            got = [m.get("error", {}).get("code") for m in new]
            assert got == want and all(m.get("id") is None for m in new), (bodies, new)

        run_example(server, "frames.mixed_stream", body)

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_truncated_header_line_before_a_frame_does_not_lose_it(server, prof):
    """A header line cut off before its line end (a writer interrupted mid-header), then a
    whole frame: the frame is read (stdio hardening: a malformed header block
    never loses the next message)."""
    @prof
    @given(st.sampled_from([b"Content-Length", b"content-length", b"CONTENT-LENGTH"]),
           st.sampled_from([b"", b":", b": ", b": 1", b": 12", b": abc", b": -3", b": 5.0"]), garbage_lines)
    def inner(name, rest, before):
        cut = name + rest
        mid = "after-truncated"
        body = json.dumps({"jsonrpc": "2.0", "id": mid, "method": "ping"}).encode()

        def check():
            c = server.c
            pending = c.expect(mid)
            try:
                c.send_raw(before + b"\r\n" + cut + frame(body))
                assert server.response(pending, SYNC_TIMEOUT).get("result") == {}
            finally:
                c._pending.pop(mid, None)

        run_example(server, "frames.truncated_header", check)

    inner()


# ---------------------------------------------------------------------- regressions found by the fuzz
def test_unterminated_bad_content_length_does_not_lose_the_next_frame(server):
    """Found by the fuzz: "Content-Length: abc" without its line end, then a whole frame:
    the frame's own Content-Length lands on the same line and is never seen."""
    body = b'{"jsonrpc":"2.0","id":"after-cut","method":"ping"}'
    run(server, "regressions", b"Content-Length: abc" + frame(body),
        Expect("id", frozenset(), "after-cut", result_ok=True, result={}, why="frame after a cut header line"))


def test_deeply_nested_params_request_is_answered(server):
    """Found by the fuzz: a ping whose params nest 5000 deep got no answer at all."""
    body = b'{"jsonrpc":"2.0","id":"deep-regression","method":"ping","params":{"x":' + b"[" * 5000 + \
        b"]" * 5000 + b"}}"
    run(server, "regressions", frame(body),
        Expect("either", frozenset({-32600, -32700, -32602}), "deep-regression", result_ok=True,
               why="deep params"))


def test_deeply_nested_top_level_array_gets_an_error(server):
    """Found by the fuzz: a body of 5000 nested arrays got no answer (not even -32600/-32700)."""
    body = b"[" * 5000 + b"]" * 5000
    run(server, "regressions", frame(body),
        Expect("null", frozenset({-32600, -32700}), why="deep top-level array"))


def test_ping_with_lone_surrogate_string_id_is_answered(server):
    """Found by the fuzz: a string id holding an escaped lone surrogate ("\\ud800") got no answer:
    the ping fast path cannot encode the id back to UTF-8."""
    body = b'{"jsonrpc":"2.0","id":"s\\ud800","method":"ping"}'
    c = server.c
    n0 = len(c.unmatched)

    def check():
        c.send_raw(frame(body))
        server.sync()
        new = c.unmatched[n0:]
        # the id cannot round-trip through strict UTF-8: either it is echoed escaped
        # (the client sees "s\ud800") or the request is refused with -32600 and id null
        assert len(new) == 1, f"no answer to a ping whose id holds a lone surrogate: {new}"
        m = new[0]
        assert m.get("id") == "s\ud800" and m.get("result") == {} or \
            m.get("id") is None and m.get("error", {}).get("code") == -32600, m

    run_example(server, "regressions", check)


def test_unknown_method_with_lone_surrogate_is_method_not_found(server):
    """Found by the fuzz: an unknown method name holding a lone surrogate got -32603
    ("result is not JSON") instead of -32601."""
    body = b'{"jsonrpc":"2.0","id":"surrogate-method","method":"x\\udc80"}'
    run(server, "regressions", frame(body),
        Expect("id", frozenset({-32601}), "surrogate-method", why="unknown method with a lone surrogate"))


def test_invalid_utf8_encoded_surrogate_is_a_parse_error(server):
    """Found by the fuzz: bytes ED A0 80 (a UTF-16 surrogate encoded as UTF-8) are not UTF-8, but
    json.loads(bytes) decodes with "surrogatepass", so this body was taken as a request
    (-32600 "jsonrpc must be 2.0") instead of -32700."""
    body = b'{"":"","\xed\xa0\x80":0}'
    run(server, "regressions", frame(body),
        Expect("null", frozenset({-32700}), why="invalid UTF-8 (encoded surrogate)"))


def test_nan_literal_is_not_json(server):
    """docs/PROTOCOL.md §1: a body that is not JSON gets -32700. NaN/Infinity are not JSON (RFC 8259),
    but Python's json accepts them, so the ping below was answered as if valid."""
    body = b'{"jsonrpc":"2.0","id":"nan","method":"ping","params":{"x":NaN}}'
    run(server, "regressions", frame(body),
        Expect("null", frozenset({-32700}), why="NaN literal"))


def test_utf16_body_is_not_accepted_as_json(server):
    """docs/PROTOCOL.md §1: the body is UTF-8. json.loads(bytes) sniffs UTF-16/32, so a UTF-16 body
    was answered as a valid ping instead of -32700."""
    body = json.dumps({"jsonrpc": "2.0", "id": "utf16", "method": "ping"}).encode("utf-16-le")
    run(server, "regressions", frame(body),
        Expect("null", frozenset({-32700}), why="UTF-16 body"))
