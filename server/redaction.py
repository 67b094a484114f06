"""Secret redaction: the one place that knows which values are secret.

Secret *values* are registered with :func:`remember_secret` (the sidecar registers the
environment variables named by every model's ``apiKeyEnv`` and by the ``secretEnv``
setting at start and at ``initialize``). :func:`redact` removes every registered value
(and, with ``patterns=True``, anything that looks like a key or a bearer token) from a
text; :func:`redact_value` does the same through a JSON-like value. The server applies
them wherever it emits or stores text, always *before* any truncation, so a cut can
never leave part of a key behind. Imports nothing but the standard library.

A registered value is masked as written and in the forms a text commonly carries it in:
JSON-escaped, URL-encoded (``quote`` and ``quote_plus``) and base64 (standard and URL-safe,
at any of the three byte alignments, so a key inside ``base64("user:" + key)`` of a Basic
``Authorization`` header is masked too; the one or two characters at each edge that mix
with the neighbouring bytes stay). Values shorter than :data:`MIN_SECRET_CHARS` are not
registered: masking them would garble ordinary text.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any, Iterable

MASK = "[REDACTED]"
MIN_SECRET_CHARS = _MIN_LEN = 4
_MIN_B64 = 16  # a base64 form shorter than this could occur by chance in an unrelated blob

_KNOWN: set[str] = set()
_ORDERED: tuple[str, ...] = ()   # longest first, so a key containing another is masked whole

_PATTERNS = (
    (re.compile(r"\bsk-[A-Za-z0-9_\-\*\.]{4,}"), lambda m: MASK),            # OpenAI-style keys
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9_\-\.=:/+]{6,}"), lambda m: "Bearer " + MASK),
    (re.compile(r"(?i)(api[_-]?key['\"]?\s*[:=]\s*['\"]?)[^\s'\",}]{6,}"), lambda m: m.group(1) + MASK),
    (re.compile(r"(?i)(://)[^/@\s:]+:[^/@\s]+@"), lambda m: m.group(1) + MASK + "@"),  # user:password@
)


#: an environment variable (``mcpServers.*.env``, a CLI model's ``env``) whose name says it holds a secret
SECRET_ENV_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)


def secret_env_values(env: Any) -> list[str]:
    """The values of an ``env`` object (an MCP server's, a CLI model's) whose names say they are
    secret (``SECRET_ENV_NAME``); not every value: masking ``debug`` or ``1`` would garble text."""
    if not isinstance(env, dict):
        return []
    return [v for k, v in env.items() if isinstance(k, str) and isinstance(v, str) and SECRET_ENV_NAME.search(k)]


def remember_secret(value: str | None) -> None:
    """Register a secret value; every later :func:`redact` removes it."""
    global _ORDERED
    if isinstance(value, str) and len(value) >= _MIN_LEN and value not in _KNOWN:
        _KNOWN.add(value)
        _ORDERED = tuple(sorted(_KNOWN, key=len, reverse=True))


def known_secrets() -> tuple[str, ...]:
    return _ORDERED


def has_secrets() -> bool:
    return bool(_ORDERED)


def redact(text: Any, secrets: Iterable[str | None] = (), *, patterns: bool = False) -> str:
    """``text`` with every registered secret (and ``secrets``) replaced by ``[REDACTED]``;
    with ``patterns``, key-looking tokens too (for error texts from providers)."""
    out = text if isinstance(text, str) else str(text)
    extra = [s for s in secrets if isinstance(s, str) and len(s) >= _MIN_LEN and s not in _KNOWN]
    forms = _text_forms_of(extra) + _known_text_forms() if extra else _known_text_forms()
    for f in forms:
        if f in out:
            out = out.replace(f, MASK)
    if patterns:
        for rx, repl in _PATTERNS:
            out = rx.sub(repl, out)
    return out


def redact_value(value: Any) -> Any:
    """``value`` (a JSON-like structure) with every registered secret redacted in every
    string, keys included. Returns ``value`` itself when nothing is registered or found."""
    if not _ORDERED:
        return value
    return _walk(value, 0)


def _walk(v: Any, depth: int) -> Any:
    if isinstance(v, str):
        return redact(v) if any(f in v for f in _known_text_forms()) else v
    if depth > 200:
        return v
    # a container is copied only when a secret was found in it: with a key configured, every tool
    # output passes here, and one with nothing to hide is kept as it is (not copied whole)
    if isinstance(v, dict):
        pairs = [((_walk(k, depth + 1) if isinstance(k, str) else k), _walk(x, depth + 1)) for k, x in v.items()]
        if all(k2 is k and x2 is x for (k2, x2), (k, x) in zip(pairs, v.items())):
            return v
        return dict(pairs)
    if isinstance(v, (list, tuple)):
        items = [_walk(x, depth + 1) for x in v]
        return v if all(a is b for a, b in zip(items, v)) else items
    return v


def redact_bytes(data: bytes) -> bytes:
    """A UTF-8/JSON byte string with every registered secret masked (the last net before
    the wire): the value in every form :func:`redact` knows, and as JSON escapes each."""
    if not _ORDERED:
        return data
    for form in _known_byte_forms():
        if form in data:
            data = data.replace(form, MASK.encode())
    return data


class StreamRedactor:
    """Redacts a text that arrives in pieces (a model's streamed reply), so a secret split
    across pieces is masked too. :meth:`feed` returns what is pending plus the new piece,
    redacted, but for the shortest end that could still begin a registered secret (in any of
    its forms) or that a secret found in the text runs into: that end waits, as written, for
    the next piece. :meth:`flush` returns it, redacted, once the text has ended. With no
    secret registered, ``feed`` returns each piece as it came."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = ""

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def feed(self, piece: str) -> str:
        if not _ORDERED and not self._pending:
            return piece
        text = self._pending + piece
        cut = _safe_cut(text, _known_text_forms())
        self._pending = text[cut:]
        return redact(text[:cut]) if cut else ""

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return redact(rest) if rest else rest


def _safe_cut(text: str, forms: tuple[str, ...]) -> int:
    """Where ``text`` can be cut so that what is before the cut can be redacted alone: before
    its longest end that is a proper beginning of one of ``forms`` (what may still become a
    secret with what comes next), and before any form found in the text that runs across
    that point (one secret can end inside another, or begin inside another's beginning)."""
    if not forms or not text:
        return len(text)
    cut = len(text)
    firsts = {f[0] for f in forms}
    for i in range(max(0, len(text) - len(forms[0]) + 1), len(text)):  # forms are longest first
        if text[i] in firsts:
            tail = text[i:]
            if any(len(f) > len(tail) and f.startswith(tail) for f in forms):
                cut = i
                break
    moved = cut < len(text)
    while moved:
        moved = False
        for f in forms:
            i = text.find(f, max(0, cut - len(f) + 1))
            if i != -1 and i < cut:  # it starts before the cut and ends after it
                cut, moved = i, True
    return cut


# the forms of the registered secrets, longest first, computed once per set of secrets
# (keyed by the ``_ORDERED`` tuple itself, so restoring it restores them too)
_TEXT_CACHE: tuple[Any, tuple[str, ...]] = (None, ())
_BYTE_CACHE: tuple[Any, tuple[bytes, ...]] = (None, ())


def _known_text_forms() -> tuple[str, ...]:
    global _TEXT_CACHE
    key, forms = _TEXT_CACHE
    if key is not _ORDERED:
        forms = _text_forms_of(_ORDERED)
        _TEXT_CACHE = (_ORDERED, forms)
    return forms


def _known_byte_forms() -> tuple[bytes, ...]:
    global _BYTE_CACHE
    key, forms = _BYTE_CACHE
    if key is not _ORDERED:
        out: dict[bytes, None] = {}
        for f in _known_text_forms():
            out[f.encode("utf-8", "surrogatepass")] = None
            for esc in (json.dumps(f, ensure_ascii=False)[1:-1], json.dumps(f)[1:-1]):
                out[esc.encode("utf-8", "surrogatepass")] = None
        forms = tuple(sorted(out, key=len, reverse=True))
        _BYTE_CACHE = (_ORDERED, forms)
    return forms


def _text_forms_of(secrets: Iterable[str]) -> tuple[str, ...]:
    out: dict[str, None] = {}
    for s in secrets:
        out.update(dict.fromkeys(_forms(s)))
    return tuple(sorted(out, key=len, reverse=True))


def _forms(s: str) -> tuple[str, ...]:
    """``s`` as written, JSON-escaped, URL-encoded and base64-encoded (see the module)."""
    from urllib.parse import quote, quote_plus  # here: urllib.parse (and ipaddress) cost ~1.6 ms at start

    try:
        raw = s.encode("utf-8", "surrogateescape")  # the bytes of an environment value
    except UnicodeEncodeError:
        raw = s.encode("utf-8", "surrogatepass")
    forms = [s, json.dumps(s, ensure_ascii=False)[1:-1], json.dumps(s)[1:-1],
             quote(raw, safe=""), quote(raw, safe="/"), quote_plus(raw, safe="")]
    for shift in range(3):  # where the value starts within a 3-byte base64 group
        enc = base64.b64encode(b"\0" * shift + raw).decode("ascii")
        first, end = -(-shift // 3), (shift + len(raw)) // 3  # the groups made of the value's bytes only
        core = enc[4 * first:4 * end]
        if len(core) >= _MIN_B64:
            forms += [core, core.replace("+", "-").replace("/", "_")]
    return tuple(dict.fromkeys(f for f in forms if len(f) >= _MIN_LEN))


__all__ = ["MASK", "MIN_SECRET_CHARS", "StreamRedactor", "remember_secret", "known_secrets", "has_secrets", "redact",
           "redact_value", "redact_bytes"]
