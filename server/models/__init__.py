"""Model providers behind the core's iModel protocol. Each provider module is
imported only when a model of its kind is first made (cold start is measured).
The providers, their fields and the fields' types are declared once, in
:mod:`server.models.config`."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import FIELDS, PROVIDERS, ModelConfigError, check_model_config

__all__ = ["FIELDS", "PROVIDERS", "ModelConfigError", "check_model_config", "make_model"]


def make_model(config: dict[str, Any], *, name: str) -> Any:
    """Build an iModel from a docs/PROTOCOL.md §2 ModelConfig. ``name`` is the configured
    name (or a generated one for inline configs). The config is checked before the
    provider module is imported."""
    check_model_config(config, f"model config {name!r}")
    mod_name, cls_name = PROVIDERS[config["provider"]].split(":")
    cls = getattr(import_module(mod_name), cls_name)
    return cls.from_config(name, config)
