"""The client's file system: with ``capabilities.fs`` the builtin file tools read and write
through ``fs/readTextFile`` / ``fs/writeTextFile`` (end to end over real pipes)."""

from __future__ import annotations

import threading

import pytest

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


def start(c, ws, *responses, policy="allow", **settings):
    c.request("initialize", {"workspaceFolders": [str(ws)], "capabilities": FS,
                             "settings": {"models": {"s": scripted(*responses)},
                                          "toolPolicy": {"edit_file": policy, "write_file": policy}, **settings}},
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


def test_a_buffer_whose_text_holds_nul_is_a_binary_file_to_read_and_edit_and_is_never_written(sidecar, tmp_path):
    f = tmp_path / "img.png"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    as_text = "\ufffdPNG\r\n\x1a\n\x00\x00"  # an editor's text of it
    bufs = Buffers({str(f): as_text}).attach(sidecar)
    bid = start(sidecar, tmp_path, {"json": {"action_requests": [
        {"function": "read_file", "arguments": {"path": "img.png"}},
        {"function": "edit_file", "arguments": {"path": "img.png", "edits": [{"oldText": "PNG", "newText": "GIF"}]}}]}})
    read, edit = outputs(operate(sidecar, bid))
    assert "binary file" in read.get("error", "") and "content" not in read, read
    assert "binary file" in edit.get("error", ""), edit
    assert [k for k, _ in bufs.log] == ["read", "read"] and bufs.files[str(f)] == as_text  # nothing written


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


LIMIT = 100_000


def test_an_unsaved_new_buffer_whose_read_is_over_max_message_bytes_is_never_overwritten(sidecar, tmp_path):
    """A file that exists only as an editor buffer (no file on disk) and whose text is over
    ``maxMessageBytes``: its read fails (as if the client answered -32600), which says nothing
    about whether it exists. write_file used to take it for "no such file", "create" it and
    overwrite the buffer unseen (``created: true``); edit_file said it did not exist."""
    new = tmp_path / "new.txt"
    bufs = Buffers({str(new): "y" * (3 * LIMIT)}).attach(sidecar)
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)], "capabilities": FS, "settings": {
        "models": {"s": scripted(call("write_file", path="new.txt", content="x\n"),
                                 call("edit_file", path="new.txt", edits=[{"oldText": "y", "newText": "z",
                                                                           "replaceAll": True}]))},
        "toolPolicy": {"edit_file": "allow", "write_file": "allow"}, "maxMessageBytes": LIMIT}}, timeout=TIMEOUT)
    bid = sidecar.branch()
    for tool in ("write_file", "edit_file"):
        out = outputs(operate(sidecar, bid))[0]
        assert out["function"] == tool and "maxMessageBytes" in out["error"], out
        assert "does not exist" not in out["error"], out
    assert bufs.files[str(new)] == "y" * (3 * LIMIT) and not [k for k, _ in bufs.log if k == "write"]
    assert not new.exists()


#: error answers that do not say the file is missing (the path is inside a folder named "not found")
FAILURES = [(-32603, "the editor crashed reading {path}", None),
            (-32000, "buffer is locked", None),
            (-32601, "Method not found", None),
            (-32603, "Internal error", {"uri": "{path}"})]


@pytest.mark.parametrize("code,message,data", FAILURES)
def test_a_failed_read_of_a_path_missing_on_disk_fails_the_call_with_the_clients_reason(sidecar, tmp_path,
                                                                                        code, message, data):
    """The client's read failed for a reason of its own, for a path with no file on disk (it
    may be an unsaved buffer): write_file fails with that reason and nothing is written (it
    used to create the file); edit_file and read_file name it too (not "does not exist")."""
    ws = tmp_path / "not found"
    ws.mkdir()
    path = str(ws / "new.txt")
    writes = []

    def fail(p):
        raise RpcError(code, message.format(path=p["path"]),
                       {k: v.format(path=p["path"]) for k, v in data.items()} if data else None)

    sidecar.on_request("fs/readTextFile", fail)
    sidecar.on_request("fs/writeTextFile", lambda p: writes.append(p) or {})
    bid = start(sidecar, ws, call("write_file", path="new.txt", content="x\n"),
                call("edit_file", path="new.txt", edits=[{"oldText": "a", "newText": "b"}]),
                call("read_file", path="new.txt"))
    shown = message.format(path=path)
    for tool in ("write_file", "edit_file", "read_file"):
        out = outputs(operate(sidecar, bid))[0]
        assert out["function"] == tool and f"the client could not read {path}: {shown}" in out["error"], out
    assert writes == [] and not (ws / "new.txt").exists()


#: how clients say a file is not there: Neovim's answer, VS Code's (a thrown FileSystemError, as
#: vscode-jsonrpc answers it, in its two wordings), an ACP client's "Resource not found" (what the
#: ACP SDK's RequestError.resource_not_found answers), and one whose reason is in ``data``
NOT_FOUND = [(-32602, "cannot read {path}: {path}: No such file or directory", None),
             (-32603, "Request fs/readTextFile failed with message: ENOENT: no such file or directory, open '{path}'",
              None),
             (-32603, "Request fs/readTextFile failed with message: Unable to read file '{path}' "
                      "(Error: Unable to resolve nonexistent file '{path}')", None),
             (-32002, "Resource not found", {"uri": "{path}"}),
             (-32603, "Internal error", {"details": "No such file or directory (os error 2)"})]


@pytest.mark.parametrize("code,message,data", NOT_FOUND)
def test_the_clients_not_found_answers_let_write_file_create_the_file(sidecar, tmp_path, code, message, data):
    path = str(tmp_path / "new.txt")
    files: dict[str, str] = {}

    def read(p):
        if p["path"] in files:
            return {"text": files[p["path"]]}
        raise RpcError(code, message.format(path=p["path"]),
                       {k: v.format(path=p["path"]) for k, v in data.items()} if data else None)

    sidecar.on_request("fs/readTextFile", read)
    sidecar.on_request("fs/writeTextFile", lambda p: files.__setitem__(p["path"], p["text"]) or {})
    bid = start(sidecar, tmp_path, call("read_file", path="new.txt"),
                call("edit_file", path="new.txt", edits=[{"oldText": "a", "newText": "b"}]),
                call("write_file", path="new.txt", content="x\n"))
    assert outputs(operate(sidecar, bid))[0]["error"] == "'new.txt' does not exist"
    assert "'new.txt' does not exist (edit_file changes" in outputs(operate(sidecar, bid))[0]["error"]
    out = outputs(operate(sidecar, bid))[0]
    assert out["created"] is True and files == {path: "x\n"}, out


def test_a_client_that_never_answers_the_preview_read_fails_the_call_within_the_tool_time_out(sidecar, tmp_path):
    """The preview's ``fs/readTextFile`` (made before the user is asked, outside any tool
    time-out) waits no longer than ``toolTimeoutMs``: it used to wait a fixed 60 s whatever the
    setting, and the error then ended in an empty reason ("...did not answer ... for <path>: ").
    Nobody is asked, nothing is written, the server takes the request back ($/cancelRequest),
    and the file is free for the next call."""
    f = tmp_path / "m.py"
    f.write_text("a\n")
    hang = threading.Event()
    reads, asked = [], []

    def read(p):
        reads.append(p)
        if len(reads) == 1:
            hang.wait(TIMEOUT)  # the first read never gets its answer in time
        return {"text": "a\n"}

    written: dict[str, str] = {}
    sidecar.on_request("fs/readTextFile", read)
    sidecar.on_request("fs/writeTextFile", lambda p: written.__setitem__(p["path"], p["text"]) or {})
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    e = call("edit_file", path="m.py", edits=[{"oldText": "a", "newText": "b"}])
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)], "capabilities": FS, "settings": {
        "models": {"s": scripted(e, e)}, "toolPolicy": {"edit_file": "ask"}, "toolTimeoutMs": 1500}},
        timeout=TIMEOUT)
    bid = sidecar.branch()
    try:
        out = outputs(operate(sidecar, bid))[0]
    finally:
        hang.set()
    assert out["error"] == f"the client did not answer fs/readTextFile for {f}: no answer within 1.5 s", out
    assert asked == [] and written == {}
    assert sidecar.wait_for(lambda n: any(m == "$/cancelRequest" for m, _ in n), TIMEOUT)
    out = outputs(operate(sidecar, bid))[0]                        # the file was given back
    assert out["removed"] == 1 and written == {str(f): "b\n"} and len(asked) == 1, out


def test_a_failed_client_write_names_the_clients_reason_with_its_data(sidecar, tmp_path):
    """An error answer to ``fs/writeTextFile`` names the client's message and, when it is text,
    its ``data`` (an ACP client's "Internal error" says why there), as a failed read does."""
    f = tmp_path / "m.py"
    f.write_text("a\n")

    def fail(p):
        raise RpcError(-32603, "Internal error", "EROFS: read-only file system")

    sidecar.on_request("fs/readTextFile", lambda p: {"text": "a\n"})
    sidecar.on_request("fs/writeTextFile", fail)
    bid = start(sidecar, tmp_path, call("edit_file", path="m.py", edits=[{"oldText": "a", "newText": "b"}]))
    out = outputs(operate(sidecar, bid))[0]
    assert out["error"] == f"the client could not write {f}: Internal error (EROFS: read-only file system)", out
    assert f.read_text() == "a\n"


def test_a_client_write_that_times_out_tells_the_model_it_may_still_land(sidecar, tmp_path):
    """A ``fs/writeTextFile`` with no answer in time fails the call, and its error says that the
    client may still apply the write, so that the model reads the file before changing it again
    (the server cannot take back a request the client already has)."""
    f = tmp_path / "m.py"
    f.write_text("a\n")
    hang = threading.Event()
    writes: list = []

    def write(p):
        writes.append(p)
        hang.wait(TIMEOUT)
        return {}

    sidecar.on_request("fs/readTextFile", lambda p: {"text": "a\n"})
    sidecar.on_request("fs/writeTextFile", write)
    try:
        bid = start(sidecar, tmp_path, call("edit_file", path="m.py", edits=[{"oldText": "a", "newText": "b"}]),
                    toolTimeoutMs=1500)
        out = outputs(operate(sidecar, bid))[0]
    finally:
        hang.set()
    assert len(writes) == 1
    assert out["error"] == (f"tool edit_file timed out after 1.5 s; the client was asked to write {f} and may "
                            "still do so: read it before changing it again"), out


def test_a_client_write_past_its_own_request_time_out_says_it_may_still_land(tmp_path):
    """The same when the request's own time-out ends the wait (a call with no time-out of its
    own): the error says the write may still land, and nothing is left pending."""
    import asyncio

    from operate_sidecar.server.core.tools import ToolCallContext
    from operate_sidecar.server.tools.errors import ToolCallError
    from operate_sidecar.server.tools.file_tools import ClientFiles

    async def no_answer(method, params, timeout):
        raise TimeoutError(f"no answer within {timeout:g} s")

    ctx = ToolCallContext("b", "c")
    with pytest.raises(ToolCallError) as ei:
        asyncio.run(ClientFiles(no_answer, timeout=2.0).write_text(tmp_path / "m.py", "x\n", ctx))
    assert str(ei.value) == (f"the client did not answer fs/writeTextFile for {tmp_path / 'm.py'}: no answer "
                             f"within 2 s; the client was asked to write {tmp_path / 'm.py'} and may still do so: "
                             "read it before changing it again")
    assert ctx.pending == []


def test_a_call_cancelled_while_its_client_write_waits_tells_the_model_it_may_still_land(sidecar, tmp_path):
    """An operate cancelled while the client has its ``fs/writeTextFile``: the call's recorded
    error says the write may still land, as a time-out's does, so that the next turn's model
    reads the file before it changes it again (it said only "cancelled")."""
    f = tmp_path / "m.py"
    f.write_text("a\n")
    asked, hang = threading.Event(), threading.Event()
    sidecar.on_request("fs/readTextFile", lambda p: {"text": "a\n"})
    sidecar.on_request("fs/writeTextFile", lambda p: (asked.set(), hang.wait(TIMEOUT), {})[2])
    try:
        bid = start(sidecar, tmp_path, call("edit_file", path="m.py", edits=[{"oldText": "a", "newText": "b"}]))
        pending = sidecar.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True})
        assert asked.wait(TIMEOUT)
        sidecar.cancel(pending.id)
        with pytest.raises(RpcError) as e:
            pending.result(TIMEOUT)
        assert e.value.code == -32800
    finally:
        hang.set()
    [resp] = [m for m in sidecar.messages(bid) if m["kind"] == "action_response"]
    assert resp["content"]["output"]["error"] == (f"cancelled; the client was asked to write {f} and may still do "
                                                  "so: read it before changing it again"), resp
