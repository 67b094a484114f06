import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fixture_modules(monkeypatch):
    """Make tests/tools/fixtures importable; forget the modules imported from it afterwards."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    before = set(sys.modules)
    yield FIXTURES
    for name in set(sys.modules) - before:
        mod = sys.modules.get(name)
        if str(getattr(mod, "__file__", "") or "").startswith(str(FIXTURES)):
            del sys.modules[name]


@pytest.fixture
def sidecar():
    """The real server over real pipes (tests/rpc/support.py); reaped afterwards."""
    from rpc.support import Sidecar, spawner  # tests/ is on sys.path

    with spawner(lambda _i, *args, **kw: Sidecar(*args, **kw)) as make:
        yield make()


@pytest.fixture
def make():
    """Real servers over real pipes with this folder's fixtures importable (their tool modules and
    MCP servers); each reaped afterwards."""
    from rpc.support import Sidecar, spawner  # tests/ is on sys.path

    with spawner(lambda _i, *args, **kw: Sidecar(*args, paths=(FIXTURES,), **kw)) as make:
        yield make
