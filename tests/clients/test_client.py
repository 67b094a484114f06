"""clients/python/client.py: the stdlib scripted-session client."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from operate_sidecar.clients.python.client import RpcError, SidecarClient  # noqa: E402

FAKE = textwrap.dedent('''
    import json, sys
    out = sys.stdout.buffer
    def send(obj, extra=b""):
        body = json.dumps(obj).encode()
        out.write(b"Content-Length: %d\\r\\n" % len(body) + extra + b"\\r\\n" + body); out.flush()
    def read():
        n = int(sys.stdin.buffer.readline().split(b":")[1]); sys.stdin.buffer.readline()
        return json.loads(sys.stdin.buffer.read(n))
    mode = sys.argv[1]
    req = read()
    if mode == "ask":
        send({"jsonrpc": "2.0", "id": "s1", "method": "unknownToClient", "params": {}})
        send({"jsonrpc": "2.0", "id": "s2", "method": "known", "params": {"x": 1}})
        answers = [read(), read()]
        send({"jsonrpc": "2.0", "method": "note", "params": {"n": 1}})
        send({"jsonrpc": "2.0", "id": req["id"], "result": answers})
    elif mode == "garbage":
        out.write(b"hello from a stray print\\n"); out.flush()
    elif mode == "headers":
        send({"jsonrpc": "2.0", "id": req["id"], "result": "ok"}, b"Content-Type: application/json\\r\\n")
    elif mode == "error":
        send({"jsonrpc": "2.0", "id": req["id"], "error": {"code": -32010, "message": "m", "data": {"d": 1}}})
    sys.stdin.buffer.read()
''')


def fake(mode: str, **kw) -> SidecarClient:
    return SidecarClient(argv=[sys.executable, "-c", FAKE, mode], **kw)


def test_server_requests_are_answered_on_a_worker_and_unknown_ones_get_method_not_found():
    c = fake("ask")
    notes = []
    c.on_notification("note", notes.append)
    c.on_request("known", lambda p: {"echo": p})
    answers = c.request("go", {}, timeout=10)
    by_id = {a["id"]: a for a in answers}
    assert by_id["s1"]["error"]["code"] == -32601
    assert by_id["s2"]["result"] == {"echo": {"x": 1}}
    assert c.wait_for(lambda n: ("note", {"n": 1}) in n, 10) and notes == [{"n": 1}]
    c.kill()


def test_error_responses_raise_rpc_error_with_code_message_data():
    c = fake("error")
    with pytest.raises(RpcError) as ei:
        c.request("x", timeout=10)
    assert (ei.value.code, ei.value.message, ei.value.data) == (-32010, "m", {"d": 1})
    c.kill()


def test_strict_mode_reports_anything_but_exact_frames():
    c = fake("garbage")
    with pytest.raises(RpcError) as ei:  # the reader stops; waiting requests fail at once
        c.request("x", timeout=10)
    assert ei.value.code == -32099
    assert c.stream_errors and "stray print" in c.stream_errors[0]
    c.kill()
    c2 = fake("headers")
    with pytest.raises(RpcError):
        c2.request("x", timeout=10)
    assert "Content-Type" in c2.stream_errors[0]
    c2.kill()
    c3 = fake("headers", strict=False)
    assert c3.request("x", timeout=10) == "ok"
    c3.kill()


def test_close_returns_the_exit_code_of_the_real_server():
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with SidecarClient(env=env, cwd=str(ROOT)) as c:
        assert c.request("ping", timeout=20) == {}
        c.request("initialize", {"settings": {"models": {"s": {"provider": "scripted", "responses": []}}}},
                  timeout=20)
        assert c.close() == 0
