"""``provider: openai``: any OpenAI-compatible Chat Completions endpoint.

Config fields: ``model`` (required), ``baseUrl`` (default: the SDK's, i.e.
api.openai.com), ``apiKeyEnv`` (default ``OPENAI_API_KEY``), ``timeoutS``
(default 120), ``maxRetries`` (default 2, the SDK's), ``options`` (default
request kwargs, merged under each request's ``options``).

The ``openai`` SDK is imported on first use. Structured requests first use the
native JSON-Schema response format; when the server rejects it (400/422) the
provider falls back, once per step, to ``json_object`` with the schema (the
llama.cpp-server/Anyscale extension), plain ``json_object``, then no response
format, and remembers what worked for later calls. Every error becomes a
``ModelError`` whose message never contains the API key.

What a server sends is bounded: a reply longer than ``MAX_REPLY_CHARS``, a stream event (or
bytes that never complete one) larger than ``MAX_EVENT_BYTES``, and an error body beyond its
first ``MAX_ERROR_BODY_BYTES`` are not read on. A reply is complete at a ``finish_reason`` of its
first choice or at ``[DONE]``; after a ``finish_reason`` the rest of the stream (a usage chunk,
``[DONE]``, its end) is waited for at most ``FINISH_GRACE_S``. A ``finish_reason`` of ``length``
(cut at the token limit) fails a structured reply, and one with no answer, as a ModelError after
its usage (:func:`cut_at_token_limit`): repaired, cut JSON ran tool calls with cut-off arguments.
What is streamed, returned and recorded is valid Unicode (:class:`_Surrogates`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import re
import weakref
from functools import lru_cache
from typing import Any, AsyncIterator

import anyio

from operate_sidecar.server.core.errors import ModelError, ReplyCut
from operate_sidecar.server.core.imodel import BaseModelProvider, ModelRequest, StreamChunk

from ._common import (
    MAX_REPLY_CHARS,
    InlineThoughts,
    cut_at_token_limit,
    field_value,
    is_loopback_url,
    json_safe,
    redact,
    redact_cut,
    redact_piece,
    remember_model_secrets,
    remember_secret,
    snake,
    snake_options,
)
from .config import FIELDS, check_model_config, openai_options_problem
from .config import header_value_problem as _header_value_problem

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
CONFIG_FIELDS = frozenset(FIELDS["openai"])  # declared (with their types) in config.py
LOOPBACK_DUMMY_KEY = "no-key-required"

# Structured-output modes, tried in this order.
RF_JSON_SCHEMA = "json_schema"
RF_JSON_OBJECT_SCHEMA = "json_object+schema"
RF_JSON_OBJECT = "json_object"
RF_NONE = "none"
RF_LADDER = (RF_JSON_SCHEMA, RF_JSON_OBJECT_SCHEMA, RF_JSON_OBJECT, RF_NONE)

_NAME_OK = re.compile(r"[^a-zA-Z0-9_-]")
#: where else a reply's token limit may come from, for its error (:func:`cut_at_token_limit`)
TOKEN_LIMIT_HINT = "(without one, the limit is the server's or the model's own)"

#: After a chunk whose choice has a ``finish_reason``, the longest wait for the rest of the
#: stream (a usage chunk, ``[DONE]``, the end of the response): a server that sends neither
#: and holds the connection has its complete reply passed on, not timed out.
FINISH_GRACE_S = 2.0
#: The most bytes a response may send without completing a stream event (one ``data:`` line
#: without end, ``data:`` lines without the blank line that ends them): the SDK's decoder
#: holds such bytes without bound. As large as the longest reply, ``MAX_REPLY_CHARS``.
MAX_EVENT_BYTES = 64 * 1024 * 1024
#: The most of an error response's body read (its message is cut to MAX_ERROR_CHARS anyway).
MAX_ERROR_BODY_BYTES = 64 * 1024
#: The first bytes of a streamed response kept, to say what came when it is not a stream.
HEAD_BYTES = 8 * 1024
#: the HTTP clients in use, by event loop and by what a client is made of (the server's address,
#: the API key, the time-out, the retries) → [client, how many models use it]. Models that differ
#: only in their options share one client and its connections: an inline ``chatModel`` per
#: temperature made a client (about 0.85 MB and a kept-alive connection) each, kept for the
#: process's life, until the sidecar ran out of file descriptors.
_CLIENTS: "weakref.WeakKeyDictionary[Any, dict[tuple, list]]" = weakref.WeakKeyDictionary()


@lru_cache(maxsize=1)
def _create_params() -> frozenset[str]:
    """Keyword names ``chat.completions.create`` accepts (the rest go to extra_body)."""
    from openai.resources.chat.completions import AsyncCompletions

    return frozenset(inspect.signature(AsyncCompletions.create).parameters) - {"self"}


def response_format_for(mode: str, schema: dict, name: str) -> dict | None:
    if mode == RF_JSON_SCHEMA:
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": False}}
    if mode == RF_JSON_OBJECT_SCHEMA:
        return {"type": "json_object", "schema": schema}
    if mode == RF_JSON_OBJECT:
        return {"type": "json_object"}
    return None


class OpenAIModel(BaseModelProvider):
    """An OpenAI-compatible chat model (``provider: openai``)."""

    is_cli = False

    def __init__(
        self,
        name: str,
        *,
        model: str,
        base_url: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 2,
        options: dict[str, Any] | None = None,
        inline_thinking: bool | str = True,
    ) -> None:
        if not model:
            from . import ModelConfigError

            raise ModelConfigError(f"model config {name!r}: provider 'openai' needs a 'model'")
        self.name = name
        self.model = model
        self.base_url = base_url
        self.api_key_env = api_key_env
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.options = snake_options(options)  # (checked by ``from_config``, as initialize checks them)
        self.inline_thinking = inline_thinking  # true: <think>...</think> opening a reply is thoughts; "opened": every reply begins in them
        self._client: Any = None  # shared with every model made of the same client (``_CLIENTS``)
        self._shared: tuple[Any, tuple] = (None, ())
        self._api_key: str | None = None
        self._rf_mode: str | None = None  # what worked for structured output
        self._stream_options_ok = True

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "OpenAIModel":
        remember_model_secrets(config)  # (given inline, they are masked as the settings' are)
        check_model_config(config, f"model config {name!r}", "openai")
        return cls(
            name,
            model=field_value(name, config, "model", "", str),
            base_url=field_value(name, config, "baseUrl", None, str),
            api_key_env=field_value(name, config, "apiKeyEnv", "OPENAI_API_KEY", str),
            timeout_s=field_value(name, config, "timeoutS", DEFAULT_TIMEOUT_S, float),
            max_retries=field_value(name, config, "maxRetries", 2, int),
            options=field_value(name, config, "options", None, dict),
            inline_thinking=field_value(name, config, "inlineThinking", True),  # true, false or "opened" (checked)
        )

    # -- client ---------------------------------------------------------------

    @property
    def structured_mode(self) -> str | None:
        """The structured-output mode that last worked (None until one did)."""
        return self._rf_mode

    def _where(self) -> str:
        return redact(self.base_url or "https://api.openai.com/v1")

    def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        key = os.environ.get(self.api_key_env) or None
        if key is None:
            if self.base_url and is_loopback_url(self.base_url):
                key = LOOPBACK_DUMMY_KEY
            else:
                raise ModelError(
                    f"model {self.name!r}: the API key environment variable {self.api_key_env} is not set "
                    f"(needed for {self._where()})"
                )
        self._api_key = key
        remember_secret(key)
        problem = _header_value_problem(key)
        if problem:  # httpx would fail on it (a UnicodeEncodeError that shows the key, or "Illegal header value")
            raise ModelError(f"model {self.name!r}: the API key in the environment variable {self.api_key_env} "
                             f"{problem}, which an HTTP header cannot carry; set it again without that")
        try:
            loop: Any = asyncio.get_running_loop()
        except RuntimeError:  # (no loop: a client of its own)
            loop = None
        made_of = (self.base_url, key, self.timeout_s, self.max_retries)
        shared = _CLIENTS.setdefault(loop, {}) if loop is not None else {}
        entry = shared.get(made_of)
        if entry is None:
            AsyncOpenAI = _client_class()  # heavy: imported on first use only
            base_url, query = _split_query(self.base_url)
            entry = shared[made_of] = [AsyncOpenAI(api_key=key, base_url=base_url, timeout=self.timeout_s,
                                                   max_retries=self.max_retries,
                                                   **({"default_query": query} if query else {})), 0]
        entry[1] += 1
        self._client, self._shared = entry[0], (loop, made_of)
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        loop, made_of = self._shared
        shared = _CLIENTS.get(loop, {}) if loop is not None else {}
        entry = shared.get(made_of)
        if entry is not None and entry[0] is client:
            entry[1] -= 1
            if entry[1] > 0:  # another model still uses it
                return
            del shared[made_of]
        with anyio.CancelScope(shield=True):
            await client.close()

    # -- errors ---------------------------------------------------------------

    def _error(self, e: BaseException, *, streaming: bool = False,
               timeout: tuple[float, str] | None = None) -> ModelError:
        """``e`` as a ModelError; ``streaming``: it happened while the reply was being read;
        ``timeout``: the request's time-out and where it was set (:meth:`_timeout_of`)."""
        openai = _require_openai()

        where = self._where()
        seconds, setting = timeout or (self.timeout_s, "timeoutS")
        if isinstance(e, openai.APITimeoutError):
            msg = f"model {self.name!r}: request to {where} timed out after {seconds:g} s ({setting})"
        elif isinstance(e, openai.APIConnectionError) or (streaming and _is_http_error(e)):
            cause = e.__cause__ or e
            kind, text = type(cause).__name__, str(cause)
            if streaming and kind == "ReadTimeout":
                what = f"the stream from {where} sent nothing for {seconds:g} s ({setting}), before the reply was complete"
            elif streaming:
                what = f"the stream from {where} ended before the reply was complete"
            elif kind in _CLOSED_ERRORS:  # it connected: the server (or a proxy) hung up
                what = f"the connection to {where} was closed before an answer came"
            elif kind == "LocalProtocolError":  # a header h11 refuses: never show its value
                what, text = f"could not send the request to {where}", text.split(" b'")[0].split(' b"')[0]
            else:
                what = f"could not connect to {where}"
            msg = f"model {self.name!r}: {what}: {kind}" + (f": {text}" if text else "")
        elif isinstance(e, (ValueError, RecursionError)) and streaming:  # an SSE event that is not JSON
            msg = f"model {self.name!r}: {where} sent a stream event that is not JSON: {e}"
        elif isinstance(e, _BadChunk):
            msg = f"model {self.name!r}: {where} sent a stream chunk of an unexpected shape: {e}"
        elif isinstance(e, _NotAStream) and e.error is not None:
            msg = f"model {self.name!r}: {where} answered with an error instead of a stream: {e.error}"
        elif isinstance(e, _NotAStream):
            msg = (f"model {self.name!r}: {where} answered with {e}, not a stream of server-sent events"
                   + (f": {e.sample}" if e.sample else "")
                   + " (is baseUrl the API's own, such as http://host:port/v1, and does that server stream replies?)")
        elif isinstance(e, _ToolCalls):
            msg = (f"model {self.name!r}: the model answered with tool calls ({e}) that the sidecar did not offer "
                   "it, and no text")
        elif isinstance(e, _TooLong):
            msg = f"model {self.name!r}: the reply from {where} is too long ({e}); it was stopped"
        elif isinstance(e, _Incomplete):
            msg = f"model {self.name!r}: the stream from {where} ended before the reply was complete ({e})"
        elif isinstance(e, openai.APIStatusError):
            msg = f"model {self.name!r}: {where} answered HTTP {e.status_code}: {_status_message(e)}"
            response = getattr(e, "response", None)
            wait = _retry_after_seconds(getattr(response, "headers", None))
            if wait is not None:
                msg += f" (it asked to be retried after {wait:g} s"
                msg += ", more than the time left allows)" if getattr(response, "_sidecar_no_time", False) else ")"
        else:
            msg = f"model {self.name!r}: {type(e).__name__}: {e}"
        # redact the whole text first, then shorten it: a cut never leaves part of a key
        msg = valid_text(redact(msg, [self._api_key, os.environ.get(self.api_key_env)]))
        if len(msg) > MAX_ERROR_CHARS:
            msg = msg[:MAX_ERROR_CHARS] + "…"
        return ModelError(msg)

    # -- request --------------------------------------------------------------

    def _kwargs(self, request: ModelRequest) -> dict[str, Any]:
        """The request's keyword arguments: the config's ``options`` under the request's
        (modelOptions). Checked before anything is sent: a key the provider sets itself, or a
        value of the wrong type for a key the SDK itself reads, is a ModelConfigError (-32602)."""
        _check_options(self.name, "modelOptions", request.options)
        request_opts = snake_options(request.options)
        opts = {**self.options, **request_opts}
        opts.pop("stream", None)
        known = _create_params()
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = dict(opts.pop("extra_body", None) or {})
        for k, v in opts.items():
            (kw if k in known else extra)[k] = v
        if extra:
            kw["extra_body"] = extra
        return kw

    async def _open(self, request: ModelRequest) -> tuple[Any, str | None, bool]:
        """Start a streamed completion, walking the structured-output ladder when
        the server rejects a response format: the stream, the ladder's mode, and whether a
        ``response_format`` was sent (the server holds the reply to JSON)."""
        openai = _require_openai()

        client = self._get_client()
        base = self._kwargs(request)
        self._check_text(request, base)
        timeout = self._timeout_of(request)
        schema = request.response_schema
        name = _NAME_OK.sub("_", request.schema_name or "response")[:64] or "response"
        modes: tuple[str | None, ...]
        if schema is None or "response_format" in base:
            modes = (None,)
        else:
            start = RF_LADDER.index(self._rf_mode) if self._rf_mode else 0
            modes = RF_LADDER[start:]
        # While probing an unconfirmed format, don't let the SDK retry a rejection
        # (llama_cpp.server answers one with HTTP 500, which the SDK retries).
        probing = schema is not None and self._rf_mode is None and len(modes) > 1
        last: BaseException | None = None
        for mode in modes:
            kw = dict(base)
            if mode is not None:
                rf = response_format_for(mode, schema, name)  # type: ignore[arg-type]
                if rf is not None:
                    kw["response_format"] = rf
            use = client.with_options(max_retries=0) if probing and mode != RF_NONE else client
            while True:
                if self._stream_options_ok:
                    kw["stream_options"] = {"include_usage": True}
                else:
                    kw.pop("stream_options", None)
                try:
                    stream = await use.chat.completions.create(
                        model=self.model, messages=request.messages, stream=True, **kw
                    )
                    return stream, mode, "response_format" in kw
                except openai.APIStatusError as e:
                    msg = _status_message(e)
                    if self._stream_options_ok and _rejects(e, msg, "stream_options"):
                        self._stream_options_ok = False
                        continue
                    if mode is not None and _rejects(e, msg, "response_format", "json_schema", "json_object"):
                        last = e
                        break
                    if use is not client:  # not a format rejection: the normal path, with retries
                        use = client
                        continue
                    raise self._error(e, timeout=timeout) from None
                except openai.OpenAIError as e:
                    if use is not client and isinstance(e, openai.APIConnectionError):
                        use = client
                        continue
                    raise self._error(e, timeout=timeout) from None
                except UnicodeError as e:  # (its text would show the value: a header's may be the key)
                    if getattr(e, "reason", "") == "surrogates not allowed":  # the JSON body, as UTF-8
                        raise ModelError(f"model {self.name!r}: the request holds text that is not valid Unicode "
                                         "(a lone UTF-16 surrogate), which an HTTP request cannot carry; nothing "
                                         "was sent") from None
                    raise ModelError(f"model {self.name!r}: a request header holds a character that is not "
                                     "ASCII, which an HTTP header cannot carry") from None
            log.info("model %r: response_format mode %s rejected, falling back", self.name, mode)
        assert last is not None
        raise self._error(last, timeout=timeout) from None

    def _check_text(self, request: ModelRequest, kwargs: dict[str, Any]) -> None:
        """A ModelError (-32011) naming where, when the request holds a surrogate character (a
        lone half of a UTF-16 pair, such as a client's ``"\\ud83d"`` escape), which its UTF-8
        body cannot carry: the SDK's UnicodeEncodeError said nothing true about it. Nothing is
        sent, and the instruction is not recorded (a failed call records nothing)."""
        where = None
        for i, message in enumerate(request.messages):
            if _surrogate_in(message):
                where = ("the current instruction" if i == len(request.messages) - 1
                         else "the system message" if message.get("role") == "system"
                         else "an earlier message of the branch")
                break
        else:
            if "response_format" not in kwargs and _surrogate_in(request.response_schema):  # (sent in it: _open)
                where = "the response schema"
            elif _surrogate_in(kwargs):
                where = "the request's options"
        if where is not None:
            raise ModelError(f"model {self.name!r}: {where} holds text that is not valid Unicode (a lone "
                             "UTF-16 surrogate, such as a \\ud83d escape without its pair), which an HTTP "
                             "request cannot carry; nothing was sent")

    def _timeout_of(self, request: ModelRequest) -> tuple[float, str]:
        """The time-out a request's HTTP reads are given, and where it was set: ``modelOptions``
        over the config's ``options`` over ``timeoutS`` (the SDK's ``timeout`` option)."""
        for options, where in ((request.options, "modelOptions"), (self.options, "options")):
            for given, value in (options or {}).items():
                if snake(given) == "timeout" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    return float(value), f"{where}.{given}"
        return self.timeout_s, "timeoutS"

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        openai = _require_openai()

        stream, mode, structured = await self._open(request)
        timeout = self._timeout_of(request)
        if mode is not None:
            self._rf_mode = mode  # the server accepted it: start there next time
        usage: dict | None = None
        model_name = self.model
        refusal: list[str] = []   # OpenAI's ``refusal`` deltas: the model declined (structured outputs)
        filtered = False          # a ``content_filter`` stop: the provider cut the reply
        cut = False               # a ``length`` stop: the reply reached the token limit
        finished = False          # the first choice said why it stopped (finish_reason)
        tools: list[str] = []     # the names of native tool calls (no tools are offered: no reply)
        tool_stop = False         # the reply stopped for tool calls
        said = False              # some reply text (not white space, not thoughts) was passed on
        thought = False           # some thoughts were passed on
        halves = _Surrogates()    # a surrogate pair's first half, held for the next delta
        seen = _watch(stream)     # [DONE] seen, the bytes of an event so far, the body's first bytes
        reply_chars = 0           # text and thinking so far: bounded (a server streaming on and on)
        chunks = 0
        inline = InlineThoughts.of(self.inline_thinking, structured=structured)
        chunk_iter = stream.__aiter__()
        grace_end: float | None = None  # once finished: how long the rest of the stream is waited for
        try:
            while True:
                try:
                    if grace_end is None:  # (no scope per chunk while the reply streams)
                        chunk = await chunk_iter.__anext__()
                    else:
                        with anyio.move_on_after(grace_end - anyio.current_time()) as grace:
                            chunk = await chunk_iter.__anext__()
                        if grace.cancelled_caught:  # finished, then neither [DONE] nor the end came: complete
                            log.debug("model %r: no end of the stream %gs after its finish_reason; the reply is "
                                      "complete", self.name, FINISH_GRACE_S)
                            break
                except StopAsyncIteration:
                    break
                chunks += 1
                part = _read_chunk(chunk)
                model_name = part.model or model_name
                usage = part.usage if part.usage is not None else usage
                finished = finished or part.finished
                filtered = filtered or part.filtered
                cut = cut or part.cut
                refusal += part.refusal
                tools += part.tools
                tool_stop = tool_stop or part.tool_stop
                for kind, text in part.out:
                    reply_chars += len(text)
                    if reply_chars > MAX_REPLY_CHARS:
                        raise _TooLong(f"more than {MAX_REPLY_CHARS >> 20} Mi characters")
                    text = halves.feed(kind, text)
                    for piece, piece_text in inline.feed(text) if kind == "text" else ((kind, text),):
                        said = said or (piece == "text" and bool(piece_text.strip()))
                        thought = thought or piece == "thinking"
                        if piece_text:
                            yield StreamChunk(type=piece, text=piece_text)
                if finished and grace_end is None:
                    grace_end = anyio.current_time() + FINISH_GRACE_S
            ends = [("thinking", halves.end("thinking"))]
            ends += [(kind, text) for kind, text in inline.feed(halves.end("text")) + inline.end()]
            for kind, text in ends:
                if text:
                    said = said or (kind == "text" and bool(text.strip()))
                    thought = thought or kind == "thinking"
                    yield StreamChunk(type=kind, text=text)
            inline.check(self.name)
            if not (finished or seen.done):
                if not chunks:
                    what = _not_a_stream(_content_type(stream), bytes(seen.head))
                    if what is not None:
                        raise what
                raise _Incomplete("no finish_reason and no [DONE]")
            if (tools or tool_stop) and not said and not refusal:
                raise _ToolCalls(", ".join(dict.fromkeys(tools)) or "unnamed")
        except (openai.OpenAIError, _BadChunk, _Incomplete, _TooLong, _NotAStream, _ToolCalls) as e:
            raise self._error(e, streaming=True, timeout=timeout) from None
        except (ValueError, RecursionError) as e:  # the SDK could not parse an event's JSON
            raise self._error(e, streaming=True, timeout=timeout) from None
        except Exception as e:
            # httpx errors mid-stream (connection dropped, read time-out)
            if _is_http_error(e):
                raise self._error(e, streaming=True, timeout=timeout) from None
            raise
        finally:
            with anyio.CancelScope(shield=True):
                for close in (getattr(chunk_iter, "aclose", None), stream.close):
                    try:  # the response is closed (a server holding it open after the reply is let go)
                        if close is not None:
                            await close()
                    except Exception:  # noqa: BLE001 - best effort
                        pass
        yield StreamChunk(type="result", usage=usage, model=model_name)  # what the call cost, refused or not
        if refusal or filtered:  # no reply to parse: say that the model declined, and why
            from operate_sidecar.server.core.errors import ModelRefused

            why = redact(valid_text("".join(refusal)).strip() or "stopped by the provider's content filter",
                         [self._api_key, os.environ.get(self.api_key_env)])[:MAX_ERROR_CHARS]
            raise ModelRefused(f"model {self.name!r} declined the request: {why}", refusal=why)
        if cut:
            if structured or request.response_schema is not None or not said:
                raise ReplyCut(cut_at_token_limit(self.name, thought and not said, TOKEN_LIMIT_HINT),
                               fix=_limit_fix(self.name, snake_options(request.options), self.options))
            log.info("model %r: the reply was cut at the token limit (finish_reason \"length\"); its text so far "
                     "is the reply", self.name)
        elif thought and not said:  # (a server whose reasoning parser took the answer too: vLLM's without </think>)
            log.warning("model %r: the reply was the model's thoughts only, no answer after them: an empty reply",
                        self.name)


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """``text`` as valid Unicode: a UTF-16 surrogate pair given as two characters (a JSON
    ``"\\ud83c\\udf89"``) joined into the one character it encodes, a lone surrogate (which no
    UTF-8 can carry: an HTTP body, the state database, the wire) made U+FFFD."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class _Surrogates:
    """Joins a surrogate pair that a server split across two deltas of the same kind (a JSON
    writer with ASCII escapes cutting an emoji's ``"\\ud83c"`` from its ``"\\udf89"``): a delta's
    last character, when it is a first half, is held for the next delta of its kind; what
    still is no pair becomes U+FFFD (:func:`valid_text`)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, str] = {}

    def feed(self, kind: str, text: str) -> str:
        text = self._held.pop(kind, "") + text
        if text and "\ud800" <= text[-1] <= "\udbff":
            self._held[kind], text = text[-1], text[:-1]
        return valid_text(text)

    def end(self, kind: str) -> str:
        """What is held of ``kind`` at the end of the reply (a half that never found its pair)."""
        return valid_text(self._held.pop(kind, ""))


def _surrogate_in(value: Any) -> bool:
    """Does a request's JSON value hold a surrogate character (a lone one, or half of a pair given
    as two characters), which UTF-8, and so the request's body, cannot carry?"""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_surrogate_in(k) or _surrogate_in(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_surrogate_in(v) for v in value)
    return False


#: httpx errors of a connection made, then lost before the response's headers came
_CLOSED_ERRORS = frozenset({"ReadError", "WriteError", "RemoteProtocolError", "CloseError"})


class _BadChunk(Exception):
    """A stream chunk that is not a ``chat.completion.chunk`` object."""


class _Incomplete(Exception):
    """The stream ended with no sign that the reply was complete."""


class _NotAStream(Exception):
    """A 200 whose body is not an event stream (an HTML page, a JSON document): its text says
    what came; ``error``: the message of a JSON error document (``{"error": {"message": ...}}``);
    ``sample``: what the body says (:func:`_sample`)."""

    def __init__(self, what: str, error: str | None = None, sample: str = "") -> None:
        super().__init__(what)
        self.error = error
        self.sample = sample


class _ToolCalls(Exception):
    """A reply of native tool calls only (the sidecar offers the model none this way)."""


def _not_a_stream(kind: str, head: bytes) -> _NotAStream | None:
    """What a 200 that yielded no stream chunk sent instead, from its content type (``kind``)
    and its first bytes; None when it may be an (empty) event stream."""
    text = head.decode("utf-8", "replace").lstrip()
    error = _error_message(text) if text.startswith("{") else None
    if error is not None:  # (whatever its content type said)
        return _NotAStream(kind or "JSON", error)
    sample = _sample(text, cut=len(head) >= HEAD_BYTES)
    if "event-stream" in kind:  # (a proxy's or a web UI's page, labelled as the stream asked for)
        return None if not text or _SSE_LINE.search(text) else _NotAStream(f"a body sent as {kind}", sample=sample)
    if kind:
        return _NotAStream(f"{kind} content", sample=sample)
    if _is_html(text):
        return _NotAStream("an HTML page (and no content type)", sample=sample)
    if text.startswith(("{", "[")):
        return _NotAStream("a JSON document (and no content type)", sample=sample)
    return _NotAStream("a body with no content type", sample=sample) if text else None


#: a line of an event stream: a field (``data:``, ``event:``, ``id:``, ``retry:``) or a comment
_SSE_LINE = re.compile(r"^(?:data|event|id|retry)?:", re.M)
_HTML_START = re.compile(r"<(?:!doctype\s+html|html|head|body|title)\b", re.I)
_HTML_SKIP = re.compile(r"<(script|style)\b.*?(?:</\1\s*>|$)|<!--.*?(?:-->|$)|<[^>]*>?", re.I | re.S)
#: a page's title: its text up to the next tag (``<title>…</title>``). Each match attempt stops at
#: the next ``<``: ``(.*?)</title`` looked for the closing tag from every ``<title``, to the end of
#: the body each time, and 64 KiB of ``<title>`` took seconds of the event loop
_TITLE = re.compile(r"<title\b[^<>]*>([^<]*)", re.I)
#: the most characters of a body's words that a message quotes
SAMPLE_CHARS = 160
#: the most characters of a body that :func:`_sample` reads (its title or first words are in them)
SAMPLE_SCAN_CHARS = HEAD_BYTES


def _is_html(text: str) -> bool:
    return _HTML_START.match(text.lstrip()) is not None


def _sample(text: str, cut: bool = False) -> str:
    """What a body that is not the JSON or event stream expected says, for a message, bounded:
    an HTML page as ``an HTML page, "<its title, or its first words>"``, other text as its first
    words in quotes; "" when it says nothing. Only its first SAMPLE_SCAN_CHARS characters are
    read, by patterns that take time in proportion to them (an error body is up to
    MAX_ERROR_BODY_BYTES, and this runs on the event loop). Known secrets and key-shaped tokens
    are masked before any cut (docs/SECURITY.md G6): in what is read, without the piece of a
    secret that the end of what was read may cut (``cut``: the body went on past ``text``, read
    only so far), and in the words again before they are cut to SAMPLE_CHARS."""
    import html

    text = redact_piece(text[:SAMPLE_SCAN_CHARS], cut_after=cut or len(text) > SAMPLE_SCAN_CHARS).strip()
    page = _is_html(text)
    if page:
        title = _TITLE.search(text)
        words = html.unescape(_HTML_SKIP.sub(" ", title.group(1) if title else text))
    else:
        words = text
    words = redact_cut(" ".join(words.split()), SAMPLE_CHARS, "…")
    quoted = f'"{words}"' if words else ""
    return ("an HTML page" + (f", {quoted}" if quoted else "")) if page else quoted


def _content_type(stream: Any) -> str:
    """The media type of the streamed response (``text/html``), or "" where unknown."""
    try:
        return str(stream.response.headers.get("content-type") or "").split(";")[0].strip().lower()[:100]
    except Exception:  # noqa: BLE001 - another SDK: unknown
        return ""


class _TooLong(Exception):
    """The reply outgrew MAX_REPLY_CHARS."""


def _is_http_error(e: BaseException) -> bool:
    return type(e).__module__.startswith(("httpx", "httpcore"))


class _Part:
    __slots__ = ("model", "usage", "finished", "filtered", "cut", "refusal", "tools", "tool_stop", "out")

    def __init__(self) -> None:
        self.model: str | None = None
        self.usage: dict | None = None
        self.finished = False
        self.filtered = False
        self.cut = False            # finish_reason "length": stopped at the token limit
        self.refusal: list[str] = []
        self.tools: list[str] = []  # names of native tool calls (``tool_calls``, ``function_call``)
        self.tool_stop = False      # finish_reason "tool_calls" (or the older "function_call")
        self.out: list[tuple[str, str]] = []  # ("text" | "thinking", text)


def _field(obj: Any, name: str) -> Any:
    """``obj.name`` of an SDK object (built without validation: any JSON may be inside)."""
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None)
        if isinstance(extra, dict):
            value = extra.get(name)
    return value


def _text_field(obj: Any, name: str, what: str) -> str | None:
    value = _field(obj, name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _BadChunk(f"{what} is {type(value).__name__}, not a string")
    return value


def _read_chunk(chunk: Any) -> _Part:
    """What one streamed chunk says, its shape checked (the SDK builds chunks without
    validating them, so a server can put anything anywhere)."""
    part = _Part()
    if not (hasattr(chunk, "model_dump") or isinstance(chunk, dict)):
        raise _BadChunk(f"a JSON {type(chunk).__name__}, not an object")
    model = _field(chunk, "model")
    if model and isinstance(model, str):
        part.model = valid_text(model)
    usage = _field(chunk, "usage")
    if usage is not None:
        dump = getattr(usage, "model_dump", None)
        if dump is not None:
            try:  # no serializer warning for a count that is not an int: it becomes null below
                usage = dump(exclude_none=True, warnings=False)
            except (TypeError, ValueError):  # pydantic v1
                usage = dump(exclude_none=True)
        if not isinstance(usage, dict):
            raise _BadChunk(f"usage is {type(usage).__name__}, not an object")
        part.usage = json_safe(usage)  # NaN/Infinity counts are not JSON: null
    choices = _field(chunk, "choices")
    if choices is None:
        return part
    if not isinstance(choices, list):
        raise _BadChunk(f"choices is {type(choices).__name__}, not a list")
    for choice in choices:
        if not (hasattr(choice, "model_dump") or isinstance(choice, dict)):
            raise _BadChunk(f"a choice is {type(choice).__name__}, not an object")
        index = _field(choice, "index")
        if index is not None and index != 0:
            continue  # another choice of the same request (the reply is the first one's)
        reason = _field(choice, "finish_reason")
        if reason:
            part.finished = True
            part.filtered = part.filtered or reason == "content_filter"
            part.cut = part.cut or reason == "length"
            part.tool_stop = reason in ("tool_calls", "function_call")
        delta = _field(choice, "delta")
        if delta is None:
            continue
        if not (hasattr(delta, "model_dump") or isinstance(delta, dict)):
            raise _BadChunk(f"a delta is {type(delta).__name__}, not an object")
        part.tools += _tool_names(delta)
        refused = _text_field(delta, "refusal", "refusal")
        if refused:
            part.refusal.append(refused)
        # (the thoughts of a reasoning model: ``reasoning_content`` from llama.cpp's server,
        # vLLM and DeepSeek; ``reasoning`` from OpenRouter, Ollama and LM Studio, used only as
        # text: a server may give that name something else, which is not a reason to fail)
        other = _field(delta, "reasoning")
        thinking = _text_field(delta, "reasoning_content", "reasoning_content") \
            or (other if isinstance(other, str) and other else None)
        if thinking:
            part.out.append(("thinking", thinking))
        content = _text_field(delta, "content", "content")
        if content:
            part.out.append(("text", content))
    return part


def _tool_names(delta: Any) -> list[str]:
    """The names of the native tool calls a delta starts (any JSON may be there: only
    string names are read)."""
    calls = _field(delta, "tool_calls")
    legacy = _field(delta, "function_call")
    if not calls and not legacy:  # (every text delta)
        return []
    out: list[str] = []
    for call in (calls if isinstance(calls, list) else []) + ([{"function": legacy}] if legacy else []):
        function = _field(call, "function") if call is not None else None
        name = _field(function, "name") if function is not None else None
        if isinstance(name, str) and name:
            out.append(valid_text(name[:64]))
    return out


class _Seen:
    """What :func:`_watch` sees of a streamed response."""

    __slots__ = ("done", "pending", "head")

    def __init__(self) -> None:
        self.done = False        # the server's ``data: [DONE]`` event went by
        self.pending = 0         # bytes read since the last complete event
        self.head = bytearray()  # the body's first HEAD_BYTES


def _watch(stream: Any) -> _Seen:
    """Watch a streamed response through the SDK's event iterator (``AsyncStream._iter_events``,
    which decodes ``stream.response.aiter_bytes()``): note ``[DONE]``, keep the body's first
    bytes, and fail (``_TooLong``) when more than MAX_EVENT_BYTES come without completing an
    event, which the SDK's decoder would hold without bound. Where the SDK has no such
    iterator, ``done`` is true (unknown: only ``finish_reason`` then tells a complete reply)."""
    seen = _Seen()
    events = getattr(stream, "_iter_events", None)
    if events is None or not callable(events):
        seen.done = True
        return seen

    async def watched() -> Any:
        async for sse in events():
            seen.pending = 0
            if str(getattr(sse, "data", "")).startswith("[DONE]"):
                seen.done = True
            yield sse

    try:
        stream._iter_events = watched
    except (AttributeError, TypeError):
        seen.done = True
        return seen
    response = getattr(stream, "response", None)
    read = getattr(response, "aiter_bytes", None)
    if not callable(read):
        log.debug("openai: this SDK's stream has no response.aiter_bytes; stream events are not bounded")
        return seen

    async def counted(*args: Any, **kwargs: Any) -> Any:
        async with contextlib.aclosing(read(*args, **kwargs)) as parts:
            async for part in parts:
                if len(seen.head) < HEAD_BYTES:
                    seen.head += part[:HEAD_BYTES - len(seen.head)]
                seen.pending += len(part)
                if seen.pending > MAX_EVENT_BYTES:
                    raise _TooLong(f"more than {MAX_EVENT_BYTES >> 20} MiB without the end of a stream event")
                yield part

    try:
        response.aiter_bytes = counted
    except (AttributeError, TypeError):
        log.debug("openai: this SDK's response takes no reader; stream events are not bounded")
    return seen


def _limit_fix(name: str, call: dict[str, Any], given: dict[str, Any]) -> str:
    """Which setting to raise for a reply cut at the token limit, as the request sent it
    (``_kwargs``: the model's ``options`` under the call's ``modelOptions``, both snake_case):
    ``max_completion_tokens`` when it was sent (an OpenAI-style server honours it over
    ``max_tokens``), else ``max_tokens``, named with the layer that supplied it (the call, or
    the model's config; a call's null sets the config's aside); else none was sent and the
    limit is the server's or the model's own."""
    merged = {**given, **call}
    sent = [(key, merged[key]) for key in ("max_completion_tokens", "max_tokens")
            if isinstance(merged.get(key), int) and not isinstance(merged[key], bool)]
    if not sent:
        return (f'Set maxTokens in the "options" of model {name!r} in its config: none was sent, so the limit was '
                "the server's or the model's own.")

    def named(key: str) -> str:
        word = "maxCompletionTokens" if key == "max_completion_tokens" else "maxTokens"
        where = "the call's modelOptions" if key in call else f'the "options" of model {name!r} in its config'
        return f"{word} in {where}"

    (key, value), rest = sent[0], sent[1:]
    fix = f"Raise {named(key)} (now {value})."
    if rest:
        fix += f" ({named(rest[0][0])}, {rest[0][1]}, was sent too: OpenAI-style servers take maxCompletionTokens over it.)"
    return fix


def _check_options(name: str, where: str, options: dict[str, Any] | None) -> None:
    """Refuse (ModelConfigError: -32602) ``options`` the provider cannot send
    (``config.openai_options_problem``: the check ``initialize`` makes of a model's ``options``),
    naming the option as given (camelCase or snake_case), never a header's value."""
    problem = openai_options_problem(options, where)
    if problem:
        from . import ModelConfigError

        raise ModelConfigError(f"model {name!r}: {problem}")


def _rejects(e: Any, msg: str, *words: str) -> bool:
    """Did the server reject the request because of one of ``words``? A 400/422
    that names it, or any 400/422 for a response format; a 5xx only if it names it
    (llama_cpp.server reports request validation errors as HTTP 500)."""
    named = any(w in msg for w in words)
    status = getattr(e, "status_code", 0)
    if status in (400, 422):
        return named or "response_format" in words
    return status >= 500 and named


def _status_message(e: Any) -> str:
    """The server's error text, whole: callers redact it before they shorten it."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(body.get("detail"), (list, str)):
            return str(body["detail"])
    if isinstance(body, str) and body.startswith("{"):  # a JSON body cut at MAX_ERROR_BODY_BYTES
        message = _error_message(body)
        if message:
            return message
    elif isinstance(body, str) and body.strip():  # an HTML page (a proxy's), plain text: what it says
        return _sample(body)
    return str(getattr(e, "message", None) or e)


_MESSAGE_FIELD = re.compile(r'"message"\s*:\s*"((?:[^"\\]|\\.)*)')


def _error_message(text: str) -> str | None:
    """The ``error.message`` (or top-level ``message``) of a JSON error document, or of the
    first part of one (a body read only so far): None when there is none."""
    try:
        body = json.loads(text)
    except ValueError:
        found = _MESSAGE_FIELD.search(text)
        if found is None or '"error"' not in text[:found.start()]:
            return None
        try:
            return json.loads('"' + found.group(1) + '"')
        except ValueError:
            return found.group(1)
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]:
        return err["message"]
    if isinstance(err, str) and err:
        return err
    return None


MAX_ERROR_CHARS = 600
INSTALL_HINT = "pip install 'operate-sidecar[openai]'"


@lru_cache(maxsize=1)
def _client_class() -> Any:
    """``AsyncOpenAI``, except that the server's ``Retry-After`` is measured against the time the
    call has left (its ``timeoutS`` deadline): a retry it asks to wait for too long to leave the
    retry time for its answer (:func:`_retry_in_time`) is not waited for (the server's answer, a
    429 or 503 and its message, is the error at once, instead of a time-out after sleeping out
    the whole ``timeoutS``), and one within the time left is waited for as asked, however long (the SDK alone gives up on any beyond two minutes, and waits its
    own shorter back-off for them when told to retry); and that of an error response's body only
    the first MAX_ERROR_BODY_BYTES are read (the SDK reads it whole, whatever its size). Without
    a deadline (none is set: not in the pipeline), the SDK's own rules apply."""
    openai = _require_openai()
    if not callable(getattr(openai.AsyncOpenAI, "_should_retry", None)):  # a private hook of the SDK
        log.debug("openai: this SDK has no AsyncOpenAI._should_retry; a Retry-After beyond timeoutS is waited for")
        return openai.AsyncOpenAI

    class Client(openai.AsyncOpenAI):  # type: ignore[misc, valid-type]
        def _should_retry(self, response: Any) -> bool:
            wait = _retry_after_seconds(getattr(response, "headers", None))
            if wait is not None:
                in_time = _retry_in_time(wait, self.timeout)
                if in_time is False:
                    try:
                        response._sidecar_no_time = True  # for the error message
                    except AttributeError:
                        pass
                    return False
                if in_time:  # a wait in time: whether to retry is the status's (and the SDK's) say
                    return super()._should_retry(_WithoutRetryAfter(response))
            return super()._should_retry(response)

        def _calculate_retry_timeout(self, remaining_retries: int, options: Any,
                                     response_headers: Any = None) -> float:
            wait = _retry_after_seconds(response_headers)
            in_time = _retry_in_time(wait, self.timeout) if wait is not None else None
            if in_time:
                return wait
            if in_time is False:  # (never slept: the SDK's own back-off, not the server's wait)
                response_headers = None
            return super()._calculate_retry_timeout(remaining_retries, options, response_headers)

        async def _send_request(self, request: Any, *, stream: bool, **kwargs: Any) -> Any:
            response = await super()._send_request(request, stream=stream, **kwargs)
            if stream and getattr(response, "status_code", 0) >= 400:
                await _read_error_head(response)
            return response

    return Client


def _time_left() -> float:
    """Seconds until the deadline of the enclosing cancel scopes (the call's ``timeoutS``), or
    infinity without one."""
    return anyio.current_effective_deadline() - anyio.current_time()


def _retry_in_time(wait: float, timeout: Any) -> bool | None:
    """Whether a retry after the ``wait`` a server asked for can still be answered before the
    call's deadline: the wait must leave the retry half the time left, or the client's read
    time-out (``timeout``) when that is shorter. Waiting 119 of 120 s left only to time out
    would give the user a time-out instead of the server's own answer (its 429 and message).
    None without a deadline (the SDK's own rules apply)."""
    left = _time_left()
    if not math.isfinite(left):
        return None
    read = getattr(timeout, "read", timeout)  # (an httpx Timeout, or seconds)
    read = float(read) if isinstance(read, (int, float)) and not isinstance(read, bool) and read > 0 else math.inf
    return wait < left - min(left / 2, read)


class _WithoutRetryAfter:
    """A response as the SDK's retry rule reads it, without its ``Retry-After`` headers (whose
    wait the time left already allows), so that the SDK's cap on them does not refuse it."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self.headers = response.headers.copy()
        for name in ("retry-after", "retry-after-ms"):
            if name in self.headers:
                del self.headers[name]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)


async def _read_error_head(response: Any) -> None:
    """Read the first MAX_ERROR_BODY_BYTES of a streamed error response, close it, and leave
    them as its content (what the SDK's error then reads); a transport error while reading
    keeps what came."""
    if getattr(response, "is_closed", True) or hasattr(response, "_content"):
        return
    head = bytearray()
    try:
        async with contextlib.aclosing(response.aiter_bytes()) as parts:
            async for part in parts:
                head += part
                if len(head) >= MAX_ERROR_BODY_BYTES:
                    break
    except Exception as e:
        if not _is_http_error(e):
            raise
    finally:
        with anyio.CancelScope(shield=True):
            await response.aclose()
    response._content = bytes(head[:MAX_ERROR_BODY_BYTES])


def _retry_after_seconds(headers: Any) -> float | None:
    """The delay a response's ``Retry-After-Ms`` or ``Retry-After`` (seconds, or an HTTP date)
    asks for, if any (as the SDK reads them)."""
    if headers is None:
        return None
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            wait = float(value) / divisor
        except ValueError:
            continue
        return wait if math.isfinite(wait) and wait > 0 else None
    value = headers.get("retry-after")
    if value:
        import email.utils
        import time

        try:
            when = email.utils.parsedate_tz(value)
            wait = float(email.utils.mktime_tz(when) - time.time()) if when is not None else None
        except (TypeError, ValueError, OverflowError, OSError):
            wait = None
        return wait if wait is not None and wait > 0 else None
    return None


def _require_openai() -> Any:
    """The ``openai`` package, or a ModelError (-32011 on the wire) naming the extra to install."""
    try:
        import openai
    except ImportError:
        raise ModelError(f"the openai provider needs the 'openai' package, which is not installed "
                         f"({INSTALL_HINT})") from None
    return openai


def _split_query(base_url: str | None) -> tuple[str | None, dict[str, str]]:
    """``baseUrl`` without its query, and the query's parameters: the SDK joins the endpoint's
    path to the URL's text, so ``.../v1?api-version=2024-06-01`` (Azure's, a gateway's
    ``?key=``) became ``.../v1/?api-version=2024-06-01chat/completions`` (a 404). The
    parameters go with every request instead (the SDK's ``default_query``)."""
    if not base_url or "?" not in base_url:
        return base_url, {}
    from urllib.parse import parse_qsl, urlsplit, urlunsplit

    parts = urlsplit(base_url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit(parts._replace(query="", fragment="")), query
