"""Tool sources: Python modules, MCP servers, builtin workspace tools.

Each source produces :class:`server.core.tools.Tool` objects for the registry. Nothing
here imports the ``mcp`` SDK until an MCP server is started.
"""

from .errors import ToolCallError, ToolSourceError, WorkspacePathError

# The sources are imported on first use (PEP 562): the server's warm-up thread imports
# ``python_modules`` while a request may import ``builtin``; eager imports here made the two
# race on Python 3.11 ("cannot import name ... from partially initialized module").
_LAZY = {"WorkspaceTools": "builtin", "McpToolSource": "mcp_source", "open_mcp_sources": "mcp_source",
         "load_tool_modules": "python_modules", "module_tools": "python_modules"}


def __getattr__(name: str):  # noqa: ANN202
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

__all__ = [
    "McpToolSource",
    "ToolCallError",
    "ToolSourceError",
    "WorkspacePathError",
    "WorkspaceTools",
    "load_tool_modules",
    "module_tools",
    "open_mcp_sources",
]
