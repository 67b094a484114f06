"""The ``operate-sidecar`` command line as a user meets it: a common mistake (a config file that is
not TOML, a PID that is not one) is one clear line on stderr and exit code 2, never a traceback or
a server that starts and silently ignores the flag; ``--help`` names what it accepts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from operate_sidecar.server.rpc.settings import DEFAULTS

pytestmark = pytest.mark.timeout(60)


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """Run the real CLI; its stdin is a pipe closed at once (a server that started anyway ends at EOF)."""
    return subprocess.run([sys.executable, "-m", "operate_sidecar.server", *args], input="", cwd=cwd,
                          capture_output=True, text=True, timeout=45)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith("usage:"), proc.stderr
    return lines[-1]


@pytest.mark.parametrize("content, why", [
    (b"x = [\n", "is not a TOML file: "),
    (b'{"models": {}}\n', "is not a TOML file: "),
    (b"\xff\xfe m = 1\n", "is not a TOML file: it is not UTF-8 text"),
])
def test_a_config_file_that_is_not_toml_is_named_as_such(tmp_path, content, why):
    (tmp_path / "settings.toml").write_bytes(content)
    line = one_line_error(cli("--config", "settings.toml", cwd=tmp_path))
    assert line.startswith("operate-sidecar: bad configuration: settings.toml " + why), line


@pytest.mark.parametrize("path, why", [("missing.toml", "No such file or directory"), (".", "Is a directory")])
def test_a_config_file_that_cannot_be_read_is_one_plain_line(tmp_path, path, why):
    line = one_line_error(cli("--config", path, cwd=tmp_path))
    assert line == f"operate-sidecar: bad configuration: cannot read {path}: {why}", line


@pytest.mark.parametrize("pid", ["0", "-5", "abc"])
def test_a_client_process_id_that_is_no_process_id_is_refused(pid):
    # 0 names the server's own process group to kill(2): the watchdog never fired; a negative
    # number made the server exit at once, as if the client had died
    line = one_line_error(cli(f"--client-process-id={pid}"))
    assert line == f"operate-sidecar: error: argument --client-process-id: not a process id: {pid!r}" + (
        " (a PID is a positive integer)" if pid != "abc" else ""), line


def test_help_names_every_setting_a_config_file_may_hold():
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    config_help = " ".join(proc.stdout.split("\n  --config FILE", 1)[1].split("\n  --state-dir", 1)[0].split())
    missing = [key for key in DEFAULTS if key not in config_help]
    assert not missing, (missing, config_help)


def test_version_prints_the_installed_version_on_stdout_and_starts_no_server():
    """``--version`` (what an editor's health check or a bug report asks first): the version the
    installed distribution has, the one ``initialize`` reports as ``serverInfo.version``."""
    import importlib.metadata

    import operate_sidecar
    from operate_sidecar.server import __version__

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
    installed = importlib.metadata.version("operate-sidecar")
    assert proc.stdout == f"operate-sidecar {installed}\n", proc.stdout
    assert __version__ == operate_sidecar.__version__ == installed
