"""Generate ``protocol/schema.json`` (JSON Schema draft 2020-12) from the wire declarations.

    python -m operate_sidecar.protocol.gen_schema            # rewrite protocol/schema.json
    python -m operate_sidecar.protocol.gen_schema --check    # exit 1 when schema.json is stale
    python -m operate_sidecar.protocol.gen_schema --stdout   # print instead of writing

Any other argument is refused (usage, exit code 2) and writes nothing.

The document has ``$defs`` for every wire type and named union, ``methods`` (method ->
direction, params schema, result schema), ``notifications`` (method -> direction, params
schema), ``errorCodes`` and ``errorData`` (the ``error.data`` shape per code). It is never
edited by hand.
"""

import inspect
import json
import sys
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import attrs

from . import catalog
from ._base import OMITTED, wire_name
from .branches import MessageContent
from .convert import find_tag, literal_values, wire_fields
from .errors import ERROR_CODES
from .lifecycle import Model, ModelConfig
from .notifications import ProgressValue
from .operate import ValidationFailedData

SCHEMA_PATH = Path(__file__).with_name("schema.json")
DIALECT = "https://json-schema.org/draft/2020-12/schema"
NoneType = type(None)
_UNIONS = (typing.Union, type(int | str))

# Unions that get their own $defs entry (largest first, so Model wins over ModelConfig).
NAMED_UNIONS: list[tuple[str, Any]] = [
    ("Model", Model),
    ("MessageContent", MessageContent),
    ("ModelConfig", ModelConfig),
    ("ProgressValue", ProgressValue),
]
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", NoneType: "null"}


class _Builder:
    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def ref(self, name: str) -> dict:
        return {"$ref": f"#/$defs/{name}"}

    def of(self, t: Any) -> dict:
        if t is Any:
            return {}
        if t in _SCALARS:
            return {"type": _SCALARS[t]}
        if attrs.has(t):
            return self.cls(t)
        origin = get_origin(t)
        if origin is Literal:
            values = literal_values(t)
            return {"const": values[0]} if len(values) == 1 else {"enum": values}
        if origin is list:
            (item,) = get_args(t)
            return {"type": "array", "items": self.of(item)} if item is not Any else {"type": "array"}
        if origin is dict:
            value = get_args(t)[1]
            return {"type": "object", "additionalProperties": self.of(value)} if value is not Any \
                else {"type": "object"}
        if origin in _UNIONS:
            return self.union(t)
        raise TypeError(f"no schema for {t!r}")

    def union(self, t: Any) -> dict:
        args = list(get_args(t))
        for name, named in NAMED_UNIONS:
            if set(get_args(named)) == set(args):
                if name not in self.defs:
                    self.defs[name] = {}  # placeholder against recursion
                    self.defs[name] = self.union_body(args, skip=name)
                return self.ref(name)
        return self.union_body(args)

    def union_body(self, args: list, skip: str | None = None) -> dict:
        for name, named in NAMED_UNIONS:
            members = get_args(named)
            if name != skip and set(members) < set(args):
                rest = [a for a in args if a not in members]
                arms = [self.of(a) for a in rest] + [self.of(typing.Union[members])]
                return {"anyOf": sorted(arms, key=lambda s: json.dumps(s, sort_keys=True))}
        classes = [a for a in args if attrs.has(a)]
        tagged = len(classes) == len(args) and find_tag(classes)
        # sorted: typing caches unions by (order-blind) equality, so arm order is not stable
        arms = sorted((self.of(a) for a in args), key=lambda s: json.dumps(s, sort_keys=True))
        return {("oneOf" if tagged else "anyOf"): arms}

    def cls(self, c: type) -> dict:
        name = c.__name__
        if name in self.defs:
            return self.ref(name)
        self.defs[name] = {}  # placeholder
        schema: dict[str, Any] = {"type": "object"}
        doc = inspect.getdoc(c)
        if doc and not doc.startswith(name + "("):
            schema["description"] = " ".join(doc.split())
        props: dict[str, Any] = {}
        required: list[str] = []
        conditions: list[dict] = []
        for f, af in zip(wire_fields(c), attrs.fields(c)):
            if f.by:
                sibling = attrs.fields_dict(c)[f.by[0]]
                sibling_key = sibling.metadata.get("wire") or wire_name(f.by[0])
                s = self.of(f.type)
                for value, (t, _) in f.by[1].items():
                    conditions.append({
                        "if": {"properties": {sibling_key: {"const": value}}, "required": [sibling_key]},
                        "then": {"properties": {f.key: self.of(t)}},
                    })
            else:
                s = self.of(f.type)
            if f.nullable and s != {}:
                s = {"anyOf": [s, {"type": "null"}]}
            if not f.required and af.default not in (attrs.NOTHING, None, OMITTED):
                s = {**s, "default": af.default}
            props[f.key] = s
            if f.required:
                required.append(f.key)
        schema["properties"] = props
        if required:
            schema["required"] = required
        if getattr(c, "__wire_extra__", "forbid") == "forbid":
            schema["additionalProperties"] = False
        if conditions:
            schema["allOf"] = conditions
        self.defs[name] = schema
        return self.ref(name)


def build_schema() -> dict:
    """The protocol's JSON Schema document, as a dict (deterministic)."""
    b = _Builder()
    methods: dict[str, Any] = {}
    for direction, table in (("clientToServer", catalog.REQUESTS),
                             ("serverToClient", catalog.SERVER_TO_CLIENT_REQUESTS)):
        for method, (params, result) in table.items():
            methods[method] = {
                "direction": direction,
                "params": b.of(params),
                "result": b.of(result) if result is not None else {"type": "null"},
            }
    notifications: dict[str, Any] = {}
    for direction, table in (("clientToServer", catalog.NOTIFICATIONS),
                             ("serverToClient", catalog.SERVER_NOTIFICATIONS)):
        for method, params in table.items():
            notifications[method] = {"direction": direction, "params": b.of(params)}
    return {
        "$schema": DIALECT,
        "title": "operate-sidecar wire protocol",
        "description": "Generated by `python -m operate_sidecar.protocol.gen_schema` from the attrs declarations in "
                       "protocol/; do not edit. A request without params means {}.",
        "protocolVersion": 1,
        "methods": methods,
        "notifications": notifications,
        "errorCodes": dict(ERROR_CODES),
        "errorData": {str(ERROR_CODES["ValidationFailed"]): b.of(ValidationFailedData)},
        "$defs": {k: b.defs[k] for k in sorted(b.defs)},
    }


def render() -> str:
    return json.dumps(build_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Rewrite, check (``--check``) or print (``--stdout``) the schema. Any other argument is
    refused with the usage and exit code 2: a typo (``--chek``) must not rewrite the file."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m operate_sidecar.protocol.gen_schema", allow_abbrev=False,
                                     description="Generate protocol/schema.json from the wire declarations in "
                                                 "protocol/ (with no option: rewrite it).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when schema.json is stale; write nothing")
    mode.add_argument("--stdout", action="store_true", help="print the schema instead of writing it")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else ""
        if current != text:
            print(f"{SCHEMA_PATH} is stale: run python -m operate_sidecar.protocol.gen_schema", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
