"""The SQLite state store, side by side with the 0.1 JSONL journal it replaced.

    .venv/bin/python -m bench.run --only store [--quick] [--no-markdown]

1. ``operate`` p50 over the wire: the real server with a ``stateDir`` vs without one
   (target: with ≤ 1.3× without). Fresh processes, interleaved (order rotated per
   repetition); per process a warm-up, then sequential operates on one branch with the
   instant scripted model. Every operate with a ``stateDir`` commits its messages (one
   transaction, ``synchronous=FULL``) before it answers.
2. Commit of one operate's messages in-process: ``StateStore.flush`` vs the JSONL
   ``Journal.flush`` (append + fsync), same messages.
3. Restore of 100,000 messages: ``StateStore.load`` vs the JSONL ``Journal.load``, each in a
   fresh process (imports excluded), and over the wire: server spawn → ``listBranches``
   answered with the branch restored.

Results: ``bench/out/store_results.json`` and the store section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common
from .report import replace_section

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BEGIN, END = "<!-- store-bench:begin -->", "<!-- store-bench:end -->"
TARGET_RATIO = 1.3
RESTORE_N = 100_000
DELAY_MS = 20  # a model answering in 20 ms: faster than any real one here (the local 135M model takes longer)


def _log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def _argv(server_cpu: int | None) -> list[str]:
    """The measured server (``common.ours_argv``: ``Unavailable`` when it does not exist), pinned."""
    return common.pinned(common.ours_argv(), server_cpu)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summ(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "p90": _pct(xs, 0.9), "min": min(xs), "max": max(xs), "n": len(xs)}


def _operate_session(argv: list[str], state_dir: str | None, warm: int, n: int, delay_ms: int = 0) -> list[float]:
    from operate_sidecar.clients.python.client import SidecarClient

    settings: dict[str, Any] = {"models": {"instant": {"provider": "scripted",
                                                       "responses": [{"text": "ok", "delayMs": delay_ms}
                                                                     if delay_ms else {"text": "ok"}] * (warm + n)}},
                                "defaultModel": "instant"}
    if state_dir:
        settings["stateDir"] = state_dir
    c = SidecarClient(argv=argv, stderr=subprocess.DEVNULL)
    try:
        c.request("initialize", {"clientInfo": {"name": "store-bench"}, "settings": settings}, timeout=60)
        bid = c.request("createBranch", {"system": "bench"}, timeout=60)["branchId"]
        out = []
        for i in range(warm + n):
            t = time.perf_counter()
            c.request("operate", {"branchId": bid, "instruction": f"q{i}"}, timeout=60)
            if i >= warm:
                out.append((time.perf_counter() - t) * 1000)
        return out
    finally:
        c.close()


_INPROC = r"""
import json, os, sys, time
sys.path.insert(0, {bench!r})
from operate_sidecar.server.core import Branch
kind, d, n_groups, restore_n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if kind == "jsonl":
    from legacy_jsonl_journal import Journal as S
else:
    from operate_sidecar.server.state import StateStore as S
mode = sys.argv[5]
if mode == "commit":
    s = S(d)
    b = Branch(system="sys", name="b")
    s.attach(b, {{"name": "b", "createdAt": 1}})
    s.flush()
    out = []
    for g in range(n_groups):
        b.messages.add("instruction", {{"instruction": "what is the weather in Lima? " * 4}})
        b.messages.add("assistant_response", {{"text": "It is sunny. " * 20}})
        t = time.perf_counter()
        s.flush()
        out.append((time.perf_counter() - t) * 1000)
    print(json.dumps(out))
elif mode == "write":
    s = S(d)
    b = Branch(system="sys", name="big")
    s.attach(b, {{"name": "big", "createdAt": 1}})
    for i in range(restore_n):
        b.messages.add("instruction" if i % 2 else "assistant_response",
                       {{"instruction": f"question {{i}}"}} if i % 2 else {{"text": f"answer {{i}}"}})
        if i % 5000 == 4999:
            s.flush()
    s.flush()
else:
    t = time.perf_counter()
    loaded = S(d).load()
    ms = (time.perf_counter() - t) * 1000
    assert sum(len(lb.messages) for lb in loaded) == restore_n + 1, sum(len(lb.messages) for lb in loaded)
    print(json.dumps(ms))
"""


def _inproc(kind: str, d: str, mode: str, server_cpu: int | None, n_groups: int = 0) -> Any:
    argv = common.pinned([sys.executable, "-c", _INPROC.format(bench=str(BENCH)), kind, d, str(n_groups),
                          str(RESTORE_N), mode], server_cpu)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {mode}: {out.stderr[-800:]}")
    return json.loads(out.stdout) if out.stdout.strip() else None


def _wire_restore(argv: list[str], d: str) -> float:
    from operate_sidecar.clients.python.client import SidecarClient

    t = time.perf_counter()
    c = SidecarClient(argv=argv, stderr=subprocess.DEVNULL)
    try:
        c.request("initialize", {"settings": {"stateDir": d, "models": {"s": {"provider": "scripted",
                                                                              "responses": ["x"]}},
                                              "defaultModel": "s"}}, timeout=120)
        got = c.request("listBranches", {}, timeout=120)["branches"]
        ms = (time.perf_counter() - t) * 1000
        assert got and got[0]["messageCount"] == RESTORE_N + 1, got
        return ms
    finally:
        c.close()


def measure(quick: bool, server_cpu: int | None) -> dict[str, Any]:
    reps, warm, n = (3, 20, 60) if quick else (8, 50, 200)
    argv = _argv(server_cpu)
    lat: dict[str, list[float]] = {"without": [], "with": [], "without_20": [], "with_20": []}
    per_rep: dict[str, list[float]] = {k: [] for k in lat}
    work = Path(tempfile.mkdtemp(prefix="store-bench-"))
    try:
        for r in range(reps):
            order = ["without", "with"] if r % 2 == 0 else ["with", "without"]
            for which in order:
                state = str(work / f"op-{r}") if which == "with" else None
                xs = _operate_session(argv, state, warm, n)
                lat[which] += xs
                per_rep[which].append(statistics.median(xs))
                state = str(work / f"op20-{r}") if which == "with" else None
                xs = _operate_session(argv, state, 5, max(10, n // 4), delay_ms=DELAY_MS)
                lat[which + "_20"] += xs
                per_rep[which + "_20"].append(statistics.median(xs))
        _log(f"   operate p50: without {statistics.median(lat['without']):.3f} ms, "
             f"with stateDir {statistics.median(lat['with']):.3f} ms")
        commit: dict[str, list[float]] = {"sqlite": [], "jsonl": []}
        restore: dict[str, list[float]] = {"sqlite": [], "jsonl": [], "wire": []}
        for kind in ("sqlite", "jsonl"):
            d = str(work / f"restore-{kind}")
            _inproc(kind, d, "write", server_cpu)
        for r in range(2 if quick else 5):
            for kind in (("sqlite", "jsonl") if r % 2 == 0 else ("jsonl", "sqlite")):
                commit[kind] += _inproc(kind, str(work / f"commit-{kind}-{r}"), "commit", server_cpu,
                                        n_groups=50 if quick else 200)
                restore[kind].append(_inproc(kind, str(work / f"restore-{kind}"), "load", server_cpu))
            restore["wire"].append(_wire_restore(argv, str(work / "restore-sqlite")))
        _log(f"   restore of {RESTORE_N} messages: sqlite {statistics.median(restore['sqlite']):.0f} ms, "
             f"jsonl {statistics.median(restore['jsonl']):.0f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    p50_with, p50_without = statistics.median(lat["with"]), statistics.median(lat["without"])
    ratio = p50_with / p50_without
    ratio_20 = statistics.median(lat["with_20"]) / statistics.median(lat["without_20"])
    return {
        "reps": reps, "warm": warm, "per_process": n, "restore_n": RESTORE_N, "ours": common.ours_label(),
        "summary": {"operate_without": _summ(lat["without"]), "operate_with": _summ(lat["with"]),
                    "operate_without_20": _summ(lat["without_20"]), "operate_with_20": _summ(lat["with_20"]),
                    "commit_sqlite": _summ(commit["sqlite"]), "commit_jsonl": _summ(commit["jsonl"]),
                    "restore_sqlite": _summ(restore["sqlite"]), "restore_jsonl": _summ(restore["jsonl"]),
                    "restore_wire": _summ(restore["wire"])},
        "per_rep_p50": per_rep,
        "ratios": [{"what": "operate p50 with stateDir / without, instant model", "ratio": ratio,
                    "target": f"≤ {TARGET_RATIO}", "met": ratio <= TARGET_RATIO},
                   {"what": f"operate p50 with stateDir / without, {DELAY_MS} ms model", "ratio": ratio_20,
                    "target": f"≤ {TARGET_RATIO}", "met": ratio_20 <= TARGET_RATIO}],
    }


def meta_now(command: str, server_cpu: int | None) -> dict[str, Any]:
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, SQLite "
                       f"{__import__('sqlite3').sqlite_version}, measured processes pinned to CPU {server_cpu}, "
                       f"load average at start {'/'.join(f'{x:.2f}' for x in os.getloadavg())}"}


def section(res: dict[str, Any], meta: dict[str, Any]) -> str:
    s = res["summary"]
    lines = [BEGIN, "## State store: SQLite vs the 0.1 JSONL journal", "",
             f"- date: {meta['date']}; command: `{meta['command']}`; {meta['machine']}{common.override_note(res)}",
             f"- operate over the wire: {res['reps']} fresh server processes per variant, interleaved; per process "
             f"{res['warm']} warm-up operates, then {res['per_process']} measured, sequential, on one branch, with "
             "the instant scripted model. With a `stateDir` every operate commits its messages (WAL, "
             "`synchronous=FULL`) before it answers.",
             f"- commit: one operate's two messages, in-process, `StateStore.flush` vs the old `Journal.flush` "
             f"(append + fsync). Restore: {res['restore_n']:,} messages in one branch, `load()` in a fresh process "
             "(imports excluded); over the wire: spawn → `initialize` → `listBranches` answered, branch restored.",
             "- reading the ratios: with the instant model an operate round trip costs a fraction of a "
             "millisecond, so the ratio measures the fixed cost of durability: one `fsync`ed transaction plus "
             "a hop to a worker thread per operate (the 0.1 JSONL journal paid an `fsync` per operate too, see "
             "the commit rows). That cost cannot go below one `fsync` without giving up `synchronous=FULL`. "
             f"With a model answering in {DELAY_MS} ms (faster than any real model here) the same cost is "
             "within the target. The machine is shared: see the load average above.",
             "", "| ratio | value | target | met |", "|---|---|---|---|"]
    for r in res["ratios"]:
        lines.append(f"| {r['what']} | {r['ratio']:.2f} | {r['target']} | {'yes' if r['met'] else 'NO'} |")
    lines += ["", "| measure (ms) | median | p90 | min..max | n |", "|---|---|---|---|---|"]
    labels = [("operate_without", "operate round trip, no stateDir, instant model"),
              ("operate_with", "operate round trip, stateDir (SQLite), instant model"),
              ("operate_without_20", f"operate round trip, no stateDir, {DELAY_MS} ms model"),
              ("operate_with_20", f"operate round trip, stateDir (SQLite), {DELAY_MS} ms model"),
              ("commit_sqlite", "commit of one operate, SQLite"),
              ("commit_jsonl", "commit of one operate, JSONL journal (0.1)"),
              ("restore_sqlite", f"restore {res['restore_n']:,} messages, SQLite"),
              ("restore_jsonl", f"restore {res['restore_n']:,} messages, JSONL journal (0.1)"),
              ("restore_wire", "spawn → listBranches with them restored, SQLite")]
    for key, label in labels:
        x = s.get(key)
        if x:
            lines.append(f"| {label} | {x['median']:.3f} | {x['p90']:.3f} | {x['min']:.3f}..{x['max']:.3f} | {x['n']} |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(res: dict[str, Any] | None, meta: dict[str, Any], path: Path = BENCH / "RESULTS.md") -> None:
    """Replace (or append) this benchmark's section of RESULTS.md."""
    if res and "summary" in res:
        replace_section(path, BEGIN, END, section(res, meta))


def run_alone(quick: bool, server_cpu: int | None, command: str, markdown: bool = True,
              out: Path = BENCH / "out", md_path: Path = BENCH / "RESULTS.md") -> int:
    """Measure, write ``<out>/store_results.json`` and (``markdown``) the section; 1 when unavailable."""
    meta = meta_now(command, server_cpu)
    _log(">> state store: operate with/without stateDir over the wire, commit and restore vs the JSONL journal")
    res = common.attempt(lambda: measure(quick, server_cpu))
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_results.json").write_text(json.dumps({"meta": meta, **res}, indent=1, default=str))
    if "unavailable" in res:
        _log(f"   state store: {res['unavailable']}")
        return 1
    for r in res["ratios"]:
        _log(f"   {r['what']}: {r['ratio']:.2f} (target {r['target']})")
    if markdown:
        write_section(res, meta, md_path)
        _log(f">> wrote the state store section of {md_path}")
    return 0
