"""Faults end to end: each one ends as the contract says and leaves the branch
consistent (every action_request has its action_response) and usable.

The in-operate faults share one server (``faulty``): each test has its own branch and its own
scripted model. Client disappearance and parent death get a server each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from operate_sidecar.server.rpc.settings import DEFAULT_TOOL_TIMEOUT_MS

from .support import TIMEOUT, RpcError, Sidecar, assert_consistent, calls, outputs, scripted

MODELS = {
    "model_error": scripted({"error": "upstream exploded"}, "after"),
    "model_timeout": scripted({"text": "too late", "delayMs": 60000}, "after", timeoutS=0.3),
    "raising": scripted(calls(("raising_tool", {"x": 1}))),
    "hanging": scripted(calls(("hanging_tool", {"seconds": 30})), "after"),
    "decorated": scripted(calls(("timed_tool", {"seconds": 30}))),
    "client_silent": scripted(calls(("client_probe", {"x": 1})), "after"),
    "permission_silent": scripted(calls(("record_tool", {"n": 1}))),
}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    c = Sidecar(record=str(tmp_path_factory.mktemp("faults") / "record.jsonl"))
    c.release = threading.Event()          # lets the never-answering client handlers go at the end
    c.asked = []
    try:
        c.init(models=MODELS, toolModules=["recording_tools", "timed_tools"], toolTimeoutMs=300,
               permissionTimeoutMs=300, toolPolicy={"record_tool": "ask"},
               capabilities={"toolPermission": True, "clientTools": True})
        c.register_recording_client_tool(answer=lambda p: (c.release.wait(TIMEOUT), {"output": "late"})[1])
        c.on_request("requestToolPermission",
                     lambda p: (c.asked.append(p), c.release.wait(TIMEOUT), {"decision": "allow_once"})[2])
        yield c
    finally:
        c.release.set()
        c.kill()
        c.wait(TIMEOUT)
        c.close_input()


def act(c, bid, **extra):
    return c.request("operate", {"branchId": bid, "instruction": "go", "actions": True, **extra}, timeout=TIMEOUT)


def usable(c, bid):
    assert_consistent(c.messages(bid))
    assert c.request("operate", {"branchId": bid, "instruction": "again"}, timeout=TIMEOUT)["result"] == "after"


def test_model_error_is_32011_and_the_branch_stays_usable(faulty):
    bid = faulty.branch(chatModel="model_error")
    err = faulty.error_of("operate", {"branchId": bid, "instruction": "x"})
    assert err.code == -32011 and "upstream exploded" in err.message
    usable(faulty, bid)


def test_model_timeout_is_32011(faulty):
    bid = faulty.branch(chatModel="model_timeout")
    err = faulty.error_of("operate", {"branchId": bid, "instruction": "x"})
    assert err.code == -32011 and "timed out" in err.message
    usable(faulty, bid)


def test_a_raising_tool_gives_an_error_output_not_a_failed_operate(faulty):
    bid = faulty.branch(chatModel="raising")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "raising_tool" and "exploded on purpose" in o["error"]
    assert [i["tool"] for i in faulty.invocations()].count("raising_tool") == 1
    assert_consistent(faulty.messages(bid))
    assert [e["event"] for e in faulty.of("toolEvent") if e["branchId"] == bid] == ["pre", "error"]


def test_a_hanging_python_tool_hits_tool_timeout_ms(faulty):
    bid = faulty.branch(chatModel="hanging")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "hanging_tool" and "timed out after 0.3 s" in o["error"]
    usable(faulty, bid)


def test_the_tool_decorator_timeout_wins_over_tool_timeout_ms(faulty):
    assert DEFAULT_TOOL_TIMEOUT_MS == 120_000
    bid = faulty.branch(chatModel="decorated")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "timed_tool" and "timed out after 0.2 s" in o["error"]   # not the 0.3 s setting
    assert_consistent(faulty.messages(bid))


def test_an_unanswered_client_tool_times_out_with_an_error_output(faulty):
    bid = faulty.branch(chatModel="client_silent")
    [o] = outputs(act(faulty, bid))
    assert o["function"] == "client_probe" and "timed out" in o["error"]
    assert [p["branchId"] for p in faulty.client_calls].count(bid) == 1
    # the server withdrew its request
    assert faulty.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    usable(faulty, bid)


def test_an_unanswered_permission_request_times_out_to_deny(faulty):
    bid = faulty.branch(chatModel="permission_silent")
    [o] = outputs(act(faulty, bid))
    assert o == {"error": "denied by governance gate", "function": "record_tool",
                 "reason": "permission request timed out"}
    assert [p["branchId"] for p in faulty.asked] == [bid]
    assert "record_tool" not in [i["tool"] for i in faulty.invocations()]
    assert_consistent(faulty.messages(bid))


def test_client_vanishing_mid_operate_exits_promptly_and_the_journal_is_intact(spawn, tmp_path):
    state = str(tmp_path / "state")
    c = spawn()
    c.init(models={"s": scripted("first", calls(("hanging_tool", {"seconds": 30})))},
           toolModules=["recording_tools"], stateDir=state)
    bid = c.branch(name="kept")
    assert c.request("operate", {"branchId": bid, "instruction": "one"})["result"] == "first"
    c.request_async("operate", {"branchId": bid, "instruction": "two", "actions": True})
    assert c.wait_for(lambda n: any(m == "toolEvent" and e["event"] == "pre" for m, e in n), TIMEOUT)
    c.proc.stdin.close()                   # the client vanishes while the tool runs
    assert c.wait(TIMEOUT) == 1            # prompt exit, not after the 30 s tool
    c2 = spawn()
    c2.init(models={"s": scripted("third")}, stateDir=state, toolModules=["recording_tools"])
    assert [b["name"] for b in c2.request("listBranches")["branches"]] == ["kept"]
    msgs = c2.messages(bid)
    assert_consistent(msgs)
    assert [m["content"]["instruction"] for m in msgs if m["kind"] == "instruction"][0] == "one"
    cancelled = [m["content"]["output"] for m in msgs if m["kind"] == "action_response"]
    assert cancelled in ([], [{"error": "cancelled", "function": "hanging_tool"}])
    assert c2.request("operate", {"branchId": bid, "instruction": "three"})["result"] == "third"


def test_parent_death_makes_the_watchdog_exit(sidecar):
    parent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        sidecar.request("initialize", {"processId": parent.pid, "settings": {"models": {"s": scripted("x")}}})
        assert sidecar.request("ping") == {}
        parent.stdin.close()               # the helper exits on its own: the client process is gone
        parent.wait(TIMEOUT)
        assert sidecar.wait(TIMEOUT) == 1  # the watchdog stopped the server
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(TIMEOUT)


# ---------------------------------------------------------------- the event loop never freezes

def _one_shot(c, *requests, **settings):
    """Initialize with a scripted model asking for ``requests`` (then answering "after"), run
    one operate with actions, return its outputs."""
    c.init(models={"s": scripted(calls(*requests), "after")}, **settings)
    bid = c.branch()
    return bid, outputs(c.request("operate", {"branchId": bid, "instruction": "go", "actions": True},
                                  timeout=TIMEOUT))


@pytest.mark.parametrize("tool, args, raised", [
    ("exiting_tool", {"code": 2}, "SystemExit: 2"),
    ("interrupted_tool", {}, "KeyboardInterrupt"),
    ("async_exiting_tool", {}, "SystemExit: 3"),
    # (an exception whose __str__ raises was an internal error answering the operate)
    ("unsayable_tool", {}, "_Unsayable (its message could not be read)"),
    ("unsayable_exit_tool", {}, "tool raised _UnsayableExit: _UnsayableExit (its message could not be read)"),
])
def test_a_tool_raising_systemexit_or_keyboardinterrupt_is_that_calls_error(spawn, tool, args, raised):
    """Any BaseException from a tool is that call's error output, even one whose message cannot
    be read; the server lives on."""
    c = spawn()
    bid, [o] = _one_shot(c, (tool, args), toolModules=["hostile_tools"])
    assert o["function"] == tool and raised in o["error"]
    assert c.request("ping", timeout=TIMEOUT) == {}
    assert_consistent(c.messages(bid))
    assert c.proc.poll() is None


def test_a_catastrophic_regex_in_search_text_cannot_freeze_the_server(spawn, tmp_path):
    """``(a+)+$`` over "a"*40+"!" backtracks for hours in a backtracking engine (holding the GIL:
    no ping, no exit). search_text uses a linear-time engine: the call answers at once."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "evil.txt").write_text("a" * 40 + "!\n" + "a" * 10 + "\n")
    c = spawn()
    c.request("initialize", {"workspaceFolders": [str(ws)], "settings": {
        "models": {"s": scripted(calls(("search_text", {"pattern": "(a+)+$", "regex": True})), "after")},
        "toolPolicy": {"search_text": "allow"}}}, timeout=TIMEOUT)
    bid = c.branch()
    pending = c.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True})
    assert c.request("ping", timeout=5) == {}          # the loop is not frozen meanwhile
    [o] = outputs(pending.result(TIMEOUT))
    assert o["matches"] == [{"path": "evil.txt", "line": 2, "text": "a" * 10}]


EVIL = "a" * 40 + "!"  # (a+)+$ backtracks 2**40 ways over it


@pytest.mark.parametrize("schema, arguments, error", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(a+)+$"}}}, {"a": EVIL},
     f"invalid arguments: a: '{EVIL}' does not match '(a+)+$'"),
    ({"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}}}, {EVIL: "x", "aaa": "y"},
     "invalid arguments: aaa: 'y' is not of type 'integer'"),
    ({"type": "object", "patternProperties": {"^(a+)+$": {}}, "additionalProperties": False}, {EVIL: 1},
     f"invalid arguments: (arguments): '{EVIL}' does not match any of the regexes: '^(a+)+$'"),
    # (and a schema that cannot check anything says so, not jsonschema's traceback-like text)
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, {"a": "x"},
     "the tool's input schema cannot check arguments (unresolvable $ref: PointerToNowhere: '/$defs/gone' does not exist "
     "within {'type': 'object', 'properties': {'a': {'$ref': '#/$defs/gone'}}})"),
    # a pattern RE2 cannot run (a lookahead) is not checked here: the tool checks its own arguments
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=b)"}}}, {"a": EVIL}, None),
])
def test_arguments_are_checked_against_a_tool_schema_in_linear_time_and_its_faults_named(spawn, schema, arguments, error):
    """A client tool's (or an MCP server's) input schema may hold a pattern that backtracks for
    hours in Python's engine, holding the GIL: no ping, no cancel, no exit. Arguments are checked
    against it in linear time (RE2), the call is refused as any invalid one, and the loop is never
    frozen meanwhile."""
    c = spawn()
    c.init(models={"s": scripted(calls(("slow_field", arguments)), "after")}, capabilities={"clientTools": True})
    assert c.request("registerClientTools", {"tools": [
        {"name": "slow_field", "description": "d", "inputSchema": schema}]}, timeout=TIMEOUT) == {"registered": ["slow_field"]}
    invoked = []
    c.on_request("invokeClientTool", lambda p: invoked.append(p) or {"output": "called"})
    pending = c.request_async("operate", {"branchId": c.branch(), "instruction": "go", "actions": True})
    assert c.request("ping", timeout=5) == {}          # the loop is not frozen meanwhile
    [o] = outputs(pending.result(TIMEOUT))
    if error is None:
        assert o == "called" and [p["arguments"] for p in invoked] == [arguments], (o, invoked)
    else:
        assert o["error"] == error and not invoked, o


def test_a_long_edit_of_a_large_file_never_holds_the_loop(spawn, tmp_path):
    """800 edits of a 10 MB file take seconds (each scans and copies the text), then its diff:
    done on a worker thread, so ``ping`` is answered within a second all along (on the event
    loop it waited for the whole edit); the edit lands as asked."""
    ws = tmp_path / "ws"
    ws.mkdir()
    big = ws / "big.txt"
    big.write_text("".join(f"line {i} some text here\n" for i in range(380_000)))  # (under 10 MiB)
    edits = [{"oldText": f"line {i} some", "newText": f"LINE {i} some"} for i in range(0, 380_000, 475)]
    c = spawn()
    c.request("initialize", {"workspaceFolders": [str(ws)], "settings": {
        "models": {"s": scripted(calls(("edit_file", {"path": "big.txt", "edits": edits})), "after")},
        "toolPolicy": {"edit_file": "allow"}, "toolTimeoutMs": 120_000}}, timeout=TIMEOUT)
    bid = c.branch()
    started = time.monotonic()
    pending = c.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True})
    slowest = 0.0
    while not pending.done():
        t = time.monotonic()
        assert c.request("ping", timeout=TIMEOUT) == {}
        slowest = max(slowest, time.monotonic() - t)
        time.sleep(0.01)
    [out] = outputs(pending.result(TIMEOUT))
    took = time.monotonic() - started
    assert "error" not in out, out  # (its diff is over the output bound: the output is its preview)
    # no ping waited for the edit (on the loop, the slowest waited for nearly all of it: 4.8 of 4.9 s)
    assert slowest < min(1.0, took / 3), (took, slowest)
    assert big.read_text().count("LINE ") == len(edits)


def test_search_text_skips_a_fifo_instead_of_blocking_on_it(spawn, tmp_path):
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    os.mkfifo(ws / "sub" / "pipe")                      # nobody ever writes to it
    (ws / "sub" / "note.txt").write_text("needle here\n")
    c = spawn()
    c.request("initialize", {"workspaceFolders": [str(ws)], "settings": {
        "models": {"s": scripted(calls(("search_text", {"pattern": "needle"}), ("read_file", {"path": "sub/pipe"})),
                                 "after")},
        "toolPolicy": {"search_text": "allow", "read_file": "allow"}, "toolTimeoutMs": 60_000}}, timeout=TIMEOUT)
    bid = c.branch()
    found, piped = outputs(c.request("operate", {"branchId": bid, "instruction": "go", "actions": True},
                                     timeout=TIMEOUT))
    assert found["matches"] == [{"path": "sub/note.txt", "line": 1, "text": "needle here"}]
    assert "not a file" in piped["error"]


def test_read_file_of_a_2gb_sparse_file_reads_within_its_caps(spawn, tmp_path):
    """Text first (so it is not taken for binary), then 2 GB of hole without a newline: the
    reader keeps at most its caps, and answers well within a 10 s tool time-out."""
    ws = tmp_path / "ws"
    ws.mkdir()
    big = ws / "sparse.log"
    with open(big, "wb") as f:
        f.write(b"line one\n" * 1000)
        f.truncate(2 * 1024 ** 3)
    c = spawn()
    c.request("initialize", {"workspaceFolders": [str(ws)], "settings": {
        "models": {"s": scripted(calls(("read_file", {"path": "sparse.log", "limit": 1000}),
                                       ("read_file", {"path": "sparse.log", "offset": 1001})), "after")},
        "toolPolicy": {"read_file": "allow"}, "toolTimeoutMs": 10_000, "maxToolOutputChars": 10_000_000}},
        timeout=TIMEOUT)
    bid = c.branch()
    head, tail = outputs(c.request("operate", {"branchId": bid, "instruction": "go", "actions": True},
                                   timeout=TIMEOUT))
    assert head["lines"] == 1000 and head["content"] == "line one\n" * 1000 and head["nextOffset"] == 1001
    assert tail["truncated"] is True and len(tail["content"]) <= 256 * 1024, {k: v for k, v in tail.items()
                                                                               if k != "content"}


def test_a_huge_response_format_is_refused_with_32602_and_pings_flow(spawn):
    c = spawn()
    c.init(models={"s": scripted("x")})
    bid = c.branch()
    props = {f"f{i}": {"type": "string", "description": "d" * 200} for i in range(25_000)}   # ~5 MB
    pending = c.request_async("operate", {"branchId": bid, "instruction": "x",
                                          "responseFormat": {"type": "object", "properties": props}})
    assert c.request("ping", timeout=5) == {}
    with pytest.raises(RpcError) as ei:
        pending.result(TIMEOUT)
    assert ei.value.code == -32602 and "responseFormat" in ei.value.message and "limit" in ei.value.message


# ---------------------------------------------------------------- nothing runs or leaks

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"     # a zombie is dead
    except (FileNotFoundError, IndexError):
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def test_a_tools_grandchild_dies_with_a_sigkilled_sidecar(spawn, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    c = spawn()
    _, [o] = _one_shot(c, ("spawn_tool", {"pidfile": str(pidfile)}), toolModules=["hostile_tools"])
    pid = int(pidfile.read_text())
    try:
        assert o == pid and _alive(pid)
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(TIMEOUT)
        assert _gone_within(pid, 5), "the tool's child outlived the sidecar"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_cli_models_child_dies_with_a_sigkilled_sidecar(spawn, tmp_path):
    """A CLI model mid-call (its own process group) is killed by the kernel when the sidecar
    is SIGKILLed (PR_SET_PDEATHSIG): nothing is left to run unattended."""
    pidfile = tmp_path / "cli.pid"
    script = tmp_path / "slow_cli.py"
    script.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    c = spawn()
    c.init(models={"cli": {"provider": "cli", "profile": "jsonl", "command": [sys.executable, str(script)]}})
    bid = c.branch()
    c.request_async("operate", {"branchId": bid, "instruction": "hi"})
    deadline = time.monotonic() + TIMEOUT
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    try:
        assert _alive(pid)
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(TIMEOUT)
        assert _gone_within(pid, 5), "the CLI model's process outlived the sidecar"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_tool_timeout_stops_a_cpu_bound_tool_and_the_server_keeps_answering(spawn):
    """``toolTimeoutMs`` ends a call whose tool spins in pure Python: the call's error output
    arrives on time, and ``ping`` is answered while the abandoned thread still spins."""
    c = spawn()
    c.init(models={"s": scripted(calls(("busy_tool", {"seconds": 4})), "after")}, toolModules=["hostile_tools"],
           toolTimeoutMs=300)
    bid = c.branch()
    started = time.monotonic()
    [o] = outputs(c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT))
    assert o["function"] == "busy_tool" and "timed out after 0.3 s" in o["error"]
    assert time.monotonic() - started < 3.5       # not after the 4 s spin
    assert c.request("ping", timeout=2) == {}
    assert_consistent(c.messages(bid))
