#!/usr/bin/env python3
"""A protocol stand-in for operate-sidecar, used only to self-test the "ours" drivers.

NOT a contender.  Implements just enough of docs/PROTOCOL.md (initialize with
scripted `settings.models`, ping, listTools, createBranch, deleteBranch,
operate with delayMs / chunks / workDoneToken $/progress, shutdown, exit) with
asyncio + stdlib.  Usage:
    OPERATE_SIDECAR_BIN=bench/peers/fake_sidecar.py python -m bench.run --quick --only ours
"""
import asyncio
import itertools
import json
import sys


class Server:
    def __init__(self):
        self.models = {}
        self.cursor = {}
        self.default = None
        self.branches = {}
        self.ids = itertools.count(1)
        self.out = sys.stdout.buffer

    def send(self, msg):
        body = json.dumps(msg).encode()
        self.out.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.out.flush()

    async def next_entry(self, name):
        entries = self.models[name]["responses"]
        i = self.cursor.get(name, 0)
        if i >= len(entries):
            raise RuntimeError("scripted model exhausted")
        self.cursor[name] = i + 1
        e = entries[i]
        return {"text": e} if isinstance(e, str) else e

    async def operate(self, p):
        b = self.branches[p["branchId"]]
        e = await self.next_entry(b["model"] or self.default)
        if e.get("delayMs"):
            await asyncio.sleep(e["delayMs"] / 1000)
        text = e.get("text") if "json" not in e else json.dumps(e["json"])
        tok = p.get("workDoneToken")
        if tok is not None:
            self.send({"jsonrpc": "2.0", "method": "$/progress",
                       "params": {"token": tok, "value": {"kind": "begin", "title": "operate",
                                                          "message": "communicate"}}})
            n = max(1, e.get("chunks") or 1)
            size = -(-len(text) // n)
            for i in range(0, len(text), size):
                self.send({"jsonrpc": "2.0", "method": "$/progress",
                           "params": {"token": tok, "value": {"kind": "report", "message": "stream",
                                                              "phase": "stream",
                                                              "delta": text[i:i + size]}}})
            self.send({"jsonrpc": "2.0", "method": "$/progress",
                       "params": {"token": tok, "value": {"kind": "end", "message": "done"}}})
        b["messages"] += 2
        return {"result": text, "kind": "text", "model": None}

    async def handle(self, msg):
        m, p, rid = msg.get("method"), msg.get("params") or {}, msg.get("id")
        try:
            if m == "initialize":
                s = p.get("settings") or {}
                self.models = s.get("models", {})
                self.default = s.get("defaultModel")
                r = {"protocolVersion": 1, "serverInfo": {"name": "fake", "version": "0"},
                     "capabilities": {"methods": ["initialize", "ping", "listTools", "createBranch",
                                                  "deleteBranch", "operate", "shutdown"],
                                      "notifications": [], "models": list(self.models),
                                      "stateDir": None}}
            elif m == "ping":
                r = {}
            elif m == "listTools":
                r = {"tools": [{"name": "read_file", "description": "Read a file",
                                "inputSchema": {"type": "object"}, "source": "builtin",
                                "policy": "allow"}]}
            elif m == "createBranch":
                bid = f"b{next(self.ids)}"
                self.branches[bid] = {"model": p.get("chatModel"), "messages": 0}
                r = {"branchId": bid}
            elif m == "deleteBranch":
                del self.branches[p["branchId"]]
                r = {}
            elif m == "operate":
                r = await self.operate(p)
            elif m == "shutdown":
                r = None
            else:
                raise KeyError(m)
            if rid is not None:
                self.send({"jsonrpc": "2.0", "id": rid, "result": r})
        except Exception as e:  # noqa: BLE001
            if rid is not None:
                self.send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32603, "message": repr(e)}})


async def main():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    srv = Server()
    tasks = set()
    while True:
        length = None
        while True:
            line = await reader.readline()
            if not line:
                return
            if line.strip() == b"":
                break
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v)
        msg = json.loads(await reader.readexactly(length))
        if msg.get("method") == "exit":
            return
        t = asyncio.ensure_future(srv.handle(msg))
        tasks.add(t)
        t.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(main())
