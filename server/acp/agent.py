"""The ACP methods over the service (``server.service.service.Service`` with an ``AcpPort``).

A session is a branch (the session id is the branch id). A prompt turn is an ``operate``
with actions and every tool, repeated while the model keeps calling tools, up to
``MAX_ROUNDS`` rounds, or until the same calls failed the same way ``REPEAT_LIMIT`` rounds in
a row (``service.rounds``; the turn then ends ``end_turn`` with a notice saying so). A reply
cut at the model's token limit (``ReplyCut``, a model error with ``stop_reason``
``max_tokens``: the ``local`` and ``openai`` providers') ends the turn ``max_tokens``, with a
notice naming the setting to raise. Per
session the editor picks a ``model`` (a configured model) and a ``mode`` (the permission
policy: ``ask``, ``auto-edit``, ``read-only``), both as config options (and the mode also as
an ACP session mode). The mode is the branch's permission mode in the service, which applies
it; this module only maps the option to it. What a session has beyond its branch (cwd, model,
update time; a fork's title) is the branch's info, which the service saves with the branch
(``Service.set_branch_info``; the update time with the turn's messages, taken as they are saved,
and only when the turn recorded some). A session's title is the first line of its first recorded
prompt (``OperateAgent._title``: the store's order, so of two servers' first turns on one session
the one saved first names it, and a prompt that recorded nothing names nothing); a fork's, and
one an earlier version saved, is in its info. An
``acp-sessions.json`` left in the state directory by an older version is imported once (then
renamed ``acp-sessions.json.imported``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import gc
import importlib
import json
import logging
import math
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

from acp import PROTOCOL_VERSION, Agent, RequestError, update_agent_message_text
from acp.schema import (AgentCapabilities, CloseSessionResponse, ConfigOptionUpdate, CurrentModeUpdate,
                        DeleteSessionRequest, DeleteSessionResponse, ForkSessionResponse, Implementation,
                        InitializeResponse, ListSessionsResponse, LoadSessionResponse, McpCapabilities,
                        NewSessionResponse, PromptCapabilities, PromptResponse, ResumeSessionResponse,
                        SessionAdditionalDirectoriesCapabilities, SessionCapabilities, SessionCloseCapabilities,
                        SessionConfigOptionSelect, SessionConfigSelectOption, SessionDeleteCapabilities,
                        SessionForkCapabilities, SessionInfo, SessionListCapabilities, SessionMode, SessionModeState,
                        SessionResumeCapabilities, SetSessionConfigOptionResponse, SetSessionModeResponse, Usage,
                        UsageUpdate)

from .. import codecache
from ..service.rounds import REPEAT_LIMIT
from .port import AcpPort, Turn
from .reply import PLAN_REPLY_FORMAT, REPLY_FORMAT, ReplyText

log = logging.getLogger("operate_sidecar.server.acp")

#: rounds of one prompt turn (each a whole operate; another runs while the model calls tools)
MAX_ROUNDS = 8
#: the service's permission modes (``service.governance.MODES``) as the editor shows them
MODES = {"ask": ("Ask", "Ask before a file edit or an MCP tool that changes something "
                        "(the server's own tools follow its configuration)"),
         "auto-edit": ("Auto-edit", "Edit files in the workspace without asking; ask as in Ask mode for the rest"),
         "read-only": ("Read-only", "Only tools that change nothing; everything else is denied")}
#: what a prompt turn needs from the core, imported on a worker thread right after initialize
CORE_MODULES = ("operate_sidecar.server.core", "operate_sidecar.server.core.branch",
                "operate_sidecar.server.core.operate", "operate_sidecar.server.core.prepare",
                "operate_sidecar.server.core.tools", "operate_sidecar.server.models",
                "operate_sidecar.server.models.scripted", "operate_sidecar.server.service.service",
                "operate_sidecar.server.tools.builtin", "operate_sidecar.protocol", "json_schema_to_pydantic")


#: session metadata of older versions, in the state directory: imported once, then renamed
LEGACY_SESSIONS = "acp-sessions.json"
#: the session fields kept in the branch's info
INFO_FIELDS = ("cwd", "title", "model", "updatedAt")

#: ``session/list`` answers at most this many sessions, with a ``nextCursor`` when more follow
LIST_PAGE = 100
#: ``session/close`` waits this long for the session's cancelled turn to end
CLOSE_WAIT_S = 10.0
#: a turn whose request is cancelled (the input ended, the connection closes) has this long to
#: end and send its updates before the request's answer (less than ``run.EXIT_GRACE_S``, the
#: time the requests in flight at the input's end have to be answered)
WIND_UP_S = 1.5

#: messages of a history ``session/load`` replays between two yields to the event loop
REPLAY_SLICE = 200

#: a ``resource_link``'s text was cut where the ``read_file`` tool stops reading
LINK_CUT = "\n[cut here: the file goes on; the rest was not included]"


_LAST_MS = [0]


def _now() -> str:
    """An update time: ISO 8601 in UTC, to the millisecond, and later than any this process made
    before (two updates within one millisecond, or the wall clock stepped back, would otherwise
    tie or reorder the sessions' list)."""
    ms = max(time.time_ns() // 1_000_000, _LAST_MS[0] + 1)
    _LAST_MS[0] = ms
    when = datetime.fromtimestamp(ms // 1000, timezone.utc).replace(microsecond=ms % 1000 * 1000)
    return when.isoformat(timespec="milliseconds")


def _saved_at() -> dict[str, Any]:
    """A prompt turn's info, merged into the session's as the turn is saved (``Service.operate``
    calls it then, and only when the turn recorded something): its update time."""
    return {"updatedAt": _now()}


#: the update time of a session without a readable one: older than any (finite: a cursor holds it)
_OLDEST = -sys.float_info.max


def _when(updated_at: str | None) -> float:
    """An update time as a timestamp for ordering (any ISO 8601 precision; unreadable: oldest)."""
    try:
        when = datetime.fromisoformat(updated_at or "")
        return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    except (ValueError, TypeError, OverflowError):
        return _OLDEST


def _issue_cursor(key: tuple[float, str]) -> str:
    """``session/list``'s ``nextCursor``: where the page ended, in the list's order (opaque to
    the client). A page goes on after it even when that session was deleted meanwhile."""
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode()


def _invalid(message: str, data: dict[str, Any]) -> RequestError:
    """-32602 with what is wrong and what to do as its message (an editor shows the message;
    the SDK's ``RequestError.invalid_params`` says only "Invalid params"), ``data`` as before."""
    return RequestError(-32602, message, data)


def _cursor_key(cursor: str) -> tuple[float, str]:
    """The position a ``cursor`` of ours names; anything else is -32602."""
    try:
        when, sid = json.loads(base64.urlsafe_b64decode(cursor))
        if not isinstance(sid, str) or isinstance(when, bool) or not isinstance(when, (int, float)) \
                or not math.isfinite(when):  # (json reads NaN and Infinity; ours are finite numbers)
            raise ValueError(when, sid)
        return float(when), sid
    except Exception:
        raise _invalid(f"session/list: cursor {cursor!r} is not a cursor this agent gave (pass a nextCursor back as it came)",
                       {"cursor": cursor, "reason": "not a cursor this agent gave"}) from None


def _kind_of(m: Any) -> Any:
    """A stored message's kind, as a string (``instruction``, ``action_response``...)."""
    kind = getattr(m, "kind", None)
    return getattr(kind, "value", kind)


def _folder(path: str) -> str:
    """An absolute path as the folder it names: "/ws/", "/ws/." and "//ws" are "/ws" (``normpath``
    keeps two leading slashes, which POSIX leaves to the system; on Linux they are one)."""
    p = os.path.normpath(path)
    return "/" + p.lstrip("/") if p.startswith("//") else p


def _route_delete(conn: Any, agent: Any) -> bool:
    """Route ``session/delete`` to ``agent.delete_session`` on the SDK's connection ``conn``:
    the SDK's schema has the method (``DeleteSessionRequest``, ``sessionCapabilities.delete``),
    its router does not serve it (an SDK that does is left as it is). Whether it is served: it
    is advertised then only (``initialize``). The router is the SDK's private one: one laid
    out otherwise is not served the method."""
    router = getattr(getattr(conn, "_conn", None), "_handler", None)
    routes = getattr(router, "_requests", None)
    if not isinstance(routes, dict) or not callable(getattr(router, "route_request", None)):
        return False
    if "session/delete" not in routes:
        from acp.utils import normalize_result

        router.route_request("session/delete", DeleteSessionRequest, agent, "delete_session",
                             adapt_result=normalize_result)
    return True


class _Prompt:
    """A prompt of a session: cancelled by ``session/cancel``; its task once it runs."""

    __slots__ = ("cancelled", "deleted", "task")

    def __init__(self) -> None:
        self.cancelled = False  # a ``session/cancel`` came for it: answered ``cancelled`` (``_run_prompt``)
        self.deleted = False  # its session was deleted (``session/delete``): answered -32012
        self.task: asyncio.Task | None = None

    def cancel(self, deleted: bool = False) -> None:
        """``session/cancel`` (``deleted``: its session was deleted)."""
        self.cancelled = True
        self.deleted = self.deleted or deleted
        if self.task is not None:
            self.task.cancel()


#: the requests whose lists ACP's schema says to skip a bad item of (``mcpServers``,
#: ``additionalDirectories``: ``x-deserialize-skip-invalid-items``): the SDK drops it unseen
_SESSION_REQUESTS = frozenset({"session/new", "session/load", "session/resume", "session/fork"})
#: what the SDK dropped of the request being served (:func:`dropped_items`, set by
#: ``run.explain_invalid_params``): told to its session (``_add_mcp``), never lost without a word
DROPPED: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("acp_dropped", default=())


def dropped_items(method: str, params: Any) -> tuple[tuple[str, str], ...]:
    """(what, why) of each item of a session request's ``mcpServers`` and
    ``additionalDirectories`` that fails ACP's schema, which the SDK drops as the schema says
    (a server entry without its ``env``, say: it would never start, and nothing would say so)."""
    if method not in _SESSION_REQUESTS or type(params) is not dict:
        return ()
    out: list[tuple[str, str]] = []
    servers = params.get("mcpServers")
    if type(servers) is list and servers:
        from acp.schema import AcpMcpServer, HttpMcpServer, McpServerStdio, SseMcpServer
        from pydantic import ValidationError

        kinds: dict[Any, Any] = {"http": HttpMcpServer, "sse": SseMcpServer, "acp": AcpMcpServer}
        for i, item in enumerate(servers, 1):
            name = item.get("name") if type(item) is dict else None
            what = f"MCP server {name!r}" if isinstance(name, str) else f"MCP server #{i}"
            if type(item) is not dict:
                out.append((what, "its entry is not an object"))
                continue
            kind = item.get("type")
            if "type" in item and kind not in kinds and kind != "stdio":
                out.append((what, f"its type {json.dumps(kind)[:40]} is none that ACP names"))
                continue
            try:
                kinds.get(kind, McpServerStdio).model_validate(item)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(map(str, err.get("loc", ()))) or "entry"
                out.append((what, f"{where}: {err.get('msg', 'invalid')}"))
    folders = params.get("additionalDirectories")
    if type(folders) is list:
        out.extend((f"additionalDirectories item {i}", f"{json.dumps(f)[:40]} is not a path")
                   for i, f in enumerate(folders, 1) if not isinstance(f, str))
    return tuple(out)


class OperateAgent(Agent):
    """``acp.Agent`` over the service. ``settings`` are the validated flags + config file."""

    def __init__(self, settings: dict[str, Any], version: str = "0", debug: bool = False) -> None:
        self.settings = settings
        self.version = version
        self.debug = debug
        self.port = AcpPort(settings)
        self.port.branch_messages = self._messages
        self.port.cancel_turn = self._cancel_turn
        self.port.branch_folders = lambda sid: self.sidecar.branch_folders(sid) if self.sidecar is not None else None
        self.sidecar: Any = None
        self._imported: asyncio.Task | None = None  # the one-time import of ``LEGACY_SESSIONS``
        self._core: asyncio.Future | None = None   # the service, once the core is imported
        self._warm: asyncio.Future | None = None   # set once first-use paths are warmed
        self._live: set[asyncio.Task] = set()   # every turn (and background) task until it has finished
        self._prompts: dict[str, asyncio.Lock] = {}  # held by a session's prompt until it is answered
        self._current: dict[str, _Prompt] = {}  # the prompt holding a session's lock
        self._waiting: dict[str, _Prompt] = {}  # a prompt sent after its session's turn was cancelled
        #: per session, the last request whose effect depends on, or changes, whether the
        #: session is served here (``_in_order``): done once that effect is
        self._order: dict[str, asyncio.Future] = {}
        self._queued: dict[str, list[_Prompt]] = {}  # prompts waiting for their turn in ``_in_order``
        self._shutting: set[str] = set()        # sessions being closed (session/close)
        self._closed: set[str] = set()          # sessions closed here and not taken up again since
        self._closing = False                   # ``aclose`` has begun: start nothing more
        self._warned_models: set[str] = set()   # models whose problem (``model_problem``) was logged
        self._deletes = False                   # ``session/delete`` is served (``_route_delete``)

    def on_connect(self, conn: Any) -> None:
        from .run import explain_invalid_params

        self.port.client = conn
        self._deletes = _route_delete(conn, self)  # before the SDK's handler is wrapped
        explain_invalid_params(conn)  # a request the schema refuses: its message says why

    # ------------------------------------------------------------------ the core, loaded early
    def start_loading(self) -> None:
        """Right after the initialize answer is queued, on a worker thread: import the core and
        make the service, then warm every first-use path with a throwaway operate on a
        throwaway service, so that the first prompt costs what a warm one does."""
        if self._core is not None:
            return
        loop = asyncio.get_running_loop()
        self._core, self._warm = loop.create_future(), loop.create_future()

        def signal(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(_settle, fut, value, error)
            except RuntimeError:  # the loop is closed: the process is exiting
                pass

        def load() -> None:
            t0 = time.perf_counter()
            try:
                codecache.install()  # before protocol/'s attrs classes are defined
                for name in CORE_MODULES:
                    importlib.import_module(name)
                from operate_sidecar.server.rpc.stdio import bind_children_to_process
                from operate_sidecar.server.service.service import Service

                bind_children_to_process()  # the tools' children die with the sidecar
                sidecar = Service(self.port)
                sidecar.load_core()
                for fmt in (REPLY_FORMAT, PLAN_REPLY_FORMAT):  # constants: their cache keys are made once
                    sidecar.schemas.pin(fmt)
            except BaseException as e:  # pragma: no cover - broken install
                log.error("could not load the core: %s", e)
                gc.enable()
                signal(self._core, None, e)  # type: ignore[arg-type]
                signal(self._warm, None, None)  # type: ignore[arg-type]
                return
            log.info("core loaded in %.0f ms", (time.perf_counter() - t0) * 1000)
            signal(self._core, sidecar, None)  # type: ignore[arg-type]
            try:
                loop.call_soon_threadsafe(self._start_warm_up, sidecar)
            except RuntimeError:  # the loop is closed: the process is exiting
                return
            codecache.save_soon()  # what the core compiled (only when something was new)

        loop.run_in_executor(None, load)  # the loop's own worker thread: warm for the service's to_thread calls

    def _start_warm_up(self, sidecar: Any) -> None:
        """On the event loop, once the core is loaded: the warm-up, for an agent that has a
        connection and is not closing. Otherwise (an agent used in-process with no client, or
        one already closing) there is no first prompt to prepare, and a warm-up started now could
        outlive the loop: it is marked done without one."""
        if self.port.client is None or self._closing:
            _collector_on()
            _settle(self._warm, None, None)  # type: ignore[arg-type]
            return
        self._background(self._warm_up(sidecar))

    async def _warm_up(self, sidecar: Any) -> None:
        """On the event loop (the thread, and so the core, that serves the prompts): a few
        throwaway prompt turns over the whole path (``warm_up``); then the collector runs again."""
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(warm_up(sidecar), WARM_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.debug("warm-up failed", exc_info=True)
        finally:
            _collector_on()
            _settle(self._warm, None, None)  # type: ignore[arg-type]
        log.info("warmed in %.0f ms", (time.perf_counter() - t0) * 1000)

    async def _ready(self, warm: bool = False) -> Any:
        if self._core is None:
            self.start_loading()
        self.sidecar = await asyncio.shield(self._core)  # type: ignore[arg-type]
        if warm:
            await asyncio.shield(self._warm)  # type: ignore[arg-type]
        return self.sidecar

    def _messages(self, sid: str) -> Any:
        return self.sidecar.messages_of(sid) if self.sidecar is not None else ()

    async def _restored(self) -> Any:
        """The service with the stored branches restored (and other processes' commits taken
        in), and an older version's session file imported (once)."""
        sc = await self._ready()
        try:
            await sc.restore()
        except Exception as e:
            raise self._error(e) from None
        if self._imported is None:
            self._imported = asyncio.get_running_loop().create_task(self._import_legacy(sc))
            self._live.add(self._imported)  # stopped by ``aclose`` like a turn
            self._imported.add_done_callback(self._live.discard)
        await asyncio.shield(self._imported)
        return sc

    async def _branch(self, session_id: str) -> Any:
        sc = await self._restored()
        from operate_sidecar.server.service.errors import RpcError

        try:
            return sc.branch(session_id)
        except RpcError:
            raise _invalid(f"unknown session {session_id!r} (session/list lists the stored ones)",
                           {"sessionId": session_id, "reason": "unknown session"}) from None

    async def _import_legacy(self, sc: Any) -> None:
        """Import ``acp-sessions.json`` (written by older versions) into the branches' info and
        permission modes, then rename it so it is read once. Sessions whose branch is gone, or
        that have info already (another process imported them), are skipped; when a save
        fails the file stays, to be imported at the next start."""
        state_dir = self.settings.get("stateDir")
        if not state_dir:
            return
        path = os.path.join(state_dir, LEGACY_SESSIONS)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("ACP session metadata at %s unreadable (%s); not imported", path, e)
            return
        try:
            kept = await self._import_sessions(sc, data)
        except Exception:  # never in the way of the request that triggered it
            log.exception("ACP session metadata at %s not imported", path)
            return
        if kept:
            try:
                os.replace(path, path + ".imported")
            except OSError:
                pass  # another process imported it meanwhile

    async def _import_sessions(self, sc: Any, data: Any) -> bool:
        """The sessions of an old ``acp-sessions.json``; False when one could not be saved."""
        from operate_sidecar.server.service.errors import RpcError

        kept = True
        for sid, meta in (data.items() if isinstance(data, dict) else ()):
            if not isinstance(meta, dict):
                continue
            try:
                sc.branch(sid)
            except RpcError:
                continue  # the branch was deleted
            if sc.branch_info(sid):
                continue
            info = {k: meta[k] for k in INFO_FIELDS if isinstance(meta.get(k), str)}
            mode = meta.get("mode") if meta.get("mode") in MODES and meta.get("mode") != "ask" else None
            try:
                await sc.set_branch_info(sid, info, mode=mode)
            except Exception as e:
                kept = False
                log.warning("ACP session %s not imported: %s", sid, e)
        return kept

    def _error(self, e: BaseException) -> RequestError:
        """A service error as an ACP error: the same code, message and data; a bound of the
        settings that is reached says what an ACP client can do about it (``_remedies``)."""
        from operate_sidecar.server.service.errors import map_exception

        code, message, data = map_exception(e, self.debug, self._remedies())
        return RequestError(code, message, data)

    def _remedies(self) -> dict[str, str]:
        """What an ACP client can do when a bound of the settings is reached, by the setting
        (``service.errors.LimitReached``; raising the setting is said after it). Deleting a session
        is said only when ``session/delete`` is served: else, at ``maxBranches``, raising the
        setting is all a client can do (no ACP method removes a session)."""
        if not self._deletes:
            return {"maxMessagesPerBranch": "start a new session (session/new)"}
        return {"maxBranches": "delete sessions you no longer need (session/delete)",
                "maxMessagesPerBranch": "start a new session (session/new), delete this one (session/delete)"}

    # ------------------------------------------------------------------ initialize
    async def initialize(self, protocol_version: int, client_capabilities: Any = None, client_info: Any = None,
                         **kw: Any) -> InitializeResponse:
        fs = getattr(client_capabilities, "fs", None)
        if isinstance(fs, dict):  # (the SDK puts its default's JSON in place of an fs it cannot read)
            read, write = fs.get("readTextFile"), fs.get("writeTextFile")
        else:
            read, write = getattr(fs, "read_text_file", False), getattr(fs, "write_text_file", False)
        # the latest initialize's capabilities rule: a client that says so no more is read no more
        served = read is True and write is True
        if served != bool(self.port.client_capabilities.get("fs")):
            if served:
                self.port.client_capabilities["fs"] = True
            else:
                self.port.client_capabilities.pop("fs", None)
            if self.sidecar is not None:  # the builtin file tools already made read through the new way
                self.sidecar.workspace_changed()
        self.start_loading()
        return InitializeResponse(
            protocol_version=PROTOCOL_VERSION,
            agent_capabilities=AgentCapabilities(
                load_session=True,
                prompt_capabilities=PromptCapabilities(image=False, audio=False, embedded_context=True),
                mcp_capabilities=McpCapabilities(http=False, sse=False),
                session_capabilities=SessionCapabilities(list=SessionListCapabilities(),
                                                         resume=SessionResumeCapabilities(),
                                                         close=SessionCloseCapabilities(),
                                                         fork=SessionForkCapabilities(),
                                                         # a session's folders: its cwd and these
                                                         additional_directories=SessionAdditionalDirectoriesCapabilities(),
                                                         **({"delete": SessionDeleteCapabilities()}
                                                            if self._deletes else {}))),
            agent_info=Implementation(name="operate-sidecar", title="operate-sidecar", version=self.version),
            auth_methods=[])

    async def authenticate(self, method_id: str, **kw: Any) -> None:
        raise _invalid(f"authentication method {method_id!r}: this agent has none and needs none",
                       {"methodId": method_id, "reason": "no authentication methods"})

    # ------------------------------------------------------------------ sessions
    @contextlib.asynccontextmanager
    async def _in_order(self, session_id: str) -> Any:
        """The requests on a session whose effect depends on, or changes, whether it is served
        here (``session/prompt``'s checks, ``session/load``, ``session/resume``,
        ``session/close``, ``session/delete``, ``session/set_config_option``,
        ``session/set_mode``, ``session/fork``) take effect in the order they were read from the
        wire: the SDK serves every request at once, each on a task of its own, so a prompt sent
        right after a load, without waiting for its answer, was checked while the load was still
        under way, and a close that waited for its turn freed the session after a load read
        after it. Entered on the request's first step (the SDK starts its tasks in the order it
        read their lines), this waits for the session's request read before, until it leaves (a
        prompt leaves once it has been checked and has its place, before its turn runs; a fork
        once the fork is made, before the new session is set up; a close or delete once it is
        done, which waits up to ``CLOSE_WAIT_S`` for the turn it ends, so a request read after
        it waits that long too). Other sessions are not held up, nor is ``session/cancel``. A
        request cancelled while it waits (the input ended) lets the next one go only once the
        one before it has left."""
        before = self._order.get(session_id)
        mine = asyncio.get_running_loop().create_future()
        self._order[session_id] = mine

        def done(_: Any = None) -> None:
            if not mine.done():
                mine.set_result(None)
            if self._order.get(session_id) is mine:
                del self._order[session_id]

        try:
            if before is not None and not before.done():
                await asyncio.wait({before})  # (cancelled here, ``before`` is not)
            yield
        finally:
            if before is not None and not before.done():
                before.add_done_callback(done)
            else:
                done()

    async def new_session(self, cwd: str, additional_directories: Any = None, mcp_servers: Any = None,
                          **kw: Any) -> NewSessionResponse:
        sc = await self._restored()
        # a session whose model cannot run, when no other can: that error, before anything is made
        # (when another can, the session is made and its Model option shows the problem)
        default = self.settings["defaultModel"]
        found = self._unrunnable(default)
        if found is not None and not found[1]:
            log.warning("%s", found[0])
            raise self._model_error(default, found)
        folders = self._add_folders(cwd, additional_directories)
        try:  # the session's info is saved with the new branch, in one transaction
            sid = (await sc.createBranch({}, info={"cwd": cwd, "updatedAt": _now()},
                                         prime_first=False))["branchId"]  # primed below, for its turns
        except RequestError:
            raise
        except Exception as e:
            raise self._error(e) from None
        sc.set_branch_folders(sid, folders)  # its tools reach its folders, not another session's
        await self._add_mcp(sid, mcp_servers)
        # the first prompt must cost what a warm one does: finish the warm-up and build the tools now
        # that the folder is known (configured MCP servers start in the background; a prompt waits)
        # and what a turn builds on first use for this session's tools, reply format and model
        await self._ready(warm=True)
        await self._primed(sc, sid)
        return NewSessionResponse(session_id=sid, config_options=self._options(sid), modes=self._modes(sid))

    async def load_session(self, cwd: str, session_id: str, mcp_servers: Any = None,
                           additional_directories: Any = None, **kw: Any) -> LoadSessionResponse:
        async with self._in_order(session_id):
            b, was = await self._take_up(cwd, session_id, mcp_servers, additional_directories)
            await self._replay(session_id, b, was)
            await self.port.flush(session_id)  # every update of the session before the answer
            return LoadSessionResponse(config_options=self._options(session_id), modes=self._modes(session_id))

    async def resume_session(self, cwd: str, session_id: str, mcp_servers: Any = None,
                             additional_directories: Any = None, **kw: Any) -> ResumeSessionResponse:
        """``session/load`` without the history: the client shows what it kept."""
        async with self._in_order(session_id):
            await self._take_up(cwd, session_id, mcp_servers, additional_directories)  # (its history is not replayed)
            return ResumeSessionResponse(config_options=self._options(session_id), modes=self._modes(session_id))

    async def _take_up(self, cwd: str, session_id: str, mcp_servers: Any, additional_directories: Any) -> Any:
        """A stored session (one made by an earlier run, another server on the state directory,
        or closed) served again: its folders and MCP servers given, listed under ``cwd``. Returns
        its branch, and the folder it was listed under before (None: none)."""
        b = await self._branch(session_id)
        self.sidecar.set_branch_folders(session_id, self._add_folders(cwd, additional_directories))
        self._closed.discard(session_id)
        await self._add_mcp(session_id, mcp_servers)
        info = self.sidecar.branch_info(session_id)
        if info.get("cwd") != cwd:  # now listed under this folder (a branch made natively: listed from now on)
            await self._save(session_id, {"cwd": cwd} if info.get("updatedAt") else {"cwd": cwd, "updatedAt": _now()})
        was = info.get("cwd")
        return b, was if isinstance(was, str) and os.path.isabs(was) else None

    async def fork_session(self, session_id: str, cwd: str, additional_directories: Any = None,
                           mcp_servers: Any = None, **kw: Any) -> ForkSessionResponse:
        """A new session on a fork of the session's branch (its messages, as they were before a
        turn still running on it, its mode, policy and model; its title marked ``(fork)``), in
        ``cwd``; the source session goes on as it was. Only the fork itself takes its turn among
        the source's requests (``_in_order``): the new session's set-up (its MCP servers, its
        priming, slow on a first warm-up) does not hold up a request on the source read after it."""
        async with self._in_order(session_id):
            sc, sid = await self._fork(session_id, cwd, additional_directories)
        await self._add_mcp(sid, mcp_servers)
        await self._primed(sc, sid)
        return ForkSessionResponse(session_id=sid, config_options=self._options(sid), modes=self._modes(sid))

    async def _fork(self, session_id: str, cwd: str, additional_directories: Any) -> tuple[Any, str]:
        """The fork made (the only step that reads the source): the service and the new session."""
        await self._branch(session_id)
        sc = self.sidecar
        folders = self._add_folders(cwd, additional_directories)
        source = sc.branch_info(session_id)
        info = {k: v for k, v in source.items() if k == "model"}
        title = self._title(session_id, source)
        if title:  # the two are told apart in a list of sessions
            info["title"] = title + " (fork)"
        try:  # the fork's info is saved with it, in one transaction
            sid = (await sc.forkBranch({"branchId": session_id}, info={**info, "cwd": cwd, "updatedAt": _now()}))["branchId"]
        except Exception as e:
            raise self._error(e) from None
        sc.set_branch_folders(sid, folders)
        return sc, sid

    async def close_session(self, session_id: str, **kw: Any) -> CloseSessionResponse:
        """Cancel the session's turn (as ``session/cancel``) and wait for it to be answered, then
        free what serving it holds: its folders, the MCP servers only it passed (stopped before
        the answer). The session stays stored and listed; ``session/load`` or
        ``session/resume`` takes it up again (a prompt, or a change of its model or mode, before
        that is -32602: one read after the close waits for it to be done, ``_in_order``, so
        for up to ``CLOSE_WAIT_S`` when the cancelled turn does not end)."""
        async with self._in_order(session_id):
            return await self._close(session_id)

    async def _close(self, session_id: str) -> CloseSessionResponse:
        await self._branch(session_id)
        self._shutting.add(session_id)  # a prompt from here on is refused, as after the close
        try:
            self._cancel_turn(session_id)
            await self._end_turn(session_id, "closed")  # its answer (``cancelled``) goes out first
            self._closed.add(session_id)
            self.port.release(session_id)  # its outbox, once what it has queued is written
            await self.sidecar.release_branch(session_id)
        finally:
            self._shutting.discard(session_id)
        return CloseSessionResponse()

    async def delete_session(self, session_id: str, **kw: Any) -> DeleteSessionResponse:
        """``session/delete``: the session deleted from the store, and so from ``session/list``,
        as ``deleteBranch`` deletes its branch (docs/PROTOCOL.md §3, §13): on disk first (a delete
        that cannot be saved is -32013 and changes nothing), then a turn running on it ends as
        on ``session/cancel`` (its shown calls end ``failed``), nothing of it is kept, and its
        prompt, and one waiting for it, is answered -32012; the delete is answered once that
        prompt is (waited for ``CLOSE_WAIT_S`` at most, as by ``session/close``). The MCP
        servers only it passed stop. Takes its turn among the session's requests
        (``_in_order``): one read after it waits for it to be done (so for up to
        ``CLOSE_WAIT_S``), then meets an unknown session (-32602)."""
        async with self._in_order(session_id):
            sc = await self._restored()
            await self._branch(session_id)
            try:
                await sc.deleteBranch({"branchId": session_id})
            except Exception as e:
                raise self._error(e) from None
            self._cancel_turn(session_id, deleted=True)
            await self._end_turn(session_id, "deleted")  # its answer (-32012) goes out first
            self._closed.discard(session_id)
            self.port.forget_session(session_id)
        return DeleteSessionResponse()

    async def _end_turn(self, session_id: str, what: str) -> None:
        """Wait for the session's cancelled turn, and the prompt waiting for it, to be answered
        (``CLOSE_WAIT_S`` at most: a warning then, and the session is ``what``, closed or
        deleted, without it); then the session has no turn lock here."""
        lock = self._prompts.get(session_id)
        if lock is not None and lock.locked():
            try:
                await asyncio.wait_for(lock.acquire(), CLOSE_WAIT_S)
                lock.release()
            except asyncio.TimeoutError:
                log.warning("session %s: its cancelled turn did not end within %.0f s; %s without it",
                            session_id, CLOSE_WAIT_S, what)
        self._prompts.pop(session_id, None)

    async def list_sessions(self, cwd: str | None = None, cursor: str | None = None, additional_directories: Any = None,
                            **kw: Any) -> ListSessionsResponse:
        if cwd is not None:
            if not os.path.isabs(cwd):
                raise _invalid(f"session/list: cwd {cwd!r} must be an absolute path",
                               {"cwd": cwd, "reason": "must be an absolute path"})
            cwd = _folder(cwd)  # "/ws/" and "/ws/." name the folder "/ws" is
        sc = await self._restored()
        try:
            branches = (await sc.listBranches({}))["branches"]
        except Exception as e:
            raise self._error(e) from None
        after = _cursor_key(cursor) if cursor is not None else None
        keyed = []
        for b in branches:
            info = sc.branch_info(b["branchId"])
            if not info:  # not a session (made natively)
                continue
            if cwd is not None and _folder(info.get("cwd") or "/") != cwd:
                continue
            key = (-_when(info.get("updatedAt")), b["branchId"])  # most recent first; ties by id, stably
            if after is None or key > after:
                keyed.append((key, info))
        keyed.sort(key=lambda k: k[0])
        page = keyed[:LIST_PAGE]  # (titles are made for the page's sessions only: a title reads messages)
        more = _issue_cursor(page[-1][0]) if len(keyed) > LIST_PAGE else None
        return ListSessionsResponse(sessions=[SessionInfo(session_id=sid, cwd=info.get("cwd") or "",
                                                          title=self._title(sid, info),
                                                          updated_at=info.get("updatedAt"))
                                              for (_, sid), info in page], next_cursor=more)

    def _title(self, sid: str, info: dict[str, Any]) -> str | None:
        """The session's title: the one in its info (a fork's; one an earlier version saved),
        else the first line of its first recorded prompt that has one (at most 80 characters).
        The messages are in the store's order, so the first prompt saved names the session
        whichever server ran it, and a prompt that recorded nothing (failed, cancelled before
        its reply) names nothing: a title saved with the turn was the one of whichever turn
        ended last, and a prompt that recorded nothing still set it."""
        title = info.get("title")
        if isinstance(title, str) and title:
            return title
        skip = _continuations()
        for m in self.sidecar.messages_of(sid):
            if _kind_of(m) != "instruction":
                continue
            text = (getattr(m, "content", None) or {}).get("instruction")
            if isinstance(text, str) and text not in skip:
                line = (text.strip().splitlines() or [""])[0][:80]
                if line:
                    return line
        return None

    async def _save(self, sid: str, info: dict[str, Any] | None = None, mode: str | None = None) -> None:
        """Save a change of the session's info or mode (durable before the answer; -32013 when not)."""
        try:
            await self.sidecar.set_branch_info(sid, info, mode=mode)
        except Exception as e:
            raise self._error(e) from None

    def _model(self, sid: str) -> str:
        """The session's model: the one picked, while it is configured; else the default."""
        model = self.sidecar.branch_info(sid).get("model")
        return model if model in self.settings["models"] else self.settings["defaultModel"]

    def _unrunnable(self, model: str) -> tuple[str, bool] | None:
        """Why ``model`` cannot run (``model_problem``: a stat, 4 bytes read) and whether another
        configured model can; None when it can run."""
        problem = model_problem(self.settings, model)
        if problem is None:
            return None
        return problem, any(model_problem(self.settings, n) is None for n in self.settings["models"])

    def _model_failed(self, e: BaseException, model: str) -> RequestError:
        """A prompt turn's model error (-32011) as the editor gets it: its message (a ``local``
        model file that would not load: with the way out, and another model in the session's
        Model option), and ``data.model``, the model, as when its file is missing."""
        from operate_sidecar.server.service.errors import map_exception

        code, message, data = map_exception(e, self.debug)
        if getattr(e, "model_file", None) and len(self.settings["models"]) > 1:
            message += "; or pick another model in the session's Model option"
        return RequestError(code, message, {**(data if isinstance(data, dict) else {}), "model": model})

    @staticmethod
    def _model_error(model: str, found: tuple[str, bool]) -> RequestError:
        """The error (-32011) a turn on ``model`` would meet in its model call (``found``: what
        ``_unrunnable`` said of it), with the way out."""
        from operate_sidecar.protocol.errors import MODEL_ERROR

        problem, other = found
        message = f"{problem}; or pick another model in the session's Model option" if other \
            else f"no configured model can run: {problem}"
        return RequestError(MODEL_ERROR, message, {"model": model})

    def _options(self, sid: str) -> list[SessionConfigOptionSelect]:
        from operate_sidecar.server.models.config import describe as describe_model

        models = self.settings["models"]
        current = self._model(sid)
        found = {n: _model_problem(self.settings, n) for n in models}
        problems = {n: f[0] if f else None for n, f in found.items()}
        if problems[current] and current not in self._warned_models:  # once per model: on stderr too
            self._warned_models.add(current)
            log.warning("%s; a session can pick another model (session/set_config_option \"model\")",
                        problems[current])
        return [
            SessionConfigOptionSelect(type="select", id="model", name="Model", category="model",
                                      current_value=current,
                                      description=problems[current] or describe_model(models[current]),
                                      options=[SessionConfigSelectOption(
                                          value=n, name=f"{n} ({found[n][1]})" if found[n] else n,
                                          description=problems[n] or describe_model(c))
                                          for n, c in models.items()]),
            SessionConfigOptionSelect(type="select", id="mode", name="Permissions", category="mode",
                                      current_value=self.sidecar.permission_mode(sid),
                                      options=[SessionConfigSelectOption(value=k, name=v[0], description=v[1])
                                               for k, v in MODES.items()]),
        ]

    def _modes(self, sid: str) -> SessionModeState:
        return SessionModeState(current_mode_id=self.sidecar.permission_mode(sid),
                                available_modes=[SessionMode(id=k, name=v[0], description=v[1])
                                                 for k, v in MODES.items()])

    async def set_config_option(self, config_id: str, session_id: str, value: Any,
                                **kw: Any) -> SetSessionConfigOptionResponse:
        async with self._in_order(session_id):
            await self._set_option(config_id, session_id, value)
            if config_id == "mode":  # the mode is also the session's ACP mode: a client's mode selector follows
                self.port.send(session_id, CurrentModeUpdate(session_update="current_mode_update",
                                                             current_mode_id=value))
                await self.port.flush(session_id)
            return SetSessionConfigOptionResponse(config_options=self._options(session_id))

    async def set_session_mode(self, mode_id: str, session_id: str, **kw: Any) -> SetSessionModeResponse:
        async with self._in_order(session_id):
            await self._set_option("mode", session_id, mode_id)
            # the mode is also a config option: a client's option selectors follow
            self.port.send(session_id, ConfigOptionUpdate(session_update="config_option_update",
                                                          config_options=self._options(session_id)))
            await self.port.flush(session_id)
            return SetSessionModeResponse()

    async def _set_option(self, config_id: str, session_id: str, value: Any) -> None:
        """The session's ``model`` or ``mode`` (-32602 for another option or value). A model that
        cannot run (``_unrunnable``: its ``local`` model file is missing, empty or not a GGUF) is
        refused at once with the error a prompt on it would meet, and the session keeps its
        model. A session closed here (``session/close``) is -32602 until it is loaded or resumed
        again, as a prompt on it is: it is not served, and its updates would name a session the
        client let go. (One this process never took up, made by an earlier run or another server
        on the state directory, is not closed: its options can be set, and the other servers see
        them.)"""
        await self._branch(session_id)
        if session_id in self._closed or session_id in self._shutting:
            raise self._not_loaded(session_id)
        if config_id == "model" and value in self.settings["models"]:
            found = self._unrunnable(value)
            if found is not None:  # said before anything is saved
                raise self._model_error(value, found)
            await self._save(session_id, {"model": value})
        elif config_id == "mode" and value in MODES:
            await self._save(session_id, mode=value)  # the service applies it from the next tool call
        else:
            allowed = list(self.settings["models"]) if config_id == "model" else list(MODES)
            known = config_id in ("model", "mode")
            shown = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
            message = f"{shown} is not a {config_id} option: one of {', '.join(allowed)}" if known \
                else f"unknown config option {config_id!r}: this agent has model and mode"
            raise _invalid(message, {"configId": config_id, "value": value,
                                     "reason": f"one of {', '.join(allowed)}" if known else "unknown option"})

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._live.add(task)
        task.add_done_callback(self._live.discard)

    # ------------------------------------------------------------------ folders and MCP servers
    def _add_folders(self, cwd: str, more: Any = None) -> list[str]:
        """A session's folders (its ``cwd`` first), checked; the builtin tools exist once there
        is a folder (each operate is confined to its session's: ``Service.set_branch_folders``)."""
        added = False
        folders = [cwd, *(more or [])]
        for folder in folders:  # every one checked before any is added
            why = _not_a_folder(folder)
            if why is not None:
                name = "cwd" if folder is cwd else "additionalDirectories"
                raise _invalid(f"{name} {folder!r} {why}", {name: folder, "reason": "must be an absolute directory"})
        for folder in folders:
            if folder not in self.port.workspace_folders:
                self.port.workspace_folders.append(folder)
                added = True
        if added and self.sidecar is not None:  # the builtin tools cover the new folders
            self.sidecar.workspace_changed()
        return folders

    async def _add_mcp(self, sid: str, servers: Any) -> None:
        """The client MCP servers a session passed (``session/new``, ``session/load``): stdio
        ones become the session's own tool sources (``Service.add_branch_mcp_servers``: started
        in the background, shared or renamed there; a prompt waits for them, ``session/new``
        does not); http and sse ones are not advertised, and are ignored with a warning. What
        the SDK dropped of the request (:data:`DROPPED`) is told to the session too."""
        for what, why in DROPPED.get():
            log.warning("session %s: %s ignored: it does not fit ACP's schema (%s)", sid, what, why)
            self.port.tell(sid, 2, f"{what} ignored: its entry does not fit ACP's schema ({why})")
        stdio = []
        for s in servers or ():
            command = getattr(s, "command", None)
            if not isinstance(command, str):  # http / sse: not advertised
                log.warning("MCP server %r ignored: only stdio servers are supported", getattr(s, "name", "?"))
                self.port.tell(sid, 2, f"MCP server {getattr(s, 'name', '?')!r} ignored: this agent runs stdio MCP "
                                       "servers only (an http or sse one is not connected)")
                continue
            stdio.append((s.name, {"command": [command, *(s.args or [])], "env": {e.name: e.value for e in s.env or ()}}))
        await self.sidecar.add_branch_mcp_servers(sid, stdio)

    # ------------------------------------------------------------------ prompt turns
    async def prompt(self, prompt: list, session_id: str, **kw: Any) -> PromptResponse:
        """One prompt turn at a time per session. A prompt sent while the session's turn runs is
        refused, unless that turn was cancelled and not answered yet: it then starts once that
        answer is sent (CodeCompanion does not wait for it); a second such prompt is refused
        unless the first was cancelled too. ``session/cancel`` stops the prompt at whatever it
        does (reading a linked file from the client, the model, a tool) and a waiting one. Its
        checks take their turn among the session's requests (``_in_order``): a prompt sent right
        after a ``session/load`` or ``session/resume``, without waiting for its answer, is
        checked once the session is taken up; one read after a ``session/close`` is refused."""
        me = _Prompt()
        queued = self._queued.setdefault(session_id, [])
        queued.append(me)  # until it has its place: a ``session/cancel`` read meanwhile cancels it
        try:
            async with self._in_order(session_id):
                lock = await self._place(me, session_id)
        finally:
            queued.remove(me)
            if not queued and self._queued.get(session_id) is queued:
                del self._queued[session_id]
        if lock is None:
            return PromptResponse(stop_reason="cancelled")
        try:
            async with lock:
                if self._waiting.get(session_id) is me:
                    del self._waiting[session_id]
                if me.deleted:
                    raise self._deleted(session_id)
                if me.cancelled or session_id in self._shutting:
                    return PromptResponse(stop_reason="cancelled")
                self._current[session_id] = me
                try:
                    return await self._run_prompt(me, prompt, session_id)
                finally:
                    del self._current[session_id]
        finally:
            if self._waiting.get(session_id) is me:  # (the connection closed while it waited)
                del self._waiting[session_id]

    async def _place(self, me: "_Prompt", session_id: str) -> asyncio.Lock | None:
        """The prompt ``me`` checked, in its turn among the session's requests: the session must
        be served here (taken up by this process, and not closed since), and no turn of it may
        run unless that turn was cancelled (``me`` then waits for it: ``_waiting``). The
        session's turn lock, which ``me`` takes to run; None when ``me`` was cancelled while it
        waited for its turn."""
        if session_id in self._shutting or session_id in self._closed or self.sidecar is None \
                or self.sidecar.branch_folders(session_id) is None:
            # a session this process has not taken up (made by an earlier run or another server
            # on the state directory), or closed here: it has no folders here, and its tools would
            # reach every session's; ACP has it loaded first, which gives them
            await self._branch(session_id)  # (an unknown session is said to be one)
            raise self._not_loaded(session_id)
        if me.cancelled:
            return None
        lock = self._prompts.setdefault(session_id, asyncio.Lock())
        if lock.locked():
            current, waiting = self._current.get(session_id), self._waiting.get(session_id)
            if not (current is None or current.cancelled) or (waiting is not None and not waiting.cancelled):
                raise _invalid(f"session {session_id!r}: a prompt turn is already running (wait for its answer, or "
                               "session/cancel it first)",
                               {"sessionId": session_id, "reason": "a prompt turn is already running"})
            self._waiting[session_id] = me
        return lock

    async def _run_prompt(self, me: "_Prompt", prompt: list, session_id: str) -> PromptResponse:
        """The prompt ``me`` as a task that ``session/cancel`` cancels; its answer."""
        me.task = task = asyncio.get_running_loop().create_task(self._prompt(prompt, session_id))
        self._live.add(task)
        task.add_done_callback(self._live.discard)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the input ended (answered -32800) or the connection closes: stop the turn
            task.cancel()
            await self._wind_up(task, session_id)
            raise
        finally:
            self.port.turns.pop(session_id, None)
        self.port.end_calls(session_id)
        await self.port.flush(session_id)  # every update of the turn before its answer, an error answer too
        if me.deleted:
            raise self._deleted(session_id)
        exc = None if task.cancelled() else task.exception()
        if task.cancelled() or me.cancelled:
            # a ``session/cancel`` came for the turn: ``cancelled``, as ACP says a cancelled prompt
            # MUST be answered, also when it came too late to stop anything (once the turn's save
            # had begun, its rounds all over: the turn was saved whole, its updates all sent, and
            # ``session/load`` replays it, docs/PROTOCOL.md §13), and whatever the turn's error
            # (a save that failed then kept nothing of it)
            return PromptResponse(stop_reason="cancelled")
        if exc is not None:
            if isinstance(exc, RequestError):
                raise exc
            error = self._error(exc)
            from operate_sidecar.protocol.errors import BRANCH_NOT_FOUND

            if error.code == BRANCH_NOT_FOUND:  # its branch was deleted as it ran (here, or by another server)
                raise self._deleted(session_id) from None
            raise error from None
        return task.result()

    async def _wind_up(self, task: asyncio.Task, session_id: str) -> None:
        """The turn ``task``, cancelled with its request (the input ended: the request is answered
        -32800; or the connection closes), ends as a cancelled turn does before its answer: its
        updates, and the ``failed`` of each call the editor was shown that has no final status,
        go out first. Bounded (``WIND_UP_S``): a tool that does not stop, or a client that does
        not read, holds up neither the answer nor the exit."""
        loop = asyncio.get_running_loop()
        until = loop.time() + WIND_UP_S
        await asyncio.wait({task}, timeout=WIND_UP_S)
        self.port.end_calls(session_id)
        try:
            await asyncio.wait_for(self.port.flush(session_id), max(0.0, until - loop.time()))
        except asyncio.TimeoutError:
            log.debug("session %s: the cancelled turn's updates were not all sent before its answer", session_id)

    @staticmethod
    def _deleted(session_id: str) -> RequestError:
        """-32012 for a prompt whose session was deleted while its turn ran or waited to run."""
        from operate_sidecar.protocol.errors import BRANCH_NOT_FOUND

        return RequestError(BRANCH_NOT_FOUND, f"session {session_id!r} was deleted before or during its turn: "
                                              "nothing of the turn is kept", {"sessionId": session_id,
                                                                   "reason": "the session was deleted"})

    @staticmethod
    def _not_loaded(session_id: str) -> RequestError:
        return _invalid(f"session {session_id!r} is not loaded here: session/load or session/resume it first",
                        {"sessionId": session_id, "reason": "the session is not loaded: session/load it first"})

    async def _prompt(self, prompt: list, session_id: str) -> PromptResponse:
        """The prompt turn: checks, linked files read, then the operate (``_turn``)."""
        b = await self._branch(session_id)
        if self.sidecar.branch_folders(session_id) is None:  # (``_place`` checked it; never its tools unconfined)
            raise self._not_loaded(session_id)
        instruction, context = _prompt_parts(prompt)
        model = self._model(session_id)
        found = self._unrunnable(model)
        if found is not None:  # said before anything is recorded
            raise self._model_error(model, found)
        if context:  # a file a link names reaches the model with its text
            context = [await self._link(session_id, c) if "name" in c else c for c in context]
        # the update time goes with the turn's messages, taken as they are saved (a turn runs for
        # minutes: another turn saved meanwhile is older), and only when the turn recorded some
        return await self._turn(b, instruction, context, _saved_at)

    async def cancel(self, session_id: str, **kw: Any) -> None:
        """The session's turn, the prompt waiting for it and those read before this cancel that
        wait for their turn among the session's requests (``_in_order``)."""
        for p in self._queued.get(session_id, ()):
            p.cancel()
        self._cancel_turn(session_id)

    # ------------------------------------------------------------------ extensions (``_``-prefixed)
    # None is served: the ``acp.Agent`` protocol's stubs would answer every extension request
    # with ``result: null``, as if it had been done.
    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        raise RequestError.method_not_found(f"_{method}")

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None  # ignored, as JSON-RPC has a notification no one serves

    def _cancel_turn(self, session_id: str, deleted: bool = False) -> None:
        """Cancel the session's prompt, at whatever it does, and the one waiting for it (``deleted``:
        their session was deleted, so they are answered -32012)."""
        for p in (self._current.get(session_id), self._waiting.get(session_id)):
            if p is not None:
                p.cancel(deleted)

    # ------------------------------------------------------------------ resource links
    async def _link(self, sid: str, item: dict[str, Any]) -> dict[str, Any]:
        """A ``resource_link`` of a prompt as the model is given it: a file (a ``file:`` URI or a
        path, relative ones from the session's ``cwd``) with its text, read as the session's
        ``read_file`` tool reads it (its folders, the client's buffer, its bounds; ``LINK_CUT``
        after a text cut there); anything else, its address with a ``note`` why its text is
        not there. Never an error: the prompt goes on."""
        path = _link_path(item["resource"])
        if path is None:
            return {**item, "note": "not included: not a file"}
        try:
            res = await self.sidecar.read_for_user(sid, path)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the tool's error (outside the folders, missing, binary...)
            log.debug("linked file %s not read: %s", path, e)
            return {**item, "note": f"not included: {e}"}
        cut = res.get("truncated") or res.get("nextOffset") is not None
        return {**item, "text": str(res.get("content", "")) + (LINK_CUT if cut else "")}

    def _params(self, sid: str, instruction: str) -> dict[str, Any]:
        """A prompt turn's ``operate`` params (without its context and round bound)."""
        model = self._model(sid)
        params = {"branchId": sid, "instruction": instruction, "actions": True,
                  "responseFormat": reply_format(self.settings, model), "workDoneToken": sid, "chatModel": model}
        tools = self.sidecar.branch_tools(sid)
        if tools is not None:
            params["tools"] = tools
        return params

    async def _primed(self, sc: Any, sid: str) -> None:
        """A new session primed before its answer (``_prime``); with configured MCP servers, which
        may still be starting (a prompt waits for them), in the background instead."""
        if self.settings.get("mcpServers"):
            self._background(self._prime(sc, sid))
        else:
            await self._prime(sc, sid)

    async def _prime(self, sc: Any, sid: str) -> None:
        """The tools (configured MCP servers included), the session's model object (a provider
        is lazy: no weights, no connection yet) and what a turn on this session builds on first
        use (``Service.prime``). A failure is left to the prompt that meets it."""
        try:
            await sc.ensure_tools()
            await sc.prime(self._params(sid, ""))
        except Exception:  # a bad config is reported by the prompt that uses it
            log.debug("session not primed", exc_info=True)

    async def _turn(self, branch: Any, instruction: str, context: Any, info: Any) -> PromptResponse:
        sid = branch.id
        sc = await self._ready(warm=True)
        await sc.ensure_tools()
        await sc.branch_mcp_ready(sid)  # the session's MCP servers still starting
        turn = self.port.turns[sid] = Turn()
        if self.port.noticed.get(sid, 0) != self.port.notice_gen:  # a warning not told to this session yet
            notice = self.port.notices_for(sid, sc.branch_problems)  # its own, its MCP servers' too
            if notice:  # before the reply, never recorded (not the model's words)
                self.port.send(sid, update_agent_message_text(notice))
        limit = MAX_ROUNDS
        params = self._params(sid, instruction)
        if context:
            params["context"] = context
        from operate_sidecar.server.core.errors import ModelError, ModelRefused

        try:
            res = await sc.operate({**params, "maxRounds": limit}, info=info, repeat_limit=REPEAT_LIMIT)
        except ModelRefused as e:  # the model declined: its explanation is the turn's last words
            self.port.send(sid, update_agent_message_text(("\n\n" if turn.shown else "") + e.refusal))
            res, stop = {}, "refusal"
        except ModelError as e:
            if getattr(e, "stop_reason", None) != "max_tokens":
                raise self._model_failed(e, params["chatModel"]) from None
            # the reply was cut at the token limit: nothing of it was parsed, run or recorded (the
            # rounds before it were, as on a cancel); the editor is told so, and which setting to raise
            self.port.send(sid, update_agent_message_text(("\n\n" if turn.shown else "") + cut_notice(e)))
            res, stop = {}, "max_tokens"
        else:
            rounds = int(res.get("rounds") or 1)
            self.port.send_plan(sid, turn, res)
            self._round_text(sid, turn, res)
            stop = "max_turn_requests" if _ran_tools(res) and rounds >= limit else "end_turn"
            if res.get("repeated"):  # the same calls failed the same way REPEAT_LIMIT rounds in a row
                stop = "end_turn"  # (also when that was the last round allowed: it said why it stopped)
                self.port.send(sid, update_agent_message_text(("\n\n" if turn.shown else "") + repeat_notice(res)))
        usage: dict[str, Any] = {}
        _add_usage(usage, res.get("usage") or turn.usage)
        out = PromptResponse(stop_reason=stop)
        if usage:
            out.usage = Usage(input_tokens=usage.get("inputTokens", 0), output_tokens=usage.get("outputTokens", 0),
                              total_tokens=usage.get("inputTokens", 0) + usage.get("outputTokens", 0))
            size = sc.context_size(self._model(sid))
            if size and usage.get("contextTokens") is not None:
                self.port.send(sid, UsageUpdate(session_update="usage_update", used=usage["contextTokens"], size=size))
        return out

    def _round_text(self, sid: str, turn: Any, res: dict) -> None:
        """The round's user text when the stream showed none (a provider that does not stream)."""
        text = turn.text(turn.reply.rest(res))
        if text:
            self.port.send(sid, update_agent_message_text(text))
        turn.reply = ReplyText()

    # ------------------------------------------------------------------ load: replay history
    async def _replay(self, sid: str, branch: Any, was: str | None = None) -> None:
        """The session's history as the client was shown it live, through the live paths, from
        what the branch holds: each prompt (its text and resources), each reply's text and plan
        (a plan once per turn where it changed), each tool call (``AcpPort.replay_call``, where
        it was made: in ``was``, the folder the session was in), then the calls of a turn running
        on it that the client was shown and that have no outcome yet. ``REPLAY_SLICE`` messages
        at a time, yielding to the loop between slices and waiting while the client has not read
        what was queued (``AcpPort.room``): a history of 100,000 messages holds up no other
        request. The history and the running calls are taken as they are when it begins; the
        session's live updates made meanwhile follow the replay (``AcpPort.replaying``)."""
        from acp import update_user_message

        port = self.port
        send = port.send
        skip = _continuations()
        with port.replaying(sid):
            msgs = list(branch.messages)
            running = port.running_calls(sid, ())  # (those the history answers are left out below)
            responses: dict[Any, Any] = {}
            for i, m in enumerate(msgs, 1):
                if _kind_of(m) == "action_response":
                    c = getattr(m, "content", None) or {}
                    responses[c.get("callId")] = c
                if i % (REPLAY_SLICE * 10) == 0:
                    await asyncio.sleep(0)
            calls: dict[Any, tuple[Any, Any]] = {}
            turn = Turn()
            for i, m in enumerate(msgs, 1):
                if i % REPLAY_SLICE == 0:
                    await port.room(sid)
                kind, c = _kind_of(m), getattr(m, "content", None) or {}
                if kind == "instruction":
                    text = c.get("instruction")
                    if isinstance(text, str) and text in skip:  # a round of the same turn
                        continue
                    turn = Turn()
                    for block in _prompt_blocks(text, c.get("context")):
                        send(sid, update_user_message(block))
                elif kind == "assistant_response":
                    self._round_text(sid, turn, c.get("text") or "")
                    port.send_plan(sid, turn, c.get("text"))
                elif kind in ("action_request", "action_response"):
                    call_id = c.get("callId")
                    if call_id not in calls:
                        if call_id not in responses:  # never answered (the turn was stopped): not shown
                            continue
                        calls[call_id] = port.replay_call(sid, call_id, responses[call_id], was)
                        send(sid, calls[call_id][0])
                    if kind == "action_response":
                        send(sid, calls[call_id][1])
            for start in running:  # the running turn's calls (asked about, or running)
                if start.tool_call_id not in calls:
                    send(sid, start)

    # ------------------------------------------------------------------ shutdown
    async def aclose(self, timeout: float = 3.0) -> None:
        self._closing = True
        for task in list(self._live):
            task.cancel()
        if self._live:
            await asyncio.wait(list(self._live), timeout=timeout)
        if self.sidecar is not None:  # stops the MCP servers too
            try:
                await asyncio.wait_for(self.sidecar.aclose(), timeout)
            except asyncio.TimeoutError:  # an MCP server or a tool that does not stop: one line
                log.warning("the service did not close within %.0f s (an MCP server or a tool did not stop); "
                            "exiting without it", timeout)
            except BaseException as e:
                log.warning("the service did not close cleanly: %s", str(e) or type(e).__name__,
                            exc_info=self.debug)
        await self.port.aclose()


#: a resource's fields a prompt's context keeps (``_resource_fields``): ACP's name → the block's attribute
RESOURCE_FIELDS = {"title": "title", "description": "description", "mimeType": "mime_type", "size": "size"}
#: characters of a resource's ``title``, ``description`` or ``mimeType`` kept (the context is in
#: every later model call of the session); a longer one is cut, with "…"
RESOURCE_FIELD_LIMIT = 1000


def _resource_fields(obj: Any) -> dict[str, Any]:
    """The fields of a resource link or of an embedded resource's contents that a prompt's
    context keeps beside its address (``RESOURCE_FIELDS``), those it has, so that
    ``session/load`` shows the resource as it was sent (``_prompt_blocks``), and the model
    reads them too: a text at most ``RESOURCE_FIELD_LIMIT`` characters, a size that is a
    whole number."""
    out: dict[str, Any] = {}
    for key, attr in RESOURCE_FIELDS.items():
        value = getattr(obj, attr, None)
        if isinstance(value, str):
            out[key] = value if len(value) <= RESOURCE_FIELD_LIMIT else value[:RESOURCE_FIELD_LIMIT - 1] + "…"
        elif type(value) is int:
            out[key] = value
    return out


def _prompt_parts(prompt: list) -> tuple[str, Any]:
    """ACP content blocks → (instruction text, context). Text is the instruction; resource
    links (with their ``name``: ``OperateAgent._link`` adds the file's text) and embedded
    resources (a text one with its text) become context, with their title, description, MIME
    type and size when they have them (``_resource_fields``)."""
    texts: list[str] = []
    context: list[Any] = []
    for block in prompt:
        t = getattr(block, "type", None)
        if t == "text":
            texts.append(block.text)
        elif t == "resource_link":
            context.append({"resource": block.uri, "name": block.name, **_resource_fields(block)})
        elif t == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            context.append({"resource": res.uri, **({"text": text} if text is not None else {}),
                            **_resource_fields(res)})
        else:
            raise _invalid(f"content type {t!r} is not supported: this agent takes text, resource links and "
                           "embedded resources (initialize's promptCapabilities)",
                           {"prompt": f"content type {t!r} is not supported"})
    instruction = "\n".join(texts)
    if not context and not instruction.strip():  # no block, or only whitespace: nothing to ask the model
        raise _invalid("the prompt is empty (no content block, or text that is only whitespace): send some text "
                       "or a resource", {"prompt": "empty"})
    return instruction, context


def _not_a_folder(folder: Any) -> str | None:
    """Why ``folder`` cannot be a session's folder (None when it can)."""
    if not isinstance(folder, str) or not os.path.isabs(folder):
        return "must be an absolute path"
    if not os.path.exists(folder):
        return "does not exist"
    if not os.path.isdir(folder):
        return "is not a directory"
    return None


def _prompt_blocks(instruction: Any, context: Any) -> list[Any]:
    """A stored prompt (instruction, context) → the ACP content blocks ``_prompt_parts`` took it
    from: its text (none when it had none), then its resources (a link, as the user sent it,
    with its title, description, MIME type and size, without the file's text the model was
    given; an embedded text resource with its text and MIME type; an embedded blob, whose bytes
    are not kept, as a link with its MIME type)."""
    from acp import embedded_text_resource, resource_block, resource_link_block, text_block

    if instruction is not None and not isinstance(instruction, str):  # a branch made natively
        instruction = json.dumps(instruction, ensure_ascii=False, default=str)
    blocks = [text_block(instruction)] if instruction else []
    for item in context if isinstance(context, list) else ():
        uri = item.get("resource") if isinstance(item, dict) else None
        if not isinstance(uri, str):
            continue
        kept = {attr: item[key] for key, attr in RESOURCE_FIELDS.items()
                if type(item.get(key)) is (int if key == "size" else str)}  # (as ``_resource_fields`` keeps them)
        if isinstance(item.get("text"), str) and "name" not in item:  # a link has a name
            blocks.append(resource_block(embedded_text_resource(uri, item["text"], mime_type=kept.get("mime_type"))))
        else:
            name = item.get("name")
            blocks.append(resource_link_block(name if isinstance(name, str) else uri.rsplit("/", 1)[-1] or uri, uri,
                                              **kept))
    return blocks


def _link_path(uri: str) -> str | None:
    """The file a ``resource_link`` names: a local ``file:`` URI's path, or the link itself when
    it is a path; None for any other address."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(uri)
    if parts.scheme == "file" and parts.netloc in ("", "localhost") and parts.path:
        return unquote(parts.path)
    return uri if not parts.scheme and uri else None


def _responses(res: Any) -> list:
    """The action responses of an operate's result envelope (its last round's); [] for none."""
    r = res.get("result") if isinstance(res, dict) else None
    responses = r.get("action_responses") if isinstance(r, dict) else None
    return responses if isinstance(responses, list) else []


def repeat_notice(res: Any) -> str:
    """What the editor is shown when a turn stopped because the model kept making the same
    failed calls: which call and its error (the last round's first), and what to do."""
    responses = _responses(res)
    first = responses[0] if responses and isinstance(responses[0], dict) else {}
    output = first.get("output")
    error = output.get("error") if isinstance(output, dict) else None
    what = f" (`{first.get('function')}`: {str(error).splitlines()[0][:200].rstrip('.')})" if error else ""
    calls = "calls" if len(responses) > 1 else "call"
    return (f"> ⚠ **Stopped:** the model made the same failing tool {calls}{what} {REPEAT_LIMIT} rounds in a row, so "
            "another round would not help. Rephrase the request, or choose another model.\n\n")


def cut_notice(e: BaseException) -> str:
    """What the editor is shown when the turn's reply was cut at the model's token limit (the
    model error's ``fix``: which setting to raise, as the provider knows it)."""
    fix = getattr(e, "fix", None) or "A larger maxTokens in the model's config may let it finish."
    return (f"> ⚠ **Cut:** the model's reply reached its token limit before it was complete, so none of it was "
            f"used: nothing of it ran, and it is not kept in the session. {fix}\n\n")


def _ran_tools(res: Any) -> bool:
    """Whether the (last) round ran a tool: a response that is not a governance denial."""
    return any(not (isinstance(x, dict) and isinstance(x.get("output"), dict)
                    and x["output"].get("error") == "denied by governance gate") for x in _responses(res))


def _add_usage(total: dict, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    for k in ("inputTokens", "outputTokens", "modelCalls"):
        if isinstance(usage.get(k), int):
            total[k] = total.get(k, 0) + usage[k]
    if isinstance(usage.get("contextTokens"), int):
        total["contextTokens"] = usage["contextTokens"]


def _continuations() -> set[str]:
    """The instructions of the rounds after the first (not the user's words: not replayed)."""
    from operate_sidecar.server.service.rounds import CONTINUATION

    return {CONTINUATION}


def _collector_on() -> None:
    """What is loaded now lives as long as the process: keep the collector from walking it again
    (a full collection over the freshly imported core would land on the first prompt). The
    collector was off during start-up (``__main__``): it runs from here on."""
    gc.freeze()
    gc.enable()


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def model_problem(settings: dict[str, Any], model: str) -> str | None:
    """Why the configured ``model`` cannot run, as far as one stat and a file's first bytes
    tell, with the way out: the embedded ``local`` model's file is missing
    or is empty or not a GGUF file (llama.cpp would refuse it at the first prompt:
    ``config.local_model_problem``); no other provider is checked (None)."""
    found = _model_problem(settings, model)
    return None if found is None else found[0]


def _model_problem(settings: dict[str, Any], model: str) -> tuple[str, str] | None:
    """``model_problem`` and what the Model option marks the model with (``(model file
    missing)``, ``(model file unusable)``)."""
    config = settings["models"].get(model) or {}
    if config.get("provider") != "local":
        return None
    from operate_sidecar.server.models.config import local_model_problem

    found = local_model_problem(config)
    return None if found is None else (f"model {model!r}: {found[0]}", f"model file {found[1]}")


def reply_format(settings: dict[str, Any], model: str) -> dict[str, Any]:
    """A prompt turn's reply format for a configured model: with the optional ``plan`` for every
    provider but the embedded ``local`` one (a model that small never fills a plan in, and the
    extra field costs it speed and accuracy)."""
    provider = (settings["models"].get(model) or {}).get("provider")
    return REPLY_FORMAT if provider == "local" else PLAN_REPLY_FORMAT


#: prompts the warm-up sends through the wire: enough for the interpreter to specialize the path
WARM_PROMPTS = 8
#: of which the first ones run a tool round (the tool-call updates, the tool path); the rest
#: are replies only, the shape of most turns, and cheaper to repeat
WARM_TOOL_ROUNDS = 2
#: the warm-up is abandoned after this long (``session/new`` waits for it, then goes on)
WARM_TIMEOUT_S = 10.0


class _WarmAgent(OperateAgent):
    """The warm-up's agent: its own port and service, the real service's reply-format cache
    and the reply format the real default model gets."""

    def __init__(self, real: Any) -> None:
        from operate_sidecar.server.rpc import settings as S
        from operate_sidecar.server.service.service import Service

        tool_round = {"json": {"message": "warm", "action_requests": [{"function": "list_dir", "arguments": {}}]}}
        reply = {"json": {"message": "warm"}}
        replies = [tool_round, reply] * WARM_TOOL_ROUNDS + [reply] * (WARM_PROMPTS - WARM_TOOL_ROUNDS)
        super().__init__(S.finalize(S.merge(S.DEFAULTS, {"defaultModel": "warm", "models": {
            "warm": {"provider": "scripted", "responses": replies}}})))
        self.format = reply_format(real.settings, real.settings["defaultModel"])
        sc = Service(self.port)
        sc.schemas = real.schemas
        loop = asyncio.get_running_loop()
        self._core, self._warm = loop.create_future(), loop.create_future()
        self._core.set_result(sc)
        self._warm.set_result(None)

    def _params(self, sid: str, instruction: str) -> dict[str, Any]:
        return {**super()._params(sid, instruction), "responseFormat": self.format}


class _WarmClient:
    """The warm-up's client: takes every update, is asked nothing."""

    async def session_update(self, session_id: str, update: Any, **kw: Any) -> None:
        pass


async def warm_up(sidecar: Any) -> None:
    """Run once, as soon as the core is loaded, on the event loop that serves the client:
    prompt turns over the whole path a real one takes, so that the first real prompt costs
    what a warm one does. A throwaway agent (``_WarmAgent``, with a throwaway service sharing
    the real one's reply-format cache) is served by the SDK's own connection over a pair of
    pipes, framed and bounded as stdio is (``run._streams``, both ends), and the SDK's client
    side sends it ``initialize``, ``session/new`` and ``WARM_PROMPTS`` prompt turns (the first
    ``WARM_TOOL_ROUNDS`` with a tool round). The SDK's parsing, routing and serialization, this
    module, the port's updates and the pipeline all run (cattrs structuring code, pydantic
    schema and model builds, the reply format and its operative classes, the builtin tools'
    schemas), often enough for the interpreter to specialize them, on the thread that serves
    the real prompts. Every step awaits, so a request that arrives meanwhile is served between
    them. The workspace is this package's own folder, which the warm-up only lists: nothing is
    created on disk, so nothing is left behind when the process is stopped in the middle of
    it; nothing reaches the real client.

    Every pipe, transport and task it opens is closed on every way out, a cancellation at any of
    its awaits included (the warm-up's time-out, then the agent closing as the client goes, may
    cancel it twice): the pipes are opened, and everything closed, by tasks of their own
    (``_warm_pipes``, ``_warm_down``) that a cancellation of the warm-up does not interrupt; pipes
    whose opening outlived the warm-up are closed as soon as they are open (``_close_warm_pipes``).
    On the normal path those tasks are simply awaited: nothing is added but their creation."""
    import acp

    folder = os.path.dirname(os.path.abspath(__file__))
    opening = _uninterrupted(_warm_pipes())
    try:
        a_reader, a_writer, c_reader, c_writer = await asyncio.shield(opening)
    except BaseException:
        opening.add_done_callback(_close_warm_pipes)  # (at once if it is done already)
        raise
    agent = serve = conn = None
    try:
        agent = _WarmAgent(sidecar)
        serve = asyncio.get_running_loop().create_task(acp.run_agent(agent, a_writer, a_reader))
        conn = acp.connect_to_agent(_WarmClient(), c_writer, c_reader)
        await conn.initialize(protocol_version=PROTOCOL_VERSION)  # bounded as a whole (``WARM_TIMEOUT_S``)
        sid = (await conn.new_session(cwd=folder)).session_id
        for _ in range(WARM_PROMPTS):
            await conn.prompt(session_id=sid, prompt=[acp.text_block("warm")])
    finally:
        c_writer.close()  # EOF: the throwaway connection ends
        await asyncio.shield(_uninterrupted(_warm_down(a_writer, agent, serve, conn)))


#: the warm-up's tasks that its cancellation leaves running (``_uninterrupted``), held until done
_WARM_TASKS: set[asyncio.Task] = set()


def _uninterrupted(coro: Any) -> asyncio.Task:
    """``coro`` as a task of its own, held (``_WARM_TASKS``) until it is done: the warm-up awaits
    it through ``asyncio.shield``, so that a cancellation of the warm-up does not interrupt it."""
    task = asyncio.get_running_loop().create_task(coro)
    _WARM_TASKS.add(task)
    task.add_done_callback(_WARM_TASKS.discard)
    return task


async def _warm_pipes() -> tuple[Any, Any, Any, Any]:
    """The warm-up's two pipes as streams (``run._streams``): the agent's reader and writer,
    then the client side's. Not interrupted by the warm-up's cancellation (``_uninterrupted``): a
    cancellation inside ``run._streams`` would lose the writer it has made (a pipe left open
    until the collector finds it). Should it fail all the same (only a cancellation of every
    task, as the loop ends, can), what it still holds is closed: the descriptors not yet handed
    to ``run._streams``, and the agent's writer once the agent's streams are made."""
    from .run import _streams

    to_agent = os.pipe()
    try:
        to_client = os.pipe()
    except BaseException:
        _close_fds(*to_agent)
        raise
    try:
        a_reader, a_writer = await _streams(to_agent[0], to_client[1], 1 << 20)
    except BaseException:
        _close_fds(to_client[0], to_agent[1])  # (the other two are the transports': closed with them)
        raise
    try:
        c_reader, c_writer = await _streams(to_client[0], to_agent[1], 1 << 20)
    except BaseException:
        a_writer.close()
        raise
    return a_reader, a_writer, c_reader, c_writer


def _close_warm_pipes(opening: asyncio.Task) -> None:
    """The streams of a ``_warm_pipes`` that outlived its warm-up, closed once it is done: both
    writers, and so both readers at the end of their input (each transport then closes its
    pipe). An opening that failed closed what it had made."""
    if opening.cancelled() or opening.exception() is not None:
        return
    _, a_writer, _, c_writer = opening.result()
    c_writer.close()
    a_writer.close()


async def _warm_down(a_writer: Any, agent: Any, serve: Any, conn: Any) -> None:
    """The warm-up's way out, once the client side's writer is closed: the agent's connection
    ends at that EOF (waited for 5 s at most, then cancelled), then its writer is closed (EOF to
    the client side, every pipe closed), the agent (its service's tool threads) and the client
    side's connection. Not interrupted by the warm-up's cancellation (``_uninterrupted``); the
    writer is closed however it ends."""
    try:
        if serve is not None:
            try:
                await asyncio.wait_for(serve, 5)
            except Exception:  # (a warm-up cut short: the agent's connection ended as it could)
                log.debug("the warm-up's connection did not end cleanly", exc_info=True)
        a_writer.close()  # the SDK leaves its writer open
        if agent is not None:
            await agent.aclose()
        if conn is not None:
            await conn.close()
    finally:
        a_writer.close()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


__all__ = ["OperateAgent", "MAX_ROUNDS", "MODES", "warm_up"]
