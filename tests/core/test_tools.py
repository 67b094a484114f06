"""Tools and the registry (D2 tool-schema publication; docs/PIPELINE.md: tool schemas are valid JSON Schema)."""

from __future__ import annotations

from typing import Optional

import jsonschema
import pytest

from operate_sidecar.server.core import Tool, ToolArgumentError, ToolCallContext, ToolNotRegistered, ToolRegistry, tool

pytestmark = pytest.mark.anyio

CTX = ToolCallContext(branch_id="b", call_id="c")


def typed(count: int, ratio: float, name: str, flag: bool, items: list[str], limit: int | None = None,
          legacy: Optional[int] = None, **extra) -> dict:
    """Do typed things.

    More detail that is not the summary.

    Args:
        count: how many.
        ratio: a fraction
            spanning two lines.
        name: the name.
    """
    return {"count": count, "limit": limit}


def test_schema_maps_int_to_integer_and_int_or_none_works():
    """DESIGN: int → "integer" (not "number"); int | None and Optional[int] are accepted."""
    t = Tool.from_function(typed)
    props = t.input_schema["properties"]
    assert props["count"]["type"] == "integer"
    assert props["ratio"]["type"] == "number"
    assert props["flag"]["type"] == "boolean"
    assert props["items"] == {"type": "array", "items": {"type": "string"}}
    assert {"type": "integer"} in props["limit"]["anyOf"] and {"type": "null"} in props["limit"]["anyOf"]
    assert {"type": "integer"} in props["legacy"]["anyOf"]


def test_schema_is_valid_json_schema_with_only_required_params_required():
    """DESIGN: tool schemas are valid JSON Schema; defaulted parameters are not required."""
    t = Tool.from_function(typed)
    jsonschema.Draft202012Validator.check_schema(t.input_schema)
    assert t.input_schema["type"] == "object"
    assert sorted(t.input_schema["required"]) == ["count", "flag", "items", "name", "ratio"]
    assert "extra" not in t.input_schema["properties"]


def test_descriptions_come_from_the_docstring():
    """Tools: the description is the docstring summary; Args lines describe parameters."""
    t = Tool.from_function(typed)
    assert t.description == "Do typed things."
    assert t.input_schema["properties"]["count"]["description"] == "how many."
    assert t.input_schema["properties"]["ratio"]["description"] == "a fraction spanning two lines."


def test_openai_function_schema_shape():
    """D2: the published schema is the OpenAI function format wrapping the input schema."""
    t = Tool.from_function(typed)
    assert t.schema() == {"type": "function", "function": {"name": "typed", "description": "Do typed things.",
                                                           "parameters": t.input_schema}}


async def test_arguments_validated_before_invocation():
    """docs/PROTOCOL.md §4: arguments are validated against the schema; a mismatch raises before invocation."""
    seen = []

    def f(n: int) -> int:
        seen.append(n)
        return n

    t = Tool.from_function(f)
    for bad in ({}, {"n": "x"}, {"n": 1, "zz": 2}, [1]):
        with pytest.raises(ToolArgumentError):
            t.validate_arguments(bad)
    assert seen == []
    assert await t.call(t.validate_arguments({"n": 3}), CTX) == 3
    assert seen == [3]


async def test_sync_and_async_functions_are_invoked():
    """Tools: sync functions run (in a worker thread) and async functions are awaited."""
    def sync_add(a: int, b: int = 2) -> int:
        return a + b

    async def async_add(a: int) -> int:
        return a + 1

    s, a = Tool.from_function(sync_add), Tool.from_function(async_add)
    assert await s.call(s.validate_arguments({"a": 1}), CTX) == 3
    assert await a.call(a.validate_arguments({"a": 1}), CTX) == 2


def test_tool_decorator_sets_name_read_only_and_timeout():
    """Tools: @tool marks read_only, timeout and a name."""
    @tool(read_only=True, timeout=1.5, name="lookup")
    def f(q: str) -> str:
        return q

    t = Tool.from_function(f)
    assert (t.name, t.read_only, t.timeout) == ("lookup", True, 1.5)


async def test_tool_with_explicit_schema_validates_with_jsonschema():
    """docs/PROTOCOL.md §4: tools declared with a JSON Schema (client/MCP) validate arguments against it."""
    async def func(args, ctx):
        return args["q"]

    t = Tool(name="client", description="d", input_schema={"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}, func=func, source="client")
    with pytest.raises(ToolArgumentError):
        t.validate_arguments({"q": 1})
    assert await t.call(t.validate_arguments({"q": "ok"}), CTX) == "ok"


def test_registry_rejects_duplicate_names_unless_update():
    """Tools: registering a taken name fails unless update=True."""
    reg = ToolRegistry()

    def f() -> None: ...

    first = reg.register(f)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(f)
    second = reg.register(Tool.from_function(f), update=True)
    assert reg.get("f") is second and second is not first


def test_registry_resolve_selectors():
    """D2: selectors are True/None (all), a name, a Tool, a callable (auto-registered) or a list of them."""
    reg = ToolRegistry()

    def a() -> None: ...

    def b() -> None: ...

    reg.register(a)
    assert [t.name for t in reg.resolve(True)] == ["a"]
    assert [t.name for t in reg.resolve(None)] == ["a"]
    assert [t.name for t in reg.resolve("a")] == ["a"]
    assert [t.name for t in reg.resolve([b])] == ["b"]
    assert "b" in reg
    with pytest.raises(ToolNotRegistered, match="Tool nope is not registered"):
        reg.resolve(["a", "nope"])


def test_get_tool_schema_wraps_selected_schemas():
    """D2: get_tool_schema returns {"tools": [...]} for the selected tools."""
    reg = ToolRegistry()

    def a() -> None: ...

    def b() -> None: ...

    reg.register(a)
    reg.register(b)
    assert reg.get_tool_schema(["b"]) == {"tools": [reg.get("b").schema()]}
    assert [s["function"]["name"] for s in reg.get_tool_schema()["tools"]] == ["a", "b"]


async def test_tools_from_one_function_read_its_signature_once_and_own_their_schemas(monkeypatch):
    """Every workspace's builtin tools are bound methods of another instance: the signature is
    read into an arguments model once, and each tool still gets a schema of its own and calls
    its own instance."""
    from operate_sidecar.server.core import tools as T

    class Folder:
        def __init__(self, root: str) -> None:
            self.root = root

        def where(self, path: str, depth: int = 1) -> str:
            """Say where a path is.

            Args:
                path: the path
            """
            return f"{self.root}/{path}@{depth}"

    built = []
    real = T._doc_parts
    monkeypatch.setattr(T, "_doc_parts", lambda fn: built.append(fn) or real(fn))
    a, b = Tool.from_function(Folder("a").where), Tool.from_function(Folder("b").where)
    assert len(built) == 1                                          # read once
    assert a.input_schema == b.input_schema and a.input_schema is not b.input_schema
    a.input_schema["properties"].clear()                            # one tool's schema is its own
    assert b.input_schema["properties"]["path"]["description"] == "the path"
    assert b.description == "Say where a path is."
    assert await a.call({"path": "x"}, CTX) == "a/x@1" and await b.call({"path": "y", "depth": 2}, CTX) == "b/y@2"
    assert b.validate_arguments({"path": "y"}) == {"path": "y"}    # checked by the shared model
    with pytest.raises(ToolArgumentError):
        b.validate_arguments({"path": "y", "nope": 1})
