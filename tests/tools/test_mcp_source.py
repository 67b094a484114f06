"""operate_sidecar.server.tools.mcp_source against a real MCP stdio server (fixtures/mcp_server.py), spawned for real."""

import io
import os
from pathlib import Path
import subprocess
import sys

import anyio
import jsonschema
import pytest

from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.tools import McpToolSource, ToolCallError, ToolSourceError, open_mcp_sources

SERVER = str(__import__("pathlib").Path(__file__).parent / "fixtures" / "mcp_server.py")
CTX = ToolCallContext(branch_id="b", call_id="c")
WAIT = 60  # seconds: every wait in these tests is bounded

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def spec(*args, env=None):
    out = {"command": [sys.executable, SERVER, *args]}
    if env is not None:
        out["env"] = env
    return out


@pytest.fixture(scope="module")
async def two_servers():
    """Servers "alpha" and "beta" (same tool names, so they clash) plus "add" reserved.
    Start is bounded by start_timeout; the SDK bounds the shutdown."""
    err = io.StringIO()
    config = {"alpha": spec("alpha"), "beta": spec("beta", env={"MCP_FIXTURE_TAG": "t1"})}
    async with open_mcp_sources(config, reserved={"add"}, errlog=err, start_timeout=WAIT) as tools:
        yield {t.name: t for t in tools}, err


@pytest.fixture(scope="module")
async def one_server():
    async with anyio.create_task_group() as tg:
        source = McpToolSource("solo", spec("solo")["command"], errlog=io.StringIO(), start_timeout=WAIT)
        with anyio.fail_after(WAIT):
            await source.start(tg)
        try:
            yield source
        finally:
            with anyio.fail_after(WAIT):
                await source.aclose()


async def call(tool, args):
    with anyio.fail_after(WAIT):
        return await tool.call(tool.validate_arguments(args), CTX)


async def test_lists_tools_with_plain_names_source_mcp_and_valid_schemas(one_server):
    tools = {t.name: t for t in one_server.tools()}
    assert set(tools) == {"echo", "add", "stats", "lines", "fail", "whoami", "pid"}
    for t in tools.values():
        assert t.source == "mcp"
        jsonschema.Draft202012Validator.check_schema(t.input_schema)
    assert tools["add"].description == "Add two integers."
    assert tools["add"].input_schema["required"] == ["a", "b"]


async def test_read_only_hint_sets_read_only(one_server):
    tools = {t.name: t for t in one_server.tools()}
    assert tools["echo"].read_only is True
    assert tools["add"].read_only is False


async def test_call_returns_text_content(one_server):
    tools = {t.name: t for t in one_server.tools()}
    assert await call(tools["echo"], {"text": "héllo"}) == "héllo"
    assert await call(tools["lines"], {"n": 3}) == "line 0\nline 1\nline 2"


async def test_call_returns_structured_content_unwrapping_primitive_results(one_server):
    tools = {t.name: t for t in one_server.tools()}
    assert await call(tools["add"], {"a": 2, "b": 3}) == 5
    assert await call(tools["stats"], {"values": [1, 3]}) == {"min": 1.0, "max": 3.0, "n": 2.0}


async def test_error_result_raises_tool_call_error_with_the_error_text(one_server):
    fail = {t.name: t for t in one_server.tools()}["fail"]
    with pytest.raises(ToolCallError, match="failed on purpose: boom"):
        await call(fail, {"reason": "boom"})


async def test_server_keeps_serving_after_a_tool_error(one_server):
    tools = {t.name: t for t in one_server.tools()}
    with pytest.raises(ToolCallError):
        await call(tools["fail"], {"reason": "x"})
    assert await call(tools["echo"], {"text": "still here"}) == "still here"


async def test_arguments_are_validated_against_the_server_schema(one_server):
    add = {t.name: t for t in one_server.tools()}["add"]
    from operate_sidecar.server.core.errors import ToolArgumentError

    with pytest.raises(ToolArgumentError):
        add.validate_arguments({"a": "two", "b": 1})


async def test_clashing_and_reserved_names_get_the_server_prefix(two_servers):
    tools, _ = two_servers
    assert {"alpha__echo", "beta__echo", "alpha__add", "beta__add"} <= set(tools)
    assert "echo" not in tools and "add" not in tools
    assert await call(tools["beta__echo"], {"text": "b"}) == "b"


async def test_env_is_passed_to_the_server(two_servers):
    tools, _ = two_servers
    assert await call(tools["beta__whoami"], {}) == "beta:t1"
    assert await call(tools["alpha__whoami"], {}) == "alpha:"


async def test_server_stderr_is_relayed_to_errlog_with_the_server_name(two_servers):
    tools, err = two_servers
    await call(tools["alpha__echo"], {"text": "marker-123"})
    with anyio.fail_after(WAIT):
        while "marker-123" not in err.getvalue():
            await anyio.sleep(0.05)
    line = next(line for line in err.getvalue().splitlines() if "marker-123" in line)
    assert line.startswith("[mcp alpha] ")


async def test_tools_fail_clearly_after_the_source_is_closed():
    source = McpToolSource("short", spec("short")["command"], errlog=io.StringIO(), start_timeout=WAIT)
    async with source:
        echo = {t.name: t for t in source.tools()}["echo"]
    assert not source.running
    with pytest.raises(ToolCallError, match="'short' is not running"):
        await call(echo, {"text": "x"})


async def test_server_that_exits_at_start_is_named_with_its_stderr():
    with pytest.raises(ToolSourceError) as info:
        async with open_mcp_sources({"crashy": spec("--crash")}, errlog=io.StringIO(), start_timeout=WAIT):
            pass  # pragma: no cover
    msg = str(info.value)
    assert "MCP server 'crashy' failed to start" in msg
    assert "refusing to start (--crash)" in msg


async def test_missing_command_is_named():
    with pytest.raises(ToolSourceError, match=r"'ghost' failed to start.*command not found"):
        async with open_mcp_sources({"ghost": {"command": ["/nonexistent/mcp-server-xyz"]}}, start_timeout=WAIT):
            pass  # pragma: no cover


async def test_server_that_never_answers_times_out_with_its_name():
    with pytest.raises(ToolSourceError, match=r"'sleepy' failed to start.*within 1 s") as info:
        async with open_mcp_sources({"sleepy": spec("--hang")}, start_timeout=1, errlog=io.StringIO()):
            pass  # pragma: no cover
    assert "hanging (--hang)" in str(info.value)


async def test_a_server_whose_answer_cannot_be_read_is_named_with_what_could_not_be_read():
    """The SDK drops a line it cannot read (logging it) and its request is never answered: the
    time-out's message says what the line was, not only that no answer came."""
    unreadable = {"command": [sys.executable, str(Path(SERVER).parent / "unreadable_mcp_server.py")]}
    with pytest.raises(ToolSourceError) as info:
        async with open_mcp_sources({"odd": unreadable}, start_timeout=2, errlog=io.StringIO()):
            pass  # pragma: no cover
    msg = str(info.value)
    assert "'odd' failed to start" in msg and ("within 2 s (a message it sent could not be read: not a JSON-RPC "
                                               'message: {"jsonrpc": "2.0", "id": 2, "result": null})') in msg, msg


async def test_one_failing_server_stops_the_others_and_names_the_failure():
    with pytest.raises(ToolSourceError, match="'crashy'"):
        async with open_mcp_sources({"good": spec("good"), "crashy": spec("--crash")}, errlog=io.StringIO(),
                                    start_timeout=WAIT):
            pass  # pragma: no cover


async def test_exception_in_the_block_propagates_unwrapped():
    with pytest.raises(KeyError, match="from the body"):
        async with open_mcp_sources({"body": spec("body")}, errlog=io.StringIO(), start_timeout=WAIT):
            raise KeyError("from the body")


def process_gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_cancelling_the_block_stops_the_servers():
    with anyio.CancelScope() as scope:
        async with open_mcp_sources({"c1": spec("c1"), "c2": spec("c2")}, errlog=io.StringIO(),
                                    start_timeout=WAIT) as tools:
            by = {t.name: t for t in tools}
            pids = [await call(by["c1__pid"], {}), await call(by["c2__pid"], {})]
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert all(process_gone(p) for p in pids)


async def test_closing_the_block_stops_the_servers():
    async with open_mcp_sources({"s1": spec("s1")}, errlog=io.StringIO(), start_timeout=WAIT) as tools:
        pid = await call(tools[-1], {})
    assert tools[-1].name == "pid" and process_gone(pid)


async def test_bad_configuration_is_a_tool_source_error():
    with pytest.raises(ToolSourceError, match="command must be a non-empty list"):
        async with open_mcp_sources({"bad": {"command": "python server.py"}}):
            pass  # pragma: no cover
    with pytest.raises(ToolSourceError, match="unknown configuration keys"):
        async with open_mcp_sources({"bad": {"command": ["x"], "args": []}}):
            pass  # pragma: no cover


async def test_no_servers_yields_no_tools():
    async with open_mcp_sources({}) as tools:
        assert tools == []


def test_importing_server_tools_does_not_import_the_mcp_sdk():
    code = "import sys, operate_sidecar.server.tools; print('mcp' in sys.modules, 'mcp_types' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT,
                         cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False"


async def test_relayed_stderr_lines_are_redacted(two_servers, monkeypatch):
    """SECURITY.md G6: a registered secret, or a key-shaped token, that the server writes to its
    stderr never reaches ours (nor the tail quoted when a server fails to start)."""
    from operate_sidecar.server import redaction

    monkeypatch.setattr(redaction, "_KNOWN", set(redaction._KNOWN))  # forget the secret afterwards
    monkeypatch.setattr(redaction, "_ORDERED", redaction._ORDERED)
    secret = "mcp-relay-secret-5309"
    redaction.remember_secret(secret)
    tools, err = two_servers
    await call(tools["alpha__echo"], {"text": f"marker-456 {secret} sk-live0123456789abcdef"})
    with anyio.fail_after(WAIT):
        while "marker-456" not in err.getvalue():
            await anyio.sleep(0.05)
    line = next(line for line in err.getvalue().splitlines() if "marker-456" in line)
    assert line.startswith("[mcp alpha] ") and line.count("[REDACTED]") == 2
    assert secret not in err.getvalue() and "sk-live0123456789abcdef" not in err.getvalue()


# -- every process an MCP server started goes with it ---------------------------------------------
# The SDK starts a server in a session of its own (out of reach of the sidecar's own reaper).

def recording(pidfile, then, *, ignore_term=False):
    """A server command: a grandchild (``sleep``) and the server itself write their pids to
    ``pidfile`` (the grandchild's first), then the server ``exec``s ``then``."""
    trap = 'trap "" TERM; ' if ignore_term else ""
    return ["/bin/sh", "-c", trap + 'sleep 600 & echo $! >> "$0"; echo $$ >> "$0"; exec "$@"', str(pidfile), *then]


def running(pid):
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


async def recorded(pidfile):
    with anyio.fail_after(WAIT):
        while len(pidfile.read_text().split() if pidfile.exists() else []) < 2:
            await anyio.sleep(0.02)
    return [int(p) for p in pidfile.read_text().split()]


@pytest.fixture
def no_leftovers():
    pids = []
    yield pids
    for p in pids:  # the test failed: do not leave its processes behind
        if running(p):
            os.kill(p, 9)


async def test_a_stopped_start_terminates_a_server_hanging_in_its_handshake_at_once(tmp_path, no_leftovers):
    pidfile = tmp_path / "pids"
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        async def stop_when_running():
            no_leftovers.extend(await recorded(pidfile))
            stop.set()

        tg.start_soon(stop_when_running)
        async with open_mcp_sources({"hung": {"command": recording(pidfile, ["sleep", "600"])}}, stop=stop,
                                    start_timeout=WAIT, errlog=io.StringIO()) as tools:
            stopped_at = anyio.current_time()
            assert tools == []                      # stopped on purpose: no tools, no failure
        assert anyio.current_time() - stopped_at < 1.5  # not the SDK's 2 s grace after stdin closes
    assert not [p for p in no_leftovers if running(p)]


async def test_a_cancelled_start_does_not_wait_on_the_server(tmp_path, no_leftovers):
    pidfile = tmp_path / "pids"
    cancelled_at = []
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_when_running():
                no_leftovers.extend(await recorded(pidfile))
                cancelled_at.append(anyio.current_time())
                scope.cancel()

            tg.start_soon(cancel_when_running)
            async with open_mcp_sources({"hung": {"command": recording(pidfile, ["sleep", "600"])}},
                                        start_timeout=WAIT, errlog=io.StringIO()):
                pass  # pragma: no cover
    assert scope.cancelled_caught
    assert anyio.current_time() - cancelled_at[0] < 1.5  # not the SDK's 2 s grace after stdin closes
    assert not [p for p in no_leftovers if running(p)]


async def test_closing_a_server_kills_what_it_left_in_its_group(tmp_path, no_leftovers):
    # the server exits when its stdin closes; its child ignores SIGTERM: it was left running
    pidfile = tmp_path / "pids"
    cmd = recording(pidfile, [sys.executable, SERVER, "left"], ignore_term=True)
    async with open_mcp_sources({"left": {"command": cmd}}, start_timeout=WAIT, errlog=io.StringIO()) as tools:
        assert "echo" in {t.name for t in tools}
        no_leftovers.extend(await recorded(pidfile))
        assert all(running(p) for p in no_leftovers)
    assert not [p for p in no_leftovers if running(p)]


def wait_gone(pids, timeout=WAIT):
    import time

    deadline = time.monotonic() + timeout
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def sync_recorded(pidfile, timeout=WAIT):
    import time

    deadline = time.monotonic() + timeout
    while len(pidfile.read_text().split() if pidfile.exists() else []) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    return [int(p) for p in pidfile.read_text().split()] if pidfile.exists() else []


def test_a_server_hanging_in_its_handshake_does_not_outlive_the_sidecar(sidecar, tmp_path, no_leftovers):
    import time

    pidfile = tmp_path / "pids"
    sidecar.request("initialize", {"settings": {
        "models": {"s": {"provider": "scripted", "responses": ["done"]}},
        "mcpServers": {"hung": {"command": recording(pidfile, ["sleep", "600"])}}}}, timeout=WAIT)
    bid = sidecar.request("createBranch", {}, timeout=WAIT)["branchId"]
    sidecar.request_async("operate", {"branchId": bid, "instruction": "x"})  # loads the tools: waits on "hung"
    no_leftovers.extend(sync_recorded(pidfile))
    assert len(no_leftovers) == 2
    t0 = time.monotonic()
    sidecar.proc.stdin.close()
    sidecar.proc.wait(WAIT)
    took = time.monotonic() - t0
    assert wait_gone(no_leftovers, 2.0) == []
    assert "did not stop in time" not in sidecar.stderr_text() and "Traceback" not in sidecar.stderr_text()
    assert took < WAIT


def test_a_started_server_and_its_child_die_with_a_killed_sidecar(sidecar, tmp_path, no_leftovers):
    pidfile = tmp_path / "pids"
    sidecar.request("initialize", {"settings": {
        "models": {"s": {"provider": "scripted", "responses": ["done"]}},
        "mcpServers": {"fx": {"command": recording(pidfile, [sys.executable, SERVER, "fx"])}}}}, timeout=WAIT)
    bid = sidecar.request("createBranch", {}, timeout=WAIT)["branchId"]
    sidecar.request("operate", {"branchId": bid, "instruction": "x"}, timeout=WAIT)  # the server has started
    assert "echo" in {t["name"] for t in sidecar.request("listTools", {}, timeout=WAIT)["tools"]}
    no_leftovers.extend(sync_recorded(pidfile))
    assert all(running(p) for p in no_leftovers) and len(no_leftovers) == 2
    sidecar.proc.kill()                                   # SIGKILL: no clean-up of its own
    sidecar.proc.wait(WAIT)
    assert wait_gone(no_leftovers, 5.0) == []


async def test_a_line_the_sdk_cannot_read_is_logged_in_one_line_saying_what_it_was(caplog):
    """The SDK logs such a line with its parser's traceback; the log says what the line was."""
    import logging

    unreadable = {"command": [sys.executable, str(Path(SERVER).parent / "unreadable_mcp_server.py")]}
    with caplog.at_level(logging.ERROR, logger="mcp.client.stdio"):
        with pytest.raises(ToolSourceError):
            async with open_mcp_sources({"odd": unreadable}, start_timeout=2, errlog=io.StringIO()):
                pass  # pragma: no cover
    records = [r for r in caplog.records if r.name == "mcp.client.stdio"]
    assert records and all(r.exc_info is None and r.exc_text is None for r in records)
    assert records[0].getMessage() == ("an MCP server wrote a line that could not be read, which is ignored: not a "
                                       'JSON-RPC message: {"jsonrpc": "2.0", "id": 2, "result": null}')
    assert "Traceback" not in caplog.text
