"""Governance's ``_ask`` (docs/PROTOCOL.md §4) on client answers of any shape: an answer that is no
permission is a deny quoting what came, bounded, however deep or long the answer is. The real server
over real pipes is in tests/clients/test_client.py; here the unit, called from a deep stack."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from operate_sidecar.server.service.governance import Governance


def test_an_answer_nested_deeper_than_the_stack_allows_is_a_deny_quoting_its_first_levels():
    """``repr`` of an answer nested 900 lists deep, from an operate's stack, raised RecursionError
    out of the authorizer (the operate ended with an internal error instead of a denied call)."""
    deep: list = []
    for _ in range(900):  # (what the server's reader parses from a client at its shallow stack)
        deep = [deep]

    async def answer(method: str, params: dict, timeout: float) -> list:
        return deep

    governance = Governance(settings_policy={}, timeout_ms=1000, can_ask=lambda: True, ask_client=answer)
    inv = SimpleNamespace(function="write_file", branch_id="b")

    async def nested(depth: int):  # the stack of an operate's tool call, and more
        return await governance._ask(inv, {}) if depth == 0 else await nested(depth - 1)

    result = asyncio.run(asyncio.wait_for(nested(120), 30))
    assert not result.allowed and result.reason == "invalid permission answer [[[[...]]]]", result
