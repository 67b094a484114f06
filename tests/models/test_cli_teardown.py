"""``provider: cli``: how a run's processes end. The program's process group and the processes
holding its stdout (a child it detached with ``setsid``, out of the group) are stopped together,
within one grace; a sidecar that reaches the end of its input, or is SIGKILLed, in the middle of
a run leaves none of them running (the run's reaper kills the group and the stdout's holders).
Real processes throughout: small Python programs written by the tests, the real server over
real pipes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from operate_sidecar.clients.python.client import RpcError, SidecarClient
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import ModelConfigError, make_model
from process_support import alive, cancel_once_said, script

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
REQUEST = ModelRequest(messages=[{"role": "user", "content": "go"}], purpose="run")


def wait_all_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait (at most ``timeout`` seconds) until none of ``pids`` runs; those still running."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_left(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# -- a cancel: the group and the stdout's holders in one grace --------------------------------

# The setsid child holds the program's stdout. On SIGTERM it leaves a mark and exits; it says
# its pid on stdout once its handler is in place.
HOLDER_MARKS_TERM = """
import os, signal, sys, time
def on_term(*_):
    open(sys.argv[1], "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
print('{"type": "text", "text": "%d"}' % os.getpid(), flush=True)
time.sleep(300)
"""

# The program, on SIGTERM, waits for the holder's mark (its own SIGTERM) and exits once it sees it.
WAITS_FOR_THE_HOLDERS_TERM = """
import os, signal, subprocess, sys, time
holder_code, mark, saw = sys.argv[1], sys.argv[2], sys.argv[3]
def on_term(*_):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(mark):
            open(saw, "w").close()
            os._exit(0)
        time.sleep(0.02)
    os._exit(1)
signal.signal(signal.SIGTERM, on_term)
sys.stdin.read()
subprocess.Popen([sys.executable, holder_code, mark], start_new_session=True)
time.sleep(300)
"""


@pytest.mark.anyio
async def test_a_cancel_sends_sigterm_to_the_setsid_holder_of_stdout_together_with_the_group(tmp_path):
    """On a cancel the child that left the group with setsid, holding stdout, gets its SIGTERM
    while the group's grace runs, not after it: the program waits for that SIGTERM before it
    exits. (It used to come once the group was gone, after a whole grace: the program was killed
    without seeing it, and everything died only after two graces.)"""
    holder_code = script(tmp_path, "holder.py", HOLDER_MARKS_TERM)
    mark, saw = tmp_path / "holder-got-sigterm", tmp_path / "program-saw-it"
    model = make_model(
        {"provider": "cli", "profile": "jsonl", "killGraceS": 20,
         "command": [PY, script(tmp_path, "prog.py", WAITS_FOR_THE_HOLDERS_TERM), holder_code, str(mark), str(saw)]},
        name="waits",
    )
    holder: list[int] = []

    def both_run() -> None:
        assert alive(model.last_pid) and alive(holder[0])

    try:
        await cancel_once_said(model, REQUEST, holder, 90, both_run)
        assert mark.exists(), "the setsid holder never got its SIGTERM"
        assert saw.exists(), "the setsid holder got its SIGTERM only after the group's grace"
        assert not wait_all_gone([model.last_pid, holder[0]], 10)
    finally:
        kill_left(holder + [model.last_pid])


# -- the sidecar ends in the middle of a run --------------------------------------------------

# The program ignores SIGTERM, and so do its children (the disposition is inherited): one in its
# process group, and one in a session of its own (setsid) holding its stdout.
LEAVES_CHILDREN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stdin.read()
sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
group = subprocess.Popen(sleeper, stdout=subprocess.DEVNULL)
holder = subprocess.Popen(sleeper, start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {group.pid} {holder.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
print('{"type": "text", "text": "working"}', flush=True)
time.sleep(300)
"""


def start_run(tmp_path: Path, c: SidecarClient, kill_grace_s: float | None) -> list[int]:
    """Initialize ``c`` with a CLI model running LEAVES_CHILDREN, start an operate on it, and
    return the pids of the program, its group child and its setsid child (all running)."""
    pids_file = tmp_path / "pids"
    model = {"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "prog.py", LEAVES_CHILDREN),
                                                               str(pids_file)]}
    if kill_grace_s is not None:
        model["killGraceS"] = kill_grace_s
    c.request("initialize", {"workspaceFolders": [str(tmp_path)],
                             "settings": {"models": {"prog": model}, "defaultModel": "prog"}}, timeout=60)
    bid = c.request("createBranch", {})["branchId"]
    c.request_async("operate", {"branchId": bid, "instruction": "go"})
    deadline = time.monotonic() + 30
    while not pids_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert all(alive(p) for p in pids)
    return pids


def sidecar() -> SidecarClient:
    return SidecarClient(argv=[PY, "-m", "operate_sidecar.server"], env=dict(os.environ, PYTHONPATH=str(REPO)),
                         cwd=str(REPO), stderr=subprocess.DEVNULL)


def run_then_end_the_sidecar(tmp_path: Path, kill_grace_s: float | None,
                             end: Callable[[SidecarClient], None]) -> tuple[list[int], list[int]]:
    """Start a run (``start_run``), end the sidecar in its middle with ``end``, and wait (10 s at
    most) for the run's processes to be gone: (their pids, those still running). None is left
    running after."""
    pids: list[int] = []
    with sidecar() as c:
        try:
            pids = start_run(tmp_path, c, kill_grace_s)
            end(c)
            return pids, wait_all_gone(pids, 10)
        finally:
            kill_left(pids)
            c.kill()


@pytest.mark.parametrize("kill_grace_s", [None, 30], ids=["default-grace", "grace-longer-than-the-exit"])
def test_at_the_end_of_input_a_runs_setsid_child_holding_stdout_dies_with_the_sidecar(tmp_path, kill_grace_s):
    """The end of stdin cancels the run and the server exits: the program, its group child and
    the child it detached with setsid (holding its stdout, ignoring SIGTERM) are all gone. With
    the default grace the run's teardown ends before the exit; with a grace longer than the exit
    waits, the run's reaper kills what is left once the server is gone. (The setsid child used
    to be left running for ever: the exit cut the teardown before it was reached.)"""
    def at_the_end_of_input(c: SidecarClient) -> None:
        c.close_input()
        c.proc.wait(60)

    pids, left = run_then_end_the_sidecar(tmp_path, kill_grace_s, at_the_end_of_input)
    assert not left, f"{left} of the run's processes (program, group child, setsid child) {pids} outlived the sidecar"


def test_a_sigkilled_sidecar_takes_the_runs_setsid_child_holding_stdout_with_it(tmp_path):
    """SIGKILL the sidecar mid-run: the run's reaper kills its group and then the child the
    program detached with setsid, found by the run's stdout it still holds."""
    def sigkilled(c: SidecarClient) -> None:
        c.proc.kill()
        c.proc.wait(10)

    pids, left = run_then_end_the_sidecar(tmp_path, None, sigkilled)
    assert not left, f"{left} of the run's processes (program, group child, setsid child) {pids} outlived the sidecar"


NO_GROUP = 2**22 + 1  # above PID_MAX_LIMIT: a process group no process can have

SLEEPER = [PY, "-c", "import time; time.sleep(300)"]


def test_a_released_reaper_leaves_the_holders_of_its_pipe_alone(tmp_path):
    """A run's reaper let go on purpose (its run's teardown is over) does not look for its pipe's
    holders: only a sidecar gone makes it kill them."""
    from operate_sidecar.server.reaper import release_reaper, start_reaper

    r, w = os.pipe()
    holder = subprocess.Popen(SLEEPER, stdout=w, start_new_session=True)
    os.close(w)
    try:
        started = start_reaper(NO_GROUP, os.fstat(r).st_ino)
        assert started is not None
        proc, fd = started
        release_reaper(fd)
        assert proc.wait(10) == 0
        assert alive(holder.pid)
        started = start_reaper(NO_GROUP, os.fstat(r).st_ino)
        assert started is not None
        proc, fd = started
        os.close(fd)  # as when the sidecar is gone
        assert proc.wait(10) == 0
        assert holder.wait(10) == -signal.SIGKILL
    finally:
        os.close(r)
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_a_released_reaper_leaves_its_group_alone():
    """A reaper let go on purpose kills nothing, not even its group: the run's teardown stopped
    the group and reaped its leader, whose pid (the group's id) may be another group's by then.
    (It used to SIGKILL the group anyway.)"""
    from operate_sidecar.server.reaper import release_reaper, start_reaper

    group = subprocess.Popen(SLEEPER, start_new_session=True)  # stands for a group that took the id
    try:
        started = start_reaper(group.pid)
        assert started is not None
        proc, fd = started
        release_reaper(fd)
        assert proc.wait(10) == 0
        assert group.poll() is None and alive(group.pid), "a released reaper killed its group"
        started = start_reaper(group.pid)
        assert started is not None
        proc, fd = started
        os.close(fd)  # as when the sidecar is gone: the group dies
        assert proc.wait(10) == 0
        assert group.wait(10) == -signal.SIGKILL
    finally:
        if group.poll() is None:
            group.kill()
            group.wait(10)


def reap_with_sidecar_gone(inode: int) -> None:
    """Start a reaper for ``inode`` (no group) and end it as a sidecar's death does."""
    from operate_sidecar.server.reaper import start_reaper

    started = start_reaper(NO_GROUP, inode)
    assert started is not None
    proc, fd = started
    os.close(fd)
    assert proc.wait(20) == 0


@pytest.mark.parametrize("lines", [True, False], ids=["fake-lines", "fake-line-end"])
def test_a_file_name_that_fakes_lines_of_ls_does_not_make_the_reaper_kill_another_process(tmp_path, lines):
    """A process holding a file whose name holds newlines and, after them, what ``ls -l`` prints
    for another process's descriptor on the run's stdout cannot get that process killed; nor can
    a name that ends as such a line (`` 9 -> pipe:[inode]``) get its holder killed: only the real
    holder dies. (The name's lines were read as lines of their own: the victim was killed.)"""
    r, w = os.pipe()
    inode = os.fstat(r).st_ino
    holder = subprocess.Popen(SLEEPER, stdout=w, start_new_session=True)
    os.close(w)
    victim = subprocess.Popen(SLEEPER, start_new_session=True)  # holds nothing of the run
    forged = tmp_path / (f"x\n/proc/{victim.pid}/fd:\nl-wx------ 1 0 0 64 Dec  7 18:41 9 -> pipe:[{inode}]"
                         if lines else f"x 9 -> pipe:[{inode}]")
    forged.parent.mkdir(parents=True, exist_ok=True)
    forged.touch()
    opener = subprocess.Popen([PY, "-c", "import sys, time; f = open(sys.argv[1], 'a'); print(flush=True); "
                               "time.sleep(300)", str(forged)], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert opener.stdout.readline() == b"\n"  # the file is open
        reap_with_sidecar_gone(inode)
        assert holder.wait(10) == -signal.SIGKILL
        assert alive(victim.pid), "the reaper killed a process named by a file's name"
        assert alive(opener.pid), "the reaper killed the process holding the forged name"
    finally:
        os.close(r)
        kill_left([holder.pid, victim.pid, opener.pid])
        for p in (holder, victim, opener):
            p.wait(10)


@pytest.mark.parametrize("env", [{"TIME_STYLE": "long-iso"}, {"TIME_STYLE": "+%Y %m %d %H %M"},
                                 {"QUOTING_STYLE": "shell-always"}, {"QUOTING_STYLE": "c"}],
                         ids=["long-iso", "time-in-five-words", "shell-always", "c-quotes"])
def test_the_reaper_finds_the_holders_whatever_ls_settings_it_inherits(env, monkeypatch):
    """``TIME_STYLE`` and ``QUOTING_STYLE`` in the sidecar's environment (and so the reaper's)
    change what ``ls`` prints: the holder is still found and killed. (The scan failed silently.)"""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r, w = os.pipe()
    holder = subprocess.Popen(SLEEPER, stdout=w, start_new_session=True)
    os.close(w)
    try:
        reap_with_sidecar_gone(os.fstat(r).st_ino)
        assert holder.wait(10) == -signal.SIGKILL, f"with {env} the reaper did not find the holder"
    finally:
        os.close(r)
        kill_left([holder.pid])
        holder.wait(10)


def test_the_reaper_kills_the_holders_though_its_shell_is_bash_told_errexit(tmp_path, monkeypatch):
    """A system whose ``sh`` is bash, a sidecar started with ``SHELLOPTS=errexit`` exported (bash
    takes it up): the run's group is already empty, so the reaper's kill of it fails, and the
    holder of the run's stdout is still killed. (The failed kill ended the script.)"""
    from operate_sidecar.server import reaper

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    sh = tmp_path / "sh"
    sh.symlink_to(bash)
    monkeypatch.setattr(reaper, "_shell", lambda: str(sh))
    monkeypatch.setenv("SHELLOPTS", "errexit")
    r, w = os.pipe()
    holder = subprocess.Popen(SLEEPER, stdout=w, start_new_session=True)
    os.close(w)
    try:
        reap_with_sidecar_gone(os.fstat(r).st_ino)
        assert holder.wait(10) == -signal.SIGKILL, "with errexit the reaper did not kill the holder"
    finally:
        os.close(r)
        kill_left([holder.pid])
        holder.wait(10)


def test_a_released_reaper_exits_at_once_though_another_process_holds_its_pipe():
    """A reaper let go on purpose exits at once and kills nothing, even while another process
    holds its pipe's write end too. (It waited for the pipe's end: each run's teardown waited
    its 2 s for it, then killed it.)"""
    from operate_sidecar.server.reaper import release_reaper, start_reaper

    group = subprocess.Popen(SLEEPER, start_new_session=True)
    other = None
    try:
        started = start_reaper(group.pid)
        assert started is not None
        proc, fd = started
        other = subprocess.Popen(SLEEPER, pass_fds=(fd,), start_new_session=True)  # holds the write end
        release_reaper(fd)
        try:
            assert proc.wait(10) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError("a released reaper waited for every copy of its pipe to close") from None
        assert alive(group.pid), "a released reaper killed its group"
    finally:
        kill_left([group.pid] + ([other.pid] if other is not None else []))
        for p in (group, other):
            if p is not None:
                p.wait(10)


def test_a_process_forked_while_a_reaper_lives_does_not_keep_it_from_firing():
    """A tool that ``os.fork()``s while a reaper lives: the child closes the copy of the reaper's
    write end it inherited, so the sidecar's end (here: its write end closed) still makes the
    reaper kill its group while the child runs on. (The reaper waited for the child's exit.)"""
    from operate_sidecar.server.reaper import start_reaper

    group = subprocess.Popen(SLEEPER, start_new_session=True)
    go_r, go_w = os.pipe()
    child = None
    try:
        started = start_reaper(group.pid)
        assert started is not None
        proc, fd = started
        child = os.fork()
        if child == 0:  # runs until the test lets it go (the end of go_r)
            try:
                os.close(go_w)
                os.read(go_r, 1)
            finally:
                os._exit(0)
        os.close(fd)  # as when the sidecar is gone
        try:
            assert group.wait(10) == -signal.SIGKILL
        except subprocess.TimeoutExpired:
            raise AssertionError("a forked child's copy of the reaper's pipe kept it from firing") from None
        assert proc.wait(10) == 0
    finally:
        os.close(go_w)
        os.close(go_r)
        if child:
            os.waitpid(child, 0)
        kill_left([group.pid])
        group.wait(10)


def test_only_the_write_end_of_the_pipe_makes_a_holder(tmp_path):
    """A pipe's read end has the same inode as its write end, and a process forked by the sidecar
    (or a sibling run's child before its exec) holds the sidecar's read end of a run's stdout: it
    is no holder. Neither the teardown's scan nor the reaper touches it; the write end's holder
    dies. (Both counted: the reader was killed.)"""
    from operate_sidecar.server.models.cli import _pipe_holders

    r, w = os.pipe()
    inode = os.fstat(r).st_ino
    writer = subprocess.Popen(SLEEPER, stdout=w, start_new_session=True)
    os.close(w)
    reader = subprocess.Popen(SLEEPER, stdin=r, start_new_session=True)
    try:
        assert _pipe_holders(inode) == [writer.pid]
        reap_with_sidecar_gone(inode)
        assert writer.wait(10) == -signal.SIGKILL
        assert alive(reader.pid), "the reaper killed a process holding only the read end"
    finally:
        os.close(r)
        kill_left([writer.pid, reader.pid])
        for p in (writer, reader):
            p.wait(10)


def test_the_teardowns_holders_leave_out_the_members_of_the_group(tmp_path):
    """The group's members are signalled with the group (``killpg``), not one by one as holders:
    a member that dies frees its pid, and a pid remembered is no process to kill later."""
    from operate_sidecar.server.models.cli import _pipe_holders

    r, w = os.pipe()
    inode = os.fstat(r).st_ino
    member = subprocess.Popen(SLEEPER, stdout=w, start_new_session=True)
    outside = subprocess.Popen(SLEEPER, stdout=w, start_new_session=True)
    os.close(w)
    try:
        assert sorted(_pipe_holders(inode)) == sorted([member.pid, outside.pid])
        assert _pipe_holders(inode, member.pid) == [outside.pid]
    finally:
        os.close(r)
        kill_left([member.pid, outside.pid])
        for p in (member, outside):
            p.wait(10)


# The setsid child holds the program's stdout. On SIGTERM it lets go of stdout (and leaves a mark)
# but keeps running: it holds nothing of the run any more.
HOLDER_LETS_GO_ON_TERM = """
import os, signal, sys, time
def on_term(*_):
    os.close(1)
    open(sys.argv[1], "w").close()
signal.signal(signal.SIGTERM, on_term)
print('{"type": "text", "text": "%d"}' % os.getpid(), flush=True)
while True:
    time.sleep(300)
"""

# The program starts that child and exits on SIGTERM.
STARTS_THE_HOLDER = """
import subprocess, sys, time
sys.stdin.read()
subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], start_new_session=True)
time.sleep(300)
"""


@pytest.mark.anyio
async def test_the_sigkill_after_the_grace_goes_only_to_what_still_holds_stdout(tmp_path):
    """The SIGKILL at the end of the grace goes to the processes a fresh scan finds holding the
    run's stdout, never to a pid found before the grace: the setsid child that let go of stdout on
    SIGTERM is no holder any more, and is left running. (The pid found before the grace was
    SIGKILLed whatever it had become: another process, once that pid was reused.)"""
    mark = tmp_path / "holder-let-go"
    model = make_model(
        {"provider": "cli", "profile": "jsonl", "killGraceS": 1,
         "command": [PY, script(tmp_path, "prog.py", STARTS_THE_HOLDER),
                     script(tmp_path, "holder.py", HOLDER_LETS_GO_ON_TERM), str(mark)]},
        name="lets-go",
    )
    holder: list[int] = []
    try:
        await cancel_once_said(model, REQUEST, holder, 60)
        assert mark.exists(), "the setsid holder never got its SIGTERM"
        assert not wait_all_gone([model.last_pid], 10)
        assert alive(holder[0]), "a process that no longer held stdout was SIGKILLed after the grace"
    finally:
        kill_left(holder + [model.last_pid])


# The setsid child holds the program's stdout and says the pipe's inode; it dies on SIGTERM.
HOLDER_SAYS_ITS_PIPE = """
import os, time
print('{"type": "text", "text": "%d %d"}' % (os.getpid(), os.fstat(1).st_ino), flush=True)
time.sleep(300)
"""


@pytest.mark.anyio
async def test_a_cancel_spares_a_process_that_holds_only_the_sidecars_read_end_of_stdout(tmp_path):
    """A process with the sidecar's read end of the run's stdout (as one the sidecar forks holds)
    is not stopped with the run; the setsid child holding the write end is. (A read end counted
    as holding stdout: the bystander got SIGTERM.)"""
    model = make_model(
        {"provider": "cli", "profile": "jsonl", "killGraceS": 5,
         "command": [PY, script(tmp_path, "prog.py", STARTS_THE_HOLDER),
                     script(tmp_path, "holder.py", HOLDER_SAYS_ITS_PIPE), "-"]},
        name="bystander",
    )
    said: list[int] = []
    bystander: list[subprocess.Popen] = []

    def start_the_bystander() -> None:
        target = f"pipe:[{said[1]}]"
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}") == target]
        assert fds, "the sidecar's read end of the run's stdout was not found"
        bystander.append(subprocess.Popen(SLEEPER, pass_fds=fds[:1], start_new_session=True))

    try:
        await cancel_once_said(model, REQUEST, said, 60, start_the_bystander)
        assert not wait_all_gone([model.last_pid, said[0]], 10)
        assert bystander[0].poll() is None and alive(bystander[0].pid), \
            "a process holding only the read end of the run's stdout was stopped"
    finally:
        kill_left(said[:1] + [model.last_pid] + [p.pid for p in bystander])
        for p in bystander:
            p.wait(10)


# -- the command's program name ------------------------------------------------------------------


@pytest.mark.parametrize("command", [[""], ["", "--flag"], '"" --flag'])
def test_a_command_whose_program_name_is_empty_is_refused(command):
    """``command: [""]`` was accepted, and every operate failed with ``could not start '':
    Permission denied``: it is refused as a config error naming the field."""
    with pytest.raises(ModelConfigError, match=r"models\.x: command must begin with the program to run"):
        from operate_sidecar.server.models.config import check_model_config

        check_model_config({"provider": "cli", "profile": "jsonl", "command": command}, "models.x")
    with pytest.raises(ModelConfigError, match="command must begin with the program to run"):
        make_model({"provider": "cli", "profile": "jsonl", "command": command}, name="x")


def test_initialize_refuses_a_command_whose_program_name_is_empty(tmp_path):
    with sidecar() as c:
        try:
            with pytest.raises(RpcError) as e:
                c.request("initialize", {"workspaceFolders": [str(tmp_path)], "settings": {
                    "models": {"blank": {"provider": "cli", "profile": "llm", "command": [""]}}}}, timeout=60)
            assert e.value.code == -32602
            assert "models.blank" in e.value.message and "command must begin with the program to run" in e.value.message
        finally:
            c.kill()  # not initialized: no shutdown to ask for
