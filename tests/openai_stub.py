"""Loopback stand-ins for OpenAI endpoints (``loopback`` serves any handler). The main one stands in for the remote OpenAI API, for the replies no local server produces
(llama.cpp's server never refuses, and ``llama_cpp.server`` streams no reasoning model's
thoughts): it answers every ``POST /v1/chat/completions`` with the
streamed chunks it is given, in OpenAI's documented server-sent-events form, so the real
``openai`` SDK and the real provider read them over real HTTP. Everything else of the
provider is tested against llama.cpp's real server (``tests/models/conftest.py``)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from typing import Any, Iterator

MODEL = "gpt-4o-2024-08-06"


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    """One ``chat.completion.chunk``: a choice with ``delta`` (and ``finish``), or a usage-only chunk."""
    body: dict[str, Any] = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1_700_000_000,
                            "model": MODEL, "choices": []}
    if delta is not None or finish is not None:
        body["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}]
    if usage is not None:
        body["usage"] = usage
    return body


def content_stream(text: str) -> list[dict]:
    """A reply streamed as content deltas (a few characters each), then ``stop``."""
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": text[i:i + 16]}) for i in range(0, len(text), 16)]
    return out + [chunk({}, finish="stop")]


def reasoning_stream(thoughts: list[str], text: str, field: str = "reasoning_content") -> list[dict]:
    """What a reasoning model's API streams (DeepSeek's ``deepseek-reasoner`` and vLLM:
    ``reasoning_content``; OpenRouter and Ollama: ``reasoning``; llama_cpp.server streams neither):
    the thoughts as deltas of ``field`` with no content, then the reply as content deltas."""
    out = [chunk({"role": "assistant", "content": None})]
    out += [chunk({field: t, "content": None}) for t in thoughts]
    return out + content_stream(text)[1:]


def refusal_stream(text: str, usage: dict | None = None) -> list[dict]:
    """What the API streams when the model declines a structured-output request: the words in
    ``refusal`` deltas, no content."""
    words = text.split(" ")
    out = [chunk({"role": "assistant", "content": None, "refusal": ""})]
    out += [chunk({"refusal": w if i == 0 else " " + w}) for i, w in enumerate(words)]
    out.append(chunk({}, finish="stop"))
    if usage is not None:
        out.append(chunk(usage=usage))
    return out


class StubHandler(http.server.BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler for loopback stubs: ``request_body()`` reads what was posted,
    ``answer()`` sends a whole reply (status, extra headers, content type, body)."""

    protocol_version = "HTTP/1.1"

    def request_body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status: int, body: bytes, content_type: str = "application/json",
               headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


@contextlib.contextmanager
def openai_stub(*streams: list[dict]) -> Iterator[tuple[str, list[dict]]]:
    """Serve the ``streams`` (lists of chunks) as the replies of the chat completions asked for,
    in order, the last one again for any further request; yields (base URL, the request bodies
    received)."""
    received: list[dict] = []

    class Handler(StubHandler):
        def do_POST(self) -> None:  # noqa: N802
            received.append(json.loads(self.request_body() or b"{}"))
            if not self.path.endswith("/chat/completions"):
                self.send_error(404)
                return
            events = streams[min(len(received), len(streams)) - 1]
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            self.answer(200, data, "text/event-stream")

    with loopback(Handler) as url:
        yield url, received


@contextlib.contextmanager
def loopback(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on 127.0.0.1 (a free port) from a thread; yields the base URL
    (``http://127.0.0.1:PORT/v1``). Stopped and joined (bounded) on exit."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)
