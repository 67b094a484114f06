"""Property: a tool runs exactly when docs/PIPELINE.md says it must (D1 ActionParam rule, D3 return order,
D4 governance, Consequences "fail before effect") and never otherwise.

The oracle below is written from the pipeline's rules, not from the implementation:

* D1: an ActionParam exists iff invoke_actions and actions are enabled (loose flag or Instruct).
* D3: skip_validation returns the raw result first; then a caller-model mismatch returns/raises;
  then invoke_actions=False returns; only then are action requests inspected.
* D2/D3: without a caller model the generated action model is still parsed and inspected.
* D4: requests execute only through act(): a tool outside the call's selection or a denied
  authorization is never invoked.

The cases reach every gate on both entries (``Branch.operate`` and the coordinator ``operate()``
called directly with a prepared ActionParam, where only the D3 ``invoke_actions`` gate holds the
tool), repair turns (the first reply is prose, the repair turn's reply decides), batches where a
sibling call fails or is vetoed (the recording call still runs exactly once, and a batch loses
nothing), and cancellation in the middle of the tool (it ran once; every request is answered).
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from operate_sidecar.server.core import ActionParam, ChatParam, HookEventType, Instruct, Tool, ValidationFailed
from operate_sidecar.server.core import operate as coordinator
from operate_sidecar.server.core.params import RunParam, make_parse_param

from .support import NO_REPAIR, Answer, RecordingTool, call, make_branch

REPLIES = ("valid", "invalid", "mismatching")
POLICIES = ("return_value", "return_none", "raise")
ACTIONS = ("off", "loose", "instruct")
SELECTIONS = ("all", "including", "excluding")
ENTRIES = ("facade", "coordinator")
BATCHES = ("single", "failing_sibling", "vetoed_sibling")


@dataclass(frozen=True)
class Case:
    has_format: bool
    reply: str
    handle_validation: str
    skip_validation: bool
    invoke_actions: bool
    actions: str
    allow: bool
    selection: str
    requests_tool: bool
    reason: bool
    cli: bool
    strategy: str
    adapter: str
    entry: str = "facade"
    repair: bool = False
    batch: str = "single"
    cancel: bool = False


def mostly(value: bool) -> st.SearchStrategy[bool]:
    """A boolean that is ``value`` three times in four: keeps the tool-running corner well sampled."""
    return st.sampled_from([value, value, value, not value])


cases = st.builds(
    Case,
    has_format=st.booleans(),
    reply=st.sampled_from(REPLIES),
    handle_validation=st.sampled_from(POLICIES),
    skip_validation=mostly(False),
    invoke_actions=mostly(True),
    actions=st.sampled_from(ACTIONS),
    allow=mostly(True),
    selection=st.sampled_from(SELECTIONS),
    requests_tool=mostly(True),
    reason=st.booleans(),
    cli=st.booleans(),
    strategy=st.sampled_from(("concurrent", "sequential")),
    adapter=st.sampled_from(("scripted", "mapping")),
    entry=st.sampled_from(ENTRIES),
    repair=st.booleans(),
    batch=st.sampled_from(BATCHES),
    cancel=mostly(False),
)

# Critical corners of the rules, always run in addition to the random examples.
BASE = dict(has_format=True, reply="valid", handle_validation="return_value", skip_validation=False,
            invoke_actions=True, actions="loose", allow=True, selection="all", requests_tool=True, reason=False,
            cli=False, strategy="concurrent", adapter="scripted")
CORNERS = [
    Case(**BASE),  # the tool must run
    Case(**{**BASE, "adapter": "mapping"}),  # D3: mapping with action_requests but a caller model: mismatch
    Case(**{**BASE, "reply": "mismatching", "handle_validation": "raise"}),
    Case(**{**BASE, "skip_validation": True}),  # D3 seam: raw mode disables actions
    Case(**{**BASE, "invoke_actions": False}),
    Case(**{**BASE, "selection": "excluding"}),  # DESIGN: outside the selection is denied
    Case(**{**BASE, "allow": False}),
    Case(**{**BASE, "has_format": False, "reply": "mismatching", "cli": True}),
    Case(**{**BASE, "entry": "coordinator", "invoke_actions": False}),  # D3's own invoke_actions gate
    Case(**{**BASE, "entry": "coordinator"}),
    Case(**{**BASE, "repair": True}),  # the repair turn's valid reply runs the tool
    Case(**{**BASE, "repair": True, "reply": "mismatching", "handle_validation": "raise"}),
    Case(**{**BASE, "batch": "failing_sibling"}),
    Case(**{**BASE, "batch": "vetoed_sibling"}),  # concurrent: the veto is the sibling's error output
    Case(**{**BASE, "batch": "vetoed_sibling", "strategy": "sequential"}),  # sequential: the same
    Case(**{**BASE, "cancel": True}),
    Case(**{**BASE, "cancel": True, "batch": "failing_sibling", "entry": "coordinator"}),
]

PROSE = "Let me think about that first; no JSON here."


def scripted_reply(c: Case) -> dict | str:
    """The model's reply. "invalid" has no JSON at all; "mismatching" is JSON that violates the caller's
    model (answer is not an int); "valid" satisfies it."""
    if c.reply == "invalid":
        return "Sorry, no structured answer. I would call record with x equal to 1." if c.requests_tool \
            else "Sorry, no structured answer."
    body: dict = {"answer": 1 if c.reply == "valid" else "definitely not an int"}
    if c.requests_tool:
        body["action_requests"] = requests_of(c)
    return {"json": body}


def requests_of(c: Case) -> list[dict]:
    """The recording call first, then the batch's sibling (a tool that fails, or one a hook vetoes)."""
    reqs = [call("record", x=1)]
    if c.batch == "failing_sibling":
        reqs.append(call("boom", x=2))
    elif c.batch == "vetoed_sibling":
        reqs.append(call("vetoed", x=3))
    return reqs


def mapping_value(c: Case) -> dict | str:
    """What a custom Middle returns: a mapping (never an instance of the caller's model) or prose."""
    if c.reply == "invalid":
        return "prose, no mapping"
    value: dict = {"answer": 1 if c.reply == "valid" else "definitely not an int"}
    if c.requests_tool:
        value["action_requests"] = requests_of(c)
    return value


class MappingMiddle:
    def __init__(self, value: dict | str) -> None:
        self.value = value

    async def __call__(self, branch, instruction, chat_param, parse_param, clear_messages=False, *,
                       skip_validation=False):
        return self.value


def oracle(c: Case) -> tuple[bool, bool]:
    """(tool must run, operate must raise ValidationFailed), from the rules alone. A repair turn
    replaces the first (prose) reply by the case's reply, so the repaired reply decides."""
    if c.skip_validation:  # D3: raw result returned before every other rule
        return False, False
    if c.repair and c.adapter == "scripted" and not c.has_format:
        # no caller model to validate against: the prose reply is the result, no repair turn
        c = Case(**{**c.__dict__, "reply": "invalid"})
    action_param = c.invoke_actions and c.actions != "off"  # D1
    structured = c.reply in ("valid", "mismatching")  # a JSON object / mapping, not prose
    if c.has_format:
        # Only a parsed valid reply is an instance of the caller's model; a mapping never is.
        matches = c.adapter == "scripted" and c.reply == "valid"
        if not matches:  # D3: mismatch policy, before any action
            return False, c.handle_validation == "raise"
    else:
        # D2/D3: no caller model, no type policy. A structured reply parses into the generated action
        # model (or is inspected as a mapping); prose carries no action_requests.
        matches = structured
    if not action_param:  # D3 invoke_actions gate / D4 "execution requires an ActionParam"
        return False, False
    runs = matches and c.requests_tool and c.allow and c.selection != "excluding"  # D4 governance
    return runs, False


async def run_case(c: Case) -> tuple[RecordingTool, RecordingTool, BaseException | None, object]:
    record, other = RecordingTool("record"), RecordingTool("other")
    boom, vetoed = RecordingTool("boom", fail="boom exploded"), RecordingTool("vetoed")
    scope = anyio.CancelScope()
    if c.cancel:  # the recording tool is cancelled in its middle (after its effect)
        async def cancelling(x: int = 0, note: str = "") -> dict:
            record.calls.append({"x": x, "note": note})
            scope.cancel()
            await anyio.sleep(5)
            return {"doubled": 2 * x}  # pragma: no cover - cancelled first

        record.tool = Tool.from_function(cancelling, name="record")
    first = scripted_reply(c)
    replies = [PROSE, first] if c.repair else [first, first]
    branch, model = make_branch(replies, cli=c.cli, tools=(record, other, boom, vetoed))

    async def authorize(inv):
        return c.allow

    branch.authorizer = authorize

    def veto(event):
        if event.type is HookEventType.TOOL_PRE and event.tool == "vetoed":
            raise PermissionError("vetoed by a hook")

    branch.hooks.subscribe(veto)
    kw: dict = dict(
        handle_validation=c.handle_validation,
        skip_validation=c.skip_validation,
        invoke_actions=c.invoke_actions,
        reason=c.reason,
        action_strategy=c.strategy,
        parse_call_params=NO_REPAIR,
    )
    if c.adapter == "mapping":
        kw["middle"] = MappingMiddle(mapping_value(c))
    if c.has_format:
        kw["response_format"] = Answer
    if c.actions == "loose":
        kw["actions"] = True
        kw["instruction"] = "go"
    elif c.actions == "instruct":
        kw["instruct"] = Instruct(instruction="go", actions=True)
    else:
        kw["instruction"] = "go"
    if c.selection == "including":
        kw["tools"] = ["record", "other", "boom", "vetoed"]
    elif c.selection == "excluding":
        kw["tools"] = ["other"]
    error: BaseException | None = None
    result: object = None
    with anyio.fail_after(10):
        with scope:
            try:
                if c.entry == "facade":
                    result = await branch.operate(**kw)
                else:
                    result = await call_coordinator(branch, c, kw)
            except (ValidationFailed, PermissionError) as e:
                error = e
    # docs/PROTOCOL.md §7 consistency: every recorded action_request has its action_response.
    reqs = [m.id for m in branch.messages if m.kind == "action_request"]
    answered = [m.content["requestId"] for m in branch.messages if m.kind == "action_response"]
    assert sorted(reqs) == sorted(answered)
    return record, other, error, result


async def call_coordinator(branch, c: Case, kw: dict) -> object:
    """D3 directly: an ActionParam is prepared whenever actions are on, whatever invoke_actions
    says, so the coordinator's own gate is the one under test."""
    fmt = kw.get("response_format")
    param_cls = RunParam if c.cli else ChatParam
    action_param = None
    if c.actions != "off":
        action_param = ActionParam(tools=kw.get("tools"), strategy=c.strategy)
    return await coordinator(branch, "go", param_cls(response_format=fmt), action_param=action_param,
                             parse_param=(make_parse_param(fmt, branch.parse_model, alcall_params=NO_REPAIR)
                                          if fmt is not None else None),  # as the facade prepares it
                             handle_validation=c.handle_validation, invoke_actions=c.invoke_actions,
                             skip_validation=c.skip_validation, reason=c.reason, middle=kw.get("middle"))


def with_corners(f):
    for corner in reversed(CORNERS):
        f = example(corner)(f)
    return f


@settings(max_examples=500, deadline=None)
@given(cases)
@with_corners
def test_tool_runs_exactly_when_the_adr_says(c: Case):
    """D1–D4 / Consequences: fail before effect — the recording tool ran iff the oracle says so."""
    must_run, must_raise = oracle(c)
    record, other, error, result = anyio.run(run_case, c)
    assert len(record.calls) == (1 if must_run else 0), (c, record.calls, result)
    assert other.calls == []  # never requested, never run
    assert (error is not None) == must_raise, (c, error, result)
    assert not isinstance(error, PermissionError), (c, error)
    if must_run and not c.cancel:
        responses = result["action_responses"] if isinstance(result, dict) else result.action_responses
        assert responses[0].output == {"doubled": 2}
        if c.batch != "single":  # the failing or vetoed sibling is its own error output, nothing lost
            assert len(responses) == 2 and "error" in responses[1].output, responses
