"""What the command-line test files share: the real CLI run with its stdin closed at once, and the
check that a mistake is one clear line on stderr with exit code 2."""

from __future__ import annotations

import subprocess
import sys

SERVER = [sys.executable, "-m", "operate_sidecar.server"]


def cli(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run the real CLI with a stdin closed at once (a server that started anyway ends at EOF)."""
    return subprocess.run([*SERVER, *args], input="", cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The one line a mistake gives (after a usage line, for a flag's), checked: exit code 2,
    nothing on stdout, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith("usage:"), proc.stderr
    return lines[-1]
