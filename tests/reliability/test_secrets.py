"""Secrets and leaks (docs/SECURITY.md): a planted API key never appears in anything the server emits
(responses, notifications, stderr, branchMessages, journal files); no traceback text on the wire
unless ``--debug``."""

from __future__ import annotations

import json
import os
import socket

import pytest
from openai_stub import StubHandler, loopback

from .support import TIMEOUT, RpcError, scripted

# shaped unlike any pattern the redactor knows, so only exact-value redaction can hide it
KEY = "plantedKEY0123456789abcdefXYZ"
ENV = "RELIABILITY_PLANTED_KEY"


class _EchoAuth(StubHandler):
    """Answers every request 401, echoing the Authorization header back (a hostile endpoint)."""

    seen: list[str] = []

    def do_POST(self):  # noqa: N802
        auth = self.headers.get("Authorization", "")
        self.seen.append(auth)
        self.request_body()
        body = json.dumps({"error": {"message": f"Incorrect API key provided: {auth}", "type": "invalid_request_error",
                                     "code": "invalid_api_key", "param": auth}}).encode()
        self.answer(401, body, headers={"WWW-Authenticate": auth})


@pytest.fixture
def echo_server():
    _EchoAuth.seen = []  # per test: a key seen by an earlier test must not satisfy this one
    with loopback(_EchoAuth) as url:
        yield url


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


# ---------------------------------------------------------------- every known secret, everywhere

TOKEN = "userMarkedTOKEN_9f8e7d6c5b4a3210"      # named in secretEnv
TOKEN_ENV = "RELIABILITY_USER_TOKEN"


def _scrubbed(text: str, *secrets: str) -> None:
    for s in secrets:
        assert s not in text
        assert s[:10] not in text and s[-10:] not in text, "a recognisable part of a secret leaked"


def test_tool_outputs_and_errors_holding_secrets_are_redacted_everywhere(spawn, tmp_path):
    """A tool's output or error text holding the value of an ``apiKeyEnv`` variable or of a
    ``secretEnv`` variable reaches neither the operate result, toolEvent, branchMessages, the
    journal, nor stderr; redaction comes before the output bound, so the preview cut cannot
    leave part of a key either."""
    from .support import calls

    state = str(tmp_path / "state")
    c = spawn(env={ENV: KEY, TOKEN_ENV: TOKEN})
    c.init(models={"s": scripted(calls(("env_value_tool", {"name": TOKEN_ENV}), ("env_error_tool", {"name": ENV}),
                                       ("env_value_tool", {"name": ENV})), "done"),
                   "unused": {"provider": "openai", "model": "m", "apiKeyEnv": ENV}},
           toolModules=["hostile_tools"], secretEnv=[TOKEN_ENV], stateDir=state, maxToolOutputChars=24)
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    outs = [r["output"] for r in out["result"]["action_responses"]]
    assert "[REDACTED]" in json.dumps(outs)                      # the outputs did get through, masked
    # (an error is bounded by maxToolOutputChars too: what is left of it holds no part of the key)
    assert outs[1]["error"].startswith("could not authenticate")
    assert sorted(i["tool"] for i in c.invocations()) == ["env_error_tool", "env_value_tool", "env_value_tool"]
    _scrubbed(everything_emitted(c, state, [bid]), KEY, TOKEN)


def test_a_cli_models_error_text_is_redacted(spawn, tmp_path):
    script = tmp_path / "leaky_cli.py"
    script.write_text("import os, sys\nsys.stderr.write('auth failed for key ' + os.environ['%s'] + '\\n')\n"
                      "sys.exit(1)\n" % TOKEN_ENV)
    import sys

    c = spawn(env={TOKEN_ENV: TOKEN})
    c.init(models={"cli": {"provider": "cli", "profile": "jsonl", "command": [sys.executable, str(script)]}},
           secretEnv=[TOKEN_ENV])
    bid = c.branch()
    err = c.error_of("operate", {"branchId": bid, "instruction": "hi"})
    assert err.code == -32011 and "auth failed for key [REDACTED]" in err.message
    _scrubbed(everything_emitted(c, str(tmp_path / "none"), [bid]), TOKEN)


class _PaddedEcho(_EchoAuth):
    """A hostile endpoint whose error text puts the echoed key right across the cut of the
    server's error message (``pad`` characters before it, set by the test)."""

    pad = 0

    def do_POST(self):  # noqa: N802
        auth = self.headers.get("Authorization", "")
        self.seen.append(auth)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"error": {"message": "x" * self.pad + auth.removeprefix("Bearer "),
                                     "type": "invalid_request_error"}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_an_openai_error_is_redacted_before_it_is_shortened(spawn):
    from operate_sidecar.server.models.openai_compat import MAX_ERROR_CHARS

    _PaddedEcho.seen = []
    with loopback(_PaddedEcho) as url:
        head = f"model 'm': {url} answered HTTP 401: "     # what the server puts before the provider's text
        _PaddedEcho.pad = MAX_ERROR_CHARS - len(head) - len(KEY) // 2   # the cut falls in the key's middle
        c = spawn(env={ENV: KEY})
        c.init(models={"m": _model(url)})
        bid = c.branch()
        err = c.error_of("operate", {"branchId": bid, "instruction": "hi"})
        assert err.code == -32011 and err.message.startswith(head + "x" * _PaddedEcho.pad), err.message[:80]
        assert f"Bearer {KEY}" in _PaddedEcho.seen
        _scrubbed(err.message, KEY)
        _scrubbed(everything_emitted(c, "/nonexistent", [bid]), KEY)


def test_an_openai_model_without_the_openai_package_is_32011_naming_the_extra(spawn):
    from rpc.support import server_env

    shadow = os.path.join(os.path.dirname(__file__), "fixtures", "no_openai")
    c = spawn(env={ENV: KEY, "PYTHONPATH": shadow + os.pathsep + server_env()["PYTHONPATH"]})
    c.init(models={"m": _model("http://127.0.0.1:9/v1")})
    bid = c.branch()
    err = c.error_of("operate", {"branchId": bid, "instruction": "hi"})
    assert err.code == -32011, err
    assert "pip install 'operate-sidecar[openai]'" in err.message


def test_a_models_own_reply_echoing_a_key_is_stored_redacted(spawn, tmp_path):
    """A secret the model itself writes into its reply (a model can echo a key it saw) is masked
    in the stored branch: neither ``branchMessages`` nor any file under the state directory
    holds it."""
    state = str(tmp_path / "state")
    c = spawn(env={ENV: KEY})
    c.init(models={"s": scripted(f"the key is {KEY}"),
                   "unused": {"provider": "openai", "model": "m", "apiKeyEnv": ENV}},
           stateDir=state)
    bid = c.branch()
    c.request("operate", {"branchId": bid, "instruction": "say it"}, timeout=TIMEOUT)
    stored = json.dumps(c.request("branchMessages", {"branchId": bid}, timeout=TIMEOUT))
    c.close()
    assert "[REDACTED]" in stored
    files = []
    for root, _, names in os.walk(state):
        for f in names:
            with open(os.path.join(root, f), "rb") as fh:
                files.append(fh.read().decode("utf-8", "replace"))
    on_disk = "\n".join(files)
    assert "the key is" in on_disk                      # the reply was stored ...
    _scrubbed(on_disk + stored, KEY)                    # ... without the key
