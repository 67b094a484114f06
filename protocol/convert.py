"""The cattrs converter for wire types: camelCase keys, strict JSON types, named errors.

Structuring never coerces (``"5"`` is not an int, ``1`` is not a bool, a string is not a
list); it raises :class:`ParamsError` whose message names the field path (wire names) and,
for unknown keys, lists them all in ``unknown_fields``. Hooks are built once per type by the
factories below and cached by the converter.

Field rules (derived from each attrs field, nothing else to maintain):

* no default, or a one-value ``Literal`` (a tag such as ``provider``/``kind``): required;
  ``null`` allowed only when the annotation contains ``None``;
* default ``None``: optional, omitted -> ``None``; an explicit ``null`` is rejected
  (unless the type is free-form JSON, where null and omitted are the same);
* default ``OMITTED``: optional, omitted -> ``OMITTED``; ``null`` -> ``None`` when the
  annotation contains ``None`` (or is free-form JSON);
* any other default: optional, omitted -> that default; ``null`` rejected.

Unstructuring writes camelCase keys and leaves out ``OMITTED`` values and ``None`` values of
fields whose default is ``None``; required nullable fields are written as ``null``.
"""

import json
import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

import attrs
import cattrs

from ._base import OMITTED, Omitted, wire_name
from .errors import ParamsError

__all__ = ["converter", "structure", "unstructure", "describe_type", "wire_fields"]

NoneType = type(None)
_UNION_ORIGINS = (typing.Union, types.UnionType)
_SCALARS = (str, int, float, bool, NoneType)

converter = cattrs.Converter(detailed_validation=False)

#: The largest integer a JSON number can carry to the readers this protocol meets (a double, as in
#: JavaScript): anything larger is out of range (Python would take it, then fail converting it to
#: seconds or a time-out, -32603).
MAX_JSON_INT = int(sys.float_info.max)


# --- helpers ------------------------------------------------------------------------------

def _json_kind(v: Any) -> str:
    t = type(v)
    if t is bool:
        return "boolean"
    if t is int:
        return "integer"
    if t is float:
        return "number"
    if t is str:
        return "string"
    if v is None:
        return "null"
    if t is list:
        return "array"
    if t is dict:
        return "object"
    return t.__name__


def _describe_value(v: Any) -> str:
    kind = _json_kind(v)
    if kind in ("boolean", "integer", "number", "string"):
        text = json.dumps(v)
        if len(text) > 60:
            text = text[:57] + "..."
        return f"{kind} {text}"
    return kind


def literal_values(t: Any) -> list:
    """A Literal's values in a stable order. (typing caches unions by equality, and Literals
    compare equal regardless of order, so declaration order does not survive ``X | None``.)"""
    return sorted(get_args(t), key=lambda v: (type(v).__name__, str(v)))


def describe_type(t: Any) -> str:
    """Human wording of a declared type, for error messages."""
    if t is Any:
        return "any JSON value"
    if t in (str, int, float, bool, NoneType):
        return {str: "string", int: "integer", float: "number", bool: "boolean", NoneType: "null"}[t]
    origin = get_origin(t)
    if origin is Literal:
        values = literal_values(t)
        return "one of " + ", ".join(json.dumps(x) for x in values) if len(values) > 1 \
            else json.dumps(values[0])
    if origin is list:
        return "array"
    if origin is dict or t is dict or attrs.has(t):
        return "object"
    if origin in _UNION_ORIGINS:
        parts: list[str] = []
        for arm in get_args(t):
            d = describe_type(arm)
            if d not in parts:
                parts.append(d)
        return " or ".join(parts)
    return getattr(t, "__name__", str(t))


def _fail(t: Any, v: Any) -> typing.NoReturn:
    raise ParamsError(f"expected {describe_type(t)}, got {_describe_value(v)}")


def _kinds(t: Any) -> frozenset[str]:
    """The JSON kinds a declared type can accept."""
    if t is Any:
        return frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
    if t is float:
        return frozenset({"integer", "number"})
    if t in (str, int, bool, NoneType):
        return frozenset({_json_kind({str: "", int: 0, bool: False, NoneType: None}[t])})
    origin = get_origin(t)
    if origin is Literal:
        return frozenset(_json_kind(x) for x in get_args(t))
    if origin is list:
        return frozenset({"array"})
    if origin is dict or t is dict or attrs.has(t):
        return frozenset({"object"})
    if origin in _UNION_ORIGINS:
        return frozenset().union(*(_kinds(a) for a in get_args(t)))
    return frozenset()


def split_optional(t: Any) -> tuple[Any, bool]:
    """``X | None | Omitted`` -> ``(X, True)``; ``X`` -> ``(X, False)``."""
    if get_origin(t) not in _UNION_ORIGINS:
        return t, False
    args = get_args(t)
    rest = [a for a in args if a is not NoneType and a is not Omitted]
    core = rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    return core, NoneType in args


# --- scalar hooks -------------------------------------------------------------------------

def _structure_str(v: Any, _: Any) -> str:
    if type(v) is str:
        return v
    _fail(str, v)


def _in_range(v: int) -> int:
    if -MAX_JSON_INT <= v <= MAX_JSON_INT:
        return v
    raise ParamsError(f"expected a number within a double's range (at most 1.8e308 in size), got {_describe_value(v)}")


def _structure_int(v: Any, _: Any) -> int:
    if type(v) is int:
        return _in_range(v)
    _fail(int, v)


def _structure_float(v: Any, _: Any) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return _in_range(v)
    _fail(float, v)


def _structure_bool(v: Any, _: Any) -> bool:
    if type(v) is bool:
        return v
    _fail(bool, v)


converter.register_structure_hook(str, _structure_str)
converter.register_structure_hook(int, _structure_int)
converter.register_structure_hook(float, _structure_float)
converter.register_structure_hook(bool, _structure_bool)


# --- generic hooks --------------------------------------------------------------------------

def _literal_factory(t: Any):
    values = get_args(t)

    def hook(v: Any, _: Any) -> Any:
        for x in values:
            if v == x and type(v) is type(x):
                return x
        _fail(t, v)

    return hook


def _list_factory(t: Any):
    (item_t,) = get_args(t) or (Any,)
    if item_t is Any:
        def passthrough(v: Any, _: Any) -> list:
            if type(v) is list:
                return v
            _fail(t, v)
        return passthrough
    item = converter.get_structure_hook(item_t)

    def hook(v: Any, _: Any) -> list:
        if type(v) is not list:
            _fail(t, v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x, item_t))
            except ParamsError as e:
                raise e.at(i) from None
        return out

    return hook


def _dict_factory(t: Any):
    args = get_args(t)
    value_t = args[1] if len(args) == 2 else Any
    if value_t is Any:
        def passthrough(v: Any, _: Any) -> dict:
            if type(v) is dict:
                return v
            _fail(t, v)
        return passthrough
    value = converter.get_structure_hook(value_t)

    def hook(v: Any, _: Any) -> dict:
        if type(v) is not dict:
            _fail(t, v)
        out = {}
        for k, x in v.items():
            try:
                out[k] = value(x, value_t)
            except ParamsError as e:
                raise e.at(k) from None
        return out

    return hook


def find_tag(classes: list[type]) -> str | None:
    """A field every class declares as a one-value ``Literal`` with distinct values."""
    common = None
    for c in classes:
        names = {f.name for f in attrs.fields(c)
                 if get_origin(f.type) is Literal and len(get_args(f.type)) == 1}
        common = names if common is None else common & names
    for name in sorted(common or ()):
        values = [get_args(attrs.fields_dict(c)[name].type)[0] for c in classes]
        if len(set(values)) == len(values):
            return name
    return None


def _tagged_hook(t: Any, classes: list[type], tag: str):
    key = wire_name(tag)
    by_value = {get_args(attrs.fields_dict(c)[tag].type)[0]: c for c in classes}
    hooks = {value: converter.get_structure_hook(c) for value, c in by_value.items()}
    choices = typing.Literal[tuple(sorted(by_value))]

    def hook(v: Any, _: Any) -> Any:
        if type(v) is not dict:
            _fail(t, v)
        if key not in v:
            raise ParamsError("missing required field", path=(key,))
        tag_value = v[key]
        h = hooks.get(tag_value) if type(tag_value) is str else None
        if h is None:
            try:
                _fail(choices, tag_value)
            except ParamsError as e:
                raise e.at(key) from None
        return h(v, by_value[tag_value])

    return hook


def _union_factory(t: Any):
    arms = list(get_args(t))
    objects = [a for a in arms if attrs.has(a)]
    tag = find_tag(objects) if len(objects) > 1 else None
    candidates: list[tuple[frozenset[str], Any, Any]] = []
    for arm in arms:
        if tag and arm in objects:
            if arm is objects[0]:
                sub = typing.Union[tuple(objects)]
                candidates.append((frozenset({"object"}), sub, _tagged_hook(sub, objects, tag)))
            continue
        candidates.append((_kinds(arm), arm, converter.get_structure_hook(arm)))

    def hook(v: Any, _: Any) -> Any:
        kind = _json_kind(v)
        error = None
        for kinds, arm, h in candidates:
            if kind in kinds:
                try:
                    return h(v, arm)
                except ParamsError as e:
                    error = error or e
        if error is not None:
            raise error
        _fail(t, v)

    return hook


# --- attrs classes ------------------------------------------------------------------------

@attrs.frozen
class _Field:
    name: str          # python attribute
    key: str           # wire key
    type: Any          # declared type without None/Omitted
    hook: Any
    required: bool
    nullable: bool
    any_json: bool
    by: tuple | None   # (sibling attribute, {sibling value: type}) for kind-selected fields


def wire_fields(cls: type) -> list[_Field]:
    """The wire view of a wire type's fields (also used by the schema generator)."""
    out = []
    for f in attrs.fields(cls):
        core, has_none = split_optional(f.type)
        # a one-value Literal (``provider``, ``kind``) is a tag: required on the wire even
        # though python code may leave it to its default
        is_tag = get_origin(core) is Literal and len(get_args(core)) == 1
        required = f.default is attrs.NOTHING or is_tag
        by = f.metadata.get("by")
        out.append(_Field(
            name=f.name,
            key=f.metadata.get("wire") or wire_name(f.name),
            type=core,
            hook=None if by else converter.get_structure_hook(core),
            required=required,
            nullable=has_none and (required or f.default is OMITTED),
            any_json=core is Any,
            by=(by[0], {k: (c, converter.get_structure_hook(c)) for k, c in by[1].items()}) if by else None,
        ))
    return out


def _attrs_structure_factory(cls: type):
    fields = wire_fields(cls)
    keys = frozenset(f.key for f in fields)
    forbid = getattr(cls, "__wire_extra__", "forbid") == "forbid"
    check = getattr(cls, "__wire_check__", None)

    def hook(data: Any, _: Any = None) -> Any:
        if type(data) is not dict:
            raise ParamsError(f"expected an object, got {_describe_value(data)}")
        if forbid:
            unknown = [k for k in data if k not in keys]
            if unknown:
                names = ", ".join(json.dumps(k) for k in unknown)
                raise ParamsError(f"unknown field{'s' if len(unknown) > 1 else ''}: {names}",
                                  unknown_fields=unknown)
        kwargs: dict[str, Any] = {}
        for f in fields:
            if f.key not in data:
                if f.required:
                    raise ParamsError("missing required field", path=(f.key,))
                continue
            v = data[f.key]
            if v is None and not f.any_json:
                if not f.nullable:
                    raise ParamsError(f"expected {describe_type(f.type)}, got null", path=(f.key,))
                kwargs[f.name] = None
                continue
            try:
                if f.by:
                    t, h = f.by[1][kwargs[f.by[0]]]
                    kwargs[f.name] = h(v, t)
                else:
                    kwargs[f.name] = f.hook(v, f.type)
            except ParamsError as e:
                raise e.at(f.key) from None
        obj = cls(**kwargs)
        if check is not None:
            check(obj)
        return obj

    return hook


def _unstructure_value(v: Any) -> Any:
    if type(v) in _SCALARS:
        return v
    return converter.unstructure(v)


def _attrs_unstructure_factory(cls: type):
    spec = [(f.name, f.metadata.get("wire") or wire_name(f.name), f.default is None)
            for f in attrs.fields(cls)]

    def hook(obj: Any) -> dict:
        out = {}
        for name, key, skip_none in spec:
            v = getattr(obj, name)
            if v is OMITTED or (v is None and skip_none):
                continue
            out[key] = v if type(v) in _SCALARS else converter.unstructure(v)
        return out

    return hook


converter.register_structure_hook_factory(lambda t: get_origin(t) is Literal, _literal_factory)
converter.register_structure_hook_factory(lambda t: get_origin(t) is list, _list_factory)
converter.register_structure_hook_factory(lambda t: get_origin(t) is dict, _dict_factory)
converter.register_structure_hook_factory(lambda t: get_origin(t) in _UNION_ORIGINS, _union_factory)
converter.register_structure_hook_factory(attrs.has, _attrs_structure_factory)
converter.register_unstructure_hook_factory(attrs.has, _attrs_unstructure_factory)


# --- public -------------------------------------------------------------------------------

def structure(cls: type, data: Any) -> Any:
    """Wire JSON -> ``cls`` instance. A missing ``params`` (``None``) and an empty
    by-position ``[]`` mean ``{}``. Raises :class:`ParamsError` (-32602) naming the field."""
    if data is None or (type(data) is list and not data):
        data = {}
    return converter.structure(data, cls)


def unstructure(obj: Any) -> Any:
    """Wire type instance (or list/dict of them, or plain JSON) -> plain JSON value."""
    return _unstructure_value(obj)
