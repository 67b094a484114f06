"""The JSON-RPC stdio server (PROTOCOL.md): transport, lifecycle, methods.

Kept light on purpose: importing ``server.rpc`` pulls in neither pygls nor the
core; ``server.rpc.server`` (the pygls JsonRPCServer) is loaded in the
background once the process runs.
"""

from .lifecycle import register_exit_hook
from .run import serve

__all__ = ["serve", "register_exit_hook"]
