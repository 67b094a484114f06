"""One operate's messages are one transaction: a process killed (SIGKILL) while it commits groups
leaves each group entirely on disk or entirely absent, never a part of one, and the database
passes its integrity check afterwards. A real child process writes through the real store."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

from operate_sidecar.server.state import StateStore

GROUP = 7  # messages per group (instruction, response, 5 more: a tool-heavy operate)

WRITER = textwrap.dedent(f"""
    import sys
    from operate_sidecar.server.core import Branch
    from operate_sidecar.server.state import StateStore
    s = StateStore(sys.argv[1])
    loaded = s.load()
    if loaded:
        from operate_sidecar.server.core.messages import MessageLog
        b = Branch(id=loaded[0].id, messages=MessageLog(loaded[0].messages))
        s.adopt(b, loaded[0].meta)
    else:
        b = Branch(name="g")                      # no system message: the count is GROUP * groups
        s.attach(b, {{"name": "g", "createdAt": 1}})
        s.flush()
    print("ready", flush=True)
    n = 0
    while True:
        for i in range({GROUP}):
            b.messages.add("instruction", {{"instruction": "x" * 2000, "n": sys.argv[2] + "-" + str(n), "i": i}})
        s.flush()
        n += 1
""")


def _count(state: str) -> tuple[int, list[int]]:
    s = StateStore(state)
    try:
        assert not s.problems, s.problems
        lb = s.load()[0]
    finally:
        s.close()
    per: dict[str, int] = {}
    for m in lb.messages:
        per[m.content["n"]] = per.get(m.content["n"], 0) + 1
    return len(lb.messages), sorted(set(per.values()))


def test_sigkill_mid_commit_never_leaves_part_of_a_group(tmp_path):
    state = str(tmp_path / "state")
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    last = 0
    for run in range(12):
        p = subprocess.Popen([sys.executable, "-c", WRITER, state, str(run)], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.3))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(20)
            p.stdout.close()
        total, sizes = _count(state)
        assert total % GROUP == 0 and sizes in ([], [GROUP]), (total, sizes)   # whole groups only
        assert total >= last                                                     # nothing committed is lost
        last = total
    assert last > 0
