"""Over the wire (docs/PROTOCOL.md §5): a reply is held to the whole ``responseFormat``, the
constraints inside an array's ``items`` and a map's value schema included, and the schema the
model is shown (the instruction's ``responseSchema``, what the provider was sent) keeps them.
The cases, and what the model builder holds by itself: ``tests/service/test_schema_items.py``."""

from __future__ import annotations

from .support import TIMEOUT, scripted

NO_RETRY = {"retryAttempts": 0, "retryInitialDelay": 0}


def test_a_reply_breaking_a_constraint_inside_items_or_a_maps_values_is_refused_and_the_model_is_shown_it(sidecar):
    props = {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3}},
             "ns": {"type": "array", "items": {"type": "integer", "maximum": 5}},
             "m": {"type": "object", "additionalProperties": {"type": "integer"}}}
    schema = {"title": "R", "type": "object", "properties": props, "required": list(props)}
    keeps = {"tags": ["abc"], "ns": [5], "m": {"a": 1}}
    breaks = [{**keeps, "tags": ["waytoolong"]}, {**keeps, "ns": [99]}, {**keeps, "m": {"a": "x"}}]
    sidecar.init(models={"s": scripted(*[{"json": b} for b in breaks for _ in range(2)], {"json": keeps})})
    bid = sidecar.branch()
    for reply in breaks:  # (each reply, and its repair turn's)
        err = sidecar.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": schema,
                                           "handleValidation": "raise", "parseOptions": NO_RETRY})
        assert err.code == -32010 and err.data["expected"] == "R", (reply, err)
    out = sidecar.request("operate", {"branchId": bid, "instruction": "x", "responseFormat": schema},
                          timeout=TIMEOUT)
    assert (out["kind"], out["result"]) == ("model", keeps), out
    for message in [m for m in sidecar.messages(bid) if m["kind"] == "instruction"]:
        assert message["content"]["responseSchema"]["properties"] == props, message
