"""Edits, previews and rounds: what they add to an operate (``python -m bench.run --only edit``).

Over the wire (real server, instant scripted model, pinned to one CPU, fresh processes per
variant, interleaved across repetitions), the per-operate latency of:

- ``write``: one ``write_file`` call, policy ``allow`` (no preview): the baseline;
- ``write_ask``: the same, policy ``ask``: the permission request carries the diff preview,
  the client answers ``allow_once``, the write re-checks the file (no lost work);
- ``edit_ask``: one ``edit_file`` call, policy ``ask``: preview, permission, re-check, edit;
- ``edit``: one ``edit_file`` call, policy ``allow``;
- ``tool``: one operate whose model calls ``read_file`` (``maxRounds`` 1);
- ``followup``: one operate whose model calls no tool (actions on): "one extra operate";
- ``rounds2``: ``maxRounds`` 2, round 1 calls ``read_file``, round 2 calls none.

Added cost of a preview + edit = ``edit_ask`` − ``write`` (p50); the cost of a round =
``rounds2`` − ``tool``, whose target is at most one extra operate (``followup``): those three
also take turns in one process per repetition, and the round's cost is the median of each
``rounds2`` operate's time less the ``tool`` operate's next to it (two ~1 ms medians from
different processes differ by more than a round on this machine).
In-process: ``unified_diff`` of a 10,000-line file (one edit, 100 scattered changed lines,
every line changed), target under 50 ms.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common
from .client import Conn
from .report import replace_section
from .store_bench import BENCH, _argv, _log, _summ, meta_now

BEGIN, END = "<!-- edit-bench:begin -->", "<!-- edit-bench:end -->"
DIFF_TARGET_MS = 50.0
ROUND_TARGET = 1.0  # a round costs at most one extra operate

FILE_LINES = 200
READ = {"json": {"action_requests": [{"function": "read_file", "arguments": {"path": "f.py"}}]}}
NONE = {"json": {"action_requests": []}}


class AllowConn(Conn):
    """The bench client, answering every permission request ``allow_once``."""

    def _dispatch(self, msg: dict) -> None:
        if msg.get("method") == "requestToolPermission" and "id" in msg:
            self.server_requests.append({"preview": bool((msg.get("params") or {}).get("preview"))})
            self._write({"jsonrpc": "2.0", "id": msg["id"], "result": {"decision": "allow_once"}})
            return
        super()._dispatch(msg)


def _text(tag: str) -> str:
    return "".join(f"line {i}: value = {i * 7}  # {tag if i == FILE_LINES // 2 else 'same'}\n"
                   for i in range(FILE_LINES))


def _responses(plan: list[str]) -> list[Any]:
    """The scripted model's replies for the operates of ``plan`` (one variant name per operate)."""
    out: list[Any] = []
    for i, variant in enumerate(plan):
        tag_old, tag_new = ("A", "B") if i % 2 == 0 else ("B", "A")
        if variant.startswith("write"):
            out.append({"json": {"action_requests": [{"function": "write_file", "arguments": {
                "path": "f.py", "content": _text(tag_new)}}]}})
        elif variant.startswith("edit"):
            out.append({"json": {"action_requests": [{"function": "edit_file", "arguments": {
                "path": "f.py", "edits": [{"oldText": f"# {tag_old}\n", "newText": f"# {tag_new}\n"}]}}]}})
        elif variant == "tool":
            out.append(READ)
        elif variant == "followup":
            out.append(NONE)
        else:  # rounds2
            out += [READ, NONE]
    return out


async def _session(argv: list[str], plan: list[str], warm: int) -> dict[str, list[float]]:
    """One fresh server running the operates of ``plan`` in order on one branch: each one's time
    (ms) by variant, after the first ``warm``. The tool policy is ``ask`` when the plan's
    variants are the ``_ask`` ones. Its workspace is a temporary folder, removed at the end."""
    work = Path(tempfile.mkdtemp(prefix="edit-bench-"))
    conn = AllowConn("lsp")
    try:
        (work / "f.py").write_text(_text("A"))
        policy = "ask" if plan[0].endswith("_ask") else "allow"
        await conn.spawn(argv, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        await conn.request("initialize", {"clientInfo": {"name": "edit-bench"}, "workspaceFolders": [str(work)],
                                          "capabilities": {"toolPermission": True},
                                          "settings": {"models": {"s": {"provider": "scripted",
                                                                        "responses": _responses(plan)}},
                                                       "defaultModel": "s", "toolPolicy": {
                                                           "write_file": policy, "edit_file": policy}}}, timeout=60)
        bid = (await conn.request("createBranch", {}, timeout=60))["branchId"]
        out: dict[str, list[float]] = {v: [] for v in plan}
        for i, variant in enumerate(plan):
            rounds = 2 if variant == "rounds2" else 1
            t = time.perf_counter()
            res = await conn.request("operate", {"branchId": bid, "instruction": f"q{i}", "actions": True,
                                                 "clearMessages": True, **({"maxRounds": 2} if rounds == 2 else {})},
                                     timeout=60)
            dt = (time.perf_counter() - t) * 1000
            outputs = [r.get("output") for r in (res["result"] or {}).get("action_responses") or []]
            if any(isinstance(o, dict) and "error" in o for o in outputs):
                raise RuntimeError(f"{variant}: a tool failed: {outputs}")
            if res.get("rounds") != rounds:
                raise RuntimeError(f"{variant}: {res.get('rounds')} rounds, not {rounds}")
            if i >= warm:
                out[variant].append(dt)
        if policy == "ask" and not all(r["preview"] for r in conn.server_requests[-(len(plan) - warm):]):
            raise RuntimeError(f"{plan[0]}: a permission request without a preview")
        return out
    finally:
        await conn.close()
        shutil.rmtree(work, ignore_errors=True)


VARIANTS = ("write", "write_ask", "edit_ask", "edit", "tool", "followup", "rounds2")
#: the round's cost is measured in one process, the three shapes taking turns (the order rotated
#: each time): the difference of two ~1 ms medians from different processes is within this
#: machine's drift, and once read below zero
PAIRED = ("tool", "rounds2", "followup")


def _diff_cases() -> dict[str, tuple[str, str]]:
    rnd = random.Random(7)
    lines = [f"    line_{i} = compute({i}, {'x' * rnd.randint(10, 60)!r})\n" for i in range(10_000)]
    old = "".join(lines)
    return {
        "one_edit": (old, old.replace("line_5000 =", "line_5000_renamed =")),
        "scattered_100": (old, "".join(ln.upper() if i % 100 == 0 else ln for i, ln in enumerate(lines))),
        "all_changed": (old, old.upper()),
    }


def _diff_times(reps: int) -> dict[str, Any]:
    from operate_sidecar.server.tools.edits import unified_diff

    cases = _diff_cases()
    unified_diff("a\n", "b\n", "warm")  # imports
    out: dict[str, Any] = {}
    for name, (old, new) in cases.items():
        xs = []
        for _ in range(reps):
            t = time.perf_counter()
            unified_diff(old, new, "big.py")
            xs.append((time.perf_counter() - t) * 1000)
        out[name] = _summ(xs)
    return out


def measure(quick: bool, server_cpu: int | None) -> dict[str, Any]:
    reps, warm, n = (2, 10, 40) if quick else (5, 20, 150)
    argv = _argv(server_cpu)
    lat: dict[str, list[float]] = {v: [] for v in VARIANTS}
    paired: dict[str, list[float]] = {v: [] for v in PAIRED}
    for r in range(reps):
        order = list(VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)])  # rotated each repetition
        for v in order:
            lat[v] += asyncio.run(_session(argv, [v] * (warm + n), warm))[v]
        turns = [PAIRED[(i + k) % 3] for i in range(warm + n) for k in range(3)]
        for v, xs in asyncio.run(_session(argv, turns, 3 * warm)).items():
            paired[v] += xs
        _log(f"   rep {r + 1}/{reps}: " + ", ".join(f"{v} {statistics.median(lat[v]):.2f} ms" for v in VARIANTS)
             + "; taking turns in one process: " + ", ".join(f"{v} {statistics.median(paired[v]):.2f} ms"
                                                             for v in PAIRED))
    p50 = {v: statistics.median(xs) for v, xs in lat.items()}
    diff = _diff_times(5 if quick else 15)
    # each rounds2 operate against the tool operate next to it, in the same process
    round_cost = statistics.median(b - a for a, b in zip(paired["tool"], paired["rounds2"]))
    extra_operate = statistics.median(paired["followup"])
    summary = {
        "preview_edit_added_ms": p50["edit_ask"] - p50["write"],
        "preview_write_added_ms": p50["write_ask"] - p50["write"],
        "edit_vs_write_ms": p50["edit"] - p50["write"],
        "preview_on_edit_ms": p50["edit_ask"] - p50["edit"],
        "round_cost_ms": round_cost,
        "extra_operate_ms": extra_operate,
        "round_ratio": round_cost / extra_operate,
        "diff_ms": {k: v["median"] for k, v in diff.items()},
    }
    ratios = [
        {"what": "one round / one extra operate (p50)", "ratio": summary["round_ratio"],
         "target": f"<= {ROUND_TARGET}", "met": summary["round_ratio"] <= ROUND_TARGET},
    ] + [{"what": f"diff of a 10,000-line file, {k} (median ms)", "ratio": v,
          "target": f"< {DIFF_TARGET_MS}", "met": v < DIFF_TARGET_MS} for k, v in summary["diff_ms"].items()]
    return {"reps": reps, "warm": warm, "per_process": n, "ours": common.ours_label(), "latency_ms": {v: _summ(xs) for v, xs in lat.items()},
            "paired_ms": {v: _summ(xs) for v, xs in paired.items()},
            "diff": diff, "summary": summary, "ratios": ratios}


def section(res: dict[str, Any], meta: dict[str, Any]) -> str:
    s = res["summary"]
    L = res["latency_ms"]
    lines = [BEGIN, "## Edits, previews and rounds", "",
             f"- date: {meta['date']}; command: `{meta['command']}`; {meta['machine']}{common.override_note(res)}",
             f"- over the wire: {res['reps']} fresh server processes per variant, interleaved (order rotated per "
             f"repetition); per process {res['warm']} warm-up operates, then {res['per_process']} measured, "
             f"sequential, with the instant scripted model and a {FILE_LINES}-line file; the client answers "
             "permission requests `allow_once` at once (no human in the loop).",
             "",
             "| variant | p50 ms | p90 ms |", "|---|---|---|"]
    for v in VARIANTS:
        lines.append(f"| `{v}` | {L[v]['median']:.3f} | {L[v]['p90']:.3f} |")
    lines += ["",
              f"- preview + edit over a plain `write_file` (`edit_ask` − `write`): **{s['preview_edit_added_ms']:+.3f} ms**"
              f" per call (the preview and the permission round trip alone, `write_ask` − `write`: "
              f"{s['preview_write_added_ms']:+.3f} ms; `edit` − `write` without asking: {s['edit_vs_write_ms']:+.3f} ms). "
              "A `write_file` call carries the whole file through the model reply, parse, validation and the "
              "recorded messages, an `edit_file` call only the changed text (but reads the file to apply it), "
              "so which of the two costs more depends on the file's size.",
              f"- preview + permission round trip + re-check on the same edit (`edit_ask` − `edit`): "
              f"**{s['preview_on_edit_ms']:+.3f} ms**",
              f"- a round (`rounds2` − `tool`, each against the one next to it: the three shapes take turns in one "
              f"process per repetition, {res['per_process']} of each after {res['warm']} warm-up turns, so that no "
              f"drift between processes enters the difference): **{s['round_cost_ms']:.3f} ms**, one extra "
              f"operate (`followup`, the same processes): "
              f"{s['extra_operate_ms']:.3f} ms → ratio **{s['round_ratio']:.2f}** (target ≤ {ROUND_TARGET}); a round "
              "runs inside the server (no request to frame, parse, dispatch and answer), so it costs less than a "
              "separate operate. With a real model both are dominated by the model call.",
              "- `unified_diff` of a 10,000-line file, in-process, median ms: "
              + ", ".join(f"{k} **{v:.1f}**" for k, v in s["diff_ms"].items()) + f" (target < {DIFF_TARGET_MS:g})",
              "", "| check | value | target | met |", "|---|---|---|---|"]
    for r in res["ratios"]:
        lines.append(f"| {r['what']} | {r['ratio']:.2f} | {r['target']} | {'yes' if r['met'] else 'NO'} |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(res: dict[str, Any] | None, meta: dict[str, Any], path: Path = BENCH / "RESULTS.md") -> None:
    """Replace (or append) this benchmark's section of RESULTS.md."""
    if res and "summary" in res:
        replace_section(path, BEGIN, END, section(res, meta))


def rewrite_from_json(path: Path = BENCH / "out" / "edit_results.json") -> None:
    """Rewrite the RESULTS.md section from the last run's JSON (after a change to the text only)."""
    data = json.loads(path.read_text())
    meta = data.pop("meta")
    lat = data["latency_ms"]
    s = data["summary"]
    s.setdefault("preview_on_edit_ms", lat["edit_ask"]["median"] - lat["edit"]["median"])
    write_section(data, meta)


def run_alone(quick: bool, server_cpu: int | None, command: str, markdown: bool = True,
              out: Path = BENCH / "out", md_path: Path = BENCH / "RESULTS.md") -> int:
    """Measure, write ``<out>/edit_results.json`` and (``markdown``) the section; 1 when unavailable
    or a target is not met."""
    meta = meta_now(command, server_cpu)
    _log(">> edits, previews and rounds over the wire; diff of a 10,000-line file")
    res = common.attempt(lambda: measure(quick, server_cpu))
    out.mkdir(parents=True, exist_ok=True)
    (out / "edit_results.json").write_text(json.dumps({"meta": meta, **res}, indent=1, default=str))
    if "unavailable" in res:
        _log(f"   edits: {res['unavailable']}")
        return 1
    for r in res["ratios"]:
        _log(f"   {r['what']}: {r['ratio']:.2f} (target {r['target']})")
    if markdown:
        write_section(res, meta, md_path)
        _log(f">> wrote the edits section of {md_path}")
    return 0 if all(r["met"] for r in res["ratios"]) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_alone("--quick" in sys.argv, None, "python -m bench.edit_bench"))
