"""protocol/schema.json is generated from the declarations and must not go stale."""

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from operate_sidecar import protocol
from operate_sidecar.protocol import catalog, gen_schema, methods

ROOT = Path(__file__).resolve().parents[2]


def _wire_types() -> set[str]:
    return {name for name, v in vars(protocol).items() if isinstance(v, type) and attrs.has(v)}


def test_schema_json_is_up_to_date_with_the_declarations():
    on_disk = json.loads(gen_schema.SCHEMA_PATH.read_text(encoding="utf-8"))
    assert on_disk == gen_schema.build_schema(), "stale: run python -m operate_sidecar.protocol.gen_schema"


def test_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch):
    stale = tmp_path / "schema.json"
    stale.write_text(gen_schema.render().replace('"branchId"', '"branchID"', 1))
    monkeypatch.setattr(gen_schema, "SCHEMA_PATH", stale)
    assert gen_schema.main(["--check"]) == 1
    stale.write_text(gen_schema.render())
    assert gen_schema.main(["--check"]) == 0


def test_generator_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "operate_sidecar.protocol.gen_schema", "--stdout"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == gen_schema.build_schema()


def test_every_wire_type_has_a_def():
    schema = gen_schema.build_schema()
    assert _wire_types() <= set(schema["$defs"])


def test_schema_lists_every_method_and_notification():
    schema = gen_schema.build_schema()
    assert set(schema["methods"]) == set(methods.SERVER_REQUESTS) | set(methods.CLIENT_REQUESTS)
    assert set(schema["notifications"]) == set(methods.CLIENT_NOTIFICATIONS) | set(methods.SERVER_NOTIFICATIONS)
    assert {m for m, v in schema["methods"].items() if v["direction"] == "serverToClient"} == \
        set(methods.CLIENT_REQUESTS)


def test_strict_types_forbid_additional_properties_in_the_schema():
    defs = gen_schema.build_schema()["$defs"]
    assert defs["OperateParams"]["additionalProperties"] is False
    assert "additionalProperties" not in defs["ClientCapabilities"]


def test_schema_is_a_valid_draft_2020_12_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(gen_schema.build_schema())


def test_catalog_matches_method_lists():
    assert tuple(catalog.REQUESTS) == methods.SERVER_REQUESTS
    assert tuple(catalog.SERVER_TO_CLIENT_REQUESTS) == methods.CLIENT_REQUESTS
