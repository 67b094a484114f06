"""The text a user reads from the model's reply, while it streams.

A prompt turn asks for a structured reply (``REPLY_FORMAT``: a ``message`` for the user
plus the action fields), so the raw stream is JSON. ``ReplyText`` pulls the ``message``
string out of the partial JSON as it grows, decoding escapes, so that the editor shows
prose, chunk by chunk: a surrogate pair's two escapes are one character (the first half waits
for the second when the stream splits them), a lone half is U+FFFD and the text after it
stays the string's. A reply that does not start as JSON (a model that ignored the
format) is shown as it streams."""

from __future__ import annotations

import re
from typing import Any

#: the reply format of a prompt turn; the action fields are added by operate
REPLY_FORMAT: dict[str, Any] = {
    "title": "Reply",
    "type": "object",
    "properties": {"message": {"type": "string",
                               "description": "What you say to the user (Markdown). Empty while you only call tools."}},
    "required": ["message"],
}

#: the optional plan a model that can keep one reports with each reply (ACP ``plan`` updates)
PLAN_PROPERTY: dict[str, Any] = {
    "type": "array",
    "description": ("Optional: your plan for a task of several steps, all of it each time you change it "
                    "(the editor shows it as a checklist). Omit it for a simple answer."),
    "items": {"type": "object",
              "properties": {"content": {"type": "string", "description": "the step"},
                             "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                             "priority": {"type": "string", "enum": ["high", "medium", "low"]}},
              "required": ["content", "status"]},
}
#: ``REPLY_FORMAT`` with the optional plan: offered to every model but the embedded local one
#: (measured with it: it never fills a plan in, and its turns get slower and noisier)
PLAN_REPLY_FORMAT: dict[str, Any] = {**REPLY_FORMAT,
                                     "properties": {**REPLY_FORMAT["properties"], "plan": PLAN_PROPERTY}}

_STATUSES = ("pending", "in_progress", "completed")
_PRIORITIES = ("high", "medium", "low")


def plan_of(value: Any) -> list[dict[str, str]] | None:
    """The plan a reply reports (a result envelope, a parsed reply or a whole reply text) as
    ACP plan entries (``content``, ``status``, ``priority``), or None when it reports none.
    Entries without text are dropped; an unknown status is ``pending``, priority ``medium``."""
    if isinstance(value, str):  # the pipeline's own extraction (fences, prose around it, repair)
        if "plan" not in value:  # no plan to find (most replies): not worth a parse
            return None
        from operate_sidecar.server.core.parse import extract_json

        value = extract_json(value)
    if isinstance(value, dict) and "kind" in value and "result" in value:
        value = value["result"]
    plan = value.get("plan") if isinstance(value, dict) else None
    if not isinstance(plan, list):
        return None
    entries = []
    for item in plan:
        if isinstance(item, str):
            item = {"content": item}
        if not isinstance(item, dict) or not isinstance(item.get("content"), str) or not item["content"].strip():
            continue
        status, priority = item.get("status"), item.get("priority")
        entries.append({"content": item["content"].strip(),
                        "status": status if status in _STATUSES else "pending",
                        "priority": priority if priority in _PRIORITIES else "medium"})
    return entries or None


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", '"': '"', "\\": "\\", "/": "/"}
#: the second half of a surrogate pair as a JSON escape (``\\uDC00``-``\\uDFFF``), or the
#: beginning of one (what a stream may have delivered of it so far)
_LOW_ESCAPE = re.compile(r"\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]{0,2})?)?)?")


def _hex4(digits: str) -> int:
    """The code of a ``\\uXXXX`` escape's four digits; U+FFFD when they are not four hex digits."""
    return int(digits, 16) if re.fullmatch(r"[0-9a-fA-F]{4}", digits) else 0xFFFD


class ReplyText:
    """Feed the streamed deltas of one model reply; each ``feed`` returns the new user text."""

    __slots__ = ("_buf", "_mode", "_i", "_done", "emitted", "_j", "_depth", "_base", "_in_str", "_str_at", "_key")

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "raw" or "json"
        self._i = -1                    # scan position inside the message string (-1: not found yet)
        self._done = False
        self.emitted = ""
        # the search for the reply's own "message" key: a key of the outermost object, not one
        # nested in a tool call's arguments (``{"action_requests": [{"arguments": {"message"...``)
        self._j = 0            # search position
        self._depth = 0        # brackets open at ``_j``
        self._base: int | None = None  # the depth of the outermost object's keys
        self._in_str = False
        self._str_at = 0       # where the string being read starts
        self._key = ""         # "message" once that key (then its ':') was read at the outermost level

    def feed(self, delta: str) -> str:
        self._buf += delta
        if self._mode is None:
            head = self._buf.lstrip()
            if not head:
                return ""
            self._mode = "json" if head[0] in "{[`" else "raw"
            if self._mode == "raw":
                return self._out(self._buf)
        if self._mode == "raw":
            return self._out(delta)
        return self._out(self._scan())

    def _out(self, text: str) -> str:
        self.emitted += text
        return text

    def _scan(self) -> str:
        if self._done:
            return ""
        b = self._buf
        if self._i < 0:
            self._i = self._find_message()
            if self._i < 0:
                return ""
        i, out = self._i, []
        while i < len(b):
            c = b[i]
            if c == '"':
                self._done = True
                i += 1
                break
            if c != "\\":
                out.append(c)
                i += 1
                continue
            if i + 1 >= len(b):
                break
            e = b[i + 1]
            if e != "u":
                out.append(_ESCAPES.get(e, e))
                i += 2
                continue
            if i + 6 > len(b):
                break
            code = _hex4(b[i + 2:i + 6])
            if 0xD800 <= code < 0xDC00:  # the first half of a surrogate pair, or a lone one
                low = b[i + 6:i + 12]
                if len(low) < 6 and (not low or _LOW_ESCAPE.fullmatch(low)):  # its second half may be coming
                    break
                if len(low) == 6 and _LOW_ESCAPE.fullmatch(low):
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (_hex4(low[2:]) - 0xDC00)))
                    i += 12
                    continue
                code = 0xFFFD  # a lone half: the text after it is the string's own
            elif 0xDC00 <= code < 0xE000:  # a second half with no first
                code = 0xFFFD
            out.append(chr(code))
            i += 6
        self._i = i
        return "".join(out)

    def _find_message(self) -> int:
        """Where the string value of the outermost object's ``message`` key starts, once the
        stream has reached it; else -1 (the search goes on from where it stopped)."""
        b, j, n = self._buf, self._j, len(self._buf)
        while j < n:
            c = b[j]
            if self._in_str:
                if c == "\\":
                    if j + 1 >= n:
                        break  # the escaped character has not arrived yet
                    j += 2
                    continue
                if c == '"':
                    self._in_str = False
                    if self._depth == self._base and b[self._str_at:j] == "message":
                        self._key = "message?"  # a key when a ':' follows
                    else:
                        self._key = ""
                j += 1
                continue
            if c in " \t\r\n":
                j += 1
                continue
            if c == '"':
                if self._key == "message:":  # its value: a string
                    self._j = j + 1
                    return j + 1
                self._in_str, self._str_at, self._key = True, j + 1, ""
            elif c == ":" and self._key == "message?":
                self._key = "message:"
            else:
                self._key = ""
                if c in "{[":
                    self._depth += 1
                    if c == "{" and self._base is None:
                        self._base = self._depth
                elif c in "}]":
                    self._depth -= 1
            j += 1
        self._j = j
        return -1

    @property
    def raw(self) -> str:
        """The reply's text as it streamed so far."""
        return self._buf

    def rest(self, final: Any) -> str:
        """Called once the reply is complete with the operate result (or the recorded reply
        text): the user text not yet shown, if the stream showed none (a provider that does
        not stream, a reply that only parsed after repair)."""
        if self.emitted:
            return ""
        text = message_of(final)
        return self._out(text) if text else ""


def message_of(value: Any) -> str:
    """The user text of a reply: a result envelope, a parsed reply, or a raw reply text. A
    reply text that is not the reply format (a model that answered with broken JSON, or JSON
    without a ``message``: the result of a reply that failed validation) is shown as it came,
    not as an empty turn."""
    if isinstance(value, dict) and "kind" in value and "result" in value:
        value = value["result"]
    if isinstance(value, dict):
        msg = value.get("message")
        return msg if isinstance(msg, str) else ""
    if isinstance(value, str):
        r = ReplyText()
        r.feed(value)
        if r._mode == "json" and not r.emitted:
            from operate_sidecar.server.core.parse import extract_json  # the pipeline's (fences, repair)

            parsed = extract_json(value)
            msg = parsed.get("message") if isinstance(parsed, dict) else None
            return msg if isinstance(msg, str) else value.strip()
        return r.emitted
    return ""
