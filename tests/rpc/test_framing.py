"""The frame parser on its own (in-process): any split of the byte stream, any
garbage between frames, gives the same bodies; oversize bodies are skipped."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from operate_sidecar.server.rpc.framing import FrameParser, encode_frame, looks_like_answer, peek_id, peek_keys

bodies = st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=20), max_size=3).map(
    lambda d: json.dumps(d, ensure_ascii=False).encode()), min_size=1, max_size=6)
garbage = st.sampled_from([b"", b"\r\n", b"junk\r\n", b"Content-Length: x\r\n\r\n", b"no newline junk",
                           b"X-Header: 1\r\n\r\n"])


def header(n: int, style: int) -> bytes:
    return [b"Content-Length: %d\r\n\r\n", b"content-length:%d\r\nContent-Type: a/b\r\n\r\n",
            b"CONTENT-LENGTH:   %d\n\n"][style] % n


@settings(max_examples=200, deadline=None)
@given(bodies, st.lists(garbage, min_size=6, max_size=6), st.lists(st.integers(0, 2), min_size=6, max_size=6),
       st.lists(st.integers(1, 64), min_size=1, max_size=50))
def test_any_split_with_garbage_between_frames_yields_every_body(bs, junk, styles, cuts):
    stream = b"".join(junk[i] + header(len(b), styles[i]) + b for i, b in enumerate(bs))
    out: list[bytes] = []
    p = FrameParser(out.append)
    pos = 0
    i = 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        p.feed(stream[pos:pos + step])
        pos += step
        i += 1
    assert out == bs


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 200), st.lists(st.integers(1, 300), min_size=1, max_size=20))
def test_oversize_body_is_skipped_and_the_next_frame_parsed(extra, cuts):
    big = json.dumps({"jsonrpc": "2.0", "id": 7, "params": {"x": "y" * (100 + extra)}}).encode()
    small = b'{"id":8}'
    stream = encode_frame(big) + encode_frame(small)
    out: list[bytes] = []
    skipped: list[tuple] = []
    p = FrameParser(out.append, lambda head, size: skipped.append((peek_id(head), size)), max_bytes=100)
    pos = i = 0
    while pos < len(stream):
        p.feed(stream[pos:pos + cuts[i % len(cuts)]])
        pos += cuts[i % len(cuts)]
        i += 1
    assert out == [small] and skipped == [(7, len(big))]


def test_the_head_of_an_answer_is_told_from_a_request_and_from_junk():
    # an oversized body that is the client's answer is never answered (tests/rpc/test_oversize_answers.py)
    assert peek_keys(b'{"jsonrpc":"2.0","id":"sidecar-1","result":{"text":"xx') == {"jsonrpc", "id", "result"}
    assert peek_keys(b' {"id":1, "error" :{"code":1,"message":"m"},"x"') == {"id", "error"}
    assert peek_keys(b'{"a":"\\"result\\":1","b') == {"a"}
    assert peek_keys(b'') is None and peek_keys(b'[{"result":1}]') is None
    assert peek_keys(b'{"id":1,"result":{}}{"id":1') is None and peek_keys(b'{"id":1,"result":{}}\n ') == {"id", "result"}
    answer = '{"jsonrpc":"2.0","id":"sidecar-1","result":{"text":"é✓'.encode()
    assert looks_like_answer(answer) and looks_like_answer(answer[:-1])        # a character cut short
    assert looks_like_answer(b'{"error":{"code":1,"message":"' + b"m" * 100)  # the id may come later
    assert not looks_like_answer(b'{"jsonrpc":"2.0","id":1,"method":"operate","params":{"result":1')
    assert not looks_like_answer(b'{"id":1,"result":{"a":"\xe2(\xa1"')     # not UTF-8
    assert not looks_like_answer(b'{"id":1,"result":{}}{"id":1,"result":{}}')  # not one object
    assert not looks_like_answer(b'{"id":1,"params":{}') and not looks_like_answer(b'"result"')


def test_peek_id_reads_only_the_top_level_id():
    assert peek_id(b'{"params":{"id":5},"id":"x"') == "x"
    assert peek_id(b'{"jsonrpc":"2.0","id":0,"method"') == 0
    assert peek_id(b'{"params":{"id":5}') is None
    assert peek_id(b'{"a":"\\"id\\":3"}') is None


def test_a_failing_handler_neither_replays_nor_loses_later_frames():
    seen: list[bytes] = []

    def handle(body: bytes) -> None:
        seen.append(body)
        if body == b"bad":
            raise RuntimeError("handler bug")

    p = FrameParser(handle)
    p.feed(encode_frame(b"bad") + encode_frame(b"good"))
    p.feed(encode_frame(b"later"))
    assert seen == [b"bad", b"good", b"later"]


def test_a_header_cut_off_before_its_line_end_resyncs_on_the_next_content_length():
    out: list[bytes] = []
    p = FrameParser(out.append)
    for cut in (b"Content-Length: abc", b"content-length: -3", b"CONTENT-LENGTH", b"Content-Length: 12"):
        p.feed(b"\xdf\x01\r\n" + cut + encode_frame(b'{"n":1}'))
    assert out == [b'{"n":1}'] * 4
