"""What ``registerClientTools`` refuses before anything is registered (docs/PROTOCOL.md §4): an
``inputSchema`` nested deeper than 64 levels (it ran the metaschema's check out of stack: a
-32603 and a traceback thousands of lines long), a name no model could call; and a -32603's
log line, whose traceback is written only with ``--debug`` (§8). The real server over pipes."""

from __future__ import annotations

import pytest

from .support import Sidecar, scripted

CLIENT_TOOLS = {"clientTools": True}


def _nested(levels: int, key: str) -> dict:
    """An object schema whose property ``x`` nests ``levels`` schemas by ``key``."""
    inner: dict = {}
    for _ in range(levels):
        inner = {"type": "object", "properties": {"a": inner}} if key == "properties" else {"items": inner}
    return {"type": "object", "properties": {"x": inner}}


def _tool(name: str, schema: dict | None = None) -> dict:
    return {"name": name, "description": "d", "inputSchema": schema or {"type": "object", "properties": {}}}


@pytest.mark.parametrize("levels,key", [(100, "properties"), (400, "items"), (40, "properties")])
def test_an_input_schema_nested_too_deeply_is_refused_saying_where(sidecar, levels, key):
    sidecar.init(models={"s": scripted("x")}, capabilities=CLIENT_TOOLS)
    err = sidecar.error_of("registerClientTools", {"tools": [_tool("ok"), _tool("deep", _nested(levels, key))]})
    assert err.code == -32602, err.message
    assert "nested too deeply" in err.message and "the limit is 64 levels" in err.message
    assert err.data["limit"] == 64 and err.data["path"].startswith(f"/properties/x/{key}/")
    names = [t["name"] for t in sidecar.request("listTools", {})["tools"]]
    assert "ok" not in names and "deep" not in names  # none of the call's tools
    assert "Traceback" not in sidecar.stderr_text() and "RecursionError" not in sidecar.stderr_text()
    assert sidecar.request("ping") == {}


def test_an_input_schema_within_the_nesting_bound_is_registered(sidecar):
    sidecar.init(models={"s": scripted("x")}, capabilities=CLIENT_TOOLS)
    schema = _nested(30, "properties")  # 62 levels of objects
    assert sidecar.request("registerClientTools", {"tools": [_tool("deep", schema)]}) == {"registered": ["deep"]}


@pytest.mark.parametrize("name", ["", "a b/../\n", "tab\there", "bell\x07", "del\x7f", "nbsp\u00a0", "x" * 129,
                                  "rm\u202efdp", "zero\u200bwidth", "bom\ufeff", "line\u2028sep", "para\u2029sep"])
def test_a_tool_name_no_model_could_call_is_refused(sidecar, name):
    sidecar.init(models={"s": scripted("x")}, capabilities=CLIENT_TOOLS)
    err = sidecar.error_of("registerClientTools", {"tools": [_tool("fine"), _tool(name)]})
    assert err.code == -32602 and err.message.startswith("tools[1].name: the tool name "), err.message
    assert err.data["path"] == "tools[1].name"
    names = [t["name"] for t in sidecar.request("listTools", {})["tools"]]
    assert "fine" not in names and name not in names


def test_a_name_of_128_characters_is_registered(sidecar):
    sidecar.init(models={"s": scripted("x")}, capabilities=CLIENT_TOOLS)
    name = "n" * 128
    assert sidecar.request("registerClientTools", {"tools": [_tool(name)]}) == {"registered": [name]}


def test_a_name_with_letters_of_any_script_is_registered(sidecar):
    sidecar.init(models={"s": scripted("x")}, capabilities=CLIENT_TOOLS)
    names = ["café_tool", "名前", "ツール-2"]
    assert sidecar.request("registerClientTools", {"tools": [_tool(n) for n in names]}) == {"registered": names}


def test_a_name_with_an_invisible_format_character_is_refused_saying_which(sidecar):
    sidecar.init(models={"s": scripted("x")}, capabilities=CLIENT_TOOLS)
    err = sidecar.error_of("registerClientTools", {"tools": [_tool("rm\u202efdp")]})
    assert err.code == -32602 and "an invisible format character" in err.message and "U+202E" in err.message
    assert "\u202e" not in err.message  # (shown escaped, never as the override itself)


@pytest.mark.parametrize("debug", [False, True])
def test_an_internal_error_logs_its_traceback_only_with_debug(spawn, debug):
    c: Sidecar = spawn(*(["--debug"] if debug else []))
    c.init(models={"s": scripted("x")}, toolModules=["boom_patch"])
    c.request("listTools", {})  # loads the tool module that breaks branch lookup
    err = c.error_of("branchMessages", {"branchId": "b"})
    assert err.code == -32603
    c.close()
    log = c.stderr_text()
    assert "failed: internal error: " in log and "boom" in log  # one line says what failed
    assert ("Traceback" in log) is debug, log[-2000:]


def _wide_and_deep(numbers: int, levels: int) -> dict:
    """An object schema whose property ``x`` holds ``numbers`` numbers (an ``enum``) under
    ``levels`` levels of ``items``."""
    inner: dict = {"enum": [0] * numbers}
    for _ in range(levels):
        inner = {"items": inner}
    return {"type": "object", "properties": {"x": inner}}


@pytest.mark.parametrize("levels", [58, 70])
def test_the_nesting_check_of_a_wide_body_takes_memory_for_its_depth_not_its_size(levels):
    """The walk keeps one iterator per level, not every value with its path: 300 000 numbers
    58 levels deep took over 100 MiB (a 23 MiB body, gigabytes), and take kilobytes now. In
    process (``tracemalloc`` counts what the check allocates, not the body made before)."""
    import tracemalloc

    from operate_sidecar.server.rpc import settings as S
    from operate_sidecar.server.service.errors import RpcError
    from operate_sidecar.server.service.schemas import check_depth

    schema = _wide_and_deep(300_000, levels)
    tracemalloc.start()
    try:
        try:
            check_depth(schema, "tool 'w': inputSchema")
            refused = None
        except RpcError as e:
            refused = e
        S.check_depth(schema, limit=100)  # the settings' check, the same walk: all of it walked
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if levels + 3 > 64:  # (the object, properties, x: 3 levels above the first ``items``)
        assert refused is not None and refused.code == -32602 and refused.data["limit"] == 64
        assert refused.data["path"] == "/properties/x" + "/items" * 62
    else:
        assert refused is None
    assert peak < 4 * 2**20, f"{peak / 2**20:.0f} MiB"
