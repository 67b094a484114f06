"""Test helpers for projects that use operate-sidecar: an asyncio client for the sidecar over
stdio, and :func:`run_session_script` to run a session script as a test.

The client is a pygls ``JsonRPCClient`` started through pytest-lsp's ``ClientServerConfig``
(the way pytest-lsp starts language servers), with what the sidecar's protocol needs on top
of it: plain-dict requests and results, every notification kept in arrival order and waitable
with a pattern, and answers to the server's requests (``requestToolPermission``,
``invokeClientTool``, ``fs/*``) from handlers or standing answers. The pytest fixture lives
in :mod:`operate_sidecar.pytest_plugin`.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import signal
import sys
import tempfile
from typing import Any, Awaitable, Callable

from pygls.client import JsonRPCClient
from pygls.exceptions import JsonRpcException
from pygls.io_ import run_async
from pygls.protocol import JsonRPCNotification, JsonRPCProtocol, JsonRPCRequestMessage, JsonRPCResponseMessage

from operate_sidecar.server.script.matcher import first_mismatch, notification_miss, short

__all__ = ["SidecarError", "SidecarExited", "HandlerFailed", "SidecarTestClient", "ScriptFailed", "run_session_script",
           "server_command"]

DEFAULT_TIMEOUT_S = 30.0


def server_command(*args: str) -> list[str]:
    """The command that starts this sidecar with this interpreter."""
    return [sys.executable, "-m", "operate_sidecar.server", *args]


#: the end of a time-out's message: how to give the call (or every call) longer
WAIT_LONGER = "to wait longer, pass timeout=S to this call, or give the client a longer timeout " \
              "(the sidecar marker's timeout=S)"

class SidecarError(Exception):
    """An error answer from the sidecar: ``code``, ``message``, ``data``."""

    def __init__(self, method: str, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{method} failed with {code}: {message}")
        self.method, self.code, self.message, self.data = method, code, message, data


class SidecarExited(RuntimeError):
    """The sidecar process exited (it crashed, was killed, or was told to exit) before a
    request was answered, a notification could be sent or an awaited notification came:
    ``method``, ``returncode`` (negative: killed by that signal; None when it was sent ``exit``
    and has not exited yet) and ``stderr`` (its last lines). The message says all three. Once
    the client has sent ``exit``, every later request and notification raises it at once: nothing
    sent after ``exit`` is served; a wait for a notification still gets what the sidecar sends as
    it exits (a cancelled operate's last ``$/progress``), and raises it once the sidecar's output
    has ended without a match."""

    def __init__(self, what: str, method: str, returncode: int | None, stderr: str, *,
                 told_to_exit: bool = False) -> None:
        self.method, self.returncode, self.stderr = method, returncode, stderr
        how = ("the sidecar was sent exit (it has not exited yet)" if told_to_exit and returncode is None
               else f"the sidecar exited ({_exit_status(returncode)})")
        super().__init__(f"{what}: {how}"
                         + (f"\nsidecar stderr (last lines):\n{stderr}" if stderr else "\nsidecar stderr: (nothing)"))


class HandlerFailed(AssertionError):
    """An ``on_request`` handler raised (anything but :class:`SidecarError`) or returned a value
    that is not JSON: the sidecar was answered -32603, and the test fails with this at teardown
    (its cause is the handler's exception)."""


def _json(value: Any, what: str | None = None) -> None:
    """Raise ``TypeError``/``ValueError`` when ``value`` is not a JSON value (pygls would log the
    error and send nothing: the other side would wait for a message that never comes)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        if what is None:
            raise
        raise type(e)(f"{what}: params are not JSON ({e})") from None


def _exit_status(returncode: int | None) -> str:
    if returncode is None:
        return "its input is closed; exit code not known yet"
    if returncode < 0:
        try:
            return f"code {returncode}, killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"code {returncode}, killed by signal {-returncode}"
    return f"code {returncode}"


def _converter() -> Any:
    """pygls's converter, except that params and results stay plain JSON values (pygls turns
    objects of methods it does not know into namedtuples)."""
    import attrs
    from lsprotocol import converters

    converter = converters.get_converter()

    def plain(obj: dict, cls: type) -> Any:
        return cls(**{f.name: obj.get(f.name) for f in attrs.fields(cls)})

    for cls in (JsonRPCRequestMessage, JsonRPCResponseMessage, JsonRPCNotification):
        converter.register_structure_hook(cls, plain)
    return converter


class _Protocol(JsonRPCProtocol):
    """pygls's JSON-RPC protocol, keeping every notification the server sends."""

    def _handle_notification(self, method_name: str, params: Any) -> None:
        client: SidecarTestClient = self._server  # type: ignore[assignment]
        client._notified(method_name, params)
        if method_name in self.fm.features:
            super()._handle_notification(method_name, params)


class SidecarTestClient(JsonRPCClient):
    """A client for one sidecar process. Use it from ``async`` tests::

        result = await client.request("createBranch", {"system": "..."})
        client.respond("requestToolPermission", {"decision": "allow_once"})
        note = await client.wait_for_notification("toolEvent", {"event": "post"})
    """

    def __init__(self) -> None:
        super().__init__(protocol_cls=_Protocol, converter_factory=_converter)
        self.notifications: list[tuple[str, Any]] = []      # every notification, in arrival order
        self.server_requests: list[tuple[str, Any]] = []    # every server-to-client request
        self._consumed: set[int] = set()
        self._changed: asyncio.Condition | None = None
        self._stderr = tempfile.TemporaryFile()
        self._stderr_kept = ""  # what the stderr file held when :meth:`stop` closed it
        self.timeout = DEFAULT_TIMEOUT_S
        self.initialize_result: Any = None                  # set by the pytest fixture
        self.handler_errors: list[tuple[str, BaseException]] = []  # (method, error) of failed handlers
        self._ids = itertools.count(1)  # request ids: a timed-out one is cancelled by its id
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it was started on: it reads there
        self._exit_sent = False  # this client sent exit: the sidecar serves nothing sent after it
        self._connection: asyncio.Task[Any] | None = None  # reads the sidecar's output to its end

    # ------------------------------------------------------------------ process
    async def start_io(self, cmd: str, *args: str, **kwargs: Any) -> None:
        """Start the server (pygls's ``start_io``, with the server's stderr kept in a file
        for failure reports instead of a pipe nobody reads)."""
        server = await asyncio.create_subprocess_exec(
            cmd, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=self._stderr, **kwargs)
        assert server.stdin is not None and server.stdout is not None
        self._loop = asyncio.get_running_loop()
        self.protocol.set_writer(server.stdin)
        connection = asyncio.create_task(run_async(stop_event=self._stop_event, reader=server.stdout,
                                                   protocol=self.protocol, logger=None,
                                                   error_handler=self.report_server_error))
        self._server, self._connection = server, connection
        self._async_tasks.extend([connection, asyncio.create_task(self._server_exit())])

    def _stderr_tail(self, lines: int = 20) -> str:
        try:
            text = self.stderr_text().rstrip()
        except (OSError, ValueError):
            return ""
        return "\n".join("  " + ln for ln in text.splitlines()[-lines:])

    def _check_loop(self, what: str) -> None:
        """Refuse a call from another event loop than the client's: the client reads the sidecar's
        answers on its own loop, so from another one every wait would last until its time-out."""
        __tracebackhide__ = True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a plain function): nothing is awaited here
            return
        if self._loop is not None and running is not self._loop:
            raise RuntimeError(
                f"{what}: the sidecar client was started on another event loop than this one, and reads the "
                "sidecar's answers only while its own loop runs; use it on one loop: an async fixture of yours "
                "that uses the sidecar fixture must run on the test's loop (its loop_scope, or "
                "asyncio_default_fixture_loop_scope, the same as the test's: asyncio_default_test_loop_scope "
                "or @pytest.mark.asyncio(loop_scope=...))")

    def _exited(self, what: str, method: str) -> SidecarExited:
        return SidecarExited(what, method, self.returncode, self._stderr_tail(), told_to_exit=self._exit_sent)

    async def _reaped(self, timeout: float = 5.0) -> None:
        """Wait (briefly) for the exit code of a sidecar that closed its input."""
        if self._server is not None and self._server.returncode is None:
            try:
                await asyncio.wait_for(self._server.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _gone(self) -> bool:
        """The sidecar has exited, closed its stdin, or was sent ``exit`` (it is exiting: nothing
        sent reaches it, or is served: a request after ``exit`` was answered -32800 as the sidecar
        cancelled it, or not at all, by chance)."""
        server = self._server
        if server is None:
            return False
        return (self._exit_sent or server.returncode is not None or server.stdin is None
                or server.stdin.is_closing())

    def stderr_text(self) -> str:
        """What the server wrote to stderr so far (after :meth:`stop`: all it wrote)."""
        if self._stderr.closed:
            return self._stderr_kept
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    @property
    def returncode(self) -> int | None:
        return None if self._server is None else self._server.returncode

    async def stop(self, timeout: float = 10.0) -> int | None:
        """``shutdown`` + ``exit`` when the server still runs; kills it if it does not exit in time."""
        server = self._server
        if server is not None and server.returncode is None and not self._exit_sent:
            try:
                await self.request("shutdown", None, timeout=timeout)
            except (SidecarError, TimeoutError, RuntimeError, OSError, ConnectionError):
                pass  # refused (not initialized, shut down already) or no answer: exit all the same
            try:
                self.notify("exit")
            except (RuntimeError, OSError, ConnectionError):
                pass
        if server is not None and server.returncode is None:
            try:
                await asyncio.wait_for(server.wait(), timeout)
            except asyncio.TimeoutError:
                server.kill()
                await server.wait()
        self._stop_event.set()
        for task in self._async_tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*self._async_tasks, return_exceptions=True)
        if not self._stderr.closed:  # its text kept, the file closed (an open one is a ResourceWarning)
            self._stderr_kept = self.stderr_text()
            self._stderr.close()
        return None if server is None else server.returncode

    # ------------------------------------------------------------------ client → server
    async def request(self, method: str, params: Any = None, *, timeout: float | None = None) -> Any:
        """Send a request; returns its result, raises :class:`SidecarError` for an error answer,
        :class:`SidecarExited` at once when the sidecar has exited or exits before answering,
        and ``TimeoutError`` when no answer comes in time. A request that times out, or whose
        awaiting task is cancelled (``task.cancel()``, an ``asyncio.wait_for`` around it), is
        cancelled on the sidecar with ``$/cancelRequest``."""
        __tracebackhide__ = True
        timeout = self.timeout if timeout is None else timeout
        params = {} if params is None else params
        _json(params, f"request {method}")
        self._check_loop(f"request {method}")
        if self._gone():
            await self._reaped()
            raise self._exited(f"request {method} not sent", method)
        msg_id = next(self._ids)
        try:
            fut = self.protocol.send_request_async(method, params, msg_id=msg_id)
            # shielded: a time-out must not cancel pygls's future, or the answer that comes later
            # fails to be set on it (a logged traceback); that answer is dropped, its error retrieved
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except JsonRpcException as e:
            if self._exit_sent and e.code == -32800:  # in flight when exit was sent: cancelled as the sidecar exits
                await self._reaped()
                raise self._exited(f"request {method} not answered", method) from None
            raise SidecarError(method, e.code, e.message, getattr(e, "data", None)) from None
        except asyncio.TimeoutError:
            self._cancel(msg_id)
            raise TimeoutError(f"no answer to {method} within {timeout:g} s; {WAIT_LONGER}") from None
        except asyncio.CancelledError:  # the test cancelled the task awaiting it (task.cancel(), wait_for)
            self._cancel(msg_id)
            raise
        except (RuntimeError, OSError):  # pygls fails the requests of a server that exited
            if self.returncode is None and not self._gone():
                raise
            await self._reaped()
            raise self._exited(f"request {method} not answered", method) from None

    def _cancel(self, msg_id: int) -> None:
        """``$/cancelRequest`` for a request nobody waits for any more: the sidecar stops working on
        it (its -32800 answer is dropped)."""
        if not self._gone():
            try:
                self.protocol.notify("$/cancelRequest", {"id": msg_id})
            except (RuntimeError, OSError, ConnectionError):  # it is going: nothing runs on it any more
                pass

    def notify(self, method: str, params: Any = None) -> None:
        """Send a notification; raises :class:`SidecarExited` when the sidecar has exited."""
        __tracebackhide__ = True
        _json(params, f"notification {method}")
        self._check_loop(f"notification {method}")
        if self._gone():
            raise self._exited(f"notification {method} not sent", method)
        self.protocol.notify(method, params)
        if method == "exit":
            self._exit_sent = True

    # ------------------------------------------------------------------ server → client
    def on_request(self, method: str, handler: Callable[[Any], Any | Awaitable[Any]]) -> None:
        """Answer the server's ``method`` requests with ``handler(params)`` (sync or async);
        raise :class:`SidecarError` in it to answer with an error."""

        async def handle(params: Any) -> Any:
            self.server_requests.append((method, params))
            try:
                out = handler(params)
                if inspect.isawaitable(out):
                    out = await out
            except SidecarError as e:
                raise JsonRpcException(message=e.message, code=e.code, data=e.data) from None
            except Exception as e:  # a bug in the test: the sidecar is answered, the test fails
                self.handler_errors.append((method, e))
                raise JsonRpcException(message=f"the test's {method} handler raised {type(e).__name__}: {e}",
                                       code=-32603) from None
            try:
                _json(out)
            except (TypeError, ValueError) as e:
                error = TypeError(f"returned a value that is not JSON ({e}): {short(out, 200)}")
                self.handler_errors.append((method, error))
                raise JsonRpcException(message=f"the test's {method} handler {error}", code=-32603) from None
            return out

        handle.__name__ = "answer_" + method.replace("/", "_")
        self.protocol.fm.features[method] = handle

    def respond(self, method: str, result: Any) -> None:
        """A standing answer: every ``method`` request from the server gets ``result``."""
        self.on_request(method, lambda _params: result)

    async def server_exit(self, server: asyncio.subprocess.Process) -> None:
        """pygls calls this once the server process has exited: wake the waits for a
        notification (they fail at once instead of waiting out their time-out)."""
        self._wake()

    # ------------------------------------------------------------------ notifications
    def _notified(self, method: str, params: Any) -> None:
        self.notifications.append((method, params))
        self._wake()

    def _wake(self) -> None:
        cond = self._changed
        if cond is not None:
            async def wake() -> None:
                async with cond:
                    cond.notify_all()
            asyncio.ensure_future(wake())

    def _find(self, method: str, match: Any) -> int | None:
        for i, (m, params) in enumerate(self.notifications):
            if m == method and i not in self._consumed and (match is None or first_mismatch(match, params) is None):
                return i
        return None

    async def _read_to_end(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until the sidecar's output has been read to its end: what it
        wrote before it exited (a cancelled operate's last ``$/progress``, sent after ``exit``) is
        then in :attr:`notifications`."""
        connection = self._connection
        if connection is not None and not connection.done() and timeout > 0:
            await asyncio.wait([connection], timeout=timeout)
        self._wake()  # (the other waits look again)

    async def wait_for_notification(self, method: str, match: Any = None, *, timeout: float | None = None) -> Any:
        """The params of the first ``method`` notification, not returned before, whose params
        match the pattern ``match`` (objects are subsets, arrays element-wise, ``"*"`` anything);
        waits for it up to ``timeout`` seconds (``TimeoutError`` names the nearest miss). Once the
        sidecar has exited or was sent ``exit``, it waits (within ``timeout``) for the rest of the
        sidecar's output only, and raises :class:`SidecarExited` when none of it matches."""
        __tracebackhide__ = True
        self._check_loop(f"wait_for_notification {method}")
        timeout = self.timeout if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + timeout
        if self._changed is None:
            self._changed = asyncio.Condition()
        cond = self._changed

        async def wait() -> int | None:
            async with cond:
                while True:
                    i = self._find(method, match)
                    if i is not None:
                        return i
                    if self.returncode is not None or self._exit_sent:
                        return None
                    await cond.wait()

        try:
            i = await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(self._miss(method, match, timeout)) from None
        if i is None:  # it exited, or was sent exit: what it wrote until then may still match
            await self._read_to_end(deadline - asyncio.get_running_loop().time())
            i = self._find(method, match)
        if i is None:
            await self._reaped()  # (sent exit: its exit code, briefly waited for)
            i = self._find(method, match)
        if i is None:
            raise self._exited(f"no matching {method} notification came", method)
        self._consumed.add(i)
        return self.notifications[i][1]

    def _miss(self, method: str, match: Any, timeout: float) -> str:
        text = f"no {method} notification matching {'any params' if match is None else short(match, 120)} " \
               f"within {timeout:g} s"
        miss = notification_miss(match, [(p, 0 if i in self._consumed else None)
                                         for i, (m, p) in enumerate(self.notifications) if m == method],
                                 ("an earlier wait_for_notification", "earlier wait_for_notification calls"))
        return f"{text}; {miss}; {WAIT_LONGER}" if miss else f"{text}; {WAIT_LONGER}"

    def of(self, method: str) -> list[Any]:
        """The params of every ``method`` notification so far."""
        return [p for m, p in self.notifications if m == method]


# --------------------------------------------------------------------------- scripts
class ScriptFailed(AssertionError):
    """A session script had failing steps. The message's first line names the script, the first
    failing step and what failed (all that pytest's short test summary shows); the replay report
    follows it, every step."""


def _shown_path(path: str | os.PathLike[str]) -> str:
    """A script's path as a report names it: normalised (the test file's folder joined to
    ``../s.jsonl`` is the folder above it, not ``tests/../s.jsonl``) when that is the same file;
    as given when it is not (``scripts/../s.jsonl`` with ``scripts`` a symlink: the ``..`` is the
    folder above the symlink's target) or the file cannot be found. The script is opened by the
    path as given, whatever it is shown as."""
    given = os.fspath(path)
    normal = os.path.normpath(given)
    if normal == given:
        return given
    try:
        return normal if os.path.samefile(normal, given) else given
    except OSError:
        return given


def script_options_problem(server: Any = None, step_timeout: Any = None, env: Any = None, cwd: Any = None,
                           scripted: Any = False) -> str | None:
    """What is wrong with :func:`run_session_script`'s options, in words (None when nothing): a
    wrong type failed deep in the start of the server (``env={"X": 1}``, ``cwd=5``), started a command
    spelt letter by letter (``server="operate-sidecar ..."``) or was taken as the default (``step_timeout=0``)."""
    from operate_sidecar.server.script.runner import MAX_TIMEOUT_MS

    if server is not None and (isinstance(server, (str, bytes)) or not isinstance(server, (list, tuple))
                               or not server or not all(isinstance(a, str) for a in server)):
        return (f"server must be a list of strings, the command and its arguments, got {server!r}; "
                "for this sidecar with flags: server_command('--config', 'settings.toml')")
    if step_timeout is not None and (isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float))
                                     or not 0 < step_timeout < float("inf")):
        return f"step_timeout must be a positive number of seconds, got {step_timeout!r}"
    if step_timeout is not None and step_timeout * 1000 > MAX_TIMEOUT_MS:  # the clock's waits refuse 1e300
        return f"step_timeout must be at most {MAX_TIMEOUT_MS // 1000} seconds (one day), got {step_timeout!r}"
    if env is not None and (not isinstance(env, dict)
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        return f"env must be a dict of strings to strings (added to the environment), got {env!r}"
    if cwd is not None and not isinstance(cwd, (str, os.PathLike)):
        return f"cwd must be a folder's path (a str or a pathlib.Path), got {cwd!r}"
    if not isinstance(scripted, bool):
        return f"scripted must be True or False, got {scripted!r}"
    return None


def run_session_script(path: str | os.PathLike[str], *, server: list[str] | None = None,
                       scripted: bool = False, step_timeout: float | None = None,
                       env: dict[str, str] | None = None,
                       cwd: str | os.PathLike[str] | None = None) -> list[Any]:
    """Run a session script (``operate-sidecar replay``) against a fresh sidecar; raises
    :class:`ScriptFailed` (an ``AssertionError``) whose message names the first failing step in its
    first line, then lists every step, the failing ones with the JSON path of each difference (the
    first few). ``env`` is added to this process's
    environment. Returns the step results."""
    from operate_sidecar.server.script.runner import DEFAULT_STEP_TIMEOUT_S, first_failure, format_report, replay

    __tracebackhide__ = True
    problem = script_options_problem(server, step_timeout, env, cwd, scripted)
    if problem:
        raise TypeError(problem)
    if env is not None:  # added to this process's environment, as the sidecar marker's env is
        env = {**os.environ, **env}
    if step_timeout is None:
        step_timeout = DEFAULT_STEP_TIMEOUT_S
    shown = _shown_path(path)  # the same name in a malformed script's file:line and in the report
    runner = replay(path, server, scripted=scripted, step_timeout=step_timeout,
                    env=env, cwd=cwd, timeout_option="pass step_timeout=S", shown=shown)
    if runner.failed:
        report = first_failure(runner, shown) + "\n" + format_report(runner, shown)
        if runner.stderr_tail:
            report += "\nserver stderr (last lines):\n" + runner.stderr_tail
        raise ScriptFailed(report)
    return runner.results
