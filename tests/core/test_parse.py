"""Parsing a reply into the requested model (D1 ParseParam, D2 generated types; reference §2.2)."""

from __future__ import annotations

import copy
import pickle

import pytest

from operate_sidecar.server.core import (
    AlcallParams,
    FuzzyMatchKeysParams,
    ParseError,
    ParseParam,
    Step,
    UnparsedResponse,
    extract_json,
    parse,
)
from operate_sidecar.server.core.parse import fuzzy_match_keys, validate_into
from operate_sidecar.server.models.scripted import ScriptedModel

from .support import NO_REPAIR, Answer, kinds, make_branch

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- extraction

@pytest.mark.parametrize("text, expected", [
    ('{"answer": 1}', {"answer": 1}),
    ('Here:\n```json\n{"answer": 2}\n```\nthanks', {"answer": 2}),
    ('prose before {"answer": 3} and after', {"answer": 3}),
    ("{'answer': 4,}", {"answer": 4}),
    ('```\n[{"answer": 5}]\n```', [{"answer": 5}]),
])
def test_extract_json_finds_the_first_json_value(text, expected):
    """Parse: whole text, fenced blocks, a balanced object in prose, then repair of near-JSON."""
    assert extract_json(text) == expected


@pytest.mark.parametrize("text", ["no json here", "", "   ", None, 12])
def test_extract_json_returns_none_without_json(text):
    """Parse: text without a JSON object or array yields None."""
    assert extract_json(text) is None


def test_extract_json_parses_valid_json_of_any_size_up_to_the_cap_and_nothing_over_it():
    """Valid JSON up to the 10 MB cap is parsed whole (it used to be cut at the cap first,
    which made a reply just over it invalid JSON); a longer reply holds none."""
    from operate_sidecar.server.core.parse import MAX_EXTRACT_CHARS

    head = '{"content": "'
    big = head + "z" * (MAX_EXTRACT_CHARS - len(head) - 2) + '"}'
    assert len(big) == MAX_EXTRACT_CHARS and extract_json(big) == {"content": big[len(head):-2]}
    assert extract_json(big[:-2] + 'z"}') is None


def test_a_long_cut_off_reply_is_not_handed_to_json_repair(monkeypatch):
    """json-repair is pure Python on the event loop (a 10 MB cut-off string took minutes and
    froze the server); a candidate over MAX_REPAIR_CHARS is not repaired, a short one is."""
    import json_repair

    from operate_sidecar.server.core.parse import MAX_REPAIR_CHARS

    seen: list[int] = []
    real = json_repair.repair_json
    monkeypatch.setattr(json_repair, "repair_json", lambda s, **kw: seen.append(len(s)) or real(s, **kw))
    cut = '{"action_requests": [{"function": "write_file", "arguments": {"content": "' + "z" * MAX_REPAIR_CHARS
    assert extract_json(cut) is None and seen == []
    assert extract_json("{'answer': 4,}") == {"answer": 4} and seen == [len("{'answer': 4,}")]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64 * 1024])
def test_the_bracket_scan_is_string_aware_at_any_chunk_size(monkeypatch, chunk):
    """The span scan skips what lies between brackets and quotes a chunk at a time (a
    character-by-character scan of 10 MB took about a second): strings, escapes cut at a
    chunk's end, runs of brackets, mismatched pairs and prose quotes come out the same."""
    import importlib

    P = importlib.import_module("operate_sidecar.server.core.parse")

    monkeypatch.setattr(P, "SCAN_CHUNK", chunk)
    text = r'say "hi" [1, "]\\"] {"a": "}\"{", "b": [[{}]]} ] } {x] [[[["q]"]]]] {"open": "never'
    assert P._balanced_objects(text) == [r'[1, "]\\"]', r'{"a": "}\"{", "b": [[{}]]}', '[[[["q]"]]]]']
    assert P._balanced_objects("[" * 50 + "]" * 60 + "{}") == ["[" * 50 + "]" * 50, "{}"]


def test_a_reply_of_many_spans_tries_a_bounded_number(monkeypatch):
    """Millions of "[x]" were millions of parse attempts (13 s for 9 MB) and every span a repair
    candidate: the first MAX_SPANS are tried, and the repair gets MAX_REPAIR_CHARS in all."""
    import json_repair

    from operate_sidecar.server.core.parse import MAX_REPAIR_CHARS, MAX_SPANS, _balanced_objects

    assert len(_balanced_objects("[x]" * (MAX_SPANS * 3))) == MAX_SPANS
    seen: list[int] = []
    monkeypatch.setattr(json_repair, "repair_json", lambda s, **kw: seen.append(len(s)))
    assert extract_json(("{" + "x" * 99_999 + "}") * 10) is None
    assert seen and sum(seen) <= MAX_REPAIR_CHARS


def test_fuzzy_key_matching_maps_near_names():
    """Parse: keys are matched fuzzily (Jaro-Winkler ≥ 0.85): "Answer" → answer."""
    assert fuzzy_match_keys({"Answer": 1}, ["answer"], FuzzyMatchKeysParams()) == {"answer": 1}


def test_fuzzy_ignore_keeps_extras_force_fills_and_drops():
    """Parse: handle_unmatched "ignore" keeps extras; "force" fills missing keys with None and drops extras."""
    data = {"answer": 1, "zzz": 2}
    assert fuzzy_match_keys(data, ["answer", "other"], FuzzyMatchKeysParams(handle_unmatched="ignore")) == \
        {"answer": 1, "zzz": 2}
    assert fuzzy_match_keys(data, ["answer", "other"], FuzzyMatchKeysParams(handle_unmatched="force")) == \
        {"answer": 1, "other": None}
    with pytest.raises(ParseError):
        fuzzy_match_keys(data, ["answer"], FuzzyMatchKeysParams(handle_unmatched="raise"))


def test_validate_into_drops_runtime_only_fields_of_generated_types():
    """D2: values for request-excluded fields (action_responses) are never taken from the reply."""
    op = Step.respond_operative(Step.request_operative(base_type=Answer, actions=True))
    out = validate_into('{"answer": 1, "action_responses": [{"function": "f", "output": 1}]}', op.response_type,
                        FuzzyMatchKeysParams())
    assert out.answer == 1 and out.action_responses is None


def test_validate_into_distinguishes_extraction_and_validation_failures():
    """Parse: failure_kind is "extraction" (no JSON) or "validation" (JSON the model rejects)."""
    with pytest.raises(ParseError) as e1:
        validate_into("nothing", Answer, None)
    with pytest.raises(ParseError) as e2:
        validate_into('{"answer": "x"}', Answer, None)
    assert e1.value.kind == "extraction"
    assert e2.value.kind == "validation" and e2.value.validation_error is not None


# ---------------------------------------------------------------- parse() and repair

def pp(model=None, *, attempts: int = 0, policy: str = "return_value") -> ParseParam:
    return ParseParam(response_format=Answer, imodel=model, handle_validation=policy,
                      alcall_params=AlcallParams(retry_attempts=attempts), fuzzy_match_params=FuzzyMatchKeysParams())


async def test_first_attempt_needs_no_model_call():
    """Parse: a reply that validates is parsed without any model call."""
    model = ScriptedModel("p", [])
    b, _ = make_branch([])
    out = await parse(b, '{"answer": 9}', pp(model))
    assert out == Answer(answer=9) and model.calls == 0


@pytest.mark.parametrize("attempts", [0, 1, 3])
async def test_repair_makes_retry_attempts_plus_one_calls(attempts):
    """D1: retry_attempts=N allows N retries: N+1 repair turns before the policy applies."""
    model = ScriptedModel("p", ["bad"] * 10)
    b, _ = make_branch([])
    out = await parse(b, "not json", pp(model, attempts=attempts))
    assert model.calls == attempts + 1
    assert isinstance(out, UnparsedResponse) and out == "not json"


async def test_repair_success_returns_the_model():
    """Parse: a repair turn that validates returns the model and stops retrying."""
    model = ScriptedModel("p", ["still bad", '{"answer": 4}', '{"answer": 5}'])
    b, _ = make_branch([])
    out = await parse(b, "not json", pp(model, attempts=3))
    assert out == Answer(answer=4) and model.calls == 2


async def test_repair_uses_parse_model_with_parse_purpose_and_escalating_guidance():
    """Parse: repair turns go to the parse model (purpose "parse"), with guidance that escalates."""
    model = ScriptedModel("p", ['{"answer": "x"}'] * 3)
    b, chat = make_branch([])
    await parse(b, "not json", pp(model, attempts=2))
    assert chat.calls == 0
    texts = [r.messages[-1]["content"] for r in model.requests]
    assert all(r.purpose == "parse" for r in model.requests)
    assert "reformat" in texts[0] and "not json" in texts[0]
    assert "did not validate" not in texts[0]
    assert "did not validate" in texts[1] and "attempt 2" not in texts[1]
    assert "This is attempt 3" in texts[2]
    assert model.requests[0].schema_name == "Answer"


async def test_give_up_policies():
    """Parse: after the repair turns, return_value → UnparsedResponse, return_none → None, raise → ParseError."""
    b, _ = make_branch([])
    out = await parse(b, '{"answer": "x"}', pp(ScriptedModel("p", ['{"answer": "y"}']), policy="return_value"))
    assert isinstance(out, UnparsedResponse) and out.failure_kind == "validation"
    assert await parse(b, "nope", pp(ScriptedModel("p", ["nope"]), policy="return_none")) is None
    with pytest.raises(ParseError) as ei:
        await parse(b, "nope", pp(ScriptedModel("p", ["nope"]), policy="raise"))
    assert ei.value.kind == "extraction"


async def test_failing_parse_model_degrades_to_policy():
    """Parse: a parse-model failure during repair degrades like a failed parse."""
    model = ScriptedModel("p", [{"error": "boom"}])
    b, _ = make_branch([])
    out = await parse(b, "not json", pp(model))
    assert isinstance(out, UnparsedResponse)


async def test_no_alcall_params_means_no_repair_turn():
    """D3: the fallback ParseParam (no alcall params) parses once and never calls a model."""
    model = ScriptedModel("p", ['{"answer": 1}'])
    b, _ = make_branch([])
    out = await parse(b, "not json", ParseParam(response_format=Answer, imodel=model))
    assert isinstance(out, UnparsedResponse) and model.calls == 0


async def test_per_call_parse_options_bound_repair_turns_through_operate():
    """D1 (docs/PIPELINE.md "What the wire fixes"): parse_call_params sets the repair count for one call."""
    b, m = make_branch(["no json"] + ["still no json"] * 5)
    out = await b.operate(instruction="x", response_format=Answer, parse_call_params=AlcallParams(retry_attempts=2))
    assert isinstance(out, UnparsedResponse)
    assert m.calls == 1 + 3
    assert [r.purpose for r in m.requests] == ["chat", "parse", "parse", "parse"]


async def test_repair_turns_are_not_recorded_as_messages():
    """Parse: reformat turns are not recorded as branch messages."""
    b, m = make_branch(["no json", '{"answer": 2}'])
    out = await b.operate(instruction="x", response_format=Answer, parse_call_params=NO_REPAIR)
    assert out.answer == 2 and m.calls == 2
    assert kinds(b) == ["instruction", "assistant_response"]
    assert b.messages[1].content["text"] == "no json"


def test_unparsed_response_survives_copy_and_pickle():
    """Parse: UnparsedResponse is a str that keeps its failure kind through copy and pickle."""
    u = UnparsedResponse("text", "validation")
    assert copy.copy(u).failure_kind == "validation"
    assert copy.deepcopy(u).failure_kind == "validation"
    back = pickle.loads(pickle.dumps(u))
    assert isinstance(back, UnparsedResponse) and back == "text" and back.failure_kind == "validation"
