"""The client's file system: with ``capabilities.fs`` the builtin file tools read and write
through ``fs/readTextFile`` / ``fs/writeTextFile`` (end to end over real pipes)."""

from __future__ import annotations

import threading

from .support import TIMEOUT, RpcError, scripted

FS = {"fs": True, "toolPermission": True}


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


def operate(c, bid):
    return c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)


def outputs(res):
    return [r["output"] for r in res["result"]["action_responses"]]


class Buffers:
    """An editor's unsaved buffers, served over fs/*; every request is logged."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = dict(files)
        self.log: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def read(self, p):
        with self.lock:
            self.log.append(("read", p))
            if p["path"] not in self.files:
                raise RpcError(-32002, f"no buffer for {p['path']}")
            return {"text": self.files[p["path"]]}

    def write(self, p):
        with self.lock:
            self.log.append(("write", p))
            self.files[p["path"]] = p["text"]
            return {}

    def attach(self, c) -> "Buffers":
        c.on_request("fs/readTextFile", self.read)
        c.on_request("fs/writeTextFile", self.write)
        return self


def start(c, ws, *responses, policy="allow"):
    c.request("initialize", {"workspaceFolders": [str(ws)], "capabilities": FS,
                             "settings": {"models": {"s": scripted(*responses)},
                                          "toolPolicy": {"edit_file": policy, "write_file": policy}}},
              timeout=TIMEOUT)
    return c.branch()


def test_edit_through_the_client_never_touches_the_disk(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("on disk\n")
    before = f.stat()
    bufs = Buffers({str(f): "unsaved = 1\n"}).attach(sidecar)
    bid = start(sidecar, tmp_path, call("edit_file", path="m.py", edits=[{"oldText": "unsaved = 1",
                                                                          "newText": "unsaved = 2"}]))
    out = outputs(operate(sidecar, bid))[0]
    assert out["diff"].endswith("-unsaved = 1\n+unsaved = 2\n")             # computed from the buffer
    assert bufs.files[str(f)] == "unsaved = 2\n"                             # landed in the buffer
    assert f.read_text() == "on disk\n" and f.stat().st_mtime_ns == before.st_mtime_ns  # disk untouched
    call_id = sidecar.messages(bid)[-1]["content"]["callId"]
    read = ("read", {"branchId": bid, "callId": call_id, "path": str(f)})
    assert [(k, p) for k, p in bufs.log] == [  # computed from a read, re-read just before the write
        read, read, ("write", {"branchId": bid, "callId": call_id, "path": str(f), "text": "unsaved = 2\n"})]


def test_read_file_sees_the_unsaved_buffer(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("disk\n")
    Buffers({str(f): "l1\nl2\nl3\n"}).attach(sidecar)
    bid = start(sidecar, tmp_path, call("read_file", path="m.py", offset=2, limit=1))
    out = outputs(operate(sidecar, bid))[0]
    assert "content" in out, (out, sidecar.stderr_text()[-3000:])
    assert out["content"] == "l2\n" and out["nextOffset"] == 3 and out["path"] == "m.py"


def test_write_file_creates_through_the_client(sidecar, tmp_path):
    bufs = Buffers({}).attach(sidecar)
    bid = start(sidecar, tmp_path, call("write_file", path="new.txt", content="x\n"))
    out = outputs(operate(sidecar, bid))[0]
    assert out["created"] is True and bufs.files[str(tmp_path / "new.txt")] == "x\n"
    assert not (tmp_path / "new.txt").exists()


def test_preview_and_stale_check_use_the_buffer(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("disk\n")
    bufs = Buffers({str(f): "v = 1\n"}).attach(sidecar)
    bid = start(sidecar, tmp_path, call("edit_file", path="m.py", edits=[{"oldText": "v = 1", "newText": "v = 2"}]),
                policy="ask")
    asked = []

    def user_keeps_typing(p):
        asked.append(p)
        bufs.files[str(f)] = "v = 1\nw = 0\n"
        return {"decision": "allow_once"}

    sidecar.on_request("requestToolPermission", user_keeps_typing)
    out = outputs(operate(sidecar, bid))[0]
    assert asked[0]["preview"]["oldText"] == "v = 1\n"
    assert "changed after the change was previewed" in out["error"]
    assert bufs.files[str(f)] == "v = 1\nw = 0\n" and not [k for k, _ in bufs.log if k == "write"]


def test_a_path_outside_is_refused_before_any_client_request(sidecar, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    bufs = Buffers({}).attach(sidecar)
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    bid = start(sidecar, ws, call("read_file", path="../x.txt"),
                call("edit_file", path=str(tmp_path / "x.txt"), edits=[{"oldText": "a", "newText": "b"}]),
                policy="ask")
    for _ in range(2):
        assert "outside the workspace" in outputs(operate(sidecar, bid))[0]["error"]
    assert bufs.log == [] and asked == []


def test_a_client_error_answer_is_a_tool_error(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a\n")

    def fail(p):
        raise RpcError(-32000, "buffer is read-only")

    sidecar.on_request("fs/readTextFile", lambda p: {"text": "a\n"})
    sidecar.on_request("fs/writeTextFile", fail)
    bid = start(sidecar, tmp_path, call("edit_file", path="m.py", edits=[{"oldText": "a", "newText": "b"}]))
    out = outputs(operate(sidecar, bid))[0]
    assert "buffer is read-only" in out["error"] and out["function"] == "edit_file"
    assert f.read_text() == "a\n"


def test_without_the_capability_the_disk_is_used(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a\n")
    asked = []
    sidecar.on_request("fs/readTextFile", lambda p: asked.append(p) or {"text": "zzz"})
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
        "models": {"s": scripted(call("edit_file", path="m.py", edits=[{"oldText": "a", "newText": "b"}]))},
        "toolPolicy": {"edit_file": "allow"}}}, timeout=TIMEOUT)
    operate(sidecar, sidecar.branch())
    assert f.read_text() == "b\n" and asked == []
