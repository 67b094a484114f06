"""Fixtures for the provider tests: the real SmolLM2 GGUF, a real
``llama_cpp.server`` on 127.0.0.1, and helpers. Nothing here is mocked."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tied import popen_tied

SERVER_START_TIMEOUT_S = 90.0


@pytest.fixture(scope="session")
def gguf_path() -> str:
    from operate_sidecar.server.models.local import default_model_path

    return default_model_path()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    return free_port()


class LlamaServer:
    """``python -m llama_cpp.server`` serving the GGUF on a free loopback port."""

    def __init__(self, gguf: str, log_path: Path) -> None:
        self.gguf = gguf
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._tie = None  # (ties the server's group to this process: tests/tied.py)

    def start(self) -> "LlamaServer":
        self._log = open(self.log_path, "wb")
        self.proc, self._tie = popen_tied(
            [
                sys.executable, "-m", "llama_cpp.server",
                "--model", self.gguf,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--n_ctx", "4096",  # an edit session's second round: ~1,800 tokens and the first reply
            ],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited early: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2) as r:
                    if json.load(r).get("data"):
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama_cpp.server did not answer /v1/models within {SERVER_START_TIMEOUT_S}s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        if self._tie is not None:
            self._tie.close()
            self._tie = None
        if getattr(self, "_log", None):
            self._log.close()


@pytest.fixture(scope="session")
def llama_server(gguf_path, tmp_path_factory):
    server = LlamaServer(gguf_path, tmp_path_factory.mktemp("llama-server") / "server.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_llama_server(gguf_path, tmp_path):
    """A server this test may stop."""
    server = LlamaServer(gguf_path, tmp_path / "server.log").start()
    try:
        yield server
    finally:
        server.stop()

