"""``provider: openai`` at the edges of a reply, and the embedded ``local`` model where the two
must agree: a reply cut at the token limit, a UTF-16 surrogate pair split across deltas (or a
lone surrogate), a ``baseUrl`` without its scheme, the time-out that applied, a ``Retry-After``
beyond the SDK's own cap, and bodies that are not what was asked for. Every server is a real one
on loopback (tests/openai_stub.py), read by the real SDK and provider over real HTTP; some go
through the real sidecar over its pipes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest
from openai_stub import StubHandler, chunk, content_stream, loopback, openai_stub

from operate_sidecar.clients.python.client import RpcError, SidecarClient
from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import ModelConfigError, make_model
from operate_sidecar.server.models._common import cut_at_token_limit
from operate_sidecar.server.models.openai_compat import TOKEN_LIMIT_HINT, OpenAIModel

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
USAGE = {"prompt_tokens": 50, "completion_tokens": 64, "total_tokens": 114}
SURROGATE = re.compile(r"[\ud800-\udfff]")


def ask(text: str = "x", **options) -> ModelRequest:
    return ModelRequest(messages=[{"role": "user", "content": text}], options=options)


def openai_model(base_url: str, **extra) -> OpenAIModel:
    return make_model({"provider": "openai", "model": "m", "baseUrl": base_url, "maxRetries": 0, **extra}, name="oai")


async def streamed(url: str, request: ModelRequest | None = None, **config) -> tuple[list, BaseException | None]:
    """The chunks a model of ``url`` streams for ``request``, and the error that ended it (None)."""
    model = openai_model(url, **config)
    chunks: list = []
    try:
        with anyio.fail_after(60):
            async for c in model.stream(request or ask()):
                chunks.append(c)
    except ModelError as e:
        return chunks, e
    finally:
        await model.aclose()
    return chunks, None


def text_of(chunks: list, kind: str = "text") -> str:
    return "".join(c.text for c in chunks if c.type == kind)


@contextlib.contextmanager
def sidecar(tmp_path: Path, models: dict, **settings):
    """The real sidecar over its pipes, initialized with ``models`` (the first is the default)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(REPO),
                       stderr=subprocess.DEVNULL) as c:
        c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
            "models": models, "defaultModel": next(iter(models)), **settings}}, timeout=60)
        yield c


# -- a reply cut at the token limit ----------------------------------------------------------

#: a structured reply cut by max_tokens inside a write_file call's content: json-repair closes the
#: string, and the file was written with the function cut off
CUT_WRITE = ('{"summary": "writing the module", "action_required": true, "action_requests": [{"function": '
             '"write_file", "arguments": {"path": "app.py", "content": "def total(items):\\n    s = 0\\n    '
             'for i in items:\\n        s += i\\n')


def cut_stream(text: str, field: str = "content") -> list[dict]:
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({field: text[i:i + 9]}) for i in range(0, len(text), 9)]
    return out + [chunk({}, finish="length"), chunk(usage=USAGE)]


def test_a_structured_reply_cut_at_the_token_limit_fails_and_runs_no_tool(tmp_path):
    """finish_reason "length" in the middle of a write_file call: the reply was repaired into a
    valid one and app.py written with half a function. Now the operate is -32011 saying the reply
    was cut at the token limit and that a larger maxTokens may let it finish; no file is written,
    no repair turn is sent, and nothing is recorded (as for any failed model call)."""
    with openai_stub(cut_stream(CUT_WRITE)) as (url, got), sidecar(tmp_path, {"m": {
            "provider": "openai", "model": "m", "baseUrl": url, "maxRetries": 0, "options": {"maxTokens": 64}}},
            toolPolicy={"write_file": "allow"}) as c:
        bid = c.request("createBranch", {})["branchId"]
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": bid, "instruction": "write app.py", "actions": True, "responseFormat": {
                "title": "Work", "type": "object", "properties": {"summary": {"type": "string"}},
                "required": ["summary"]}}, timeout=60)
        messages = c.request("branchMessages", {"branchId": bid})["messages"]
    message = e.value.message
    assert e.value.code == -32011 and "'m'" in message, message
    assert "cut at the token limit" in message and "before it was complete" in message, message
    assert "a larger maxTokens may let it finish" in message, message
    assert not (tmp_path / "app.py").exists() and messages == [] and len(got) == 1


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_thoughts_cut_at_the_token_limit_fail_the_call_like_inline_thoughts(field):
    """A reasoning model cut by max_tokens while thinking, its thoughts in the API's own field: it
    was a completed operate with an empty reply (the same cut in a <think> block fails). It fails
    now, saying no answer came; the call's usage is still reported."""
    with openai_stub(cut_stream("I am thinking and thinking", field=field)) as (url, _):
        chunks, error = await streamed(url)
    assert isinstance(error, ModelError), chunks
    assert "cut at the token limit" in str(error) and "before any answer (only the model's thoughts came)" in str(error)
    assert "maxTokens" in str(error)
    assert str(error) == cut_at_token_limit("oai", True, TOKEN_LIMIT_HINT)  # (the embedded model's words too)
    assert text_of(chunks, "thinking") == "I am thinking and thinking" and text_of(chunks) == ""
    assert [c.usage for c in chunks if c.type == "result"] == [USAGE]


async def test_a_plain_reply_cut_at_the_token_limit_is_the_reply_so_far():
    """maxTokens caps a chat reply: its text, cut, is the reply (a structured one is not)."""
    with openai_stub(cut_stream("a reply cut by max tok")) as (url, _):
        chunks, error = await streamed(url)
    assert error is None and text_of(chunks) == "a reply cut by max tok"


async def test_thoughts_only_at_a_normal_stop_are_an_empty_reply():
    """Thoughts and no text at finish_reason "stop": an empty reply, as a <think> block with
    nothing after it (docs/PROTOCOL.md §2), never the thoughts taken for the reply."""
    stream = [chunk({"role": "assistant", "content": None}), chunk({"reasoning_content": "mulling"}),
              chunk({}, finish="stop")]
    with openai_stub(stream) as (url, _):
        chunks, error = await streamed(url)
    assert error is None and text_of(chunks) == "" and text_of(chunks, "thinking") == "mulling"


async def test_a_structured_reply_of_the_embedded_model_cut_at_max_tokens_fails_the_call():
    """The embedded model agrees: a structured reply cut at maxTokens (which only logged a warning,
    then was repaired) is a model error saying so; its usage is still reported."""
    model = make_model({"provider": "local", "options": {"temperature": 0}}, name="loc")
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    request = ModelRequest(messages=[{"role": "user", "content": "Write a long story about a dragon as JSON."}],
                           response_schema=schema, schema_name="Story", options={"max_tokens": 6})
    chunks = []
    try:
        with anyio.fail_after(300), pytest.raises(ModelError) as e:
            async for c in model.stream(request):
                chunks.append(c)
    finally:
        await model.aclose()
    assert "'loc'" in str(e.value) and "cut at the token limit" in str(e.value), str(e.value)
    assert "a larger maxTokens may let it finish" in str(e.value)
    # the words of the openai provider's (one function writes both), but for the setting that bounded the reply
    assert str(e.value) == cut_at_token_limit("loc", False,
                                              "(the limit here: the call's modelOptions.maxTokens, 6 tokens)")
    assert text_of(chunks).startswith("{") and [c.usage["completion_tokens"] for c in chunks if c.type == "result"] == [6]


# -- UTF-16 surrogates -----------------------------------------------------------------------
# json.dumps writes a lone surrogate as its escape, as a server writing ASCII-only JSON does when
# it cuts an emoji's pair between two chunks.

SPLIT_REPLY = [chunk({"role": "assistant", "content": ""}), chunk({"content": "party \ud83c"}),
               chunk({"content": "\udf89 time"}), chunk({}, finish="stop")]


def test_a_surrogate_pair_split_across_chunks_is_one_character_and_the_branch_goes_on(tmp_path):
    """The two halves of 🎉 in two chunks were taken in as two lone surrogates: recorded, they
    made every later request unsendable ("a request header holds a character that is not ASCII"),
    for good. They are joined now: the deltas, the result and the record hold 🎉, and the next
    operate sends it."""
    with openai_stub(SPLIT_REPLY, content_stream("fine")) as (url, got), sidecar(tmp_path, {"m": {
            "provider": "openai", "model": "m", "baseUrl": url, "maxRetries": 0}}) as c:
        values: list[dict] = []
        c.on_notification("$/progress", lambda p: values.append(p["value"]))
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "hi", "workDoneToken": "t"}, timeout=60)
        messages = c.request("branchMessages", {"branchId": bid})["messages"]
        again = c.request("operate", {"branchId": bid, "instruction": "next"}, timeout=60)
    deltas = [v["delta"] for v in values if v.get("kind") == "report" and "delta" in v]
    assert out["result"] == "party 🎉 time" and "".join(deltas) == "party 🎉 time", (out, deltas)
    assert [m["content"]["text"] for m in messages if m["kind"] == "assistant_response"] == ["party 🎉 time"]
    assert not SURROGATE.search(json.dumps([values, out, messages], ensure_ascii=False))
    assert again["result"] == "fine" and "party 🎉 time" in json.dumps(got[1]["messages"], ensure_ascii=False)


async def test_thoughts_are_joined_too_and_a_surrogate_without_its_pair_is_a_replacement_character():
    stream = [chunk({"role": "assistant", "content": None}), chunk({"reasoning_content": "hmm \ud83e"}),
              chunk({"content": "a \ud800 b "}), chunk({"reasoning_content": "\udd14 ok"}),
              chunk({"content": "\udf89 c \ud83c"}), chunk({}, finish="stop")]
    with openai_stub(stream) as (url, _):
        chunks, error = await streamed(url)
    assert error is None
    assert text_of(chunks, "thinking") == "hmm 🤔 ok"  # (the other kind's delta between its halves)
    assert text_of(chunks) == "a \ufffd b \ufffd c \ufffd"
    assert not any(SURROGATE.search(c.text) for c in chunks)


@pytest.mark.parametrize("messages,where", [
    ([{"role": "user", "content": "emoji half \ud83d here"}], "the current instruction"),
    ([{"role": "system", "content": "be kind"}, {"role": "user", "content": "a \udc00"},
      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}], "an earlier message of the branch"),
], ids=["instruction", "history"])
async def test_text_that_is_not_valid_unicode_is_named_as_such_not_as_a_header(messages, where):
    """A lone surrogate in the request (a client's "\\ud83d" escape) could not be encoded: the
    error said a request header held a non-ASCII character. It now says what and where; nothing
    is sent."""
    with openai_stub(content_stream("never")) as (url, got):
        _, error = await streamed(url, ModelRequest(messages=messages))
    message = str(error)
    assert isinstance(error, ModelError) and f"{where} holds text that is not valid Unicode" in message, message
    assert "header" not in message and got == []


async def test_a_lone_surrogate_in_the_response_schema_is_named_there():
    """The response schema (sent as the response format) was not looked at: a lone surrogate in
    it gave the generic "the request holds text that is not valid Unicode", not where."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "description": "half \ud83d"}}}
    with openai_stub(content_stream("never")) as (url, got):
        _, error = await streamed(url, ModelRequest(messages=[{"role": "user", "content": "go"}],
                                                    response_schema=schema, schema_name="A"))
    message = str(error)
    assert isinstance(error, ModelError), error
    assert "'oai': the response schema holds text that is not valid Unicode" in message, message
    assert got == []


async def test_a_server_error_text_with_a_lone_surrogate_is_valid_text():
    class Broken(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            self.answer(400, json.dumps({"error": {"message": "bad \ud83d input"}}).encode())

    with loopback(Broken) as url:
        _, error = await streamed(url)
    assert "bad \ufffd input" in str(error) and not SURROGATE.search(str(error))


# -- baseUrl ---------------------------------------------------------------------------------

@pytest.mark.parametrize("url,words", [
    ("localhost:8080/v1", "baseUrl must begin with http:// or https:// (it has none: did you mean "
                          "'http://localhost:8080/v1'?)"),
    ("ftp://example.com/v1", "baseUrl must begin with http:// or https://, not 'ftp://'"),
    ("http:///v1", "baseUrl has no host after http://"),
    ("user:sk-secret@host/v1", "baseUrl must begin with http:// or https:// (it has none)"),
])
def test_a_base_url_without_an_http_scheme_is_refused_at_the_config(url, words):
    """``localhost:8080/v1`` was accepted, then an operate said the API key variable was not set
    (the URL read as the scheme "localhost", so not as loopback) or retried an unsupported
    protocol."""
    with pytest.raises(ModelConfigError) as e:
        make_model({"provider": "openai", "model": "m", "baseUrl": url}, name="api")
    assert words in str(e.value) and "sk-secret" not in str(e.value), str(e.value)


def test_a_base_url_without_a_scheme_is_invalid_params_at_initialize_naming_the_model(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(REPO),
                       stderr=subprocess.DEVNULL) as c, pytest.raises(RpcError) as e:
        c.request("initialize", {"settings": {"models": {"api": {
            "provider": "openai", "model": "m", "baseUrl": "localhost:8080/v1"}}, "defaultModel": "api"}}, timeout=60)
    assert e.value.code == -32602 and "models.api" in e.value.message and "http://localhost:8080/v1" in e.value.message


# -- the time-out that applied ---------------------------------------------------------------

@contextlib.contextmanager
def silent_server():
    """A server that reads each request and never answers (until the test ends)."""
    release = threading.Event()

    class Silent(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            release.wait(60)
            self.close_connection = True

    try:
        with loopback(Silent) as url:
            yield url
    finally:
        release.set()


@pytest.mark.parametrize("where", ["modelOptions", "options"])
async def test_a_request_time_out_names_the_time_out_that_applied(where):
    """modelOptions.timeout 0.5 fired after half a second, and the error said "timed out after
    30s" (timeoutS)."""
    with silent_server() as url:
        if where == "modelOptions":
            _, error = await streamed(url, ask(timeout=0.5), timeoutS=30)
        else:
            _, error = await streamed(url, timeoutS=30, options={"timeout": 0.5})
    assert isinstance(error, ModelError) and f"timed out after 0.5 s ({where}.timeout)" in str(error), str(error)
    assert "30" not in str(error).split("timed out")[1]


# -- Retry-After -----------------------------------------------------------------------------

def _response(status: int, headers: dict[str, str]):
    import httpx2

    return httpx2.Response(status, headers=headers, request=httpx2.Request("POST", "http://127.0.0.1:9/v1"))


async def test_a_retry_after_within_the_time_left_is_honoured_beyond_the_sdks_cap():
    """Retry-After 130 with timeoutS 600 was answered at once without a retry (the SDK gives up on
    any beyond 120 s), though only one beyond the time left is: within it, it is waited for as
    asked; beyond it, not."""
    from openai._models import FinalRequestOptions

    from operate_sidecar.server.models.openai_compat import _client_class

    client = _client_class()(api_key="k", base_url="http://127.0.0.1:9/v1", max_retries=2)
    try:
        options = FinalRequestOptions.construct(method="post", url="/chat/completions")
        limited = _response(429, {"Retry-After": "130"})
        with anyio.fail_after(600):
            assert client._should_retry(limited)
            assert client._calculate_retry_timeout(2, options, limited.headers) == 130
        with anyio.fail_after(60):
            assert not client._should_retry(limited) and limited._sidecar_no_time
        assert not client._should_retry(_response(400, {"Retry-After": "130"}))  # (the status still decides)
    finally:
        await client.close()


async def test_a_retry_after_that_leaves_the_retry_no_time_is_not_waited_for():
    """Retry-After 119 with 120 s left: the SDK slept 119 s, then the retry timed out, and the
    user saw a time-out instead of the server's 429. A wait must leave the retry half the time
    left (or the read time-out, when shorter); both hooks agree."""
    from openai._models import FinalRequestOptions

    from operate_sidecar.server.models.openai_compat import _client_class

    options = FinalRequestOptions.construct(method="post", url="/chat/completions")
    client = _client_class()(api_key="k", base_url="http://127.0.0.1:9/v1", max_retries=2)
    quick = _client_class()(api_key="k", base_url="http://127.0.0.1:9/v1", max_retries=2, timeout=10)
    try:
        for wait, left, retried in (("119", 120, False), ("61", 120, False), ("59", 120, True)):
            limited = _response(429, {"Retry-After": wait})
            with anyio.fail_after(left):
                assert client._should_retry(limited) is retried, (wait, left)
                assert getattr(limited, "_sidecar_no_time", False) is not retried
                assert (client._calculate_retry_timeout(2, options, limited.headers) == float(wait)) is retried
        limited = _response(429, {"Retry-After": "585"})  # a read time-out of 10 s: 10 s of room is enough
        with anyio.fail_after(600):
            assert quick._should_retry(limited) and quick._calculate_retry_timeout(2, options, limited.headers) == 585
        limited = _response(429, {"Retry-After": "595"})
        with anyio.fail_after(600):
            assert not quick._should_retry(limited) and limited._sidecar_no_time
    finally:
        await client.close()
        await quick.close()


async def test_a_retry_after_beyond_the_sdks_cap_is_waited_for_over_http(monkeypatch):
    """The same over real HTTP, the SDK's cap lowered so the wait is short: the 429 is retried
    after the server's Retry-After-Ms, and the retry's reply is the answer."""
    import openai._base_client

    assert openai._base_client.MAX_RETRY_AFTER_DELAY == 120  # (an SDK that moves it: rewrite this test)
    monkeypatch.setattr(openai._base_client, "MAX_RETRY_AFTER_DELAY", 0.05)
    count = [0]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in content_stream("after the wait"))

    class Limited(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            count[0] += 1
            if count[0] == 1:
                self.answer(429, b'{"error": {"message": "slow down"}}', headers={"Retry-After-Ms": "300"})
            else:
                self.answer(200, body + b"data: [DONE]\n\n", "text/event-stream")

    with loopback(Limited) as url:
        chunks, error = await streamed(url, timeoutS=30, maxRetries=2)
    assert error is None and text_of(chunks) == "after the wait" and count[0] == 2, error


def test_the_installed_openai_sdk_still_has_the_retry_delay_hook_the_client_overrides():
    import inspect

    import openai

    hook = getattr(openai.AsyncOpenAI, "_calculate_retry_timeout", None)
    assert callable(hook)
    assert list(inspect.signature(hook).parameters) == ["self", "remaining_retries", "options", "response_headers"]


# -- bodies that are not what was asked for --------------------------------------------------

def test_an_error_page_of_repeated_title_tags_is_named_at_once():
    """An error body of 64 KiB of ``<title>`` froze the event loop for seconds (the title pattern
    looked for ``</title`` from every ``<title``, to the end of the body each time: time in the
    square of its size). The patterns take time in proportion to the text, and only its first
    characters are read: a body of 2 MiB is named well within the guard (the old code took hours
    on it), in a process of its own so that a hang is killed."""
    code = (
        "from operate_sidecar.server.models import openai_compat as oc\n"
        "page = '<html>' + '<title>' * (2 * 1024 * 1024 // 7)\n"
        "class E:\n    body = page\n    message = 'x'\n"
        "print(oc._sample(page), '|', oc._status_message(E()), '|', oc._sample('<html><TITLE lang=en>Gateway &amp; '"
        " + 'x ' * 10 + '</title>' + '<title>' * 100000))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == 'an HTML page | an HTML page | an HTML page, "Gateway & x x x x x x x x x x"', out.stdout



@pytest.mark.parametrize("status,kind,body,words", [
    (200, "text/event-stream", b"<!DOCTYPE html><html><body>Login to portal</body></html>",
     'answered with a body sent as text/event-stream, not a stream of server-sent events: an HTML page, '
     '"Login to portal"'),
    (200, "text/event-stream", b"upstream connect error or disconnect/reset before headers\n",
     'not a stream of server-sent events: "upstream connect error or disconnect/reset before headers"'),
    (200, "text/html", b"<html><head><title>Sign in &amp; go</title></head><body>x</body></html>",
     'answered with text/html content, not a stream of server-sent events: an HTML page, "Sign in & go"'),
    (503, "text/html", b"<html>Service Unavailable</html>", 'answered HTTP 503: an HTML page, "Service Unavailable"'),
    (502, "text/plain", b"Bad gateway " * 100, 'answered HTTP 502: "Bad gateway Bad gateway'),
], ids=["HTML as an event stream", "text as an event stream", "HTML", "503 HTML", "502 text"])
async def test_a_body_that_is_not_what_was_asked_for_is_named_with_its_first_words(status, kind, body, words):
    """An HTML page labelled text/event-stream was "the stream ended before the reply was
    complete", a 503 with an HTML page only "Error code: 503": what came is named, bounded."""

    class Page(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            self.answer(status, body, kind)

    with loopback(Page) as url:
        _, error = await streamed(url)
    message = str(error)
    assert isinstance(error, ModelError) and words in message, message
    assert "ended before the reply was complete" not in message and "Error code" not in message
    assert len(message) < 600


@pytest.mark.parametrize("config_options, call_options, says", [
    ({"maxTokens": 64}, {}, "Raise maxTokens in the \"options\" of model 'oai' in its config (now 64)."),
    ({"maxTokens": 64}, {"maxTokens": 32}, "Raise maxTokens in the call's modelOptions (now 32)."),
    ({}, {"max_completion_tokens": 16}, "Raise maxCompletionTokens in the call's modelOptions (now 16)."),
    ({}, {}, "Set maxTokens in the \"options\" of model 'oai' in its config: none was sent"),
    # both keys go out (the call's over the config's): the server honours max_completion_tokens
    ({"maxCompletionTokens": 100}, {"maxTokens": 32},
     "Raise maxCompletionTokens in the \"options\" of model 'oai' in its config (now 100). (maxTokens in the "
     "call's modelOptions, 32, was sent too: OpenAI-style servers take maxCompletionTokens over it.)"),
    ({"maxTokens": 64}, {"maxTokens": None}, "Set maxTokens in the \"options\" of model 'oai' in its config: none "
     "was sent"),
])
async def test_a_cut_reply_is_a_reply_cut_naming_the_setting_that_bounded_it(config_options, call_options, says):
    """A structured reply cut at the token limit is the ``ReplyCut`` model error (ACP's
    ``max_tokens`` stop reason, as the embedded model's), its ``fix`` naming the setting that sent
    the limit and its value (as sent: the call's modelOptions over the config's options, a call's
    null too; maxCompletionTokens, which the server honours, before maxTokens), or that none
    was sent."""
    from operate_sidecar.server.core.errors import ReplyCut

    request = ModelRequest(messages=[{"role": "user", "content": "x"}], options=call_options,
                           response_schema={"type": "object"})
    with openai_stub(cut_stream(CUT_WRITE)) as (url, _):
        chunks, error = await streamed(url, request, options=config_options)
    assert isinstance(error, ReplyCut) and error.stop_reason == "max_tokens", error
    assert says in error.fix, error.fix
    assert str(error) == cut_at_token_limit("oai", False, TOKEN_LIMIT_HINT)


def test_a_base_url_with_a_query_keeps_the_endpoint_path_and_sends_the_query_with_each_request():
    """Azure's ``…/openai/v1?api-version=…`` (a gateway's ``?key=``): the SDK joined the endpoint
    to the URL's text, so the request went to ``…/v1/?api-version=2024-06-01chat/completions``
    (a 404, or the wrong api-version from a lenient server)."""
    paths: list[str] = []

    class Handler(StubHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.request_body()
            paths.append(self.path)
            events = content_stream("hi")
            self.answer(200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                        + b"data: [DONE]\n\n", "text/event-stream")

    with loopback(Handler) as url:
        chunks, error = anyio.run(streamed, f"{url}?api-version=2024-06-01&x=a%20b")
    assert error is None and text_of(chunks) == "hi", error
    assert paths == ["/v1/chat/completions?api-version=2024-06-01&x=a+b"], paths
