"""Secrets on the ACP front end (``--acp``, docs/SECURITY.md): every line the agent writes is
masked for the known secrets whatever built it (a tool call's ``rawInput`` and title made from
arguments a model wrote, kept as written in memory), and the secret-looking ``env`` values of
an MCP server the client passes in ``session/new`` are known secrets. Driven with the ACP SDK's
own client over real pipes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import acp
from acp.schema import EnvVariable, McpServerStdio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "acp"))

from acp_support import MCP_SERVER, RecordingClient, bounded, reply, run, scripted, spawn, write_config  # noqa: E402

KEY = "acpPlantedKey0123456789abcdefXYZ"
MCP_KEY = "mcpClientToken9876543210zyxwQ"


def received(conn) -> str:
    """Every message the agent sent, as the client read it."""
    return "\n".join(json.dumps(m) for m in conn.tap.incoming)


def test_a_secret_a_model_writes_into_a_tool_calls_arguments_reaches_the_editor_masked(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    config = write_config(tmp_path / "s.toml", {
        "models": {"s": scripted(reply("reading", calls=[("read_file", {"path": f"notes/{KEY}.txt"})]),
                                 reply("done"))},
        "secretEnv": ["ACP_PROBE_KEY"]})

    async def main():
        c = RecordingClient()
        async with spawn(c, config, env={"ACP_PROBE_KEY": KEY}) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("go")]))
            call = c.of("tool_call")[0]
            assert call.raw_input == {"path": "notes/[REDACTED].txt"}, call.raw_input
            assert "[REDACTED]" in call.title
            wire = received(conn)
            assert KEY not in wire and KEY not in repr(c.updates)

    run(main())


def test_the_secret_env_of_an_mcp_server_the_client_passes_is_a_known_secret(tmp_path, capfd):
    """The server's env value under a secret-looking name, echoed by one of its tools (and by
    its stderr, which the sidecar relays), is masked on the wire and on stderr."""
    ws = tmp_path / "ws"
    ws.mkdir()
    config = write_config(tmp_path / "s.toml", {
        "models": {"s": scripted(reply("", calls=[("echo", {"text": f"token={MCP_KEY}"})]), reply("ok"))}})
    server = McpServerStdio(name="fx", command=sys.executable, args=[MCP_SERVER, "fx"],
                            env=[EnvVariable(name="FX_API_TOKEN", value=MCP_KEY)])

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("go")]))
            done = c.of("tool_call_update")[-1]
            assert done.status == "completed" and "token=[REDACTED]" in str(done.raw_output), done
            assert c.of("tool_call")[0].raw_input == {"text": "token=[REDACTED]"}
            assert MCP_KEY not in received(conn)

    run(main())
    err = capfd.readouterr().err
    assert "echo called with" in err and MCP_KEY not in err, err
