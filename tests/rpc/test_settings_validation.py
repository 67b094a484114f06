"""initialize rejects a bad ModelConfig up front (docs/PROTOCOL.md §2 Settings / ModelConfig):
a typo or a wrong type in any ``settings.models`` entry is -32602 at initialize, naming
the model and the field, not at the model's first use. Valid configs are unchanged.

The per-provider field table (server/models/config.py) is the one that make_model and the
providers' from_config use; the last tests prove it agrees with the constructors and with
the wire types in protocol/, and that checking it imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .support import ANSWER_SCHEMA, ROOT, SERVER, TIMEOUT, scripted, server_env

INVALID_PARAMS = -32602
PREFIX = "invalid params: settings: "

# provider → (a config with one unknown field, the field), then (config, field) cases of bad types/values
CASES = {
    "local": (
        ({"provider": "local", "gguf": "/x.gguf"}, "gguf"),
        [({"provider": "local", "nThreads": "four"}, "nThreads"),
         ({"provider": "local", "nCtx": 4096.5}, "nCtx"),
         ({"provider": "local", "maxTokens": True}, "maxTokens"),
         ({"provider": "local", "options": ["temperature"]}, "options")],
    ),
    "openai": (
        ({"provider": "openai", "model": "m", "baseUrll": "http://127.0.0.1:1/v1"}, "baseUrll"),
        [({"provider": "openai", "model": "m", "timeoutS": "soon"}, "timeoutS"),
         ({"provider": "openai", "model": "m", "maxRetries": 1.5}, "maxRetries"),
         ({"provider": "openai", "model": 5}, "model"),
         ({"provider": "openai"}, "model")],
    ),
    "cli": (
        ({"provider": "cli", "profile": "llm", "cmd": ["llm"]}, "cmd"),
        [({"provider": "cli", "profile": "llm", "command": ["llm", 1]}, "command"),
         ({"provider": "cli", "profile": "llm", "env": {"K": 1}}, "env.K"),
         ({"provider": "cli", "profile": "llm", "promptVia": "pipe"}, "promptVia"),
         ({"provider": "cli", "profile": "bogus"}, "profile"),
         ({"provider": "cli"}, "profile"),
         ({"provider": "cli", "profile": "jsonl"}, "command")],
    ),
    "scripted": (
        ({"provider": "scripted", "response": ["x"]}, "response"),
        [({"provider": "scripted", "responses": "x"}, "responses"),
         ({"provider": "scripted", "responses": ["ok", {"delayMs": -1}]}, "responses[1].delayMs"),
         ({"provider": "scripted", "responses": [{"txt": "x"}]}, "txt"),
         ({"provider": "scripted", "responses": [], "cli": "yes"}, "cli"),
         ({"provider": "scripted", "responses": [], "timeoutS": 0}, "timeoutS")],
    ),
}


def init_error(sidecar, models: dict, **settings):
    err = sidecar.error_of("initialize", {"clientInfo": {"name": "pytest"}, "settings": {"models": models, **settings}})
    assert err.code == INVALID_PARAMS, err.message
    assert err.message.startswith(PREFIX), err.message
    return err.message


@pytest.mark.parametrize("provider", sorted(CASES))
def test_a_bad_field_or_type_is_invalid_params_at_initialize(sidecar, provider):
    (typo, typo_field), bad_types = CASES[provider]
    from operate_sidecar.server.models.config import FIELDS

    msg = init_error(sidecar, {"ok": scripted("x"), "fast": typo})
    assert msg == (f"{PREFIX}models.fast: unknown field '{typo_field}' "
                   f"({provider} accepts: {', '.join(sorted(FIELDS[provider]))})")
    for config, field in bad_types:
        msg = init_error(sidecar, {"ok": scripted("x"), "fast": config})
        assert msg.startswith(f"{PREFIX}models.fast: ") and field in msg, (config, msg)
    # a failed initialize changes nothing: the same server still initializes with a good config
    assert sidecar.init(models={"ok": scripted("x")})["capabilities"]["models"] == ["ok"]


def test_unknown_field_errors_never_echo_values(sidecar):
    msg = init_error(sidecar, {"gpt": {"provider": "openai", "model": "m", "apiKey": "sk-abcdef123456"}})
    assert "apiKey" in msg and "apiKeyEnv" in msg and "sk-abcdef123456" not in msg
    msg = init_error(sidecar, {"c": {"provider": "cli", "profile": "llm", "env": {"TOKEN": 12345678}}})
    assert "env.TOKEN must be a string" in msg and "12345678" not in msg


def test_unknown_missing_or_malformed_provider(sidecar):
    msg = init_error(sidecar, {"m": {"provider": "nope"}})
    assert msg == f"{PREFIX}models.m: unknown provider 'nope' (expected one of cli, local, openai, scripted)"
    assert "missing 'provider'" in init_error(sidecar, {"m": {"model": "x"}})
    assert "models.m: provider must be a string" in init_error(sidecar, {"m": {"provider": 5}})
    assert "models.m must be an object" in init_error(sidecar, {"m": "local"})


def test_an_empty_state_dir_is_refused_at_initialize_not_memory_only_in_silence(sidecar):
    """``stateDir: ""`` names no folder: it is refused (it made a server that kept nothing)."""
    assert "settings: stateDir must be a path (not empty) or null" in init_error(sidecar, {"s": scripted("x")},
                                                                                stateDir="")
    assert sidecar.init(models={"s": scripted("x")}, stateDir=None)["capabilities"]["models"] == ["s"]


def test_default_model_must_be_configured(sidecar):
    msg = init_error(sidecar, {"s": scripted("x")}, defaultModel="t")
    assert "defaultModel" in msg and "'t'" in msg
    r = sidecar.init(models={"s": scripted("x"), "t": scripted("y")}, defaultModel="t")
    assert r["capabilities"]["models"] == ["s", "t"]


VALID = {
    "loc": {"provider": "local", "path": "/nonexistent/model.gguf", "nCtx": 512, "nThreads": 1, "maxTokens": 8,
            "maxItems": 2, "maxStringLength": None, "options": {"temperature": 0}, "timeoutS": 30},
    "oai": {"provider": "openai", "model": "m", "baseUrl": "http://127.0.0.1:9/v1", "apiKeyEnv": None,
            "timeoutS": 1.5, "maxRetries": 0, "options": {"seed": 1}},
    "agent": {"provider": "cli", "profile": "jsonl", "command": "python3 agent.py", "cwd": "/tmp",
              "env": {"A": "b"}, "promptVia": "stdin", "timeoutS": 5, "killGraceS": 0.5},
    "claude": {"provider": "cli", "profile": "claude-code"},
    "s": {"provider": "scripted", "responses": [{"json": {"answer": "42"}, "chunks": 2, "delayMs": 0}, "t"],
          "cli": False, "timeoutS": 10},
}


def test_valid_configs_of_every_provider_initialize_and_scripted_still_operates(sidecar):
    r = sidecar.init(models=VALID, defaultModel="s")
    assert r["capabilities"]["models"] == list(VALID)
    for name in VALID:  # the constructors accept what initialize accepted (none of these runs a model)
        assert sidecar.branch(chatModel=name)
    bid = sidecar.branch()
    out = sidecar.request("operate", {"branchId": bid, "instruction": "q", "responseFormat": ANSWER_SCHEMA},
                          timeout=TIMEOUT)
    assert {k: out[k] for k in ("result", "kind", "model")} == \
        {"result": {"answer": "42"}, "kind": "model", "model": "AnswerResponse"}


def test_inline_model_configs_are_checked_too(sidecar):
    sidecar.init(models={"s": scripted("x")})
    for config, field in [({"provider": "openai", "model": "m", "baseUrll": "x"}, "baseUrll"),
                          ({"provider": "local", "nThreads": "four"}, "nThreads"),
                          ({"provider": "scripted", "responses": "x"}, "responses"),
                          ({"provider": "nope"}, "nope")]:
        err = sidecar.error_of("createBranch", {"chatModel": config})
        assert err.code == INVALID_PARAMS and "chatModel" in err.message and field in err.message, err.message
    assert sidecar.branch(chatModel=scripted("inline"))


def test_a_bad_model_in_the_config_file_exits_2_naming_it(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[models.fast]\nprovider = "openai"\nmodel = "m"\nbaseUrll = "x"\n')
    out = subprocess.run(SERVER + ["--config", str(cfg)], capture_output=True, text=True, env=server_env(),
                         cwd=ROOT, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stdout == ""
    assert "models.fast: unknown field 'baseUrll'" in out.stderr


# --- the table agrees with the constructors and the wire types ----------------------------

SAMPLES = {"string": "x", "integer": 3, "number": 1.5, "positive number": 2, "boolean": True, "object": {"k": 1},
           "string map": {"K": "v"}, "argv": ["prog", "arg"], "responses": ["t", {"text": "u"}], "inline thinking": "opened"}
WRONG = {"string": 5, "integer": "3", "number": "1.5", "positive number": "2", "boolean": "yes", "object": [1],
         "string map": {"K": 1}, "argv": [1], "responses": "t", "inline thinking": "open"}


def _sample_config(provider: str, override: dict | None = None) -> dict:
    from operate_sidecar.server.models.config import FIELDS

    cfg = {"provider": provider}
    for key, kind in FIELDS[provider].items():
        cfg[key] = kind[-1] if isinstance(kind, tuple) else SAMPLES[kind]
    if provider == "openai":  # a URL the baseUrl check takes (an http(s) scheme and a host)
        cfg["baseUrl"] = "http://localhost:8080/v1"
    cfg.update(override or {})
    return cfg


@pytest.mark.parametrize("provider", ["local", "openai", "cli", "scripted"])
def test_field_table_agrees_with_the_constructors(provider):
    from operate_sidecar.server.models import ModelConfigError, make_model
    from operate_sidecar.server.models.config import FIELDS, PROVIDERS

    assert set(FIELDS) == set(PROVIDERS)
    model = make_model(_sample_config(provider), name="every-field")  # every field, a valid value each
    assert model.name == "every-field"
    cls = type(model)
    if hasattr(sys.modules[cls.__module__], "CONFIG_FIELDS"):
        assert sys.modules[cls.__module__].CONFIG_FIELDS == set(FIELDS[provider])
    for key, kind in FIELDS[provider].items():  # each field, a wrong value: make_model and from_config refuse
        wrong = "not-a-choice" if isinstance(kind, tuple) else WRONG[kind]
        config = _sample_config(provider, {key: wrong})
        with pytest.raises(ModelConfigError, match=key):
            make_model(config, name="bad")
        with pytest.raises(ModelConfigError, match=key):
            cls.from_config("bad", config)
    with pytest.raises(ModelConfigError, match="unknown field 'typo'"):
        cls.from_config("bad", _sample_config(provider, {"typo": 1}))


def test_field_table_agrees_with_the_wire_types():
    import attrs

    from operate_sidecar.protocol import CliModelConfig, LocalModelConfig, OpenAIModelConfig, ScriptedEntry, ScriptedModelConfig
    from operate_sidecar.protocol._base import wire_name
    from operate_sidecar.server.models.config import ENTRY_FIELDS, FIELDS, REQUIRED

    def keys(cls) -> set[str]:
        return {f.metadata.get("wire", wire_name(f.name)) for f in attrs.fields(cls)} - {"provider"}

    def required(cls) -> set[str]:
        return {wire_name(f.name) for f in attrs.fields(cls) if f.default is attrs.NOTHING}

    for provider, cls in [("local", LocalModelConfig), ("openai", OpenAIModelConfig), ("cli", CliModelConfig),
                          ("scripted", ScriptedModelConfig)]:
        assert keys(cls) == set(FIELDS[provider]), provider
        # the server is as lenient as today for scripted.responses (missing = no responses)
        assert required(cls) - {"responses"} == set(REQUIRED.get(provider, ())), provider
    assert keys(ScriptedEntry) == set(ENTRY_FIELDS)


def test_the_check_imports_nothing_heavy():
    """initialize is the cold-start path: checking models, and the settings' nesting depth
    (checked before anything else, on initialize's settings and a --config file), must not import
    pydantic, the core, the protocol package, a provider module or an SDK."""
    code = (
        "import json, sys\n"
        "import server.rpc.transport\n"
        "from operate_sidecar.server.rpc import settings as S\n"
        "S.check_depth({'models': {'a': {'b': [1, {'c': 2}]}}})\n"
        "try:\n"
        "    S.check_depth(json.loads('[' * 100 + ']' * 100))\n"
        "except S.SettingsError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('nesting 100 deep not refused')\n"
        f"models = json.loads({json.dumps(json.dumps(VALID))})\n"
        "S.finalize(S.merge(S.DEFAULTS, {'models': models}))\n"
        "try:\n"
        "    S.finalize(S.merge(S.DEFAULTS, {'models': {'x': {'provider': 'local', 'nThreads': 'four'}}}))\n"
        "except S.SettingsError as e:\n"
        "    assert 'nThreads' in str(e)\n"
        "else:\n"
        "    raise SystemExit('not rejected')\n"
        "heavy = ('pydantic', 'operate_sidecar.server.core', 'llama_cpp', 'openai', 'httpx', 'anyio', 'attrs', 'cattrs', 'operate_sidecar.protocol',\n"
        "         'operate_sidecar.server.models.local', 'operate_sidecar.server.models.openai_compat', 'operate_sidecar.server.models.cli', 'operate_sidecar.server.models.scripted')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy\n"
        "                        or any(m.startswith(h + '.') for h in heavy))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=server_env(), cwd=ROOT,
                         timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


# --- numeric bounds: a double's range, finite, and what each field can use ---------------------

HUGE = 10**400  # an integer JSON carries but no double holds (the wire refuses it; so do settings)


def test_settings_bounds_beyond_a_double_or_a_usable_time_out_are_refused_at_initialize(sidecar):
    """A bound of 10**400 was accepted and the first createBranch answered -32603 (OverflowError);
    a time-out is held to about 31 years (the timers it reaches overflow far above that)."""
    from operate_sidecar.server.rpc.settings import MAX_TIMEOUT_MS, POSITIVE_INT_KEYS

    for key in POSITIVE_INT_KEYS:
        err = sidecar.error_of("initialize", {"settings": {"models": {"s": scripted("x")}, key: HUGE}})
        assert err.code == INVALID_PARAMS, (key, err.message)
        assert err.message == f"{PREFIX}{key} must be a number within a double's range " \
                              "(at most 1.8e308 in size)", err.message
    for key in ("permissionTimeoutMs", "toolTimeoutMs"):
        err = sidecar.error_of("initialize", {"settings": {"models": {"s": scripted("x")}, key: MAX_TIMEOUT_MS + 1}})
        assert err.code == INVALID_PARAMS and f"settings: {key} must be at most {MAX_TIMEOUT_MS}" in err.message
    # at the bounds: accepted, and the server works with them
    big = {key: 10**300 for key in POSITIVE_INT_KEYS} | {"permissionTimeoutMs": MAX_TIMEOUT_MS,
                                                           "toolTimeoutMs": MAX_TIMEOUT_MS}
    sidecar.init(models={"s": scripted("ok")}, **big)
    out = sidecar.request("operate", {"branchId": sidecar.branch(), "instruction": "q"}, timeout=TIMEOUT)
    assert out["result"] == "ok"


# (config, the field named) for every numeric field of every provider: beyond a double, not
# finite (TOML's inf/nan), or beyond what the provider can use
OUT_OF_BOUNDS = [
    ({"provider": "scripted", "responses": ["x"], "timeoutS": HUGE}, "timeoutS must be a number within a double's range"),
    ({"provider": "scripted", "responses": [{"text": "x", "delayMs": HUGE}]}, "responses[0].delayMs must be a number within"),
    ({"provider": "scripted", "responses": [{"text": "x", "delayMs": 1e300}]}, "responses[0].delayMs must be at most 1000000000000"),
    ({"provider": "scripted", "responses": [{"text": "x", "chunks": HUGE}]}, "responses[0].chunks must be a number within"),
    ({"provider": "local", "nCtx": 10**30}, "nCtx must be at most 4294967295"),
    ({"provider": "local", "nCtx": 0}, "nCtx must be at least 1"),
    ({"provider": "local", "nThreads": 10**6}, "nThreads must be at most 512"),
    ({"provider": "local", "nThreads": -1}, "nThreads must be at least 1"),
    ({"provider": "local", "maxTokens": 2**40}, "maxTokens must be at most 2147483647"),
    ({"provider": "local", "maxItems": 5000}, "maxItems must be at most 1000"),
    ({"provider": "local", "maxStringLength": 10**6}, "maxStringLength must be at most 1000"),
    ({"provider": "local", "maxStringLength": -1}, "maxStringLength must be at least 0"),
    ({"provider": "local", "timeoutS": 1e10}, "timeoutS must be at most 1000000000"),
    ({"provider": "openai", "model": "m", "maxRetries": 10**6}, "maxRetries must be at most 100"),
    ({"provider": "openai", "model": "m", "timeoutS": HUGE}, "timeoutS must be a number within"),
    ({"provider": "cli", "profile": "llm", "killGraceS": 10**6}, "killGraceS must be at most 300"),
    ({"provider": "cli", "profile": "llm", "timeoutS": HUGE}, "timeoutS must be a number within"),
]


def test_model_numbers_out_of_range_are_refused_at_initialize_naming_the_field(sidecar):
    """timeoutS or delayMs of 10**400 was accepted and the first operate answered -32603; nCtx of
    10**30 wrapped in llama.cpp's uint32 and allocated a gigantic context; nThreads of 10**6
    tried to start a million threads; maxItems/maxStringLength in the thousands crashed llama.cpp."""
    for config, expected in OUT_OF_BOUNDS:
        msg = init_error(sidecar, {"ok": scripted("x"), "m": config})
        assert msg.startswith(f"{PREFIX}models.m: {expected}"), (config, msg)
    bounds = {"provider": "local", "nCtx": 2**32 - 1, "nThreads": 512, "maxTokens": 2**31 - 1, "maxItems": 1000,
              "maxStringLength": 1000, "timeoutS": 1e9}
    assert sidecar.init(models={"l": bounds, "s": {"provider": "scripted", "responses": [
        {"text": "x", "delayMs": 1e12, "chunks": 10**300}], "timeoutS": 1e9}})["capabilities"]["models"] == ["l", "s"]


def test_non_finite_numbers_in_the_config_file_exit_2_naming_them(tmp_path):
    """TOML has inf, nan and integers of any length: each is refused at start-up, naming the key."""
    for body, expected in [
        ('[models.m]\nprovider = "scripted"\nresponses = ["x"]\ntimeoutS = inf\n', "models.m: timeoutS must be a finite number"),
        ('[models.m]\nprovider = "cli"\nprofile = "llm"\nkillGraceS = nan\n', "models.m: killGraceS must be a finite number"),
        (f"toolTimeoutMs = {HUGE}\n", "bad configuration: toolTimeoutMs must be a number within a double's range"),
        ("permissionTimeoutMs = 10_000_000_000_000\n", "bad configuration: permissionTimeoutMs must be at most"),
    ]:
        cfg = tmp_path / "bad.toml"
        cfg.write_text(body)
        out = subprocess.run(SERVER + ["--config", str(cfg)], capture_output=True, text=True, env=server_env(),
                             cwd=ROOT, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        assert out.returncode == 2 and out.stdout == "", (body, out.stderr)
        assert expected in out.stderr, (body, out.stderr)


def test_inline_models_out_of_range_are_refused_too(sidecar):
    sidecar.init(models={"s": scripted("x")})
    for config in ({"provider": "local", "nCtx": 10**30}, {"provider": "local", "nThreads": 10**6},
                   {"provider": "scripted", "responses": [{"text": "x", "delayMs": 1e300}]}):
        err = sidecar.error_of("createBranch", {"chatModel": config})
        assert err.code == INVALID_PARAMS and "chatModel" in err.message, err.message


def test_a_model_picker_describes_each_provider_by_what_it_runs(tmp_path, monkeypatch):
    """``config.describe`` (the ACP Model option's descriptions): the embedded model by its GGUF
    file (the default one found in the installed package, else the package to install), an API
    model by its name and server, a command-line model by its command."""
    from operate_sidecar.server.models import config as C

    assert C.describe({"provider": "local"}) == \
        "embedded llama.cpp model, runs offline: " + C.default_local_model().rsplit("/", 1)[1]
    monkeypatch.setattr(C, "_FOUND", [])
    monkeypatch.setattr(C, "LOCAL_MODEL_PACKAGE", "no_such_package_here")
    assert C.describe({"provider": "local"}) == \
        "embedded llama.cpp model, runs offline: the default model (no_such_package_here)"
    assert C.describe({"provider": "openai", "model": "gpt-4o-mini"}) == \
        "gpt-4o-mini at the OpenAI API (OpenAI-compatible API)"
    assert C.describe({"provider": "cli", "profile": "claude-code"}) == "command-line model (claude-code)"
    assert C.describe({"provider": "cli", "profile": "jsonl", "command": "my-model --json"}) == \
        "command-line model (jsonl): my-model --json"
