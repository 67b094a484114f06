"""The core's errors carry what happened, not a wire answer: the service maps them."""

from __future__ import annotations

import json

from operate_sidecar.server.core.errors import ConfigurationError, FieldNameClash
from operate_sidecar.server.service.errors import map_exception


def test_a_field_name_clash_carries_where_and_which_and_the_service_makes_it_invalid_params():
    e = FieldNameClash("responseFormat: property 'reason' would be replaced", path="/properties/reason",
                       field="reason")
    assert isinstance(e, ConfigurationError) and (e.path, e.field) == ("/properties/reason", "reason")
    assert not hasattr(e, "code") and not hasattr(e, "to_dict")  # no JSON-RPC in the core
    assert json.dumps(map_exception(e)) == (
        '[-32602, "invalid params: responseFormat: property \'reason\' would be replaced", '
        '{"path": "/properties/reason", "field": "reason"}]')
    assert map_exception(e, debug=True) == map_exception(e)
