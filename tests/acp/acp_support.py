"""Drive ``operate-sidecar --acp`` with the ACP SDK's own client side over real pipes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

import acp
import jsonschema
from acp import schema as S
from acp.connection import StreamDirection
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
        return json.dumps(v, ensure_ascii=False)  # TOML has no escape for half a surrogate pair
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


def echo_model(folder: Path) -> tuple[dict[str, Any], Path]:
    """A model (``cli``, ``jsonl``) that writes each prompt it is given as one JSON line to a file
    and answers ``ok``: (its config, the file). What the model saw, not what the branch holds."""
    script, seen = folder / "echo_model.py", folder / "model-prompts.jsonl"
    script.write_text("import json, sys\n"
                      "with open(sys.argv[1], 'a') as f:\n    f.write(json.dumps(sys.stdin.read()) + '\\n')\n"
                      "print(json.dumps({'type': 'text', 'text': json.dumps({'message': 'ok'})}))\n")
    seen.write_text("")
    return {"provider": "cli", "profile": "jsonl", "command": [sys.executable, str(script), str(seen)]}, seen


def reply(message: str = "", calls: list[tuple[str, dict]] | None = None, **entry: Any) -> dict[str, Any]:
    """A scripted structured reply: a message for the user and the tool calls to make."""
    body: dict[str, Any] = {"message": message, "action_required": bool(calls),
                            "action_requests": [{"function": f, "arguments": a} for f, a in calls or []]}
    return {"json": body, **entry}


#: what the agent may send, by method: its requests' params, and the results of the client's requests
AGENT_REQUESTS = {"session/request_permission": S.RequestPermissionRequest, "fs/read_text_file": S.ReadTextFileRequest,
                  "fs/write_text_file": S.WriteTextFileRequest}
RESULTS = {"initialize": S.InitializeResponse, "authenticate": S.AuthenticateResponse,
           "session/new": S.NewSessionResponse, "session/load": S.LoadSessionResponse,
           "session/list": S.ListSessionsResponse, "session/prompt": S.PromptResponse,
           "session/set_config_option": S.SetSessionConfigOptionResponse,
           "session/set_mode": S.SetSessionModeResponse, "session/resume": S.ResumeSessionResponse,
           "session/fork": S.ForkSessionResponse, "session/close": S.CloseSessionResponse}
_VALIDATORS: dict[Any, Any] = {}


def schema_errors(model: Any, value: Any) -> list[str]:
    """``value`` checked strictly against the JSON Schema of one of the SDK's models (the SDK's
    own client is lenient: it drops a malformed list item or field instead of failing)."""
    v = _VALIDATORS.get(model)
    if v is None:
        v = _VALIDATORS[model] = jsonschema.Draft202012Validator(model.model_json_schema(by_alias=True))
    return [f"{model.__name__}: {'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in v.iter_errors(value)]


def not_utf8(value: Any, where: str = "") -> list[str]:
    """Each string in ``value`` that is not Unicode text (a lone surrogate: Python's JSON reader
    takes a lone ``\\udXXX`` escape, strict readers such as Rust's serde_json refuse the line)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return [f"{where or '/'}: not Unicode text: {value[:80]!r}"]
        return []
    if isinstance(value, dict):
        return [e for k, v in value.items() for e in not_utf8(k, where + "/<key>") + not_utf8(v, f"{where}/{k}")]
    if isinstance(value, list):
        return [e for i, v in enumerate(value) for e in not_utf8(v, f"{where}/{i}")]
    return []


class SchemaTap:
    """Sees every message on the client's connection; ``violations()`` lists each message the
    agent sent that is not the schema's (checked at the end, when every request's method is
    known)."""

    def __init__(self) -> None:
        self.methods: dict[Any, str] = {}
        self.incoming: list[dict[str, Any]] = []

    def __call__(self, event: Any) -> None:
        msg = event.message
        if event.direction is StreamDirection.OUTGOING:
            if "method" in msg and "id" in msg:
                self.methods[msg["id"]] = msg["method"]
        else:
            self.incoming.append(msg)

    def violations(self) -> list[tuple[str, list[str]]]:
        out = []
        for msg in self.incoming:
            errors = [] if msg.get("jsonrpc") == "2.0" else ["jsonrpc must be 2.0"]
            method = msg.get("method")
            if method is not None and "id" in msg:
                model = AGENT_REQUESTS.get(method)
                errors += schema_errors(model, msg.get("params")) if model else [f"unexpected request {method}"]
            elif method is not None:
                errors += schema_errors(S.SessionNotification, msg.get("params")) if method == "session/update" \
                    else [f"unexpected notification {method}"]
            elif "error" in msg:
                errors += schema_errors(S.Error, msg["error"])
            elif msg.get("id") in self.methods and self.methods[msg["id"]] in RESULTS:
                errors += schema_errors(RESULTS[self.methods[msg["id"]]], msg.get("result"))
            errors += not_utf8(msg)
            if errors:
                out.append((json.dumps(msg)[:300], errors))
        return out


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
                state_dir: str | None = None, env: dict[str, str] | None = None,
                initialize: bool = True) -> AsyncIterator[tuple[Any, Any]]:
    """Spawn the sidecar in ACP mode, initialize it (unless ``initialize`` is false: the test
    does), yield ``(conn, process)``; the process is reaped (killed if it does not exit on EOF
    within the time-out). Every message the agent sent is then checked against the ACP schema
    (``SchemaTap``; ``conn.tap``). ``env`` is added to the agent's environment."""
    args = ["-m", "operate_sidecar.server", "--acp", *extra]
    if config:
        args += ["--config", config]
    if state_dir:
        args += ["--state-dir", state_dir]
    tap = SchemaTap()
    async with acp.spawn_agent_process(client, sys.executable, *args, env=agent_env(**(env or {})),
                                       transport_kwargs={"stderr": None}) as (conn, proc):
        conn._conn.add_observer(tap)
        conn.tap = tap
        try:
            caps = ClientCapabilities(fs=FileSystemCapabilities(read_text_file=True, write_text_file=True)) \
                if fs else ClientCapabilities()
            if initialize:
                conn.init = await asyncio.wait_for(conn.initialize(protocol_version=acp.PROTOCOL_VERSION,
                                                                   client_capabilities=caps,
                                                                   client_info=Implementation(name="tests", version="0")),
                                                   TIMEOUT)
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
    # the body ran through: every message the agent sent is the schema's
    problems = tap.violations()
    assert not problems, problems


def run(coro: Any, timeout: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def bounded(aw: Any, timeout: float = TIMEOUT) -> Any:
    return await asyncio.wait_for(aw, timeout)


async def until(check: Any, what: str, timeout: float = TIMEOUT) -> None:
    """Wait (bounded) until ``check()`` holds, letting the loop run meanwhile."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not in {timeout} s"
        await asyncio.sleep(0.02)


def cfg(tmp_path: Path, *responses: Any, **settings: Any) -> str:
    """A settings file in ``tmp_path``: a scripted model ``s`` answering ``responses`` (or the
    ``models`` given), and the other settings."""
    models = settings.pop("models", None) or {"s": scripted(*responses)}
    return write_config(tmp_path / "settings.toml", {"models": models, **settings})


def sdk_prompt(conn: Any, sid: str, text: str = "go") -> Any:
    """A text prompt through the SDK's client connection, bounded."""
    return bounded(conn.prompt(session_id=sid, prompt=[acp.text_block(text)]))


# ---------------------------------------------------------------- a plain JSON-lines client
AGENT = [sys.executable, "-m", "operate_sidecar.server", "--acp"]


class Raw:
    """The agent over pipes from a plain newline-delimited JSON client (no SDK: lines in one
    write reach the agent in one read, and params the SDK's client would refuse can be sent):
    ``send`` writes any number of messages in one write; every message the agent writes is kept (``seen``) and answers are waited for by id. ``extra``:
    more arguments for the agent; ``stderr``: where its log goes (``subprocess.PIPE``: read by
    the caller)."""

    def __init__(self, config: str, env: dict[str, str] | None = None, *extra: str,
                 stderr: int | None = subprocess.DEVNULL) -> None:
        self.proc = subprocess.Popen(AGENT + ["--config", config, *extra], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr, env=env or agent_env())
        self.seen: list[dict] = []
        self._answers: dict[object, dict] = {}
        self._cond = threading.Condition()
        self.ended = False  # the agent's output ended (every message it wrote is in ``seen``)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                self.seen.append(msg)
                if "id" in msg and "method" not in msg:
                    self._answers[msg["id"]] = msg
                self._cond.notify_all()
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def until(self, check: Any, what: str, timeout: float = TIMEOUT) -> None:
        """Wait until ``check()`` holds (it is called with the messages' lock held)."""
        with self._cond:
            assert self._cond.wait_for(check, timeout), f"{what}: not in {timeout} s"

    def updates(self) -> list[dict]:
        """The session updates seen so far."""
        with self._cond:
            return [m["params"]["update"] for m in self.seen if m.get("method") == "session/update"]

    def send(self, *msgs: dict) -> None:
        self.proc.stdin.write(b"".join(json.dumps(m).encode() + b"\n" for m in msgs))
        self.proc.stdin.flush()

    def send_line(self, line: bytes) -> None:
        """Raw bytes as one line, as they are."""
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def answer(self, msg_id: object, timeout: float = TIMEOUT) -> dict:
        with self._cond:
            assert self._cond.wait_for(lambda: msg_id in self._answers, timeout), f"no answer to {msg_id} in {timeout} s"
            return self._answers[msg_id]

    def request_seen(self, method: str, timeout: float = TIMEOUT) -> dict:
        with self._cond:
            found = self._cond.wait_for(lambda: [m for m in self.seen if m.get("method") == method], timeout)
            assert found, f"no {method} in {timeout} s"
            return found[0]

    def text(self) -> str:
        with self._cond:
            return "".join(m["params"]["update"]["content"]["text"] for m in self.seen
                           if m.get("method") == "session/update"
                           and m["params"]["update"].get("sessionUpdate") == "agent_message_chunk")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class Logged(Raw):
    """``Raw`` with the agent's log (its stderr) kept in the file ``agent.stderr`` in ``folder``
    (``stderr()``), read while it runs too."""

    def __init__(self, config: str, folder: Path, env: dict[str, str] | None = None, *extra: str) -> None:
        self.errpath = folder / "agent.stderr"
        self._err = open(self.errpath, "wb")
        super().__init__(config, env, *extra, stderr=self._err.fileno())

    def stderr(self) -> str:
        return self.errpath.read_text(errors="replace")

    def warnings(self) -> list[str]:
        return [line for line in self.stderr().splitlines() if "WARNING" in line]

    def logged(self, text: str, times: int = 1, timeout: float = TIMEOUT) -> None:
        """Wait (bounded) until the agent has logged ``text`` on ``times`` lines."""
        deadline = time.monotonic() + timeout
        while sum(text in line for line in self.stderr().splitlines()) < times:
            assert time.monotonic() < deadline, f"{text!r} not logged {times}x in {timeout} s: {self.stderr()}"
            time.sleep(0.02)

    def close(self) -> None:
        super().close()
        self._err.close()


def turn_order(a: Raw, msg_id: int) -> list[tuple]:
    """The turn of prompt ``msg_id`` as the client saw it: each session update (kind, status)
    and, where it came, its answer's error code."""
    with a._cond:
        return [("answer", m["error"]["code"]) if m.get("id") == msg_id
                else (m["params"]["update"]["sessionUpdate"], m["params"]["update"].get("status"))
                for m in a.seen if m.get("id") == msg_id or m.get("method") == "session/update"]


def req(msg_id: int, method: str, **params: object) -> dict:
    return {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}


def prompt(msg_id: int, sid: str, text: str = "hi", *extra: dict) -> dict:
    return req(msg_id, "session/prompt", sessionId=sid, prompt=[{"type": "text", "text": text}, *extra])


def cancel(sid: str) -> dict:
    return {"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": sid}}


def start(tmp_path, ws, *responses, fs: bool = False, env: dict[str, str] | None = None,
          **settings) -> tuple[Raw, str]:
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(*responses)}, **settings})
    a = Raw(config, env)
    return a, open_session(a, ws, fs=fs)


def open_session(a: Any, ws: Path, fs: bool = False) -> str:
    """``initialize`` (request 1; the client serves files with ``fs``) and ``session/new`` in
    ``ws`` (request 2) from a plain client ``a`` (a ``Raw``): the new session's id."""
    caps = {"fs": {"readTextFile": True, "writeTextFile": True}} if fs else {}
    a.send(req(1, "initialize", protocolVersion=1, clientCapabilities=caps))
    a.answer(1)
    a.send(req(2, "session/new", cwd=str(ws), mcpServers=[]))
    return a.answer(2)["result"]["sessionId"]
