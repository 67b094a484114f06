"""Model providers behind the core's iModel protocol. Each provider module is
imported only when a model of its kind is first made (cold start is measured)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

PROVIDERS: dict[str, str] = {
    "local": "server.models.local:LocalModel",
    "openai": "server.models.openai_compat:OpenAIModel",
    "cli": "server.models.cli:CLIModel",
    "scripted": "server.models.scripted:ScriptedModel",
}


class ModelConfigError(ValueError):
    """A model configuration that cannot be used (unknown provider, bad field)."""


def make_model(config: dict[str, Any], *, name: str) -> Any:
    """Build an iModel from a PROTOCOL §2 ModelConfig. ``name`` is the configured
    name (or a generated one for inline configs)."""
    if not isinstance(config, dict):
        raise ModelConfigError(f"model config for {name!r} must be an object")
    provider = config.get("provider")
    target = PROVIDERS.get(provider)  # type: ignore[arg-type]
    if target is None:
        raise ModelConfigError(f"unknown model provider {provider!r} for {name!r}; expected one of {sorted(PROVIDERS)}")
    mod_name, cls_name = target.split(":")
    cls = getattr(import_module(mod_name), cls_name)
    return cls.from_config(name, config)
