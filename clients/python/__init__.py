"""Python client for operate-sidecar (stdlib only): ``from clients.python import SidecarClient``."""

from .client import RpcError, SidecarClient, StreamError

__all__ = ["SidecarClient", "RpcError", "StreamError"]
