"""operate-sidecar: a JSON-RPC stdio sidecar that runs composed LLM operations for editors.

The installed import packages are ``operate_sidecar.server`` (the server), ``operate_sidecar.protocol``
(the wire types and schema) and ``operate_sidecar.clients.python`` (a stdlib client). In the
repository they live in ``server/``, ``protocol/`` and ``clients/python/``.
"""

import os as _os

__version__ = "0.2.0"

# A source checkout that is not installed (or installed elsewhere, not editable): the
# subpackages are the repository's top-level folders, so ``operate_sidecar.server`` is
# ``./server`` whenever this package is imported from the checkout itself.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if all(_os.path.isfile(_os.path.join(_root, *p)) for p in (("setup.py",), ("server", "__main__.py"),
                                                            ("protocol", "schema.json"))):
    __path__.append(_root)  # noqa: F821 - a package's own __path__
del _os, _root
