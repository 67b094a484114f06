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
  against a fresh sidecar and fails the test with the replay report if any step fails.

Tests that use ``sidecar`` are ``async def`` tests run by pytest-asyncio (mark them
``@pytest.mark.asyncio``). Nothing heavy is imported until a fixture is used.
"""

from __future__ import annotations

from typing import Any

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


@pytest.fixture
def sidecar_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Options for the ``sidecar`` fixture: the ``sidecar`` marker's keywords, or the value of an
    indirect parametrization of this fixture."""
    options: dict[str, Any] = {}
    for mark in reversed(list(request.node.iter_markers(MARKER))):  # closest marker wins
        options.update(mark.kwargs)
    param = getattr(request, "param", None)
    if isinstance(param, dict):
        options.update(param)
    return options


async def _sidecar(sidecar_options: dict[str, Any]) -> Any:
    """An initialized operate-sidecar over stdio (see the module doc)."""
    import os

    from pytest_lsp import ClientServerConfig

    from operate_sidecar.testing import SidecarTestClient, server_command

    unknown = set(sidecar_options) - _OPTION_KEYS
    if unknown:
        raise pytest.UsageError(f"sidecar marker: unknown option(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(sorted(_OPTION_KEYS))}")
    env = None
    if sidecar_options.get("env"):
        env = {**os.environ, **sidecar_options["env"]}
    config = ClientServerConfig(server_command=server_command(*sidecar_options.get("args", ())),
                                client_factory=SidecarTestClient, server_env=env)
    client: SidecarTestClient = await config.start()  # type: ignore[assignment]
    client.timeout = float(sidecar_options.get("timeout", client.timeout))
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
        await client.stop()
        _add_stderr(e, client)
        raise
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


if pytest_asyncio is not None:
    sidecar = pytest_asyncio.fixture(_sidecar, name="sidecar")
else:  # pragma: no cover - depends on the environment
    @pytest.fixture(name="sidecar")
    def _sidecar_missing() -> Any:
        raise pytest.UsageError("the sidecar fixture needs pytest-lsp: pip install 'operate-sidecar[testing]'")


@pytest.fixture
def sidecar_script() -> Any:
    """``sidecar_script(path, scripted=False, server=None, step_timeout=None, env=None)``: run a
    session script against a fresh sidecar; a failing step fails the test with the report."""
    from operate_sidecar.testing import run_session_script

    def run(path: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return run_session_script(path, **kwargs)

    return run
