"""The stdio contenders: how to start each one and what to ask it.

Every server is started the same way: `taskset -c <server cpu> <python> <script>`
(exec, so the pid is the server's), stderr to <out>/logs/<name>.stderr (bench/out by
default), cwd a work folder made for the run and removed at its end.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import common, venvs

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PEERS = BENCH / "peers"

MCP_PROTOCOL_VERSION = "2025-06-18"

# The model every "ours" session is configured with: scripted, so nothing is
# loaded at start-up and no local GGUF is touched.
OURS_IDLE_SETTINGS = {
    "models": {"bench": {"provider": "scripted", "responses": []}},
    "defaultModel": "bench",
    "stateDir": None,
}


@dataclass
class Contender:
    name: str
    label: str
    argv: list[str]
    framing: str                          # "lsp" | "ndjson"
    init_params: dict
    after_init: list[str] = field(default_factory=list)   # notifications sent after the answer
    light: dict[str, tuple[str, dict]] = field(default_factory=dict)  # metric -> (method, params)
    throughput: tuple[str, dict] = ("ping", {})
    first_use: list[tuple[str, dict]] = field(default_factory=list)  # for "RSS after first use"
    setup: str | None = None              # peer venv to ensure first
    unavailable: str | None = None


def lsp_init(name: str, settings: dict | None = None) -> dict:
    p = {"protocolVersion": 1, "clientInfo": {"name": "operate-bench", "version": "1"},
         "processId": os.getpid(), "capabilities": {}}
    if settings is not None:
        p["settings"] = settings
    return p


def _ours_unavailable() -> str | None:
    """Why "ours" cannot be measured, in the words the sections use (they name the override):
    the program ``common.ours_argv`` spawns does not exist."""
    try:
        common.ours_argv()
    except common.Unavailable as e:
        return common.reason(e)
    return None


def all_contenders() -> list[Contender]:
    return [
        Contender(
            name="stdlib", label="stdlib floor",
            argv=[sys.executable, str(PEERS / "stdlib_echo.py")], framing="lsp",
            init_params=lsp_init("stdlib"),
            light={"ping": ("ping", {}), "add": ("add", {"a": 2, "b": 3})},
            first_use=[("add", {"a": 2, "b": 3})],
        ),
        Contender(
            name="pygls", label="bare pygls 2.1.1",
            argv=[str(venvs.python_of("pygls")), str(PEERS / "pygls_server.py")], framing="lsp",
            init_params=lsp_init("pygls"),
            # pygls 2.1.1 never answers a request without params: always send {}.
            light={"ping": ("ping", {}), "add": ("add", {"a": 2, "b": 3})},
            first_use=[("add", {"a": 2, "b": 3})],
            setup="pygls",
        ),
        Contender(
            name="mcp", label="MCP SDK MCPServer",
            argv=[str(venvs.python_of("mcp")), str(PEERS / "mcp_server.py")], framing="ndjson",
            init_params={"protocolVersion": MCP_PROTOCOL_VERSION, "capabilities": {},
                         "clientInfo": {"name": "operate-bench", "version": "1"}},
            after_init=["notifications/initialized"],
            light={"ping": ("ping", {}), "tools/list": ("tools/list", {}),
                   "tools/call": ("tools/call", {"name": "add", "arguments": {"a": 2, "b": 3}})},
            first_use=[("tools/list", {}), ("tools/call", {"name": "add", "arguments": {"a": 2, "b": 3}})],
            setup="mcp",
        ),
        Contender(
            name="ours", label=common.ours_label(),
            argv=[common.ours_bin()], framing="lsp",
            init_params=lsp_init("ours", OURS_IDLE_SETTINGS),
            light={"ping": ("ping", {}), "listTools": ("listTools", {})},
            first_use=[("listTools", {}), ("createBranch", {})],
            unavailable=_ours_unavailable(),
        ),
    ]
