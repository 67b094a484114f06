"""What the set-up (`$(STAMP)`, run by `make demo` and `make test` when `pyproject.toml` or
`setup.py` changed) says about compiling llama.cpp: only when it is about to be compiled (not
installed yet, another version), not on every reinstall where nothing compiles. The real `make`
runs the real recipe, on a venv path of the test's own whose `python` is a stand-in: it logs
what it was asked, and runs the recipe's checks of the installed llama-cpp-python with this
interpreter against a stand-in `llama_cpp` (not installed, or of a given version). A stand-in
`uname` makes the machine another one where a test says so."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make") or "make"
#: the version pyproject.toml pins (what the recipe compares the installed one with)
PINNED = re.search(r"llama-cpp-python==([0-9.]+)", (ROOT / "pyproject.toml").read_text()).group(1)


def setup_run(tmp_path: Path, installed: bool, version: str = PINNED,
              machine: str | None = None) -> tuple[str, list[str]]:
    """The set-up's output and what it asked `python`, with llama-cpp-python ``version``
    installed (or not), on this machine or one whose ``uname -m`` is ``machine``."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "python.log"
    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        f"__version__ = {version!r}\ndef llama_print_system_info():\n    return b'AVX2 = 1 | AMX_INT8 = 0 |'\n"
        if installed else "raise ImportError('llama_cpp is not installed')\n")
    python = venv / "bin" / "python"
    # `-c ...`: the recipe's checks of the installed llama_cpp, run against the stand-in (no
    # site-packages: the real one is not seen); anything else (pip) succeeds
    python.write_text(f'#!/bin/sh\necho "python $*" >> {log}\n'
                      f'case "$1" in -c) PYTHONPATH={fake.parent} exec {sys.executable} -S "$@" ;; esac\nexit 0\n')
    python.chmod(0o755)
    env = dict(os.environ)
    if machine is not None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "uname").write_text(f"#!/bin/sh\necho {machine}\n")
        (bin_dir / "uname").chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run([MAKE, "-s", "-C", str(ROOT), f"VENV={venv}", f"{venv}/.installed-stamp"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (venv / ".installed-stamp").exists()
    return out.stdout + out.stderr, log.read_text().splitlines()


def test_a_reinstall_where_llama_cpp_is_installed_says_nothing_of_compiling_it(tmp_path):
    said, calls = setup_run(tmp_path, installed=True)
    assert "llama.cpp" not in said and "minutes" not in said, said
    assert said.splitlines() == [f">> installing operate-sidecar and its dependencies into {tmp_path / 'venv'}"]
    assert not any("llama-cpp-python==" in c for c in calls), calls   # nothing compiled
    assert calls[-1] == "python -m pip install -q -e .[test]", calls


def test_a_first_install_says_llama_cpp_is_compiled_and_how_long_that_takes(tmp_path):
    said, calls = setup_run(tmp_path, installed=False)
    lines = [ln for ln in said.splitlines() if "llama.cpp" in ln]
    assert len(lines) == 1 and "6 to 15 minutes on 2 cores" in lines[0], said
    if platform.machine() == "x86_64":   # compiled by the recipe itself, without AMX
        assert lines[0].startswith(">> compiling llama-cpp-python "), lines
        assert any("llama-cpp-python==" in c for c in calls), calls
    else:                                # compiled by the install of the package's dependencies
        assert lines[0].startswith(">> (llama-cpp-python compiles llama.cpp"), lines


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_another_version_installed_says_it_is_compiled_on_any_machine(tmp_path, machine):
    said, calls = setup_run(tmp_path, installed=True, version="0.0.1", machine=machine)
    lines = [ln for ln in said.splitlines() if "llama.cpp" in ln]
    assert len(lines) == 1 and "6 to 15 minutes on 2 cores" in lines[0], said
    if machine == "x86_64":   # compiled by the recipe itself, without AMX
        assert lines[0].startswith(">> compiling llama-cpp-python "), lines
        assert any("llama-cpp-python==" in c for c in calls), calls
    else:                     # compiled by the install of the package's dependencies (the pinned version)
        assert lines[0].startswith(">> (llama-cpp-python compiles llama.cpp"), lines
        assert not any("llama-cpp-python==" in c for c in calls), calls
    assert calls[-1] == "python -m pip install -q -e .[test]", calls


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_pinned_version_installed_says_nothing_of_compiling_on_any_machine(tmp_path, machine):
    said, calls = setup_run(tmp_path, installed=True, machine=machine)
    assert said.splitlines() == [f">> installing operate-sidecar and its dependencies into {tmp_path / 'venv'}"]
    assert not any("llama-cpp-python==" in c for c in calls), calls
