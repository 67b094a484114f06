"""The service both front ends drive: the state and the methods of the protocol, with no wire.

Holds branches (with a per-branch FIFO lock), configured models (built on first use), the
server-wide tool registry every branch shares, governance, the optional state store and the
``toolEvent`` sequence. It reaches its client only through a ``ClientPort`` (``port``); the
native front end (``server.rpc``) and the ACP front end (``server.acp``) each pass their own.
Its methods take and return the protocol's JSON shapes (names as on the native wire) and raise
``errors.RpcError`` (or core errors, mapped by ``errors.map_exception``). No pipeline policy
lives here: ``operate`` is ``prepare_operate_kw`` + core ``operate`` with the wire's values.
Imports no transport: no pygls, no lsprotocol, nothing from ``server.rpc`` or ``server.acp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Collection

from . import errors as E
from .errors import RpcError, invalid_params
from .governance import MODES, Governance
from .port import ClientRequestError
from .progress import WireProgress
from .schemas import SchemaCache
from .turns import Turns

if TYPE_CHECKING:
    from .port import ClientPort

log = logging.getLogger("operate_sidecar.server.service")

#: worker threads the service uses at once for blocking store work
THREADS = 4
#: threads the service runs sync Python tools on at once (its own ``core.tools.ToolThreads``,
#: shut down by ``aclose``; the core's default pool has the same size, ``core.tools.TOOL_THREADS``,
#: not imported here so that making a service loads no core). A tool that outlives its time-out
#: holds its thread until it returns (threads cannot be killed); when every thread is held, a
#: fresh pool takes the next calls (a few times over, then they queue and fail on their own
#: time-out): see ``ToolThreads``.
TOOL_THREADS = 16
#: how long ``aclose`` lets background tasks finish before they are cancelled
CLOSE_TIMEOUT_S = 3.0
#: how long one step of the event loop builds restored branches before it lets other work run
#: (``Service._restore_build``: 12,000 branches built in one step froze the server for seconds)
RESTORE_SLICE_S = 0.005
#: the lists of its tools an MCP server that says they changed may have at once, one after the
#: other, and the time that earns it one more (``Service._serve_mcp``): its lists are bounded
#: (one that says so at every list is listed once a second), and a few changes close together
#: are each listed at once
RELIST_BURST = 3
RELIST_EVERY_S = 1.0
#: how long requests (an operate and its rounds, listTools, a prompt) wait for a list of tools
#: due when they came (or, an operate's, when its round began), from when the first began to,
#: and how long one request waits in all (``Service._relists_waited``: the time its several
#: waits, a prompt's, its operate's and its rounds', spend waiting adds up to that at most,
#: however long the time between them): a list that hangs (until its time-out, 30 s) then
#: goes on in the background, and the requests with the tools registered
RELIST_WAIT_S = 5.0
#: messages of a ``branchMessages`` page made, and encoded (``rpc.server.encode_page``), between
#: two yields to the event loop
PAGE_SLICE = 1000


def _camel_to_snake(name: str) -> str:
    out = []
    for ch in name:
        if ch.isupper():
            out.append("_")
            out.append(ch.lower())
        else:
            out.append(ch)
    return "".join(out)


class Service:
    """State and methods. ``rpc`` is the front end's ``ClientPort`` (``port``: notify,
    request_client, conn): the native ``SidecarServer`` or the ACP front end's ``AcpPort``."""

    def __init__(self, rpc: "ClientPort") -> None:
        self.rpc = rpc
        self.conn = rpc.conn
        self.branches: dict[str, Any] = {}
        self._turns_: Any = None  # ``_turns``: operates' turns in arrival order (``service.turns``)
        self._models: dict[str, Any] = {}
        self._inline: dict[str, Any] = {}
        self.schemas = SchemaCache()
        self.seq = 0
        self.registry: Any = None
        self.governance: Governance | None = None
        self.journal: Any = None
        self._tools_ready: asyncio.Event | None = None
        self._policy_names_checked = False  # ``_check_policy_names`` ran
        #: tool name -> the source that offers it, for what a name clash reports ("module 'x'",
        #: "MCP server 'y'"; tools not in it are named by their kind, ``_origin``)
        self._tool_origin: dict[str, str] = {}
        self._mcp_stop = asyncio.Event()  # set by ``aclose``: the MCP servers stop cleanly
        #: the configured MCP servers (``settings.mcpServers``) that stopped on their own, each with
        #: the warning that told it: the next ``ensure_tools`` starts those again (their running
        #: siblings are left alone); ``_mcp_restarted``: set once that start is over
        self._mcp_lost: dict[str, str] = {}
        self._mcp_restarted: asyncio.Event | None = None
        #: the configured MCP servers that failed their first start, each with the warning that told
        #: it: the next ``ensure_tools`` (a need after the one that waited for that start) tries
        #: them once more, as it starts again those that stopped
        self._mcp_failed: dict[str, str] = {}
        #: the configured MCP servers running (one started again is named knowing its siblings'
        #: names, ``_mcp_sibling_names``: its tools keep the names they had)
        self._mcp_running: set[str] = set()
        #: per block of configured MCP servers one of which said its tools changed: set once they
        #: are listed again (``_serve_mcp``); ``ensure_tools`` waits for them
        self._mcp_unsettled: set[_Relist] = set()
        #: request (its task: an operate with its rounds, listTools, an ACP prompt with its
        #: operate) -> how long it may still wait for lists of tools, in seconds: ``RELIST_WAIT_S``
        #: less the time its waits took so far (``_relists_waited``; none yet: all of it)
        self._relist_left: weakref.WeakKeyDictionary[asyncio.Task, float] = weakref.WeakKeyDictionary()
        #: configured MCP server -> its own name for each tool it listed -> the name that tool was
        #: offered as (kept once it stopped: started again, a tool it still lists keeps that name)
        self._mcp_offered: dict[str, dict[str, str]] = {}
        #: set once the background try of configured MCP servers whose first start timed out has
        #: ended (started or not): ``_check_policy_names_once`` waits for it
        self._mcp_retry: asyncio.Event | None = None
        #: branch -> the warnings that concern it alone (``_branch_problem``, ``branch_problems``)
        self._problems: dict[str, list[str]] = {}
        self._state_loaded = False
        #: the task restoring the branches (``_restore``) while one runs: set when it ends
        self._restoring: asyncio.Event | None = None
        #: the last request in ``_state``'s line: done once it has gone on past it (``_state``)
        self._state_last: asyncio.Future | None = None
        self._opened: tuple[Any, list, str | None] | None = None  # what it read
        #: the task group that owns every background task of the service (see ``start``)
        self._tg: Any = None
        self._owner: asyncio.Task | None = None
        self._started: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._threads: Any = None  # anyio.CapacityLimiter: blocking store work on worker threads
        self._model_specs: dict[str, dict[str, Any]] = {}  # branch id -> wire model specs (journal meta)
        self._flush_lock: asyncio.Lock | None = None
        #: branch id -> (message count, copy if the operate clears) before the operate running on it
        self._settled: dict[str, tuple[int, list | None]] = {}
        #: branch id -> token usage of the operates run on it (``listBranches``)
        self._usage: dict[str, Any] = {}
        #: branch id -> what a front end keeps about it (``branch_info``; saved with the branch)
        self._info: dict[str, dict[str, Any]] = {}
        #: branch id -> the folders its operates' builtin tools are confined to (``set_branch_folders``)
        self._roots: dict[str, tuple[Any, ...]] = {}
        self._tool_threads: Any = None  # see ``tool_threads``
        self._tool_threads_closed = False
        #: branch id -> the task of the operate running on it (``deleteBranch`` ends it)
        self._running: dict[str, asyncio.Task] = {}
        #: branch id -> the operates waiting for their turn on it (``deleteBranch`` ends them too)
        self._waiting: dict[str, set[asyncio.Task]] = {}
        #: the operates whose branch was deleted while they ran: they answer -32012
        self._doomed: set[asyncio.Task] = set()
        #: branch id -> a delete of it in progress (done when it is over, deleted or not)
        self._deleting: dict[str, asyncio.Future] = {}
        #: forks being built off the loop (``forkBranch``): they count towards ``maxBranches``
        self._forking = 0
        #: the MCP servers front ends' sessions passed (``add_branch_mcp_servers``), by their name
        #: and config: the name each runs under and its ready event (its tools once ready)
        self._branch_mcp: dict[str, tuple[str, McpServerReady]] = {}
        #: branch id -> the keys of ``_branch_mcp`` it passed
        self._branch_mcp_of: dict[str, set[str]] = {}
        #: every MCP server :meth:`add_mcp_server` started and not yet stopped (``aclose`` stops them)
        self._added_mcp: set[McpServerReady] = set()

    # ------------------------------------------------------------------ setup
    @property
    def tool_threads(self) -> Any:
        """Where sync Python tools run (``operate`` sets ``core.tools.tool_executor``): a
        ``ToolThreads`` of ``TOOL_THREADS`` threads, made on first need (threads start as calls
        come); ``aclose`` shuts it down (made after that, it is made shut down)."""
        if self._tool_threads is None:
            from operate_sidecar.server.core.tools import ToolThreads

            self._tool_threads = ToolThreads(TOOL_THREADS)
            if self._tool_threads_closed:
                self._tool_threads.shutdown(wait=False, cancel_futures=True)
        return self._tool_threads

    @property
    def settings(self) -> dict[str, Any]:
        return self.conn.settings

    def load_core(self) -> None:
        """Build the tool registry and the governance now (importing the core), rather than on
        the first request that needs them: a front end calls it off the event loop at start-up."""
        self._core()

    def _core(self) -> Any:
        if self.registry is None:
            from operate_sidecar.server.core.tools import ToolRegistry

            self.registry = ToolRegistry()
            s = self.settings
            self.governance = Governance(
                settings_policy=s.get("toolPolicy") or {},
                timeout_ms=s.get("permissionTimeoutMs", 120000),
                can_ask=lambda: bool(self.conn.client_capabilities.get("toolPermission")),
                ask_client=self.rpc.request_client,
                on_branch_change=self._policy_changed,
            )
        return self.registry

    def _ensure_state(self) -> None:
        """Restore stored branches now (blocking; handlers await ``_state()`` first, which
        restores on a worker thread, so this only runs for a caller that cannot await). When
        the background restore has read them and is building them, the rest are built here:
        nothing is read again."""
        self._core()
        if self._state_loaded:
            return
        if self.journal is not None:  # the background restore is building (``_restore``): finish it here
            self._restore_build(None)
            return
        state_dir = self.settings.get("stateDir")
        self._apply_restore(self._open_state(state_dir) if state_dir else None)

    @staticmethod
    def _open_state(state_dir: str, collection: contextlib.ExitStack | None = None) -> tuple[Any, list, str | None]:
        """Open the store and read every branch (blocking): (store, loaded branches, error).
        With ``collection``, garbage collection is off from now until it is closed (``_restore``)."""
        import sqlite3

        from operate_sidecar.server.state import StateStore, UnavailableStore, no_collection

        if collection is not None:
            collection.enter_context(no_collection())

        try:
            store = StateStore(state_dir)
            return store, store.load(), None
        except Exception as e:
            # a fault of the directory or the database is said in one line (``_apply_restore``);
            # anything else is a bug: its traceback too
            expected = isinstance(e, (OSError, sqlite3.Error))
            log.log(logging.DEBUG if expected else logging.ERROR, "state directory %s unusable", state_dir,
                    exc_info=True)
            return UnavailableStore(state_dir, str(e)), [], str(e)

    def _apply_restore(self, opened: tuple[Any, list, str | None] | None) -> None:
        """Take in what a restore read, every branch built at once (blocking: for
        ``_ensure_state``; ``_restore`` builds them a slice at a time)."""
        self._restore_begin(opened)
        self._restore_build(None)

    def _restore_begin(self, opened: tuple[Any, list, str | None] | None) -> None:
        """Start taking in what a restore read: its store is the one in use, its problems are
        told, and its branches wait in ``_opened`` (a deque) for ``_restore_build``. Once a
        restore has begun, ``opened`` is closed unless it is that one (a blocking restore,
        ``_ensure_state``, and the background one may both have read the store)."""
        if self._state_loaded or self.journal is not None:
            if opened is not None and opened[0] is not self.journal:
                opened[0].close()
            return
        if opened is None:
            self._state_loaded = True
            return
        import collections

        store, loaded, error = opened
        self.journal = store
        self._opened = (store, collections.deque(loaded), error)
        if error is not None:
            self.conn.log_message(1, f"state directory {store.root} unusable: {error}; "
                                     "every change will be refused until it is fixed (restart the server)")
        for note in store.problems:
            self.conn.log_message(1 if ("damaged" in note or "cannot be written" in note) else 3, note)

    def _restore_build(self, budget: float | None) -> bool:
        """Build the restored branches still waiting (``_restore_begin``), for ``budget``
        seconds at most (None: all of them); True once none is left (``_state_loaded``: the
        requests that waited for them go on, all at once)."""
        if self._state_loaded:
            return True
        opened = self._opened  # (the deque ``_restore_begin`` left there, with the store in use)
        waiting = opened[1] if opened is not None and opened[0] is self.journal else ()
        start = time.monotonic()
        while waiting:
            self._restored_branch(waiting.popleft())  # (taken off first: a branch that fails is not built twice)
            if budget is not None and waiting and time.monotonic() - start >= budget:
                return False
        self._state_loaded = True
        return True

    def _restored_branch(self, lb: Any) -> None:
        """Build (or refresh in place) the in-memory branch of a stored one."""
        from operate_sidecar.server.core.branch import Branch
        from operate_sidecar.server.core.messages import MessageLog

        meta = lb.meta
        policy = dict(meta.get("policy") or {})
        self._restore_usage(lb.id, meta.get("usage"))
        self._restore_settings(lb.id, meta)
        b = self.branches.get(lb.id)
        if b is not None:  # another process committed to it: take its state
            items = b.messages.items
            if lb.incremental:
                items.extend(lb.messages)
            else:
                items[:] = lb.messages
            b.messages.generation += 1
            self.governance.branch[b.id] = policy  # type: ignore[union-attr]
            if meta.get("name") is not None:
                b.name = meta.get("name")
            return
        try:
            chat = (self.resolve_model(meta.get("chatModel"), restored=True) if meta.get("chatModel")
                    else self.default_model())
            parse = self.resolve_model(meta.get("parseModel"), restored=True) if meta.get("parseModel") else None
        except RpcError as e:
            self._problems[lb.id] = []  # (restored again: said again, not kept twice)
            self._branch_problem(self._problems[lb.id], f"branch {lb.id}: {e.message}; using the default model")
            chat, parse = self.default_model(), None
        b = Branch(id=lb.id, name=meta.get("name"), chat_model=chat, parse_model=parse, tools=self.registry,
                   messages=MessageLog(lb.messages))
        if policy:
            self.governance.branch[b.id] = policy  # type: ignore[union-attr]
        self._adopt(b)
        self._model_specs[b.id] = {"chatModel": meta.get("chatModel"), "parseModel": meta.get("parseModel")}
        self.journal.adopt(b, meta)

    def _busy_branches(self) -> set[str]:
        return set(self._settled) | (set() if self._turns_ is None else self._turns_.holding())

    async def _state(self) -> None:
        """Restore stored branches (once, on a worker thread: the event loop keeps answering),
        then take in what other processes on the same ``stateDir`` committed since.

        Requests go on past it in the order they came to it, whatever they waited for: a
        request that has to wait (the restore, another process's commits to read) makes those
        after it wait for it, and one that need not wait goes on at once only when nobody is
        in the line. Without the line, requests sent together went on in another order (the
        first after the restore last, each reading other processes' commits on its own worker
        thread): an ``authorizeTool`` deny acknowledged before an ``operate`` sent after it did
        not stop that operate's call, and a ``listBranches`` saw a branch a later request made."""
        self._core()
        last = self._state_last
        if (last is None or last.done()) and self._state_loaded and (self.journal is None or self.journal.unchanged()):
            return
        mine = asyncio.get_running_loop().create_future()
        self._state_last = mine
        try:
            if last is not None and not last.done():
                await asyncio.shield(last)  # (a cancel of this request leaves the line as it is)
            await self._catch_up()
        finally:
            if last is not None and not last.done():  # cancelled while waiting: those after it wait for `last` still
                last.add_done_callback(lambda _f: mine.done() or mine.set_result(None))
            else:
                mine.set_result(None)

    async def _catch_up(self) -> None:
        """``_state``'s work, for one request at a time."""
        if not self._state_loaded:
            state_dir = self.settings.get("stateDir")
            if not state_dir:
                self._state_loaded = True
                return
            # one task of the service restores them (``_restore``), however many requests wait:
            # a request cancelled meanwhile leaves it going, and none goes on before all are built
            while not self._state_loaded:
                restoring = self._restoring
                if restoring is None:
                    self._restoring = restoring = asyncio.Event()
                    try:
                        await self._spawn(self._restore, state_dir, restoring, name="restore branches")
                    except BaseException:
                        self._restoring = None  # never started: nobody waits for it
                        restoring.set()
                        raise
                await restoring.wait()
        if self.journal is None or self.journal.unchanged():
            return
        import sqlite3  # loaded with the store

        try:
            changes = await self._to_thread(self.journal.poll, self._busy_branches())
        except (OSError, sqlite3.Error) as e:  # a damaged or vanished database: one line, not a traceback
            log.error("could not read other processes' changes from the state store: %s", e)
            return
        except Exception:
            log.exception("could not read other processes' changes from the state store")
            return
        if changes:
            changed, removed = changes
            for lb in changed:
                self._restored_branch(lb)
            for bid in removed:
                if bid in self.branches and bid not in self._busy_branches():
                    self.branches.pop(bid, None)
                    self._model_specs.pop(bid, None)
                    self._info.pop(bid, None)
                    self._roots.pop(bid, None)
                    self.governance.forget_branch(bid)  # type: ignore[union-attr]

    def _restore_settings(self, branch_id: str, meta: dict[str, Any]) -> None:
        """The permission mode and the front end's info of a branch, from its stored meta."""
        mode = meta.get("mode")
        self.governance.set_mode(branch_id, mode if mode in MODES else "ask", notify=False)  # type: ignore[union-attr]
        info = meta.get("client")
        if isinstance(info, dict) and info:
            self._info[branch_id] = dict(info)
        else:
            self._info.pop(branch_id, None)

    def _restore_meta(self, branch_id: str) -> None:
        """After a failed save: the branch's policy, permission mode, info and usage totals in
        memory are the committed ones again."""
        if self.journal is None or branch_id not in self.branches:
            return
        committed = self.journal.committed_meta(branch_id)
        self._usage.pop(branch_id, None)
        self._restore_usage(branch_id, committed.get("usage"))
        policy = dict(committed.get("policy") or {})
        if policy:
            self.governance.branch[branch_id] = policy  # type: ignore[union-attr]
        else:
            self.governance.branch.pop(branch_id, None)  # type: ignore[union-attr]
        self._restore_settings(branch_id, committed)

    @staticmethod
    async def _to_the_end(aw: Any) -> Any:
        """Await ``aw``, a change being saved, to its end even when the request is cancelled
        meanwhile, and return (or raise) its outcome: once a change has begun it is saved, or
        undone, whole, and the request answers what happened (a cancel that comes too late is
        ignored, as for a finished request). Cancelled half-way, a new branch stayed in memory
        unsaved (a fork was lost on a crash), a delete went on on disk while memory kept the
        branch (whose next operate was acknowledged and saved nowhere), and a refused save left
        a policy changed in memory only."""
        task = asyncio.ensure_future(aw)
        me = asyncio.current_task()
        before = me.cancelling() if me is not None else 0  # (cancels from before are not ours to drop)
        try:
            while True:
                try:
                    return await asyncio.shield(task)
                except asyncio.CancelledError:
                    if task.cancelled():
                        raise
        finally:
            # every cancel that came meanwhile is dropped, two in one loop step too (each is
            # counted, one CancelledError is raised for them)
            while me is not None and me.cancelling() > before:
                me.uncancel()

    async def _commit_new_branch(self, branch_id: str) -> None:
        """Commit a new branch (createBranch, forkBranch); when that fails it is not created."""
        from operate_sidecar.server.state import StateNotSaved

        try:
            await self.flush_journal(branch_id)
        except StateNotSaved as e:
            self.branches.pop(branch_id, None)
            self._model_specs.pop(branch_id, None)
            self._info.pop(branch_id, None)
            self._roots.pop(branch_id, None)
            self.governance.forget_branch(branch_id)  # type: ignore[union-attr]
            self.journal.forget(branch_id)
            raise E.state_not_saved(f"the branch was not created ({e})") from None

    async def _commit_operate(self, branch: Any, mark: tuple[int, list | None] | None, cancelled: bool) -> None:
        """Commit an operate's messages (one transaction) before it answers. When that fails,
        the branch goes back to what is on disk: the operate's messages are removed (and a
        cleared history put back), a policy answered during it is undone, and the operate
        answers -32013 instead of its result (even if it failed otherwise: the client must
        learn that the branch was reset). An operate ``cancelled`` (its rounds ended by a cancel,
        before its save began) stays cancelled: no -32013, its branch put back all the same; one
        cancelled while it is saved is not (its cancel came too late: it answers what happened,
        its result or this -32013). Awaited to its end whatever cancel comes (``_to_the_end``):
        the operate answers, and frees its branch's turn, only once the branch is as saved."""
        from operate_sidecar.server.state import StateNotSaved

        try:
            await self.flush_journal(branch.id)
        except StateNotSaved as e:
            if mark is not None:
                items = branch.messages.items
                if mark[1] is not None:
                    items[:] = mark[1]
                else:
                    del items[mark[0]:]
                branch.messages.generation += 1
            self._restore_meta(branch.id)
            if cancelled:
                return
            # a branch another process deleted meanwhile is not "as it was": it is gone (-32012 next)
            after = ("the branch no longer exists" if branch.id in e.deleted
                     else "the branch is as it was before it")
            raise E.state_not_saved(f"the messages of this operate on branch {branch.id} were not saved ({e}); "
                                    f"{after}", {"branchId": branch.id}) from None

    async def ensure_tools(self, relisted: bool = True) -> None:
        """Load tool sources on first need (never before initialize is answered). The loading
        is the service's own task (a caller cancelled meanwhile never leaves it half done) and
        imports ``toolModules`` on a worker thread: a module slow to import never freezes the
        event loop (ping, cancel and shutdown are answered meanwhile). With ``relisted`` (what
        offers or lists MCP tools: an operate, listTools), the lists of tools configured MCP
        servers said changed are waited for too, those due when this began (not those a server
        asks for meanwhile: one that says so at every list would hold the request for ever), and
        ``RELIST_WAIT_S`` at most (:meth:`_relists_waited`)."""
        self._core()
        if self._mcp_failed:  # failed at their first start, an earlier need's: tried again below, once
            self._mcp_lost.update(self._mcp_failed)
            self._mcp_failed = {}
        if self._tools_ready is None and not self.settings.get("toolModules") and not self.settings.get("mcpServers"):
            self._tools_ready = asyncio.Event()  # only the builtin tools: nothing to wait for, no task
            self._register_workspace_tools()
            self._tools_ready.set()
        if self._tools_ready is None:
            await self.start()  # the one wait before the loading is spawned (a cancel here changes nothing)
        if self._tools_ready is None:
            ready = self._tools_ready = asyncio.Event()
            try:
                await self._spawn(self._load_tools, ready, name="tool sources")  # started: no wait
            except BaseException:  # the service is closed: nothing will load
                ready.set()
                raise
        await self._tools_ready.wait()
        self._check_policy_names_once()
        if self._mcp_lost and not self._mcp_stop.is_set():
            # configured MCP servers that stopped on their own: no session passes them again, so
            # the next need (an operate, listTools, a session's server) starts those again, and
            # only those (the others run on, untouched); each one's stop is then over: told
            # again if it stops again (the port's optional ``log_problem_over``)
            lost, self._mcp_lost = self._mcp_lost, {}
            self._problems_over(lost.values())
            configured = self.settings.get("mcpServers") or {}
            again = {name: configured[name] for name in lost if name in configured}
            if again:
                restarted = self._mcp_restarted = asyncio.Event()
                try:
                    await self._spawn(self._serve_mcp, again, restarted, name="tool sources (started again)")
                except BaseException:
                    restarted.set()
                    raise
        restarted = self._mcp_restarted
        if restarted is not None:
            await restarted.wait()
            if self._mcp_restarted is restarted:
                self._mcp_restarted = None  # started again: the next need waits for nothing
        if relisted:  # tools a configured server said changed: listed again first
            await self._relists_waited([*self._mcp_unsettled])

    async def _relists_waited(self, unsettled: "list[_Relist]") -> None:
        """Wait for the lists of MCP tools ``unsettled`` (each set once its list is over),
        ``RELIST_WAIT_S`` at most from when each was first waited for (its ``deadline``), and
        ``RELIST_WAIT_S`` of waiting at most in all for the request (the current task: each
        request is one; ``_relist_left``): the waits of one prompt (its own, its operate's, each
        round's) share that time, whatever lists each waits for, and only the time spent waiting
        counts (a round whose model took long, or an operate that waited long for its turn,
        still waits for the lists due as its next round begins). A list still under way then
        goes on in the background (it may hang until its time-out), and the tools registered
        meanwhile are used."""
        unsettled = [e for e in unsettled if not e.is_set()]
        if not unsettled:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for e in unsettled:
            if e.deadline is None:
                e.deadline = now + RELIST_WAIT_S
        me = asyncio.current_task()
        left = self._relist_left.get(me, RELIST_WAIT_S) if me is not None else RELIST_WAIT_S
        until = min(max(e.deadline for e in unsettled), now + left)  # type: ignore[type-var]
        if until <= now:  # (they, or this request, were waited for that long already)
            log.debug("the lists of MCP tools due are not waited for: they, or this request, waited %g s already",
                      RELIST_WAIT_S)
            return
        try:
            async with asyncio.timeout_at(until):
                for settled in unsettled:
                    await settled.wait()
        except TimeoutError:
            log.info("the tools of an MCP server that said they changed are still being listed after %.3g s of "
                     "this wait (a list is waited for %g s at most, and a request %g s in all): the tools offered "
                     "before are used meanwhile", loop.time() - now, RELIST_WAIT_S, RELIST_WAIT_S)
        finally:
            if me is not None:
                self._relist_left[me] = max(0.0, left - (loop.time() - now))

    def _check_policy_names_once(self) -> None:
        """:meth:`_check_policy_names`, once, when the configured tool sources are loaded: after
        the background try of a configured MCP server whose first start timed out
        (``_mcp_retry``) has ended too, since its tools are configured ones."""
        if not self._policy_names_checked and (self._mcp_retry is None or self._mcp_retry.is_set()):
            self._policy_names_checked = True
            self._check_policy_names()

    def _check_policy_names(self) -> None:
        """Warn once, when the configured tool sources (the builtin tools, ``toolModules``,
        ``mcpServers``) are loaded, about each ``settings.toolPolicy`` entry that names no tool
        they offer (a typo, or ``echo`` for the MCP tool listed as ``b__echo``): such an entry
        decides nothing, and would otherwise fail in silence. A name ``<server>__<tool>`` whose
        server part names no configured MCP server is left alone: it may name a tool of a server
        added later (an ACP session's), which this check, run once, cannot see; a tool such a
        server offers under its own name is still warned about, hence the message's wording."""
        import re

        unknown = [name for name in self.settings.get("toolPolicy") or {} if name not in self.registry]
        if not unknown:
            return
        import difflib

        builtin = _module(_BUILTIN).TOOL_NAMES  # named before a workspace folder offers them: no typo
        prefixes = [re.sub(r"[^A-Za-z0-9_-]", "_", server) + "__" for server in self.settings.get("mcpServers") or {}]
        unknown = [name for name in unknown if name not in builtin
                   and ("__" not in name or any(name.startswith(p) for p in prefixes))]
        known = sorted({*self.registry.names(), *builtin})
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if not close:
                close = [k for k in known if k.endswith("__" + name)][:1]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            self.conn.log_message(2, f"settings.toolPolicy names {name!r}, which none of the configured tool "
                                     f"sources offers{hint}: the entry decides nothing until a tool of that name "
                                     f"is offered (a tool is named as listTools lists it)")

    async def _load_tools(self, ready: asyncio.Event) -> None:
        try:
            await self._load_sync_tools()
        finally:
            if self.settings.get("mcpServers") and not self._mcp_stop.is_set():
                await self._serve_mcp(self.settings["mcpServers"], ready)
            else:
                ready.set()

    async def _load_sync_tools(self) -> None:
        reg = self.registry
        self._register_workspace_tools()
        modules = self.settings.get("toolModules") or []
        if modules:
            from operate_sidecar.server.tools.python_modules import load_tool_modules

            # one at a time, in order: registration and reports keep that order; a module named
            # twice is loaded once (not one clash report per tool)
            for name in dict.fromkeys(modules):
                try:
                    tools = await self._off_loop_until_close(load_tool_modules, [name])
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # the module's failure, whatever it raised: the others load
                    self.conn.log_message(2, str(e) or f"tool module {name!r} could not be loaded: "
                                                       f"{type(e).__name__}")
                    continue
                if tools is None:  # the service closed meanwhile
                    return
                for t in tools:
                    if t.name in reg:
                        self.conn.log_message(2, f"tool {t.name!r} of module {name!r} is not offered: "
                                                 f"{self._origin(t.name)} offers a tool of that name")
                        continue
                    reg.register(t)
                    self._tool_origin[t.name] = f"module {name!r}"

    async def _off_loop_until_close(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a worker thread (an import runs the module's code: never on the
        event loop), abandoned at once when the service closes (then None)."""
        import anyio
        import anyio.to_thread

        outcome: list[Any] = []

        async def run() -> None:
            try:
                outcome.append((True, await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)))
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as e:  # what ``fn`` raised (a KeyboardInterrupt too) is its outcome
                outcome.append((False, e))
            tg.cancel_scope.cancel()

        async def stop_on_close() -> None:
            await self._closing.wait()  # type: ignore[union-attr]
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            tg.start_soon(stop_on_close)
        if not outcome:
            return None
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _register_workspace_tools(self) -> None:
        """The builtin workspace tools over the port's workspace folders as they are now."""
        if not self.conn.workspace_folders:
            return
        try:
            from operate_sidecar.server.tools.builtin import MAX_READ_BYTES, WorkspaceTools

            files = None
            if self.conn.client_capabilities.get("fs"):  # the client's buffers, not the disk
                from operate_sidecar.server.tools.file_tools import ClientFiles

                # each fs/* request waits at most as long as a tool may run: the preview's read
                # too, which is made before the user is asked, outside any tool time-out
                files = ClientFiles(self.rpc.request_client, timeout=float(self.settings["toolTimeoutMs"]) / 1000.0)
            # a read_file page fits in a tool output (maxToolOutputChars, which cuts a longer one
            # into a preview without its nextOffset): at most half as many bytes, since JSON
            # writes a newline, a quote or a backslash as two characters
            page = max(1, min(int(self.settings["maxToolOutputChars"]) // 2, MAX_READ_BYTES))
            for t in WorkspaceTools(self.conn.workspace_folders, files=files, max_read_bytes=page,
                                    per_branch=getattr(self.conn, "folders_per_branch", False)).tools():
                self.registry.register(t, update=True)
        except Exception as e:
            self.conn.log_message(2, f"workspace tools unavailable: {e}")

    def set_branch_folders(self, branch_id: str, folders: list[str]) -> None:
        """Confine the builtin workspace tools of this branch's operates to ``folders`` (absolute
        directories; relative paths start at the first), not the workspace's: an ACP session's
        ``cwd`` and additional directories. Kept in memory only: a front end gives them again
        when it takes the branch up again (ACP: ``session/load`` carries the ``cwd``).
        ToolSourceError for a folder that is not a directory."""
        from operate_sidecar.server.tools.builtin import resolve_roots

        self._roots[branch_id] = resolve_roots(folders)

    async def read_for_user(self, branch_id: str, path: str) -> dict[str, Any]:
        """``path`` read as the branch's ``read_file`` tool reads it for the model (confined to
        the branch's folders, the client's buffer when the client serves files, the tool's
        bounds), for a file the user gave with a message (an ACP ``resource_link``): no
        governance and nothing recorded, as the user's own message. The tool's result
        (``content``, ``truncated``, ``nextOffset``); its error (``ToolCallError``) as it says
        why (outside the folders, missing, binary); ``ToolNotRegistered`` with no folder."""
        await self.ensure_tools(relisted=False)  # (a builtin tool: no MCP list to wait for)
        tool = self.registry.get("read_file")
        ctx = _module(_CORE + "tools").ToolCallContext(branch_id=branch_id, call_id=f"read-for-user-{time.monotonic_ns()}")
        scope = self._enter_tools_scope(branch_id)
        try:
            return await tool.call({"path": path}, ctx)
        finally:
            self._leave_tools_scope(scope)

    def _enter_tools_scope(self, branch_id: str) -> tuple[Any, Any]:
        """Enter what a branch's tools run in (``_leave_tools_scope`` leaves it): the service's
        pool for sync tools, and the branch's own folders (``set_branch_folders``), if it has them,
        for its tools and previews."""
        threads = _module(_CORE + "tools").tool_executor.set(self.tool_threads)
        roots = self._roots.get(branch_id)
        return threads, None if roots is None else _module(_BUILTIN).scoped_roots.set(roots)

    @staticmethod
    def _leave_tools_scope(scope: tuple[Any, Any]) -> None:
        threads, roots = scope
        _module(_CORE + "tools").tool_executor.reset(threads)
        if roots is not None:
            _module(_BUILTIN).scoped_roots.reset(roots)

    def branch_folders(self, branch_id: str) -> list[str] | None:
        """The folders :meth:`set_branch_folders` gave the branch, or None (the workspace's)."""
        roots = self._roots.get(branch_id)
        return [str(r) for r in roots] if roots is not None else None

    def workspace_changed(self) -> None:
        """The port's workspace folders changed (a front end added one): the builtin workspace
        tools cover them from now on. Before the tools are first loaded there is nothing to
        do (they are built from the folders then)."""
        if self._tools_ready is not None:
            self._register_workspace_tools()

    async def add_mcp_server(self, name: str, config: dict[str, Any],
                             after: asyncio.Event | None = None) -> McpServerReady:
        """One more MCP server (``{command, env}``, e.g. one the client passed) as a tool
        source, started in the background in the service's task group after the configured
        tools (and once ``after`` is set), stopped by :meth:`aclose`. The event returned is set
        once its tools are registered (their names, as offered, are then its ``tools``), or it
        failed (reported; the other tools are unaffected; ``tools`` stays empty)."""
        ready = McpServerReady()
        self._added_mcp.add(ready)

        async def run() -> None:
            try:
                if after is not None:
                    await after.wait()
                if not ready.stop.is_set():  # released before its turn came (``release_branch``)
                    await self.ensure_tools()  # its tools' names must not shadow those
                    await self._serve_mcp({name: config}, ready, ready.stop)
            finally:
                ready.set()
                ready.stopped.set()
                self._added_mcp.discard(ready)

        await self._spawn(run, name=f"mcp server {name}")
        return ready

    async def add_branch_mcp_servers(self, branch_id: str, servers: list[tuple[str, dict[str, Any]]]) -> None:
        """The MCP servers (``(name, {command, env})``) a front end's session passed for this
        branch (ACP's ``session/new`` and ``session/load``): tool sources of the service
        (:meth:`add_mcp_server`), started one after the other (each one's tool names are then
        chosen knowing every tool already registered, whatever the timing), and the branch's own: its operates are
        offered the tools of the servers it passed and no other branch's (:meth:`branch_tools`).
        A server another branch passed with the same name and the same command and env is
        shared while it runs or starts (a turn waits for it); once it has failed (it did not
        start, or stopped on its own), a branch passing it (again) starts it again in its place,
        for every branch that passed it (their turns do not: each would wait out its handshake);
        one with the same name and another command or env is started for this branch
        under a name of its own (``<name>-2`` ...; where its tools' names clash with the
        other's, they are ``<name>-2__<tool>``), with one warning line that names it. A branch
        taken up again (``session/load``) passes its servers again: one it passed before and
        passes no more (its args or env changed) is stopped first, unless another branch passed
        it, so the changed one is started under the name passed. The values of its ``env``
        whose names say they are secret, and those its command line gives options named like a
        secret (``--token VALUE``, ``--password=VALUE``), are known secrets from here on (masked
        wherever the server emits or stores text: ``redaction.mcp_server_secrets``)."""
        from operate_sidecar.server import redaction

        for _, config in servers:
            for value in redaction.mcp_server_secrets(config):  # before anything can echo them
                redaction.remember_secret(value)
        keyed = [(json.dumps([name, config], sort_keys=True), name, config) for name, config in servers]
        keys = {key for key, _, _ in keyed}
        # the ones it passed before and passes no more (a session taken up again with a server's
        # args or env changed) stop first: a changed server gets the name it is passed under
        await self._stop_branch_mcp(branch_id, self._branch_mcp_of.get(branch_id, set()) - keys)
        for key, name, config in keyed:
            entry = self._branch_mcp.get(key)
            if entry is not None and not _mcp_ended(entry[1]):
                continue  # running, or still starting (a turn waits for it): shared
            if entry is not None:
                # it failed to start, or stopped on its own: passed anew, it is started again
                # under its name (its tools are gone with it), in place of the old entry; the
                # branches that passed that one hold the key, so they have this one (its tools,
                # its problems: the old one's are no longer current), and a later turn of theirs
                # does not start it again: only a branch passing it again does
                del self._branch_mcp[key]
                self._problems_over(entry[1].problems)  # a new stop or failure of it is told again
                public = entry[0]
                log.info("MCP server %r (%r) passed again by session %s after it %s: starting it again",
                         name, public, branch_id, "failed to start" if not entry[1].tools else "stopped")
            else:
                public, taken, n = name, {public for public, _ in self._branch_mcp.values()}, 2
                while public in taken:
                    public, n = f"{name}-{n}", n + 1
                if public != name:  # (the one under that name: passed by this session, or another's)
                    mine = any(p == name and k in keys for k, (p, _) in self._branch_mcp.items())
                    log.warning("MCP server %r of session %s differs (command, args or env) from %s under that "
                                "name: started as %r for this session", name, branch_id,
                                "another one this session passed" if mine else "the one another session started",
                                public)
            last = next(reversed(self._branch_mcp.values()))[1] if self._branch_mcp else None
            self._branch_mcp[key] = (public, await self.add_mcp_server(public, config, after=last))
        self._branch_mcp_of[branch_id] = keys

    async def release_branch(self, branch_id: str) -> None:
        """A front end is done with the branch for now (ACP's ``session/close``): it keeps its
        messages, info and policy (stored, listed, taken up again with its folders), but its
        folders are forgotten and the MCP servers it passed that no other branch passed are
        stopped, their tools unregistered, before this returns (bounded: ``CLOSE_TIMEOUT_S``
        more than a server's own stop bound; one that takes longer is left to end on its own,
        with a warning). The operate running on it is the front end's to end first."""
        self._roots.pop(branch_id, None)
        await self._stop_branch_mcp(branch_id, self._branch_mcp_of.pop(branch_id, set()))

    async def _stop_branch_mcp(self, branch_id: str, keys: set[str]) -> None:
        """Stop the MCP servers of ``keys`` (ones the branch passed) that no other branch passed,
        their tools unregistered, before this returns (bounded as :meth:`release_branch` says)."""
        await self._mcp_stopped(branch_id, self._drop_branch_mcp(branch_id, keys))

    def _drop_branch_mcp(self, branch_id: str, keys: set[str]) -> list[tuple[str, McpServerReady]]:
        """Ask the MCP servers of ``keys`` (ones the branch passed) that no other branch passed
        to stop, out of the branch servers; those asked (:meth:`_mcp_stopped` waits for them)."""
        shared = set().union(*(k for b, k in self._branch_mcp_of.items() if b != branch_id))
        stopping = []
        for key in keys - shared:
            entry = self._branch_mcp.pop(key, None)
            if entry is not None:
                entry[1].stop.set()
                self._problems_over(entry[1].problems)
                stopping.append(entry)
        return stopping

    async def _mcp_stopped(self, branch_id: str, stopping: list[tuple[str, McpServerReady]]) -> None:
        """Once the MCP servers :meth:`_drop_branch_mcp` asked to stop have stopped (bounded as
        :meth:`release_branch` says; one that takes longer is left to end on its own)."""
        if stopping:
            from operate_sidecar.server.tools.mcp_source import STOP_BOUND_S

            try:
                await asyncio.wait_for(asyncio.gather(*(r.stopped.wait() for _, r in stopping)),
                                       STOP_BOUND_S + CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("branch %s: its MCP server(s) %s did not stop in time; left to end on their own",
                            branch_id, ", ".join(repr(n) for n, r in stopping if not r.stopped.is_set()))

    async def branch_mcp_ready(self, branch_id: str) -> None:
        """Once every MCP server this branch passed is ready (or failed): its turn waits for
        this, since a server still starting decides which tool names it is offered. Not for
        other branches' servers: their tools are not its own (:meth:`branch_tools`), and one
        that hangs in its handshake would hold up every session's turns. (A server of its own
        passed after another's starts after it: see :meth:`add_branch_mcp_servers`.)"""
        readies = self._branch_readies(branch_id)
        for ready in readies:
            await ready.wait()
        await self._relists_waited([ready.settled for ready in readies])  # tools said to have changed, listed again

    def _branch_readies(self, branch_id: str) -> list[McpServerReady]:
        """The MCP servers the branch passed (:meth:`add_branch_mcp_servers`), as they are now."""
        return [entry[1] for key in list(self._branch_mcp_of.get(branch_id, ()))
                if (entry := self._branch_mcp.get(key)) is not None]

    async def _round_relists_waited(self, branch_id: str) -> None:
        """As a round of an operate on the branch begins (its first once its turn has come, its
        slot taken; each later one, before the check that its save can still be made): the
        lists of tools due then (said to have changed, by a configured MCP server or one the
        branch passed: those its operates use) waited for, bounded as :meth:`_relists_waited`
        says (within the request's ``RELIST_WAIT_S`` of waiting in all), so that the round is
        offered the tools as they are when it begins (a tool turned not read-only, or removed,
        by a call of the round before, or of the operate before it, is offered so, or not at
        all)."""
        await self._relists_waited([*self._mcp_unsettled, *(r.settled for r in self._branch_readies(branch_id))])

    def branch_tools(self, branch_id: str) -> list[str] | None:
        """The tools an operate of this branch is offered: every tool but those of the MCP
        servers other branches passed (:meth:`add_branch_mcp_servers`); None (all) when no
        branch passed one. A :class:`BranchTools`: an operate given it as its ``tools`` does not
        refuse the names gone by the time it runs (an MCP server listed its tools again
        meanwhile, without them), where a client's list naming them is refused (-32602): each of
        its rounds is offered the list computed again then (:meth:`_round_tools`)."""
        if not self._branch_mcp:
            return None
        own = self._branch_mcp_of.get(branch_id, set())
        other = set().union(*(ready.tools for key, (_, ready) in self._branch_mcp.items()
                              if key not in own and not ready.stopped.is_set()))  # a stopped one's are gone
        return BranchTools(n for n in self.registry.names() if n not in other)

    async def _serve_mcp(self, config: dict[str, Any], ready: asyncio.Event, stop: asyncio.Event | None = None) -> None:
        """Run MCP servers as tool sources until :meth:`aclose` (or ``stop``, which ``aclose``
        sets too); ``ready`` is set once their
        tools are registered or they failed. Their tools are named knowing every tool registered
        when they are (also those registered while the servers started: another MCP server's, a
        client's), so a taken name is offered as ``<server>__<tool>`` (with a warning naming
        both sources), and they are registered all at once or not at all; they are unregistered
        when the servers stop, so no tool is left pointing at a stopped server. Each server starts
        on its own: one that does not is told as ``MCP server 'x' unavailable: why``
        (:meth:`_mcp_unavailable`; a configured one is tried once more at a later need), and the
        others' tools are registered all the same. A server that
        stops on its own (it exits, crashes, is killed) has its tools unregistered at once, and
        is told as ``MCP server 'x' stopped: why`` (:meth:`_mcp_problem`); the others run on
        (this returns once none runs). A branch's is then over (:func:`_mcp_ended`: a branch
        passing it again starts it again); a configured one (``settings.mcpServers``, served
        together) is started again at the next :meth:`ensure_tools` (an operate, listTools),
        alone, its tools named as they were (its siblings' names are taken:
        :meth:`_mcp_sibling_names`). A
        configured one whose first start timed out is tried once more at once, in the background
        (:meth:`_mcp_unavailable`). A server that says its tools changed
        (``notifications/tools/list_changed``) has them listed again in a task of its own (one
        whose list hangs holds up no other, nor the handling of a stop), one list at a time,
        ``RELIST_BURST`` in a row at most, then one each ``RELIST_EVERY_S`` (what it says
        meanwhile asks for one list more), and put in place of its tools all at once
        (:meth:`_mcp_relisted`: a tool it still lists keeps its name while free). A request that
        came before such a list was over waits for it, ``RELIST_WAIT_S`` at most (then it goes
        on with the tools registered, the list going on): :meth:`ensure_tools` (a configured
        one's) or :meth:`branch_mcp_ready` (a branch's), and each round of an operate for those
        due as it begins (:meth:`_round_relists_waited`); one that came later waits only for the
        lists due when it came. A list is due only for a server that runs: one said due while a
        server started that then failed is over at once."""
        from operate_sidecar.server.tools.errors import ToolSourceError
        from operate_sidecar.server.tools.mcp_source import open_mcp_sources

        label = f"MCP server{'s' if len(config) > 1 else ''} {', '.join(map(repr, config))}"
        configured = not isinstance(ready, McpServerReady)
        first_start = configured and ready is self._tools_ready  # (not a start again: ``ensure_tools``)
        # a configured server started again alone: its siblings' names count as taken, as when
        # they all started together (a name two of them offer stays prefixed)
        taken = _TakenNames(self.registry, self._mcp_sibling_names(config) if configured else ())
        registered: list[Any] = []
        stop = self._mcp_stop if stop is None else stop
        lost: list[tuple[str, str]] = []
        running = set(config)  # the servers of ``config`` still running (once started)
        over = asyncio.Event()  # asked to stop, a server stopped on its own or said its tools changed
        #: server -> the round of its tools' lists due: said to have changed since its last list
        #: began, set once the list that follows is over (the requests that came meanwhile wait
        #: for it: a branch's is its ready's ``settled`` (``branch_mcp_ready``), the configured
        #: ones' are in ``_mcp_unsettled`` (``ensure_tools``) once the block has begun); what the
        #: server says during that list opens a new round, which only later requests wait for
        rounds: dict[str, _Relist] = {}
        relisters: dict[str, asyncio.Task] = {}  # server -> its task listing its tools again
        #: server -> (the lists it may have at once, as of the loop time next to it): ``relist``
        budget: dict[str, tuple[float, float]] = {}
        begun = False  # the block has begun (its servers' starts are over)
        told: dict[str, set[str]] = {}  # server -> the warnings told about its last list

        def on_lost(server: str, why: str) -> None:
            lost.append((server, why))
            over.set()

        def on_changed(server: str) -> None:
            # a list is due only for a server that runs (or starts: one that then fails to start
            # has its round settled as the block begins; it is never listed)
            if server not in rounds and server in running:
                due = rounds[server] = _Relist()
                if isinstance(ready, McpServerReady):
                    ready.settled = due
                elif begun:  # (one during a start: once the block has begun)
                    self._mcp_unsettled.add(due)
            over.set()

        def settle(due: asyncio.Event | None) -> None:
            if due is not None:
                due.set()
                self._mcp_unsettled.discard(due)

        async def relist(server: str) -> None:
            """List ``server``'s tools again while a round is due for it, one list at a time,
            ``RELIST_BURST`` lists in a row at most, then one each ``RELIST_EVERY_S`` (a server
            that says its tools changed at every list is listed that often at most); each round
            is set once its list is over (listed, failed, or the server gone). Each server has
            its own: one whose list hangs holds up no other."""
            loop = asyncio.get_running_loop()
            due = None
            try:
                while server in rounds and server in running and not stop.is_set():
                    left, at = budget.get(server, (RELIST_BURST, loop.time()))
                    left = min(RELIST_BURST, left + (loop.time() - at) / RELIST_EVERY_S)
                    if left < 1:
                        await asyncio.sleep((1 - left) * RELIST_EVERY_S)
                        continue
                    budget[server] = (left - 1, loop.time())
                    due = rounds.pop(server)
                    why = await self._mcp_list_again(tools, server)
                    if stop.is_set() or not tools.running(server) or server not in running:
                        break  # (stopped meanwhile: told as such, if on its own)
                    if why is not None:
                        self._mcp_problem(ready, f"MCP server {server!r}: its tools could not be listed again "
                                                 f"after it said they changed ({why}); the tools it offered "
                                                 f"before are offered still")
                    else:
                        self._mcp_relisted(ready, tools, server, registered, origin, told)
                    settle(due)
                    due = None
            except Exception:  # (a bug: the round is over all the same, and the one said meanwhile)
                log.exception("MCP server %r: its tools could not be listed again", server)
                settle(rounds.pop(server, None))  # (no task would list it: it would hold requests)
            finally:
                settle(due)
                if relisters.get(server) is asyncio.current_task():
                    del relisters[server]

        origin: dict[str, tuple[str, str]] = {}  # tool name as offered -> (its server, its own name)

        def unregister(servers: Any = None) -> None:
            """The tools of ``servers`` (of ``config``; None: all) out of the registry: they are
            stopped."""
            every = servers is None
            servers = set(running) if every else servers
            gone = [t for t in registered if every or origin.get(t.name, ("",))[0] in servers]
            ids = {id(t) for t in gone}
            registered[:] = [t for t in registered if id(t) not in ids]  # (one pass: thousands of tools)
            for t in gone:
                if t.name in self.registry and self.registry.get(t.name) is t:
                    self.registry.unregister(t.name)
                    self._tool_origin.pop(t.name, None)
            for server in servers:
                if configured and server in running:
                    self._mcp_running.discard(server)
                running.discard(server)

        async def until_stop() -> None:
            await stop.wait()
            over.set()

        watch = asyncio.get_running_loop().create_task(until_stop())
        try:
            # a server started again: a tool it still lists keeps the name it had, while free
            kept = {server: self._mcp_offered.get(server, {}) for server in config} if configured else None
            async with open_mcp_sources(config, reserved=taken, stop=stop, lost=on_lost, changed=on_changed,
                                        kept=kept, registered=self.registry) as tools:
                # each server started on its own: those that did not are told (below), and the
                # others' tools are offered all the same
                failed = tools.failed
                if failed:
                    running.difference_update(failed)
                    for server in failed:  # (said during its start: no list follows, none is due)
                        settle(rounds.pop(server, None))
                    started = [server for server in config if server in running]
                    label = f"MCP server{'s' if len(started) > 1 else ''} {', '.join(map(repr, started))}"
                # the names were chosen just now (no wait since): a clash here is a bug, and it
                # refuses the servers whole rather than leave some of their tools registered
                names = [t.name for t in tools]
                clash = _clashing(names, self.registry)
                if clash:
                    raise ToolSourceError("tool names taken: " + ", ".join(
                        f"{n!r} ({self._origin(n)})" if n in self.registry else repr(n) for n in clash))
                renamed = self._renamed_mcp_tools(config, names, taken.seen, configured)
                origin = tools.origin
                self._mcp_registered(tools, origin, label, registered,
                                     [server for server in config if server in running] if configured else ())
                retried = {server: message for server, why in failed.items()
                           if (message := self._mcp_unavailable(ready, server, why, again=first_start))}
                for message in [*tools.warnings, *_renamed_told(renamed)]:
                    self._mcp_problem(ready, message)
                    for server in config:  # (each names its server first)
                        if message.startswith(f"MCP server {server!r}"):
                            told.setdefault(server, set()).add(message)
                if isinstance(ready, McpServerReady):
                    ready.tools = tuple(t.name for t in registered)
                begun = True
                if configured:  # (lists said due while they started: waited for from now on)
                    self._mcp_unsettled.update(rounds.values())
                if retried and not stop.is_set():
                    self._mcp_retry = asyncio.Event()
                ready.set()
                if ready is self._mcp_retry:  # (the background try's start is over)
                    self._check_policy_names_once()
                if retried and not stop.is_set():  # timed out at their first start: tried once more, unwaited for
                    self._problems_over(retried.values())
                    try:
                        await self._spawn(self._serve_mcp, {server: config[server] for server in retried},
                                          self._mcp_retry, name="tool sources (tried again)")
                    except BaseException:
                        self._mcp_retry.set()  # type: ignore[union-attr]
                        raise
                try:
                    while running:
                        await over.wait()
                        over.clear()
                        if stop.is_set() or running <= {server for server, _ in lost}:
                            break  # asked to stop, or none runs any more: the block ends (told below)
                        # some stopped on their own, the others run on: the stopped ones' tools go
                        # now, then they are told (as below); their lists due are over
                        gone, lost[:] = list(lost), []
                        unregister({server for server, _ in gone})
                        for server, why in gone:
                            task = relisters.pop(server, None)
                            if task is not None:
                                task.cancel()
                            settle(rounds.pop(server, None))
                            self._mcp_lost_told(ready, server, why)
                        for server in list(rounds):  # said their tools changed: listed again, each on its own
                            if server in running and server not in relisters:
                                relisters[server] = asyncio.get_running_loop().create_task(relist(server))
                finally:
                    tasks = list(relisters.values())
                    for task in tasks:
                        task.cancel()
                    if tasks:
                        await asyncio.wait(tasks)
                    for due in rounds.values():  # (no list follows: what waits for one goes on now)
                        settle(due)
                    rounds.clear()
        except Exception as e:
            self._mcp_problem(ready, f"{label} unavailable: {e}")
        finally:
            watch.cancel()
            unregister()  # the servers are stopped: all their tools go with them
            for due in rounds.values():
                settle(due)
            rounds.clear()
            ready.set()
            if ready is self._mcp_retry:
                self._check_policy_names_once()
        if not stop.is_set():  # (told once their tools are gone)
            for server, why in lost:
                self._mcp_lost_told(ready, server, why)

    @staticmethod
    async def _mcp_list_again(tools: Any, server: str) -> str | None:
        """``tools.list_again(server)`` (an ``McpTools``' server: bounded by its start time-out;
        a stop cancels the task that awaits it); why it failed, else None."""
        from operate_sidecar.server.tools.errors import ToolSourceError

        try:
            await tools.list_again(server)
        except ToolSourceError as e:
            return str(e)
        return None

    def _mcp_relisted(self, ready: asyncio.Event, tools: Any, server: str, registered: list[Any],
                      origin: dict[str, tuple[str, str]], told: dict[str, set[str]]) -> None:
        """Put the tools the MCP server ``server`` (of ``tools``: ``ready``'s block) has just
        listed again in place of those it offered, all at once (nothing awaited in between: no
        request sees half of them): named as at its start, every other tool registered taken,
        and, a configured one's, the names its siblings hold (:meth:`_mcp_sibling_names`: as
        when it is started again alone), so that a tool it still lists keeps its name; ``registered``
        and ``origin`` (its block's) follow. A tool removed goes (a call of it already running
        ends as it would have: the session is the same). Its warnings (as its start tells them)
        are told when the previous list's (``told``) did not have them. A name taken all the
        same (a bug) leaves the tools it offered, with a warning."""
        configured = not isinstance(ready, McpServerReady)
        mine = [t for t in registered if origin.get(t.name, ("",))[0] == server]
        own = {t.name for t in mine}
        others = frozenset(n for n in self.registry.names() if n not in own)
        siblings = self._mcp_sibling_names({server}) if configured else set()
        kept = {own: public for public, (s, own) in origin.items() if s == server}
        new = tools.named(server, others | siblings, kept, others)  # (a tool listed before keeps its name)
        names = [t.name for t in new]
        clash = _clashing(names, others)
        if clash:
            self._mcp_problem(ready, f"MCP server {server!r}: its tools listed again are not offered, since these "
                                     f"names are taken: {', '.join(map(repr, clash))}; the tools it offered before "
                                     f"are offered still")
            return
        gone = {id(t) for t in mine}
        registered[:] = [t for t in registered if id(t) not in gone]  # (one pass: thousands of tools)
        for t in mine:
            origin.pop(t.name, None)
            if t.name in self.registry and self.registry.get(t.name) is t:
                self.registry.unregister(t.name)
                self._tool_origin.pop(t.name, None)
        origin.update(new.origin)
        self._mcp_registered(new, origin, f"MCP server {server!r}", registered, [server] if configured else ())
        if isinstance(ready, McpServerReady):
            ready.tools = tuple(t.name for t in registered)
        log.info("MCP server %r listed its tools again: %s", server, ", ".join(names) or "none")
        renamed = self._renamed_mcp_tools({server: None}, names, others, configured)
        messages = [*new.warnings, *_renamed_told(renamed)]
        for message in messages:
            if message not in told.get(server, ()):
                self._mcp_problem(ready, message)
        told[server] = set(messages)

    def _mcp_registered(self, tools: list[Any], origin: dict[str, tuple[str, str]], label: str,
                        registered: list[Any], configured: Collection[str]) -> None:
        """Register ``tools`` (MCP tools just named), kept in ``registered`` (their block's), each
        told as its server's (``_origin``: ``MCP server 'a'``, by ``origin``; ``label`` when it
        has none); for each server of ``configured`` (configured ones), the
        names it holds from now on, by ``origin`` (each tool's name as offered -> its server and
        its own name): it runs (``_mcp_running``), its tools offered as ``_mcp_offered`` says."""
        for t in tools:
            self.registry.register(t)
            registered.append(t)
            held = origin.get(t.name)
            self._tool_origin[t.name] = label if held is None else f"MCP server {held[0]!r}"
        for server in configured:
            mine = {public: own for public, (s, own) in origin.items() if s == server}
            self._mcp_running.add(server)
            self._mcp_offered[server] = {own: public for public, own in mine.items()}

    def _mcp_sibling_names(self, servers: Collection[str]) -> set[str]:
        """The names the configured MCP servers but ``servers`` hold, which a tool of ``servers``
        named now does not take: a running one's own names for its tools (a start of them all
        together would have found them clashing), and a stopped one's, its own and those its
        tools were offered as (started again, its tools take those back: a
        ``settings.toolPolicy`` entry follows the name, and must not pass to another server's
        tool while it is down)."""
        return set(self._mcp_sibling_holders(servers))

    def _mcp_sibling_holders(self, servers: Collection[str]) -> dict[str, str]:
        """Each name of :meth:`_mcp_sibling_names` -> the configured server that holds it (the
        first one, in the order they were started), for the warning that names it."""
        holders: dict[str, str] = {}
        for s, offered in self._mcp_offered.items():
            if s not in servers:
                for name in offered:
                    holders.setdefault(name, s)
                if s not in self._mcp_running:
                    for name in offered.values():
                        holders.setdefault(name, s)
        return holders

    def _mcp_lost_told(self, ready: asyncio.Event, server: str, why: str) -> None:
        """Tell that the MCP server ``server`` (of ``ready``: a branch's, or a configured one)
        stopped on its own, its tools gone; a configured one is started again at the next
        :meth:`ensure_tools`."""
        again = ("; a session passing it again starts it again" if isinstance(ready, McpServerReady) else
                 "; it is started again when its tools are next needed (the other configured servers run on)")
        first, nl, rest = why.partition("\n")  # what to do on the first line (the rest: its last stderr lines)
        message = f"MCP server {server!r} stopped: {first}{again}{nl}{rest}"
        if not isinstance(ready, McpServerReady):
            self._mcp_lost[server] = message
        self._mcp_problem(ready, message)

    def _mcp_unavailable(self, ready: asyncio.Event, server: str, why: Any, again: bool) -> str | None:
        """Tell that the MCP server ``server`` (of ``ready``) did not start (``why``); with
        ``again`` (a configured one's first start), it is tried once more: one that failed at
        once (its command not found, it exited) at the next need after this one
        (:meth:`ensure_tools`, which waits for it), as one that stopped is started again; one that
        timed out (``StartTimedOut``: it hangs) at once, in the background, since a need that
        waited for it would wait a second time-out: then the warning told is returned (else None),
        and its caller starts it. One that fails then is not tried again."""
        from operate_sidecar.server.tools.mcp_source import StartTimedOut

        first, nl, rest = str(why).partition("\n")  # what to do on the first line (the rest: its last stderr lines)
        now = again and isinstance(why, StartTimedOut)
        note = ("; it is tried once more now, in the background: its tools are offered once it has started" if now
                else "; it is tried once more when tools are next needed" if again else "")
        message = f"MCP server {server!r} unavailable: {first}{note}{nl}{rest}"
        if again and not now:
            self._mcp_failed[server] = message
        self._mcp_problem(ready, message)
        return message if now else None

    def _mcp_problem(self, ready: asyncio.Event, message: str) -> None:
        """A warning about MCP servers: about one a front end's session passed (``ready`` is its
        ``McpServerReady``), a problem of the branches that passed it (:meth:`_branch_problem`);
        about the configured ones, the whole server's."""
        if isinstance(ready, McpServerReady):
            self._branch_problem(ready.problems, message)
        else:
            self.conn.log_message(2, message)

    def _branch_problem(self, problems: list[str], message: str) -> None:
        """A warning that concerns some branches only, kept in ``problems`` (a branch's own, or
        those of an MCP server branches passed) for :meth:`branch_problems`, and told through the
        port's optional ``log_branch_problem`` when it has one (a front end that tells each
        session its own problems), else ``log_message`` as any other."""
        problems.append(message)
        getattr(self.conn, "log_branch_problem", self.conn.log_message)(2, message)

    def _problems_over(self, messages: Any) -> None:
        """Warnings told before that are over (the MCP server they were about is started again,
        or no branch holds it any more): through the port's optional ``log_problem_over``, so
        that the same text told later, a new occurrence (it stopped again), is told again."""
        over = getattr(self.conn, "log_problem_over", None)
        if over is not None:
            for message in messages:
                over(message)

    def branch_problems(self, branch_id: str) -> list[str]:
        """The warnings that concern the branch (:meth:`_branch_problem`), in order: its own (its
        stored model not configured), then those of the MCP servers it passed (one failed to
        start or stopped, its tools are offered under other names), each server as it is now
        (one started again in place of one that failed has its own)."""
        own = self._branch_mcp_of.get(branch_id, ())
        return [*self._problems.get(branch_id, ()),
                *(p for key, (_, ready) in self._branch_mcp.items() if key in own for p in ready.problems)]

    def _renamed_mcp_tools(self, config: dict[str, Any], names: list[str], taken: frozenset[str],
                           configured: bool = False) -> dict[str, list[tuple[str, str, str]]]:
        """server -> (its tool's own name, the name it is offered as, why) for the tools of
        ``config``'s servers offered as ``<server>__<tool>`` (``names``): the name was taken by
        another source (``taken``: the names registered when they were chosen), another of
        these servers offers it too, or (``configured``: they are configured ones) a configured
        sibling holds it (:meth:`_mcp_sibling_holders`: a running one's own name, told with the
        name it offers that tool as when that is another, ``offers 'x', as 'a__x'``; or a stopped
        one's). Linear in the names (a server may list thousands of tools)."""
        import re

        prefixes = {re.sub(r"[^A-Za-z0-9_-]", "_", server): server for server in config}
        longest_first = sorted(prefixes, key=len, reverse=True)
        plain_of: dict[str, tuple[str, str]] = {}  # public name -> (server, its own name)
        offering: dict[str, list[str]] = {}  # own name -> the servers that offer it prefixed
        for public in names:
            for prefix in longest_first:
                if public.startswith(prefix + "__") and len(public) > len(prefix) + 2:
                    plain_of[public] = (prefixes[prefix], public[len(prefix) + 2:])
                    offering.setdefault(public[len(prefix) + 2:], []).append(prefixes[prefix])
                    break
        offered = set(names)
        holders = self._mcp_sibling_holders(config) if configured and plain_of else {}
        out: dict[str, list[tuple[str, str, str]]] = {}
        for public, (server, plain) in plain_of.items():
            others = sorted(s for s in offering[plain] if s != server)
            if plain in taken and plain in self.registry:
                why = f"{self._origin(plain)} offers {plain!r}"
            elif plain in offered:
                continue  # the server's own name for it
            elif others:
                why = "MCP server" + ("s " if len(others) > 1 else " ") + ", ".join(map(repr, others)) \
                      + f" offer{'' if len(others) > 1 else 's'} {plain!r} too"
            elif plain in holders:
                holder = holders[plain]
                as_ = self._mcp_offered.get(holder, {}).get(plain, plain)  # (its own name: offered as that)
                why = f"MCP server {holder!r} " + ((f"offers {plain!r}" + (f", as {as_!r}" if as_ != plain else ""))
                                                   if holder in self._mcp_running
                                                   else f"holds {plain!r} while it is stopped")
            else:
                continue
            out.setdefault(server, []).append((plain, public, why))
        return out

    def _origin(self, name: str) -> str:
        """Who offers the registered tool ``name``, for a clash report."""
        where = self._tool_origin.get(name)
        if where is not None:
            return where
        source = self.registry.get(name).source
        return {"builtin": "the builtin workspace tool set", "python": "toolModules", "mcp": "an MCP server",
                "client": "the client (registerClientTools)"}.get(source, f"a {source} tool")

    # ------------------------------------------------------------------ tasks
    async def start(self) -> None:
        """Open the task group that owns the service's background tasks (the restore of stored
        branches, the MCP servers). Idempotent; the service starts it on first need, so a front
        end need not call it. :meth:`aclose` closes it."""
        if self._started is None:
            self._started, self._closing = asyncio.Event(), asyncio.Event()
            self._owner = asyncio.get_running_loop().create_task(self._own(), name="service tasks")
        await self._started.wait()

    async def _own(self) -> None:
        import anyio

        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._started.set()  # type: ignore[union-attr]
                await self._closing.wait()  # type: ignore[union-attr]
                # let the tasks finish (MCP servers stop cleanly), then cancel what is left
                tg.cancel_scope.deadline = anyio.current_time() + CLOSE_TIMEOUT_S
        finally:
            self._tg = None
            self._started.set()  # type: ignore[union-attr]

    async def _spawn(self, fn: Any, *args: Any, name: str) -> None:
        """Run ``fn(*args)`` in the service's task group. Its failure is logged, never
        propagated: one background task cannot take down the others."""
        await self.start()
        if self._tg is None:
            raise RuntimeError("the service is closed")

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("background task %r failed", name)

        self._tg.start_soon(guarded, name=name)

    async def _to_thread(self, fn: Any, *args: Any) -> Any:
        """Blocking work (the store) on a worker thread, at most ``THREADS`` at a time."""
        import anyio.to_thread

        if self._threads is None:
            import anyio

            self._threads = anyio.CapacityLimiter(THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    async def _restore(self, state_dir: str, restoring: asyncio.Event) -> None:
        """Read the stored branches on a worker thread (``_open_state``), then build them on the
        loop (they are its objects), ``RESTORE_SLICE_S`` at a time so that it keeps answering (a
        ping, a cancel) meanwhile; then wake the requests waiting for them (``restoring``).

        No cyclic garbage collection runs from the read to the last branch built
        (``no_collection``): it would walk the growing heap again and again with the loop
        stopped. Once all are built, what is alive is frozen (``gc.freeze``, once): restored
        branches live as long as the server, and unfrozen, the collections after the restore
        walked them all (a full one took 0.2 s to 0.6 s at 12,000 branches, again and again).
        The freeze exempts for good everything alive then, the requests in flight and garbage
        cycles made during the restore too (a bounded leak, once, for no stall afterwards).

        A restore that ends before all are built (the service closing, a branch that failed)
        lets the next waiter start another, which goes on where it stopped."""
        import gc

        try:
            with contextlib.ExitStack() as collection:
                if self._opened is None:
                    gc.collect(1)  # (the young garbage, not frozen with the restore; a quick one)
                    self._opened = await self._to_thread(self._open_state, state_dir, collection)
                else:
                    from operate_sidecar.server.state import no_collection  # (loaded with the store)

                    collection.enter_context(no_collection())
                self._restore_begin(self._opened)
                while not self._restore_build(RESTORE_SLICE_S):
                    await asyncio.sleep(0)
                gc.freeze()
        finally:
            if self._restoring is restoring:
                self._restoring = None
            restoring.set()

    async def aclose(self) -> None:
        """Stop the background tasks (bounded: ``CLOSE_TIMEOUT_S``), then commit what is
        pending and close the store (that too when the caller stops waiting). The sync tools'
        pool is shut down first: a queued call is answered ``ToolThreadsClosed`` without running,
        a later one is refused; a tool still running is left to finish (its caller is answered
        by its own time-out or cancel), its thread then ends."""
        self._tool_threads_closed = True
        if self._tool_threads is not None:
            self._tool_threads.shutdown(wait=False, cancel_futures=True)
        self._mcp_stop.set()
        for ready in self._added_mcp:
            ready.stop.set()
        try:
            if self._owner is not None:
                self._closing.set()  # type: ignore[union-attr]
                try:
                    await asyncio.wait_for(asyncio.shield(self._owner), CLOSE_TIMEOUT_S + 1.0)
                except TimeoutError:
                    log.warning("the service's tasks did not stop in time")
        finally:
            self.flush_journal_sync()
            if self.journal is not None:
                self.journal.close()  # the last connection out checkpoints the WAL into the database file

    def flush_journal_sync(self) -> None:
        """Commit everything still pending (on stop: e.g. a cancelled operate's messages)."""
        if self.journal is not None:
            try:
                self.journal.flush()
            except Exception:
                log.exception("state could not be saved on stop")

    async def flush_journal(self, *branch_ids: str, messages: bool = True) -> None:
        """Write + fsync the pending records of ``branch_ids`` (all when none given) before
        the caller answers. Flushes are serialized, so a flush that finds nothing pending
        still waits for one in progress (which may hold its records) to reach the disk.
        An operate flushes only its own branch: another branch's in-flight operate is
        never written half-done. ``messages=False`` writes only changed branch metas
        (e.g. a policy), each on a line of its own, and leaves message records pending:
        an operate running on that very branch is not written half-done either."""
        if self.journal is None:
            return
        if self._flush_lock is None:
            self._flush_lock = asyncio.Lock()
        bids = set(branch_ids) if branch_ids else None
        async with self._flush_lock:
            if self.journal.dirty(bids, messages=messages):
                # raises StateNotSaved (nothing of those branches written); returns the branches
                # another process committed to meanwhile, re-read whole
                for lb in await self._to_thread(lambda: self.journal.flush(bids, messages=messages)):
                    if lb.id in self.branches:
                        self._restored_branch(lb)

    # ------------------------------------------------------------------ models
    def default_model(self) -> Any:
        return self.resolve_model(self.settings["defaultModel"])

    def resolve_model(self, spec: Any, where: str = "chatModel", restored: bool = False) -> Any:
        """A configured name or an inline ModelConfig → an iModel (cached). ``restored``: the
        spec is a stored branch's, read back from the store, where the mask in any of its
        fields stands for a secret (``models._common.masked_model``)."""
        if spec is None:
            return None
        if not isinstance(spec, (str, dict)):  # an attrs ModelConfig from protocol/
            from operate_sidecar.protocol import unstructure

            spec = unstructure(spec)
        if isinstance(spec, str):
            model = self._models.get(spec)
            if model is None:
                from operate_sidecar.server.models import make_model

                config = self.settings["models"].get(spec)
                if config is None:
                    raise invalid_params(f"{where}: unknown model {spec!r}; configured: "
                                         + ", ".join(self.settings["models"]))
                model = self._make(make_model, config, spec, where)
                self._models[spec] = model
            return model
        key = ("restored:" if restored else "") + json.dumps(spec, sort_keys=True, separators=(",", ":"))
        model = self._inline.get(key)
        if model is None:
            from operate_sidecar.server.models import make_model
            from operate_sidecar.server.models._common import masked_model

            name = f"inline-{spec.get('provider')}-{len(self._inline) + 1}"
            model = masked_model(spec, name, restored) or self._make(make_model, spec, name, where)  # (masked: refused)
            self._inline[key] = model
        return model

    def context_size(self, model_name: str) -> int | None:
        """The context window (tokens) of a configured model already in use, when it reports one."""
        model = self._models.get(model_name)
        for attr in ("context_window", "n_ctx", "context_size"):
            v = getattr(model, attr, None)
            v = v() if callable(v) else v
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    def _make(self, make_model: Any, config: dict, name: str, where: str) -> Any:
        try:
            model = make_model(config, name=name)
        except (ValueError, TypeError, KeyError) as e:
            raise invalid_params(f"{where}: {e}") from None
        recorder = getattr(self.conn, "recorder", None)
        if recorder is not None:  # --record: keep each invocation's text for replay --scripted
            model = recorder.wrap_model(model, config, name, inline=self.settings["models"].get(name) is not config)
        return model

    # ------------------------------------------------------------------ branches
    def branch(self, branch_id: Any) -> Any:
        self._ensure_state()
        b = self.branches.get(branch_id) if isinstance(branch_id, str) else None
        if b is None:
            raise E.branch_not_found(branch_id)
        return b

    async def _stored_branch(self, branch_id: Any) -> Any:
        """The branch, after taking in what is stored (-32012 when there is none), and after the
        delete of it under way, if one is (a request sent after a ``deleteBranch`` meets it done,
        as it meets a ``createBranch`` sent before it done)."""
        await self._state()
        deleting = self._deleting.get(branch_id) if isinstance(branch_id, str) else None
        if deleting is not None:
            await asyncio.shield(deleting)
        return self.branch(branch_id)

    async def restore(self) -> None:
        """Restore the stored branches (once, off the event loop) and take in what other
        processes on the same ``stateDir`` committed since the last look. Every method that
        reads branches does this first; a front end calls it before :meth:`branch`."""
        await self._state()

    def messages_of(self, branch_id: str) -> Any:
        """The message log of a branch held here, or an empty tuple (never restores, never raises)."""
        b = self.branches.get(branch_id)
        return b.messages if b is not None else ()

    def branch_info(self, branch_id: str) -> dict[str, Any]:
        """What a front end keeps about a branch (e.g. ACP's cwd, title, model, updatedAt): a
        JSON object the service stores with the branch and never interprets; empty when none."""
        return dict(self._info.get(branch_id) or {})

    def permission_mode(self, branch_id: str) -> str:
        """The branch's permission mode (``governance.MODES``): ``ask`` unless set."""
        self._core()
        return self.governance.mode_of(branch_id)  # type: ignore[union-attr]

    async def set_branch_info(self, branch_id: str, info: dict[str, Any] | None = None, *,
                              mode: str | None = None) -> None:
        """Merge ``info`` into the branch's info and/or set its permission mode (applied by the
        service's authorizer from the next tool call on), saved durably in one transaction before
        it returns. When that fails: -32013, and memory is what is on disk again."""
        await self._stored_branch(branch_id)
        if mode is not None and mode not in MODES:
            raise invalid_params(f"unknown permission mode {mode!r}; one of {', '.join(MODES)}",
                                 {"mode": mode, "modes": list(MODES)})
        if info:
            self._info[branch_id] = {**self._info.get(branch_id, {}), **info}
        if mode is not None:
            self.governance.set_mode(branch_id, mode)  # type: ignore[union-attr]  # marks the meta changed
        if self.journal is None or not (info or mode is not None):
            return
        if info:
            self.journal.update_meta(branch_id, {"client": dict(self._info[branch_id])})
        from operate_sidecar.server.state import StateNotSaved

        async def save() -> None:
            try:  # only the meta: an operate running on the branch keeps its messages for its own commit
                await self.flush_journal(branch_id, messages=False)
            except StateNotSaved as e:
                self._restore_meta(branch_id)
                raise E.state_not_saved(f"branch {branch_id} was not changed ({e})",
                                        {"branchId": branch_id}) from None

        await self._to_the_end(save())

    def _check_branch_room(self) -> None:
        """``maxBranches``: the branches held and those being forked (``forkBranch`` builds its
        copy off the loop) leave room for one more. What the client can do about it is worded
        by its front end (``errors.LimitReached``)."""
        limit = int(self.settings["maxBranches"])
        held = len(self.branches) + self._forking
        if held >= limit:
            raise E.LimitReached(f"maxBranches limit reached: the server holds {held} branches (limit {limit})",
                                 {"limit": "maxBranches", "value": limit})

    def _check_message_room(self, branch: Any, clearing: bool) -> None:
        limit = int(self.settings["maxMessagesPerBranch"])
        if not clearing and len(branch.messages) >= limit:
            raise E.LimitReached(f"maxMessagesPerBranch limit reached: branch {branch.id} holds "
                                 f"{len(branch.messages)} messages (limit {limit})",
                                 {"limit": "maxMessagesPerBranch", "value": limit, "branchId": branch.id})

    @property
    def _turns(self) -> Any:
        if self._turns_ is None:
            self._turns_ = Turns(int(self.settings["maxConcurrentOperates"]))
        return self._turns_

    @contextlib.asynccontextmanager
    async def _turn(self, branch_id: str, ticket: int) -> Any:
        """An operate's turn, by the ticket it took as it arrived (``service.turns``): its
        branch's line first (every earlier operate of the branch over), then one of
        maxConcurrentOperates slots (the earliest waiting ticket first); cancellable. A delete of
        the branch ends a waiting operate (-32012) as it ends the running one: it would wait for
        another branch's operate to free a slot."""
        turns = self._turns
        with self._findable(branch_id):  # (waiting: until its turn has come)
            self.branch(branch_id)  # (deleted before it waited, while its params were read: -32012 now)
            line = turns.line(branch_id)
            await line.wait(ticket)
            line.running = ticket
            try:
                await turns.slots.acquire(ticket)
            except BaseException:
                line.running = None
                raise
        try:
            yield
        finally:
            turns.slots.release()
            line.running = None

    def _not_waiting(self, branch_id: str, waiting: set[asyncio.Task], me: asyncio.Task | None) -> None:
        waiting.discard(me)  # type: ignore[arg-type]
        if not waiting and self._waiting.get(branch_id) is waiting:
            del self._waiting[branch_id]

    def _adopt(self, b: Any) -> None:
        b.authorizer = self._authorize
        b.max_tool_output_chars = int(self.settings["maxToolOutputChars"])
        b.default_tool_timeout = float(self.settings["toolTimeoutMs"]) / 1000.0
        b.hooks.subscribe(self._on_hook)
        self.branches[b.id] = b

    async def _authorize(self, inv: Any) -> Any:
        """The branches' authorizer: governance decides (mode, then the policy in force, which
        may ask the client); then a port that shows calls (``tool_decided``, optional) hears
        the decision before an allowed call runs. The port never changes the decision."""
        result = await self.governance.authorize(inv)  # type: ignore[union-attr]
        decided = getattr(self.rpc, "tool_decided", None)
        if decided is not None:
            try:
                await decided({"branchId": inv.branch_id, "callId": inv.call_id, "tool": str(inv.function),
                               "arguments": inv.arguments, "allowed": bool(result.allowed)})
            except Exception:
                log.warning("the port's tool_decided failed", exc_info=True)
        return result

    def _meta(self, b: Any, spec_chat: Any = None, spec_parse: Any = None) -> dict[str, Any]:
        meta = {"name": b.name, "chatModel": spec_chat, "parseModel": spec_parse, "createdAt": time.time(),
                "policy": dict(self.governance.branch.get(b.id, {}))}  # type: ignore[union-attr]
        mode = self.governance.mode_of(b.id)  # type: ignore[union-attr]
        if mode != "ask":
            meta["mode"] = mode
        if self._info.get(b.id):
            meta["client"] = dict(self._info[b.id])
        return meta

    def _policy_changed(self, branch_id: str) -> None:
        """Mark the branch's journal meta changed (its policy and permission mode). No message
        record is queued with it: the meta is written by the branch's next flush (authorizeTool,
        set_branch_info: at once, on its own, see ``flush_journal(messages=False)``; an
        ``allow_always``/``deny_always`` answer during an operate: with that operate's group)."""
        if self.journal is not None and branch_id in self.branches:
            gov = self.governance
            self.journal.update_meta(branch_id, {"policy": dict(gov.branch.get(branch_id, {})),  # type: ignore[union-attr]
                                                 "mode": gov.mode_of(branch_id)})  # type: ignore[union-attr]

    def _on_hook(self, ev: Any) -> None:
        self.seq += 1
        params: dict[str, Any] = {"seq": self.seq, "branchId": ev.branch_id, "callId": ev.call_id,
                                  "event": getattr(ev.type, "value", ev.type), "tool": ev.tool,
                                  "argsSummary": ev.args_summary}
        if ev.result_summary is not None:
            params["resultSummary"] = ev.result_summary
        if ev.error is not None:
            params["error"] = ev.error
        if ev.duration_ms is not None:
            params["durationMs"] = ev.duration_ms
        self.rpc.notify("toolEvent", params)

    async def createBranch(self, params: dict, *, info: dict[str, Any] | None = None,
                           prime_first: bool = True) -> dict:
        """``info`` (not on the wire): the front end's info of the new branch, saved with it.
        ``prime_first=False``: a front end that primes the branch its own way (ACP's sessions,
        with their tools and reply format) skips the plain operate's priming of a first branch."""
        from operate_sidecar.protocol import CreateBranchParams, structure

        p = structure(CreateBranchParams, params)
        await self._state()
        self._check_branch_room()
        from operate_sidecar.server.core.branch import Branch

        chat = self.resolve_model(p.chat_model, "chatModel") if p.chat_model is not None else self.default_model()
        parse = self.resolve_model(p.parse_model, "parseModel") if p.parse_model is not None else None
        b = Branch(system=p.system, chat_model=chat, parse_model=parse, name=p.name, tools=self.registry)
        self._adopt(b)
        if info:
            self._info[b.id] = dict(info)
        if self.journal is not None:
            from operate_sidecar.protocol import unstructure

            specs = {"chatModel": unstructure(p.chat_model), "parseModel": unstructure(p.parse_model)}
            self._model_specs[b.id] = specs
            self.journal.attach(b, self._meta(b, specs["chatModel"], specs["parseModel"]))
            await self._to_the_end(self._commit_new_branch(b.id))
        if prime_first:
            await self._to_the_end(self._prime_first(b.id))  # (the branch is made: a cancel now is too late)
        return {"branchId": b.id}

    async def forkBranch(self, params: dict, *, info: dict[str, Any] | None = None) -> dict:
        """``info`` (not on the wire): the front end's info of the new branch, saved with it.
        The copy of the messages, and their records for the store, are made on a worker thread
        (``_build_fork``): a branch of 100,000 messages took seconds, and held up every request
        meanwhile. What is copied is taken on the loop, at once: the branch as it is, or as it was
        before an operate still running on it (never half a turn); the fork is saved before the
        answer. Once the copy has begun the fork is made, whatever comes (docs/PROTOCOL.md §7)."""
        from operate_sidecar.protocol import BranchParams, structure
        from operate_sidecar.server.core.messages import new_id

        p = structure(BranchParams, params)
        src = await self._stored_branch(p.branch_id)
        self._check_branch_room()
        # an operate running on the source: copy the branch as it was before it (never half a turn)
        mark = self._settled.get(src.id)
        kept = list(src.messages) if mark is None else list(mark[1] if mark[1] is not None
                                                            else src.messages[:mark[0]])
        bid = new_id()
        self.governance.copy_branch(src.id, bid)  # type: ignore[union-attr]
        if src.id in self._roots:
            self._roots[bid] = self._roots[src.id]
        if info:
            self._info[bid] = dict(info)
        specs = dict(self._model_specs.get(src.id, {}))
        meta = None
        if self.journal is not None:
            self._model_specs[bid] = specs
            meta = self._meta(_Named(bid, src.name), specs.get("chatModel"), specs.get("parseModel"))
        self._forking += 1
        try:
            b = await self._to_the_end(self._to_thread(self._build_fork, src, bid, kept, meta))
        except BaseException:
            self._model_specs.pop(bid, None)
            self._info.pop(bid, None)
            self._roots.pop(bid, None)
            self.governance.forget_branch(bid)  # type: ignore[union-attr]
            if self.journal is not None:  # a half-made fork recorded (its attach failed late): no later flush saves it
                self.journal.forget(bid)
            raise
        finally:
            self._forking -= 1
        self._adopt(b)
        if self.journal is not None:
            await self._to_the_end(self._commit_new_branch(b.id))
        return {"branchId": b.id}

    def _build_fork(self, src: Any, bid: str, kept: list, meta: dict[str, Any] | None) -> Any:
        """On a worker thread: the fork ``bid`` of ``src`` with copies of the messages ``kept``,
        attached to the store with ``meta`` (its records made there). No one else sees the new
        branch yet; ``src``'s messages are not read here (``kept`` was taken on the loop)."""
        from operate_sidecar.server.core.messages import MessageLog

        b = src.fork(id=bid, messages=MessageLog(kept).copy().items)
        if meta is not None:
            self.journal.attach(b, meta)
        return b

    async def deleteBranch(self, params: dict) -> dict:
        """Delete the branch (on disk first: a failed delete leaves it as it was). An operate
        running on it ends as a cancelled one does (a pending permission request is cancelled,
        no further tool starts, the model call is cancelled) and answers -32012; one whose save
        races the delete waits for the delete's outcome before it answers (see ``operate``)."""
        from operate_sidecar.protocol import BranchParams, structure

        p = structure(BranchParams, params)
        await self._stored_branch(p.branch_id)
        stopping: list[tuple[str, McpServerReady]] = []  # the MCP servers only it held
        if self.journal is not None:
            from operate_sidecar.server.state import StateNotSaved

            # (known at once, before the delete's task runs: a request read after this one waits for it)
            over = asyncio.get_running_loop().create_future()
            self._deleting[p.branch_id] = over

            async def delete() -> None:
                try:
                    try:
                        await self._to_thread(self.journal.delete, p.branch_id)
                    except StateNotSaved as e:
                        raise E.state_not_saved(f"branch {p.branch_id} was not deleted ({e})",
                                                {"branchId": p.branch_id}) from None
                    stopping.extend(self._forget(p.branch_id))
                finally:
                    if self._deleting.get(p.branch_id) is over:
                        del self._deleting[p.branch_id]
                    over.set_result(None)

            try:
                await self._to_the_end(delete())  # forgets the branch once it is deleted on disk
            finally:
                if not over.done():  # (its task never ran: nobody waits for it in vain)
                    if self._deleting.get(p.branch_id) is over:
                        del self._deleting[p.branch_id]
                    over.set_result(None)
        else:
            stopping = self._forget(p.branch_id)
        # the MCP servers only it held were asked to stop (``_forget``): answered once they have
        # stopped, as a released branch is (a cancelled caller leaves them to stop on their own)
        await self._mcp_stopped(p.branch_id, stopping)
        return {}

    def _forget(self, branch_id: str) -> list[tuple[str, McpServerReady]]:
        """A deleted branch out of memory; the operate running on it, and those waiting for their
        turn on it, are ended (-32012); the MCP
        servers it passed that no other branch holds are stopped (their tools unregistered), as
        for a released branch (:meth:`release_branch`): those asked to stop, returned
        (:meth:`_mcp_stopped` waits for them)."""
        for task in (self._running.pop(branch_id, None), *self._waiting.pop(branch_id, ())):
            if task is not None and not task.done() and task not in self._doomed:
                self._doomed.add(task)
                task.cancel()
        self.branches.pop(branch_id, None)
        self._usage.pop(branch_id, None)
        self._model_specs.pop(branch_id, None)
        self._info.pop(branch_id, None)
        self._roots.pop(branch_id, None)
        self._problems.pop(branch_id, None)
        stopping = self._drop_branch_mcp(branch_id, self._branch_mcp_of.pop(branch_id, set()))
        self.governance.forget_branch(branch_id)  # type: ignore[union-attr]
        return stopping

    async def listBranches(self, params: dict) -> dict:
        if params:
            raise invalid_params("unknown fields: " + ", ".join(json.dumps(k) for k in params),
                                 {"unknownFields": list(params)})
        await self._state()
        for deleting in list(self._deleting.values()):  # (deletes under way, saved first: the list shows them done)
            await asyncio.shield(deleting)
        return {"branches": [{"branchId": b.id, "name": b.name, "messageCount": len(b.messages),
                              "chatModel": getattr(b.chat_model, "name", None), "usage": self._usage_of(b.id)}
                             for b in self.branches.values()]}

    def _restore_usage(self, branch_id: str, saved: Any) -> None:
        if not isinstance(saved, dict):
            return
        from operate_sidecar.server.core.imodel import UsageMeter

        def count(key: str) -> int | None:
            v = saved.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

        self._usage[branch_id] = UsageMeter(input_tokens=count("inputTokens"), output_tokens=count("outputTokens"),
                                            context_tokens=count("contextTokens"),
                                            model_calls=count("modelCalls") or 0)

    def _usage_of(self, branch_id: str) -> dict[str, Any]:
        """The token totals of the operates run on a branch (saved with the branch)."""
        meter = self._usage.get(branch_id)
        if meter is None:
            return {"inputTokens": 0, "outputTokens": 0, "contextTokens": None, "modelCalls": 0}
        return meter.to_wire()

    async def branchMessages(self, params: dict) -> dict:
        from operate_sidecar.protocol import BranchMessagesParams, structure

        p = structure(BranchMessagesParams, params)
        if p.offset < 0 or p.limit < 0:
            raise invalid_params("offset and limit must be non-negative")
        b = await self._stored_branch(p.branch_id)
        # the page is taken at once, then made ``PAGE_SLICE`` messages at a time, yielding to the
        # loop between slices: a page of 100,000 messages held up every request for a second
        items, total = b.messages.items[p.offset:p.offset + p.limit], len(b.messages)
        out: list[dict[str, Any]] = []
        for i in range(0, len(items), PAGE_SLICE):
            if i:
                await asyncio.sleep(0)
            out.extend(m.to_dict() for m in items[i:i + PAGE_SLICE])
        return {"messages": out, "total": total}

    # ------------------------------------------------------------------ tools
    def _tool_info(self, t: Any, branch_id: str | None) -> dict:
        info = t.info()
        info["policy"] = self.governance.policy_for(t, branch_id)  # type: ignore[union-attr]
        return info

    async def listTools(self, params: dict) -> dict:
        from operate_sidecar.protocol import ListToolsParams, structure

        p = structure(ListToolsParams, params)
        if p.branch_id is not None:
            await self._stored_branch(p.branch_id)
        await self.ensure_tools()
        return {"tools": [self._tool_info(t, p.branch_id) for t in self.registry]}

    async def authorizeTool(self, params: dict) -> dict:
        from operate_sidecar.protocol import AuthorizeToolParams, structure

        p = structure(AuthorizeToolParams, params)
        if p.branch_id is not None:
            await self._stored_branch(p.branch_id)
        await self.ensure_tools(relisted=False)  # (a decision: no MCP server's list to wait for)
        if p.tool not in self.registry:
            raise invalid_params(f"unknown tool {p.tool!r}", {"tool": p.tool})
        self.governance.set(p.tool, p.decision, p.branch_id)  # type: ignore[union-attr]
        if p.branch_id is not None:
            # durable before the answer, but only the policy: an operate running on this
            # branch keeps its recorded messages pending until its own commit writes them whole
            from operate_sidecar.server.state import StateNotSaved

            async def save() -> None:
                try:
                    await self.flush_journal(p.branch_id, messages=False)
                except StateNotSaved as e:
                    self._restore_meta(p.branch_id)
                    raise E.state_not_saved(f"the policy of branch {p.branch_id} was not changed ({e})",
                                            {"branchId": p.branch_id}) from None

            await self._to_the_end(save())
        return {"tool": p.tool, "decision": p.decision, "branchId": p.branch_id}

    async def registerClientTools(self, params: dict) -> dict:
        from operate_sidecar.protocol import RegisterClientToolsParams, structure

        p = structure(RegisterClientToolsParams, params)
        for i, spec in enumerate(p.tools):
            _check_tool_name(spec.name, f"tools[{i}].name")
        await self.ensure_tools(relisted=False)  # (the client's tools: no MCP server's list to wait for)
        from operate_sidecar.server.core.tools import Tool

        def check_schemas() -> None:  # valid object schemas, or -32602 saying where (off the event loop)
            from .schemas import check_depth, check_valid

            for spec in p.tools:
                if not isinstance(spec.input_schema, dict) or spec.input_schema.get("type", "object") != "object":
                    raise invalid_params(f"tool {spec.name!r}: inputSchema must be an object schema")
                check_depth(spec.input_schema, f"tool {spec.name!r}: inputSchema")  # (the check below recurses)
                check_valid(spec.input_schema, f"tool {spec.name!r}: inputSchema")

        import anyio.to_thread

        await anyio.to_thread.run_sync(check_schemas, abandon_on_cancel=True)
        # the names last, with no await between the check and the registration
        names = [t.name for t in p.tools]
        taken = [n for n in names if n in self.registry]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if taken or dupes:
            raise invalid_params(f"tool name{'s' if len(taken + dupes) > 1 else ''} already taken: "
                                 + ", ".join([f"{n} (by {self._origin(n)})" for n in taken]
                                             + [f"{n} (twice in this call)" for n in dupes]),
                                 {"taken": taken + dupes})
        for spec in p.tools:
            self.registry.register(Tool(name=spec.name, description=spec.description,
                                        input_schema=spec.input_schema, func=self._client_tool(spec.name),
                                        source="client"))
        return {"registered": names}

    def _client_tool(self, name: str) -> Any:
        async def call(arguments: dict, ctx: Any) -> Any:
            from operate_sidecar.server.tools.errors import ToolCallError

            try:
                res = await self.rpc.request_client("invokeClientTool", {
                    "branchId": ctx.branch_id, "callId": ctx.call_id, "tool": name, "arguments": arguments}, None)
            except ClientRequestError as e:
                raise ToolCallError(e.message or f"client tool {name} failed") from None
            if isinstance(res, dict) and "output" in res:
                return res["output"]
            return res

        return call

    # ------------------------------------------------------------------ operate
    async def _operate_kw(self, p: Any) -> dict[str, Any]:
        """The core's keyword arguments for the structured ``operate`` params ``p``: models
        resolved, schemas built (off the event loop), the rest as they are; -32602 for a clash."""
        kw: dict[str, Any] = {}
        if p.instruct is not None:
            from operate_sidecar.protocol import unstructure

            kw["instruct"] = {_camel_to_snake(k): v for k, v in unstructure(p.instruct).items()}
        else:
            kw.update(instruction=p.instruction, guidance=p.guidance, context=p.context)
        if p.chat_model is not None:
            kw["chat_model"] = self.resolve_model(p.chat_model, "chatModel")
        if p.parse_model is not None:
            kw["parse_model"] = self.resolve_model(p.parse_model, "parseModel")
        if p.response_format is not None:  # bounded, and built off the event loop
            kw["response_format"] = await self.schemas.model_for_async(p.response_format)
        if p.field_models:
            kw["field_models"] = await self.schemas.specs_for_async(list(p.field_models))
        if p.parse_options is not None:
            from operate_sidecar.server.core.params import AlcallParams

            o = p.parse_options
            kw["parse_call_params"] = AlcallParams(retry_attempts=o.retry_attempts,
                                                   retry_initial_delay=o.retry_initial_delay,
                                                   retry_backoff=o.retry_backoff, max_concurrent=o.max_concurrent,
                                                   throttle_period=o.throttle_period)
        prepare_operate_kw = _module(_CORE + "prepare").prepare_operate_kw
        # the rest as they are (an omitted actionStrategy is None: not given)
        kw.update((name, getattr(p, name)) for name in passed_as_is(prepare_operate_kw))

        options = dict(p.model_options or {})
        clash = sorted(set(options) & _pipeline_names(prepare_operate_kw))
        if clash:  # modelOptions go to the provider; they never set pipeline parameters
            raise invalid_params("modelOptions: " + ", ".join(clash) + " name operate pipeline parameters, "
                                 "not provider options", {"fields": clash})
        kw.update(options)
        return kw

    async def prime(self, params: dict) -> None:
        """Build now, for an ``operate`` with ``params`` (its branch, reply format, tools and
        model), what its first run would build on first use: the reply model, its operative
        types and the schema shown to the model, narrowed to the branch's tools. No model call,
        no message, no tool, nothing saved. The ACP front end calls it when a session is made,
        so that its first prompt costs what a later one does."""
        from operate_sidecar.server.core.operate import prime
        from operate_sidecar.server.core.prepare import prepare_operate_kw

        self.tool_threads  # noqa: B018 - the pool the operate enters its tools' scope with (no thread starts)
        _, branch, kw = await self._operate_call(params)
        prime(branch, **prepare_operate_kw(branch, **self._round_tools(branch, kw)))

    async def _prime_first(self, branch_id: str) -> None:
        """A branch made before any operate or prime in this service (the tools' pool, which
        both make, is not made yet): what its first plain ``operate`` builds on first use (the
        builtin tools, the tools' pool, :meth:`prime`'s types) is built now, ~0.1 ms before the
        answer, rather than in the editor's first operate, which often follows its first
        ``createBranch`` at once. Not for the ACP front end, which primes each session for its own
        turns once its folders and tools are known (``createBranch(prime_first=False)``). Skipped
        when tool modules or MCP servers are configured (their loading may take long, and the
        first operate waits for it anyway); a failure is left to the operate that meets it."""
        if self._tool_threads is not None or self.settings.get("toolModules") or self.settings.get("mcpServers"):
            return
        try:
            await self.prime({"branchId": branch_id})
        except Exception:  # noqa: BLE001 - a bad default model is reported by the operate that uses it
            log.debug("first branch not primed", exc_info=True)

    async def _operate_call(self, params: dict, *, findable: bool = False) -> tuple[Any, Any, dict[str, Any]]:
        """An ``operate``'s wire params checked and resolved: (the structured params, the branch,
        the core's keyword arguments). -32602 for unknown fields or tools, -32012 for no branch.
        ``findable`` (an operate's own): from the moment its branch is found, a delete of that
        branch ends it (-32012, docs/PROTOCOL.md §3) while it waits here (for the tool sources to
        load: MCP servers starting, ``toolModules`` importing; for its reply format to be built),
        as it ends one waiting for its turn."""
        protocol = _module("operate_sidecar.protocol")
        computed = params.get("tools") if isinstance(params, dict) else None
        if not isinstance(computed, BranchTools):
            computed = None
        else:  # (a front end's, ``branch_tools``': a plain list on the wire)
            params = {**params, "tools": list(computed)}
        p = protocol.structure(protocol.OperateParams, params)  # unknown fields named, removed modelOptions refused (-32602)
        branch = await self._stored_branch(p.branch_id)
        with self._findable(branch.id) if findable else contextlib.nullcontext():
            await self.ensure_tools()
            if isinstance(p.tools, list):
                unknown = [t for t in p.tools if t not in branch.tools]
                if unknown and computed is None:  # (a front end's: computed again for each round)
                    raise invalid_params(f"tools: unknown tool{'s' if len(unknown) > 1 else ''}: "
                                         + ", ".join(unknown), {"unknownTools": unknown})
            kw = await self._operate_kw(p)
            if computed is not None:  # (computed again for each round: ``_round_tools``)
                kw["tools"] = BranchTools()
            return p, branch, kw

    def _round_tools(self, branch: Any, kw: dict[str, Any]) -> dict[str, Any]:
        """``kw`` (an operate's, ``_operate_call``'s) for one of its rounds, its ``tools`` as they
        are when that round begins (an MCP server may list its tools again, or stop, during an
        operate): a front end's computed list (:class:`BranchTools`) computed again (every tool
        but other branches' MCP servers': one added since is offered, one removed is not); a
        client's list without the names gone since, with a log line (its names were checked as
        the operate began: a later round that failed for a name gone would fail after the
        earlier rounds' effects)."""
        tools = kw.get("tools")
        if isinstance(tools, BranchTools):
            return {**kw, "tools": self.branch_tools(branch.id)}
        if isinstance(tools, list):
            gone = [t for t in tools if isinstance(t, str) and t not in branch.tools]
            if gone:
                log.info("branch %s: tools gone since its operate began, left out of this round: %s",
                         branch.id, ", ".join(gone))
                return {**kw, "tools": [t for t in tools if t not in gone]}
        return kw

    @contextlib.contextmanager
    def _findable(self, branch_id: str) -> Any:
        """The current task among the operates waiting on the branch (``_waiting``, which
        ``_forget`` ends) for the block's time."""
        me = asyncio.current_task()
        waiting = self._waiting.setdefault(branch_id, set())
        if me is not None:
            waiting.add(me)
        try:
            yield
        finally:
            self._not_waiting(branch_id, waiting, me)

    async def operate(self, params: dict, *, info: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
                      repeat_limit: int = 0) -> dict:
        """``info`` (not on the wire): merged into the branch's info when the operate has put
        something on the branch (a message, or a clear), and saved in the same transaction as
        those messages (e.g. ACP's update time); one that put nothing there (it failed, or was
        cancelled, before its model's reply: fail before effect) leaves the info as it was. A
        callable is called then, as the operate is saved, for the info to merge (ACP's update
        time is when the turn was saved, not when it began).
        A branch deleted while the operate runs ends it (``deleteBranch`` cancels its task):
        it answers -32012, unless it was cancelled as well (-32800). ``repeat_limit`` (the ACP
        front end's; on the native wire the params' ``repeatLimit``): the rounds also stop after
        that many rounds in a row of the same failed calls (``service.rounds``), and the result
        then has ``repeated: true``."""
        me = asyncio.current_task()
        # its place in line, taken as it arrives (before its first wait: its parameters may
        # take longer to read than a later operate's, which must still wait for it)
        branch_id = params.get("branchId") if isinstance(params, dict) else None
        branch_id = branch_id if isinstance(branch_id, str) else ""  # ("": refused before any turn)
        ticket = self._turns.arrive(branch_id)
        try:
            out = await self._operate(params, info, repeat_limit, ticket)
        except asyncio.CancelledError:
            if me is None or me not in self._doomed:
                raise
            self._doomed.discard(me)
            if me.uncancel() > 0:  # the client cancelled it too: a cancelled request
                raise
            raise E.branch_not_found(self._doomed_id(params)) from None
        finally:
            self._turns.leave(branch_id, ticket)
        if me is not None and me in self._doomed:  # deleted after its last wait: its result is lost
            self._doomed.discard(me)
            if me.cancelling():
                me.uncancel()
            raise E.branch_not_found(self._doomed_id(params))
        return out

    def _end_if_deleted(self, me: asyncio.Task | None, branch_id: str, sink: Any, meter: Any) -> None:
        """In an operate that was just cancelled: when the cancel was its branch's delete (and
        nobody else cancelled it), it is no longer cancelled, its progress ends ``failed`` and
        it raises -32012. Otherwise nothing."""
        if me is None or me not in self._doomed or me.cancelling() != 1:
            return
        self._doomed.discard(me)
        me.uncancel()
        if sink is not None:
            sink.finish("failed", meter.to_wire())
        raise E.branch_not_found(branch_id) from None

    @staticmethod
    def _doomed_id(params: dict) -> Any:
        return params.get("branchId") if isinstance(params, dict) else None

    async def _operate(self, params: dict, info: dict[str, Any] | Callable[[], dict[str, Any]] | None,
                       repeat_limit: int, ticket: int) -> dict:
        p, branch, kw = await self._operate_call(params, findable=True)
        imodel, rounds = _module(_CORE + "imodel"), _module("operate_sidecar.server.service.rounds")
        UsageMeter, current_usage = imodel.UsageMeter, imodel.current_usage
        core_operate = _module(_CORE + "operate").operate  # the module: ``core.operate`` is also a function
        RunParam, prepare_operate_kw = _module(_CORE + "params").RunParam, _module(_CORE + "prepare").prepare_operate_kw
        current_progress = _module(_CORE + "progress").current_progress
        CONTINUATION, run_rounds = rounds.CONTINUATION, rounds.run_rounds

        def prepare(k: int) -> dict[str, Any]:
            """Round k's prepared params: round 1 the caller's; later rounds the same params with
            the tools as they are as the round begins (``before`` has waited for the lists due),
            the continuation instruction, no repeated context and no clearing (see service.rounds)."""
            if k == 1:
                return prepared
            later = dict(self._round_tools(branch, kw), clear_messages=False)
            if "instruct" in later:
                later["instruct"] = {**later["instruct"], "instruction": CONTINUATION, "context": None}
            else:
                later.update(instruction=CONTINUATION, context=None)
            return prepare_operate_kw(branch, **later)

        async def before(k: int) -> None:
            """Before round k (after the first), before ``refused`` is asked: the lists of tools
            said to have changed meanwhile waited for (:meth:`_round_relists_waited`: a call of
            the round before may have changed them). A save that becomes known to fail during
            that wait still ends the rounds before the round's model is called."""
            await self._round_relists_waited(branch.id)

        def refused() -> bool:
            """Before each round after the first, as before round 1 (each time after the wait for
            the lists of tools due): whether the operate's save is already known to fail (a stat
            or two). Then the rounds end before the next round's model is called or any of its
            tools runs, and the save below answers -32013 and puts the branch back as it was
            before the operate (docs/PROTOCOL.md §3, §11)."""
            return self.journal is not None and self.journal.refusal() is not None

        self._check_message_room(branch, bool(p.clear_messages))
        async with self._turn(branch.id, ticket):
            # the lists said due while it waited for its turn (a call of the branch's operate before
            # it may have asked for one), waited for before the refusal check below; its slot of
            # maxConcurrentOperates is held meanwhile (a list is waited for RELIST_WAIT_S at most
            # from when a first request began to, so a hanging list holds the slots that long at
            # most, as a slow model would)
            with self._findable(branch.id):  # (a delete of the branch meanwhile ends it: -32012)
                await self._round_relists_waited(branch.id)
            # the branch as it is now that this operate's turn has come: one deleted while it
            # waited is -32012 (it would have run, and answered, on a branch that is gone)
            branch = self.branch(branch.id)
            self._check_message_room(branch, bool(p.clear_messages))
            refusal = self.journal.refusal() if self.journal is not None else None
            if refusal is not None:  # its save is bound to fail: refused before the model and tools run
                raise E.state_not_saved(f"the operate on branch {branch.id} was not run: {refusal}",
                                        {"branchId": branch.id})
            me = asyncio.current_task()
            if me is not None:  # what deleteBranch ends
                self._running[branch.id] = me
            prepared = prepare_operate_kw(branch, **self._round_tools(branch, kw))
            sink = None
            if p.work_done_token is not None:
                sink = WireProgress(self.rpc.notify, p.work_done_token,
                                    "run_and_collect" if isinstance(prepared["chat_param"], RunParam)
                                    or getattr(prepared["chat_param"].imodel, "is_cli", False) else "communicate",
                                    getattr(self.rpc, "thought", None),
                                    bool(self.conn.client_capabilities.get("thoughts")))
            # what forkBranch copies while this operate runs, until it answers (its save, and its
            # wait for a racing delete, included: a fork taken during a save that then fails would
            # keep a turn that never happened), and what keeps its branch busy: the messages before it
            self._settled[branch.id] = (len(branch.messages), list(branch.messages) if p.clear_messages else None)
            try:
                token = current_progress.set(sink)
                meter = UsageMeter()  # every model call of every round (chat and parse repair)
                usage_token = current_usage.set(meter)
                scope = self._enter_tools_scope(branch.id)
                cancelled = False  # the rounds ended by a cancel (not a tool that swallowed one: they went on)
                try:
                    result, rounds, repeated = await run_rounds(branch, p.max_rounds or 1, prepare, core_operate,
                                                                 repeat_limit=repeat_limit or p.repeat_limit or 0,
                                                                 stop=refused, before=before)
                except asyncio.CancelledError:
                    cancelled = True
                    self._end_if_deleted(me, branch.id, sink, meter)
                    if sink is not None:
                        sink.finish("cancelled", meter.to_wire())
                    raise
                except BaseException:
                    if sink is not None:
                        sink.finish("failed", meter.to_wire())
                    raise
                finally:
                    current_progress.reset(token)
                    current_usage.reset(usage_token)
                    self._leave_tools_scope(scope)
                    if self._running.get(branch.id) is me:
                        del self._running[branch.id]
                    mark = self._settled.get(branch.id)  # (dropped once the save has ended, below)
                    kept = self.branches.get(branch.id) is branch  # not deleted meanwhile
                    # the front end's info goes with the operate's messages: none, no info either
                    noted = (info() if callable(info) else dict(info)) \
                        if info and kept and _recorded(branch, mark) else None
                    if kept:
                        self._usage.setdefault(branch.id, UsageMeter()).add(meter)
                        if noted:
                            self._info[branch.id] = {**self._info.get(branch.id, {}), **noted}
                    if self.journal is not None and kept:  # with no store there is nothing to save
                        # the branch's totals (and info) are saved with its messages, in one transaction
                        # before the answer; on failure the branch is put back (-32013)
                        meta: dict[str, Any] = {"usage": self._usage_of(branch.id)}
                        if noted:
                            meta["client"] = dict(self._info[branch.id])
                        self.journal.update_meta(branch.id, meta)
                        # the save goes to its end whatever cancel comes meanwhile (docs/PROTOCOL.md
                        # §7): one that arrives once it has begun is too late, and the operate answers
                        # what happened, its result or -32013; one whose rounds a cancel ended (its
                        # cancel in flight here) answers -32800, only once its save has ended (before,
                        # the branch's next operate could run meanwhile, and a failed save's undoing
                        # then removed that one's messages from memory, not from disk)
                        try:
                            await self._to_the_end(self._commit_operate(branch, mark, cancelled))
                        except BaseException:  # cancelled while saving, or not saved: the one end says so
                            self._end_if_deleted(me, branch.id, sink, meter)
                            if sink is not None:
                                sink.finish("failed", meter.to_wire())  # "cancelled" when it is
                            raise
                # a delete of the branch that began before the save ended: its outcome decides
                # (deleted: the messages just saved went with the branch, and the answer says so)
                deleting = self._deleting.get(branch.id)
                if deleting is not None:
                    try:  # (a cancel meanwhile is too late too: the operate was saved, a failed delete keeps it)
                        await self._to_the_end(deleting)
                    except BaseException:
                        self._end_if_deleted(me, branch.id, sink, meter)
                        if sink is not None:
                            sink.finish("failed", meter.to_wire())
                        raise
                if self.branches.get(branch.id) is not branch:
                    if sink is not None:
                        sink.finish("failed", meter.to_wire())
                    raise E.branch_not_found(branch.id)
                if sink is not None:
                    sink.finish("completed", meter.to_wire())
            finally:
                self._settled.pop(branch.id, None)
        out = envelope(result)
        out["usage"] = meter.to_wire()
        out["rounds"] = rounds
        if repeated:  # (only for a caller that asked for the stop: repeatLimit, or the ACP front end)
            out["repeated"] = True
        return out


def _check_tool_name(name: str, path: str) -> None:
    """-32602 (``data.path``: ``path``) for a client tool's name that is empty, longer than
    ``MAX_TOOL_NAME`` characters, or holds whitespace, a control or format character or
    a line or paragraph separator (``server.tools.names``): the model calls a tool by its name,
    log lines and permission prompts show it, and such a name was registered (``""``,
    ``"a b/../\\n"``) where no model could call it, or shown as another (``"rm\\u202efdp"``)."""
    from operate_sidecar.server.tools.names import MAX_TOOL_NAME, name_problem

    why = name_problem(name)
    if why is not None:
        raise invalid_params(f"{path}: the tool name {name[:MAX_TOOL_NAME]!r} {why}",
                             {"path": path, "name": name[:MAX_TOOL_NAME]})


def _clashing(names: list[str], taken: Collection[str]) -> list[str]:
    """The names of ``names`` (MCP tools just named) that ``taken`` has or that are there twice,
    sorted; in one pass (a server may list thousands of tools)."""
    seen: set[str] = set()
    twice: set[str] = set()
    for n in names:
        (twice if n in seen else seen).add(n)
    return sorted({n for n in seen if n in taken} | twice)


def _renamed_told(renamed: dict[str, list[tuple[str, str, str]]]) -> list[str]:
    """The warnings of ``Service._renamed_mcp_tools``' answer: one per server."""
    return [f"MCP server {server!r}: " + "; ".join(f"its tool {plain!r} is offered as {public!r} ({why})"
                                                   for plain, public, why in pairs)
            for server, pairs in renamed.items()]


def _mcp_ended(ready: McpServerReady) -> bool:
    """The added MCP server is over though nothing asked it to stop: it failed to start (not
    found, it exited or timed out in its handshake) or stopped on its own; its tools are gone."""
    return ready.stopped.is_set() and not ready.stop.is_set()


class BranchTools(list):
    """The tools ``Service.branch_tools`` computed for a front end's operate (ACP's): given as an
    operate's ``tools``, a name in it gone by the time the operate runs is not refused (a
    client on the wire can only send a plain list), since each round, the first too, is offered
    the tools computed again then for the operate's branch (``Service._round_tools``); in the
    operate's keyword arguments, an empty one marks that."""


class _Relist(asyncio.Event):
    """A round of an MCP server's tools' lists (``Service._serve_mcp``): set once its list is
    over; ``deadline``: the loop time until which requests wait for it, ``RELIST_WAIT_S`` after
    the first one began to (``Service._relists_waited``)."""

    def __init__(self) -> None:
        super().__init__()
        self.deadline: float | None = None


class McpServerReady(asyncio.Event):
    """Set once an added MCP server's tools are registered (or it failed); ``tools``: the
    names they are offered under (none when it failed)."""

    def __init__(self) -> None:
        super().__init__()
        self.tools: tuple[str, ...] = ()
        self.stop = asyncio.Event()  # set: the server stops (its tools are unregistered)
        self.stopped = asyncio.Event()  # set once it has stopped (or never started)
        self.settled = _Relist()  # clear while its tools, said to have changed, are listed again
        self.settled.set()
        self.problems: list[str] = []  # the warnings reported about it (``Service._branch_problem``)


class _TakenNames:
    """The names registered in ``registry`` as they are when read (an MCP source chooses its
    tools' names with it); ``seen``: what the last read gave."""

    __slots__ = ("_registry", "_also", "seen")

    def __init__(self, registry: Any, also: Collection[str] = ()) -> None:
        self._registry = registry
        self._also = frozenset(also)  # names taken though not registered (not in ``seen``)
        self.seen: frozenset[str] = frozenset()

    def __contains__(self, name: object) -> bool:
        return name in self._registry or name in self._also

    def __len__(self) -> int:
        return len(set(self._registry.names()) | self._also)

    def __iter__(self) -> Any:
        names = list(self._registry.names())
        self.seen = frozenset(names)
        return iter([*names, *sorted(self._also - self.seen)])


_PIPELINE_NAMES: frozenset[str] | None = None
_AS_IS: tuple[str, ...] | None = None

#: ``operate`` params the service turns into something else before ``prepare_operate_kw``
#: (models, schemas, the instruction) ...
CONVERTED = frozenset({"instruct", "instruction", "guidance", "context", "chat_model", "parse_model",
                       "response_format", "field_models", "parse_options"})
#: ... and those it uses itself
CONSUMED = frozenset({"branch_id", "model_options", "work_done_token", "max_rounds", "repeat_limit"})


class _Named:
    """What ``Service._meta`` reads of a branch (its id and name), for a fork not built yet."""

    __slots__ = ("id", "name")

    def __init__(self, id: str, name: str | None) -> None:
        self.id = id
        self.name = name


def _recorded(branch: Any, mark: tuple[int, list | None] | None) -> bool:
    """Whether an operate put anything on ``branch`` since ``mark`` (its ``_settled`` entry: the
    message count before it, and the messages themselves when it may clear them): a message
    appended, or the history cleared. The core appends nothing for a call that fails or is
    cancelled before its model's reply (fail before effect), so such an operate recorded nothing."""
    if mark is None:
        return True
    items = branch.messages.items
    count, before = mark
    if before is None:
        return len(items) != count
    return len(items) != len(before) or any(a is not b for a, b in zip(items, before))


@functools.cache
def _module(name: str) -> Any:
    """The module ``name``, imported on first use and kept: an operate reads the names it uses
    through it (a module attribute replaced is seen) instead of running its import statements
    again on every call; making a service still loads no core."""
    return importlib.import_module(name)


_CORE = "operate_sidecar.server.core."
_BUILTIN = "operate_sidecar.server.tools.builtin"


def _pipeline_names(fn: Any) -> frozenset[str]:
    global _PIPELINE_NAMES
    if _PIPELINE_NAMES is None:
        import inspect

        _PIPELINE_NAMES = frozenset(n for n, prm in inspect.signature(fn).parameters.items()
                                    if prm.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))
    return _PIPELINE_NAMES


def passed_as_is(prepare: Any) -> tuple[str, ...]:
    """The ``operate`` params (the protocol's ``OperateParams`` fields) that reach ``prepare``
    (``prepare_operate_kw``) unchanged, by name: every field that names one of its parameters
    and is not ``CONVERTED``. The parameter list is declared once, in the protocol."""
    global _AS_IS
    if _AS_IS is None:
        import attrs

        from operate_sidecar.protocol import OperateParams

        _AS_IS = tuple(f.name for f in attrs.fields(OperateParams)
                       if f.name in _pipeline_names(prepare) and f.name not in CONVERTED)
    return _AS_IS


def envelope(result: Any) -> dict[str, Any]:
    if result is None:
        return {"result": None, "kind": "none", "model": None}
    dump = getattr(result, "model_dump", None)
    if dump is not None:
        return {"result": dump(mode="json"), "kind": "model", "model": type(result).__name__}
    if isinstance(result, str):
        return {"result": result, "kind": "text", "model": None}
    return {"result": result, "kind": "dict", "model": None}


__all__ = ["Service", "envelope"]
