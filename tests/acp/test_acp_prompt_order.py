"""The order of a session's prompts, cancels and close when a client sends them in one burst
(as CodeCompanion and Zed do: a cancel and the next prompt together, a close as the panel
goes), over real pipes from a plain newline-delimited JSON client, so that the lines reach the
agent in one read: the SDK's client writes each message on its own."""

from __future__ import annotations

import json
import time

from acp_support import cancel, prompt, reply, req, start


def test_a_prompt_sent_with_the_close_is_refused_and_the_close_answers_once_the_turn_it_cancelled_has(tmp_path, ws):
    """The prompt came in the same read as the close: it ran a whole turn on the closed session,
    and the close waited for it."""
    a, sid = start(tmp_path, ws, reply("r0", delayMs=60_000), reply("r1"), reply("r2"))
    try:
        a.send(prompt(3, sid, "running"))
        time.sleep(0.4)                                            # (in its minute-long model call)
        a.send(req(4, "session/close", sessionId=sid), prompt(5, sid, "after close"))
        assert a.answer(3)["result"]["stopReason"] == "cancelled"
        refused = a.answer(5)
        assert refused["error"]["code"] == -32602, refused
        assert a.answer(4) == {"jsonrpc": "2.0", "id": 4, "result": {}}
        a.send(req(6, "session/load", cwd=str(ws), sessionId=sid, mcpServers=[]))
        a.answer(6)
        assert "after close" not in json.dumps(a.seen)             # never recorded, never replayed
        a.send(prompt(7, sid, "next"))
        assert a.answer(7)["result"]["stopReason"] == "end_turn" and a.text().endswith("r1")
    finally:
        a.close()


def test_a_cancel_stops_a_prompt_while_it_reads_a_linked_file_from_the_client(tmp_path, ws):
    """The client's ``fs/read_text_file`` of a file the prompt links was waited for (up to the
    tool time-out, 120 s) before the cancel took effect, and once the read was answered the turn
    ran anyway."""
    a, sid = start(tmp_path, ws, reply("r0"), reply("r1"), fs=True)
    try:
        link = {"type": "resource_link", "name": "a.txt", "uri": (ws / "a.txt").as_uri()}
        a.send(prompt(3, sid, "read it", link))
        read = a.request_seen("fs/read_text_file")                 # (not answered yet)
        a.send(cancel(sid))
        assert a.answer(3, timeout=30)["result"]["stopReason"] == "cancelled"   # (before the read's 120 s)
        a.send(prompt(4, sid, "again"))
        assert a.answer(4)["result"]["stopReason"] == "end_turn" and a.text() == "r0"   # the model was not asked
        a.send({"jsonrpc": "2.0", "id": read["id"], "result": {"content": "late"}})  # the read answered late
        a.send(prompt(5, sid, "once more"))                        # runs next: the cancelled turn never does
        assert a.answer(5)["result"]["stopReason"] == "end_turn" and a.text() == "r0r1"
        assert len([m for m in a.seen if "id" in m and "method" not in m]) == 5
    finally:
        a.close()


def test_cancel_prompt_cancel_prompt_in_one_burst_runs_the_last_prompt(tmp_path, ws):
    """The second cancel cancels the prompt waiting for the first cancelled turn; the last
    prompt then waits and runs (it was refused as a second prompt)."""
    a, sid = start(tmp_path, ws, reply("slow", delayMs=60_000), reply("last"))
    try:
        a.send(prompt(3, sid, "one"))
        time.sleep(0.4)
        a.send(cancel(sid), prompt(4, sid, "two"), cancel(sid), prompt(5, sid, "three"))
        assert a.answer(3)["result"]["stopReason"] == "cancelled"
        assert a.answer(4)["result"]["stopReason"] == "cancelled"
        assert a.answer(5)["result"]["stopReason"] == "end_turn" and a.text() == "last"
        a.send(prompt(6, sid, "four"), prompt(7, sid, "five"))     # (no cancel: the second is refused)
        assert a.answer(7)["error"]["code"] == -32602 and "already running" in json.dumps(a.answer(7))
    finally:
        a.close()
