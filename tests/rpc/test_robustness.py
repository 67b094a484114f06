"""Any params to any method get an answer (result or a JSON-RPC error), never a hang,
never a dead server, never a byte that is not a frame."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .support import RpcError, Sidecar, scripted

METHODS = ["initialize", "createBranch", "forkBranch", "deleteBranch", "listBranches", "branchMessages",
           "listTools", "authorizeTool", "registerClientTools", "operate", "noSuchMethod"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
keys = st.sampled_from(["branchId", "instruction", "tools", "responseFormat", "fieldModels", "chatModel",
                        "decision", "tool", "offset", "limit", "settings", "instruct", "modelOptions",
                        "actions", "name", "system", "x"])
params = st.dictionaries(keys, json_values, max_size=4)


@pytest.fixture(scope="module")
def server():
    c = Sidecar()
    c.init(models={"s": scripted(*["reply"] * 500)})
    c.real_branch = c.branch()
    yield c
    c.kill()
    c.proc.wait(10)
    c.close_input()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(METHODS), params, st.booleans())
def test_any_params_get_an_answer(server, method, p, real_branch):
    if real_branch:
        p["branchId"] = server.real_branch
    try:
        server.request(method, p, timeout=20)
    except RpcError as e:
        assert e.code in (-32600, -32601, -32602, -32010, -32011, -32012), (method, p, e)
    assert server.proc.poll() is None
    assert server.stream_errors == []
