"""The client's answers to the server's own requests (docs/PROTOCOL.md §4, §10), fuzzed: an
operate whose model calls the builtin file tools (read, edit, write: through the client's
``fs/readTextFile`` and ``fs/writeTextFile``, the edits asked about with
``requestToolPermission``) and a client tool (``invokeClientTool``), with the client answering
each request as the drawn plan says: the right shapes and the wrong ones, errors of any code,
results that are not objects. Whatever the answers, the operate is answered once, with a
result of its wire type (a bad answer is that call's tool error, or a deny) or an error the
protocol allows operate; never -32603, never a traceback; the server stays in sync.
One server process for the module (``fuzz_support``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operate_sidecar import protocol
from frame_model import json_values
from fuzz_support import (OUTCOMES, OPERATE_TIMEOUT, REQUEST_TIMEOUT, FuzzServer, RpcError, fuzz_server_fixture,
                          has_traceback, profile, run_example)

PROFILES = [pytest.param(profile("fast", 40), id="fast"),
            pytest.param(profile("stress", 800), id="stress", marks=pytest.mark.slow)]


def call(*calls: tuple[str, dict]) -> dict:
    return {"json": {"action_requests": [{"function": f, "arguments": a} for f, a in calls]}}


#: each operate: one model turn calling every kind of tool that asks the client something
TURN = call(("read_file", {"path": "a.txt"}),
            ("edit_file", {"path": "a.txt", "edits": [{"oldText": "old", "newText": "new"}]}),
            ("write_file", {"path": "c.txt", "content": "c\n"}),
            ("client_echo", {"text": "hi"}))
INIT = {"clientInfo": {"name": "fuzz-client-answers"},
        "capabilities": {"toolPermission": True, "clientTools": True, "fs": True},
        "settings": {"models": {"s": {"provider": "scripted", "responses": [TURN] * 4000}}, "defaultModel": "s",
                     "permissionTimeoutMs": 2000}}
METHODS = ("requestToolPermission", "fs/readTextFile", "fs/writeTextFile", "invokeClientTool")
#: once the plan has none left, each request is answered as a client would: allow once, a file
#: not found (a write goes on, an edit of it fails), a write done, the tool's output
FALLBACK = {"requestToolPermission": ("result", {"decision": "allow_once"}),
            "fs/readTextFile": ("error", -32002, "not found"), "fs/writeTextFile": ("result", {}),
            "invokeClientTool": ("result", {"output": "hi"})}


class AnswerServer(FuzzServer):
    def start(self) -> None:  # (the builtin file tools work in the workspace folders)
        self.init_params = {**INIT, "workspaceFolders": [self.workdir.name]}
        super().start()

    def on_start(self) -> None:
        self.plan: list[tuple] = []
        self.lock = threading.Lock()
        self.asked: list[str] = []
        self.c.request("registerClientTools", {"tools": [
            {"name": "client_echo", "description": "echo", "inputSchema": {
                "type": "object", "properties": {"text": {"type": "string"}}}}]}, timeout=REQUEST_TIMEOUT)
        for method in METHODS:
            self.c.on_request(method, lambda p, m=method: self.answer(m, p))
        self.branch = self.c.request("createBranch", {}, timeout=REQUEST_TIMEOUT)["branchId"]
        self.err_seen = len(self.stderr_tail(1 << 20))

    def answer(self, method: str, params: Any) -> Any:
        with self.lock:
            how = self.plan.pop(0) if self.plan else FALLBACK[method]
            self.asked.append(method)
        if how[0] == "error":
            raise RpcError(how[1], how[2])
        if how[0] == "text":
            return {"text": how[1]}
        if how[0] == "decision":
            return {"decision": how[1]}
        return how[1]


@pytest.fixture(scope="module")
def server():
    yield from fuzz_server_fixture(AnswerServer(INIT, "client-answers"))


answers = st.one_of(
    st.just(("text", "old text\n")),  # (the file as it is: the edit goes on to be asked about and written)
    st.tuples(st.just("decision"), st.sampled_from(["allow_once", "allow_always", "deny_once", "deny_always",
                                                    "allow", "ALLOW_ONCE", "", None, 5, ["allow_once"]])),
    st.tuples(st.just("text"), st.text(max_size=30) | st.sampled_from(["", "x" * 5000, "\x00bin", "old\r\ntext"])),
    st.tuples(st.just("result"), json_values | st.sampled_from([
        None, {}, {"decision": {}}, {"text": 5}, {"text": None}, {"text": ["x"]}, {"output": None}, [], "ok", 0])),
    st.tuples(st.just("error"), st.sampled_from([-32002, -32601, -32603, -32602, -32000, -32800, 1, 0]),
              st.sampled_from(["", "not found", "No such file or directory", "boom"])))


@pytest.mark.parametrize("prof", PROFILES)
def test_whatever_the_client_answers_the_operate_ends_with_an_answer_of_its_type(server, prof):
    @prof
    @given(st.lists(answers, min_size=1, max_size=8), st.sampled_from(["allow", "ask", None]))
    def inner(plan, edits):
        def body() -> None:
            s = server
            with s.lock:
                s.plan, s.asked = list(plan), []
            if edits is not None:  # (ask: the edits are asked about; allow: they are not)
                for tool in ("edit_file", "write_file"):
                    s.c.request("authorizeTool", {"tool": tool, "decision": edits, "branchId": s.branch},
                                timeout=REQUEST_TIMEOUT)
            pending = s.c.request_async("operate", {"branchId": s.branch, "instruction": "go", "actions": True,
                                                    "clearMessages": True})
            msg = s.response(pending, OPERATE_TIMEOUT)
            with s.lock:
                asked = list(s.asked)
                s.plan = []
            for m in asked:
                OUTCOMES[f"asked the client {m}"] = OUTCOMES.get(f"asked the client {m}", 0) + 1
            shown = f"operate with the client's answers {plan!r:.1500} (asked: {asked})"
            err_text = s.stderr_tail(1 << 20)
            assert "Traceback" not in err_text[s.err_seen:], f"a traceback on stderr: {shown}\n{err_text[s.err_seen:][-3000:]}"
            s.err_seen = len(err_text)
            if "result" in msg:
                OUTCOMES["client-answers operate result"] = OUTCOMES.get("client-answers operate result", 0) + 1
                try:
                    protocol.structure(protocol.result_type("operate"), msg["result"])
                except protocol.RpcError as e:
                    raise AssertionError(f"{shown}: result does not match its wire type ({e.message})")
                return
            err = msg["error"]
            OUTCOMES[f"client-answers operate {err.get('code')}"] = \
                OUTCOMES.get(f"client-answers operate {err.get('code')}", 0) + 1
            assert not has_traceback(err), f"traceback in the error for {shown}: {err!r:.1500}"
            assert err.get("code") != -32603, f"internal error: {shown} -> {err!r:.1500}"
            assert err.get("code") in (-32010, -32011), f"{shown} -> {err!r:.800}"

        run_example(server, "client answers", body)

    inner()
