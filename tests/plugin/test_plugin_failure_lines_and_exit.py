"""The pytest plugin as another project sees it, where one line is all a reader gets: the short
test summary of a failing ``sidecar_script`` names the failing step, not the first passing one;
and a test that sent ``exit`` gets ``SidecarExited`` from every later call, not the sidecar's
-32800 for a request it cancelled as it exited. A separate temporary project run by pytest in a
subprocess, real sidecars over real pipes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pytest_plugin import GOOD, WRONG, make_project, run_pytest  # noqa: E402


def run_wide(project: Path, *args: str) -> str:
    """pytest on ``project`` with a terminal wide enough that the short summary's lines are not
    cut (pytest cuts them to the terminal's width); all it printed."""
    out = run_pytest(project, "-ra", *args, env={"COLUMNS": "400"})
    return out.stdout + out.stderr


SUMMARY_TESTS = '''
def test_wrong(sidecar_script):
    sidecar_script("scripts/../wrong.jsonl")
'''


def test_the_short_summary_of_a_failing_script_names_the_failing_step_and_the_normalised_script(tmp_path):
    """pytest's short summary shows the first line of the exception's message: it was the
    report's first line, ``PASS line 1: request initialize: result {...``. Now it names the
    script (normalised: it was ``.../scripts/../wrong.jsonl``), the first failing line and what
    failed; the whole report follows in the failure's section."""
    project = make_project(tmp_path / "ext")
    (project / "scripts").mkdir()
    (project / "test_summary.py").write_text(SUMMARY_TESTS)
    text = run_wide(project, "test_summary.py")
    assert "1 failed" in text, text
    assert (f"FAILED test_summary.py::test_wrong - operate_sidecar.testing.ScriptFailed: {project}/wrong.jsonl "
            'line 3: request operate: at $.result.result: expected "other text", got "plain text"\n') in text, text
    section = text.split("_ test_wrong _", 1)[1].split("short test summary", 1)[0]
    assert (f"E       operate_sidecar.testing.ScriptFailed: {project}/wrong.jsonl line 3: request operate: at "
            '$.result.result: expected "other text", got "plain text"\nE       PASS line 1: request initialize: '
            ) in section, section
    assert f"E       1 of 3 steps failed in {project}/wrong.jsonl; first: line 3: request operate\n" in section, section
    assert "scripts/../wrong.jsonl" not in text.replace('sidecar_script("scripts/../wrong.jsonl")', ""), text


def test_the_first_line_names_the_end_of_the_session_and_counts_the_other_failures(tmp_path):
    """In-process, as :func:`run_session_script` raises it: the first failing step, then how many
    more failures the report below lists."""
    import pytest

    from operate_sidecar.testing import ScriptFailed, run_session_script

    wrong = tmp_path / "w.jsonl"
    wrong.write_text(WRONG + '{"request": "listBranches", "expect": {"result": {"branches": []}}}\n')
    with pytest.raises(ScriptFailed) as info:
        run_session_script(wrong)
    first, *rest = str(info.value).splitlines()
    assert first.startswith(f'{wrong} line 3: request operate: at $.result.result: expected "other text", got '), first
    assert first.endswith(" (and 1 more failure(s), below)"), first
    assert rest[0].startswith("PASS line 1: request initialize: ") and "2 of 4 steps failed in " in str(info.value)


def test_a_script_path_through_a_symlink_is_opened_as_given_and_named_as_given(tmp_path):
    """The report names a script by its normalised path, but the script is opened by the path as
    given: ``scripts/../good.jsonl``, ``scripts`` a symlink to ``real/sub``, is ``real/good.jsonl``
    (the ``..`` of the link's target), not ``good.jsonl`` beside ``scripts``, which normalising the
    path without looking at symlinks gives (another script was run, or a missing one reported).
    Such a path is named as given: its normalised form is another file."""
    import pytest

    from operate_sidecar.testing import ScriptFailed, run_session_script

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "scripts").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "real" / "good.jsonl").write_text(GOOD)
    (tmp_path / "good.jsonl").write_text(WRONG)  # what the normalised path names: not this one
    (tmp_path / "real" / "wrong.jsonl").write_text(WRONG)  # and no wrong.jsonl beside scripts
    assert all(r.ok for r in run_session_script(tmp_path / "scripts" / ".." / "good.jsonl"))
    given = f"{tmp_path}/scripts/../wrong.jsonl"
    with pytest.raises(ScriptFailed) as info:
        run_session_script(given)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f'{given} line 3: request operate: at $.result.result: expected "other text", '), first


# the head of the test files below: a sidecar whose operate runs for 30 s
EXIT_HEAD = '''
import asyncio

import pytest

from operate_sidecar.testing import SidecarExited

SLOW = {"models": {"m": {"provider": "scripted", "responses": [{"text": "slow", "delayMs": 30000}]}}}
'''

EXIT_TESTS = EXIT_HEAD + '''
SAID = {"request": "request createBranch not sent: the sidecar exited (code 0)",
        "notify": "notification $/cancelRequest not sent: the sidecar ",
        "wait": "no matching toolEvent notification came: the sidecar exited (code 0)"}


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["request"] * 5 + ["notify", "wait"])  # (a request raced the exit: five)
async def test_a_call_after_exit(sidecar, call):
    await sidecar.request("shutdown")
    sidecar.notify("exit")
    with pytest.raises(SidecarExited) as info:
        if call == "request":
            await sidecar.request("createBranch")
        elif call == "notify":
            sidecar.notify("$/cancelRequest", {"id": 1})
        else:
            await sidecar.wait_for_notification("toolEvent", timeout=60)
    assert str(info.value).startswith(SAID[call]), info.value


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SLOW)
async def test_request_in_flight_at_exit(sidecar):
    branch = (await sidecar.request("createBranch"))["branchId"]
    operate = asyncio.ensure_future(sidecar.request("operate", {"branchId": branch, "instruction": "x",
                                                                "skipValidation": True, "workDoneToken": 1}))
    await sidecar.wait_for_notification("$/progress", {"token": 1, "value": {"kind": "begin"}})
    sidecar.notify("exit")
    with pytest.raises(SidecarExited) as info:
        await operate
    assert str(info.value).startswith("request operate not answered: the sidecar exited (code 1)"), info.value
'''


def test_after_exit_requests_notifications_and_waits_raise_sidecar_exited(tmp_path):
    """The README: a sidecar that has exited fails ``request``, ``notify`` and
    ``wait_for_notification`` at once with ``SidecarExited`` (its docstring: "or was told to
    exit"). A request sent just after ``exit``, before the sidecar had gone, raised
    ``SidecarError(-32800)`` most of the time (the sidecar cancelled it as it exited), a
    notification was sent into a sidecar that serves nothing more, and a request in flight when
    ``exit`` was sent got the same -32800. The client now remembers that it sent ``exit``."""
    project = make_project(tmp_path / "ext")
    (project / "test_exit.py").write_text(EXIT_TESTS)
    text = run_wide(project, "test_exit.py")
    assert "8 passed" in text and "failed" not in text, text


EXIT_END_TESTS = EXIT_HEAD + '''
END = {"token": 1, "value": {"kind": "end"}}


@pytest.mark.asyncio
@pytest.mark.sidecar(settings=SLOW, timeout=60)
@pytest.mark.parametrize("when", ["at once", "once it exited"])
async def test_the_end_of_a_cancelled_operate(sidecar, when):
    branch = (await sidecar.request("createBranch"))["branchId"]
    operate = asyncio.ensure_future(sidecar.request("operate", {"branchId": branch, "instruction": "x",
                                                                "skipValidation": True, "workDoneToken": 1}))
    await sidecar.wait_for_notification("$/progress", {"token": 1, "value": {"kind": "begin"}})
    sidecar.notify("exit")
    if when == "once it exited":  # its exit code known (its last output may not have been read yet)
        deadline = asyncio.get_running_loop().time() + 30
        while sidecar.returncode is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert sidecar.returncode == 1
    end = await sidecar.wait_for_notification("$/progress", END, timeout=30)
    assert end["value"]["message"] == "cancelled", end
    with pytest.raises(SidecarExited):
        await operate
    with pytest.raises(SidecarExited) as info:  # nothing more came: it says so, not a time-out
        await sidecar.wait_for_notification("$/progress", END, timeout=30)
    assert str(info.value).startswith("no matching $/progress notification came: the sidecar exited (code 1)")
'''


def test_a_wait_after_exit_gets_what_the_sidecar_sent_as_it_exited(tmp_path):
    """The sidecar still writes after ``exit``: an operate it cancels as it exits ends its
    ``$/progress`` with ``{"kind": "end", "message": "cancelled"}``. A wait for it after ``exit``
    raised ``SidecarExited`` unless that notification had been read already; it now waits for the
    sidecar's output to end (read to its end even once the process has exited) and raises only
    when none of it matches."""
    project = make_project(tmp_path / "ext")
    (project / "test_exit_end.py").write_text(EXIT_END_TESTS)
    text = run_wide(project, "test_exit_end.py")
    assert "2 passed" in text and "failed" not in text, text
