"""The native front end's warm-up: what the first requests after a spawn do, done once on
a throwaway connection before they are served, so that the first ``operate`` costs what a
warm one does.

The interpreter runs a path slowly the first times (CPython specializes code as it runs it),
and much is built on first use (cattrs structuring code, pydantic models and schemas, the
pipeline's operative types). Right after the core is loaded, and before the requests that
waited for it are served, :func:`warm_up` drives a second ``transport.Connection`` with its
own app (``server.SidecarServer``) and service through frames, as a client would:
``initialize`` with a scripted model, ``createBranch``, then ``operate`` calls of the shapes
editors send, each several times: a plain one before the waiting requests are served
(``FIRST``), and, a little later in the background, one with progress and a response format
and one with actions and a tool round (``LATER``). The frames are parsed by the same parser, dispatched by pygls through
the catalog, answered through the same serialization; only the output goes to a sink here,
never to the client. Its workspace is this package's own folder, which the warm-up only
lists: nothing is written anywhere, and nothing is saved (no state directory).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("operate_sidecar.server.rpc")

#: how many times each operate shape is sent: enough for the interpreter to specialize the path
WARM_CYCLES = 5
#: the whole warm-up is abandoned after this long (the waiting requests are served anyway)
WARM_TIMEOUT_S = 5.0


class _Sink:
    """The throwaway connection's wire: answers are matched to their requests, the rest dropped."""

    closed = False
    on_broken = None
    tap = None

    def __init__(self) -> None:
        self.waiting: dict[Any, asyncio.Future] = {}

    def send_bytes(self, body: bytes) -> None:
        msg = json.loads(body)
        fut = self.waiting.pop(msg.get("id"), None) if "method" not in msg else None
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def close(self) -> None:
        self.closed = True


#: the operate shapes editors send, as (params, the scripted model's replies for one call)
SHAPES: dict[str, tuple[dict[str, Any], list[Any]]] = {
    "plain": ({}, ["warm"]),
    "format": ({"workDoneToken": "warm", "responseFormat": {
        "type": "object", "title": "Warm", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}},
        [{"json": {"answer": "warm"}}]),
    # (the replies carry exactly the keys of the request model an ``actions`` operate asks for:
    # a key it does not have would load the fuzzy key matcher, several MiB that a model keeping
    # to the schema never needs)
    "tools": ({"actions": True, "maxRounds": 2, "workDoneToken": "warm"},
              [{"json": {"action_required": True, "action_requests": [{"function": "list_dir", "arguments": {}}]}},
               {"json": {"action_required": False, "action_requests": []}}]),
}
#: warmed before the first requests are served: the plain operate, cheap to warm (a few ms) ...
FIRST = ("plain",)
#: ... and these a little later, in the background: their first use imports and builds more
#: (the JSON Schema → pydantic builder, a reply model; anyio's worker threads, the tool path:
#: about 40 ms), which would hold up the first ``createBranch`` for an editor that sends none
LATER = ("format", "tools")


async def warm_up(version: str = "0", shapes: tuple[str, ...] = FIRST, cycles: int = WARM_CYCLES) -> None:
    from . import server as app
    from .framing import encode_frame
    from .transport import Connection

    folder = os.path.dirname(os.path.abspath(__file__))
    replies = [r for _ in range(cycles) for name in shapes for r in SHAPES[name][1]]
    sink = _Sink()
    conn = Connection(sink, base_settings={"models": {"warm": {"provider": "scripted", "responses": replies}},
                                           "defaultModel": "warm"}, version=version)
    ids = iter(range(1, 1 << 30))

    async def call(method: str, params: dict) -> Any:
        msg_id = next(ids)
        fut = sink.waiting[msg_id] = asyncio.get_running_loop().create_future()
        conn.feed(encode_frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method,
                                           "params": params}).encode()))
        answer = await fut
        if "error" in answer:
            raise RuntimeError(f"warm-up {method}: {answer['error'].get('message')}")
        return answer["result"]

    try:
        await call("initialize", {"clientInfo": {"name": "warm-up"}, "workspaceFolders": [folder]})
        conn._app_loaded(app, None)  # the app and its service, without a loader thread
        branch = (await call("createBranch", {}))["branchId"]
        for _ in range(cycles):
            for name in shapes:
                await call("operate", {"branchId": branch, "instruction": "warm", **SHAPES[name][0]})
    finally:
        sink.close()
        await conn.aclose()


async def warm_then(version: str, then: Any, shapes: tuple[str, ...] = FIRST) -> None:
    """Warm up (bounded by ``WARM_TIMEOUT_S``; a failure is logged at debug level), then ``then()``."""
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(warm_up(version, shapes), WARM_TIMEOUT_S)
        log.info("warmed (%s) in %.0f ms", ", ".join(shapes), (time.perf_counter() - t0) * 1000)
    except asyncio.CancelledError:
        raise
    except BaseException:
        log.debug("warm-up failed", exc_info=True)
    finally:
        if then is not None:
            then()
