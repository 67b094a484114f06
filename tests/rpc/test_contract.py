"""The RPC layer's fast-path constants agree with protocol/ (the contract's typed copy).
server.rpc keeps its own copies so that nothing heavy is imported before initialize."""

from __future__ import annotations

from operate_sidecar import protocol
from operate_sidecar.protocol import errors as perr
from operate_sidecar.protocol import methods as pm

from operate_sidecar.server.rpc import errors as E
from operate_sidecar.server.rpc import transport


def test_error_codes_match_protocol():
    assert (E.PARSE_ERROR, E.INVALID_REQUEST, E.METHOD_NOT_FOUND, E.INVALID_PARAMS, E.INTERNAL_ERROR,
            E.NOT_INITIALIZED, E.REQUEST_CANCELLED, E.VALIDATION_FAILED, E.MODEL_ERROR, E.BRANCH_NOT_FOUND) == \
        (perr.PARSE_ERROR, perr.INVALID_REQUEST, perr.METHOD_NOT_FOUND, perr.INVALID_PARAMS, perr.INTERNAL_ERROR,
         perr.SERVER_NOT_INITIALIZED, perr.REQUEST_CANCELLED, perr.VALIDATION_FAILED, perr.MODEL_ERROR,
         perr.BRANCH_NOT_FOUND)


def test_method_and_notification_names_match_protocol():
    assert transport.REQUEST_METHODS == pm.SERVER_REQUESTS
    assert transport.SERVER_NOTIFICATIONS == pm.SERVER_NOTIFICATIONS
    assert transport.PROTOCOL_VERSION == protocol.PROTOCOL_VERSION


def test_settings_keys_match_protocol():
    import attrs

    from operate_sidecar.server.rpc import settings as S

    wire = {f.metadata.get("wire") or protocol.wire_name(f.name) for f in attrs.fields(protocol.Settings)}
    assert set(S.DEFAULTS) == wire


def test_importing_the_transport_pulls_in_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, server.rpc.run, server.__main__; "
            "heavy = [m for m in ('pygls', 'lsprotocol', 'pydantic', 'operate_sidecar.protocol', 'operate_sidecar.server.core', 'cattrs', "
            "'json_schema_to_pydantic', 'anyio') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=str(__import__("rpc.support", fromlist=["ROOT"]).ROOT), env=__import__("rpc.support", fromlist=["x"]).server_env())
    assert out.stdout.strip() == "[]", out.stderr
