"""Benchmark harness: python -m bench.run [--quick] [--only a,b] [--no-setup] [--out DIR]

Creates the peers' venvs under bench/.venvs/ if missing, then measures every
contender INTERLEAVED in one run (round-robin per repetition, order rotated
each repetition), with the client pinned to one CPU and every server to the
other.  Writes <out>/results.json (bench/out by default) and regenerates
bench/RESULTS.md: all of it after a full run, only the separately written
sections measured (store, edit, acp, first) after an ``--only`` run, each with
the date and machine line its child harness recorded.

A folder named by ``--out`` gets results.json, <section>_results.json and
logs/<server>.stderr, and loses nothing else; one that holds files but none of
these is refused (exit 2). Only bench/out is also cleared of every old
logs/*.stderr and of the work/ folder older runs left there.

The store, edit, acp and first sections of a combined run each run in a child
harness (``python -m bench.run --only <section>``): one that fails is recorded
as unavailable and the run goes on, and Ctrl-C or SIGTERM reaches them at once.
A stopped run closes its servers, removes its temporary folders, writes
nothing more, prints one line and exits 130 (SIGINT) or 143 (SIGTERM).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from . import acp_bench, common, edit_bench, first_bench, ours_extras, store_bench, venvs
from . import contenders as C
from .client import Conn, kill_tree, settled_rss_kib
from .report import write_markdown
from .stats import summary

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = BENCH / "out"
RESULTS_MD = BENCH / "RESULTS.md"
#: the stdio contenders and the lionagi in-process runner (``--only`` picks among them) ...
CONTENDERS = ("stdlib", "pygls", "mcp", "ours", "lionagi")
#: ... and the separately written sections, each measured (``run_alone``) and written
#: (``write_section``) by its own module
SECTIONS = {"acp": acp_bench, "store": store_bench, "edit": edit_bench, "first": first_bench}
#: the bound on one section's child harness (a full ``first`` or ``store`` takes a few minutes)
SECTION_TIMEOUT_S = 3600.0
#: how long a section's child harness has to end once told to stop, before it is killed
SECTION_GRACE_S = 60.0


class Config:
    def __init__(self, quick: bool):
        self.quick = quick
        self.cold_reps = 5 if quick else 20
        self.rss_settle_s = 1.0      # idle RSS: at least this long after initialize + ping ...
        self.rss_settle_max_s = 5.0  # ... until two samples 0.25 s apart agree within 128 KiB
        self.light_reps, self.light_block = (3, 100) if quick else (12, 250)
        self.light_warmup = 30 if quick else 200
        self.tp_reps, self.tp_block = (3, 300) if quick else (6, 2000)
        self.in_flight = 16
        self.inproc_reps, self.inproc_n, self.inproc_hist_n = (1, 30, 30) if quick else (3, 100, 30)
        self.ours_concurrent = 100
        self.ours_progress_runs = 2 if quick else 5
        self.ours_mem_total = 1000 if quick else 10_000
        self.ours_first_reps = 3 if quick else 8


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- pinning
def pick_cpus() -> tuple[int | None, int | None]:
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None, None
    if len(cpus) < 2 or not shutil.which("taskset"):
        return None, None
    return cpus[0], cpus[1]


class Harness:
    def __init__(self, cfg: Config, contenders: list[C.Contender], out: Path, work: Path,
                 cpus: tuple[int | None, int | None]):
        """``out``: where results and logs go; ``work``: the servers' working folder (the caller
        makes it fresh for the run and removes it after: lionagi leaves its log dumps there)."""
        self.cfg = cfg
        self.contenders = {c.name: c for c in contenders}
        self.out, self.logs, self.work = out, out / "logs", work
        self.client_cpu, self.server_cpu = cpus
        if self.client_cpu is not None:
            os.sched_setaffinity(0, {self.client_cpu})
        self.env = dict(os.environ)
        self.env.pop("PYTHONPATH", None)

    def server_argv(self, argv: list[str]) -> list[str]:
        return common.pinned(argv, self.server_cpu)

    async def spawn(self, name: str, on_notification=None, extra_env: dict | None = None) -> Conn:
        c = self.contenders[name]
        conn = Conn(c.framing, on_notification)
        env = {**self.env, **extra_env} if extra_env else self.env
        await conn.spawn(self.server_argv(c.argv), cwd=str(self.work), env=env,
                         stderr_path=self.logs / f"{name}.stderr")
        return conn

    async def handshake(self, conn: Conn, c: C.Contender, timeout: float | None = 60) -> dict:
        res = await conn.request("initialize", c.init_params, timeout=timeout)
        for note in c.after_init:
            conn.notify(note)
        return res

    def live(self) -> list[C.Contender]:
        return [c for c in self.contenders.values() if not c.unavailable]

    def order(self, rep: int) -> list[C.Contender]:
        cs = self.live()
        if not cs:
            return cs
        k = rep % len(cs)
        return cs[k:] + cs[:k]

    # ------------------------------------------------------------ probe
    async def probe(self) -> None:
        for c in self.contenders.values():
            if not c.unavailable and not Path(c.argv[0]).exists():
                c.unavailable = f"unavailable: {c.argv[0]} not found"
            if c.unavailable:
                log(f"   probe {c.name}: {c.unavailable}")
                continue
            conn = None
            try:
                conn = await self.spawn(c.name)
                await self.handshake(conn, c, timeout=60)
                for metric, (method, params) in c.light.items():
                    await conn.request(method, params, timeout=30)
            except Exception as e:  # noqa: BLE001 - any failure means "skip it"
                tail = _tail(self.logs / f"{c.name}.stderr")
                c.unavailable = f"unavailable: {type(e).__name__}: {e} {tail}".strip()
            finally:
                if conn is not None and conn.proc is not None:
                    await conn.close()
            log(f"   probe {c.name}: {c.unavailable or 'ok'}")

    # ------------------------------------------------------- cold start
    async def cold_start(self) -> dict:
        cold: dict[str, list[float]] = {c.name: [] for c in self.live()}
        rss: dict[str, list[int]] = {c.name: [] for c in self.live()}
        used: dict[str, list[int]] = {c.name: [] for c in self.live()}
        failures: dict[str, list[str]] = {c.name: [] for c in self.live()}
        for rep in range(self.cfg.cold_reps):
            for c in self.order(rep):
                conn = Conn(c.framing)
                try:
                    t0 = time.perf_counter()
                    await conn.spawn(self.server_argv(c.argv), cwd=str(self.work), env=self.env,
                                     stderr_path=self.logs / f"{c.name}.stderr")
                    await self.handshake(conn, c, timeout=60)
                    cold[c.name].append(time.perf_counter() - t0)
                    # idle: answered initialize and a ping, then left alone until its RSS is
                    # steady (ours finishes loading pygls in the background meanwhile)
                    await conn.request("ping", {}, timeout=60)
                    r = await self._settled_rss(conn)
                    if r:
                        rss[c.name].append(r)
                    # first use: the requests a session starts with (ours: listTools and
                    # createBranch, which load the core; MCP: tools/list and tools/call)
                    for method, params in c.first_use:
                        await conn.request(method, params, timeout=60)
                    r = await self._settled_rss(conn)
                    if r:
                        used[c.name].append(r)
                except Exception as e:  # noqa: BLE001
                    failures[c.name].append(repr(e))
                finally:
                    await conn.close()
        return {name: {"cold_start_s": summary(cold[name]), "idle_rss_kib": summary(rss[name]),
                       "used_rss_kib": summary(used[name]), "failures": failures[name]} for name in cold}

    async def _settled_rss(self, conn: Conn) -> int | None:
        """The server's RSS with that of the processes under it (ours: its tools' ``sh`` reaper)."""
        return await settled_rss_kib(conn.pid, self.cfg.rss_settle_s, self.cfg.rss_settle_max_s, tree=True)

    # --------------------------------------------- light + throughput
    async def sessions(self) -> dict:
        """Light latency and 16-in-flight throughput, one connection per contender.

        A contender whose connection fails (or a block that takes over 300 s) is
        dropped from the rest of this phase and reported with the error.
        """
        conns: dict[str, Conn] = {}
        errors: dict[str, str] = {}
        out: dict[str, dict] = {}
        live = self.live()
        lat = {c.name: {m: [] for m in c.light} for c in live}
        tps: dict[str, list[float]] = {c.name: [] for c in live}

        async def guarded(name: str, coro) -> None:
            try:
                await asyncio.wait_for(coro, 300)
            except Exception as e:  # noqa: BLE001
                errors[name] = f"unavailable: session failed: {type(e).__name__}: {e}"[:500]
                log(f"   {name}: {errors[name]}")

        async def open_one(c: C.Contender) -> None:
            conn = await self.spawn(c.name)
            conns[c.name] = conn
            await self.handshake(conn, c)
            for method, params in c.light.values():  # warm-up
                for _ in range(self.cfg.light_warmup):
                    await conn.request(method, params)

        async def light_block(c: C.Contender) -> None:
            conn = conns[c.name]
            for metric, (method, params) in c.light.items():
                samples = lat[c.name][metric]
                req = conn.request
                for _ in range(self.cfg.light_block):
                    t0 = time.perf_counter()
                    await req(method, params)
                    samples.append(time.perf_counter() - t0)

        async def tp_block(c: C.Contender) -> None:
            tps[c.name].append(await self._throughput(conns[c.name], *c.throughput))

        try:
            for c in live:
                await guarded(c.name, open_one(c))
            for rep in range(self.cfg.light_reps):
                for c in self.order(rep):
                    if c.name not in errors:
                        await guarded(c.name, light_block(c))
            for rep in range(self.cfg.tp_reps):
                for c in self.order(rep):
                    if c.name not in errors:
                        await guarded(c.name, tp_block(c))
            for c in live:
                if c.name in errors:
                    out[c.name] = {"unavailable": errors[c.name]}
                    continue
                out[c.name] = {
                    "light_s": {m: summary(v) for m, v in lat[c.name].items()},
                    "throughput_rps": summary(tps[c.name]),
                    "throughput_method": c.throughput[0],
                    "rss_after_load_kib": conns[c.name].rss_kib(),
                }
        finally:
            for conn in conns.values():
                await conn.close()
        return out

    async def _throughput(self, conn: Conn, method: str, params: dict) -> float:
        total, window = self.cfg.tp_block, self.cfg.in_flight
        sent = 0
        done = asyncio.get_running_loop().create_future()
        finished = 0

        def on_done(fut: asyncio.Future) -> None:
            nonlocal sent, finished
            finished += 1
            if fut.exception() is not None and not done.done():
                done.set_exception(fut.exception())
                return
            if sent < total:
                sent += 1
                try:
                    conn.send_request(method, params).add_done_callback(on_done)
                except ConnectionError as e:
                    if not done.done():
                        done.set_exception(e)
            elif finished == total and not done.done():
                done.set_result(None)

        t0 = time.perf_counter()
        for _ in range(min(window, total)):
            sent += 1
            conn.send_request(method, params).add_done_callback(on_done)
        await asyncio.wait_for(done, 300)
        return total / (time.perf_counter() - t0)

    # ----------------------------------------------------- in-process
    async def inproc(self, lionagi_py: Path | None) -> dict:
        runners = {}
        if lionagi_py is not None:
            runners["lionagi"] = [str(lionagi_py), str(BENCH / "peers" / "lionagi_inproc.py")]
        runners["ours"] = [sys.executable, "-m", "bench.ours_inproc"]
        ours_c = self.contenders.get("ours")
        if ours_c is not None and not ours_c.unavailable:
            runners["ours_wire"] = None  # over the wire: ours_extras.wire_operates, same scenarios
        args = ["--n", str(self.cfg.inproc_n), "--hist-n", str(self.cfg.inproc_hist_n)]
        pooled: dict[str, dict[str, list[float]]] = {k: {} for k in runners}
        meta: dict[str, dict] = {k: {"runs": 0, "errors": []} for k in runners}
        names = list(runners)
        for rep in range(self.cfg.inproc_reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                wire = runners[name] is None
                if wire:
                    res, err = await self._inproc_wire()
                else:
                    res, err = await self._inproc_subprocess(name, self.server_argv(runners[name] + args))
                m = meta[name]
                if err is not None:
                    m["errors"].append(err)
                    continue
                m["runs"] += 1
                if wire:
                    m["checks"] = res.get("checks")
                    m.setdefault("branch_memory", []).append(res.get("branch_memory"))
                else:
                    m["import_s"] = res.get("import_s")
                    m["checks"] = res.get("checks")
                    m["version"] = res.get("version")
                for sc, xs in res.get("samples_ms", {}).items():
                    pooled[name].setdefault(sc, []).extend(x / 1000.0 for x in xs)
                for sc, s in res.get("scenarios", {}).items():
                    if "messages_start" in s:
                        m.setdefault("history_messages", {})[sc] = [s["messages_start"], s["messages_end"]]
        out = {}
        for name in runners:
            if meta[name]["runs"] == 0:
                out[name] = {"unavailable": "unavailable: " + "; ".join(meta[name]["errors"])[:800]}
                continue
            out[name] = {"operate_s": {sc: summary(xs) for sc, xs in pooled[name].items()}, **meta[name]}
        return out

    async def _inproc_wire(self) -> tuple[dict | None, str | None]:
        """ours over the wire (ours_extras.wire_operates): (result, None) or (None, error)."""
        try:
            return await asyncio.wait_for(ours_extras.wire_operates(
                self.spawn, n=self.cfg.inproc_n, hist_n=self.cfg.inproc_hist_n), 1800), None
        except Exception as e:  # noqa: BLE001
            return None, f"{type(e).__name__}: {e}"[:600]

    async def _inproc_subprocess(self, name: str, argv: list[str]) -> tuple[dict | None, str | None]:
        """One in-process runner: (its last stdout line as JSON, None) or (None, error). The
        runner is killed however this ends (a timeout, the run cancelled by a signal)."""
        env = dict(self.env)
        if name == "ours":
            env["PYTHONPATH"] = str(ROOT)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=str(ROOT if name == "ours" else self.work), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            so, se = await asyncio.wait_for(proc.communicate(), 1800)
        except asyncio.TimeoutError:
            return None, "timeout"
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        (self.logs / f"inproc-{name}.stderr").write_bytes(se[-200_000:])
        try:
            return json.loads(so.decode().strip().splitlines()[-1]), None
        except (IndexError, ValueError):
            err = se.decode(errors="replace").strip().splitlines()
            return None, " | ".join(err[-3:])[:600] or f"rc={proc.returncode}"

    # ---------------------------------------------- separate sections
    def section_argv(self, name: str) -> list[str]:
        """The child harness that measures section ``name``."""
        pin = ",".join("-" if c is None else str(c) for c in (self.client_cpu, self.server_cpu))
        return [sys.executable, "-m", "bench.run", "--only", name, "--out", str(self.out), "--no-markdown",
                "--pin", pin, *(["--quick"] if self.cfg.quick else [])]

    async def section(self, name: str) -> dict:
        """One of ``SECTIONS``, measured by a child harness (``section_argv``) that writes
        ``<out>/<name>_results.json``: its results, with the child's ``meta`` (its date and
        machine line, which a partial run's section shows), or ``{"unavailable": reason}`` alone
        (its own, or how the child ended without any). The child is in this process's group, so a
        terminal's Ctrl-C reaches it at once; a signal to this process alone, or the child's
        ``SECTION_TIMEOUT_S`` running out, is passed on to it, and if it has not ended
        ``SECTION_GRACE_S`` later it is killed together with every process under it (its servers
        run in sessions of their own, which killing the child alone would leave running)."""
        path = self.out / f"{name}_results.json"
        path.unlink(missing_ok=True)
        proc = await asyncio.create_subprocess_exec(*self.section_argv(name), cwd=str(ROOT),
                                                    stdin=asyncio.subprocess.DEVNULL)
        try:
            rc = await asyncio.wait_for(proc.wait(), SECTION_TIMEOUT_S)
        except asyncio.TimeoutError:
            rc = None
        finally:
            if proc.returncode is None:
                proc.send_signal(common.stopped_by() or signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(proc.wait()), SECTION_GRACE_S)
                except asyncio.TimeoutError:
                    kill_tree(proc.pid)
                    await proc.wait()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            why = f"no end in {SECTION_TIMEOUT_S:g} s" if rc is None else f"exited {rc} without results"
            data = {"unavailable": f"unavailable: the {name} harness {why} (see above)"}
            log(f"   {name}: {data['unavailable']}")
        if "unavailable" in data:
            data.pop("meta", None)
        return data

    # -------------------------------------------------- ours extras
    async def ours_extra(self) -> dict:
        res: dict = {}
        for key, coro in (
            ("concurrent_100_operates", lambda: ours_extras.concurrent_operates(
                self.spawn, n=self.cfg.ours_concurrent, delay_ms=200)),
            # the default maxConcurrentOperates (256) has room for all 100; the explicit 128-slot
            # variant is kept so runs before the default was raised stay comparable:
            ("concurrent_100_operates_128_slots", lambda: ours_extras.concurrent_operates(
                self.spawn, n=self.cfg.ours_concurrent, delay_ms=200,
                extra_settings={"maxConcurrentOperates": 128})),
            ("progress_deltas", lambda: ours_extras.progress_deltas(
                self.spawn, operates=self.cfg.ours_progress_runs)),
            ("memory_growth", lambda: ours_extras.memory_growth(
                self.spawn, total=self.cfg.ours_mem_total)),
            ("first_request", lambda: ours_extras.first_request(
                self.spawn, reps=self.cfg.ours_first_reps)),
        ):
            try:
                res[key] = await coro()
            except Exception as e:  # noqa: BLE001
                res[key] = {"unavailable": f"unavailable: {type(e).__name__}: {e}"[:800]}
            log(f"   ours {key}: {'ok' if 'unavailable' not in res[key] else res[key]['unavailable']}")
        return res


def _tail(p: Path, n: int = 3) -> str:
    try:
        lines = p.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return ("[stderr: " + " | ".join(lines[-n:])[:500] + "]") if lines else ""


def setup_peers(names: list[str]) -> dict[str, str]:
    """Ensure each peer venv; return {peer: error} for the ones that failed."""
    failed = {}
    for peer in names:
        try:
            venvs.ensure(peer, log=log)
        except Exception as e:  # noqa: BLE001
            failed[peer] = f"unavailable: venv setup failed: {e}"
    return failed


# ------------------------------------------------------------- ratios
TARGETS = [
    # key, description, numerator, denominator, op, target
    ("cold_ours_pygls", "cold start ours / pygls", ("cold", "ours"), ("cold", "pygls"), "<=", 1.1),
    ("cold_ours_mcp", "cold start ours / MCP", ("cold", "ours"), ("cold", "mcp"), "<=", 0.65),
    ("ping_ours_pygls", "ping p50 ours / pygls", ("light", "ours", "ping"), ("light", "pygls", "ping"), "<=", 0.5),
    ("list_ours_mcp", "listTools p50 ours / MCP tools/list", ("light", "ours", "listTools"),
     ("light", "mcp", "tools/list"), "<=", 0.4),
    ("tp_ours_pygls", "16-in-flight req/s ours / pygls", ("tp", "ours"), ("tp", "pygls"), ">=", 2.0),
    ("op_plain", "operate plain lionagi / ours", ("op", "lionagi", "plain"), ("op", "ours", "plain"), ">=", 5.0),
    ("op_rf", "operate response_format lionagi / ours", ("op", "lionagi", "response_format"),
     ("op", "ours", "response_format"), ">=", 5.0),
    ("op_actions", "operate +actions lionagi / ours", ("op", "lionagi", "actions"),
     ("op", "ours", "actions"), ">=", 10.0),
    ("op_actions_async", "operate +actions, async tool, lionagi / ours", ("op", "lionagi", "actions_async"),
     ("op", "ours", "actions_async"), ">=", 10.0),
    ("wire_plain", "operate plain: lionagi in-process / ours over the wire", ("op", "lionagi", "plain"),
     ("op", "ours_wire", "plain"), ">", 1.0),
    ("wire_rf", "operate response_format: lionagi in-process / ours over the wire",
     ("op", "lionagi", "response_format"), ("op", "ours_wire", "response_format"), ">", 1.0),
    ("wire_actions", "operate +actions: lionagi in-process / ours over the wire", ("op", "lionagi", "actions"),
     ("op", "ours_wire", "actions"), ">", 1.0),
    ("hist_inproc", "history: ours in-process p50 at 1,000 msgs / at 0", ("op", "ours", "history_1000"),
     ("op", "ours", "history_0"), "<=", 1.2),
    ("hist_wire", "history: ours over the wire p50 at 1,000 msgs / at 0", ("op", "ours_wire", "history_1000"),
     ("op", "ours_wire", "history_0"), "<=", 1.2),
    ("rss_ours_mcp", "idle RSS ours / MCP", ("rss", "ours"), ("rss", "mcp"), "<=", 0.8),
    ("rss_used_ours_mcp", "RSS after first use ours / MCP (not an issue target; the core loaded)",
     ("rss_used", "ours"), ("rss_used", "mcp"), "<=", 0.8),
    # absolute checks: (value, 1) pairs
    ("conc100", "100 concurrent operates (200 ms model): slowest answer / (1.5 × 200 ms + single-call "
     "overhead)", ("x", "conc100"), None, "<=", 1.0),
    ("conc100_128", "the same with settings.maxConcurrentOperates 128",
     ("x", "conc100_128"), None, "<=", 1.0),
    ("deltas", "`$/progress` deltas/s, in order (value = deltas/s)", ("x", "deltas"), None, ">=", 20000),
    ("branch_mem", "RSS added by a branch of 1,000 messages (MiB)", ("x", "branch_mem"), None, "<", 2.0),
    ("mem_growth", "RSS growth over the 10,000-operate run (1,000 with --quick) after its first 10% (MiB; "
     "branches deleted, so nothing is kept)",
     ("x", "mem_growth"), None, "<=", 1.0),
]


def _pick(results: dict, ref: tuple) -> float | None:
    kind, name, *rest = ref
    try:
        if kind == "cold":
            return results["cold_start"][name]["cold_start_s"]["median"]
        if kind == "rss":
            return results["cold_start"][name]["idle_rss_kib"]["median"]
        if kind == "rss_used":
            return results["cold_start"][name]["used_rss_kib"]["median"]
        if kind == "light":
            return results["sessions"][name]["light_s"][rest[0]]["median"]
        if kind == "tp":
            return results["sessions"][name]["throughput_rps"]["median"]
        if kind == "op":
            return results["inproc"][name]["operate_s"][rest[0]]["median"]
        if kind == "x":
            return _absolute(results, name)
    except (KeyError, TypeError):
        return None
    return None


def _absolute(results: dict, name: str) -> float | None:
    ex = results.get("ours_extra", {})
    if name in ("conc100", "conc100_128"):
        c = ex["concurrent_100_operates" + ("_128_slots" if name == "conc100_128" else "")]
        return c["latency_s"]["max"] * 1000 / (1.5 * c["delay_ms"] + c["single_call_overhead_ms"])
    if name == "deltas":
        p = ex["progress_deltas"]
        return p["deltas_per_s"]["median"] if p.get("in_order") else 0.0
    if name == "branch_mem":
        bm = [x for x in results["inproc"]["ours_wire"].get("branch_memory") or [] if x]
        return sorted(x["per_branch_kib"] for x in bm)[len(bm) // 2] / 1024 if bm else None
    if name == "mem_growth":
        return ex["memory_growth"]["growth_after_warmup_kib"] / 1024
    return None


_OPS = {"<=": lambda r, t: r <= t, ">=": lambda r, t: r >= t, "<": lambda r, t: r < t,
        ">": lambda r, t: r > t}


def compute_ratios(results: dict) -> list[dict]:
    out = []
    for key, desc, num, den, op, target in TARGETS:
        a = _pick(results, num)
        b = _pick(results, den) if den is not None else 1.0
        r = a / b if (a is not None and b) else None
        ok = None if r is None else _OPS[op](r, target)
        out.append({"key": key, "what": desc, "ratio": r, "target": f"{op} {target}", "met": ok})
    return out


# --------------------------------------------------------------- main
#: the servers' logs a run writes into ``<out>/logs`` (appended to, so cleared before a run)
LOG_NAMES = (*CONTENDERS, "inproc-ours", "inproc-lionagi", "acp-ours", "acp-sdk")
#: what an ``--out`` folder holds after a run: a folder holding any of these was one
OUT_MARKS = ("results.json", *(f"{s}_results.json" for s in SECTIONS), "logs")


def foreign_out(out: Path) -> bool:
    """``out`` is not ``bench/out`` and is a folder that holds something but nothing a run
    writes: someone's own folder, which the harness refuses to write into."""
    if out == OUT or not out.is_dir():
        return False
    return any(out.iterdir()) and not any((out / m).exists() for m in OUT_MARKS)


def prepare_out(out: Path) -> None:
    """Make ``out`` and ``out/logs``, and remove the servers' logs of an earlier run there, by
    name: in a folder named by ``--out`` nothing else is removed. ``bench/out`` also loses every
    ``logs/*.stderr`` and its ``work`` folder (the servers' working folder before each run had a
    temporary one of its own)."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in LOG_NAMES:
        (logs / f"{name}.stderr").unlink(missing_ok=True)
    if out == OUT:
        for f in logs.glob("*.stderr"):
            f.unlink()
        shutil.rmtree(out / "work", ignore_errors=True)


async def amain(ns: argparse.Namespace, only: set[str] | None, out: Path, work: Path,
                cpus: tuple[int | None, int | None]) -> dict:
    common.stop_by_cancelling(asyncio.current_task())  # type: ignore[arg-type]
    cfg = Config(ns.quick)
    prepare_out(out)
    all_cs = C.all_contenders()
    if only:
        all_cs = [c for c in all_cs if c.name in only]
    want_lionagi = only is None or "lionagi" in only
    failed = {} if ns.no_setup else setup_peers(
        sorted({c.setup for c in all_cs if c.setup} | ({"lionagi"} if want_lionagi else set())))
    for c in all_cs:
        if c.setup in failed:
            c.unavailable = failed[c.setup]
        elif c.setup and not venvs.python_of(c.setup).exists():
            c.unavailable = f"unavailable: no venv for {c.setup}"
    h = Harness(cfg, all_cs, out, work, cpus)
    started = _dt.datetime.now(_dt.timezone.utc)
    log(f">> pinning: client cpu {h.client_cpu}, servers cpu {h.server_cpu}")
    log(">> probing contenders")
    await h.probe()
    results: dict = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.run", *sys.argv[1:]]),
        "quick": cfg.quick,
        "only": sorted(only) if only else None,
        "config": {k: v for k, v in vars(cfg).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "client_cpu": h.client_cpu,
                    "server_cpu": h.server_cpu, "loadavg_start": os.getloadavg()},
        "versions": {p: venvs.version_of(p) for p in venvs.PEERS},
        "contenders": {c.name: {"label": c.label, "argv": c.argv, "framing": c.framing,
                                "unavailable": c.unavailable} for c in all_cs},
    }
    log(">> cold start + idle RSS (interleaved)")
    results["cold_start"] = await h.cold_start()
    log(">> light latency + 16-in-flight throughput (interleaved)")
    results["sessions"] = await h.sessions()
    if want_lionagi or "ours" in (only or ()):
        log(">> operate in-process (interleaved lionagi / ours)")
        lion_py = None if "lionagi" in failed or not want_lionagi else venvs.python_of("lionagi")
        results["inproc"] = await h.inproc(lion_py)
    ours = h.contenders.get("ours")
    if ours is not None and not ours.unavailable:
        log(">> operate-sidecar over the wire: 100 concurrent operates, $/progress, memory growth")
        results["ours_extra"] = await h.ours_extra()
    else:
        results["ours_extra"] = {"unavailable": ours.unavailable if ours else "not selected"}
    for name in SECTIONS:  # each child harness says what it measures, and why not if it cannot
        if only is None or name in only:
            results[name] = await h.section(name)
    results["ratios"] = compute_ratios(results)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds()
    return results


def section_meta(results: dict, name: str, full: bool) -> dict:
    """The date, command and machine line of section ``name``'s text: the run's command; after a
    full run, its date and "see the machine line above" (the main tables' line, written by the
    same run); after a partial run, which leaves the main tables as another run wrote them, the
    date and machine line the section's child harness recorded (every section measured has them:
    see ``Harness.section``)."""
    child = results[name]["meta"]
    return {"date": results["date"] if full else child["date"], "command": results["command"],
            "machine": "see the machine line above" if full else child["machine"]}


def write_results_md(results: dict, md_path: Path, full: bool, out: Path = OUT) -> None:
    """A full run: the main tables (with ``RESULTS_NOTES.md``) and every section measured. An
    ``--only`` run: only the separately written sections it measured; its main tables would
    show every contender left out as not measured. A section that was unavailable keeps the
    figures it had. ``out``: where the raw figures are (the main tables name it)."""
    if full:
        write_markdown(results, md_path, out)
    for name, mod in SECTIONS.items():
        if results.get(name) and "summary" in results[name]:
            mod.write_section(results[name], section_meta(results, name, full), md_path)
    what = "its tables and the sections measured" if full else \
        "the sections measured, if any (its main tables are written by a full run only)"
    log(f">> wrote {what} to {md_path} ({results['elapsed_s']:.0f} s)")


def _cpus(spec: str | None) -> tuple[int | None, int | None]:
    if not spec:
        return pick_cpus()
    client, server = (None if x == "-" else int(x) for x in spec.split(","))
    return client, server


def main(argv: list[str] | None = None) -> int:
    common.stop_by_raising()  # until the event loop takes over: no traceback, whenever it comes
    try:
        return _main(argv)
    except (KeyboardInterrupt, asyncio.CancelledError):
        if "--pin" not in (sys.argv[1:] if argv is None else argv):  # a section's child: its parent says it
            common.say_stopped()
        return common.exit_code()


def _main(argv: list[str] | None) -> int:
    known = (*CONTENDERS, *SECTIONS)
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (~3-4 min on a 2-core machine)")
    ap.add_argument("--only", help="comma list of contenders: stdlib,pygls,mcp,ours,lionagi; and/or sections: acp "
                                   "(the ACP front end against the ACP SDK's minimal example agent), store "
                                   "(the SQLite state store vs the JSONL journal it replaced), first (spawn → first "
                                   "createBranch, first vs warm operate), edit (edits, previews and rounds). "
                                   "Writes only the sections measured to RESULTS.md, never its main tables")
    ap.add_argument("--no-setup", action="store_true", help="do not create/install peer venvs")
    ap.add_argument("--no-markdown", action="store_true", help="do not rewrite RESULTS.md")
    ap.add_argument("--out", type=Path, default=OUT, help="folder for results.json, the sections' JSON and the "
                                                          "servers' logs (default bench/out): a new or empty "
                                                          "one, or one an earlier run wrote")
    ap.add_argument("--results-md", type=Path, default=RESULTS_MD, help="the markdown rewritten (default "
                                                                        "bench/RESULTS.md)")
    ap.add_argument("--pin", help=argparse.SUPPRESS)  # "CLIENT,SERVER" cpus, for a section's child harness
    ns = ap.parse_args(argv)
    only = {x.strip() for x in ns.only.split(",") if x.strip()} if ns.only is not None else None
    if only is not None:
        unknown = sorted(only - set(known))
        if unknown or not only:
            ap.error(f"--only: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    out, md_path = ns.out.resolve(), ns.results_md.resolve()
    if foreign_out(out):
        ap.error(f"--out {ns.out}: a folder with files of its own and no results of an earlier run; "
                 "name a new or empty folder, or one an earlier run wrote")
    cpus = _cpus(ns.pin)
    command = " ".join(["python -m bench.run", *sys.argv[1:]])
    if only is not None and len(only) == 1 and next(iter(only)) in SECTIONS:  # a section alone
        mod = SECTIONS[next(iter(only))]
        if cpus[0] is not None:
            os.sched_setaffinity(0, {cpus[0]})
        return mod.run_alone(ns.quick, cpus[1], command, markdown=not ns.no_markdown, out=out, md_path=md_path)
    work = Path(tempfile.mkdtemp(prefix="bench-work-"))
    try:
        results = asyncio.run(amain(ns, only, out, work, cpus))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    log(f">> wrote {out / 'results.json'}")
    if not ns.no_markdown:
        write_results_md(results, md_path, full=only is None, out=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
