"""A concurrent batch never loses a started call: one call's hook veto, raising authorizer or
re-raised tool error does not cancel its siblings; every started call completes and is
recorded, and the failure is that call's error output. A tool raising SystemExit or
KeyboardInterrupt (sync or async) is that call's error output, never the process's."""

from __future__ import annotations

import anyio
import pytest

from operate_sidecar.server.core import AuthorizationResult, HookEventType, Tool

from .support import Answer, call, make_branch, reply

pytestmark = pytest.mark.anyio


def slow_tool(log: list[str], name: str = "slow") -> Tool:
    async def fn(x: int = 0) -> str:
        log.append(f"start {x}")
        await anyio.sleep(0.05)
        log.append(f"end {x}")
        return f"done {x}"

    return Tool.from_function(fn, name=name)


def plain_tool(log: list[str], name: str) -> Tool:
    async def fn(x: int = 0) -> str:
        log.append(f"{name} ran")
        return "ran"

    return Tool.from_function(fn, name=name)


def pairs(branch) -> dict[str, object]:
    """callId → output, and every request answered once."""
    reqs = [m.content["callId"] for m in branch.messages if m.kind == "action_request"]
    resps = {m.content["callId"]: m.content["output"] for m in branch.messages if m.kind == "action_response"}
    assert sorted(reqs) == sorted(resps)
    return resps


async def test_a_vetoed_call_does_not_cancel_a_running_sibling():
    log: list[str] = []
    b, _ = make_branch([reply(1, call("slow", x=1), call("vetoed", x=2), call("slow", x=3))])
    b.tools.register(slow_tool(log))
    b.tools.register(plain_tool(log, "vetoed"))

    async def veto(event):
        if event.type is HookEventType.TOOL_PRE and event.tool == "vetoed":
            await anyio.sleep(0.01)     # the slow siblings are running by now
            raise PermissionError("no vetoed today")

    b.hooks.subscribe(veto)
    with anyio.fail_after(10):
        out = await b.operate(instruction="x", response_format=Answer, actions=True)
    outputs = [r.output for r in out.action_responses]
    assert outputs[0] == "done 1" and outputs[2] == "done 3"
    assert outputs[1]["function"] == "vetoed" and "no vetoed today" in outputs[1]["error"]
    assert sorted(log) == ["end 1", "end 3", "start 1", "start 3"]      # the vetoed tool never ran
    assert len(pairs(b)) == 3


async def test_a_raising_authorizer_for_one_call_does_not_cancel_its_siblings():
    log: list[str] = []
    b, _ = make_branch([reply(1, call("slow", x=1), call("other", x=2))])
    b.tools.register(slow_tool(log))
    b.tools.register(plain_tool(log, "other"))

    async def authorizer(inv):
        if inv.function == "other":
            await anyio.sleep(0.01)
            raise RuntimeError("policy store unreachable")
        return AuthorizationResult(True)

    b.authorizer = authorizer
    with anyio.fail_after(10):
        out = await b.operate(instruction="x", response_format=Answer, actions=True)
    first, second = [r.output for r in out.action_responses]
    assert first == "done 1" and "policy store unreachable" in second["error"]
    assert log == ["start 1", "end 1"]
    assert len(pairs(b)) == 2


async def test_a_sequential_batch_turns_a_veto_and_a_raising_authorizer_into_those_calls_errors():
    """actionStrategy sequential: a raising authorizer or TOOL_PRE handler failed the whole
    operate after the calls before it had run (their results never reached the model) and the
    calls after it never ran; like a concurrent batch, each is that call's error output."""
    log: list[str] = []
    b, _ = make_branch([reply(1, call("slow", x=1), call("other", x=2), call("vetoed", x=3), call("slow", x=4))])
    b.tools.register(slow_tool(log))
    b.tools.register(plain_tool(log, "other"))
    b.tools.register(plain_tool(log, "vetoed"))

    async def authorizer(inv):
        if inv.function == "other":
            raise RuntimeError("policy store unreachable")
        return AuthorizationResult(True)

    def veto(event):
        if event.type is HookEventType.TOOL_PRE and event.tool == "vetoed":
            raise PermissionError("no vetoed today")

    b.authorizer = authorizer
    b.hooks.subscribe(veto)
    with anyio.fail_after(10):
        out = await b.operate(instruction="x", response_format=Answer, actions=True, action_strategy="sequential")
    outputs = [r.output for r in out.action_responses]
    assert outputs[0] == "done 1" and outputs[3] == "done 4"
    assert "policy store unreachable" in outputs[1]["error"] and "no vetoed today" in outputs[2]["error"]
    assert log == ["start 1", "end 1", "start 4", "end 4"]  # in order; the failed two never ran
    assert len(pairs(b)) == 4
    # a single call keeps the veto's meaning: it propagates
    with pytest.raises(PermissionError):
        await b.act([call("vetoed")], strategy="sequential")


async def test_a_reraised_tool_error_waits_for_its_running_siblings():
    log: list[str] = []
    b, _ = make_branch([])
    b.tools.register(slow_tool(log))

    async def boom(x: int = 0) -> str:
        await anyio.sleep(0.01)
        raise RuntimeError("kaput")

    b.tools.register(Tool.from_function(boom, name="boom"))
    with anyio.fail_after(10), pytest.raises(RuntimeError, match="kaput"):
        await b.act([call("slow", x=1), call("boom")], suppress_errors=False)
    assert log == ["start 1", "end 1"]                    # finished, not cancelled
    outs = pairs(b)
    assert "done 1" in outs.values()


async def test_a_single_vetoed_call_still_propagates():
    """Outside a batch the veto keeps its D4 meaning: the exception propagates, nothing runs."""
    log: list[str] = []
    b, _ = make_branch([])
    b.tools.register(plain_tool(log, "vetoed"))

    def veto(event):
        if event.type is HookEventType.TOOL_PRE:
            raise PermissionError("vetoed")

    b.hooks.subscribe(veto)
    with pytest.raises(PermissionError):
        await b.act([call("vetoed")])
    assert log == []


def _exit_sync(code: int = 2) -> str:
    raise SystemExit(code)


def _interrupt_sync() -> str:
    raise KeyboardInterrupt


async def _exit_async() -> str:
    raise SystemExit(3)


@pytest.mark.parametrize("fn, expected", [(_exit_sync, "SystemExit: 2"), (_interrupt_sync, "KeyboardInterrupt"),
                                          (_exit_async, "SystemExit: 3")])
async def test_base_exceptions_from_a_tool_are_that_calls_error_output(fn, expected):
    b, _ = make_branch([])
    b.tools.register(Tool.from_function(fn, name="t"))
    with anyio.fail_after(10):
        (resp,) = await b.act(call("t"))
    assert resp.output["function"] == "t" and expected in resp.output["error"]
    assert len(pairs(b)) == 1
