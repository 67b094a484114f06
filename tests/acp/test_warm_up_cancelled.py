"""The ACP warm-up (server/acp/agent.py ``warm_up``) cancelled at any of its awaits, once or
twice (its time-out, then the agent closing as the client goes): every pipe, transport and task
it opened is closed. The warm-up runs in a child process (it changes process-wide state: the
interpreter's warmed code, the collector)."""

from __future__ import annotations

import json
import subprocess
import sys

from acp_support import agent_env

CANCELLED = r'''
import asyncio, gc, json, os, sys, time, warnings
from operate_sidecar.server.acp import agent as A
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.service import Service

SETUP = int(sys.argv[1])  # every loop step up to this one (the pipes, initialize, session/new)
SPREAD = int(sys.argv[2])  # then this many steps spread over the rest of a whole warm-up

caught = []
warnings.simplefilter("always", ResourceWarning)
warnings.showwarning = lambda message, category, *a, **kw: caught.append(f"{category.__name__}: {message}")


def fds():
    """The process's open pipes (what the warm-up opens: ``os.pipe``), each as ``fd=pipe:[inode]``:
    a descriptor something else opens once and keeps (a file, a socket) is not the warm-up's."""
    out = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            out.add(f"{f}={target}")
    return out


async def steps(task):
    n = 0
    while not task.done():
        await asyncio.sleep(0)
        n += 1
    return n


async def settled(before):
    """Bounded: the warm-up's own tasks done and its descriptors closed."""
    deadline = time.monotonic() + 30  # (a loaded machine: the pipes close as their transports see EOF)
    while (A._WARM_TASKS or fds() != before) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    gc.collect()


async def main():
    a = A.OperateAgent(S.finalize(S.merge(S.DEFAULTS, {})))
    sc = Service(a.port)
    sc.load_core()
    loop = asyncio.get_running_loop()
    await A.warm_up(sc)  # the first one builds what the others reuse
    second = loop.create_task(A.warm_up(sc))
    whole = await steps(second)  # a whole warm-up's loop steps
    second.result()
    before = fds()
    points = sorted(set(range(SETUP + 1)) | set(range(SETUP, whole + 1, max(1, (whole - SETUP) // SPREAD))))
    left, outcomes = {}, set()
    # (-1: cancelled once it has ended, a no-op: a warm-up's loop steps vary with the machine's
    # load, so the last step counted above may still find it running)
    for n in [*points, -1]:
        for again in (None, 1, 4):  # once, or a second time that many steps later (on the way out)
            task = loop.create_task(A.warm_up(sc))
            if n < 0:
                await asyncio.wait({task}, timeout=30)
            for _ in range(max(n, 0)):
                await asyncio.sleep(0)
            task.cancel()
            if again is not None:
                for _ in range(again):
                    await asyncio.sleep(0)
                task.cancel()
            try:
                await asyncio.wait_for(task, 30)
                outcomes.add("finished")
            except asyncio.CancelledError:
                outcomes.add("cancelled")
            await settled(before)
            stray = sorted(fds() - before)
            if stray or caught or A._WARM_TASKS:
                left[f"{n}/{again}"] = [stray, caught[:], len(A._WARM_TASKS)]
                caught.clear()
                before = fds()
                if len(left) >= 3:
                    break
        if len(left) >= 3:
            break
    print(json.dumps({"whole": whole, "tried": len(points), "outcomes": sorted(outcomes), "left": left}))


asyncio.run(main())
'''


def test_a_warm_up_cancelled_at_any_step_leaves_no_pipe_transport_or_task_open(tmp_path):
    """Cancelled at every loop step of its opening of the pipes, its ``initialize`` and
    ``session/new`` (and at steps spread over its prompt turns), once or again on its way out:
    no descriptor stays open, no transport is left for the collector (no ResourceWarning), no
    task is left pending or with an exception nobody read."""
    out = subprocess.run([sys.executable, "-c", CANCELLED, "100", "30"], capture_output=True, text=True,
                         timeout=300, env=agent_env())
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["left"] == {}, res
    assert res["tried"] > 100 and res["outcomes"] == ["cancelled", "finished"], res  # (finished: the -1, after its end)
    for noise in ("Task was destroyed", "never retrieved", "unclosed", "Traceback"):
        assert noise not in out.stderr, out.stderr[-3000:]
