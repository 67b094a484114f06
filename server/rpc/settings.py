"""Settings (the `initialize` settings of docs/PROTOCOL.md): defaults ← command-line flags ← ``--config`` TOML file
← ``initialize.settings``. Dict-valued keys (``models``, ``toolPolicy``,
``mcpServers``) merge per entry; every other key is replaced."""

from __future__ import annotations

import copy
import json
import re
import sys
from typing import Any

from operate_sidecar.server import redaction as _redaction
from operate_sidecar.server.nesting import too_deep

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_PERMISSION_TIMEOUT_MS = 120_000
DEFAULT_TOOL_TIMEOUT_MS = 120_000        # tools without their own time-out (client and MCP tools included)
DEFAULT_MAX_TOOL_OUTPUT_CHARS = 100_000   # a tool output longer than this (as JSON) is kept as a preview
DEFAULT_MAX_CONCURRENT_OPERATES = 256     # more operates wait, in arrival order (cancellable)
DEFAULT_MAX_BRANCHES = 10_000
DEFAULT_MAX_MESSAGES_PER_BRANCH = 100_000
DEFAULT_MODEL_NAME = "local"
DEFAULT_MODEL_CONFIG: dict[str, Any] = {"provider": "local"}

DEFAULTS: dict[str, Any] = {
    "models": {},
    "defaultModel": None,
    "toolPolicy": {},
    "permissionTimeoutMs": DEFAULT_PERMISSION_TIMEOUT_MS,
    "mcpServers": {},
    "toolModules": [],
    "stateDir": None,
    "maxMessageBytes": DEFAULT_MAX_MESSAGE_BYTES,
    "toolTimeoutMs": DEFAULT_TOOL_TIMEOUT_MS,
    "maxToolOutputChars": DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    "maxConcurrentOperates": DEFAULT_MAX_CONCURRENT_OPERATES,
    "maxBranches": DEFAULT_MAX_BRANCHES,
    "maxMessagesPerBranch": DEFAULT_MAX_MESSAGES_PER_BRANCH,
    "secretEnv": [],
}

#: bounds that must be positive integers: every integer field of ``protocol.Settings``. This
#: module's tables (DEFAULTS, these keys, the merged and policy tables) are copies kept off the
#: cold-start path; tests/rpc/test_catalog.py pins each to the protocol's declaration.
POSITIVE_INT_KEYS = ("maxMessageBytes", "permissionTimeoutMs", "toolTimeoutMs", "maxToolOutputChars",
                     "maxConcurrentOperates", "maxBranches", "maxMessagesPerBranch")

#: the largest value of each bound where a larger one cannot work: a time-out is a float of
#: seconds in the timers it reaches (at most about 31 years, "never" for a call); every other
#: bound is only held to JSON's integer range (a double's, the wire's rule)
MAX_TIMEOUT_MS = 10**12
MAXIMUM: dict[str, int] = {"permissionTimeoutMs": MAX_TIMEOUT_MS, "toolTimeoutMs": MAX_TIMEOUT_MS}
MAX_JSON_INT = int(sys.float_info.max)

#: settings deeper than this (objects/arrays inside one another) are refused at once: no
#: setting needs more, and a deep value would otherwise exhaust the recursion limit
MAX_SETTINGS_DEPTH = 32

_DICT_KEYS = ("models", "toolPolicy", "mcpServers")
_POLICIES = ("allow", "deny", "ask")


class SettingsError(ValueError):
    pass


def check_depth(value: Any, limit: int = MAX_SETTINGS_DEPTH, where: str = "") -> None:
    """SettingsError when ``value`` nests objects/arrays more than ``limit`` deep (iterative:
    any depth is measured without recursion, in memory that grows with the depth only: the
    one walk, ``server.nesting.too_deep``). ``where`` names what is nested (``<file>: the
    settings``); without it the message is bare, for a caller that says "settings" itself."""
    if too_deep(value, limit)[0] is not None:
        raise SettingsError(f"{where} are nested more than {limit} levels deep" if where
                            else f"nested more than {limit} levels deep")


def merge(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in (over or {}).items():
        if key in _DICT_KEYS and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_toml(path: str) -> dict[str, Any]:
    """A ``--config`` file's settings; SettingsError for nesting deeper than ``MAX_SETTINGS_DEPTH``,
    as on the wire (a deep one would exhaust the parser's recursion). What JSON cannot hold is
    found by ``not_json`` once the fields are checked.

    The settings are top-level keys, a ``[settings]`` table, or both: TOML puts every key after
    ``[settings]`` in that table and a later ``[models.m]`` back at the top, so a file may well
    mix them, and each key then means one setting; a setting given in both places is refused,
    naming it. A UTF-8 byte-order mark at the start (as Windows editors write one) is skipped,
    as session scripts skip it."""
    import codecs
    import tomllib

    with open(path, "rb") as f:
        raw = f.read().removeprefix(codecs.BOM_UTF8)
    try:
        data = tomllib.loads(raw.decode("utf-8"))  # (UnicodeDecodeError: the caller says "not UTF-8 text")
    except RecursionError:
        raise SettingsError(f"{path}: the settings are nested more than {MAX_SETTINGS_DEPTH} levels deep") \
            from None
    table = data.get("settings")
    if isinstance(table, dict):
        top = {k: v for k, v in data.items() if k != "settings"}
        both = [k for k in table if k in top]
        if both:
            raise SettingsError(f"{path}: {', '.join(both)} {'is' if len(both) == 1 else 'are'} set both at the "
                                "top level and in the [settings] table; set each setting once")
        data = {**top, **table}
    check_depth(data, where=f"{path}: the settings")
    return data


def not_json(settings: dict[str, Any]) -> str | None:
    """The first value (in the file's order) of a ``--config`` file's settings that JSON cannot
    hold (a TOML date or time, a NaN or infinity), named by its key path, or None. The file's
    settings are those ``initialize`` may send: a value in a free-form object (a model's
    ``options``) would otherwise go on to a provider and fail there, at the first operate."""
    import datetime
    import math

    def key(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k, ensure_ascii=False)

    stack: list[tuple[str, Any]] = [(key(k), v) for k, v in reversed(settings.items())]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{where}.{key(k)}", x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, (datetime.date, datetime.time)):  # (a datetime is a date)
            kind = "date-time" if isinstance(v, datetime.datetime) else type(v).__name__
            return (f"{where} is a TOML {kind} ({v.isoformat()}), which no setting holds "
                    "(settings are JSON values: write it as a quoted string)")
        elif isinstance(v, float) and not math.isfinite(v):
            return f"{where} is {v}, not a finite number (settings are JSON values)"
    return None


def finalize(settings: dict[str, Any]) -> dict[str, Any]:
    """Validate and fill the derived defaults (default model). Each ModelConfig is checked
    field by field (``server.models.config``), so a typo fails here, not at first use.

    The secret values the settings name or hold (``secret_values``) are registered for
    redaction first, before any check: settings that are refused (an ``initialize`` answered
    -32602, a ``--record`` session script that keeps them) are masked too."""
    s = settings
    _register_secrets(s)  # every front end's settings pass here: one registration point
    if not isinstance(s.get("models"), dict):
        raise SettingsError("models must be an object")
    if s["models"]:  # every field of every model, up front (ModelConfig)
        from operate_sidecar.server.models.config import ModelConfigError, check_model_config  # a table; no provider

        for name, cfg in s["models"].items():
            try:
                check_model_config(cfg, f"models.{name}")
            except ModelConfigError as e:
                raise SettingsError(str(e)) from None
    if not s["models"]:
        s["models"] = {DEFAULT_MODEL_NAME: dict(DEFAULT_MODEL_CONFIG)}
    if s.get("defaultModel") is not None and not isinstance(s["defaultModel"], str):
        raise SettingsError("defaultModel must be a model name")
    if s.get("defaultModel") == "":  # (it meant the first model in silence)
        raise SettingsError("defaultModel must be a model name, not empty (leave it out for the first model)")
    if not s.get("defaultModel"):
        s["defaultModel"] = next(iter(s["models"]))
    elif s["defaultModel"] not in s["models"]:
        raise SettingsError(f"defaultModel {s['defaultModel']!r} is not a configured model"
                            + _closest_model(s["defaultModel"], s["models"]))
    if not isinstance(s.get("toolPolicy"), dict):
        raise SettingsError("toolPolicy must be an object")
    for tool, decision in s["toolPolicy"].items():
        if decision not in _POLICIES:
            raise SettingsError(f"toolPolicy.{tool} must be one of {', '.join(_POLICIES)}")
    for key in POSITIVE_INT_KEYS:
        v = s.get(key)
        if type(v) is not int or v < 1:
            raise SettingsError(f"{key} must be a positive integer")
        if v > MAX_JSON_INT:
            raise SettingsError(f"{key} must be a number within a double's range "
                                "(at most 1.8e308 in size)")
        if v > MAXIMUM.get(key, v):
            raise SettingsError(f"{key} must be at most {MAXIMUM[key]} (about 31 years), not {v}")
    if not isinstance(s.get("toolModules"), list) or not all(isinstance(m, str) for m in s["toolModules"]):
        raise SettingsError("toolModules must be a list of module names")
    stdlib = [m for m in s["toolModules"] if _is_stdlib_module(m)]
    if stdlib:
        raise SettingsError(f"toolModules: {', '.join(map(repr, stdlib))} "
                            f"{'is a module' if len(stdlib) == 1 else 'are modules'} of the Python standard "
                            "library; only your own tool modules can be loaded")
    if not isinstance(s.get("mcpServers"), dict):
        raise SettingsError("mcpServers must be an object")
    for name, spec in s["mcpServers"].items():
        problem = _mcp_problem(spec)
        if problem:
            raise SettingsError(f"mcpServers.{name}: {problem}")
    secret_env = s.get("secretEnv")
    if not isinstance(secret_env, list) or not all(isinstance(n, str) and n for n in secret_env):
        raise SettingsError("secretEnv must be a list of environment variable names")
    if s.get("stateDir") is not None and (not isinstance(s["stateDir"], str) or not s["stateDir"]):
        # "" is no path: it would have kept nothing on disk, in silence
        raise SettingsError("stateDir must be a path (not empty) or null")
    _register_secrets(s)  # (again: a default filled in above may name one)
    resolve_paths(s)
    return s


def resolve_paths(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (changed in place, and returned) with every path setting absolute: the
    ``stateDir``, a ``local`` model's ``path`` and a ``cli`` model's ``cwd``, a leading ``~``
    expanded (an editor passes arguments without a shell, so nobody else does), a relative path
    taken against the server's working directory, wherever it was given (a flag, the ``--config``
    file, ``initialize``): as it always was, so that a state directory a user has does not move
    (an editor starts the server in the project's folder: a ``stateDir = "state"`` is the
    project's). So ``initialize`` reports the folder it uses, and a message names the file it
    looked for. Values of the wrong type, and empty ones, are left for :func:`finalize` to
    refuse."""
    import os

    def absolute(path: Any) -> Any:
        if not isinstance(path, str) or not path or "\0" in path:
            return path
        return os.path.abspath(os.path.expanduser(path))

    if "stateDir" in settings:
        settings["stateDir"] = absolute(settings["stateDir"])
    models = settings.get("models")
    for cfg in (models.values() if isinstance(models, dict) else ()):
        if isinstance(cfg, dict):
            provider = cfg.get("provider")
            key = {"local": "path", "cli": "cwd"}.get(provider) if isinstance(provider, str) else None
            if key and key in cfg:
                cfg[key] = absolute(cfg[key])
    return settings


def _register_secrets(settings: dict[str, Any]) -> None:
    from .. import redaction  # standard library only

    for value in secret_values(settings):
        redaction.remember_secret(value)


def _closest_model(name: str, models: dict[str, Any]) -> str:
    """`` (did you mean 'gpt'?)`` for the configured model a misspelt name is closest to, else
    the configured names."""
    from operate_sidecar.server.script.matcher import did_you_mean  # (the error path only)

    meant = did_you_mean(name, [m for m in models if isinstance(m, str)])
    return f" (did you mean {meant!r}?)" if meant else " (configured: " + ", ".join(map(str, models)) + ")"


def _is_stdlib_module(name: str) -> bool:
    import sys

    top = name.strip().split(".", 1)[0]
    return top in sys.stdlib_module_names


_MCP_KEYS = ("command", "env")


def _mcp_problem(spec: Any) -> str | None:
    """Why an ``mcpServers`` entry has the wrong shape (None when it is right)."""
    if not isinstance(spec, dict):
        return f"must be an object {{command, env}}, got {type(spec).__name__}"
    unknown = [k for k in spec if k not in _MCP_KEYS]
    if unknown:
        return "unknown field(s) " + ", ".join(map(str, unknown)) + " (expected command, env)"
    cmd = spec.get("command")
    if not isinstance(cmd, list) or not cmd or not all(isinstance(c, str) and c for c in cmd):
        return "command must be a non-empty list of strings (the executable, then its arguments)"
    env = spec.get("env")
    if env is not None and (not isinstance(env, dict)
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        return "env must be an object of strings"
    return None


def secret_values(settings: dict[str, Any]) -> list[str]:
    """The secret values the settings name or hold: those of every model
    (``redaction.model_secrets``: the values of the environment variables every model's
    ``apiKeyEnv`` names, ``OPENAI_API_KEY`` for an ``openai`` model without one; a CLI model's
    ``env`` entry named like ``SECRET_ENV_NAME``, ``API_KEY``, ``GITHUB_TOKEN``, ``DB_PASSWORD``
    ...; a header of a model's ``options.extraHeaders`` named like ``redaction.SECRET_HEADER_NAME``,
    ``Authorization``, ``X-Api-Key`` ..., whole and without its scheme, ``Bearer``, ``Basic``; a
    key pasted as an ``apiKeyEnv``), the values of the variables every name in ``secretEnv``
    lists, and an ``env`` entry of an MCP server named like ``SECRET_ENV_NAME`` and the value its
    ``command`` gives an option named like a secret (``--token VALUE``, ``--password=VALUE``:
    ``redaction.mcp_server_secrets``, as a CLI model's). Used to redact
    them from everything the server emits or stores. Settings of any shape (not checked yet, or
    refused) give what can be read of them: a part of the wrong type is skipped, a ``secretEnv``
    that is one name instead of a list is that name."""
    names: list[str] = []
    values: list[str] = []

    def of(v: Any) -> dict[str, Any]:
        return v if isinstance(v, dict) else {}

    for cfg in of(settings.get("models")).values():
        got_names, got_values = _redaction.model_secrets(cfg)
        names.extend(got_names)
        values.extend(got_values)
    for spec in of(settings.get("mcpServers")).values():
        values.extend(_redaction.mcp_server_secrets(spec))
    listed = settings.get("secretEnv")
    names.extend(n for n in (listed if isinstance(listed, list) else [listed]) if isinstance(n, str) and n)
    return [v for v in map(_redaction.env_value, names) if v] + [v for v in values if v]
