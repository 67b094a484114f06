"""The layers, checked in a fresh interpreter: the service runs with no transport loaded, and
the core loads nothing of the layers above it."""

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

from operate_sidecar.server import core, service
from operate_sidecar.server.rpc import settings as S

ROOT = Path(__file__).resolve().parents[2]

#: a ClientPort with nothing behind it, then every module of the package, then real calls
SERVICE_RUN = """
import asyncio, json, sys
import operate_sidecar.server.service as pkg
for name in {modules!r}:
    __import__("operate_sidecar.server.service." + name)
from operate_sidecar.server.service.service import Service

class Port:
    def __init__(self):
        self.conn = self
        self.settings = json.loads({settings!r})
        self.client_capabilities = {{}}
        self.workspace_folders = []
        self.sent = []
    def log_message(self, type_, message):
        pass
    def notify(self, method, params):
        self.sent.append(method)
    async def request_client(self, method, params, timeout):
        raise RuntimeError("no client")

async def main():
    port = Port()
    svc = Service(port)
    bid = (await svc.createBranch({{}}))["branchId"]
    out = await svc.operate({{"branchId": bid, "instruction": "hi", "workDoneToken": "t", "maxRounds": 2,
                             "responseFormat": {{"type": "object", "properties": {{"a": {{"type": "string"}}}}}}}})
    assert out["result"] == {{"a": "x"}}, out
    assert (await svc.listBranches({{}}))["branches"][0]["messageCount"] == 2
    await svc.listTools({{}})
    await svc.aclose()
    assert "$/progress" in port.sent

asyncio.run(main())
print(json.dumps(sorted(sys.modules)))
"""


def _modules(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _under(mods: set[str], *packages: str) -> set[str]:
    return {m for m in mods for p in packages if m == p or m.startswith(p + ".")}


def test_the_service_runs_with_no_transport_loaded():
    settings = S.finalize(S.merge(S.DEFAULTS, {"defaultModel": "s", "models": {"s": {
        "provider": "scripted", "responses": [{"json": {"a": "x"}}]}}}))
    modules = sorted(m.name for m in pkgutil.iter_modules(service.__path__))
    assert {"service", "errors", "governance", "port", "progress", "rounds", "schemas"} <= set(modules)
    mods = _modules(SERVICE_RUN.format(modules=modules, settings=json.dumps(settings)))
    assert "operate_sidecar.server.service.service" in mods and "operate_sidecar.server.core.operate" in mods
    assert not _under(mods, "pygls", "lsprotocol", "acp", "operate_sidecar.server.rpc", "operate_sidecar.server.acp")


def test_the_core_imports_nothing_of_the_layers_above_it():
    names = sorted(m.name for m in pkgutil.iter_modules(core.__path__))
    assert {"operate", "prepare", "act", "branch", "tools"} <= set(names)
    code = ("import json, sys\n"
            f"for name in {names!r}:\n"
            "    __import__('operate_sidecar.server.core.' + name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    mods = _modules(code)
    assert "operate_sidecar.server.core.operate" in mods
    assert not _under(mods, "operate_sidecar.server.service", "operate_sidecar.server.rpc",
                      "operate_sidecar.server.acp", "operate_sidecar.server.state", "operate_sidecar.server.models",
                      "operate_sidecar.protocol", "pygls", "lsprotocol", "acp", "openai", "llama_cpp", "sqlite3")


def test_every_operate_param_is_passed_converted_or_used_by_the_service():
    """The operate parameter list is the protocol's: a field that names a ``prepare_operate_kw``
    parameter reaches it by name; every other field is one the service converts or uses."""
    import attrs

    from operate_sidecar.protocol import OperateParams
    from operate_sidecar.server.core.prepare import prepare_operate_kw
    from operate_sidecar.server.service.service import CONSUMED, CONVERTED, passed_as_is

    fields = {f.name for f in attrs.fields(OperateParams)}
    as_is = set(passed_as_is(prepare_operate_kw))
    assert {"reason", "actions", "tools", "action_strategy", "clear_messages", "snapshot_dir"} <= as_is
    assert as_is | CONVERTED | CONSUMED == fields
    assert not as_is & (CONVERTED | CONSUMED) and not CONVERTED & CONSUMED
