"""A configured MCP server whose first start timed out (it hangs in its handshake) is tried once
more at once, in the background: no request waits for that try, and its tools are offered once
it has started. The real server over real pipes, with real MCP stdio servers."""

import sys
from pathlib import Path

from tools.mcp_support import FIXTURES, WAIT, until  # tests/ is on sys.path

SERVER = str(FIXTURES / "mcp_server.py")
RETRIED = str(FIXTURES / "retried_mcp_server.py")
GATED = str(Path(__file__).parents[1] / "service" / "fixtures" / "gated_mcp_server.py")
#: a start times out after this many seconds here (30 s out of tests): what hangs is given up on
#: sooner, and what these tests do while a try hangs takes well under it
START_TIMEOUT_S = 5
#: the servers' environment (``make(env=ENV)``, ``make``: conftest.py's)
ENV = {"OPERATE_SIDECAR_MCP_START_TIMEOUT_S": str(START_TIMEOUT_S)}
GOOD = {"echo", "add", "stats", "lines", "fail", "whoami", "pid"}  # mcp_server.py's tools


def unavailable(c):
    return [p["message"] for p in c.of("window/logMessage")
            if p.get("type") == 2 and p["message"].startswith("MCP server 'late' unavailable: ")]


def test_a_server_whose_first_start_timed_out_is_tried_again_without_a_request_waiting_for_it(make, tmp_path):
    """Before, a server that never answered ``initialize`` was waited for 30 s by the first
    request that needed the tools, and its warning said it would be tried once more when tools
    are next needed: the next such request started it again and waited for it, as long again.
    Now its warning says it is tried once more now, in the background; the next request answers
    while that try still hangs (its failure not yet told); and once the server answers, its
    tools are offered with no request having waited for it."""
    gate, starts = tmp_path / "gate", tmp_path / "starts"
    late = ["/bin/sh", "-c", 'echo start >> "$0"; shift; exec "$@"', str(starts), "--",
            sys.executable, GATED, "late", str(gate), "late_tool"]
    c = make(env=ENV)
    c.init(mcpServers={"good": {"command": [sys.executable, SERVER, "good"]}, "late": {"command": late}})

    def mcp_tools():
        return {t["name"] for t in c.request("listTools", {}, timeout=WAIT)["tools"] if t["source"] == "mcp"}

    try:
        assert mcp_tools() == GOOD  # waited for late's start, which timed out
        [told] = unavailable(c)
        first = told.splitlines()[0]
        assert f"no answer to initialize/tools/list within {START_TIMEOUT_S} s" in first, told
        assert first.endswith("; it is tried once more now, in the background: its tools are offered once it has "
                              "started"), told
        assert mcp_tools() == GOOD  # answered while the second try still hangs ...
        assert unavailable(c) == [told]  # ... its time-out not told, so not waited for
        until(lambda: starts.read_text().count("start") == 2, "the second start")  # begun with no request
    finally:
        gate.touch()  # the server answers from now on
    until(lambda: "late_tool" in mcp_tools(), "late's tool once it has started")
    assert mcp_tools() == GOOD | {"late_tool"} and unavailable(c) == [told]
    assert starts.read_text().count("start") == 2


def test_a_retry_that_says_its_tools_changed_while_it_starts_holds_up_no_request_nor_the_policy_check(make, tmp_path):
    """The background try of a server whose first start timed out says its tools changed before
    it answers its handshake. Before, that made every request that needs the tools wait for the
    try (up to its time-out), and ``settings.toolPolicy``'s names were checked before the
    try had ended: an entry naming its tool was told to name no tool. Now a request answers while
    the try hangs, and the check waits for the try: only the entry naming no tool is told."""
    gate, starts = tmp_path / "gate", tmp_path / "starts"
    c = make(env=ENV)
    c.init(mcpServers={"good": {"command": [sys.executable, SERVER, "good"]},
                       "late": {"command": [sys.executable, RETRIED, str(starts), str(gate)]}},
           toolPolicy={"late_tool": "allow", "no_such_tool": "allow"})

    def mcp_tools():
        return {t["name"] for t in c.request("listTools", {}, timeout=WAIT)["tools"] if t["source"] == "mcp"}

    def policy_told():
        return [p["message"] for p in c.of("window/logMessage") if "settings.toolPolicy names" in p["message"]]

    try:
        assert mcp_tools() == GOOD  # waited for late's start, which timed out
        until(lambda: Path(str(gate) + ".told").exists(), "the second start's notice")
        assert mcp_tools() == GOOD
        assert len(unavailable(c)) == 1  # answered while the try hangs (its time-out not told)
        assert not policy_told()
    finally:
        gate.touch()
    until(lambda: "late_tool" in mcp_tools(), "late's tool once it has started")
    until(policy_told, "the policy check")
    assert ["'no_such_tool'" in m for m in policy_told()] == [True], policy_told()
