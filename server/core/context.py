"""Context providers: objects with an optional ``async writeback(branch, responses)``
that is offered every non-None action response (denials and errors included)."""

from __future__ import annotations

from typing import Any, Protocol


class ContextProvider(Protocol):
    async def writeback(self, branch: Any, responses: list) -> Any: ...
