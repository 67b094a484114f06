"""Package hygiene: light imports, no server dependency, names and codes as docs/PROTOCOL.md says."""

import json
import re
import subprocess
import sys
from pathlib import Path

from operate_sidecar import protocol
from operate_sidecar.protocol import errors, gen_schema, methods

ROOT = Path(__file__).resolve().parents[2]


def _modules_after_import() -> set[str]:
    code = "import sys, json, operate_sidecar.protocol; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_import_protocol_pulls_in_no_server_module():
    mods = _modules_after_import()
    assert "operate_sidecar.protocol" in mods
    assert not {m for m in mods if m == "operate_sidecar.server" or m.startswith("operate_sidecar.server.")}


def test_import_protocol_pulls_in_nothing_heavy():
    mods = _modules_after_import()
    heavy = ("pygls", "lsprotocol", "pydantic", "anyio", "asyncio", "jsonschema", "llama_cpp", "openai")
    assert not {m for m in mods if m.split(".")[0] in heavy}


def test_protocol_sources_never_import_server():
    for path in Path(protocol.__file__).parent.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import)\s+server\b", text, re.M), path.name


def test_error_codes_are_the_protocol_codes():
    assert (errors.PARSE_ERROR, errors.INVALID_REQUEST, errors.METHOD_NOT_FOUND, errors.INVALID_PARAMS,
            errors.INTERNAL_ERROR, errors.SERVER_NOT_INITIALIZED, errors.REQUEST_CANCELLED,
            errors.VALIDATION_FAILED, errors.MODEL_ERROR, errors.BRANCH_NOT_FOUND) == \
        (-32700, -32600, -32601, -32602, -32603, -32002, -32800, -32010, -32011, -32012)


def test_rpc_error_to_dict_omits_null_data():
    assert errors.RpcError(-32012, "branch not found").to_dict() == {"code": -32012, "message": "branch not found"}
    assert errors.RpcError(-32010, "m", {"expected": "A"}).to_dict()["data"] == {"expected": "A"}


def test_params_error_is_an_rpc_error_with_code_32602():
    err = errors.ParamsError("x")
    assert isinstance(err, errors.RpcError) and err.code == -32602


def test_server_requests_are_the_served_methods():
    assert set(methods.SERVER_REQUESTS) == {
        "initialize", "ping", "shutdown", "createBranch", "forkBranch", "deleteBranch", "listBranches",
        "branchMessages", "listTools", "authorizeTool", "registerClientTools", "operate"}
    assert methods.PROGRESS == "$/progress" and methods.CANCEL_REQUEST == "$/cancelRequest"
    assert methods.LOG_MESSAGE == "window/logMessage"


def test_readme_names_every_method_field_type_and_error_code():
    readme = (Path(protocol.__file__).parent / "README.md").read_text(encoding="utf-8")
    names = (methods.SERVER_REQUESTS + methods.CLIENT_REQUESTS + methods.CLIENT_NOTIFICATIONS
             + methods.SERVER_NOTIFICATIONS)
    assert [n for n in names if f"`{n}`" not in readme] == []
    assert [c for c in errors.ERROR_CODES.values() if f"`{c}`" not in readme] == []
    operate_keys = gen_schema.build_schema()["$defs"]["OperateParams"]["properties"]
    assert [k for k in operate_keys if f"`{k}`" not in readme] == []
