"""Token usage in the operate result, in ``$/progress`` ``end`` and in ``listBranches``
(end to end over real pipes; real CLI subprocesses and the embedded llama.cpp model)."""

from __future__ import annotations

import json
import sys

from .support import ANSWER_SCHEMA, TIMEOUT, scripted

FAST_PARSE = {"retryAttempts": 2, "retryInitialDelay": 0, "retryBackoff": 1, "throttlePeriod": 0}


def jsonl_cli(*events, stderr: str = "") -> dict:
    """A real CLI-backed model: a Python one-liner printing ``events`` as JSONL (and ``stderr``)."""
    lines = "\n".join(json.dumps(e) for e in events)
    code = f"import sys; print({lines!r}); sys.stderr.write({stderr!r})"
    return {"provider": "cli", "profile": "jsonl", "command": [sys.executable, "-c", code]}


def test_usage_counts_a_repair_call(sidecar):
    sidecar.init(models={"s": scripted("this is not json", {"json": {"answer": "fixed"}})})
    bid = sidecar.branch()
    out = sidecar.request("operate", {"branchId": bid, "instruction": "q", "responseFormat": ANSWER_SCHEMA,
                                      "parseOptions": FAST_PARSE, "workDoneToken": "u"}, timeout=TIMEOUT)
    assert out["result"] == {"answer": "fixed"}
    assert out["usage"] == {"inputTokens": 0, "outputTokens": 0, "contextTokens": 0, "modelCalls": 2}
    end = [p["value"] for p in sidecar.of("$/progress")][-1]
    assert end == {"kind": "end", "message": "completed", "usage": out["usage"]}


def test_repair_tokens_are_summed_and_context_is_the_last_chat_call(sidecar):
    """The chat call is a CLI reporting 7 in / 3 out; the repair is the real local model."""
    sidecar.init(models={
        "chat": jsonl_cli({"type": "text", "text": "not json"},
                          {"type": "result", "usage": {"input_tokens": 7, "output_tokens": 3}}),
        "local": {"provider": "local", "options": {"temperature": 0, "seed": 1}},
    })
    bid = sidecar.branch(chatModel="chat", parseModel="local")
    out = sidecar.request("operate", {"branchId": bid, "instruction": "q", "responseFormat": ANSWER_SCHEMA,
                                      "parseModel": "local", "parseOptions": FAST_PARSE}, timeout=120)
    u = out["usage"]
    assert out["kind"] == "model" and u["modelCalls"] == 2
    assert u["inputTokens"] > 7 + 20 and u["outputTokens"] > 3   # the local repair reported real counts
    assert u["contextTokens"] == 7                               # the chat call's input, not the repair's
    listed = {b["branchId"]: b["usage"] for b in sidecar.request("listBranches", {})["branches"]}
    assert listed[bid] == u


def test_a_count_the_provider_does_not_report_is_null(sidecar):
    sidecar.init(models={"quiet": jsonl_cli({"type": "text", "text": "hi"})})
    out = sidecar.request("operate", {"branchId": sidecar.branch(chatModel="quiet"), "instruction": "q"},
                          timeout=TIMEOUT)
    assert out["result"] == "hi"
    assert out["usage"] == {"inputTokens": None, "outputTokens": None, "contextTokens": None, "modelCalls": 1}


def test_a_cli_usage_line_on_stderr_is_read(sidecar):
    """The ``llm`` CLI's ``-u`` prints ``Token usage: N input, M output`` on stderr."""
    sidecar.init(models={"llmish": jsonl_cli({"type": "text", "text": "hi"},
                                             stderr="Token usage: 1,204 input, 31 output\n")})
    out = sidecar.request("operate", {"branchId": sidecar.branch(chatModel="llmish"), "instruction": "q"},
                          timeout=TIMEOUT)
    assert out["usage"] == {"inputTokens": 1204, "outputTokens": 31, "contextTokens": 1204, "modelCalls": 1}


def test_list_branches_carries_each_branchs_totals(sidecar):
    sidecar.init(models={"c": jsonl_cli({"type": "text", "text": "a"},
                                        {"type": "result", "usage": {"input_tokens": 10, "output_tokens": 2}})})
    b1, b2 = sidecar.branch(chatModel="c"), sidecar.branch(chatModel="c")
    for _ in range(2):
        sidecar.request("operate", {"branchId": b1, "instruction": "q"}, timeout=TIMEOUT)
    listed = {b["branchId"]: b["usage"] for b in sidecar.request("listBranches", {})["branches"]}
    assert listed[b1] == {"inputTokens": 20, "outputTokens": 4, "contextTokens": 10, "modelCalls": 2}
    assert listed[b2] == {"inputTokens": 0, "outputTokens": 0, "contextTokens": None, "modelCalls": 0}


def test_a_branchs_totals_are_saved_with_it_and_survive_a_restart(spawn, tmp_path):
    """With a stateDir the totals are committed with the operate, so ``listBranches`` of a new
    server on the same state directory shows them."""
    state = str(tmp_path / "state")
    model = {"c": jsonl_cli({"type": "text", "text": "a"},
                            {"type": "result", "usage": {"input_tokens": 10, "output_tokens": 2}})}
    first = spawn()
    first.init(models=model, stateDir=state)
    bid = first.branch(chatModel="c")
    for _ in range(2):
        first.request("operate", {"branchId": bid, "instruction": "q"}, timeout=TIMEOUT)
    first.close()
    second = spawn()
    second.init(models=model, stateDir=state)
    listed = {b["branchId"]: b["usage"] for b in second.request("listBranches", {})["branches"]}
    assert listed[bid] == {"inputTokens": 20, "outputTokens": 4, "contextTokens": 10, "modelCalls": 2}


def test_a_cli_run_ending_on_a_tool_result_keeps_its_usage_in_the_branch(sidecar):
    """A run whose last event before its result is a tool result has no closing text: its
    usage was on no assistant_response (lost from the branch's record while the operate's
    usage and listBranches had it). An empty closing reply now carries it; the text before the
    tool stays as it was and the operate's result is that text."""
    sidecar.init(models={"c": jsonl_cli({"type": "text", "text": "looking"},
                                        {"type": "tool_use", "id": "t1", "name": "bash", "input": {"c": "ls"}},
                                        {"type": "tool_result", "id": "t1", "output": "a.txt"},
                                        {"type": "result", "usage": {"input_tokens": 10, "output_tokens": 2}})})
    bid = sidecar.branch(chatModel="c")
    out = sidecar.request("operate", {"branchId": bid, "instruction": "q"}, timeout=TIMEOUT)
    assert out["result"] == "looking"
    replies = [m["content"] for m in sidecar.messages(bid) if m["kind"] == "assistant_response"]
    assert [r["text"] for r in replies] == ["looking", ""]
    assert replies[-1]["usage"] == {"input_tokens": 10, "output_tokens": 2}
    recorded = [r["usage"] for r in replies if r["usage"] is not None]
    assert sum(u["input_tokens"] for u in recorded) == out["usage"]["inputTokens"] == 10
    assert sum(u["output_tokens"] for u in recorded) == out["usage"]["outputTokens"] == 2
    listed = {b["branchId"]: b["usage"] for b in sidecar.request("listBranches", {})["branches"]}
    assert listed[bid] == out["usage"]
