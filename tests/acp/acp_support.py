"""Drive ``operate-sidecar --acp`` with the ACP SDK's own client side over real pipes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import acp
from acp.schema import (AllowedOutcome, ClientCapabilities, DeniedOutcome, FileSystemCapabilities, Implementation,
                        ReadTextFileResponse, RequestPermissionResponse, WriteTextFileResponse)

ROOT = Path(__file__).resolve().parents[2]
MCP_SERVER = str(ROOT / "tests" / "tools" / "fixtures" / "mcp_server.py")
TIMEOUT = 60.0


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML for {v!r}")


def write_config(path: Path, settings: dict[str, Any]) -> str:
    """Settings → a TOML file for ``--config`` (every key at the top level)."""
    path.write_text("".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in settings.items()))
    return str(path)


def scripted(*responses: Any) -> dict[str, Any]:
    return {"provider": "scripted", "responses": list(responses)}


def reply(message: str = "", calls: list[tuple[str, dict]] | None = None, **entry: Any) -> dict[str, Any]:
    """A scripted structured reply: a message for the user and the tool calls to make."""
    body: dict[str, Any] = {"message": message, "action_required": bool(calls),
                            "action_requests": [{"function": f, "arguments": a} for f, a in calls or []]}
    return {"json": body, **entry}


class RecordingClient(acp.Client):
    """Records every session update; answers permission requests with ``choice`` (an option
    kind, or "cancel" to cancel the turn while asked); serves files from ``files`` when the
    test gives it the fs capability."""

    def __init__(self, choice: str = "allow_once") -> None:
        self.updates: list[tuple[str, Any]] = []
        self.permissions: list[Any] = []
        self.choice = choice
        self.files: dict[str, str] = {}
        self.writes: list[tuple[str, str]] = []
        self.conn: Any = None
        self.asked = asyncio.Event()

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    async def session_update(self, session_id: str, update: Any, **kw: Any) -> None:
        self.updates.append((session_id, update))

    async def request_permission(self, session_id: str, tool_call: Any, options: list, **kw: Any) -> Any:
        self.permissions.append((tool_call, options))
        self.asked.set()
        if self.choice == "cancel":
            await self.conn.cancel(session_id=session_id)
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        if self.choice == "cancelled-outcome":
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        if self.choice == "never":
            await asyncio.sleep(3600)
        opt = next(o for o in options if o.kind == self.choice)
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=opt.option_id))

    async def read_text_file(self, session_id: str, path: str, line: Any = None, limit: Any = None, **kw: Any) -> Any:
        if path not in self.files:
            raise acp.RequestError.resource_not_found(path)
        return ReadTextFileResponse(content=self.files[path])

    async def write_text_file(self, session_id: str, path: str, content: str, **kw: Any) -> Any:
        self.files[path] = content
        self.writes.append((path, content))
        return WriteTextFileResponse()

    # -- reading what came
    def kinds(self) -> list[str]:
        return [u.session_update for _, u in self.updates]

    def text(self) -> str:
        return "".join(u.content.text for _, u in self.updates if u.session_update == "agent_message_chunk")

    def of(self, kind: str) -> list[Any]:
        return [u for _, u in self.updates if u.session_update == kind]


def agent_env(**extra: str) -> dict[str, str]:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "VIRTUAL_ENV") if k in os.environ}
    env["PYTHONPATH"] = str(Path(__file__).parent / "fixtures")
    env.update(extra)
    return env


@contextlib.asynccontextmanager
async def spawn(client: acp.Client, config: str | None = None, *extra: str, fs: bool = False,
                state_dir: str | None = None) -> AsyncIterator[tuple[Any, Any]]:
    """Spawn the sidecar in ACP mode, initialize it, yield ``(conn, process)``; the process
    is reaped (killed if it does not exit on EOF within the time-out)."""
    args = ["-m", "operate_sidecar.server", "--acp", *extra]
    if config:
        args += ["--config", config]
    if state_dir:
        args += ["--state-dir", state_dir]
    async with acp.spawn_agent_process(client, sys.executable, *args, env=agent_env(),
                                       transport_kwargs={"stderr": None}) as (conn, proc):
        try:
            caps = ClientCapabilities(fs=FileSystemCapabilities(read_text_file=True, write_text_file=True)) \
                if fs else ClientCapabilities()
            init = await asyncio.wait_for(conn.initialize(protocol_version=acp.PROTOCOL_VERSION,
                                                          client_capabilities=caps,
                                                          client_info=Implementation(name="tests", version="0")),
                                          TIMEOUT)
            conn.init = init
            yield conn, proc
        finally:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(Exception):
                    proc.stdin.close()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except asyncio.TimeoutError:
                    proc.kill()
                    await proc.wait()


def run(coro: Any, timeout: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def bounded(aw: Any, timeout: float = TIMEOUT) -> Any:
    return await asyncio.wait_for(aw, timeout)
