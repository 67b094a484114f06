"""The native front end's warm-up: what the first requests after a spawn do, done once on
a throwaway connection before they are served, so that the first ``operate`` costs what a
warm one does.

The interpreter runs a path slowly the first times (CPython specializes code as it runs it),
and much is built on first use (cattrs structuring code, pydantic models and schemas, the
pipeline's operative types). Right after the core is loaded, and before the requests that
waited for it are served, :func:`warm_up` drives a second ``transport.Connection`` with its
own app (``server.SidecarServer``) and service through frames, as a client would, over a pair
of pipes read and written by the same reader and ``Wire`` as stdio (so their code warms too):
``initialize`` with a scripted model, ``createBranch``, then ``operate`` calls of the shapes
editors send, each several times: a plain one before the waiting requests are served
(``FIRST``), and, a little later in the background, one with progress and a response format
and one with actions and a tool round (``LATER``). The frames are parsed by the same parser, dispatched by pygls through
the catalog, answered through the same serialization; only the output goes to a pipe of
its own, never to the client. Its workspace is this package's own folder, which the warm-up only
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

#: how many times the plain operate is sent before the first requests are served: enough for
#: the interpreter to specialize the path (CPython quickens a function after 8 calls; with 5
#: the first real operate was 1.5x a warm one, with 12 to 24 1.2-1.3x, in alternated runs of
#: ``python -m bench.run --only first``; each costs well under a millisecond)
WARM_CYCLES = 20
#: ... and each of the later shapes, in the background
LATER_CYCLES = 8
#: the whole warm-up is abandoned after this long (the waiting requests are served anyway)
WARM_TIMEOUT_S = 5.0


class _Answers:
    """The throwaway connection's answers, seen as its wire sends them (the wire's ``tap``):
    each is matched to its request, the rest dropped."""

    def __init__(self) -> None:
        self.waiting: dict[Any, asyncio.Future] = {}

    def __call__(self, body: bytes) -> None:
        msg = json.loads(body)
        fut = self.waiting.pop(msg.get("id"), None) if "method" not in msg else None
        if fut is not None and not fut.done():
            fut.set_result(msg)


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


async def warm_up(version: str = "0", shapes: tuple[str, ...] = FIRST, cycles: int | None = None) -> None:
    """``cycles`` rounds of the ``shapes``' operates (``WARM_CYCLES`` for the first ones,
    ``LATER_CYCLES`` for the others) through a throwaway connection over two pipes."""
    from . import server as app
    from .framing import encode_frame
    from .stdio import Wire, attach_reader
    from .transport import Connection

    if cycles is None:
        cycles = WARM_CYCLES if shapes == FIRST else LATER_CYCLES
    loop = asyncio.get_running_loop()
    folder = os.path.dirname(os.path.abspath(__file__))
    replies = [r for _ in range(cycles) for name in shapes for r in SHAPES[name][1]]
    answers = _Answers()
    in_r, in_w = os.pipe()    # the frames, to the connection's reader
    out_r, out_w = os.pipe()  # its output, read back and dropped
    wire = Wire(out_w)
    wire.tap = answers
    conn = Connection(wire, base_settings={"models": {"warm": {"provider": "scripted", "responses": replies}},
                                           "defaultModel": "warm"}, version=version)
    loop.add_reader(out_r, os.read, out_r, 1 << 16)
    reader = None
    ids = iter(range(1, 1 << 30))

    async def call(method: str, params: dict) -> Any:
        msg_id = next(ids)
        fut = answers.waiting[msg_id] = loop.create_future()
        # (a frame is far smaller than a pipe's buffer, and one is in flight at a time: no wait)
        os.write(in_w, encode_frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method,
                                                "params": params}).encode()))
        answer = await fut
        if "error" in answer:
            raise RuntimeError(f"warm-up {method}: {answer['error'].get('message')}")
        return answer["result"]

    try:
        # the reader owns ``in_r`` from the call on (its transport closes it, also when this is
        # cancelled while it attaches: closed here too, it was closed twice, or another's fd)
        fd, in_r = in_r, -1
        reader = await attach_reader(fd, conn.feed, lambda: None)
        await call("initialize", {"clientInfo": {"name": "warm-up"}, "workspaceFolders": [folder]})
        conn._app_loaded(app, None)  # the app and its service, without a loader thread
        branch = (await call("createBranch", {}))["branchId"]
        for _ in range(cycles):
            for name in shapes:
                await call("operate", {"branchId": branch, "instruction": "warm", **SHAPES[name][0]})
    finally:
        try:
            if reader is not None:
                reader.close()
            wire.tap = None
            await conn.aclose()
        finally:  # (the pipes are closed even when the close above is cancelled)
            wire.close()  # (closes ``out_w``; the drain goes with it, before the loop runs again)
            loop.remove_reader(out_r)
            for fd in (in_r, in_w, out_r):
                if fd >= 0:
                    os.close(fd)


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
