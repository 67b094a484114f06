"""Redaction where it used to fail (docs/SECURITY.md, G4 and G6): a secret nested deeper than the
walk recursed is stored masked; the last net keeps every frame valid JSON and the protocol's
words as they are (a number that is a secret becomes ``"[REDACTED]"``, a placeholder key such as
``none`` is no secret); the text the client's file system is asked to write is the real text;
a refused ``initialize`` is recorded masked; ``ping``'s fast path and a tool's ``warnings.warn``
pass the net too. The real server over real pipes (native and ``--acp``), plus the redaction
functions themselves on values and frames no session builds easily."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import acp
import pytest

from rpc.support import frame, server_env, wait_unmatched

from .support import TIMEOUT, calls, scripted

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "acp"))

from acp_support import RecordingClient, bounded, reply, run, spawn, write_config  # noqa: E402

KEY = "faultKeyQ8w7E6r5T4y3U2i1O0pZ"
KEY_ENV = "REDACTION_FAULT_KEY"
PIN = "20240917"           # a numeric secret (an account number, a PIN)
PIN_ENV = "REDACTION_FAULT_PIN"
MCP_TOKEN = "mcpTokZ9Y8X7W6V5U4T3S2R1"
OTHER_TOKEN = "othTok1A2b3C4d5E6f7G8h9"

TOOLS = '''
import os, warnings


def nested(name: str, depth: int, data: dict | None = None) -> dict:
    """Return an environment variable's value nested depth levels deep."""
    v = {"k": os.environ.get(name, "")}
    for _ in range(depth):
        v = {"d": v}
    return v


def number(name: str) -> dict:
    """Return an environment variable's value as a number, in a text, and inside a longer number."""
    v = os.environ.get(name, "")
    return {"n": int(v), "text": "pin " + v, "longer": int("1" + v)}


def warn(name: str) -> str:
    """Warn with an environment variable's value."""
    warnings.warn("the token is " + os.environ.get(name, ""))
    return "warned"
'''


def tool_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    (tmp_path / "fault_tools.py").write_text(TOOLS)
    return {"PYTHONPATH": str(tmp_path) + os.pathsep + server_env()["PYTHONPATH"], **extra}


def state_text(state: Path) -> str:
    parts = []
    for root, _, files in os.walk(state):
        for f in files:
            parts.append(open(os.path.join(root, f), "rb").read().decode("utf-8", "replace"))
    return "\n".join(parts)


def deep(value, depth: int):
    for _ in range(depth):
        value = {"d": value}
    return value


def test_a_secret_nested_deeper_than_the_walk_recursed_is_stored_masked(spawn, tmp_path):
    state = tmp_path / "state"
    c = spawn(env=tool_env(tmp_path, **{KEY_ENV: KEY}))
    # (the deep arguments as the model's text: settings are bounded to 32 levels)
    ask = calls(("nested", {"name": KEY_ENV, "depth": 230, "data": deep({"k": KEY}, 210)}))
    c.init(models={"s": scripted({"text": json.dumps(ask["json"])}, "done")},
           toolModules=["fault_tools"], secretEnv=[KEY_ENV], stateDir=str(state))
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    response = out["result"]["action_responses"][0]
    value = response["output"]
    for _ in range(230):
        value = value["d"]
    assert value == {"k": "[REDACTED]"}
    stored = json.dumps(c.messages(bid))
    assert stored.count("[REDACTED]") >= 2 and KEY not in stored  # the model's arguments and the tool's output
    c.close()
    assert KEY not in state_text(state)
    assert KEY not in "\n".join(json.dumps(m) for m in c.wire_log)


def test_redact_value_masks_at_any_depth_and_copies_nothing_it_need_not(monkeypatch):
    from operate_sidecar.server import redaction

    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    redaction.remember_secret(KEY)
    redaction.remember_secret(PIN)
    value = [KEY, int(PIN), 5]
    for _ in range(20_000):  # far deeper than Python recurses
        value = [{"d": value, KEY: "key"}, int(PIN)]
    masked = redaction.redact_value(value)
    for _ in range(20_000):
        assert masked[1] == "[REDACTED]" and masked[0][redaction.MASK] == "key"
        masked = masked[0]["d"]
    assert masked == ["[REDACTED]", "[REDACTED]", 5]
    clean = deep(["nothing", 1.5, True, None], 1_000)
    assert redaction.redact_value(clean) is clean


def test_a_numeric_secret_keeps_every_frame_json_and_is_masked_in_the_store(spawn, tmp_path):
    state, rec = tmp_path / "state", tmp_path / "session.jsonl"
    c = spawn("--record", str(rec), env=tool_env(tmp_path, **{PIN_ENV: PIN}))
    c.init(models={"s": scripted(calls(("number", {"name": PIN_ENV})), "done")},
           toolModules=["fault_tools"], secretEnv=[PIN_ENV], stateDir=str(state))
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    assert out["result"]["action_responses"][0]["output"] == \
        {"n": "[REDACTED]", "text": "pin [REDACTED]", "longer": int("1" + PIN)}
    # a request id the client chose that is the secret: answered under that id (an answer keeps
    # the id it answers), in a frame that is still JSON
    c.send_raw(frame({"jsonrpc": "2.0", "id": int(PIN), "method": "listBranches", "params": {}}))
    assert [m["id"] for m in wait_unmatched(c, 1)] == [int(PIN)]
    c.close()
    assert not c.stream_errors
    bare = re.compile(rf"(?<![0-9]){PIN}(?![0-9])")
    assert not bare.search(state_text(state))
    recording = rec.read_text(encoding="utf-8")
    assert not bare.search(recording)
    for line in recording.splitlines():
        json.loads(line)


def test_a_count_or_a_short_number_is_no_secret_whatever_its_variable_is_named(monkeypatch):
    """An env value is a secret by its variable's name, but for a number under a name that says
    it counts (``MAX_TOKENS``, ``TOKEN_LIMIT``, ``KEYCLOAK_PORT``, ``maxOutputTokens``); and no
    number of 7 digits or fewer is registered (a count, a limit, a port: no key is that short),
    while 8 digits and more (an account number) are."""
    from operate_sidecar.server import redaction

    env = {"MAX_TOKENS": "4096", "TOKEN_LIMIT": "100000000", "maxOutputTokens": "128000", "KEYCLOAK_PORT": "8080",
           "AUTH_TIMEOUT": "2.5", "MAX_TOKENS_KEY": "sk-notANumber1", "API_KEY": PIN, "GITHUB_TOKEN": MCP_TOKEN,
           "TOKENIZER": "fast", "DEBUG": "1"}
    assert redaction.secret_env_values(env) == ["sk-notANumber1", PIN, MCP_TOKEN, "fast"]
    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    for value in ("4096", "8080", "1000000", PIN, MCP_TOKEN, "fast"):
        redaction.remember_secret(value)
    assert set(redaction.known_secrets()) == {PIN, MCP_TOKEN}  # ("fast": a placeholder word)
    assert redaction.redact(f"line 4096 of 1000000, pin {PIN}") == "line 4096 of 1000000, pin [REDACTED]"


def test_a_placeholder_key_is_no_secret_and_protocol_words_stay(spawn):
    c = spawn("--debug", env={"OPENAI_API_KEY": "none"})
    c.init(models={"s": scripted({"json": {"answer": 5}}),
                   "local": {"provider": "openai", "model": "llama3", "baseUrl": "http://127.0.0.1:9/v1"}},
           defaultModel="s")
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "go", "handleValidation": "return_none",
                                "responseFormat": {"title": "A", "type": "object",
                                                   "properties": {"answer": {"type": "string"}},
                                                   "required": ["answer"]}}, timeout=TIMEOUT)
    assert out["kind"] == "none" and out["result"] is None
    c.close()
    assert "[REDACTED]" not in "\n".join(json.dumps(m) for m in c.wire_log)
    assert "a secret value of 4 letters is not masked" in c.stderr_text()


def strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


@pytest.mark.parametrize("secret", [PIN, "abcd\\", 'q"uo\\te', "tail\\u00e9x", "n1ce-key", KEY])
def test_the_last_net_leaves_json_text_valid_json(monkeypatch, secret):
    from operate_sidecar.server import redaction

    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    redaction.remember_secret(secret)
    texts = [secret, secret + "n", "\\" + secret, "a\\" + secret + "\\n", secret + secret, f"x {secret} y",
             "\n" + secret[1:]]  # (a newline, then the secret but its first letter: written \n1ce-key)
    msg = {"jsonrpc": "2.0", "id": 7, "result": {"texts": texts, secret: [1, 2.5, -3, int(PIN), int("1" + PIN)],
                                                "nested": {"t": texts}, "ok": True, "none": None}}
    for ensure_ascii in (False, True):
        data = json.dumps(msg, ensure_ascii=ensure_ascii, separators=(",", ":")).encode()
        for lines in (data, data + b"\n" + data + b"\n"):
            out = redaction.redact_bytes(lines)
            for line in out.splitlines():
                result = json.loads(line)["result"]
                assert result["ok"] is True and result["none"] is None
                assert not [t for t in strings(result) if secret in t], out
                assert result["texts"][-1] == "\n" + secret[1:]  # no secret: kept as it is
                # a number is masked when it is the secret, never cut: a longer one stays whole
                assert result[redaction.MASK] == [1, 2.5, -3, redaction.MASK if secret == PIN else int(PIN),
                                                  int("1" + PIN)], out


def test_the_client_file_system_is_asked_to_write_the_real_text(spawn, tmp_path):
    path = str(tmp_path / "app.env")
    buffers = {path: f"GITHUB_TOKEN={KEY}\nLEVEL=1\n"}
    writes: list[dict] = []
    c = spawn(env={KEY_ENV: KEY})
    c.on_request("fs/readTextFile", lambda p: {"text": buffers[p["path"]]})
    c.on_request("fs/writeTextFile", lambda p: writes.append(p) or {})
    c.request("initialize", {"workspaceFolders": [str(tmp_path)], "capabilities": {"fs": True}, "settings": {
        "models": {"s": scripted(calls(("edit_file", {"path": "app.env",
                                                      "edits": [{"oldText": "LEVEL=1", "newText": "LEVEL=2"}]})),
                                 "done")},
        "secretEnv": [KEY_ENV], "toolPolicy": {"edit_file": "allow"}}}, timeout=TIMEOUT)
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    assert "error" not in out["result"]["action_responses"][0]["output"], out
    assert [w["text"] for w in writes] == [f"GITHUB_TOKEN={KEY}\nLEVEL=2\n"]  # what the edit made of the buffer
    c.close()
    others = [m for m in c.wire_log if m.get("method") != "fs/writeTextFile"]
    assert KEY not in json.dumps(others) and "[REDACTED]" in json.dumps(others)  # the rest is masked


def test_the_acp_client_file_system_is_asked_to_write_the_real_text(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    path = str(ws / "app.env")
    config = write_config(tmp_path / "s.toml", {
        "models": {"s": {"provider": "scripted", "responses": [
            reply("", [("edit_file", {"path": "app.env", "edits": [{"oldText": "LEVEL=1", "newText": "LEVEL=2"}]})]),
            reply("done")]}},
        "secretEnv": [KEY_ENV]})

    async def main():
        c = RecordingClient("allow_once")
        c.files[path] = f"GITHUB_TOKEN={KEY}\nLEVEL=1\n"
        async with spawn(c, config, fs=True, env={KEY_ENV: KEY}) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("go")]))).stop_reason == "end_turn"
            assert c.writes == [(path, f"GITHUB_TOKEN={KEY}\nLEVEL=2\n")]
            others = [m for m in conn.tap.incoming if m.get("method") != "fs/write_text_file"]
            assert KEY not in json.dumps(others) and "[REDACTED]" in json.dumps(others)

    run(main())


def test_an_acp_tool_returning_a_numeric_secret_keeps_every_line_json(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    config = write_config(tmp_path / "s.toml", {
        "models": {"s": {"provider": "scripted", "responses": [reply("", [("number", {"name": PIN_ENV})]),
                                                               reply("done")]}},
        "toolModules": ["fault_tools"], "secretEnv": [PIN_ENV], "toolPolicy": {"number": "allow"}})
    env = tool_env(tmp_path, **{PIN_ENV: PIN})

    async def main():
        c = RecordingClient("allow_once")
        async with spawn(c, config, env=env) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("go")]))).stop_reason == "end_turn"
            done = c.of("tool_call_update")[-1]
            assert done.status == "completed"
            assert done.raw_output["n"] == "[REDACTED]" and done.raw_output["longer"] == int("1" + PIN), done
            assert not re.search(rf"(?<![0-9]){PIN}(?![0-9])", json.dumps(conn.tap.incoming))

    run(main())


def test_a_refused_initialize_is_recorded_masked(spawn, tmp_path):
    rec = tmp_path / "session.jsonl"
    c = spawn("--record", str(rec))
    refused = [  # refused by the settings' checks, and before them (an unknown field)
        {"mcpServers": {"gh": {"command": ["gh-mcp"], "env": {"GITHUB_TOKEN": MCP_TOKEN, "DEBUG": 1}}}},
        {"mcpServers": {"gh": {"command": ["gh-mcp"], "env": {"API_TOKEN": OTHER_TOKEN}}}, "noSuchSetting": 1},
    ]
    for settings in refused:
        assert c.error_of("initialize", {"settings": settings}).code == -32602
    c.close()
    recording = rec.read_text(encoding="utf-8")
    assert recording.count('"initialize"') == 2 and "[REDACTED]" in recording
    assert MCP_TOKEN not in recording and OTHER_TOKEN not in recording


def test_refused_settings_register_their_secrets_first(monkeypatch):
    from operate_sidecar.server import redaction
    from operate_sidecar.server.rpc import settings as S

    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    monkeypatch.setenv(KEY_ENV, KEY)
    bad = {"mcpServers": {"gh": {"command": "not a list", "env": {"GITHUB_TOKEN": MCP_TOKEN}}},
           "secretEnv": KEY_ENV, "models": ["not", "an", "object"]}
    with pytest.raises(S.SettingsError):
        S.finalize(S.merge(S.DEFAULTS, bad))
    assert set(redaction.known_secrets()) == {MCP_TOKEN, KEY}


def test_a_request_whose_id_holds_a_secret_is_answered_under_that_id(spawn):
    """An answer keeps the id it answers, whatever the last net masks (the client chose it):
    a ``ping`` (its fast path) and any other request, a success and an error; the rest of the
    answer is masked."""
    c = spawn(env={KEY_ENV: KEY})
    c.send_raw(frame({"jsonrpc": "2.0", "id": f"before-{KEY}", "method": "ping"}))  # (nothing known yet)
    c.init(models={"s": scripted("x")}, secretEnv=[KEY_ENV])
    c.send_raw(frame({"jsonrpc": "2.0", "id": f"id-{KEY}", "method": "ping"}))
    c.send_raw(frame({"jsonrpc": "2.0", "id": f"list-{KEY}", "method": "listBranches", "params": {}}))
    c.send_raw(frame({"jsonrpc": "2.0", "id": f"bad-{KEY}", "method": "branchMessages",
                      "params": {"branchId": f"no-{KEY}"}}))
    answers = wait_unmatched(c, 4)
    assert [m["id"] for m in answers] == [f"before-{KEY}", f"id-{KEY}", f"list-{KEY}", f"bad-{KEY}"]
    assert "error" in answers[3] and KEY not in json.dumps(answers[3]["error"]), answers[3]
    assert "[REDACTED]" in answers[3]["error"]["message"], answers[3]
    c.close()


@pytest.mark.parametrize("secret", [KEY, PIN, 'q"uo\\te', "tail\u00e9x"])
def test_the_last_net_reads_a_frame_again_only_when_its_id_may_have_been_masked(monkeypatch, secret):
    """The last net kept a message's id by parsing the frame twice more (as it was, and masked)
    whenever a secret was masked anywhere in it: three full parses of every such frame, a long tool
    output too. The original is read only when the id may have been touched now; every id is kept."""
    from types import SimpleNamespace

    from operate_sidecar.server import redaction

    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    redaction.remember_secret(secret)
    parsed: list[bytes] = []

    def loads(data, *args, **kwargs):
        parsed.append(data)
        return json.loads(data, *args, **kwargs)

    monkeypatch.setattr(redaction, "json", SimpleNamespace(loads=loads, dumps=json.dumps))
    plain = secret.isascii() and '"' not in secret and "\\" not in secret  # (its forms hold no quote, no backslash)
    ids = [7, "call-7", f"id-{secret}"] + ([int(secret)] if secret.isdigit() else [])
    for msg_id in ids:
        msg = {"jsonrpc": "2.0", "id": msg_id, "result": {"text": f"the key is {secret}", "n": 5, "more": ["x" * 100]}}
        for ensure_ascii in (False, True):
            frame = json.dumps(msg, ensure_ascii=ensure_ascii, separators=(",", ":")).encode()
            parsed.clear()
            masked = redaction.redact_bytes(frame, keep_id=True)
            out = json.loads(masked)
            assert out["id"] == msg_id and type(out["id"]) is type(msg_id), (out, msg_id)
            assert secret not in json.dumps(out["result"], ensure_ascii=False), out
            touched = not plain or secret in str(msg_id)
            assert (frame in parsed) == touched, (msg_id, parsed)  # the original: only when the id may differ
            assert parsed.count(masked) <= 1, (msg_id, parsed)      # the masked frame: once at most


def test_a_tools_warning_reaches_stderr_masked(spawn, tmp_path):
    c = spawn(env=tool_env(tmp_path, **{KEY_ENV: KEY}))
    c.init(models={"s": scripted(calls(("warn", {"name": KEY_ENV})), "done")},
           toolModules=["fault_tools"], secretEnv=[KEY_ENV])
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    assert out["result"]["action_responses"][0]["output"] == "warned"
    c.close()
    err = c.stderr_text()
    assert "the token is [REDACTED]" in err and KEY not in err, err[-2000:]
