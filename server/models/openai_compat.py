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
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
from functools import lru_cache
from typing import Any, AsyncIterator

import anyio

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import BaseModelProvider, ModelRequest, StreamChunk

from ._common import (
    MAX_REPLY_CHARS,
    InlineThoughts,
    field_value,
    is_loopback_url,
    json_safe,
    redact,
    remember_secret,
    snake,
    snake_options,
)
from .config import FIELDS, check_model_config, json_kind

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
        _check_options(name, "options", options)
        self.options = snake_options(options)
        self.inline_thinking = inline_thinking  # true: <think>...</think> opening a reply is thoughts; "opened": every reply begins in them
        self._client: Any = None
        self._api_key: str | None = None
        self._rf_mode: str | None = None  # what worked for structured output
        self._stream_options_ok = True

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "OpenAIModel":
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
        AsyncOpenAI = _client_class()  # heavy: imported on first use only
        self._api_key = key
        remember_secret(key)
        self._client = AsyncOpenAI(
            api_key=key, base_url=self.base_url, timeout=self.timeout_s, max_retries=self.max_retries
        )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with anyio.CancelScope(shield=True):
                await client.close()

    # -- errors ---------------------------------------------------------------

    def _error(self, e: BaseException, *, streaming: bool = False) -> ModelError:
        """``e`` as a ModelError; ``streaming``: it happened while the reply was being read."""
        openai = _require_openai()

        where = self._where()
        if isinstance(e, openai.APITimeoutError):
            msg = f"model {self.name!r}: request to {where} timed out after {self.timeout_s:g}s"
        elif isinstance(e, openai.APIConnectionError) or (streaming and _is_http_error(e)):
            cause = e.__cause__ or e
            what = (f"the stream from {where} ended before the reply was complete" if streaming
                    else f"could not connect to {where}")
            msg = f"model {self.name!r}: {what}: {type(cause).__name__}: {cause}"
        elif isinstance(e, (ValueError, RecursionError)) and streaming:  # an SSE event that is not JSON
            msg = f"model {self.name!r}: {where} sent a stream event that is not JSON: {e}"
        elif isinstance(e, _BadChunk):
            msg = f"model {self.name!r}: {where} sent a stream chunk of an unexpected shape: {e}"
        elif isinstance(e, _NotAStream):
            msg = (f"model {self.name!r}: {where} answered with {e} content, not a stream of server-sent events "
                   "(is baseUrl the API's own, such as http://host:port/v1, and does that server stream replies?)")
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
                msg += ", more than the time left)" if getattr(response, "_sidecar_no_time", False) else ")"
        else:
            msg = f"model {self.name!r}: {type(e).__name__}: {e}"
        # redact the whole text first, then shorten it: a cut never leaves part of a key
        msg = redact(msg, [self._api_key, os.environ.get(self.api_key_env)])
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
                    raise self._error(e) from None
                except openai.OpenAIError as e:
                    if use is not client and isinstance(e, openai.APIConnectionError):
                        use = client
                        continue
                    raise self._error(e) from None
            log.info("model %r: response_format mode %s rejected, falling back", self.name, mode)
        assert last is not None
        raise self._error(last) from None

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        openai = _require_openai()

        stream, mode, structured = await self._open(request)
        if mode is not None:
            self._rf_mode = mode  # the server accepted it: start there next time
        usage: dict | None = None
        model_name = self.model
        refusal: list[str] = []   # OpenAI's ``refusal`` deltas: the model declined (structured outputs)
        filtered = False          # a ``content_filter`` stop: the provider cut the reply
        finished = False          # a choice said why it stopped (finish_reason)
        done = _watch_done(stream)  # [DONE] seen (where the SDK lets us see it)
        reply_chars = 0             # text and thinking so far: bounded (a server streaming on and on)
        chunks = 0
        inline = InlineThoughts.of(self.inline_thinking, structured=structured)
        try:
            async for chunk in stream:
                chunks += 1
                part = _read_chunk(chunk)
                model_name = part.model or model_name
                usage = part.usage if part.usage is not None else usage
                finished = finished or part.finished
                filtered = filtered or part.filtered
                refusal += part.refusal
                for kind, text in part.out:
                    reply_chars += len(text)
                    if reply_chars > MAX_REPLY_CHARS:
                        raise _TooLong(f"more than {MAX_REPLY_CHARS >> 20} Mi characters")
                    for piece, piece_text in inline.feed(text) if kind == "text" else ((kind, text),):
                        yield StreamChunk(type=piece, text=piece_text)
            for kind, text in inline.end():
                yield StreamChunk(type=kind, text=text)
            inline.check(self.name)
            if not (finished or done[0]):
                kind = _content_type(stream)
                if not chunks and kind and "event-stream" not in kind:
                    raise _NotAStream(kind)
                raise _Incomplete("no finish_reason and no [DONE]")
        except (openai.OpenAIError, _BadChunk, _Incomplete, _TooLong, _NotAStream) as e:
            raise self._error(e, streaming=True) from None
        except (ValueError, RecursionError) as e:  # the SDK could not parse an event's JSON
            raise self._error(e, streaming=True) from None
        except Exception as e:
            # httpx errors mid-stream (connection dropped, read time-out)
            if _is_http_error(e):
                raise self._error(e, streaming=True) from None
            raise
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await stream.close()
                except Exception:  # noqa: BLE001 - best effort
                    pass
        yield StreamChunk(type="result", usage=usage, model=model_name)  # what the call cost, refused or not
        if refusal or filtered:  # no reply to parse: say that the model declined, and why
            from operate_sidecar.server.core.errors import ModelRefused

            why = redact("".join(refusal).strip() or "stopped by the provider's content filter",
                         [self._api_key, os.environ.get(self.api_key_env)])[:MAX_ERROR_CHARS]
            raise ModelRefused(f"model {self.name!r} declined the request: {why}", refusal=why)


class _BadChunk(Exception):
    """A stream chunk that is not a ``chat.completion.chunk`` object."""


class _Incomplete(Exception):
    """The stream ended with no sign that the reply was complete."""


class _NotAStream(Exception):
    """A 200 whose body is not an event stream (an HTML page, a JSON document)."""


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
    __slots__ = ("model", "usage", "finished", "filtered", "refusal", "out")

    def __init__(self) -> None:
        self.model: str | None = None
        self.usage: dict | None = None
        self.finished = False
        self.filtered = False
        self.refusal: list[str] = []
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
        part.model = model
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
        reason = _field(choice, "finish_reason")
        if reason:
            part.finished = True
            part.filtered = part.filtered or reason == "content_filter"
        delta = _field(choice, "delta")
        if delta is None:
            continue
        if not (hasattr(delta, "model_dump") or isinstance(delta, dict)):
            raise _BadChunk(f"a delta is {type(delta).__name__}, not an object")
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


def _watch_done(stream: Any) -> list[bool]:
    """``[seen]``: set once the server's ``data: [DONE]`` event went by. Reads the SDK's event
    iterator (``AsyncStream._iter_events``); where that is not there, ``[True]`` (unknown:
    only ``finish_reason`` then tells a complete reply)."""
    seen = [False]
    events = getattr(stream, "_iter_events", None)
    if events is None or not callable(events):
        return [True]

    async def watched() -> Any:
        async for sse in events():
            if str(getattr(sse, "data", "")).startswith("[DONE]"):
                seen[0] = True
            yield sse

    try:
        stream._iter_events = watched
    except (AttributeError, TypeError):
        return [True]
    return seen


#: modelOptions the provider sets itself (after snake_case)
_PROVIDER_KEYS = {"model": "the model config's 'model'", "messages": "the branch's messages",
                  "stream_options": None}
#: options the SDK itself reads (not sent as they are): their JSON types
_SDK_OPTION_TYPES = {"extra_body": "object", "extra_headers": "object", "extra_query": "object",
                     "timeout": "positive number", "response_format": "object"}


def _check_options(name: str, where: str, options: dict[str, Any] | None) -> None:
    """Refuse (ModelConfigError: -32602) an option the provider sets itself and an option the
    SDK reads whose value is of the wrong type, naming it as given (camelCase or snake_case)."""
    from . import ModelConfigError

    for given, value in (options or {}).items():
        key = snake(given)
        if key in _PROVIDER_KEYS:
            instead = _PROVIDER_KEYS[key]
            raise ModelConfigError(f"model {name!r}: {where}.{given} is set by the provider and cannot be given"
                                   + (f" (it is {instead})" if instead else ""))
        kind = _SDK_OPTION_TYPES.get(key)
        if kind is None or value is None:
            continue
        if kind == "object":
            ok = isinstance(value, dict)
            if ok and key == "extra_headers":
                ok = all(isinstance(v, str) for v in value.values())
                kind = "an object of strings"
            else:
                kind = "an object"
        else:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value) and value > 0)
            kind = "a positive number of seconds"
        if not ok:
            raise ModelConfigError(f"model {name!r}: {where}.{given} must be {kind}, not {json_kind(value)}")


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
    return str(getattr(e, "message", None) or e)


MAX_ERROR_CHARS = 600
INSTALL_HINT = "pip install 'operate-sidecar[openai]'"


@lru_cache(maxsize=1)
def _client_class() -> Any:
    """``AsyncOpenAI``, except that a retry the server asks to wait for longer than the call has
    left (its ``Retry-After`` beyond the ``timeoutS`` deadline) is not waited for: the server's
    answer (a 429 or 503 and its message) is the error at once, instead of a time-out after
    sleeping out the whole ``timeoutS``."""
    openai = _require_openai()
    if not callable(getattr(openai.AsyncOpenAI, "_should_retry", None)):  # a private hook of the SDK
        log.debug("openai: this SDK has no AsyncOpenAI._should_retry; a Retry-After beyond timeoutS is waited for")
        return openai.AsyncOpenAI

    class Client(openai.AsyncOpenAI):  # type: ignore[misc, valid-type]
        def _should_retry(self, response: Any) -> bool:
            wait = _retry_after_seconds(getattr(response, "headers", None))
            if wait is not None:
                left = anyio.current_effective_deadline() - anyio.current_time()
                if wait >= left:
                    try:
                        response._sidecar_no_time = True  # for the error message
                    except AttributeError:
                        pass
                    return False
            return super()._should_retry(response)

    return Client


def _retry_after_seconds(headers: Any) -> float | None:
    """The delay a response's ``Retry-After-Ms`` or ``Retry-After`` (seconds) asks for, if any."""
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
    return None


def _require_openai() -> Any:
    """The ``openai`` package, or a ModelError (-32011 on the wire) naming the extra to install."""
    try:
        import openai
    except ImportError:
        raise ModelError(f"the openai provider needs the 'openai' package, which is not installed "
                         f"({INSTALL_HINT})") from None
    return openai
