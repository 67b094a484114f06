"""The two generators of committed files, ``python -m operate_sidecar.protocol.gen_schema`` (writes
protocol/schema.json) and ``clients/typescript/scripts/gen.mjs`` (writes src/generated/protocol.ts),
refuse an argument they do not know with the usage and exit code 2, and write nothing: a typo of
``--check`` (``--chek``) used to rewrite the file and say "wrote ...", exit 0. ``--help`` prints
the usage. Neither test touches the committed files: gen_schema writes to a scratch copy
(``SCHEMA_PATH``), gen.mjs is given ``--out`` in a temporary folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from operate_sidecar.protocol import gen_schema

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TS = ROOT / "clients" / "typescript"
STALE = "{}  (stale on purpose)\n"
MISTAKES = [["--chek"], ["--stdout-please"], ["check"], ["--check", "--stdout"], ["--check", "extra"]]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    path = tmp_path / "schema.json"
    path.write_text(STALE)
    monkeypatch.setattr(gen_schema, "SCHEMA_PATH", path)
    return path


@pytest.mark.parametrize("argv", MISTAKES)
def test_gen_schema_refuses_an_unknown_argument_and_writes_nothing(scratch, capsys, argv):
    with pytest.raises(SystemExit) as e:
        gen_schema.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m operate_sidecar.protocol.gen_schema "), err
    assert "error: " in err and "wrote" not in err, err
    assert scratch.read_text() == STALE


def test_gen_schema_help_prints_the_usage_and_writes_nothing(scratch, capsys):
    with pytest.raises(SystemExit) as e:
        gen_schema.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m operate_sidecar.protocol.gen_schema ") and "--check" in out, out
    assert scratch.read_text() == STALE


def test_gen_schema_still_checks_and_writes(scratch):
    assert gen_schema.main(["--check"]) == 1 and scratch.read_text() == STALE
    assert gen_schema.main([]) == 0 and scratch.read_text() == gen_schema.render()
    assert gen_schema.main(["--check"]) == 0


def node(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("node") is None:
        pytest.fail("node is required to run clients/typescript/scripts/gen.mjs")
    return subprocess.run(["node", "scripts/gen.mjs", *args], cwd=TS, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=90)


@pytest.mark.parametrize("argv", MISTAKES + [["--schema"], ["--out"]])
def test_gen_mjs_refuses_an_unknown_argument_and_writes_nothing(tmp_path, argv):
    generated = TS / "src" / "generated" / "protocol.ts"
    before = generated.stat().st_mtime_ns
    out = tmp_path / "protocol.ts"
    p = node(*argv, "--out", str(out)) if argv != ["--out"] else node(*argv)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stdout == "" and p.stderr.startswith("usage: node scripts/gen.mjs "), p.stderr
    assert "gen.mjs: error: " in p.stderr, p.stderr
    assert not out.exists() and generated.stat().st_mtime_ns == before


def test_gen_mjs_help_prints_the_usage(tmp_path):
    out = tmp_path / "protocol.ts"
    p = node("--help", "--out", str(out))
    assert p.returncode == 0 and p.stdout.startswith("usage: node scripts/gen.mjs ") and "--check" in p.stdout, p
    assert not out.exists()
