"""MCP Python SDK peer: an MCPServer (formerly FastMCP) over stdio with three tools.

Runs in bench/.venvs/mcp.  The wire is newline-delimited JSON-RPC.
"""
try:
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer

server = MCPServer("bench-peer")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def word_count(text: str) -> int:
    """Count whitespace-separated words."""
    return len(text.split())


if __name__ == "__main__":
    server.run("stdio")
