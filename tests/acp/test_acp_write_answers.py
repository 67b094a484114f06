"""What the editor answers ``fs/write_text_file`` with, judged as the native front end judges
``fs/writeTextFile`` (docs/PROTOCOL.md §10): the ACP port hands back the editor's raw result
and the file tools' one check (``write_failed``) decides. An object with an ``error`` in it is
a failed write (the port reported it written, with its diff, while the file kept its old text);
``true`` is a write done (an editor whose handler returns its save's success)."""

from __future__ import annotations

import json

import pytest
from acp_support import RecordingClient, bounded, cfg, reply, run, spawn
from acp_support import sdk_prompt as prompt


class WriteAnswers(RecordingClient):
    """Answers ``fs/write_text_file`` with ``answer``; keeps the text only for a write done."""

    def __init__(self, answer, done: bool):
        super().__init__("allow_once")
        self.answer, self.done = answer, done

    async def write_text_file(self, session_id, path, content, **kw):
        if self.done:
            self.files[path] = content
        self.writes.append((path, content))
        return self.answer


@pytest.mark.parametrize("answer, done", [({"error": "disk full"}, False), ({"error": {"code": 28}}, False),
                                          ("failed to save", False), (True, True), ({"saved": True}, True)],
                         ids=["error-member", "error-object", "string", "true", "object"])
def test_a_write_answer_is_judged_as_the_native_front_end_judges_it(tmp_path, ws, capfd, answer, done):
    async def main():
        c = WriteAnswers(answer, done)
        path = str(ws / "a.txt")
        c.files[path] = "old text\n"
        config = cfg(tmp_path, reply("", [("edit_file", {"path": "a.txt", "edits": [{"oldText": "old", "newText": "new"}]})]),
                     reply("done"))
        async with spawn(c, config, fs=True) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
            assert c.writes == [(path, "new text\n")]
            last = c.of("tool_call_update")[-1]
            if done:
                assert last.status == "completed" and c.files[path] == "new text\n", last
            else:
                shown = json.dumps(answer)
                assert last.status == "failed", last
                assert last.raw_output["error"] == f"the client could not write {path}: it answered fs/writeTextFile " \
                                                   f"with {shown} (a write done is answered with {{}})", last.raw_output
                assert "added" not in last.raw_output and not [
                    b for b in (last.content or []) if getattr(b, "type", None) == "diff"], last
                assert c.files[path] == "old text\n"

    run(main())
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "not a write done" in line]
    if done:
        assert warnings == [], err
    else:
        assert len(warnings) == 1 and "WARNING" in warnings[0] and json.dumps(answer) in warnings[0], err
        assert "Traceback" not in err, err
