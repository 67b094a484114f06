"""Fixtures: spawn the real server (see support.py)."""

from __future__ import annotations

import subprocess

import pytest

from .support import Sidecar


@pytest.fixture
def spawn():
    started: list[Sidecar] = []

    def make(*args: str) -> Sidecar:
        c = Sidecar(*args)
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
