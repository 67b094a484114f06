"""Fixtures: spawn the real server (see support.py); every process is reaped. Each server's
fixture tools record their invocations in a file of its own under the test's tmp_path."""

from __future__ import annotations

import pytest

from rpc.support import spawner  # tests/ is on sys.path

from .support import Sidecar


@pytest.fixture
def spawn(tmp_path):
    def build(i: int, *args: str, **kw) -> Sidecar:
        kw.setdefault("record", str(tmp_path / f"record-{i}.jsonl"))
        return Sidecar(*args, **kw)

    with spawner(build) as make:
        yield make


@pytest.fixture
def sidecar(spawn) -> Sidecar:
    return spawn()
