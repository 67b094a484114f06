"""What the editor is shown about a tool call whose path is no file name (a NUL, half a
surrogate pair), and the ``diff`` of a file edit: the file tool's own (its preview when the
user is asked, else the change it made), never a guess the front end makes by reading the
file itself (docs/PROTOCOL.md §13)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from types import SimpleNamespace

from acp_support import RecordingClient, bounded, cfg, reply, run, sdk_prompt, spawn

from operate_sidecar.server.service.governance import Governance


def diffs(update) -> list[tuple[str | None, str]]:
    return [(x.old_text, x.new_text) for x in update.content or () if x.type == "diff"]


def finals(c: RecordingClient) -> list:
    return [u for u in c.of("tool_call_update") if u.status in ("completed", "failed")]


def test_a_path_that_is_no_file_name_is_asked_about_without_a_location_and_the_turn_goes_on(tmp_path, ws):
    """A tool asked about (``ask``) called with a ``path`` holding a NUL: describing the call for
    the permission request resolved the path (``os.path.realpath``), which raised ValueError, and
    the whole prompt failed with -32603 (no request, no tool call, the turn lost). The user is
    asked about it, shown without a location; the reject is the call's outcome, the turn ends
    normally, the session goes on, and ``session/load`` shows the call again."""
    async def main():
        c = RecordingClient("reject_once")
        config = cfg(tmp_path, reply("", [("write_note", {"path": "x\x00y", "content": "M"})]), reply("after"),
                     toolModules=["acp_fixture_tools"], toolPolicy={"write_note": "ask"})
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn"
            [(asked, _)] = c.permissions
            assert asked.title == "write_note x\x00y" and not asked.locations, asked
            [start] = c.of("tool_call")
            assert start.title == "write_note x\x00y" and not start.locations
            [done] = finals(c)
            assert done.status == "failed" and done.raw_output["reason"] == "denied by the user", done.raw_output
            assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn" and c.text() == "after"

            c.updates.clear()
            await bounded(conn.load_session(cwd=str(ws), session_id=sid, mcp_servers=[]))
            [replayed] = c.of("tool_call")
            assert replayed.title == "write_note x\x00y" and not replayed.locations

    run(main())


def test_a_path_that_is_no_file_name_is_shown_with_its_title_and_no_traceback(tmp_path, ws, capfd):
    """``read_file`` of ``a.txt\\0`` and a ``write_file`` of a path holding half a surrogate pair
    (allowed without asking): the port's ``tool_decided`` raised on resolving the path, a
    warning with a traceback went to stderr for each call, and the calls lost their titles
    (shown as the bare tool names). They are shown titled, without a location, and fail with
    the tool's own error; stderr has no traceback."""
    broken = ('{"message": "", "action_required": true, "action_requests": [{"function": "write_file", '
              '"arguments": {"path": "b\\ud800.txt", "content": "x"}}]}')  # (a JSON escape can carry half a pair)

    async def main():
        c = RecordingClient()
        config = cfg(tmp_path, reply("", [("read_file", {"path": "a.txt\x00"})]), reply("read"), broken, reply("wrote"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn"
            assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn"
            read, write = c.of("tool_call")
            assert read.title == "Read a.txt\x00" and not read.locations, read
            assert write.title == "Write b\ufffd.txt" and not write.locations, write  # (U+FFFD on the wire)
            assert [u.status for u in finals(c)] == ["failed", "failed"]
            assert "NUL" in finals(c)[0].raw_output["error"] and "surrogate" in finals(c)[1].raw_output["error"]
            assert not c.permissions and c.text() == "readwrote"

    run(main())
    err = capfd.readouterr().err
    assert "Traceback" not in err and "tool_decided failed" not in err, err[-3000:]


def test_a_permission_request_that_raises_in_the_front_end_denies_that_call_only():
    """Governance's ``_ask`` let anything but a client error or a time-out out of the front end's
    ``requestToolPermission`` (the ACP port raising on a path it could not resolve): it ended
    the whole operate (the ACP prompt answered -32603). It is that call's deny, saying why."""
    async def broken_port(method: str, params: dict, timeout: float):
        raise ValueError("embedded null byte")

    governance = Governance(settings_policy={}, timeout_ms=1000, can_ask=lambda: True, ask_client=broken_port)
    result = asyncio.run(asyncio.wait_for(governance._ask(SimpleNamespace(function="touch", branch_id="b"), {}), 30))
    assert not result.allowed and result.reason == "permission request failed: ValueError: embedded null byte"


def chain(start: str, pairs: list[tuple[str | None, str]]) -> str:
    """Follow changes from ``start``, each from the text the one before left: the text at the end
    (an assertion fails when one does not start where the file was)."""
    text, left = start, list(pairs)
    while left:
        step = next((p for p in left if p[0] == text), None)
        assert step is not None, f"no change shown starts from {text!r}: {pairs}"
        left.remove(step)
        text = step[1]
    return text


def test_edits_allowed_without_asking_show_the_change_each_made(tmp_path, ws):
    """``auto-edit`` (nobody asked): two changes of one file in one reply. The port made each
    call's diff itself, as the call was decided (both before either ran), from the file as it
    was then: the second ``write_file`` was shown replacing ``one two``, which the first had
    already replaced; the second ``edit_file`` was shown undoing the first. Each call now shows
    the change it made (the tool's own, from its output), once it ran: one after the other, they
    lead from the old text to the file as it is. Nothing is shown before (no guess)."""
    async def main(calls):
        c = RecordingClient()
        (ws / "x.txt").write_text("one\ntwo\n")
        config = cfg(tmp_path, reply("", calls), reply("ok"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn"
        assert not c.permissions
        assert [diffs(u) for u in c.of("tool_call")] == [[], []]
        done = finals(c)
        assert [u.status for u in done] == ["completed", "completed"]
        final = (ws / "x.txt").read_text()
        assert chain("one\ntwo\n", [d for u in done for d in diffs(u)]) == final
        assert all(len(diffs(u)) == 1 and u.content[0].path == str(ws / "x.txt") for u in done)
        return final

    writes = [("write_file", {"path": "x.txt", "content": "A\n"}), ("write_file", {"path": "x.txt", "content": "B\n"})]
    assert run(main(writes)) in ("A\n", "B\n")
    edits = [("edit_file", {"path": "x.txt", "edits": [{"oldText": "one", "newText": "ONE"}]}),
             ("edit_file", {"path": "x.txt", "edits": [{"oldText": "two", "newText": "TWO"}]})]
    assert run(main(edits)) == "ONE\nTWO\n"


def test_an_edit_that_cannot_apply_is_shown_with_its_error_and_no_diff(tmp_path, ws):
    """``auto-edit``: an ``edit_file`` whose ``oldText`` matches twice changes nothing; it was shown
    running with the diff the port made up (the first match replaced), then failed with that
    diff still attached. It shows no diff at all, only its error."""
    async def main():
        c = RecordingClient()
        (ws / "x.txt").write_text("dup\ndup\n")
        config = cfg(tmp_path, reply("", [("edit_file", {"path": "x.txt",
                                                        "edits": [{"oldText": "dup", "newText": "CHANGED"}]})]),
                     reply("ok"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn"
        [start] = c.of("tool_call")
        [failed] = finals(c)
        assert failed.status == "failed" and "matches 2 times" in failed.raw_output["error"]
        assert not diffs(start) and not diffs(failed), (start.content, failed.content)
        assert [x.type for x in failed.content] == ["content"] and "matches 2 times" in failed.content[0].content.text
        assert (ws / "x.txt").read_text() == "dup\ndup\n"

    run(main())


class ChangesTheFileWhenAsked(RecordingClient):
    """Allows the call, having changed its file on disk meanwhile (as the user might, in
    another program, while the question is open)."""

    def __init__(self, path) -> None:
        super().__init__("allow_once")
        self.path = path

    async def request_permission(self, session_id, tool_call, options, **kw):
        self.path.write_text("changed meanwhile\n")
        return await super().request_permission(session_id, tool_call, options, **kw)


def test_an_allowed_edit_that_then_fails_keeps_no_diff_in_its_last_update(tmp_path, ws):
    """Asked with its preview, allowed, then refused by the tool (the file changed after the
    preview: nothing written): its last update kept the previewed diff next to the error, a
    change that was never made. It has the error only; the permission request had the diff."""
    async def main():
        c = ChangesTheFileWhenAsked(ws / "a.txt")
        config = cfg(tmp_path, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("ok"))
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn"
        [(asked, _)] = c.permissions
        assert diffs(asked) == [("old text\n", "new\n")]
        [failed] = finals(c)
        assert failed.status == "failed" and "changed after the change was previewed" in failed.raw_output["error"]
        assert not diffs(failed), failed.content
        assert (ws / "a.txt").read_text() == "changed meanwhile\n"

    run(main())


def test_a_diff_never_shows_a_file_outside_the_workspace_swapped_in_by_a_symlink(tmp_path):
    """``auto-edit`` on the disk: the port read the old text for its diff itself, following
    symlinks (``os.stat`` / ``os.open`` on the path ``realpath`` gave a moment before). With
    ``ws/sub`` flipping between a folder and a symlink to a folder outside, about half of 80
    calls were shown the outside file's text. The diff is the tool's own change (whose reads
    are confined, docs/SECURITY.md G8): no update carries the outside text."""
    ws, out, real = tmp_path / "ws", tmp_path / "outside", tmp_path / "realsub"
    ws.mkdir()
    out.mkdir()
    real.mkdir()
    (out / "f.txt").write_text("SECRET outside\n")
    (real / "f.txt").write_text("inside f\n")
    turns = 80
    config = cfg(tmp_path, *[r for _ in range(turns) for r in (
        reply("", [("write_file", {"path": "sub/f.txt", "content": "inside f\n"})]), reply("ok"))])
    stop = threading.Event()

    def flip() -> None:
        link = ws / "sub"
        while not stop.is_set():
            try:
                os.rename(real, link)
                stop.wait(0.0003)
                os.rename(link, real)
                os.symlink(out, link)
                stop.wait(0.0003)
                os.unlink(link)
            except OSError:
                pass

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            await bounded(conn.set_config_option(config_id="mode", session_id=sid, value="auto-edit"))
            flipper = threading.Thread(target=flip)
            flipper.start()
            try:
                for _ in range(turns):
                    assert (await sdk_prompt(conn, sid)).stop_reason == "end_turn"
            finally:
                stop.set()
                flipper.join(10)
        return c

    c = run(main(), 300)
    shown = [json.dumps(u.model_dump(mode="json")) for _, u in c.updates]
    assert len(c.of("tool_call")) == turns
    assert not [u for u in shown if "SECRET outside" in u], [u[:300] for u in shown if "SECRET" in u][:2]
    assert (out / "f.txt").read_text() == "SECRET outside\n"
