from pathlib import Path

import pytest

# The test files that take longest, longest first (390 s down to 55 s of a 2,100 s suite). `make test` runs the files in two processes
# (pytest-xdist, --dist loadfile), handing out whole files in collection order: started first,
# these cannot leave one process working alone at the end while the other idles. The order
# of the tests inside a file is unchanged, and so is every other file's place.
LONGEST_FIRST = [
    "models/test_models_local.py",
    "clients/test_vscode.py",
    "acp/test_acp.py",
    "clients/test_nvim.py",
    "plugin/test_pytest_plugin.py",
    "script/test_record.py",
    "models/test_models_openai.py",
    "script/test_replay.py",
    "acp/test_acplint.py",
    "clients/test_typescript.py",
]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    rank = {(here / name).resolve(): i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).resolve(), len(rank)))


@pytest.fixture
def anyio_backend():
    return "asyncio"
