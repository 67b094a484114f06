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
import os
import re
from functools import lru_cache
from typing import Any, AsyncIterator

import anyio

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import BaseModelProvider, ModelRequest, StreamChunk

from ._common import field_value, is_loopback_url, redact, remember_secret, snake_options
from .config import FIELDS, check_model_config

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
        self.options = snake_options(options)
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
        AsyncOpenAI = _require_openai().AsyncOpenAI  # heavy: imported on first use only
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

    def _error(self, e: BaseException) -> ModelError:
        openai = _require_openai()

        where = self._where()
        if isinstance(e, openai.APITimeoutError):
            msg = f"model {self.name!r}: request to {where} timed out after {self.timeout_s:g}s"
        elif isinstance(e, openai.APIConnectionError):
            cause = e.__cause__ or e
            msg = f"model {self.name!r}: could not connect to {where}: {type(cause).__name__}: {cause}"
        elif isinstance(e, openai.APIStatusError):
            msg = f"model {self.name!r}: {where} answered HTTP {e.status_code}: {_status_message(e)}"
        else:
            msg = f"model {self.name!r}: {type(e).__name__}: {e}"
        # redact the whole text first, then shorten it: a cut never leaves part of a key
        msg = redact(msg, [self._api_key, os.environ.get(self.api_key_env)])
        if len(msg) > MAX_ERROR_CHARS:
            msg = msg[:MAX_ERROR_CHARS] + "…"
        return ModelError(msg)

    # -- request --------------------------------------------------------------

    def _kwargs(self, request: ModelRequest) -> dict[str, Any]:
        opts = {**self.options, **snake_options(request.options)}
        opts.pop("stream", None)
        known = _create_params()
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = dict(opts.pop("extra_body", None) or {})
        for k, v in opts.items():
            (kw if k in known else extra)[k] = v
        if extra:
            kw["extra_body"] = extra
        return kw

    async def _open(self, request: ModelRequest) -> tuple[Any, str | None]:
        """Start a streamed completion, walking the structured-output ladder when
        the server rejects a response format."""
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
                    return stream, mode
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

        stream, mode = await self._open(request)
        if mode is not None:
            self._rf_mode = mode  # the server accepted it: start there next time
        usage: dict | None = None
        model_name = self.model
        refusal: list[str] = []   # OpenAI's ``refusal`` deltas: the model declined (structured outputs)
        filtered = False          # a ``content_filter`` stop: the provider cut the reply
        try:
            async for chunk in stream:
                if getattr(chunk, "model", None):
                    model_name = chunk.model
                if getattr(chunk, "usage", None) is not None:
                    usage = chunk.usage.model_dump(exclude_none=True)
                for choice in chunk.choices or ():
                    filtered = filtered or getattr(choice, "finish_reason", None) == "content_filter"
                    delta = choice.delta
                    if delta is None:
                        continue
                    if getattr(delta, "refusal", None):
                        refusal.append(delta.refusal)
                    thinking = getattr(delta, "reasoning_content", None) or (
                        (delta.model_extra or {}).get("reasoning_content") if delta.model_extra else None
                    )
                    if thinking:
                        yield StreamChunk(type="thinking", text=thinking)
                    if delta.content:
                        yield StreamChunk(type="text", text=delta.content)
        except openai.OpenAIError as e:
            raise self._error(e) from None
        except Exception as e:
            # httpx errors mid-stream (connection dropped, read time-out)
            if type(e).__module__.startswith(("httpx", "httpcore")):
                raise self._error(e) from None
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


def _require_openai() -> Any:
    """The ``openai`` package, or a ModelError (-32011 on the wire) naming the extra to install."""
    try:
        import openai
    except ImportError:
        raise ModelError(f"the openai provider needs the 'openai' package, which is not installed "
                         f"({INSTALL_HINT})") from None
    return openai
