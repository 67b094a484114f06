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


async def start_failure(name, server, **kw):
    """Why the server ``server`` (a config entry), started as ``name`` alone, did not start: the
    message of its ``ToolSourceError`` (``open_mcp_sources``' ``failed``)."""
    kw.setdefault("errlog", io.StringIO())
    kw.setdefault("start_timeout", WAIT)
    async with open_mcp_sources({name: server}, **kw) as tools:
        assert list(tools) == [] and list(tools.failed) == [name]
        assert isinstance(tools.failed[name], ToolSourceError)
        return str(tools.failed[name])


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
    msg = await start_failure("crashy", spec("--crash"))
    assert "MCP server 'crashy' failed to start" in msg
    assert "refusing to start (--crash)" in msg


async def test_missing_command_is_named():
    msg = await start_failure("ghost", {"command": ["/nonexistent/mcp-server-xyz"]})
    assert "'ghost' failed to start" in msg and "command not found: /nonexistent/mcp-server-xyz" in msg, msg


async def test_server_that_never_answers_times_out_with_its_name():
    msg = await start_failure("sleepy", spec("--hang"), start_timeout=1)
    assert "'sleepy' failed to start" in msg and "within 1 s" in msg, msg
    assert "hanging (--hang)" in msg


async def test_a_server_whose_answer_cannot_be_read_is_named_with_what_could_not_be_read():
    """The SDK drops a line it cannot read (logging it) and its request is never answered: the
    time-out's message says what the line was, not only that no answer came."""
    unreadable = {"command": [sys.executable, str(Path(SERVER).parent / "unreadable_mcp_server.py")]}
    msg = await start_failure("odd", unreadable, start_timeout=2)
    assert "'odd' failed to start" in msg and ("within 2 s (a message it sent could not be read: not a JSON-RPC "
                                               'message: {"jsonrpc": "2.0", "id": 2, "result": null})') in msg, msg


async def test_one_failing_server_is_named_and_the_others_tools_are_offered():
    """Each server starts on its own: one that does not start (it exits, its command is not
    found) is named with why, and took every other server's tools with it; now the others'
    tools are offered (and work), named as if the failed one were not configured."""
    config = {"good": spec("good"), "crashy": spec("--crash"), "ghost": {"command": ["/nonexistent/mcp-xyz"]}}
    async with open_mcp_sources(config, errlog=io.StringIO(), start_timeout=WAIT) as tools:
        assert sorted(tools.failed) == ["crashy", "ghost"]
        assert "MCP server 'crashy' failed to start" in str(tools.failed["crashy"])
        assert "command not found" in str(tools.failed["ghost"])
        by = {t.name: t for t in tools}
        assert set(by) == {"echo", "add", "stats", "lines", "fail", "whoami", "pid"}  # plain: nothing clashes
        assert {server for server, _ in tools.origin.values()} == {"good"}
        assert await call(by["whoami"], {}) == "good:"


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


async def test_relayed_stderr_lines_are_redacted(two_servers):
    """SECURITY.md G6: a registered secret, or a key-shaped token, that the server writes to its
    stderr never reaches ours (nor the tail quoted when a server fails to start)."""
    from operate_sidecar.server import redaction

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
        await start_failure("odd", unreadable, start_timeout=2)
    records = [r for r in caplog.records if r.name == "mcp.client.stdio"]
    assert records and all(r.exc_info is None and r.exc_text is None for r in records)
    assert records[0].getMessage() == ("an MCP server wrote a line that could not be read, which is ignored: not a "
                                       'JSON-RPC message: {"jsonrpc": "2.0", "id": 2, "result": null}')
    assert "Traceback" not in caplog.text


# -- servers that misbehave ---------------------------------------------------------------------

RAW = str(Path(SERVER).parent / "raw_mcp_server.py")
LONG_STDERR = str(Path(SERVER).parent / "long_stderr_server.py")


def raw(*args):
    return {"command": [sys.executable, RAW, *args]}


async def test_a_line_not_in_utf8_on_a_servers_stdout_is_dropped_and_the_server_serves_on(caplog):
    """A byte that is not UTF-8 on a server's stdout (a Latin-1 banner a wrapper script prints
    first, a child's output during a call) ended the SDK's reader there: the start, or the call
    and every later call, waited for their time-outs, with nothing said. Now such a line is
    dropped, and logged, as any line that is no JSON-RPC message, and the server serves on."""
    import logging

    with caplog.at_level(logging.ERROR, logger="mcp.client.stdio"):
        async with open_mcp_sources({"banner": raw("--banner"), "mid": raw()}, errlog=io.StringIO(),
                                    start_timeout=20) as tools:
            assert tools.failed == {}
            by = {t.name: t for t in tools}
            assert await call(by["banner__echo"], {"text": "after the banner"}) == "after the banner"
            assert await call(by["mid__garble"], {}) == "garbled"
            assert await call(by["mid__echo"], {"text": "still served"}) == "still served"
    unread = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(unread) == 2, unread


def test_a_start_failure_inside_exception_groups_is_named_by_its_cause():
    """The SDK's task groups wrap what went wrong in exception groups, which say only "unhandled
    errors in a TaskGroup (1 sub-exception)": the warning names the cause inside them."""
    import asyncio

    from operate_sidecar.server.tools.mcp_source import _describe

    source = McpToolSource("grouped", ["/nonexistent/grouped-server"])
    nested = BaseExceptionGroup("unhandled errors in a TaskGroup", [
        asyncio.CancelledError(), ExceptionGroup("unhandled errors in a TaskGroup", [FileNotFoundError(2, "gone")])])
    assert source._start_failure(nested) == ("MCP server 'grouped' failed to start (/nonexistent/grouped-server): "
                                             "command not found: /nonexistent/grouped-server")
    assert _describe(ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("the real cause")])) == \
        "the real cause"


async def test_a_secret_in_a_stderr_line_too_long_to_relay_whole_is_masked_wherever_the_line_is_cut():
    """SECURITY.md G6. A stderr line longer than the relay holds is relayed in pieces; in a line
    with no blank to cut at (a minified JSON dump), a known secret across a cut was masked in
    neither piece. Now no cut goes through a secret or a key-shaped token (one with a blank in
    it too), and the stderr the warning quotes is bounded (it quoted the whole line)."""
    from operate_sidecar.server import redaction

    secret = "long-line-secret-8675309"
    redaction.remember_secret(secret)
    bearer = "Bearer abcdefgh12345678"
    for unit, masked in ((f"-{secret}", "-[REDACTED]"), (f" {bearer} {'x' * 40}", f" Bearer [REDACTED] {'x' * 40}")):
        err = io.StringIO()
        count = 800_000 // len(unit)
        env = {"LONG_STDERR_UNIT": unit, "LONG_STDERR_COUNT": str(count)}
        msg = await start_failure("long", {"command": [sys.executable, LONG_STDERR], "env": env}, errlog=err)
        pieces = [line.removeprefix("[mcp long] ") for line in err.getvalue().splitlines()]
        assert len(pieces) > 3  # relayed in pieces
        assert "".join(pieces) == masked * count  # every secret masked whole, nothing else changed
        first, _, quoted = msg.partition("\nstderr (last lines):\n")
        assert first.startswith("MCP server 'long' failed to start") and quoted, msg[:300]
        assert len(quoted) <= 4000 and all(len(line) < 1100 for line in quoted.splitlines()), len(quoted)
        assert "[REDACTED]" in quoted and "abcdefgh1234" not in quoted and secret[:12] not in quoted


@pytest.mark.parametrize("head,tail,masked", [
    ('{"api_key": "', '", "next": 1}', '{"api_key": "[REDACTED]", "next": 1}'),
    ("key: sk-", " done", "key: [REDACTED] done"),
    ("Authorization: Bearer ", " done", "Authorization: Bearer [REDACTED] done"),
], ids=["api_key", "sk", "bearer"])
async def test_a_key_shaped_value_longer_than_the_relay_holds_is_masked_whole(head, tail, masked):
    """SECURITY.md G6. A key-shaped value of 200 Ki characters in a stderr line (longer than the
    8 Ki characters held back, so that it runs across every place the line could be cut) was cut
    at the limit: the first piece masked, the rest of the value relayed as it was. The text held
    is masked whole now, the token's first characters kept for what comes next of it: none of the
    value is relayed."""
    err = io.StringIO()
    env = {"LONG_STDERR_HEAD": head, "LONG_STDERR_UNIT": "k" * 50_000, "LONG_STDERR_COUNT": "4",
           "LONG_STDERR_TAIL": tail}
    msg = await start_failure("long", {"command": [sys.executable, LONG_STDERR], "env": env}, errlog=err)
    relayed = err.getvalue()
    assert "k" * 6 not in relayed and "k" * 6 not in msg, relayed[:300]
    assert "".join(line.removeprefix("[mcp long] ") for line in relayed.splitlines()) == masked, relayed[:300]


async def test_a_tool_name_a_server_lists_twice_is_offered_once_with_a_warning():
    """A server listing one name twice lost all its tools, with a message blaming the prefix.
    Now the first tool of that name is offered, the server's other tools too, and a warning
    names what is listed twice."""
    async with open_mcp_sources({"twice": raw("--twice")}, errlog=io.StringIO(), start_timeout=WAIT) as tools:
        assert [t.name for t in tools] == ["echo", "garble"] and tools.failed == {}
        assert tools[0].description == "the first echo"
        assert tools.warnings == ["MCP server 'twice' lists the tool name 'echo' more than once: the first tool of "
                                  "that name is offered, the others are not"]
        assert await call(tools[0], {"text": "once"}) == "once"


async def test_two_server_names_with_the_same_prefix_keep_the_first_ones_tools_and_say_so():
    """``a b`` and ``a_b`` both prefix their clashing tools ``a_b__``: every configured server's
    tools were lost ("taken twice even with the server prefix"). Now the first one's are offered,
    and a warning names the other's that are not, and why."""
    async with open_mcp_sources({"a b": raw(), "a_b": raw()}, errlog=io.StringIO(), start_timeout=WAIT) as tools:
        assert sorted(t.name for t in tools) == ["a_b__echo", "a_b__garble"]
        assert {server for server, _ in tools.origin.values()} == {"a b"}
        assert tools.warnings == ["MCP server 'a_b': tools not offered, since their names are taken even with the "
                                  "server's prefix: 'echo' as 'a_b__echo', 'garble' as 'a_b__garble' (MCP server "
                                  "'a b' offers tools of those names)"]


async def test_a_list_of_tools_that_never_ends_is_read_to_its_100th_page_and_said():
    async with open_mcp_sources({"pages": raw("--endless-pages")}, errlog=io.StringIO(),
                                start_timeout=WAIT) as tools:
        assert [t.name for t in tools] == [f"page_{n}" for n in range(100)]
        assert tools.warnings == ["MCP server 'pages' listed its tools on more than 100 pages (each answer to "
                                  "tools/list gave a next cursor): the tools of the first 100 pages are offered, "
                                  "the rest are not"]


async def test_a_key_in_a_servers_command_line_is_masked_in_why_it_did_not_start():
    """SECURITY.md G6: the command line the warning quotes is masked as the server's stderr is."""
    key = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
    msg = await start_failure("keyed", {"command": ["/nonexistent/mcp-xyz", "--api-key", key]})
    assert key not in msg and "(/nonexistent/mcp-xyz --api-key [REDACTED])" in msg, msg


async def test_terminal_escape_codes_a_server_writes_on_stderr_do_not_reach_ours():
    """A server's stderr is relayed to ours, which a terminal or an editor's log view shows: its
    escape sequences (colours, a window title, the clipboard: ``ESC ] 52``) would act there, and a
    carriage return would overwrite what came before it. They are dropped; the text is kept, as a
    terminal would have shown it; other control characters are shown escaped. The same for the
    stderr quoted when the server fails to start."""
    err = io.StringIO()
    script = ("printf 'boot \\033[1;31mred\\033[0m done \\033]52;c;cHduZWQ=\\007 \\033]0;title\\033\\\\ "
              "bell\\007 got 10%%\\rprogress 100%%\\n' >&2; exit 3")
    msg = await start_failure("noisy", {"command": ["/bin/sh", "-c", script]}, errlog=err)
    relayed = [line for line in err.getvalue().splitlines() if line.startswith("[mcp noisy] ")]
    assert relayed == ["[mcp noisy] progress 100%"], err.getvalue()
    script = "printf 'boot \\033[1;31mred\\033[0m done \\033]52;c;cHduZWQ=\\007 bell\\007 end\\n' >&2; exit 3"
    err = io.StringIO()
    msg = await start_failure("noisy", {"command": ["/bin/sh", "-c", script, "arg\rwith a return"]}, errlog=err)
    assert "[mcp noisy] boot red done  bell\\x07 end" in err.getvalue().splitlines()
    # our own message quoting its command line is cut nowhere: the return in an argument is shown
    assert msg.startswith("MCP server 'noisy' failed to start (/bin/sh -c "), msg
    assert "arg\\x0dwith a return" in msg.partition("\n")[0], msg
    tail = msg.partition("stderr (last lines):")[2]
    assert "boot red done  bell\\x07 end" in tail
    for text in (err.getvalue(), tail):
        assert "\x1b" not in text and "\x07" not in text and "cHduZWQ" not in text
