"""The restored branches are built by one task of the service, however many requests wait for
them: each loop pass builds one slice (not one per waiting request), the collector is turned off
once, a request cancelled meanwhile leaves the build going, and a caller that cannot await
(``Service.branch``) finishes the build under way rather than reading the whole store again.
Every request sees none or all of the branches. Driven in-process on a real store, a slice made
one branch long (``RESTORE_SLICE_S`` = 0) so that the build takes many loop passes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Any

import pytest

import operate_sidecar.server.state as state_pkg
from operate_sidecar.server.core import Branch
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service import service as service_module
from operate_sidecar.server.service.service import Service
from operate_sidecar.server.state import StateStore

WAIT = 60  # seconds: every wait here is bounded
N = 60  # stored branches
WAITERS = 8


class Port:
    """No client behind it: what is logged is kept."""

    def __init__(self, settings: dict) -> None:
        self.conn = self
        self.settings = settings
        self.client_capabilities: dict = {}
        self.workspace_folders: list[str] = []
        self.logged: list[str] = []

    def log_message(self, type_: int, message: str) -> None:
        self.logged.append(message)

    def notify(self, method: str, params: Any) -> None:
        pass

    async def request_client(self, method: str, params: Any, timeout: float | None) -> Any:
        raise RuntimeError("no client")


@pytest.fixture(autouse=True)
def _unfrozen():
    """The restore freezes what is alive once built (``gc.freeze``): not for the next tests."""
    frozen = gc.get_freeze_count()
    yield
    if gc.get_freeze_count() != frozen:
        gc.unfreeze()


@pytest.fixture
def settings(tmp_path, monkeypatch) -> dict:
    state = str(tmp_path / "state")
    store = StateStore(state)
    for i in range(N):
        b = Branch(system="sys", name=f"b{i}")
        store.attach(b, {"name": f"b{i}", "createdAt": i})
        b.messages.add("instruction", {"instruction": f"q{i}"})
    store.flush()
    store.close()
    monkeypatch.setattr(service_module, "RESTORE_SLICE_S", 0.0)  # a slice builds one branch
    return S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted", "responses": []}},
                                           "defaultModel": "s", "stateDir": state}))


async def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0)


def test_one_task_builds_the_branches_however_many_requests_wait(settings, monkeypatch):
    entered: list[int] = []
    no_collection = state_pkg.no_collection

    @contextlib.contextmanager
    def counted():
        entered.append(1)
        with no_collection():
            yield

    monkeypatch.setattr(state_pkg, "no_collection", counted)
    enabled = gc.isenabled()

    async def main() -> None:
        svc = Service(Port(settings))
        per_pass: list[int] = []
        stop = asyncio.Event()

        async def watch() -> None:  # one turn per loop pass: how many branches each pass built
            last = len(svc.branches)
            while not stop.is_set():
                await asyncio.sleep(0)
                per_pass.append(len(svc.branches) - last)
                last = len(svc.branches)

        watcher = asyncio.ensure_future(watch())
        answers = await asyncio.wait_for(asyncio.gather(*(svc.listBranches({}) for _ in range(WAITERS))), WAIT)
        stop.set()
        await watcher
        assert [len(a["branches"]) for a in answers] == [N] * WAITERS  # all of them, for every request
        assert sum(per_pass) == N
        # one slice per loop pass, not one per waiting request (which held the loop WAITERS times longer)
        assert max(per_pass) == 1, per_pass
        assert len(entered) == 1, entered  # the collector turned off once, not once per request
        assert gc.isenabled() == enabled  # and back on
        await svc.aclose()

    asyncio.run(main())


def test_a_request_cancelled_during_the_build_leaves_it_going(settings):
    async def main() -> None:
        svc = Service(Port(settings))
        request = asyncio.ensure_future(svc.listBranches({}))
        await _until(lambda: svc.branches, "the build to begin")
        assert len(svc.branches) < N
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        # no request waits any more: the service's own task builds the rest
        await _until(lambda: len(svc.branches) == N, "the build to end with no request waiting")
        assert len((await asyncio.wait_for(svc.listBranches({}), WAIT))["branches"]) == N
        await svc.aclose()

    asyncio.run(main())


def test_a_caller_that_cannot_await_finishes_the_build_under_way_without_reading_again(settings):
    async def main() -> None:
        svc = Service(Port(settings))
        opened: list[str] = []

        def open_state(state_dir: str, *rest: Any) -> Any:
            opened.append(state_dir)
            return Service._open_state(state_dir, *rest)

        svc._open_state = open_state
        request = asyncio.ensure_future(svc.listBranches({}))
        await _until(lambda: svc.branches, "the build to begin")
        assert len(svc.branches) < N
        last = f"b{N - 1}"
        [bid] = [lb.id for lb in svc._opened[1] if lb.meta.get("name") == last]  # not built yet
        assert svc.branch(bid).name == last  # synchronous: the rest is built now
        assert len(svc.branches) == N
        assert opened == [settings["stateDir"]]  # the store was read once, by the background restore
        assert len((await asyncio.wait_for(request, WAIT))["branches"]) == N
        await svc.aclose()

    asyncio.run(main())
