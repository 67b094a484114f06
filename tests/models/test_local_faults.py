"""``provider: local`` where it went wrong: token counts, the context window a client is told,
a long tool-using history, damaged or misnamed model files, llama parameters of the wrong type,
a grammar llama.cpp refuses. Against the real SmolLM2-135M GGUF in llama.cpp (loaded once per
process: ``local._CACHE``), with tiny replies."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import ModelConfigError, make_model
from operate_sidecar.server.models import local as local_mod
from operate_sidecar.server.models.local import LocalModel, _fit_context

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
EMOJI = "Reply with ten party emoji 🎉🎉🎉🎉🎉🎉🎉🎉🎉🎉 and nothing else."


@pytest.fixture
def local() -> LocalModel:
    return make_model({"provider": "local"}, name="local")


def ask(text: str, **options) -> ModelRequest:
    return ModelRequest(messages=[{"role": "user", "content": text}], options={"temperature": 0, **options})


async def _reply(model: LocalModel, request: ModelRequest) -> tuple[str, int, dict]:
    """The reply's text, how many text chunks carried it, and the call's usage."""
    text, chunks, usage = "", 0, None
    with anyio.fail_after(120):
        async for chunk in model.stream(request):
            if chunk.type == "text":
                text += chunk.text
                chunks += 1
            elif chunk.type == "result":
                usage = chunk.usage
    assert usage is not None
    return text, chunks, usage


# -- usage: tokens, not stream chunks --------------------------------------------------------


async def test_usage_counts_the_tokens_llama_cpp_counts_not_the_chunks_of_the_stream(local):
    """An emoji is three tokens that llama-cpp-python streams as one chunk, and the last token it
    samples is never evaluated: outputTokens counted chunks (2 for a 6-token reply) and
    inputTokens was the context's length less that (76, 84, 104 for one prompt). Both are now
    what llama-cpp-python itself reports for the same call, and what the reply tokenizes to."""
    loaded = await local.load()
    llama = loaded.llama
    for text, max_tokens in ((EMOJI, 4), (EMOJI, 12), ("Write a long poem about the sea.", 5)):
        request = ask(text, max_tokens=max_tokens)
        reply, chunks, usage = await _reply(local, request)
        with anyio.fail_after(120):  # llama-cpp-python's own count of the same (greedy) call
            truth = llama.create_chat_completion(messages=request.messages, temperature=0,
                                                 max_tokens=max_tokens)["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            truth["prompt_tokens"], truth["completion_tokens"]), (text, max_tokens, reply)
        assert usage["completion_tokens"] == len(llama.tokenize(reply.encode("utf-8"), add_bos=False, special=False))
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if text == EMOJI:
            assert "🎉" in reply and chunks < usage["completion_tokens"]  # the shape that was miscounted
        else:
            assert usage["completion_tokens"] == max_tokens  # cut by maxTokens


# -- the context window a client is told ----------------------------------------------------


async def test_the_context_size_reported_is_the_window_in_use_not_the_configured_n_ctx():
    """nCtx 100000 runs with the model's 8192 (lowered, logged): ACP's ``usage_update.size``
    (``Service.context_size``) said 100000. It is 8192, before the model is loaded (read from the
    GGUF's header) and after."""
    from operate_sidecar.server.rpc import settings as S
    from operate_sidecar.server.service.service import Service

    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"big": {"provider": "local", "nCtx": 100000}}}))
    port = SimpleNamespace(settings=settings)
    port.conn = port
    service = Service(port)
    model = service.resolve_model("big")
    assert model.n_ctx == 100000
    assert service.context_size("big") == 8192  # not loaded yet
    with anyio.fail_after(120):
        loaded = await model.load()
    assert loaded.n_ctx == 8192 and service.context_size("big") == 8192
    small = make_model({"provider": "local", "nCtx": 2048}, name="small")
    assert small.context_window == 2048  # a smaller nCtx is used as it is


# -- a long tool-using history ----------------------------------------------------------------


def _tool_branch() -> list[dict[str, str]]:
    """A branch of seven tool calls as core.render renders it: every user turn after the first
    begins with the results of the calls the assistant turn before it made."""
    filler = "The weather report says it is sunny and warm with light wind. " * 6
    messages = [{"role": "system", "content": "You call tools to get facts."},
                {"role": "user", "content": "Instruction: weather in city 0? " + filler}]
    for k in range(1, 8):
        messages.append({"role": "assistant", "content": json.dumps(
            {"summary": filler[:100], "action_requests": [{"function": "get_weather", "arguments": {"city": f"c{k}"}}]})})
        messages.append({"role": "user", "content": 'Tool results: [{"function": "get_weather", "arguments": '
                         f'{{"city": "c{k}"}}, "output": {{"temp": 21}}}}]\n\nInstruction: weather in city {k}? ' + filler})
    return messages


async def test_a_tool_using_history_that_no_longer_fits_keeps_as_much_as_fits(local):
    """Every user turn of a tool-using branch carries tool results, and none could open the kept
    history: with room for half of it, 13 of 14 history messages were left out. The kept history
    now starts at the earliest turn boundary that fits (an assistant turn that called tools, kept
    with the turn carrying the results, or a results turn), and the prompt fits the budget."""
    loaded = await local.load()
    counter = loaded.counter
    messages = _tool_branch()
    n_ctx, reserve = 1024, 100
    budget = n_ctx - reserve
    assert counter.exact(messages) > budget
    kept, dropped = _fit_context(counter, messages, n_ctx, reserve)
    assert kept == [messages[0], *messages[1 + dropped:]]
    assert counter.exact(kept) <= budget
    history = messages[1:-1]
    # no earlier turn boundary would have fitted
    for start in range(dropped):
        m = history[start]
        well_formed = m["role"] == "user" or history[start + 1]["content"].startswith("Tool results: ")
        if well_formed:
            assert counter.exact([messages[0], *history[start:], messages[-1]]) > budget, start
    assert dropped <= 6, dropped  # (history from message 6 fits in 891 of the 924 tokens)
    opened = history[dropped]
    assert opened["role"] == "user" or history[dropped + 1]["content"].startswith("Tool results: ")


def test_a_results_turn_or_the_call_turn_before_it_may_open_the_kept_history():
    """The rule, with a counter of one token per word: a results turn names its calls' functions
    and arguments, so it may open the kept history; the assistant turn that made the calls may
    open it with that turn after it; an assistant reply that called nothing may not."""
    class Words:
        def count(self, text: str) -> int:
            return len(text.split()) + 1

        def exact(self, messages) -> None:
            return None

    def turn(role: str, words: int, tag: str) -> dict[str, str]:
        return {"role": role, "content": f"{tag} " + "w " * words}

    system = {"role": "system", "content": "sys"}
    history = [turn("user", 10, "Instruction: u0"), turn("assistant", 10, "a0 calls"),
               turn("user", 10, "Tool results: r0 Instruction: on"), turn("assistant", 10, "a1 calls"),
               turn("user", 10, "Tool results: r1 Instruction: on"), turn("assistant", 10, "a2 reply")]
    now = turn("user", 5, "Instruction: now")
    messages = [system, *history, now]
    cost = {id(m): Words().count(m["content"]) for m in messages}
    base = local_mod.PROMPT_OVERHEAD + cost[id(system)] + cost[id(now)]

    def fits_from(start: int) -> int:
        return base + sum(cost[id(m)] for m in history[start:]) + 100

    # room from history[1] (an assistant turn whose calls history[2] answers): it opens
    assert _fit_context(Words(), messages, fits_from(1), 100) == ([system, *history[1:], now], 1)
    # room from history[3] (the same: its calls answered by history[4])
    assert _fit_context(Words(), messages, fits_from(3), 100) == ([system, *history[3:], now], 3)
    # room from history[4] (a results turn): it opens
    assert _fit_context(Words(), messages, fits_from(4), 100) == ([system, *history[4:], now], 4)
    # room from history[5] only (a reply nothing answers): left out too
    assert _fit_context(Words(), messages, fits_from(5), 100) == ([system, now], 6)


async def test_a_first_instruction_too_long_for_the_context_is_the_documented_error():
    """A branch with no system message and no history: the instruction was not measured (a
    single message was passed on as it was), so llama-cpp-python's own message came back (with
    nCtx 8: "could not broadcast input array ..."). It is the documented nCtx error now."""
    for n_ctx, text in ((256, "word " * 400), (8, "hi")):
        model = make_model({"provider": "local", "nCtx": n_ctx}, name=f"n{n_ctx}")
        with anyio.fail_after(120), pytest.raises(ModelError, match=r"the instruction alone needs \d+ tokens, which "
                                                                     rf"does not fit the context window of {n_ctx} "
                                                                     r"tokens \(nCtx\)"):
            await model.invoke(ask(text, max_tokens=4))


# -- model files ------------------------------------------------------------------------------


async def test_a_damaged_gguf_header_is_a_clean_load_failure(tmp_path):
    """A GGUF whose first metadata key claims 2^40 bytes: reading the training context from its
    header asked Python for a terabyte (MemoryError: -32603 with a traceback). No read goes past
    the file's end now; the file is handed to llama.cpp, which refuses it (-32011)."""
    path = tmp_path / "hugekey.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**40) + b"x" * 64)
    assert local_mod.gguf_context_length(str(path)) is None
    model = make_model({"provider": "local", "path": str(path)}, name="damaged")
    assert model.context_window == model.n_ctx
    with anyio.fail_after(60), pytest.raises(ModelError, match="could not load local model"):
        await model.invoke(ask("hi", max_tokens=2))


@pytest.mark.parametrize("header", [
    # one metadata entry: a string array claiming 2^60 strings
    struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**60),
    # 2^60 metadata entries
    struct.pack("<IQQ", 3, 0, 2**60),
], ids=["string-array", "entries"])
def test_a_count_the_file_cannot_hold_is_damage_not_a_loop_over_the_whole_file(tmp_path, header):
    """A GGUF header whose count of strings (or of metadata entries) is far more than the file
    could hold, followed by zeros: reading the training context turned its loop once per 8 bytes
    of the file (each zero length a string), minutes for a model of gigabytes, and
    ``context_window`` does it on the event loop (``Service.context_size``) before the model is
    loaded. The count is damage now. An 8 GiB sparse file, in a child process that is killed if
    it does not answer in time."""
    path = tmp_path / "hugecount.gguf"
    with open(path, "wb") as f:
        f.write(b"GGUF" + header)
        f.truncate(8 * 2**30)  # sparse: no disk space taken
    code = ("import sys\n"
            "from operate_sidecar.server.models import make_model\n"
            "from operate_sidecar.server.models.local import gguf_context_length\n"
            "print(gguf_context_length(sys.argv[1]))\n"
            "print(make_model({'provider': 'local', 'path': sys.argv[1], 'nCtx': 4096}, name='m').context_window)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                          cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "4096"]


async def test_a_path_that_is_a_directory_is_said_to_be_one(tmp_path):
    from operate_sidecar.server.models.config import local_model_problem

    model = make_model({"provider": "local", "path": str(tmp_path)}, name="dir")
    with anyio.fail_after(30), pytest.raises(ModelError, match="is a directory, not a GGUF file"):
        await model.invoke(ask("hi"))
    assert "is a directory, not a GGUF file" in local_model_problem({"path": str(tmp_path)})[0]
    assert "does not exist" in local_model_problem({"path": str(tmp_path / "nope.gguf")})[0]


# -- llama parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"temperature": "hot"}, "options.temperature must be a number, not a string"),
    ({"topP": -0.5}, "options.topP must be at least 0, not -0.5"),
    ({"temperature": float("nan")}, "options.temperature must be a finite number, not nan"),
    ({"seed": 2**40}, "options.seed must be at most 4294967295"),
    ({"seed": -2}, "options.seed must be at least -1, not -2"),
    ({"topK": 2**31}, "options.topK must be at most 2147483647"),
    ({"stop": 5}, "options.stop must be a string or a list of strings, not an integer"),
    ({"stop": ["a", 1]}, r"options.stop\[1\] must be a string, not an integer"),
    ({"max_tokens": 1.5}, "options.max_tokens must be an integer, not a number"),
    ({"mirostatMode": 3}, "options.mirostatMode must be at most 2"),
    ({"logitBias": {"-1": 5}}, r"options.logitBias\['-1'\]: a token id must be a non-negative integer"),
    ({"logitBias": {"5": "up"}}, r"options.logitBias\['5'\] must be a number, not a string"),
])
def test_config_options_of_the_wrong_type_or_range_are_refused_at_start(options, message):
    from operate_sidecar.server.rpc import settings as S

    with pytest.raises(ModelConfigError, match=message):
        make_model({"provider": "local", "options": options}, name="m")
    with pytest.raises(S.SettingsError, match="models.m: " + message):  # what initialize checks
        S.finalize(S.merge(S.DEFAULTS, {"models": {"m": {"provider": "local", "options": options}}}))


async def test_model_options_of_the_wrong_type_or_range_are_refused_before_the_call(local):
    """``{"temperature": "hot"}`` failed the call (-32011) with Python's "'<' not supported
    between instances of 'str' and 'float'"; a logitBias token id outside the vocabulary was
    ignored with a traceback per sampled token, and a negative one biased another token. Each
    is a ModelConfigError (-32602) naming the option as given; nothing runs."""
    cases = [({"temperature": "hot"}, "modelOptions.temperature must be a number, not a string"),
             ({"stop": 5}, "modelOptions.stop must be a string or a list of strings"),
             ({"seed": "x"}, "modelOptions.seed must be an integer, not a string"),
             ({"top_k": -2**31 - 1}, "modelOptions.top_k must be at least -2147483648"),
             ({"logitBias": [1, 2]}, "modelOptions.logitBias must be an object of token ids to numbers, not a list"),
             ({"logitBias": {"-3": 5}}, "a token id must be a non-negative integer"),
             ({"logitBias": {"99999999": 5}}, r"token id 99999999 is not in the model's vocabulary \(0 to 49151\)")]
    for options, message in cases:
        with anyio.fail_after(60), pytest.raises(ModelConfigError, match=message):
            await local.invoke(ask("hi", max_tokens=2, **options))
    assert not (await local.load()).lock.locked()
    # a token id the vocabulary has is used: a strong bias makes it the reply's first token
    llama = (await local.load()).llama
    token = llama.tokenize(b"Banana", add_bos=False, special=False)[0]
    piece = llama.detokenize([token]).decode("utf-8").strip()
    with anyio.fail_after(120):
        response = await local.invoke(ask("Say hi.", max_tokens=2, logitBias={str(token): 100}))
    assert response.text.lstrip().startswith(piece), (piece, response.text)


#: llama.cpp's own "random" and "off" values: seed -1 (LLAMA_DEFAULT_SEED once made a uint32),
#: topK 0 or less, topP and typicalP above 1, a negative temperature (sampled without one)
LLAMA_SPECIAL_VALUES = {"seed": -1, "topK": -1, "temperature": -1, "topP": 2, "typicalP": 1.5}


def test_llama_cpps_own_off_and_random_values_are_accepted_in_a_config():
    """``seed: -1`` and ``topK: -1`` (llama.cpp's usual "random" and "off") were refused at
    start, as were a negative temperature and topP/typicalP above 1, which llama.cpp takes."""
    from operate_sidecar.server.rpc import settings as S

    make_model({"provider": "local", "options": LLAMA_SPECIAL_VALUES}, name="m")
    S.finalize(S.merge(S.DEFAULTS, {"models": {"m": {"provider": "local", "options": LLAMA_SPECIAL_VALUES}}}))


async def test_llama_cpps_own_off_and_random_values_run_as_model_options(local):
    """The same values as an operate's ``modelOptions`` reach llama.cpp, which samples with them."""
    with anyio.fail_after(120):
        response = await local.invoke(ModelRequest(messages=[{"role": "user", "content": "Say hi."}],
                                                   options={"max_tokens": 2, **LLAMA_SPECIAL_VALUES}))
    assert response.usage["prompt_tokens"] > 0 and response.usage["completion_tokens"] <= 2, response.usage


def test_model_options_of_the_wrong_type_are_minus_32602_over_the_wire(tmp_path):
    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(tmp_path / "stderr", "w+b") as err, SidecarClient(
            argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(REPO), stderr=err) as c:
        c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        for options, message in (({"temperature": "hot"}, "modelOptions.temperature must be a number"),
                                 ({"logitBias": {"99999999": 5}}, "token id 99999999 is not in the model's vocabulary")):
            with pytest.raises(RpcError) as refused:
                c.request("operate", {"branchId": bid, "instruction": "hi",
                                      "modelOptions": {"maxTokens": 2, **options}}, timeout=120)
            assert refused.value.code == -32602 and message in refused.value.message, refused.value.message
        with pytest.raises(RpcError) as refused:
            c.request("operate", {"branchId": bid, "instruction": "hi",
                                  "chatModel": {"provider": "local", "options": {"temperature": "hot"}}}, timeout=120)
        assert refused.value.code == -32602 and "options.temperature must be a number" in refused.value.message
        assert c.close(30) == 0
        err.seek(0)
        assert b"Traceback" not in err.read()


# -- a grammar llama.cpp refuses ---------------------------------------------------------------


async def test_a_refused_grammar_is_reported_with_its_cause_not_a_guess(local, caplog):
    """An enum value holding a double quote: llama-cpp-python writes it into the grammar with its
    backslash unescaped, and llama.cpp refuses the grammar. The warning blamed "an array or string
    bound above about 1000?"; it names the value now (and a bound only where there is one)."""
    llama = (await local.load()).llama
    local_mod._grammar_for.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="operate_sidecar.server.models.local"):
            for prop in ({"enum": ["plain", 'c"d']}, {"type": "string", "maxLength": 1500}):
                schema = {"type": "object", "properties": {"a": prop}, "required": ["a"]}
                entry = local_mod._grammar_for(json.dumps(schema), 3, 200)
                assert entry.grammar is not None and local_mod._grammar_usable(llama, entry) is False
    finally:
        local_mod._grammar_for.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if "refused the grammar" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert 'holds a double quote ("c\\"d")' in warnings[0] and "bound" not in warnings[0], warnings[0]
    assert "maxLength 1500 is more repetitions than llama.cpp's grammar takes" in warnings[1], warnings[1]
