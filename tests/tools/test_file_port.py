"""The file tools' port (server/tools/file_tools.py): any front end can supply its own
``FileAccess``; previews plan without writing; a planned call writes only onto the text it
was planned from."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.tools import ToolCallError, WorkspaceTools

pytestmark = pytest.mark.anyio


class Memory:
    """A FileAccess keeping files in a dict (what an editor front end's buffers look like)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.calls: list[tuple[str, str]] = []

    async def read_text(self, real: Path, ctx: ToolCallContext) -> str | None:
        self.calls.append(("read", ctx.call_id))
        return self.files.get(str(real))

    async def write_text(self, real: Path, text: str, ctx: ToolCallContext) -> None:
        self.calls.append(("write", ctx.call_id))
        self.files[str(real)] = text


def tools_with(tmp_path: Path, files: dict[str, str]) -> tuple[dict, Memory]:
    mem = Memory(files)
    return {t.name: t for t in WorkspaceTools([tmp_path], files=mem).tools()}, mem


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_a_front_end_supplies_its_own_file_access(tmp_path):
    path = str(tmp_path.resolve() / "a.py")
    tools, mem = tools_with(tmp_path, {path: "x = 1\n"})
    ctx = ToolCallContext("b1", "c1")
    out = await tools["edit_file"].call({"path": "a.py", "edits": [{"oldText": "1", "newText": "2"}]}, ctx)
    assert mem.files[path] == "x = 2\n" and out["added"] == out["removed"] == 1
    assert not (tmp_path / "a.py").exists()                                    # never the disk
    read = await tools["read_file"].call({"path": "a.py"}, ToolCallContext("b1", "c2"))
    assert read["content"] == "x = 2\n"
    assert mem.calls == [("read", "c1"), ("read", "c1"), ("write", "c1"), ("read", "c2")]


async def test_preview_plans_without_writing_and_the_call_writes_the_plan(tmp_path):
    path = str(tmp_path.resolve() / "a.py")
    tools, mem = tools_with(tmp_path, {path: "v = 1\n"})
    t, ctx = tools["edit_file"], ToolCallContext("b1", "c1")
    args = {"path": "a.py", "edits": [{"oldText": "v = 1", "newText": "v = 2"}]}
    preview = await t.preview(args, ctx)
    assert preview == {"kind": "diff", "path": path, "oldText": "v = 1\n", "newText": "v = 2\n",
                       "diff": "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-v = 1\n+v = 2\n"}
    assert mem.files[path] == "v = 1\n" and [k for k, _ in mem.calls] == ["read"]
    await t.call(args, ctx)
    assert mem.files[path] == "v = 2\n"


async def test_a_planned_call_onto_a_changed_file_writes_nothing(tmp_path):
    path = str(tmp_path.resolve() / "a.py")
    tools, mem = tools_with(tmp_path, {path: "v = 1\n"})
    t, ctx = tools["write_file"], ToolCallContext("b1", "c1")
    await t.preview({"path": "a.py", "content": "new\n"}, ctx)
    mem.files[path] = "v = 1\nedited meanwhile\n"
    with pytest.raises(ToolCallError, match="changed after the change was previewed"):
        await t.call({"path": "a.py", "content": "new\n"}, ctx)
    assert mem.files[path] == "v = 1\nedited meanwhile\n"


async def test_a_failed_plan_fails_the_call_without_replanning(tmp_path):
    path = str(tmp_path.resolve() / "a.py")
    tools, mem = tools_with(tmp_path, {path: "a\n"})
    t, ctx = tools["edit_file"], ToolCallContext("b1", "c1")
    args = {"path": "a.py", "edits": [{"oldText": "b", "newText": "c"}]}
    with pytest.raises(ToolCallError, match="edit 0: oldText not found"):
        await t.preview(args, ctx)
    mem.files[path] = "b\n"                      # now it would apply: the call must still fail, unasked
    with pytest.raises(ToolCallError, match="edit 0: oldText not found"):
        await t.call(args, ctx)
    assert mem.files[path] == "b\n"


async def test_denied_plans_are_forgotten(tmp_path):
    path = str(tmp_path.resolve() / "a.py")
    tools, mem = tools_with(tmp_path, {path: "a\n"})
    t, ctx = tools["write_file"], ToolCallContext("b1", "c1")
    await t.preview({"path": "a.py", "content": "b\n"}, ctx)
    t.forget("c1")
    mem.files[path] = "changed\n"   # unplanned now: the call re-plans from the current text
    await t.call({"path": "a.py", "content": "b\n"}, ctx)
    assert mem.files[path] == "b\n"


async def test_an_unplanned_call_rechecks_the_file_just_before_writing(tmp_path):
    class Typing(Memory):
        async def read_text(self, real: Path, ctx: ToolCallContext) -> str | None:
            text = await super().read_text(real, ctx)
            self.files[str(real)] = (text or "") + "typed\n"  # the user types after every read
            return text

    path = str(tmp_path.resolve() / "a.py")
    mem = Typing({path: "v = 1\n"})
    edit = {t.name: t for t in WorkspaceTools([tmp_path], files=mem).tools()}["edit_file"]
    with pytest.raises(ToolCallError, match="changed while the change was being made; nothing was written"):
        await edit.call({"path": "a.py", "edits": [{"oldText": "v = 1", "newText": "v = 2"}]},
                        ToolCallContext("b1", "c1"))
    assert "write" not in [k for k, _ in mem.calls] and mem.files[path].startswith("v = 1\ntyped\n")


async def test_an_edit_of_a_file_that_is_not_utf8_is_refused_and_leaves_its_bytes(tmp_path):
    """Text decoded with replacement characters would be written back with the file's other
    non-UTF-8 bytes destroyed: the edit fails and the file keeps every byte."""
    raw = "café = 1\n".encode("latin-1") + b"x = 1\n"
    (tmp_path / "old.py").write_bytes(raw)
    tools = {t.name: t for t in WorkspaceTools([tmp_path]).tools()}
    args = {"path": "old.py", "edits": [{"oldText": "x = 1", "newText": "x = 2"}]}
    with pytest.raises(ToolCallError, match="not UTF-8"):
        await tools["edit_file"].call(args, ToolCallContext("b1", "c1"))
    assert (tmp_path / "old.py").read_bytes() == raw



async def within(aw, seconds: float = 5.0):
    """``await aw`` in this task (asyncio.wait_for would run it in another), bounded."""
    with anyio.fail_after(seconds):
        return await aw


async def test_a_previewed_call_holds_its_file_until_it_runs_or_is_forgotten(tmp_path):
    """Another change of the file is planned only after the previewed one is written or
    forgotten, from the text as it then is; another file never waits."""
    a, b = str(tmp_path.resolve() / "a.py"), str(tmp_path.resolve() / "b.py")
    tools, mem = tools_with(tmp_path, {a: "1\n", b: "x\n"})
    edit = tools["edit_file"]
    one = {"path": "a.py", "edits": [{"oldText": "1", "newText": "2"}]}
    two = {"path": "a.py", "edits": [{"oldText": "2", "newText": "3"}]}
    await edit.preview(one, ToolCallContext("b1", "c1"))                   # this task holds a.py
    async with anyio.create_task_group() as tg:
        got: dict = {}
        second_planned = anyio.Event()

        async def second():  # another call (its own task): previews, then is denied
            got["two"] = await edit.preview(two, ToolCallContext("b1", "c2"))
            second_planned.set()
            await anyio.sleep_forever()

        tg.start_soon(second)
        other = await within(edit.preview({"path": "b.py", "edits": [{"oldText": "x", "newText": "y"}]},
                                          ToolCallContext("b1", "c3")))
        assert other["newText"] == "y\n" and "two" not in got                # b.py at once; a.py waits
        await within(edit.call(one, ToolCallContext("b1", "c1")))
        await within(second_planned.wait())
        assert got["two"]["oldText"] == "2\n"                                 # planned from the written text
        with anyio.move_on_after(0.2):
            await edit.preview(two, ToolCallContext("b1", "c4"))             # still c2's turn
            raise AssertionError("planned while another call held the file")
        edit.forget("c2")                                                    # denied: the file is free
        assert (await within(edit.preview(two, ToolCallContext("b1", "c5"))))["oldText"] == "2\n"
        tg.cancel_scope.cancel()
    edit.forget("c5")
    edit.forget("c3")


async def test_a_turn_held_by_a_call_that_never_runs_is_given_back(tmp_path):
    """Allowed, then never run (a hook vetoed it): the turn goes when the call's task ends, or
    when the same task changes that file again; a cancelled wait takes nothing."""
    from operate_sidecar.server.tools import file_tools

    path = str(tmp_path.resolve() / "a.py")
    tools, mem = tools_with(tmp_path, {path: "1\n"})
    edit, write = tools["edit_file"], tools["write_file"]
    args = {"path": "a.py", "edits": [{"oldText": "1", "newText": "2"}]}
    async with anyio.create_task_group() as tg:
        tg.start_soon(edit.preview, args, ToolCallContext("b1", "c1"))     # its task ends: given back
    await within(edit.preview(args, ToolCallContext("b1", "c2")))          # this task holds it now
    await within(edit.call(args, ToolCallContext("b1", "c3")))             # same task: c2 never ran
    assert mem.files[path] == "2\n"
    with pytest.raises(ToolCallError, match="not found"):
        await edit.call(args, ToolCallContext("b1", "c2"))                 # c2's plan went with its turn
    async with anyio.create_task_group() as tg:
        held = anyio.Event()

        async def holder():
            await write.preview({"path": "a.py", "content": "x\n"}, ToolCallContext("b1", "c4"))
            held.set()
            await anyio.sleep_forever()

        tg.start_soon(holder)
        await within(held.wait())
        with anyio.move_on_after(0.2):                                      # a wait that is cancelled
            await write.call({"path": "a.py", "content": "y\n"}, ToolCallContext("b1", "c5"))
            raise AssertionError("wrote while another call held the file")
        tg.cancel_scope.cancel()                                           # the holder's task ends
    await within(write.call({"path": "a.py", "content": "z\n"}, ToolCallContext("b1", "c6")))
    assert mem.files[path] == "z\n" and file_tools._PATH_LOCKS == {}
