"""``Service.prime``: what an operate builds on first use (its reply model, operative types
and the schema shown to the model, narrowed to the branch's tools) is built ahead, with no
model call, no message, no tool and nothing sent, so the first operate builds none of it
(the ACP front end primes each new session this way). Real service, tools and renderer."""

import asyncio
import importlib

from operate_sidecar.server.core import render
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.service import Service

from service_support import Port

WAIT = 60  # seconds: every wait here is bounded
REPLY = {"type": "object", "title": "PrimedReply", "properties": {"message": {"type": "string"}},
         "required": ["message"]}


def test_prime_builds_ahead_what_the_first_operate_would_build(tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    ws.mkdir()
    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted",
                                                                "responses": [{"json": {"message": "hi"}}]}},
                                               "defaultModel": "s"}))
    built: list[int] = []
    narrow = render._narrow_action_requests

    def counting(schema, tool_schemas):
        built.append(len(tool_schemas))
        return narrow(schema, tool_schemas)

    monkeypatch.setattr(render, "_narrow_action_requests", counting)
    params = {"instruction": "", "actions": True, "responseFormat": REPLY, "chatModel": "s"}

    async def main() -> None:
        port = Port(settings, (str(ws),))
        svc = Service(port)
        try:
            bid = (await svc.createBranch({}))["branchId"]
            await asyncio.wait_for(svc.prime({**params, "branchId": bid}), WAIT)
            assert built == [5]                          # the reply schema narrowed to the 5 builtin tools
            assert len(svc.messages_of(bid)) == 0 and port.sent == []  # no message, nothing sent
            assert svc.resolve_model("s").calls == 0                      # no model call
            res = await asyncio.wait_for(svc.operate({**params, "branchId": bid, "instruction": "go"}), WAIT)
            assert res["result"]["message"] == "hi"
            assert built == [5]                          # the operate built no schema of its own
        finally:
            await svc.aclose()

    asyncio.run(main())


def test_a_pinned_reply_format_is_not_serialized_again_per_operate(tmp_path, monkeypatch):
    """``SchemaCache.pin``: a constant schema object (ACP's reply format) gets its cache key
    once; operates that pass that very object skip the size walk and the canonical JSON.
    An equal but different object is still checked and keyed, and finds the same model."""
    from operate_sidecar.server.service import schemas

    settings = S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted",
                                                                "responses": [{"json": {"message": "hi"}}] * 4}},
                                               "defaultModel": "s"}))
    keyed: list[str] = []
    canonical = schemas._canonical
    monkeypatch.setattr(schemas, "_canonical", lambda schema, where: keyed.append(schema.get("title")) or
                        canonical(schema, where))

    async def main() -> None:
        svc = Service(Port(settings, (str(tmp_path),)))
        try:
            svc.schemas.pin(REPLY)
            assert keyed == ["PrimedReply"]
            bid = (await svc.createBranch({}))["branchId"]
            for _ in range(3):
                res = await asyncio.wait_for(svc.operate({"branchId": bid, "instruction": "go",
                                                          "responseFormat": REPLY}), WAIT)
                assert res["result"]["message"] == "hi"
            assert keyed == ["PrimedReply"]               # the pinned object: keyed once, at pin
            await asyncio.wait_for(svc.operate({"branchId": bid, "instruction": "go",
                                                "responseFormat": dict(REPLY)}), WAIT)
            assert keyed == ["PrimedReply", "PrimedReply"]  # a copy is keyed as before
            assert len(svc.schemas._models) == 1            # and finds the same model
        finally:
            await svc.aclose()

    asyncio.run(main())


def _core_operate():
    """``server.core.operate`` the module (the package's ``operate`` is the function)."""
    return importlib.import_module("operate_sidecar.server.core.operate")


def _plain_settings(**extra):
    return S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": ["hi"]}},
                                           "defaultModel": "s", **extra}))


def test_the_first_branch_is_primed_for_a_plain_operate(tmp_path, monkeypatch):
    """The service's first ``createBranch`` builds what the first plain operate would build on
    first use (the builtin tools, the tools' thread pool, what ``core.operate.prime`` builds),
    before its answer: the editor's first operate often follows at once. Once per service; no
    model call, no message, nothing sent."""
    core_operate = _core_operate()

    primed: list[str] = []
    real = core_operate.prime
    monkeypatch.setattr(core_operate, "prime", lambda branch, **kw: primed.append(branch.id) or real(branch, **kw))

    async def main() -> None:
        port = Port(_plain_settings(), (str(tmp_path),))
        svc = Service(port)
        try:
            bid = (await asyncio.wait_for(svc.createBranch({}), WAIT))["branchId"]
            assert primed == [bid]
            assert svc._tool_threads is not None and svc._tools_ready is not None and svc._tools_ready.is_set()
            assert len(svc.messages_of(bid)) == 0 and port.sent == [] and svc.resolve_model("s").calls == 0
            await asyncio.wait_for(svc.createBranch({}), WAIT)
            assert primed == [bid]                       # once per service
            res = await asyncio.wait_for(svc.operate({"branchId": bid, "instruction": "go"}), WAIT)
            assert res["result"] == "hi"
        finally:
            await svc.aclose()

    asyncio.run(main())


def test_the_first_branch_is_not_primed_when_tools_must_load(tmp_path, monkeypatch):
    """Tool modules (or MCP servers) may take long to load: ``createBranch`` does not wait for
    them to prime (the first operate waits for them anyway)."""
    core_operate = _core_operate()

    primed: list[str] = []
    monkeypatch.setattr(core_operate, "prime", lambda branch, **kw: primed.append(branch.id))

    async def main() -> None:
        svc = Service(Port(_plain_settings(toolModules=["no_such_module_here"]), (str(tmp_path),)))
        try:
            await asyncio.wait_for(svc.createBranch({}), WAIT)
            assert primed == [] and svc._tools_ready is None
        finally:
            await svc.aclose()

    asyncio.run(main())


def test_a_cancel_while_the_first_branch_is_primed_comes_too_late(tmp_path, monkeypatch):
    """The branch is made (and saved) before the priming: a cancel during it is ignored, and the
    answer names the branch, as for any request cancelled after its change was made."""
    settings = _plain_settings(stateDir=str(tmp_path / "state"))

    async def main() -> None:
        svc = Service(Port(settings, (str(tmp_path),)))
        entered, release = asyncio.Event(), asyncio.Event()

        async def slow_prime(params: dict) -> None:
            entered.set()
            await release.wait()

        monkeypatch.setattr(svc, "prime", slow_prime)
        try:
            task = asyncio.ensure_future(svc.createBranch({}))
            await asyncio.wait_for(entered.wait(), WAIT)
            task.cancel()
            await asyncio.sleep(0)
            release.set()
            bid = (await asyncio.wait_for(task, WAIT))["branchId"]
            assert bid in svc.branches
        finally:
            await svc.aclose()
        again = Service(Port(settings, (str(tmp_path),)))   # the next process: it was saved
        try:
            listed = await asyncio.wait_for(again.listBranches({}), WAIT)
            assert [b["branchId"] for b in listed["branches"]] == [bid]
        finally:
            await again.aclose()

    asyncio.run(main())


def test_a_front_end_that_primes_its_own_way_skips_the_first_branch_priming(tmp_path, monkeypatch):
    """``createBranch(prime_first=False)`` (ACP's sessions, primed for their own turns) primes
    nothing; the service's next plain ``createBranch`` is still its first primed one."""
    core_operate = _core_operate()

    primed: list[str] = []
    monkeypatch.setattr(core_operate, "prime", lambda branch, **kw: primed.append(branch.id))

    async def main() -> None:
        svc = Service(Port(_plain_settings(), (str(tmp_path),)))
        try:
            await asyncio.wait_for(svc.createBranch({}, prime_first=False), WAIT)
            assert primed == [] and svc._tool_threads is None
            bid = (await asyncio.wait_for(svc.createBranch({}), WAIT))["branchId"]
            assert primed == [bid]
        finally:
            await svc.aclose()

    asyncio.run(main())
