"""The layer both front ends share, transport-free (no pygls, no lsprotocol, nothing from
``server.rpc`` or ``server.acp``):

- ``service``    ``Service``: branches and their locks, governance, tool sources, the model
                 cache, the store, ``operate`` with rounds, usage; the protocol's methods
- ``port``       ``ClientPort``, the interface through which the service reaches its client
                 (implemented by the native and the ACP front ends), and ``ClientRequestError``
- ``errors``     the errors it raises (``RpcError`` with the protocol's codes) and
                 ``map_exception`` (any exception → code, message, data) for both front ends
- ``governance`` tool policy data, per-branch permission modes and the branch authorizer (asks the
                 client through the port)
- ``schemas``    responseFormat / fieldModels JSON Schema → pydantic / core ``Spec`` (cached)
- ``progress``   the core's ``ProgressSink`` as ``$/progress`` notifications through the port
- ``rounds``     multi-round operate

Importing this package imports nothing; ``service`` is loaded with the core, on first need.
"""
