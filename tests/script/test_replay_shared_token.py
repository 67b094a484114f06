"""``cancelAfterModelCalls`` (docs/PROTOCOL.md §12) when an earlier operate with the same
``workDoneToken`` is still waiting for its turn on the same branch as the request is sent: its
``begin`` and reports come after the request was sent, and are not the request's own. The real
server, replayed by the real ``replay`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TIMEOUT = 120


def test_a_cancel_waits_for_the_model_calls_of_its_own_operate_not_an_earlier_one_of_its_token(tmp_path: Path):
    """Operate A (token "tok") waits behind operate Z on the branch while B (token "tok" too) is
    sent, to be cancelled after its first model call: A's begin and request report came after B
    was sent and were counted as B's, so B was cancelled while it still waited for its turn, its
    model response was never taken, and the next operate got it (30 s late) instead of its own."""
    slow = {"provider": "scripted", "responses": [{"text": "z", "delayMs": 1500}, {"text": "a", "delayMs": 500},
                                                  {"text": "never seen", "delayMs": 30000}, "d"]}
    op = {"branchId": "${b}", "skipValidation": True}
    steps = [{"request": "initialize", "params": {"settings": {"models": {"m": slow}}}},
             {"request": "createBranch", "save": {"b": "branchId"}},
             {"request": "operate", "params": {**op, "instruction": "z"}, "id": "z", "wait": False,
              "expect": {"result": {"result": "z"}}},
             {"request": "operate", "params": {**op, "instruction": "a", "workDoneToken": "tok"}, "id": "a",
              "wait": False, "expect": {"result": {"result": "a"}}},
             {"request": "operate", "params": {**op, "instruction": "b", "workDoneToken": "tok"}, "id": "op",
              "wait": False, "cancelAfterModelCalls": 1, "expect": {"error": {"code": -32800}}},
             {"notify": "$/cancelRequest", "params": {"id": "op"}},
             {"await": "z", "timeoutMs": 20000},
             {"await": "a", "timeoutMs": 20000},
             {"await": "op", "timeoutMs": 20000},
             {"request": "operate", "params": {**op, "instruction": "d"}, "expect": {"result": {"result": "d"}},
              "timeoutMs": 20000}]
    script = tmp_path / "shared.jsonl"
    script.write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "replay", str(script)],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
