"""Building blocks shared by the wire type modules: the ``@wire`` decorator, the
``OMITTED`` sentinel, JSON aliases and the snake_case -> camelCase rule."""

import enum
from typing import Any

import attrs

__all__ = ["OMITTED", "Omitted", "is_omitted", "JsonValue", "JsonObject", "JsonSchema", "Id", "wire", "wire_name"]

# Free-form JSON stays plain JSON (dict/list/str/int/float/bool/None), never a class.
JsonValue = Any
JsonObject = dict[str, Any]
JsonSchema = dict[str, Any]  # a JSON Schema (draft 2020-12) object, kept as plain JSON
Id = int | str               # JSON-RPC ids and progress tokens are opaque


class Omitted(enum.Enum):
    """Type of :data:`OMITTED`: "the field was not on the wire".

    Used as the default only where ``null`` is itself a legal value that means something
    else than omission (``Settings.stateDir``, ``FieldModel.default``, ``ScriptedEntry.json``).
    Every other optional field defaults to ``None`` (= omitted) and rejects an explicit
    ``null``. ``OMITTED`` is falsy and never unstructured.
    """

    OMITTED = "OMITTED"

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "OMITTED"


OMITTED = Omitted.OMITTED


def is_omitted(value: Any) -> bool:
    return value is OMITTED


def wire_name(python_name: str) -> str:
    """``branch_id`` -> ``branchId`` (the only naming rule; override with field metadata ``wire``)."""
    head, *rest = python_name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def wire(cls: type | None = None, *, extra: str = "forbid"):
    """Declare a wire type: an ``attrs`` class (keyword-only, slotted).

    ``extra="forbid"`` (default): unknown keys are rejected and named.
    ``extra="ignore"``: unknown keys are dropped (objects clients may extend, e.g. capabilities).
    """
    if extra not in ("forbid", "ignore"):
        raise ValueError(extra)

    def apply(c: type) -> type:
        c = attrs.define(kw_only=True)(c)
        c.__wire_extra__ = extra
        return c

    return apply if cls is None else apply(cls)
