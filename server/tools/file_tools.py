"""The file tools' I/O seam and the file-changing calls (``write_file``, ``edit_file``).

**The file port.** Builtin file tools never open files themselves: they read and write
through a :class:`FileAccess`, which the front end chooses when it builds the tools:

- :class:`DiskFiles`: the workspace on disk (``WorkspaceTools._read_text`` /
  ``_write_text``, confined and symlink-safe), the default;
- :class:`ClientFiles`: the client's file system, so unsaved editor buffers are what the
  model reads and edits land in them. It sends ``fs/readTextFile {branchId, callId, path}``
  → ``{text}`` and ``fs/writeTextFile {branchId, callId, path, text}`` → ``{}`` through any
  ``request(method, params, timeout)`` coroutine function: the native front end passes its
  ``request_client``; another front end passes its own (or its own ``FileAccess``).

Paths handed to a port are always real absolute paths already confined to the workspace
folders (``WorkspaceTools.resolve``): nothing outside is ever read or asked for. The disk's
port walks each path again from its root as it opens it (``safe_fs``); a client's port opens
it by its name, following what it finds, so right before each request to the client (every
read, every write) the path is walked the same way, no symlink followed
(``WorkspaceTools.check_file``): a directory on the way that is now a symlink or not a
directory (swapped while the user was asked, say) fails the call ("'sub' is a symlink or not
a directory; nothing written") and the client is not asked; so does a path that holds a
directory, a symlink, a FIFO, a socket or a device ("is not a file", as the disk's read says:
an editor reading a FIFO blocks). A path with nothing on the disk is asked for (the editor
may hold an unsaved buffer of it). What the client does between our look and its own open is
out of our reach (docs/SECURITY.md, Known limits).

**Previews and no lost work.** :class:`FileTools` plans a change (read, apply, diff) without
writing. Governance asks for a plan before it asks the user (``PreviewTool.preview``); the
plan is kept for that ``callId`` and the call, once allowed, writes exactly the planned text
only if the file still holds the text the plan was computed from; otherwise nothing is
written and the call fails saying the file changed. An unplanned call (policy ``allow``) re-reads
the file just before it writes, with the same rule. A plan that cannot be made (edits that do
not apply, a path outside the workspace, a write bound to fail: a read-only file, a file
where a directory is needed, a directory we may not write to, checked by a port that can tell,
``check_writable``) is kept as a failure: the call then fails at once with that error, and
nobody is asked. The write checks again (something can change meanwhile). At most
``PENDING_LIMIT`` (256) changes wait at once, previewed and not yet run, holding at most
``PENDING_CHARS`` (256 Mi) characters of text (old text, new text and diff), in the whole
process (every ``FileTools``: the service builds new ones when the workspace folders change,
while the old ones' plans wait on): a preview past either is refused the same way (the call
fails at once saying too many changes, or too much text, are waiting for review), and a kept
plan is never dropped for room, since the call, planned again when it runs, would write a
change nobody saw. A plan goes when its call runs, is forgotten, or its task ends.

**Turns.** Calls that change one file take turns (a lock per real path, for the whole
process, first come first served), so of two changes made at once (two calls of one reply, or
operates on two branches) neither is lost. A previewed call takes its turn before it plans and
keeps it while the user decides, until it has written (or failed), or is forgotten (denied,
timed out, cancelled): the next change of that file is planned, and put to the user, only
then, from the file as it then is (a second edit that builds on the first applies; two
independent ones both land). An unplanned call plans inside its turn, so it builds on the
change before it. A call that holds a turn but will never run (vetoed after it was allowed)
gives it up when its task ends, or when the same task asks for that file again or has
another call previewed. Calls on
other files never wait. A change made outside the server between the preview and the write
still makes the call fail as above.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from ..core.tools import Tool, ToolCallContext, off_the_loop
from ..service.port import client_error_reason as _reason
from ..service.port import client_says_not_found
from .builtin import (  # a client's text is looked at for a NUL as far as the disk's bytes are, paged alike
    BINARY_SNIFF,
    page_json_chars,
    read_page,
)
from .edits import EditError, FileChange, apply_edits, change, split_lines
from .errors import ToolCallError, WorkspacePathError

if TYPE_CHECKING:
    from .builtin import WorkspaceTools

__all__ = ["FileAccess", "DiskFiles", "ClientFiles", "FileTools", "PreviewTool", "FILE_CHANGING", "write_failed"]

#: builtin tools that change files (their permission requests carry a diff preview)
FILE_CHANGING = ("write_file", "edit_file")
#: the most changes previewed and waiting (for the user's answer, or to run) at once, in the
#: process; a preview past it is refused
PENDING_LIMIT = 256
#: the most text (characters of old text, new text and diff) those changes hold at once, in the
#: process: each may hold over 20 Mi characters (a 10 MiB file replaced by another), so the
#: count alone bounds nothing; a preview past it is refused
PENDING_CHARS = 256 * 1024 * 1024


class FileAccess(Protocol):
    """How the builtin file tools read and write text. ``real`` is an absolute path inside a
    workspace folder; ``ctx`` names the call (``branch_id``, ``call_id``). A port may also
    have ``async check_writable(real, ctx)``, raising ToolCallError when a write is bound to
    fail (the disk's does; the client's cannot tell)."""

    async def read_text(self, real: Path, ctx: ToolCallContext) -> str | None:
        """The file's text, or None when it does not exist. Other failures raise ToolCallError."""

    async def write_text(self, real: Path, text: str, ctx: ToolCallContext) -> None:
        """Replace (or create) the file's text. Failures raise ToolCallError."""


def _missing(real: Path, ws: "WorkspaceTools | None" = None) -> bool:
    """Nothing is at ``real`` (the file a write would create). Only a lookup that says so
    (``ENOENT``, ``ENOTDIR``) counts: ``os.path.lexists`` is False for any failure, so a file
    whose absolute path is longer than the system takes (``ENAMETOOLONG``, a deep tree) was
    previewed as a new file and overwritten unseen. Such a path is looked up as the tools reach
    it, a folder at a time from its workspace folder (``ws``)."""
    try:
        os.lstat(real)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        if ws is None:
            return False
        from operate_sidecar.server.tools import safe_fs

        try:
            root, rel = ws._where(real)
            fd, _ = safe_fs.open_regular(root, rel)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except Exception:  # noqa: BLE001 - something is there (a folder, a special file...): the read says what
            return False
        os.close(fd)
    return False


class DiskFiles:
    """The workspace on disk, through the tools' confined, symlink-safe helpers."""

    def __init__(self, ws: "WorkspaceTools") -> None:
        self.ws = ws

    async def read_text(self, real: Path, ctx: ToolCallContext) -> str | None:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self._read, real)

    def _read(self, real: Path) -> str | None:
        if _missing(real, self.ws):
            return None
        return self.ws._read_text(real, strict=True)

    async def write_text(self, real: Path, text: str, ctx: ToolCallContext) -> None:
        import anyio.to_thread

        await anyio.to_thread.run_sync(self.ws._write_text, real, text)

    async def check_writable(self, real: Path, ctx: ToolCallContext) -> None:
        """Fail now, as the write would: a read-only file, a directory we may not write to..."""
        import anyio.to_thread

        await anyio.to_thread.run_sync(self.ws._check_writable, real)


class ClientFiles:
    """The client's file system over ``fs/readTextFile`` / ``fs/writeTextFile``. An error
    answer is a tool error, naming the client's reason, and nothing is written; a write's answer
    that is not a write done (:func:`write_failed`: ``"failed to save"``, ``false``,
    ``{"error": ...}``) is a tool error too, naming what the client answered, and the change
    is never reported made. Only a read
    error that says the file is not there (:func:`client_says_not_found`), for a path that does
    not exist on disk either, is taken as "no such file" (so ``write_file`` can create one): a
    read that failed otherwise (the answer was over ``maxMessageBytes``, the client failed,
    timed out) may be of an unsaved buffer with no file on disk, which must never be
    overwritten unseen, nor reported missing."""

    def __init__(self, request: Callable[[str, dict, float | None], Awaitable[Any]],
                 timeout: float | None = 60.0) -> None:
        self.request = request
        self.timeout = timeout

    async def read_text(self, real: Path, ctx: ToolCallContext) -> str | None:
        wait, near = self._read_wait()
        try:
            res = await self.request("fs/readTextFile", {"branchId": ctx.branch_id, "callId": ctx.call_id,
                                                         "path": str(real)}, wait)
        except (TimeoutError, OSError) as e:
            why = f"no answer within {wait:.1f} s, before the call's own time-out" \
                if near and isinstance(e, TimeoutError) else self._why(e)
            raise ToolCallError(f"the client did not answer fs/readTextFile for {real}: {why}") from None
        except Exception as e:  # ClientRequestError (an error answer)
            if _missing(real) and client_says_not_found(e, real):
                return None
            raise ToolCallError(f"the client could not read {real}: {_reason(e)}") from None
        text = res.get("text") if isinstance(res, dict) else None
        if not isinstance(text, str):
            raise ToolCallError(f"the client's fs/readTextFile answer for {real} has no text")
        if "\x00" in text[:BINARY_SNIFF]:  # an editor's text of a binary file: refused as the disk's is
            raise ToolCallError(f"{str(real)!r} is a binary file (the client's text of it holds NUL characters)")
        return text

    async def write_text(self, real: Path, text: str, ctx: ToolCallContext) -> None:
        # a request the client has cannot be taken back: until it is answered, a time-out of the
        # call (which cancels this; the note stays for its error) or of this request says the
        # write may still land, so the model reads before it changes the file again
        note = f"the client was asked to write {real} and may still do so: read it before changing it again"
        ctx.pending.append(note)
        try:
            res = await self.request("fs/writeTextFile", {"branchId": ctx.branch_id, "callId": ctx.call_id,
                                                          "path": str(real), "text": text}, self.timeout)
        except Exception as e:
            ctx.pending.remove(note)
            if isinstance(e, (TimeoutError, OSError)):
                may_land = f"; {note}" if isinstance(e, TimeoutError) else ""
                raise ToolCallError(f"the client did not answer fs/writeTextFile for {real}: {self._why(e)}{may_land}") \
                    from None
            raise ToolCallError(f"the client could not write {real}: {_reason(e)}") from None
        ctx.pending.remove(note)
        failed = write_failed(res)
        if failed is not None:
            raise ToolCallError(f"the client could not write {real}: it answered fs/writeTextFile with {failed} "
                                "(a write done is answered with {})")

    def _read_wait(self) -> tuple[float | None, bool]:
        """How long a read waits for the client's answer, and whether it was shortened to end
        before the call's own time-out. A read made while a call runs under a time-out
        (``toolTimeoutMs``, whose timer started first, with the same length) ends a little
        before that time-out (a tenth of the time left, at most a quarter of a second), so that
        the call fails saying the client did not answer, not only that the tool timed out. A
        read with no time-out over it (the one that makes a preview, before the user is asked)
        waits ``timeout``."""
        import math

        import anyio

        deadline = anyio.current_effective_deadline()
        if deadline == math.inf:
            return self.timeout, False
        left = deadline - anyio.current_time()
        wait = left - min(0.25, left / 10)
        if wait <= 0 or (self.timeout is not None and self.timeout <= wait):
            return self.timeout, False  # (no time left to end first: the call's time-out ends it)
        return wait, True

    def _why(self, e: BaseException) -> str:
        """Why a request got no answer (an exception is truthy even when its text is empty)."""
        if isinstance(e, TimeoutError):
            return str(e) or (f"no answer within {self.timeout:g} s" if self.timeout is not None else "timed out")
        return str(e) or type(e).__name__


def write_failed(res: Any) -> str | None:
    """The client's answer to ``fs/writeTextFile`` as shown in an error (JSON, at most 200
    characters) when it is not a write done, or None when it is one: the one check of both
    front ends (the ACP port hands back the editor's raw result). A write done is answered
    with an object with no ``error`` in it (docs/PROTOCOL.md §10: ``{}``), with null (a void
    answer, as JSON-RPC libraries send one, and avante does) or with ``true`` (an editor whose
    handler returns the save's success); an editor whose save failed may answer anything else
    instead of an error response: a string ("failed to save"), ``false``, ``0``, or an object
    whose ``error`` is not null. Taken for a write, its edit would be reported done, with its
    diff, while the file kept its old text."""
    if res is None or res is True or isinstance(res, dict) and res.get("error") is None:
        return None
    import json

    shown = json.dumps(res, ensure_ascii=False, default=str)
    return shown if len(shown) <= 200 else shown[:200] + "…"


@dataclass(slots=True, eq=False)
class PreviewTool(Tool):
    """A tool whose calls can be planned before they run: ``preview(arguments, ctx)`` returns
    the permission request's ``preview`` (or raises the error the call will fail with);
    ``forget(call_id)`` drops a plan that will not run (the call was denied)."""

    preview: Callable[[dict[str, Any], ToolCallContext], Awaitable[dict[str, Any]]] | None = None
    forget: Callable[[str], None] | None = None

class _PathLock:
    """The turns on one real path: one file-changing call at a time, in this process."""

    __slots__ = ("lock", "users", "holder")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0                  # calls that hold or await the turn (the entry goes at 0)
        self.holder: _Turn | None = None  # a previewed call holding the turn until it runs or will not


#: real path -> its turns (entries go when no call holds or awaits one)
_PATH_LOCKS: dict[Path, _PathLock] = {}


class _Pending:
    """The changes previewed and waiting in this process, of every :class:`FileTools` (the
    service builds a new one when the workspace folders change; the old one's plans still
    wait): how many (previews being made included) and the text they hold."""

    changes = 0
    chars = 0


class _Turn:
    """One call's turn on one real path, from when it is taken until :meth:`end` (idempotent)."""

    __slots__ = ("real", "entry", "owner", "abandon", "ended")

    def __init__(self, real: Path, entry: _PathLock) -> None:
        self.real = real
        self.entry = entry
        self.owner: asyncio.Task | None = None
        self.abandon: Callable[[], None] | None = None
        self.ended = False

    def hold(self, abandon: Callable[[], None]) -> None:
        """Keep the turn past the preview, until the call runs or is forgotten. Should neither
        happen (the call was vetoed, or its task ended before it ran), the turn is given up
        when its task ends, or when the same task asks for this path again (its calls come one
        after another, so that earlier call will never run)."""
        self.abandon = abandon
        self.entry.holder = self
        self.owner = asyncio.current_task()
        if self.owner is not None:
            self.owner.add_done_callback(self._owner_done)

    def _owner_done(self, _task: Any) -> None:
        self.give_up()

    def give_up(self) -> None:
        abandon, self.abandon = self.abandon, None
        if abandon is not None:
            abandon()
        self.end()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.owner is not None:
            self.owner.remove_done_callback(self._owner_done)
        entry = self.entry
        if entry.holder is self:
            entry.holder = None
        entry.lock.release()
        _leave(self.real, entry)


def _leave(real: Path, entry: _PathLock) -> None:
    entry.users -= 1
    if entry.users == 0 and _PATH_LOCKS.get(real) is entry:
        del _PATH_LOCKS[real]


async def _take_turn(real: Path) -> _Turn:
    """Wait for the turn on ``real`` (first come, first served); :meth:`_Turn.end` gives it back."""
    entry = _PATH_LOCKS.get(real)
    if entry is None:
        entry = _PATH_LOCKS[real] = _PathLock()
    entry.users += 1
    try:
        held = entry.holder
        if held is not None and held.owner is not None and held.owner is asyncio.current_task():
            held.give_up()  # an earlier call of this very task that never ran
        await entry.lock.acquire()
    except BaseException:
        _leave(real, entry)
        raise
    return _Turn(real, entry)


@dataclass(slots=True, eq=False)
class _Plan:
    real: Path
    change: FileChange | None
    error: str | None = None
    #: the call's turn on ``real``, held from the preview until it runs or is forgotten
    turn: _Turn | None = None
    #: the task the call runs in (the plan goes when it ends)
    owner: asyncio.Task | None = None
    #: the text the change holds (counted in ``_Pending.chars`` while the plan is kept)
    chars: int = 0


def _chars(ch: FileChange) -> int:
    """The text a planned change holds: old text, new text and diff."""
    return len(ch.old_text or "") + len(ch.new_text) + len(ch.diff)


#: a text longer than this is edited and diffed on a worker thread (``off_the_loop``); a
#: thousand edits of a 10 MB file held the loop, ping and cancel included, for seconds
INLINE_CHANGE_CHARS = 256 * 1024


class FileTools:
    """``read_file`` (through a client port), ``write_file`` and ``edit_file`` over a :class:`FileAccess`."""

    def __init__(self, ws: "WorkspaceTools", files: FileAccess | None = None) -> None:
        self.ws = ws
        self.files: FileAccess = files if files is not None else DiskFiles(ws)
        self.client = files is not None and not isinstance(files, DiskFiles)
        self._plans: dict[str, _Plan] = {}
        #: task -> the call id of its plan (a task's calls come one after another)
        self._owned: dict[asyncio.Task, str] = {}

    # ------------------------------------------------------------------ wiring
    def wrap(self, tools: list[Tool]) -> list[Tool]:
        """``tools`` with the file-changing ones (and ``read_file`` for a client port) bound here."""
        out: list[Tool] = []
        for t in tools:
            if t.name in FILE_CHANGING:
                t = self._bind(t, self._runner(t.name), preview=True)
            elif t.name == "read_file" and self.client:
                t = self._bind(t, self._read_file)
            out.append(t)
        return out

    def _bind(self, t: Tool, func: Any, preview: bool = False) -> Tool:
        values = {f.name: getattr(t, f.name) for f in fields(Tool)}
        values["func"] = func
        if preview:
            name = t.name
            values["preview"] = lambda arguments, ctx: self.preview(name, arguments, ctx)
            values["forget"] = self.forget
        return PreviewTool(**values)

    def _runner(self, name: str) -> Any:
        async def run(arguments: dict[str, Any], ctx: ToolCallContext) -> Any:
            return await self.run(name, arguments, ctx)

        return run

    # ------------------------------------------------------------------ planning
    async def plan(self, name: str, arguments: dict[str, Any], ctx: ToolCallContext,
                   real: Path | None = None) -> tuple[Path, FileChange]:
        """Read the file and compute the change ``name(**arguments)`` makes, without writing.
        ``real``: the path, already resolved from ``arguments["path"]``."""
        path = arguments.get("path")
        if real is None:
            real = self.ws.resolve_file(path)  # confined before anything is read or asked
        # a directory, a FIFO, a device, a symlink swapped in: refused before any port is asked
        self._check(real, None, writing=True)
        check = getattr(self.files, "check_writable", None)
        if check is not None:  # a write bound to fail is never put to the user (the write checks again)
            await check(real, ctx)
        shown = self.ws.display(real)
        if name == "write_file":
            content = arguments.get("content")
            if not isinstance(content, str):
                raise ToolCallError("content must be a string")
            self._check_size(content)
            old = await self._read_old(real, ctx)
            large = max(len(old or ""), len(content)) > INLINE_CHANGE_CHARS
            return real, await off_the_loop(large, change, shown, old, content)
        old = await self._read_old(real, ctx)
        if old is None:
            raise WorkspacePathError(f"{path!r} does not exist (edit_file changes an existing file; "
                                     "use write_file to create one)")

        def edited(old: str) -> FileChange:
            try:
                new = apply_edits(old, arguments.get("edits") or [], self.ws.max_write_bytes)
            except EditError as e:
                raise ToolCallError(f"{e}; nothing was written to {shown}") from None
            self._check_size(new)
            return change(shown, old, new)

        return real, await off_the_loop(len(old) > INLINE_CHANGE_CHARS, edited, old)

    def _check(self, real: Path, shown: str | None, *, writing: bool) -> None:
        """Refuse, as the disk's read (``writing``: write) would, a path that now goes through a
        symlink or holds something that is not a regular file (``WorkspaceTools.check_file``).
        Made on the loop, as ``Path.is_dir`` was here (a few ``openat``/``fstatat`` of the path's
        components), and with no await between it and the request it guards."""
        self.ws.check_file(real, shown, writing=writing)

    async def _read(self, real: Path, ctx: ToolCallContext, *, writing: bool = True,
                    shown: str | None = None) -> str | None:
        """The port's text of ``real``; a client's port is asked only once the path is checked
        again (:meth:`_check`): the disk's walks it as it reads."""
        if self.client:
            self._check(real, shown, writing=writing)
        return await self.files.read_text(real, ctx)

    async def _write(self, real: Path, text: str, ctx: ToolCallContext) -> None:
        """The port's write of ``text`` to ``real``, checked again first as :meth:`_read` is."""
        if self.client:
            self._check(real, None, writing=True)
        await self.files.write_text(real, text, ctx)

    async def _read_old(self, real: Path, ctx: ToolCallContext) -> str | None:
        """The text a change is computed from. The client's text of a file is held to the
        disk's size bound (``WorkspaceTools._read_text``): over 10 MiB it is neither edited nor
        replaced, with the same error (what it held could not be shown to the user)."""
        old = await self._read(real, ctx)
        if old is not None and self.client:
            self.ws.check_text_size(real, old)
        return old

    def _check_size(self, text: str) -> None:
        try:
            n = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate: a JSON escape can carry one, a file cannot
            raise ToolCallError(f"the new text is not Unicode text: character {e.start} is "
                                f"{text[e.start]!r}, half of a surrogate pair; nothing written") from None
        if n > self.ws.max_write_bytes:
            raise WorkspacePathError(f"the new text is {n} bytes; the limit is {self.ws.max_write_bytes}")

    async def preview(self, name: str, arguments: dict[str, Any], ctx: ToolCallContext) -> dict[str, Any]:
        """Plan the call and keep the plan for ``ctx.call_id``; the permission preview.
        A call that cannot be planned keeps its error (the call will fail with it) and raises.

        The plan is made in the call's turn on its file, and the turn is held until the call
        has run or is forgotten (denied, timed out, cancelled): another change of that file
        is planned, and put to the user, only after this one is decided and written, from
        the file as it then is. Calls on other files do not wait.

        At most :data:`PENDING_LIMIT` changes are previewed and waiting at once (a call waiting
        for its turn is not one yet), holding at most :data:`PENDING_CHARS` characters of text,
        counted over every ``FileTools`` of the process: past either a preview is refused (the
        call fails at once, nobody is asked, nothing is written). A plan is never dropped
        to make room: a call whose plan were gone would be planned again when it runs, and
        write a change the user never saw."""
        turn: _Turn | None = None
        counted = False
        try:
            self._drop_earlier(ctx.call_id)
            real = self.ws.resolve_file(arguments.get("path"))  # confined before anything is read or asked
            turn = await _take_turn(real)
            if _Pending.changes >= PENDING_LIMIT:
                raise ToolCallError(f"too many changes are waiting for review ({PENDING_LIMIT} at once); "
                                    "this one was not put to the user and nothing was written: "
                                    "make it again once those are decided")
            _Pending.changes += 1  # counted from now: a preview being made holds text too
            counted = True
            real, ch = await self.plan(name, arguments, ctx, real)
            size = _chars(ch)
            if _Pending.chars + size > PENDING_CHARS:  # (no await from here until it is counted)
                raise ToolCallError(f"too much text is waiting for review (this change holds {size} characters, "
                                    f"those waiting {_Pending.chars}; at most {PENDING_CHARS} at once); "
                                    "this one was not put to the user and nothing was written: "
                                    "make it again once those are decided")
        except BaseException as e:
            if turn is not None:
                turn.end()
            if counted:
                _Pending.changes -= 1
            if isinstance(e, Exception):  # any failure: the call must fail with it, never run unplanned
                self._keep(ctx.call_id, _Plan(Path("."), None, str(e) or type(e).__name__))
            raise
        plan = _Plan(real, ch, turn=turn, chars=size)
        _Pending.chars += size
        self._keep(ctx.call_id, plan)  # its count is the one taken above
        turn.hold(lambda: self._drop(ctx.call_id, plan))
        return ch.preview(str(real))

    def _keep(self, call_id: str, plan: _Plan) -> None:
        """Keep ``plan`` for ``call_id`` until the call runs, is forgotten, or its task ends
        (or goes on to another call): a call whose plan was dropped is one that will never run,
        so a plan, even a failure, is never dropped for room (the memory is bounded by
        :data:`PENDING_LIMIT` changes, :data:`PENDING_CHARS` characters, and one failure per
        task). Its caller, :meth:`preview`, has dropped the plan an earlier call of this task
        left (``_drop_earlier``)."""
        self._drop(call_id)
        owner = asyncio.current_task()
        if owner is not None:
            plan.owner = owner
            self._owned[owner] = call_id
            owner.add_done_callback(self._owner_done)
        self._plans[call_id] = plan

    def _drop_earlier(self, call_id: str) -> None:
        """Drop the plan an earlier call of this task left (its calls come one after another:
        that one will never run; it was vetoed after it was allowed)."""
        owner = asyncio.current_task()
        earlier = self._owned.get(owner) if owner is not None else None
        if earlier is not None and earlier != call_id:
            self._drop(earlier)

    def _owner_done(self, task: Any) -> None:
        call_id = self._owned.get(task)
        if call_id is not None:
            self._drop(call_id)

    def _take(self, call_id: str) -> _Plan | None:
        """Remove ``call_id``'s plan from those kept (its turn, if any, stays with it)."""
        plan = self._plans.pop(call_id, None)
        if plan is None:
            return None
        if plan.owner is not None:
            if self._owned.get(plan.owner) == call_id:
                del self._owned[plan.owner]
            plan.owner.remove_done_callback(self._owner_done)
            plan.owner = None
        if plan.change is not None:
            _Pending.changes -= 1
            _Pending.chars -= plan.chars
        return plan

    def _drop(self, call_id: str, plan: _Plan | None = None) -> None:
        """Drop ``call_id``'s plan (only if it is ``plan``, when given) and give its turn back."""
        kept = self._plans.get(call_id)
        if kept is not None and (plan is None or kept is plan):
            self._take(call_id)
            self._release(kept)

    @staticmethod
    def _release(plan: _Plan) -> None:
        if plan.turn is not None:
            plan.turn.end()

    def forget(self, call_id: str) -> None:
        self._drop(call_id)

    # ------------------------------------------------------------------ running
    async def run(self, name: str, arguments: dict[str, Any], ctx: ToolCallContext) -> dict[str, Any]:
        planned = self._take(ctx.call_id)
        if planned is not None and planned.error is not None:
            raise ToolCallError(planned.error)
        if planned is not None and planned.turn is not None:
            turn = planned.turn  # held since the preview
        else:
            real = planned.real if planned is not None else self.ws.resolve_file(arguments.get("path"))
            turn = await _take_turn(real)
        try:  # in the turn: another call's plan, check and write never come between these
            if planned is not None:
                real, ch = planned.real, planned.change
                assert ch is not None
                when = "after the change was previewed"
            else:
                real, ch = await self.plan(name, arguments, ctx, turn.real)
                when = "while the change was being made"
            # no lost work: the file must still hold the text the change was computed from
            current = await self._read(real, ctx)
            if current != ch.old_text:
                what = "was created" if ch.old_text is None else ("was deleted" if current is None else "changed")
                raise ToolCallError(f"{ch.path} {what} {when}; nothing was written. "
                                    "Read the file again and redo the change.")
            await self._write(real, ch.new_text, ctx)
        finally:
            turn.end()
        if name == "write_file":
            return {"path": ch.path, "bytes": len(ch.new_text.encode("utf-8")), "created": ch.old_text is None,
                    "diff": ch.diff}
        return {"path": ch.path, "diff": ch.diff, "added": ch.added, "removed": ch.removed}

    async def _read_file(self, arguments: dict[str, Any], ctx: ToolCallContext) -> dict[str, Any]:
        """``read_file`` through the client port (unsaved buffers included)."""
        path = arguments.get("path")
        offset = int(arguments.get("offset", 1))
        limit = int(arguments.get("limit", 2000))
        if offset < 1:
            raise WorkspacePathError("offset must be 1 or more (line numbers are 1-based)")
        if limit < 1:
            raise WorkspacePathError("limit must be 1 or more")
        real = self.ws.resolve_file(path)
        # a directory, a FIFO, a device, a symlink swapped in: "is not a file", as read_file from
        # the disk says it, and the client is not asked (an editor reading a FIFO blocks)
        text = await self._read(real, ctx, writing=False, shown=path)
        if text is None:
            raise WorkspacePathError(f"{path!r} does not exist")
        shown = self.ws.display(real)
        page = self.ws.max_read_bytes
        chars = page_json_chars(page, shown, offset, limit)  # as the disk's page

        def paged(text: str) -> tuple[str, int, int | None, bool]:
            lines = split_lines(text)  # numbered as read_file from the disk numbers them
            rest = itertools.islice(lines, offset - 1, None)
            return read_page(zip(rest, map(len, itertools.islice(lines, offset - 1, None))),
                             first=offset, limit=limit, page=page, chars=chars, text=None,
                             cut=lambda line, n: line[:n])

        # a client's text of megabytes is split and paged on a worker thread, as an edit of it is
        content, count, next_offset, truncated = await off_the_loop(len(text) > INLINE_CHANGE_CHARS, paged, text)
        return {"path": shown, "offset": offset, "lines": count, "content": content,
                "nextOffset": next_offset, "truncated": truncated}
