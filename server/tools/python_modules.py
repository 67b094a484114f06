"""Python tool modules (settings ``toolModules``).

Each named module is imported; every *public* function defined in it becomes a
:class:`~server.core.tools.Tool` with source ``python``:

- defined in that module (``fn.__module__`` is the module), so functions it imports
  from elsewhere are not tools;
- no leading underscore; when the module defines ``__all__``, only names listed there;
- plain ``def`` or ``async def`` (sync functions run in a worker thread, see core);
- the schema comes from the signature (``Tool.from_function``, pydantic), the
  description from the docstring, and ``@tool(read_only=..., timeout=..., name=...)``
  metadata is honoured.

A module of the Python standard library (``os``, ``subprocess``, ``shutil``, ...) is refused
with :class:`ToolSourceError`: its functions were never written to be a model's tools.
A module that does not import raises :class:`ToolSourceError` naming it and the reason, whatever
its code raised: an ``Exception``, ``SystemExit``, ``KeyboardInterrupt`` or another
``BaseException`` (a test runner's skip, say); the module's failure is that module's alone.
A function whose signature cannot give a JSON Schema is skipped with a warning.
Two modules defining the same tool name raise :class:`ToolSourceError`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from types import ModuleType
from typing import Any, Callable, Iterable

from ..core.errors import exception_line
from ..core.tools import Tool
from .errors import ToolSourceError

log = logging.getLogger(__name__)

__all__ = ["load_tool_modules", "module_tools"]


def load_tool_modules(names: Iterable[str]) -> list[Tool]:
    """Import each module in ``names`` and return the tools its public functions make.

    Tools are returned in module order, then definition order. A tool name that two
    of the modules both define is an error (name the tool differently with
    ``@tool(name=...)``).
    """
    if isinstance(names, str):
        names = [names]
    tools: list[Tool] = []
    owner: dict[str, str] = {}
    for name in names:
        module = _import(name)
        try:
            made = module_tools(module)
        except ToolSourceError:
            raise
        except BaseException as e:  # a function's signature or decorator ran code that raised
            raise ToolSourceError(f"tool module {name!r} could not be loaded: {type(e).__name__}: "
                                  f"{exception_line(e)}") from e
        for t in made:
            if t.name in owner:
                raise ToolSourceError(
                    f"tool {t.name!r} is defined by both tool modules {owner[t.name]!r} and {name!r}")
            owner[t.name] = name
            tools.append(t)
    return tools


def module_tools(module: ModuleType) -> list[Tool]:
    """The tools made from an already imported module's public functions."""
    if is_stdlib_module(module.__name__):
        raise ToolSourceError(f"tool module {module.__name__!r} is part of the Python standard library "
                              "and cannot be loaded as tools")
    tools: list[Tool] = []
    seen: set[int] = set()
    for attr, fn in _public_functions(module):
        if id(fn) in seen:  # an alias (``b = a``) is the same tool once
            continue
        seen.add(id(fn))
        qualname = f"{module.__name__}.{attr}"
        reason = _unsupported_signature(fn)
        if reason is None:
            try:
                tool_name = None if _valid_name(fn.__name__) else attr
                t = Tool.from_function(fn, name=tool_name, source="python")
            except Exception as e:  # pydantic cannot make a schema for an annotation, etc.
                reason = f"{type(e).__name__}: {exception_line(e)}"
        if reason is not None:
            log.warning("tool module %s: skipping function %s: its signature cannot be a tool schema (%s)",
                        module.__name__, qualname, reason)
            continue
        tools.append(t)
    return tools


def _import(name: str) -> ModuleType:
    if not isinstance(name, str) or not name.strip():
        raise ToolSourceError(f"tool module names must be non-empty strings, got {name!r}")
    if is_stdlib_module(name):
        raise ToolSourceError(f"tool module {name!r} is part of the Python standard library and cannot be "
                              "loaded as tools; name a module of your own that defines the tool functions")
    try:
        return importlib.import_module(name)
    except BaseException as e:  # its code runs here: whatever it raises is this module's failure
        raise ToolSourceError(f"tool module {name!r} could not be imported: {type(e).__name__}: {exception_line(e)}") from e


def is_stdlib_module(name: str) -> bool:
    """True when ``name`` (``os``, ``os.path``, ``email.utils``...) belongs to the standard library."""
    return name.strip().split(".", 1)[0] in sys.stdlib_module_names


def _public_functions(module: ModuleType) -> list[tuple[str, Callable[..., Any]]]:
    exported = getattr(module, "__all__", None)
    allowed = set(exported) if isinstance(exported, (list, tuple, set)) else None
    out = []
    for attr, obj in list(vars(module).items()):
        if attr.startswith("_") or (allowed is not None and attr not in allowed):
            continue
        if not inspect.isfunction(obj) or getattr(obj, "__module__", None) != module.__name__:
            continue
        out.append((attr, obj))
    return out


def _unsupported_signature(fn: Callable[..., Any]) -> str | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        return f"no signature: {e}"
    positional_only = [p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if positional_only:
        # Tools are called with keyword arguments only.
        return f"positional-only parameters {', '.join(positional_only)}"
    return None


def _valid_name(name: str) -> bool:
    return name.isidentifier()
