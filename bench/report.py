"""Render bench/out/results.json as bench/RESULTS.md.

    python -m bench.report --notes [PATH]   # copy bench/RESULTS_NOTES.md into RESULTS.md again

A full run copies the hand-written ``bench/RESULTS_NOTES.md`` after the main tables (also when
``--results-md`` names another file), then a line naming the folder of the raw figures
(``--out``); after an edit of the notes, ``--notes`` puts the new text in place without a run.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ORDER = ["stdlib", "pygls", "mcp", "ours", "lionagi"]
_SC_ORDER = {k: i for i, k in enumerate(["plain", "response_format", "actions", "actions_async",
                                          "history_0", "history_400", "history_1000"])}


def _ms(x):
    return "–" if x is None else (f"{x * 1000:.3f}" if x < 0.01 else f"{x * 1000:.1f}")


def _row_s(label, s, p99=True):
    if not s:
        return f"| {label} | – | – |" + (" – |" if p99 else "") + " – |"
    cells = [label, _ms(s["median"]), f"{_ms(s['min'])}..{_ms(s['max'])}"]
    if p99:
        cells.append(_ms(s["p99"]))
    cells.append(str(s["n"]))
    return "| " + " | ".join(cells) + " |"


def _load(la):
    return "?" if not la else "/".join(f"{x:.2f}" for x in la)


def _names(results):
    cs = results.get("contenders", {})
    return [n for n in ORDER if n in cs] + [n for n in cs if n not in ORDER]


def _label(results, name):
    c = results.get("contenders", {}).get(name, {})
    lab = c.get("label", name)
    v = results.get("versions", {}).get(name)
    if name == "mcp" and v:
        lab += f" (mcp {v})"
    return lab


def _unavail(results, name, section):
    c = results.get("contenders", {}).get(name, {})
    if c.get("unavailable"):
        return f"| {_label(results, name)} | {c['unavailable'][:200]} |"
    if name not in results.get(section, {}):
        return f"| {_label(results, name)} | not measured |"
    if "unavailable" in results[section][name]:
        return f"| {_label(results, name)} | {results[section][name]['unavailable'][:200]} |"
    return None


#: How every separately written section of RESULTS.md opens (``store``, ``acp``, ``edit``, ``first``).
SECTION_BEGIN = re.compile(r"^<!-- [\w-]+-bench:begin -->", re.M)


def keep_sections(old: str, head: str) -> str:
    """``head`` (the regenerated start of RESULTS.md) followed by everything of ``old`` from its
    first separately written section on: those sections and the dated notes written between them,
    which no run regenerates, so that a full run does not erase them."""
    first = SECTION_BEGIN.search(old)
    return head if first is None else head.rstrip("\n") + "\n\n" + old[first.start():]


def replace_section(path: Path, begin: str, end: str, block: str) -> None:
    """Put ``block`` (which opens with ``begin`` and closes with ``end``) in place of the section
    of ``path`` between those marks, or after its text when it has none yet."""
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


BENCH = Path(__file__).resolve().parent
#: the hand-written notes a full run copies after the main tables, whichever file it writes
NOTES = BENCH / "RESULTS_NOTES.md"
DEFAULT_OUT = BENCH / "out"
RAW_LINE = "Raw figures: `bench/out/results.json` (git-ignored)."
_RAW = re.compile(r"^Raw figures: `[^`\n]*`.*$", re.M)


def raw_line(out: Path | None = None) -> str:
    """The line that ends the main tables: where the run's ``results.json`` is (``out``,
    ``bench/out`` by default; a folder in the checkout is named from its top)."""
    out = Path(out).resolve() if out is not None else DEFAULT_OUT
    if out == DEFAULT_OUT:
        return RAW_LINE
    shown = out.relative_to(BENCH.parent) if out.is_relative_to(BENCH.parent) else out
    return f"Raw figures: `{shown / 'results.json'}`."


def refresh_notes(path: Path) -> bool:
    """Put the current ``bench/RESULTS_NOTES.md`` in place of the copy a full run made after
    the main tables of ``path``: from the notes' first line up to the raw figures line. False
    (nothing written) when ``path`` holds no such copy."""
    notes = NOTES.read_text().rstrip() + "\n"
    text = path.read_text()
    first = SECTION_BEGIN.search(text)
    head, rest = (text[:first.start()], text[first.start():]) if first else (text, "")
    start = head.find(notes.splitlines()[0] + "\n")
    raw = _RAW.search(head, max(start, 0))
    end = raw.start() if raw else -1
    if start < 0 or end < start:
        return False
    path.write_text(head[:start] + notes + "\n" + head[end:] + rest)
    return True


def write_markdown(results: dict, path: Path, out: Path | None = None) -> None:
    """The main tables of ``path`` from ``results`` (then ``bench/RESULTS_NOTES.md`` and the
    line naming ``out``, where the raw figures are), keeping its separately written sections."""
    L = []
    add = L.append
    q = " (--quick smoke run: small samples, indicative only)" if results.get("quick") else ""
    add("# Benchmark results\n")
    add(f"- date: {results['date']}{q}")
    add(f"- command: `{results['command']}` (`make bench` runs `python -m bench.run`)")
    m = results.get("machine", {})
    add(f"- machine: {m.get('cpus')} CPUs, Python {m.get('python')}, {m.get('platform')}; "
        f"client pinned to CPU {m.get('client_cpu')}, every server and in-process run to CPU "
        f"{m.get('server_cpu')}; load average at start {_load(m.get('loadavg_start'))}, "
        f"at end {_load(m.get('loadavg_end'))}")
    add("- versions: " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items()))
    add(f"- elapsed: {results.get('elapsed_s', 0):.0f} s. All contenders measured interleaved "
        "(round-robin per repetition, rotated order). Only ratios from one run are meaningful "
        "on this noisy 2-core machine.\n")

    add("## Targets (ratios of medians from this run)\n")
    add("| ratio | value | target | met |")
    add("|---|---|---|---|")
    for r in results.get("ratios", []):
        v = "–" if r["ratio"] is None else (f"{r['ratio']:.0f}" if r["ratio"] >= 1000 else f"{r['ratio']:.2f}")
        met = "n/a" if r["met"] is None else ("yes" if r["met"] else "NO")
        add(f"| {r['what']} | {v} | {r['target']} | {met} |")
    add("")

    cold = results.get("cold_start", {})
    add("## Cold start: spawn → `initialize` answer (ms)\n")
    add("| contender | median | min..max | p99 | n |")
    add("|---|---|---|---|---|")
    for n in _names(results):
        u = _unavail(results, n, "cold_start")
        add(u if u else _row_s(_label(results, n), cold[n]["cold_start_s"]))
    add("")

    add("## RSS (MiB, VmRSS)\n")
    add("VmRSS of the server and every process under it (ours starts a `sh` reaper for its tools "
        "once its core loads: it counts after first use). "
        "*Idle*: after the `initialize` answer and one `ping`, left alone for 1 s and then until two "
        "samples 0.25 s apart agree within 128 KiB (ours has finished loading pygls in the background "
        "by then). *After first use*: the same process once it has also answered the requests a "
        "session starts with (ours: `listTools`, `createBranch`, which load the core; MCP: `tools/list`, "
        "`tools/call`; pygls and the floor: `add`), settled the same way.\n")
    add("| contender | idle median | idle min..max | after first use median | min..max | n |")
    add("|---|---|---|---|---|---|")
    for n in _names(results):
        u = _unavail(results, n, "cold_start")
        if u:
            add(u)
            continue
        s, s2 = cold[n]["idle_rss_kib"], cold[n].get("used_rss_kib") or {}
        if not s:
            add(f"| {_label(results, n)} | – | – | – | – | – |")
            continue
        used = (f"{s2['median'] / 1024:.1f} | {s2['min'] / 1024:.1f}..{s2['max'] / 1024:.1f}" if s2
                else "– | –")
        add(f"| {_label(results, n)} | {s['median'] / 1024:.1f} | "
            f"{s['min'] / 1024:.1f}..{s['max'] / 1024:.1f} | {used} | {s['n']} |")
    add("")

    sess = results.get("sessions", {})
    add("## Light request latency, sequential on one connection (ms)\n")
    add("The stdlib floor bounds what the client, the pipes and JSON cost; p99 on this shared "
        "machine is dominated by scheduling noise.\n")
    add("| contender | request | p50 | min..max | p99 | n |")
    add("|---|---|---|---|---|---|")
    for n in _names(results):
        u = _unavail(results, n, "sessions")
        if u:
            add(u)
            continue
        for metric, s in sess[n]["light_s"].items():
            row = _row_s(_label(results, n), s)
            add(row.replace(f"| {_label(results, n)} |", f"| {_label(results, n)} | `{metric}` |", 1))
    add("")

    add("## Throughput, 16 requests in flight (req/s; median of blocks)\n")
    add("| contender | request | median | min..max | blocks |")
    add("|---|---|---|---|---|")
    for n in _names(results):
        u = _unavail(results, n, "sessions")
        if u:
            add(u)
            continue
        s = sess[n]["throughput_rps"]
        add(f"| {_label(results, n)} | `{sess[n]['throughput_method']}` | {s['median']:.0f} | "
            f"{s['min']:.0f}..{s['max']:.0f} | {s['n']} |")
    add("")

    inp = results.get("inproc", {})
    if inp:
        add("## `Branch.operate()` in-process, instant model (ms per call)\n")
        add("plain / response_format / +actions: a fresh branch per call (history 0). "
            "history_N: a branch filled to N messages outside the clock (history_0: a fresh branch per "
            "call); one timed call per size in turn, so all sizes see the same load. "
            "`actions` uses the SAME sync tool in both runtimes (`def add(a: int, b: int) -> int`; "
            "lionagi calls a sync tool inline on the event loop, ours hands it to a worker thread); "
            "`actions_async` uses the same tool as `async def` in both. `ours_wire` = the same "
            "scenarios as `operate` requests over stdio to the sidecar (time per request at the "
            "client; the tool comes from `toolModules`: bench/peers/bench_tools.py), run "
            "interleaved with the in-process runs.\n")
        add("| runtime | scenario | p50 | min..max | p99 | n |")
        add("|---|---|---|---|---|---|")
        for name, r in inp.items():
            if "unavailable" in r:
                add(f"| {name} | {r['unavailable'][:300]} | | | | |")
                continue
            for sc, s in sorted(r["operate_s"].items(), key=lambda kv: _SC_ORDER.get(kv[0], 99)):
                row = _row_s(name, s)
                add(row.replace(f"| {name} |", f"| {name} | {sc} |", 1))
        bm = [x for x in (inp.get("ours_wire") or {}).get("branch_memory") or [] if x]
        if bm:
            per = sorted(x["per_branch_kib"] / 1024 for x in bm)
            b0 = bm[0]
            add(f"\nRSS added per branch of 1,000 messages (ours over the wire, {b0['branches']} branches "
                f"grown by 500 plain operates each; instruction {b0['instruction_chars']} chars, reply "
                f"{b0['reply_chars']} chars): " + ", ".join(f"{x:.2f}" for x in per) + " MiB per run.")
        imports = ", ".join(f"{k} {v['import_s']:.2f} s" for k, v in inp.items()
                            if v.get("import_s") is not None)
        if imports:
            add(f"\nImport time of the runtime (informational): {imports}.")
        add("")

    ex = results.get("ours_extra", {})

    def extra(key, what):
        """ex[key], or {} after a line saying why `what` is unavailable."""
        d = ex.get(key, {})
        if "unavailable" in d:
            add(f"- {what}: {d['unavailable']}")
            return {}
        return d

    add("## operate-sidecar over the wire (scripted model)\n")
    if "unavailable" in ex:
        add(f"{ex['unavailable']}\n")
    else:
        for ckey, note in (("concurrent_100_operates", "server defaults"),
                           ("concurrent_100_operates_128_slots", "maxConcurrentOperates 128")):
            c = extra(ckey, f"100 concurrent operates ({note})")
            if c:
                add(f"- {c['n']} concurrent operates on {c['n']} branches ({note}), model delay {c['delay_ms']} ms: "
                    f"wall {c['wall_s'] * 1000:.0f} ms (overhead {c['overhead_ms']:.0f} ms), "
                    f"{c['operates_per_s']:.0f} operates/s; slowest answer "
                    f"{c['latency_s']['max'] * 1000:.0f} ms vs bound 1.5 × {c['delay_ms']} ms + single-call "
                    f"overhead {c.get('single_call_overhead_ms', float('nan')):.1f} ms = "
                    f"{c.get('bound_ms', float('nan')):.0f} ms: "
                    f"{'all within' if c.get('all_within_bound') else 'NOT all within'}")
        p = extra("progress_deltas", "`$/progress` deltas")
        if p.get("deltas_per_s"):
            s = p["deltas_per_s"]
            add(f"- `$/progress` deltas/s ({p['chunks']} chunks per reply): median {s['median']:.0f}, "
                f"{s['min']:.0f}..{s['max']:.0f} over {s['n']} operates; deltas "
                f"{'in order and complete' if p.get('in_order') else 'OUT OF ORDER or missing'}")
        mg = extra("memory_growth", "memory growth")
        if mg:
            add(f"- memory over {mg['operates']} operates (create/operate/delete, 16 in flight; from the RSS "
                "a server settles at after one such cycle and its delayed warm-up): "
                f"RSS {mg['rss_start_kib'] / 1024:.1f} → {mg['rss_end_kib'] / 1024:.1f} MiB "
                f"(+{mg['growth_kib'] / 1024:.1f} MiB; after the first {mg['operates'] // 10} operates +"
                f"{mg.get('growth_after_warmup_kib', 0) / 1024:.1f} MiB; second half +"
                f"{mg['growth_second_half_kib'] / 1024:.1f} MiB), {mg['wall_s']:.1f} s")
        fr = extra("first_request", "first request after `initialize`")
        if fr:
            add(f"- first requests after the `initialize` answer (median of {fr['reps']} fresh servers): "
                f"createBranch + operate {fr['first_create_operate_s']['median'] * 1000:.0f} ms "
                f"({fr['first_create_operate_s']['min'] * 1000:.0f}..{fr['first_create_operate_s']['max'] * 1000:.0f}), "
                f"then operate + responseFormat {fr['first_operate_rf_s']['median'] * 1000:.1f} ms; warm: "
                f"operate {fr['warm_operate_s']['median'] * 1000:.2f} ms, + responseFormat "
                f"{fr['warm_operate_rf_s']['median'] * 1000:.2f} ms (initialize itself "
                f"{fr['initialize_s']['median'] * 1000:.0f} ms)")
        add("")
    if NOTES.exists():  # hand-written sections kept across regenerations
        add(NOTES.read_text().rstrip() + "\n")
    add(raw_line(out))
    head = "\n".join(L) + "\n"
    old = path.read_text() if path.exists() else ""
    path.write_text(keep_sections(old, head))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--notes"]:
        sys.exit(__doc__)
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent / "RESULTS.md"
    sys.exit(0 if refresh_notes(target) else f"{target}: no copy of RESULTS_NOTES.md to replace")
