"""pytest plugin for projects that test against operate-sidecar (registered as a ``pytest11``
entry point, so installing operate-sidecar is enough).

Fixtures:

- ``sidecar``: a running sidecar over stdio, already initialized, as a
  :class:`operate_sidecar.testing.SidecarTestClient` (``await sidecar.request(...)``,
  ``sidecar.notify(...)``, ``await sidecar.wait_for_notification(...)``,
  ``sidecar.respond(...)`` / ``sidecar.on_request(...)``). It is started with pytest-lsp's
  ``ClientServerConfig`` and shut down (``shutdown`` + ``exit``) after the test. How it starts
  comes from the ``sidecar`` marker, or from the ``sidecar_options`` fixture (override it, or
  parametrize it indirectly)::

      @pytest.mark.sidecar(settings={"models": {...}}, capabilities={"toolPermission": True},
                           args=["--state-dir", "/tmp/x"], env={...}, initialize=True)

- ``sidecar_script``: ``sidecar_script("session.jsonl", scripted=False)`` runs a session script
  against a fresh sidecar and fails the test with the replay report if any step fails, or if a
  server-to-client request that came as the session ended (after the last step) was not
  answered, or was answered with what it did not offer.

An unknown option (of the marker, the ``sidecar_options`` fixture or ``sidecar_script``) fails
the test naming it, with the option it is closest to (``setings (did you mean settings?)``).

Tests that use ``sidecar`` are ``async def`` tests run by pytest-asyncio (mark them
``@pytest.mark.asyncio``). The sidecar is started on the event loop the test runs in, whatever
its loop scope (``asyncio_default_test_loop_scope``, ``@pytest.mark.asyncio(loop_scope=...)``),
and whatever ``asyncio_default_fixture_loop_scope`` says. Nothing heavy is imported until a
fixture is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pytest

try:  # the `testing` extra (pytest-lsp brings pytest-asyncio); without it the fixture says so
    import pytest_asyncio
except ImportError:  # pragma: no cover - depends on the environment
    pytest_asyncio = None

MARKER = "sidecar"
_OPTION_KEYS = {"settings", "capabilities", "args", "env", "initialize", "client_info", "workspace_folders",
                "timeout"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "sidecar(settings=None, capabilities=None, args=(), env=None, initialize=True, client_info=None, "
        "workspace_folders=None, timeout=30): how the `sidecar` fixture starts and initializes "
        "operate-sidecar")


def _refuse(message: str) -> None:
    """Fail the test's set-up with ``message`` alone (a wrong option is the test's mistake: the
    plugin's and pytest-asyncio's frames would only hide it)."""
    __tracebackhide__ = True
    pytest.fail(message, pytrace=False)


def _unknown_options(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``unknown option(s) setings (did you mean settings?)``, as a script's misspelt step field is
    named; the known names too when one of the unknown is close to none of them."""
    from operate_sidecar.server.script.matcher import did_you_mean, misspelt

    known, unknown = sorted(known), sorted(unknown)
    text = "unknown option(s) " + ", ".join(misspelt(name, known) for name in unknown)
    if any(did_you_mean(name, known) is None for name in unknown):
        text += f"; known: {', '.join(known)}"
    return text


def _check_options(options: Any) -> None:
    """Refuse, by name, options of the wrong type or unknown ones, before any sidecar starts (a
    wrong type failed deep inside the start-up, or after it with the sidecar left running)."""
    if not isinstance(options, dict):
        _refuse(f"sidecar options must be a dict of keywords, got {type(options).__name__}")
    unknown = set(options) - _OPTION_KEYS
    if unknown:
        _refuse(f"sidecar marker: {_unknown_options(unknown, _OPTION_KEYS)}")

    def bad(key: str, want: str) -> None:
        _refuse(f"sidecar marker: {key} must be {want}, got {options[key]!r}")

    for key in ("settings", "capabilities", "client_info"):
        if options.get(key) is not None and not isinstance(options[key], dict):
            bad(key, "a dict")
    args = options.get("args", ())
    if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)) \
            or not all(isinstance(a, str) for a in args):
        bad("args", "a list of strings (server flags)")
    env = options.get("env")
    if env is not None and (not isinstance(env, dict)
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        bad("env", "a dict of strings to strings")
    if not isinstance(options.get("initialize", True), bool):
        bad("initialize", "True or False")
    if options.get("workspace_folders") is not None and not isinstance(options["workspace_folders"], list):
        bad("workspace_folders", "a list")
    timeout = options.get("timeout", 1)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        bad("timeout", "a number of seconds above 0")


@pytest.fixture
def sidecar_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Options for the ``sidecar`` fixture: the ``sidecar`` marker's keywords, or the value of an
    indirect parametrization of this fixture."""
    options: dict[str, Any] = {}
    for mark in reversed(list(request.node.iter_markers(MARKER))):  # closest marker wins
        if mark.args:
            _refuse(f"sidecar marker: options are keywords (settings=..., args=[...]), got "
                                    f"positional {short_repr(mark.args)}")
        options.update(mark.kwargs)
    param = getattr(request, "param", None)
    if param is not None:
        _check_options(param)
        options.update(param)
    return options


async def _sidecar(sidecar_options: dict[str, Any], request: pytest.FixtureRequest) -> Any:
    """An initialized operate-sidecar over stdio (see the module doc)."""
    import inspect
    import os

    test = getattr(request, "function", None)
    if test is not None and not inspect.iscoroutinefunction(test) and "sidecar" in inspect.signature(test).parameters:
        _refuse(f"{test.__name__}: the sidecar fixture is async: make the test `async def` (with "
                "@pytest.mark.asyncio, or asyncio_mode = auto); in a plain `def` test its requests are "
                "coroutines nobody runs, and the test would pass having checked nothing")

    from pytest_lsp import ClientServerConfig

    from operate_sidecar.testing import SidecarError, SidecarExited, SidecarTestClient, server_command

    _check_options(sidecar_options)
    env = None
    if sidecar_options.get("env"):
        env = {**os.environ, **sidecar_options["env"]}
    config = ClientServerConfig(server_command=server_command(*sidecar_options.get("args", ())),
                                client_factory=SidecarTestClient, server_env=env)
    client: SidecarTestClient = await config.start()  # type: ignore[assignment]
    client.timeout = float(sidecar_options.get("timeout", client.timeout))
    failed: BaseException | None = None
    try:
        if sidecar_options.get("initialize", True):
            params: dict[str, Any] = {"clientInfo": sidecar_options.get("client_info") or {"name": "pytest"}}
            if sidecar_options.get("capabilities") is not None:
                params["capabilities"] = sidecar_options["capabilities"]
            if sidecar_options.get("settings") is not None:
                params["settings"] = sidecar_options["settings"]
            if sidecar_options.get("workspace_folders") is not None:
                params["workspaceFolders"] = sidecar_options["workspace_folders"]
            client.initialize_result = await client.request("initialize", params)
    except Exception as e:  # the sidecar did not start (bad args, bad settings...): say what it said
        failed = e
    if failed is not None:
        await client.stop()
        _add_stderr(failed, client)
        if not isinstance(failed, (SidecarError, SidecarExited, TimeoutError)):
            raise failed
        # the test's options are wrong: the sidecar's words, without the frames of pytest-asyncio and of
        # this fixture around them (refused outside the except: no chained traceback)
        _refuse(f"the sidecar did not start and initialize with {short_repr(sidecar_options, 300)}:\n"
                + "\n".join([f"{type(failed).__name__}: {failed}", *getattr(failed, "__notes__", ())]))
    try:
        yield client
    finally:
        await client.stop()
    if client.handler_errors:  # the sidecar got -32603 and went on: the test must not pass
        from operate_sidecar.testing import HandlerFailed

        method, error = client.handler_errors[0]
        more = len(client.handler_errors) - 1
        raise HandlerFailed(f"on_request handler for {method}: {type(error).__name__}: {error}; the sidecar was "
                            f"answered -32603" + (f" ({more} more handler failure(s))" if more else "")) from error


def short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _add_stderr(error: BaseException, client: Any, lines: int = 40) -> None:
    """Append the server's stderr (its last ``lines`` lines) to ``error``, as a note."""
    from operate_sidecar.testing import SidecarError, SidecarExited

    if isinstance(error, SidecarExited):  # its message has the exit code and the stderr already
        return
    try:
        text = client.stderr_text().rstrip()
    except (OSError, ValueError):
        return
    if not text:
        if isinstance(error, SidecarError):  # it answered: the answer says it all
            return
        text = "(nothing)"
    tail = text.splitlines()[-lines:]
    error.add_note("sidecar stderr" + (f" (last {lines} lines)" if len(text.splitlines()) > lines else "")
                   + ":\n" + "\n".join("  " + ln for ln in tail))


#: pytest-asyncio's loop scopes: the ``sidecar`` fixture runs on the loop of the test that uses it
_LOOP_SCOPES = ("function", "class", "module", "package", "session")


def _test_loop_scope(request: pytest.FixtureRequest) -> str:
    """The scope of the event loop the test runs in, by pytest-asyncio's rule: the closest
    ``asyncio`` marker's ``loop_scope``, else the ``asyncio_default_test_loop_scope`` setting,
    else ``function``."""
    marker = request.node.get_closest_marker("asyncio")
    scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope") if marker is not None else None
    if not scope:
        try:
            scope = request.config.getini("asyncio_default_test_loop_scope")
        except ValueError:  # a pytest-asyncio without that setting
            scope = None
    return scope or "function"


def _on_loop(scope: str) -> Any:
    """``_sidecar`` as a pytest-asyncio fixture run on the ``scope`` loop (a copy of the function
    each: pytest-asyncio marks the function object itself with its loop scope)."""
    import types

    func = types.FunctionType(_sidecar.__code__, _sidecar.__globals__, f"_sidecar_on_{scope}_loop",
                              _sidecar.__defaults__, _sidecar.__closure__)
    func.__doc__, func.__module__ = _sidecar.__doc__, _sidecar.__module__
    return pytest_asyncio.fixture(func, name=f"_sidecar_on_{scope}_loop", loop_scope=scope)


if pytest_asyncio is not None:
    for _scope in _LOOP_SCOPES:
        globals()[f"_sidecar_on_{_scope}_loop"] = _on_loop(_scope)
    del _scope

    @pytest.fixture(name="sidecar")
    def _sidecar_on_the_tests_loop(sidecar_options: dict[str, Any], request: pytest.FixtureRequest) -> Any:
        """An initialized operate-sidecar over stdio, as a ``SidecarTestClient``, started on the
        event loop the test runs in (whatever its loop scope: ``asyncio_default_test_loop_scope``,
        ``@pytest.mark.asyncio(loop_scope=...)``; a client started on another loop reads its
        answers only while that loop runs, so every request of the test timed out). See the
        ``operate_sidecar.pytest_plugin`` module doc."""
        scope = _test_loop_scope(request)
        if scope not in _LOOP_SCOPES:
            _refuse(f"the sidecar fixture: the test's event loop scope {scope!r} is not one of "
                    f"{', '.join(_LOOP_SCOPES)}")
        return request.getfixturevalue(f"_sidecar_on_{scope}_loop")
else:  # pragma: no cover - depends on the environment
    @pytest.fixture(name="sidecar")
    def _sidecar_missing() -> Any:
        _refuse("the sidecar fixture needs pytest-lsp: pip install 'operate-sidecar[testing]'")


@pytest.fixture
def sidecar_script(request: pytest.FixtureRequest) -> Any:
    """``sidecar_script(path, scripted=False, server=None, step_timeout=None, env=None)``: run a
    session script against a fresh sidecar; a failing step fails the test with the report. A
    relative ``path`` is found beside the test file first, then from the working directory."""
    import inspect

    from operate_sidecar.server.script.runner import ScriptError
    from operate_sidecar.testing import run_session_script, script_options_problem

    here = Path(str(request.node.path)).parent
    options = [name for name, p in inspect.signature(run_session_script).parameters.items()
               if p.kind is p.KEYWORD_ONLY]

    def run(path: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        unknown = set(kwargs) - set(options)
        if unknown:  # a TypeError from run_session_script, under the plugin's frames, said only the name
            _refuse(f"sidecar_script: {_unknown_options(unknown, options)}")
        problem = script_options_problem(kwargs.get("server"), kwargs.get("step_timeout"), kwargs.get("env"),
                                         kwargs.get("cwd"), kwargs.get("scripted", False))
        if problem:
            _refuse(f"sidecar_script: {problem}")
        given = Path(path)
        if not given.is_absolute() and (here / given).is_file():
            path = here / given  # beside the test file: pytest may run from any directory
        elif not given.is_absolute() and not given.exists():
            _refuse(f"sidecar_script: no session script {str(path)!r} beside the test file ({here}) "
                    f"nor in the working directory ({Path.cwd()})")
        try:
            return run_session_script(path, **kwargs)
        except (OSError, ScriptError) as e:  # the script is the test's mistake: what and where, no runner frames
            problem = str(e)
        _refuse(f"sidecar_script: {problem}")

    return run
