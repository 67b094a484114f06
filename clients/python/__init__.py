"""Python client for operate-sidecar (stdlib only): ``from operate_sidecar.clients.python import SidecarClient``."""

from .client import RpcError, SidecarClient, StreamError

__all__ = ["SidecarClient", "RpcError", "StreamError"]
