"""The native front end's warm-up (server/rpc/warm.py): once the core is loaded, and before
the requests that waited for it are served, plain ``operate`` calls run through a throwaway
connection (the same reader, parser, pygls dispatch, serialization and ``Wire``, over two pipes
of its own) with its own service, so that
the first real operate costs what a warm one does; nothing of it reaches the client, and a
warm-up that fails holds nothing up. A real connection in a child process (the core load and
the interpreter's warmed code are process-wide); the client's output is captured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import call_count

from .support import server_env

SCRIPT = r'''
import asyncio, functools, json, sys
from operate_sidecar.server.rpc import transport, warm
from operate_sidecar.server.rpc.framing import encode_frame
from operate_sidecar.server.service import service
from operate_sidecar.server.tools import builtin

FAIL = sys.argv[1] == "fail"
events = []
real_warm_up, real_operate = warm.warm_up, service.Service.operate


async def warm_up(*args, **kw):
    events.append(["warm-up", list(kw.get("shapes", args[1] if len(args) > 1 else warm.FIRST))])
    if FAIL:
        raise RuntimeError("the warm-up broke")
    await real_warm_up(*args, **kw)
    events.append(["warmed"])


async def operate(self, params, **kw):
    events.append(["operate", params["instruction"]])
    return await real_operate(self, params, **kw)


real_list_dir = builtin.WorkspaceTools.list_dir


@functools.wraps(real_list_dir)
def list_dir(self, *args, **kw):
    events.append(["tool", "list_dir"])
    return real_list_dir(self, *args, **kw)


warm.warm_up, service.Service.operate, builtin.WorkspaceTools.list_dir = warm_up, operate, list_dir


class Client:
    closed, on_broken, tap = False, None, None

    def send_bytes(self, body):
        events.append(["sent", json.loads(body)])


async def main():
    conn = transport.Connection(Client(), version="t", base_settings={
        "models": {"s": {"provider": "scripted", "responses": ["one"]}}, "defaultModel": "s"})
    loop = asyncio.get_running_loop()
    conn.on_initialized.append(lambda c: c.start_app_loader(loop))

    def send(msg_id, method, params):
        conn.feed(encode_frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method,
                                           "params": params}).encode()))

    async def answer(msg_id):
        while not any(e[0] == "sent" and e[1].get("id") == msg_id for e in events):
            await asyncio.sleep(0.01)

    send(1, "initialize", {})
    send(2, "createBranch", {"name": "real"})
    await asyncio.wait_for(answer(2), 60)
    branch = next(e[1]["result"]["branchId"] for e in events if e[0] == "sent" and e[1].get("id") == 2)
    send(3, "operate", {"branchId": branch, "instruction": "real"})
    await asyncio.wait_for(answer(3), 60)
    if not FAIL:  # the other shapes, in the background a little later
        from operate_sidecar.server.rpc.server import WARM_DELAY_S

        async def later_done():
            while events.count(["warmed"]) < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(later_done(), WARM_DELAY_S + 60)
    await conn.aclose()
    print(json.dumps(events + [["loaded", sorted(m for m in ("rapidfuzz",) if m in sys.modules)]]))


asyncio.run(main())
'''


def _run(mode: str) -> tuple[list, list]:
    """The events, and which of the modules the child checks for it had loaded at the end."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         env=server_env())
    assert out.returncode == 0, out.stderr[-3000:]
    *events, (_, loaded) = json.loads(out.stdout.strip().splitlines()[-1])
    return events, loaded


def _answers(events: list) -> list:
    return [e[1] for e in events if e[0] == "sent"]


def test_plain_operates_are_warmed_before_the_waiting_create_branch_is_answered_and_the_rest_later():
    from operate_sidecar.server.rpc.warm import FIRST, LATER_CYCLES, WARM_CYCLES

    events, loaded = _run("ok")
    start = events.index(["warm-up", list(FIRST)])
    done = events.index(["warmed"])
    during = events[start + 1:done]
    assert during == [["operate", "warm"]] * WARM_CYCLES  # the throwaway's operates, and nothing sent
    answers = _answers(events)
    assert [a["id"] for a in answers] == [1, 2, 3]  # initialize, then createBranch once warmed, operate
    assert events.index(["sent", answers[1]]) > done
    assert answers[2]["result"]["result"] == "one"
    assert events[events.index(["sent", answers[1]]):].count(["operate", "real"]) == 1
    assert not any(isinstance(a.get("method"), str) for a in answers)  # no notification of the warm-up
    # later (half a second after createBranch is served), the other shapes: one operate of each
    # per cycle, each answered (else no "warmed"), and nothing sent to the client meanwhile but
    # the real operate's answer, should a slow machine still be serving it
    after = events[events.index(["warm-up", ["format", "tools"]]) + 1:]
    assert [e for e in after if e[0] == "operate" and e[1] == "warm"] == [["operate", "warm"]] * (2 * LATER_CYCLES)
    assert after[-1] == ["warmed"]
    assert [e for e in after if e[0] == "sent" and e[1].get("id") != 3] == []
    # the tool shape runs its tool round each cycle, and its replies keep to the keys of the
    # request model an ``actions`` operate asks for: the fuzzy key matcher (rapidfuzz, several
    # MiB that a model keeping to the schema never needs) is not loaded by the warm-up
    assert after.count(["tool", "list_dir"]) == LATER_CYCLES
    assert loaded == []


def test_a_failed_warm_up_holds_nothing_up():
    events, _ = _run("fail")
    assert ["warm-up", ["plain"]] in events and ["warmed"] not in events
    answers = _answers(events)
    assert [a["id"] for a in answers] == [1, 2, 3] and all("result" in a for a in answers)
    assert answers[2]["result"]["result"] == "one"


CALLS = r'''
import asyncio, json
from call_count import counted
from operate_sidecar.server.rpc import transport, warm
from operate_sidecar.server.rpc.framing import encode_frame
from operate_sidecar.server.rpc.server import WARM_DELAY_S

waiting, warming = {}, [0, 0]  # warm-ups started, ended
real_warm_up = warm.warm_up


async def warm_up(*args, **kw):
    warming[0] += 1
    try:
        await real_warm_up(*args, **kw)
    finally:
        warming[1] += 1


warm.warm_up = warm_up


class Client:
    closed, on_broken, tap = False, None, None

    def send_bytes(self, body):
        m = json.loads(body)
        fut = waiting.pop(m.get("id"), None) if "method" not in m else None
        if fut is not None and not fut.done():
            fut.set_result(m)


async def main():
    conn = transport.Connection(Client(), version="t", base_settings={
        "models": {"s": {"provider": "scripted", "responses": ["one"] * 8}}, "defaultModel": "s"})
    loop = asyncio.get_running_loop()
    conn.on_initialized.append(lambda c: c.start_app_loader(loop))
    ids = iter(range(1, 100))

    async def call(method, params):
        """The answer, and the Python functions called on this thread from the frame's arrival
        to its answer (the handler's tasks included: all on the loop's thread)."""
        msg_id = next(ids)
        fut = waiting[msg_id] = loop.create_future()

        async def answered():
            conn.feed(encode_frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method,
                                               "params": params}).encode()))
            return await fut

        m, n = await counted(answered())
        assert "result" in m, m
        return m["result"], n

    await call("initialize", {})
    branch = (await call("createBranch", {}))[0]["branchId"]
    op = {"branchId": branch, "instruction": "x"}
    first = (await call("operate", op))[1]

    async def later_warm_up_over():  # the later warm-up (the other shapes) started and ended: not counted
        while warming != [2, 2]:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(later_warm_up_over(), WARM_DELAY_S + 60)
    warm = [(await call("operate", op))[1] for _ in range(5)]
    await conn.aclose()
    print(json.dumps([first, *warm]))


asyncio.run(main())
'''


def test_the_first_operate_after_create_branch_runs_the_calls_a_warm_one_does():
    """The first ``operate`` after ``createBranch`` calls as many Python functions as the later
    ones (counted, not timed: the time is in ``bench/``, ``python -m bench.run --only first``):
    the params checkers, the pipeline's option names, the operative types and the reply's
    schema are all built before it (the core loader and the warm-up). Allowed: the few
    per-branch objects made on first use (its lock, the tool pool), about 15 calls."""
    out = subprocess.run([sys.executable, "-c", CALLS], capture_output=True, text=True, timeout=120,
                         env=server_env(paths=(Path(call_count.HERE),)))
    assert out.returncode == 0, out.stderr[-3000:]
    call_count.assert_first_as_warm(json.loads(out.stdout.strip().splitlines()[-1]), "operate")


FDS = r'''
import asyncio, json, os
from operate_sidecar.server.rpc import warm
from operate_sidecar.server.service import service

real_operate, operating = service.Service.operate, []


async def operate(self, params, **kw):
    operating.append(1)
    return await real_operate(self, params, **kw)


service.Service.operate = operate


def fds():
    """This process's open descriptors and what each is (the listing's own, gone when read, left out)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            pass
    return out


async def main():
    await warm.warm_up()  # (the first also starts what the core keeps: the tools' reaper ...)
    await asyncio.sleep(0.1)  # (a transport's close completes on a later turn of the loop)
    before = fds()
    await warm.warm_up()
    await warm.warm_up(shapes=warm.LATER)
    # one stopped in the middle (its time-out, or the server closing): cancelled after its
    # third operate has started
    operating.clear()
    task = asyncio.ensure_future(warm.warm_up())

    async def third_operate():
        while len(operating) < 3 and not task.done():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(third_operate(), 30)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    # and one stopped as it begins, while its reader is being attached: the reader owns the
    # pipe's read end from then on (its transport closes it): the warm-up closed it again
    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["message"]))
    first = asyncio.ensure_future(warm.warm_up())
    await asyncio.sleep(0)
    first.cancel()
    try:
        await first
    except asyncio.CancelledError:
        pass
    await asyncio.sleep(0.1)
    print(json.dumps([before, fds(), task.cancelled() and first.cancelled(), errors]))


asyncio.run(main())
'''


def test_the_warm_up_closes_its_pipes():
    """The throwaway connection runs over two pipes of its own, read and written by the same
    reader and ``Wire`` as stdio: a warm-up leaves none of their four ends open, a warm-up
    cancelled in the middle neither, and one cancelled as it attaches its reader closes no end twice."""
    out = subprocess.run([sys.executable, "-c", FDS], capture_output=True, text=True, timeout=120,
                         env=server_env())
    assert out.returncode == 0, out.stderr[-3000:]
    before, after, cancelled, errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert cancelled  # (the last two were stopped: in the middle, and as the first began)
    assert after == before
    assert errors == []  # (a descriptor closed twice: "Exception in callback ... Bad file descriptor")
