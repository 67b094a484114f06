"""Secret redaction: the one place that knows which values are secret.

Secret *values* are registered with :func:`remember_secret` (the sidecar registers the
environment variables named by every model's ``apiKeyEnv`` and by the ``secretEnv``
setting at start and at ``initialize``). :func:`redact` removes every registered value
(and, with ``patterns=True``, anything that looks like a key or a bearer token) from a
text; :func:`redact_value` does the same through a JSON-like value. The server applies
them wherever it emits or stores text, always *before* any truncation, so a cut can
never leave part of a key behind. Imports nothing but the standard library.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

MASK = "[REDACTED]"
_MIN_LEN = 4

_KNOWN: set[str] = set()
_ORDERED: tuple[str, ...] = ()   # longest first, so a key containing another is masked whole

_PATTERNS = (
    (re.compile(r"\bsk-[A-Za-z0-9_\-\*\.]{4,}"), lambda m: MASK),            # OpenAI-style keys
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9_\-\.=:/+]{6,}"), lambda m: "Bearer " + MASK),
    (re.compile(r"(?i)(api[_-]?key['\"]?\s*[:=]\s*['\"]?)[^\s'\",}]{6,}"), lambda m: m.group(1) + MASK),
    (re.compile(r"(?i)(://)[^/@\s:]+:[^/@\s]+@"), lambda m: m.group(1) + MASK + "@"),  # user:password@
)


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
    for s in (*sorted(extra, key=len, reverse=True), *_ORDERED):
        if s in out:
            out = out.replace(s, MASK)
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
        return redact(v) if any(s in v for s in _ORDERED) else v
    if depth > 200:
        return v
    if isinstance(v, dict):
        return {(_walk(k, depth + 1) if isinstance(k, str) else k): _walk(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_walk(x, depth + 1) for x in v]
    return v


def redact_bytes(data: bytes) -> bytes:
    """A UTF-8/JSON byte string with every registered secret masked (the last net before
    the wire): the value as written raw and as JSON escapes it."""
    if not _ORDERED:
        return data
    for s in _ORDERED:
        for form in _forms(s):
            if form in data:
                data = data.replace(form, MASK.encode())
    return data


_FORM_CACHE: dict[str, tuple[bytes, ...]] = {}


def _forms(s: str) -> tuple[bytes, ...]:
    forms = _FORM_CACHE.get(s)
    if forms is None:
        import json

        raw = s.encode("utf-8", "surrogatepass")
        esc = json.dumps(s, ensure_ascii=False)[1:-1].encode("utf-8", "surrogatepass")
        asc = json.dumps(s, ensure_ascii=True)[1:-1].encode("ascii")
        forms = tuple(dict.fromkeys((raw, esc, asc)))
        _FORM_CACHE[s] = forms
    return forms


__all__ = ["MASK", "remember_secret", "known_secrets", "has_secrets", "redact", "redact_value", "redact_bytes"]
