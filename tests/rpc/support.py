"""End-to-end helpers: the real server process over real pipes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from operate_sidecar.clients.python.client import RpcError, SidecarClient  # noqa: E402

SERVER = [sys.executable, "-m", "operate_sidecar.server"]
TIMEOUT = 20.0

ANSWER_SCHEMA = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}},
                 "required": ["answer"]}


def server_env(extra: dict[str, str] | None = None, paths: tuple[Path, ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *map(str, paths), str(FIXTURES), env.get("PYTHONPATH", "")])
    env.pop("PYTHONSTARTUP", None)
    env.update(extra or {})
    return env


class Sidecar(SidecarClient):
    """SidecarClient plus test conveniences; stderr goes to a temp file."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, paths: tuple[Path, ...] = ()) -> None:
        self.stderr_file = tempfile.TemporaryFile()
        super().__init__(argv=SERVER + list(args), env=server_env(env, paths), cwd=str(ROOT),
                         stderr=self.stderr_file)

    def stderr_text(self) -> str:
        self.stderr_file.seek(0)
        return self.stderr_file.read().decode("utf-8", "replace")

    def init(self, models: dict | None = None, capabilities: dict | None = None, **settings) -> dict:
        s = dict(settings)
        if models is not None:
            s["models"] = models
        params: dict = {"clientInfo": {"name": "pytest"}, "settings": s}
        if capabilities is not None:
            params["capabilities"] = capabilities
        return self.request("initialize", params, timeout=TIMEOUT)

    def branch(self, **params) -> str:
        return self.request("createBranch", params, timeout=TIMEOUT)["branchId"]

    def error_of(self, method: str, params=None, **kw) -> RpcError:
        with pytest.raises(RpcError) as ei:
            self.request(method, params, timeout=kw.pop("timeout", TIMEOUT), **kw)
        return ei.value

    def messages(self, branch_id: str) -> list[dict]:
        return self.request("branchMessages", {"branchId": branch_id}, timeout=TIMEOUT)["messages"]

    def of(self, method: str) -> list:
        return [p for m, p in self.notifications if m == method]


def frame_body(body: bytes, header: bytes = b"Content-Length") -> bytes:
    """``body`` (raw bytes) in one frame."""
    return header + b": %d\r\n\r\n" % len(body) + body


def frame(obj, header: bytes = b"Content-Length") -> bytes:
    """``obj`` as JSON in one frame."""
    return frame_body(json.dumps(obj, ensure_ascii=False).encode(), header)


def unframe(data: bytes) -> list[dict]:
    """The messages of ``data``, in frames as the server writes them (``Content-Length: N``, a
    blank line, the body)."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        n = int(head.split(b":")[1])
        out.append(json.loads(rest[:n]))
        data = rest[n:]
    return out


def wait_unmatched(c: SidecarClient, n: int = 1) -> list[dict]:
    """The responses to ids nobody was waiting for, once there are at least ``n`` (bounded)."""
    assert c.wait_for(lambda _: len(c.unmatched) >= n, TIMEOUT) or len(c.unmatched) >= n
    return c.unmatched


def wait_log(c: "Sidecar", text: str, timeout: float = TIMEOUT) -> bool:
    """Poll the server's stderr until it holds ``text`` (False after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in c.stderr_text():
            return True
        time.sleep(0.05)
    return text in c.stderr_text()


def scripted(*responses, cli: bool = False) -> dict:
    cfg: dict = {"provider": "scripted", "responses": list(responses)}
    if cli:
        cfg["cli"] = True
    return cfg


@contextlib.contextmanager
def spawner(factory: Callable[..., "Sidecar"]) -> Iterator[Callable[..., "Sidecar"]]:
    """Yield ``make(*args, **kw)`` building servers with ``factory(index, *args, **kw)``;
    on exit every server still running is killed and reaped (waits are bounded)."""
    started: list[Sidecar] = []

    def make(*args: str, **kw) -> Sidecar:
        c = factory(len(started), *args, **kw)
        started.append(c)
        return c

    try:
        yield make
    finally:
        for c in started:
            if c.proc.poll() is None:
                c.kill()
            try:
                c.proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
            c.close_input()
