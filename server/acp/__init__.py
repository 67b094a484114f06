"""The Agent Client Protocol front end (``operate-sidecar --acp``).

ACP (newline-delimited JSON-RPC on stdio, protocol version 1) over the same service as the
native front end: a session is a branch, a prompt turn is a multi-round ``operate`` with
actions and every tool, tool calls are ``tool_call`` / ``tool_call_update``, ``ask`` is
``session/request_permission``. Framing and types come from the ``agent-client-protocol``
SDK; nothing here imports pygls.

- ``run``    process entry: stdout guard, the SDK's import (``import_sdk``: models built on
             first use), the SDK's stdio streams, exit
- ``agent``  the ACP methods (initialize, session/new|load|list|prompt|cancel, config options),
             the core's background load and the first-use warm-up (``warm_up``)
- ``port``   ``AcpPort``: the service's ``ClientPort`` in ACP terms
- ``reply``  the user-visible text of a streamed structured reply
"""
