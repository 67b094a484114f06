"""``Service.prime``: what an operate builds on first use (its reply model, operative types
and the schema shown to the model, narrowed to the branch's tools) is built ahead, with no
model call, no message, no tool and nothing sent, so the first operate builds none of it
(the ACP front end primes each new session this way). Real service, tools and renderer."""

import asyncio

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
