"""Operates' turns in arrival order (docs/PROTOCOL.md §2, §5): on one branch one at a time, and
at most ``maxConcurrentOperates`` at once, each in the order the operates arrived, not the
order in which their parameters happened to be ready (a response format not seen before is
built on a worker thread, a cached one is not: the later operate was ready first, and ran first).

An operate takes a ticket as it arrives, before its first wait (``Turns.arrive``), and gives it
back when it ends, however it ends (``Turns.leave``). ``BranchLine``: a ticket's turn on its
branch comes once every earlier ticket of that branch has left, ready or not (a follow-up never
runs before the turn it follows). ``Slots``: a free slot goes to the earliest ticket waiting for
one; an operate still reading its parameters when a slot frees does not hold it up. Every wait
is cancellable and leaves nothing behind."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class BranchLine:
    """One branch's tickets, in arrival order: the first one's turn is now (``running`` once
    it has taken it, until it gives it back)."""

    __slots__ = ("tickets", "waiters", "running")

    def __init__(self) -> None:
        self.tickets: list[int] = []
        self.waiters: dict[int, asyncio.Future] = {}
        self.running: int | None = None

    async def wait(self, ticket: int) -> None:
        if self.tickets and self.tickets[0] == ticket:
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters[ticket] = fut
        try:
            await fut
        finally:
            self.waiters.pop(ticket, None)

    def leave(self, ticket: int) -> None:
        try:
            self.tickets.remove(ticket)
        except ValueError:
            return
        if self.tickets:
            head = self.waiters.get(self.tickets[0])
            if head is not None and not head.done():
                head.set_result(None)


class Slots:
    """``capacity`` slots; the earliest waiting ticket gets the next free one."""

    __slots__ = ("free", "_waiting")

    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self._waiting: list[tuple[int, asyncio.Future]] = []  # a heap by ticket

    async def acquire(self, ticket: int) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (ticket, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: the next one's
                self.release()
            else:
                fut.cancel()  # skipped when its turn comes
            raise

    def release(self) -> None:
        self.free += 1
        while self._waiting and self.free > 0:
            _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                self.free -= 1
                fut.set_result(None)


class Turns:
    """The tickets of every operate: ``arrive`` at once, ``leave`` at the end, ``line`` and
    ``slots`` to wait on in between."""

    __slots__ = ("_count", "_lines", "slots")

    def __init__(self, capacity: int) -> None:
        self._count = itertools.count()
        self._lines: dict[str, BranchLine] = {}
        self.slots = Slots(capacity)

    def arrive(self, branch_id: str) -> int:
        ticket = next(self._count)
        line = self._lines.get(branch_id)
        if line is None:
            line = self._lines[branch_id] = BranchLine()
        line.tickets.append(ticket)  # tickets only grow: the line stays in arrival order
        return ticket

    def line(self, branch_id: str) -> BranchLine:
        return self._lines[branch_id]

    def holding(self) -> set[str]:
        """The branches an operate has its turn on (running, or waiting for a slot)."""
        return {bid for bid, line in self._lines.items() if line.running is not None}

    def leave(self, branch_id: str, ticket: int) -> None:
        line = self._lines.get(branch_id)
        if line is None:
            return
        line.leave(ticket)
        if not line.tickets:
            del self._lines[branch_id]
