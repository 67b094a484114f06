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
from typing import Any

from pydantic import BaseModel, ValidationError

from . import progress
from .errors import ParseError
from .imodel import ModelRequest, model_deadline
from .operative import request_info
from .params import FuzzyMatchKeysParams, ParseParam
from .render import render_repair_request

#: a reply longer than this holds no JSON for the pipeline (a 10 MB cap, docs/PIPELINE.md); cutting
#: it instead would make valid JSON invalid and hand megabytes to the repair
MAX_EXTRACT_CHARS = 10_000_000
#: json-repair is pure Python (~2 µs a character on a cut-off string) and runs on the event
#: loop: a candidate longer than this is not repaired (valid JSON of any size up to the cap
#: is still parsed, by the C parser)
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


def _balanced_objects(text: str) -> list[str]:
    """Every top-level balanced ``{...}`` or ``[...]`` span, string-aware."""
    spans: list[str] = []
    depth = 0
    start = -1
    in_str = False
    esc = False
    opener = ""
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"' and depth:
            in_str = True
        elif ch in "{[":
            if depth == 0:
                start = i
                opener = ch
            depth += 1
        elif ch in "}]" and depth:
            depth -= 1
            if depth == 0:
                if (opener == "{") == (ch == "}"):
                    spans.append(text[start: i + 1])
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

    for cand in candidates:
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


REFORMAT_GUIDANCE = "follow the required response format, using the model schema as a guide"


async def parse(branch: Any, text: Any, parse_param: ParseParam) -> Any:
    """Parse ``text`` into ``parse_param.response_format`` with repair turns."""
    fmt = parse_param.response_format
    fuzzy = parse_param.fuzzy_match_params
    progress.report("parsing reply", "parse")
    try:
        return validate_into(text, fmt, fuzzy)
    except ParseError as e:
        last: ParseError = e

    alc = parse_param.alcall_params
    model = parse_param.imodel or getattr(branch, "parse_model", None)
    if alc is not None and model is not None:

        attempt = [0]

        async def repair(_: Any) -> Any:
            nonlocal last
            n = attempt[0]
            attempt[0] += 1
            guidance = REFORMAT_GUIDANCE
            if n >= 1:
                err = str(last)
                if len(err) > 800:
                    err = err[:800] + "…(truncated)"
                guidance += (f" The previous attempt did not validate: {err}. Correct exactly what that error names"
                             " — every field it reports must carry a value of the required type.")
            if n >= 2:
                guidance += (f" This is attempt {n + 1}; earlier attempts failed. Return only the JSON object,"
                             " with no text before or after it.")
            request: ModelRequest = render_repair_request(branch, str(text), fmt, guidance, parse_param.imodel_kw)
            progress.report(f"repair attempt {n + 1}", "parse")
            with model_deadline(model):
                reply = await model.invoke(request)
            try:
                return validate_into(reply.text, fmt, fuzzy)
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
