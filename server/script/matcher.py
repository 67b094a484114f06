"""Matching and substitution for session scripts.

A pattern matches a value when every key it names matches recursively: objects are
subsets (keys the pattern does not name are ignored), arrays match element by element
(same length), ``"*"`` matches anything (including a missing key; ``"$*"`` is the literal
text ``*``, ``"$$*"`` the text ``$*``), and anything else must be equal (``1`` and ``1.0`` are
equal, ``true`` and ``1`` are not). :func:`first_mismatch`
returns the smallest difference: the JSON path of the first place where they part,
what was expected there and what came; :func:`mismatches` every difference, in the pattern's
order, and :func:`describe_mismatches` says them in one line.

``"${name}"`` is a saved value: a string that is exactly ``"${name}"`` becomes the saved
value itself (any JSON type); a reference inside a longer string is replaced by the
value's text. In a pattern what is substituted matches as itself: a saved ``"*"`` (or a
text made with it) is the text ``*``, not a pattern. ``$${`` is a literal ``${`` (as in docker-compose): ``"$${HOME}"`` is the text
``${HOME}``; :func:`escape` turns any text into the string that substitutes back to it.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

ANY = "*"
#: a pattern's literal ``"*"``: ``"$*"`` (and ``"$$*"`` the text ``$*``: one ``$`` fewer, as ``$${`` is ``${``)
_ESCAPED_ANY = re.compile(r"\$+\*")
_MISSING = object()
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.-]*)\}")
#: ``$${`` (a literal ``${``) or a reference, scanned left to right
_ESCAPED_OR_REF = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_.-]*)\}")
#: how many differences :func:`describe_mismatches` names (then "and N more")
SHOWN_MISMATCHES = 5


@dataclass(frozen=True)
class Mismatch:
    path: str          # JSON path of the first difference, e.g. ``$.result.branches[0].name``
    expected: Any
    got: Any           # ``MISSING`` when the key is absent
    why: str = ""

    def describe(self, limit: int = 160) -> str:
        """``at PATH: expected X, got Y`` (each value at most ``limit`` characters; two long values
        cut around the first character where they differ, so the difference shows)."""
        if self.got is _MISSING or self.expected is _MISSING:
            got = "(missing)" if self.got is _MISSING else short(self.got, limit)
            expected = "(nothing)" if self.expected is _MISSING else short(self.expected, limit)  # an extra item
        else:
            expected, got = short_pair(self.expected, self.got, limit)
        text = f"at {self.path}: expected {expected}, got {got}"
        return f"{text} ({self.why})" if self.why else text


MISSING = _MISSING


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def short(value: Any, limit: int = 160) -> str:
    text = _json_text(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def short_pair(expected: Any, got: Any, limit: int = 160) -> tuple[str, str]:
    """Two values that differ, each at most ``limit`` characters: cut from their start only when
    the first difference shows so; else both around the first character where they part (``…``
    on either side), since two long texts cut alike would read as equal."""
    a, b = _json_text(expected), _json_text(got)
    if len(a) <= limit and len(b) <= limit:
        return a, b
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if same < limit - 1 - limit // 4:  # the difference is within what a cut from the start shows
        return short(expected, limit), short(got, limit)
    start = same - limit // 4  # a quarter of the window before the difference, the rest after it

    def window(text: str) -> str:
        body = text[start + 1:start + limit - 1]
        return "…" + body + ("…" if start + limit - 1 < len(text) else text[start + limit - 1:])

    return window(a), window(b)


def did_you_mean(word: Any, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` a misspelt name is closest to (``expcet``: ``expect``), if any is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def misspelt(name: Any, known: Iterable[str]) -> str:
    """An unknown name, with the known one it is closest to: ``expcet (did you mean expect?)``."""
    meant = did_you_mean(name, known)
    return f"{name} (did you mean {meant}?)" if meant else str(name)


def _key_path(path: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$]*", key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _a(v: Any) -> str:
    """``v``'s JSON type with its article, as a difference names it: ``an object``, ``a string``, ``null``."""
    kind = _type(v)
    return kind if kind == "null" else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def mismatches(pattern: Any, value: Any, path: str = "$") -> Iterator[Mismatch]:
    """Every difference between ``pattern`` and ``value``, in the pattern's order (an object's keys
    as the pattern names them, an array's items by index; of arrays of different lengths, the
    items they share, then the first extra or missing one); none when the pattern matches."""
    if isinstance(pattern, str) and pattern == ANY:
        return
    pattern = literal(pattern)
    if value is _MISSING:
        yield Mismatch(path, pattern, _MISSING)
    elif isinstance(pattern, dict):
        if not isinstance(value, dict):
            yield Mismatch(path, pattern, value, f"expected an object, got {_a(value)}")
            return
        for key, sub in pattern.items():
            yield from mismatches(sub, value.get(key, _MISSING), _key_path(path, key))
    elif isinstance(pattern, list):
        if not isinstance(value, list):
            yield Mismatch(path, pattern, value, f"expected an array, got {_a(value)}")
            return
        for i, (sub, item) in enumerate(zip(pattern, value)):
            yield from mismatches(sub, item, f"{path}[{i}]")
        if len(pattern) != len(value):
            i = min(len(pattern), len(value))
            why = f"expected {len(pattern)} items, got {len(value)}"
            if len(value) > len(pattern):
                yield Mismatch(f"{path}[{i}]", _MISSING, value[i], why)
            else:
                yield Mismatch(f"{path}[{i}]", pattern[i], _MISSING, why)
    elif _type(pattern) != _type(value):
        yield Mismatch(path, pattern, value, f"expected {_a(pattern)}, got {_a(value)}")
    elif pattern != value:
        yield Mismatch(path, pattern, value)


def first_mismatch(pattern: Any, value: Any, path: str = "$") -> Mismatch | None:
    """``None`` when ``pattern`` matches ``value``, else the first difference."""
    return next(mismatches(pattern, value, path), None)


def describe_mismatches(found: list[Mismatch], shown: int = SHOWN_MISMATCHES) -> str:
    """Differences in one line: one as :meth:`Mismatch.describe` says it; several counted, the
    first ``shown`` of them (their values shorter), then how many more."""
    if len(found) == 1:
        return found[0].describe()
    more = len(found) - shown
    return (f"{len(found)} differences: " + "; ".join(m.describe(60) for m in found[:shown])
            + (f"; and {more} more" if more > 0 else ""))


def nearest(misses: list[tuple[int, Mismatch]], pattern: Any = None, values: Any = None) -> tuple[int, Mismatch]:
    """Of ``(index, mismatch)`` pairs, the candidate that matched most: with ``pattern`` and
    ``values`` (index -> the value the pattern was held to), the one with the fewest differences
    (one wrong value of many that match is nearer than two), then the one that matched deepest
    before parting, then the latest of equals."""
    def differences(i: int) -> int:
        if pattern is None or values is None:
            return 0
        return sum(1 for _ in mismatches(pattern, values[i], "$.params"))

    return min(misses, key=lambda t: (differences(t[0]), -(t[1].path.count(".") + t[1].path.count("[")), -t[0]))


def notification_miss(pattern: Any, arrived: list[tuple[Any, int | None]],
                      takers: tuple[str, str] = ("an earlier step", "earlier steps")) -> str:
    """What came instead of a notification whose params match ``pattern`` (``None``: any), for a
    wait that timed out: ``arrived`` holds the params of every notification of that method so far,
    each with the line of the step that took it (``0``: taken by an earlier wait of no line;
    ``None``: not taken). The nearest of those not taken (its first mismatch), and those an
    earlier wait took (their lines); ``""`` when none arrived."""
    if not arrived:
        return ""

    def by(taken: list[int]) -> str:  # "earlier steps (lines 4, 6)"
        named = sorted({n for n in taken if n})
        lines = f" (line{'s' if len(named) > 1 else ''} {', '.join(map(str, named))})" if named else ""
        return takers[len(taken) > 1] + lines

    misses = [(i, first_mismatch(pattern, p, "$.params") if pattern is not None else None)
              for i, (p, _) in enumerate(arrived)]
    free = [(i, mm) for i, mm in misses if arrived[i][1] is None and mm is not None]
    taken_matching = [arrived[i][1] or 0 for i, mm in misses if arrived[i][1] is not None and mm is None]
    parts = []
    values = {i: p for i, (p, _) in enumerate(arrived)}
    if free:
        i, mm = nearest(free, pattern, values)
        parts.append(f"{len(free)} unmatched, nearest {mm.describe()}")
    if len(taken_matching) == len(arrived):
        parts.append(f"{len(arrived)} arrived, {'all ' if len(arrived) > 1 else ''}matched by {by(taken_matching)}")
    elif taken_matching:
        n = len(taken_matching)
        parts.append(f"{n} that match{'es' if n == 1 else ''} arrived but {'was' if n == 1 else 'were'} matched by "
                     f"{by(taken_matching)}")
    elif not free:  # all taken, none of them matches: the nearest of them
        i, mm = nearest([(i, mm) for i, mm in misses if mm is not None], pattern, values)
        taken = [line or 0 for _, line in arrived]
        parts.append(f"{len(arrived)} arrived, {'all ' if len(arrived) > 1 else ''}matched by {by(taken)}; "
                     f"nearest {mm.describe()}")
    return "; ".join(parts)


def matches(pattern: Any, value: Any) -> bool:
    return first_mismatch(pattern, value) is None


class UnknownName(KeyError):
    def __str__(self) -> str:
        return f"${{{self.args[0]}}} was never saved"


def escape(text: str) -> str:
    """``text`` as it is written in a script: every literal ``${`` as ``$${`` (so that
    :func:`substitute` gives ``text`` back, an original ``$${`` included)."""
    return text.replace("${", "$${")


def escape_pattern(text: str) -> str:
    """A string as a pattern writes it so that it matches that text only: ``"*"`` (else any
    value) as ``"$*"``, and a string that is ``$``s then ``*`` with one ``$`` more; any literal
    ``${`` as :func:`escape` writes it."""
    return "$" + text if text == ANY or _ESCAPED_ANY.fullmatch(text) else escape(text)


def literal(pattern: Any) -> Any:
    """The text a pattern's string stands for: ``"$*"`` is the text ``*`` (a ``"*"`` matches
    anything), ``"$$*"`` the text ``$*``; any other value as it is."""
    if isinstance(pattern, str) and _ESCAPED_ANY.fullmatch(pattern):
        return pattern[1:]
    return pattern


def is_name(name: Any) -> bool:
    """Whether ``${name}`` refers to ``name`` (a name ``save`` may give)."""
    return isinstance(name, str) and _REF.fullmatch("${%s}" % name) is not None


def whole_reference(value: Any) -> bool:
    """Whether ``value`` is a string that is exactly ``"${name}"`` (substituted by the value itself, any JSON type)."""
    return isinstance(value, str) and _REF.fullmatch(value) is not None


def references(value: Any) -> set[str]:
    """The names ``value`` refers to (``${name}``, not the literal ``$${``), in its values at any depth."""
    if isinstance(value, str):
        return {m.group(1) for m in _ESCAPED_OR_REF.finditer(value) if m.group(1) is not None}
    if isinstance(value, dict):
        return set().union(*map(references, value.values()))
    if isinstance(value, list):
        return set().union(*map(references, value))
    return set()


def substitute(value: Any, saved: dict[str, Any], pattern: bool = False) -> Any:
    """``value`` with every ``${name}`` replaced by ``saved[name]`` and every ``$${`` by a
    literal ``${``. In a ``pattern`` (an ``expect``, a ``match``) what is substituted matches
    as itself (:func:`as_pattern`): a saved ``"*"`` is the text ``*``, not a pattern that
    matches anything."""
    if isinstance(value, str):
        m = _REF.fullmatch(value)
        if m:
            if m.group(1) not in saved:
                raise UnknownName(m.group(1))
            return as_pattern(saved[m.group(1)]) if pattern else saved[m.group(1)]

        def text(m: re.Match) -> str:
            if m.group(1) is None:  # $${
                return "${"
            if m.group(1) not in saved:
                raise UnknownName(m.group(1))
            v = saved[m.group(1)]
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        if "${" not in value:
            return value
        out = _ESCAPED_OR_REF.sub(text, value)
        # a text made with a saved value is that text (a written "$*" with no reference stays a pattern's)
        return as_pattern(out) if pattern and references(value) else out
    if isinstance(value, dict):
        return {k: substitute(v, saved, pattern) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, saved, pattern) for v in value]
    return value


def as_pattern(value: Any) -> Any:
    """``value`` (substituted: no ``${`` left to read) as a pattern that matches it as it is:
    each string a pattern reads otherwise, ``"*"`` (anything) and ``"$*"`` (the text ``*``),
    written with one ``$`` more, at any depth."""
    if isinstance(value, str):
        return "$" + value if value == ANY or _ESCAPED_ANY.fullmatch(value) else value
    if isinstance(value, dict):
        return {k: as_pattern(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_pattern(v) for v in value]
    return value


class PathError(LookupError):
    pass


def get_path(value: Any, path: str) -> Any:
    """The value at a dotted path (``branches.0.branchId``; ``""`` or ``"$"`` is the whole
    value; a leading ``$.`` is allowed). Raises :class:`PathError` naming the missing part."""
    if path in ("", "$"):
        return value
    if path.startswith("$."):
        path = path[2:]
    cur = value
    walked = "$"
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
            walked = _key_path(walked, part)
        elif isinstance(cur, list) and re.fullmatch(r"-?\d+", part) and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
            walked = f"{walked}[{part}]"
        else:
            raise PathError(f"{walked} has no {part!r} (it is {short(cur, 80)})")
    return cur
