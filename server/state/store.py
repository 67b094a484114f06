"""Branch state in one SQLite database (``<stateDir>/state.sqlite3``).

The standard library's ``sqlite3``, WAL journal, ``synchronous=FULL`` (a commit is on disk
when it returns), a busy timeout for the other processes on the same ``stateDir``.

Tables: ``branches(id, meta, created_at, version, clear_gen)`` and
``messages(branch_id, seq, msg_id, record)``; ``info`` holds the schema version and the
marker of a 0.1 journal already imported.

Recording works as the 0.1 journal did: a branch is *attached* (its ``MessageLog`` listeners
queue message records and clears as pending operations, its meta is marked dirty on a
change) and :meth:`StateStore.flush` writes what is pending, **one transaction per branch**:
a new branch with its first messages, one operate's messages, a policy change, a fork.
``flush(messages=False)`` writes only a changed meta and leaves pending messages where they
are (a policy change while an operate runs on that branch never writes half the operate).
A transaction that fails is rolled back, the branch's pending operations are dropped and its
meta goes back to the last committed one; :class:`StateNotSaved` tells the caller, who undoes
the in-memory change, so memory and disk agree.

Several processes may share the database. Every commit of a branch bumps its ``version``;
message sequence numbers are taken inside the transaction, so two processes appending to one
branch each land their whole group after the other's. A process learns of the others' commits
with :meth:`poll` (``PRAGMA data_version`` first, so it is one cheap query when nothing
changed) and when a commit finds the branch's version moved (the flush returns the branch
re-read from disk). A commit that finds the branch's version moved applies its own meta changes
over what is on disk: ``policy`` and ``client`` (a front end's info) entry by entry, ``usage``
by adding what this process added to each total, other keys whole, so two processes changing
different things of one branch both keep theirs, and their operates both count.

At open, the database is checked (``PRAGMA quick_check``); a damaged file is moved aside
(kept, with its ``-wal``/``-shm``; beside the file a link ``state.sqlite3`` leads to, the link
kept: ``StateStore._set_aside``), whatever can still be read from it is copied into a fresh
database, branch by branch (a damaged row costs its own branch's settings, never the other
branches: ``StateStore._salvage``), and :attr:`StateStore.problems` says so for the server to
report. That copy is marked in ``info`` until it is done: a process that dies during it leaves a database that
passes the check, and the next open finishes the copy; a branch it could not write (a full disk) is
told, and the next open copies it. Opening is done under a lock on the
state directory (``flock``: shared to check, exclusive to move aside and rebuild), so servers
starting at once rebuild a damaged database once: the others wait for it and use the rebuilt
file. The files a connection writes are taken when it connects, and every commit checks that
they are still ``<stateDir>/state.sqlite3`` (and its ``-wal``).

Disk space: a database is made with ``auto_vacuum=INCREMENTAL``, and the pages a delete frees
(a deleted branch, a cleared history) are given back to the filesystem soon after, off the
answer's path: a thread of the store runs ``PRAGMA incremental_vacuum`` a bounded number of
pages per transaction (``VACUUM_STEP_PAGES``), letting the server's commits in between, then
checkpoints, which cuts the file (``StateStore._tidy``); a step another server is in the way of is
tried again a little later, never waited for while the thread holds the connection. A database made before that
(``auto_vacuum=0``, which only reuses its free pages) is converted once at open when that pays
(``StateStore._compact_at_open``). ``PRAGMA journal_size_limit`` keeps the ``-wal`` from staying
as large as the largest transaction: once checkpointed it is cut back (``JOURNAL_SIZE_LIMIT``).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from operate_sidecar.server.core.messages import Message
from operate_sidecar.server.redaction import has_secrets, redact_value

try:
    import fcntl
except ImportError:  # Windows: no lock between servers opening one state directory (``_DirLock``)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DB_FILE = "state.sqlite3"
SCHEMA_VERSION = "1"
BUSY_TIMEOUT_MS = 10_000
#: how long an open waits for another server checking or rebuilding the database (``StateStore._open``)
LOCK_WAIT_S = 60.0
_DAMAGE_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB
#: meta keys whose value is an object merged key by key when two processes changed one branch:
#: ``policy`` (per tool) and ``client`` (the front end's info, per field)
MERGED_PER_KEY = ("policy", "client")
#: meta keys whose value holds running totals, and which of its fields are totals: when two
#: processes changed one branch, each total is what is on disk plus what this process added since
#: it last read it (``usage``: two servers' operates on one branch both count); its other fields
#: (``contextTokens``: the last call's) are taken from the process that changed them
SUMMED = {"usage": ("inputTokens", "outputTokens", "modelCalls")}
#: the ``-wal`` file is cut back to this size once it is checkpointed (``PRAGMA journal_size_limit``):
#: one large operate (up to ``maxMessageBytes``, 64 MiB) no longer leaves a log that large behind
JOURNAL_SIZE_LIMIT = 16 << 20
#: the free pages one ``PRAGMA incremental_vacuum`` transaction gives back (``StateStore._tidy``):
#: 4 MiB of 4 KiB pages, tens of milliseconds, so a commit waiting behind it waits no longer
VACUUM_STEP_PAGES = 1024
#: the pause between two of those transactions (the server's commits go first)
TIDY_PAUSE_S = 0.01
#: a step of the tidying never waits for another server's write (or read) holding the connection:
#: it is tried again after each of these pauses (taken without the connection; about 10 s in all),
#: then left for the next delete, commit or start
TIDY_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0)
#: a database made with ``auto_vacuum=0`` is converted at open (``StateStore._compact_at_open``)
#: when more than half its pages, and more than this, are free ...
CONVERT_MIN_FREE_BYTES = 4 << 20
#: ... and it holds no more data than this (``VACUUM`` copies it, holding the write lock, so another
#: server's commits wait: about 0.5 s per 100 MiB)
CONVERT_MAX_BYTES = 64 << 20
#: how long the conversion waits for another server's write before it is left for a later start
CONVERT_BUSY_MS = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS info(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS branches(
    id TEXT PRIMARY KEY, meta TEXT NOT NULL, created_at REAL NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 1, clear_gen INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS messages(
    branch_id TEXT NOT NULL, seq INTEGER NOT NULL, msg_id TEXT NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY(branch_id, seq)) WITHOUT ROWID;
"""


class StateNotSaved(Exception):
    """A change could not be committed; nothing of it is on disk."""

    def __init__(self, message: str, branch_ids: Iterable[str] = (), *, deleted: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.branch_ids = list(branch_ids)
        #: those of ``branch_ids`` that another process deleted: they are gone, on disk and soon here
        self.deleted = list(deleted)


@dataclass
class LoadedBranch:
    id: str
    meta: dict[str, Any]
    messages: list[Message] = field(default_factory=list)
    #: only the messages after the ones this process already holds (an append by another process)
    incremental: bool = False


@dataclass
class _State:
    meta: dict[str, Any] = field(default_factory=dict)
    committed_meta: dict[str, Any] = field(default_factory=dict)
    meta_dirty: bool = False
    new: bool = True            # no row yet: the first flush inserts it
    pending: list[tuple[str, Any]] = field(default_factory=list)  # ("msg", (id, json)) | ("clear", [ids])
    version: int = 0
    clear_gen: int = 0
    max_seq: int = 0


def _dumps(obj: Any) -> str:
    """A record as stored: every known secret value redacted first (a model may echo a key)."""
    if has_secrets():
        obj = redact_value(obj)
    text = json.dumps(obj, ensure_ascii=False, default=str, separators=(",", ":"))
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (legal as a JSON escape, not as UTF-8 text):
            # stored escaped, so it reads back as it came
            text = json.dumps(obj, ensure_ascii=True, default=str, separators=(",", ":"))
    return text


@contextmanager
def _transaction(conn: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> Iterator[None]:
    """One transaction on ``conn`` (autocommit mode): committed when the block ends, rolled back
    when it raises (a failed rollback is not what is reported: the block's error is)."""
    conn.execute(begin)
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise


class _DirLock:
    """An advisory lock (``flock``) on the state directory itself (no file of its own), held
    by a server only while it opens the database (see ``StateStore._open``): shared to check
    it, exclusive to replace or rebuild it. Released when the process ends, however it ends.
    Where there is no ``flock`` (Windows) or the directory cannot be opened or locked (some
    network filesystems), every take succeeds: each server checks and rebuilds on its own."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        if fcntl is None:
            return
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.fd = None

    def take(self, *, exclusive: bool, deadline: float) -> bool:
        """Take the lock, waiting until ``deadline`` (``time.monotonic()``) at most; False
        when another process still holds it then."""
        if self.fd is None:
            return True
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        pause = 0.0
        while True:
            try:
                fcntl.flock(self.fd, op)
                return True
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    log.warning("state: the lock on %s is still held by another server; going on without it",
                                self.path)
                    return False
                if not pause:
                    log.info("state: another server holds the lock on %s (checking or rebuilding the state "
                             "database); waiting for it, %.0f s at most", self.path, deadline - now)
                pause = min(pause * 2 or 0.005, 0.1, deadline - now)
                time.sleep(pause)
            except OSError:  # a filesystem without flock (some network ones): as where there is none
                return True

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            except OSError:
                pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (releases the lock)
            self.fd = None


_collection_lock = threading.Lock()
_collection_off = [0, False]  # how many ``no_collection`` scopes are open; was the collector on before the first


@contextmanager
def no_collection() -> Iterator[None]:
    """No cyclic garbage collection while a restore makes its objects (millions of them for a
    large store: :meth:`StateStore.load` on its worker thread, then the server's branches built
    from them on the event loop). A collection walks every object the process holds with the
    interpreter lock taken: while a restore grew the heap one ran every few hundred ms, each
    longer than the last (0.1 s to 0.3 s at 12,000 branches), and the event loop answered nothing
    meanwhile, wherever the restore ran. The collector is only switched off, and back on when the
    last scope open ends (scopes of two threads may overlap); nothing is frozen, so every object,
    cycles too, is collected as usual afterwards. Process-wide: the collections of other threads
    are put off by that long too, no more."""
    with _collection_lock:
        if _collection_off[0] == 0:
            _collection_off[1] = gc.isenabled()
            gc.disable()
        _collection_off[0] += 1
    try:
        yield
    finally:
        with _collection_lock:
            _collection_off[0] -= 1
            if _collection_off[0] == 0 and _collection_off[1]:
                gc.enable()


def _quick_check(conn: sqlite3.Connection) -> str | None:
    """SQLite's quick check of the database: None when sound, else its first findings."""
    rows = conn.execute("PRAGMA quick_check").fetchall()
    return None if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows[:3])


def _is_busy(e: BaseException) -> bool:
    """``SQLITE_BUSY`` or ``SQLITE_LOCKED``, extended codes too (``SQLITE_BUSY_RECOVERY`` is
    261, ``SQLITE_BUSY_SNAPSHOT`` 517): another connection holds what this one needs."""
    code = getattr(e, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in (5, 6)


def _sqlite_temp_dir() -> str | None:
    """The folder SQLite makes its temporary files in (``VACUUM`` builds its copy there), found
    the way SQLite finds it: on Unix the first of ``SQLITE_TMPDIR``, ``TMPDIR``, ``/var/tmp``,
    ``/usr/tmp``, ``/tmp``, ``.`` that is a folder it may write to; on Windows the user's
    temporary folder. None when there is none (``VACUUM`` then fails, changing nothing)."""
    if os.name == "nt":
        return tempfile.gettempdir()
    for folder in (os.environ.get("SQLITE_TMPDIR"), os.environ.get("TMPDIR"), "/var/tmp", "/usr/tmp", "/tmp", "."):
        if folder and os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
            return folder
    return None


def _is_damage(e: BaseException) -> bool:
    return isinstance(e, sqlite3.DatabaseError) and (
        getattr(e, "sqlite_errorcode", None) in _DAMAGE_CODES
        or "malformed" in str(e) or "not a database" in str(e))


def _salvage_walk(old: sqlite3.Connection, table: str, cols: str, *, where: str = "", params: tuple = (),
                  descending: bool = False, seek: bool = False) -> tuple[list[tuple], bool]:
    """The rows ``SELECT cols FROM table WHERE where`` yields from a damaged database, in the
    order of its first column (unique among them), up to the first one SQLite cannot read; and
    whether the walk got to the end. They are read at once, then (when that fails) one by one
    from the last one read: a cursor reads a row ahead, so the failed read of a damaged page
    also loses the row before it. With ``seek``, one by one from the start, each the next value
    of the first column (the distinct values of a column many rows share, a few page reads
    each)."""
    key = cols.split(",")[0].strip()
    order = f" ORDER BY {key} {'DESC' if descending else 'ASC'}"
    rows: list[tuple] = []
    if not seek:
        try:
            for row in old.execute(f"SELECT {cols} FROM {table}{f' WHERE {where}' if where else ''}{order}", params):
                rows.append(row)
            return rows, True
        except sqlite3.Error:
            pass
    while True:
        conds, args = ([where] if where else []), params
        if rows:
            last = rows[-1][0]
            conds.append(f"{key} {'<' if descending else '>'} {'CAST(? AS TEXT)' if isinstance(last, bytes) else '?'}")
            args += (last,)
        sql = f"SELECT {cols} FROM {table}{' WHERE ' + ' AND '.join(conds) if conds else ''}{order} LIMIT 1"
        try:
            row = old.execute(sql, args).fetchone()
        except sqlite3.Error:
            return rows, False
        if row is None:
            return rows, True
        # a damaged tree may answer a seek out of order: each step must move on, so the walk ends
        if rows and (type(row[0]) is not type(last) or (row[0] >= last if descending else row[0] <= last)):
            return rows, False
        rows.append(row)


def _salvage_ids(old: sqlite3.Connection) -> dict[bytes, list[int]]:
    """Every branch id a damaged database still yields (as stored: bytes), with the rowids its
    row may have: from the branches' index and from their table, and from the messages. Each
    is walked from its start, and from its end too when that walk stops at a damaged page (the
    other one gets past it): a few walks over the ids, so a large database costs what reading
    it costs, never a search of the whole table per branch."""
    ids: dict[bytes, list[int]] = {}
    for table, cols in (("branches INDEXED BY sqlite_autoindex_branches_1", "id, rowid"),
                        ("branches NOT INDEXED", "rowid, id")):
        rows, whole = _salvage_walk(old, table, cols)
        if not whole:
            rows += _salvage_walk(old, table, cols, descending=True)[0]
        for row in rows:
            bid, rowid = row if cols.startswith("id") else row[::-1]
            if isinstance(bid, bytes) and isinstance(rowid, int) and rowid not in ids.setdefault(bid, []):
                ids[bid].append(rowid)
    found, whole = _salvage_walk(old, "messages", "branch_id", seek=True)
    if not whole:
        found += _salvage_walk(old, "messages", "branch_id", seek=True, descending=True)[0]
    for (bid,) in found:
        if isinstance(bid, bytes):
            ids.setdefault(bid, [])
    return ids


def _salvage_row(old: sqlite3.Connection, bid: str, rowids: list[int]) -> tuple | None:
    """``(meta, created_at, version, clear_gen)`` of one branch of a damaged database, read on its
    own: by a rowid it was found with (only the pages on the way to it are read), else by its
    id; None when it cannot be read."""
    damaged = False
    for rowid in rowids:
        try:
            row = old.execute("SELECT id, meta, created_at, version, clear_gen FROM branches WHERE rowid=?",
                              (rowid,)).fetchone()
        except sqlite3.Error:
            damaged = True
            continue
        if row is not None and row[0] == bid.encode("utf-8"):
            return tuple(row[1:])
    if damaged:  # its page is damaged: found by its id, the same page would be read
        return None
    try:
        row = old.execute("SELECT meta, created_at, version, clear_gen FROM branches WHERE id=?", (bid,)).fetchone()
    except sqlite3.Error:
        return None
    return None if row is None else tuple(row)


def _salvage_text(value: Any) -> Any:
    """A stored text read as bytes, as text: bytes that are not UTF-8 replaced by U+FFFD."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


#: what reading a stored meta or message record raises when it is none (a damaged row)
_UNREADABLE = (ValueError, KeyError, TypeError, RecursionError)


def _meta_of(stored: Any) -> dict[str, Any] | None:
    """A branch's stored settings (text or bytes): the JSON object they hold, else None. Loading
    (``StateStore._rows_to_branch``) and the rebuild (``_salvage_meta``) read them this one way."""
    try:
        meta = json.loads(stored, parse_constant=str)
    except _UNREADABLE:
        return None
    return meta if isinstance(meta, dict) else None


def _message_of(record: Any) -> Message:
    """One stored message record (text or bytes) as a message; raises one of ``_UNREADABLE``
    when it is none."""
    return Message.from_record(json.loads(record, parse_constant=str))


def _messages_of(records: list[Any]) -> list[Message]:
    """A branch's stored message records, all of one type (text or bytes), as messages: one
    parse for them all (much faster than one per record, ``_message_of``, which is for finding
    the bad one). Raises one of ``_UNREADABLE`` when one of them is no message, or when they do
    not read as one value each (a damaged record that reads as two). Loading
    (``StateStore._rows_to_branch``) and the rebuild (``_messages_read``) read them this one way.
    (``parse_constant``: a NaN or ±Infinity that an earlier version stored, which no client's
    JSON can take, is read as the string "NaN", "Infinity", "-Infinity", as a tool output's is
    made today: read as a number, every branchMessages of the branch failed -32603.)"""
    if records and isinstance(records[0], bytes):
        joined: Any = b"[" + b",".join(records) + b"]"
    else:
        joined = "[" + ",".join(records) + "]"
    out = [Message.from_record(r) for r in json.loads(joined, parse_constant=str)]
    if len(out) != len(records):
        raise ValueError("the records do not read as one message each")
    return out


def _salvage_meta(value: Any) -> str | None:
    """A branch's stored settings, as text, when they are a JSON object (``_meta_of``); else None."""
    text = _salvage_text(value)
    return text if _meta_of(text) is not None else None


def _messages_read(msgs: list[tuple]) -> int:
    """How many of a branch's stored messages ``(branch_id, seq, msg_id, record)``, read from a
    damaged database, can be copied: those before the first that is no message (one SQLite
    reads, but not as written: a damaged page it does not notice, which loading would skip,
    ``_rows_to_branch``), or whose ``seq`` is no number, or whose ``msg_id`` is not its record's
    id (read as NULL, which the copy cannot insert; or as another text, by which a later clear
    would keep the wrong messages). Parsed as loading parses them: the whole branch at once
    (``_messages_of``), and one by one only to find where a bad one is."""
    try:
        parsed: list[Message] | None = _messages_of([m[3] for m in msgs])
    except _UNREADABLE:
        parsed = None
    for i, (_, seq, mid, record) in enumerate(msgs):
        try:
            message = parsed[i] if parsed is not None else _message_of(record)
        except _UNREADABLE:
            return i
        if not (isinstance(seq, int) and isinstance(mid, str) and message.id == mid):
            return i
    return len(msgs)


def _first_time(msgs: list[tuple]) -> float:
    """The creation time of a branch whose row is lost: its first message's (0 when unknown,
    or no finite number: a damaged record may hold 400 digits, which no float holds)."""
    try:
        t = json.loads(msgs[0][3], parse_constant=str)["created_at"]
    except (IndexError, *_UNREADABLE):
        return 0.0
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return 0.0
    try:
        t = float(t)
    except OverflowError:
        return 0.0
    return t if math.isfinite(t) else 0.0


def _salvage_mark(value: str) -> tuple[str, list[str] | None]:
    """The ``salvaging`` mark of a rebuild not done: the damaged file it copies from, and the
    branches still owed when it was done but for branches it could not write (the mark is then
    ``{"from": file, "branches": [ids]}``, ``StateStore._finish_salvage``); None when it was cut
    short (the mark is the file's path: everything is copied again)."""
    if value.startswith("{"):
        try:
            mark = json.loads(value)
            return str(mark["from"]), [str(bid) for bid in mark["branches"]]
        except (ValueError, KeyError, TypeError):
            pass
    return value, None


class StateStore:
    """The branch store of one ``stateDir``. Thread-safe; its blocking methods are meant to
    run on worker threads (the server calls them with ``asyncio.to_thread``)."""

    def __init__(self, state_dir: str) -> None:
        self.root = os.path.abspath(state_dir)
        os.makedirs(self.root, exist_ok=True)
        self.path = os.path.join(self.root, DB_FILE)
        self.problems: list[str] = []      # damage found / import notes, for the server to report
        self._db = threading.RLock()       # the connection
        self._lock = threading.Lock()      # ``_branches`` and their pending operations
        self._branches: dict[str, _State] = {}
        self._data_version: int | None = None
        self._stale = False
        self.read_only = False
        #: the files this connection writes to (see ``_check_file``), taken when it connects
        self._file_id: tuple[int, int, tuple[int, int] | None] | None = None
        #: the thread giving free pages back (``_tidy``) while one runs, and whether it should go again
        self._tidy_lock = threading.Lock()
        self._tidy_thread: threading.Thread | None = None
        self._tidy_again = False
        #: the last failure of the tidying that was said (``_tidy_failed``), until a tidying goes through
        self._tidy_fault: str | None = None
        #: the file SQLite works on (``_real_file``: a ``state.sqlite3`` that is a link to a file
        #: elsewhere has its ``-wal`` and ``-shm`` beside that file): taken when it connects
        self._file = self._real_file()
        #: the conversion's copy is still in the ``-wal`` (another server's reader was in the way of
        #: its checkpoint), so the file is as large as before: ``_tidy`` checkpoints it
        self._checkpoint_owed = False
        self._closed = False
        self._stop = threading.Event()     # set by ``close``: ends the tidying's pauses at once
        self.conn = self._open()
        if self._file_id is None:
            log.warning("state: cannot stat %s; a database deleted or replaced while the server runs will not "
                        "be noticed", self.path)
        if not self.read_only:
            self._compact_at_open()
            self._import_jsonl()

    # ------------------------------------------------------------ opening
    def _real_file(self) -> str:
        """The file ``path`` leads to now, the one SQLite works on: it resolves links, and keeps
        the ``-wal`` and ``-shm`` beside the file it resolved to. ``path`` itself unless
        ``state.sqlite3`` is a link (folders above it that are links lead to the same place, and
        ``path`` names it as the user gave it); a link whose file is gone leads to where that
        file was, where SQLite makes a fresh one."""
        real = os.path.realpath(self.path)
        return self.path if real == os.path.join(os.path.realpath(self.root), DB_FILE) else real

    def _connect(self) -> sqlite3.Connection:
        # the links resolved once, here, and that file opened: its -wal is the one ``_check_file``
        # watches, even when ``path`` is pointed elsewhere later (which is then a replaced file)
        self._file = self._real_file()
        conn = sqlite3.connect(self._file, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                # a new database: able to give free pages back (``_tidy``). Only before its first
                # page is written (switching to WAL writes it); on an existing one this would take
                # a write lock for nothing (its conversion is ``_compact_at_open``'s)
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"could not switch {self.path} to WAL (journal_mode={mode})")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO info(key, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))
        except BaseException:
            conn.close()
            raise
        # the files this connection has open (its -wal too, made by the write above): taken now,
        # under the state directory's lock (``_open``), so that no other server has moved them
        # since; taken later (after a salvage), it could be another server's fresh file
        self._file_id = self._identity()
        return conn

    def _open(self) -> sqlite3.Connection:
        """Open the database, checked, under the state directory's lock (``_DirLock``): a
        shared hold to connect and check it (servers starting at once check side by side),
        an exclusive one to set a damaged file aside and rebuild it, or to finish a rebuild a
        server that stopped left half done. A server that finds the file damaged waits until
        the one rebuilding it is done, checks again and uses the rebuilt file: it never moves
        another server's fresh file aside as damaged (whose connection would then write to a
        file nobody reads again), and never takes a rebuild still running for one that stopped.
        The wait is bounded (``LOCK_WAIT_S``, then ``_open_unlocked``); a holder that dies
        releases the lock with its process."""
        lock = _DirLock(self.root)
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            if os.path.exists(self.path):
                if not lock.take(exclusive=False, deadline=deadline):
                    return self._open_unlocked()
                try:
                    conn = self._open_if_sound()
                finally:
                    lock.release()
                if conn is not None:
                    return conn
            if not lock.take(exclusive=True, deadline=deadline):
                return self._open_unlocked()
            return self._open_locked()
        finally:
            lock.close()

    def _open_if_sound(self) -> sqlite3.Connection | None:
        """A connection to the database when it exists, passes the check and no rebuild is
        marked in it; else None (what to do is decided under the exclusive lock)."""
        try:
            conn = self._connect()
        except sqlite3.DatabaseError:
            return None
        try:
            if (_quick_check(conn) is None
                    and conn.execute("SELECT value FROM info WHERE key='salvaging'").fetchone() is None):
                return conn
        except sqlite3.DatabaseError:
            pass
        conn.close()
        return None

    def _open_unlocked(self) -> sqlite3.Connection:
        """Another server has held the lock for ``LOCK_WAIT_S`` (a long rebuild): the database
        is used as it is when it passes the check (a rebuild still running: its branches come
        in as they are copied, as any other server's commits do, :meth:`poll`). Nothing is moved
        aside or rebuilt here: a damaged file is the other server's to replace, and the store
        cannot be opened meanwhile."""
        busy = (f"another server has held the lock on {self.root} for over {LOCK_WAIT_S:.0f} s, checking "
                "or rebuilding the state database")
        if not os.path.exists(self.path):
            return self._connect()
        try:
            conn = self._connect()
        except sqlite3.DatabaseError as e:
            if not _is_damage(e):
                return self._open_read_only(e)
            raise sqlite3.OperationalError(f"state database {self.path} is damaged ({e}) and {busy}; "
                                           "restart the server once it is done") from None
        try:
            problem = _quick_check(conn)
            row = conn.execute("SELECT value FROM info WHERE key='salvaging'").fetchone() if problem is None else None
        except sqlite3.DatabaseError as e:
            problem, row = str(e), None
        if problem is not None:
            conn.close()
            raise sqlite3.OperationalError(f"state database {self.path} is damaged ({problem}) and {busy}; "
                                           "restart the server once it is done")
        if row is not None:
            self.problems.append(f"state database {self.path} is being rebuilt from the damaged "
                                 f"{_salvage_mark(row[0])[0]} by {busy}; "
                                 "the branches it has not copied yet appear as it copies them")
        return conn

    def _open_locked(self) -> sqlite3.Connection:
        """Open, check, and rebuild the database if need be (under the exclusive lock: no other
        server is rebuilding it, so a rebuild marked in it is one a server that stopped left)."""
        if not os.path.exists(self.path):
            self._keep_orphan_log()
            return self._connect()
        try:
            conn = self._connect()
        except sqlite3.DatabaseError as e:
            if not _is_damage(e):
                return self._open_read_only(e)
            return self._replace_damaged(str(e))
        try:
            problem = _quick_check(conn)
        except sqlite3.DatabaseError as e:
            if not _is_damage(e):
                conn.close()
                raise
            problem = str(e)
        if problem is None:
            row = conn.execute("SELECT value FROM info WHERE key='salvaging'").fetchone()
            if row is not None:  # a rebuild not done: a server died during it, or could not write every branch
                aside, owed = _salvage_mark(row[0])
                copied, done = self._finish_salvage(row[0], conn)
                if owed is None:
                    self.problems.append(
                        f"state database {self.path} was being rebuilt from the damaged {aside} by a server that "
                        f"stopped before it was done; {'finished' if done else 'continued'} now, with what could "
                        f"still be read ({copied})")
                else:
                    self.problems.append(
                        f"state database {self.path} was rebuilt from the damaged {aside} without {len(owed)} "
                        f"branches that could not be written then; tried again now ({copied})")
            return conn
        conn.close()
        return self._replace_damaged(problem)

    def _identity(self) -> tuple[int, int, tuple[int, int] | None] | None:
        """(device, inode) of the database file and of its ``-wal`` (None when there is none);
        None when the database file cannot be stat-ed. The file is the one ``path`` leads to now
        (a link pointed elsewhere since the connection was made is a replaced file); the ``-wal``
        is the one beside the file the connection writes to (``_file``), where SQLite keeps it."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        try:
            wal = os.stat(self._file + "-wal")
        except OSError:
            return st.st_dev, st.st_ino, None
        return st.st_dev, st.st_ino, (wal.st_dev, wal.st_ino)

    def _check_file(self) -> None:
        """A commit is acknowledged only if it lands in ``<stateDir>/state.sqlite3``: once that
        file or its ``-wal`` (where a commit lands first; SQLite keeps it while a connection is
        open) is deleted or replaced (by a person, a backup restore, a clean-up of "stale"
        files, another server setting a damaged file aside, a link ``state.sqlite3`` pointed at
        another file), this connection would write to a file nobody will read again. Every
        change is then refused (StateNotSaved) until the server is restarted."""
        if self._file_id is not None and self._identity() != self._file_id:
            wal = "its -wal" if self._file == self.path else f"its -wal, {self._file}-wal"
            raise StateNotSaved(f"the state database {self.path} (or {wal}) was deleted or replaced while the "
                                "server was running; changes are refused until the server is restarted")

    def refusal(self) -> str | None:
        """Why every change is refused now, else None: the database is read-only, or was deleted
        or replaced since it was opened (``_check_file``: a stat or two). A change bound to fail
        is refused before it has any effect (an operate: before its model and tools run)."""
        if self.read_only:
            return (f"the state database {self.path} cannot be written; every change is refused until it can be "
                    "(restart the server)")
        try:
            self._check_file()
        except StateNotSaved as e:
            return str(e)
        return None

    def _open_read_only(self, error: BaseException) -> sqlite3.Connection:
        """The database exists but cannot be written (a read-only filesystem, say): serve its
        branches; every change fails (and is refused with :class:`StateNotSaved`)."""
        conn = None
        # read-only WAL needs a -shm file it can create or use: in a directory it cannot write, a
        # database closed cleanly (no -wal left) is still read whole as an immutable file
        for immutable in (False, True):
            try:
                conn = sqlite3.connect(f"file:{self.path}?mode=ro{'&immutable=1' if immutable else ''}", uri=True,
                                       isolation_level=None, check_same_thread=False)
                conn.execute("SELECT COUNT(*) FROM branches").fetchone()
                break
            except sqlite3.Error:
                if conn is not None:
                    conn.close()
                conn = None
        if conn is None:
            raise error from None
        self.read_only = True
        self._file_id = self._identity()
        note = ""
        wal = self._file + "-wal"
        if immutable and os.path.exists(wal) and os.path.getsize(wal) > 0:
            note = (f"; its write-ahead log {wal} ({os.path.getsize(wal)} bytes) cannot be read without "
                    "writing beside it, so the changes it holds are not shown")
        self.problems.append(f"state database {self.path} cannot be written ({error}); its branches are served "
                             f"read-only and every change is refused until it can be written (restart the server)"
                             f"{note}")
        return conn

    def _keep_orphan_log(self) -> None:
        """The database file is gone but its ``-wal`` is not (deleted by hand, a clean-up, a
        backup restored without it): SQLite would silently discard that log, which may hold
        most of the branches. It is moved aside (with its ``-shm``) and reported instead. A link
        ``state.sqlite3`` whose file is gone has that log beside where the file was
        (``_real_file``)."""
        real = self._real_file()
        wal = real + "-wal"
        if not (os.path.exists(wal) and os.path.getsize(wal) > 0):
            return
        aside = self._set_aside("orphan", ("-wal", "-shm"))
        what = self.path if real == self.path else f"{self.path} (a link to {real})"
        self.problems.append(f"state database {what} is missing but its write-ahead log was not; the log "
                             f"({os.path.getsize(aside + '-wal')} bytes) is kept as {aside}-wal and a fresh "
                             "database is in use")

    def _set_aside(self, why: str, suffixes: tuple[str, ...]) -> str:
        """Move the database's files of these ``suffixes`` ("" the database itself) aside, for
        ``why``: beside it, stamped. Returns the path they now have (without the suffix). The
        database is the file ``path`` leads to (``_real_file``): a link ``state.sqlite3`` (to
        another disk, say) is kept, its file and that file's ``-wal`` and ``-shm`` are set aside
        beside it, and the fresh database is made where the link leads."""
        real = self._real_file()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
        aside = f"{real}.{why}-{stamp}"
        for suffix in suffixes:
            if os.path.exists(real + suffix):
                os.replace(real + suffix, aside + suffix)
        return aside

    def _replace_damaged(self, problem: str) -> sqlite3.Connection:
        """Set the damaged database aside (``_set_aside``), make a fresh one and copy into it
        what the damaged one still yields (``_finish_salvage``)."""
        aside = self._set_aside("damaged", ("", "-wal", "-shm"))
        conn = self._connect()
        # marked first: a process that dies half-way leaves a database that looks whole, and the
        # next open finishes the copy (``_open``)
        conn.execute("INSERT OR REPLACE INTO info(key, value) VALUES ('salvaging', ?)", (aside,))
        copied, _ = self._finish_salvage(aside, conn)
        self.problems.append(
            f"state database {self.path} is damaged ({problem}); kept as {aside}; a fresh database is in "
            f"use, with what could still be read from the damaged one ({copied})")
        return conn

    def _finish_salvage(self, mark: str, conn: sqlite3.Connection) -> tuple[str, bool]:
        """Copy what the damaged file the ``salvaging`` mark names still yields (again: a copied
        row is kept as it is; when the mark lists the branches still owed, those only), then
        unmark. Branches that could not be written (a full disk) leave the mark, listing them
        (``_salvage_mark``): the next start copies those, and only those (the others are in use
        by then: changed, cleared, deleted, none of which a copy may undo). Writing that list
        can fail too: the open fails then, as it would on a full disk anyway, and the next start
        copies everything again (nothing was served meanwhile). Returns what was copied, to be
        told, and whether the copy is done."""
        aside, owed = _salvage_mark(mark)
        branches, messages, bare, failed, error = self._salvage(aside, conn)
        copied = f"{branches} branches, {messages} messages"
        if bare:
            copied += (f"; {bare} of those branches without their settings (name, models, policy, usage, "
                       "permission mode, front end's info), which could not be read")
        if not failed:
            conn.execute("DELETE FROM info WHERE key='salvaging'")
            return copied, True
        if owed is None or sorted(owed) != sorted(failed):
            conn.execute("UPDATE info SET value=? WHERE key='salvaging'",
                         (json.dumps({"from": aside, "branches": failed}),))
        copied += (f"; {len(failed)} more branches could not be written ({error}), and are copied at the "
                   "next start")
        return copied, False

    def _salvage(self, aside: str, conn: sqlite3.Connection) -> tuple[int, int, int, list[str], str]:
        """Copy what the damaged database still yields, branch by branch (one transaction each:
        a server waiting for the rebuild sees the branches come in, and a damaged row costs
        only its own branch, never every branch read with it).

        The branches are every id that can still be read (``_salvage_ids``), or those of them
        the ``salvaging`` mark lists as still owed (``_finish_salvage``). Each one's row is read
        on its own, by its rowid, and its messages up to the first unreadable one (no hole that
        SQLite or loading notices): one SQLite cannot read, or one it reads but that is no
        message (a damaged page it does not notice, which loading would skip), or whose
        ``msg_id`` is not its record's id (``_messages_read``). A damaged page that SQLite reads
        as a valid page with fewer rows goes unnoticed: its rows are missing without a trace. A
        branch whose row cannot be read, or whose settings are no JSON object (a damaged page
        SQLite still reads), but whose messages can, is kept with empty settings, as loading
        such a row gives: no name, the default models, no policy, its usage counted from zero,
        the permission mode back to Ask (a read-only branch asks before a change again instead
        of refusing it), and no front end's info; its messages are the work. One with neither is
        gone. Text that is not UTF-8 is copied with U+FFFD in place of the bad bytes, as loading
        reads a record.

        Returns the branches and messages copied (the messages each branch holds once copied),
        how many of those branches were kept without their settings, and the branches that could
        not be written, with the first error."""
        nb = nm = bare = 0
        failed: list[str] = []
        error = ""
        row = conn.execute("SELECT value FROM info WHERE key='salvaging'").fetchone()
        owed = None if row is None else _salvage_mark(row[0])[1]
        try:
            old = sqlite3.connect(f"file:{aside}?mode=ro", uri=True, isolation_level=None)
        except sqlite3.Error:
            return 0, 0, 0, [], ""
        old.text_factory = bytes  # a stored text that is not UTF-8 fails no read: decoded here, bad bytes replaced
        try:
            ids = _salvage_ids(old)
            if owed is not None:
                wanted = {bid.encode("utf-8") for bid in owed}
                ids = {raw_id: rowids for raw_id, rowids in ids.items() if raw_id in wanted}
            for raw_id in sorted(ids, key=lambda i: (min(ids[i], default=1 << 63), i)):  # the old rows' order
                try:
                    bid = raw_id.decode("utf-8")
                except UnicodeDecodeError:  # a garbled id: no branch anyone knows
                    continue
                row = _salvage_row(old, bid, ids[raw_id])
                msgs = [(bid, seq, _salvage_text(mid), _salvage_text(rec)) for seq, mid, rec in _salvage_walk(
                    old, "messages", "seq, msg_id, record", where="branch_id=?", params=(bid,))[0]]
                msgs = msgs[:_messages_read(msgs)]
                meta = _salvage_meta(row[0]) if row is not None else None
                if meta is None and not msgs:
                    continue
                created = row[1] if row is not None and isinstance(row[1], (int, float)) else _first_time(msgs)
                version, clear_gen = row[2:] if row is not None else (1, 0)
                try:
                    with _transaction(conn):
                        conn.execute("INSERT OR IGNORE INTO branches(id, meta, created_at, version, clear_gen) "
                                     "VALUES (?,?,?,?,?)",
                                     (bid, "{}" if meta is None else meta, created,
                                      version if isinstance(version, int) else 1,
                                      clear_gen if isinstance(clear_gen, int) else 0))
                        conn.executemany("INSERT OR IGNORE INTO messages(branch_id, seq, msg_id, record) "
                                         "VALUES (?,?,?,?)", msgs)
                        held = conn.execute("SELECT COUNT(*) FROM messages WHERE branch_id=?", (bid,)).fetchone()[0]
                except sqlite3.Error as e:  # a full disk, say: told, and copied at the next start
                    failed.append(bid)
                    error = error or str(e)
                    continue
                nb += 1
                nm += held
                bare += meta is None
        finally:
            old.close()
        return nb, nm, bare, failed, error

    def _import_jsonl(self) -> None:
        """Import a 0.1 JSONL journal (``branches/``) once, then rename it ``branches.imported-0.1``."""
        old_dir = os.path.join(self.root, "branches")
        if not os.path.isdir(old_dir):
            return
        with self._db:
            done = self.conn.execute("SELECT value FROM info WHERE key='jsonl_imported'").fetchone()
        if done is None:
            from .jsonl_import import created_at, read_journal

            imported = read_journal(self.root)
            skipped = sum(b.skipped for b in imported)
            with self._db:
                c = self.conn
                with _transaction(c):
                    for b in imported:
                        c.execute("INSERT OR IGNORE INTO branches(id, meta, created_at, version, clear_gen) "
                                  "VALUES (?,?,?,1,0)", (b.id, _dumps(b.meta), created_at(b.meta)))
                        c.executemany("INSERT OR IGNORE INTO messages(branch_id, seq, msg_id, record) "
                                      "VALUES (?,?,?,?)",
                                      [(b.id, i + 1, r["id"], _dumps(r)) for i, r in enumerate(b.records)])
                    c.execute("INSERT OR REPLACE INTO info(key, value) VALUES ('jsonl_imported', ?)",
                              (_dumps({"branches": len(imported), "skipped": skipped, "at": time.time()}),))
            note = (f"imported the 0.1 journal in {old_dir}: {len(imported)} branches, "
                    f"{sum(len(b.records) for b in imported)} messages")
            if skipped:
                note += f"; {skipped} unreadable records skipped (every later record kept)"
            self.problems.append(note)
        try:
            os.replace(old_dir, old_dir + ".imported-0.1")
        except OSError:
            pass  # the marker in the database keeps it from being imported twice

    def close(self) -> None:
        """Close the connection (the last one out checkpoints the WAL into the database file).
        A tidying thread (``_tidy``) stops at once: it never holds the connection while it waits
        for another server, so this waits for one step of it at most, never for another server."""
        with self._tidy_lock:
            self._closed = True
            tidying = self._tidy_thread
        self._stop.set()
        with self._db:
            try:
                self.conn.close()
            except sqlite3.Error:
                pass
        if tidying is not None and tidying is not threading.current_thread():
            tidying.join(5.0)

    # ------------------------------------------------------------ disk space
    @contextmanager
    def _busy_timeout(self, ms: int) -> Iterator[None]:
        """The connection's busy timeout is ``ms`` for the block (held with ``self._db``)."""
        self.conn.execute(f"PRAGMA busy_timeout={ms}")
        try:
            yield
        finally:
            try:
                self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            except sqlite3.Error:
                pass

    def _room_for_copy(self, data: int) -> str | None:
        """None when the disks have room for ``VACUUM``'s copy of ``data`` bytes: SQLite builds
        it in a temporary file (in ``_sqlite_temp_dir()``), then writes it into the database
        through the ``-wal`` beside it (one filesystem holding both needs room for both): beside
        the file SQLite works on, in the folder a link ``state.sqlite3`` leads to (``_file``),
        not in the state directory. Else what is short, to be said."""
        margin = 8 << 20
        need: dict[int, list[Any]] = {}  # device: [bytes needed, bytes free, folders]
        for folder in (os.path.dirname(self._file), _sqlite_temp_dir()):
            if folder is None:
                continue
            try:
                dev, free = os.stat(folder).st_dev, shutil.disk_usage(folder).free
            except OSError:
                continue
            n = need.setdefault(dev, [margin, free, []])
            n[0] += data
            n[1] = min(n[1], free)
            n[2].append(folder)
        for want, free, folders in need.values():
            if free < want:
                return (f"that needs about {want >> 20} MiB of free disk in {' and '.join(folders)}, "
                        f"{free >> 20} MiB are free")
        return None

    def _compact_at_open(self) -> None:
        """A database made with ``auto_vacuum=0`` (before the store gave space back) only reuses
        the pages its deletes freed: deleting every branch left the file at its largest. It is
        converted here once (``PRAGMA auto_vacuum=INCREMENTAL; VACUUM``: a compact copy written
        through the WAL, the file kept in place) when that pays: more than half its pages, and
        more than ``CONVERT_MIN_FREE_BYTES``, are free. ``VACUUM`` holds the write lock while it
        copies, so another server's commits wait for it: never at the cost of the start, of
        another server or of the data: not when it holds more than ``CONVERT_MAX_BYTES`` (said
        in one line, with how to do it by hand), nor when the disk has no room for the copy
        (``_room_for_copy``; said too, tried again at the next start); when another server is
        writing to it (``SQLITE_BUSY`` after ``CONVERT_BUSY_MS``) it is left quietly for a later
        start; a failed ``VACUUM`` (a full disk) changes nothing (SQLite rolls it back; said in
        one line). Another server that has the file open reads on from it as before. The copy
        went through the ``-wal``, which is cut to nothing then (a truncating checkpoint, or
        ``_tidy`` once another server's reader is done: until that checkpoint the file keeps its
        old size, so it is owed, ``_checkpoint_owed``, whatever the size of the ``-wal``). A converted database, or one made so,
        with free pages left (a server stopped before it gave them back) has them given back
        now (``_tidy_soon``)."""
        c = self.conn
        with self._db:
            try:
                mode, pages, free, size = (c.execute(f"PRAGMA {p}").fetchone()[0] for p in
                                           ("auto_vacuum", "page_count", "freelist_count", "page_size"))
            except sqlite3.Error:
                return
            if mode != 0:
                if free:
                    self._tidy_soon()
                return
            if not (free * 2 > pages and free * size > CONVERT_MIN_FREE_BYTES):
                return
            mib = 1 << 20
            data = (pages - free) * size
            if data > CONVERT_MAX_BYTES:
                log.warning("state: %s has %d MiB of free pages (deleted branches) that it keeps; with %d MiB of "
                            "data it is too large to compact at start: with every server on it stopped, run "
                            "sqlite3 %s 'PRAGMA auto_vacuum=INCREMENTAL; VACUUM' once (from then on the space "
                            "of deleted branches is given back)", self.path, free * size // mib, data // mib,
                            self.path)
                return
            short = self._room_for_copy(data)
            if short is not None:
                log.warning("state: %s has %d MiB of free pages (deleted branches) but is not compacted: %s "
                            "(tried again at the next start)", self.path, free * size // mib, short)
                return
            try:
                with self._busy_timeout(CONVERT_BUSY_MS):
                    c.execute("PRAGMA auto_vacuum=INCREMENTAL")
                    c.execute("VACUUM")
            except sqlite3.Error as e:
                if _is_busy(e):  # another server
                    log.debug("state: %s not compacted now (another server is writing to it)", self.path)
                else:
                    log.warning("state: could not compact %s (%s); it is kept as it was (tried again at the "
                                "next start)", self.path, e)
                return
            if not self._checkpoint(truncate=True):  # another server reads the old pages: later
                self._checkpoint_owed = True
                self._tidy_soon()
            log.info("state: compacted %s once: %d of its %d MiB were free pages (deleted branches); from now on "
                     "the space of a deleted branch is given back as it is deleted",
                     self.path, free * size // mib, pages * size // mib)

    def _checkpoint(self, truncate: bool) -> bool:
        """One checkpoint that never waits (held with ``self._db``): ``TRUNCATE`` cuts the
        ``-wal`` to nothing, ``PASSIVE`` copies it into the file (which cuts the file to its
        pages). True when it went through whole; False when another server's reader or writer
        was in the way (or it failed): to be tried again."""
        try:
            with self._busy_timeout(0):
                busy, frames, done = self.conn.execute(
                    f"PRAGMA wal_checkpoint({'TRUNCATE' if truncate else 'PASSIVE'})").fetchone()
        except sqlite3.Error:
            return False
        return busy == 0 and frames == done

    def _tidy_soon(self) -> None:
        """Have free pages given back and a grown ``-wal`` cut, on a thread of the store
        (``_tidy``), started now unless one runs (which then goes once more). Called after a
        commit that freed pages (a delete, a clear) or grew the log past ``JOURNAL_SIZE_LIMIT``:
        the caller's answer never waits for it."""
        if self.read_only:
            return
        with self._tidy_lock:
            if self._closed:
                return
            self._tidy_again = True
            if self._tidy_thread is not None:
                return
            self._tidy_thread = threading.Thread(target=self._tidy_loop, name="state-tidy", daemon=True)
            self._tidy_thread.start()

    def _tidy_loop(self) -> None:
        """Tidy until nobody asked again meanwhile; the thread ends then (none waits idle)."""
        while True:
            with self._tidy_lock:
                if self._closed or not self._tidy_again:
                    self._tidy_thread = None
                    return
                self._tidy_again = False
            try:
                self._tidy()
            except Exception:  # never more than space not given back yet: a later change tries again
                log.exception("state: could not give the free space of %s back", self.path)

    def _tidy_failed(self, e: BaseException) -> None:
        """A step of the tidying failed, not for another server (a damaged page, an I/O error):
        said in one line, once for as long as it fails the same way. It is tried again after
        every later delete or clear, and after every commit while the ``-wal`` is over its limit
        (when the checkpoint that follows could not cut it): a line for each would fill the log."""
        said = f"{type(e).__name__}: {e}"
        if said == self._tidy_fault:
            log.debug("state: the free space of %s is still not given back (%s)", self.path, e)
            return
        self._tidy_fault = said
        log.warning("state: could not give the free space of %s back (%s); tried again after each later delete "
                    "or clear, each commit while its -wal is over %d MiB, and at the next start (not said again "
                    "while it fails the same way)", self.path, e, JOURNAL_SIZE_LIMIT >> 20)

    def _tidy_pause(self, seconds: float) -> bool:
        """Wait ``seconds`` without holding the connection; True when the store is closed
        meanwhile (the tidying stops then)."""
        return self._stop.wait(seconds)

    def _tidy_retry(self, retries: Iterator[float], later: str) -> bool:
        """Wait the next of the ``TIDY_RETRY_S`` pauses (``retries``) without the connection, for
        a step another server was in the way of; True when the tidying stops: none is left (said
        on the debug log: ``later``, with the database's path) or the store was closed meanwhile."""
        pause = next(retries, None)
        if pause is None:
            log.debug("state: " + later, self.path)
            return True
        return self._tidy_pause(pause)

    def _after_commit(self, freed: bool) -> None:
        """After a commit: tidy when it freed pages, or left the ``-wal`` above its limit (a
        large operate: the log is cut back by a checkpoint that truncates it, which the commit's
        own automatic checkpoint does not do)."""
        if not freed:
            try:
                if os.path.getsize(self._file + "-wal") <= JOURNAL_SIZE_LIMIT:
                    return
            except OSError:
                return
        self._tidy_soon()

    def _tidy(self) -> None:
        """Give the free pages back (``PRAGMA incremental_vacuum``), ``VACUUM_STEP_PAGES`` per
        transaction, each committed as any other (WAL, ``synchronous=FULL``: a crash during one
        leaves the database as it was before it), the connection let go for ``TIDY_PAUSE_S``
        between them so the server's commits do not wait behind more than one; then checkpoint,
        which cuts the file to its pages, and the ``-wal`` to nothing when it grew past its limit
        (``_checkpoint``). No step waits for another server while it holds the connection
        (busy timeout 0): one that another server's write or read is in the way of is tried
        again after the next of the ``TIDY_RETRY_S`` pauses, taken without the connection (so
        the server's reads and commits go on meanwhile, and ``close`` ends them), then left for
        the next delete or start (or a commit that leaves the ``-wal`` over its limit). The
        checkpoint the conversion at open could not make (``_checkpoint_owed``) is made here as
        after pages given back. Nothing is done once the file was replaced (``_check_file``). A
        step that fails otherwise (a damaged page, ``_tidy_failed``) ends the giving back, not the
        checkpoint after it: a ``-wal`` over its limit is still cut."""
        retries = iter(TIDY_RETRY_S)
        gave_back = False
        while True:
            busy = False
            with self._db:
                if self._closed:
                    return
                c = self.conn
                try:
                    self._check_file()
                    with self._busy_timeout(0):
                        if (c.execute("PRAGMA auto_vacuum").fetchone()[0] != 2
                                or c.execute("PRAGMA freelist_count").fetchone()[0] == 0):
                            self._tidy_fault = None  # it went through: a failure after this is said again
                            break
                        c.executescript(f"PRAGMA incremental_vacuum({VACUUM_STEP_PAGES})")  # (all its steps)
                    gave_back = True
                except StateNotSaved:
                    return
                except sqlite3.Error as e:  # a damaged page is a DatabaseError, not an OperationalError
                    if not _is_busy(e):
                        self._tidy_failed(e)
                        break  # the checkpoint still goes on: a grown -wal is cut all the same
                    busy = True
            if self._tidy_retry(retries, "the free space of %s is given back later (another server kept writing "
                                "to it)") if busy else self._tidy_pause(TIDY_PAUSE_S):
                return
        while True:
            with self._db:
                if self._closed:
                    return
                try:
                    wal = os.path.getsize(self._file + "-wal")
                except OSError:
                    wal = 0
                owed = self._checkpoint_owed
                if not gave_back and not owed and wal <= JOURNAL_SIZE_LIMIT:
                    return
                if self._checkpoint(truncate=owed or wal > JOURNAL_SIZE_LIMIT):
                    self._checkpoint_owed = False
                    return
            if self._tidy_retry(retries, "the -wal of %s is cut after a later commit (another server kept reading "
                                         "from it)"):
                return

    # ------------------------------------------------------------ loading
    def _rows_to_branch(self, bid: str, meta_json: bytes, rows: list[tuple]) -> tuple[LoadedBranch, int]:
        """A branch from its rows, read as bytes (``CAST(... AS BLOB)``): a value that is not
        UTF-8 (a damaged page) must not fail the read of every branch, as SQLite's decoding
        for Python would; json decodes the bytes, and a damaged row alone is dealt with."""
        meta = _meta_of(meta_json)
        if meta is None:
            log.warning("state: branch %s has an unreadable meta; loaded without name and policy", bid)
            meta = {}
        max_seq = rows[-1][0] if rows else 0
        try:  # one parse for the whole branch ...
            msgs = _messages_of([rec for _, rec in rows])
        except _UNREADABLE:  # ... and row by row when one is unreadable
            msgs = []
            for seq, rec in rows:
                try:
                    msgs.append(_message_of(rec))
                except UnicodeDecodeError:  # bytes that are not UTF-8: kept with U+FFFD in their place
                    try:
                        msgs.append(_message_of(rec.decode("utf-8", "replace")))
                        log.warning("state: message %d of branch %s held bytes that are not UTF-8; "
                                    "loaded with U+FFFD in their place", seq, bid)
                    except _UNREADABLE:
                        log.warning("state: message %d of branch %s unreadable; skipped", seq, bid)
                except _UNREADABLE:
                    log.warning("state: message %d of branch %s unreadable; skipped", seq, bid)
        return LoadedBranch(id=bid, meta=meta, messages=msgs), max_seq

    def load(self) -> list[LoadedBranch]:
        """Every stored branch, oldest first by creation (blocking: call from a worker thread)."""
        with no_collection():
            return self._load()

    def _load(self) -> list[LoadedBranch]:
        with self._db:
            c = self.conn
            with _transaction(c, "BEGIN"):
                branches = c.execute("SELECT id, CAST(meta AS BLOB), version, clear_gen FROM branches "
                                     "ORDER BY created_at, rowid").fetchall()
                per = {bid: c.execute("SELECT seq, CAST(record AS BLOB) FROM messages WHERE branch_id=? "
                                      "ORDER BY seq", (bid,)).fetchall() for bid, *_ in branches}
                self._data_version = c.execute("PRAGMA data_version").fetchone()[0]
        out = []
        for bid, meta_json, version, clear_gen in branches:
            lb, max_seq = self._rows_to_branch(bid, meta_json, per[bid])
            with self._lock:
                self._branches[bid] = _State(meta=dict(lb.meta), committed_meta=dict(lb.meta), new=False,
                                             version=version, clear_gen=clear_gen, max_seq=max_seq)
            out.append(lb)
        return out

    def _read_branch(self, bid: str, after_seq: int = 0) -> tuple[LoadedBranch, int, int, int] | None:
        row = self.conn.execute("SELECT CAST(meta AS BLOB), version, clear_gen FROM branches WHERE id=?",
                                (bid,)).fetchone()
        if row is None:
            return None
        rows = self.conn.execute("SELECT seq, CAST(record AS BLOB) FROM messages WHERE branch_id=? AND seq>? "
                                 "ORDER BY seq", (bid, after_seq)).fetchall()
        lb, max_seq = self._rows_to_branch(bid, row[0], rows)
        return lb, row[1], row[2], max_seq or after_seq

    def unchanged(self) -> bool:
        """True when no other process committed since the last look (one ``PRAGMA
        data_version``, without waiting: False when the connection is busy). Cheap enough
        for the event loop; :meth:`poll` does the rest on a worker thread."""
        if not self._db.acquire(blocking=False):
            return False
        try:
            return not self._stale and self.conn.execute("PRAGMA data_version").fetchone()[0] == self._data_version
        except sqlite3.Error:
            return False
        finally:
            self._db.release()

    def poll(self, busy: Iterable[str] = ()) -> tuple[list[LoadedBranch], list[str]] | None:
        """What other processes committed since this one last looked: (branches new or changed,
        ids deleted). ``busy`` branches (an operate running here) are left for a later poll.
        None when nothing changed (one ``PRAGMA data_version``)."""
        busy = set(busy)
        with self._db:
            c = self.conn
            dv = c.execute("PRAGMA data_version").fetchone()[0]
            if dv == self._data_version and not self._stale:
                return None
            self._data_version = dv
            with _transaction(c, "BEGIN"):
                rows = c.execute("SELECT id, version, clear_gen FROM branches").fetchall()
                on_disk = {r[0] for r in rows}
                changed: list[LoadedBranch] = []
                stale = False
                for bid, version, clear_gen in rows:
                    with self._lock:
                        st = self._branches.get(bid)
                        if st is not None and st.version == version:
                            continue
                        if bid in busy or (st is not None and (st.pending or st.meta_dirty or st.new)):
                            stale = True
                            continue
                    incremental = st is not None and st.clear_gen == clear_gen
                    got = self._read_branch(bid, st.max_seq if incremental else 0)  # type: ignore[union-attr]
                    if got is None:
                        continue
                    lb, version, clear_gen, max_seq = got
                    lb.incremental = incremental
                    with self._lock:
                        self._branches[bid] = _State(
                            meta=dict(lb.meta), committed_meta=dict(lb.meta), new=False, version=version,
                            clear_gen=clear_gen, max_seq=max_seq)
                    changed.append(lb)
                removed = []
                with self._lock:
                    for bid, st in list(self._branches.items()):
                        if bid in on_disk or st.new:
                            continue
                        if bid in busy or st.pending or st.meta_dirty:
                            stale = True
                            continue
                        del self._branches[bid]
                        removed.append(bid)
                self._stale = stale
        return (changed, removed) if changed or removed else None

    # ------------------------------------------------------------ recording
    def attach(self, branch: Any, meta: dict[str, Any], *, new: bool = True) -> None:
        """Record ``branch`` from now on. ``new``: it has no row yet; its meta and current
        messages go out with its first flush. Their records are made before the store's lock
        is taken, and installed under it: a fork of 100,000 messages (``forkBranch``, attached on
        a worker thread) took half a second to make them, and every recorded message, flush
        and new branch of the event loop waits for that lock."""
        bid = branch.id
        records = [("msg", (m.id, _dumps(m.to_record()))) for m in branch.messages] if new else []
        with self._lock:
            st = self._branches.get(bid)
            if st is None or new:
                st = self._branches[bid] = _State(new=new)
            st.meta = dict(meta)
            if new:
                st.meta_dirty = True
                st.pending = records
            else:
                st.committed_meta = dict(meta)

        def on_append(m: Message) -> None:
            rec = _dumps(m.to_record())
            with self._lock:
                s = self._branches.get(bid)
                if s is not None:
                    s.pending.append(("msg", (m.id, rec)))

        def on_clear(kept: list[Message]) -> None:
            with self._lock:
                s = self._branches.get(bid)
                if s is not None:
                    s.pending.append(("clear", [m.id for m in kept]))

        branch.messages.on_append(on_append)
        branch.messages.on_clear(on_clear)

    def adopt(self, branch: Any, meta: dict[str, Any]) -> None:
        """Record a branch read from the database (its rows exist)."""
        self.attach(branch, meta, new=False)

    def update_meta(self, bid: str, meta: dict[str, Any]) -> None:
        with self._lock:
            st = self._branches.get(bid)
            if st is None:
                return
            st.meta = {**st.meta, **meta}
            st.meta_dirty = True

    def committed_meta(self, bid: str) -> dict[str, Any]:
        with self._lock:
            st = self._branches.get(bid)
            return dict(st.committed_meta) if st is not None else {}

    def forget(self, bid: str) -> None:
        """Stop recording a branch that was never committed (its creation failed)."""
        with self._lock:
            st = self._branches.get(bid)
            if st is not None and st.new:
                del self._branches[bid]

    def dirty(self, bids: Any = None, *, messages: bool = True) -> bool:
        with self._lock:
            return any(st.meta_dirty or st.new or (messages and st.pending) for bid, st in self._branches.items()
                       if bids is None or bid in bids)

    def flush(self, bids: Any = None, *, messages: bool = True) -> list[LoadedBranch]:
        """Commit what is pending, one transaction per branch (blocking). Returns the branches
        another process had committed to in the meantime, re-read whole (the caller replaces
        its copy). Raises :class:`StateNotSaved` naming the branches whose transaction failed:
        their pending operations are dropped and their meta is the committed one again."""
        with self._db:
            with self._lock:
                todo = [bid for bid, st in self._branches.items()
                        if (bids is None or bid in bids) and (st.meta_dirty or st.new or (messages and st.pending))]
            reloads: list[LoadedBranch] = []
            failed: dict[str, str] = {}
            deleted: list[str] = []
            for bid in todo:
                try:
                    lb = self._commit(bid, messages)
                except StateNotSaved as e:
                    failed[bid] = str(e)
                    deleted += e.deleted
                    continue
                if lb is not None:
                    reloads.append(lb)
            if failed:
                raise StateNotSaved("; ".join(f"branch {b}: {m}" for b, m in failed.items()), failed,
                                    deleted=deleted)
            return reloads

    def _commit(self, bid: str, messages: bool) -> LoadedBranch | None:
        with self._lock:
            st = self._branches.get(bid)
            if st is None:
                return None
            ops = st.pending if messages else []
            if messages:
                st.pending = []
            meta = dict(st.meta) if (st.meta_dirty or st.new) else None
            st.meta_dirty = False
            new, known_version = st.new, st.version
        c = self.conn
        try:
            with _transaction(c):
                self._check_file()
                row = c.execute("SELECT version, clear_gen FROM branches WHERE id=?", (bid,)).fetchone()
                if new:
                    if row is not None:
                        raise StateNotSaved(f"a branch with id {bid} already exists")
                    c.execute("INSERT INTO branches(id, meta, created_at, version, clear_gen) VALUES (?,?,?,0,0)",
                              (bid, _dumps(meta), float((meta or {}).get("createdAt") or time.time())))
                    version, clear_gen = 0, 0
                else:
                    if row is None:
                        raise StateNotSaved("it was deleted by another process", [bid], deleted=[bid])
                    version, clear_gen = row
                diverged = not new and version != known_version
                seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM messages WHERE branch_id=?",
                                (bid,)).fetchone()[0]
                rows: list[tuple] = []
                for kind, payload in ops:
                    if kind == "msg":
                        seq += 1
                        rows.append((bid, seq, payload[0], payload[1]))
                    else:
                        if rows:
                            c.executemany("INSERT INTO messages(branch_id, seq, msg_id, record) VALUES (?,?,?,?)",
                                          rows)
                            rows = []
                        keep = list(payload)
                        c.execute(f"DELETE FROM messages WHERE branch_id=? AND msg_id NOT IN "
                                  f"({','.join('?' * len(keep))})", (bid, *keep))
                        clear_gen += 1
                if rows:
                    c.executemany("INSERT INTO messages(branch_id, seq, msg_id, record) VALUES (?,?,?,?)", rows)
                if meta is not None:
                    if diverged:  # another process changed the meta too: keep its other changes
                        meta = self._merge_meta(bid, meta)
                    c.execute("UPDATE branches SET meta=?, version=version+1, clear_gen=? WHERE id=?",
                              (_dumps(meta), clear_gen, bid))
                else:
                    c.execute("UPDATE branches SET version=version+1, clear_gen=? WHERE id=?", (clear_gen, bid))
                version += 1
        except Exception as e:  # whatever it was, nothing of it is on disk: say so, put memory back
            with self._lock:
                st2 = self._branches.get(bid)
                if st2 is not None:
                    st2.meta = dict(st2.committed_meta)
                    st2.meta_dirty = False
            # (a branch another process deleted meanwhile is no fault here: the request says so, -32013)
            (log.warning if getattr(e, "deleted", ()) else log.error)("state: could not save branch %s: %s", bid, e)
            raise StateNotSaved(str(e), [bid], deleted=getattr(e, "deleted", ())) from e
        self._after_commit(freed=any(kind == "clear" for kind, _ in ops))
        with self._lock:
            st2 = self._branches.get(bid)
            if st2 is not None:
                st2.new = False
                st2.version = version
                st2.clear_gen = clear_gen
                st2.max_seq = seq
                if meta is not None:
                    st2.committed_meta = dict(meta)
                    if not st2.meta_dirty:
                        st2.meta = dict(meta)
        if not diverged:
            return None
        with self._db:
            got = self._read_branch(bid)
        if got is None:
            return None
        lb, version, clear_gen, max_seq = got
        with self._lock:
            st2 = self._branches.get(bid)
            if st2 is not None and not st2.pending and not st2.meta_dirty:
                st2.version, st2.clear_gen, st2.max_seq = version, clear_gen, max_seq
                st2.meta = dict(lb.meta)
                st2.committed_meta = dict(lb.meta)
        return lb

    def _merge_meta(self, bid: str, meta: dict[str, Any]) -> dict[str, Any]:
        """Our meta changes applied over what is on disk now (policies per tool, the front
        end's info per field: ``MERGED_PER_KEY``; running totals by adding our increase:
        ``SUMMED``; everything else per key)."""
        row = self.conn.execute("SELECT CAST(meta AS BLOB) FROM branches WHERE id=?", (bid,)).fetchone()
        try:
            disk = json.loads(row[0]) if row else {}
        except ValueError:
            disk = {}
        with self._lock:
            base = dict(self._branches[bid].committed_meta) if bid in self._branches else {}
        out = dict(disk)
        for k, v in meta.items():
            if k in MERGED_PER_KEY and isinstance(v, dict):
                old = base.get(k) if isinstance(base.get(k), dict) else {}
                merged = dict(disk.get(k)) if isinstance(disk.get(k), dict) else {}
                for key in set(old) | set(v):
                    if old.get(key) != v.get(key):
                        if key in v:
                            merged[key] = v[key]
                        else:
                            merged.pop(key, None)
                out[k] = merged
            elif k in SUMMED and isinstance(v, dict) and base.get(k) != v:
                out[k] = _summed(SUMMED[k], disk.get(k), base.get(k), v)
            elif base.get(k) != v:
                out[k] = v
        return out

    def delete(self, bid: str) -> None:
        """Delete a branch and its messages in one transaction (blocking)."""
        with self._db:
            c = self.conn
            try:
                with _transaction(c):
                    self._check_file()
                    c.execute("DELETE FROM messages WHERE branch_id=?", (bid,))
                    c.execute("DELETE FROM branches WHERE id=?", (bid,))
            except (sqlite3.Error, OSError, StateNotSaved) as e:
                log.error("state: could not delete branch %s: %s", bid, e)
                raise StateNotSaved(str(e), [bid]) from e
            with self._lock:
                self._branches.pop(bid, None)
        self._tidy_soon()  # its pages given back after the answer, not before


def _summed(totals: tuple[str, ...], disk: Any, base: Any, mine: dict[str, Any]) -> dict[str, Any]:
    """``mine`` (this process's value, read as ``base``) applied over ``disk`` (another
    process's since): each of ``totals`` is disk's plus what this process added to it (None,
    unknown, when either side's is); every other field changed here is this process's."""
    disk = disk if isinstance(disk, dict) else {}
    base = base if isinstance(base, dict) else {}
    out = dict(disk)

    def count(d: dict[str, Any], key: str) -> int | None:
        n = d.get(key, 0)
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    for key, now in mine.items():
        if key not in totals:
            if base.get(key) != now:
                out[key] = now
            continue
        there, before, mine_n = count(disk, key), count(base, key), count(mine, key)
        if mine_n is not None and mine_n == before:
            continue  # not added to here: disk's stands
        if there is None or mine_n is None:
            out[key] = None
        else:
            out[key] = there + max(mine_n - (before or 0), 0)
    return out


class UnavailableStore:
    """Stands in when ``stateDir`` cannot be opened: every change is refused with
    :class:`StateNotSaved` (the server never acts memory-only while it claims a ``stateDir``)."""

    def __init__(self, state_dir: str, reason: str) -> None:
        self.root = state_dir
        self.reason = reason
        self.problems: list[str] = []

    def _refuse(self, bids: Any = ()) -> None:
        raise StateNotSaved(self.refusal(), bids or ())

    def refusal(self) -> str:
        return f"the state directory {self.root} is unusable: {self.reason}"

    def attach(self, branch: Any, meta: dict[str, Any], *, new: bool = True) -> None:
        pass

    adopt = attach

    def update_meta(self, bid: str, meta: dict[str, Any]) -> None:
        pass

    def committed_meta(self, bid: str) -> dict[str, Any]:
        return {}

    def forget(self, bid: str) -> None:
        pass

    def dirty(self, bids: Any = None, *, messages: bool = True) -> bool:
        return bids is not None

    def flush(self, bids: Any = None, *, messages: bool = True) -> list[LoadedBranch]:
        if bids is not None:  # nothing can be pending: no branch was ever created here
            self._refuse(bids)
        return []

    def delete(self, bid: str) -> None:
        self._refuse([bid])

    def poll(self, busy: Iterable[str] = ()) -> None:
        return None

    def unchanged(self) -> bool:
        return True

    def close(self) -> None:
        pass
