"""LSP base-protocol framing: an incremental, desync-resistant frame parser and
the one frame encoder.

Rules (docs/PROTOCOL.md §1, hardened where stock readers go wrong):
- header names are matched case-insensitively; unknown headers are ignored;
- a malformed header block never loses the *next* message: the parser drops
  what it cannot use and resynchronises on the next ``Content-Length``;
- the length counts bytes;
- a body larger than ``max_bytes`` is skipped (never buffered) and reported as soon as
  its head (where the request id is) has been seen, so the answer does not wait for the
  rest and the stream stays in sync;
- a ``Content-Length`` no client could ever send (over ``_MAX_SANE_LENGTH``: 4 GiB, or
  16 × ``max_bytes`` when that is larger) is reported at once and *not* waited for: the
  parser resynchronises on the next ``Content-Length`` header instead.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

log = logging.getLogger(__name__)

_CL = b"content-length"
_CL_ANYWHERE = re.compile(rb"content-length\s*:", re.IGNORECASE)
_MAX_HEADER_LINE = 8192
_ID_IN_HEAD = 65536
_MAX_SANE_LENGTH = 1 << 32


def encode_frame(body: bytes) -> bytes:
    """Exactly ``Content-Length: N\\r\\n\\r\\n<body>``."""
    return b"Content-Length: %d\r\n\r\n%b" % (len(body), body)


class FrameParser:
    """Feed bytes in; complete bodies come out through ``on_body(bytes)``.

    ``on_oversize(head: bytes, size: int)`` is called once a too-large body has
    been skipped (``head`` holds its first bytes, to recover the request id).

    ``quiet`` logs nothing: for a parser that looks over a stream another parser
    reads (and reports on), which may start in the middle of a frame.
    """

    __slots__ = ("_buf", "_length", "_need", "_skip", "_skip_head", "_skip_size", "_reported",
                 "max_bytes", "on_body", "on_oversize", "quiet")

    def __init__(self, on_body: Callable[[bytes], None],
                 on_oversize: Callable[[bytes, int], None] | None = None,
                 max_bytes: int = 64 * 1024 * 1024, quiet: bool = False) -> None:
        self._buf = bytearray()
        self._length: int | None = None   # Content-Length of the header block being read
        self._need = -1                   # >= 0: reading a body of this many bytes
        self._skip = 0                    # bytes of an oversize body still to drop
        self._skip_head = bytearray()
        self._skip_size = 0
        self._reported = False            # the oversize body being skipped was answered already
        self.max_bytes = max_bytes
        self.on_body = on_body
        self.on_oversize = on_oversize
        self.quiet = quiet

    def feed(self, data: bytes) -> None:
        if self._skip:
            data = self._drop(data)
            if not data:
                return
        buf = self._buf
        buf += data
        pos = 0
        while True:
            n = len(buf)
            if self._need >= 0:                      # body
                need = self._need
                if n - pos < need:
                    break
                body = bytes(buf[pos:pos + need])
                pos += need
                self._need = -1
                try:
                    self.on_body(body)
                except Exception:  # a failing handler must not replay or lose the stream
                    if not self.quiet:
                        log.exception("error while handling a message")
                continue
            nl = buf.find(b"\n", pos)              # a header line
            if nl < 0:
                if n - pos > _MAX_HEADER_LINE:
                    # a runaway line: keep a tail that may hold a "Content-Length" prefix
                    if not self.quiet:
                        log.warning("dropping %d bytes of garbage between frames", n - pos - 32)
                    pos = n - 32
                    self._length = None
                break
            line = bytes(buf[pos:nl])
            pos = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if line:
                self._header_line(line)
                continue
            length = self._length                    # blank line: end of a header block
            if length is None:
                continue                             # nothing announced: keep scanning
            self._length = None
            if length <= self.max_bytes:
                self._need = length
                continue
            if length > max(_MAX_SANE_LENGTH, 16 * self.max_bytes):
                # never coming: answer now and resynchronise on the next header
                self._report(bytes(buf[pos:pos + _ID_IN_HEAD]), length)
                continue
            take = min(n - pos, length)              # oversize: skip without buffering
            self._skip_head = bytearray(buf[pos:pos + min(take, _ID_IN_HEAD)])
            self._skip_size = length
            self._skip = length - take
            self._reported = False
            pos += take
            if self._skip:
                if len(self._skip_head) >= _ID_IN_HEAD:  # the id is known: answer before the rest
                    self._reported = True
                    self._report(bytes(self._skip_head), length)
                break
            self._finish_skip()
        del buf[:pos]

    def _header_line(self, line: bytes) -> None:
        found = None
        for found in _CL_ANYWHERE.finditer(line):  # the last "Content-Length:" on the line wins: a
            pass                                   # cut-off header glued to the next one resyncs there
        if found is not None:
            if (found.start() > 0 or line.count(b":") > 1) and not self.quiet:
                log.warning("garbage before a header; resynchronising")
            self._set_length(line[found.end():])
            return
        name, sep, _ = line.partition(b":")
        key = name.strip()
        if not (sep and key and key.replace(b"-", b"").isalnum()) and not self.quiet:
            log.warning("malformed header line ignored: %r", line[:80])
        # else: some other header, ignored

    def _set_length(self, value: bytes) -> None:
        try:
            length = int(value.strip())
            if length < 0:
                raise ValueError
        except ValueError:
            if not self.quiet:
                log.warning("bad Content-Length %r; waiting for the next header", value[:40])
            self._length = None
            return
        self._length = length

    def _drop(self, data: bytes) -> bytes:
        take = min(len(data), self._skip)
        room = _ID_IN_HEAD - len(self._skip_head)
        if room > 0:
            self._skip_head += data[:min(take, room)]
            if len(self._skip_head) >= _ID_IN_HEAD and self._skip > take and not self._reported:
                self._reported = True
                self._report(bytes(self._skip_head), self._skip_size)
        self._skip -= take
        if not self._skip:
            self._finish_skip()
        return data[take:]

    def _finish_skip(self) -> None:
        head, size = bytes(self._skip_head), self._skip_size
        self._skip_head = bytearray()
        self._skip_size = 0
        reported, self._reported = self._reported, False
        if not reported:
            self._report(head, size)

    def _report(self, head: bytes, size: int) -> None:
        if self.on_oversize is not None:
            try:
                self.on_oversize(head, size)
            except Exception:
                if not self.quiet:
                    log.exception("error while reporting an oversize message")


def _top_keys(head: bytes) -> tuple[list[tuple[str, int]], bool]:
    """Best effort over a (possibly cut) JSON object's first bytes: its top-level keys, each
    with the index just after its ``:``, and whether the bytes can be the start of one object
    (they are an object, with nothing but whitespace after it)."""
    keys: list[tuple[str, int]] = []
    depth, i, n = 0, 0, len(head)
    while i < n and head[i] in b" \t\r\n":
        i += 1
    if i == n or head[i] != 0x7B:  # "{"
        return keys, False
    start = i
    while i < n:
        c = head[i]
        if depth == 0 and c not in b" \t\r\n" and i > start:
            return keys, False  # something after the object
        if c == 0x22:  # a string: a key when it is followed by ':' at depth 1
            j = i + 1
            while j < n and head[j] != 0x22:
                j += 2 if head[j] == 0x5C else 1
            k = j + 1
            while k < n and head[k] in b" \t\r\n":
                k += 1
            if depth == 1 and k < n and head[k] == 0x3A:
                keys.append((head[i + 1:j].decode("utf-8", "replace"), k + 1))
            i = j + 1
            continue
        if c in b"{[":
            depth += 1
        elif c in b"}]":
            depth -= 1
        i += 1
    return keys, True


def peek_keys(head: bytes) -> set[str] | None:
    """Best effort: the top-level keys of a (possibly cut) JSON object's first bytes; None when
    they cannot be the start of one object (not an object, or more than whitespace after it)."""
    keys, one_object = _top_keys(head)
    return {key for key, _ in keys} if one_object else None


#: the members a JSON-RPC response may have
_ANSWER_KEYS = frozenset({"jsonrpc", "id", "result", "error"})


def looks_like_answer(head: bytes) -> bool:
    """Whether the first bytes of a body are those of a JSON-RPC response (an answer to a
    request of ours, never to be answered): well-formed UTF-8, one object whose top-level
    members so far are a response's only, with ``result`` or ``error`` among them."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data" or e.end < len(head):  # not just a character cut short
            return False
    keys = peek_keys(head)
    return bool(keys) and keys <= _ANSWER_KEYS and bool(keys & {"result", "error"})


def peek_id(head: bytes) -> Any:
    """Best effort: the top-level ``"id"`` of a (possibly cut) JSON object, else None."""
    import json

    for key, at in _top_keys(head)[0]:
        if key == "id":
            m = re.match(rb'\s*(-?\d+|"(?:[^"\\]|\\.)*")', head[at:at + 300])
            if not m:
                return None
            try:
                return json.loads(m.group(1))
            except ValueError:
                return None
    return None
