"""A tool call that fails is the model's to handle (its output is the error, docs/PIPELINE.md
D4), not a fault of the server: it is logged as one WARNING line, with no traceback. Over the
real server (a subprocess, real pipes) with a tool module written by the test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from operate_sidecar.clients.python.client import SidecarClient

REPO = Path(__file__).resolve().parents[2]

TOOLS = '''
def fails(text: str) -> str:
    """Raises, with a message of two lines."""
    raise ValueError("first line of the failure\\nsecond line of it")
'''


def call(function: str, arguments) -> dict:
    return {"function": function, "arguments": arguments}


def failing_calls(tmp_path: Path, *argv: str) -> list[str]:
    """The server (with ``argv``) asked to run three calls that fail: a tool that raises, arguments
    that do not fit it, a tool that is not registered; its stderr's lines."""
    (tmp_path / "failing_tools.py").write_text(TOOLS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]))
    reply = {"json": {"action_requests": [call("fails", {"text": "x"}), call("fails", {"nope": 1}),
                                          call("missing", {})]}}
    with open(tmp_path / "server.err", "wb") as err:
        c = SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server", *argv], env=env, cwd=str(REPO),
                          stderr=err)
        try:
            c.request("initialize", {"settings": {"models": {"s": {"provider": "scripted", "responses": [reply]}},
                                                  "toolModules": ["failing_tools"]}}, timeout=60)
            bid = c.request("createBranch", {})["branchId"]
            out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=60)
            outputs = [r["output"] for r in out["result"]["action_responses"]]
            assert all("error" in o for o in outputs) and len(outputs) == 3, outputs
            assert c.close(timeout=30) == 0
        finally:
            c.kill()
    return (tmp_path / "server.err").read_text().splitlines()


def test_a_failing_tool_call_is_one_warning_line_not_an_error(tmp_path):
    """A tool that raised, arguments that do not fit the tool, a tool that is not registered:
    each was logged at ERROR level, as a fault of the server would be. Now each is one WARNING
    line naming the tool and its error, and nothing is logged at ERROR."""
    lines = failing_calls(tmp_path)
    assert not [line for line in lines if " ERROR " in line or "Traceback" in line], lines
    warned = [line for line in lines if " WARNING " in line and "Error invoking action" in line]
    assert len(warned) == 3, lines  # (the calls run concurrently: in any order)
    said = "\n".join(warned)
    assert "'fails': first line of the failure second line of it" in said, warned
    assert "'fails': invalid arguments" in said and "'missing'" in said, warned


def test_a_failing_tool_calls_traceback_is_in_the_debug_log(tmp_path):
    """The WARNING line has no traceback; yet what raised may be a bug of the server (in a builtin
    tool, or in the machinery calling a tool), told apart only by its traceback: with ``--debug``
    it is logged too, at DEBUG level, after the WARNING line."""
    lines = failing_calls(tmp_path, "--debug")
    text = "\n".join(lines)
    assert not [line for line in lines if " ERROR " in line], lines
    assert len([line for line in lines if " WARNING " in line and "Error invoking action" in line]) == 3, lines
    traced = [i for i, line in enumerate(lines) if " DEBUG " in line and "Traceback of the failed action 'fails'" in line]
    assert traced, text
    after = "\n".join(lines[traced[0]:])
    assert "Traceback (most recent call last)" in after and "ValueError: first line of the failure" in text, after
