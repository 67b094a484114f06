"""A mistake on the ``operate-sidecar --acp`` command line, as an ACP editor meets it: the editor
shows the agent's answers, not its stderr, so the server answers ``initialize``, and every request
after it, with the one line it wrote on stderr (-32603), then exits 2 at the end of its input, as
it does for a bad ``--config`` file (README "Running the server"). Before, argparse and the flag
checks exited 2 at once: the editor's ``initialize`` got no answer, its pipe just closed. Without
``--acp`` as written (absent or misspelt) the native behaviour stays: the line, exit 2 at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(90)

REQUESTS = [
    {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
    {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": os.getcwd(), "mcpServers": []}},
    {"jsonrpc": "2.0", "id": 3, "method": "_editor/probe", "params": {}},  # (an extension's: the line too)
    # a method ACP does not have: -32601 as ever (the SDK's router answers it)
    {"jsonrpc": "2.0", "id": 4, "method": "editor/probe", "params": {}},
]


@pytest.mark.parametrize("args, line", [
    (["--confg", "x.toml"], "operate-sidecar: error: unrecognized arguments: --confg x.toml"),
    (["--client-process-id", "abc"], "operate-sidecar: error: argument --client-process-id: not a process id: 'abc'"),
    (["--log-level", "verbose"], "operate-sidecar: error: argument --log-level: invalid choice: 'verbose' "),
    (["--config"], "operate-sidecar: error: argument --config: expected one argument"),
    (["--state-dir", ""], "operate-sidecar: --state-dir: no folder name given "),
    (["--record", "session.jsonl"], "operate-sidecar: --record records the native protocol; it cannot be "
                                    "combined with --acp"),
])
def test_a_command_line_mistake_with_acp_answers_every_request_with_its_line(tmp_path, args, line):
    wire = b"".join(json.dumps(r).encode() + b"\n" for r in REQUESTS)
    proc = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "--acp", *args], input=wire,
                          cwd=tmp_path, capture_output=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    said = proc.stderr.decode().strip()
    assert "\n" not in said and said.startswith(line), said
    answers = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [a["id"] for a in answers] == [1, 2, 3, 4], proc.stdout
    for a in answers[:3]:
        assert (a["error"]["code"], a["error"]["message"]) == (-32603, said), a
    assert answers[3]["error"]["code"] == -32601, answers[3]
    assert not (tmp_path / "session.jsonl").exists()  # nothing was served, nothing recorded


@pytest.mark.parametrize("args", [["--apc", "--confg", "x.toml"], ["--confg", "x.toml"]])
def test_without_acp_as_written_a_command_line_mistake_is_the_native_usage_and_exit_2(tmp_path, args):
    wire = json.dumps(REQUESTS[0]).encode() + b"\n"
    proc = subprocess.run([sys.executable, "-m", "operate_sidecar.server", *args], input=wire, cwd=tmp_path,
                          capture_output=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == b"", proc
    lines = proc.stderr.decode().strip().splitlines()
    assert lines[0].startswith("usage: operate-sidecar ") and lines[-1].startswith(
        "operate-sidecar: error: unrecognized arguments: "), lines


def test_a_command_line_mistake_with_acp_at_a_terminal_exits_2_at_once():
    # a person who typed the command has read the line on stderr: nothing to wait for
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "--acp", "--log-level", "loud"],
                              stdin=follower, capture_output=True, timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    assert proc.returncode == 2 and proc.stdout == b"", proc
    assert proc.stderr.decode().strip().startswith("operate-sidecar: error: argument --log-level: invalid choice"), \
        proc.stderr
