"""Generators of hostile frames and bodies, and the docs/PROTOCOL.md §1 oracle of what each
body must be answered with. Shared by the frame and oversize fuzz modules."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

MISSING = object()


# ---------------------------------------------------------------------- the oracle
@dataclass
class Expect:
    """What one body must produce.

    ``mode``: ``"none"`` (no response), ``"null"`` (one error, id null), ``"id"`` (a response
    to ``id``), ``"either"`` (one error, id echoed or null). ``codes``: acceptable error codes;
    ``result_ok``: a result is acceptable too (``result`` if it must equal a value)."""
    mode: str
    codes: frozenset = frozenset()
    id: Any = None
    result_ok: bool = False
    result: Any = MISSING
    why: str = ""


def _valid_id(v: Any) -> bool:
    return type(v) is int or type(v) is str


APP_METHODS = ("listBranches", "listTools", "branchMessages")  # harmless app methods junk may name


def expect_for_value(msg: Any) -> Expect:
    """docs/PROTOCOL.md §1 + JSON-RPC 2.0 for a body that is valid JSON with value ``msg``."""
    if type(msg) is list:
        return Expect("null", frozenset({-32600}), why="a batch (array) is -32600")
    if type(msg) is not dict:
        return Expect("null", frozenset({-32600}), why="JSON that is not a request object is -32600")
    has_id = "id" in msg
    mid = msg.get("id")
    echo = mid if _valid_id(mid) else None
    method = msg.get("method")
    if msg.get("jsonrpc") != "2.0":
        return Expect("either", frozenset({-32600}), echo, why='"jsonrpc" is not "2.0"')
    if method is None:
        if has_id and ("result" in msg or "error" in msg):
            return Expect("none", why="a response object: nothing to answer")
        return Expect("either", frozenset({-32600}), echo, why="no method")
    if type(method) is not str:
        return Expect("either", frozenset({-32600}), echo, why="method is not a string")
    if has_id and not _valid_id(mid):
        return Expect("null", frozenset({-32600}), why="id is neither an integer nor a string")
    params = msg.get("params")
    params_ok = params is None or params == [] or type(params) is dict
    if not has_id:
        return Expect("none", why="a notification")
    if method == "ping":  # ping answers {} (lenient about params) or refuses bad params
        return Expect("id", frozenset({-32602}), mid, result_ok=True, result={}, why="ping")
    if not params_ok:
        return Expect("id", frozenset({-32602}), mid, why="params neither object, null nor []")
    if method == "initialize":
        return Expect("id", frozenset({-32600, -32602}), mid, why="initialize again")
    if method in APP_METHODS:
        return Expect("id", frozenset({-32602, -32012}), mid, result_ok=True, why=f"{method} with junk params")
    return Expect("id", frozenset({-32601}), mid, why="unknown method")


def strict_json(body: bytes) -> Any:
    """The value of ``body`` if it is RFC 8259 JSON in UTF-8 (no BOM, no NaN/Infinity), else MISSING.
    Raises RecursionError for nesting Python cannot parse."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return MISSING

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=no_constants)
    except ValueError:
        return MISSING


def expect_for_body(body: bytes) -> Expect:
    try:
        value = strict_json(body)
    except RecursionError:  # nested deeper than a parser follows (the bodies made here carry no id)
        return Expect("null", frozenset({-32700}), why="nested too deeply to parse: -32700 with id null")
    if value is MISSING:
        return Expect("null", frozenset({-32700}), why="not JSON: -32700 with id null")
    return expect_for_value(value)


# ---------------------------------------------------------------------- JSON values
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63) |
           st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) |
                           st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=10)

valid_ids = st.integers(-2**63, 2**63) | st.text(max_size=20) | st.sampled_from([0, "", "0", -1, 2**53 + 1])
invalid_ids = (st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) |
               st.lists(scalars, max_size=2) | st.dictionaries(st.text(max_size=4), scalars, max_size=2))
junk_methods = (st.sampled_from(["ping", "initialize", "initialized", "$/cancelRequest", "$/setTrace",
                                 "textDocument/hover", "Ping", "ping ", "listBranches", "listTools",
                                 "branchMessages", "invokeClientTool", "requestToolPermission", ""])
                | st.text(max_size=30)).filter(lambda m: m not in ("exit", "shutdown"))
junk_params = (st.none() | st.just([]) | st.just({}) | json_values |
               st.dictionaries(st.sampled_from(["branchId", "id", "offset", "limit", "x"]), json_values,
                               max_size=3))


@st.composite
def request_shapes(draw) -> dict:
    """Objects shaped like requests, each part possibly missing or of a wrong type."""
    msg: dict = {}
    jr = draw(st.sampled_from(["2.0", "2.0", "2.0", MISSING, "1.0", 2.0, None, "2"]))
    if jr is not MISSING:
        msg["jsonrpc"] = jr
    kind = draw(st.sampled_from(["valid", "valid", "valid", "missing", "invalid"]))
    if kind == "valid":
        msg["id"] = draw(valid_ids)
    elif kind == "invalid":
        msg["id"] = draw(invalid_ids)
    m = draw(st.sampled_from(["str", "str", "str", "missing", "wrong"]))
    if m == "str":
        msg["method"] = draw(junk_methods)
    elif m == "wrong":
        msg["method"] = draw(st.none() | st.integers() | st.lists(st.text(max_size=3), max_size=2) |
                             st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    p = draw(st.sampled_from(["missing", "value"]))
    if p == "value":
        msg["params"] = draw(junk_params)
    if draw(st.booleans()) and m != "str":
        msg[draw(st.sampled_from(["result", "error"]))] = draw(json_values)
    for k, v in draw(st.dictionaries(st.text(max_size=6).filter(
            lambda k: k not in ("jsonrpc", "id", "method", "params", "result", "error")), json_values, max_size=2)).items():
        msg[k] = v
    # order of keys varies too
    keys = draw(st.permutations(list(msg)))
    return {k: msg[k] for k in keys}


def dumps(v: Any) -> bytes:
    return json.dumps(v, ensure_ascii=False, allow_nan=False).encode("utf-8")


# bodies of each class
request_bodies = request_shapes().map(dumps)
non_request_bodies = (st.lists(json_values | request_shapes(), max_size=3) | scalars).map(dumps)
INVALID_UTF8 = [b"\xff", b"\xfe", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\x28",
                b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\x80"]


@st.composite
def invalid_utf8_bodies(draw) -> bytes:
    base = draw(request_bodies)
    bad = draw(st.sampled_from(INVALID_UTF8))
    i = draw(st.integers(0, len(base)))
    return base[:i] + bad + base[i:]


@st.composite
def truncated_json_bodies(draw) -> bytes:
    base = draw(request_bodies | non_request_bodies)
    return base[:draw(st.integers(0, max(0, len(base) - 1)))]


def _not_json(b: bytes) -> bool:
    try:
        return strict_json(b) is MISSING
    except RecursionError:
        return False


non_json_bodies = (st.binary(max_size=200) | st.text(max_size=80).map(lambda t: t.encode()) | invalid_utf8_bodies() |
                   truncated_json_bodies() | st.sampled_from([b"", b" ", b"{", b"}", b"[", b"{]", b"nul", b"tru",
                                                              b"{'a': 1}", b'{"a":1,}', b"[1,]", b"01", b"\x00",
                                                              b'{"jsonrpc":"2.0","id":1,"method":"ping"}}',
                                                              b'{"jsonrpc":"2.0"} {"id":2}'])
                   ).filter(lambda b: not b.startswith(b"\xef\xbb\xbf")).filter(_not_json)


# ---------------------------------------------------------------------- headers
EOL = [b"\r\n", b"\n"]
_CL_TEXT = re.compile(rb"content-length", re.IGNORECASE)

cl_names = st.lists(st.booleans(), min_size=14, max_size=14).map(
    lambda bits: "".join(c.upper() if b else c for c, b in zip("content-length", bits)).encode())
separators = st.sampled_from([b": ", b":", b":  ", b":\t", b": \t "])
header_names = (st.sampled_from([b"Content-Type", b"content-type", b"X-Foo", b"Accept", b"Content-Encoding"])
                | st.from_regex(rb"\A[A-Za-z][A-Za-z0-9-]{0,15}\Z")).filter(lambda n: not _CL_TEXT.search(n))
header_values = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")).filter(
    lambda v: not _CL_TEXT.search(v))
unknown_headers = st.tuples(header_names, separators, header_values).map(lambda t: t[0] + t[1] + t[2])
garbage_lines = st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")).filter(
    lambda b: not _CL_TEXT.search(b))


@st.composite
def header_block(draw, length: int, eols: list[bytes] = [b"\r\n"]) -> bytes:
    """A header block announcing ``length``: the Content-Length header (case varied, maybe
    repeated with the same value) among unknown headers, in any order."""
    lines = [draw(cl_names) + draw(separators) + str(length).encode() for _ in range(draw(st.integers(1, 3)))]
    lines += draw(st.lists(unknown_headers, max_size=4))
    lines = draw(st.permutations(lines))
    eol = st.sampled_from(eols)
    return b"".join(line + draw(eol) for line in lines) + draw(eol)


@st.composite
def garbage_prefix(draw, eols: list[bytes] = [b"\r\n"]) -> bytes:
    """Garbage lines before a frame, maybe with an unterminated tail glued to its first header."""
    out = b"".join(g + draw(st.sampled_from(eols)) for g in draw(st.lists(garbage_lines, max_size=3)))
    if draw(st.booleans()):
        out += draw(garbage_lines.map(lambda b: b.replace(b"\r", b"")))
    return out


BAD_LENGTHS = [b"-1", b"-40", b"abc", b"5a", b"0x10", b"5.0", b"1e3", b"", b" ", b"NaN", b"--5", b"five",
               b"\xff\xfe", b"1 2"]


@st.composite
def bad_header_block(draw) -> bytes:
    """A header block with no usable Content-Length (missing, or a bad value), any line endings."""
    lines = draw(st.lists(unknown_headers, max_size=3))
    if draw(st.booleans()):
        lines.append(draw(cl_names) + draw(separators) + draw(st.sampled_from(BAD_LENGTHS)))
    lines = draw(st.permutations(lines))
    eol = st.sampled_from(EOL)
    return b"".join(line + draw(eol) for line in lines) + draw(eol)
