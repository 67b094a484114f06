"""protocol/README.md's Python snippets run as written, each in a fresh interpreter outside the
checkout (the installed ``operate_sidecar.protocol``, as a reader would run them): a snippet that
fails (a name it never imported, a variable it never set) tells the reader nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "protocol" / "README.md").read_text(encoding="utf-8")
SNIPPETS = re.findall(r"^```python\n(.*?)^```$", README, re.S | re.M)


def test_there_are_snippets():
    assert SNIPPETS


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_a_snippet_runs_as_written(code, tmp_path):
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{code}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
