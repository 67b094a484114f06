"""The service owns its background tasks: MCP servers (configured, and added later as a
client's) run in its task group, against real MCP stdio servers, and ``aclose`` stops them all."""

import asyncio
import os
import sys
from pathlib import Path

from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.service import Service

from service_support import Port

MCP_SERVER = str(Path(__file__).resolve().parents[1] / "tools" / "fixtures" / "mcp_server.py")
WAIT = 60  # seconds: every wait here is bounded


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_mcp_servers_run_in_the_service_task_group_and_stop_on_aclose():
    settings = S.finalize(S.merge(S.DEFAULTS, {"mcpServers": {"cfg": {"command": [sys.executable, MCP_SERVER, "cfg"]}}}))
    port = Port(settings)

    async def main() -> None:
        svc = Service(port)
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        ready = await svc.add_mcp_server("client", {"command": [sys.executable, MCP_SERVER, "client"]})
        await asyncio.wait_for(ready.wait(), WAIT)
        configured = {t.name for t in svc.registry if t.source == "mcp"} - set(ready.tools)
        assert ready.tools and all(svc._tool_origin[n] == "MCP server 'client'" for n in ready.tools)
        assert "client__echo" in ready.tools and "echo" in configured  # named as they are offered
        assert all(svc._tool_origin[n] == "MCP server 'cfg'" for n in configured)
        pid_tools = [t for t in svc.registry if t.name.endswith("pid")]
        assert len(pid_tools) == 2, [t.name for t in svc.registry]
        pids = [await asyncio.wait_for(t.call({}, ToolCallContext(branch_id="b", call_id=t.name)), WAIT)
                for t in pid_tools]
        assert len(set(pids)) == 2 and all(_alive(p) for p in pids)
        owner = svc._owner
        assert owner is not None and not owner.done()  # the one task that holds the task group
        await asyncio.wait_for(svc.aclose(), WAIT)
        assert owner.done() and svc._tg is None
        assert not any(_alive(p) for p in pids), pids
        assert ready.stop.is_set() and ready.stopped.is_set()  # asked to stop, not cut off at the deadline
        # the one thing said: the added server's tools named like the configured one's are prefixed
        assert len(port.logged) == 1 and port.logged[0].startswith("MCP server 'client': its tool 'echo' is "
                                                                  "offered as 'client__echo' (MCP server 'cfg' "
                                                                  "offers 'echo')"), port.logged
        assert not [t.name for t in svc.registry if t.source == "mcp"]  # stopped: their tools are gone

    asyncio.run(main())


def test_a_failing_mcp_server_is_reported_and_leaves_the_others_running():
    settings = S.finalize(S.merge(S.DEFAULTS, {}))
    port = Port(settings)

    async def main() -> None:
        svc = Service(port)
        bad = await svc.add_mcp_server("ghost", {"command": ["/nonexistent/mcp-server-xyz"]})
        good = await svc.add_mcp_server("good", {"command": [sys.executable, MCP_SERVER, "good"]})
        await asyncio.wait_for(asyncio.gather(bad.wait(), good.wait()), WAIT)
        assert "echo" in svc.registry
        assert bad.tools == () and "echo" in good.tools
        assert any("ghost" in m and "unavailable" in m for m in port.logged), port.logged
        assert not svc._owner.done()
        await asyncio.wait_for(svc.aclose(), WAIT)
        assert svc._owner.done()

    asyncio.run(main())


def test_mcp_servers_passed_for_a_branch_are_its_own_shared_when_the_same_renamed_when_not(caplog):
    """``add_branch_mcp_servers`` (ACP's ``mcpServers``): each branch is offered the tools of the
    servers it passed and no other branch's; a server passed again as it was is shared (one
    process); one under a taken name with another env runs under ``<name>-2`` with one warning
    line; a secret value in a passed ``env`` is a known secret at once."""
    from operate_sidecar.server import redaction

    port = Port(S.finalize(S.merge(S.DEFAULTS, {})))

    def fx(tag: str, token: str = "") -> tuple[str, dict]:
        env = {"MCP_FIXTURE_TAG": tag, **({"FX_API_TOKEN": token} if token else {})}
        return "fx", {"command": [sys.executable, MCP_SERVER, tag], "env": env}

    async def main() -> None:
        svc = Service(port)
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        assert svc.branch_tools("a") is None  # no branch passed a server: every tool
        await svc.add_branch_mcp_servers("a", [fx("alpha", token="tok-0123456789-abcdef")])
        await svc.add_branch_mcp_servers("b", [fx("beta")])
        await svc.add_branch_mcp_servers("c", [fx("alpha", token="tok-0123456789-abcdef")])
        await asyncio.wait_for(svc.branch_mcp_ready(), WAIT)
        assert redaction.redact("key tok-0123456789-abcdef") == f"key {redaction.MASK}"
        a, b, c = (set(svc.branch_tools(x)) for x in "abc")
        assert "whoami" in a and "fx-2__whoami" not in a
        assert "fx-2__whoami" in b and "whoami" not in b
        assert a == c  # the same server, shared
        assert set(svc.branch_tools("native")) == a & b  # a branch that passed none: no client server's
        ctx = ToolCallContext(branch_id="b", call_id="1")
        assert await asyncio.wait_for(svc.registry.get("fx-2__whoami").call({}, ctx), WAIT) == "beta:beta"
        pids = [t for t in svc.registry if t.name.endswith("pid")]
        assert len(pids) == 2, [t.name for t in svc.registry]  # alpha once (shared), beta once
        await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())
    warned = [r.getMessage() for r in caplog.records if "started as 'fx-2'" in r.getMessage()]
    assert len(warned) == 1 and "'fx'" in warned[0], warned
