"""``$/progress`` for an operate that carried ``workDoneToken``: the core's
``ProgressSink`` implemented over the wire. Notifications are written
synchronously, so they all precede the operate's response, in order.

One ``begin``/``end`` pair spans the whole request, however many rounds (core operates) it
runs: the core begins and reports; the service ends the progress with
:meth:`WireProgress.finish`, whose value carries the request's ``usage``."""

from __future__ import annotations

import asyncio
from typing import Any


class WireProgress:
    __slots__ = ("_notify", "token", "default_begin", "began", "ended")

    def __init__(self, notify: Any, token: Any, default_begin: str = "communicate") -> None:
        self._notify = notify
        self.token = token
        self.default_begin = default_begin
        self.began = False
        self.ended = False

    def _send(self, value: dict[str, Any]) -> None:
        self._notify("$/progress", {"token": self.token, "value": value})

    def begin(self, message: str) -> None:
        if self.began or self.ended:
            return
        self.began = True
        self._send({"kind": "begin", "title": "operate", "message": message})

    def report(self, message: str, phase: str, delta: str | None = None) -> None:
        if self.ended:
            return
        if not self.began:
            self.begin(self.default_begin)
        value: dict[str, Any] = {"kind": "report", "message": message, "phase": phase}
        if delta is not None:
            value["delta"] = delta
        self._send(value)

    def finish(self, message: str, usage: dict[str, Any] | None = None) -> None:
        """The one ``end`` of the request, with its ``usage``."""
        if self.ended:
            return
        try:  # a failure while the request is being cancelled: say what happened
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                message = "cancelled"
        except RuntimeError:
            pass
        if not self.began:
            self.begin(self.default_begin)
        self.ended = True
        value: dict[str, Any] = {"kind": "end", "message": message}
        if usage is not None:
            value["usage"] = usage
        self._send(value)
