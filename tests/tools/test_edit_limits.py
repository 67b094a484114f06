"""The file-changing tools at their limits, through the real server over real pipes with the
scripted model (and the real tools on a real disk): more previews waiting than are kept, or
holding more text than is kept (counted over every set of tools of the process), a client buffer over the size bound, long file names, paths that cannot name a file, and a reply
carrying the largest new text a write may hold."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import anyio
import pytest
from rpc.support import TIMEOUT  # tests/ is on sys.path

from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.tools import ToolCallError, WorkspaceTools, safe_fs
from operate_sidecar.server.tools import file_tools as file_tools_module
from operate_sidecar.server.tools.file_tools import PENDING_LIMIT

MAX_WRITE = 10 * 1024 * 1024
PERM = {"toolPermission": True}
TOO_MANY = "too many changes are waiting for review"
TOO_MUCH = "too much text is waiting for review"


def call(function: str, **arguments) -> dict:
    return {"function": function, "arguments": arguments}


def reply(*calls: dict) -> dict:
    return {"json": {"action_requests": list(calls)}}


def start(c, ws: Path, *responses, caps=None, policy="allow", **settings) -> str:
    c.request("initialize", {"workspaceFolders": [str(ws)], "capabilities": caps or {},
                             "settings": {"models": {"s": {"provider": "scripted", "responses": list(responses)}},
                                          "defaultModel": "s",
                                          "toolPolicy": {"edit_file": policy, "write_file": policy}, **settings}},
              timeout=TIMEOUT)
    return c.branch()


def outputs(c, bid: str, timeout: float = TIMEOUT) -> list:
    res = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=timeout)
    return [r["output"] for r in res["result"]["action_responses"]]


def edit(path: str, old: str = "x = 1", new: str = "x = 2") -> dict:
    return call("edit_file", path=path, edits=[{"oldText": old, "newText": new}])


# ----------------------------------------------------------------- previews waiting at once


def test_no_previewed_call_writes_unseen_when_more_are_waiting_than_are_kept(sidecar, tmp_path):
    """One reply of PENDING_LIMIT + 2 edits of different files, policy ask: the user holds every
    permission request, changes every file, then allows them all. The oldest plans were dropped
    for room, so those calls were planned again from the changed files and wrote over them; now
    no more than PENDING_LIMIT are put to the user, the rest fail at once saying why, and no
    call writes. Once they are decided, the next change is put to the user and lands."""
    n = PENDING_LIMIT + 2
    for i in range(n):
        (tmp_path / f"f{i}.txt").write_text("x = 1\n")
    bid = start(sidecar, tmp_path, reply(*[edit(f"f{i}.txt") for i in range(n)]), reply(edit("f0.txt", "x = 0")),
                caps=PERM, policy="ask", permissionTimeoutMs=120_000)
    lock = threading.Lock()
    asked: list[str] = []
    all_asked, release = threading.Event(), threading.Event()

    def perm(p):
        with lock:
            asked.append(p["arguments"]["path"])
            if len(asked) == PENDING_LIMIT:
                all_asked.set()
        release.wait(120)
        return {"decision": "allow_once"}

    sidecar.on_request("requestToolPermission", perm)
    pending = sidecar.request_async("operate", {"branchId": bid, "instruction": "go", "actions": True})
    try:
        assert all_asked.wait(120), f"only {len(asked)} permission requests came"
        for i in range(n):  # the user changes every file while the requests are open
            (tmp_path / f"f{i}.txt").write_text("# the user's line\nx = 1\n")
    finally:
        release.set()
    res = pending.result(120)
    outs = {r["arguments"]["path"]: r["output"] for r in res["result"]["action_responses"]}
    assert all((tmp_path / f"f{i}.txt").read_text() == "# the user's line\nx = 1\n" for i in range(n))
    assert len(outs) == n and len(asked) == PENDING_LIMIT
    refused = sorted(p for p, o in outs.items() if TOO_MANY in str(o.get("error")))
    assert len(refused) == n - PENDING_LIMIT and not set(refused) & set(asked)
    assert "nothing was written" in outs[refused[0]]["error"]
    for p in asked:
        assert "changed after the change was previewed; nothing was written" in outs[p]["error"], (p, outs[p])
    # every plan went with its call: the next change is put to the user again, and lands
    asked.clear()
    (tmp_path / "f0.txt").write_text("x = 0\n")
    (out,) = outputs(sidecar, bid)
    assert asked == ["f0.txt"] and out.get("added") == 1, out
    assert (tmp_path / "f0.txt").read_text() == "x = 2\n"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_failed_preview_keeps_its_error_however_many_previews_follow(tmp_path, anyio_backend):
    """A call whose preview failed (its edit did not apply) is never put to the user: it must
    fail with that error when it runs. Its kept error was dropped for room once PENDING_LIMIT
    other previews followed, and the call, planned again from the file as it then was, wrote a
    change nobody was asked about. Plans go with their tasks: none is left behind."""
    ws = WorkspaceTools([tmp_path])
    tools = {t.name: t for t in ws.tools()}
    t = tools["edit_file"]
    for i in range(PENDING_LIMIT):
        (tmp_path / f"f{i}.txt").write_text("x = 1\n")
    (tmp_path / "a.txt").write_text("y = 1\n")
    args = {"path": "a.txt", "edits": [{"oldText": "x = 1", "newText": "x = 2"}]}
    ctx = ToolCallContext("b1", "a")
    with pytest.raises(ToolCallError, match="oldText not found"):
        await t.preview(args, ctx)
    held, decided = anyio.Event(), anyio.Event()
    previewed = [0]

    async def other(i: int) -> None:  # each call in its own task, as a reply's calls run
        c = ToolCallContext("b1", f"c{i}")
        await t.preview({"path": f"f{i}.txt", "edits": [{"oldText": "x = 1", "newText": "x = 2"}]}, c)
        previewed[0] += 1
        if previewed[0] == PENDING_LIMIT:
            held.set()
        await decided.wait()
        t.forget(c.call_id)  # denied

    refused: list[str] = []
    was_refused = anyio.Event()

    async def one_too_many() -> None:
        try:
            await t.preview({"path": "a.txt", "edits": [{"oldText": "x = 1", "newText": "x = 3"}]},
                            ToolCallContext("b1", "late"))
        except ToolCallError as e:
            refused.append(str(e))
        finally:
            was_refused.set()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            for i in range(PENDING_LIMIT):
                tg.start_soon(other, i)
            await held.wait()
            (tmp_path / "a.txt").write_text("x = 1\n")  # now the edit would apply
            with pytest.raises(ToolCallError, match="oldText not found"):
                await t.call(args, ctx)
            tg.start_soon(one_too_many)  # in a task that ends without running its call
            await was_refused.wait()
            decided.set()
    assert (tmp_path / "a.txt").read_text() == "x = 1\n"
    assert TOO_MANY in refused[0] and "nothing was written" in refused[0]
    await anyio.sleep(0)  # the ended tasks' callbacks
    file_tools = t.forget.__self__  # every call ran, was denied, or its task ended: nothing is kept
    assert file_tools._plans == {} and file_tools._owned == {} and file_tools_module._Pending.changes == 0


EDIT = [{"oldText": "x = 1", "newText": "x = 2"}]


def edit_tool(folder: Path):
    """The edit_file tool of a new set of workspace tools, as the service builds one."""
    return {t.name: t for t in WorkspaceTools([folder]).tools()}["edit_file"]


def preview_size(preview: dict) -> int:
    return len(preview["oldText"] or "") + len(preview["newText"]) + len(preview["diff"])


async def hold_previews(tg, previews: list[tuple]) -> tuple[list[dict], anyio.Event]:
    """Preview each ``(tool, path)`` in its own task (as a reply's calls run), held undecided until
    the event returned is set, then denied; returns once all are previewed, with the previews."""
    shown: list[dict] = []
    done, decided = anyio.Event(), anyio.Event()

    async def one(tool, path: str, call_id: str) -> None:
        c = ToolCallContext("b1", call_id)
        shown.append(await tool.preview({"path": path, "edits": EDIT}, c))
        if len(shown) == len(previews):
            done.set()
        await decided.wait()
        tool.forget(call_id)

    for i, (tool, path) in enumerate(previews):
        tg.start_soon(one, tool, path, f"held{i}")
    await done.wait()
    return shown, decided


def assert_nothing_waits(*tools) -> None:
    for t in tools:
        ft = t.forget.__self__
        assert ft._plans == {} and ft._owned == {}
    assert file_tools_module._Pending.changes == 0 and file_tools_module._Pending.chars == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_previews_waiting_are_bounded_by_the_text_they_hold(tmp_path, monkeypatch, anyio_backend):
    """Each waiting plan holds the file's old text, its new text and the diff (up to 10 MiB each):
    256 of them could hold gigabytes. Past PENDING_CHARS characters of text waiting (made small
    here) a preview is refused as one past the count is: nobody is asked, the call fails with that
    error, nothing is written; once the others are decided, the change is previewed again."""
    pad = "# " + "p" * 400 + "\n"
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(pad + "x = 1\n")
    t = edit_tool(tmp_path)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            shown, decided = await hold_previews(tg, [(t, "a.txt"), (t, "b.txt")])
            size = preview_size(shown[0])
            assert file_tools_module._Pending.chars == 2 * size
            monkeypatch.setattr(file_tools_module, "PENDING_CHARS", 2 * size + size // 2)
            ctx = ToolCallContext("b1", "late")
            with pytest.raises(ToolCallError, match=TOO_MUCH) as refused:
                await t.preview({"path": "c.txt", "edits": EDIT}, ctx)
            assert "nothing was written" in str(refused.value), refused.value
            assert f"this change holds {size} characters" in str(refused.value), refused.value
            with pytest.raises(ToolCallError, match=TOO_MUCH):  # the call fails with it, unplanned never
                await t.call({"path": "c.txt", "edits": EDIT}, ctx)
            decided.set()
        assert (tmp_path / "c.txt").read_text() == pad + "x = 1\n"
        assert_nothing_waits(t)
        preview = await t.preview({"path": "c.txt", "edits": EDIT}, ToolCallContext("b1", "again"))
        assert preview_size(preview) == size
        await t.call({"path": "c.txt", "edits": EDIT}, ToolCallContext("b1", "again"))
    assert (tmp_path / "c.txt").read_text() == pad + "x = 2\n"
    assert_nothing_waits(t)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("bound", ["count", "text"])
async def test_previews_waiting_are_counted_over_every_set_of_tools(tmp_path, monkeypatch, anyio_backend, bound):
    """The service builds new workspace tools when the workspace folders change (an ACP session
    with another cwd) while the old tools' previews still wait: the new tools started counting
    from 0, so the bounds held per set of tools, not for the process. Two sets of tools (bounds
    made small, room for two changes): two previews wait on the first, and a preview on the
    second is refused."""
    other = tmp_path / "other"
    other.mkdir()
    for f in (tmp_path / "a.txt", tmp_path / "b.txt", other / "c.txt"):
        f.write_text("x = 1\n")
    first, second = edit_tool(tmp_path), edit_tool(other)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            if bound == "count":
                monkeypatch.setattr(file_tools_module, "PENDING_LIMIT", 2)
            shown, decided = await hold_previews(tg, [(first, "a.txt"), (first, "b.txt")])
            if bound == "text":
                monkeypatch.setattr(file_tools_module, "PENDING_CHARS", 2 * preview_size(shown[0]) + 1)
            with pytest.raises(ToolCallError, match=TOO_MANY if bound == "count" else TOO_MUCH) as refused:
                await second.preview({"path": "c.txt", "edits": EDIT}, ToolCallContext("b2", "c"))
            assert "nothing was written" in str(refused.value), refused.value
            second.forget("c")
            decided.set()
        assert_nothing_waits(first, second)
        await second.preview({"path": "c.txt", "edits": EDIT}, ToolCallContext("b2", "c"))  # room again
        await second.call({"path": "c.txt", "edits": EDIT}, ToolCallContext("b2", "c"))
    assert (other / "c.txt").read_text() == "x = 2\n" and (tmp_path / "a.txt").read_text() == "x = 1\n"
    assert_nothing_waits(first, second)


# ----------------------------------------------------------------- the client's text over the bound


@pytest.mark.parametrize("big", ["x" * (MAX_WRITE + 10) + "\n", "é" * (MAX_WRITE // 2 + 10) + "\n"],
                         ids=["ascii", "two-byte characters"])
def test_a_client_buffer_over_the_size_bound_is_neither_edited_nor_replaced(sidecar, tmp_path, big):
    """With the client's file system, a buffer over 10 MiB (of UTF-8: 5 Mi two-byte characters
    are over it too) is refused as the disk's file is, with the same error and before anyone is
    asked: write_file replaced it (the user shown 10 MiB of old text), edit_file said its text
    "would be 10485771 characters long"."""
    (tmp_path / "big.txt").write_text("small on disk\n")
    path = str(tmp_path.resolve() / "big.txt")
    buffers = {path: big}
    bid = start(sidecar, tmp_path, reply(edit("big.txt", big[-2:], "y\n")), reply(call("write_file", path="big.txt",
                                                                                  content="small\n")),
                caps={"fs": True, **PERM}, policy="ask")
    asked: list = []
    written: list = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    sidecar.on_request("fs/readTextFile", lambda p: {"text": buffers[p["path"]]})
    sidecar.on_request("fs/writeTextFile", lambda p: written.append(p["path"]) or {})
    for _ in range(2):
        (out,) = outputs(sidecar, bid, timeout=60)
        assert out.get("error") == f"'big.txt' is larger than {MAX_WRITE} bytes", out
    assert asked == [] and written == [] and buffers[path] == big


# ----------------------------------------------------------------- long names


def test_a_long_utf8_name_is_edited_and_created(sidecar, tmp_path):
    """A legal name of 244 bytes (80 CJK characters): its temporary file's name was cut at 200
    characters, over NAME_MAX, and the write failed after the user allowed it, with a raw
    "[Errno 36] File name too long" naming the temporary file."""
    name, new = "中" * 80 + ".txt", "é" * 120 + ".md"
    assert len(name.encode()) == 244 and len(new.encode()) == 243
    (tmp_path / name).write_text("long\n")
    bid = start(sidecar, tmp_path, reply(edit(name, "long", "LONG")), reply(call("write_file", path=new, content="new\n")),
                caps=PERM, policy="ask")
    asked: list = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p["tool"]) or {"decision": "allow_once"})
    (out,) = outputs(sidecar, bid)
    assert "error" not in out and (tmp_path / name).read_text() == "LONG\n", out
    (out,) = outputs(sidecar, bid)
    assert out.get("created") is True and (tmp_path / new).read_text() == "new\n", out
    assert asked == ["edit_file", "write_file"] and sorted(os.listdir(tmp_path)) == sorted([name, new])


@pytest.mark.parametrize("raw", [b"\xff" * 251 + b".txt", "中".encode() * 85, b"a" * 255, b"\xe4\xb8" + b"a" * 253],
                         ids=["not utf-8", "85 CJK", "255 ascii", "a cut character"])
def test_any_legal_name_has_a_legal_temporary_name(tmp_path, raw):
    """The temporary file's name takes at most 200 bytes of the name, cut between characters
    (a byte of a name that is not UTF-8 counts as one), so every name of up to 255 bytes can be
    written, created and replaced; nothing else is left in the directory."""
    name = os.fsdecode(raw)
    assert len(raw) <= 255
    assert safe_fs.write_bytes_atomic(tmp_path, [name], b"one") is True
    assert safe_fs.write_bytes_atomic(tmp_path, [name], b"two") is False
    assert os.listdir(os.fsencode(tmp_path)) == [raw] and (tmp_path / name).read_bytes() == b"two"


# ----------------------------------------------------------------- paths that cannot name a file


def test_paths_that_cannot_name_a_file_are_refused(sidecar, tmp_path):
    """``notes.txt/.`` replaced notes.txt, ``notes.txt/../other.txt`` and ``missing/../other2.txt``
    created other.txt (realpath simplifies them; open(2) refuses all three). A path ending in
    ``.`` or ``..`` names a directory, as one ending in ``/`` does; a ``..`` must follow a
    directory. A ``..`` after a directory still works, and confinement is as it was."""
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "sub").mkdir()
    bad = {"notes.txt/.": "'notes.txt/.' ends with '.', so it names a directory, not a file",
           "notes.txt/..": "goes up ('..') from 'notes.txt', which is not a directory",
           "sub/..": "'sub/..' ends with '..', so it names a directory, not a file",
           "notes.txt/../other.txt": "goes up ('..') from 'notes.txt', which is not a directory",
           "missing/../other2.txt": "goes up ('..') from 'missing', which does not exist",
           "sub/missing/../../other3.txt": "goes up ('..') from 'sub/missing', which does not exist",
           "../outside.txt": "is outside the workspace folders"}
    good = {"sub/../made.txt": "made.txt"}
    calls = [call("write_file", path=p, content="model\n") for p in (*bad, *good)]
    calls += [edit("notes.txt/.", "mine", "theirs"), call("read_file", path="notes.txt/."),
              call("read_file", path="notes.txt/../notes.txt")]
    bid = start(sidecar, tmp_path, *[reply(c) for c in calls])
    for p, why in bad.items():
        (out,) = outputs(sidecar, bid)
        assert why in str(out.get("error")), (p, out)
    for p, shown in good.items():
        (out,) = outputs(sidecar, bid)
        assert out.get("path") == shown and out.get("created") is True, (p, out)
    for why in ("ends with '.'", "ends with '.'", "from 'notes.txt', which is not a directory"):
        (out,) = outputs(sidecar, bid)
        assert why in str(out.get("error")), out
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert sorted(os.listdir(tmp_path)) == ["made.txt", "notes.txt", "sub"]
    assert not (tmp_path.parent / "outside.txt").exists()


# ----------------------------------------------------------------- the largest write in one reply


def test_a_reply_carrying_the_largest_write_is_taken(sidecar, tmp_path):
    """A write_file of 10 MiB, the most new text the tools take, whose every character JSON
    writes as two (a tab, a quote, a backslash, a newline): the reply, over 20 MiB, was over the
    extraction bound (10,000,000 characters) and taken as plain text; the operate answered
    ``kind: "text"``, nothing was written, nothing said why."""
    content = '\t"\\\n' * (MAX_WRITE // 4)
    assert len(content.encode()) == MAX_WRITE
    response = reply(call("write_file", path="big.txt", content=content))
    assert len(json.dumps(response["json"], ensure_ascii=False)) > 2 * MAX_WRITE
    bid = start(sidecar, tmp_path, response)
    res = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=120)
    assert res["kind"] != "text"
    (out,) = [r["output"] for r in res["result"]["action_responses"]]
    assert "error" not in out, str(out)[:300]
    assert (tmp_path / "big.txt").read_bytes() == content.encode()
