"""Branch messages. Content dicts use the wire's field names (docs/PROTOCOL.md §3)."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Literal

MessageKind = Literal["system", "instruction", "assistant_response", "action_request", "action_response"]

ROLE_OF: dict[str, str] = {
    "system": "system",
    "instruction": "user",
    "assistant_response": "assistant",
    "action_request": "action",
    "action_response": "action",
}


_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(int.from_bytes(os.urandom(2), "big") << 20)


def new_id() -> str:
    """A unique id: 12 random hex digits per process, then a counter (cheaper than uuid4)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


@dataclass(slots=True)
class Message:
    kind: MessageKind
    content: dict[str, Any]
    sender: str | None = None
    recipient: str | None = None
    id: str = field(default_factory=new_id)
    created_at: float = field(default_factory=time.time)

    @property
    def role(self) -> str:
        return ROLE_OF[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "role": self.role,
            "sender": self.sender,
            "recipient": self.recipient,
            "createdAt": datetime.fromtimestamp(self.created_at, timezone.utc).isoformat(),
            "content": self.content,
        }

    def to_record(self) -> dict[str, Any]:
        """Lossless form for journaling (``created_at`` kept as a float)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "sender": self.sender,
            "recipient": self.recipient,
            "created_at": self.created_at,
            "content": self.content,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Message":
        return cls(
            kind=rec["kind"],
            content=rec["content"],
            sender=rec.get("sender"),
            recipient=rec.get("recipient"),
            id=rec["id"],
            created_at=rec["created_at"],
        )


MessageListener = Callable[[Message], None]


class MessageLog:
    """Ordered messages of a branch, oldest first. Listeners see each append
    (the journal subscribes) and each clear."""

    __slots__ = ("_items", "_listeners", "_clear_listeners", "generation")

    def __init__(self, items: list[Message] | None = None) -> None:
        self._items: list[Message] = list(items or [])
        self.generation = 0
        self._listeners: list[MessageListener] = []
        self._clear_listeners: list[Callable[[list[Message]], None]] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._items)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._items[i]

    @property
    def items(self) -> list[Message]:
        return self._items

    def on_append(self, listener: MessageListener) -> None:
        self._listeners.append(listener)

    def on_clear(self, listener: Callable[[list[Message]], None]) -> None:
        self._clear_listeners.append(listener)

    def append(self, message: Message) -> Message:
        self._items.append(message)
        for listener in self._listeners:
            listener(message)
        return message

    def add(self, kind: MessageKind, content: dict[str, Any], *, sender: str | None = None,
            recipient: str | None = None) -> Message:
        return self.append(Message(kind=kind, content=content, sender=sender, recipient=recipient))

    def clear(self) -> None:
        """Empty the log, keeping the system message if there is one."""
        kept = [m for m in self._items if m.kind == "system"][:1]
        self._items = kept
        self.generation += 1
        for listener in self._clear_listeners:
            listener(kept)

    def page(self, offset: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self._items[offset: offset + limit]]

    def copy(self) -> "MessageLog":
        return MessageLog([Message(kind=m.kind, content=dict(m.content), sender=m.sender,
                                   recipient=m.recipient, id=m.id, created_at=m.created_at)
                           for m in self._items])
