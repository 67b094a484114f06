"""Python tools and tool modules that misbehave (docs/PROTOCOL.md §2, §4): one module's failure
is that module's alone, told to the user; a tool that changes its arguments changes its own
copy; arguments that break the advertised schema are a tool error; a file name that is no
UTF-8 goes out as Unicode text; a tool that swallows its cancellation still has its operate
answered at exit."""

from __future__ import annotations

import json
import time

import pytest

from .support import TIMEOUT, RpcError, scripted


@pytest.mark.parametrize(("module", "raised"), [("skipping_tools", "Skipped: needs numpy"),
                                                ("interrupting_tools", "KeyboardInterrupt")])
def test_a_module_raising_a_base_exception_at_import_loses_only_its_own_tools(sidecar, module, raised):
    sidecar.init(models={"s": scripted("x")}, toolModules=[module, "slow_tools"])
    names = {t["name"] for t in sidecar.request("listTools", {}, timeout=TIMEOUT)["tools"]}
    assert {"echo_tool", "slow_tool", "failing_tool"} <= names
    assert sidecar.wait_for(lambda _: sidecar.of("window/logMessage"), TIMEOUT)
    [told] = sidecar.of("window/logMessage")
    assert told["type"] == 2 and f"tool module {module!r} could not be imported: {raised}" in told["message"]
    assert sidecar.request("ping") == {} and sidecar.close() == 0


def call(*calls: tuple) -> dict:
    return {"json": {"action_requests": [{"function": f, "arguments": a} for f, a in calls]}}


def test_a_tool_changing_its_arguments_in_place_leaves_the_record_as_the_model_asked(spawn, tmp_path):
    """The tool gets its own copy: the action_request, the action_responses' arguments and the
    result's action_requests are what the model asked for, in memory and after a restart."""
    asked = [("normalise", {"record": {"user": {"name": "ann", "password": "pw"}}, "tags": [{"x": 1}]}),
             ("scrub", {"payload": {"k": ["v"]}})]
    expected = [a for _, a in asked]
    c = spawn()
    c.init(models={"s": scripted(call(*asked))}, toolModules=["misbehaving_tools"], stateDir=str(tmp_path))
    bid = c.branch()
    res = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)["result"]
    assert [r["output"] for r in res["action_responses"]] == ["ok", "ok"]
    assert [r["arguments"] for r in res["action_requests"]] == expected
    assert [r["arguments"] for r in res["action_responses"]] == expected

    def recorded(client) -> list:
        return [[m["content"]["arguments"] for m in client.messages(bid) if m["kind"] == kind]
                for kind in ("action_request", "action_response")]

    assert recorded(c) == [expected, expected]
    assert c.close() == 0
    again = spawn()
    again.init(models={"s": scripted("x")}, toolModules=["misbehaving_tools"], stateDir=str(tmp_path))
    assert recorded(again) == [expected, expected]


def test_a_file_name_that_is_no_utf8_comes_out_with_u_fffd_not_a_lone_surrogate(sidecar):
    """A name ``os.listdir`` decoded with ``surrogateescape`` (in an output and in an error
    text) is Unicode text on the wire, in the result, the toolEvent and branchMessages."""
    sidecar.init(models={"s": scripted(call(("listing", {}), ("listing_error", {})))},
                 toolModules=["misbehaving_tools"])
    bid = sidecar.branch()
    res = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    listing, error = [r["output"] for r in res["result"]["action_responses"]]
    assert listing == ["caf\ufffd.txt", "ok.txt"]
    assert "/tmp/caf\ufffd" in error["error"]
    recorded = [m["content"]["output"] for m in sidecar.messages(bid) if m["kind"] == "action_response"]
    assert recorded == [listing, error]
    seen = json.dumps([res, recorded, sidecar.of("toolEvent")], ensure_ascii=False)
    assert "\ufffd" in seen
    seen.encode("utf-8")  # no lone surrogate anywhere


def test_shutdown_and_exit_answer_an_operate_whose_tool_swallows_its_cancellation(sidecar, tmp_path):
    """The tool never ends (it swallows every CancelledError); ``shutdown`` + ``exit`` still
    answer its operate -32800 (docs/PROTOCOL.md §2), once, and the server exits 0."""
    started = tmp_path / "started"
    sidecar.init(models={"s": scripted(call(("stubborn_poll", {"seconds": 120, "started": str(started)})))},
                 toolModules=["misbehaving_tools"])
    bid = sidecar.branch()
    pending = sidecar.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True},
                                    msg_id="op")
    deadline = time.monotonic() + TIMEOUT
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started.exists()
    assert sidecar.close(timeout=TIMEOUT) == 0
    with pytest.raises(RpcError) as ei:
        pending.result(timeout=TIMEOUT)
    assert ei.value.code == -32800
    assert [u for u in sidecar.unmatched if u.get("id") == "op"] == []  # answered once


def test_a_request_answered_on_the_way_out_is_not_answered_again_when_its_handler_ends():
    """``answer_unfinished`` answers -32800 a handler still running; when that handler ends
    later (a tool that swallowed its cancellation returns), nothing more is sent."""
    import asyncio
    import functools

    from operate_sidecar.server.rpc.server import SidecarServer

    class Conn:
        debug = False

        def __init__(self) -> None:
            self.sent: list[tuple] = []

        def send_error(self, msg_id, code, message, data=None) -> None:
            self.sent.append((msg_id, code))

        def send_result(self, msg_id, result) -> None:
            self.sent.append((msg_id, result))

    async def main() -> list[tuple]:
        conn = Conn()
        protocol = SidecarServer(conn).protocol
        release = asyncio.Event()

        async def handler() -> str:
            await release.wait()
            return "late"

        protocol._execute_handler("op", handler, functools.partial(protocol._send_handler_result, msg_id="op"))
        future = protocol._request_futures["op"]
        protocol.answer_unfinished()
        release.set()
        await asyncio.wait_for(future, TIMEOUT)
        await asyncio.sleep(0)  # the done callbacks run
        return conn.sent

    assert asyncio.run(main()) == [("op", -32800)]


def test_python_tool_arguments_that_break_its_input_schema_are_a_tool_error_not_a_call(sidecar):
    """"3" for an integer and "no" for a boolean were coerced by pydantic's lax mode and the tool
    ran; they are checked against the advertised inputSchema as an MCP or client tool's are
    (docs/PROTOCOL.md §4), and what the schema takes is still converted (2.0 is an integer)."""
    sidecar.init(models={"s": scripted(call(("delete_rows", {"count": "3", "dry_run": "no"}),
                                            ("delete_rows", {"count": 2, "dry_run": 0}),
                                            ("delete_rows", {"count": 2.0, "dry_run": True})))},
                 toolModules=["misbehaving_tools"])
    res = sidecar.request("operate", {"branchId": sidecar.branch(), "instruction": "go", "actions": True},
                          timeout=TIMEOUT)
    strings, zero, right = [r["output"] for r in res["result"]["action_responses"]]
    assert strings["error"] == ("invalid arguments: count: '3' is not of type 'integer'; "
                                "dry_run: 'no' is not of type 'boolean'")
    assert zero["error"] == "invalid arguments: dry_run: 0 is not of type 'boolean'"
    assert right == "deleted 2 rows, dry_run=True"


def test_a_module_named_twice_in_tool_modules_is_loaded_once_without_clash_reports(sidecar):
    sidecar.init(models={"s": scripted("x")}, toolModules=["slow_tools", "slow_tools"])
    names = [t["name"] for t in sidecar.request("listTools", {}, timeout=TIMEOUT)["tools"]]
    assert names.count("echo_tool") == 1
    assert sidecar.close() == 0
    assert sidecar.of("window/logMessage") == []
