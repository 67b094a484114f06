"""Reader of the 0.1 JSONL journal, kept only to import it into the SQLite store once.

Layout of that journal under ``state_dir``::

    branches/<id>.log       one JSON record per line, each with a sequence number ``s``
    branches/<id>.snap      the latest snapshot ``{"s", "meta", "messages"}``

Records: ``{"s", "t": "meta", "meta"}``, ``{"s", "t": "msg", "m"}``, ``{"s", "t": "clear",
"keep"}`` and ``{"s", "t": "batch", "r": [record, ...]}`` (one operate's group).

Unlike the 0.1 loader (which took the first unreadable line for a torn tail and cut
everything after it), this reader skips only what it cannot read: an unreadable line, a
record of the wrong shape or with a sequence number that is no integer (``1e999``), one bad
message (no id, no content object, a ``kind`` this version does not know). Every later record
is kept. A bad ``createdAt`` (not a number, or one no date can hold: ``1e999``, 400 digits)
sorts the branch first instead of failing the whole journal; a message's bad ``created_at``
becomes the time of the message before it (0 for the first): it changes no order, and the
message is kept. A message whose id was already read is read once. Nothing is written here.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..core.messages import ROLE_OF

log = logging.getLogger(__name__)


@dataclass
class ImportedBranch:
    id: str
    meta: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)  # message records, in order
    skipped: int = 0  # unreadable lines / records / messages left out


def _loads(text: Any) -> Any:
    """JSON as 0.1 wrote it: ``NaN`` and ``±Infinity`` (which it wrote for such floats, and which
    no JSON reader of the client's can take) become the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``, as a tool output's are today (docs/PROTOCOL.md §4): imported as numbers,
    every ``branchMessages`` of the branch failed -32603."""
    return json.loads(text, parse_constant=str)


def _message_ok(r: Any) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("id"), str) and r.get("kind") in ROLE_OF
            and isinstance(r.get("content"), dict))


def _timestamp(v: Any) -> float | None:
    """``v`` as a time a message's date can be made of (None: not a number, or out of range)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        t = float(v)
        datetime.fromtimestamp(t, timezone.utc)
    except (OverflowError, ValueError, OSError):
        return None
    return t if math.isfinite(t) else None


class _Messages:
    """The messages read so far, in order: each id once, each ``created_at`` a usable time."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._ids: set[str] = set()

    def add(self, r: Any) -> bool:
        """Keep ``r`` (True), or tell it is unreadable (False); an id already read: nothing."""
        if not _message_ok(r):
            return False
        if r["id"] in self._ids:
            return True
        if _timestamp(r.get("created_at")) is None:
            r = dict(r, created_at=self.items[-1]["created_at"] if self.items else 0.0)
        self._ids.add(r["id"])
        self.items.append(r)
        return True

    def keep(self, ids: set[str]) -> None:
        self.items = [m for m in self.items if m["id"] in ids]
        self._ids = {m["id"] for m in self.items}


def created_at(meta: dict[str, Any]) -> float:
    """The branch's creation time for ordering; 0 (first) when ``createdAt`` is no usable time."""
    return _timestamp(meta.get("createdAt")) or 0.0


def _sequence(r: Any) -> int:
    """A record's sequence number ``s`` (0 when it has none); ValueError when it is no integer."""
    try:
        return int(r.get("s", 0))
    except (TypeError, ValueError, AttributeError, OverflowError):
        raise ValueError(f"bad sequence number: {r!r:.80}") from None


def read_branch(directory: str, bid: str) -> ImportedBranch | None:
    """One branch of a 0.1 journal, everything readable kept (None: no meta anywhere)."""
    meta: dict[str, Any] = {}
    records = _Messages()
    skipped = 0
    seq = 0
    snap_path = os.path.join(directory, f"{bid}.snap")
    if os.path.exists(snap_path):
        try:
            with open(snap_path, encoding="utf-8") as fh:
                snap = _loads(fh.read())
            seq = _sequence(snap)
            meta = snap.get("meta") if isinstance(snap.get("meta"), dict) else {}
            for r in snap.get("messages") or []:
                if not records.add(r):
                    skipped += 1
        except (OSError, ValueError, TypeError, AttributeError, RecursionError):
            log.warning("0.1 journal: snapshot of branch %s unreadable; its log is still imported", bid)
            skipped += 1
            seq = 0
            records = _Messages()
    log_path = os.path.join(directory, f"{bid}.log")
    if os.path.exists(log_path):
        with open(log_path, "rb") as fh:
            raw = fh.read()
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = _loads(line)
            except (ValueError, RecursionError):  # (a damaged line nested too deeply failed the whole
                skipped += 1  # journal: the state directory unusable) unreadable: skip this line only
                continue
            if not isinstance(rec, dict):
                skipped += 1
                continue
            group = rec.get("r") if rec.get("t") == "batch" else [rec]
            if not isinstance(group, list):
                skipped += 1
                continue
            for r in group:
                try:
                    s = _sequence(r)
                except ValueError:  # (1e999 is no integer: it failed the whole journal)
                    skipped += 1
                    continue
                if s and s <= seq:
                    continue  # already in the snapshot (a crash between snapshot and log reset)
                seq = max(seq, s)
                t = r.get("t")
                if t == "meta" and isinstance(r.get("meta"), dict):
                    meta = r["meta"]
                elif t == "msg":
                    skipped += not records.add(r.get("m"))
                elif t == "clear" and isinstance(r.get("keep"), list):
                    records.keep(set(map(str, r["keep"])))
                else:
                    skipped += 1
    if not meta:
        return None
    if _timestamp(meta.get("createdAt")) is None and isinstance(meta.get("createdAt"), (int, float)):
        meta = dict(meta, createdAt=0.0)  # a number no time can be (1e999, 400 digits): ordered first
    return ImportedBranch(id=bid, meta=meta, records=records.items, skipped=skipped)


def read_journal(state_dir: str) -> list[ImportedBranch]:
    """Every branch of the 0.1 journal under ``state_dir``, oldest first by creation."""
    directory = os.path.join(state_dir, "branches")
    if not os.path.isdir(directory):
        return []
    ids = sorted({f.rsplit(".", 1)[0] for f in os.listdir(directory) if f.endswith((".log", ".snap"))})
    out = []
    for bid in ids:
        try:
            b = read_branch(directory, bid)
        except OSError:
            log.warning("0.1 journal: branch %s unreadable", bid, exc_info=True)
            continue
        if b is not None:
            out.append(b)
    out.sort(key=lambda b: created_at(b.meta))
    return out
