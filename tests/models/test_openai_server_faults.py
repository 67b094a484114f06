"""``provider: openai`` against OpenAI-compatible servers that misbehave at the HTTP level: an
event that never ends, a huge error body, a connection held open after a complete reply, two
choices at once, native tool calls, an error sent as a 200, a connection reset before any
answer; and keys or headers HTTP cannot carry. Each server is a real one on loopback
(tests/openai_stub.py's ``loopback``), read by the real SDK and provider over real HTTP; a few
go through the real sidecar over its pipes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest
from openai_stub import StubHandler, chunk, content_stream, loopback, openai_stub

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import ModelConfigError, make_model
from operate_sidecar.server.models.openai_compat import MAX_EVENT_BYTES, OpenAIModel

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
FAKE_KEY = "sk-test-9f8e7d6c5b4a39281706abcdef"
MiB = 1024 * 1024


def ask(text: str = "x", **options) -> ModelRequest:
    return ModelRequest(messages=[{"role": "user", "content": text}], options=options)


def openai_model(base_url: str, **extra) -> OpenAIModel:
    return make_model({"provider": "openai", "model": "m", "baseUrl": base_url, "maxRetries": 0, **extra}, name="oai")


def sse(*events: dict | bytes) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


async def invoke(url: str, request: ModelRequest | None = None, **config):
    model = openai_model(url, **config)
    try:
        with anyio.fail_after(60):
            return await model.invoke(request or ask())
    finally:
        await model.aclose()


async def failure(url: str, request: ModelRequest | None = None, **config) -> str:
    with pytest.raises(ModelError) as info:
        await invoke(url, request, **config)
    return str(info.value)


class Outcome:
    """What a loopback handler did: bytes written, and how it ended ("done", "client gone")."""

    def __init__(self) -> None:
        self.sent = 0
        self.ended = threading.Event()
        self.how = ""

    def end(self, how: str) -> None:
        if not self.ended.is_set():  # (the first word stays)
            self.how = how
            self.ended.set()


@contextlib.contextmanager
def serving(respond):
    """A loopback server whose every POST is answered by ``respond(handler, outcome)``; yields
    (base URL, outcome, the number of requests as a one-item list)."""
    outcome, count = Outcome(), [0]

    class Handler(StubHandler):
        def do_POST(self):  # noqa: N802
            self.request_body()
            count[0] += 1
            try:
                respond(self, outcome)
                outcome.end("done")
            except OSError:  # the client hung up
                outcome.end("client gone")
            self.close_connection = True

    with loopback(Handler) as url:
        yield url, outcome, count


def stream_head(handler: StubHandler) -> None:
    """A 200 event stream, its length unknown (the body ends when the connection does)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()


# -- bounds on what is read ------------------------------------------------------------------

#: what the endless servers send at most: without a bound on an event the client reads it all
SERVER_CAP = 2 * MAX_EVENT_BYTES


@pytest.mark.parametrize("kind", ["one line", "data lines"])
async def test_a_stream_event_that_never_ends_fails_the_call_before_the_server_sent_much(kind):
    """One ``data:`` line without end, or ``data:`` lines without the blank line that ends an
    event: the SDK's decoder held it all (1 GiB in 13 s, until timeoutS). Past MAX_EVENT_BYTES
    without a complete event the call fails and the request is stopped: the server's writes
    fail long before it sent twice that (without the bound, it sends all of it, ends, and the
    client reads a giant event that is not JSON)."""
    blob = b"x" * MiB if kind == "one line" else (b"data: " + b"y" * 1000 + b"\n") * 1024

    def endless(handler, outcome):
        stream_head(handler)
        handler.wfile.write(sse(chunk({"role": "assistant", "content": ""})) + (b"data: " if kind == "one line" else b""))
        while outcome.sent < SERVER_CAP:
            handler.wfile.write(blob)
            outcome.sent += len(blob)

    with serving(endless) as (url, outcome, _):
        message = await failure(url)
        assert outcome.ended.wait(30)
    assert "without the end of a stream event" in message and "64 MiB" in message and "'oai'" in message, message
    assert outcome.how == "client gone" and outcome.sent < SERVER_CAP, (outcome.how, outcome.sent)


async def test_only_the_start_of_a_huge_error_body_is_read_and_its_message_kept():
    """An HTTP 500 whose JSON body is 32 MiB was read whole (then cut to 600 characters): now
    its first MAX_ERROR_BODY_BYTES only, and the message is read from them; the server cannot
    send the rest."""
    body = json.dumps({"error": {"message": "Quota exceeded for project alpha. " + "x" * (32 * MiB)}}).encode()

    def huge_error(handler, outcome):
        handler.send_response(500)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        for i in range(0, len(body), MiB):
            handler.wfile.write(body[i:i + MiB])
            outcome.sent += MiB

    with serving(huge_error) as (url, outcome, _):
        message = await failure(url)
        assert outcome.ended.wait(30)
    assert "answered HTTP 500: Quota exceeded for project alpha. xxx" in message, message[:300]
    assert len(message) < 700
    assert outcome.how == "client gone" and outcome.sent < len(body), (outcome.how, outcome.sent)


# -- a complete reply on a connection held open ----------------------------------------------


def test_a_complete_reply_on_a_connection_the_server_holds_is_the_operates_answer(tmp_path):
    """A finish_reason and a usage chunk, then neither ``[DONE]`` nor the end of the response:
    the call waited out timeoutS and threw the complete reply away as a time-out. Now, shortly
    after the finish_reason, the reply is complete and the response closed. timeoutS is 120;
    the client waits 30 s at most."""
    def held(handler, outcome):
        stream_head(handler)
        handler.wfile.write(sse(*content_stream("complete reply, connection held"),
                                chunk(usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})))
        handler.wfile.flush()
        handler.rfile.read(1)  # until the client closes the connection
        outcome.end("client closed")

    from operate_sidecar.clients.python.client import SidecarClient

    with serving(held) as (url, outcome, count), SidecarClient(
            argv=[sys.executable, "-m", "operate_sidecar.server"], env=dict(os.environ, PYTHONPATH=str(REPO)),
            cwd=str(REPO), stderr=subprocess.DEVNULL) as c:
        c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {"models": {"m": {
            "provider": "openai", "model": "gpt-4o", "baseUrl": url, "timeoutS": 120, "maxRetries": 0}},
            "defaultModel": "m"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "go"}, timeout=30)
        messages = c.request("branchMessages", {"branchId": bid})["messages"]
        assert outcome.ended.wait(30) and outcome.how == "client closed"
    assert out["result"] == "complete reply, connection held" and out["usage"]["inputTokens"] == 3, out
    assert [m["kind"] for m in messages] == ["instruction", "assistant_response"] and count[0] == 1


# -- choices and tool calls ------------------------------------------------------------------


async def test_only_the_first_choice_is_the_reply_and_n_other_than_1_is_refused():
    """Two choices streamed at once (``n: 2``, as OpenAI interleaves them) were read as one
    reply made of both. The reply is choice 0's; ``n`` other than 1 is refused before anything
    is sent."""
    first, second = "First choice reply.", "SECOND choice text!"
    events = [chunk({"role": "assistant", "content": ""})]
    for i in range(0, len(first), 4):
        for index, text in ((0, first), (1, second)):
            event = chunk({"content": text[i:i + 4]})
            event["choices"][0]["index"] = index
            events.append(event)
    other = chunk({}, finish="stop")
    other["choices"][0]["index"] = 1
    events += [other, chunk({"content": " And more."}), chunk({}, finish="stop")]  # choice 1 stopping ends nothing
    with openai_stub(events) as (url, got):
        assert (await invoke(url, ask(n=1))).text == "First choice reply. And more."
        for n in (2, "2", True):
            with pytest.raises(ModelConfigError, match=r"modelOptions\.n must be 1"):
                await invoke(url, ask(n=n))
    assert len(got) == 1 and got[0]["n"] == 1
    with pytest.raises(ModelConfigError, match=r"options\.n must be 1 .*not 3"):
        make_model({"provider": "openai", "model": "m", "options": {"n": 3}}, name="cfg")


async def test_a_reply_of_native_tool_calls_only_is_a_model_error():
    """The sidecar offers the model no native tools; a reply made only of ``tool_calls`` (its
    finish_reason "tool_calls") was recorded as an empty success."""
    calls = [chunk({"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": ""}}]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "a.txt"}'}}]}),
             chunk({}, finish="tool_calls")]
    with openai_stub(calls) as (url, _):
        message = await failure(url)
    assert "answered with tool calls (read_file) that the sidecar did not offer it, and no text" in message, message
    with openai_stub([chunk({"role": "assistant", "content": None}), chunk({}, finish="tool_calls")]) as (url, _):
        assert "tool calls (unnamed)" in await failure(url)
    with openai_stub([*content_stream("Here it is.")[:-1], *calls[:2], chunk({}, finish="tool_calls")]) as (url, _):
        assert (await invoke(url)).text == "Here it is."  # text and a call: the text is the reply


# -- what came instead of an answer ----------------------------------------------------------


async def test_an_error_sent_as_a_200_json_document_gives_the_servers_message_without_the_key(monkeypatch):
    """A proxy answering an error as a 200 ``{"error": {"message": ...}}``: its message was
    dropped (the user was told to check baseUrl); now it is the error, redacted."""
    monkeypatch.setenv("OPERATE_TEST_KEY", FAKE_KEY)

    def json_error(handler, outcome):
        message = f"The model `gpt-5-typo` does not exist (key {handler.headers.get('Authorization')})"
        handler.answer(200, json.dumps({"error": {"message": message, "code": "model_not_found"}}).encode())

    with serving(json_error) as (url, _, _count):
        message = await failure(url, apiKeyEnv="OPERATE_TEST_KEY")
    assert "answered with an error instead of a stream: The model `gpt-5-typo` does not exist" in message, message
    assert FAKE_KEY not in message and "9f8e7d6c5b4a" not in message


async def test_an_html_page_without_a_content_type_is_named():
    def page(handler, outcome):
        body = b"<!doctype html><html><body>Login</body></html>"
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    with serving(page) as (url, _, _count):
        message = await failure(url)
    assert "answered with an HTML page (and no content type), not a stream of server-sent events" in message, message


async def test_a_connection_closed_before_any_answer_says_so_not_could_not_connect():
    def hang_up(handler, outcome):
        handler.close_connection = True
        handler.connection.shutdown(2)

    with serving(hang_up) as (url, _, count):
        message = await failure(url)
    assert "the connection to" in message and "was closed before an answer came" in message, message
    assert "could not connect" not in message and count[0] == 1


# -- what HTTP cannot carry ------------------------------------------------------------------


@pytest.mark.parametrize("key,words", [
    ("sk-proj-0123456789abcdef\u00a0", "holds a character that is not ASCII"),
    ("sk-proj-0123456789abcdef\n", "ends with a line break"),
    ("sk-proj-0123\r\nX-Evil: 1", "holds a line break"),
    (" sk-proj-0123456789abcdef", "begins or ends with white space"),
], ids=["no-break space", "trailing newline", "line break inside", "leading space"])
async def test_an_api_key_http_cannot_carry_is_a_model_error_naming_its_variable_not_its_value(key, words, monkeypatch):
    monkeypatch.setenv("OPERATE_TEST_KEY", key)
    with openai_stub(content_stream("never")) as (url, got):
        message = await failure(url, apiKeyEnv="OPERATE_TEST_KEY")
    assert f"the API key in the environment variable OPERATE_TEST_KEY {words}" in message, message
    assert "0123" not in message and "could not connect" not in message and got == []


@pytest.mark.parametrize("headers,words", [
    ({"X-Team": "café…"}, "['X-Team'] holds a character that is not ASCII"),
    ({"X-Team": "a\nb"}, "['X-Team'] holds a line break"),
    ({"X Team": "a"}, " has 'X Team', which is not an HTTP header name"),
], ids=["non-ASCII value", "line break", "bad name"])
async def test_extra_headers_http_cannot_carry_are_refused_before_anything_is_sent(headers, words):
    with openai_stub(content_stream("never")) as (url, got):
        with pytest.raises(ModelConfigError) as info:
            await invoke(url, ask(extraHeaders=headers))
    assert f"modelOptions.extraHeaders{words}" in str(info.value) and got == [], str(info.value)
    assert "café" not in str(info.value)


def test_over_the_wire_a_non_ascii_key_is_a_model_error_not_an_internal_one(tmp_path):
    """It was -32603 with a traceback on stderr (a UnicodeEncodeError whose text shows the key)."""
    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    key = "sk-proj-0123456789abcdef\u00a0"
    stderr = tmp_path / "stderr.log"
    with openai_stub(content_stream("never")) as (url, got), open(stderr, "wb") as err, SidecarClient(
            argv=[sys.executable, "-m", "operate_sidecar.server"],
            env=dict(os.environ, PYTHONPATH=str(REPO), OPERATE_TEST_KEY=key), cwd=str(REPO), stderr=err) as c:
        c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {"models": {"m": {
            "provider": "openai", "model": "gpt-4o", "baseUrl": url, "apiKeyEnv": "OPERATE_TEST_KEY"}},
            "defaultModel": "m"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": bid, "instruction": "go"}, timeout=60)
    assert e.value.code == -32011 and "OPERATE_TEST_KEY holds a character that is not ASCII" in e.value.message
    logged = stderr.read_text()
    assert got == [] and "UnicodeEncodeError" not in logged and "0123456789" not in logged, logged


def test_the_installed_openai_sdk_still_has_the_hooks_the_provider_uses():
    """The provider bounds error bodies in ``AsyncOpenAI._send_request`` and stream events in
    ``AsyncStream._iter_events`` (private to the SDK): one renamed must fail here."""
    import inspect

    import openai
    from openai._streaming import AsyncStream

    send = getattr(openai.AsyncOpenAI, "_send_request", None)
    assert callable(send) and list(inspect.signature(send).parameters)[:3] == ["self", "request", "stream"]
    assert "self.response.aiter_bytes()" in inspect.getsource(AsyncStream._iter_events)


# -- inline models ---------------------------------------------------------------------------


def sockets_of(pid: int) -> int:
    """How many sockets the process ``pid`` holds open."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def test_inline_models_that_differ_only_in_options_share_one_client_and_its_connections(tmp_path):
    """An inline ``chatModel`` per temperature (a client tuning it call by call) against a server
    that keeps connections alive: each one made an HTTP client of its own, kept with its open
    connection for the process's life, until the sidecar ran out of descriptors. They share
    one client now: the sockets held stay as many as for one model."""
    from operate_sidecar.clients.python.client import SidecarClient

    with openai_stub(content_stream("ok")) as (url, received), SidecarClient(
            argv=[sys.executable, "-m", "operate_sidecar.server"], env=dict(os.environ, PYTHONPATH=str(REPO)),
            cwd=str(REPO), stderr=subprocess.DEVNULL) as c:
        c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {"models": {"m": {
            "provider": "openai", "model": "gpt-4o", "baseUrl": url, "maxRetries": 0}}, "defaultModel": "m"}},
            timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        assert c.request("operate", {"branchId": bid, "instruction": "go"}, timeout=30)["result"] == "ok"
        held = sockets_of(c.proc.pid)
        for i in range(30):
            inline = {"provider": "openai", "model": "gpt-4o", "baseUrl": url, "maxRetries": 0,
                      "options": {"temperature": i / 100}}
            out = c.request("operate", {"branchId": bid, "instruction": "go", "chatModel": inline}, timeout=30)
            assert out["result"] == "ok"
        assert [r.get("temperature") for r in received[1:]] == [i / 100 for i in range(30)]
        assert sockets_of(c.proc.pid) <= held + 1, (held, sockets_of(c.proc.pid))
