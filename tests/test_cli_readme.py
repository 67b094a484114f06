"""README.md's *Running the server* as a new user meets it: every flag its synopsis names is one
``--help`` lists (and the other way round), and its sample ``--config`` file starts the server,
the missing API key being reported at the first operate, not at start-up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from operate_sidecar.clients.python.client import RpcError, SidecarClient

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

pytestmark = pytest.mark.timeout(90)


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_synopsis_names_the_flags_help_lists():
    synopsis = section("Running the server").split("```sh\n", 1)[1].split("```", 1)[0]
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", synopsis))
    helps = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "--help"], capture_output=True,
                           text=True, timeout=30).stdout
    listed = set(re.findall(r"^  (--[a-z][a-z-]+)", helps, re.M)) - {"--help"}
    assert named - {"--scripted", "--timeout", "--quiet"} == listed, (named, listed)


def test_the_sample_config_starts_and_a_missing_key_is_told_at_the_first_operate(tmp_path):
    toml = section("Running the server").split("```toml\n", 1)[1].split("```", 1)[0]
    # the sample's own stateDir is a user's home: keep the state in the test's directory
    toml = re.sub(r'^stateDir = ".*"', f'stateDir = "{tmp_path / "state"}"', toml, flags=re.M)
    (tmp_path / "settings.toml").write_text(toml)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    with open(tmp_path / "stderr.txt", "wb") as err, SidecarClient(
            [sys.executable, "-m", "operate_sidecar.server", "--config", str(tmp_path / "settings.toml")],
            env=env, cwd=str(tmp_path), stderr=err) as c:
        init = c.request("initialize", {}, timeout=60)
        assert init["capabilities"]["models"] == ["gpt"]
        branch = c.request("createBranch", {}, timeout=60)["branchId"]
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": branch, "instruction": "hi"}, timeout=60)
        assert e.value.code == -32011 and "OPENAI_API_KEY is not set" in e.value.message, e.value
    assert (tmp_path / "state" / "state.sqlite3").is_file()
    # the sample's tool module is a placeholder: one warning naming it, no traceback
    stderr = (tmp_path / "stderr.txt").read_text()
    assert "tool module 'mypackage.tools' could not be imported" in stderr and "Traceback" not in stderr, stderr


def test_the_replay_synopsis_of_the_readme_and_the_protocol_is_the_one_help_prints():
    """docs/PROTOCOL.md wrote ``replay SCRIPT.jsonl [--scripted] ...`` while the README and
    ``replay --help`` put the options first: one synopsis, the one --help prints."""
    usage = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "replay", "--help"], capture_output=True,
                           text=True, timeout=30).stdout.split("\n", 1)[0]
    synopsis = "operate-sidecar replay " + usage.split("operate-sidecar replay [-h] ", 1)[1]
    protocol = (ROOT / "docs/PROTOCOL.md").read_text(encoding="utf-8")
    assert synopsis in section("Running the server"), synopsis
    assert f"`{synopsis}`" in protocol.split("\n## 12. Session scripts\n", 1)[1], synopsis


def test_the_acp_sections_larger_model_config_starts_and_both_models_are_in_the_menu(tmp_path):
    """The config the *Agent Client Protocol* section gives for work (a llama.cpp server on
    loopback, the embedded model kept in the menu) is one the ACP front end takes: its session
    offers both models, the configured default first."""
    toml = section("Agent Client Protocol").split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "settings.toml").write_text(toml)
    lines = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
             {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": str(tmp_path), "mcpServers": []}}]
    proc = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config",
                             str(tmp_path / "settings.toml")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=str(tmp_path))
    try:
        proc.stdin.write("".join(json.dumps(x) + "\n" for x in lines).encode())
        proc.stdin.flush()
        answer = None
        while answer is None:  # (bounded by the test's time-out; a closed stdout ends it too)
            line = proc.stdout.readline()
            assert line, "the agent closed its output before answering session/new"
            msg = json.loads(line)
            answer = msg if msg.get("id") == 2 else None
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    model = next(o for o in answer["result"]["configOptions"] if o["id"] == "model")
    assert model["currentValue"] == "coder" and [o["value"] for o in model["options"]][:2] == ["coder", "local"]
