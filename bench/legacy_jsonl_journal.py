"""The 0.1 JSONL journal (server/state/journal.py before the SQLite store), kept for the bench
only: `bench/store_bench.py` measures it side by side with the store that replaced it.

Layout under ``state_dir``::

    branches/<id>.log       one JSON record per line, each with a sequence number
    branches/<id>.snap      the latest snapshot (written to a temp file, fsynced, renamed)

Records: ``{"s": seq, "t": "meta", "meta": {...}}``, ``{"s": seq, "t": "msg", "m": {...}}``,
``{"s": seq, "t": "clear"}``. Message records are buffered in memory ("pending")
as messages are added and written + fsynced by :meth:`Journal.flush` — the
server calls it before it answers the request that produced them, so every
acknowledged message is on disk. The records one flush writes for a branch
(e.g. all the messages of one operate) go out as a single line ``{"s": last,
"t": "batch", "r": [record, ...]}``, so a crash never leaves half a group on
disk. Sequence numbers are given when records are written, so they follow the
order of the lines in the file.

The branch's meta (name, models, tool policy) is not a pending record: a change
(:meth:`Journal.update_meta`) marks it dirty, and the next flush writes the
current meta once — at the head of the branch's group, or, with
``flush(messages=False)``, as a line of its own that leaves pending message
records where they are. That is how a policy change is made durable while an
operate on the branch is still running without writing half of that operate.

Flushes are serialized: a flush returns only once everything pending when it
was called (including records another flush had already taken) is on disk.
Loading replays snapshot + log records with a higher sequence number; a torn
last line (a crash mid-write) is dropped and cut off. Compaction writes a
snapshot, then atomically replaces the log with an empty one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from operate_sidecar.server.core.messages import Message

log = logging.getLogger(__name__)

COMPACT_AFTER = 2000  # log records before a snapshot is written


@dataclass
class LoadedBranch:
    id: str
    meta: dict[str, Any]
    messages: list[Message] = field(default_factory=list)


@dataclass
class _BranchState:
    seq: int = 0  # the sequence number of the last record taken for writing
    log_records: int = 0
    pending: list[str] = field(default_factory=list)  # JSON objects without "s" (given when written)
    meta: dict[str, Any] = field(default_factory=dict)
    meta_dirty: bool = False  # ``meta`` changed since it was last taken for writing
    records: list[dict[str, Any]] = field(default_factory=list)  # message records up to ``seq``, for snapshots


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str, data: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _dumps(rec: dict[str, Any]) -> str:
    return json.dumps(rec, ensure_ascii=False, default=str, separators=(",", ":"))


class Journal:
    def __init__(self, state_dir: str, *, compact_after: int = COMPACT_AFTER) -> None:
        self.root = os.path.abspath(state_dir)
        self.dir = os.path.join(self.root, "branches")
        os.makedirs(self.dir, exist_ok=True)
        self.compact_after = compact_after
        self._branches: dict[str, _BranchState] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # held for a whole flush (write + fsync), and by delete

    # ------------------------------------------------------------ paths
    def _log_path(self, bid: str) -> str:
        return os.path.join(self.dir, f"{bid}.log")

    def _snap_path(self, bid: str) -> str:
        return os.path.join(self.dir, f"{bid}.snap")

    # ------------------------------------------------------------ recording
    def attach(self, branch: Any, meta: dict[str, Any], *, new: bool = True) -> None:
        """Journal ``branch`` from now on. ``new`` writes its meta and current messages."""
        st = self._branches.get(branch.id)
        if st is None:
            st = _BranchState()
            self._branches[branch.id] = st
        with self._lock:
            st.meta = dict(meta)
            if new:
                st.meta_dirty = True  # written at the head of the first flush's group
        if new:
            for m in branch.messages:
                self._record(branch.id, {"t": "msg", "m": m.to_record()})
        bid = branch.id

        def on_append(m: Message) -> None:
            if bid in self._branches:
                self._record(bid, {"t": "msg", "m": m.to_record()})

        def on_clear(kept: list[Message]) -> None:
            if bid in self._branches:
                self._record(bid, {"t": "clear", "keep": [m.id for m in kept]})

        branch.messages.on_append(on_append)
        branch.messages.on_clear(on_clear)

    def update_meta(self, bid: str, meta: dict[str, Any]) -> None:
        """Merge ``meta`` into the branch's meta. Nothing is queued with the pending message
        records: the next flush of the branch writes the current meta (with
        ``messages=False``, on a line of its own)."""
        with self._lock:
            st = self._branches.get(bid)
            if st is None:
                return
            st.meta = {**st.meta, **meta}
            st.meta_dirty = True

    def _record(self, bid: str, rec: dict[str, Any]) -> None:
        with self._lock:
            st = self._branches[bid]
            t = rec["t"]
            if t == "msg":
                st.records.append(rec["m"])
            elif t == "clear":
                keep = set(rec["keep"])
                st.records = [r for r in st.records if r["id"] in keep]
            st.pending.append(_dumps(rec))

    def dirty(self, bids: Any = None, *, messages: bool = True) -> bool:
        """Whether a flush with the same arguments has anything to write."""
        return any(st.meta_dirty or (messages and st.pending) for bid, st in self._branches.items()
                   if bids is None or bid in bids)

    def flush(self, bids: Any = None, *, messages: bool = True) -> None:
        """Write and fsync pending records (blocking; call from a worker thread).
        ``bids``: only these branches (default: all). Records of one branch taken by
        one flush are written as one line, so a group is all there or not at all; a
        changed meta goes first in that line. ``messages=False`` writes only changed
        metas, each as a line of its own, and leaves pending message records pending
        (an operate still running on the branch is not written in part)."""
        with self._flush_lock:
            work = []
            with self._lock:
                for bid, st in self._branches.items():
                    if bids is not None and bid not in bids:
                        continue
                    bodies = []
                    if st.meta_dirty:
                        bodies.append(_dumps({"t": "meta", "meta": st.meta}))
                        st.meta_dirty = False
                    if messages and st.pending:
                        bodies.extend(st.pending)
                        st.pending = []
                    if not bodies:
                        continue
                    work.append((bid, st, st.seq + 1, bodies))
                    st.seq += len(bodies)  # sequence numbers in the order the lines reach the file
            for bid, st, first, bodies in work:
                lines = ['{"s":%d,%s' % (first + i, body[1:]) for i, body in enumerate(bodies)]
                n = len(lines)
                if n == 1:
                    data = lines[0] + "\n"
                else:
                    data = '{"s":%d,"t":"batch","r":[%s]}\n' % (first + n - 1, ",".join(lines))
                path = self._log_path(bid)
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                st.log_records += n
                if st.log_records >= self.compact_after:
                    self.compact(bid)

    def compact(self, bid: str) -> None:
        st = self._branches[bid]
        with self._lock:
            if st.pending or st.meta_dirty:  # keep ordering: never snapshot past unflushed records
                return
            snap = {"s": st.seq, "meta": st.meta, "messages": list(st.records)}
        _atomic_write(self._snap_path(bid), json.dumps(snap, ensure_ascii=False, default=str))
        _atomic_write(self._log_path(bid), "")
        st.log_records = 0

    def delete(self, bid: str) -> None:
        with self._flush_lock:  # a concurrent flush must not re-create the deleted log
            with self._lock:
                self._branches.pop(bid, None)
            for p in (self._log_path(bid), self._snap_path(bid)):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            _fsync_dir(self.dir)

    # ------------------------------------------------------------ loading
    def load(self) -> list[LoadedBranch]:
        """Every journaled branch, oldest first by creation."""
        ids = sorted({f.rsplit(".", 1)[0] for f in os.listdir(self.dir) if f.endswith((".log", ".snap"))})
        out: list[LoadedBranch] = []
        for bid in ids:
            try:
                lb, seq, nrec = self._load_one(bid)
            except Exception:
                log.warning("could not load branch %s from the journal", bid, exc_info=True)
                continue
            if lb is None:
                continue
            st = _BranchState(seq=seq, log_records=nrec, meta=lb.meta,
                              records=[m.to_record() for m in lb.messages])
            self._branches[bid] = st
            out.append(lb)
        out.sort(key=lambda b: b.meta.get("createdAt", 0))
        return out

    def _load_one(self, bid: str) -> tuple[LoadedBranch | None, int, int]:
        meta: dict[str, Any] = {}
        msgs: list[Message] = []
        seq = 0
        snap_path = self._snap_path(bid)
        if os.path.exists(snap_path):
            with open(snap_path, encoding="utf-8") as fh:
                snap = json.load(fh)
            seq = int(snap["s"])
            meta = snap.get("meta") or {}
            msgs = [Message.from_record(r) for r in snap.get("messages", [])]
        log_path = self._log_path(bid)
        nrec = 0
        if os.path.exists(log_path):
            with open(log_path, "rb") as fh:
                raw = fh.read()
            good_end = 0
            pos = 0
            while pos < len(raw):
                nl = raw.find(b"\n", pos)
                if nl < 0:
                    break  # torn tail
                line = raw[pos:nl]
                try:
                    rec = json.loads(line)
                except ValueError:
                    break
                pos = nl + 1
                good_end = pos
                group = (rec.get("r") or []) if rec.get("t") == "batch" else [rec]
                nrec += len(group)
                for r in group:
                    s = int(r.get("s", 0))
                    if s <= seq:
                        continue
                    seq = s
                    t = r.get("t")
                    if t == "meta":
                        meta = r["meta"]
                    elif t == "msg":
                        msgs.append(Message.from_record(r["m"]))
                    elif t == "clear":
                        keep = set(r.get("keep") or [])
                        msgs = [m for m in msgs if m.id in keep]
            if good_end < len(raw):
                log.warning("journal of branch %s had a torn tail of %d bytes; cut off", bid, len(raw) - good_end)
                with open(log_path, "r+b") as fh:
                    fh.truncate(good_end)
                    fh.flush()
                    os.fsync(fh.fileno())
        if not meta:
            return None, seq, nrec
        return LoadedBranch(id=bid, meta=meta, messages=msgs), seq, nrec

    def adopt(self, branch: Any, meta: dict[str, Any]) -> None:
        """Journal a branch rebuilt by :meth:`load` (its records are on disk already)."""
        self.attach(branch, meta, new=False)
