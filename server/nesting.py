"""How deep a JSON value nests, walked without recursion: a module of its own, importing
nothing, so that the settings' check (read before the server answers ``initialize``) costs
no import of the service or the protocol."""

from __future__ import annotations

from typing import Any


def too_deep(value: Any, limit: int, max_nodes: int = 0) -> tuple[list[Any] | None, int]:
    """Where ``value`` (JSON: dicts, lists and scalars) nests an object or array ``limit`` levels
    deep (``value`` itself is level 0): the keys and indexes down to the first such one, or None;
    and how many objects and arrays were walked (the walk stops at the first one past
    ``max_nodes``, when that is > 0). Depth-first, without recursion, with one iterator per
    level and only objects and arrays pushed: memory grows with the depth, not with the size
    (a stack of every value with its path took gigabytes for a body of megabytes of numbers a
    few dozen levels deep), and the path is built for the one found only. The one walk of a
    body's nesting: the schemas (``server.service.schemas``), the settings
    (``server.rpc.settings.check_depth``)."""
    if not isinstance(value, (dict, list)):
        return None, 0
    if limit <= 0:
        return [], 1
    nodes = 1
    path: list[Any] = []  # the keys down to the innermost iterator's object or array
    stack: list[Any] = [iter(value.items()) if isinstance(value, dict) else enumerate(value)]
    while stack:
        for k, x in stack[-1]:
            if isinstance(x, (dict, list)):
                nodes += 1
                if len(stack) >= limit:  # (x is len(stack) levels deep)
                    return [*path, k], nodes
                if 0 < max_nodes < nodes:
                    return None, nodes
                path.append(k)
                stack.append(iter(x.items()) if isinstance(x, dict) else enumerate(x))
                break
        else:  # this object or array is walked: back to its parent
            stack.pop()
            if path:
                path.pop()
    return None, nodes
