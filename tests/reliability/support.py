"""Helpers for the reliability suite: the real server over real pipes (see tests/rpc/support.py),
with an invocation record for the fixture tools and journal checks."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from operate_sidecar.clients.python.client import RpcError  # noqa: E402,F401
from rpc.support import TIMEOUT, frame_body, server_env  # noqa: E402,F401  (tests/ is on sys.path)
from rpc.support import Sidecar as RpcSidecar  # noqa: E402

CLIENT_TOOL = {"name": "client_probe", "description": "A client tool that records every call.",
               "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


class Sidecar(RpcSidecar):
    """The end-to-end client of tests/rpc plus: ``record`` names the file the fixture tools
    append to; ``wire_log`` keeps every message the server sent; ``client_calls`` lists every
    ``invokeClientTool`` received."""

    def __init__(self, *args: str, record: str | None = None, env: dict[str, str] | None = None) -> None:
        self.wire_log: list[dict] = []  # every message the server sent, in arrival order
        self.record = record or tempfile.mktemp(prefix="reliability-record-")
        self.client_calls: list[dict] = []
        super().__init__(*args, env={"RELIABILITY_RECORD": self.record, **(env or {})}, paths=(FIXTURES,))

    def _dispatch(self, msg: dict) -> None:
        self.wire_log.append(msg)
        super()._dispatch(msg)

    def messages(self, branch_id: str) -> list[dict]:
        return self.request("branchMessages", {"branchId": branch_id, "limit": 1_000_000}, timeout=TIMEOUT)["messages"]

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
