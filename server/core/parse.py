"""Turning a model reply into the requested structure.

First attempt without any model call: extract JSON (whole text, fenced blocks,
the first balanced object in prose, then json-repair), match keys fuzzily
(rapidfuzz Jaro-Winkler), drop runtime-only keys the request model excludes
(invented ``action_responses``), validate. On failure, a repair loop asks the
parse model to reformat, under the ParseParam's AlcallParams (defaults of docs/PIPELINE.md D1:
3 retries, delays 1 s × 1.85ⁿ). It gives up with the ParseParam's policy.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from ..redaction import redact_cut
from . import progress
from .errors import ParseError
from .imodel import ModelRequest, model_deadline
from .operative import request_info
from .params import FuzzyMatchKeysParams, ParseParam
from .render import render_repair_request
from .tools import off_the_loop

#: a reply longer than this holds no JSON for the pipeline (docs/PIPELINE.md, D3): twice the
#: 10 MiB of new text a write_file may carry (JSON writes a newline, a tab, a quote or a
#: backslash as two characters), and 1 MiB for the rest of the reply; at 10,000,000 a reply
#: with a 10 MiB write_file was never extracted. Cutting it instead would make valid JSON
#: invalid and hand megabytes to the repair
MAX_EXTRACT_CHARS = 21 * 1024 * 1024
#: json-repair is pure Python (~8 µs a character on a cut-off string): a candidate longer than
#: this is not repaired, and the candidates of one reply get this many characters together
#: (valid JSON of any size up to the cap is still parsed, by the C parser)
MAX_REPAIR_CHARS = 256 * 1024
_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)


class UnparsedResponse(str):
    """A reply that could not be parsed: the text, with why (``failure_kind``
    is ``extraction`` or ``validation``) and the validation error, if any."""

    failure_kind: str
    validation_error: Any

    def __new__(cls, text: str, failure_kind: str = "extraction", validation_error: Any = None):  # type: ignore[no-untyped-def]
        obj = super().__new__(cls, text)
        obj.failure_kind = failure_kind
        obj.validation_error = validation_error
        return obj

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (UnparsedResponse, (str(self), self.failure_kind, None))

    def __copy__(self):  # type: ignore[no-untyped-def]
        return UnparsedResponse(str(self), self.failure_kind, self.validation_error)

    def __deepcopy__(self, memo):  # type: ignore[no-untyped-def]
        return self.__copy__()


#: how many top-level bracketed spans of a reply are tried as JSON (and offered to the repair):
#: a reply of millions of ``[x]`` is not millions of parse attempts
MAX_SPANS = 1000
#: characters one regular-expression call of the scan looks at: a call holds the GIL, so on a
#: worker thread the event loop still gets its turn every few milliseconds
SCAN_CHUNK = 64 * 1024
_OPEN = re.compile(r"[{\[]")
_INNER = re.compile(r'[{}\[\]"]')
_OPENERS = re.compile(r"[{\[]+")
_CLOSERS = re.compile(r"[}\]]+")
#: a JSON string's characters up to its closing quote (or a backslash at the chunk's end)
_STRING_PART = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)


def _search(pattern: re.Pattern[str], text: str, pos: int) -> int:
    """The index of ``pattern``'s next match from ``pos``, or -1; a chunk per call."""
    n = len(text)
    while pos < n:
        end = min(n, pos + SCAN_CHUNK)
        m = pattern.search(text, pos, end)
        if m is not None:
            return m.start()
        pos = end
    return -1


def _run_end(pattern: re.Pattern[str], text: str, pos: int) -> int:
    """Where the run of ``pattern`` (a one-character class repeated) starting at ``pos`` ends."""
    n = len(text)
    while pos < n:
        end = min(n, pos + SCAN_CHUNK)
        m = pattern.match(text, pos, end)
        if m is None:
            break
        pos = m.end()
        if pos < end:
            break
    return pos


def _string_end(text: str, pos: int) -> int:
    """Given ``pos`` just after a string's opening quote: just after its closing quote, or -1
    for a string never closed."""
    n = len(text)
    while pos < n:
        end = min(n, pos + SCAN_CHUNK)
        pos = _STRING_PART.match(text, pos, end).end()  # type: ignore[union-attr]
        if pos == end:
            continue
        if text[pos] == '"':
            return pos + 1
        pos += 2  # a backslash the chunk cut from what it escapes
    return -1


def _balanced_objects(text: str, limit: int = MAX_SPANS) -> list[str]:
    """The first ``limit`` top-level balanced ``{...}`` or ``[...]`` spans, string-aware.
    Linear, and the characters between brackets and quotes are skipped by regular expressions
    (a character-by-character scan of a 10 MB reply took about a second)."""
    spans: list[str] = []
    depth = 0
    start = -1
    opener = ""
    pos = 0
    while len(spans) < limit:
        # outside any span a quote is prose: only an opener starts one
        pos = _search(_OPEN if depth == 0 else _INNER, text, pos)
        if pos < 0:
            break
        ch = text[pos]
        if depth == 0:
            start, opener = pos, ch
        if ch == '"':
            pos = _string_end(text, pos + 1)
            if pos < 0:  # a string never closed: no span ends after it
                break
        elif ch in "{[":  # a run of openers at once (5 million '[' are one step, not 5 million)
            end = _run_end(_OPENERS, text, pos)
            depth += end - pos
            pos = end
        else:
            end = _run_end(_CLOSERS, text, pos)
            if end - pos < depth:
                depth -= end - pos
                pos = end
            else:  # the span's closer is in this run
                pos += depth
                depth = 0
                if (opener == "{") == (text[pos - 1] == "}"):
                    spans.append(text[start: pos])
    return spans


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except (ValueError, TypeError, RecursionError):  # nested deeper than the parser goes: not JSON here
        return None


def extract_json(text: Any) -> Any:
    """The first JSON value found in ``text`` (dicts preferred), or None."""
    if isinstance(text, (dict, list)):
        return text
    if not isinstance(text, str):
        return None
    if len(text) > MAX_EXTRACT_CHARS:
        return None
    stripped = text.strip()
    if not stripped:
        return None
    value = _loads(stripped)
    if isinstance(value, (dict, list)):
        return value
    blocks = [b.strip() for b in _FENCE.findall(text)]
    for block in blocks:
        value = _loads(block)
        if isinstance(value, (dict, list)):
            return value
    spans = _balanced_objects(text)
    for span in spans:
        value = _loads(span)
        if isinstance(value, (dict, list)):
            return value
    candidates = [c for c in blocks + spans + [stripped] if len(c) <= MAX_REPAIR_CHARS]
    if not candidates:
        return None
    from json_repair import repair_json

    budget = MAX_REPAIR_CHARS  # for all the candidates together: a thousand broken spans are not a minute
    for cand in candidates:
        if len(cand) > budget:
            continue
        budget -= len(cand)
        try:
            value = repair_json(cand, return_objects=True)
        except Exception:
            continue
        if isinstance(value, (dict, list)) and value:
            return value
    return None


def fuzzy_match_keys(data: dict[str, Any], keys: list[str], params: FuzzyMatchKeysParams | None) -> dict[str, Any]:
    params = params or FuzzyMatchKeysParams(handle_unmatched="force")
    wanted = set(keys)
    out: dict[str, Any] = {}
    unmatched: list[str] = []
    for k, v in data.items():
        if k in wanted:
            out[k] = v
        else:
            unmatched.append(k)
    if unmatched:
        from rapidfuzz.distance import JaroWinkler

        free = [k for k in keys if k not in out]
        for k in unmatched:
            best, score = None, 0.0
            lk = k.lower()
            for cand in free:
                s = JaroWinkler.normalized_similarity(lk, cand.lower())
                if s > score:
                    best, score = cand, s
            if best is not None and score >= params.similarity_threshold:
                out[best] = data[k]
                free.remove(best)
            elif params.handle_unmatched == "ignore":
                out[k] = data[k]
            elif params.handle_unmatched == "raise":
                raise ParseError(f"unmatched key {k!r}", kind="validation")
    if params.handle_unmatched == "force":
        for k in keys:
            out.setdefault(k, None)
    return out


def _first_mapping(value: Any) -> Any:
    while isinstance(value, list) and value:
        value = value[0]
    return value


def validate_into(text: Any, response_format: Any, fuzzy: FuzzyMatchKeysParams | None) -> Any:
    """One no-model attempt. Raises ParseError(kind=extraction|validation)."""
    data = _first_mapping(extract_json(text))
    if not isinstance(data, dict):
        raise ParseError("no JSON object found in the reply", kind="extraction")
    if isinstance(response_format, type) and issubclass(response_format, BaseModel):
        info = request_info(response_format)
        if info is not None:
            for k in info[1]:
                data.pop(k, None)  # runtime-only fields are never taken from the model
        keys = list(response_format.model_fields)
        data = fuzzy_match_keys(data, keys, fuzzy)
        if info is not None:
            for k in info[1]:
                data.pop(k, None)
        try:
            return response_format.model_validate(data)
        except ValidationError as e:
            raise ParseError(str(e), kind="validation", validation_error=e) from None
    return data


#: a reply longer than this is parsed on a worker thread (a shorter one inline: the common case
#: pays no thread hop); scanning, parsing and repairing megabytes held the event loop, ping and
#: cancel included, for as long as it took
INLINE_PARSE_CHARS = 32 * 1024


async def _validate(text: Any, response_format: Any, fuzzy: FuzzyMatchKeysParams | None) -> Any:
    """``validate_into``, on a worker thread for a long reply."""
    return await off_the_loop(isinstance(text, str) and len(text) > INLINE_PARSE_CHARS,
                              validate_into, text, response_format, fuzzy)


REFORMAT_GUIDANCE = "follow the required response format, using the model schema as a guide"


async def parse(branch: Any, text: Any, parse_param: ParseParam, history: Callable[[], Any] | None = None) -> Any:
    """Parse ``text`` into ``parse_param.response_format`` with repair turns. A repair turn is
    shown the branch's conversation, or, when ``history`` is given, what it returns instead (the
    branch with the instruction and reply a Middle records only once this parse is over): it is
    called once, at the first repair turn, and every repair turn is shown the same."""
    fmt = parse_param.response_format
    fuzzy = parse_param.fuzzy_match_params
    progress.report("parsing reply", "parse")
    try:
        return await _validate(text, fmt, fuzzy)
    except ParseError as e:
        last: ParseError = e

    alc = parse_param.alcall_params
    model = parse_param.imodel or getattr(branch, "parse_model", None)
    if alc is not None and model is not None:

        attempt = [0]
        shown: list[Any] = []  # what the repair turns render as the conversation (made once)

        async def repair(_: Any) -> Any:
            nonlocal last
            n = attempt[0]
            attempt[0] += 1
            guidance = REFORMAT_GUIDANCE
            if n >= 1:
                err = redact_cut(str(last), 800, more="…(truncated)")  # (masked before the cut: docs/SECURITY.md G6)
                guidance += (f" The previous attempt did not validate: {err}. Correct exactly what that error names"
                             " — every field it reports must carry a value of the required type.")
            if n >= 2:
                guidance += (f" This is attempt {n + 1}; earlier attempts failed. Return only the JSON object,"
                             " with no text before or after it.")
            if not shown:
                shown.append(history() if history is not None else branch)
            request: ModelRequest = render_repair_request(shown[0], str(text), fmt, guidance, parse_param.imodel_kw)
            progress.report(f"{progress.REPAIR_ATTEMPT} {n + 1}", "parse")
            with model_deadline(model):
                reply = await model.invoke(request)
            try:
                return await _validate(reply.text, fmt, fuzzy)
            except ParseError as pe:
                last = pe
                raise

        try:
            out = await alc([0], repair)
            return out[0]
        except ParseError as pe:
            last = pe
        except Exception as exc:  # a failing parse model degrades like a failed parse
            last = ParseError(f"repair failed: {exc}", kind=last.kind, validation_error=last.validation_error)

    policy = parse_param.handle_validation
    if policy == "raise":
        raise ParseError(f"Failed to parse response: {last}", kind=last.kind, validation_error=last.validation_error)
    if policy == "return_none":
        return None
    return UnparsedResponse(str(text), last.kind, last.validation_error)
