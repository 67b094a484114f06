"""operate-sidecar in-process: server.core Branch.operate() with a scripted model.

Mirrors bench/peers/lionagi_inproc.py scenario for scenario (same instruction,
schema, replies and tool from bench/peers/inproc_common.py) and prints the same
JSON.  Run with the project venv:  python -m bench.ours_inproc [--n N] ...

THE ADAPTER (the only place that knows the core API) is `make_model`,
`make_branch` and `call`; fix these up if the core API moves.
"""
import asyncio
import gc
import json
import sys
import time
from pathlib import Path

T_IMPORT0 = time.perf_counter()
from operate_sidecar.server.core import Branch  # noqa: E402
from operate_sidecar.server.models.scripted import ScriptedModel  # noqa: E402

IMPORT_S = time.perf_counter() - T_IMPORT0

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from inproc_common import (  # noqa: E402
    ACTION_REPLY, HISTORY_SIZES, INSTRUCTION, PLAIN_REPLY, STRUCTURED_REPLY, Answer, aadd, add,
    argv_int, summarize,
)


# ---- adapter -------------------------------------------------------------
def make_model(reply: str, count: int):
    """A scripted model (docs/PROTOCOL.md §2 `scripted` config) answering `reply` `count` times."""
    return ScriptedModel(name="s", responses=[reply] * count)


def make_branch(model, tools=None):
    if tools:
        from operate_sidecar.server.core.tools import ToolRegistry

        reg = ToolRegistry()
        for t in tools:
            reg.register(t)
        return Branch(chat_model=model, tools=reg)
    return Branch(chat_model=model)


async def call(branch, model, kind: str):
    kw = {"instruction": INSTRUCTION, "chat_model": model}
    if kind != "plain":
        kw["response_format"] = Answer
    if kind.startswith("actions"):
        kw["actions"] = True
    return await branch.operate(**kw)


def _forget_requests(model) -> None:
    """The scripted test double keeps every request it was sent (each with the whole
    history) for tests to inspect; lionagi's instant model keeps nothing. Dropped outside
    the clock so the history scenario measures the branch, not the double's log."""
    reqs = getattr(model, "requests", None)
    if reqs is not None:
        reqs.clear()


def message_count(branch) -> int:
    for attr in ("messages", "msgs"):
        m = getattr(branch, attr, None)
        if m is not None:
            try:
                return len(m)
            except TypeError:
                pass
    return -1
# -------------------------------------------------------------------------


REPLIES = {"plain": PLAIN_REPLY, "response_format": STRUCTURED_REPLY, "actions": ACTION_REPLY,
           "actions_async": ACTION_REPLY}
# +actions: the sync `add` (lionagi calls a sync tool inline on the loop; ours hands it to a
# worker thread); actions_async: the same tool as `async def` in both runtimes.
TOOLS = {"actions": [add], "actions_async": [aadd]}


async def main() -> dict:
    n = argv_int("--n", 200)
    hist_n = argv_int("--hist-n", 30)
    results: dict = {"runtime": "ours", "import_s": IMPORT_S, "scenarios": {}, "samples_ms": {}}

    checks = {}
    for kind, reply in REPLIES.items():
        m = make_model(reply, 8)
        b = make_branch(m, TOOLS.get(kind))
        checks[kind] = repr(await call(b, m, kind))[:300]
    results["checks"] = checks

    # Each timed call: fresh branch + fresh scripted model, built outside the timing.
    for kind, reply in REPLIES.items():
        gc.collect()
        out = []
        for i in range(n + 3):
            m = make_model(reply, 8)
            b = make_branch(m, TOOLS.get(kind))
            t0 = time.perf_counter()
            await call(b, m, kind)
            dt = time.perf_counter() - t0
            if i >= 3:
                out.append(dt)
        results["scenarios"][kind] = summarize(out)
        results["samples_ms"][kind] = [x * 1000 for x in out]

    sizes = [int(s) for s in (sys.argv[sys.argv.index("--sizes") + 1].split(",")
                              if "--sizes" in sys.argv else HISTORY_SIZES)]
    # One branch per size N > 0 filled to N messages outside the clock; size 0 is a fresh
    # branch (and model) per sample. One timed call per size in turn, so every size sees the
    # same machine load (a block per size would compare different moments of a noisy machine).
    branches = {}
    for size in sizes:
        if size:
            m = make_model(PLAIN_REPLY, size // 2 + hist_n + 16)
            b = make_branch(m)
            while message_count(b) < size:
                await call(b, m, "plain")
                _forget_requests(m)
            branches[size] = (b, m, message_count(b))
    gc.collect()
    outs: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(hist_n):
        for size in sizes:
            if size:
                b, m, _start = branches[size]
            else:
                m = make_model(PLAIN_REPLY, 4)
                b = make_branch(m)
            t0 = time.perf_counter()
            await call(b, m, "plain")
            outs[size].append(time.perf_counter() - t0)
            _forget_requests(m)
    for size in sizes:
        s = summarize(outs[size])
        s.update(messages_start=branches[size][2] if size else 0,
                 messages_end=message_count(branches[size][0]) if size else 2)
        results["scenarios"][f"history_{size}"] = s
        results["samples_ms"][f"history_{size}"] = [x * 1000 for x in outs[size]]
    return results


if __name__ == "__main__":
    sys.stdout.write(json.dumps(asyncio.run(main())) + "\n")
