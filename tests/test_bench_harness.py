"""The benchmark harness itself (``bench/``): how it fails, stops and cleans up, not what it measures.

Each run here is the real ``python -m bench.run`` in a subprocess, with ``--out`` and ``--results-md``
pointing into the test's folder (the committed ``bench/RESULTS.md`` and ``bench/out`` are never
touched), ``TMPDIR`` set to a folder of the test's own (so that what the harness leaves there is
seen), and a marker in its environment that every process under it inherits (so that one left
running is found whatever session it started). Only what finishes in seconds is run: sections
that cannot start, runs stopped by a signal as soon as a server or runner is up, and one
partial run that measures the quickest contender and section (stdlib, edit: about 20 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from process_support import marked_processes

ROOT = Path(__file__).resolve().parents[1]
KNOWN = "stdlib, pygls, mcp, ours, lionagi, acp, store, edit, first"
SECTIONS = ("acp", "store", "edit", "first")


class Run:
    """Paths and environment of one harness run in ``base``."""

    def __init__(self, base: Path, **env: str) -> None:
        self.base = base
        self.out, self.tmp, self.md = base / "out", base / "tmp", base / "RESULTS.md"
        self.tmp.mkdir(parents=True)
        shutil.copy(ROOT / "bench" / "RESULTS.md", self.md)
        self.mark = uuid.uuid4().hex
        self.env = {**os.environ, "TMPDIR": str(self.tmp), "BENCH_TEST_MARK": self.mark, **env}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "bench.run", "--quick", "--no-setup", "--out", str(self.out),
                "--results-md", str(self.md), *args]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def processes(self) -> dict[int, str]:
        """Every live process (not a zombie) with this run's marker: pid -> command line."""
        return marked_processes(f"BENCH_TEST_MARK={self.mark}")

    def left_in_tmp(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir())

    def md_unchanged(self) -> bool:
        return self.md.read_bytes() == (ROOT / "bench" / "RESULTS.md").read_bytes()


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


# ------------------------------------------------------------ --only
def test_an_unknown_only_name_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    r = Run(tmp_path)
    p = r.run("--only", "stdlib,pygsl")

    assert p.returncode == 2, p.stderr
    assert "pygsl" in p.stderr and KNOWN in p.stderr
    assert not r.out.exists()
    assert r.md_unchanged()


# ------------------------------------------- sections that cannot start
@pytest.fixture(scope="module")
def missing_bin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, subprocess.CompletedProcess]:
    """Every section, with OPERATE_SIDECAR_BIN naming a program that does not exist; the markdown
    is written (into the copy). The --out folder holds an earlier run's results.json and files
    of the user's: a ``work`` folder (the name of the old fixed work folder in bench/out) and a
    log of its own."""
    base = tmp_path_factory.mktemp("missing-bin")
    r = Run(base, OPERATE_SIDECAR_BIN=str(base / "no-such-sidecar"))
    (r.out / "work" / "data" / "logs").mkdir(parents=True)
    (r.out / "work" / "data" / "logs" / "old.json").write_text("{}")
    (r.out / "logs").mkdir()
    (r.out / "logs" / "mine.stderr").write_text("the user's own\n")
    (r.out / "results.json").write_text("{}")
    return r, r.run("--only", ",".join(SECTIONS))


def test_sections_whose_sidecar_is_missing_are_unavailable_and_the_run_completes(missing_bin) -> None:
    r, p = missing_bin
    assert p.returncode == 0, p.stderr
    results = json.loads((r.out / "results.json").read_text())
    for name in SECTIONS:
        assert results[name] == {
            "unavailable": f"unavailable: OPERATE_SIDECAR_BIN={r.base / 'no-such-sidecar'} not found"}, name
    assert "Traceback" not in p.stderr


def test_sections_that_are_unavailable_keep_the_figures_they_had(missing_bin) -> None:
    r, p = missing_bin
    assert p.returncode == 0, p.stderr
    assert r.md_unchanged()


def test_a_run_leaves_no_work_folder_and_nothing_in_the_temp_folder(missing_bin) -> None:
    r, p = missing_bin
    assert p.returncode == 0, p.stderr
    assert r.left_in_tmp() == []


def test_a_folder_named_by_out_loses_nothing_the_run_did_not_write(missing_bin) -> None:
    r, p = missing_bin
    assert p.returncode == 0, p.stderr
    assert (r.out / "work" / "data" / "logs" / "old.json").read_text() == "{}", "the user's work folder is kept"
    assert (r.out / "logs" / "mine.stderr").read_text() == "the user's own\n"


def test_an_out_folder_of_someone_elses_files_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    r = Run(tmp_path)
    (r.out / "work").mkdir(parents=True)
    (r.out / "notes.txt").write_text("mine")

    p = r.run("--only", "stdlib")

    assert p.returncode == 2, p.stderr
    assert "--out" in p.stderr and "Traceback" not in p.stderr
    assert sorted(x.name for x in r.out.iterdir()) == ["notes.txt", "work"]
    assert list((r.out / "work").iterdir()) == []
    assert r.md_unchanged()


def test_only_bench_out_loses_its_old_work_folder_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/out (here a stand-in for it) is cleared of the old fixed work folder and of every
    old log; another folder only of the logs a run writes."""
    from bench import run

    default, mine = tmp_path / "default", tmp_path / "mine"
    for d in (default, mine):
        (d / "work").mkdir(parents=True)
        (d / "work" / "x").write_text("x")
        (d / "logs").mkdir()
        (d / "logs" / "old.stderr").write_text("old")
        (d / "logs" / "stdlib.stderr").write_text("old")
    monkeypatch.setattr(run, "OUT", default)

    run.prepare_out(default)
    run.prepare_out(mine)

    assert sorted(x.name for x in default.iterdir()) == ["logs"]
    assert list((default / "logs").iterdir()) == []
    assert (mine / "work" / "x").read_text() == "x"
    assert sorted(x.name for x in (mine / "logs").iterdir()) == ["old.stderr"]


# ------------------------------------------- a partial run that measures
@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, subprocess.CompletedProcess]:
    """``--only stdlib,edit`` with this checkout's server: a contender and one section (the
    quickest), measured for real; the markdown is written (into the copy)."""
    r = Run(tmp_path_factory.mktemp("partial"))
    return r, r.run("--only", "stdlib,edit", timeout=180)


def _parts(text: str) -> tuple[str, dict[str, str], str]:
    """(everything before the edit section, {"edit": the section}, everything after it)."""
    from bench.edit_bench import BEGIN, END

    head, rest = text.split(BEGIN, 1)
    body, tail = rest.split(END, 1)
    return head, {"edit": BEGIN + body + END}, tail


def test_a_partial_run_leaves_the_main_tables_and_unmeasured_sections_alone(partial) -> None:
    r, p = partial
    assert p.returncode == 0, p.stderr
    results = json.loads((r.out / "results.json").read_text())
    assert "summary" in results["edit"], results["edit"]
    old_head, old, old_tail = _parts((ROOT / "bench" / "RESULTS.md").read_text())
    head, new, tail = _parts(r.md.read_text())

    assert head == old_head, "the main tables and the sections before edit are as they were"
    assert tail.strip("\n") == old_tail.strip("\n"), "the sections after edit are as they were"
    assert new["edit"] != old["edit"]
    assert f"command: `python -m bench.run {' '.join(r.argv('--only', 'stdlib,edit')[3:])}`" in new["edit"]


def test_a_partial_runs_section_names_its_own_machine_and_date(partial) -> None:
    """The main tables above are another run's: the section gives the date and machine line its
    child harness recorded."""
    r, p = partial
    assert p.returncode == 0, p.stderr
    meta = json.loads((r.out / "results.json").read_text())["edit"]["meta"]
    _, new, _ = _parts(r.md.read_text())

    assert "see the machine line above" not in new["edit"]
    assert f"- date: {meta['date']};" in new["edit"]
    assert meta["machine"] in new["edit"] and "CPUs" in meta["machine"]


# ------------------------------------------------------------ report
def test_the_main_tables_take_the_notes_from_bench_and_name_the_out_folder(tmp_path: Path) -> None:
    """With ``--results-md`` elsewhere (no RESULTS_NOTES.md beside it) and ``--out`` elsewhere."""
    from bench.report import refresh_notes, write_markdown

    notes = (ROOT / "bench" / "RESULTS_NOTES.md").read_text().rstrip() + "\n"
    path = tmp_path / "RESULTS.md"
    write_markdown({"date": "2026-12-03T13:00:00+00:00", "command": "python -m bench.run", "ratios": []}, path,
                   tmp_path / "o")
    text = path.read_text()

    assert notes in text
    assert f"Raw figures: `{tmp_path / 'o' / 'results.json'}`." in text
    assert "bench/out" not in text.split(notes, 1)[1]

    first = notes.splitlines()[0]
    path.write_text(text.replace(notes, first + "\nan old text of the notes\n"))
    assert refresh_notes(path)
    assert path.read_text() == text


def test_a_sidecar_that_exits_at_start_is_unavailable_in_every_section(tmp_path: Path) -> None:
    bad = tmp_path / "bad-sidecar"
    bad.write_text("#!/bin/sh\necho 'bad-sidecar: refusing to start' >&2\nexit 3\n")
    bad.chmod(0o755)
    r = Run(tmp_path / "run", OPERATE_SIDECAR_BIN=str(bad))

    p = r.run("--only", ",".join(SECTIONS))

    assert p.returncode == 0, p.stderr
    results = json.loads((r.out / "results.json").read_text())
    for name in SECTIONS:
        assert results[name]["unavailable"].startswith("unavailable: "), (name, results[name])
    assert r.left_in_tmp() == []
    assert r.processes() == {}
    assert r.md_unchanged()


def test_the_acp_section_gives_up_soon_on_a_program_that_does_not_speak_acp(tmp_path: Path) -> None:
    """bench/README's self-test stand-in reads Content-Length frames: it never answers ACP's
    initialize, which is waited for 10 s (not 60)."""
    r = Run(tmp_path, OPERATE_SIDECAR_BIN=str(ROOT / "bench" / "peers" / "fake_sidecar.py"))

    p = r.run("--only", "acp", timeout=45)

    assert p.returncode == 1, p.stderr
    res = json.loads((r.out / "acp_results.json").read_text())
    assert "no initialize answer in 10 s" in res["unavailable"], res
    assert r.left_in_tmp() == []
    assert r.processes() == {}


# ------------------------------------------------------------ signals
def _start(r: Run, *args: str) -> tuple[subprocess.Popen, threading.Thread, list[str]]:
    p = subprocess.Popen(r.argv(*args), cwd=ROOT, env=r.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    lines: list[str] = []

    def read() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return p, reader, lines


def _short(procs: dict[int, str]) -> str:
    return f"{len(procs)} processes: " + "; ".join(c[:80] for c in list(procs.values())[:3])


def _stopped(r: Run, p: subprocess.Popen, reader: threading.Thread, lines: list[str], code: int,
             send) -> None:
    """``send()`` signals the harness: it then starts nothing more, exits with ``code`` (within
    60 s), having printed one line about it and no traceback, with nothing of it left running
    and nothing left in its temp folder."""
    before = set(r.processes())
    send()
    started: dict[int, str] = {}
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        started.update({pid: c for pid, c in r.processes().items() if pid not in before})
        time.sleep(0.05)
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        for pid in r.processes():
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"the harness went on after the signal, starting {_short(started)}")
    rc = p.wait()
    assert started == {}, f"measuring went on after the signal, starting {_short(started)}"
    left = r.processes()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert rc == code, lines
    assert left == {}, left
    reader.join(10)
    assert not any("Traceback" in ln for ln in lines), lines
    assert sum(ln.startswith(">> stopped by") for ln in lines) == 1, lines
    assert r.left_in_tmp() == []
    assert r.md_unchanged()


def test_ctrl_c_stops_a_run_during_the_store_section(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the whole process group) while the store section's servers
    run (they start in sessions of their own, out of the terminal's reach)."""
    r = Run(tmp_path)
    p, reader, lines = _start(r, "--only", "store,edit")
    _wait(lambda: any("operate-sidecar" in c for c in r.processes().values()), 60, "a store server up")

    _stopped(r, p, reader, lines, 130, lambda: os.killpg(p.pid, signal.SIGINT))
    assert not (r.out / "results.json").exists()


def test_sigterm_to_the_harness_alone_ends_its_in_process_runner(tmp_path: Path) -> None:
    r = Run(tmp_path, OPERATE_SIDECAR_BIN=str(tmp_path / "no-such-sidecar"))  # straight to the runners
    p, reader, lines = _start(r, "--only", "ours")
    _wait(lambda: any("bench.ours_inproc" in c for c in r.processes().values()), 60, "the runner up")

    _stopped(r, p, reader, lines, 143, lambda: p.send_signal(signal.SIGTERM))


HUNG_SECTION = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
a = subprocess.Popen(["sleep", "300"], start_new_session=True)
b = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{a.pid} {b.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_section_child_that_will_not_end_is_killed_with_the_servers_it_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child harness that ignores SIGTERM, with servers in sessions of their own (one with a
    child of its own): when the run is stopped, the child and all of them are gone once the
    grace period has passed."""
    from bench import run
    from bench.client import descendants

    pids_file = tmp_path / "pids"
    monkeypatch.setattr(run, "SECTION_GRACE_S", 0.2)
    monkeypatch.setattr(run.Harness, "section_argv",
                        lambda self, name: [sys.executable, "-c", HUNG_SECTION, str(pids_file)])
    h = run.Harness(run.Config(True), [], tmp_path / "out", tmp_path / "work", (None, None))
    found: list[int] = []

    async def go() -> None:
        task = asyncio.ensure_future(h.section("store"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not task.done():
            if pids_file.exists():
                a, b = (int(x) for x in pids_file.read_text().split())
                under_b = descendants(b)
                if under_b:
                    found.extend([a, b, *under_b])
                    break
            await asyncio.sleep(0.05)
        assert found, "the hung child started its servers"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)

    try:
        asyncio.run(go())
        _wait(lambda: not any(_alive(pid) for pid in found), 10, f"{found} gone")
    finally:
        for pid in found:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------ pieces, in-process
def test_an_edit_session_removes_its_workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import edit_bench

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    times = asyncio.run(edit_bench._session(edit_bench._argv(None), ["write", "write"], 1))

    assert len(times["write"]) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_rss_of_a_server_counts_the_processes_under_it() -> None:
    from bench.client import descendants, rss_kib, tree_rss_kib

    p = subprocess.Popen(["sh", "-c", "sleep 60 & read _"], stdin=subprocess.PIPE)
    try:
        kids = _wait(lambda: descendants(p.pid), 10, "the child started")
        own, tree = rss_kib(p.pid), tree_rss_kib(p.pid)
        assert own and tree and tree > own
    finally:
        for pid in descendants(p.pid):
            os.kill(pid, signal.SIGKILL)
        p.kill()
        p.wait(timeout=10)
    assert kids


def test_results_md_holds_the_notes_as_they_are_now() -> None:
    """RESULTS.md's copy of RESULTS_NOTES.md (``python -m bench.report --notes`` refreshes it)."""
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    notes = (ROOT / "bench" / "RESULTS_NOTES.md").read_text().rstrip() + "\n"
    assert notes in text
