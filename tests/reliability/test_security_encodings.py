"""Secrets in the forms a text carries them in (docs/SECURITY.md, G6): a known secret that a
tool returns URL-encoded, base64-encoded (alone or inside a Basic ``Authorization`` value)
or JSON-escaped reaches neither the wire, ``branchMessages``, the state directory, a
``--record`` session script, nor stderr."""

from __future__ import annotations

import base64
import json
import os
from urllib.parse import quote, quote_plus

from rpc.support import server_env

from .support import TIMEOUT, calls, scripted

# a secret with the characters URL encoding and base64 change: '/', '+', '=', '"'
TOKEN = 'userTok/en+9f8e7d6c5b4a=3210"q'
TOKEN_ENV = "SECURITY_ENCODED_TOKEN"

TOOLS = '''
import base64, json, os
from urllib.parse import quote, quote_plus


def encoded_tool(name: str) -> dict:
    """Return an environment variable's value in the ways a text commonly carries it."""
    v = os.environ.get(name, "")
    return {"url": "https://example.test/cb?token=" + quote(v, safe=""),
            "form": "token=" + quote_plus(v),
            "path": "/auth/" + quote(v),
            "basic": "Authorization: Basic " + base64.b64encode(("user:" + v).encode()).decode(),
            "b64": [base64.b64encode((p + v).encode()).decode() for p in ("", "a", "ab")],
            "urlsafe": base64.urlsafe_b64encode(("x" + v).encode()).decode(),
            "json": json.dumps({"token": v})}
'''


def encodings(v: str) -> list[str]:
    """The recognisable encoded forms of ``v`` (the base64 ones without the edge characters
    that mix with neighbouring bytes)."""
    out = [quote(v, safe=""), quote_plus(v), quote(v), json.dumps(v)[1:-1]]
    for prefix in ("", "a", "ab", "user:", "x"):
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            text = enc((prefix + v).encode()).decode()
            out.append(text[len(prefix) * 4 // 3 + 4:-4])  # a middle stretch: the value's bytes alone
    return out


def test_a_secret_a_tool_returns_url_or_base64_encoded_is_redacted_everywhere(spawn, tmp_path):
    (tmp_path / "encoding_tools.py").write_text(TOOLS)
    state, rec = tmp_path / "state", tmp_path / "session.jsonl"
    c = spawn("--record", str(rec),
              env={TOKEN_ENV: TOKEN, "PYTHONPATH": str(tmp_path) + os.pathsep + server_env()["PYTHONPATH"]})
    c.init(models={"s": scripted(calls(("encoded_tool", {"name": TOKEN_ENV})), "done")},
           toolModules=["encoding_tools"], secretEnv=[TOKEN_ENV], stateDir=str(state))
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True, "workDoneToken": "t"},
                    timeout=TIMEOUT)
    output = out["result"]["action_responses"][0]["output"]
    assert output["url"] == "https://example.test/cb?token=[REDACTED]"   # the output got through, masked
    assert output["basic"].startswith("Authorization: Basic dXNlcjp") and "[REDACTED]" in output["basic"]
    stored = json.dumps(c.request("branchMessages", {"branchId": bid}, timeout=TIMEOUT))
    c.close()
    texts = {"wire": "\n".join(json.dumps(m) for m in c.wire_log) + stored, "stderr": c.stderr_text(),
             "recording": rec.read_text(encoding="utf-8")}
    for root, _, files in os.walk(state):
        for f in files:
            texts[f] = open(os.path.join(root, f), "rb").read().decode("utf-8", "replace")
    forms = [TOKEN, *encodings(TOKEN)]
    assert all(len(f) >= 16 for f in forms[4:]), forms
    leaks = {(where, form) for where, text in texts.items() for form in forms if form in text}
    assert not leaks
