"""A cancel that arrives while an operate's messages are being saved, made deterministic: the
save is held at its start until the cancel has been delivered. The cancel is too late
(docs/PROTOCOL.md §7): the save goes to its end and the operate answers its result, which is
kept in memory and on disk, or -32013 when the save fails. One cancelled before its save
(its rounds ended by the cancel) stays cancelled, and answers only once its save has ended
(its branch's next operate waits until then); a failing save then answers -32800 with the
branch as it was. A cancel while the operate waits for a delete racing its save is too late
as well. A fork taken during the save copies the branch as it was before the operate."""

import asyncio
import threading

import pytest

from operate_sidecar.server.core.tools import Tool
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.errors import RpcError
from operate_sidecar.server.service.service import Service
from operate_sidecar.server.state.store import StateNotSaved

from service_support import Port

WAIT = 60  # seconds: every wait here is bounded


def _settings(tmp_path, *responses) -> dict:
    return S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": list(responses)}},
                                           "defaultModel": "s", "stateDir": str(tmp_path / "state")}))


def _held_saves(svc: Service, bid: str, fail: bool = False) -> tuple[asyncio.Event, asyncio.Event]:
    """(entered, gate): the branch's first save sets ``entered`` and waits for ``gate`` before
    writing (``fail``: then the store's transaction fails, as on a full disk, and the store
    drops what it held pending); its later saves write at once."""
    entered, gate, flush = asyncio.Event(), asyncio.Event(), svc.flush_journal

    def disk_full() -> None:
        raise StateNotSaved("disk full (test)")

    async def flush_journal(*ids: str, messages: bool = True) -> None:
        if bid in ids and not entered.is_set():
            entered.set()
            await gate.wait()
            if fail:
                svc.journal._check_file = disk_full  # (checked in each branch's transaction)
                try:
                    await flush(*ids, messages=messages)
                finally:
                    del svc.journal._check_file
                return
        await flush(*ids, messages=messages)

    svc.flush_journal = flush_journal
    return entered, gate


async def _outcome(task: asyncio.Future) -> tuple:
    """What the operate answered: ``("result", <result>)``, ``("-32800",)`` or ``(code, message)``."""
    try:
        return "result", (await asyncio.wait_for(task, WAIT))["result"]
    except asyncio.CancelledError:
        return ("-32800",)
    except RpcError as e:
        return e.code, e.message


async def _kinds(svc: Service, bid: str) -> list[str]:
    return [m["kind"] for m in (await svc.branchMessages({"branchId": bid}))["messages"]]


async def _on_disk(settings: dict, bid: str) -> list[str]:
    """The branch's messages as a restart on the same stateDir finds them."""
    again = Service(Port(settings))
    await again.restore()
    try:
        return await _kinds(again, bid)
    finally:
        await again.aclose()


async def _model_called(svc: Service, bid: str) -> None:
    """Until the branch's operate runs its rounds (bounded)."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while bid not in svc._running:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


async def _cancelled_in_a_tool(svc: Service, func) -> tuple[str, asyncio.Future, asyncio.Event]:
    """``func`` registered as a tool of its name (no arguments) and allowed; an operate on a new
    branch whose saves fail (not held) is cancelled once ``func`` runs. Returns the branch, the
    operate and ``entered`` (set once its save has run)."""
    ran = asyncio.Event()

    async def tool(arguments: dict, ctx: object) -> str:
        ran.set()
        return await func(arguments, ctx)

    await svc.ensure_tools()
    svc.registry.register(Tool(name=func.__name__, description="d", input_schema={"type": "object", "properties": {}},
                               func=tool))
    await svc.authorizeTool({"tool": func.__name__, "decision": "allow"})
    bid = (await svc.createBranch({}))["branchId"]
    entered, gate = _held_saves(svc, bid, fail=True)
    gate.set()
    running = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "go", "actions": True}))
    await asyncio.wait_for(ran.wait(), WAIT)
    running.cancel()
    return bid, running, entered


async def _spin(turns: int = 50) -> None:
    """Let the event loop run ``turns`` times: a cancelled task that does not wait for anything
    would have ended meanwhile."""
    for _ in range(turns):
        await asyncio.sleep(0)


@pytest.mark.parametrize("cancels", [1, 2])
def test_an_operate_cancelled_while_its_messages_are_saved_answers_its_result_and_is_kept(tmp_path, cancels):
    """Also two cancels in one loop step: both are dropped (the task was left with one pending,
    ``cancelling() == 1``, as only the one CancelledError raised for them was counted)."""
    settings = _settings(tmp_path, "the reply")

    async def main() -> None:
        svc = Service(Port(settings))
        bid = (await svc.createBranch({}))["branchId"]
        entered, gate = _held_saves(svc, bid)
        running = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "go"}))
        await asyncio.wait_for(entered.wait(), WAIT)  # its rounds are over: the save has begun
        for _ in range(cancels):
            running.cancel()
        for _ in range(3):  # (the cancel is delivered while the save is held)
            await asyncio.sleep(0)
        gate.set()
        out = await asyncio.wait_for(running, WAIT)
        assert out["result"] == "the reply", out
        assert not running.cancelled() and running.cancelling() == 0
        kinds = [m["kind"] for m in (await svc.branchMessages({"branchId": bid}))["messages"]]
        assert kinds == ["instruction", "assistant_response"]
        await svc.aclose()

        again = Service(Port(settings))  # a restart on the same stateDir: the operate is on disk
        await again.restore()
        kinds = [m["kind"] for m in (await again.branchMessages({"branchId": bid}))["messages"]]
        assert kinds == ["instruction", "assistant_response"]
        await again.aclose()

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_an_operate_cancelled_before_its_save_stays_cancelled(tmp_path):
    settings = _settings(tmp_path, {"text": "late", "delayMs": 60_000})

    async def main() -> None:
        svc = Service(Port(settings))
        bid = (await svc.createBranch({}))["branchId"]
        entered, gate = _held_saves(svc, bid)
        gate.set()
        running = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "go", "workDoneToken": "t"}))
        await _model_called(svc, bid)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, WAIT)
        assert await _kinds(svc, bid) == []
        await svc.aclose()

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_a_cancel_while_a_failing_save_runs_answers_its_32013(tmp_path):
    """Too late to cancel, the operate answers what happened: its messages were not saved, and
    the branch is put back (not -32800, which would hide the reset)."""
    settings = _settings(tmp_path, "the reply")

    async def main() -> None:
        svc = Service(Port(settings))
        bid = (await svc.createBranch({}))["branchId"]
        entered, gate = _held_saves(svc, bid, fail=True)
        running = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "go"}))
        await asyncio.wait_for(entered.wait(), WAIT)
        running.cancel()
        await _spin(3)
        gate.set()
        code, message = await _outcome(running)
        assert code == -32013 and "were not saved" in message and "disk full (test)" in message, message
        assert await _kinds(svc, bid) == []
        await svc.aclose()
        assert await _on_disk(settings, bid) == []

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_an_operate_cancelled_before_a_failing_save_answers_32800_with_the_branch_as_it_was(tmp_path):
    """Cancelled during a tool (its call and the cancel's output recorded), then its save fails:
    -32800, as a cancelled operate answers, and nothing of it kept, in memory or on disk."""
    reply = {"json": {"action_requests": [{"function": "slow", "arguments": {}}]}}
    settings = _settings(tmp_path, reply)

    async def main() -> None:
        svc = Service(Port(settings))

        async def slow(arguments: dict, ctx: object) -> str:
            await asyncio.sleep(WAIT * 2)
            return "never"

        bid, running, entered = await _cancelled_in_a_tool(svc, slow)
        assert await _outcome(running) == ("-32800",)
        assert entered.is_set()  # (its save ran, and failed)
        assert await _kinds(svc, bid) == []
        await svc.aclose()
        assert await _on_disk(settings, bid) == []

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_a_tool_that_swallows_the_cancel_leaves_a_failing_save_answered_32013(tmp_path):
    """A tool that catches its cancellation and returns lets the rounds end as they would have:
    the operate is not cancelled, so a save that then fails answers -32013 (not its result, for
    a branch put back as it was)."""
    reply = {"json": {"action_requests": [{"function": "stubborn", "arguments": {}}]}}
    settings = _settings(tmp_path, reply)

    async def main() -> None:
        svc = Service(Port(settings))

        async def stubborn(arguments: dict, ctx: object) -> str:
            try:
                await asyncio.sleep(WAIT * 2)
            except asyncio.CancelledError:
                return "swallowed"
            return "never"

        bid, running, _ = await _cancelled_in_a_tool(svc, stubborn)
        code, message = await _outcome(running)
        assert code == -32013 and "were not saved" in message, message
        assert await _kinds(svc, bid) == []
        await svc.aclose()

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_an_operate_cancelled_again_during_its_failing_save_answers_once_it_has_ended(tmp_path):
    """Cancelled during its model call, then again while its (failing) save is held: it answers
    -32800 only once that save has ended, so the branch's next operate runs after the failed
    save's undoing, and keeps its messages in memory as on disk (answered at the second cancel,
    the next operate ran meanwhile and that undoing removed its messages from memory only)."""
    settings = _settings(tmp_path, {"text": "late", "delayMs": 60_000}, "second")

    async def main() -> None:
        svc = Service(Port(settings))
        bid = (await svc.createBranch({}))["branchId"]
        entered, gate = _held_saves(svc, bid, fail=True)
        first = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "one"}))
        await _model_called(svc, bid)
        first.cancel()
        await asyncio.wait_for(entered.wait(), WAIT)  # its save (of nothing recorded) began, held
        first.cancel()
        second = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "two"}))
        await _spin()
        assert not first.done()  # not answered while its save runs
        gate.set()
        assert await _outcome(first) == ("-32800",)
        assert await _outcome(second) == ("result", "second")
        assert await _kinds(svc, bid) == ["instruction", "assistant_response"]
        await svc.aclose()
        assert await _on_disk(settings, bid) == ["instruction", "assistant_response"]

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_a_cancel_while_the_operate_waits_for_a_racing_delete_that_fails_answers_its_result(tmp_path):
    """Saved, the operate waits for the outcome of a ``deleteBranch`` that began during its
    save; cancelled then, it is too late too: the delete fails (-32013) and the branch keeps
    the operate's messages, so the operate answers its result (not -32800 for kept messages)."""
    settings = _settings(tmp_path, "the reply")

    async def main() -> None:
        svc = Service(Port(settings))
        bid = (await svc.createBranch({}))["branchId"]
        entered, gate = _held_saves(svc, bid)
        go = threading.Event()

        def refused_delete(branch_id: str) -> None:  # (on the delete's worker thread)
            assert go.wait(WAIT)
            raise StateNotSaved("delete refused (test)", [branch_id])

        svc.journal.delete = refused_delete
        held, saved = svc.flush_journal, asyncio.Event()

        async def flush_journal(*ids: str, messages: bool = True) -> None:
            await held(*ids, messages=messages)
            if bid in ids:
                saved.set()

        svc.flush_journal = flush_journal
        running = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "go"}))
        await asyncio.wait_for(entered.wait(), WAIT)
        deleting = asyncio.ensure_future(svc.deleteBranch({"branchId": bid}))
        deadline = asyncio.get_running_loop().time() + WAIT
        while bid not in svc._deleting:  # the delete has begun (bounded)
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.wait_for(saved.wait(), WAIT)
        await _spin(20)  # the operate goes on to wait for the delete, which waits for ``go``
        assert not running.done()
        running.cancel()
        await _spin(3)
        go.set()
        assert await _outcome(running) == ("result", "the reply")
        code, _ = await _outcome(deleting)
        assert code == -32013
        assert await _kinds(svc, bid) == ["instruction", "assistant_response"]
        await svc.aclose()
        assert await _on_disk(settings, bid) == ["instruction", "assistant_response"]

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_a_fork_during_an_operates_failing_save_gets_the_branch_as_it_was_before_it(tmp_path):
    """A ``forkBranch`` that arrives while an operate's messages are being saved copies the
    branch as it was before that operate, as during its rounds (docs/PROTOCOL.md §3): the save
    then fails (-32013) and the source is put back, and the fork, its own transaction, holds no
    turn that never happened, in memory or on disk (it copied the unsaved messages once the
    operate's mark was dropped as its save began)."""
    settings = _settings(tmp_path, "first", "second")

    async def main() -> None:
        svc = Service(Port(settings))
        bid = (await svc.createBranch({}))["branchId"]
        assert await _outcome(asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "one"}))) \
            == ("result", "first")
        before = await _kinds(svc, bid)
        assert before == ["instruction", "assistant_response"]
        entered, gate = _held_saves(svc, bid, fail=True)
        running = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "two"}))
        await asyncio.wait_for(entered.wait(), WAIT)  # its rounds are over: its (failing) save is held
        assert bid in svc._busy_branches()  # (its branch is still busy while saved)
        fork = (await asyncio.wait_for(svc.forkBranch({"branchId": bid}), WAIT))["branchId"]
        assert not running.done()
        gate.set()
        code, message = await _outcome(running)
        assert code == -32013 and "were not saved" in message, message
        assert await _kinds(svc, bid) == before
        assert await _kinds(svc, fork) == before
        assert bid not in svc._busy_branches()
        await svc.aclose()
        assert await _on_disk(settings, bid) == before
        assert await _on_disk(settings, fork) == before

    asyncio.run(asyncio.wait_for(main(), WAIT))
