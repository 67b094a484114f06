"""``provider: local``: the real SmolLM2-135M GGUF in llama.cpp, in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import anyio
import jsonschema
import pytest

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import make_model
from operate_sidecar.server.models._common import bound_schema
from operate_sidecar.server.models.local import LocalModel, _CACHE

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]

PERSON_SCHEMA = {
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "mood", "hobbies"],
}


def ask(text: str, **options) -> ModelRequest:
    return ModelRequest(messages=[{"role": "user", "content": text}], options={"temperature": 0, **options})


@pytest.fixture
def local() -> LocalModel:
    return make_model({"provider": "local"}, name="local")


async def test_local_streams_several_text_deltas_then_a_result(local):
    chunks = []
    with anyio.fail_after(60):
        async for chunk in local.stream(ask("Name three colours.", max_tokens=24)):
            chunks.append(chunk)
    texts = [c for c in chunks if c.type == "text"]
    assert len(texts) > 1
    assert "".join(c.text for c in texts).strip()
    assert chunks[-1].type == "result"
    assert chunks[-1].usage["completion_tokens"] >= len(texts) > 0
    assert chunks[-1].model.endswith(".gguf")


async def test_local_model_is_loaded_once_per_path(local):
    other = make_model({"provider": "local"}, name="another")
    with anyio.fail_after(60):
        a = await local.load()
        b = await other.load()
    assert a is b and a.llama is b.llama
    assert _CACHE[(local.path, local.n_ctx)] is a


async def test_local_max_tokens_option_caps_the_reply(local):
    with anyio.fail_after(60):
        response = await local.invoke(ask("Write a long poem about the sea.", maxTokens=5))
    assert 0 < response.usage["completion_tokens"] <= 5


async def test_local_structured_reply_validates_against_the_schema(local):
    request = ModelRequest(
        messages=[
            {"role": "system", "content": "You describe people as JSON."},
            {"role": "user", "content": "Describe Ada, a calm 36 year old who likes maths and chess."},
        ],
        response_schema=PERSON_SCHEMA,
        schema_name="Person",
        options={"temperature": 0, "max_tokens": 200},
    )
    with anyio.fail_after(60):
        response = await local.invoke(request)
    value = json.loads(response.text)
    jsonschema.validate(value, PERSON_SCHEMA)
    assert len(value["hobbies"]) <= 3  # arrays are bounded so a 135M model stops


async def test_local_cancel_stops_generation_and_model_stays_usable(local):
    seen: list[str] = []
    got_some = anyio.Event()
    finished = False

    async def consume() -> None:
        nonlocal finished
        async for chunk in local.stream(ask("Write a very long story about a dragon.", max_tokens=1500, temperature=0.8)):
            if chunk.type == "text":
                seen.append(chunk.text)
                if len(seen) == 3:
                    got_some.set()
        finished = True

    loaded = await local.load()
    with anyio.fail_after(30):  # a timeout, not a timing assertion
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await got_some.wait()
            tg.cancel_scope.cancel()
    assert not finished
    # The generation thread is done and the llama context is free again.
    assert not loaded.lock.locked()
    with anyio.fail_after(60):
        response = await local.invoke(ask("Say OK.", max_tokens=8))
    assert response.text.strip()


async def test_local_missing_gguf_is_a_model_error(tmp_path):
    model = make_model({"provider": "local", "path": str(tmp_path / "nope.gguf")}, name="missing")
    # (the words ACP's check says before a prompt: config.local_file_problem)
    with anyio.fail_after(30), pytest.raises(ModelError, match=r"the local model file .*nope\.gguf does not exist"):
        await model.invoke(ask("hi"))


def test_bound_schema_adds_limits_without_touching_the_original():
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}},
            "fixed": {"type": "array", "items": {"type": "integer"}, "maxItems": 9},
            "kind": {"type": "string", "enum": ["a", "b"]},
            "ref": {"$ref": "#/$defs/Item"},
            "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "$defs": {"Item": {"type": "object", "properties": {"xs": {"type": "array", "minItems": 5}}}},
    }
    original = json.dumps(schema, sort_keys=True)
    out = bound_schema(schema, max_items=3, max_length=100)
    assert json.dumps(schema, sort_keys=True) == original
    props = out["properties"]
    assert props["tags"]["maxItems"] == 3 and props["tags"]["items"]["maxLength"] == 100
    assert props["fixed"]["maxItems"] == 9
    assert "maxLength" not in props["kind"]
    assert props["maybe"]["anyOf"][0]["maxLength"] == 100
    assert out["$defs"]["Item"]["properties"]["xs"]["maxItems"] == 5  # never below minItems


def test_local_writes_nothing_to_stdout_and_imports_llama_lazily():
    """Run a real generation in a child process and check its fd 1 stays empty."""
    script = textwrap.dedent(
        """
        import sys, anyio
        from operate_sidecar.server.core.imodel import ModelRequest
        from operate_sidecar.server.models import make_model
        m = make_model({"provider": "local"}, name="local")
        assert "llama_cpp" not in sys.modules, "llama_cpp imported before first use"
        req = ModelRequest(messages=[{"role": "user", "content": "Hi"}], options={"max_tokens": 8})
        r = anyio.run(m.invoke, req)
        assert "llama_cpp" in sys.modules
        sys.stderr.write("GENERATED:" + repr(r.text))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert b"GENERATED:" in proc.stderr
    assert proc.stdout == b""


def test_unknown_config_fields_are_rejected():
    from operate_sidecar.server.models import ModelConfigError

    with pytest.raises(ModelConfigError, match="gguf"):
        make_model({"provider": "local", "gguf": "/x.gguf"}, name="typo")


async def test_an_abandoned_stream_does_not_block_the_model_forever(local, monkeypatch):
    """A consumer that stops iterating without closing the stream (and keeps a
    reference to it) loses the llama context once it is stale."""
    import operate_sidecar.server.models.local as local_mod

    monkeypatch.setattr(local_mod, "STALE_LEASE_S", 0.2)
    abandoned = local.stream(ask("Count from one to fifty.", max_tokens=200))
    with anyio.fail_after(60):
        first = await abandoned.__anext__()
        assert first.type == "text"
        response = await local.invoke(ask("Say OK.", max_tokens=8))  # waits ~0.2 s, then takes over
        assert response.text.strip()
        with pytest.raises(ModelError, match="abandoned"):
            await abandoned.__anext__()
        await abandoned.aclose()
    assert not (await local.load()).lock.locked()


# -- a history longer than the context window ----------------------------------------------


class _WordCounter:
    """A stand-in tokenizer for ``_fit_context``: one token per word, plus one per message."""

    def count(self, text: str) -> int:
        return len(text.split()) + 1

    def exact(self, messages) -> None:
        return None


def test_fit_context_leaves_out_the_oldest_turns():
    from operate_sidecar.server.models.local import PROMPT_OVERHEAD, _fit_context

    def turn(role, words, tag):
        return {"role": role, "content": f"{tag} " + "w " * words}

    system = {"role": "system", "content": "sys"}
    history = [turn("user", 10, "Instruction: u0"), turn("assistant", 10, "a0"),
               turn("user", 10, "Instruction: u1"), turn("assistant", 10, 'a1 {"action_requests": [...]}'),
               turn("user", 10, "Tool results: r1 Instruction: go on"), turn("assistant", 10, "a2")]
    now = turn("user", 5, "Instruction: now")
    messages = [system, *history, now]
    costs = {id(m): len(m["content"].split()) + 1 for m in messages}
    base = PROMPT_OVERHEAD + costs[id(system)] + costs[id(now)]

    sent, dropped = _fit_context(_WordCounter(), messages, n_ctx=10_000, reserve=100)
    assert (sent, dropped) == (messages, 0)                     # fits: sent as it is
    # Room for the last two turns only: the one with tool results opens the history (it names
    # each call's function and arguments beside its output).
    room = base + sum(costs[id(m)] for m in history[4:])
    sent, dropped = _fit_context(_WordCounter(), messages, n_ctx=room + 100, reserve=100)
    assert (sent, dropped) == ([system, *history[4:], now], 4)
    # Room for the last turn only: a reply that no results answer cannot open it.
    room = base + sum(costs[id(m)] for m in history[5:])
    sent, dropped = _fit_context(_WordCounter(), messages, n_ctx=room + 100, reserve=100)
    assert (sent, dropped) == ([system, now], 6)
    room = base + sum(costs[id(m)] for m in history[2:])
    sent, dropped = _fit_context(_WordCounter(), messages, n_ctx=room + 100, reserve=100)
    assert (sent, dropped) == ([system, *history[2:], now], 2)
    # An instruction carrying tool results keeps the assistant turn that made the calls.
    results = turn("user", 5, "Tool results: r2 Instruction: go on")
    calls = [system, *history[:4], results]
    room = PROMPT_OVERHEAD + costs[id(system)] + costs[id(history[3])] + len(results["content"].split()) + 1
    sent, dropped = _fit_context(_WordCounter(), calls, n_ctx=room + 100, reserve=100)
    assert (sent, dropped) == ([system, history[3], results], 3)
    with pytest.raises(ModelError, match="context window of 40"):   # system + instruction alone too big
        _fit_context(_WordCounter(), messages, n_ctx=40, reserve=10)


async def test_a_history_longer_than_the_context_window_still_gets_an_answer(caplog):
    """A branch whose rendered history is several times nCtx 512: the real model still answers,
    the oldest turns are left out of the request only, and the branch keeps every message."""
    import logging

    from operate_sidecar.server.core import Branch, Tool
    from operate_sidecar.server.models.scripted import ScriptedModel

    async def lookup(key: str = "") -> dict:
        """Look a key up.

        Args:
            key: what to look up.
        """
        return {"key": key, "value": "forty-two " * 20}

    turns = 12
    answer = "Here is a medium-length answer about the question you asked. " * 4
    script: list = [{"json": {"answer": answer, "action_requests": [{"function": "lookup",
                                                                      "arguments": {"key": "k"}}]}}]
    script += [answer] * turns
    branch = Branch(system="You are brief.", chat_model=ScriptedModel("scripted", script))
    branch.tools.register(Tool.from_function(lookup, name="lookup"))
    with anyio.fail_after(60):
        await branch.operate(instruction="Look up k.", actions=True, response_format={
            "title": "R", "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]})
        for i in range(turns):
            await branch.operate(instruction=f"Question {i}: explain it briefly.")
    before = [m.id for m in branch.messages]
    assert "action_response" in [m.kind for m in branch.messages]

    small = make_model({"provider": "local", "nCtx": 512, "maxTokens": 16, "options": {"temperature": 0}},
                       name="small")
    branch.chat_model = small
    with caplog.at_level(logging.INFO, logger="operate_sidecar.server.models.local"), anyio.fail_after(120):
        out = await branch.operate(instruction="Say hi.")
    assert isinstance(out, str) and out.strip()
    assert [m.id for m in branch.messages][: len(before)] == before       # nothing removed
    assert [m.kind for m in branch.messages][len(before):] == ["instruction", "assistant_response"]
    assert any("left out the" in r.getMessage() for r in caplog.records)


# -- a read-then-edit session in rounds, over real pipes ------------------------------------
#
# What the 135M model does with "read greeting.txt, then fix its typo with edit_file" in
# rounds (measured 2026-12-02, this machine, seeds 0-4, temperature 0.2, maxRounds 3, the
# embedded model): every call was well-formed (the grammar only admits the offered tools with
# their argument schemas), round 1 always called read_file, but 0 of 5 sessions fixed the file:
# the model copies text from the tool descriptions into oldText instead of the file's text, so
# each edit fails with "edit 0: oldText not found" (which the next round shows it) and it
# repeats the same call. About 45 s per 3-round session (~4500 input tokens). The same session
# with a scripted model is tests/rpc/test_rounds.py::test_read_then_edit_in_one_call_with_a_scripted_model.
# These tests therefore check what the grammar guarantees (well-formed calls, the round
# structure, real usage counts), not that a 135M model fixes the file.

EDIT_TASK = ("The file greeting.txt has a typo. First call read_file with path greeting.txt. Then call "
             "edit_file on greeting.txt replacing the misspelled word (oldText) with the correct word (newText).")


def _edit_session(model_config: dict, tmp_path: Path, *, grammar: bool = True) -> tuple[dict, list[dict], str]:
    from operate_sidecar.clients.python.client import SidecarClient
    from operate_sidecar.server.tools.builtin import EDIT_FILE_SCHEMA, WorkspaceTools

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "greeting.txt").write_text("Hello wrld\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(REPO),
                       stderr=subprocess.DEVNULL) as c:
        c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
            "models": {"m": model_config}, "defaultModel": "m", "toolPolicy": {"edit_file": "allow"}}}, timeout=60)
        bid = c.request("createBranch", {"system": "You fix files with the tools."})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": EDIT_TASK, "actions": True,
                                    "tools": ["read_file", "edit_file"], "actionStrategy": "sequential",
                                    "maxRounds": 2}, timeout=600)
        msgs = c.request("branchMessages", {"branchId": bid})["messages"]
    calls = [m["content"] for m in msgs if m["kind"] == "action_request"]
    if not grammar:  # the server's looser JSON mode: a malformed call is refused, never invoked
        outputs = {m["content"]["callId"]: m["content"]["output"] for m in msgs if m["kind"] == "action_response"}
        for call in calls:
            if call["function"] == "edit_file" and not jsonschema.Draft202012Validator(EDIT_FILE_SCHEMA).is_valid(
                    call["arguments"]):
                assert isinstance(outputs[call["callId"]], dict) and "error" in outputs[call["callId"]], call
        return out, calls, (tmp_path / "greeting.txt").read_text()
    schemas = {t.name: t.input_schema for t in WorkspaceTools([tmp_path]).tools()}
    outputs = {m["content"]["callId"]: m["content"]["output"] for m in msgs if m["kind"] == "action_response"}
    complete = True
    for m in msgs:  # each round's reply, then the calls it asked for
        if m["kind"] == "assistant_response":
            complete = _is_json(m["content"]["text"])
            continue
        if m["kind"] != "action_request":
            continue
        call, output = m["content"], outputs[m["content"]["callId"]]
        refused = isinstance(output, dict) and "invalid arguments" in str(output.get("error", ""))
        if complete:  # what the grammar guarantees: arguments the called tool's own schema accepts
            jsonschema.validate(call["arguments"], schemas[call["function"]])
            assert not refused, m
        else:  # a reply that was not JSON as it came (a reply cut at maxTokens fails the call
            # instead): json-repair mended it, and a call it leaves malformed is refused, never run
            if not jsonschema.Draft202012Validator(schemas[call["function"]]).is_valid(call["arguments"]):
                assert refused, (call, output)
    return out, calls, (tmp_path / "greeting.txt").read_text()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


SESSION_SEEDS = (3, 1, 5)
#: through llama_cpp.server, whose grammar from the schema bounds no array (the schema sent has no
#: maxItems), the 135M model often repeats a call until max_tokens cuts the reply, which fails that
#: call (-32011, nothing of it runs): in one full run all of 3, 1 and 5 were cut, in another 3 was
#: not. Seeds tried in turn until one reply is whole (each cut one costs ~30 s here); all of them
#: cut is an outcome the test takes, having checked that each ran nothing
SERVER_SESSION_SEEDS = (3, 1, 5, 2)


def _session_with_a_call(model_config: Callable[[int], dict], tmp_path: Path, seeds: tuple[int, ...] = SESSION_SEEDS,
                         cut_ok: bool = False, **kw) -> tuple[dict | None, list[dict], str]:
    """An edit session in which round 1 asked for a tool, trying the seeds in turn.

    Whether a 135M model's first reply asks for a tool at all is its choice, and it varies with
    the prompt (the workspace path is in it, and pytest's temporary paths change between runs)
    and the CPU's float arithmetic: in 8 sessions here (2026-12-05, seeds 1-5, temperatures 0-0.7)
    every round 1 asked for one, yet one CI run's did not. A reply that asks for none must end the
    call after one round (what the round rule says); the next seed is then tried. The round rule
    itself is asserted on every session, so a pipeline that never runs a second round, or never
    records a call, still fails. A reply cut at the token limit fails its call (-32011) and none
    of it runs (the file is as it was); with ``cut_ok``, every seed's reply cut is an outcome too
    (``None``, no calls, the file as it was)."""
    from operate_sidecar.clients.python.client import RpcError

    cut = []
    for seed in seeds:
        try:
            out, calls, text = _edit_session(model_config(seed), tmp_path / f"seed-{seed}", **kw)
        except RpcError as e:  # a reply cut at the token limit fails the call, never runs a cut call:
            # a 135M model repeating a call until max_tokens is its choice; the next seed is tried
            if e.code != -32011 or "cut at the token limit" not in e.message:
                raise
            assert (tmp_path / f"seed-{seed}" / "greeting.txt").read_text() == "Hello wrld\n"  # nothing of it ran
            cut.append(seed)
            continue
        assert out["rounds"] == (2 if calls else 1), (seed, out, calls)  # round 1 ran a tool iff a 2nd round ran
        if calls:
            return out, calls, text
    if cut_ok and cut == list(seeds):
        return None, [], "Hello wrld\n"
    raise AssertionError(f"round 1 asked for no tool with any of the seeds {seeds} "
                         f"(replies cut at the token limit with seeds {cut})")


@pytest.mark.timeout(900)  # a hang guard: up to 4 long rounds, 64 s each alone on a slow day, on two busy cores
def test_two_round_read_then_edit_session_with_the_embedded_model(tmp_path):
    out, calls, _text = _session_with_a_call(
        lambda seed: {"provider": "local", "options": {"temperature": 0.2, "seed": seed}}, tmp_path)
    assert out["rounds"] == 2                                  # round 1 ran a tool, so a 2nd round ran
    # Which call the model makes, and with which path, is the model's choice and varies with the
    # CPU's float arithmetic even at a fixed seed (on CI's machine the same seed read the path
    # "read_file"): assert what the grammar guarantees, an offered tool with valid arguments.
    assert calls and {c["function"] for c in calls} <= {"read_file", "edit_file"}  # only the offered
    u = out["usage"]
    assert u["modelCalls"] == 2 and u["inputTokens"] > u["contextTokens"] > 500 and u["outputTokens"] > 20


@pytest.mark.timeout(1200)  # a hang guard: up to 4 long rounds through llama_cpp.server (one thread), 64 s each alone on a slow day
def test_an_edit_session_through_llama_cpp_server_runs_two_rounds_or_fails_its_cut_reply_running_nothing(
        llama_server, tmp_path):
    out, calls, _text = _session_with_a_call(
        lambda seed: {"provider": "openai", "model": "smollm2", "baseUrl": llama_server.base_url,
                      # max_tokens: round 2 must fit the server's n_ctx 4096 (a reply
                      # repeating calls to the window's end overflowed it; the stream then
                      # ends with no finish_reason, which is -32011)
                      # timeoutS: a round took 57 s alone on a slow day (1,042 prompt tokens
                      # at 64/s, 383 generated at 23/s) and passed the default 120 s on two
                      # busy cores; a bound on a hang, not on speed
                      "timeoutS": 300,
                      "options": {"temperature": 0.2, "seed": seed, "max_tokens": 384}},
        tmp_path, seeds=SERVER_SESSION_SEEDS, cut_ok=True, grammar=False)
    if out is None:  # every seed's reply was cut at max_tokens: each failed -32011 and ran nothing (checked)
        return
    assert out["rounds"] == 2 and calls
    # The server constrains replies to the schema (json_object + schema) only loosely: it does
    # not bound array lengths, so the 135M model may repeat a call until max_tokens cuts the
    # JSON (that call fails, nothing of it runs: the next seed is tried), and a repaired reply
    # can hold a call with an empty name or without its required arguments. Such a call is
    # refused before it runs (a tool error the next round sees), never invoked with arguments
    # its schema rejects:
    names = {"read_file", "edit_file"}
    assert any(c["function"] in names for c in calls)  # which, and in what order, is the model's choice
    u = out["usage"]  # llama_cpp.server's streamed replies carry no usage: a count not reported is null
    assert u["modelCalls"] >= 2 and u["inputTokens"] is None and u["outputTokens"] is None


# --- nCtx beyond the model's training context; grammars llama.cpp cannot take ----------------


def test_gguf_context_length_is_read_from_the_header(gguf_path, tmp_path):
    from operate_sidecar.server.models.local import gguf_context_length

    assert gguf_context_length(gguf_path) == 8192  # SmolLM2-135M's llama.context_length
    (tmp_path / "text.gguf").write_text("not a model")
    with open(gguf_path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(200))
    assert gguf_context_length(str(tmp_path / "text.gguf")) is None
    assert gguf_context_length(str(tmp_path / "cut.gguf")) is None


async def test_an_n_ctx_beyond_the_training_context_is_clamped_with_a_warning(gguf_path, caplog):
    """nCtx above the GGUF's training context made llama.cpp allocate a KV cache for all of it
    (nCtx 10**30 wrapped to 2**30 tokens and the operate hung); it is clamped, and logged."""
    model = make_model({"provider": "local", "nCtx": 16384}, name="wide")
    with anyio.fail_after(60):
        loaded = await model.load()
        response = await model.invoke(ask("Say OK.", max_tokens=4))
    assert loaded.n_ctx == 8192 and loaded.llama.n_ctx() == 8192
    assert response.text.strip()
    assert any("nCtx 16384" in r.getMessage() and "8192" in r.getMessage() for r in caplog.records)


def test_a_response_schema_llama_cpp_cannot_take_falls_back_to_json_instead_of_crashing():
    """A responseFormat with maxLength 1500 made llama.cpp refuse the grammar and
    llama-cpp-python sample with a null grammar (segmentation fault: the server died); with
    maxItems 50000 the grammar parser overflowed the C stack. Both now answer (plain JSON mode).
    Asked again with the same schema (a parse-repair turn is), neither grammar is built or checked
    again: one warning each (it was logged on every call), one grammar dump from llama.cpp."""
    code = textwrap.dedent("""
        import anyio
        from operate_sidecar.server.core.imodel import ModelRequest
        from operate_sidecar.server.core.errors import ModelError
        from operate_sidecar.server.models import make_model

        async def main():
            model = make_model({"provider": "local"}, name="local")
            for prop in ({"type": "string", "maxLength": 1500},
                         {"type": "array", "items": {"type": "integer"}, "maxItems": 50000}) * 2:
                schema = {"type": "object", "properties": {"a": prop}, "required": ["a"]}
                request = ModelRequest(messages=[{"role": "user", "content": "Give a."}], response_schema=schema,
                                       options={"temperature": 0, "max_tokens": 8})
                with anyio.fail_after(60):
                    try:
                        await model.invoke(request)
                    except ModelError as e:  # 8 tokens may cut the reply: a clean answer too
                        assert "cut at the token limit" in str(e), e
                print("answered", flush=True)

        anyio.run(main)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=180,
                         stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, (out.returncode, out.stderr[-1500:])
    assert out.stdout.split() == ["answered"] * 4
    assert out.stderr.count("falling back to JSON") == 2, out.stderr[-3000:]
    assert "refused the grammar" in out.stderr and "nests 50000 levels deep" in out.stderr
    assert out.stderr.count("error parsing grammar") == 1  # llama.cpp's own report of the refused one


# -- cancel and exit over the wire while the embedded model reads a long prompt -------------------


def _long_system(tag: str) -> str:
    """A system message of about 1,300 tokens, its first word ``tag``: evaluating it takes llama.cpp
    three batches (seconds on CI), and branches with different tags share no cached prefix."""
    return f"{tag}. " + "You are a helpful assistant who answers every question briefly and politely. " * 90


class _Wire:
    """The real server over real pipes with no model configured (the embedded SmolLM2), and the
    time each ``$/progress`` value arrived."""

    def __init__(self, tmp_path: Path) -> None:
        from operate_sidecar.clients.python.client import SidecarClient

        self.stderr = open(tmp_path / "server.stderr", "w+b")
        self.client = SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], cwd=str(REPO),
                                    env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=self.stderr)
        self.progress: list[tuple[float, Any, dict]] = []
        self.client.on_notification("$/progress", lambda p: self.progress.append(
            (time.monotonic(), p["token"], p["value"])))
        self.client.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {}}, timeout=60)

    def deltas(self, token: str) -> list[tuple[float, str]]:
        return [(t, v["delta"]) for t, tok, v in list(self.progress) if tok == token and v.get("delta")]

    def requested_at(self, token: str) -> float | None:
        return next((t for t, tok, v in list(self.progress) if tok == token and v.get("phase") == "request"), None)

    def operate(self, branch: str, token: str, instruction: str = "Write a very long story about a lighthouse.",
                **options: Any) -> Any:
        return self.client.request_async("operate", {
            "branchId": branch, "instruction": instruction, "workDoneToken": token,
            "modelOptions": {"maxTokens": 1000, "temperature": 0.8, **options}})

    def prompt_time(self, branch: str, token: str) -> tuple[Any, float]:
        """Start an operate and wait for its third delta; returns it (running) and how long the
        prompt's evaluation took, from the ``request`` report to the first delta."""
        run = self.operate(branch, token)
        assert self.client.wait_for(lambda _: len(self.deltas(token)) >= 3, 300), self.progress
        return run, self.deltas(token)[0][0] - self.requested_at(token)

    def close(self) -> None:
        if self.client.proc.poll() is None:
            self.client.kill()
        self.client.proc.wait(30)
        self.client.close_input()
        self.stderr.close()


@pytest.mark.timeout(400)  # three long prompts on two busy cores
def test_a_cancel_stops_the_local_model_between_tokens_and_while_it_reads_a_long_prompt(tmp_path):
    """A cancelled operate on the embedded model is answered -32800 within about a token: while
    it generates, and while llama.cpp evaluates a long prompt (one uninterruptible step of
    seconds once, answered only when it ended); the branch stays usable at once."""
    from operate_sidecar.clients.python.client import RpcError

    w = _Wire(tmp_path)
    try:
        c = w.client
        a = c.request("createBranch", {"system": _long_system("Alpha")})["branchId"]
        run, prompt_s = w.prompt_time(a, "a")
        seen = len(w.deltas("a"))
        c.cancel(run.id)
        with pytest.raises(RpcError) as cancelled:
            run.result(120)
        assert cancelled.value.code == -32800
        assert len(w.deltas("a")) - seen <= 20  # of up to 1000: the stream stopped

        b = c.request("createBranch", {"system": _long_system("Bravo")})["branchId"]
        run = w.operate(b, "b")
        assert c.wait_for(lambda _: w.requested_at("b") is not None, 60)
        # Nothing on the wire says the evaluation has begun: a quarter of the uncancelled one is
        # well inside it (loading nothing, fitting the context: milliseconds).
        time.sleep(prompt_s / 4)
        asked = time.monotonic()
        c.cancel(run.id)
        with pytest.raises(RpcError) as cancelled:
            run.result(120)
        took = time.monotonic() - asked
        assert cancelled.value.code == -32800
        assert not w.deltas("b")
        assert took < prompt_s / 3, f"the cancel took {took:.2f}s; the prompt's evaluation takes {prompt_s:.2f}s"

        out = c.request("operate", {"branchId": b, "instruction": "Say OK.", "modelOptions": {"maxTokens": 8}},
                        timeout=300)
        assert out["kind"] == "text" and out["result"].strip()
        msgs = c.request("branchMessages", {"branchId": b})["messages"]
        assert [m["kind"] for m in msgs][-2:] == ["instruction", "assistant_response"], msgs
        assert c.close(30) == 0
    finally:
        w.close()


@pytest.mark.timeout(400)  # three long prompts on two busy cores
def test_the_server_exits_promptly_when_stdin_closes_while_the_local_model_reads_a_long_prompt(tmp_path):
    """stdin closed (the client quit) while llama.cpp evaluates a long prompt: the server exits
    at once (it went on for the whole evaluation, then waited for the context at exit), and
    without a crash (the context is never freed while a thread still uses it)."""
    from operate_sidecar.clients.python.client import RpcError

    w = _Wire(tmp_path)
    try:
        c = w.client
        a = c.request("createBranch", {"system": _long_system("Alpha")})["branchId"]
        run, prompt_s = w.prompt_time(a, "a")
        c.cancel(run.id)
        with pytest.raises(RpcError, match="cancelled"):
            run.result(120)
        b = c.request("createBranch", {"system": _long_system("Bravo")})["branchId"]
        w.operate(b, "b")
        assert c.wait_for(lambda _: w.requested_at("b") is not None, 120)
        time.sleep(prompt_s / 4)  # well inside the evaluation (see the test above)
        closed = time.monotonic()
        c.proc.stdin.close()
        code = c.proc.wait(120)
        took = time.monotonic() - closed
        assert took < prompt_s / 3, f"exit took {took:.2f}s; the prompt's evaluation takes {prompt_s:.2f}s"
        assert code == 1  # stdin EOF without shutdown; not a signal
        w.stderr.seek(0)
        err = w.stderr.read().decode("utf-8", "replace")
        assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
    finally:
        w.close()


async def test_a_cancel_does_not_wait_forever_for_a_step_that_cannot_be_aborted(monkeypatch, caplog):
    """Where the abort callback cannot be installed, a cancelled prompt evaluation runs on: the
    cancellation waited for it without a deadline (a cancel, or the exit, waited out the whole
    evaluation). It now waits CANCEL_WAIT_S, then gives the lease up (nothing touches the
    context after it) and goes on."""
    import threading

    from operate_sidecar.server.models import local as local_mod

    monkeypatch.setattr(local_mod, "CANCEL_WAIT_S", 0.2)
    loaded = local_mod._Loaded(llama=None, lock=threading.Lock())
    monkeypatch.setattr(loaded, "_set_abort", lambda lease: False)
    lease = await loaded.acquire()
    started, go_on = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        go_on.wait(30)
        return "done"

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                async def step() -> None:
                    await loaded.run(lease, slow, abortable=True)

                tg.start_soon(step)
                while not started.is_set():
                    await anyio.sleep(0.005)
                tg.cancel_scope.cancel()
        assert lease.revoked and lease.aborted
        assert "still runs" in caplog.text
        t0 = time.monotonic()
        loaded.release(lease)  # a no-op, at once: the running step still holds the context
        assert time.monotonic() - t0 < 5 and loaded.lease is lease
        go_on.set()
        assert loaded.step_lock.acquire(timeout=10)  # the step ends
        loaded.step_lock.release()
        with pytest.raises(ModelError, match="abandoned"):  # and no other step of it runs
            loaded.step(lease, lambda: None)
    finally:
        go_on.set()


def test_a_llama_grammar_without_its_text_attribute_still_gives_a_grammar(monkeypatch):
    """The grammar depth check reads LlamaGrammar's private ``_grammar``: were it renamed, every
    structured call lost its grammar (the AttributeError was taken for an unsupported schema)."""
    import llama_cpp

    from operate_sidecar.server.models import local as local_mod

    class Bare:
        pass

    monkeypatch.setattr(llama_cpp.LlamaGrammar, "from_json_schema", classmethod(lambda cls, s, verbose=False: Bare()))
    local_mod._grammar_for.cache_clear()
    try:
        entry = local_mod._grammar_for(json.dumps({"type": "object"}), 8, None)
    finally:
        local_mod._grammar_for.cache_clear()
    assert isinstance(entry.grammar, Bare) and entry.reason is None


def test_with_amx_kernels_in_llama_cpp_the_model_loads_without_weight_repacking(monkeypatch, gguf_path):
    """llama.cpp's AMX kernels crash on Q4 weights (the embedded model's): a segmentation fault
    in the first decode. A build that has them (``amx_in_build``, forced here: the test venv's
    llama.cpp is compiled without them) loads the model with its extra buffer types off, so no
    weight is repacked for AMX; the real model then answers. Without them nothing changes."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    from operate_sidecar.server.models import local as local_mod

    defaults = lib.llama_model_default_params
    made = []
    try:
        for amx in (True, False):
            monkeypatch.setattr(local_mod, "amx_in_build", lambda amx=amx: amx)
            llama = local_mod._new_llama(llama_cpp.Llama, model_path=gguf_path, n_ctx=256, n_threads=1,
                                         n_threads_batch=1, verbose=False)
            made.append(llama)
            assert llama.model_params.use_extra_bufts is (not amx)
            assert lib.llama_model_default_params is defaults  # put back after the load
            reply = llama.create_completion("The sky is", max_tokens=4, temperature=0)
            assert reply["choices"][0]["text"].strip()
    finally:
        for llama in made:
            llama.close()


def test_amx_in_build_reads_llama_cpp_system_info(monkeypatch):
    import llama_cpp

    from operate_sidecar.server.models.local import amx_in_build

    assert amx_in_build() is (b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())
    for info, expected in ((b"CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | ", True),
                           (b"CPU : AVX2 = 1 | AVX512 = 1 | REPACK = 1 | ", False),
                           ("CPU : AMX_INT8 = 1 | ", True)):
        monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda info=info: info)
        assert amx_in_build() is expected

    def broken() -> bytes:
        raise OSError("no such symbol")

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", broken)
    assert amx_in_build() is False


# -- a reasoning model's thoughts written into its text ----------------------------------------
# A reasoning GGUF run by the embedded model writes "<think>...</think>" and then its reply. The
# real SmolLM2 in llama.cpp, held to such a reply by a grammar that the test hands to llama.cpp
# (the provider makes a grammar only for a response schema).

THINK_GBNF = r'root ::= "<think>" [a-z ]{4,40} "</think>" "\n\n" "Hello" [a-z !]{0,10}'


@pytest.fixture
def thinks_first(monkeypatch):
    """Every local generation is held to THINK_GBNF (or the given grammar)."""
    from llama_cpp import LlamaGrammar

    from operate_sidecar.server.models.local import _Grammar

    held = {"gbnf": THINK_GBNF}
    kwargs = LocalModel._kwargs

    def with_grammar(self, request):
        kw = kwargs(self, request)
        kw["grammar"] = _Grammar(LlamaGrammar.from_string(held["gbnf"], verbose=False))
        return kw

    monkeypatch.setattr(LocalModel, "_kwargs", with_grammar)
    return held


async def test_the_embedded_models_inline_thoughts_are_thinking_chunks_not_the_reply(thinks_first):
    split = make_model({"provider": "local"}, name="local")
    kept = make_model({"provider": "local", "inlineThinking": False}, name="kept")
    with anyio.fail_after(120):
        chunks = [c async for c in split.stream(ask("Say hello", max_tokens=60))]
        raw = [c async for c in kept.stream(ask("Say hello", max_tokens=60))]
    from thought_checks import assert_thoughts_then_reply

    assert_thoughts_then_reply(chunks)
    # the usage still counts every generated token, the thoughts' too
    assert chunks[-1].usage["completion_tokens"] >= len(chunks) - 1
    raw_text = "".join(c.text for c in raw if c.type == "text")
    assert "thinking" not in [c.type for c in raw] and raw_text.startswith("<think>") and "</think>" in raw_text


async def test_the_embedded_model_ending_inside_its_thoughts_is_a_model_error_and_stays_usable(thinks_first, local):
    thinks_first["gbnf"] = r'root ::= "<think>" [a-z ]{40,60} "</think>" "Hello"'
    with anyio.fail_after(120), pytest.raises(ModelError, match="ended inside the model's thoughts"):
        async for _ in local.stream(ask("Say hello", max_tokens=6)):
            pass
    thinks_first["gbnf"] = THINK_GBNF
    with anyio.fail_after(120):  # the context was given back: the next call runs
        chunks = [c async for c in local.stream(ask("Say hello", max_tokens=60))]
    assert "".join(c.text for c in chunks if c.type == "text").startswith("Hello")


#: the end of DeepSeek-R1's chat template (QwQ's is alike): its generation prompt opens the thoughts
R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")


async def test_thoughts_the_chat_template_opens_are_thinking_up_to_their_closing_tag(thinks_first, monkeypatch):
    """A GGUF whose chat template ends its generation prompt with "<think>" (DeepSeek-R1, QwQ):
    the reply has no opening tag, it is thoughts from its first token up to "</think>". The
    template is read from the model's real formatter (llama-cpp-python's Jinja2ChatFormatter, here
    given R1's template); the real SmolLM2 is held to such a reply by a grammar."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from operate_sidecar.server.models import local as local_module

    model = make_model({"provider": "local"}, name="r1")
    loaded = await model.load()
    monkeypatch.setattr(loaded, "_counter", None)  # (made again, from the template below)
    monkeypatch.setattr(local_module, "_template_formatter",
                        lambda _llama: Jinja2ChatFormatter(template=R1_TEMPLATE, eos_token="", bos_token=""))
    thinks_first["gbnf"] = r'root ::= [a-z ]{4,40} "</think>" "\n\n" "Hello" [a-z !]{0,10}'
    with anyio.fail_after(120):
        chunks = [c async for c in model.stream(ask("Say hello", max_tokens=60))]
    thoughts = "".join(c.text for c in chunks if c.type == "thinking")
    text = "".join(c.text for c in chunks if c.type == "text")
    assert thoughts.strip() and "<" not in thoughts and text.startswith("Hello") and "think" not in text, chunks
    # a structured reply is held to JSON by a grammar: no thoughts are looked for in it
    thinks_first["gbnf"] = r'root ::= "{\"a\": \"b\"}"'
    with anyio.fail_after(120):
        chunks = [c async for c in model.stream(ModelRequest(messages=[{"role": "user", "content": "json"}],
                                                             response_schema={"type": "object"}))]
    assert [c.type for c in chunks[:-1]] == ["text"] * (len(chunks) - 1) and "".join(c.text for c in chunks[:-1]) == '{"a": "b"}'
