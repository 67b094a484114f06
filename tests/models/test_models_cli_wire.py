"""``provider: cli`` over the real server: a run's teardown, its argv and stdin, its config
checks, and what a failing program's call answers. Real processes throughout (small Python
scripts written by the tests, and the server as a subprocess over real pipes)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from process_support import alive as pid_alive, script  # (the provider's own tests' helpers)

from operate_sidecar.clients.python.client import RpcError, SidecarClient

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


def wait_until(done, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def server(tmp_path: Path, models: dict, *argv: str) -> Iterator[SidecarClient]:
    """An initialized server serving ``models`` (the first the default); closed at the end."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(tmp_path / "server.err", "wb") as err:
        c = SidecarClient(argv=[PY, "-m", "operate_sidecar.server", *argv], env=env, cwd=str(REPO), stderr=err)
        try:
            c.request("initialize", {"workspaceFolders": [str(tmp_path)],
                                     "settings": {"models": models, "defaultModel": next(iter(models))}}, timeout=60)
            yield c
            c.close(timeout=30)
        finally:
            c.kill()


# --- teardown: a cancel never cuts the kill short -----------------------------------------------

#: a program that ignores SIGTERM (noting each one in ``<dir>/termed``) and starts a child that
#: ignores it too; it writes "<own pid> <child pid>" to ``<dir>/pids``, then waits for ever
STUBBORN = """
import os, signal, subprocess, sys, time
where = sys.argv[1]
def noted(*_):
    with open(os.path.join(where, "termed"), "a") as f:
        f.write("x")
signal.signal(signal.SIGTERM, noted)
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(os.path.join(where, "pids.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(os.path.join(where, "pids.tmp"), os.path.join(where, "pids"))
while True:
    time.sleep(1)
"""

GRACE = 2.0


def stubborn_model(tmp_path: Path, **config) -> dict:
    return {"provider": "cli", "profile": "jsonl", "killGraceS": GRACE,
            "command": [PY, script(tmp_path, "stubborn.py", STUBBORN), str(tmp_path)], **config}


def started(tmp_path: Path) -> tuple[int, int]:
    assert wait_until(lambda: (tmp_path / "pids").exists(), 30), "the program did not start"
    program, child = map(int, (tmp_path / "pids").read_text().split())
    assert pid_alive(program) and pid_alive(child)
    return program, child


def termed(tmp_path: Path) -> bool:
    return (tmp_path / "termed").exists()


def test_a_second_cancel_during_the_kill_grace_does_not_stop_the_kill(tmp_path):
    """A user pressing Esc twice: the second ``$/cancelRequest`` came while the first waited out
    killGraceS for a program ignoring SIGTERM, aborted the teardown, and the program and its child
    ran on until the sidecar exited. Now both are killed within the grace."""
    with server(tmp_path, {"stubborn": stubborn_model(tmp_path)}) as c:
        bid = c.request("createBranch", {})["branchId"]
        call = c.request_async("operate", {"branchId": bid, "instruction": "go"})
        program, child = started(tmp_path)
        c.cancel(call.id)
        assert wait_until(lambda: termed(tmp_path), 15), "no SIGTERM came"
        c.cancel(call.id)  # the same id again, during the grace
        with pytest.raises(RpcError) as e:
            call.result(30)
        assert e.value.code == -32800
        assert wait_until(lambda: not pid_alive(program) and not pid_alive(child), GRACE + 10), \
            f"still running after the grace: program {pid_alive(program)}, child {pid_alive(child)}"
        assert c.request("createBranch", {}, timeout=30)["branchId"]  # and the server goes on


def test_a_cancel_during_a_time_outs_kill_grace_does_not_stop_the_kill(tmp_path):
    """The run timed out (SIGTERM sent, ignored; SIGKILL due killGraceS later) and a
    ``$/cancelRequest`` came meanwhile: the SIGKILL was never sent. Now it is, within the grace."""
    with server(tmp_path, {"stubborn": stubborn_model(tmp_path, timeoutS=1)}) as c:
        bid = c.request("createBranch", {})["branchId"]
        call = c.request_async("operate", {"branchId": bid, "instruction": "go"})
        program, child = started(tmp_path)
        assert wait_until(lambda: termed(tmp_path), 30), "the time-out sent no SIGTERM"
        c.cancel(call.id)
        with pytest.raises(RpcError) as e:
            call.result(30)
        assert e.value.code in (-32800, -32011)
        assert wait_until(lambda: not pid_alive(program) and not pid_alive(child), GRACE + 10), \
            f"still running after the grace: program {pid_alive(program)}, child {pid_alive(child)}"


# --- the prompt: an argument, or stdin --------------------------------------------------------

#: a ``claude -p --output-format stream-json`` stand-in that answers with what it was given: its
#: arguments after the profile's own, and its stdin
ECHO_CLAUDE = """
import json, sys
given = {"argv": sys.argv[1:], "stdin": sys.stdin.read()}
print(json.dumps({"type": "assistant", "message": {"content": [{"type": "text", "text": json.dumps(given)}]}}))
print(json.dumps({"type": "result", "subtype": "success", "is_error": False}))
"""

LONG = 140_000  # characters: over Linux's 131072-byte limit of one argument


def echo_model(tmp_path: Path, **config) -> dict:
    return {"provider": "cli", "profile": "claude-code",
            "command": [PY, script(tmp_path, "echo_claude.py", ECHO_CLAUDE)], **config}


def given(c: SidecarClient, system: str | None, instruction: str, model: str = "echo") -> dict:
    bid = c.request("createBranch", {"chatModel": model, **({"system": system} if system else {})})["branchId"]
    return json.loads(c.request("operate", {"branchId": bid, "instruction": instruction}, timeout=60)["result"])


def test_by_default_a_prompt_no_argument_can_carry_goes_on_stdin(tmp_path):
    """promptVia not set (``arg``, the claude-code and llm default): a prompt longer than one
    argument may be (a branch's history past 128 KiB failed every operate with "Argument list too
    long"), one opening with "-" (a markdown list or "---" front matter as the system prompt, read
    as an option) and one holding a NUL go on stdin; any other stays the last argument."""
    with server(tmp_path, {"echo": echo_model(tmp_path)}) as c:
        short = given(c, None, "Say hi")
        assert short["argv"][-1].endswith("Say hi") and short["stdin"] == ""
        for system, instruction in ((None, "x" * LONG), ("- You are terse.\n- One word.", "Say hi"),
                                    ("---\nrole: helper\n---\nBe terse.", "Say hi"), (None, "a\0b")):
            got = given(c, system, instruction)
            assert got["argv"] == [], got["argv"][:5]
            assert instruction in got["stdin"] and got["stdin"].startswith(system or "")


def test_prompt_via_arg_said_passes_a_dash_prompt_after_a_double_dash_and_refuses_a_long_one(tmp_path):
    """``promptVia = "arg"`` said: a prompt opening with "-" comes after "--"; one too long for an
    argument is a -32011 naming ``promptVia = "stdin"`` (not an OSError's text); so is a
    ``{prompt}`` in the command that the prompt makes too long."""
    models = {"echo": echo_model(tmp_path, promptVia="arg"),
              "subst": {"provider": "cli", "profile": "claude-code",
                        "command": [PY, script(tmp_path, "echo_claude.py", ECHO_CLAUDE), "--prompt={prompt}"]}}
    with server(tmp_path, models) as c:
        got = given(c, "- You are terse.", "Say hi")
        assert got["argv"][-2] == "--" and got["argv"][-1].startswith("- You are terse.") and got["stdin"] == ""
        assert given(c, None, "Say hi")["argv"][-1].endswith("Say hi")
        for model in ("echo", "subst"):
            with pytest.raises(RpcError) as e:
                given(c, None, "x" * LONG, model=model)
            assert e.value.code == -32011, e.value.message
            assert "too long for one command-line argument" in e.value.message
            assert 'promptVia = "stdin"' in e.value.message and "Argument list" not in e.value.message
        subst = given(c, None, "Say hi", model="subst")["argv"][-1]
        assert subst.startswith("--prompt=") and subst.endswith("Say hi")


# --- what no program can be started with ------------------------------------------------------


@pytest.mark.parametrize(("config", "field"), [
    ({"command": [PY, "-c", "pass", "gar\0bage"]}, "command must not contain a NUL character"),
    ({"command": PY + " -c pass gar\0bage"}, "command must not contain a NUL character"),
    ({"cwd": "/tmp\0x"}, "cwd must not contain a NUL character"),
    ({"env": {"A=B": "1"}}, "env variable name 'A=B' must not contain '='"),
    ({"env": {"": "1"}}, "env must not have a variable with an empty name"),
    ({"env": {"A\0B": "1"}}, "env variable name 'A\\x00B' must not contain a NUL character"),
    ({"env": {"TOKEN": "se\0cret"}}, "env.TOKEN must not contain a NUL character"),
])
def test_initialize_refuses_a_cli_config_no_program_can_be_started_with(tmp_path, config, field):
    """A NUL in the command, the env or the cwd, or '=' or nothing as a variable's name, passed the
    checks, and then every operate was -32603 with a traceback (and a leaked descriptor). Now
    initialize refuses it (-32602 naming the model and the field), as any bad model config."""
    model = {"provider": "cli", "profile": "jsonl", "command": [PY, "-c", "pass"], **config}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    c = SidecarClient(argv=[PY, "-m", "operate_sidecar.server"], env=env, cwd=str(REPO), stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(RpcError) as e:
            c.request("initialize", {"settings": {"models": {"nul": model}, "defaultModel": "nul"}}, timeout=60)
        assert e.value.code == -32602
        assert "models.nul" in e.value.message and field in e.value.message, e.value.message
        assert "se\0cret" not in e.value.message
    finally:
        c.kill()  # not initialized: no shutdown to ask for


def test_a_program_that_cannot_be_started_leaves_no_descriptor_open(tmp_path):
    """Whatever fails the start (here a NUL in an argument, which only a model made without the
    config's checks can have), the stderr and stdin files are closed and the call is -32011."""
    import anyio

    from operate_sidecar.server.core.errors import ModelError
    from operate_sidecar.server.core.imodel import ModelRequest
    from operate_sidecar.server.models.cli import CLIModel

    def open_fds() -> int:
        """The temporary files this process holds open (a run's stderr and prompt files are
        unlinked ones); others the test run opens or closes meanwhile are not counted."""
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                held += os.readlink(f"/proc/self/fd/{fd}").endswith(" (deleted)")
            except OSError:
                pass
        return held

    kept: list = []  # the errors, held as a log or a caller may hold them (their frames with them)

    async def fail(model: CLIModel) -> None:
        with pytest.raises(ModelError, match="could not start") as info:
            async for _ in model.stream(ModelRequest(messages=[{"role": "user", "content": "hi"}])):
                pass
        kept.append(info.value)

    for command in ([PY, "-c", "pass", "gar\0bage"], ["/nonexistent/agent-cli"]):
        model = CLIModel("nul", profile="jsonl", command=command)
        anyio.run(fail, model)  # (once first: whatever the event loop opens for itself stays)
        before = open_fds()
        for _ in range(5):
            anyio.run(fail, model)
        assert open_fds() <= before  # (two more for each failure, without the fix)


# --- a program that fails after part of a reply -------------------------------------------------

PARTIAL = """
import json, os, signal, sys
sys.stdin.read()
print(json.dumps({"type": "text", "text": "half a reply"}), flush=True)
if sys.argv[1] == "exit":
    sys.stderr.write("crashed midway\\n")
    sys.exit(3)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_program_that_fails_after_part_of_a_reply_fails_the_call(tmp_path):
    """A non-zero exit (or death by a signal) after some text was a success, the text cut short
    the answer (and recorded by ``--record`` as the model's reply). Now it is a -32011 with the
    status and the stderr tail, and the recording holds a failure."""
    program = script(tmp_path, "partial.py", PARTIAL)
    models = {"exits": {"provider": "cli", "profile": "jsonl", "command": [PY, program, "exit"]},
              "killed": {"provider": "cli", "profile": "jsonl", "command": [PY, program, "kill"]}}
    recording = tmp_path / "session.jsonl"
    said = {"exits": "python exited with status 3: crashed midway", "killed": "python was killed by signal SIGKILL"}
    with server(tmp_path, models, "--record", str(recording)) as c:
        for model in said:
            bid = c.request("createBranch", {"chatModel": model})["branchId"]
            with pytest.raises(RpcError) as e:
                c.request("operate", {"branchId": bid, "instruction": "go"}, timeout=60)
            assert e.value.code == -32011 and said[model] in e.value.message, e.value.message
    recorded = json.loads(recording.read_text().splitlines()[-1])["recordedModels"]
    for model in said:
        (entry,) = recorded[model]["responses"]
        assert said[model] in entry["error"] and "text" not in entry, entry  # a failure, not a reply
