"""A lean asyncio JSON-RPC client for stdio servers.

Two framings: "lsp" (Content-Length headers, LSP base protocol) and "ndjson"
(one JSON object per line, as MCP's stdio transport).  Stdlib only; kept small
so that the client is not what the benchmark measures.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

_dumps = json.JSONEncoder(separators=(",", ":")).encode
_loads = json.loads


class RpcError(Exception):
    def __init__(self, error: dict):
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.error = error


class Conn:
    """One spawned server process and the JSON-RPC session over its stdio."""

    def __init__(self, framing: str, on_notification: Callable[[dict], None] | None = None):
        assert framing in ("lsp", "ndjson")
        self.framing = framing
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[Any, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.on_notification = on_notification
        self.server_requests: list[dict] = []
        self._reader_task: asyncio.Task | None = None
        self.closed_reason: str | None = None
        # LSP framing only: bodies starting with raw_prefix are kept undecoded in raw_bodies
        self.raw_prefix: bytes | None = None
        self.raw_bodies: list[bytes] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def spawn(self, argv: list[str], *, cwd: str | None = None, env: dict | None = None,
                    stderr_path: Path | None = None) -> None:
        err = open(stderr_path, "ab") if stderr_path else asyncio.subprocess.DEVNULL
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=err, cwd=cwd, env=env, limit=64 * 1024 * 1024)
        finally:
            if stderr_path:
                err.close()
        self._reader_task = asyncio.ensure_future(self._read_loop())

    # -- wire -------------------------------------------------------------
    def _frame(self, msg: dict) -> bytes:
        body = _dumps(msg).encode()
        if self.framing == "lsp":
            return b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        return body + b"\n"

    async def _read_line(self) -> dict | None:
        """ndjson framing: the next message (None at EOF). LSP framing: _read_frames."""
        rd = self.proc.stdout
        while True:
            line = await rd.readline()
            if not line:
                return None
            if line.strip():
                return _loads(line)

    async def _read_frames(self):
        """LSP framing: every complete frame from each read, no await per message
        (the client's per-message cost otherwise bounded the $/progress run)."""
        rd = self.proc.stdout
        buf = b""
        while True:
            data = await rd.read(1 << 20)
            if not data:
                if buf.strip():
                    raise asyncio.IncompleteReadError(buf, None)
                return
            buf = buf + data if buf else data
            pos = 0
            out = []
            while True:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                length = None
                for line in buf[pos:end].split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length is None:
                    raise ValueError(f"no Content-Length in {buf[pos:end][:200]!r}")
                start = end + 4
                if len(buf) < start + length:
                    break
                body = buf[start:start + length]
                if self.raw_prefix is not None and body.startswith(self.raw_prefix):
                    self.raw_bodies.append(body)  # decoded by the caller later, outside its clock
                else:
                    out.append(_loads(body))
                pos = start + length
            buf = buf[pos:]
            yield out

    async def _read_loop(self) -> None:
        try:
            if self.framing == "lsp":
                async for msgs in self._read_frames():
                    for msg in msgs:
                        if isinstance(msg, list):  # batch answer
                            for m in msg:
                                self._dispatch(m)
                        else:
                            self._dispatch(msg)
                self.closed_reason = "server closed stdout"
                return
            while True:
                msg = await self._read_line()
                if msg is None:
                    self.closed_reason = "server closed stdout"
                    break
                if isinstance(msg, list):  # batch answer
                    for m in msg:
                        self._dispatch(m)
                else:
                    self._dispatch(msg)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            self.closed_reason = f"read error: {e!r}"
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(self.closed_reason or "closed"))
            self.pending.clear()

    def _dispatch(self, msg: dict) -> None:
        if "method" not in msg:
            fut = self.pending.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                if "error" in msg and msg["error"] is not None:
                    fut.set_exception(RpcError(msg["error"]))
                else:
                    fut.set_result(msg.get("result"))
            return
        if "id" in msg:  # server -> client request: deny / not supported
            self.server_requests.append(msg)
            if self.closed_reason is not None:
                return
            if msg["method"] == "requestToolPermission":
                self._write({"jsonrpc": "2.0", "id": msg["id"], "result": {"decision": "deny_once"}})
            else:
                self._write({"jsonrpc": "2.0", "id": msg["id"],
                             "error": {"code": -32601, "message": "not supported by bench client"}})
            return
        if self.on_notification is not None:
            self.on_notification(msg)

    def _write(self, msg: dict) -> None:
        if self.closed_reason is not None or self.proc.stdin.is_closing():
            raise ConnectionError(self.closed_reason or "stdin closed")
        self.proc.stdin.write(self._frame(msg))

    # -- api --------------------------------------------------------------
    def send_request(self, method: str, params: Any = None) -> asyncio.Future:
        rid = next(self.ids)
        msg = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self._write(msg)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        return fut

    async def request(self, method: str, params: Any = None, timeout: float | None = None) -> Any:
        fut = self.send_request(method, params)
        if timeout is None:
            return await fut
        return await asyncio.wait_for(fut, timeout)

    def notify(self, method: str, params: Any = None) -> None:
        msg = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self._write(msg)

    async def drain(self) -> None:
        await self.proc.stdin.drain()

    def rss_kib(self) -> int | None:
        return rss_kib(self.proc.pid)

    async def close(self, timeout: float = 3.0) -> int | None:
        """Close stdin (EOF) and wait; kill the process if it lingers."""
        if self.proc is None:
            return None
        try:
            if self.proc.returncode is None:
                self.proc.stdin.close()
        except Exception:
            pass
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            await self.proc.wait()
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except (asyncio.CancelledError, Exception):
                pass
        return self.proc.returncode


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children, their children, ...), from ``/proc/*/stat``."""
    parent_of: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        parent_of[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        out += kids
        todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it, and the process group of each of them (what
    a server in a session of its own started and has since left orphaned). Each process found
    is stopped (SIGSTOP) first, and the search repeated until it finds no more, so that none
    starts another one unseen meanwhile."""
    seen: list[int] = []
    tried: set[int] = set()
    new = [pid]
    while new:
        for p in new:
            tried.add(p)
            try:
                os.kill(p, signal.SIGSTOP)
                seen.append(p)
            except ProcessLookupError:
                pass
        new = [c for c in descendants(pid) if c not in tried]
    for p in seen:
        try:
            if os.getpgid(p) == p:
                os.killpg(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def tree_rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` plus that of every process under it (a server's helpers: ours starts a
    ``sh`` reaper for its tools once its core loads)."""
    own = rss_kib(pid)
    if own is None:
        return None
    return own + sum(rss_kib(c) or 0 for c in descendants(pid))


async def settled_rss_kib(pid: int, at_least_s: float = 1.0, at_most_s: float = 5.0,
                          tree: bool = False) -> int | None:
    """A process's RSS once it stops moving: after ``at_least_s``, two samples 0.25 s apart
    within 128 KiB (or the last sample after ``at_most_s`` more). ``tree``: with the processes
    under it (``tree_rss_kib``)."""
    sample = tree_rss_kib if tree else rss_kib
    await asyncio.sleep(at_least_s)
    last = sample(pid)
    deadline = time.monotonic() + at_most_s
    while last is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = sample(pid)
        if now is None or abs(now - last) < 128:
            return now
        last = now
    return last


def now() -> float:
    return time.perf_counter()
