"""Secrets in streamed text (docs/SECURITY.md, G6): a known secret a model writes across several
deltas is masked in ``$/progress`` (and so in ACP's ``agent_message_chunk``s, which are made from
them), though no single piece holds it."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from .support import TIMEOUT, scripted

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
