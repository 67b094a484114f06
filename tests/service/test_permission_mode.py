"""A branch's permission mode is the service's own policy: set through ``set_branch_info``,
applied by the service's authorizer with no front end in between, saved with the branch
(with the front end's info) and back after a restart. Real service, store and tools; the
port is a bare ``ClientPort`` that cannot be asked (so ``ask`` means deny)."""

import asyncio

import pytest

from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.errors import RpcError
from operate_sidecar.server.service.service import Service

from service_support import Port

WAIT = 60  # seconds: every wait here is bounded


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


def test_the_permission_mode_is_applied_by_the_service_and_saved_with_the_branch(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("old\n")
    replies = [call("write_file", path="a.txt", content="ask\n"), call("write_file", path="a.txt", content="auto\n"),
               call("read_file", path="a.txt"), call("write_file", path="a.txt", content="ro\n"),
               call("write_file", path="a.txt", content="denied\n")]
    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": replies}},
                                               "defaultModel": "s", "stateDir": str(tmp_path / "state")}))

    async def output(svc: Service, bid: str) -> object:
        res = await asyncio.wait_for(svc.operate({"branchId": bid, "instruction": "go", "actions": True}), WAIT)
        [r] = res["result"]["action_responses"]
        return r["output"]

    async def main() -> None:
        port = Port(settings, (str(ws),))
        svc = Service(port)
        bid = (await svc.createBranch({}, info={"cwd": str(ws), "title": "t"}))["branchId"]
        assert svc.permission_mode(bid) == "ask"
        assert "cannot be asked" in (await output(svc, bid))["reason"]
        await svc.set_branch_info(bid, mode="auto-edit")
        await output(svc, bid)
        assert (ws / "a.txt").read_text() == "auto\n"                  # edited without asking
        await svc.set_branch_info(bid, {"model": "s"}, mode="read-only")
        assert (await output(svc, bid))["content"] == "auto\n"          # a read-only tool runs
        assert "read-only mode" in (await output(svc, bid))["reason"]  # nothing that changes anything
        assert (ws / "a.txt").read_text() == "auto\n"
        assert port.decided == [("write_file", False), ("write_file", True), ("read_file", True),
                                ("write_file", False)]
        with pytest.raises(RpcError) as e:
            await svc.set_branch_info(bid, mode="anything-goes")
        assert e.value.code == -32602 and svc.permission_mode(bid) == "read-only"
        await svc.aclose()

        again = Service(Port(settings, (str(ws),)))                         # a restart on the same stateDir
        await again.restore()
        assert again.permission_mode(bid) == "read-only"
        assert again.branch_info(bid) == {"cwd": str(ws), "title": "t", "model": "s"}
        assert "read-only mode" in (await output(again, bid))["reason"]
        assert (ws / "a.txt").read_text() == "auto\n"
        await again.aclose()

    asyncio.run(asyncio.wait_for(main(), 2 * WAIT))
