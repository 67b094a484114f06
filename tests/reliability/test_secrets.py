"""Secrets and leaks (issue 5 §5): a planted API key never appears in anything the server emits
(responses, notifications, stderr, branchMessages, journal files); no traceback text on the wire
unless ``--debug``."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading

import pytest

from .support import TIMEOUT, RpcError, scripted

# shaped unlike any pattern the redactor knows, so only exact-value redaction can hide it
KEY = "plantedKEY0123456789abcdefXYZ"
ENV = "RELIABILITY_PLANTED_KEY"


class _EchoAuth(http.server.BaseHTTPRequestHandler):
    """Answers every request 401, echoing the Authorization header back (a hostile endpoint)."""

    seen: list[str] = []

    def do_POST(self):  # noqa: N802
        auth = self.headers.get("Authorization", "")
        self.seen.append(auth)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"error": {"message": f"Incorrect API key provided: {auth}", "type": "invalid_request_error",
                                     "code": "invalid_api_key", "param": auth}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("WWW-Authenticate", auth)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def echo_server():
    _EchoAuth.seen = []  # per test: a key seen by an earlier test must not satisfy this one
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoAuth)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()
    t.join(TIMEOUT)


@pytest.fixture
def closed_port_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/v1"


def everything_emitted(c, state_dir: str, bids: list[str]) -> str:
    parts = [json.dumps(m) for m in c.wire_log]
    for bid in bids:
        parts.append(json.dumps(c.request("branchMessages", {"branchId": bid}, timeout=TIMEOUT)))
    c.close()
    parts.append(c.stderr_text())
    for root, _, files in os.walk(state_dir):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                parts.append(fh.read().decode("utf-8", "replace"))
    return "\n".join(parts)


def _model(url: str) -> dict:
    return {"provider": "openai", "model": "gpt-test", "baseUrl": url, "apiKeyEnv": ENV, "maxRetries": 0,
            "timeoutS": 10}


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_planted_key_never_leaves_the_process(spawn, tmp_path, echo_server, closed_port_url, debug):
    state = str(tmp_path / "state")
    c = spawn(*(["--debug"] if debug else []), env={ENV: KEY})
    c.init(models={"echo": _model(echo_server), "closed": _model(closed_port_url)}, stateDir=state)
    bids = []
    for model in ("echo", "closed"):
        bid = c.branch(chatModel=model)
        bids.append(bid)
        for params in ({"instruction": "hi", "workDoneToken": "t"}, {"instruction": "hi", "skipValidation": True}):
            err = c.error_of("operate", {"branchId": bid, **params})
            assert err.code == -32011, err
            assert "401" in err.message if model == "echo" else "connect" in err.message
    assert f"Bearer {KEY}" in _EchoAuth.seen                 # the key really went out, and came back echoed
    text = everything_emitted(c, state, bids)
    assert KEY not in text
    assert KEY[:12] not in text and KEY[-12:] not in text     # nor a recognisable part of it
    assert "Incorrect API key" in text or "401" in text        # the error itself did get through


def _internal_error(c) -> RpcError:
    c.init(models={"s": scripted("x")}, toolModules=["boom_patch"])
    c.request("listTools", {}, timeout=TIMEOUT)  # loads the module that breaks branch lookup
    return c.error_of("branchMessages", {"branchId": "anything"})


def test_no_traceback_on_the_wire_without_debug(spawn):
    c = spawn()
    err = _internal_error(c)
    assert err.code == -32603 and "boom" in err.message and err.data is None
    wire = "\n".join(json.dumps(m) for m in c.wire_log)
    assert "Traceback" not in wire and 'File \\"' not in wire and "boom_patch.py" not in wire


def test_debug_puts_the_traceback_in_error_data(spawn):
    c = spawn("--debug")
    err = _internal_error(c)
    assert err.code == -32603 and any("boom_patch" in line for line in err.data["traceback"])
