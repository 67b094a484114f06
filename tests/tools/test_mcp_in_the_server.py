"""MCP tool sources in the real server, over real pipes, with real MCP stdio servers: an
operate waiting for its tools ends when its branch is deleted, and each configured MCP server
starts on its own."""

import sys
from pathlib import Path

import pytest

from rpc.support import RpcError, wait_log  # tests/ is on sys.path
from tools.mcp_support import FIXTURES, WAIT, until, warnings

SERVER = str(FIXTURES / "mcp_server.py")
MODELS = {"s": {"provider": "scripted", "responses": ["done"] * 8}}


def test_deleting_a_branch_ends_its_operate_waiting_for_an_mcp_server_to_start(make):
    """docs/PROTOCOL.md §3: deleting a branch ends the operate on it (-32012). One still waiting
    for the configured MCP servers to start (one hangs in its handshake) was registered nowhere a
    delete looks, and answered only once the server's start timed out (30 s), after the warning
    that says so. Now it answers at once, while that server is still starting."""
    c = make()
    c.init(models=MODELS, mcpServers={"hung": {"command": [sys.executable, SERVER, "--hang"]}})
    bid = c.branch()
    pending = c.request_async("operate", {"branchId": bid, "instruction": "x"})  # waits for the tools
    assert wait_log(c, "[mcp hung] fixture server: hanging (--hang)", WAIT)
    assert c.request("deleteBranch", {"branchId": bid}, timeout=WAIT) == {}
    with pytest.raises(RpcError) as info:
        pending.result(WAIT)
    assert info.value.code == -32012, info.value
    # answered before the server's start ended: its failure is not told yet
    assert not [m for m in warnings(c) if "failed to start" in m], warnings(c)


def test_deleting_a_branch_ends_its_operate_waiting_for_a_tool_module_to_import(make, tmp_path):
    """As for an MCP server starting: an operate waiting for a ``toolModules`` module that takes
    long to import answers -32012 once its branch is deleted, the import still under way."""
    gate = tmp_path / "gate"
    c = make(env={"GATED_IMPORT_GATE": str(gate)})
    c.init(models=MODELS, toolModules=["gated_import_tools"])
    bid = c.branch()
    pending = c.request_async("operate", {"branchId": bid, "instruction": "x"})  # waits for the tools
    until(Path(str(gate) + ".started").exists, "the import is under way")
    try:
        assert c.request("deleteBranch", {"branchId": bid}, timeout=WAIT) == {}
        with pytest.raises(RpcError) as info:
            pending.result(WAIT)
        assert info.value.code == -32012, info.value
    finally:
        gate.touch()  # the import ends
    other = c.branch()  # the server goes on: the next operate waits for the import, then runs
    assert c.request("operate", {"branchId": other, "instruction": "x"}, timeout=WAIT)["result"] == "done"
    assert "gated_tool" in {t["name"] for t in c.request("listTools", {}, timeout=WAIT)["tools"]}


def test_a_configured_mcp_server_that_fails_to_start_leaves_the_others_tools_and_is_tried_once_more(make, tmp_path):
    """One configured MCP server that did not start (its command misspelt, it exits) took every
    other configured server's tools with it until the sidecar restarted. Now each server starts
    on its own: the others' tools are offered, a warning names the one that failed and says it
    is tried once more, which the next request needing the tools does (not the one that waited
    for the start): one that starts then has its tools, one that fails again is told again and
    is not tried a third time."""
    flaky_flag, broken_starts = tmp_path / "flaky", tmp_path / "broken.starts"
    flaky = ["/bin/sh", "-c", 'if [ -e "$0" ]; then exec "$@"; fi; touch "$0"; echo "not ready yet" >&2; exit 3',
             str(flaky_flag), sys.executable, SERVER, "flaky"]
    broken = ["/bin/sh", "-c", 'echo start >> "$0"; echo "broken for good" >&2; exit 4', str(broken_starts)]
    c = make()
    c.init(models=MODELS, mcpServers={"good": {"command": [sys.executable, SERVER, "good"]},
                                      "flaky": {"command": flaky}, "broken": {"command": broken}})

    def mcp_tools():
        return {t["name"] for t in c.request("listTools", {}, timeout=WAIT)["tools"] if t["source"] == "mcp"}

    own = {"echo", "add", "stats", "lines", "fail", "whoami", "pid"}
    assert mcp_tools() == own  # good's, plainly named: nothing else started
    told = warnings(c)
    assert [m.splitlines()[0].split(" failed to start")[0] for m in told] == [
        "MCP server 'flaky' unavailable: MCP server 'flaky'", "MCP server 'broken' unavailable: MCP server 'broken'"], told
    assert all(m.splitlines()[0].endswith("; it is tried once more when tools are next needed") for m in told), told
    assert "not ready yet" in told[0] and "broken for good" in told[1]

    # the next need: flaky starts (its names clash with good's, which keeps its own), broken fails again
    assert mcp_tools() == own | {f"flaky__{n}" for n in own}
    assert warnings(c, "its tool 'echo' is offered as 'flaky__echo' (MCP server 'good' offers 'echo')")
    again = warnings(c, " unavailable: ")[len(told):]
    assert len(again) == 1 and again[0].startswith("MCP server 'broken' unavailable: ") and "tried" not in again[0]
    assert "broken for good" in again[0] and broken_starts.read_text().count("start") == 2
    out = c.request("operate", {"branchId": c.branch(), "instruction": "x"}, timeout=WAIT)
    assert out["result"] == "done" and broken_starts.read_text().count("start") == 2  # not a third time
    assert len(warnings(c, " unavailable: ")) == 3, warnings(c)
