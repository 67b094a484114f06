"""operate-sidecar-only scenarios over the wire (PROTOCOL.md §2, §3, §5, §6).

Each scenario starts its own server with a `scripted` model configured through
initialize `settings.models`, so the server is never given a real model.
"""
from __future__ import annotations

import asyncio
import time

from .client import Conn, rss_kib
from .contenders import lsp_init
from .stats import summary


def _settings(responses: list) -> dict:
    return {"models": {"s": {"provider": "scripted", "responses": responses}},
            "defaultModel": "s", "stateDir": None}


async def _start(spawn, responses: list, on_notification=None) -> Conn:
    conn = await spawn("ours", on_notification=on_notification)
    await conn.request("initialize", lsp_init("ours", _settings(responses)), timeout=60)
    conn.notify("initialized", {})
    return conn


async def concurrent_operates(spawn, n: int = 100, delay_ms: int = 200) -> dict:
    """n operates in flight at once, one per branch, each model call taking delay_ms."""
    conn = await _start(spawn, [{"text": "done", "delayMs": delay_ms}] * n)
    try:
        branches = [(await conn.request("createBranch", {"name": f"b{i}"}, timeout=30))["branchId"]
                    for i in range(n)]
        lat: list[float] = []

        async def one(bid: str) -> None:
            t0 = time.perf_counter()
            await conn.request("operate", {"branchId": bid, "instruction": "go"})
            lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(b) for b in branches)), 120)
        wall = time.perf_counter() - t0
        return {"n": n, "delay_ms": delay_ms, "wall_s": wall,
                "overhead_ms": wall * 1000 - delay_ms, "latency_s": summary(lat),
                "operates_per_s": n / wall}
    finally:
        await conn.close()


async def progress_deltas(spawn, operates: int = 3, chunks: int = 2000) -> dict:
    """$/progress report deltas per second while a scripted reply streams in `chunks` parts."""
    stamps: list[float] = []

    def on_note(msg: dict) -> None:
        if msg.get("method") == "$/progress":
            v = (msg.get("params") or {}).get("value") or {}
            if v.get("kind") == "report" and v.get("delta") is not None:
                stamps.append(time.perf_counter())

    text = "x" * chunks
    conn = await _start(spawn, [{"text": text, "chunks": chunks}] * operates, on_note)
    rates = []
    try:
        bid = (await conn.request("createBranch", {}, timeout=30))["branchId"]
        for i in range(operates):
            stamps.clear()
            t0 = time.perf_counter()
            await asyncio.wait_for(conn.request("operate", {"branchId": bid, "instruction": "go",
                                                            "workDoneToken": f"t{i}"}), 120)
            t1 = time.perf_counter()
            rates.append({"deltas": len(stamps), "operate_s": t1 - t0,
                          "deltas_per_s": len(stamps) / (t1 - t0) if t1 > t0 else None})
        return {"chunks": chunks, "runs": rates,
                "deltas_per_s": summary([r["deltas_per_s"] for r in rates if r["deltas_per_s"]])}
    finally:
        await conn.close()


async def memory_growth(spawn, total: int = 10_000, in_flight: int = 16, samples: int = 10) -> dict:
    """RSS while `total` operates run (create branch, operate, delete branch)."""
    conn = await _start(spawn, ["ok"] * total)
    curve = []
    try:
        await asyncio.sleep(0.3)
        rss0 = rss_kib(conn.pid)
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
