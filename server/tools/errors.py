"""Errors raised by tool sources (``server/tools``).

- :class:`ToolSourceError`: a source could not be set up (a tool module that does not
  import, an MCP server that does not start, a bad source configuration). Raised while
  loading, before any tool runs; the message names the module or server.
- :class:`ToolCallError`: a tool ran and failed (an MCP ``isError`` result, a lost MCP
  connection, a workspace path outside the roots). The message is what the model sees
  as the action response's ``error``.
"""

from __future__ import annotations

from ..core.errors import OperateError


class ToolSourceError(OperateError, ValueError):
    """A tool source that cannot be loaded or started."""


class ToolCallError(OperateError, RuntimeError):
    """A tool invocation that failed; the message is safe to show to the model."""


class WorkspacePathError(ToolCallError, ValueError):
    """A workspace path that is invalid or resolves outside every workspace root."""
