"""operate-sidecar: a JSON-RPC stdio sidecar that runs composed LLM operations for editors.

The installed import packages are ``operate_sidecar.server`` (the server), ``operate_sidecar.protocol``
(the wire types and schema) and ``operate_sidecar.clients.python`` (a stdlib client). In the
repository they live in ``server/``, ``protocol/`` and ``clients/python/``.
"""

__version__ = "0.2.0"
