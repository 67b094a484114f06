"""Fixtures: spawn the real server (see support.py); every process is reaped."""

from __future__ import annotations

import pytest

from .support import Sidecar, spawner


@pytest.fixture
def spawn():
    with spawner(lambda _i, *args, **kw: Sidecar(*args, **kw)) as make:
        yield make


@pytest.fixture
def sidecar(spawn) -> Sidecar:
    return spawn()
