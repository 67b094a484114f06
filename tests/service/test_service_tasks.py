"""The service owns its background tasks: MCP servers (configured, and added later as a
client's) run in its task group, against real MCP stdio servers, and ``aclose`` stops them all."""

import asyncio
import os
import sys
from pathlib import Path
from typing import Callable

from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.service import Service

from service_support import Port

MCP_SERVER = str(Path(__file__).resolve().parents[1] / "tools" / "fixtures" / "mcp_server.py")
WAIT = 60  # seconds: every wait here is bounded


async def mcp_ready(svc: Service, *branches: str) -> None:
    """Once the MCP servers each of ``branches`` passed are ready (what a turn of each waits for)."""
    for branch in branches:
        await asyncio.wait_for(svc.branch_mcp_ready(branch), WAIT)


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
        await mcp_ready(svc, "a", "b", "c")
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


FLAG_SERVER = str(Path(__file__).resolve().parent / "fixtures" / "flag_mcp_server.py")


def flag_server(tmp_path: Path, name: str = "fl", up: bool = False) -> tuple[list[str], Callable[[], int]]:
    """The flag MCP server's command (it starts only once ``tmp_path/flag`` exists: made now
    with ``up``) and how many times it was started so far."""
    flag, starts = tmp_path / "flag", tmp_path / "flag.starts"
    if up:
        flag.write_text("up")
    return ([sys.executable, FLAG_SERVER, name, str(flag)],
            lambda: len(starts.read_text().split()) if starts.exists() else 0)


def test_an_mcp_server_that_failed_to_start_is_started_again_when_a_branch_passes_it_again(tmp_path):
    """A branch's MCP server that failed to start (its flag file missing: as a missing program
    or config) was kept under its key, so every later branch passing it shared the dead entry
    until the process restarted. Now a branch passing it again starts it again, in the old
    entry's place, for every branch that passed it: those earlier branches get its tools and its
    problems as they are now (not the old failure on top). A branch's turns (``branch_mcp_ready``)
    never start it again; one still starting or running is shared, not started twice; it stops
    when the last branch holding it is released."""
    flag = tmp_path / "flag"
    command, started = flag_server(tmp_path)
    server = ("fl", {"command": command})
    port = Port(S.finalize(S.merge(S.DEFAULTS, {})))

    async def main() -> None:
        svc = Service(port)

        def unavailable(branch: str) -> list[str]:
            return [p for p in svc.branch_problems(branch) if "unavailable" in p]

        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        await svc.add_branch_mcp_servers("a", [server])
        await mcp_ready(svc, "a")
        assert started() == 1 and "probe" not in svc.branch_tools("a")
        assert len(unavailable("a")) == 1 and "is missing" in unavailable("a")[0], svc.branch_problems("a")
        await mcp_ready(svc, "a")  # a's next turn: not started again
        assert started() == 1

        await svc.add_branch_mcp_servers("b", [server])  # passed anew, still failing: tried again
        await mcp_ready(svc, "b")
        assert started() == 2 and "probe" not in svc.branch_tools("b")
        for branch in "ab":  # the failure as it is now, once: not the old one's on top
            assert len(unavailable(branch)) == 1, (branch, svc.branch_problems(branch))

        flag.write_text("fixed")  # the user fixes the cause
        await mcp_ready(svc, "a", "b")  # a turn of a or b: not started again
        assert started() == 2 and "probe" not in svc.branch_tools("a")

        await svc.add_branch_mcp_servers("c", [server])  # a new session: started again, and it works
        await svc.add_branch_mcp_servers("d", [server])  # while that one starts: shared, not started twice
        await mcp_ready(svc, "c", "d")
        await svc.add_branch_mcp_servers("e", [server])  # running: shared
        await mcp_ready(svc, "e")
        assert started() == 3, (tmp_path / "flag.starts").read_text()
        for branch in "abcde":  # the earlier branches hold the server started again: its tools, no problem
            assert "probe" in svc.branch_tools(branch) and svc.branch_problems(branch) == [], branch
        ctx = ToolCallContext(branch_id="a", call_id="1")
        assert await asyncio.wait_for(svc.registry.get("probe").call({}, ctx), WAIT) == "fl:up"
        pid = await asyncio.wait_for(svc.registry.get("pid").call({}, ctx), WAIT)
        assert _alive(pid)

        for branch in "abcd":  # released one by one: the server runs while a branch holds it
            await asyncio.wait_for(svc.release_branch(branch), WAIT)
            assert "probe" in svc.registry and _alive(pid), branch
        await asyncio.wait_for(svc.release_branch("e"), WAIT)
        assert "probe" not in svc.registry and not _alive(pid) and not svc._branch_mcp
        assert started() == 3
        await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())


async def _until(check, what: str) -> None:
    """Wait (bounded: WAIT) until ``check()`` is true."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {WAIT} s: {what}"
        await asyncio.sleep(0.05)


def test_a_branch_mcp_server_that_dies_ends_its_entry_and_is_started_again_when_passed_again(tmp_path):
    """A branch's MCP server that started and then died (killed) kept its entry: the service
    waited for a stop request, its tools stayed registered, every call failed, no one was told.
    Now its end is seen: a call running on it fails at once with a tool error naming it, its
    tools are unregistered, every branch that passed it has the problem (``MCP server 'fl'
    stopped``), their turns do not start it again, and a branch passing it again does."""
    import signal

    from operate_sidecar.server.tools.errors import ToolCallError

    command, started = flag_server(tmp_path, up=True)
    stalling = tmp_path / "flag.stalling"
    server = ("fl", {"command": command})
    port = Port(S.finalize(S.merge(S.DEFAULTS, {})))

    async def main() -> None:
        svc = Service(port)

        def stopped(branch: str) -> list[str]:
            return [p for p in svc.branch_problems(branch) if "MCP server 'fl' stopped" in p]

        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        await svc.add_branch_mcp_servers("a", [server])
        await svc.add_branch_mcp_servers("b", [server])
        await mcp_ready(svc, "a", "b")
        assert started() == 1 and "probe" in svc.branch_tools("a") and "probe" in svc.branch_tools("b")
        ctx = ToolCallContext(branch_id="a", call_id="1")
        old_probe = svc.registry.get("probe")
        pid = await asyncio.wait_for(svc.registry.get("pid").call({}, ctx), WAIT)
        stall = asyncio.ensure_future(svc.registry.get("stall").call({}, ctx))
        await _until(stalling.exists, "the stall call reaches the server")

        os.kill(pid, signal.SIGKILL)  # it dies on its own: nothing asked it to stop
        try:
            await asyncio.wait_for(stall, WAIT)
            raise AssertionError("the call running on the dead server answered")
        except ToolCallError as e:  # not a hang: a tool error naming the server
            assert "MCP server 'fl', tool 'stall'" in str(e) and "closed" in str(e), str(e)
        await _until(lambda: stopped("a"), "the dead server's entry ends")
        assert "probe" not in svc.registry and "probe" not in svc.branch_tools("a")
        for branch in "ab":  # told to every branch that passed it, once
            assert len(stopped(branch)) == 1, (branch, svc.branch_problems(branch))
        assert "a session passing it again starts it again" in stopped("a")[0].splitlines()[0], stopped("a")
        try:
            await asyncio.wait_for(old_probe.call({}, ctx), WAIT)
            raise AssertionError("a tool of the dead server answered")
        except ToolCallError as e:
            assert "MCP server 'fl'" in str(e), str(e)
        await mcp_ready(svc, "a", "b")  # a turn of a or b: not started again
        assert started() == 1
        await _until(lambda: not _alive(pid), "the killed server is reaped")

        await svc.add_branch_mcp_servers("c", [server])  # passed again: started again, for a and b too
        await mcp_ready(svc, "c")
        assert started() == 2, (tmp_path / "flag.starts").read_text()
        for branch in "abc":  # its tools, and the old stop no longer told as current
            assert "probe" in svc.branch_tools(branch) and svc.branch_problems(branch) == [], branch
        new_pid = await asyncio.wait_for(svc.registry.get("pid").call({}, ctx), WAIT)
        assert new_pid != pid and _alive(new_pid)
        assert await asyncio.wait_for(svc.registry.get("probe").call({}, ctx), WAIT) == "fl:up"
        await asyncio.wait_for(svc.aclose(), WAIT)
        assert not _alive(new_pid)

    asyncio.run(main())


def test_a_configured_mcp_server_that_dies_is_told_and_started_again_at_the_next_need(tmp_path):
    """A configured MCP server (``settings.mcpServers``: no session passes it again) that died
    kept its tools registered, failing, with nothing said. Now its tools go, a warning says it
    stopped and when it starts again, and the next ``ensure_tools`` (an operate, listTools)
    starts it again."""
    import signal

    command, started = flag_server(tmp_path, "cfg", up=True)
    settings = S.finalize(S.merge(S.DEFAULTS, {"mcpServers": {"cfg": {"command": command}}}))
    port = Port(settings)

    async def main() -> None:
        svc = Service(port)
        ctx = ToolCallContext(branch_id="b", call_id="1")
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        pid = await asyncio.wait_for(svc.registry.get("pid").call({}, ctx), WAIT)
        os.kill(pid, signal.SIGKILL)
        await _until(lambda: "probe" not in svc.registry, "the dead server's tools go")
        await _until(lambda: any("MCP server 'cfg' stopped" in m for m in port.logged), "it is told")
        told = [m for m in port.logged if "MCP server 'cfg' stopped" in m]
        assert len(told) == 1 and "started again when its tools are next needed" in told[0].splitlines()[0], port.logged
        assert started() == 1
        await asyncio.wait_for(svc.ensure_tools(), WAIT)  # the next need: started again
        assert started() == 2 and "probe" in svc.registry
        assert await asyncio.wait_for(svc.registry.get("probe").call({}, ctx), WAIT) == "cfg:up"
        await asyncio.wait_for(svc.ensure_tools(), WAIT)  # running: not started again
        assert started() == 2
        new_pid = await asyncio.wait_for(svc.registry.get("pid").call({}, ctx), WAIT)
        await asyncio.wait_for(svc.aclose(), WAIT)
        assert not _alive(new_pid) and len([m for m in port.logged if "stopped" in m]) == 1, port.logged

    asyncio.run(main())


def test_a_configured_mcp_server_that_dies_is_started_again_alone_its_siblings_run_on(tmp_path):
    """When one of the configured MCP servers (served together) stopped on its own, all of them
    were stopped with it and started again at the next need: a healthy sibling lost its state
    and a call running on it failed. Now only the one that stopped goes (its tools, told once)
    and is started again at the next need, under the tool names it had; the sibling keeps its
    process, its tools and its running call; ``aclose`` still stops both."""
    import signal

    from operate_sidecar.server.tools.errors import ToolCallError

    (tmp_path / "dies").mkdir()
    (tmp_path / "sib").mkdir()
    dies, dies_started = flag_server(tmp_path / "dies", "dies", up=True)
    sib, sib_started = flag_server(tmp_path / "sib", "sib", up=True)
    settings = S.finalize(S.merge(S.DEFAULTS, {"mcpServers": {"dies": {"command": dies}, "sib": {"command": sib}}}))
    port = Port(settings)

    async def main() -> None:
        svc = Service(port)
        ctx = ToolCallContext(branch_id="b", call_id="1")
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        names = {t.name for t in svc.registry if t.source == "mcp"}
        assert {"dies__probe", "sib__probe"} <= names, names  # both offer it: prefixed
        pid = await asyncio.wait_for(svc.registry.get("dies__pid").call({}, ctx), WAIT)
        sib_pid = await asyncio.wait_for(svc.registry.get("sib__pid").call({}, ctx), WAIT)
        stall = asyncio.ensure_future(svc.registry.get("sib__stall").call({}, ctx))
        await _until((tmp_path / "sib" / "flag.stalling").exists, "the sibling's call reaches it")

        os.kill(pid, signal.SIGKILL)  # one of them dies on its own
        await _until(lambda: "dies__probe" not in svc.registry, "the dead server's tools go")
        await _until(lambda: any("MCP server 'dies' stopped" in m for m in port.logged), "it is told")
        assert {n for n in names if n.startswith("sib__")} <= set(svc.registry.names()), svc.registry.names()
        assert await asyncio.wait_for(svc.registry.get("sib__probe").call({}, ctx), WAIT) == "sib:up"
        await asyncio.wait_for(svc.ensure_tools(), WAIT)  # the next need: the dead one started again
        assert (dies_started(), sib_started()) == (2, 1)
        assert {t.name for t in svc.registry if t.source == "mcp"} == names  # the names they had
        assert await asyncio.wait_for(svc.registry.get("dies__probe").call({}, ctx), WAIT) == "dies:up"
        new_pid = await asyncio.wait_for(svc.registry.get("dies__pid").call({}, ctx), WAIT)
        assert new_pid != pid and _alive(new_pid)
        assert await asyncio.wait_for(svc.registry.get("sib__pid").call({}, ctx), WAIT) == sib_pid
        assert _alive(sib_pid) and not stall.done()  # the sibling's running call was not disrupted
        await asyncio.wait_for(svc.ensure_tools(), WAIT)  # all running: nothing started again
        assert (dies_started(), sib_started()) == (2, 1)
        told = [m for m in port.logged if "stopped" in m]
        assert len(told) == 1 and told[0].startswith("MCP server 'dies' stopped: "), port.logged
        await asyncio.wait_for(svc.aclose(), WAIT)
        try:  # stopped with its server, as any call running at the close
            await asyncio.wait_for(stall, WAIT)
        except ToolCallError:
            pass
        assert not _alive(new_pid) and not _alive(sib_pid)
        assert not [t.name for t in svc.registry if t.source == "mcp"]

    asyncio.run(main())


def test_deleting_a_branch_stops_the_mcp_servers_only_it_held(tmp_path):
    """``deleteBranch`` dropped the branch's server list without stopping them: a server only
    that branch held ran until the service closed. Now it is stopped (its process gone, its
    tools unregistered) by the time the delete is answered, as a released branch's are; one
    another branch holds runs on."""
    mine = ("mine", {"command": [sys.executable, MCP_SERVER, "mine"]})
    both = ("both", {"command": flag_server(tmp_path, "both", up=True)[0]})
    settings = S.finalize(S.merge(S.DEFAULTS, {"stateDir": str(tmp_path / "state")}))

    async def main() -> None:
        svc = Service(Port(settings))
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        a = (await svc.createBranch({}))["branchId"]
        b = (await svc.createBranch({}))["branchId"]
        await svc.add_branch_mcp_servers(a, [mine, both])
        await svc.add_branch_mcp_servers(b, [both])
        await mcp_ready(svc, a, b)
        ctx = ToolCallContext(branch_id=a, call_id="1")
        tools = {public: set(ready.tools) for public, ready in svc._branch_mcp.values()}
        mine_pid = await asyncio.wait_for(svc.registry.get("pid").call({}, ctx), WAIT)  # started first
        both_pid = await asyncio.wait_for(svc.registry.get("both__pid").call({}, ctx), WAIT)
        assert _alive(mine_pid) and _alive(both_pid) and tools["mine"] <= set(svc.branch_tools(a))
        assert "probe" in tools["both"] and "probe" in svc.branch_tools(b)

        assert await asyncio.wait_for(svc.deleteBranch({"branchId": a}), WAIT) == {}
        assert not tools["mine"] & set(svc.registry.names()), tools
        await _until(lambda: not _alive(mine_pid), "the server only the deleted branch held is gone")
        assert _alive(both_pid) and tools["both"] <= set(svc.branch_tools(b))
        assert await asyncio.wait_for(svc.registry.get("probe").call({}, ctx), WAIT) == "both:up"
        await asyncio.wait_for(svc.aclose(), WAIT)
        assert not _alive(both_pid)

    asyncio.run(main())


def test_a_restored_branchs_unconfigured_model_is_a_problem_of_that_branch_alone(tmp_path):
    """A stored branch whose chat model is no longer configured is restored with the default
    model and a warning that concerns it alone: kept for it (``branch_problems``, which the ACP
    front end tells that session only), told through the port's ``log_branch_problem`` when it
    has one, else logged as any other; another branch has no such problem."""
    scripted = {"provider": "scripted", "responses": []}
    state = str(tmp_path / "state")
    before = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": scripted, "gone": scripted}, "defaultModel": "s",
                                             "stateDir": state}))
    after = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": scripted}, "defaultModel": "s", "stateDir": state}))

    class Telling(Port):
        def __init__(self, settings: dict) -> None:
            super().__init__(settings)
            self.told: list[str] = []

        def log_branch_problem(self, type_: int, message: str) -> None:
            self.told.append(message)

    async def main() -> None:
        svc = Service(Port(before))
        gone = (await svc.createBranch({"chatModel": "gone"}))["branchId"]
        other = (await svc.createBranch({}))["branchId"]
        await svc.aclose()
        for port in (Telling(after), Port(after)):
            again = Service(port)
            await again.restore()
            said = again.branch_problems(gone)
            assert len(said) == 1 and said[0].startswith(f"branch {gone}: ") and "using the default model" in said[0]
            assert again.branch_problems(other) == []
            assert (port.told if isinstance(port, Telling) else port.logged) == said, (port.logged, said)
            await again.aclose()

    asyncio.run(asyncio.wait_for(main(), WAIT))
