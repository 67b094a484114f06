"""Small helpers shared by the providers: option names, secret redaction,
schema bounding and prompt rendering. Imports nothing heavy."""

from __future__ import annotations

import copy
import json
import logging
import math
from typing import Any, Iterable
from urllib.parse import urlsplit

from .config import INLINE_OPENED, snake

# --- option names -----------------------------------------------------------


def snake_options(options: dict[str, Any] | None) -> dict[str, Any]:
    return {snake(k): v for k, v in (options or {}).items()}


def field_value(name: str, config: dict[str, Any], key: str, default: Any, kind: Any = None) -> Any:
    """``config[key]`` converted by ``kind``; missing or null → ``default``."""
    value = config.get(key)
    if value is None:
        return default
    if kind is None:
        return value
    try:
        return kind(value)
    except (TypeError, ValueError):
        from . import ModelConfigError

        raise ModelConfigError(f"model config {name!r}: {key} must be {getattr(kind, '__name__', kind)}, not {value!r}") from None


# --- bounds -----------------------------------------------------------------

#: The longest reply (text and thinking, in characters) a provider passes on from one call: a
#: server or program that writes on and on fails the call (-32011) instead of filling memory
#: (a reply is one message, and one answer frame, the size of ``maxMessageBytes``'s default).
MAX_REPLY_CHARS = 64 * 1024 * 1024


# --- JSON-safe values ---------------------------------------------------------
# Python's json reads NaN, Infinity and 1e400 (→ inf); none of them is JSON, so a provider
# never passes one on (a message holding one could not be sent or stored): each becomes null.


def _finite_or_none(text: str) -> float | None:
    v = float(text)
    return v if math.isfinite(v) else None


def loads_json_safe(raw: str | bytes) -> Any:
    """``json.loads`` where NaN, ±Infinity and numbers too large for a float are null."""
    return json.loads(raw, parse_constant=lambda _: None, parse_float=_finite_or_none)


def json_safe(value: Any, _depth: int = 0) -> Any:
    """``value`` (parsed JSON, a provider's record) with every non-finite float replaced by
    None; containers are copied only where something changed."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if _depth > 200:
        return value
    if isinstance(value, dict):
        out = {k: json_safe(v, _depth + 1) for k, v in value.items()}
        return value if all(out[k] is value[k] for k in value) else out
    if isinstance(value, list):
        items = [json_safe(v, _depth + 1) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


# --- inline thoughts ----------------------------------------------------------
# A reasoning model that a server does not parse (llama-cpp-python's server, a GGUF run by the
# embedded model, an ``llm`` CLI) writes its thoughts into its text: ``<think>...</think>`` and
# then the reply. Those thoughts are not the reply: they are split off as ``thinking`` chunks.

#: the tags a reply may open with, each with its closing tag
THOUGHT_TAGS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("<thinking>", "</thinking>"))
_LONGEST_OPEN = max(len(o) for o, _ in THOUGHT_TAGS)
_START, _THOUGHT, _AFTER, _REPLY = range(4)


class InlineThoughts:
    """Splits the streamed text of one model call: a reply that opens (after white space) with
    ``<think>`` or ``<thinking>`` has everything up to the matching closing tag as thoughts
    (``("thinking", text)``) and the rest, its leading white space dropped, as the reply
    (``("text", text)``). Any other reply is passed on as it is, from its first visible
    character on. A tag split across deltas is recognised; only a possible tag is held back.
    ``unclosed`` is true when the call ended inside the thoughts (no reply followed them).

    ``opened``: the closing tag of thoughts the prompt itself opened (a chat template whose
    generation prompt ends with ``<think>``, as DeepSeek-R1's and QwQ's do): the text is thoughts
    from its first character, up to that tag. ``enabled=False`` (the model config's
    ``inlineThinking: false``): every delta is text, as it came."""

    __slots__ = ("_state", "_held", "_close", "_declared", "unclosed")

    def __init__(self, opened: str | None = None, enabled: bool = True, declared: bool = False) -> None:
        self._state = _REPLY if not enabled else _THOUGHT if opened else _START
        self._held = ""
        self._close = opened or ""
        self._declared = declared  # (opened because the model config says so: its error says how to undo that)
        self.unclosed = False

    @classmethod
    def of(cls, setting: bool | str, *, structured: bool = False, template: str | None = None) -> "InlineThoughts":
        """The splitter of one call. ``setting``: the model config's ``inlineThinking`` (true,
        false or ``"opened"``: the server's chat template opens the thoughts, so the reply is
        thoughts up to ``</think>``); ``template``: the closing tag of thoughts the model's own
        template opens (the embedded model reads it there). Neither opens the thoughts of a
        ``structured`` reply, which a grammar or a JSON mode holds to JSON."""
        if not setting:
            return cls(enabled=False)
        if structured:
            return cls()
        if template:
            return cls(template)
        if setting == INLINE_OPENED:
            return cls(THOUGHT_TAGS[0][1], declared=True)
        return cls()

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces of one text delta, in order: ``("thinking" | "text", text)``."""
        if self._state == _REPLY:
            return [("text", text)] if text else []
        out: list[tuple[str, str]] = []
        held = self._held + text
        self._held = ""
        if self._state == _START:
            head = held.lstrip()
            for open_tag, close_tag in THOUGHT_TAGS:
                if head.startswith(open_tag):
                    self._state, self._close = _THOUGHT, close_tag
                    held = head[len(open_tag):]
                    break
            else:
                if len(head) < _LONGEST_OPEN and any(o.startswith(head) for o, _ in THOUGHT_TAGS):
                    self._held = held  # white space or the start of a tag so far: wait
                    return out
                self._state = _REPLY
                return [("text", held)] if held else out
        if self._state == _THOUGHT:
            end = held.find(self._close)
            if end < 0:
                keep = _tag_start(held, self._close)
                if len(held) > keep:
                    out.append(("thinking", held[:len(held) - keep]))
                self._held = held[len(held) - keep:]
                return out
            if end:
                out.append(("thinking", held[:end]))
            held = held[end + len(self._close):]
            self._state = _AFTER
        held = held.lstrip()  # _AFTER: the white space between the thoughts and the reply
        if held:
            self._state = _REPLY
            out.append(("text", held))
        return out

    def end(self) -> list[tuple[str, str]]:
        """What is still held at the end of the call: a reply's first characters (that might
        have begun a tag), or the last of unclosed thoughts."""
        held, self._held = self._held, ""
        if self._state == _THOUGHT:
            self.unclosed = True
            return [("thinking", held)] if held else []
        return [("text", held)] if held and self._state == _START else []

    def check(self, name: str) -> None:
        """After :meth:`end`: a ModelError (-32011, saying so) when model ``name``'s call ended
        inside its thoughts."""
        if self.unclosed:
            from operate_sidecar.server.core.errors import ModelError

            raise ModelError(unclosed_thoughts(name, self._declared))


def opened_thought(prompt: str) -> str | None:
    """The closing tag of the thoughts a rendered prompt opens (it ends, but for white space,
    with an opening tag), else None."""
    tail = prompt.rstrip()
    for open_tag, close_tag in THOUGHT_TAGS:
        if tail.endswith(open_tag):
            return close_tag
    return None


def unclosed_thoughts(name: str, declared: bool = False) -> str:
    """The model error of a call that ended inside the model's inline thoughts (``declared``:
    the model config said its template opens them, ``inlineThinking: "opened"``)."""
    if declared:
        return (f"model {name!r}: the reply never closed the thoughts that its model config says the chat "
                'template opens ("inlineThinking": "opened": the reply is thoughts up to </think>), so no answer '
                "came after them; if the server takes the thoughts apart itself, or its template does not open "
                'them, set "inlineThinking" to true; else a larger maxTokens may let the model finish')
    return (f"model {name!r}: the reply ended inside the model's thoughts (a <think> block that was never "
            "closed), with no answer after them; a larger maxTokens may let it finish "
            '(or "inlineThinking": false keeps such text as the reply)')


def cut_at_token_limit(name: str, thinking: bool, hint: str) -> str:
    """The model error of a reply stopped at the token limit (``finish_reason`` ``"length"``)
    that cannot be used as it is: a structured reply (its JSON is not whole: repaired, it would
    run tool calls with cut-off arguments), or one with no answer at all (``thinking``: only the
    model's thoughts came). ``hint``: the provider's word on where else the limit may come from
    (docs/PROTOCOL.md §2: the same words for every provider but that)."""
    where = "before any answer (only the model's thoughts came)" if thinking else "before it was complete"
    return (f"model {name!r}: the reply was cut at the token limit (finish_reason \"length\") {where}, so none "
            f"of it is used; a larger maxTokens may let it finish {hint}")


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0 when none does)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# --- redaction --------------------------------------------------------------
# One implementation for the whole server (``server/redaction.py``): provider error texts
# get the registered secrets *and* the key-looking patterns removed.

from operate_sidecar.server import redaction as _redaction  # noqa: E402 - stdlib only

remember_secret = _redaction.remember_secret
remember_model_secrets = _redaction.remember_model_secrets


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """Remove registered secret values, ``secrets`` and anything that looks like a key/token."""
    return _redaction.redact(text, secrets, patterns=True)


def redact_cut(text: str, limit: int, more: str = "") -> str:
    """:func:`redact`, then the first ``limit`` characters (``more`` after them when there were
    more): masked before the cut (``redaction.redact_cut``)."""
    return _redaction.redact_cut(text, limit, more=more, patterns=True)


def redact_piece(text: str, *, cut_before: bool = False, cut_after: bool = False) -> str:
    """:func:`redact` for a piece of a text that was cut before it could be masked, without
    the piece of a known secret a cut left at its edge (``redaction.redact_piece``)."""
    return _redaction.redact_piece(text, cut_before=cut_before, cut_after=cut_after, patterns=True)


def masked_model(config: dict[str, Any], name: str, restored: bool = False) -> Any:
    """For a model given inline (``chatModel``) whose ``config`` holds ``[REDACTED]``
    (``redaction.masked_fields``: a branch restored after a restart, the store keeps such a
    model's secrets masked), a model that refuses every call (:class:`_Masked`), made instead of
    the provider's; else None. Its config is not checked: the mask is what is wrong with it (a
    masked ``baseUrl`` is no loopback one). ``restored``: the config was read from the store,
    which masks a known secret in any field, so the mask in any field is one; a config a client
    just sent is looked at only in the fields stored masked."""
    masked = _redaction.masked_fields(config, anywhere=restored)
    if not masked:
        return None
    remember_model_secrets(config)  # (what it still names is masked as a provider's would be: its apiKeyEnv's value)
    return _Masked(name, masked[0], config.get("provider") == "cli")


class _Masked:
    """A model whose config holds the mask where a secret was: every call raises ModelError
    (-32011) naming the first such field, before anything is sent or spawned, rather than the
    mask sent as a key or passed to a program; its branch is restored and shown as any other."""

    def __init__(self, name: str, field: str, is_cli: bool) -> None:
        self.name = name
        self.is_cli = is_cli
        self._message = (f"model {name!r}: {field} is {_redaction.MASK}: a secret of a model given inline is "
                         "stored masked, so a branch restored after a restart cannot use it; configure the model "
                         "in settings.models (a branch stores only its name) and name it")

    async def stream(self, request: Any) -> Any:
        from operate_sidecar.server.core.errors import ModelError

        raise ModelError(self._message)
        yield  # (an async generator, as a provider's ``stream`` is)

    async def invoke(self, request: Any) -> Any:
        async for _ in self.stream(request):
            pass

    async def aclose(self) -> None:
        return None


class RedactingFilter(logging.Filter):
    """A handler filter: log lines (message, arguments, traceback text) pass through
    :func:`redact` with every remembered secret. Third-party debug logs (httpx, openai)
    can print request and response headers; this keeps keys out of stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg = redact(record.getMessage())
            record.args = None
            if record.exc_info:
                text = record.exc_text or logging.Formatter().formatException(record.exc_info)
                record.exc_text = redact(text)
                record.exc_info = None
            if record.stack_info:
                record.stack_info = redact(record.stack_info)
        except Exception:  # never lose a log line to the filter
            pass
        return True


def is_loopback_url(url: str | None) -> bool:
    if not url:
        return False
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        return False
    return host in {"localhost", "::1", "ip6-localhost"} or host.startswith("127.")


# --- JSON Schema bounding (so tiny models stop) ----------------------------

_SUBSCHEMA_DICT_KEYS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _has_type(schema: dict, name: str) -> bool:
    t = schema.get("type")
    return t == name or (isinstance(t, list) and name in t)


def bound_schema(schema: dict, *, max_items: int = 3, max_length: int | None = 200) -> dict:
    """A copy of ``schema`` where every array without ``maxItems`` gets one and
    every free-form string (no enum/const/pattern/format/maxLength) gets
    ``maxLength``. Grammar-constrained small models otherwise never stop."""
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for n in node:
                walk(n)
            return
        if not isinstance(node, dict):
            return
        if _has_type(node, "array") and "maxItems" not in node:
            node["maxItems"] = max(max_items, int(node.get("minItems", 0)))
        if (
            max_length is not None
            and node.get("type") == "string"
            and not any(k in node for k in ("enum", "const", "pattern", "format", "maxLength"))
        ):
            node["maxLength"] = max(max_length, int(node.get("minLength", 0)))
        for key in _SUBSCHEMA_DICT_KEYS:
            sub = node.get(key)
            if isinstance(sub, dict):
                for v in sub.values():
                    walk(v)
        for key in _SUBSCHEMA_KEYS:
            sub = node.get(key)
            if isinstance(sub, (dict, list)):
                walk(sub)
        for key in _SUBSCHEMA_LIST_KEYS:
            sub = node.get(key)
            if isinstance(sub, list):
                walk(sub)

    walk(out)
    return out


# --- prompt rendering for CLI models ---------------------------------------

SCHEMA_INSTRUCTION = (
    "Respond with only one JSON object that validates against this JSON Schema "
    "(no prose, no code fences):"
)


def render_prompt(messages: list[dict[str, Any]], response_schema: dict | None = None) -> str:
    """Render chat messages into one prompt text: system text, then earlier
    turns as a transcript, then the current instruction (the last user message)."""
    system = [str(m.get("content") or "") for m in messages if m.get("role") == "system"]
    turns = [m for m in messages if m.get("role") != "system"]
    current = ""
    if turns and turns[-1].get("role") == "user":
        current = str(turns[-1].get("content") or "")
        turns = turns[:-1]
    parts: list[str] = []
    if any(system):
        parts.append("\n\n".join(s for s in system if s))
    if turns:
        lines = ["Conversation so far:"]
        for m in turns:
            role = str(m.get("role") or "user").capitalize()
            lines.append(f"[{role}]\n{m.get('content') or ''}")
        parts.append("\n\n".join(lines))
    if current:
        parts.append(current)
    if response_schema is not None:
        parts.append(SCHEMA_INSTRUCTION + "\n" + json.dumps(response_schema, ensure_ascii=False))
    return "\n\n".join(parts)
