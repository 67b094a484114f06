"""Tool names are one namespace over every source. A source's tools are registered all at once
or not at all, a name another source took is never a failure half way through a source (an MCP
server's clashing tool is offered as ``<server>__<tool>``, and a warning names both sources and
the tool), and a stopped MCP server leaves no tool behind. Against real MCP stdio servers that
are held in their start while the test acts."""

import asyncio
import sys
from pathlib import Path

from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.service import Service

from service_support import Port

GATED = str(Path(__file__).resolve().parent / "fixtures" / "gated_mcp_server.py")
WAIT = 60  # seconds: every wait here is bounded


def _gated(tmp_path: Path, name: str, *tools: str) -> tuple[dict, Path]:
    gate = tmp_path / f"{name}.gate"
    return {"command": [sys.executable, GATED, name, str(gate), *tools]}, gate


async def _started(gate: Path) -> None:
    """Until the server's process runs (it is then held before its handshake)."""
    async def poll() -> None:
        while not Path(str(gate) + ".started").exists():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), WAIT)


async def _call(svc: Service, name: str) -> object:
    tool = svc.registry.get(name)
    return await asyncio.wait_for(tool.call({}, ToolCallContext(branch_id="b", call_id=name)), WAIT)


def test_two_mcp_servers_started_at_once_offering_one_name_both_serve_every_tool(tmp_path):
    """Two MCP servers added at the same time, both offering ``two``: the one whose tools come
    second offers it as ``b__two`` with its other tools (it was refused after registering
    ``three``, left pointing at its stopped server); a warning names both servers and the tool;
    once the service is closed no MCP tool is left."""
    port = Port(S.finalize(S.merge(S.DEFAULTS, {})))
    a_cfg, a_gate = _gated(tmp_path, "a", "one", "two")
    b_cfg, b_gate = _gated(tmp_path, "b", "three", "two")

    async def main() -> None:
        svc = Service(port)
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        a_ready = await svc.add_mcp_server("a", a_cfg)
        b_ready = await svc.add_mcp_server("b", b_cfg)
        await _started(a_gate)
        await _started(b_gate)  # both are starting: each chose its names knowing neither's tools
        a_gate.touch()
        await asyncio.wait_for(a_ready.wait(), WAIT)
        b_gate.touch()
        await asyncio.wait_for(b_ready.wait(), WAIT)
        names = sorted(t.name for t in svc.registry if t.source == "mcp")
        assert names == ["b__two", "one", "three", "two"], (names, port.logged)
        for name in names:  # every tool registered is served by a running server
            assert await _call(svc, name) == {"b__two": "b:two"}.get(name, f"{'b' if name == 'three' else 'a'}:{name}")
        warned = [m for m in port.logged if "'two'" in m and "'b__two'" in m]
        assert len(warned) == 1 and "MCP server 'b'" in warned[0] and "MCP server 'a'" in warned[0], port.logged
        assert not any("unavailable" in m for m in port.logged), port.logged
        await asyncio.wait_for(svc.aclose(), WAIT)
        left = [t.name for t in svc.registry if t.source == "mcp"]
        assert not left, left  # a stopped server leaves no tool behind

    asyncio.run(main())


def test_a_client_tool_registered_while_an_mcp_server_starts_keeps_its_name(tmp_path):
    """A client tool registered while an MCP server starts takes a name the server offers: the
    server's tool is ``g__beta`` and its other tools are served (before: ``alpha`` was left
    registered for a server that had stopped, the others were gone)."""
    port = Port(S.finalize(S.merge(S.DEFAULTS, {})))
    cfg, gate = _gated(tmp_path, "g", "alpha", "beta", "gamma")

    async def main() -> None:
        svc = Service(port)
        ready = await svc.add_mcp_server("g", cfg)
        await _started(gate)
        out = await asyncio.wait_for(svc.registerClientTools(
            {"tools": [{"name": "beta", "description": "the client's", "inputSchema": {"type": "object"}}]}), WAIT)
        assert out == {"registered": ["beta"]}
        gate.touch()
        await asyncio.wait_for(ready.wait(), WAIT)
        assert svc.registry.get("beta").source == "client"
        mcp = sorted(t.name for t in svc.registry if t.source == "mcp")
        assert mcp == ["alpha", "g__beta", "gamma"], (mcp, port.logged)
        assert [await _call(svc, n) for n in mcp] == ["g:alpha", "g:beta", "g:gamma"]
        warned = [m for m in port.logged if "'beta'" in m and "'g__beta'" in m]
        assert len(warned) == 1 and "MCP server 'g'" in warned[0] and "client" in warned[0], port.logged
        await asyncio.wait_for(svc.aclose(), WAIT)
        assert [t.name for t in svc.registry] == ["beta"]  # the client's tool stays; the server's are gone

    asyncio.run(main())
