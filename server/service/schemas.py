"""Wire JSON Schemas → what the core takes: ``responseFormat`` → a pydantic model
class (named after the schema's ``title``), ``fieldModels`` → core ``Spec``s.
Built with ``json-schema-to-pydantic`` (imported on first use), cached by the
canonical schema text so a repeated schema builds nothing. A schema that is not
valid JSON Schema (checked against its metaschema with ``jsonschema``, imported on
first use: ``"properties": "x"``, ``"required": "a"``, ``"type": 5``) and a keyword
the builder would silently ignore are refused (-32602 naming them and where). Forms the
builder gets wrong are rewritten before it sees them (``_check``), and a schema with a
keyword the built model does not hold a reply to where it stands (found location by location
in the built model, ``_Holds``: the builder keeps little but types under ``items``, in a map's
value schema, an ``anyOf``'s parts or a ``$ref``'d definition) gets a check of the reply
against the whole schema, as the client wrote it, and the schema the model is shown then has
the client's properties as written (``_held_to_schema``).

Building is bounded and kept off the event loop: a schema longer than
``MAX_SCHEMA_CHARS`` characters of JSON, with more than ``MAX_SCHEMA_NODES``
objects or nested deeper than ``MAX_SCHEMA_DEPTH`` is refused with -32602 before
anything is built, and ``model_for_async`` / ``spec_for_async`` run the check and
the build on a worker thread, so ``ping`` is answered meanwhile. A client tool's
``inputSchema`` has the same nesting bound (``check_depth``), checked before its metaschema
check, which recurses."""

from __future__ import annotations

import json
import threading
from typing import Any

from ..nesting import too_deep
from .errors import invalid_params

#: keywords json-schema-to-pydantic accepts but does not enforce
UNSUPPORTED_KEYWORDS = frozenset({
    "if", "then", "else", "not", "patternProperties", "propertyNames", "contains", "minContains",
    "maxContains", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
    "unevaluatedItems", "prefixItems", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf")
_SUBSCHEMA_ONE = ("items", "additionalProperties")

RESERVED_PREFIXES = ("model_", "_")
DEFAULT_TITLE = "Response"
CACHE_LIMIT = 256
MAX_SCHEMA_CHARS = 256 * 1024
MAX_SCHEMA_NODES = 5000
MAX_SCHEMA_DEPTH = 64


def _pointer(path: list[Any]) -> str:
    """``path`` as a JSON Pointer (``/properties/x/items``)."""
    return "/" + "/".join(str(x).replace("~", "~0").replace("/", "~1") for x in path)


def _canonical(schema: Any, where: str) -> str:
    """The cache key, after the size bounds (checked without recursion)."""
    path, nodes = too_deep(schema, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES)
    if path is not None:
        raise invalid_params(f"{where}: the schema is nested too deeply; the limit is {MAX_SCHEMA_DEPTH} levels",
                             {"limit": MAX_SCHEMA_DEPTH})
    if nodes > MAX_SCHEMA_NODES:
        raise invalid_params(f"{where}: the schema has too many objects and arrays; the limit is {MAX_SCHEMA_NODES}",
                             {"limit": MAX_SCHEMA_NODES})
    key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    if len(key) > MAX_SCHEMA_CHARS:
        raise invalid_params(f"{where}: the schema is {len(key)} characters of JSON; the limit is {MAX_SCHEMA_CHARS}",
                             {"chars": len(key), "limit": MAX_SCHEMA_CHARS})
    return key


def check_depth(schema: Any, where: str) -> None:
    """-32602 for a schema nested deeper than ``MAX_SCHEMA_DEPTH`` levels of objects and arrays,
    ``data.path`` saying where it goes too deep; checked without recursion, in memory that grows
    with the depth only (``too_deep``), before anything recursive sees it (the metaschema's
    check ran out of stack at about 100 levels of ``properties``: a -32603)."""
    path, _ = too_deep(schema, MAX_SCHEMA_DEPTH)
    if path is not None:
        at = _pointer(path)
        raise invalid_params(f"{where}: the schema is nested too deeply at {_cut(at)}; the limit is "
                             f"{MAX_SCHEMA_DEPTH} levels", {"path": at, "limit": MAX_SCHEMA_DEPTH})


def _check_name(name: Any, path: str, where: str) -> None:
    """pydantic reserves ``model_*`` (its own members) and ``_*`` (private attributes)."""
    if isinstance(name, str) and name.startswith(RESERVED_PREFIXES):
        raise invalid_params(f"{where}: field name {name!r} at {path or '/'} is reserved "
                             f"(names may not start with {' or '.join(RESERVED_PREFIXES)})", {"field": name})


#: how much of a complaint (the metaschema's of a schema, the schema's of a reply) a message quotes
MAX_COMPLAINT_CHARS = 300


def _cut(complaint: str) -> str:
    return complaint if len(complaint) <= MAX_COMPLAINT_CHARS else complaint[:MAX_COMPLAINT_CHARS] + "..."


def check_valid(schema: dict[str, Any], where: str) -> None:
    """-32602 unless ``schema`` is valid under its metaschema (its ``$schema``, else draft 2020-12)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        at = "/" + "/".join(str(x) for x in e.path)
        complaint = _cut(e.message)
        raise invalid_params(f"{where}: not a valid JSON Schema at {at}: {complaint}", {"path": at}) from None


#: keywords whose values are data, not schemas: a ``$ref`` member there is a value
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _check_refs(root: Any, where: str) -> None:
    """-32602 naming where, for a local ``$ref`` (``#/...``) of a reply's schema that points at
    nothing in it: valid JSON Schema, but the model builder then failed with its own exception's
    name and no path (``ReferenceError: Invalid reference path``). (A tool's input schema is not
    built into a model: such a ``$ref`` fails its calls, named, as before.)"""
    from urllib.parse import unquote

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                target: Any = root
                for part in ref[2:].split("/"):
                    key = unquote(part).replace("~1", "/").replace("~0", "~")
                    if isinstance(target, dict) and key in target:
                        target = target[key]
                    elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                        target = target[int(key)]
                    else:
                        raise invalid_params(f"{where}: $ref {ref!r} at {path or '/'} points at nothing in the schema",
                                             {"path": f"{path}/$ref"})
            for k, v in node.items():
                if k not in _DATA_KEYWORDS:
                    walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(root, "")


#: what a pattern's refusal says of the engine that runs it
PATTERN_ENGINE = "replies are checked in linear time, with no look-around and no backreferences"


def _check_pattern(pattern: str, path: str, where: str) -> None:
    """-32602 unless the reply's validator (pydantic-core, whose regex engine runs in linear
    time) can run ``pattern``; built alone, the refusal would be pydantic's multi-line text."""
    from pydantic_core import SchemaError, SchemaValidator, core_schema

    try:
        SchemaValidator(core_schema.str_schema(pattern=pattern))
    except SchemaError as e:
        lines = _lines_of(e)
        why = lines[-1].removeprefix("error: ") if lines else ""
        at = f"{path}/pattern"
        raise invalid_params(f"{where}: the pattern {pattern!r} at {at} cannot be used: {why} ({PATTERN_ENGINE})",
                             {"path": at, "pattern": pattern}) from None


#: ``uniqueItems`` as the builder is given it: a keyword it does not know, which it passes through
#: to the schema the model is shown, where it is named back (``_held_to_schema``); the reply's
#: check (``_reply_check``) enforces the client's own
UNIQUE_ITEMS_SHOWN = "x-operate-sidecar-uniqueItems"


def _check(schema: Any, path: str, where: str, defaults: list[tuple[str, dict]] | None = None) -> Any:
    """-32602 for what the builder cannot take or enforce; else the schema as the builder takes it
    (a copy where something was rewritten): a ``true`` subschema (any value) is written ``{}``,
    and ``"items": false`` (only an empty array) ``"maxItems": 0``, which the builder enforces
    (``true`` broke the build with an ``AttributeError``, and ``"items": false`` let any array
    through); ``uniqueItems`` is renamed (the builder made the array a set); an ``allOf`` of
    keywords is merged (``_all_of_merged``). A ``false`` subschema elsewhere (no value) is
    refused, named. Each property with a ``default`` other than null goes into ``defaults`` (its
    path, its schema), for ``_check_defaults``."""
    if not isinstance(schema, dict):
        if isinstance(schema, bool):
            return schema
        raise invalid_params(f"{where}: schema at {path or '/'} must be an object")
    bad = sorted(k for k in schema if k in UNSUPPORTED_KEYWORDS)
    if bad:
        raise invalid_params(f"{where}: JSON Schema keyword{'s' if len(bad) > 1 else ''} "
                             f"{', '.join(bad)} at {path or '/'} not supported",
                             {"unsupported": bad, "path": path or "/"})
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        _check_pattern(pattern, path, where)
    if schema.get("enum") == []:  # (valid JSON Schema: no value at all, which the builder cannot make)
        raise invalid_params(f"{where}: an empty enum at {path or '/'} allows no value: give it at least one",
                             {"path": f"{path}/enum"})
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise invalid_params(f"{where}: only local $ref (#/...) is supported, got {ref!r}")
    if ref == "#":
        raise invalid_params(f"{where}: a $ref to the whole schema ('#') at {path or '/'} is not supported: put the "
                             "part that repeats under $defs and refer to it as '#/$defs/<name>'",
                             {"path": f"{path}/$ref"})
    props = schema.get("properties")
    if isinstance(props, dict):
        for name, sub in props.items():
            _check_name(name, f"{path}/properties", where)
            if defaults is not None and isinstance(sub, dict) and sub.get("default") is not None:
                defaults.append((f"{path}/properties/{name}", sub))
    out = schema

    def put(key: str, value: Any) -> None:
        nonlocal out
        if out is schema:
            out = dict(schema)
        out[key] = value

    def drop(key: str) -> None:
        nonlocal out
        if out is schema:
            out = dict(schema)
        del out[key]

    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            new = {name: _subschema(s, f"{path}/{key}/{name}", where, defaults) for name, s in sub.items()}
            if any(new[name] is not s for name, s in sub.items()):
                put(key, new)
    for key in _SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            listed = [_subschema(s, f"{path}/{key}/{i}", where, defaults) for i, s in enumerate(sub)]
            if any(a is not b for a, b in zip(listed, sub)):
                put(key, listed)
    for key in _SUBSCHEMA_ONE:
        sub = schema.get(key)
        if isinstance(sub, dict):
            checked = _check(sub, f"{path}/{key}", where, defaults)
            if checked is not sub:
                put(key, checked)
    if schema.get("items") is True:
        put("items", {})
    elif schema.get("items") is False:
        drop("items")
        put("maxItems", 0)
    if "uniqueItems" in schema:  # (the builder makes it a set: objects never fit, and repeats were dropped)
        drop("uniqueItems")
        put(UNIQUE_ITEMS_SHOWN, schema["uniqueItems"])  # (passed through, and named back in the schema shown)
    if isinstance(out.get("allOf"), list):
        out = _all_of_merged(out, path, where)
    return out


#: keywords that describe a value and check nothing: where an ``allOf`` is merged into its
#: schema, the schema's own are kept
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly"})


def _is_object_schema(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "object" or "properties" in schema


def _all_of_merged(schema: dict[str, Any], path: str, where: str) -> dict[str, Any]:
    """``allOf`` written into its schema where the builder would get it wrong: the builder takes
    an ``allOf`` as object schemas to merge, so ``{"allOf": [{"$ref": "#/$defs/Colour"}],
    "description": ...}`` (as pydantic 1 and other generators write a described reference) or
    ``{"type": "string", "allOf": [{"minLength": 2}]}`` made a field no value could fill. Parts
    that are ``{}`` go; one part under a schema that only describes is merged into it; parts that
    check no object (no ``properties``, no ``$ref``) are merged keyword by keyword, and a keyword
    that two of them set differently is refused (-32602). Object parts are left to the
    builder, which merges them."""
    parts = [x for x in schema["allOf"] if x != {}]
    rest = {k: v for k, v in schema.items() if k != "allOf"}
    if not parts:
        return rest
    if len(parts) == 1 and set(rest) <= ANNOTATIONS:
        return {**parts[0], **rest}
    if any(not isinstance(x, dict) or _is_object_schema(x) or "$ref" in x for x in parts) or _is_object_schema(rest):
        return schema
    for i, x in enumerate(parts):
        for k, v in x.items():
            if k in rest and rest[k] != v and k not in ANNOTATIONS:
                raise invalid_params(f"{where}: allOf at {path or '/'} sets {k!r} differently in two places "
                                     f"({json.dumps(rest[k])[:60]} and {json.dumps(v)[:60]}): not supported; "
                                     "write the schema as one", {"path": f"{path}/allOf/{i}/{k}"})
            rest.setdefault(k, v)
    return rest


def _subschema(schema: Any, path: str, where: str, defaults: list[tuple[str, dict]] | None = None) -> Any:
    """A subschema under ``properties``, ``$defs`` or a combinator, checked (see ``_check``)."""
    if schema is True:
        return {}
    if schema is False:
        raise invalid_params(f"{where}: the schema at {path} is false, which no value matches: not supported "
                             "(leave it out, or give it a schema)", {"path": path})
    return _check(schema, path, where, defaults)


def _check_default(annotation: Any, default: Any, where: str) -> None:
    """-32602 unless ``default`` is a value of the field's schema (it is the result's value when
    the reply leaves the field out, and is shown to the model)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(annotation).validate_json(json.dumps(default), strict=True)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        at = "/" + "/".join(str(x) for x in first.get("loc", ()))
        complaint = str(first.get("msg") or e)[:MAX_COMPLAINT_CHARS]
        raise invalid_params(f"{where}: not a value of the field's schema{'' if at == '/' else ' at ' + at}: "
                             f"{complaint}", {"path": at}) from None


def _check_defaults(root: dict[str, Any], defaults: list[tuple[str, dict]], where: str) -> None:
    """-32602 for a property's ``default`` (``_check`` collects them) that is not a value of that
    property's schema (``$ref`` resolved in ``root``): the built model puts it, unchecked, into a
    reply that leaves the property out, so the result would break the schema the client wrote.
    ``null`` is taken: an optional property the reply leaves out is written ``null`` anyway (§14)."""
    if not defaults:
        return
    from jsonschema.exceptions import best_match

    from operate_sidecar.server.core.tools import linear_validator

    validator = linear_validator(root)
    for at, sub in defaults:
        error = best_match(validator.evolve(schema=sub).iter_errors(sub["default"]))
        if error is not None:
            inner = "".join(f"/{x}" for x in error.absolute_path)
            raise invalid_params(f"{where}: the default at {at}/default is not a value of its property's schema"
                                 f"{' at ' + inner if inner else ''}: {_cut(error.message)}", {"path": f"{at}/default"})


def _reply_check(schema: dict[str, Any]) -> Any:
    """``check(data)``: a ``ValueError`` naming where ``data`` (a reply, as validated and coerced
    by the built model, dumped as JSON without its defaults) is not a value of ``schema``, the
    client's own. The builder enforces only part of JSON Schema (``uniqueItems``,
    ``minProperties``, ``maxProperties``, ``additionalProperties`` of a map were not held), so the
    whole schema is checked here, with ``pattern`` on the linear-time engine the tools' arguments
    use. Raised inside a pydantic validator, the error is the reply's validation error: a repair
    turn, then ``handleValidation``, as for any other."""
    from jsonschema.exceptions import best_match

    from operate_sidecar.server.core.tools import linear_validator

    validator = linear_validator(schema)

    def check(data: Any) -> None:
        error = best_match(validator.iter_errors(data))
        if error is not None:
            at = "/" + "/".join(str(x) for x in error.absolute_path)
            raise ValueError(f"not a value of the schema at {at}: {_cut(error.message)}")

    return check


def _named_back(value: Any, name: str | None = "uniqueItems") -> Any:
    """A JSON Schema with ``UNIQUE_ITEMS_SHOWN`` named ``name`` again, or left out (None), in
    place (only the builder's copies hold it: ``_check`` copies what it rewrites)."""
    if isinstance(value, dict):
        if UNIQUE_ITEMS_SHOWN in value:
            shown = value.pop(UNIQUE_ITEMS_SHOWN)
            if name is not None:
                value[name] = shown
        for v in value.values():
            _named_back(v, name)
    elif isinstance(value, list):
        for v in value:
            _named_back(v, name)
    return value


#: keywords that check nothing where they are (``format`` included: the reply's check does not
#: assert it), with ``x-...`` extensions
CHECK_NOTHING = frozenset({"$schema", "$id", "$anchor", "$defs", "definitions", "format", "contentEncoding",
                           "contentMediaType", *ANNOTATIONS})

#: by the type of a node of the built model's core schema (what pydantic-core validates), the key
#: of that node that holds a value to a JSON Schema keyword
_CORE_BOUNDS: dict[str, dict[str, str]] = {
    "str": {"minLength": "min_length", "maxLength": "max_length", "pattern": "pattern"},
    "list": {"minItems": "min_length", "maxItems": "max_length"},
    "int": {"minimum": "ge", "maximum": "le", "exclusiveMinimum": "gt", "exclusiveMaximum": "lt",
            "multipleOf": "multiple_of"},
}
_CORE_BOUNDS["float"] = _CORE_BOUNDS["int"]

#: the core schema types whose values are all of a JSON type
_CORE_TYPES = {"string": {"str", "datetime", "date", "time", "uuid", "url"}, "integer": {"int"},
               "number": {"int", "float"}, "boolean": {"bool"}, "null": {"none"}, "object": {"model", "dict"},
               "array": {"list"}}
_CORE_ANY: dict[str, Any] = {"type": "any"}


def _of_json_type(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return name == "boolean"
    if isinstance(value, int):
        return name in ("integer", "number")
    if isinstance(value, float):
        return name == "number" or (name == "integer" and value.is_integer())
    return {str: "string", type(None): "null", dict: "object", list: "array"}.get(type(value)) == name


def _is_null_schema(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null" and \
        all(k == "type" or k in CHECK_NOTHING or k.startswith("x-") for k in schema)


class _Holds:
    """Whether a built model holds a reply to every keyword of the client's schema: each
    location of the schema (a property, an array's ``items``, a map's value schema, a part of
    an ``anyOf``, what a ``$ref`` names, ...) is found in the model's core schema, and each of
    its keywords must be held there (``maxLength`` as that string's ``max_length``, ``enum`` as
    the literal's values, ``properties`` as the model's fields, ...). Where the builder drops a
    keyword (it did for everything under ``items`` but types and enums, in a map's value schema,
    in an ``anyOf``'s parts, behind a ``$ref`` to a string or number), or keeps it in a form
    not known here, the schema is not held: the reply is then checked against the whole of it.
    So a keyword is taken as held only where the model shows that it is."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.defs: dict[str, Any] = {}
        self.seen: set[tuple[int, int]] = set()
        self.made: list[dict[str, Any]] = []  # (the parts of schemas made here: alive, their ids not reused)

    def model(self, model: type) -> bool:
        try:
            return self.holds(self.root, model.__pydantic_core_schema__)  # type: ignore[attr-defined]
        except RecursionError:  # (a chain of $refs deeper than the stack: checked whole)
            return False

    def _core(self, core: Any) -> Any:
        """``core`` without what does not change which values it takes (a field's default, a
        reference to a definition), or None when it cannot be followed."""
        while isinstance(core, dict):
            kind = core.get("type")
            if kind == "definitions":
                self.defs.update((d.get("ref"), d) for d in core.get("definitions", ()) if isinstance(d, dict))
                core = core.get("schema")
            elif kind == "definition-ref":
                core = self.defs.get(core.get("schema_ref"))
            elif kind == "default":
                core = core.get("schema")
            else:
                return core
        return None

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return None
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def holds(self, schema: Any, core: Any) -> bool:
        if schema is True:
            return True
        core = self._core(core)
        if not isinstance(schema, dict) or core is None:
            return False
        seen = (id(schema), id(core))
        if seen in self.seen:  # (a recursive schema: this pair is being checked already)
            return True
        self.seen.add(seen)
        keys = {k for k in schema if k not in CHECK_NOTHING and not k.startswith("x-")}
        if not keys:
            return True
        if "$ref" in keys:
            target = self._resolve(schema["$ref"])
            return target is not None and self.holds(target, core) and \
                self.holds(self._made({k: schema[k] for k in keys - {"$ref"}}), core)
        kind = core.get("type")
        if kind == "nullable":
            rest = self._without_null(schema)
            return rest is not None and self.holds(self._made(rest), core.get("schema"))
        if "anyOf" in keys:
            parts = schema["anyOf"]
            choices = [c[0] if isinstance(c, tuple) else c for c in core.get("choices", ())] \
                if kind == "union" else [core]
            return keys == {"anyOf"} and isinstance(parts, list) and len(parts) == len(choices) and \
                all(self.holds(p, c) for p, c in zip(parts, choices))
        if "type" in keys and not self._typed(schema["type"], core, only=keys == {"type"}):
            return False
        bounds = _CORE_BOUNDS.get(kind, {})
        for key in keys - {"type"}:
            value = schema[key]
            if key in bounds:
                held = core.get(bounds[key]) == value and not isinstance(value, bool) or \
                    (key in ("minLength", "minItems") and value == 0)
            elif kind == "list" and key == "items":
                held = self.holds(value, core.get("items_schema", _CORE_ANY))
            elif kind == "literal" and key in ("enum", "const"):
                expected = [value] if key == "const" else value
                held = json.dumps(core.get("expected"), default=repr) == json.dumps(expected, default=repr)
            elif kind == "none" and key in ("enum", "const"):
                held = value in ([None], None) and (key == "enum") == isinstance(value, list)
            elif kind == "dict" and key == "additionalProperties":
                held = self.holds(value, core.get("values_schema", _CORE_ANY))
            elif kind == "model" and key in ("properties", "required", "additionalProperties"):
                held = self._fields(schema, key, core)
            else:
                held = False
            if not held:
                return False
        return True

    def _made(self, schema: dict[str, Any]) -> dict[str, Any]:
        self.made.append(schema)
        return schema

    @staticmethod
    def _without_null(schema: dict[str, Any]) -> dict[str, Any] | None:
        """``schema`` with the null it takes (a type, a part of its ``anyOf``) left out, or None when
        it takes no null: also when an ``enum`` without null or a ``const`` other than null beside
        that type refuses it (the builder's nullable literal takes null, the schema does not)."""
        if "enum" in schema and (not isinstance(schema["enum"], list) or None not in schema["enum"]) or \
                "const" in schema and schema["const"] is not None:
            return None
        types = schema.get("type")
        if isinstance(types, list) and "null" in types:
            left = [t for t in types if t != "null"]
            return {**schema, "type": left[0] if len(left) == 1 else left} if left else None
        parts = schema.get("anyOf")
        if isinstance(parts, list):
            left = [p for p in parts if not _is_null_schema(p)]
            if left and len(left) < len(parts):
                return {**schema, "anyOf": left}
        return None

    @staticmethod
    def _typed(types: Any, core: dict[str, Any], only: bool) -> bool:
        """Every value ``core`` takes is of a type ``types`` names (a union of them only with no
        other keyword, which the builder would put on the union as a whole)."""
        def fits(name: Any, node: Any) -> bool:
            if not isinstance(node, dict):
                return False
            if node.get("type") == "literal":
                return all(_of_json_type(v, name) for v in node.get("expected", ()))
            return node.get("type") in _CORE_TYPES.get(name, ())

        if isinstance(types, str):
            return fits(types, core)
        if not isinstance(types, list):
            return False
        if len(types) == 1:
            return fits(types[0], core)
        choices = [c[0] if isinstance(c, tuple) else c for c in core.get("choices", ())]
        return only and core.get("type") == "union" and len(choices) == len(types) and \
            all(fits(t, c) for t, c in zip(types, choices))

    def _fields(self, schema: dict[str, Any], key: str, core: dict[str, Any]) -> bool:
        """``properties``, ``required`` or ``additionalProperties`` held by a model: each
        property by its field, each required name by a field without a default of null (one
        with another default holds the result: the default fills it), and keys the schema does
        not name dropped or refused (the model's extra fields are not kept)."""
        fields_schema = core.get("schema")
        if core.get("root_model") or not isinstance(fields_schema, dict) or \
                fields_schema.get("type") != "model-fields" or \
                (core.get("config") or {}).get("extra_fields_behavior") == "allow":
            return False
        fields = fields_schema.get("fields") or {}
        if key == "additionalProperties":
            return True
        if key == "required":
            required = schema["required"]
            return isinstance(required, list) and all(
                isinstance(fields.get(n), dict) and not (fields[n].get("schema", {}).get("type") == "default"
                                                        and fields[n]["schema"].get("default") is None)
                for n in required)
        props = schema["properties"]
        return isinstance(props, dict) and all(
            isinstance(fields.get(n), dict) and fields[n].get("validation_alias") in (None, n)
            and self.holds(sub, fields[n].get("schema")) for n, sub in props.items())


def _needs_whole_check(schema: dict[str, Any], model: type) -> bool:
    """``model``, built from the client's ``schema``, does not hold a reply to all of it
    (``_Holds``): the reply is then checked against the whole of it (``_held_to_schema``)."""
    return not _Holds(schema).model(model)


def _refs_in(value: Any, found: set[str]) -> set[str]:
    """Every ``$ref`` string in ``value``, added to ``found``."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                found.add(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _def_name(ref: str) -> str | None:
    """The name a ``#/$defs/<name>`` reference (or one to a place inside that definition) names."""
    if not ref.startswith("#/$defs/"):
        return None
    return ref[len("#/$defs/"):].split("/", 1)[0].replace("~1", "/").replace("~0", "~")


def _renamed_refs(value: Any, names: dict[str, str]) -> Any:
    """``value`` with each reference to ``#/$defs/<name>`` renamed as ``names`` says, in place."""
    def renamed(ref: str) -> str:
        name = _def_name(ref)
        if name not in names:
            return ref
        rest = ref[len("#/$defs/"):].split("/", 1)
        return "#/$defs/" + names[name].replace("~", "~0").replace("/", "~1") + \
            ("/" + rest[1] if len(rest) > 1 else "")

    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                node["$ref"] = renamed(node["$ref"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return value


def _with_clients_properties(shown: dict[str, Any], clients: dict[str, Any]) -> dict[str, Any]:
    """``shown``, a built model's JSON Schema (or that of a type the pipeline derives from it),
    with each of the client's properties written as the client wrote it (``clients``: the
    client's schema as the builder took it, ``uniqueItems`` named back), and the client's
    ``$defs`` and ``definitions`` with them: the built model's own leaves out what it does not
    hold (``maxLength`` under ``items``, a map's value schema, ...), and the model (a local
    model's grammar) would be steered by less than the reply is held to. The pipeline's own
    properties (the tool fields of an ``actions`` operate) and definitions stay; a client's
    definition with the name of one of them is renamed."""
    import copy

    props = shown.get("properties")
    client_props = clients.get("properties")
    if not isinstance(props, dict) or not isinstance(client_props, dict):
        return shown
    ours = [n for n in client_props if n in props]
    defs = shown.pop("$defs", {})
    # (the definitions the pipeline's own properties reach, through each other: kept)
    kept: dict[str, Any] = {}
    todo = _refs_in({k: v for k, v in shown.items() if k != "properties"}, set())
    _refs_in([v for n, v in props.items() if n not in ours], todo)
    while todo:
        name = _def_name(todo.pop())
        if name in defs and name not in kept:
            kept[name] = defs[name]
            _refs_in(kept[name], todo)
    written = copy.deepcopy({"properties": {n: client_props[n] for n in ours},
                             "$defs": clients.get("$defs") or {}})
    clash = {n: n for n in written["$defs"] if n in kept}
    for name in clash:
        i = 1
        while f"{name}_{i}" in kept or f"{name}_{i}" in written["$defs"]:
            i += 1
        clash[name] = f"{name}_{i}"
    if clash:
        _renamed_refs(written, clash)
        written["$defs"] = {clash.get(n, n): v for n, v in written["$defs"].items()}
    props.update(written["properties"])
    if kept or written["$defs"]:
        shown["$defs"] = {**kept, **written["$defs"]}
    if isinstance(clients.get("definitions"), dict):
        shown["definitions"] = copy.deepcopy(clients["definitions"])
    return shown


def _held_to_schema(model: type, schema: dict[str, Any], clients: dict[str, Any]) -> type:
    """``model`` (its name kept) with an after-validator holding a reply to the whole ``schema``
    (``_reply_check``): only the model's own fields are checked, so a type the pipeline derives
    from it (the tool fields of an ``actions`` operate) is checked on the client's fields alone.
    Its JSON Schema, the one the model is shown, and that of a type derived from it, has the
    client's properties as ``clients`` writes them (``_with_clients_properties``)."""
    from pydantic import model_validator

    check = _reply_check(schema)
    names = set(model.model_fields)

    def held(self: Any) -> Any:
        check(self.model_dump(mode="json", by_alias=True, exclude_defaults=True, include=names))
        return self

    def model_json_schema(cls: Any, *args: Any, **kw: Any) -> dict[str, Any]:
        return _with_clients_properties(_named_back(super(held_type, cls).model_json_schema(*args, **kw)), clients)

    held_type: type = type(model)(model.__name__, (model,), {
        "__module__": model.__module__, "__qualname__": model.__qualname__,
        "held_to_schema": model_validator(mode="after")(held), "model_json_schema": classmethod(model_json_schema)})
    return held_type


def _value_held_to_schema(annotation: Any, schema: dict[str, Any], clients: dict[str, Any]) -> Any:
    """A field's ``annotation`` whose values are held to its whole ``schema`` (``_reply_check``);
    null, which a field made optional by a null default may hold, is not checked. Its JSON Schema
    (what the model is shown of the field) is ``clients``, the client's schema as the builder took
    it, ``uniqueItems`` named back, unless that refers to its own definitions (a ``$ref``), which
    the pipeline's model would not hold: the built type's then."""
    from typing import Annotated

    from pydantic import AfterValidator, TypeAdapter, WithJsonSchema

    check = _reply_check(schema)
    adapter = TypeAdapter(annotation)

    def held(value: Any) -> Any:
        if value is not None:
            check(adapter.dump_python(value, mode="json", by_alias=True, exclude_defaults=True))
        return value

    if _refs_in(clients, set()):
        return Annotated[annotation, AfterValidator(held)]
    return Annotated[annotation, AfterValidator(held), WithJsonSchema(clients)]


class SchemaCache:
    def __init__(self) -> None:
        self._models: dict[str, type] = {}
        self._specs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pinned: dict[int, tuple[dict[str, Any], str]] = {}  # id → (the schema, its key)

    def pin(self, schema: dict[str, Any], where: str = "responseFormat") -> None:
        """Remember the key of a schema that never changes (a module constant a front end
        passes with every call, such as ACP's reply format) by the object's identity, so that
        it is not serialized again per call. Only for objects nobody mutates; the object is
        held, so its id cannot be reused by another."""
        self._pinned[id(schema)] = (schema, _canonical(schema, where))

    def _pinned_key(self, schema: dict[str, Any]) -> str | None:
        pinned = self._pinned.get(id(schema))
        return pinned[1] if pinned is not None and pinned[0] is schema else None

    def _key(self, schema: dict[str, Any], where: str) -> str:
        key = self._pinned_key(schema)
        return key if key is not None else _canonical(schema, where)

    async def model_for_async(self, schema: dict[str, Any], where: str = "responseFormat") -> type:
        """``model_for`` on a worker thread (the event loop keeps answering meanwhile); a
        schema already built is answered from the cache without the thread hop (the key is
        computed under the size bounds, so this stays cheap on the loop). Worker threads are
        anyio's, bounded by its default capacity limiter."""
        cached = self._models.get(self._key(schema, where))
        if cached is not None:
            return cached
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.model_for, schema, where, abandon_on_cancel=True)

    async def specs_for_async(self, fields: list[Any]) -> list[Any]:
        """``spec_for`` of every field, on a worker thread."""
        import anyio.to_thread

        return await anyio.to_thread.run_sync(lambda: [self.spec_for(f, i) for i, f in enumerate(fields)],
                                             abandon_on_cancel=True)

    def model_for(self, schema: dict[str, Any], where: str = "responseFormat") -> type:
        key = self._key(schema, where)
        cached = self._models.get(key)
        if cached is not None:
            return cached
        if self._pinned_key(schema) is None:  # (a pinned schema is a front end's own constant)
            check_valid(schema, where)
            _check_refs(schema, where)
        defaults: list[tuple[str, dict]] = []
        built = _check(schema, "", where, defaults)
        if self._pinned_key(schema) is None:
            _check_defaults(schema, defaults, where)
        if schema.get("type", "object") != "object":
            raise invalid_params(f"{where}: must be an object schema (\"type\": \"object\")")
        model = self._build(dict(built, title=schema.get("title") or DEFAULT_TITLE), where)
        if self._pinned_key(schema) is None and _needs_whole_check(schema, model):
            import copy

            model = _held_to_schema(model, schema, _named_back(copy.deepcopy(built)))
        with self._lock:
            if len(self._models) >= CACHE_LIMIT:
                self._models.pop(next(iter(self._models)))
            self._models[key] = model
        return model

    def spec_for(self, field: Any, index: int = 0) -> Any:
        """A wire FieldModel (attrs object or dict) → core ``Spec``."""
        from operate_sidecar.server.core.operative import Spec

        get = (lambda k, d=None: field.get(k, d)) if isinstance(field, dict) else \
            (lambda k, d=None: getattr(field, k, d))
        name, schema = get("name"), get("schema")
        where = f"fieldModels[{index}]"
        if not isinstance(name, str) or not name.isidentifier():
            raise invalid_params(f"{where}.name must be an identifier, got {name!r}")
        if not isinstance(schema, dict):
            raise invalid_params(f"{where}.schema must be an object")
        _check_name(name, "", f"{where}.name")
        key = _canonical(schema, f"{where}.schema")
        annotation = self._specs.get(key)
        if annotation is None:
            check_valid(schema, f"{where}.schema")
            _check_refs(schema, f"{where}.schema")
            # (a field's type is built into the pipeline's own model: the builder is given
            # uniqueItems left out, held by the whole schema's check)
            import copy

            defaults: list[tuple[str, dict]] = []
            checked = _check(schema, "", f"{where}.schema", defaults)
            clients = _named_back(copy.deepcopy(checked))
            built = _named_back(checked, None)
            _check_defaults(schema, defaults, f"{where}.schema")
            wrapper = {"title": "FieldWrapper", "type": "object", "properties": {"value": built},
                       "required": ["value"]}
            model = self._build(wrapper, f"{where}.schema")
            fi = model.model_fields["value"]
            annotation = fi.annotation
            if fi.metadata:
                from typing import Annotated

                annotation = Annotated[(annotation, *fi.metadata)]  # type: ignore[valid-type]
            if _needs_whole_check({**wrapper, "properties": {"value": schema}}, model):
                annotation = _value_held_to_schema(annotation, schema, clients)
            with self._lock:
                if len(self._specs) >= CACHE_LIMIT:
                    self._specs.pop(next(iter(self._specs)))
                self._specs[key] = annotation
        kw: dict[str, Any] = {"name": name, "annotation": annotation, "description": get("description")}
        default = get("default")
        if isinstance(field, dict):
            given = "default" in field
        else:
            from operate_sidecar.protocol import is_omitted

            given = not is_omitted(default)
        if given:
            if default is None:
                kw["nullable"] = True  # a null default: the field may be left out or null
            else:
                _check_default(annotation, default, f"{where}.default")
            kw["default"] = default
        return Spec(**kw)

    @staticmethod
    def _build(schema: dict[str, Any], where: str) -> type:
        import json_schema_to_pydantic as j2p

        try:
            return j2p.create_model(schema, allow_undefined_array_items=True, allow_undefined_type=True)
        except Exception as e:  # noqa: BLE001 - the client's schema, valid JSON Schema, that cannot be built
            raise invalid_params(f"{where}: {_build_error(e)}") from None


def _build_error(e: BaseException) -> str:
    """The builder's error in one line: pydantic's schema errors are a nested, multi-line text
    (``Error building "model" validator: ... Field "a": ... 'ge' must be coercible to an
    integer``): the fields it names and its last line."""
    lines = _lines_of(e)
    if len(lines) <= 1:
        return f"{type(e).__name__}: {lines[0] if lines else ''}"
    fields = [ln.split('"')[1] for ln in lines if ln.startswith('SchemaError: Field "') and ln.count('"') >= 2]
    return f"cannot build a reply model{' (field ' + '.'.join(fields) + ')' if fields else ''}: {lines[-1]}"


def _lines_of(e: BaseException) -> list[str]:
    """The non-blank lines of an error's text, stripped (pydantic's schema errors nest over several)."""
    from operate_sidecar.server.core.errors import exception_text

    return [ln.strip() for ln in exception_text(e).splitlines() if ln.strip()]
