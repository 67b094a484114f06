"""Step D4 (docs/PIPELINE.md): structured action requests execute through act() and augment the result."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import pytest
from pydantic import BaseModel

from operate_sidecar.server.core import (
    DENIED,
    ActionParam,
    ActionRequestModel,
    ActionResponseModel,
    AlcallParams,
    AuthorizationResult,
    ChatParam,
    ConfigurationError,
    HookEventType,
    Message,
    Step,
    Tool,
    ToolInvocation,
    act,
    alcall,
    operate,
)

from .support import (
    Answer,
    RecordingTool,
    action_outputs,
    call,
    interleaving_tools,
    kinds,
    make_branch,
    overlapped,
    reply,
)

pytestmark = pytest.mark.anyio


class ValueMiddle:
    def __init__(self, value: Any) -> None:
        self.value = value

    async def __call__(self, branch, instruction, chat_param, parse_param, clear_messages=False, *,
                       skip_validation=False):
        return self.value


class Provider:
    def __init__(self, probe: Any = None) -> None:
        self.seen: list[list] = []
        self.probe = probe
        self.probed: list[Any] = []

    async def writeback(self, branch, responses):
        self.seen.append(list(responses))
        if self.probe is not None:
            self.probed.append(self.probe())


class Authorizer:
    def __init__(self, allow: bool | AuthorizationResult = True) -> None:
        self.allow = allow
        self.seen: list[ToolInvocation] = []

    async def __call__(self, inv: ToolInvocation):
        self.seen.append(inv)
        return self.allow


class Events:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self, event) -> None:
        self.events.append(event)

    @property
    def types(self) -> list[str]:
        return [e.type.value for e in self.events]


# ---------------------------------------------------------------- reading requests

async def test_requests_read_from_generated_model_attribute(record):
    """D4: action_requests are read from a returned BaseModel attribute."""
    b, _ = make_branch([reply(1, call(x=5))], tools=(record,))
    await b.operate(instruction="x", response_format=Answer, actions=True)
    assert record.calls == [{"x": 5, "note": ""}]


async def test_requests_read_from_mapping_key(record):
    """D4: action_requests are read from a returned mapping key."""
    b, _ = make_branch([], tools=(record,))
    await b.operate(instruction="x", actions=True, middle=ValueMiddle({"action_requests": [call(x=6)]}))
    assert record.calls == [{"x": 6, "note": ""}]


@pytest.mark.parametrize("value", ['{"action_requests": [{"function": "record", "arguments": {"x": 1}}]}',
                                   42, None, ["record"]])
async def test_text_and_other_values_produce_no_requests(record, value):
    """D4: plain text and other values produce no requests (no tool side effect)."""
    b, _ = make_branch([], tools=(record,))
    out = await b.operate(instruction="x", actions=True, middle=ValueMiddle(value))
    assert out == value
    assert not record.ran


async def test_absent_action_requests_field_does_nothing(record):
    """D4: an absent action_requests field does nothing."""
    b, _ = make_branch([], tools=(record,))
    prov = Provider()
    b.providers.append(prov)
    value = {"answer": 1}
    out = await b.operate(instruction="x", actions=True, middle=ValueMiddle(value))
    assert out is value and "action_responses" not in value
    assert not record.ran and prov.seen == []


async def test_empty_action_requests_dispatch_nothing_and_no_enrichment(record):
    """D4: an empty list dispatches but yields no responses, hence no enrichment and no writeback."""
    b, _ = make_branch([reply(1, action_requests=[])], tools=(record,))
    prov = Provider()
    b.providers.append(prov)
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert out.action_requests == [] and out.action_responses is None
    assert not record.ran and prov.seen == []
    assert kinds(b) == ["instruction", "assistant_response"]


async def test_execution_requires_action_param(record):
    """D4: without an ActionParam, returned action_requests cause no tool execution."""
    b, _ = make_branch([], tools=(record,))
    value = {"action_requests": [call(x=1)]}
    out = await operate(b, "x", ChatParam(), action_param=None, middle=ValueMiddle(value))
    assert out is value and "action_responses" not in value
    assert not record.ran


# ---------------------------------------------------------------- shapes

async def test_accepted_shapes_list_of_mappings(record):
    """D4: a list of {"function", "arguments"} mappings is accepted."""
    b, _ = make_branch([], tools=(record,))
    out = await act(b, [call(x=1), call(x=2)], ActionParam())
    assert [r.output for r in out] == [{"doubled": 2}, {"doubled": 4}]


async def test_accepted_shape_single_mapping(record):
    """D4: a single mapping is accepted (wrapped in a list)."""
    b, _ = make_branch([], tools=(record,))
    out = await act(b, call(x=3), ActionParam())
    assert [r.output for r in out] == [{"doubled": 6}]


async def test_accepted_shape_action_request_message(record):
    """D4: an ActionRequest (action_request message) is accepted."""
    b, _ = make_branch([], tools=(record,))
    msg = Message(kind="action_request", content={"function": "record", "arguments": {"x": 4}})
    out = await act(b, msg, ActionParam())
    assert out[0].output == {"doubled": 8}


async def test_accepted_shape_pydantic_model_with_function_and_arguments(record):
    """D4: a Pydantic model exposing both function and arguments is accepted."""

    class MyCall(BaseModel):
        function: str
        arguments: dict

    b, _ = make_branch([], tools=(record,))
    out = await act(b, [MyCall(function="record", arguments={"x": 1}),
                        ActionRequestModel(function="record", arguments={"x": 2})], ActionParam())
    assert [r.output for r in out] == [{"doubled": 2}, {"doubled": 4}]


class NoArgs(BaseModel):
    function: str


@pytest.mark.parametrize("bad", [
    {"function": "record"},
    {"arguments": {"x": 1}},
    "record(x=1)",
    NoArgs(function="record"),
    Message(kind="instruction", content={"function": "record", "arguments": {}}),
])
async def test_rejected_shapes_raise_valueerror_before_invocation(record, bad):
    """D4: any other shape raises ValueError before invocation (even after a valid item)."""
    b, _ = make_branch([], tools=(record,))
    with pytest.raises(ValueError, match="action_request must be"):
        await act(b, [call(x=1), bad], ActionParam())
    assert not record.ran
    assert len(b.messages) == 0


# ---------------------------------------------------------------- strategy

async def test_concurrent_strategy_runs_requests_together_results_in_input_order():
    """D4: "concurrent" runs through the AlcallParams callable; results keep input order."""
    log, tools = interleaving_tools()
    b, _ = make_branch([])
    for t in tools:
        b.tools.register(t)
    out = await act(b, [call("first"), call("second")], ActionParam(strategy="concurrent"))
    assert overlapped(log)
    assert [r.output for r in out] == ["first", "second"]


async def test_concurrent_strategy_uses_configured_call_params():
    """D4: "concurrent" uses the configured AlcallParams (max_concurrent=1 serializes)."""
    log, tools = interleaving_tools()
    b, _ = make_branch([])
    for t in tools:
        b.tools.register(t)
    await act(b, [call("first"), call("second")],
              ActionParam(strategy="concurrent", action_call_params=AlcallParams(max_concurrent=1)))
    assert not overlapped(log)


async def test_sequential_strategy_awaits_in_input_order():
    """D4: "sequential" awaits requests one after another in input order."""
    log, tools = interleaving_tools()
    b, _ = make_branch([])
    for t in tools:
        b.tools.register(t)
    out = await act(b, [call("second"), call("first")], ActionParam(strategy="sequential"))
    assert log == [("start", "second"), ("end", "second"), ("start", "first"), ("end", "first")]
    assert [r.output for r in out] == ["second", "first"]


async def test_invalid_strategy_raises_configuration_error(record):
    """D4: any other strategy raises ConfigurationError, and no tool runs."""
    b, _ = make_branch([], tools=(record,))
    with pytest.raises(ConfigurationError):
        await b.act(call(x=1), strategy="batch")
    assert not record.ran


async def test_invalid_strategy_through_operate_raises_configuration_error(record):
    """D4: operate() surfaces the ConfigurationError from act(); the tool never runs."""
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    with pytest.raises(ConfigurationError):
        await b.operate(instruction="x", response_format=Answer, actions=True, action_strategy="batch")
    assert not record.ran


def test_default_action_call_params_drop_none():
    """D4: the default action AlcallParams sets output_dropna=True and otherwise library defaults."""
    assert ActionParam().action_call_params is None  # act() falls back to the default below
    from operate_sidecar.server.core.params import DEFAULT_ACTION_ALCALL

    assert DEFAULT_ACTION_ALCALL == AlcallParams(output_dropna=True)


# ---------------------------------------------------------------- authorization

async def test_authorization_denial_returned_as_error_payload_not_raised(record):
    """D4: a denial is returned as an ActionResponseModel with an error payload, not raised."""
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    b.authorizer = Authorizer(AuthorizationResult(False, "policy says no"))
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert not record.ran
    (resp,) = out.action_responses
    assert isinstance(resp, ActionResponseModel)
    assert resp.output == {"error": DENIED, "function": "record", "reason": "policy says no"}


async def test_authorization_denial_recorded_in_messages(record):
    """D4: a denial is recorded as an action_request + action_response pair."""
    b, _ = make_branch([], tools=(record,))
    b.authorizer = Authorizer(False)
    await b.act(call(x=1))
    assert kinds(b) == ["action_request", "action_response"]
    req, resp = b.messages
    assert resp.content["requestId"] == req.id and resp.content["callId"] == req.content["callId"]
    assert resp.content["output"] == {"error": DENIED, "function": "record"}


async def test_authorization_asked_before_invocation_with_invocation_details(record):
    """D4: _act() asks branch.authorize(ToolInvocation(...)) before invoking."""
    auth = Authorizer(True)
    b, _ = make_branch([], tools=(record,))
    b.authorizer = auth
    await b.act(call(x=9))
    (inv,) = auth.seen
    assert (inv.function, inv.arguments, inv.branch_id) == ("record", {"x": 9}, str(b.id))
    assert record.calls == [{"x": 9, "note": ""}]


async def test_tool_outside_selection_denied_by_governance(record, other):
    """D4 / DESIGN: a registered tool the model names outside the call's selection is denied."""
    b, _ = make_branch([reply(1, call("record", x=1))], tools=(record, other))
    out = await b.operate(instruction="x", response_format=Answer, actions=True, tools=["other"])
    assert not record.ran and not other.ran
    assert out.action_responses[0].output["error"] == DENIED
    assert out.action_responses[0].output["function"] == "record"
    assert kinds(b)[-2:] == ["action_request", "action_response"]


async def test_unregistered_tool_is_a_tool_error_without_authorize(record):
    """D4 / docs/PROTOCOL.md §5 : an unregistered name gets an error response; authorize is not asked."""
    auth = Authorizer(True)
    b, _ = make_branch([], tools=(record,))
    b.authorizer = auth
    (resp,) = await b.act(call("nope", x=1))
    assert auth.seen == []
    assert resp.output["error"] == "Tool nope is not registered."
    assert resp.output["function"] == "nope"


# ---------------------------------------------------------------- hooks

async def test_hooks_order_pre_then_post_on_success(record):
    """D4: hooks emit TOOL_PRE then TOOL_POST on success; messages are recorded."""
    ev = Events()
    b, _ = make_branch([], tools=(record,))
    b.hooks.subscribe(ev)
    await b.act(call(x=1))
    assert ev.types == ["pre", "post"]
    assert ev.events[0].call_id == ev.events[1].call_id
    assert ev.events[1].result_summary == '{"doubled":2}'
    assert kinds(b) == ["action_request", "action_response"]
    assert [e["event"] for e in b.logs] == ["post"]  # successful calls are logged


async def test_hooks_order_pre_then_error_on_exception():
    """D4: hooks emit TOOL_PRE then TOOL_ERROR when the tool raises."""
    boom = RecordingTool("boom", fail="kaput")
    ev = Events()
    b, _ = make_branch([], tools=(boom,))
    b.hooks.subscribe(ev)
    await b.act(call("boom", x=1))
    assert ev.types == ["pre", "error"]
    assert "kaput" in ev.events[1].error


async def test_hook_summaries_truncate_to_200_but_real_call_does_not(record):
    """D4: hook argument/result summaries are cut to 200 chars; the invocation and result are not."""
    ev = Events()
    b, _ = make_branch([], tools=(record,))
    b.hooks.subscribe(ev)
    note = "n" * 1000
    (resp,) = await b.act(call(x=1, note=note))
    pre, post = ev.events
    assert len(pre.args_summary) == 200 and pre.args_summary == json.dumps({"x": 1, "note": note}, separators=(",", ":"))[:200]
    assert record.calls == [{"x": 1, "note": note}]
    assert resp.arguments["note"] == note

    echo_calls = []

    async def echo(text: str) -> str:
        echo_calls.append(text)
        return text

    b.tools.register(Tool.from_function(echo))
    ev.events.clear()
    (resp,) = await b.act(call("echo", text="r" * 500))
    assert len(ev.events[1].result_summary) == 200
    assert resp.output == "r" * 500


async def test_verbose_action_preview_truncated_to_50(record, caplog):
    """D4: verbose debug logging truncates its argument preview to 50 characters."""
    b, _ = make_branch([], tools=(record,))
    with caplog.at_level(logging.INFO, logger="operate_sidecar.server.core.act"):
        await b.act(call(x=1, note="v" * 300), verbose_action=True)
    preview = str({"x": 1, "note": "v" * 300})[:50] + "..."
    assert any(preview in r.getMessage() for r in caplog.records)
    assert record.calls[0]["note"] == "v" * 300


async def test_tool_pre_veto_propagates(record):
    """D4: a TOOL_PRE handler that raises vetoes the call: the exception propagates, nothing runs."""
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))

    def veto(event):
        if event.type is HookEventType.TOOL_PRE:
            raise PermissionError("vetoed")

    b.hooks.subscribe(veto)
    with pytest.raises(PermissionError, match="vetoed"):
        await b.operate(instruction="x", response_format=Answer, actions=True)
    assert not record.ran
    assert "action_request" not in kinds(b)


async def test_post_hook_failure_is_swallowed(record):
    """D4: a failing TOOL_POST handler does not fail the call."""
    b, _ = make_branch([], tools=(record,))

    def bad(event):
        if event.type is HookEventType.TOOL_POST:
            raise RuntimeError("observer broke")

    b.hooks.subscribe(bad)
    (resp,) = await b.act(call(x=2))
    assert resp.output == {"doubled": 4}


async def test_denial_emits_tool_denied_event_not_pre(record):
    """D4 (project choice): denials emit a TOOL_DENIED hook event and never TOOL_PRE."""
    ev = Events()
    b, _ = make_branch([], tools=(record,))
    b.hooks.subscribe(ev)
    b.authorizer = Authorizer(False)
    await b.act(call(x=1))
    assert ev.types == ["denied"]


# ---------------------------------------------------------------- errors

async def test_suppress_errors_true_returns_error_response():
    """D4: with suppress_errors=True a tool exception is recorded and returned as an ActionResponseModel."""
    boom = RecordingTool("boom", fail="kaput")
    b, _ = make_branch([reply(1, call("boom", x=1))], tools=(boom,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    (resp,) = out.action_responses
    assert resp.output == {"error": "kaput", "function": "boom", "arguments": {"x": 1}}
    assert action_outputs(b) == [resp.output]
    assert any(e.get("event") == "error" for e in b.logs)


async def test_suppress_errors_false_reraises_original_after_error_hook():
    """D4: with suppress_errors=False the original exception is re-raised after the error hook and log path."""
    boom = RecordingTool("boom", fail="kaput")
    ev = Events()
    b, _ = make_branch([], tools=(boom,))
    b.hooks.subscribe(ev)
    with pytest.raises(RuntimeError, match="kaput"):
        await b.act(call("boom"), suppress_errors=False)
    assert ev.types == ["pre", "error"]
    assert any(e.get("event") == "error" for e in b.logs)
    assert kinds(b) == ["action_request", "action_response"]


@pytest.mark.parametrize("request_, expected_fragment", [
    (call("boom"), "kaput"),
    (call("record", x="not a number"), "invalid arguments"),
    (call("record", unknown=1), "invalid arguments"),
    (call("missing"), "not registered"),
])
async def test_tool_failure_output_is_error_mapping_never_null(request_, expected_fragment, record):
    """D4 / docs/PROTOCOL.md §5: a failing tool's output is {"error": msg, "function": name, ...}, never null."""
    boom = RecordingTool("boom", fail="kaput")
    b, _ = make_branch([], tools=(record, boom))
    (resp,) = await b.act(request_)
    assert isinstance(resp.output, dict)
    assert expected_fragment in resp.output["error"]
    assert resp.output["function"] == request_["function"]
    assert not record.ran


async def test_tool_timeout_is_error_response():
    """D4 / docs/PROTOCOL.md §5: a tool that times out yields an error output, not a failed operate."""
    async def slow() -> str:
        await anyio.sleep_forever()
        return "never"  # pragma: no cover

    b, _ = make_branch([])
    b.tools.register(Tool.from_function(slow, timeout=0.01))
    with anyio.fail_after(10):
        (resp,) = await b.act(call("slow"))
    assert "timed out" in resp.output["error"] and resp.output["function"] == "slow"


async def test_cancelled_tool_call_gets_cancelled_action_response():
    """D4 / docs/PROTOCOL.md §7 (project choice): a cancelled call's action_request gets {"error": "cancelled"}."""
    started = anyio.Event()

    async def hang() -> str:
        started.set()
        await anyio.sleep_forever()
        return "never"  # pragma: no cover

    b, _ = make_branch([])
    b.tools.register(Tool.from_function(hang))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.act, call("hang"))
            await started.wait()
            tg.cancel_scope.cancel()
    assert kinds(b) == ["action_request", "action_response"]
    assert b.messages[1].content["output"] == {"error": "cancelled", "function": "hang"}


async def test_cancelled_sync_tool_is_abandoned_and_branch_stays_consistent():
    """A sync tool runs in a worker thread; on cancel the call is abandoned at once (the
    thread finishes on its own, its result is dropped) and the branch stays consistent."""
    import threading

    entered, release, finished = threading.Event(), threading.Event(), threading.Event()

    def block() -> str:
        entered.set()
        release.wait(10)
        finished.set()
        return "late"

    b, _ = make_branch([])
    b.tools.register(Tool.from_function(block))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.act, call("block"))
            while not entered.is_set():
                await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
    assert not finished.is_set()  # abandoned: the cancel did not wait for the thread
    assert kinds(b) == ["action_request", "action_response"]
    assert b.messages[1].content["output"] == {"error": "cancelled", "function": "block"}
    release.set()
    assert finished.wait(5)
    await anyio.sleep(0.05)  # the late result is dropped, nothing more is recorded
    assert kinds(b) == ["action_request", "action_response"]


async def test_sync_tool_result_exception_and_context():
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    def seen() -> str:
        return var.get()

    def boom() -> None:
        raise ValueError("bad input")

    b, _ = make_branch([])
    b.tools.register(Tool.from_function(seen))
    b.tools.register(Tool.from_function(boom))
    var.set("caller")
    with anyio.fail_after(10):
        (r1,) = await b.act(call("seen"))
        (r2,) = await b.act(call("boom"), suppress_errors=True)
    assert r1.output == "caller"  # the caller's context is copied into the worker thread
    assert "bad input" in r2.output["error"]


# ---------------------------------------------------------------- None, writeback, enrichment

class FirstOnly(AlcallParams):
    """A real AlcallParams callable that dispatches only the first request and reports None for the rest."""

    async def __call__(self, inputs, func):
        done = await alcall(list(inputs)[:1], func)
        return done + [None] * (len(inputs) - 1)


class NoneAll(AlcallParams):
    """A real AlcallParams callable that dispatches nothing and reports None for every request."""

    async def __call__(self, inputs, func):
        return [None for _ in inputs]


async def test_none_responses_dropped_before_enrichment(record):
    """D4: None responses are removed before enrichment."""
    value = {"action_requests": [call(x=1), call(x=2)]}
    b, _ = make_branch([], tools=(record,))
    out = await b.operate(instruction="x", actions=True, call_params=FirstOnly(), middle=ValueMiddle(value))
    assert [r.output for r in out["action_responses"]] == [{"doubled": 2}]


async def test_all_none_responses_return_original_result(record):
    """D4: if no responses remain, the original result is returned (no enrichment, no writeback)."""
    value = {"action_requests": [call(x=1)]}
    b, _ = make_branch([], tools=(record,))
    prov = Provider()
    b.providers.append(prov)
    out = await b.operate(instruction="x", actions=True, call_params=NoneAll(), middle=ValueMiddle(value))
    assert out is value and "action_responses" not in value
    assert prov.seen == []


async def test_writeback_gets_every_response_including_denials_and_errors(record, other):
    """D4: writeback is offered every non-None response: success, governance denial, suppressed error."""
    boom = RecordingTool("boom", fail="kaput")
    b, _ = make_branch([reply(1, call("record", x=1), call("boom"), call("other"))], tools=(record, other, boom))

    async def deny_other(inv):
        return inv.function != "other"

    b.authorizer = deny_other
    prov = Provider()
    b.providers.append(prov)
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    (seen,) = prov.seen
    assert [r.function for r in seen] == ["record", "boom", "other"]
    assert seen[0].output == {"doubled": 2}
    assert seen[1].output["error"] == "kaput"
    assert seen[2].output["error"] == DENIED
    assert out.action_responses == seen


async def test_writeback_happens_before_enrichment(record):
    """D4: writeback runs before the result is enriched."""
    value = {"action_requests": [call(x=1)]}
    b, _ = make_branch([], tools=(record,))
    prov = Provider(probe=lambda: "action_responses" in value)
    b.providers.append(prov)
    await b.operate(instruction="x", actions=True, middle=ValueMiddle(value))
    assert prov.probed == [False]
    assert "action_responses" in value


async def test_failing_writeback_does_not_fail_operate(record):
    """D4: a provider whose writeback raises is logged; the operate still returns the enriched result."""

    class Broken:
        async def writeback(self, branch, responses):
            raise RuntimeError("store down")

    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    b.providers.append(Broken())
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert out.action_responses[0].output == {"doubled": 2}


async def test_enrichment_of_generated_model_keeps_fields_and_adds_responses(record):
    """D4: a generated Pydantic result is updated with action_responses, never replaced by the list."""
    b, _ = make_branch([reply(7, call(x=1), action_required=True)], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True, reason=True)
    assert type(out).__name__ == "AnswerResponse"
    assert out.answer == 7 and out.action_required is True
    assert out.action_requests == [ActionRequestModel(function="record", arguments={"x": 1})]
    assert out.action_responses == [ActionResponseModel(function="record", arguments={"x": 1},
                                                        output={"doubled": 2})]


async def test_enrichment_sets_operative_response_model(record):
    """D4: for a generated result the coordinator sets operative.response_model to the updated model."""
    op = Step.respond_operative(Step.request_operative(base_type=Answer, actions=True))
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    out = await operate(b, "x", ChatParam(response_format=op.response_type), action_param=ActionParam(),
                        operative=op)
    assert op.response_model is out
    assert out.action_responses[0].output == {"doubled": 2}


async def test_enrichment_of_mapping_mutates_in_place(record):
    """D4: for a mapping the coordinator sets result["action_responses"]; the same mapping is returned."""
    value = {"note": "keep me", "action_requests": [call(x=2)]}
    b, _ = make_branch([], tools=(record,))
    out = await b.operate(instruction="x", actions=True, middle=ValueMiddle(value))
    assert out is value
    assert value["note"] == "keep me"
    assert value["action_responses"] == [ActionResponseModel(function="record", arguments={"x": 2},
                                                             output={"doubled": 4})]


async def test_enrichment_of_frozen_caller_model(record):
    """D4: enrichment never fails after tools ran, even when the caller's model is frozen."""
    from pydantic import ConfigDict

    class FrozenAnswer(BaseModel):
        model_config = ConfigDict(frozen=True)
        answer: int

    b, _ = make_branch([reply(1, call(x=1))], tools=(record,))
    out = await b.operate(instruction="x", response_format=FrozenAnswer, actions=True)
    assert isinstance(out, FrozenAnswer) and out.answer == 1
    assert out.action_responses[0].output == {"doubled": 2}


async def test_json_string_arguments_are_decoded_before_invocation(record):
    """D4: a JSON-encoded arguments object (function-calling style) invokes the tool with those arguments."""
    b, _ = make_branch([], tools=(record,))
    (resp,) = await b.act({"function": "record", "arguments": '{"x": 5}'})
    assert record.calls == [{"x": 5, "note": ""}]
    assert resp.output == {"doubled": 10}


@pytest.mark.parametrize("arguments", [[1, 2], "not json", '["a"]', 7])
async def test_non_object_arguments_are_a_tool_error_never_a_call(record, arguments):
    """D4 / docs/PROTOCOL.md §4: arguments that are not an object are a tool error; the tool is never called with {}."""
    b, _ = make_branch([], tools=(record,))
    (resp,) = await b.act({"function": "record", "arguments": arguments})
    assert not record.ran
    assert "must be an object" in resp.output["error"] and resp.output["function"] == "record"
    assert kinds(b) == ["action_request", "action_response"]


async def test_structured_reply_with_json_string_arguments_executes(record):
    """D2/D4: a generated action request accepts arguments sent as a JSON string."""
    entry = {"json": {"answer": 1, "action_requests": [{"function": "record", "arguments": '{"x": 7}'}]}}
    b, _ = make_branch([entry], tools=(record,))
    out = await b.operate(instruction="x", response_format=Answer, actions=True)
    assert out.action_requests == [ActionRequestModel(function="record", arguments={"x": 7})]
    assert record.calls == [{"x": 7, "note": ""}]


@pytest.mark.parametrize("selection", [None, ["record"]])
async def test_non_string_function_name_is_a_tool_error_not_a_crash(record, selection):
    """D4 / docs/PROTOCOL.md §5: a request whose function is not a string yields an error response, no exception."""
    b, _ = make_branch([], tools=(record,))
    value = {"action_requests": [{"function": 5, "arguments": {}}, {"function": {"a": 1}, "arguments": {}}]}
    out = await b.operate(instruction="x", actions=True, tools=selection, middle=ValueMiddle(value))
    assert [r.output["function"] for r in out["action_responses"]] == ["5", "{'a': 1}"]
    assert all("error" in r.output for r in out["action_responses"])
    assert not record.ran


def _selfref() -> dict:
    d: dict = {}
    d["d"] = d
    return d


def _nested(levels: int) -> list:
    v: list = []
    for _ in range(levels):
        v = [v]
    return v


@pytest.mark.parametrize("value, expected", [
    ({"n": float("nan"), "i": float("inf"), "j": float("-inf")}, {"n": "NaN", "i": "Infinity", "j": "-Infinity"}),
    ({"b": b"\xff\x00ok"}, {"b": "\ufffd\x00ok"}),
    ({(1, 2): "t", 3: [float("nan")]}, {"(1, 2)": "t", "3": ["NaN"]}),
    ({"s": frozenset({7}), "t": (b"a", float("inf"))}, {"s": [7], "t": ["a", "Infinity"]}),
], ids=["nan", "bytes", "keys", "containers"])
async def test_tool_output_json_cannot_hold_is_made_json_before_it_is_recorded(value, expected):
    """D4 / docs/PROTOCOL.md §4: an output that is not JSON is converted once, where it is produced:
    the result and the recorded message hold the same JSON value, and the branch stays serialisable."""
    import json

    b, _ = make_branch([])
    b.tools.register(Tool.from_function(lambda: value, name="odd"))
    (resp,) = await b.act({"function": "odd", "arguments": {}})
    assert resp.output == expected
    assert action_outputs(b) == [expected]
    json.dumps(b.to_dict(), allow_nan=False)  # the store's form: never raises
    json.dumps(resp.model_dump(mode="json"), allow_nan=False)


@pytest.mark.parametrize("value, problem", [
    ({"o": object()}, "object at $['o']"),
    (_selfref(), "contains itself"),
    ((i for i in range(3)), "generator"),
    (10 ** 5000, "too many digits"),
    (_nested(5000), "nests too deeply"),
], ids=["object", "selfref", "generator", "bigint", "deep"])
async def test_tool_output_that_cannot_be_json_is_a_tool_error_naming_the_problem(value, problem):
    """D4 / docs/PROTOCOL.md §4, §5: an output that contains itself or holds an object with no JSON
    form is that call's tool error (recorded like any); the operate and the branch are unaffected."""
    import json

    b, _ = make_branch([])
    b.tools.register(Tool.from_function(lambda: value, name="odd"))
    (resp,) = await b.act({"function": "odd", "arguments": {}})
    assert problem in resp.output["error"] and resp.output["function"] == "odd"
    assert kinds(b) == ["action_request", "action_response"] and action_outputs(b) == [resp.output]
    json.dumps(b.to_dict(), allow_nan=False)


@pytest.fixture
def no_secrets(monkeypatch):
    """The process's registered secrets emptied for the test (another test in this worker may
    have registered one: a key in a config), restored after it."""
    from operate_sidecar.server import redaction

    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    return redaction


async def test_json_tool_output_is_kept_as_returned(no_secrets):
    """D4: the common case (output json.dumps already writes) is recorded as it is, not copied,
    with no secret registered and with one registered that the output does not hold (as when an
    API key is configured: the output was copied whole); one holding the secret is redacted."""
    value = {"a": [1, 2.5, "x", None, True], "b": {"c": "d"}, "t": (1, "y")}
    b, _ = make_branch([])
    b.tools.register(Tool.from_function(lambda: value, name="plain"))
    (resp,) = await b.act({"function": "plain", "arguments": {}})
    assert resp.output is value and action_outputs(b)[0] is value
    no_secrets.remember_secret("sk-test-not-in-the-output")
    (resp,) = await b.act({"function": "plain", "arguments": {}})
    assert resp.output is value and action_outputs(b)[1] is value
    value["b"]["c"] = "key sk-test-not-in-the-output"
    (resp,) = await b.act({"function": "plain", "arguments": {}})
    assert resp.output == {**value, "b": {"c": "key [REDACTED]"}}  # (the tool's own object is left as it was)
    assert resp.output["a"] is value["a"] and value["b"]["c"] == "key sk-test-not-in-the-output"
