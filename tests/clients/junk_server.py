"""A stand-in for the server that answers the editor clients' start-up as the real one does,
then answers each ``operate`` with junk: notifications of every kind the protocol has
(``$/progress`` for the request's token, ``toolEvent``, ``window/logMessage``) whose fields
hold values of any type, a ``requestToolPermission`` of odd params, and a result (or error)
of the wrong shapes. What a client must survive from a server of another version, or a
broken one. The junk is drawn from ``random.Random(seed)``, the seed the operate's
instruction ends with (``... seed 7``), so a failing turn can be sent again; an instruction
without one gets a sane answer (``ok``). The history of a branch named ``junk-history-<seed>``
is junk too (``branchMessages``).

    python junk_server.py
"""

from __future__ import annotations

import json
import random
import re
import sys
from typing import Any

METHODS = ["initialize", "ping", "shutdown", "createBranch", "forkBranch", "deleteBranch", "listBranches",
           "branchMessages", "listTools", "authorizeTool", "registerClientTools", "operate"]
NOTIFICATIONS = ["$/progress", "toolEvent", "window/logMessage"]


def junk(r: random.Random, depth: int = 0) -> Any:
    kinds = ["null", "bool", "int", "float", "str", "long", "nl"] + (["list", "dict"] if depth < 3 else [])
    k = r.choice(kinds)
    if k == "null":
        return None
    if k == "bool":
        return r.random() < 0.5
    if k == "int":
        return r.choice([0, -1, 1, 2**53, -(2**31), 7])
    if k == "float":
        return r.choice([0.5, -1e300, 1e-9, 3.0])
    if k == "str":
        return r.choice(["", "x", "pre", "post", "error", "begin", "report", "end", "stream", "parse", "request",
                         "tool", "%s %d", "\\", "🙂", "a\tb", "]]--", "%", "{}", "nil", "[[", "\u200b", "\x01"])
    if k == "long":
        return "long " * r.randint(50, 400)
    if k == "nl":
        return "line one\nline two\r\n\nline four"
    if k == "list":
        return [junk(r, depth + 1) for _ in range(r.randint(0, 3))]
    return {r.choice(["a", "kind", "text", "message", "output", "error", "diff", "path", "1", ""]): junk(r, depth + 1)
            for _ in range(r.randint(0, 3))}


def maybe(r: random.Random, good: Any) -> Any:
    """The right value most of the time, junk otherwise (a field of the wrong type)."""
    return good if r.random() < 0.6 else junk(r)


class Server:
    def __init__(self) -> None:
        self.out = sys.stdout.buffer
        self.branches: dict[str, list] = {}
        self.n = 0
        self.ids = 0

    def send(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.out.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.out.flush()

    def read(self) -> dict | None:
        length = None
        while True:
            line = sys.stdin.buffer.readline()
            if not line:
                return None
            if line in (b"\r\n", b"\n"):
                break
            k, _, v = line.decode().partition(":")
            if k.strip().lower() == "content-length":
                length = int(v)
        return json.loads(sys.stdin.buffer.read(length or 0))

    def answer(self, msg: dict, result: Any) -> None:
        self.send({"jsonrpc": "2.0", "id": msg["id"], "result": result})

    def serve(self) -> None:
        while True:
            msg = self.read()
            if msg is None:
                return
            method, p = msg.get("method"), msg.get("params") or {}
            if "method" not in msg:  # the client's answer to a request of ours: nothing to do
                continue
            if method == "exit":
                return
            if "id" not in msg:
                continue
            if method == "initialize":
                self.answer(msg, {"protocolVersion": 1, "serverInfo": {"name": "operate-sidecar", "version": "0.0.0-junk"},
                                  "capabilities": {"methods": METHODS, "notifications": NOTIFICATIONS,
                                                   "models": ["s"], "stateDir": None}})
            elif method in ("ping", "authorizeTool"):
                self.answer(msg, {})
            elif method == "shutdown":
                self.answer(msg, None)
            elif method in ("createBranch", "forkBranch"):
                self.n += 1
                b = f"junk-branch-{self.n:04d}"
                self.branches[b] = []
                self.answer(msg, {"branchId": b})
            elif method == "deleteBranch":
                self.answer(msg, {"deleted": bool(self.branches.pop(p.get("branchId"), None) is not None)})
            elif method == "listBranches":  # (and the branches of junk history, with fields of any type)
                r = random.Random(0)
                self.answer(msg, {"branches": [{"branchId": b, "name": None, "messageCount": len(m)}
                                               for b, m in self.branches.items()] + [
                    {"branchId": f"junk-history-{i}", "name": maybe(r, f"history {i}"), "messageCount": maybe(r, 3),
                     "chatModel": junk(r), "usage": junk(r), "updatedAt": junk(r)} for i in range(1, 61)]})
            elif method == "branchMessages":
                m = re.fullmatch(r"junk-history-(\d+)", str(p.get("branchId")))
                if m:  # a branch whose history is junk (its messages of odd shapes, in pages)
                    self.answer(msg, self.history(random.Random(int(m.group(1))), p))
                else:
                    self.answer(msg, {"messages": self.branches.get(p.get("branchId"), [])})
            elif method == "listTools":
                self.answer(msg, {"tools": [{"name": "junk_tool", "description": "d", "source": "python",
                                             "inputSchema": {"type": "object"}, "decision": "ask"}]})
            elif method == "registerClientTools":
                self.answer(msg, {"registered": []})
            elif method == "operate":
                self.operate(msg, p)
            else:
                self.send({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": "method not found"}})

    def history(self, r: random.Random, p: dict) -> Any:
        """A page of a junk history: messages of every kind with fields of any type, among
        items that are not messages; ``total`` and the page of the wrong types at times."""
        def message() -> Any:
            kind = r.choice(["instruction", "assistant_response", "action_request", "action_response", "system",
                             "x", None])
            content = {"instruction": maybe(r, "a question"), "text": maybe(r, r.choice(["an answer", '{"a": 1}'])),
                       "function": maybe(r, "read_file"), "callId": maybe(r, f"c{r.randint(1, 4)}"),
                       "arguments": maybe(r, {"path": "a.txt"}), "output": junk(r)}
            return maybe(r, {"id": maybe(r, "m"), "kind": kind, "role": junk(r), "createdAt": maybe(r, "2026-12-01T10:00:00Z"),
                             "content": maybe(r, content)})
        if r.random() < 0.1:
            return junk(r)
        msgs = [message() for _ in range(r.randint(0, 12))]
        offset = p.get("offset") if isinstance(p.get("offset"), int) else 0
        return {"messages": maybe(r, msgs[offset:] if offset < 3 else []), "total": maybe(r, len(msgs))}

    def operate(self, msg: dict, p: dict) -> None:
        text = str(p.get("instruction") or (p.get("instruct") or {}).get("instruction") or "")
        m = re.search(r"seed (\d+)\s*$", text)
        token = p.get("workDoneToken")
        if not m:
            self.answer(msg, {"result": "ok", "kind": "text", "model": "s",
                              "usage": {"inputTokens": 1, "outputTokens": 1, "contextTokens": 1, "modelCalls": 1},
                              "rounds": 1})
            return
        r = random.Random(int(m.group(1)))
        branch = p.get("branchId")
        for _ in range(r.randint(5, 25)):
            kind = r.choice(["progress", "progress", "progress", "tool", "tool", "log", "permission"])
            if kind == "progress":
                value = r.choice([
                    {"kind": maybe(r, "begin"), "title": maybe(r, "operate")},
                    {"kind": maybe(r, "report"), "phase": maybe(r, r.choice(["request", "stream", "parse", "tool", "x"])),
                     "delta": maybe(r, "some text "), "message": maybe(r, "working"),
                     "model": maybe(r, "s"), "round": maybe(r, 1)},
                    {"kind": maybe(r, "report"), "phase": "thinking", "delta": junk(r)},
                    {"kind": maybe(r, "end"), "usage": maybe(r, {"inputTokens": 3, "outputTokens": junk(r)})},
                    junk(r)])
                self.send({"jsonrpc": "2.0", "method": "$/progress",
                           "params": {"token": maybe(r, token), "value": value}})
            elif kind == "tool":
                self.send({"jsonrpc": "2.0", "method": "toolEvent", "params": {
                    "branchId": maybe(r, branch), "callId": maybe(r, f"call-{r.randint(1, 3)}"),
                    "event": maybe(r, r.choice(["pre", "post", "error", "denied", "x"])),
                    "tool": maybe(r, r.choice(["edit_file", "read_file", "junk_tool"])),
                    "arguments": maybe(r, {"path": "a.txt"}), "output": junk(r), "error": junk(r),
                    "durationMs": junk(r)}})
            elif kind == "log":
                self.send({"jsonrpc": "2.0", "method": "window/logMessage",
                           "params": {"type": maybe(r, r.randint(1, 4)), "message": maybe(r, "a log line")}})
            else:  # a request of ours with odd params: the client answers it or refuses it, and goes on
                self.ids += 1
                self.send({"jsonrpc": "2.0", "id": f"junk-{self.ids}", "method": "requestToolPermission", "params": {
                    "branchId": maybe(r, branch), "callId": maybe(r, "call-9"), "tool": maybe(r, "edit_file"),
                    "arguments": junk(r), "options": maybe(r, ["allow_once", "deny_once"]),
                    "preview": maybe(r, {"kind": "diff", "path": maybe(r, "/nonexistent/a.txt"), "oldText": junk(r),
                                         "newText": junk(r), "diff": maybe(r, "@@ -1 +1 @@\n-a\n+b\n")})}})
        if r.random() < 0.25:
            self.send({"jsonrpc": "2.0", "id": msg["id"], "error": {
                "code": maybe(r, -32011), "message": maybe(r, "the model failed"), "data": junk(r)}})
            return
        self.answer(msg, r.choice([
            junk(r),
            {"result": junk(r), "kind": maybe(r, "text"), "model": junk(r), "usage": junk(r), "rounds": junk(r)},
            {"result": {"message": junk(r), "action_responses": junk(r), "action_requests": junk(r)},
             "kind": maybe(r, "model"), "usage": maybe(r, {"inputTokens": junk(r)}), "rounds": maybe(r, 2),
             "stopped": junk(r)}]))


if __name__ == "__main__":
    Server().serve()
