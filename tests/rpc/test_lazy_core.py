"""The core (pydantic, the pipeline) is loaded on first use, off the event loop, and the
requests that arrive meanwhile are answered in order (server/rpc/server.py CoreLoader).
When a request already waits while pygls loads (an editor's first createBranch right after
initialize), the same background pass goes on to the core; the first operate after that
has nothing left to import (server/rpc/transport.py start_app_loader)."""

from __future__ import annotations

import re
import subprocess
import sys

from .support import ROOT, TIMEOUT, frame, scripted, server_env, wait_log, wait_unmatched

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


def _loaded_line(text: str) -> str:
    return next(line for line in text.splitlines() if LOADED in line)


def test_the_first_request_after_initialize_has_the_core_loaded_in_the_loaders_pass(spawn):
    sidecar = spawn("--log-level", "info")
    sidecar.init(models={"s": scripted("x")})
    assert sidecar.request("createBranch", {"name": "first"}, timeout=TIMEOUT)["branchId"]
    assert wait_log(sidecar, LOADED)
    # the thread that loaded pygls went straight on: no hand-over to a worker thread
    assert "(thread app-loader)" in _loaded_line(sidecar.stderr_text())
    assert sidecar.stderr_text().count(LOADED) == 1


def test_the_lazy_load_runs_on_a_worker_thread_when_no_request_waited(spawn):
    sidecar = spawn("--log-level", "debug")
    sidecar.init(models={"s": scripted("x")})
    sidecar.send_raw(frame({"jsonrpc": "2.0", "id": "app-probe", "result": None}))
    assert wait_log(sidecar, APP_PROBE)
    assert sidecar.request("createBranch", {}, timeout=TIMEOUT)["branchId"]
    assert wait_log(sidecar, LOADED)
    assert "(thread app-loader)" not in _loaded_line(sidecar.stderr_text())


_IMPORT = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", re.M)
_WARM = ("json_schema_to_pydantic", "operate_sidecar.server.tools.python_modules")


def _warm_closure() -> set[str]:
    """What the delayed warm-up (server.rpc.server.CORE_WARM, and ``warm.LATER``'s operates)
    imports once the core is in: it may land at any time after the first createBranch, so it
    is allowed."""
    from operate_sidecar.server.rpc.server import CORE_MODULES, CORE_WARM

    code = (f"import asyncio, importlib, sys\nfor m in {CORE_MODULES!r}: importlib.import_module(m)\n"
            "from operate_sidecar.server.rpc import warm\n"
            "asyncio.run(warm.warm_up(shapes=warm.FIRST))\n"
            f"sys.stderr.write('--- warm\\n')\nfor m in {CORE_WARM!r}: importlib.import_module(m)\n"
            "asyncio.run(warm.warm_up(shapes=warm.LATER))\n")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=str(ROOT), env=server_env())
    assert "--- warm" in out.stderr, out.stderr[-2000:]
    return set(_IMPORT.findall(out.stderr.split("--- warm", 1)[1]))


def test_the_first_operate_after_create_branch_imports_nothing(spawn, tmp_path):
    """Everything the first operate needs (the state store, the rounds loop, the workspace
    tools, the params checkers) is loaded with the core, before createBranch is answered."""
    sidecar = spawn(env={"PYTHONPROFILEIMPORTTIME": "1"})
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)],
                                   "settings": {"models": {"s": scripted("one", "two")}}}, timeout=TIMEOUT)
    branch = sidecar.request("createBranch", {}, timeout=TIMEOUT)["branchId"]
    before = set(_IMPORT.findall(sidecar.stderr_text()))
    assert "operate_sidecar.server.core.branch" in before  # the import log works
    assert sidecar.request("operate", {"branchId": branch, "instruction": "hi"}, timeout=TIMEOUT)["result"] == "one"
    new = set(_IMPORT.findall(sidecar.stderr_text())) - before
    allowed = _warm_closure()
    assert new <= allowed, f"the first operate imported {sorted(new - allowed)}"
