"""Hostile params of every method (docs/PROTOCOL.md §2–§5, §8): random JSON and mutations
of valid params (dropped/added fields, wrong types, unknown tools and branch ids, bad schemas
in responseFormat/fieldModels, bad enums and model configs). Every answer must be a result
that matches the method's result type, or an error whose code docs/PROTOCOL.md §8 allows for that
method and input (-32602 bad params, -32012 unknown branch, -32010/-32011 only from operate,
-32010 only with handleValidation "raise"); never -32603, never a traceback; after each
input the server answers a ping (alive, in sync). One server process for the module, with
the scripted model and fast parse options so operate calls that pass validation finish at
once. ``shutdown`` is excluded (it would end the session)."""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operate_sidecar import protocol
from frame_model import json_values
from fuzz_support import (OUTCOMES, ERROR_CODES, OPERATE_TIMEOUT, REQUEST_TIMEOUT, FuzzServer, encode, frame,
                          fuzz_server_fixture, has_traceback, profile, run_example)

ANSWER = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
FAST_PARSE = {"retryAttempts": 1, "retryInitialDelay": 0, "retryBackoff": 1, "maxConcurrent": 1, "throttlePeriod": 0}
SCRIPTED = {"provider": "scripted", "responses": ['{"answer": "ok", "score": 1, "reason": "r"}'] * 20000}
INIT = {"clientInfo": {"name": "fuzz-params"}, "capabilities": {"toolPermission": False, "clientTools": True},
        "settings": {"models": {"s": SCRIPTED}, "defaultModel": "s", "toolModules": ["slow_tools"],
                     "permissionTimeoutMs": 1000}}

METHODS = ["initialize", "ping", "createBranch", "forkBranch", "deleteBranch", "listBranches", "branchMessages",
           "listTools", "authorizeTool", "registerClientTools", "operate"]
BRANCH_METHODS = {"forkBranch", "deleteBranch", "branchMessages", "listTools", "authorizeTool", "operate"}
ALLOWED: dict[str, set[int]] = {
    "initialize": {-32600},                 # initialize after initialize: refused, whatever its params
    "ping": {-32602},                       # {} for no params; any key is unknown (§14)
    "createBranch": {-32602},
    "listBranches": {-32602},
    "registerClientTools": {-32602},
    **{m: {-32602, -32012} for m in BRANCH_METHODS},
}
ALLOWED["operate"] = {-32602, -32012, -32010, -32011}

FIELDS: dict[str, list[str]] = {
    "initialize": ["protocolVersion", "clientInfo", "processId", "capabilities", "workspaceFolders", "settings"],
    "ping": [],
    "createBranch": ["system", "chatModel", "parseModel", "name"],
    "forkBranch": ["branchId"], "deleteBranch": ["branchId"], "listBranches": [],
    "branchMessages": ["branchId", "offset", "limit"],
    "listTools": ["branchId"],
    "authorizeTool": ["tool", "decision", "branchId"],
    "registerClientTools": ["tools"],
    "operate": ["branchId", "instruct", "instruction", "guidance", "context", "chatModel", "parseModel",
                "responseFormat", "fieldModels", "reason", "actions", "invokeActions", "tools", "actionStrategy",
                "verboseAction", "handleValidation", "skipValidation", "clearMessages", "streamPersist",
                "persistDir", "snapshotDir", "parseOptions", "modelOptions", "workDoneToken"],
}

PROFILES = [pytest.param(profile("fast", 120), id="fast"),
            pytest.param(profile("stress", 4000), id="stress", marks=pytest.mark.slow)]

SURROGATES = ["\ud800", "\udfff", "x\udc80y", "\udbff\udc00\ud800"]


class ParamsServer(FuzzServer):
    def on_start(self) -> None:
        self.branches: list[str] = [self._create() for _ in range(3)]
        self.extra: list[str] = []
        self.client_tools: list[str] = []

    def _create(self) -> str:
        return self.c.request("createBranch", {"name": "pool"}, timeout=REQUEST_TIMEOUT)["branchId"]

    def tidy(self) -> None:
        """Keep the server's state small: refill the pool, drop extra branches."""
        while len(self.branches) < 3:
            self.branches.append(self._create())
        if len(self.extra) > 20:
            for b in self.extra:
                try:
                    self.c.request("deleteBranch", {"branchId": b}, timeout=REQUEST_TIMEOUT)
                except protocol.RpcError:
                    pass
                except Exception:
                    pass
            self.extra = []

    def tools(self) -> list[str]:
        return ["echo_tool", "slow_tool", "failing_tool"] + self.client_tools[-5:]


@pytest.fixture(scope="module")
def server():
    yield from fuzz_server_fixture(ParamsServer(INIT, "params"))


# ---------------------------------------------------------------------- generators
def texts(surrogates: bool):
    t = st.text(max_size=30)
    if surrogates:
        t = st.one_of(t, st.tuples(t, st.sampled_from(SURROGATES), t).map("".join))
    return t


def bad_values(key: str, s: ParamsServer, surrogates: bool) -> st.SearchStrategy:
    txt = texts(surrogates)
    pools: dict[str, list] = {
        "branchId": ["nope", "", "b" * 300, 5, None, [s.branches[0]], {"id": s.branches[0]}],
        "chatModel": ["nope", 5, {}, {"provider": "nope"}, {"provider": "scripted"}, {"provider": "scripted", "responses": "x"},
                      {"provider": "scripted", "responses": [{"error": "boom"}]}, {"provider": "scripted", "responses": []},
                      {"provider": "scripted", "responses": [{"delayMs": "x"}]}, {"provider": "scripted", "responses": [5]},
                      {"provider": "scripted", "responses": ["x"], "cli": "yes"}, {"provider": "scripted", "responses": ["x"], "z": 1},
                      {"provider": "local", "path": 5}, {"provider": "openai"}, {"provider": "openai", "model": 5},
                      {"provider": "cli", "profile": "nope", "command": []}, {"provider": "cli", "profile": "llm"},
                      {"provider": "cli", "profile": "jsonl", "command": "x"}, {"provider": None}, [], True],
        "responseFormat": [{"type": "string"}, {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                           {"type": "object", "properties": 5}, {"type": "object", "required": "a"},
                           {"type": "object", "required": ["missing"]},
                           {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, {"$ref": "http://x/y"},
                           {"type": "object", "if": {}}, {"type": "object", "properties": {"a": {"enum": []}}},
                           {"type": "object", "properties": {"a": {"type": "array", "items": 5}}},
                           {"type": "object", "properties": {"a": {"anyOf": []}}}, {"type": "object", "title": 5},
                           {"type": "object", "title": "class"}, {"type": "object", "title": "1 bad name!"},
                           {"type": "object", "title": ""}, {"type": "object", "properties": {"": {"type": "string"}}},
                           {"type": "object", "properties": {"model_config": {"type": "string"}}},
                           {"type": "object", "properties": {"schema": {"type": "string"}}},
                           {"type": "object", "properties": {"model_fields": {"type": "string"}}},
                           {"type": "object", "properties": {"model_dump": {"type": "string"}}},
                           {"type": "object", "properties": {"__class__": {"type": "string"}}},
                           {"type": "object", "properties": {"a b-c": {"type": "string"}}},
                           {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},
                           {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}},
                           {"type": ["object", "null"]}, {"type": "object", "properties": {"a": {"$ref": "#"}}},
                           {"type": "object", "properties": {"a": {"type": "string", "format": "nonsense"}}},
                           {"type": "object", "properties": {"action_requests": {"type": "string"}}},
                           {"type": "object", "properties": {"action_responses": {"type": "integer"}}},
                           {"type": "object", "properties": {"reason": {"type": "integer"}}},
                           {"type": "object", "properties": {"a": {"type": "string", "default": 5}}},
                           {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"$ref": "#/properties/a"}}}}},
                           {"type": "object", "$defs": {"X": 5}, "properties": {"a": {"$ref": "#/$defs/X"}}},
                           {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"type": "integer"}]}}},
                           {"type": "object", "properties": {"a": {"const": {"x": [1]}}}},
                           {"type": "object", "properties": {"a": True}}, {"type": "object", "properties": {"a": None}},
                           True, False, [], "x", {}, {"type": None}],
        "fieldModels": [[{"name": "1x", "schema": {"type": "string"}}], [{"name": "a"}], [{"name": "a", "schema": 5}],
                        [{"name": "class", "schema": {}}], [{"name": "a", "schema": {"type": "string"}},
                                                            {"name": "a", "schema": {"type": "integer"}}],
                        [{"name": "answer", "schema": {"type": "integer"}}], [{"name": "reason", "schema": {}}],
                        [{"name": "action_requests", "schema": {}}], [{"name": "a", "schema": {"type": "bogus"}}],
                        [{"name": "a", "schema": {"type": "string"}, "default": 5}], [{"name": "model_config", "schema": {}}],
                        [{"name": "model_dump", "schema": {}}], [{"name": "model_fields", "schema": {}}],
                        [{"name": "_private", "schema": {}}], [{"name": "", "schema": {}}], "x", [5], [None], [],
                        [{"name": "a", "schema": {"$ref": "#/nope"}}], [{"name": "a", "schema": {"if": {}}}],
                        [{"name": "a", "schema": {"type": "object", "properties": {"b": {"type": "nonsense"}}}}]],
        "tools": [["nope"], [5], True, False, "echo_tool", [], ["echo_tool", "echo_tool"], [None], {"echo_tool": True}],
        "actionStrategy": ["parallel", 5, None, "", "Concurrent"],
        "handleValidation": ["explode", True, None, "RAISE"],
        "parseOptions": [{"retryAttempts": -1}, {"maxConcurrent": 0}, {"maxConcurrent": -1}, {"retryInitialDelay": -1},
                         {"retryBackoff": -1}, {"throttlePeriod": -1}, {"retryAttempts": "3"}, {"unknownOpt": 1},
                         {"retryAttempts": 1.5}, {"retryAttempts": True}, 5, [], None],
        "modelOptions": [{"request_model": 1}, {"imodel": 1}, {"operativeModel": 1}, {"instruction": "x"},
                         {"branch": 1}, {"tools": 1}, {"temperature": "hot"}, {"response_format": 1},
                         {"skip_validation": True}, 5, [], None],
        "instruct": [{"instruction": 5}, {"actionStrategy": "x"}, {"unknown": 1}, "x", {"reason": "yes"},
                     {"actions": 1}, {"guidance": {"deep": [[[[]]]]}}, {}, None, []],
        "workDoneToken": [1.5, [], True, {}, None, ""],
        "offset": [-1, 1.5, "1", True, 10**30, -10**30, None],
        "limit": [-1, 1.5, "1", False, 10**30, None, 0],
        "decision": ["always", "", None, "ALLOW", "allow_once", 1],
        "tool": ["nope", 5, "", "echo_tool ", None, ["echo_tool"]],
        "tools_register": [[{"name": "echo_tool", "description": "d", "inputSchema": {"type": "object"}}],
                           [{"name": ""}], [{"name": 5}], [{"name": "x", "inputSchema": {"type": "string"}}],
                           [{"name": "x", "inputSchema": 5}], [{"name": "dup", "inputSchema": {"type": "object"}}] * 2,
                           [{"name": "x", "inputSchema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}],
                           "x", [None], [5], [{"name": "a b/c", "inputSchema": {"type": "object"}}],
                           [{"name": "x", "description": 5, "inputSchema": {"type": "object"}}],
                           [{"name": "x", "inputSchema": {"type": "object"}, "extra": 1}]],
        "persistDir": ["persist", "/proc/forbidden/x", 5, "", "\x00bad"],
        "context": [{"deep": json.loads("[" * 200 + "]" * 200)}, "x" * 100_000, [None] * 100],
        "settings": [{"models": {"s": {"provider": "scripted", "responses": []}}}, {"unknown": 1}, 5, None],
        "protocolVersion": [2, "1", None, 0],
    }
    pools["parseModel"] = pools["chatModel"]
    pools["snapshotDir"] = pools["persistDir"]
    pools["guidance"] = pools["context"]
    if key == "tools" and s is not None and s.__dict__.get("_method") == "registerClientTools":
        key = "tools_register"
    pool = pools.get(key, [])
    generic = json_values | txt
    return st.sampled_from(pool) | generic if pool else generic


@st.composite
def valid_params(draw, method: str, s: ParamsServer, surrogates: bool) -> dict:
    txt = texts(surrogates)
    b = s.branches[draw(st.integers(0, 2)) % len(s.branches)]  # the pool changes: draw an index
    if method == "initialize":
        return {"clientInfo": {"name": draw(txt)}, "protocolVersion": 1, "settings": {"models": {"s": SCRIPTED}}}
    if method in ("ping", "listBranches"):
        return {}
    if method == "createBranch":
        return {k: v for k, v in {"system": draw(txt), "chatModel": "s", "parseModel": "s", "name": draw(txt)}.items()
                if draw(st.booleans())}
    if method in ("forkBranch", "deleteBranch"):
        return {"branchId": b}
    if method == "branchMessages":
        return {"branchId": b, "offset": draw(st.integers(0, 5)), "limit": draw(st.integers(0, 50))}
    if method == "listTools":
        return {"branchId": b} if draw(st.booleans()) else {}
    if method == "authorizeTool":
        tools = s.tools()
        p = {"tool": tools[draw(st.integers(0, 7)) % len(tools)], "decision": draw(st.sampled_from(["allow", "deny", "ask"]))}
        if draw(st.booleans()):
            p["branchId"] = b
        return p
    if method == "registerClientTools":
        return {"tools": [{"name": f"ct_{uuid.uuid4().hex[:10]}", "description": draw(txt),
                           "inputSchema": {"type": "object", "properties": {"a": {"type": "string"}}}}
                          for _ in range(draw(st.integers(0, 2)))]}
    assert method == "operate"
    p: dict[str, Any] = {"branchId": b, "parseOptions": dict(FAST_PARSE)}
    if draw(st.booleans()):
        p["instruction"] = draw(txt)
    else:
        p["instruct"] = {"instruction": draw(txt), "guidance": draw(json_values), "context": draw(json_values)}
    optional = {
        "responseFormat": ANSWER, "fieldModels": [{"name": "score", "schema": {"type": "integer"}, "default": 0}],
        "reason": True, "actions": draw(st.booleans()), "invokeActions": draw(st.booleans()),
        "tools": draw(st.sampled_from([True, ["echo_tool"], []])),
        "actionStrategy": draw(st.sampled_from(["concurrent", "sequential"])),
        "verboseAction": draw(st.booleans()), "handleValidation": draw(st.sampled_from(["return_value", "return_none", "raise"])),
        "skipValidation": draw(st.booleans()), "clearMessages": draw(st.booleans()),
        "modelOptions": {"temperature": 0}, "workDoneToken": draw(st.sampled_from(["tok", 7])),
        "guidance": draw(txt), "context": draw(json_values), "chatModel": "s", "parseModel": "s",
    }
    for k, v in optional.items():
        if draw(st.integers(0, 3)) == 0:
            p[k] = v
    return p


@st.composite
def mutated_params(draw, method: str, s: ParamsServer, surrogates: bool) -> Any:
    """Valid params with 1-3 mutations, or random JSON (mostly keyed by the method's fields)."""
    s.__dict__["_method"] = method
    fields = FIELDS[method]
    if draw(st.integers(0, 4)) == 0:  # random JSON params
        keys = st.sampled_from(fields) | texts(surrogates) if fields else texts(surrogates)
        return draw(st.dictionaries(keys, json_values | texts(surrogates), max_size=5))
    p = draw(valid_params(method, s, surrogates))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "unknown", "wrong", "bad", "bad", "nested"]))
        if op == "drop" and p:
            p.pop(draw(st.sampled_from(sorted(p))))
        elif op == "unknown":
            k = draw(texts(surrogates) | st.sampled_from(["_meta", "branch_id", "response_format", "id", "jsonrpc"]))
            if k not in fields:
                p[k] = draw(json_values)
        elif op in ("wrong", "bad") and fields:
            k = draw(st.sampled_from(fields))
            p[k] = draw(json_values) if op == "wrong" else draw(bad_values(k, s, surrogates))
        elif op == "nested":
            dicts = [k for k, v in p.items() if isinstance(v, dict) and k not in ("chatModel", "parseModel")]
            lists = [k for k, v in p.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
            if dicts or lists:
                k = draw(st.sampled_from(sorted(dicts + lists)))
                target = p[k] = copy.deepcopy(p[k])
                if isinstance(target, list):
                    target = target[0]
                sub = draw(st.sampled_from(sorted(target) + ["__new__"]))
                if sub == "__new__" or draw(st.booleans()):
                    target[draw(texts(surrogates))] = draw(json_values)
                elif draw(st.booleans()):
                    target.pop(sub, None)
                else:
                    target[sub] = draw(json_values | st.sampled_from(
                        [None, "", -1, "x", {"type": "bogus"}, [], "nope", "echo_tool"]))
    return p


# ---------------------------------------------------------------------- the check
def send(server: FuzzServer, method: str, params: Any) -> dict:
    """Send one request (ASCII-escaped JSON, so lone surrogates go as \\udXXX); its response."""
    c = server.c
    mid = server.fresh_id(method)
    pending = c.expect(mid)
    msg = {"jsonrpc": "2.0", "id": mid, "method": method, "params": params}
    c.send_raw(frame(encode(msg)))
    timeout = OPERATE_TIMEOUT if method == "operate" else REQUEST_TIMEOUT
    if not pending._done.wait(timeout):
        c.cancel(mid)  # a stuck request: cancel it, then report it as hung
        server.response(pending, 10.0)
        server.check_alive()
        raise AssertionError(f"{method} did not answer within {timeout}s (cancelled): params {params!r:.1500}")
    return server.response(pending, 1.0)


def check_params(server: ParamsServer, test: str, method: str, params: Any) -> None:
    def body() -> None:
        server.tidy()
        msg = send(server, method, params)
        outcome = "result" if "result" in msg else str(msg["error"].get("code"))
        OUTCOMES[f"{method} {outcome}"] = OUTCOMES.get(f"{method} {outcome}", 0) + 1
        shown = f"{method} params {json.dumps(params, ensure_ascii=True)[:1500]}"
        if "result" in msg:
            result = msg["result"]
            if method == "ping":
                assert result == {}, f"{shown}: {msg}"
            elif method != "initialize":
                try:
                    protocol.structure(protocol.result_type(method), result)
                except protocol.RpcError as e:
                    raise AssertionError(f"{shown}: result does not match its wire type ({e.message}): {result!r:.800}")
            assert method != "initialize", f"initialize after initialize succeeded: {shown}"
            if method in ("createBranch", "forkBranch"):
                server.extra.append(result["branchId"])
            elif method == "deleteBranch" and params.get("branchId") in server.branches:
                server.branches.remove(params["branchId"])
            elif method == "registerClientTools":
                server.client_tools.extend(result["registered"])
            return
        err = msg["error"]
        code = err.get("code")
        assert not has_traceback(err), f"traceback in error.data for {shown}: {err!r:.1500}"
        assert code != -32603, f"internal error on bad input: {shown} -> {err!r:.1500}"
        assert code in ERROR_CODES, f"code outside docs/PROTOCOL.md §8 for {shown}: {err}"
        assert code in ALLOWED[method], f"{code} is not a code {method} may answer bad params with: {shown} -> {err!r:.800}"
        if code == -32010:
            assert isinstance(params, dict) and params.get("handleValidation") == "raise", \
                f"-32010 without handleValidation 'raise': {shown} -> {err!r:.800}"
        if code == -32012:
            assert isinstance(params, dict) and "branchId" in params and params["branchId"] not in server.branches, \
                f"-32012 for a branch that exists: {shown} -> {err!r:.800}"

    run_example(server, test, body)


def fuzz_mutated_params(server: ParamsServer, prof, test: str, surrogates: bool) -> None:
    """Any method with mutated or random params (strings with lone surrogates if ``surrogates``)."""
    @prof
    @given(st.data())
    def inner(data):
        server.begin()
        server.tidy()
        method = data.draw(st.sampled_from(METHODS), label="method")
        params = data.draw(mutated_params(method, server, surrogates), label="params")
        check_params(server, test, method, params)

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_mutated_and_random_params_of_every_method_get_a_result_or_a_fitting_error(server, prof):
    fuzz_mutated_params(server, prof, "params.mutated", surrogates=False)


@pytest.mark.parametrize("prof", PROFILES)
def test_valid_params_of_every_method_succeed(server, prof):
    """The unmutated generators: every method answers a result (operate: the scripted reply)
    or, for operate with handleValidation "raise", at most -32010."""
    @prof
    @given(st.data())
    def inner(data):
        server.begin()
        server.tidy()
        method = data.draw(st.sampled_from([m for m in METHODS if m != "initialize"]), label="method")
        params = data.draw(valid_params(method, server, False), label="params")

        def body() -> None:
            server.tidy()
            msg = send(server, method, params)
            if "error" in msg:
                assert method == "operate" and msg["error"]["code"] == -32010 and \
                    params.get("handleValidation") == "raise", f"{method} {params!r:.800} -> {msg['error']!r:.800}"
            elif method in ("createBranch", "forkBranch"):
                server.extra.append(msg["result"]["branchId"])
            elif method == "deleteBranch":
                server.branches.remove(params["branchId"])
            elif method == "registerClientTools":
                server.client_tools.extend(msg["result"]["registered"])

        run_example(server, "params.valid", body)

    inner()


@pytest.mark.parametrize("prof", PROFILES)
def test_params_with_lone_surrogates_get_a_fitting_error(server, prof):
    """Strings holding lone surrogates (sent as \\udXXX escapes, which is valid JSON): the answer
    must still be a result or a fitting error, never -32603 because an echo cannot be encoded."""
    fuzz_mutated_params(server, prof, "params.surrogates", surrogates=True)


# ---------------------------------------------------------------------- regressions found by the fuzz
def test_authorize_unknown_tool_with_lone_surrogate_is_invalid_params(server):
    """Found by the fuzz: error.data echoes the tool name; a lone surrogate in it cannot be
    encoded to UTF-8 and the whole answer became -32603 "result is not JSON"."""
    check_params(server, "regressions", "authorizeTool", {"tool": "x\ud800", "decision": "allow"})


@pytest.mark.parametrize("where, name", [("fieldModels", "model_config"), ("fieldModels", "model_dump"),
                                         ("responseFormat", "model_fields")])
def test_field_named_like_a_pydantic_member_is_invalid_params(server, where, name):
    """Found by the fuzz: a field name that collides with a pydantic BaseModel member is bad
    input, but these answered -32603 (TypeError "'FieldInfo' object is not iterable",
    ValueError "conflicts with member", PydanticSerializationError) instead of -32602 (or a
    result). responseFormat with "model_dump" already answers -32602."""
    server.begin()
    server.tidy()
    params: dict = {"branchId": server.branches[0], "instruction": "x", "parseOptions": dict(FAST_PARSE)}
    if where == "fieldModels":
        params["fieldModels"] = [{"name": name, "schema": {}}]
    else:
        params["responseFormat"] = {"type": "object", "properties": {name: {"type": "string"}}}
    check_params(server, "regressions", "operate", params)
