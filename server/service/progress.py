"""``$/progress`` for an operate that carried ``workDoneToken``: the core's
``ProgressSink`` implemented over the wire. Notifications are written
synchronously, so they all precede the operate's response, in order.

One ``begin``/``end`` pair spans the whole request, however many rounds (core operates) it
runs: the core begins and reports; the service ends the progress with
:meth:`WireProgress.finish`, whose value carries the request's ``usage``.

Streamed ``delta`` texts are redacted as one text (``redaction.StreamRedactor``): a known secret
a model writes across several deltas is masked, the few characters that could still begin one
waiting for the next delta. What waits is sent (redacted) before any other report, by
:meth:`WireProgress.end_text` when the model's text ends, and before the ``end``, so
``$/progress`` and every front end built on it (ACP's ``agent_message_chunk``) see the text
whole and in order. With no secret registered nothing waits.

A reasoning model's thoughts (:meth:`WireProgress.think`) are not the reply: each stretch of them
is one ``report`` with the message ``thinking`` (phase ``stream``, no ``delta``), so a client can
say the model is thinking; their text goes, redacted the same way, only to a port that shows
thoughts (``thought``, see ``server.service.port``) or, for a native client that announced
``capabilities.thoughts``, in the reports after it (``thinking`` with a ``thought``)."""

from __future__ import annotations

import asyncio
from typing import Any

from ..redaction import StreamRedactor


#: the message of the ``stream`` report (no ``delta``) that begins a stretch of a model's thoughts
THINKING = "thinking"


class WireProgress:
    __slots__ = ("_notify", "token", "default_begin", "began", "ended", "_text", "_text_message", "_on_thought",
                 "_thought", "_thinking")

    def __init__(self, notify: Any, token: Any, default_begin: str = "communicate",
                 thought: Any = None, thoughts_on_wire: bool = False) -> None:
        self._notify = notify
        self.token = token
        self.default_begin = default_begin
        self.began = False
        self.ended = False
        self._text = StreamRedactor()   # the streamed text's pending tail (secrets split across deltas)
        self._text_message = "streaming"
        # the port's ``thought(token, text)``; else, for a native client that shows them, a report each
        if thought is None and thoughts_on_wire:
            thought = self._thought_report
        self._on_thought = thought
        self._thought: StreamRedactor | None = None  # the thoughts' pending tail (made at the first)
        self._thinking = False          # a stretch of thoughts is running (its report was sent)

    def _send(self, value: dict[str, Any]) -> None:
        self._notify("$/progress", {"token": self.token, "value": value})

    def begin(self, message: str) -> None:
        if self.began or self.ended:
            return
        self.began = True
        self._send({"kind": "begin", "title": "operate", "message": message})

    def think(self, text: str) -> None:
        """A piece of a reasoning model's thoughts: the first of a stretch sends the ``thinking``
        report; the text goes to the port's ``thought`` (redacted), if it has one."""
        if self.ended:
            return
        if not self.began:
            self.begin(self.default_begin)
        if not self._thinking:
            self.end_text()
            self._thinking = True
            self._send({"kind": "report", "message": THINKING, "phase": "stream"})
        if self._on_thought is not None:
            if self._thought is None:
                self._thought = StreamRedactor()
            piece = self._thought.feed(text)
            if piece:
                self._on_thought(self.token, piece)

    def _thought_report(self, _token: Any, text: str) -> None:
        self._send({"kind": "report", "message": THINKING, "phase": "stream", "thought": text})

    def _end_thought(self) -> None:
        """The stretch of thoughts is over: what of them was held back goes to the port."""
        if self._thinking:
            self._thinking = False
            rest = self._thought.flush() if self._thought is not None and self._thought.pending else ""
            if rest and self._on_thought is not None:
                self._on_thought(self.token, rest)

    def report(self, message: str, phase: str, delta: str | None = None) -> None:
        if self.ended:
            return
        if not self.began:
            self.begin(self.default_begin)
        self._end_thought()
        if delta is not None:
            self._text_message = message
            piece, delta = delta, self._text.feed(delta)
            if piece and not delta:
                return  # all of it may begin a secret: it waits for the next delta
        else:
            self.end_text()
        value: dict[str, Any] = {"kind": "report", "message": message, "phase": phase}
        if delta is not None:
            value["delta"] = delta
        self._send(value)

    def end_text(self) -> None:
        """The streamed text has ended (or paused for something else): send what of it was
        held back, redacted."""
        if self._text.pending and not self.ended:
            rest = self._text.flush()
            if rest:
                self._send({"kind": "report", "message": self._text_message, "phase": "stream", "delta": rest})

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
        self._end_thought()
        self.end_text()
        self.ended = True
        value: dict[str, Any] = {"kind": "end", "message": message}
        if usage is not None:
            value["usage"] = usage
        self._send(value)
