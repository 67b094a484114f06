from pathlib import Path

import pytest

# The test files that take longest, longest first (220 s down to 34 s of a 1,800 s suite, summed over
# the processes, `--durations=0` of a `make test`). `make test` runs the files in three processes
# (pytest-xdist, --dist loadfile), handing out whole files in collection order: started first,
# these cannot leave one process working alone at the end while the others idle. The order
# of the tests inside a file is unchanged, and so is every other file's place.
LONGEST_FIRST = [
    "clients/test_nvim.py",
    "clients/test_vscode.py",
    "acp/test_acp.py",
    "models/test_models_local.py",
    "plugin/test_pytest_plugin.py",
    "tools/test_mcp_list_changed.py",
    "acp/test_acplint.py",
    "clients/test_typescript.py",
    "script/test_replay_fidelity.py",
    "test_bench_harness.py",
    "script/test_record.py",
]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    rank = {(here / name).resolve(): i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).resolve(), len(rank)))


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _secrets_a_test_registers_stay_with_it():
    """The server's registry of secrets (``server.redaction``) is one per process: a test that
    registers one in pytest's own process (a unit test of the masking) would change what later
    tests in that process see (a stream's text held back while it could be the start of a
    secret, its chunks cut elsewhere). Each test leaves the registry as it found it."""
    from operate_sidecar.server import redaction

    known, ordered = set(redaction._KNOWN), redaction._ORDERED
    yield
    redaction._KNOWN.clear()
    redaction._KNOWN.update(known)
    redaction._ORDERED = ordered


class _Unrun:
    """Under pytest-xdist, in the controlling process: how many of the tests collected never
    reported, said at the end. `make test` runs with ``--max-worker-restart=0``, because
    pytest-xdist 3.8 with ``--dist loadfile`` waits for ever once a crashed worker is replaced
    (https://github.com/pytest-dev/pytest-xdist/issues/784); without a replacement the run ends
    at once, failing on the crash, but the files the crashed worker had been handed are not run
    by any other, and nothing else would say so. An interrupted run (``TEST_TIMEOUT``) has its
    count said the same way."""

    collected: int | None = None
    reported: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _Unrun.collected = len(ids)  # every worker collects the same tests


def pytest_runtest_logreport(report):
    _Unrun.reported.add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _Unrun.collected is None:
        return
    unrun = _Unrun.collected - len(_Unrun.reported)
    if unrun > 0:
        terminalreporter.write_line(
            f"{unrun} of the {_Unrun.collected} tests collected did not run: a worker crashed (its files "
            "were not handed to another: see 'crashed while running' above) or the run was interrupted",
            red=True, bold=True)
