"""A ``settings.toolPolicy`` entry is checked once, against the configured tool sources, when
they are first loaded: an entry ``<server>__<tool>`` whose server is not configured may name a
tool of an MCP server added later (an ACP session's), so it is not warned about; one naming a
configured server's tool that the server does not offer is."""

from __future__ import annotations

import sys
from pathlib import Path

from .support import TIMEOUT, scripted, wait_log


def test_a_policy_entry_for_a_server_not_configured_is_not_warned_about(sidecar, tmp_path):
    gated = str(Path(__file__).resolve().parents[1] / "service" / "fixtures" / "gated_mcp_server.py")
    gate = tmp_path / "open"
    gate.touch()  # the server starts at once
    sidecar.init(models={"s": scripted("x")},
                 mcpServers={"b": {"command": [sys.executable, gated, "b", str(gate), "one"]}},
                 toolPolicy={"later__search": "deny", "b__nosuch": "deny", "one": "allow"})
    tools = {t["name"] for t in sidecar.request("listTools", {}, timeout=TIMEOUT)["tools"]}
    assert "one" in tools, tools
    said = [m["message"] for m in sidecar.of("window/logMessage") if "toolPolicy" in m["message"]]
    assert said == [
        "settings.toolPolicy names 'b__nosuch', which none of the configured tool sources offers: the entry "
        "decides nothing until a tool of that name is offered (a tool is named as listTools lists it)"], said
    assert wait_log(sidecar, said[0]), sidecar.stderr_text()
