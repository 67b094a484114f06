"""Secrets in streamed text (docs/SECURITY.md, G6): a known secret a model writes across several
deltas is masked in ``$/progress`` (and so in ACP's ``agent_message_chunk``s, which are made from
them) and in what ``streamPersist`` writes (the chunk buffer and the branch snapshot), though
no single piece holds it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from .support import TIMEOUT, RpcError, scripted

# shaped unlike any pattern the redactor knows, so only exact-value redaction can hide it
KEY = "plantedKEY0123456789abcdefXYZ"
ENV = "RELIABILITY_PLANTED_KEY"
SAID = f"the key is {KEY} ok"


def _stream(c, token: str = "t") -> list[dict]:
    return [m["params"]["value"] for m in c.wire_log
            if m.get("method") == "$/progress" and m["params"]["token"] == token]


def test_a_secret_split_across_streamed_deltas_is_masked_on_the_wire(spawn):
    c = spawn(env={ENV: KEY})
    c.init(models={"s": scripted({"text": SAID, "chunks": 8}, {"text": SAID, "chunks": len(SAID)})},
           secretEnv=[ENV])
    bid = c.branch()
    for token in ("t", "u"):  # 8 pieces, then one character a delta
        out = c.request("operate", {"branchId": bid, "instruction": "say it", "workDoneToken": token},
                        timeout=TIMEOUT)
        assert out["result"] == "the key is [REDACTED] ok"
        values = _stream(c, token)
        deltas = [v["delta"] for v in values if "delta" in v]
        # the text arrives whole, masked, in order, and all of it before the progress ends
        assert "".join(deltas) == "the key is [REDACTED] ok", deltas
        assert values[-1]["kind"] == "end" and all("delta" not in v for v in values[-1:])
        assert len(deltas) > 1  # still streamed: what cannot begin the key is not held back
    assert not [m for m in c.wire_log if KEY in json.dumps(m)]


def test_without_known_secrets_every_delta_is_sent_as_it_came(spawn):
    c = spawn()
    c.init(models={"s": scripted({"text": SAID, "chunks": 8})})
    bid = c.branch()
    c.request("operate", {"branchId": bid, "instruction": "say it", "workDoneToken": "t"}, timeout=TIMEOUT)
    deltas = [v["delta"] for v in _stream(c) if "delta" in v]
    assert len(deltas) == 8 and "".join(deltas) == SAID


def _blocking_jsonl_program(tmp_path: Path, *events: dict) -> dict:
    """A CLI-backed model (profile ``jsonl``) that prints ``events`` and then waits to be stopped."""
    script = tmp_path / "leaky_run.py"
    script.write_text("import json, sys, time\nsys.stdin.read()\n"
                      f"for e in json.loads({json.dumps(json.dumps(list(events)))}):\n"
                      "    print(json.dumps(e), flush=True)\n"
                      "time.sleep(3600)\n")
    return {"provider": "cli", "profile": "jsonl", "command": [sys.executable, str(script)]}


def test_stream_persist_writes_no_secret_to_the_buffer_or_the_snapshot(spawn, tmp_path):
    run = _blocking_jsonl_program(tmp_path,
                                  {"type": "text", "text": "the key is plantedKEY01"},
                                  {"type": "text", "text": "23456789abcdefXYZ ok, pla"},
                                  {"type": "tool_use", "id": "1", "name": "login", "input": {"token": KEY}},
                                  {"type": "tool_result", "id": "1", "output": "ok"})
    persist, snaps = tmp_path / "persist", tmp_path / "snaps"
    c = spawn(env={ENV: KEY})
    c.init(models={"c": run}, secretEnv=[ENV])
    bid = c.branch(chatModel="c")
    pending = c.request_async("operate", {"branchId": bid, "instruction": "go", "workDoneToken": "t",
                                          "streamPersist": True, "persistDir": str(persist),
                                          "snapshotDir": str(snaps)})
    buffer = persist / f"{bid}.buffer.jsonl"
    deadline = time.monotonic() + TIMEOUT
    seen = ""
    while '"tool_result"' not in seen:  # the run wrote its last event and waits
        assert time.monotonic() < deadline, f"the buffer never got the run's last chunk: {seen!r}"
        time.sleep(0.05)
        seen = buffer.read_text(encoding="utf-8") if buffer.exists() else ""
    records = [json.loads(line) for line in seen.splitlines()]
    text = "".join(r.get("text", "") for r in records if r["type"] == "text")
    assert text == "the key is [REDACTED] ok, pla", records
    assert [r["input"] for r in records if r["type"] == "tool_use"] == [{"token": "[REDACTED]"}]
    assert KEY not in seen
    # the text before the tool use reached the wire whole (its end, which could begin the key,
    # once the tool use showed it did not), masked, while the run still runs
    assert c.wait_for(lambda _: "".join(v.get("delta", "") for v in _stream(c)) == "the key is [REDACTED] ok, pla",
                      timeout=TIMEOUT), _stream(c)

    c.cancel(pending.id)
    try:
        pending.result(TIMEOUT)
    except RpcError as e:
        assert e.code == -32800
    snapshot = (snaps / f"{bid}.json").read_text(encoding="utf-8")
    assert not buffer.exists()
    assert "the key is [REDACTED] ok, pla" in snapshot and KEY not in snapshot
    assert not [m for m in c.wire_log if KEY in json.dumps(m)]


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, str)):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml, v)) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"


def test_acp_message_chunks_of_a_split_secret_are_masked(tmp_path):
    """ACP's ``agent_message_chunk``s are made from the same ``$/progress`` deltas."""
    import acp
    from acp.schema import ClientCapabilities, Implementation

    class Client(acp.Client):
        def __init__(self) -> None:
            self.updates: list = []

        async def session_update(self, session_id, update, **kw):
            self.updates.append(update)

    reply = {"json": {"message": SAID, "action_required": False, "action_requests": []}, "chunks": 16}
    settings = {"secretEnv": [ENV], "models": {"s": {"provider": "scripted", "responses": [reply]}}}
    config = tmp_path / "settings.toml"
    config.write_text("".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in settings.items()))
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "VIRTUAL_ENV") if k in os.environ}
    env[ENV] = KEY

    async def main() -> list:
        client = Client()
        async with acp.spawn_agent_process(client, sys.executable, "-m", "operate_sidecar.server", "--acp",
                                           "--config", str(config), env=env,
                                           transport_kwargs={"stderr": None}) as (conn, proc):
            await conn.initialize(protocol_version=acp.PROTOCOL_VERSION, client_capabilities=ClientCapabilities(),
                                  client_info=Implementation(name="tests", version="0"))
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("say it")])
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        return client.updates

    updates = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    chunks = [u.content.text for u in updates if u.session_update == "agent_message_chunk"]
    assert "".join(chunks) == "the key is [REDACTED] ok", chunks
    assert KEY not in repr(updates)
