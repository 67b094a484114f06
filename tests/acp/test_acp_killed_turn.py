"""An ACP agent killed (SIGKILL) in the middle of a multi-round prompt turn, then spawned again on
the same state directory (docs/PROTOCOL.md §3: the records of one operate are saved together, so
after a crash each is entirely saved or not at all). The turn before it is replayed whole by
``session/load``; of the killed turn nothing is (not its prompt, not its first round, whose call
the client was shown completed), while the file that round wrote stays written; and the session
goes on. Real processes over real pipes, the SDK's client side."""

from __future__ import annotations

import asyncio
import signal

from acp_support import RecordingClient, bounded, cfg, reply, run, spawn, until
from acp_support import sdk_prompt as prompt


def _texts(updates):
    return [(u.session_update, u.content.text) for u in updates
            if u.session_update in ("user_message_chunk", "agent_message_chunk")]


def _completed(updates):
    return [u for u in updates if getattr(u, "status", None) == "completed"]


def test_a_turn_killed_in_its_second_round_is_not_kept_in_part_and_the_session_goes_on(tmp_path, ws):
    config = cfg(tmp_path, reply("first answer"),
                 reply("I will write.", [("write_file", {"path": "b.txt", "content": "hello\n"})]),
                 {**reply("never said"), "delayMs": 120_000})
    (tmp_path / "again").mkdir()
    config_again = cfg(tmp_path / "again", reply("after the restart"))  # (the model of the process spawned again)
    state = str(tmp_path / "state")

    async def main():
        c = RecordingClient()
        async with spawn(c, config, state_dir=state) as (conn, proc):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid, "first")).stop_reason == "end_turn"
            turn = asyncio.ensure_future(prompt(conn, sid, "write it"))
            # round 1's call shown completed, round 2's model call waiting: killed there
            await until(lambda: _completed([u for _, u in c.updates]), "round 1's tool call completed")
            proc.send_signal(signal.SIGKILL)
            await bounded(proc.wait())
            turn.cancel()
        assert proc.returncode == -signal.SIGKILL
        assert (ws / "b.txt").read_text() == "hello\n"  # the tool's effect stays
        c2 = RecordingClient()
        async with spawn(c2, config_again, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            replay = [u for _, u in c2.updates]
            assert _texts(replay) == [("user_message_chunk", "first"), ("agent_message_chunk", "first answer")]
            assert not [u for u in replay if u.session_update in ("tool_call", "tool_call_update")]
            c2.updates.clear()
            assert (await prompt(conn, sid, "again")).stop_reason == "end_turn"
            assert _texts([u for _, u in c2.updates]) == [("agent_message_chunk", "after the restart")]

    run(main())
