"""Secrets written into the settings (docs/SECURITY.md, G6): an ``env`` value of an MCP server or
a CLI model whose name says it is secret, and a model's ``options.extraHeaders`` value whose
header name does, are known secrets: masked wherever the server emits or stores text, the
``--record`` session script included. Other values stay as written."""

from __future__ import annotations

import json
import os
import sys

from .support import ROOT, TIMEOUT, calls, scripted

MCP_TOKEN = "mcpTok9f8e7d6c5b4a3210zz"
CLI_KEY = "cliKeyA1b2C3d4E5f6G7h8"
HEADER_KEY = "hdrKey0a1b2c3d4e5f6g7"
BEARER = "brrTok7Q6W5E4R3T2Y1U0"
PLAIN = "plain-visible-value"   # under a name that says nothing of a secret: kept

# the MCP fixture server, made to answer ``whoami`` with its SERVICE_TOKEN (and a plain value)
MCP_WRAPPER = '''
import os, runpy, sys
os.environ["MCP_FIXTURE_TAG"] = os.environ["SERVICE_TOKEN"] + "|" + os.environ["LOG_LEVEL"]
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_secret_looking_env_and_header_values_in_the_settings_are_masked_everywhere(spawn, tmp_path):
    wrapper = tmp_path / "mcp_wrapper.py"
    wrapper.write_text(MCP_WRAPPER)
    fixture = str(ROOT / "tests" / "tools" / "fixtures" / "mcp_server.py")
    cli = tmp_path / "cli_echo.py"
    cli.write_text("import json, os, sys\nsys.stdin.read()\n"
                   "print(json.dumps({'type': 'text', 'text': 'key ' + os.environ['MY_API_KEY'] + ' level '"
                   " + os.environ['LOG_LEVEL']}))\n")
    rec, state = tmp_path / "session.jsonl", tmp_path / "state"
    c = spawn("--record", str(rec))
    c.init(models={"s": scripted(calls(("whoami", {})), "done", "done", "done"),
                   "c": {"provider": "cli", "profile": "jsonl", "command": [sys.executable, str(cli)],
                         "env": {"MY_API_KEY": CLI_KEY, "LOG_LEVEL": PLAIN}},
                   "o": {"provider": "openai", "model": "m", "baseUrl": "http://127.0.0.1:9/v1",
                         "options": {"extraHeaders": {"X-Api-Key": HEADER_KEY, "Authorization": f"Bearer {BEARER}",
                                                      "X-Client": PLAIN}}}},
           defaultModel="s", stateDir=str(state),
           mcpServers={"fx": {"command": [sys.executable, str(wrapper), fixture, "fx"],
                              "env": {"SERVICE_TOKEN": MCP_TOKEN, "LOG_LEVEL": PLAIN}}})
    c.request("authorizeTool", {"tool": "whoami", "decision": "allow"}, timeout=TIMEOUT)
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "who", "actions": True}, timeout=60)
    assert out["result"]["action_responses"][0]["output"] == f"fx:[REDACTED]|{PLAIN}"
    cli_bid = c.branch(chatModel="c")
    assert c.request("operate", {"branchId": cli_bid, "instruction": "go"}, timeout=TIMEOUT)["result"] \
        == f"key [REDACTED] level {PLAIN}"
    # a header's value, whole and without its scheme, is a known secret too
    said = f"headers {HEADER_KEY} and Bearer {BEARER} and {BEARER} and {PLAIN}"
    c.request("operate", {"branchId": bid, "instruction": said, "skipValidation": True}, timeout=TIMEOUT)
    stored = json.dumps(c.messages(bid) + c.messages(cli_bid))
    assert f"headers [REDACTED] and [REDACTED] and [REDACTED] and {PLAIN}" in stored
    c.close()
    texts = {"wire": "\n".join(json.dumps(m) for m in c.wire_log), "stderr": c.stderr_text(),
             "recording": rec.read_text(encoding="utf-8")}
    for root, _, files in os.walk(state):
        for f in files:
            texts[f] = open(os.path.join(root, f), "rb").read().decode("utf-8", "replace")
    leaks = {(where, s) for where, text in texts.items() for s in (MCP_TOKEN, CLI_KEY, HEADER_KEY, BEARER)
             if s in text}
    assert not leaks
    assert PLAIN in texts["recording"]  # the settings' other values are recorded as written
