"""Helpers for the reliability suite: the real server over real pipes (see tests/rpc/support.py),
with an invocation record for the fixture tools and journal checks."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
RPC_FIXTURES = ROOT / "tests" / "rpc" / "fixtures"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from clients.python.client import RpcError, SidecarClient  # noqa: E402

SERVER = [sys.executable, "-m", "server"]
TIMEOUT = 20.0
CLIENT_TOOL = {"name": "client_probe", "description": "A client tool that records every call.",
               "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(FIXTURES), str(RPC_FIXTURES), env.get("PYTHONPATH", "")])
    env.pop("PYTHONSTARTUP", None)
    env.update(extra or {})
    return env


class Sidecar(SidecarClient):
    """SidecarClient plus conveniences; stderr goes to a temp file; ``record`` names the file the
    fixture tools append to; ``client_calls`` lists every ``invokeClientTool`` received."""

    def __init__(self, *args: str, record: str | None = None, env: dict[str, str] | None = None) -> None:
        self.stderr_file = tempfile.TemporaryFile()
        self.wire_log: list[dict] = []  # every message the server sent, in arrival order
        self.record = record or tempfile.mktemp(prefix="reliability-record-")
        extra = {"RELIABILITY_RECORD": self.record, **(env or {})}
        super().__init__(argv=SERVER + list(args), env=server_env(extra), cwd=str(ROOT), stderr=self.stderr_file)
        self.client_calls: list[dict] = []

    def _dispatch(self, msg: dict) -> None:
        self.wire_log.append(msg)
        super()._dispatch(msg)

    def stderr_text(self) -> str:
        self.stderr_file.seek(0)
        return self.stderr_file.read().decode("utf-8", "replace")

    def init(self, models: dict | None = None, capabilities: dict | None = None, **settings) -> dict:
        s = dict(settings)
        if models is not None:
            s["models"] = models
        params: dict = {"clientInfo": {"name": "pytest-reliability"}, "settings": s}
        if capabilities is not None:
            params["capabilities"] = capabilities
        return self.request("initialize", params, timeout=TIMEOUT)

    def branch(self, **params) -> str:
        return self.request("createBranch", params, timeout=TIMEOUT)["branchId"]

    def error_of(self, method: str, params=None, timeout: float = TIMEOUT) -> RpcError:
        with pytest.raises(RpcError) as ei:
            self.request(method, params, timeout=timeout)
        return ei.value

    def messages(self, branch_id: str) -> list[dict]:
        return self.request("branchMessages", {"branchId": branch_id, "limit": 1_000_000}, timeout=TIMEOUT)["messages"]

    def of(self, method: str) -> list:
        return [p for m, p in self.notifications if m == method]

    def invocations(self) -> list[dict]:
        """Every fixture-tool invocation, in order."""
        try:
            with open(self.record, encoding="utf-8") as fh:
                return [json.loads(line) for line in fh if line.strip()]
        except FileNotFoundError:
            return []

    def register_recording_client_tool(self, answer=lambda p: {"output": {"ok": p["arguments"]}}) -> None:
        def handle(params):
            self.client_calls.append(params)
            return answer(params)

        self.on_request("invokeClientTool", handle)
        assert self.request("registerClientTools", {"tools": [CLIENT_TOOL]}, timeout=TIMEOUT) == \
            {"registered": ["client_probe"]}


def scripted(*responses, **extra) -> dict:
    return {"provider": "scripted", "responses": list(responses), **extra}


def calls(*requests: tuple[str, dict]) -> dict:
    """A scripted reply asking for these tool calls."""
    return {"json": {"action_requests": [{"function": f, "arguments": a} for f, a in requests]}}


def assert_consistent(msgs: list[dict]) -> None:
    """Every action_request has exactly one action_response (same callId), after it."""
    pos: dict[str, int] = {}
    for i, m in enumerate(msgs):
        c = m["content"]
        if m["kind"] == "action_request":
            assert c["callId"] not in pos, f"duplicate action_request {c['callId']}"
            pos[c["callId"]] = i
    answered = {}
    for i, m in enumerate(msgs):
        if m["kind"] == "action_response":
            cid = m["content"]["callId"]
            assert cid in pos and pos[cid] < i, f"action_response {cid} without an earlier request"
            assert cid not in answered, f"two responses for {cid}"
            assert m["content"]["output"] is not None
            answered[cid] = i
    missing = set(pos) - set(answered)
    assert not missing, f"action_request(s) without action_response: {sorted(missing)}"


def outputs(result: dict) -> list:
    return [r["output"] for r in (result["result"] or {}).get("action_responses") or []]
