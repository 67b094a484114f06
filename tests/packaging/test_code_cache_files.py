"""The code cache's folder (server/codecache.py, README "A code cache speeds up every spawn")
does not grow with every environment that ever ran the sidecar: each environment (a fresh
clone's ``.venv``, a throwaway venv of a test) has a file of its own there, ~1.7 MB. When a
process writes its file it removes the files of environments that no longer exist, those not
used for 30 days and the least recently used beyond 8; a process that uses its file marks it
used (once a day); and removing a file breaks no process using it. Real interpreters, real
venvs, in a cache folder of the test's own (``XDG_CACHE_HOME``)."""

from __future__ import annotations

import json
import marshal
import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operate_sidecar.server import codecache

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120
DAY = 86400

pytestmark = pytest.mark.timeout(300)

#: a server's use of the cache: read at start, lsprotocol's ~550 classes, then the write
USE = """
import json, sys
from operate_sidecar.server import codecache
codecache.install()
print("read", flush=True)
if "--wait" in sys.argv:
    sys.stdin.readline()
import lsprotocol.types as t
r = t.Range(start=t.Position(line=1, character=2), end=t.Position(line=3, character=4))
codecache.save()
print(json.dumps({"path": codecache.default_path(), "repr": repr(r), **codecache.stats()}))
"""


def env_for(xdg: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", codecache.ENV)}
    env["XDG_CACHE_HOME"] = str(xdg)
    return env


def use(python: str | Path, xdg: Path) -> dict:
    """One process of ``python`` using the cache under ``xdg``; what it says (its file, its stats)."""
    out = subprocess.run([str(python), "-c", USE], capture_output=True, text=True, env=env_for(xdg), cwd=ROOT,
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def make_venv(where: Path) -> Path:
    """A throwaway environment: no packages of its own, this one's through a ``.pth`` (the
    checkout is the working directory, so ``operate_sidecar`` is the repository's)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=TIMEOUT)
    py = where / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=TIMEOUT).stdout.strip()
    (Path(purelib) / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return py


def cache_file(folder: Path, name: str, prefix: str | None, age_days: float = 0) -> Path:
    """A cache file as a process of environment ``prefix`` writes it (None: an older file, which
    does not record it), last used ``age_days`` ago."""
    entries = {b"exec\x000\x00<attrs generated methods x.C>": (b"h" * 20, marshal.dumps(compile("1", "x", "exec")))}
    if prefix is not None:
        entries[codecache.PREFIX_KEY] = (os.fsencode(prefix), b"")
    path = folder / f"{codecache.FILE_PREFIX}{name}{codecache.FILE_SUFFIX}"
    path.write_bytes(marshal.dumps(entries))
    path.chmod(0o600)
    when = time.time() - age_days * DAY
    os.utime(path, (when, when))
    return path


def recorded_prefix(path: Path) -> str:
    return os.fsdecode(marshal.loads(path.read_bytes())[codecache.PREFIX_KEY][0])


def test_the_file_of_a_deleted_environment_is_removed_when_another_writes_its_own(tmp_path):
    xdg = tmp_path / "xdg"
    venv = tmp_path / "venv"
    theirs = Path(use(make_venv(venv), xdg)["path"])
    assert theirs.parent == xdg / "operate-sidecar" and recorded_prefix(theirs) == str(venv)
    shutil.rmtree(venv)                       # the environment is gone, its file is not (yet)
    folder = theirs.parent
    live_env = tmp_path / "live-env"
    live_env.mkdir()
    live = cache_file(folder, "live", str(live_env), age_days=2)
    older = cache_file(folder, "older-format", None, age_days=2)
    unused = cache_file(folder, "unused", str(live_env), age_days=codecache.UNUSED_DAYS + 1)
    other = folder / "notes.txt"
    other.write_text("not a cache file")
    target = cache_file(tmp_path, "target", None, age_days=90)
    (folder / f"{codecache.FILE_PREFIX}link{codecache.FILE_SUFFIX}").symlink_to(target)

    mine = use(sys.executable, xdg)          # this environment writes its file: the folder is pruned
    own = Path(mine["path"])
    assert mine["added"] > 500 and own.is_file() and recorded_prefix(own) == sys.prefix, mine
    assert not theirs.exists() and not unused.exists()
    assert live.exists() and older.exists() and other.exists() and target.exists()
    assert (folder / f"{codecache.FILE_PREFIX}link{codecache.FILE_SUFFIX}").is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [own.name, live.name, older.name, other.name, f"{codecache.FILE_PREFIX}link{codecache.FILE_SUFFIX}"])


def test_at_most_keep_files_stay_the_least_recently_used_go(tmp_path):
    xdg = tmp_path / "xdg"
    folder = xdg / "operate-sidecar"
    folder.mkdir(parents=True, mode=0o700)
    n = codecache.KEEP_FILES + 2
    files = [cache_file(folder, f"env{i}", str(tmp_path), age_days=1 + i) for i in range(n)]  # env0 newest
    own = Path(use(sys.executable, xdg)["path"])
    left = sorted(p for p in folder.iterdir() if p != own)
    assert left == sorted(files[:codecache.KEEP_FILES - 1]), left   # with its own: KEEP_FILES in all


def test_a_file_in_use_is_marked_used_once_a_day_and_not_written(tmp_path):
    xdg = tmp_path / "xdg"
    own = Path(use(sys.executable, xdg)["path"])
    data = own.read_bytes()
    hours_ago = time.time() - 3600
    os.utime(own, (hours_ago, hours_ago))
    second = use(sys.executable, xdg)         # nothing new: no write, and used within the day: no touch
    assert second["added"] == 0 and second["hits"] > 500, second
    assert own.stat().st_mtime == pytest.approx(hours_ago, abs=1)
    days_ago = time.time() - 2 * DAY
    os.utime(own, (days_ago, days_ago))
    assert use(sys.executable, xdg)["added"] == 0
    assert own.stat().st_mtime > time.time() - 600  # marked used: not the least recently used
    assert own.read_bytes() == data                # and not written


def test_removing_the_file_of_a_running_process_breaks_nothing(tmp_path):
    xdg = tmp_path / "xdg"
    own = Path(use(sys.executable, xdg)["path"])
    stale = time.time() - (codecache.UNUSED_DAYS + 1) * DAY
    os.utime(own, (stale, stale))
    running = subprocess.Popen([sys.executable, "-c", USE, "--wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env_for(xdg), cwd=ROOT)
    try:
        assert running.stdout.readline() == "read\n"   # it has read its file (not used for 31 days) ...
        use(make_venv(tmp_path / "venv"), xdg)          # ... another environment writes its own: pruned
        assert not own.exists()
        out, err = running.communicate("go\n", timeout=TIMEOUT)
    finally:
        if running.poll() is None:
            running.kill()
            running.wait(10)
    assert running.returncode == 0, err
    said = json.loads(out.splitlines()[-1])
    # every class came from what it had read, and works
    assert said["hits"] > 500 and said["added"] == 0 and said["repr"] == "1:2-3:4", said


def test_a_cache_file_someone_else_may_write_is_never_read_to_be_pruned_and_is_kept(tmp_path):
    """The files of other environments are read (to find theirs) only as the cache itself is
    read: one that someone else may write could hold marshal data made to crash the writer."""
    xdg = tmp_path / "xdg"
    folder = xdg / "operate-sidecar"
    folder.mkdir(parents=True, mode=0o700)
    gone = str(tmp_path / "gone-env")                       # an environment that does not exist
    readable = cache_file(folder, "ours-only", gone, age_days=2)
    writable = {mode: cache_file(folder, f"mode-{mode:o}", gone, age_days=2) for mode in (0o620, 0o602, 0o666)}
    for mode, path in writable.items():
        path.chmod(mode)
    use(sys.executable, xdg)
    assert not readable.exists()                           # read: its environment is gone
    for mode, path in writable.items():                   # not read: kept, as one whose environment is unknown
        assert path.exists() and path.stat().st_mode & 0o777 == mode, oct(mode)


#: ``codecache.prune`` with the folder's cache file ``victim`` swapped for a FIFO right after the
#: folder was scanned, before its environment is read
PRUNE_WITH_A_FIFO_SWAPPED_IN = """
import json, os, sys
from operate_sidecar.server import codecache
folder, own, victim = sys.argv[1:4]
real_scandir = os.scandir


class SwapAfterScan:
    def __init__(self, directory):
        self.it = real_scandir(directory)

    def __enter__(self):
        return self.it.__enter__()

    def __exit__(self, *exc):
        self.it.__exit__(*exc)
        os.unlink(victim)
        os.mkfifo(victim, 0o600)


os.scandir = SwapAfterScan
print(json.dumps(codecache.prune(folder, own)))
"""


def test_a_fifo_swapped_in_after_the_scan_does_not_block_the_writer(tmp_path):
    folder = tmp_path / "operate-sidecar"
    folder.mkdir(mode=0o700)
    own = folder / f"{codecache.FILE_PREFIX}own{codecache.FILE_SUFFIX}"
    victim = cache_file(folder, "swapped", str(tmp_path / "gone-env"), age_days=2)
    # the open of a FIFO with no writer blocks for ever: a bounded run, not a hung writer thread
    out = subprocess.run([sys.executable, "-c", PRUNE_WITH_A_FIFO_SWAPPED_IN, str(folder), str(own), str(victim)],
                         capture_output=True, text=True, env=env_for(tmp_path / "xdg"), cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []   # not read, so not removed
    assert victim.is_fifo()
