"""What the real server sends matches protocol/schema.json (and so the generated TypeScript types).

One session over real pipes touches every server → client message: every result, every
notification, every server → client request and the -32010 error data. Each is validated against
its schema (strict types forbid unknown keys, so a field the types lack fails too), and a field the
server always sends must be required there (a client library's types must not make it optional).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jsonschema
import pytest

from operate_sidecar.clients.python.client import RpcError, SidecarClient

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "protocol" / "schema.json").read_text(encoding="utf-8"))
TIMEOUT = 60

pytestmark = pytest.mark.timeout(300)

ANSWER = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}},
          "required": ["answer"]}


def _validator(sub: dict) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$defs": SCHEMA["$defs"], **sub})


class Recorder(SidecarClient):
    """Validates every message the server sends, as it arrives."""

    def __init__(self, *args, **kw) -> None:
        self.sent: dict = {}
        self.problems: list[str] = []
        self.seen: set[str] = set()
        super().__init__(*args, **kw)

    def request_async(self, method, params=None, msg_id=None):
        msg_id = next(self._ids) if msg_id is None else msg_id
        self.sent[msg_id] = method  # before sending: the answer may arrive before request_async returns
        return super().request_async(method, params, msg_id)

    def _dispatch(self, msg: dict) -> None:
        try:
            self._check(msg)
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.problems.append(f"checking {msg!r:.300}: {e!r}")
        super()._dispatch(msg)

    def _check(self, msg: dict) -> None:
        if "method" in msg:
            method = msg["method"]
            table = SCHEMA["methods"] if "id" in msg else SCHEMA["notifications"]
            entry = table.get(method)
            if entry is None or entry["direction"] != "serverToClient":
                self.problems.append(f"the server sent {method!r}, which the schema does not declare")
                return
            self.seen.add(method if method != "$/progress" else f"$/progress {msg['params']['value']['kind']}")
            self._validate(entry["params"], msg.get("params"), f"{method} params")
        elif "error" in msg:
            code = msg["error"]["code"]
            if code not in SCHEMA["errorCodes"].values():
                self.problems.append(f"error code {code} is not in the schema's errorCodes")
            data_schema = SCHEMA["errorData"].get(str(code))
            if data_schema is not None:
                self.seen.add(f"error {code}")
                self._validate(data_schema, msg["error"].get("data"), f"error {code} data")
        else:
            method = self.sent.get(msg.get("id"))
            if method is None:
                self.problems.append(f"a response to an id never sent: {msg!r:.300}")
                return
            self.seen.add(f"{method} result")
            self._validate(SCHEMA["methods"][method]["result"], msg.get("result"), f"{method} result")

    def _validate(self, sub: dict, value, what: str) -> None:
        for e in _validator(sub).iter_errors(value):
            self.problems.append(f"{what} at {list(e.absolute_path)}: {e.message[:300]}")


def _act(*calls, answer: str = "x") -> dict:
    return {"json": {"answer": answer, "action_required": bool(calls),
                     "action_requests": [{"function": f, "arguments": a} for f, a in calls]}}


@pytest.fixture
def session(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("héllo\n", encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "rpc" / "fixtures")]))
    stderr = (tmp_path / "stderr.txt").open("w")
    c = Recorder(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(ROOT), stderr=stderr)
    try:
        yield c, ws
    finally:
        c.kill()
        c.wait(TIMEOUT)
        c.close_input()
        stderr.close()


def test_every_message_the_real_server_sends_matches_the_schema(session):
    c, ws = session
    calls = [("echo_tool", {"text": "hi"}), ("ctool", {"q": 1}),
             ("write_file", {"path": str(ws / "b.txt"), "content": "new ü\n"}),
             ("read_file", {"path": str(ws / "a.txt")}),
             ("edit_file", {"path": str(ws / "a.txt"), "edits": [{"oldText": "héllo", "newText": "bye"}]}),
             ("failing_tool", {"x": 1}), ("no_such_tool", {}), ("echo_tool", {"bad": 1}), ("denied_tool", {})]
    models = {"s": {"provider": "scripted", "responses": [
        _act(*calls), _act(answer="done"),                     # operate with maxRounds: two rounds
        {"json": {"wrong": 1}}, {"json": {"wrong": 1}},        # handleValidation raise (and its one reformat turn)
        {"text": "plain streamed reply", "chunks": 3},         # raw text, streamed
        {"error": "kaput"},                                    # -32011, progress end "failed"
        {"text": "late", "delayMs": 60000},                    # cancelled, progress end "cancelled"
    ]}}
    assert c.request("ping", timeout=TIMEOUT) == {}
    c.request("initialize", {
        "clientInfo": {"name": "conformance"},
        "capabilities": {"toolPermission": True, "clientTools": True, "fs": True},
        "workspaceFolders": [str(ws)],
        "settings": {"models": models, "defaultModel": "s", "toolModules": ["slow_tools", "no_such_module_xyz"],
                     "toolPolicy": {"denied_tool": "deny"}}}, timeout=TIMEOUT)
    c.notify("initialized", {})
    c.on_request("requestToolPermission", lambda p: {"decision": "allow_once"})
    c.on_request("invokeClientTool", lambda p: {"output": {"got": p["arguments"]}})
    c.on_request("fs/readTextFile", lambda p: {"text": Path(p["path"]).read_text(encoding="utf-8")})

    def write(p):
        Path(p["path"]).write_text(p["text"], encoding="utf-8")
        return {}

    c.on_request("fs/writeTextFile", write)
    tool = {"description": "d", "inputSchema": {"type": "object"}}
    c.request("registerClientTools", {"tools": [{"name": "ctool", **tool}, {"name": "denied_tool", **tool}]},
              timeout=TIMEOUT)
    branch = c.request("createBranch", {"system": "sys", "name": "n"}, timeout=TIMEOUT)["branchId"]
    c.request("listBranches", timeout=TIMEOUT)  # a branch no operate ran on yet
    c.request("listTools", {"branchId": branch}, timeout=TIMEOUT)
    c.request("authorizeTool", {"tool": "echo_tool", "decision": "allow"}, timeout=TIMEOUT)
    c.request("authorizeTool", {"tool": "echo_tool", "decision": "allow", "branchId": branch}, timeout=TIMEOUT)
    out = c.request("operate", {"branchId": branch, "instruction": "go", "responseFormat": ANSWER, "actions": True,
                                "reason": True, "maxRounds": 3, "workDoneToken": "t1"}, timeout=TIMEOUT)
    assert out["rounds"] == 2 and out["kind"] == "model", out
    with pytest.raises(RpcError) as ei:
        c.request("operate", {"branchId": branch, "instruction": "v", "responseFormat": ANSWER,
                              "handleValidation": "raise", "parseOptions": {"retryAttempts": 0}}, timeout=TIMEOUT)
    assert ei.value.code == -32010
    assert c.request("operate", {"branchId": branch, "instruction": "t", "workDoneToken": 2},
                     timeout=TIMEOUT)["kind"] == "text"
    with pytest.raises(RpcError) as ei:
        c.request("operate", {"branchId": branch, "instruction": "e", "workDoneToken": 3}, timeout=TIMEOUT)
    assert ei.value.code == -32011
    pending = c.request_async("operate", {"branchId": branch, "instruction": "c", "workDoneToken": "t4"})
    assert c.wait_for(lambda n: any(m == "$/progress" and p["token"] == "t4" for m, p in n), TIMEOUT)
    c.cancel(pending.id)
    with pytest.raises(RpcError) as ei:
        pending.result(TIMEOUT)
    assert ei.value.code == -32800
    c.request("listBranches", timeout=TIMEOUT)
    c.request("branchMessages", {"branchId": branch}, timeout=TIMEOUT)
    fork = c.request("forkBranch", {"branchId": branch}, timeout=TIMEOUT)
    c.request("deleteBranch", fork, timeout=TIMEOUT)
    assert c.close() == 0

    assert c.problems == [], "\n".join(c.problems)
    ends = sorted(p["value"]["message"] for m, p in c.notifications
                  if m == "$/progress" and p["value"]["kind"] == "end")
    assert ends == ["cancelled", "completed", "completed", "failed"], ends
    events = {p["event"] for m, p in c.notifications if m == "toolEvent"}
    assert events == {"pre", "post", "error", "denied"}, events
    for what in ("initialize result", "ping result", "shutdown result", "createBranch result", "forkBranch result",
                 "deleteBranch result", "listBranches result", "branchMessages result", "listTools result",
                 "authorizeTool result", "registerClientTools result", "operate result", "error -32010",
                 "requestToolPermission", "invokeClientTool", "fs/readTextFile", "fs/writeTextFile",
                 "$/progress begin", "$/progress report", "$/progress end", "toolEvent", "window/logMessage"):
        assert what in c.seen, f"the session did not exercise {what}: {sorted(c.seen)}"


@pytest.mark.parametrize("type_name, field", [
    ("OperateResult", "usage"), ("OperateResult", "rounds"), ("WorkDoneProgressEnd", "usage"),
    ("BranchInfo", "usage")])
def test_fields_the_server_always_sends_are_required_in_the_schema(type_name, field):
    """The server always sends them (the test above checks what it sends against the schema), so
    the generated types must not make a client handle their absence."""
    assert field in SCHEMA["$defs"][type_name].get("required", []), f"{type_name}.{field} is optional"


def test_a_progress_end_message_is_one_of_its_three_values():
    assert SCHEMA["$defs"]["WorkDoneProgressEnd"]["properties"]["message"] == {
        "enum": ["cancelled", "completed", "failed"]}


def test_a_number_beyond_a_doubles_range_is_invalid_params_from_the_real_server(session):
    """An inline model's timeoutS of 10**400 was -32603 (OverflowError converting it to seconds)."""
    c, _ = session
    c.request("initialize", {"settings": {"models": {"s": {"provider": "scripted", "responses": ["x"]}}}},
              timeout=TIMEOUT)
    branch = c.request("createBranch", {}, timeout=TIMEOUT)["branchId"]
    for model, where in (({"provider": "scripted", "responses": ["q"], "timeoutS": 10**400}, "chatModel.timeoutS"),
                         ({"provider": "scripted", "responses": [{"text": "q", "delayMs": 10**400}]},
                          "chatModel.responses[0].delayMs")):
        with pytest.raises(RpcError) as ei:
            c.request("operate", {"branchId": branch, "instruction": "x", "chatModel": model}, timeout=TIMEOUT)
        assert ei.value.code == -32602 and where in ei.value.message, ei.value
    assert c.request("operate", {"branchId": branch, "instruction": "x"}, timeout=TIMEOUT)["result"] == "x"
    assert c.problems == [], "\n".join(c.problems)
