"""ACP front end (``operate-sidecar --acp``, instant scripted model) against the ACP SDK's
minimal example agent (``peers/acp_echo_agent.py``), measured interleaved in one run with
the SDK's own client side: spawn → ``initialize`` answer, spawn → ``session/new`` answer,
the first prompt round trip and warm ones (prompt sent → ``end_turn`` received, with its
``agent_message_chunk`` delivered). Run alone with ``python -m bench.run --only acp``; a
full ``make bench`` runs it too. Its section of ``RESULTS.md`` sits between markers, so the
other sections are left as they are when it runs alone."""
from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common
from .report import replace_section
from .stats import ratio, summary

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"
BEGIN, END = "<!-- acp-bench:begin -->", "<!-- acp-bench:end -->"
TARGET_NEW_MS = 500.0
#: the bound on each process's ``initialize`` answer: both agents answer within 0.1-1.5 s on this
#: machine, and a program that does not speak ACP (``bench/peers/fake_sidecar.py``, which waits for
#: Content-Length frames) has answered nothing by then, so the section is unavailable at once
INIT_TIMEOUT_S = 10.0


def _log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def _config(path: Path, n: int) -> str:
    replies = ", ".join(['{"json" = {"message" = "hello"}}'] * n)
    path.write_text(f'defaultModel = "instant"\n[models.instant]\nprovider = "scripted"\nresponses = [{replies}]\n')
    return str(path)


async def _session(argv: list[str], cwd: str, warm_n: int, log_path: Path) -> dict[str, Any]:
    import acp

    class Quiet(acp.Client):
        def __init__(self) -> None:
            self.chunks = 0

        async def session_update(self, session_id: str, update: Any, **kw: Any) -> None:
            if update.session_update == "agent_message_chunk":
                self.chunks += 1

    client = Quiet()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log_path, "ab") as err:
        t0 = time.perf_counter()
        async with acp.spawn_agent_process(client, argv[0], *argv[1:], env=env, cwd=cwd,
                                           transport_kwargs={"stderr": err}) as (conn, proc):
            try:
                await asyncio.wait_for(conn.initialize(protocol_version=acp.PROTOCOL_VERSION), INIT_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{log_path.stem.removeprefix('acp-')}: no initialize answer in "
                                   f"{INIT_TIMEOUT_S:g} s (does it speak ACP?)") from None
            t_init = time.perf_counter()
            sid = (await asyncio.wait_for(conn.new_session(cwd=cwd), 60)).session_id
            t_new = time.perf_counter()
            prompts = []
            for i in range(1 + warm_n):
                before = client.chunks
                t = time.perf_counter()
                r = await asyncio.wait_for(conn.prompt(session_id=sid, prompt=[acp.text_block("hello")]), 60)
                prompts.append((time.perf_counter() - t) * 1000)
                if r.stop_reason != "end_turn" or client.chunks <= before:
                    raise RuntimeError(f"prompt {i}: {r.stop_reason}, no text" if client.chunks <= before
                                       else f"prompt {i}: {r.stop_reason}")
            if proc.stdin is not None:
                proc.stdin.close()
            await asyncio.wait_for(proc.wait(), 10)
    return {"init": (t_init - t0) * 1000, "new": (t_new - t0) * 1000, "first": prompts[0], "warm": prompts[1:]}


#: then a few prompts from the plain client, each after this much idle time: what a prompt costs
#: when it does not follow another at once (a user types between turns); a reference, no target
IDLE_PROMPTS, IDLE_GAP_S = 3, 0.1


def _raw_session(argv: list[str], cwd: str, warm_n: int, log_path: Path, started: list) -> dict[str, Any]:
    """The same session from a plain newline-delimited JSON client (blocking pipes, no SDK, as
    an editor written in another language would be): the first prompt against warm ones with
    no client-side first use in them, so what is left is the agent's own. It runs on a worker
    thread: its process goes into ``started``, so that the caller can kill it when it is
    cancelled (the blocking reads then end)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log_path, "ab") as err:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=cwd, env=env)
        started.append(p)
        try:
            assert p.stdin is not None and p.stdout is not None
            ids = iter(range(1, 1 << 30))

            def call(method: str, params: dict[str, Any]) -> tuple[dict[str, Any], int]:
                msg_id = next(ids)
                p.stdin.write((json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method,  # type: ignore[union-attr]
                                           "params": params}) + "\n").encode())
                p.stdin.flush()  # type: ignore[union-attr]
                chunks = 0
                while True:
                    line = p.stdout.readline()  # type: ignore[union-attr]
                    if not line:
                        raise RuntimeError(f"{argv[0]} closed its output during {method}")
                    m = json.loads(line)
                    if m.get("method") == "session/update" and \
                            m["params"]["update"].get("sessionUpdate") == "agent_message_chunk":
                        chunks += 1
                    if m.get("id") == msg_id and "method" not in m:
                        if "error" in m:
                            raise RuntimeError(f"{method}: {m['error']}")
                        return m["result"], chunks

            call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            sid = call("session/new", {"cwd": cwd, "mcpServers": []})[0]["sessionId"]
            prompts = []
            for i in range(1 + warm_n):
                t = time.perf_counter()
                r, chunks = call("session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "hello"}]})
                prompts.append((time.perf_counter() - t) * 1000)
                if r.get("stopReason") != "end_turn" or not chunks:
                    raise RuntimeError(f"raw prompt {i}: {r}, {chunks} chunks")
            idle = []
            for _ in range(IDLE_PROMPTS):
                time.sleep(IDLE_GAP_S)
                t = time.perf_counter()
                call("session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "hello"}]})
                idle.append((time.perf_counter() - t) * 1000)
            p.stdin.close()
            p.wait(timeout=10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return {"first": prompts[0], "warm": prompts[1:], "idle": idle}


async def measure(reps: int, warm_n: int, server_cpu: int | None, out_dir: Path) -> dict[str, Any]:
    """Raises when a session fails (the caller records the section as unavailable); its
    temporary folder is removed and its processes ended whatever happens."""
    ours = common.ours_argv()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="acp-bench-"))
    started: list = []
    try:
        contenders = {
            "ours": common.pinned([*ours, "--acp", "--config", _config(work / "instant.toml",
                                                                         warm_n + IDLE_PROMPTS + 5)], server_cpu),
            "sdk": common.pinned([str(VENV_PY), str(BENCH / "peers" / "acp_echo_agent.py")], server_cpu),
        }
        raw: dict[str, dict[str, list[float]]] = {n: {"init": [], "new": [], "first": [], "warm": [],
                                                      "raw_first": [], "raw_warm": [], "raw_idle": []}
                                                  for n in contenders}
        names = list(contenders)
        for rep in range(reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:  # interleaved, order rotated per repetition
                log_path = out_dir / "logs" / f"acp-{name}.stderr"
                s = await _session(contenders[name], str(work), warm_n, log_path)
                for key in ("init", "new", "first"):
                    raw[name][key].append(s[key])
                raw[name]["warm"].extend(s["warm"])
                r = await asyncio.to_thread(_raw_session, contenders[name], str(work), warm_n, log_path, started)
                raw[name]["raw_first"].append(r["first"])
                raw[name]["raw_warm"].extend(r["warm"])
                raw[name]["raw_idle"].extend(r["idle"])
    finally:
        for p in started:  # cancelled while a plain client's session ran on its thread
            if p.poll() is None:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    res: dict[str, Any] = {"reps": reps, "warm_per_rep": warm_n, "ours": common.ours_label(),
                           "summary": {n: {k: summary(v) for k, v in m.items()} for n, m in raw.items()}}
    med = {n: {k: (v or {}).get("median") for k, v in m.items()} for n, m in res["summary"].items()}
    res["ratios"] = [
        {"what": "cold start (spawn → initialize answer) ours / SDK example", "ratio": ratio(med["ours"]["init"],
                                                                                               med["sdk"]["init"]),
         "target": "<= 1.0"},
        {"what": "prompt round trip, warm, p50 ours / SDK example", "ratio": ratio(med["ours"]["warm"],
                                                                                   med["sdk"]["warm"]),
         "target": "<= 1.0"},
        {"what": "first prompt after session/new / warm prompt (ours)", "ratio": ratio(med["ours"]["first"],
                                                                                      med["ours"]["warm"]),
         "target": "<= 1.0"},
        {"what": "spawn → session/new answered, ours (ms, absolute)", "ratio": med["ours"]["new"],
         "target": f"<= {TARGET_NEW_MS:g}"},
        {"what": "(reference, no target) first prompt / warm prompt, SDK example: the client side's and the "
                 "SDK's own first-use cost", "ratio": ratio(med["sdk"]["first"], med["sdk"]["warm"]), "target": None},
        {"what": "(reference, no target) first prompt / warm prompt from a plain JSON client (no client-side "
                 "first use), ours", "ratio": ratio(med["ours"]["raw_first"], med["ours"]["raw_warm"]), "target": None},
        {"what": "(reference, no target) the same, SDK example", "ratio": ratio(med["sdk"]["raw_first"],
                                                                                 med["sdk"]["raw_warm"]), "target": None},
        {"what": "(reference, no target) warm prompt from a plain JSON client, ours / SDK example",
         "ratio": ratio(med["ours"]["raw_warm"], med["sdk"]["raw_warm"]), "target": None},
        {"what": f"(reference, no target) first prompt / a prompt after {IDLE_GAP_S * 1000:g} ms idle, plain JSON "
                 "client, ours", "ratio": ratio(med["ours"]["raw_first"], med["ours"]["raw_idle"]), "target": None},
        {"what": f"(reference, no target) a prompt after {IDLE_GAP_S * 1000:g} ms idle, plain JSON client, ours / "
                 "SDK example", "ratio": ratio(med["ours"]["raw_idle"], med["sdk"]["raw_idle"]), "target": None},
        {"what": "(reference, no target) spawn → session/new, ours / SDK example", "ratio": ratio(
            med["ours"]["new"], med["sdk"]["new"]), "target": None},
    ]
    for r in res["ratios"]:
        if r["target"] is None:
            r["met"] = None
            continue
        limit = float(r["target"].split()[-1])
        r["met"] = None if r["ratio"] is None else r["ratio"] <= limit
    return res


def section(res: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [BEGIN, "## Agent Client Protocol front end (`--acp`) vs the ACP SDK's minimal example agent", "",
             f"- date: {meta['date']}; command: `{meta['command']}`; {meta['machine']}{common.override_note(res)}",
             f"- {res['reps']} fresh processes per contender, interleaved (order rotated per repetition); "
             f"per process: initialize, session/new, one first prompt, then {res['warm_per_rep']} warm prompts. "
             "Client: the SDK's own client side (`acp.spawn_agent_process`); then the same session from a plain "
             "newline-delimited JSON client on blocking pipes (no SDK: the client's own first use out of the "
             "measure, as for an editor written in another language). Ours: the scripted instant model "
             "(one structured reply per prompt, parsed, recorded on the branch); the SDK example "
             "(`peers/acp_echo_agent.py`) echoes the prompt as one chunk.", "",
             "| ratio | value | target | met |", "|---|---|---|---|"]
    for r in res["ratios"]:
        v = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        met = "" if r["target"] is None else ("yes" if r["met"] else "NO")
        lines.append(f"| {r['what']} | {v} | {r['target'] or ''} | {met} |")
    lines += ["", "Reading the targets: the SDK example answers a prompt with one echo chunk and does nothing "
              "else; ours runs a whole operate per prompt (render, the model call, the structured parse, the "
              "branch record, the tool-event and progress plumbing), so its warm round trip is the example's plus "
              "that work. Ours imports the SDK with its models built on first use and without reading their "
              "attribute docstrings (`server/acp/run.py` `import_sdk`), which is why its `initialize` answer "
              "comes sooner than the example's. The core then loads on a worker thread, and before "
              "`session/new` is answered a throwaway agent is served by the SDK's own connection over a pipe "
              "pair and sent prompt turns by the SDK's client on the same event loop (`agent.warm_up`), and the "
              "session is primed (`Service.prime`), so that the first prompt runs warm code. What is left of the "
              "first prompt's extra cost is the client's and the SDK's own first use (the example's ratio, with "
              "the SDK client) and cold caches, which the example shows too (its ratio with the plain client). "
              "The warm figure is a prompt sent the moment the previous one is answered: a prompt after "
              f"{IDLE_GAP_S * 1000:g} ms of idle time (the plain client, {IDLE_PROMPTS} per process) costs more "
              "than the first one, for both agents, as an editor's turns come seconds apart.",
              "", "| contender | measure (ms) | median | min..max | p99 | n |", "|---|---|---|---|---|---|"]
    labels = {"init": "spawn → initialize answer", "new": "spawn → session/new answer",
              "first": "first prompt round trip", "warm": "warm prompt round trip",
              "raw_first": "first prompt round trip, plain JSON client", "raw_warm": "warm prompt round trip, plain "
                                                                                    "JSON client",
              "raw_idle": f"prompt round trip after {IDLE_GAP_S * 1000:g} ms idle, plain JSON client"}
    for name, label in (("ours", "operate-sidecar --acp"), ("sdk", "SDK minimal example agent")):
        for key, what in labels.items():
            s = res["summary"][name][key]
            if s:
                lines.append(f"| {label} | {what} | {s['median']:.1f} | {s['min']:.1f}..{s['max']:.1f} | "
                             f"{s['p99']:.1f} | {s['n']} |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(res: dict[str, Any] | None, meta: dict[str, Any], path: Path = BENCH / "RESULTS.md") -> None:
    """Replace (or append) this benchmark's section of RESULTS.md."""
    if res and "summary" in res:
        replace_section(path, BEGIN, END, section(res, meta))


def meta_now(command: str, server_cpu: int | None) -> dict[str, Any]:
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, servers pinned to CPU "
                       f"{server_cpu}, load average at start {'/'.join(f'{x:.2f}' for x in os.getloadavg())}"}


def run_alone(quick: bool, server_cpu: int | None, command: str, markdown: bool = True,
              out: Path = BENCH / "out", md_path: Path = BENCH / "RESULTS.md") -> int:
    """Measure, write ``<out>/acp_results.json`` and (``markdown``) the section; 1 when unavailable.
    SIGINT / SIGTERM cancel the measure (its cleanup runs), then ``asyncio.CancelledError`` rises."""
    meta = meta_now(command, server_cpu)
    reps, warm = (5, 10) if quick else (20, 20)
    _log(f">> ACP: ours vs the SDK's minimal example agent, {reps} interleaved processes each")

    async def go() -> dict[str, Any]:
        common.stop_by_cancelling(asyncio.current_task())  # type: ignore[arg-type]
        return await measure(reps, warm, server_cpu, out)

    res = common.attempt(lambda: asyncio.run(go()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "acp_results.json").write_text(json.dumps({"meta": meta, **res}, indent=1, default=str))
    if "unavailable" in res:
        _log(f"   ACP: {res['unavailable']}")
        return 1
    for r in res["ratios"]:
        _log(f"   {r['what']}: {r['ratio']:.2f} (target {r['target']})" if r["ratio"] is not None else str(r))
    if markdown:
        write_section(res, meta, md_path)
        _log(f">> wrote the ACP section of {md_path}")
    return 0
