"""An MCP server that says its tools changed (``notifications/tools/list_changed``) has them
listed again before the next request that needs the tools: the real server over real pipes,
with a real MCP stdio server whose tools change while it runs (fixtures/changing_mcp_server.py)
beside the SDK's (fixtures/mcp_server.py)."""

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from rpc.support import RpcError, scripted  # tests/ is on sys.path
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
    # (it names the server that offers ``add``: before, the label of the servers started together,
    # ``(MCP servers 'good', 'ch' offers 'add')``)
    until(lambda: warnings(c, "MCP server 'ch': its tool 'add' is offered as 'ch__add' (MCP server 'good' offers "
                              "'add')"), "the warning about ch's add")
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
    server's names are kept for it: ``ch``'s tool is ``ch__add``, ``good``'s is ``add`` again,
    and a warning names both (before, none did: docs/PROTOCOL.md §4 has a list tell the warnings
    of a start)."""
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
    assert warnings(c, "MCP server 'ch'") == [  # (sent before that answer)
        "MCP server 'ch': its tool 'add' is offered as 'ch__add' (MCP server 'good' holds 'add' while it is stopped)"]
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


@pytest.mark.parametrize("fails", ["exit", "hang"])
def test_a_server_that_says_its_tools_changed_as_it_starts_and_fails_to_start_leaves_no_list_due(make, tmp_path, fails):
    """``ch`` says its tools changed while it starts, then does not start (it exits, or never
    answers ``initialize``: its start times out, 2 s here). Before, a list was due for it all
    the same, which no task would make while ``good`` ran: every request waited 5 s for it
    (``still being listed after 5 s``). A list is due only for a server that runs."""
    log = tmp_path / "requests.jsonl"
    c = make("--log-level", "info", env={"OPERATE_SIDECAR_MCP_START_TIMEOUT_S": "2"})
    c.init(models={"s": scripted("x")},
           mcpServers={"good": {"command": [sys.executable, SERVER, "good"]},
                       "ch": {"command": [sys.executable, CHANGING, str(log), "--changed-at-start",
                                          f"--{fails}-at-start"]}})
    assert mcp_tools(c) == GOOD
    assert mcp_tools(c) == GOOD
    err = c.stderr_text()
    assert "MCP server 'ch' says its tools changed" in err and "MCP server 'ch' unavailable" in err, err
    assert "still being listed after" not in err, err


def test_an_acp_prompt_waits_for_the_lists_due_5_s_at_most_in_all(tmp_path):
    """A configured server (``conf``) and the session's own (``mine``) both say their tools
    changed, and neither answers the list that follows (until its time-out, 30 s). Before, the
    prompt waited 5 s for the one, then 5 s more for the other (each wait ``RELIST_WAIT_S`` from
    when it began), and its operate a third time (told each time: ``still being listed after
    5 s``). The waits of one prompt share those 5 s: one wait, told once."""
    ws, conf_log, mine_log = tmp_path / "ws", tmp_path / "conf.jsonl", tmp_path / "mine.jsonl"
    ws.mkdir()
    go_conf, go_mine = tmp_path / "go_conf", tmp_path / "go_mine"
    config = write_config(tmp_path / "settings.toml", {
        "models": {"s": {"provider": "scripted", "responses": [reply("done")]}},
        "mcpServers": {"conf": {"command": [sys.executable, CHANGING, str(conf_log), "--hang-relist",
                                            "--notify-when", str(go_conf)]}}})
    err = tmp_path / "stderr"
    with open(err, "wb") as out:
        a = Raw(config, agent_env(), "--log-level", "info", stderr=out.fileno())
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        a.answer(1, WAIT)
        a.send(req(2, "session/new", cwd=str(ws), mcpServers=[
            {"name": "mine", "command": sys.executable, "env": [],
             "args": [CHANGING, str(mine_log), "--hang-relist", "--notify-when", str(go_mine)]}]))
        sid = a.answer(2, WAIT)["result"]["sessionId"]
        until(lambda: all(f.exists() and requests(f, "tools/list") for f in (conf_log, mine_log)), "both started")
        go_conf.touch()
        go_mine.touch()
        until(lambda: len(requests(conf_log, "tools/list")) == 2 == len(requests(mine_log, "tools/list")),
              "both listed again (their lists hang)")
        a.send(prompt(3, sid))
        assert a.answer(3, WAIT)["result"]["stopReason"] == "end_turn"
    finally:
        a.close()
    assert err.read_text().count("still being listed after") == 1, err.read_text()


def test_a_later_round_is_offered_the_tools_its_server_said_changed_in_the_round_before(make, tmp_path):
    """Round 1 calls ``change`` (``ping`` removed: the server says so before its answer, and
    answers the list that follows half a second late); round 2, whose model answers at once,
    calls ``ping``. Before, round 2 began with the tools of round 1 (the list not yet over):
    ``ping`` was called on the server, which had removed it (as a tool turned not read-only
    ran without asking). Each round waits for the lists due as it begins (5 s at most): round
    2's call of ``ping`` names a tool gone, a tool error, and never reaches the server."""
    c, log = start(make, tmp_path, "--slow-relist", responses=[call("change"), call("ping")])
    assert mcp_tools(c) == GOOD | FIRST
    bid = c.branch()
    out = c.request("operate", {"branchId": bid, "instruction": "call", "actions": True, "maxRounds": 2},
                    timeout=WAIT)
    assert out["rounds"] == 2, out
    [response] = out["result"]["action_responses"]
    assert "not registered" in json.dumps(response["output"]), response
    assert [m["params"]["name"] for m in requests(log, "tools/call")] == ["change"]


def test_a_list_of_thousands_of_tools_is_put_in_place_in_linear_time(tmp_path, monkeypatch):
    """In the service itself: ``ch`` lists 3000 tools more, then says its tools changed. Before,
    each list was put in place in quadratic time (each tool's name looked for among all those
    kept, and among all those listed: 10,000 tools held the event loop for seconds, no request
    answered meanwhile). The names compared while it is put in place are counted (each tool's
    name is a ``str`` that counts its comparisons): a few per tool."""
    import asyncio

    from operate_sidecar.server.core.tools import ToolCallContext
    from operate_sidecar.server.rpc import settings as S
    from operate_sidecar.server.service.service import Service
    from operate_sidecar.server.tools.mcp_source import McpToolSource

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
    from service_support import Port

    many = 3000
    compared = [0]

    class Name(str):
        __hash__ = str.__hash__

        def __eq__(self, other):
            compared[0] += 1
            return str.__eq__(self, other)

        def __ne__(self, other):
            compared[0] += 1
            return str.__ne__(self, other)

    listed = McpToolSource._listed

    def counted(self, remote, cursor):  # each tool's name as the server listed it: one that counts
        for r in remote:
            r.name = Name(r.name)
        listed(self, remote, cursor)

    monkeypatch.setattr(McpToolSource, "_listed", counted)
    log = tmp_path / "requests.jsonl"
    port = Port(S.finalize(S.merge(S.DEFAULTS, {"mcpServers": {
        "good": {"command": [sys.executable, SERVER, "good"]},
        "ch": {"command": [sys.executable, CHANGING, str(log), "--many", str(many)]}}})))

    async def main() -> None:
        svc = Service(port)
        await asyncio.wait_for(svc.ensure_tools(), WAIT)
        try:
            assert {f"t{i}" for i in range(many)} <= set(svc.registry.names())
            compared[0] = 0
            tool = svc.registry.get("change")
            assert await asyncio.wait_for(tool.call({}, ToolCallContext(branch_id="b", call_id="c")), WAIT) == "change"
            await asyncio.wait_for(svc.ensure_tools(), WAIT)  # (its list put in place)
            names = set(svc.registry.names())
            assert {"fresh", "ch__add", "t0", f"t{many - 1}"} <= names and "ping" not in names
            assert compared[0] < 10 * many, compared[0]
        finally:
            await asyncio.wait_for(svc.aclose(), WAIT)

    asyncio.run(main())


def tool_calls(log):
    return [m["params"]["name"] for m in requests(log, "tools/call")]


def test_a_later_round_waits_for_the_lists_due_however_long_the_rounds_before_took(make, tmp_path):
    """Round 1 calls ``change`` (the list that follows answered half a second late: round 2
    waits for it); round 2's model answers 5.5 s late, calling ``flood`` (``flooded`` added, its
    list half a second late too); round 3 calls ``flooded``. Before, an operate waited for lists
    until 5 s after its first wait began, however long it then spent elsewhere: round 3 began
    without waiting, ``flooded`` not yet offered (a tool error, never sent to the server). Only
    the time spent waiting counts towards the request's 5 s: round 3 waits, and ``flooded`` runs."""
    c, log = start(make, tmp_path, "--slow-relist",
                   responses=[call("change"), {**call("flood"), "delayMs": 5500}, call("flooded")])
    out = c.request("operate", {"branchId": c.branch(), "instruction": "call", "actions": True, "maxRounds": 3},
                    timeout=WAIT)
    assert out["rounds"] == 3, out
    assert out["result"]["action_responses"][0]["output"] == "flooded", out
    assert tool_calls(log) == ["change", "flood", "flooded"]


def replace_database(state: Path) -> None:
    """Replace the state database (and its -wal) with a copy of itself, as a backup restore
    would: the same records in other files, which the running server no longer writes to (its
    saves are then known to fail: tests/rpc/test_rounds_faults.py)."""
    names = [n for n in os.listdir(state) if n in ("state.sqlite3", "state.sqlite3-wal")]
    assert "state.sqlite3" in names
    for name in names:
        shutil.copy2(state / name, state / (name + ".copy"))
    for name in names:
        os.replace(state / (name + ".copy"), state / name)


def test_a_save_known_to_fail_once_a_round_has_waited_for_a_list_ends_the_rounds_before_its_model(make, tmp_path):
    """Round 1 calls ``change``; the list that follows is answered only once the file ``hold``
    exists, and the state database is replaced (every save known to fail) while round 2 waits
    for that list. Before, whether the save could still be made was asked before that wait:
    round 2's model was called and its ``flood`` ran on the server (an effect of an operate whose
    save then failed). It is asked after the wait: the operate answers -32013, round 2's model
    is never called and its tool never runs."""
    log, hold, state = tmp_path / "requests.jsonl", tmp_path / "hold", tmp_path / "state"
    c = make()
    c.init(models={"s": scripted(call("change"), call("flood"), call("ping"))}, stateDir=str(state),
           mcpServers={"ch": {"command": [sys.executable, CHANGING, str(log), "--hold-relist", str(hold)]}})
    bid = c.branch()
    pending = c.request_async("operate", {"branchId": bid, "instruction": "call", "actions": True, "maxRounds": 3})
    until(lambda: any(e["event"] == "post" for e in c.of("toolEvent")) and len(requests(log, "tools/list")) == 2,
          "round 1's change over, the list it asked for under way")
    replace_database(state)  # (round 2 waits for that list meanwhile)
    hold.touch()
    with pytest.raises(RpcError) as ei:
        pending.result(WAIT)
    assert ei.value.code == -32013, ei.value
    assert tool_calls(log) == ["change"]
    assert [(e["event"], e["tool"]) for e in c.of("toolEvent")] == [("pre", "change"), ("post", "change")]


def test_an_operate_queued_behind_another_is_offered_the_tools_as_they_are_when_its_turn_comes(make, tmp_path):
    """Operate A on a branch calls ``gate`` (it waits for a file), operate B comes meanwhile and
    queues behind it; then A's round 2 calls ``change`` (``ping`` removed; the list that follows
    answered half a second late) and A ends. Before, B's round 1 began at once with the tools
    as they were when B came: ``ping`` was offered and called on the server, which had removed
    it. The lists due as an operate's turn comes are waited for first: B's call of ``ping`` names
    a tool gone (a tool error), and never reaches the server."""
    log, opened = tmp_path / "requests.jsonl", tmp_path / "open"
    c = make()
    c.init(models={"s": scripted({"json": {"action_requests": [{"function": "gate",
                                                                "arguments": {"path": str(opened)}}]}},
                                 call("change"), call("ping"))},
           toolModules=["rounds_tools"],
           mcpServers={"ch": {"command": [sys.executable, CHANGING, str(log), "--slow-relist"]}})
    bid = c.branch()
    a = c.request_async("operate", {"branchId": bid, "instruction": "a", "actions": True, "maxRounds": 2})
    until(lambda: any(e["event"] == "pre" and e["tool"] == "gate" for e in c.of("toolEvent")), "A's gate runs")
    b = c.request_async("operate", {"branchId": bid, "instruction": "b", "actions": True})
    assert mcp_tools(c) == FIRST  # (answered after B was read: B has its params, and waits for its turn)
    opened.touch()
    assert a.result(WAIT)["rounds"] == 2
    [response] = b.result(WAIT)["result"]["action_responses"]
    assert "not registered" in json.dumps(response["output"]), response
    assert tool_calls(log) == ["change"]


def test_a_warning_names_the_name_a_running_sibling_offers_the_tool_as(make, tmp_path):
    """``good`` and ``other`` both offer ``add`` (offered as ``good__add`` and ``other__add``);
    ``ch`` then adds its own ``add``, offered as ``ch__add`` since ``good`` holds that name.
    Before, the warning said ``MCP server 'good' offers 'add'``, which no client could call by
    that name; it says the name ``good`` offers it as."""
    log = tmp_path / "requests.jsonl"
    c = make()
    c.init(models={"s": scripted(call("change"))},
           mcpServers={"good": {"command": [sys.executable, SERVER, "good"]},
                       "other": {"command": [sys.executable, SERVER, "other"]},
                       "ch": {"command": [sys.executable, CHANGING, str(log)]}})
    assert operate(c, c.branch()) == ["change"]
    assert {"good__add", "other__add", "ch__add"} <= mcp_tools(c)
    until(lambda: warnings(c, "MCP server 'ch'"), "the warning about ch's add")
    assert warnings(c, "MCP server 'ch'") == [
        "MCP server 'ch': its tool 'add' is offered as 'ch__add' (MCP server 'good' offers 'add', as 'good__add')"]
