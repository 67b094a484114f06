"""``provider: openai`` against a real OpenAI-compatible server: ``python -m
llama_cpp.server`` serving the same SmolLM2 GGUF on 127.0.0.1 (conftest)."""

from __future__ import annotations

import contextlib
import json

import anyio
import jsonschema
import pytest

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import make_model
from operate_sidecar.server.models._common import redact
from operate_sidecar.server.models.openai_compat import RF_JSON_OBJECT_SCHEMA, OpenAIModel

pytestmark = pytest.mark.anyio

FAKE_KEY = "sk-test-9f8e7d6c5b4a39281706abcdef"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population": {"type": "integer"},
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["city", "population", "sights"],
}


def ask(text: str, **options) -> ModelRequest:
    return ModelRequest(messages=[{"role": "user", "content": text}], options={"temperature": 0, **options})


def openai_model(base_url: str, **extra) -> OpenAIModel:
    return make_model({"provider": "openai", "model": "smollm2", "baseUrl": base_url, **extra}, name="oai")


async def test_openai_streams_text_deltas_then_a_result(llama_server):
    model = openai_model(llama_server.base_url)
    chunks = []
    try:
        with anyio.fail_after(60):
            async for chunk in model.stream(ask("Name three colours.", max_tokens=24)):
                chunks.append(chunk)
    finally:
        await model.aclose()
    texts = [c for c in chunks if c.type == "text"]
    assert len(texts) > 1
    assert "".join(c.text for c in texts).strip()
    assert chunks[-1].type == "result" and chunks[-1].model
    # llama_cpp.server sends no usage chunk: tolerated (usage stays None there).


@contextlib.contextmanager
def counting_proxy(upstream: str, sent: list[dict]):
    """A loopback HTTP proxy in front of ``upstream`` that records every request it forwards
    (path and ``response_format`` type), so a test can count what went over HTTP. Yields the
    proxy's base URL."""
    import urllib.error
    import urllib.request

    from openai_stub import StubHandler, loopback

    class Forward(StubHandler):
        def do_POST(self):  # noqa: N802
            body = self.request_body()
            try:
                fmt = (json.loads(body or b"{}").get("response_format") or {}).get("type")
            except ValueError:
                fmt = None
            sent.append({"path": self.path, "format": fmt})
            base = upstream.rsplit("/v1", 1)[0]
            req = urllib.request.Request(base + self.path, data=body, method="POST",
                                         headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    status, headers, data = r.status, r.headers, r.read()
            except urllib.error.HTTPError as e:
                status, headers, data = e.code, e.headers, e.read()
            self.answer(status, data, headers.get("Content-Type", "application/json"))

    with loopback(Forward) as url:
        yield url


async def test_openai_structured_output_validates_and_the_working_format_is_remembered(llama_server):
    """The first call walks the ladder (json_schema is rejected by llama_cpp.server, json_object +
    schema works); the second call starts at the format that worked: one request, no probing."""
    sent: list[dict] = []
    proxy = counting_proxy(llama_server.base_url, sent)
    model = openai_model(proxy.__enter__())
    request = ModelRequest(
        messages=[{"role": "user", "content": "Describe Paris as JSON: city, population, sights."}],
        response_schema=SCHEMA,
        schema_name="City Info",
        options={"temperature": 0, "max_tokens": 160},
    )
    try:
        with anyio.fail_after(90):
            first = await model.invoke(request)
            # llama_cpp.server rejects "json_schema"; it takes json_object + schema.
            assert model.structured_mode == RF_JSON_OBJECT_SCHEMA
            probes = len(sent)
            second = await model.invoke(request)
    finally:
        await model.aclose()
        proxy.__exit__(None, None, None)
    for response in (first, second):
        jsonschema.validate(json.loads(response.text), SCHEMA)
    assert [r["format"] for r in sent[:probes]] == ["json_schema", "json_object"]
    assert [r["format"] for r in sent[probes:]] == ["json_object"]      # remembered: exactly one request
    assert all(r["path"].endswith("/chat/completions") for r in sent)


async def test_openai_unreachable_server_is_a_model_error_without_the_key(own_llama_server, monkeypatch):
    monkeypatch.setenv("OPERATE_TEST_KEY", FAKE_KEY)
    model = openai_model(own_llama_server.base_url, apiKeyEnv="OPERATE_TEST_KEY", maxRetries=0, timeoutS=20)
    try:
        with anyio.fail_after(60):
            assert (await model.invoke(ask("Hi", max_tokens=4))).text is not None
        own_llama_server.stop()
        with anyio.fail_after(60), pytest.raises(ModelError) as info:
            await model.invoke(ask("Hi again", max_tokens=4))
    finally:
        await model.aclose()
    message = str(info.value)
    assert "connect" in message
    assert FAKE_KEY not in message and "9f8e7d6c5b4a" not in message


async def test_openai_http_error_is_a_model_error_without_the_key(llama_server, monkeypatch):
    monkeypatch.setenv("OPERATE_TEST_KEY", FAKE_KEY)
    wrong_path = llama_server.base_url.replace("/v1", "/nope/v1")
    model = openai_model(wrong_path, apiKeyEnv="OPERATE_TEST_KEY", maxRetries=0)
    try:
        with anyio.fail_after(30), pytest.raises(ModelError) as info:
            await model.invoke(ask("Hi", max_tokens=4))
    finally:
        await model.aclose()
    assert "404" in str(info.value)
    assert FAKE_KEY not in str(info.value)


async def test_openai_nothing_listening_is_a_model_error(monkeypatch, unused_port):
    monkeypatch.setenv("OPERATE_TEST_KEY", FAKE_KEY)
    model = openai_model(f"http://127.0.0.1:{unused_port}/v1", apiKeyEnv="OPERATE_TEST_KEY", maxRetries=0)
    with anyio.fail_after(30), pytest.raises(ModelError, match="could not connect"):
        await model.invoke(ask("Hi"))
    await model.aclose()


async def test_openai_timeout_is_a_model_error(llama_server):
    model = openai_model(llama_server.base_url, timeoutS=0.001, maxRetries=0)
    try:
        with anyio.fail_after(30), pytest.raises(ModelError, match="timed out"):
            await model.invoke(ask("Write a long story.", max_tokens=64))
    finally:
        await model.aclose()


async def test_openai_missing_key_for_a_remote_url_is_a_clear_model_error(monkeypatch):
    monkeypatch.delenv("OPERATE_TEST_KEY", raising=False)
    model = openai_model("https://api.example.invalid/v1", apiKeyEnv="OPERATE_TEST_KEY")
    with anyio.fail_after(10), pytest.raises(ModelError, match="OPERATE_TEST_KEY is not set"):
        await model.invoke(ask("Hi"))


async def test_openai_cancel_during_generation_and_the_model_stays_usable(llama_server):
    model = openai_model(llama_server.base_url)
    seen: list[str] = []
    got_some = anyio.Event()
    finished = False

    async def consume() -> None:
        nonlocal finished
        async for chunk in model.stream(ask("Write a very long story about a dragon.", max_tokens=300, temperature=0.8)):
            if chunk.type == "text":
                seen.append(chunk.text)
                if len(seen) == 3:
                    got_some.set()
        finished = True

    try:
        with anyio.fail_after(60):  # a timeout, not a timing assertion
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await got_some.wait()
                tg.cancel_scope.cancel()
        assert not finished
        with anyio.fail_after(90):
            response = await model.invoke(ask("Say OK.", max_tokens=8))
        assert response.text.strip()
    finally:
        await model.aclose()


def test_model_options_pass_through_as_request_kwargs():
    model = OpenAIModel("m", model="x", options={"maxTokens": 7})
    kw = model._kwargs(ModelRequest(messages=[], options={"temperature": 0.1, "top_k": 5, "stream": False}))
    assert kw == {"max_tokens": 7, "temperature": 0.1, "extra_body": {"top_k": 5}}


def test_redact_removes_the_key_and_token_lookalikes():
    text = f"bad key {FAKE_KEY}; Authorization: Bearer abcdef123456; api_key=hunter2secret; http://u:pw@h/x"
    out = redact(text, [FAKE_KEY])
    assert FAKE_KEY not in out and "abcdef123456" not in out and "hunter2secret" not in out and "pw@" not in out
    assert redact("key sk-proj-AbC***xyz was rejected") == "key [REDACTED] was rejected"


def test_openai_config_nulls_mean_defaults_and_bad_values_are_config_errors():
    from operate_sidecar.server.models import ModelConfigError

    model = make_model({"provider": "openai", "model": "m", "baseUrl": None, "apiKeyEnv": None, "timeoutS": None}, name="n")
    assert (model.base_url, model.api_key_env, model.timeout_s) == (None, "OPENAI_API_KEY", 120.0)
    with pytest.raises(ModelConfigError, match="timeoutS"):
        make_model({"provider": "openai", "model": "m", "timeoutS": "soon"}, name="bad")
    with pytest.raises(ModelConfigError, match="needs a 'model'"):
        make_model({"provider": "openai"}, name="nomodel")
    with pytest.raises(ModelConfigError, match="apiKey"):
        make_model({"provider": "openai", "model": "m", "apiKey": "sk-inline"}, name="inline-key")


# -- refusals -------------------------------------------------------------------------------
# llama.cpp's server never refuses, so these read OpenAI's documented refusal stream from a
# loopback stand-in (tests/openai_stub.py): the real SDK and provider over real HTTP.

async def test_a_refusal_is_model_refused_with_the_models_words_and_the_call_is_counted():
    from openai_stub import openai_stub, refusal_stream

    from operate_sidecar.server.core.errors import ModelRefused

    words = "I'm sorry, I can't help with that."
    with openai_stub(refusal_stream(words, usage={"prompt_tokens": 12, "completion_tokens": 9})) as (url, got):
        model = openai_model(url)
        chunks = []
        try:
            with anyio.fail_after(30), pytest.raises(ModelRefused) as e:
                async for c in model.stream(ModelRequest(messages=[{"role": "user", "content": "x"}],
                                                         response_schema=SCHEMA, schema_name="City")):
                    chunks.append(c)
        finally:
            await model.aclose()
    assert e.value.refusal == words and words in str(e.value) and "'oai'" in str(e.value)
    assert [c.type for c in chunks] == ["result"]                 # no text to parse, the usage still counted
    assert chunks[0].usage["prompt_tokens"] == 12 and got[0]["response_format"]["type"] == "json_schema"


async def test_a_content_filter_stop_is_model_refused():
    from openai_stub import chunk, openai_stub

    from operate_sidecar.server.core.errors import ModelRefused

    with openai_stub([chunk({"role": "assistant", "content": "Part"}), chunk({}, finish="content_filter")]) as (url, _):
        model = openai_model(url)
        try:
            with anyio.fail_after(30), pytest.raises(ModelRefused) as e:
                await model.invoke(ask("x"))
        finally:
            await model.aclose()
    assert e.value.refusal == "stopped by the provider's content filter"


def test_a_refusal_over_the_wire_is_a_model_error_with_the_refusal_and_records_nothing(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from openai_stub import openai_stub, refusal_stream

    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "a.txt").write_text("keep\n")
    words = "I can't assist with that request."
    with openai_stub(refusal_stream(words)) as (url, _):
        env = dict(os.environ, PYTHONPATH=str(repo))
        with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(repo),
                           stderr=subprocess.DEVNULL) as c:
            c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
                "models": {"m": {"provider": "openai", "model": "gpt-4o", "baseUrl": url}}, "defaultModel": "m",
                "toolPolicy": {"write_file": "allow"}}}, timeout=60)
            bid = c.request("createBranch", {})["branchId"]
            with pytest.raises(RpcError) as e:
                c.request("operate", {"branchId": bid, "instruction": "go", "actions": True,
                                      "responseFormat": {"type": "object", "properties": {"a": {"type": "string"}}}},
                          timeout=60)
            assert e.value.code == -32011 and e.value.data == {"refusal": words}
            assert c.request("branchMessages", {"branchId": bid})["messages"] == []  # nothing recorded
    assert (tmp_path / "a.txt").read_text() == "keep\n"


# -- a reasoning model's thoughts ------------------------------------------------------------
# llama_cpp.server streams no thoughts: a loopback stand-in of the remote APIs that do
# (tests/openai_stub.py), read by the real SDK and provider over real HTTP.

async def streamed_from(stream: list[dict]) -> list:
    """The chunks the provider makes of ``stream`` (served by the loopback stand-in)."""
    from openai_stub import openai_stub

    with openai_stub(stream) as (url, _):
        model = openai_model(url)
        try:
            with anyio.fail_after(30):
                return [c async for c in model.stream(ask("hi"))]
        finally:
            await model.aclose()


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_a_reasoning_models_thoughts_are_thinking_chunks_never_text(field):
    from openai_stub import reasoning_stream

    chunks = await streamed_from(reasoning_stream(["The user ", "greets me."], "Hello there!", field))
    assert "".join(c.text for c in chunks if c.type == "thinking") == "The user greets me."
    assert "".join(c.text for c in chunks if c.type == "text") == "Hello there!"
    kinds = [c.type for c in chunks]
    assert kinds.index("text") > max(i for i, k in enumerate(kinds) if k == "thinking") and kinds[-1] == "result"


async def test_a_reasoning_field_that_is_not_text_is_left_alone():
    """``reasoning`` is the thoughts' name on some servers only: one that gives it something
    else (an object) still has its reply read."""
    from openai_stub import chunk, content_stream

    chunks = await streamed_from([chunk({"role": "assistant", "content": None, "reasoning": {"effort": "low"}}),
                                  *content_stream("ok")[1:]])
    assert [c.type for c in chunks] == ["text", "result"] and chunks[0].text == "ok"


def test_over_the_wire_a_reasoning_model_is_said_thinking_and_only_its_reply_is_streamed_and_recorded():
    """Native protocol, real server over pipes: a stretch of thoughts is one ``$/progress``
    report "thinking" (phase ``stream``, no delta) before the reply's deltas; the thoughts' text
    reaches no delta, no result, no message of the branch."""
    import subprocess
    import sys
    from pathlib import Path

    from openai_stub import openai_stub, reasoning_stream

    from operate_sidecar.clients.python.client import SidecarClient

    repo = Path(__file__).resolve().parents[2]
    thoughts = ["Secret plan: ", "say hello ", "politely."]
    with openai_stub(reasoning_stream(thoughts, "Hello!")) as (url, _), SidecarClient(
            argv=[sys.executable, "-m", "operate_sidecar.server"], cwd=str(repo), stderr=subprocess.DEVNULL) as c:
        values: list[dict] = []
        c.on_notification("$/progress", lambda p: values.append(p["value"]))
        c.request("initialize", {"settings": {"models": {"m": {"provider": "openai", "model": "r1", "baseUrl": url}},
                                              "defaultModel": "m"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "hi", "workDoneToken": "t"}, timeout=60)
        messages = c.request("branchMessages", {"branchId": bid})["messages"]
    reports = [v for v in values if v["kind"] == "report"]
    thinking = [i for i, v in enumerate(reports) if v.get("message") == "thinking"]
    deltas = [i for i, v in enumerate(reports) if "delta" in v]
    assert len(thinking) == 1 and reports[thinking[0]] == {"kind": "report", "message": "thinking", "phase": "stream"}
    assert deltas and thinking[0] < deltas[0], reports
    assert "".join(reports[i]["delta"] for i in deltas) == "Hello!" and out["result"] == "Hello!"
    seen = json.dumps([values, out, messages])
    assert "Secret plan" not in seen and "politely" not in seen


# -- thoughts written into the text ---------------------------------------------------------
# A reasoning model behind a server that does not parse its thoughts (llama_cpp.server, a plain
# llama.cpp build) writes them into its text: "<think>...</think>", then the reply. The real
# llama_cpp.server with SmolLM2, held to such a reply by a grammar (llama_cpp.server's own
# ``grammar`` request field, sent through the options).

THINK_GRAMMAR = r'root ::= "<think>" [a-z ]{4,40} "</think>" "\n\n" "Hello" [a-z !]{0,10}'


async def test_thoughts_a_real_server_streams_in_the_text_are_thinking_chunks_not_the_reply(llama_server):
    split = openai_model(llama_server.base_url)
    kept = openai_model(llama_server.base_url, inlineThinking=False)
    try:
        with anyio.fail_after(120):
            chunks = [c async for c in split.stream(ask("Say hello", grammar=THINK_GRAMMAR, max_tokens=60))]
            raw = [c async for c in kept.stream(ask("Say hello", grammar=THINK_GRAMMAR, max_tokens=60))]
    finally:
        await split.aclose()
        await kept.aclose()
    from thought_checks import assert_thoughts_then_reply

    assert_thoughts_then_reply(chunks)
    # "inlineThinking": false: the text is the reply, as the server sent it
    raw_text = "".join(c.text for c in raw if c.type == "text")
    assert "thinking" not in [c.type for c in raw]
    assert raw_text.startswith("<think>") and "</think>\n\nHello" in raw_text, raw


#: the reply of a template that opens the thoughts itself (DeepSeek-R1, QwQ): no opening tag
OPENED_GRAMMAR = r'root ::= [a-z ]{4,40} "</think>" "\n\n" "Hello" [a-z !]{0,10}'


async def test_opened_a_server_whose_template_opens_the_thoughts_has_its_reply_split_at_the_closing_tag(llama_server):
    """``inlineThinking: "opened"`` (R1 or QwQ behind llama_cpp.server, whose template opens the
    thoughts: the reply writes no ``<think>``): the real server's text up to ``</think>`` is
    thinking, then the reply; with the default the thoughts and the tag stay in the reply. A
    structured reply (a ``response_format`` sent: the server holds it to JSON) is not taken for
    thoughts; a reply with no ``</think>`` fails, saying the setting may be wrong."""
    opened = openai_model(llama_server.base_url, inlineThinking="opened")
    default = openai_model(llama_server.base_url)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"]}
    structured = ModelRequest(messages=[{"role": "user", "content": "Answer hello"}],
                              options={"temperature": 0, "max_tokens": 40}, response_schema=schema, schema_name="A")
    try:
        with anyio.fail_after(180):
            chunks = [c async for c in opened.stream(ask("Say hello", grammar=OPENED_GRAMMAR, max_tokens=60))]
            raw = [c async for c in default.stream(ask("Say hello", grammar=OPENED_GRAMMAR, max_tokens=60))]
            held = [c async for c in opened.stream(structured)]
            with pytest.raises(ModelError) as e:
                async for _ in opened.stream(ask("Say hello", grammar=r'root ::= "Hello" [a-z ]{2,10}', max_tokens=20)):
                    pass
    finally:
        await opened.aclose()
        await default.aclose()
    from thought_checks import assert_thoughts_then_reply

    assert_thoughts_then_reply(chunks)
    raw_text = "".join(c.text for c in raw if c.type == "text")
    assert "thinking" not in [c.type for c in raw] and "</think>\n\nHello" in raw_text, raw
    assert opened.structured_mode not in (None, "none"), opened.structured_mode  # (a response_format was sent)
    assert "thinking" not in [c.type for c in held], held
    assert isinstance(json.loads("".join(c.text for c in held if c.type == "text"))["answer"], str), held
    assert 'never closed the thoughts' in str(e.value) and 'set "inlineThinking" to true' in str(e.value), e.value


async def test_a_reply_that_ends_inside_its_thoughts_is_a_model_error_that_says_so(llama_server):
    model = openai_model(llama_server.base_url)
    grammar = r'root ::= "<think>" [a-z ]{40,60} "</think>" "Hello"'
    try:
        with anyio.fail_after(120), pytest.raises(ModelError) as e:
            async for _ in model.stream(ask("Say hello", grammar=grammar, max_tokens=6)):
                pass
    finally:
        await model.aclose()
    assert "ended inside the model's thoughts" in str(e.value) and "maxTokens" in str(e.value)


def test_over_the_wire_thoughts_in_a_real_servers_text_are_said_thinking_and_kept_out_of_the_reply(llama_server):
    """Native protocol, real server over pipes, real llama_cpp.server: the thoughts are one
    "thinking" report, and neither the streamed deltas, nor the result, nor the branch's
    recorded reply hold them."""
    import subprocess
    import sys
    from pathlib import Path

    from operate_sidecar.clients.python.client import SidecarClient

    repo = Path(__file__).resolve().parents[2]
    model = {"provider": "openai", "model": "smollm2", "baseUrl": llama_server.base_url}
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], cwd=str(repo),
                       stderr=subprocess.DEVNULL) as c:
        values: list[dict] = []
        c.on_notification("$/progress", lambda p: values.append(p["value"]))
        c.request("initialize", {"settings": {"models": {"m": model}, "defaultModel": "m"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "Say hello", "workDoneToken": "t",
                                    "modelOptions": {"grammar": THINK_GRAMMAR, "temperature": 0, "maxTokens": 60}},
                        timeout=120)
        messages = c.request("branchMessages", {"branchId": bid})["messages"]
    reports = [v for v in values if v["kind"] == "report"]
    thinking = [i for i, v in enumerate(reports) if v.get("message") == "thinking"]
    deltas = [i for i, v in enumerate(reports) if "delta" in v]
    assert len(thinking) == 1 and deltas and thinking[0] < deltas[0], reports
    streamed = "".join(reports[i]["delta"] for i in deltas)
    assert streamed == out["result"] and out["result"].startswith("Hello"), (reports, out)
    assert "think" not in json.dumps([reports, out, messages]).replace('"thinking"', ""), (reports, messages)


# -- what a misbehaving OpenAI-compatible server may send ------------------------------------
# A loopback server answering with the raw bytes given (tests/openai_stub.py's ``loopback``):
# the real SDK and provider read them over real HTTP.

@contextlib.contextmanager
def raw_sse(body: bytes, *, cut: bool = False):
    """Serve ``body`` as the ``text/event-stream`` reply to every chat completion; ``cut``: as one
    chunk of a chunked body that never ends (the connection closes mid-body). Yields (base URL,
    the request bodies received)."""
    import http.server

    from openai_stub import loopback

    received: list[dict] = []

    class Raw(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            received.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}"))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if cut:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"%x\r\n" % len(body) + body + b"\r\n")  # no terminating 0-chunk
            else:
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args):
            pass

    with loopback(Raw) as url:
        yield url, received


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def delta_chunk(delta=None, finish=None, **extra) -> dict:
    from openai_stub import chunk

    return {**chunk(delta, finish), **extra}


BAD_STREAMS = {
    "not JSON": (sse(b"{not json", delta_chunk({"content": "hi"})) + b"data: [DONE]\n\n", "not JSON"),
    "a list": (sse({"foo": 1}, b"[1,2,3]") + b"data: [DONE]\n\n", "unexpected shape"),
    "choices a string": (sse(delta_chunk()).replace(b'"choices": []', b'"choices": "x"') + b"data: [DONE]\n\n",
                         "unexpected shape"),
    "content a number": (sse(delta_chunk({"content": 5}, "stop")) + b"data: [DONE]\n\n", "unexpected shape"),
    "a choice a number": (sse(delta_chunk()).replace(b'"choices": []', b'"choices": [7]') + b"data: [DONE]\n\n",
                          "unexpected shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
async def test_a_malformed_stream_event_is_a_model_error_without_the_key(case, monkeypatch):
    body, words = BAD_STREAMS[case]
    monkeypatch.setenv("OPERATE_TEST_KEY", FAKE_KEY)
    with raw_sse(body) as (url, _):
        model = openai_model(url, apiKeyEnv="OPERATE_TEST_KEY", maxRetries=0)
        try:
            with anyio.fail_after(30), pytest.raises(ModelError) as info:
                await model.invoke(ask("x"))
        finally:
            await model.aclose()
    message = str(info.value)
    assert words in message and "'oai'" in message, message
    assert FAKE_KEY not in message and "9f8e7d6c5b4a" not in message


@pytest.mark.parametrize("cut", [False, True], ids=["ended", "cut mid-body"])
async def test_a_stream_that_ends_before_the_reply_is_complete_is_a_model_error(cut):
    """No finish_reason and no [DONE]: a partial reply is not passed on as a whole one; a body cut
    off mid-chunk says so too (not 'could not connect')."""
    with raw_sse(sse(delta_chunk({"role": "assistant", "content": "partial rep"})), cut=cut) as (url, got):
        model = openai_model(url, maxRetries=0)
        try:
            with anyio.fail_after(30), pytest.raises(ModelError, match="ended before the reply was complete") as info:
                await model.invoke(ask("x"))
        finally:
            await model.aclose()
    assert "could not connect" not in str(info.value) and len(got) == 1


async def test_a_finish_reason_or_done_alone_completes_a_reply():
    finish_only = sse(delta_chunk({"content": "hello"}), delta_chunk({}, "stop"))
    done_only = sse(delta_chunk({"content": "hello"})) + b"data: [DONE]\n\n"
    for body in (finish_only, done_only):
        with raw_sse(body) as (url, _):
            model = openai_model(url, maxRetries=0)
            try:
                with anyio.fail_after(30):
                    assert (await model.invoke(ask("x"))).text == "hello"
            finally:
                await model.aclose()


async def test_nan_or_infinite_usage_counts_are_null():
    from operate_sidecar.server.core.imodel import usage_counts

    body = (sse(delta_chunk({"content": "hi"}, "stop"))
            + b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
              b'"usage":{"prompt_tokens":NaN,"completion_tokens":1e400,"total_tokens":3}}\n\n'
            + b"data: [DONE]\n\n")
    with raw_sse(body) as (url, _):
        model = openai_model(url, maxRetries=0)
        try:
            with anyio.fail_after(30):
                chunks = [c async for c in model.stream(ask("x"))]
        finally:
            await model.aclose()
    usage = chunks[-1].usage
    json.dumps(usage, allow_nan=False)  # stored with the reply: must be JSON
    assert usage["total_tokens"] == 3 and usage_counts(usage) == (None, None)
    assert usage_counts({"prompt_tokens": -1, "completion_tokens": float("inf")}) == (None, None)


BAD_OPTIONS = [
    ({"model": "other"}, "modelOptions.model"),
    ({"messages": []}, "modelOptions.messages"),
    ({"streamOptions": {"include_usage": False}}, "modelOptions.streamOptions"),
    ({"extraBody": "x"}, "modelOptions.extraBody must be an object"),
    ({"extra_headers": {"X-A": 1}}, "modelOptions.extra_headers must be an object of strings"),
    ({"timeout": "soon"}, "modelOptions.timeout must be a positive number"),
    ({"timeout": -1}, "modelOptions.timeout must be a positive number"),
    ({"responseFormat": "json"}, "modelOptions.responseFormat must be an object"),
]


@pytest.mark.parametrize("options,words", BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
async def test_bad_model_options_are_refused_before_anything_is_sent(options, words):
    from openai_stub import content_stream, openai_stub

    from operate_sidecar.server.models import ModelConfigError

    with openai_stub(content_stream("ok")) as (url, got):
        model = openai_model(url, maxRetries=0)
        try:
            with anyio.fail_after(30), pytest.raises(ModelConfigError, match=words.replace(".", r"\.")):
                await model.invoke(ModelRequest(messages=[{"role": "user", "content": "x"}], options=options))
        finally:
            await model.aclose()
    assert got == []  # refused before any request
    with pytest.raises(ModelConfigError, match=r"options\."):  # the config's default options too
        make_model({"provider": "openai", "model": "m", "options": options}, name="cfg")


def test_bad_model_options_are_invalid_params_over_the_wire(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from openai_stub import content_stream, openai_stub

    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    repo = Path(__file__).resolve().parents[2]
    with openai_stub(content_stream("fine")) as (url, got):
        env = dict(os.environ, PYTHONPATH=str(repo))
        with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(repo),
                           stderr=subprocess.DEVNULL) as c:
            c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
                "models": {"m": {"provider": "openai", "model": "gpt-4o", "baseUrl": url, "maxRetries": 0}},
                "defaultModel": "m"}}, timeout=60)
            bid = c.request("createBranch", {})["branchId"]
            for options, name in (({"model": "other"}, "model"), ({"extraBody": "x"}, "extraBody"),
                                  ({"timeout": "soon"}, "timeout")):
                with pytest.raises(RpcError) as e:
                    c.request("operate", {"branchId": bid, "instruction": "go", "modelOptions": options}, timeout=60)
                assert e.value.code == -32602 and f"modelOptions.{name}" in e.value.message, e.value.message
            assert got == []
            r = c.request("operate", {"branchId": bid, "instruction": "go", "modelOptions": {"temperature": 0}},
                          timeout=60)
            assert r["result"] == "fine" and len(got) == 1


# -- servers that answer on and on, or late ----------------------------------------------------


@contextlib.contextmanager
def endless_stream():
    """A loopback server whose chat completion streams content chunks without end, as fast as the
    connection takes them."""

    from openai_stub import StubHandler, loopback

    piece = sse(delta_chunk({"content": "z" * 4000})) * 16

    class Endless(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(piece)
            except OSError:  # the client hung up
                pass
            self.close_connection = True

    with loopback(Endless) as url:
        yield url


async def test_a_reply_streamed_without_end_fails_the_call_instead_of_filling_memory():
    """A server streaming content without end (tens of MB a second over loopback) was read until
    timeoutS (120 s by default): gigabytes of reply in memory. Past 64 Mi characters the call
    is a model error naming the server."""
    with endless_stream() as url:
        model = openai_model(url, maxRetries=0)
        try:
            with anyio.fail_after(60), pytest.raises(ModelError, match="too long") as info:
                await model.invoke(ask("x"))
        finally:
            await model.aclose()
    assert "'oai'" in str(info.value) and url in str(info.value)


@contextlib.contextmanager
def rate_limited(retry_after: str):
    """A loopback server answering every chat completion HTTP 429 with ``Retry-After``; yields (base
    URL, the number of requests so far as a one-item list)."""

    from openai_stub import StubHandler, loopback

    count = [0]

    class Limited(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            count[0] += 1
            body = json.dumps({"error": {"message": "Rate limit reached for requests", "type": "requests"}}).encode()
            self.answer(429, body, headers={"Retry-After": retry_after})

    with loopback(Limited) as url:
        yield url, count


def test_a_retry_after_beyond_the_time_left_answers_the_rate_limit_at_once(tmp_path):
    """HTTP 429 with Retry-After 30 and timeoutS 5: the SDK slept past the call's deadline and the
    operate answered "timed out after 5 s" five seconds later, the rate limit nowhere. Now the
    server's 429 and its message are the -32011 at once (no retry can happen in time)."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    repo = Path(__file__).resolve().parents[2]
    with rate_limited("30") as (url, count):
        env = dict(os.environ, PYTHONPATH=str(repo))
        with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(repo),
                           stderr=subprocess.DEVNULL) as c:
            c.request("initialize", {"settings": {"models": {"m": {
                "provider": "openai", "model": "gpt-4o", "baseUrl": url, "timeoutS": 5, "maxRetries": 2}},
                "defaultModel": "m"}}, timeout=60)
            bid = c.request("createBranch", {})["branchId"]
            started = time.monotonic()
            with pytest.raises(RpcError) as e:
                c.request("operate", {"branchId": bid, "instruction": "go"}, timeout=60)
            took = time.monotonic() - started
    message = e.value.message
    assert e.value.code == -32011 and "HTTP 429: Rate limit reached for requests" in message, message
    assert "retried after 30 s, more than the time left" in message and "timed out" not in message
    assert count[0] == 1 and took < 5, took


@pytest.mark.parametrize("kind,body", [
    ("text/html; charset=utf-8", b"<!doctype html><html><body>Open WebUI</body></html>"),
    ("application/json", json.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()),
], ids=["an HTML page", "a JSON completion"])
async def test_a_reply_that_is_not_an_event_stream_says_so(kind, body):
    """A 200 with a web page (a baseUrl naming a web UI instead of its API) or a whole JSON
    completion (a server that does not stream) was reported as "the stream ended before the reply
    was complete": it now names what came instead of an event stream."""

    from openai_stub import StubHandler, loopback

    class Page(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            self.answer(200, body, kind)

    with loopback(Page) as url:
        model = openai_model(url, maxRetries=0)
        try:
            with anyio.fail_after(30), pytest.raises(ModelError) as info:
                await model.invoke(ask("x"))
        finally:
            await model.aclose()
    message = str(info.value)
    assert f"answered with {kind.split(';')[0]} content, not a stream of server-sent events" in message, message
    assert "ended before the reply was complete" not in message


def test_the_installed_openai_sdk_still_has_the_retry_hook_the_client_overrides():
    """The client overrides the SDK's private ``AsyncOpenAI._should_retry`` (a Retry-After beyond
    timeoutS is not waited for): an SDK that renames it must fail here, not lose that silently."""
    import inspect

    import openai

    hook = getattr(openai.AsyncOpenAI, "_should_retry", None)
    assert callable(hook)
    assert list(inspect.signature(hook).parameters) == ["self", "response"]


def test_an_openai_sdk_without_the_retry_hook_gets_the_plain_client(monkeypatch, caplog):
    import logging
    import types

    from operate_sidecar.server.models import openai_compat

    class Plain:  # no _should_retry
        pass

    monkeypatch.setattr(openai_compat, "_require_openai", lambda: types.SimpleNamespace(AsyncOpenAI=Plain))
    openai_compat._client_class.cache_clear()
    try:
        with caplog.at_level(logging.DEBUG, logger=openai_compat.__name__):
            assert openai_compat._client_class() is Plain
        assert "_should_retry" in caplog.text
    finally:
        openai_compat._client_class.cache_clear()
