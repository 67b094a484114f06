"""`make system-deps` for root, for a developer with sudo and for one without: which way the
Makefile installs missing Debian packages, and what it says when it cannot. The real `make`
runs the real recipe; `id`, `sudo` and `apt-get` are stand-ins on a PATH of their own (the
package manager itself cannot be exercised here without changing the machine), and they
only log the command they were given."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make") or "make"   # `make test` runs these: make is there


def stand_ins(tmp_path: Path, uid: int, sudo: bool) -> tuple[dict, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("sh", "env", "cat"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    scripts = {"id": f"#!/bin/sh\necho {uid}\n", "apt-get": f'#!/bin/sh\necho "apt-get $*" >> {log}\n'}
    if sudo:
        scripts["sudo"] = f'#!/bin/sh\necho "sudo $*" >> {log}\nexec "$@"\n'
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return env, log


def system_deps(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([MAKE, "-s", "-C", str(ROOT), "system-deps",
                           "SYSTEM_PACKAGES=fake-editor:/nonexistent/fake-editor fake-tool:fake-tool-cmd"],
                          env=env, capture_output=True, text=True, timeout=60)


def test_a_developer_with_sudo_installs_through_sudo(tmp_path):
    env, log = stand_ins(tmp_path, uid=1000, sudo=True)
    out = system_deps(env)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("sudo env DEBIAN_FRONTEND=noninteractive apt-get")
    assert calls[-1].endswith("install -y -q --no-install-recommends fake-editor fake-tool")
    assert "apt-get -o DPkg::Lock::Timeout=600 update -q" in calls


def test_root_installs_with_apt_get_directly(tmp_path):
    env, log = stand_ins(tmp_path, uid=0, sudo=False)
    out = system_deps(env)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert not any(c.startswith("sudo") for c in calls)
    assert calls[-1] == "apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends fake-editor fake-tool"


def test_without_root_or_sudo_it_names_what_is_missing_and_that_those_tests_will_fail(tmp_path):
    env, log = stand_ins(tmp_path, uid=1000, sudo=False)
    out = system_deps(env)
    assert out.returncode == 0
    assert not log.exists()                       # nothing was attempted
    assert "missing system packages: fake-editor fake-tool" in out.stderr
    assert "client tests FAIL" in out.stderr and "`make check` needs none of them" in out.stderr


def test_nothing_missing_does_nothing(tmp_path):
    env, log = stand_ins(tmp_path, uid=1000, sudo=True)
    out = subprocess.run([MAKE, "-s", "-C", str(ROOT), "system-deps", "SYSTEM_PACKAGES=present:sh"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == out.stderr == "" and not log.exists()


def test_on_x86_64_the_venvs_llama_cpp_is_compiled_without_amx_kernels():
    """The set-up (`$(STAMP)`) compiles llama-cpp-python without llama.cpp's AMX kernels on
    x86-64: they crash on the embedded model's Q4 weights, in the sidecar's in-process model and
    in the `llama_cpp.server` and `llm` processes the model tests start. (On other machines there
    is nothing to leave out.)"""
    import platform

    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    if platform.machine() == "x86_64":
        assert b"AVX" in info  # compiled for this machine, not a bare baseline
        assert b"AMX_INT8 = 1" not in info, info
    recipe = subprocess.run([MAKE, "-n", "-C", str(ROOT), "-W", "pyproject.toml", ".venv/.installed-stamp"],
                            capture_output=True, text=True, timeout=60).stdout
    assert 'CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"' in recipe
    assert "llama-cpp-python==" + llama_cpp.__version__ in recipe


def test_make_tests_run_ends_at_once_when_a_test_process_crashes_and_says_what_did_not_run(tmp_path):
    """`make test`'s own pytest command (from `make -n`), on files that crash a test process:
    pytest-xdist 3.8 with `--dist loadfile` would replace the worker and wait for ever (until
    `TEST_TIMEOUT` interrupts it); the run ends by itself instead, failing, naming the test it
    crashed in and how many tests of the crashed worker's files did not run (the summary hook of
    tests/conftest.py, copied beside the files)."""
    import shlex

    dry = subprocess.run([MAKE, "-n", "-s", "-C", str(ROOT), "test", "TEST_TIMEOUT=100s"],
                         capture_output=True, text=True, timeout=60)
    command = shlex.split([line for line in dry.stdout.splitlines() if " pytest " in line][-1])
    assert command[-1] == "tests", command
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_1_crash.py").write_text(
        "import os\n\ndef test_before():\n    pass\n\ndef test_crash():\n    os._exit(1)\n\n"
        "def test_after():\n    pass\n")
    for i in (2, 3, 4):
        (tmp_path / f"test_{i}_fine.py").write_text("def test_fine():\n    pass\n")
    run = subprocess.run([*command[:-1], str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=150)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out              # failed, not interrupted by the time-out (124)
    assert "KeyboardInterrupt" not in out, out   # (what TEST_TIMEOUT's interrupt prints)
    assert "crashed while running" in out and "test_1_crash.py::test_crash" in out, out
    assert "tests collected did not run" in out and "of the 6 tests collected" in out, out
