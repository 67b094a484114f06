"""The TypeScript client package (clients/typescript), tested for real.

Set-up once per module: `npm ci` (the lockfile is committed; its `prepare` script builds dist/: tsc, then scripts/node10-types.mjs).
Then, each as its own test:
  (a) the generated wire types are current: scripts/gen.mjs --check regenerates src/generated/protocol.ts
      from protocol/schema.json and compares (and fails for a changed schema)
  (b) tsc builds dist/ (CommonJS + .d.ts) and the built package loads from plain Node
  (c) the generated types are enforced: misuses of typed requests fail tsc (negative control), correct uses pass
  (d) node --test of the client against the real Python server (scripted model)
  (e) npm pack ships dist/ and no tests
  (f) the packed tarball, installed into a separate project, drives the real server from plain JavaScript
  (g) its declarations type-check there under node10 (`"module": "commonjs"`, TypeScript 5), node16 and bundler resolution
Every subprocess has a finite timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tied import run_tied

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "clients" / "typescript"
BIN = PKG / "node_modules" / ".bin"

NPM_CI_TIMEOUT = 600
GEN_TIMEOUT = 120
TSC_TIMEOUT = 180
NODE_TEST_TIMEOUT = 300
pytestmark = pytest.mark.timeout(NPM_CI_TIMEOUT + NODE_TEST_TIMEOUT + 240)


def run(argv: list[str], timeout: float, cwd: Path = PKG) -> subprocess.CompletedProcess:
    py = ROOT / ".venv" / "bin" / "python"
    env = dict(os.environ, OPERATE_SIDECAR_PYTHON=str(py) if py.exists() else sys.executable)
    env.pop("NODE_OPTIONS", None)
    try:
        return run_tied(argv, timeout, cwd=cwd, env=env, stdin=subprocess.DEVNULL, text=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{argv}: timed out after {timeout}s\n{(e.stdout or '')[-3000:]}\n{(e.stderr or '')[-3000:]}")


def tail(p: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"rc={p.returncode}\n--- stdout\n{p.stdout[-n:]}\n--- stderr\n{p.stderr[-n:]}"


@pytest.fixture(scope="module", autouse=True)
def installed():
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is required for the TypeScript client tests")
    p = run(["npm", "ci", "--no-audit", "--no-fund"], NPM_CI_TIMEOUT)
    assert p.returncode == 0, f"npm ci failed\n{tail(p)}"


def test_a_gen_out_writes_what_check_compares(tmp_path):
    """``gen.mjs --out`` writes the types ``--check`` compares (the generator's own arguments are
    checked in tests/protocol/test_generator_arguments.py; this one needs node_modules)."""
    def gen(*args: str) -> subprocess.CompletedProcess:
        return run(["node", "scripts/gen.mjs", *args], GEN_TIMEOUT)

    out = tmp_path / "protocol.ts"
    p = gen("--out", str(out))
    assert p.returncode == 0, tail(p)
    assert out.read_text() == (PKG / "src" / "generated" / "protocol.ts").read_text()
    assert gen("--check", "--out", str(out)).returncode == 0
    out.write_text("// stale\n")
    stale = gen("--check", "--out", str(out))
    assert stale.returncode == 1 and "stale" in stale.stderr, tail(stale)


def test_a_generated_types_are_current_with_protocol_schema_json(tmp_path):
    p = run(["node", "scripts/gen.mjs", "--check"], GEN_TIMEOUT)
    assert p.returncode == 0, f"stale: run `npm run gen` in clients/typescript\n{tail(p)}"
    generated = (PKG / "src" / "generated" / "protocol.ts").read_text()
    schema = json.loads((ROOT / "protocol" / "schema.json").read_text())
    for name in schema["$defs"]:
        assert re.search(rf"^export (interface|type) {name}\b", generated, re.MULTILINE), f"no generated type for {name}"
    for method in schema["methods"]:
        assert f'"{method}": {{ params:' in generated, f"method {method} missing from the request maps"
    for method in schema["notifications"]:
        assert f'"{method}": {{ params:' in generated, f"notification {method} missing from the notification maps"
    # the check regenerates and compares: a changed schema makes it fail
    changed = json.loads(json.dumps(schema))
    changed["$defs"]["BranchInfo"]["properties"]["branchLabel"] = {"type": "string"}
    (tmp_path / "schema.json").write_text(json.dumps(changed))
    stale = run(["node", "scripts/gen.mjs", "--check", "--schema", str(tmp_path / "schema.json")], GEN_TIMEOUT)
    assert stale.returncode == 1 and "stale" in stale.stderr, tail(stale)
    out = run(["node", "scripts/gen.mjs", "--stdout", "--schema", str(tmp_path / "schema.json")], GEN_TIMEOUT)
    assert out.returncode == 0 and "branchLabel?: string;" in out.stdout, tail(out)


def test_b_tsc_builds_commonjs_and_declarations_that_load_from_node():
    p = run([str(BIN / "tsc"), "-p", ".", "--pretty", "false"], TSC_TIMEOUT)
    assert p.returncode == 0, tail(p)
    for f in ("index.js", "index.d.ts", "generated/protocol.js", "generated/protocol.d.ts"):
        assert (PKG / "dist" / f).exists(), f"dist/{f} missing"
    probe = ("const m = require('./dist/index.js');"
             "console.log(JSON.stringify({client: typeof m.SidecarClient.start, codes: m.ErrorCodes,"
             " version: m.PROTOCOL_VERSION, exited: typeof m.SidecarExitedError}))")
    out = run(["node", "-e", probe], GEN_TIMEOUT)
    assert out.returncode == 0, tail(out)
    got = json.loads(out.stdout)
    schema = json.loads((ROOT / "protocol" / "schema.json").read_text())
    assert got["client"] == "function" and got["exited"] == "function"
    assert got["version"] == schema["protocolVersion"]
    assert {k: v for k, v in got["codes"].items() if k in schema["errorCodes"]} == schema["errorCodes"]
    assert got["codes"]["NotInitialized"] == -32002 and got["codes"]["Cancelled"] == -32800


USES = """
import { SidecarClient } from '../src/index';
export async function uses(c: SidecarClient) {
  const b = await c.request('createBranch', { system: %s });
  const id: string = b.branchId;
  const r = await c.operate({ branchId: id, handleValidation: %s });
  const kind: 'dict' | 'model' | 'none' | 'text' = r.kind;
  const info = await c.request('listBranches');
  const n: number = info.branches[0].messageCount;
  return [kind, n];
}
"""


def test_c_generated_types_are_enforced_by_tsc(tmp_path):
    def check(system: str, handle: str) -> subprocess.CompletedProcess:
        work = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        (work / "probe").mkdir(parents=True)
        shutil.copytree(PKG / "src", work / "src")
        (work / "node_modules").symlink_to(PKG / "node_modules")
        (work / "probe" / "uses.ts").write_text(USES % (system, handle))
        (work / "tsconfig.json").write_text(json.dumps({
            "extends": str(PKG / "tsconfig.json"),
            "compilerOptions": {"noEmit": True, "rootDir": ".", "types": ["node"]},
            "include": ["src/**/*.ts", "probe/*.ts"]}))
        return run([str(BIN / "tsc"), "-p", ".", "--pretty", "false"], TSC_TIMEOUT, cwd=work)

    good = check("'be brief'", "'raise'")
    assert good.returncode == 0, tail(good)
    bad = check("42", "'explode'")
    assert bad.returncode != 0, tail(bad)
    errors = [line for line in bad.stdout.splitlines() if "error TS" in line]
    assert len(errors) == 2 and all(line.startswith("probe/uses.ts") for line in errors), tail(bad)


def test_d_client_against_the_real_server_with_node_test():
    build = run([str(BIN / "tsc"), "-p", "tsconfig.test.json", "--pretty", "false"], TSC_TIMEOUT)
    assert build.returncode == 0, tail(build)
    p = run(["node", "--test", "--test-timeout=60000", "--test-reporter=tap", "dist-test/test/client.test.js"],
            NODE_TEST_TIMEOUT)
    results = re.findall(r"^(ok|not ok) \d+ - (.*)$", p.stdout, re.MULTILINE)
    failed = [name for status, name in results if status != "ok"]
    counts = dict(re.findall(r"^# (tests|pass|fail|skipped|todo|cancelled) (\d+)$", p.stdout, re.MULTILINE))
    assert p.returncode == 0 and not failed, f"failed: {failed}\n{tail(p, 12000)}"
    assert counts["fail"] == counts["skipped"] == counts["todo"] == counts["cancelled"] == "0", counts
    assert int(counts["pass"]) == int(counts["tests"]) == len(results) >= 10, (counts, results)
    names = " | ".join(name for _, name in results)
    for topic in ("initialize", "branches", "$/progress", "toolEvents", "requestToolPermission", "invokeClientTool",
                  "fs/readTextFile", "preview", "maxRounds", "usage", "cancel", "error codes", "dies at start",
                  "dies mid-request", "initialize time-out"):
        assert topic in names, f"missing test about {topic!r}: {names}"


def test_e_npm_pack_ships_dist_and_no_tests():
    p = run(["npm", "pack", "--dry-run", "--json", "--ignore-scripts"], GEN_TIMEOUT)
    assert p.returncode == 0, tail(p)
    files = {f["path"] for f in json.loads(p.stdout)[0]["files"]}
    assert {"package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/node10.d.ts",
            "dist/generated/protocol.d.ts"} <= files, files
    assert not [f for f in files if f.startswith(("test/", "dist-test/", "src/", "node_modules/"))], files


CONSUMER = """
const { SidecarClient, ErrorCodes } = require('operate-sidecar-client');
(async () => {
  const c = await SidecarClient.start({ command: [process.env.OPERATE_SIDECAR_PYTHON, '-m', 'operate_sidecar.server'] });
  const timer = setTimeout(() => { c.kill(); console.error('timed out'); process.exit(3); }, 60000);
  await c.initialize({ settings: { models: { s: { provider: 'scripted', responses: [{ json: { answer: 'forty-two' } }] } } } });
  const { branchId } = await c.createBranch({ system: 'be brief' });
  const out = await c.operate({ branchId, instruction: 'answer', responseFormat: {
    title: 'Answer', type: 'object', properties: { answer: { type: 'string' } }, required: ['answer'] } });
  let code = null;
  try { await c.branchMessages('nope'); } catch (e) { code = e.code; }
  const exit = await c.stop();
  clearTimeout(timer);
  console.log(JSON.stringify({ out, code, branchNotFound: ErrorCodes.BranchNotFound, exit }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def packed_project(tmp_path: Path, *also: str) -> Path:
    """`npm pack` (its `prepare` builds dist/), then `npm install` of the tarball (and of ``also``) into a fresh
    project; that project's directory."""
    pack = run(["npm", "pack", "--json", "--pack-destination", str(tmp_path)], TSC_TIMEOUT)
    assert pack.returncode == 0, tail(pack)
    tarball = tmp_path / json.loads(pack.stdout[pack.stdout.index("["):])[0]["filename"]
    project = tmp_path / "consumer"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "consumer", "version": "1.0.0", "private": True}))
    inst = run(["npm", "install", "--no-audit", "--no-fund", "--prefer-offline", str(tarball), *also], NPM_CI_TIMEOUT,
               cwd=project)
    assert inst.returncode == 0, tail(inst)
    return project


def test_f_the_packed_tarball_works_from_a_separate_node_project(tmp_path):
    """`npm pack` then `npm install` of the tarball into a fresh project; plain JavaScript drives the real server."""
    project = packed_project(tmp_path)
    assert (project / "node_modules" / "operate-sidecar-client" / "dist" / "index.d.ts").exists()
    assert not (project / "node_modules" / "operate-sidecar-client" / "src").exists()
    (project / "main.js").write_text(CONSUMER)
    p = run(["node", "main.js"], 90, cwd=project)
    assert p.returncode == 0, tail(p)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["out"] == {**got["out"], "result": {"answer": "forty-two"}, "kind": "model", "model": "AnswerResponse"}, got
    assert got["code"] == got["branchNotFound"] == -32012 and got["exit"] == 0, got


TS_CONSUMER = """
import {
  CancellationToken, CancellationTokenSource, ErrorCodes, OperateResult, PermissionHandler, ResponseError, SidecarClient,
  SidecarExitedError,
} from 'operate-sidecar-client';
export async function run(c: SidecarClient, token: CancellationToken): Promise<number | OperateResult> {
  const allow: PermissionHandler = (req) => (req.tool === 'write_file' ? 'allow_once' : 'deny_once');
  c.setPermissionHandler(allow);
  const source = new CancellationTokenSource();
  token.onCancellationRequested(() => source.cancel());
  c.connection.onClose(() => source.dispose());
  // @ts-expect-error: a token is not a number (vscode-jsonrpc's types are there, not any)
  const n: number = source.token;
  try {
    const { branchId } = await c.createBranch({ system: 'be brief' });
    return await c.operate({ branchId, instruction: 'x' }, { token: source.token });
  } catch (e) {
    if (e instanceof ResponseError && e.code === ErrorCodes.BranchNotFound) return e.code + n;
    if (e instanceof SidecarExitedError) return e.exitCode ?? -1;
    throw e;
  }
}
"""
# TypeScript 5, in which `"module": "commonjs"` means node10 module resolution (TypeScript 7 has none)
CONSUMER_TYPESCRIPT = "typescript@5.9.3"
RESOLUTIONS = {  # compilerOptions -> the declarations of the package TypeScript loads
    "commonjs": ({"module": "commonjs"}, "node10.d.ts"),
    "node16": ({"module": "node16"}, "index.d.ts"),
    "bundler": ({"module": "esnext", "moduleResolution": "bundler"}, "index.d.ts"),
}


def test_g_the_packed_declarations_type_check_under_node10_node16_and_bundler_resolution(tmp_path):
    """A TypeScript project that installed the tarball type-checks against its declarations (no skipLibCheck) with
    `"module": "commonjs"` (node10 resolution, which cannot read vscode-jsonrpc's `exports` map), node16 and bundler."""
    project = packed_project(tmp_path, CONSUMER_TYPESCRIPT, "@types/node@20.19.43")
    (project / "main.ts").write_text(TS_CONSUMER)
    dist = project / "node_modules" / "operate-sidecar-client" / "dist"
    for name, (options, declarations) in RESOLUTIONS.items():
        (project / f"tsconfig.{name}.json").write_text(json.dumps({
            "compilerOptions": {**options, "target": "es2022", "strict": True, "noEmit": True, "types": ["node"]},
            "files": ["main.ts"]}))
        p = run(["node", "node_modules/typescript/bin/tsc", "-p", f"tsconfig.{name}.json", "--pretty", "false",
                 "--listFiles"], TSC_TIMEOUT, cwd=project)
        assert p.returncode == 0 and "error TS" not in p.stdout, f"{name}: {tail(p)}"
        loaded = {Path(line) for line in p.stdout.splitlines()}
        assert dist / declarations in loaded, f"{name}: dist/{declarations} not loaded\n{tail(p)}"
