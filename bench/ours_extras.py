"""operate-sidecar-only scenarios over the wire (docs/PROTOCOL.md §2, §3, §5, §6).

Each scenario starts its own server with a `scripted` model configured through
initialize `settings.models`, so the server is never given a real model.
"""
from __future__ import annotations

import asyncio
import json
import time

from .client import Conn, rss_kib, settled_rss_kib
from .contenders import lsp_init
from .stats import summary


def _settings(responses: list) -> dict:
    return {"models": {"s": {"provider": "scripted", "responses": responses}},
            "defaultModel": "s", "stateDir": None}


async def _start(spawn, responses: list, on_notification=None, extra_settings: dict | None = None) -> Conn:
    conn = await spawn("ours", on_notification=on_notification)
    await conn.request("initialize", lsp_init("ours", {**_settings(responses), **(extra_settings or {})}),
                       timeout=60)
    conn.notify("initialized", {})
    return conn


async def concurrent_operates(spawn, n: int = 100, delay_ms: int = 200,
                              extra_settings: dict | None = None) -> dict:
    """n operates in flight at once, one per branch, each model call taking delay_ms
    (server defaults unless extra_settings, e.g. {"maxConcurrentOperates": 128})."""
    single = 5
    conn = await _start(spawn, [{"text": "done", "delayMs": delay_ms}] * (n + single),
                        extra_settings=extra_settings)
    try:
        branches = [(await conn.request("createBranch", {"name": f"b{i}"}, timeout=30))["branchId"]
                    for i in range(n)]
        # single-call overhead: one operate at a time on the same model, minus the model delay
        b0 = (await conn.request("createBranch", {"name": "single"}, timeout=30))["branchId"]
        one_lat = []
        for _ in range(single):
            t0 = time.perf_counter()
            await conn.request("operate", {"branchId": b0, "instruction": "go"}, timeout=30)
            one_lat.append(time.perf_counter() - t0)
        overhead_1 = summary(one_lat)["median"] * 1000 - delay_ms
        lat: list[float] = []

        async def one(bid: str) -> None:
            t0 = time.perf_counter()
            await conn.request("operate", {"branchId": bid, "instruction": "go"})
            lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(b) for b in branches)), 120)
        wall = time.perf_counter() - t0
        bound_ms = 1.5 * delay_ms + overhead_1
        return {"n": n, "delay_ms": delay_ms, "wall_s": wall,
                "overhead_ms": wall * 1000 - delay_ms, "latency_s": summary(lat),
                "single_call_overhead_ms": overhead_1, "bound_ms": bound_ms,
                "all_within_bound": max(lat) * 1000 <= bound_ms,
                "operates_per_s": n / wall}
    finally:
        await conn.close()


async def progress_deltas(spawn, operates: int = 3, chunks: int = 2000) -> dict:
    """$/progress report deltas per second while a scripted reply streams in `chunks` parts.

    The client keeps `$/progress` frames undecoded while the operate runs (a Python client
    decoding each frame tops out near the target rate on this machine, which would measure
    the client); after the answer they are decoded, counted and checked to carry the
    reply's text complete and in order."""
    text = "".join(chr(ord("a") + i % 26) for i in range(chunks))  # order is checkable
    conn = await _start(spawn, [{"text": text, "chunks": chunks}] * operates)
    conn.raw_prefix = b'{"jsonrpc":"2.0","method":"$/progress"'
    rates = []
    try:
        bid = (await conn.request("createBranch", {}, timeout=30))["branchId"]
        for i in range(operates):
            conn.raw_bodies.clear()
            t0 = time.perf_counter()
            await asyncio.wait_for(conn.request("operate", {"branchId": bid, "instruction": "go",
                                                            "workDoneToken": f"t{i}"}), 120)
            t1 = time.perf_counter()
            deltas = []
            for body in conn.raw_bodies:
                v = (json.loads(body).get("params") or {}).get("value") or {}
                if v.get("kind") == "report" and v.get("delta") is not None:
                    deltas.append(v["delta"] if isinstance(v["delta"], str) else str(v["delta"]))
            rates.append({"deltas": len(deltas), "operate_s": t1 - t0,
                          "in_order": "".join(deltas) == text,
                          "deltas_per_s": len(deltas) / (t1 - t0) if t1 > t0 else None})
        return {"chunks": chunks, "runs": rates, "in_order": all(r["in_order"] for r in rates),
                "deltas_per_s": summary([r["deltas_per_s"] for r in rates if r["deltas_per_s"]])}
    finally:
        await conn.close()


async def memory_growth(spawn, total: int = 10_000, in_flight: int = 16, samples: int = 10) -> dict:
    """RSS while `total` operates run (create branch, operate, delete branch).

    One cycle runs first, outside the measure, and the server is then left until its RSS
    settles: the first ``createBranch`` loads the core, and the server warms the
    responseFormat and tool paths in the background a little later (a one-time import of
    several MiB, on a timer, so it would otherwise land anywhere in a fast run)."""
    conn = await _start(spawn, ["ok"] * (total + 1))
    curve = []
    try:
        bid = (await conn.request("createBranch", {}))["branchId"]
        await conn.request("operate", {"branchId": bid, "instruction": "go"})
        await conn.request("deleteBranch", {"branchId": bid})
        rss0 = await settled_rss_kib(conn.pid)
        curve.append((0, rss0))
        done = 0
        step = max(1, total // samples)
        sem = asyncio.Semaphore(in_flight)

        async def cycle() -> None:
            nonlocal done
            async with sem:
                bid = (await conn.request("createBranch", {}))["branchId"]
                await conn.request("operate", {"branchId": bid, "instruction": "go"})
                await conn.request("deleteBranch", {"branchId": bid})
                done += 1
                if done % step == 0:
                    curve.append((done, rss_kib(conn.pid)))

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(cycle() for _ in range(total))), 1800)
        wall = time.perf_counter() - t0
        rss1 = rss_kib(conn.pid)
        mid = next((r for d, r in curve if d >= total // 2), rss0)
        return {"operates": total, "wall_s": wall, "rss_start_kib": rss0, "rss_end_kib": rss1,
                "growth_kib": rss1 - rss0,
                "growth_second_half_kib": rss1 - mid,
                # growth after the first sample (the first `step` operates warm lazy imports/caches)
                "growth_after_warmup_kib": rss1 - (curve[1][1] if len(curve) > 1 else rss0),
                "curve": curve}
    finally:
        await conn.close()


async def first_request(spawn, reps: int = 5) -> dict:
    """Latency of the first requests right after the `initialize` answer (lazy imports
    of core/pydantic land here): createBranch + operate, then operate with a
    responseFormat schema; and the same two operates again once warm."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    first_op, first_rf, warm_op, warm_rf, init = [], [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        conn = await spawn("ours")
        try:
            await conn.request("initialize", lsp_init("ours", _settings(
                ["done", '{"answer": "5"}', "done", '{"answer": "5"}'])), timeout=60)
            t1 = time.perf_counter()
            conn.notify("initialized", {})
            bid = (await conn.request("createBranch", {}, timeout=60))["branchId"]
            await conn.request("operate", {"branchId": bid, "instruction": "go"}, timeout=60)
            t2 = time.perf_counter()
            await conn.request("operate", {"branchId": bid, "instruction": "go",
                                           "responseFormat": schema}, timeout=60)
            t3 = time.perf_counter()
            await conn.request("operate", {"branchId": bid, "instruction": "go"}, timeout=60)
            t4 = time.perf_counter()
            await conn.request("operate", {"branchId": bid, "instruction": "go",
                                           "responseFormat": schema}, timeout=60)
            t5 = time.perf_counter()
        finally:
            await conn.close()
        init.append(t1 - t0)
        first_op.append(t2 - t1)
        first_rf.append(t3 - t2)
        warm_op.append(t4 - t3)
        warm_rf.append(t5 - t4)
    return {"reps": reps, "initialize_s": summary(init),
            "first_create_operate_s": summary(first_op), "first_operate_rf_s": summary(first_rf),
            "warm_operate_s": summary(warm_op), "warm_operate_rf_s": summary(warm_rf)}


# ---- operate over the wire, scenario for scenario like the in-process runs -------------
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                                  "confidence": {"type": "number"}},
                 "required": ["answer", "confidence"]}


def _inproc_common():
    import sys

    peers = str(_peers_dir())
    if peers not in sys.path:
        sys.path.insert(0, peers)
    import inproc_common  # noqa: PLC0415 - needs pydantic, present in the project venv

    return inproc_common


async def wire_operates(spawn, n: int = 100, hist_n: int = 30, sizes=(0, 1000),
                        mem_branches: int = 3) -> dict:
    """`operate` requests over the wire, same instruction/replies/tool as the in-process
    runs: plain / response_format / actions (responseFormat + the sync `add` tool from
    the `toolModules` module bench/peers/bench_tools.py), each on a fresh branch created
    outside the clock; history_N: a branch holding N messages and a fresh branch, one timed
    operate on each in turn (same load for both sizes); then RSS added by `mem_branches`
    branches of 1,000 messages each."""
    ic = _inproc_common()
    hist_total = sum(sizes) // 2 + hist_n * len(sizes) + 8
    mem_total = mem_branches * 500 + 8
    models = {
        "plain": {"provider": "scripted", "responses": [ic.PLAIN_REPLY] * (n + 8)},
        "rf": {"provider": "scripted", "responses": [ic.STRUCTURED_REPLY] * (n + 8)},
        "act": {"provider": "scripted", "responses": [ic.ACTION_REPLY] * (n + 8)},
        "hist": {"provider": "scripted", "responses": [ic.PLAIN_REPLY] * hist_total},
        "mem": {"provider": "scripted", "responses": [ic.PLAIN_REPLY] * mem_total},
    }
    conn = await spawn("ours", extra_env={"PYTHONPATH": str(_peers_dir())})
    out: dict = {"runtime": "ours_wire", "scenarios": {}, "samples_ms": {}}
    try:
        await conn.request("initialize", lsp_init("ours", {
            "models": models, "defaultModel": "plain", "stateDir": None,
            "toolModules": ["bench_tools"]}), timeout=60)
        conn.notify("initialized", {})
        base = {"instruction": ic.INSTRUCTION}
        kinds = {"plain": {**base, "chatModel": "plain"},
                 "response_format": {**base, "chatModel": "rf", "responseFormat": ANSWER_SCHEMA},
                 "actions": {**base, "chatModel": "act", "responseFormat": ANSWER_SCHEMA,
                             "actions": True}}
        checks = {}
        for kind, params in kinds.items():
            samples = []
            for i in range(n + 3):
                bid = (await conn.request("createBranch", {}))["branchId"]
                t0 = time.perf_counter()
                res = await conn.request("operate", {"branchId": bid, **params})
                dt = time.perf_counter() - t0
                if i == 0:
                    checks[kind] = str(res)[:300]
                if i >= 3:
                    samples.append(dt)
                await conn.request("deleteBranch", {"branchId": bid})
            out["samples_ms"][kind] = [x * 1000 for x in samples]
        out["checks"] = checks
        # history: the N-message branch and a fresh (0-message) one, sampled alternately so
        # both sizes see the same machine load; branches are created outside the clock
        hp = {**base, "chatModel": "hist"}
        big = {}
        for size in sizes:
            if size:
                bid = (await conn.request("createBranch", {}))["branchId"]
                for _ in range(size // 2):
                    await conn.request("operate", {"branchId": bid, **hp})
                big[size] = bid
            out["samples_ms"][f"history_{size}"] = []
        for _ in range(hist_n):
            for size in sizes:
                if size:
                    bid = big[size]
                else:
                    bid = (await conn.request("createBranch", {}))["branchId"]
                t0 = time.perf_counter()
                await conn.request("operate", {"branchId": bid, **hp})
                out["samples_ms"][f"history_{size}"].append((time.perf_counter() - t0) * 1000)
                if not size:
                    await conn.request("deleteBranch", {"branchId": bid})
        for bid in big.values():
            await conn.request("deleteBranch", {"branchId": bid})
        # memory: RSS added by branches of 1,000 messages (warm server, after the above)
        await asyncio.sleep(0.2)
        rss0 = rss_kib(conn.pid)
        mp = {**base, "chatModel": "mem"}
        for _ in range(mem_branches):
            b = (await conn.request("createBranch", {}))["branchId"]
            for _ in range(500):
                await conn.request("operate", {"branchId": b, **mp})
        await asyncio.sleep(0.2)
        rss1 = rss_kib(conn.pid)
        out["branch_memory"] = {"branches": mem_branches, "messages_per_branch": 1000,
                                "instruction_chars": len(ic.INSTRUCTION),
                                "reply_chars": len(ic.PLAIN_REPLY),
                                "rss_before_kib": rss0, "rss_after_kib": rss1,
                                "per_branch_kib": (rss1 - rss0) / mem_branches}
    finally:
        await conn.close()
    return out


def _peers_dir():
    from pathlib import Path

    return Path(__file__).resolve().parent / "peers"
