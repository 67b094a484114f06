"""Tool sources: Python modules, MCP servers, builtin workspace tools.

Each source produces :class:`server.core.tools.Tool` objects for the registry. Nothing
here imports the ``mcp`` SDK until an MCP server is started.
"""

from .builtin import WorkspaceTools
from .errors import ToolCallError, ToolSourceError, WorkspacePathError
from .mcp_source import McpToolSource, open_mcp_sources
from .python_modules import load_tool_modules, module_tools

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
