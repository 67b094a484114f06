"""Hostile-input fuzzing helpers: one real server process per test module, and the
checks every generated input ends with (alive, in sync, stdout clean).

The server is spawned exactly as an editor would (``python -m operate_sidecar.server``, real pipes),
with the ``scripted`` model so operate calls that pass validation finish at once.
If a generated input kills the server, the example fails (naming the exit code and
the stderr tail) and the next example gets a fresh process.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

ROOT = Path(__file__).resolve().parents[2]
RPC_FIXTURES = ROOT / "tests" / "rpc" / "fixtures"   # slow_tools: echo_tool, slow_tool, failing_tool
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from operate_sidecar.clients.python.client import RpcError, SidecarClient  # noqa: E402

SERVER = [sys.executable, "-m", "operate_sidecar.server"]
SYNC_TIMEOUT = 10.0       # a ping after junk: answered within this or the stream is out of sync
REQUEST_TIMEOUT = 15.0    # a fuzzed request (non-operate)
OPERATE_TIMEOUT = 30.0    # a fuzzed operate (scripted model, fast parse options)

#: docs/PROTOCOL.md §8
ERROR_CODES = {-32700, -32600, -32601, -32602, -32603, -32002, -32800, -32010, -32011, -32012, -32013}

#: counts of generated inputs per test (printed in the terminal summary by conftest.py)
COUNTS: dict[str, int] = {}
#: answers to fuzzed params, "<method> <result|code>" -> count (coverage: how many got past validation)
OUTCOMES: dict[str, int] = {}


def profile(name: str, examples: int) -> settings:
    """Hypothesis settings for the fast (``make test``) or stress (``-m slow``) variant."""
    # fast: a fixed seed per test, so `make test` is deterministic; stress: fresh randomness
    # no shrinking: a desync costs a sync timeout per shrink step; the report shows the raw input,
    # and every bug found has a minimal regression test next to the fuzz test that found it
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=examples, deadline=None, derandomize=(name == "fast"), database=None,
                    suppress_health_check=list(HealthCheck), phases=phases)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(RPC_FIXTURES), env.get("PYTHONPATH", "")])
    env.pop("PYTHONSTARTUP", None)
    return env


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def encode(msg: Any) -> bytes:
    """JSON with ASCII escapes, so lone surrogates in generated text can be sent as ``\\udXXX``."""
    return json.dumps(msg, ensure_ascii=True, allow_nan=False).encode("ascii")


def has_traceback(err: Any) -> bool:
    """A Python traceback's text anywhere in ``err``, or a member named ``traceback`` in an
    object of it (a fuzzed field's name that an answer lists, ``unknownFields``, is neither)."""
    if isinstance(err, dict):
        return any(k == "traceback" or has_traceback(v) for k, v in err.items())
    if isinstance(err, list):
        return any(has_traceback(v) for v in err)
    return isinstance(err, str) and "Traceback (most recent call last)" in err


def sane(msg: dict) -> None:
    """Any response the server writes: JSON-RPC 2.0, a §8 code, no -32603, no traceback."""
    assert msg.get("jsonrpc") == "2.0", msg
    assert ("result" in msg) != ("error" in msg), msg
    if "error" in msg:
        err = msg["error"]
        assert err.get("code") in ERROR_CODES, f"code outside the protocol's error codes: {msg}"
        assert err.get("code") != -32603, f"internal error on bad input: {msg}"
        assert not has_traceback(err), f"traceback in error: {msg}"


class ServerDied(AssertionError):
    pass


class FuzzServer:
    """One server process, restarted when an input kills it (that input's example fails)."""

    def __init__(self, init_params: dict, name: str) -> None:
        self.init_params = init_params
        self.name = name
        self.workdir = tempfile.TemporaryDirectory(prefix="fuzz-sidecar-")
        self.client: SidecarClient | None = None
        self.stderr_file: Any = None
        self.tainted = False
        self.deaths: list[str] = []
        self.restarts = 0
        self._ids = itertools.count(1)
        self.init_result: dict | None = None
        self.start()

    # ------------------------------------------------------------------ process
    def start(self) -> None:
        self.stderr_file = tempfile.TemporaryFile()
        self.client = SidecarClient(argv=SERVER, env=server_env(), cwd=self.workdir.name, stderr=self.stderr_file)
        self.tainted = False
        self.init_result = self.client.request("initialize", self.init_params, timeout=REQUEST_TIMEOUT)
        self.on_start()

    def on_start(self) -> None:  # subclasses: state the fuzz needs (branches ...)
        pass

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            self.stderr_file.seek(0)
            return self.stderr_file.read().decode("utf-8", "replace")[-n:]
        except (OSError, ValueError):
            return ""

    def stop(self) -> None:
        c = self.client
        if c is None:
            return
        try:
            c.close(timeout=5)
        except Exception:
            c.kill()
        self.client = None

    def restart(self) -> None:
        self.restarts += 1
        c = self.client
        if c is not None:
            c.kill()
            try:
                c.proc.wait(10)
            except Exception:
                pass
            c.close_input()
        self.start()

    def close(self) -> None:
        self.stop()
        self.workdir.cleanup()

    @property
    def c(self) -> SidecarClient:
        assert self.client is not None
        return self.client

    def fresh_id(self, prefix: str = "fz") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:8]}-{next(self._ids)}"

    # ------------------------------------------------------------------ per example
    def begin(self) -> None:
        """Before an example: a fresh process if the last one died or lost sync."""
        c = self.client
        if c is None or c.proc.poll() is not None or self.tainted or c.stream_errors:
            self.restart()

    def dead(self) -> bool:
        return self.client is not None and self.client.proc.poll() is not None

    def check_alive(self) -> None:
        rc = self.c.proc.poll()
        if rc is not None:
            self.tainted = True
            msg = f"the server died (exit code {rc}); stderr tail:\n{self.stderr_tail()}"
            self.deaths.append(msg)
            raise ServerDied(msg)

    def sync(self) -> None:
        """A well-formed ping with a fresh id is answered with ``{}``: alive and in sync."""
        self.check_alive()
        ping_id = self.fresh_id("sync")
        try:
            result = self.c.request("ping", {}, timeout=SYNC_TIMEOUT, msg_id=ping_id)
        except TimeoutError:
            self.tainted = True
            self.check_alive()
            raise AssertionError(f"ping {ping_id!r} after the input was not answered within {SYNC_TIMEOUT}s: "
                                 f"the stream is out of sync or the server is stuck")
        except RpcError as e:
            self.tainted = True
            self.check_alive()
            raise AssertionError(f"ping after the input failed: {e.code} {e.message}")
        assert result == {}, f"ping answered {result!r}"
        self.check_stdout()

    def check_stdout(self) -> None:
        errors = self.c.stream_errors
        if errors:
            self.tainted = True
        assert errors == [], f"stdout carried something other than frames: {errors!r}"

    def response(self, pending: Any, timeout: float = REQUEST_TIMEOUT) -> dict:
        """The raw response message of ``pending`` (result or error); no answer taints the process."""
        try:
            pending.result(timeout)
        except RpcError:
            pass
        except TimeoutError:
            self.tainted = True
            self.check_alive()
            raise AssertionError(f"request {pending.id!r} was not answered within {timeout}s")
        msg = pending._msg or {}
        assert msg.get("id") == pending.id or msg.get("error", {}).get("code") == -32099, msg
        assert msg.get("error", {}).get("code") != -32099, "the server closed its output"
        return msg


def fuzz_server_fixture(server: FuzzServer):
    """Yield helper for module-scoped fixtures: close the process at the end."""
    try:
        yield server
    finally:
        server.close()


def run_example(server: Any, test: str, body) -> None:
    """Run one generated input: fresh process if needed, the input's own checks, then sync.
    ``server``: a FuzzServer, or any fuzzed process with the same ``begin``, ``dead``,
    ``check_alive`` and ``sync`` (the ACP fuzz's agent)."""
    COUNTS[test] = COUNTS.get(test, 0) + 1
    server.begin()
    try:
        body()
    except ServerDied:
        raise
    except BaseException:
        if server.dead():
            server.check_alive()  # name the death rather than the symptom
        raise
    server.sync()


__all__ = ["COUNTS", "OUTCOMES", "ERROR_CODES", "FuzzServer", "OPERATE_TIMEOUT", "REQUEST_TIMEOUT", "RpcError",
           "SYNC_TIMEOUT", "encode", "frame", "fuzz_server_fixture", "has_traceback", "profile",
           "run_example", "sane", "pytest"]
