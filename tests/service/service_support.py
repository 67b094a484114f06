"""A ``ClientPort`` with no client behind it, for the service's own tests: nothing can be
asked (no ``toolPermission``, so ``ask`` is a denial), what is logged, notified and decided
is kept for the test to read."""

from __future__ import annotations

from typing import Any


class Port:
    def __init__(self, settings: dict, folders: tuple[str, ...] = ()) -> None:
        self.conn = self
        self.settings = settings
        self.client_capabilities: dict = {}
        self.workspace_folders: list[str] = list(folders)
        self.logged: list[str] = []
        self.sent: list[str] = []
        self.decided: list[tuple[str, bool]] = []

    def log_message(self, type_: int, message: str) -> None:
        self.logged.append(message)

    def notify(self, method: str, params: Any) -> None:
        self.sent.append(method)

    async def request_client(self, method: str, params: Any, timeout: float | None) -> Any:
        raise RuntimeError("no client")

    async def tool_decided(self, params: dict) -> None:  # hears the decision, cannot change it
        self.decided.append((params["tool"], params["allowed"]))
