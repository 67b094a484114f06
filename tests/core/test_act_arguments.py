"""The copy of the arguments a tool is given (``act._own_copy``): every dict and list its own,
whatever the depth, a structure met twice (or containing itself) copied once."""

from __future__ import annotations

from operate_sidecar.server.core.act import _own_copy


def test_every_dict_and_list_is_copied_and_the_shape_kept():
    asked = {"record": {"user": {"name": "ann"}}, "tags": [{"x": 1}, "s"], "n": 3}
    got = _own_copy(asked)
    assert got == asked and got is not asked
    assert got["record"]["user"] is not asked["record"]["user"] and got["tags"][0] is not asked["tags"][0]
    got["record"]["user"]["name"] = "ANN"
    got["tags"].append("changed")
    assert asked == {"record": {"user": {"name": "ann"}}, "tags": [{"x": 1}, "s"], "n": 3}


def test_any_depth_and_a_structure_containing_itself():
    deep: dict = {}
    for _ in range(100_000):  # deeper than any recursion limit
        deep = {"n": deep}
    assert _own_copy(deep) is not deep
    loop: dict = {"items": []}
    loop["items"].append(loop)
    got = _own_copy(loop)
    assert got["items"][0] is got and got is not loop
