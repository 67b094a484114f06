"""Fixtures: spawn the real server (see support.py); every process is reaped."""

from __future__ import annotations

import subprocess

import pytest

from .support import Sidecar


@pytest.fixture
def spawn(tmp_path):
    started: list[Sidecar] = []

    def make(*args: str, **kw) -> Sidecar:
        kw.setdefault("record", str(tmp_path / f"record-{len(started)}.jsonl"))
        c = Sidecar(*args, **kw)
        started.append(c)
        return c

    yield make
    for c in started:
        if c.proc.poll() is None:
            c.kill()
        try:
            c.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        c._close_pipes()


@pytest.fixture
def sidecar(spawn) -> Sidecar:
    return spawn()
