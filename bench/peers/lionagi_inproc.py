"""lionagi 0.36.0 in-process: Branch.operate() against an instant fake model.

Runs in bench/.venvs/lionagi; prints one JSON object on stdout.

The fake model is a real `iModel(provider="openai")` whose endpoint `_call` (the
single method that would do the HTTP POST, see
lionagi/service/connections/endpoint.py) is replaced by a coroutine returning
a canned OpenAI chat-completion dict.  Everything else -- payload creation,
the rate-limited executor, APICalling, message bookkeeping, parsing, action
dispatch -- is lionagi's own chat path.  (lionagi.testing.ScriptedEndpoint was
not used: it is `is_cli=True`, which routes operate through the CLI middle
instead of the chat path, and it records every payload.)

usage: python lionagi_inproc.py [--n N] [--hist-n N] [--sizes 0,400,1000]
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time

T_IMPORT0 = time.perf_counter()
import lionagi  # noqa: E402
from lionagi import Branch, iModel  # noqa: E402

IMPORT_S = time.perf_counter() - T_IMPORT0

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inproc_common import (  # noqa: E402
    ACTION_REPLY, HISTORY_SIZES, INSTRUCTION, PLAIN_REPLY, STRUCTURED_REPLY, Answer, aadd, add,
    argv_int, summarize,
)


def instant_model(reply: list[str]) -> iModel:
    """An iModel whose endpoint answers reply[0] immediately, without I/O."""
    # requires_tokens=False: no tiktoken (it would fetch an encoding file over the network)
    im = iModel(provider="openai", model="gpt-4.1-mini", api_key="sk-bench-not-used",
                requires_tokens=False)

    async def _call(payload, headers, **kwargs):
        return {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": payload.get("model", "gpt-4.1-mini"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": reply[0]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    im.endpoint._call = _call
    return im


async def main() -> dict:
    n = argv_int("--n", 200)
    hist_n = argv_int("--hist-n", 30)
    reply = [PLAIN_REPLY]
    model = instant_model(reply)
    results: dict = {"runtime": "lionagi", "version": lionagi.__version__, "import_s": IMPORT_S,
                     "scenarios": {}, "samples_ms": {}}

    # sanity: each scenario produces what it should (not timed)
    checks = {}
    reply[0] = PLAIN_REPLY
    b = Branch(chat_model=model, parse_model=model)
    checks["plain"] = repr(await b.operate(instruction=INSTRUCTION))[:120]
    reply[0] = STRUCTURED_REPLY
    b = Branch(chat_model=model, parse_model=model)
    checks["response_format"] = repr(await b.operate(instruction=INSTRUCTION, response_format=Answer))[:120]
    reply[0] = ACTION_REPLY
    b = Branch(chat_model=model, parse_model=model, tools=[add])
    r = await b.operate(instruction=INSTRUCTION, response_format=Answer, actions=True)
    checks["actions"] = repr(r)[:300]
    b = Branch(chat_model=model, parse_model=model, tools=[aadd])
    r = await b.operate(instruction=INSTRUCTION, response_format=Answer, actions=True)
    checks["actions_async"] = repr(r)[:300]
    results["checks"] = checks

    def fresh(tools=None):
        return Branch(chat_model=model, parse_model=model, tools=tools)

    # Each timed call runs on a fresh branch (created outside the timed region),
    # so plain/response_format/actions are all measured at empty history.
    async def run(kind: str) -> list[float]:
        out = []
        for i in range(n + 3):
            br = fresh({"actions": [add], "actions_async": [aadd]}.get(kind))
            kw = {"instruction": INSTRUCTION}
            if kind != "plain":
                kw["response_format"] = Answer
            if kind.startswith("actions"):
                kw["actions"] = True
            t0 = time.perf_counter()
            await br.operate(**kw)
            dt = time.perf_counter() - t0
            if i >= 3:
                out.append(dt)
        return out

    for kind, text in (("plain", PLAIN_REPLY), ("response_format", STRUCTURED_REPLY),
                       ("actions", ACTION_REPLY), ("actions_async", ACTION_REPLY)):
        reply[0] = text
        gc.collect()
        samples = await run(kind)
        results["scenarios"][kind] = summarize(samples)
        results["samples_ms"][kind] = [x * 1000 for x in samples]

    # history kept: one branch per size N > 0 filled to N messages outside the clock; size 0
    # is a fresh branch per sample. One timed call per size in turn (same machine load for
    # every size), exactly as bench/ours_inproc.py does.
    reply[0] = PLAIN_REPLY
    sizes = [int(s) for s in (sys.argv[sys.argv.index("--sizes") + 1].split(",")
                              if "--sizes" in sys.argv else HISTORY_SIZES)]
    branches = {}
    for size in sizes:
        if size:
            br = fresh()
            while len(br.messages) < size:
                await br.operate(instruction=INSTRUCTION)
            branches[size] = (br, len(br.messages))
    gc.collect()
    outs = {size: [] for size in sizes}
    for _ in range(hist_n):
        for size in sizes:
            br = branches[size][0] if size else fresh()
            t0 = time.perf_counter()
            await br.operate(instruction=INSTRUCTION)
            outs[size].append(time.perf_counter() - t0)
    for size in sizes:
        s = summarize(outs[size])
        s.update(messages_start=branches[size][1] if size else 0,
                 messages_end=len(branches[size][0].messages) if size else 2)
        results["scenarios"][f"history_{size}"] = s
        results["samples_ms"][f"history_{size}"] = [x * 1000 for x in outs[size]]
    return results


if __name__ == "__main__":
    out = asyncio.run(main())
    sys.stdout.write(json.dumps(out) + "\n")
