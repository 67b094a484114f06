"""Transport hardening (docs/PROTOCOL.md §1): framing, JSON errors, ids, params."""

from __future__ import annotations

import json

from .support import TIMEOUT, RpcError, frame, frame_body, scripted, wait_unmatched


def test_header_names_are_case_insensitive_and_unknown_headers_ignored(sidecar):
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
    p1 = sidecar.expect(1)  # (before the send: an answer nobody waits for goes to unmatched)
    sidecar.send_raw(b"content-length: %d\r\nContent-Type: application/vscode-jsonrpc; charset=utf-8\r\n"
                     b"X-Whatever: 1\r\n\r\n" % len(body) + body)
    assert p1.result(TIMEOUT) == {}
    body2 = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "ping"}).encode()
    p2 = sidecar.expect(2)
    sidecar.send_raw(b"CONTENT-LENGTH:%d\r\n\r\n" % len(body2) + body2)
    assert p2.result(TIMEOUT) == {}


def test_malformed_headers_do_not_lose_the_next_message(sidecar):
    # garbage lines, a bad length and garbage glued to the next header: the ping after them is answered
    after = sidecar.expect("after-junk")
    sidecar.send_raw(b"this is not a header\r\n\r\nContent-Length: abc\r\n\r\n")
    sidecar.send_raw(b"junk" + frame({"jsonrpc": "2.0", "id": "after-junk", "method": "ping"}))
    assert after.result(TIMEOUT) == {}
    # a header block with a stray line still delivers its body, and the next message too
    body = json.dumps({"jsonrpc": "2.0", "id": "stray", "method": "ping"}).encode()
    stray = sidecar.expect("stray")
    sidecar.send_raw(b"Content-Length: %d\r\nnot-a-header line\r\n\r\n" % len(body) + body)
    assert stray.result(TIMEOUT) == {}
    assert sidecar.request("ping", msg_id="next") == {}


def test_content_length_counts_bytes_not_characters(sidecar):
    sidecar.init(models={"s": scripted("ok")})
    name = "héllo ✓ 🎉 " * 50
    bid = sidecar.branch(name=name)
    branches = sidecar.request("listBranches")["branches"]
    assert [b["name"] for b in branches if b["branchId"] == bid] == [name]


def test_oversize_body_is_skipped_with_invalid_request_and_stream_stays_in_sync(sidecar):
    sidecar.init(maxMessageBytes=1000)
    big = {"jsonrpc": "2.0", "id": 77, "method": "createBranch", "params": {"name": "x" * 5000}}
    p = sidecar.expect(77)
    sidecar.send_raw(frame(big))
    err = None
    try:
        p.result(TIMEOUT)
    except RpcError as e:
        err = e
    assert err is not None and err.code == -32600
    assert sidecar.request("ping") == {}
    assert sidecar.request("listBranches")["branches"] == []


def test_invalid_json_gets_parse_error_with_null_id(sidecar):
    sidecar.send_raw(b"Content-Length: 9\r\n\r\n{not json")
    (msg,) = wait_unmatched(sidecar)
    assert msg["id"] is None and msg["error"]["code"] == -32700
    assert sidecar.request("ping") == {}


def test_batch_array_is_invalid_request_and_server_keeps_serving(sidecar):
    sidecar.send_raw(frame([{"jsonrpc": "2.0", "id": 5, "method": "ping"}]))
    (msg,) = wait_unmatched(sidecar)
    assert msg["id"] is None and msg["error"]["code"] == -32600
    assert sidecar.request("ping") == {}


def test_json_that_is_not_a_request_is_invalid_request(sidecar):
    sidecar.send_raw(frame(42))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": 9}))
    sidecar.send_raw(frame({"id": 10, "method": "ping"}))  # no "jsonrpc"
    msgs = wait_unmatched(sidecar, 2)
    codes = [m["error"]["code"] for m in msgs]
    assert codes[:2] == [-32600, -32600]
    assert sidecar.wait_for(lambda _: len(sidecar.unmatched) >= 2, TIMEOUT)
    assert sidecar.request("ping") == {}


def test_request_without_params_means_empty_object(sidecar):
    sidecar.init(models={"s": scripted("x")})
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "no-params", "method": "listBranches"}))
    msgs = wait_unmatched(sidecar)
    assert msgs[0] == {"jsonrpc": "2.0", "id": "no-params", "result": {"branches": []}}
    for i, params in enumerate((None, [])):
        sidecar.send_raw(frame({"jsonrpc": "2.0", "id": f"p{i}", "method": "listBranches", "params": params}))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "list", "method": "listBranches", "params": [1]}))
    msgs = wait_unmatched(sidecar, 4)
    by_id = {m["id"]: m for m in msgs[1:]}     # answers may come in any order (JSON-RPC)
    assert set(by_id) == {"p0", "p1", "list"}
    assert by_id["p0"].get("result") == by_id["p1"].get("result") == {"branches": []}
    assert by_id["list"]["error"]["code"] == -32602


def test_ids_are_opaque_and_echoed_unchanged(sidecar):
    for msg_id in (0, -1, 2**40, "0", "a-string-id", "uuid-like-1234"):
        sidecar.send_raw(frame({"jsonrpc": "2.0", "id": msg_id, "method": "ping"}))
    msgs = wait_unmatched(sidecar, 6)
    assert [m["id"] for m in msgs] == [0, -1, 2**40, "0", "a-string-id", "uuid-like-1234"]
    assert all(m["result"] == {} for m in msgs)


def test_id_zero_works_for_regular_methods(sidecar):
    assert sidecar.request("initialize", {"settings": {"models": {"s": scripted("x")}}}, msg_id=0)["protocolVersion"] == 1
    assert sidecar.request("listBranches", msg_id=0) == {"branches": []}


def test_params_arrive_as_plain_dicts_with_keys_unchanged(sidecar):
    sidecar.init(models={"s": scripted("x")})
    bid = sidecar.branch()
    # a namedtuple conversion would rename "_meta" (to "_0"); the error must name it exactly
    err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "_meta": {"a": 1}})
    assert err.code == -32602 and "_meta" in err.message


def test_every_frame_written_is_exactly_content_length_crlf_crlf(sidecar):
    sidecar.init(models={"s": scripted("x")})
    sidecar.request("ping")
    sidecar.close()
    assert sidecar.stream_errors == []


def test_bodies_that_are_not_strict_utf8_json_are_parse_errors(sidecar):
    for raw in (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":NaN}}',  # NaN is not JSON
                b'{"jsonrpc":"2.0","id":2,"method":"ping","x":"\xed\xa0\x80"}',     # UTF-8-encoded surrogate
                '{"jsonrpc":"2.0","id":3,"method":"ping"}'.encode("utf-16-le")):   # not UTF-8 JSON
        sidecar.send_raw(frame_body(raw))
    msgs = wait_unmatched(sidecar, 3)
    assert [(m["id"], m["error"]["code"]) for m in msgs] == [(None, -32700)] * 3
    assert sidecar.request("ping") == {}


def test_deeply_nested_json_is_answered(sidecar):
    deep = b'{"jsonrpc":"2.0","id":"deep","method":"ping","params":{"x":' + b"[" * 5000 + b"]" * 5000 + b"}}"
    p = sidecar.expect("deep")
    sidecar.send_raw(frame_body(deep))
    try:
        p.result(TIMEOUT)
    except RpcError as e:
        assert e.code == -32700
    assert sidecar.request("ping") == {}


def test_lone_surrogates_are_echoed_escaped_and_the_stream_stays_valid(sidecar):
    sidecar.init(models={"s": scripted("x")})
    body = b'{"jsonrpc":"2.0","id":"\\ud800","method":"createBranch","params":{"\\udfff":1}}'
    sidecar.send_raw(frame_body(body))
    (msg,) = wait_unmatched(sidecar)
    assert msg["id"] == "\ud800" and msg["error"]["code"] == -32602 and "udfff" in msg["error"]["message"]
    assert sidecar.request("ping") == {} and sidecar.stream_errors == []
