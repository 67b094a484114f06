"""Installable next to anything: the wheel's only top-level import package is
``operate_sidecar``, and a project that has its own ``server`` and ``protocol`` packages
installs it, runs the console script and uses the pytest plugin without either side
shadowing the other. Offline: the wheel is built without build isolation and installed
with ``--no-deps`` into a fresh venv that sees this venv's dependencies through a ``.pth``."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240
SOURCES = ("setup.py", "pyproject.toml", "README.md", "operate_sidecar", "server", "protocol", "clients")


def run(*argv: str | os.PathLike[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=TIMEOUT, **kw)
    assert out.returncode == 0, f"{argv}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (the work tree gets no build/ or egg-info)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("node_modules", "__pycache__", "*.pyc", "out", "*.vsix", ".vscode-test")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        else:
            shutil.copy2(p, src / name)
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
        "-w", dist, src)
    (whl,) = dist.glob("operate_sidecar-*.whl")
    return whl


def test_the_wheel_installs_one_top_level_import_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"operate_sidecar"}
    assert len([t for t in tops if t.endswith(".dist-info")]) == 1
    for needed in ("operate_sidecar/server/__main__.py", "operate_sidecar/protocol/schema.json",
                   "operate_sidecar/clients/python/client.py", "operate_sidecar/pytest_plugin.py",
                   "operate_sidecar/server/script/runner.py"):
        assert needed in names
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry_points = zipfile.ZipFile(wheel).read(meta).decode()
    assert "operate-sidecar = operate_sidecar.server.__main__:main" in entry_points
    assert "[pytest11]" in entry_points and "operate_sidecar = operate_sidecar.pytest_plugin" in entry_points


PROJECT_TEST = '''
import pytest

import protocol
import server


def test_the_project_keeps_its_own_server_and_protocol():
    assert server.MINE == "the project's server" and protocol.MINE == "the project's protocol"
    import operate_sidecar.server, operate_sidecar.protocol
    assert "site-packages" in operate_sidecar.server.__file__
    assert operate_sidecar.protocol.__file__ != protocol.__file__


@pytest.mark.asyncio
@pytest.mark.sidecar(settings={"models": {"m": {"provider": "scripted", "responses": ["hello"]}}})
async def test_the_sidecar_fixture_runs_the_installed_server(sidecar):
    assert sidecar.initialize_result["capabilities"]["models"] == ["m"]
    branch = (await sidecar.request("createBranch"))["branchId"]
    out = await sidecar.request("operate", {"branchId": branch, "instruction": "hi", "skipValidation": True})
    assert out["result"] == "hello"
'''


def make_project(root: Path) -> Path:
    for pkg in ("server", "protocol"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f'MINE = "the project\'s {pkg}"\n')
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.pytest.ini_options]
        asyncio_default_fixture_loop_scope = "function"
        """))
    (root / "test_project.py").write_text(PROJECT_TEST)
    return root


def _child_env() -> dict[str, str]:
    """This environment for the new venv's processes: without this one's path settings, and
    without ``PYTEST_ADDOPTS`` (the inner pytest runs the command written here, whatever the
    outer one was given); with the code cache off: a throwaway venv would leave its own ~1.7 MB
    file in the user's cache folder at every run (server/codecache.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS")}
    env["OPERATE_SIDECAR_CODE_CACHE"] = "off"
    return env


def _cache_file(py: Path, cwd: Path) -> Path:
    """The code cache file the venv's sidecar would write were the cache on (its default one)."""
    env = {k: v for k, v in _child_env().items() if k != "OPERATE_SIDECAR_CODE_CACHE"}
    return Path(run(py, "-c", "from operate_sidecar.server import codecache; print(codecache.default_path())",
                    env=env, cwd=cwd).stdout.strip())


def test_a_project_with_its_own_server_and_protocol_packages_uses_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    # the dependencies come from this venv (appended after the new venv's own site-packages, so the
    # wheel's files are found first; .pth files of this venv, such as an editable install, are not run)
    new_site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (new_site / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel)
    project = make_project(tmp_path / "project")
    env = _child_env()

    # the console script, from inside the project: initialize + ping over stdio
    from operate_sidecar.clients.python.client import SidecarClient

    with SidecarClient(argv=[str(venv / "bin" / "operate-sidecar")], env=env, cwd=str(project),
                       stderr=subprocess.DEVNULL) as c:
        init = c.request("initialize", {"clientInfo": {"name": "packaging"}}, timeout=60)
        assert init["serverInfo"]["name"] == "operate-sidecar" and init["protocolVersion"] == 1
        assert c.request("ping", timeout=30) == {}
        assert c.close() == 0
    where = run(py, "-c", "import operate_sidecar.server as s; print(s.__file__)", env=env, cwd=project).stdout
    assert where.startswith(str(new_site)), where

    # the pytest plugin, found through the installed entry point, next to the project's packages
    out = subprocess.run([str(py), "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout=120"],
                         cwd=project, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout
    # the venv goes with tmp_path: it left no code cache file behind in the user's cache folder
    cache = _cache_file(py, project)
    assert not cache.exists(), cache


def test_the_checkout_runs_its_tests_without_being_installed(tmp_path):
    """A fresh clone with only the dependencies installed (no editable install of the project):
    ``operate_sidecar.*`` resolves to the repository's folders, and the test packages (``tests/
    clients`` is a package named ``clients``) shadow nothing the tests import."""
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    new_site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (new_site / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")  # .pth files there are not run
    env = _child_env()
    elsewhere = run(py, "-c", "import importlib.util as u; print(u.find_spec('operate_sidecar'))", env=env,
                    cwd=tmp_path).stdout
    assert elsewhere.strip() == "None"             # really not installed in this venv
    where = run(py, "-c", "import operate_sidecar.server.rpc, operate_sidecar.clients.python.client as c; "
                          "print(c.__file__)", env=env, cwd=ROOT).stdout
    assert where.strip() == str(ROOT / "clients" / "python" / "client.py")
    out = subprocess.run([str(py), "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout=120",
                          "tests/clients/test_client.py", "tests/rpc/test_lifecycle.py", "-k",
                          "initialize or ping or client"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.strip().splitlines()[-1]  # e.g. "20 passed, 18 deselected in 25.29s"
    assert re.fullmatch(r"\d+ passed(, \d+ deselected)?(, \d+ warnings?)? in [\d.]+s( \([\d:]+\))?", summary), out.stdout
    cache = _cache_file(py, ROOT)   # no code cache file of this throwaway venv in the user's cache folder
    assert not cache.exists(), cache
