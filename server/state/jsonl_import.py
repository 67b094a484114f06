"""Reader of the 0.1 JSONL journal, kept only to import it into the SQLite store once.

Layout of that journal under ``state_dir``::

    branches/<id>.log       one JSON record per line, each with a sequence number ``s``
    branches/<id>.snap      the latest snapshot ``{"s", "meta", "messages"}``

Records: ``{"s", "t": "meta", "meta"}``, ``{"s", "t": "msg", "m"}``, ``{"s", "t": "clear",
"keep"}`` and ``{"s", "t": "batch", "r": [record, ...]}`` (one operate's group).

Unlike the 0.1 loader (which took the first unreadable line for a torn tail and cut
everything after it), this reader skips only what it cannot read: an unreadable line, a
record of the wrong shape, one bad message. Every later record is kept. A bad ``createdAt``
sorts the branch first instead of failing the whole journal. Nothing is written here.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

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
    return (isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("kind"), str)
            and isinstance(r.get("content"), dict) and isinstance(r.get("created_at"), (int, float)))


def created_at(meta: dict[str, Any]) -> float:
    v = meta.get("createdAt")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def read_branch(directory: str, bid: str) -> ImportedBranch | None:
    """One branch of a 0.1 journal, everything readable kept (None: no meta anywhere)."""
    meta: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    skipped = 0
    seq = 0
    snap_path = os.path.join(directory, f"{bid}.snap")
    if os.path.exists(snap_path):
        try:
            with open(snap_path, encoding="utf-8") as fh:
                snap = _loads(fh.read())
            seq = int(snap.get("s", 0))
            meta = snap.get("meta") if isinstance(snap.get("meta"), dict) else {}
            for r in snap.get("messages") or []:
                if _message_ok(r):
                    records.append(r)
                else:
                    skipped += 1
        except (OSError, ValueError, TypeError, AttributeError, RecursionError):
            log.warning("0.1 journal: snapshot of branch %s unreadable; its log is still imported", bid)
            skipped += 1
            seq = 0
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
                    s = int(r.get("s", 0))
                except (TypeError, ValueError, AttributeError):
                    skipped += 1
                    continue
                if s and s <= seq:
                    continue  # already in the snapshot (a crash between snapshot and log reset)
                seq = max(seq, s)
                t = r.get("t")
                if t == "meta" and isinstance(r.get("meta"), dict):
                    meta = r["meta"]
                elif t == "msg" and _message_ok(r.get("m")):
                    records.append(r["m"])
                elif t == "clear" and isinstance(r.get("keep"), list):
                    keep = set(map(str, r["keep"]))
                    records = [m for m in records if m["id"] in keep]
                else:
                    skipped += 1
    if not meta:
        return None
    return ImportedBranch(id=bid, meta=meta, records=records, skipped=skipped)


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
