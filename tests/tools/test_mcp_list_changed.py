"""An MCP server that says its tools changed (``notifications/tools/list_changed``) has them
listed again before the next request that needs the tools: the real server over real pipes,
with a real MCP stdio server whose tools change while it runs (fixtures/changing_mcp_server.py)
beside the SDK's (fixtures/mcp_server.py)."""

import json
import os
import signal
import sys
import time
from pathlib import Path


from rpc.support import scripted  # tests/ is on sys.path
from tools.mcp_support import FIXTURES, WAIT, until, warnings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "acp"))

from acp_support import Raw, agent_env, prompt, reply, req, write_config  # noqa: E402

SERVER = str(FIXTURES / "mcp_server.py")
CHANGING = str(FIXTURES / "changing_mcp_server.py")
GOOD = {"echo", "add", "stats", "lines", "fail", "whoami", "pid"}  # mcp_server.py's tools
FIRST = {"ping", "change", "flood", "slow"}  # changing_mcp_server.py's, as it starts


def call(tool):
    return {"json": {"action_requests": [{"function": tool, "arguments": {}}]}}


def mcp_tools(c):
    return {t["name"] for t in c.request("listTools", {}, timeout=WAIT)["tools"] if t["source"] == "mcp"}


def operate(c, bid):
    out = c.request("operate", {"branchId": bid, "instruction": "call", "actions": True}, timeout=WAIT)
    return [r["output"] for r in out["result"]["action_responses"]]


def requests(log, method):
    return [m for m in map(json.loads, log.read_text().splitlines()) if m["method"] == method]


def start(make, tmp_path, *flags, responses=(), start_timeout=None, args=()):
    """``start_timeout``: the MCP servers' start time-out (seconds; 30 s by default), which also
    bounds each later list of their tools; ``args``: the server's command-line arguments."""
    log = tmp_path / "requests.jsonl"
    c = make(*args, env=None if start_timeout is None else {"OPERATE_SIDECAR_MCP_START_TIMEOUT_S": str(start_timeout)})
    c.init(models={"s": scripted(*responses)},
           mcpServers={"good": {"command": [sys.executable, SERVER, "good"]},
                       "ch": {"command": [sys.executable, CHANGING, str(log), *flags]}})
    return c, log


def test_tools_said_to_have_changed_are_listed_again_before_the_next_request_uses_them(make, tmp_path):
    """docs/PROTOCOL.md §4: a running MCP server's ``notifications/tools/list_changed`` was not
    acted on (its tools were those of its start until it was started again). Now its tools are
    listed again, and the next request that needs them (here listTools, while that list is still
    under way: the server answers it half a second late) waits for them: a tool removed is gone,
    the ones added are offered, named by the rules of a start (``add``, which the server ``good``
    offers, as ``ch__add``, with the warning a start gives), and they can be called. The session
    advertises no client capability."""
    c, log = start(make, tmp_path, "--slow-relist", responses=[call("change"), call("fresh")])
    assert mcp_tools(c) == GOOD | FIRST
    bid = c.branch()
    assert operate(c, bid) == ["change"]  # the server changed its tools, and said so
    assert mcp_tools(c) == GOOD | {"change", "flood", "slow", "ch__add", "fresh"}
    until(lambda: warnings(c, "MCP server 'ch': its tool 'add' is offered as 'ch__add' (MCP server"),
          "the warning about ch's add")
    assert operate(c, bid) == ["fresh"]  # an added tool is called on the server
    assert len(requests(log, "tools/list")) == 2  # its start's, and one more
    [init] = requests(log, "initialize")
    assert init["params"]["capabilities"] == {}  # no sampling, elicitation or roots claimed
    assert not warnings(c, "could not be listed again")


def test_a_call_running_while_its_server_lists_its_tools_again_is_not_disturbed(make, tmp_path):
    """The tool ``slow`` says the server's tools changed, and answers only once the server has
    answered the ``tools/list`` that follows (before it, its server's tools were listed again
    only when it started again: the call answered ``slow, without a list`` 20 s later): the call
    ends with its own answer, and the tool added is offered."""
    c, log = start(make, tmp_path, responses=[call("slow")])
    assert mcp_tools(c) == GOOD | FIRST
    assert operate(c, c.branch()) == ["slow done"]
    assert mcp_tools(c) == GOOD | FIRST | {"after_slow"}


def test_a_flood_of_list_changed_notifications_is_listed_again_once_or_twice(make, tmp_path):
    """50 notifications in a row: one list at a time, what came during it asking for one more,
    so at most two lists follow (the first may begin after all 50 were read); the tool added
    is offered."""
    c, log = start(make, tmp_path, responses=[call("flood")])
    assert mcp_tools(c) == GOOD | FIRST
    assert operate(c, c.branch()) == ["flood"]
    assert mcp_tools(c) == GOOD | FIRST | {"flooded"}
    assert 2 <= len(requests(log, "tools/list")) <= 3, requests(log, "tools/list")


def test_a_list_that_fails_leaves_the_tools_offered_before_with_a_warning(make, tmp_path):
    """The server answers its second ``tools/list`` with an error: its tools stay those it
    listed at its start (``ping`` is still called on it), and a warning says why."""
    c, log = start(make, tmp_path, "--fail-relist", responses=[call("change"), call("ping")])
    assert mcp_tools(c) == GOOD | FIRST
    bid = c.branch()
    assert operate(c, bid) == ["change"]
    assert mcp_tools(c) == GOOD | FIRST
    [told] = warnings(c, "could not be listed again")
    assert told.startswith("MCP server 'ch': its tools could not be listed again after it said they changed ("), told
    assert "list broken" in told and told.endswith("; the tools it offered before are offered still"), told
    assert operate(c, bid) == ["ping"]
    assert len(requests(log, "tools/list")) == 2


def test_an_acp_sessions_server_that_says_its_tools_changed_has_them_listed_again_before_its_next_prompt(tmp_path):
    """The same for a server an ACP session passed: its next prompt waits for the list (the
    server answers it half a second late), and the model's call of a tool added (``fresh``)
    runs (before, that tool was not offered: the call failed)."""
    log, ws = tmp_path / "requests.jsonl", tmp_path / "ws"
    ws.mkdir()
    config = write_config(tmp_path / "settings.toml", {"models": {"s": {"provider": "scripted", "responses": [
        reply("", [("change", {})]), reply("a1"), reply("", [("fresh", {})]), reply("a2")]}}})
    a = Raw(config, agent_env())
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        a.answer(1, WAIT)
        a.send(req(2, "session/new", cwd=str(ws), mcpServers=[
            {"name": "ch", "command": sys.executable, "args": [CHANGING, str(log), "--slow-relist"], "env": []}]))
        sid = a.answer(2, WAIT)["result"]["sessionId"]
        for n in (3, 4):
            a.send(prompt(n, sid))
            assert a.answer(n, WAIT)["result"]["stopReason"] == "end_turn"
        done = [u for u in a.updates() if u.get("sessionUpdate") == "tool_call_update" and u.get("status")]
        assert [(u["status"], u.get("rawOutput")) for u in done] == [("completed", "change"), ("completed", "fresh")], done
        assert len(requests(log, "tools/list")) == 2
    finally:
        a.close()


def test_a_server_that_says_its_tools_changed_at_every_list_holds_up_no_request(make, tmp_path):
    """The server says its tools changed in answer to every ``tools/list``: before, what it said
    during a list asked for one more, and a request waited until none was due, which never came
    (listTools was never answered; thousands of lists in seconds). A request waits only for the
    lists due when it came, and one server has ``RELIST_BURST`` (3) lists in a row at most, then
    one a second (``RELIST_EVERY_S``)."""
    c, log = start(make, tmp_path, "--notify-on-list", responses=[call("change")])
    assert mcp_tools(c) == GOOD | FIRST
    assert operate(c, c.branch()) == ["change"]
    assert mcp_tools(c) == GOOD | {"change", "flood", "slow", "ch__add", "fresh"}
    assert mcp_tools(c) == GOOD | {"change", "flood", "slow", "ch__add", "fresh"}  # (each answered)
    time.sleep(1.5)  # (a span to count the lists in: one a second once 3 were listed in a row)
    assert len(requests(log, "tools/list")) <= 8, len(requests(log, "tools/list"))


def test_a_tool_still_listed_keeps_its_name_when_its_server_or_a_sibling_lists_or_starts_again(make, tmp_path):
    """``ch`` adds ``add``, which ``good`` offers: ``ch__add``. Before, that made ``add`` one of
    ``ch``'s own names, so ``good`` started again (it was killed) offered its ``add`` as
    ``good__add`` (no tool named ``add`` any more: a toolPolicy entry for it decided nothing),
    and ``ch`` listing its tools while ``good`` was down offered its own as ``add``. Now a tool
    a server still lists keeps the name it had while that name is free: ``good``'s ``add`` is
    ``add`` again, ``ch``'s stays ``ch__add``."""
    go = tmp_path / "go"
    c, log = start(make, tmp_path, "--notify-when", str(go), responses=[call("change"), call("pid")])
    bid = c.branch()
    assert operate(c, bid) == ["change"]
    assert {"add", "ch__add"} <= mcp_tools(c)
    [pid] = operate(c, bid)
    os.kill(int(pid), signal.SIGKILL)
    until(lambda: warnings(c, "MCP server 'good' stopped"), "good's stop told")
    go.touch()  # ch says its tools changed (adds ``told``) while good is down
    until(lambda: len(requests(log, "tools/list")) == 3, "ch's tools listed again")
    until(lambda: "told" in mcp_tools(c), "ch's list applied")  # (this need starts good again)
    tools = {t["name"]: t for t in c.request("listTools", {}, timeout=WAIT)["tools"] if t["source"] == "mcp"}
    assert {n for n in tools if "add" in n} == {"add", "ch__add"}, sorted(tools)
    assert tools["ch__add"]["description"] == "the tool add" != tools["add"]["description"]


def test_a_list_that_hangs_holds_up_no_sibling_s_stop(make, tmp_path):
    """``ch``'s list after it said its tools changed hangs (until its time-out: 5 s here); ``good``
    is killed meanwhile. Before, the lists of the whole group ran in the task that handles a
    stopped server, one at a time: ``good``'s stop was told only after ``ch``'s list timed out.
    Each server's lists now run on their own: the stop is told first."""
    c, log = start(make, tmp_path, "--hang-relist", responses=[call("pid"), call("change")], start_timeout=5)
    bid = c.branch()
    [pid] = operate(c, bid)
    assert operate(c, bid) == ["change"]
    until(lambda: len(requests(log, "tools/list")) == 2, "ch's tools listed again")
    os.kill(int(pid), signal.SIGKILL)
    until(lambda: warnings(c, "could not be listed again"), "ch's list timed out")
    told = [m for m in warnings(c) if m.startswith("MCP server 'good' stopped") or "could not be listed" in m]
    assert [m.startswith("MCP server 'good' stopped") for m in told] == [True, False], told


def test_a_request_that_needs_no_mcp_tool_list_waits_for_no_list(make, tmp_path):
    """``ch``'s list after it said its tools changed hangs (until its time-out, 30 s). Before,
    authorizeTool (as registerClientTools, and a file a user gave) waited for it too; only an
    operate, listTools and a prompt do now: authorizeTool is answered before that list ends,
    without waiting for it at all (a wait would be logged)."""
    c, log = start(make, tmp_path, "--hang-relist", responses=[call("change")], args=("--log-level", "info"))
    assert operate(c, c.branch()) == ["change"]
    until(lambda: len(requests(log, "tools/list")) == 2, "ch's tools listed again")
    assert c.request("authorizeTool", {"tool": "echo", "decision": "allow"}, timeout=WAIT)["decision"] == "allow"
    assert not warnings(c, "could not be listed again")  # (answered while that list hangs)
    assert "still being listed after" not in c.stderr_text()


def test_an_acp_turn_goes_on_when_its_server_removes_a_tool_and_is_offered_the_tools_it_adds(tmp_path):
    """Round 1 of a prompt calls ``change`` (``ping`` removed, ``fresh`` added); round 2's model
    answers 300 ms late (its tools are listed again meanwhile), calling ``slow``, answered once
    the server's tools are listed again. Before, the tools computed for the prompt before it
    began were offered in every round, and looked up again once a round's model had answered:
    round 2 named ``ping``, gone by then, and the prompt failed (-32602) after round 1's
    effects; a tool added meanwhile was not offered. Each round is offered the tools as they are
    when it begins, a tool gone since being one its calls cannot run: the turn ends, and round
    3's calls of the tools added run."""
    log, ws = tmp_path / "requests.jsonl", tmp_path / "ws"
    ws.mkdir()
    config = write_config(tmp_path / "settings.toml", {"models": {"s": {"provider": "scripted", "responses": [
        reply("", [("change", {})]), reply("", [("slow", {})], delayMs=300),
        reply("", [("fresh", {}), ("after_slow", {})]),
        reply("done")]}}})
    a = Raw(config, agent_env())
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        a.answer(1, WAIT)
        a.send(req(2, "session/new", cwd=str(ws), mcpServers=[
            {"name": "ch", "command": sys.executable, "args": [CHANGING, str(log)], "env": []}]))
        sid = a.answer(2, WAIT)["result"]["sessionId"]
        a.send(prompt(3, sid))
        assert a.answer(3, WAIT)["result"]["stopReason"] == "end_turn"
        done = [u for u in a.updates() if u.get("sessionUpdate") == "tool_call_update" and u.get("status")]
        assert sorted((u["status"], u.get("rawOutput")) for u in done) == [
            ("completed", "after_slow"), ("completed", "change"), ("completed", "fresh"), ("completed", "slow done")], done
    finally:
        a.close()


def test_a_tool_a_clients_operate_names_gone_in_a_later_round_is_left_out_of_that_round(make, tmp_path):
    """A client's operate names ``ping`` among its tools; round 1 calls ``change`` (``ping``
    removed), round 2 ``slow`` (answered once the tools are listed again). Before, round 3
    named ``ping``, gone: the operate failed (-32602) after the earlier rounds' effects. The name
    is left out of the rounds that begin once it is gone: the operate ends."""
    c, log = start(make, tmp_path, responses=[call("change"), call("slow"), {"json": {"action_requests": []}}])
    assert mcp_tools(c) == GOOD | FIRST
    out = c.request("operate", {"branchId": c.branch(), "instruction": "call", "actions": True, "maxRounds": 3,
                                "tools": ["change", "slow", "ping"]}, timeout=WAIT)
    assert out["rounds"] == 3, out
    assert "ping" not in mcp_tools(c)


def test_a_name_a_stopped_server_held_is_not_given_to_a_sibling_s_tool_listed_meanwhile(make, tmp_path):
    """``good`` offers ``add`` (``settings.toolPolicy`` allows it by that name); it is killed,
    and while it is down ``ch`` adds a tool of its own named ``add``. Before, ``good``'s names
    were free once it stopped: ``ch``'s tool was offered as ``add`` (the policy entry allowed
    it), and ``good`` started again offered its own as ``good__add``. A stopped configured
    server's names are kept for it: ``ch``'s tool is ``ch__add``, ``good``'s is ``add`` again."""
    log, go = tmp_path / "requests.jsonl", tmp_path / "go"
    c = make("--log-level", "info")
    c.init(models={"s": scripted(call("pid"))}, toolPolicy={"add": "allow"},
           mcpServers={"good": {"command": [sys.executable, SERVER, "good"]},
                       "ch": {"command": [sys.executable, CHANGING, str(log), "--notify-when", str(go),
                                          "--adds", "add"]}})
    assert mcp_tools(c) == GOOD | FIRST
    [pid] = operate(c, c.branch())
    os.kill(int(pid), signal.SIGKILL)
    until(lambda: warnings(c, "MCP server 'good' stopped"), "good's stop told")
    go.touch()  # ch adds its own ``add``, and says so, while good is down
    until(lambda: "MCP server 'ch' listed its tools again" in c.stderr_text(), "ch's list applied")
    tools = {t["name"]: t for t in c.request("listTools", {}, timeout=WAIT)["tools"] if t["source"] == "mcp"}
    assert {n for n in tools if "add" in n} == {"add", "ch__add"}, sorted(tools)
    assert tools["ch__add"]["description"] == "the tool add" != tools["add"]["description"]


def test_a_list_that_fails_unexpectedly_leaves_no_list_due_for_ever(tmp_path):
    """In the service itself: the server says its tools changed again while they are listed, and
    putting the list in place raises (a bug). Before, the list said due meanwhile stayed due
    with no task to list it: every request that needs the tools waited for it. It is over with
    the list that failed; a later change is listed again as usual."""
    import asyncio

    from operate_sidecar.server.core.tools import ToolCallContext
    from operate_sidecar.server.rpc import settings as S
    from operate_sidecar.server.service.service import Service

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
    from service_support import Port

    log = tmp_path / "requests.jsonl"
    port = Port(S.finalize(S.merge(S.DEFAULTS, {"mcpServers": {
        "ch": {"command": [sys.executable, CHANGING, str(log)]}}})))

    async def main() -> None:
        svc = Service(port)
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        list_again, put = svc._mcp_list_again, svc._mcp_relisted
        raised = []

        async def listed(tools, server):  # the first list: the server says so again meanwhile
            why = await list_again(tools, server)
            if not raised:
                tools._sources[server]._on_tools_changed()
                for _ in range(20):  # (what it said is taken note of: a list is under way)
                    await asyncio.sleep(0)
            return why

        def broken(ready, tools, server, *rest):
            if not raised:  # once
                raised.append(server)
                raise RuntimeError("a bug")
            return put(ready, tools, server, *rest)

        svc._mcp_list_again, svc._mcp_relisted = listed, broken

        async def call(name):
            tool = svc.registry.get(name)
            return await asyncio.wait_for(tool.call({}, ToolCallContext(branch_id="b", call_id=name)), WAIT)

        try:
            assert await call("change") == "change"

            async def settled():
                while not raised or any(not e.is_set() for e in svc._mcp_unsettled):
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(settled(), 10)
            assert "fresh" not in svc.registry and "ping" in svc.registry  # (the list that failed)
            assert await call("flood") == "flood"
            await asyncio.wait_for(svc.ensure_tools(), WAIT)
            assert {"fresh", "flooded"} <= set(svc.registry.names()) and "ping" not in svc.registry
        finally:
            await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())


def test_a_request_waits_for_a_list_that_hangs_a_few_seconds_at_most(make, tmp_path):
    """``ch``'s list after it said its tools changed hangs (until its time-out, 30 s). Before,
    every operate, listTools and prompt waited for it until then, whatever servers it used.
    A request waits for it ``RELIST_WAIT_S`` (5 s) at most, then goes on with the tools offered
    before (the list goes on meanwhile: its failure not yet told)."""
    c, log = start(make, tmp_path, "--hang-relist", responses=[call("change")])
    assert operate(c, c.branch()) == ["change"]
    until(lambda: len(requests(log, "tools/list")) == 2, "ch's tools listed again")
    assert mcp_tools(c) == GOOD | FIRST
    assert not warnings(c, "could not be listed again")  # (answered while that list hangs)
