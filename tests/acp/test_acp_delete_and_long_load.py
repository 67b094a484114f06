"""``session/delete`` (an ACP user at ``maxBranches`` can make room, and the limit errors name
ACP's methods, not the native protocol's), and a ``session/load`` of a long session that holds
up no other session's answers (docs/PROTOCOL.md §13)."""

from __future__ import annotations

import asyncio

from operate_sidecar.server.acp.agent import OperateAgent
from operate_sidecar.server.acp.port import AcpPort
from operate_sidecar.server.core import Branch
from operate_sidecar.server.service.errors import LimitReached
from operate_sidecar.server.state import StateStore

from acp_support import Raw, cancel, cfg, open_session, prompt, reply, req

#: the native protocol's methods and fields, which an ACP client has not
NATIVE_NAMES = ("deleteBranch", "createBranch", "clearMessages")


def _new(msg_id: int, ws) -> dict:
    return req(msg_id, "session/new", cwd=str(ws), mcpServers=[])


def _listed(a: Raw, msg_id: int) -> list[str]:
    a.send(req(msg_id, "session/list"))
    return [s["sessionId"] for s in a.answer(msg_id)["result"]["sessions"]]


def test_a_session_deleted_makes_room_at_max_branches(tmp_path, ws):
    a = Raw(cfg(tmp_path, reply("ok"), stateDir=str(tmp_path / "state"), maxBranches=2))
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        caps = a.answer(1)["result"]["agentCapabilities"]["sessionCapabilities"]
        assert caps.get("delete") == {}                                  # advertised: it is served
        a.send(_new(2, ws), _new(3, ws))
        first, second = a.answer(2)["result"]["sessionId"], a.answer(3)["result"]["sessionId"]
        a.send(_new(4, ws))
        err = a.answer(4)["error"]
        assert err["code"] == -32602 and err["data"]["limit"] == "maxBranches"
        assert "session/delete" in err["message"] and "settings.maxBranches" in err["message"], err
        assert not any(n in err["message"] for n in NATIVE_NAMES), err
        a.send(req(5, "session/delete", sessionId=first))
        assert a.answer(5)["result"] == {}
        assert _listed(a, 6) == [second]
        a.send(_new(7, ws))                                              # room again
        third = a.answer(7)["result"]["sessionId"]
        assert sorted(_listed(a, 8)) == sorted([second, third])
        a.send(req(9, "session/delete", sessionId=first))                # gone: an unknown session
        assert a.answer(9)["error"]["code"] == -32602
        a.send(prompt(10, first))
        assert a.answer(10)["error"]["code"] == -32602
    finally:
        a.close()


def test_a_session_deleted_while_its_turn_runs_ends_that_turn_first(tmp_path, ws):
    a = Raw(cfg(tmp_path, reply("slow", delayMs=60_000), reply("ok"), stateDir=str(tmp_path / "state")))
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "a slow one"))
        a.send(req(4, "session/delete", sessionId=sid))
        assert a.answer(4)["result"] == {}
        turn = a.answer(3)
        assert turn["error"]["code"] == -32012 and "deleted" in turn["error"]["message"], turn
        order = [m.get("id") for m in a.seen if "method" not in m]
        assert order.index(3) < order.index(4)                           # the turn's answer first
        assert _listed(a, 5) == []
    finally:
        a.close()


def test_a_prompt_waiting_for_a_cancelled_turn_when_its_session_is_deleted_is_told_so(tmp_path, ws):
    """The prompt sent after a cancel waits for the cancelled turn to end (or has begun by the
    time the delete is read): either way it is told its session was deleted before or during
    its turn, not that it was deleted while a turn of its own ran."""
    a = Raw(cfg(tmp_path, reply("slow", delayMs=60_000), reply("slow too", delayMs=60_000),
                stateDir=str(tmp_path / "state")))
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "a slow one"), cancel(sid), prompt(4, sid, "waits for it"),
               req(5, "session/delete", sessionId=sid))
        assert a.answer(5)["result"] == {}
        err = a.answer(4)["error"]
        assert err["code"] == -32012 and "was deleted before or during its turn" in err["message"], err
        assert "error" in a.answer(3) or a.answer(3)["result"]["stopReason"] == "cancelled"
    finally:
        a.close()


def test_without_session_delete_the_max_branches_error_names_only_raising_the_setting():
    """An ACP SDK that cannot serve ``session/delete`` (it is then not advertised): no limit
    error tells the client to delete sessions."""
    agent = OperateAgent({})
    assert not agent._deletes                                            # (set on connect, by the SDK)
    limits = (("maxBranches", "the server holds 2 branches (limit 2)"),
              ("maxMessagesPerBranch", "the branch holds 2 messages (limit 2)"))
    for limit, fact in limits:
        err = agent._error(LimitReached(f"{limit} limit reached: {fact}", {"limit": limit, "value": 2}))
        assert "delete" not in str(err) and f"raise settings.{limit}" in str(err), err
        assert not any(n in str(err) for n in NATIVE_NAMES), err
    err = agent._error(LimitReached("maxBranches limit reached: x", {"limit": "maxBranches", "value": 2}))
    assert str(err) == "maxBranches limit reached: x; raise settings.maxBranches"
    agent._deletes = True                                                # served: deleting is the way out
    err = agent._error(LimitReached("maxBranches limit reached: x", {"limit": "maxBranches", "value": 2}))
    assert "session/delete" in str(err) and "raise settings.maxBranches" in str(err)


def test_the_max_messages_error_names_what_an_acp_client_can_do(tmp_path, ws):
    a = Raw(cfg(tmp_path, reply("one"), reply("two"), stateDir=str(tmp_path / "state"), maxMessagesPerBranch=2))
    try:
        sid = open_session(a, ws)
        a.send(prompt(3, sid, "first"))
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        a.send(prompt(4, sid, "second"))
        err = a.answer(4)["error"]
        assert err["code"] == -32602 and err["data"]["limit"] == "maxMessagesPerBranch"
        assert "session/new" in err["message"] and "session/delete" in err["message"], err
        assert not any(n in err["message"] for n in NATIVE_NAMES), err
    finally:
        a.close()


#: messages of the long session: 20,000 turns
LONG = 40_000


def _long_session(state: str, ws) -> str:
    """A stored session of ``LONG`` messages (prompts and replies), written by the real store."""
    s = StateStore(state)
    b = Branch(name=None)
    s.attach(b, {"name": None, "createdAt": 1,
                 "client": {"cwd": str(ws), "updatedAt": "2024-01-01T00:00:00.000+00:00"}})
    for i in range(LONG // 2):
        b.messages.add("instruction", {"instruction": f"prompt {i}"}, sender="user")
        b.messages.add("assistant_response", {"text": '{"message": "reply %d"}' % i})
    s.flush()
    s.close()
    return b.id


def test_a_long_load_holds_up_no_other_session(tmp_path, ws):
    state = str(tmp_path / "state")
    big = _long_session(state, ws)
    a = Raw(cfg(tmp_path, reply("slow", delayMs=60_000), stateDir=state))
    try:
        small = open_session(a, ws)
        a.send(prompt(3, small, "a slow one"))
        a.send(req(4, "session/load", sessionId=big, cwd=str(ws), mcpServers=[]))

        def replayed() -> int:
            return sum(1 for m in a.seen if m.get("method") == "session/update" and m["params"]["sessionId"] == big)

        a.until(lambda: replayed() > 0, "the replay's first update")
        a.send(cancel(small))                                            # while the replay goes on
        assert a.answer(3)["result"]["stopReason"] == "cancelled"
        assert "result" in a.answer(4, timeout=120)
        assert replayed() == LONG                                        # every prompt and reply
        seen = a.seen
        answers = {m["id"]: i for i, m in enumerate(seen) if "method" not in m and "id" in m}
        last = max(i for i, m in enumerate(seen) if m.get("method") == "session/update"
                   and m["params"]["sessionId"] == big)
        # the other session's answer did not wait for the replay: it came before the replay's end
        assert answers[3] < last < answers[4]
    finally:
        a.close()


class _Client:
    """The SDK connection's ``session_update``, kept in order."""

    def __init__(self) -> None:
        self.out: list[tuple[str, str]] = []

    async def session_update(self, session_id: str, update: str) -> None:
        await asyncio.sleep(0)
        self.out.append((session_id, update))


def test_a_task_started_during_a_replay_has_its_updates_held_until_the_replay_ends():
    """Only the replaying task's updates go out during the replay: a task started inside it
    (which inherits its context) is one of the session's live senders, held until the end."""
    async def main() -> list[str]:
        port = AcpPort({})
        port.client = _Client()

        async def live() -> None:
            port.send("A", "live")
            port.send("B", "other session")                               # not replayed: at once

        with port.replaying("A"):
            port.send("A", "r0")
            await asyncio.wait_for(asyncio.get_running_loop().create_task(live()), 5)
            await asyncio.wait_for(port.flush("B"), 5)
            port.send("A", "r1")
        await asyncio.wait_for(port.flush("A"), 5)
        await port.aclose()
        return [u for sid, u in port.client.out if sid == "A"]

    assert asyncio.run(main()) == ["r0", "r1", "live"]
