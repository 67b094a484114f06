"""Per-peer virtual environments under bench/.venvs/ (git-ignored).

Each peer gets its own venv with pinned packages, created on first use.  A
stamp file records the exact requirement list so a changed pin rebuilds it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
VENVS = BENCH / ".venvs"

# peer name -> pip requirements.  "mcp" is deliberately unpinned ("latest from
# PyPI", per the issue); the resolved version is recorded in results.json.
PEERS: dict[str, list[str]] = {
    "pygls": ["pygls==2.1.1"],
    "mcp": ["mcp"],
    "lionagi": ["lionagi==0.36.0"],
}

# Import name whose version is reported for each peer.
DIST = {"pygls": "pygls", "mcp": "mcp", "lionagi": "lionagi"}


def python_of(peer: str) -> Path:
    return VENVS / peer / "bin" / "python"


def ensure(peer: str, log=print) -> Path:
    """Create bench/.venvs/<peer> and install its pins if missing; return its python."""
    reqs = PEERS[peer]
    venv = VENVS / peer
    py = python_of(peer)
    stamp = venv / ".bench-stamp"
    want = json.dumps(reqs)
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py
    base = os.environ.get("BENCH_BASE_PYTHON", "python3")
    if not py.exists():
        log(f">> creating {venv.relative_to(BENCH.parent)}")
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    log(f">> pip install {' '.join(reqs)} into {venv.relative_to(BENCH.parent)}")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *reqs], check=True)
    stamp.write_text(want)
    return py


def version_of(peer: str) -> str | None:
    py = python_of(peer)
    if not py.exists():
        return None
    out = subprocess.run(
        [str(py), "-c", f"import importlib.metadata as m; print(m.version({DIST[peer]!r}))"],
        capture_output=True, text=True,
    )
    return out.stdout.strip() or None


if __name__ == "__main__":
    for name in sys.argv[1:] or list(PEERS):
        ensure(name)
        print(name, version_of(name))
