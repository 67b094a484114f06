"""A delete racing the save of the operate running on the branch, made deterministic: the
delete's transaction is on disk, its worker thread has not yet returned, and the operate ends
and saves meanwhile (its save finds nothing of the branch left to write). The operate must not
answer a result whose messages were saved nowhere: it answers -32012, and the branch is gone
in memory and on disk."""

import asyncio
import threading

import pytest

from operate_sidecar.server.core.tools import Tool
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.errors import RpcError
from operate_sidecar.server.service.service import Service

from service_support import Port

WAIT = 60  # seconds: every wait here is bounded


def test_an_operate_whose_save_races_the_delete_of_its_branch_answers_branch_not_found(tmp_path):
    reply = {"json": {"action_requests": [{"function": "gate", "arguments": {}}]}}
    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": [reply]}},
                                               "defaultModel": "s", "stateDir": str(tmp_path / "state")}))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        svc = Service(Port(settings))
        entered, gate, saved = asyncio.Event(), asyncio.Event(), threading.Event()

        async def wait_gate(arguments: dict, ctx: object) -> str:
            entered.set()
            await gate.wait()
            return "through"

        await svc.ensure_tools()
        svc.registry.register(Tool(name="gate", description="Wait for the test.",
                                   input_schema={"type": "object", "properties": {}}, func=wait_gate))
        bid = (await svc.createBranch({}))["branchId"]
        journal_delete, flush = svc.journal.delete, svc.flush_journal

        def delete(branch_id: str) -> None:  # on the worker thread
            journal_delete(branch_id)                 # the delete is on disk ...
            loop.call_soon_threadsafe(gate.set)       # ... the operate goes on and saves ...
            assert saved.wait(WAIT)                   # ... before the delete's thread is back

        async def flush_journal(*ids: str, messages: bool = True) -> None:
            try:
                await flush(*ids, messages=messages)
            finally:
                if bid in ids:
                    saved.set()

        svc.journal.delete = delete
        svc.flush_journal = flush_journal
        running = asyncio.ensure_future(svc.operate({"branchId": bid, "instruction": "go", "actions": True}))
        await asyncio.wait_for(entered.wait(), WAIT)  # the operate runs its tool
        assert await asyncio.wait_for(svc.deleteBranch({"branchId": bid}), WAIT) == {}
        with pytest.raises(RpcError) as e:
            await asyncio.wait_for(running, WAIT)
        assert e.value.code == -32012
        assert (await svc.listBranches({}))["branches"] == []
        assert bid not in svc._usage and bid not in svc._running and not svc._doomed
        await svc.aclose()

        again = Service(Port(settings))  # a restart on the same stateDir
        await again.restore()
        assert (await again.listBranches({}))["branches"] == []
        await again.aclose()

    asyncio.run(asyncio.wait_for(main(), WAIT))


@pytest.mark.parametrize("stored", [True, False])
def test_a_delete_forgets_its_branch_once_with_or_without_a_store(tmp_path, stored):
    extra = {"stateDir": str(tmp_path / "state")} if stored else {}
    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": []}},
                                               "defaultModel": "s", **extra}))

    async def main() -> None:
        svc = Service(Port(settings))
        bid = (await svc.createBranch({}))["branchId"]
        assert (svc.journal is not None) == stored
        forgotten: list[str] = []
        forget = svc._forget

        def spy(branch_id: str) -> list:
            forgotten.append(branch_id)
            return forget(branch_id)  # the MCP servers it asked to stop (none here)

        svc._forget = spy
        assert await asyncio.wait_for(svc.deleteBranch({"branchId": bid}), WAIT) == {}
        assert forgotten == [bid]
        assert bid not in svc.branches
        assert (await svc.listBranches({}))["branches"] == []

    asyncio.run(main())
