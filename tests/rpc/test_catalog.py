"""The native front end serves what the protocol package declares, and nothing it keeps by
hand drifts from it.

Dispatch: the pygls app registers a handler for every client → server request of
``protocol.catalog`` (the connection answers ``initialize``, ``ping`` and ``shutdown`` itself).
The fast path (``server.rpc.transport``, ``settings``, ``errors``, ``server.models.config``)
keeps copies of names, gates, fields and codes so that ``initialize`` is answered before the
protocol package is imported; each copy is pinned here to the protocol's declaration.
"""

from __future__ import annotations

import types
import typing

import attrs
import pytest

from operate_sidecar import protocol
from operate_sidecar.protocol import catalog
from operate_sidecar.protocol import errors as perr
from operate_sidecar.protocol import methods as pm
from operate_sidecar.protocol._base import wire_name
from operate_sidecar.server.rpc import errors as E
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.rpc import transport

from .support import TIMEOUT, scripted

# ------------------------------------------------------------------ served over the wire


def _params_for(method: str) -> dict:
    return {"createBranch": {"name": "catalog"}}.get(method, {})


def test_every_request_the_catalog_declares_is_served(sidecar):
    """A method added to the catalog without a handler (or missing from the connection's
    routing table) is answered -32601 here."""
    sidecar.init(models={"s": scripted("x")})
    last = [m for m in catalog.REQUESTS if m == pm.SHUTDOWN]  # it ends the session: last
    for method in [m for m in catalog.REQUESTS if m != pm.SHUTDOWN] + last:
        try:
            sidecar.request(method, _params_for(method), timeout=TIMEOUT)
        except Exception as e:  # an answer, even an error one, is fine; -32601 is not
            assert getattr(e, "code", None) != E.METHOD_NOT_FOUND, f"{method} is declared but not served: {e}"


def test_initialize_advertises_exactly_the_catalog(sidecar):
    caps = sidecar.init()["capabilities"]
    assert caps["methods"] == list(catalog.REQUESTS)
    assert caps["notifications"] == list(catalog.SERVER_NOTIFICATIONS)


@pytest.mark.parametrize("method", ["renameBranch", pm.REQUEST_TOOL_PERMISSION, pm.FS_READ_TEXT_FILE, "Operate"])
def test_a_method_the_catalog_does_not_declare_is_method_not_found(sidecar, method):
    sidecar.init()
    assert sidecar.error_of(method, {}).code == E.METHOD_NOT_FOUND


def test_the_app_registers_a_handler_for_every_catalog_request():
    """The app's registration (server.rpc.server) comes from the catalog, by name."""
    from operate_sidecar.server.rpc.server import app_methods, handler_name
    from operate_sidecar.server.service.service import Service

    assert set(app_methods()) | set(transport.CONNECTION_METHODS) == set(catalog.REQUESTS)
    missing = [m for m in app_methods() if not callable(getattr(Service, handler_name(m), None))]
    assert missing == [], f"declared in protocol/catalog.py but no Service handler: {missing}"


# ------------------------------------------------------------------ fast-path tables


def test_the_routing_tables_are_the_catalogs():
    assert transport.REQUEST_METHODS == tuple(catalog.REQUESTS) == pm.SERVER_REQUESTS
    assert transport.SERVER_NOTIFICATIONS == tuple(catalog.SERVER_NOTIFICATIONS)
    assert set(transport.CONNECTION_METHODS) <= set(catalog.REQUESTS)
    assert transport._APP_METHODS == set(catalog.REQUESTS) - set(transport.CONNECTION_METHODS)
    assert transport.BEFORE_INITIALIZE == pm.ALLOWED_BEFORE_INITIALIZE
    assert transport.AFTER_SHUTDOWN == pm.ALLOWED_AFTER_SHUTDOWN
    assert transport.PROTOCOL_VERSION == protocol.PROTOCOL_VERSION


def _wire_keys(cls: type) -> set[str]:
    return {f.metadata.get("wire") or wire_name(f.name) for f in attrs.fields(cls)}


def test_the_initialize_fields_are_the_protocols():
    assert transport._INIT_KEYS == _wire_keys(protocol.InitializeParams)
    assert transport._CAPABILITY_KEYS == _wire_keys(protocol.ClientCapabilities)


def test_the_error_codes_are_the_protocols():
    ours = {name: v for name, v in vars(E).items() if name.isupper() and type(v) is int}
    assert set(ours.values()) == set(perr.ERROR_CODES.values())
    renamed = {"NOT_INITIALIZED": "SERVER_NOT_INITIALIZED"}
    for name, value in ours.items():
        assert getattr(perr, renamed.get(name, name)) == value, name


def _arms(annotation: typing.Any) -> set:
    """The types of a field annotation, with ``None`` and ``Omitted`` dropped."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        out: set = set()
        for a in typing.get_args(annotation):
            out |= _arms(a)
        return out
    if annotation is type(None) or annotation is protocol.Omitted:
        return set()
    return {annotation}


def _fields_of_kind(cls: type, pred) -> set[str]:
    hints = typing.get_type_hints(cls)
    return {f.metadata.get("wire") or wire_name(f.name) for f in attrs.fields(cls)
            if (arms := _arms(hints[f.name])) and all(pred(a) for a in arms)}


def test_the_settings_table_is_the_protocols():
    Settings = protocol.Settings
    assert set(S.DEFAULTS) == _wire_keys(Settings)
    # every integer setting is a bound: checked positive (maxMessageBytes: 0 once slipped through)
    assert set(S.POSITIVE_INT_KEYS) == _fields_of_kind(Settings, lambda a: a is int)
    # the object-valued settings merge entry by entry across config layers
    assert set(S._DICT_KEYS) == _fields_of_kind(Settings, lambda a: typing.get_origin(a) is dict)
    assert set(S._POLICIES) == set(typing.get_args(protocol.Decision))
    assert set(S._MCP_KEYS) == _wire_keys(protocol.McpServerConfig)


def test_a_zero_bound_is_refused_for_every_integer_setting(sidecar):
    for key in sorted(_fields_of_kind(protocol.Settings, lambda a: a is int)):
        err = sidecar.error_of("initialize", {"settings": {key: 0}})
        assert err.code == E.INVALID_PARAMS and key in str(err), key


_MODEL_CLASSES = typing.get_args(protocol.ModelConfig)


def _provider(cls: type) -> str:
    (value,) = typing.get_args(typing.get_type_hints(cls)["provider"])
    return value


def test_the_model_provider_table_is_the_protocols():
    from operate_sidecar.server.models import config as C

    providers = {_provider(cls) for cls in _MODEL_CLASSES}
    assert set(C.PROVIDERS) == set(C.FIELDS) == providers
    assert set(C.CLI_PROFILES) == set(typing.get_args(protocol.CliProfile))
    prompt_via = typing.get_type_hints(protocol.CliModelConfig)["prompt_via"]
    assert {v for a in _arms(prompt_via) for v in typing.get_args(a)} == set(C.PROMPT_VIA)


_KINDS = {int: {"integer", "positive integer"}, float: {"number", "positive number"},
          str: {"string"}, bool: {"boolean"}}


def test_the_model_field_kinds_are_the_protocols():
    """Each field's JSON kind in ``server.models.config.FIELDS`` matches the wire type."""
    from operate_sidecar.server.models import config as C

    for cls in _MODEL_CLASSES:
        hints = typing.get_type_hints(cls)
        table = C.FIELDS[_provider(cls)]
        for f in attrs.fields(cls):
            name = f.metadata.get("wire") or wire_name(f.name)
            if name == "provider":
                continue
            assert name in table, f"{_provider(cls)}.{name} is on the wire but not checked"
            arms = _arms(hints[f.name])
            kind = table[name]
            (arm,) = arms if len(arms) == 1 else (None,)
            if arm in _KINDS:
                assert kind in _KINDS[arm], f"{_provider(cls)}.{name}: {kind} vs {arm}"
            elif typing.get_origin(arm) is typing.Literal:
                assert set(kind) == set(typing.get_args(arm)), f"{_provider(cls)}.{name}"
            elif typing.get_origin(arm) is dict:
                assert kind in {"object", "string map"}, f"{_provider(cls)}.{name}: {kind}"
            elif typing.get_origin(arm) is list:
                assert kind in {"argv", "responses"}, f"{_provider(cls)}.{name}: {kind}"
            elif set(arms) == {bool, typing.Literal["opened"]}:
                assert kind == "inline thinking", f"{_provider(cls)}.{name}: {kind}"
