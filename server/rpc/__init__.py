"""The JSON-RPC stdio server (PROTOCOL.md): transport, lifecycle, methods.

Modules, in the order a message meets them:

- ``stdio``      fd-level stdout/stdin guard, the ``Wire`` writer, the stdin reader
- ``framing``    desync-resistant Content-Length parser (case-insensitive, byte counts, size cap)
- ``transport``  ``Connection``: JSON-RPC validation, error frames, ping fast path,
                 initialize/shutdown/exit, ordered backlog while the app loads
- ``server``     the pygls ``JsonRPCServer``: handlers, in-flight table, cancellation,
                 server→client requests
- ``methods``    the methods of PROTOCOL §3–§5 adapted to ``server.core``; error mapping
- ``governance`` tool policy data and the branch authorizer (``requestToolPermission``)
- ``schemas``    responseFormat / fieldModels JSON Schema → pydantic / core ``Spec`` (cached)
- ``progress``   the core's ``ProgressSink`` as ``$/progress``
- ``settings``   defaults and the flags ← config file ← initialize merge
- ``watchdog`` (parent death), ``run`` (``serve()``)

Kept light on purpose: importing ``server.rpc`` pulls in neither pygls nor the core;
``server.rpc.server`` is loaded on a background thread once ``initialize`` is answered.
"""

from .run import serve

__all__ = ["serve"]
