"""The core (pydantic, the pipeline) is loaded on first use, off the event loop, and the
requests that arrive meanwhile are answered in order (server/rpc/server.py CoreLoader)."""

from __future__ import annotations

from .support import frame, scripted, wait_log, wait_unmatched

LOADED = "core loaded in"
APP_PROBE = "response to unknown request 'app-probe'"


def test_core_is_not_loaded_until_a_request_needs_it(spawn):
    sidecar = spawn("--log-level", "debug")
    sidecar.init(models={"s": scripted("x")})
    assert sidecar.request("ping") == {}
    # a stray response waits for the background loader (pygls), then the app logs it (without the core)
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "app-probe", "result": None}))
    assert wait_log(sidecar, APP_PROBE), "the background loader (pygls) never finished"
    assert LOADED not in sidecar.stderr_text()
    assert sidecar.request("listBranches") == {"branches": []}
    assert wait_log(sidecar, LOADED)
    assert sidecar.stderr_text().count(LOADED) == 1


def test_requests_before_the_core_loads_all_run_in_arrival_order(spawn):
    sidecar = spawn("--log-level", "info")
    sidecar.init(models={"s": scripted("x")})
    # straight after initialize: these queue behind pygls, then behind the core
    for name in ("one", "two", "three"):
        sidecar.send_raw(frame({"jsonrpc": "2.0", "id": name, "method": "createBranch", "params": {"name": name}}))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "list", "method": "listBranches", "params": {}}))
    msgs = wait_unmatched(sidecar, 4)
    assert sorted(m["id"] for m in msgs) == ["list", "one", "three", "two"]
    assert all("result" in m for m in msgs)
    assert [b["name"] for b in sidecar.request("listBranches")["branches"]] == ["one", "two", "three"]
    assert sidecar.stderr_text().count(LOADED) == 1


def test_a_request_cancelled_while_waiting_for_the_core_is_answered_cancelled(spawn):
    sidecar = spawn("--log-level", "info")
    sidecar.init(models={"s": scripted("x")})
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "slow", "method": "createBranch", "params": {"name": "gone"}}))
    sidecar.send_raw(frame({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": "slow"}}))
    msgs = wait_unmatched(sidecar, 1)
    assert msgs[0]["id"] == "slow" and msgs[0]["error"]["code"] == -32800
    assert sidecar.request("listBranches") == {"branches": []}  # it never ran
