"""The native front end: the JSON-RPC stdio server (docs/PROTOCOL.md), wire ⇄ ``server.service``.

Modules, in the order a message meets them:

- ``stdio``      fd-level stdout/stdin guard, the ``Wire`` writer, the stdin reader
- ``framing``    desync-resistant Content-Length parser (case-insensitive, byte counts, size cap)
- ``transport``  ``Connection``: JSON-RPC validation, error frames, ping fast path,
                 initialize/shutdown/exit, ordered backlog while the app loads
- ``server``     the pygls ``JsonRPCServer``: handlers (``protocol.catalog``'s requests, each
                 served by the ``server.service`` method of the same name), in-flight table,
                 cancellation, server→client requests (it is the service's ``ClientPort``)
- ``warm``       the first-use warm-up: once the core is loaded, operates through a throwaway
                 ``Connection`` before the requests that waited for it are served
- ``settings``   defaults and the flags ← config file ← initialize merge
- ``watchdog`` (parent death), ``run`` (``serve()``)

Kept light on purpose: importing ``server.rpc`` pulls in neither pygls nor the core;
``server.rpc.server`` is loaded on a background thread once ``initialize`` is answered.
"""

from .run import serve

__all__ = ["serve"]
