"""Settings (PROTOCOL §2): defaults ← command-line flags ← ``--config`` TOML file
← ``initialize.settings``. Dict-valued keys (``models``, ``toolPolicy``,
``mcpServers``) merge per entry; every other key is replaced."""

from __future__ import annotations

import copy
from typing import Any

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
}

#: bounds that must be positive integers (PROTOCOL §2; protocol/README.md)
POSITIVE_INT_KEYS = ("toolTimeoutMs", "maxToolOutputChars", "maxConcurrentOperates", "maxBranches",
                     "maxMessagesPerBranch")

_DICT_KEYS = ("models", "toolPolicy", "mcpServers")
_POLICIES = ("allow", "deny", "ask")


class SettingsError(ValueError):
    pass


def merge(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in (over or {}).items():
        if key in _DICT_KEYS and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_toml(path: str) -> dict[str, Any]:
    import tomllib

    with open(path, "rb") as f:
        data = tomllib.load(f)
    # allow either top-level keys or a [settings] table
    if isinstance(data.get("settings"), dict) and len(data) == 1:
        data = data["settings"]
    return data


def finalize(settings: dict[str, Any]) -> dict[str, Any]:
    """Validate and fill the derived defaults (default model). Each ModelConfig is checked
    field by field (``server.models.config``), so a typo fails here, not at first use."""
    s = settings
    if not isinstance(s.get("models"), dict):
        raise SettingsError("settings.models must be an object")
    if s["models"]:  # every field of every model, up front (PROTOCOL §2 ModelConfig)
        from operate_sidecar.server.models.config import ModelConfigError, check_model_config  # a table; no provider

        for name, cfg in s["models"].items():
            try:
                check_model_config(cfg, f"models.{name}")
            except ModelConfigError as e:
                raise SettingsError(str(e)) from None
    if not s["models"]:
        s["models"] = {DEFAULT_MODEL_NAME: dict(DEFAULT_MODEL_CONFIG)}
    if s.get("defaultModel") is not None and not isinstance(s["defaultModel"], str):
        raise SettingsError("settings.defaultModel must be a model name")
    if not s.get("defaultModel"):
        s["defaultModel"] = next(iter(s["models"]))
    elif s["defaultModel"] not in s["models"]:
        raise SettingsError(f"settings.defaultModel {s['defaultModel']!r} is not a configured model")
    if not isinstance(s.get("toolPolicy"), dict):
        raise SettingsError("settings.toolPolicy must be an object")
    for tool, decision in s["toolPolicy"].items():
        if decision not in _POLICIES:
            raise SettingsError(f"settings.toolPolicy.{tool} must be one of {', '.join(_POLICIES)}")
    for key in ("permissionTimeoutMs", "maxMessageBytes"):
        v = s.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise SettingsError(f"settings.{key} must be a non-negative number")
    for key in POSITIVE_INT_KEYS:
        v = s.get(key)
        if type(v) is not int or v < 1:
            raise SettingsError(f"settings.{key} must be a positive integer")
    if not isinstance(s.get("toolModules"), list) or not all(isinstance(m, str) for m in s["toolModules"]):
        raise SettingsError("settings.toolModules must be a list of module names")
    if not isinstance(s.get("mcpServers"), dict):
        raise SettingsError("settings.mcpServers must be an object")
    if s.get("stateDir") is not None and not isinstance(s["stateDir"], str):
        raise SettingsError("settings.stateDir must be a path or null")
    return s
