"""D4 (docs/PIPELINE.md; docs/PROTOCOL.md §4, §7): a call whose authorization is still pending
(a permission request to the client) when its operate is cancelled is denied by the cancel:
recorded as a denied call with its ``denied`` hook event, and the cancel goes on."""

from __future__ import annotations

import anyio
import pytest

from operate_sidecar.server.core import DENIED, HookEventType

from .support import RecordingTool, call, kinds, make_branch

pytestmark = pytest.mark.anyio


async def test_a_call_cancelled_while_being_authorized_is_recorded_as_denied(record: RecordingTool):
    asked = anyio.Event()

    async def authorizer(_inv):
        asked.set()
        await anyio.sleep_forever()  # the client never answers

    b, _ = make_branch([], tools=(record,))
    b.authorizer = authorizer
    events = []
    b.hooks.subscribe(events.append)
    cancelled = False
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                nonlocal cancelled
                try:
                    await b.act(call("record", x=1))
                except anyio.get_cancelled_exc_class():
                    cancelled = True  # the cancel goes on once the call is recorded
                    raise

            tg.start_soon(run)
            await asked.wait()
            tg.cancel_scope.cancel()
    assert cancelled and not record.ran
    assert kinds(b) == ["action_request", "action_response"]
    req, resp = b.messages[0].content, b.messages[1].content
    assert resp["callId"] == req["callId"] and resp["requestId"] == b.messages[0].id
    assert resp["output"] == {"error": DENIED, "function": "record", "reason": "cancelled"}
    assert [(e.type, e.call_id, e.error) for e in events] == [(HookEventType.TOOL_DENIED, req["callId"], "cancelled")]
