"""What ``initialize`` says of a bad setting, as a user reads it: the answer already says
``invalid params: settings: ``, so the field is named once after it (it read ``settings:
settings.defaultModel ...``), and a ``defaultModel`` that is not a configured model names the
one it is closest to, as session scripts' errors do (``did you mean ...?``), else the configured
ones."""

from __future__ import annotations

import pytest

from .support import scripted

pytestmark = pytest.mark.timeout(60)

PREFIX = "invalid params: settings: "
DEEP: list = []
for _ in range(40):
    DEEP = [DEEP]


def init_error(sidecar, **settings) -> str:
    err = sidecar.error_of("initialize", {"clientInfo": {"name": "pytest"}, "settings": settings})
    assert err.code == -32602, err.message
    assert err.message.startswith(PREFIX), err.message
    assert "settings: settings" not in err.message and "settings.settings" not in err.message, err.message
    return err.message[len(PREFIX):]


def test_a_misspelt_default_model_names_the_closest_configured_one(sidecar):
    models = {"gpt": scripted("x"), "local-small": scripted("y")}
    assert init_error(sidecar, models=models, defaultModel="gtp") == \
        "defaultModel 'gtp' is not a configured model (did you mean 'gpt'?)"
    assert init_error(sidecar, models=models, defaultModel="claude") == \
        "defaultModel 'claude' is not a configured model (configured: gpt, local-small)"
    assert sidecar.init(models=models, defaultModel="gpt")["capabilities"]["models"] == ["gpt", "local-small"]


@pytest.mark.parametrize("settings, message", [
    ({"toolPolicy": {"write_file": "maybe"}}, "toolPolicy.write_file must be one of allow, deny, ask"),
    ({"maxBranches": 0}, "maxBranches must be a positive integer"),
    ({"stateDir": ""}, "stateDir must be a path (not empty) or null"),
    ({"toolModules": "mypackage.tools"}, "toolModules must be a list of module names"),
    ({"mcpServers": {"git": {"cmd": ["x"]}}}, "mcpServers.git: unknown field(s) cmd (expected command, env)"),
    ({"secretEnv": [""]}, "secretEnv must be a list of environment variable names"),
    ({"models": {"m": scripted("x")}, "defaultModel": 5}, "defaultModel must be a model name"),
    ({"toolModules": DEEP}, "nested more than 32 levels deep"),
])
def test_a_bad_setting_is_named_once(sidecar, settings, message):
    assert init_error(sidecar, **settings) == message
