"""clients/python/demo.py (`make demo`): run for real, output piped (as in CI or `make demo | less`),
against the real server and the embedded local model; and its clean-up when it fails or is
interrupted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from operate_sidecar.clients.python import demo
from operate_sidecar.clients.python.client import SidecarClient

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "TMPDIR": str(tmp), "COLUMNS": "80", "TERM": "dumb"}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "operate_sidecar.clients.python.demo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"the demo failed:\n{proc.stdout}\n{proc.stderr}"
    return proc, tmp


def panel(out: str, title: str) -> list[str]:
    """The lines of the panel whose top border holds `title`."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("╭") and title in ln)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    return lines[start:end + 1]


def test_the_tools_line_shows_every_policy(piped_run):
    out = piped_run[0].stdout
    tools = " ".join(re.search(r"^tools: (.*?)\n(?=╭)", out, re.S | re.M).group(1).split())
    # each tool with its policy in brackets (not swallowed as rich markup)
    pairs = re.findall(r"(\w+) \[(allow|ask|deny)\]", tools)
    assert dict(pairs) == {"read_file": "allow", "list_dir": "allow", "search_text": "allow",
                           "write_file": "ask", "edit_file": "ask", "get_weather": "ask", "save_note": "allow"}, tools
    assert demo.tools_line([{"name": "x", "policy": "ask"}]) == r"tools: x \[ask]"


def test_nothing_is_left_behind(piped_run, tmp_path, monkeypatch, capsys):
    assert list(piped_run[1].iterdir()) == []       # a run that went well: no workspace, no server log
    # ... one that fails or is interrupted (Ctrl-C: one line, exit 130) removes its workspace too
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(demo.tempfile, "tempdir", None)
    seen = []
    for exc in (KeyboardInterrupt, RuntimeError):
        def run(workspace: Path, exc=exc) -> int:
            seen.append(workspace)
            assert workspace.is_dir() and workspace.name.startswith("operate-demo-")
            raise exc("stop")
        monkeypatch.setattr(demo, "run", run)
        if exc is KeyboardInterrupt:
            assert demo.main() == 130
            assert capsys.readouterr().err.startswith("demo interrupted (Ctrl-C): ")
        else:
            with pytest.raises(exc):   # a bug of the demo's own shows its traceback
                demo.main()
    assert len(seen) == 2 and not any(p.exists() for p in seen) and not list(tmp_path.glob("operate-demo-*"))


def test_figures_agree_with_the_panels_and_events_are_in_order(piped_run):
    out = piped_run[0].stdout
    live = panel(out, "operate (live)")
    deltas = int(re.search(r"deltas: (\d+)", live[1]).group(1))
    events = [ln for ln in live if re.match(r"│ (tool #\d+|permission asked)", ln)]
    kinds = ["permission" if "permission asked" in ln else re.search(r"tool #\d+ +(\w+)", ln).group(1)
             for ln in events]
    # the permission is asked before the tool runs: the events as they happened
    assert kinds == ["permission", "pre", "post"], live
    summary = " ".join(out[out.index("demo ok"):].split())
    first, edit = summary.split("; edit: ")
    assert f" {deltas} streamed deltas," in first                         # the first operate's own figures
    assert f" {kinds.count('pre') + kinds.count('post')} tool events," in first
    assert f" {kinds.count('permission')} permission request(s) answered," in first
    # the edit part: read_file (pre, post) and edit_file (pre, post), one permission request
    assert edit.startswith("4 tool events, 1 permission request(s) answered;"), summary


def test_piped_output_is_clean_and_titles_are_whole(piped_run):
    out = piped_run[0].stdout
    for ln in out.splitlines():
        assert "╯╭" not in ln and "╮╭" not in ln, ln                       # one panel per line
        assert "\x1b" not in ln                                           # no cursor movements
    assert out.count("operate (live)") == 1                               # not redrawn
    title = panel(out, "edit_file")[0]
    assert "permission: edit_file greeting.py" in title and "→ allo─" not in title
    assert "answering allow_once" in panel(out, "edit_file")[-1]


def test_the_edit_part_shows_its_tool_events_and_the_preview_as_they_happen(piped_run):
    """The tool events as they come, and the permission request's preview (the diff) printed by the
    permission handler before it answers: the output reads preview, permission answered, the edit
    runs (not the preview after the edit, below its events)."""
    out = piped_run[0].stdout
    part = out[out.index("an edit, in rounds"):].splitlines()
    events = []
    for ln in part:
        m = re.match(r"tool #\d+ +(pre|post) (\w+)\(", ln)
        if m:
            events.append((m.group(1), m.group(2)))
        elif ln.startswith("╭") and "permission: edit_file greeting.py" in ln:
            events.append(("permission", "edit_file"))
        elif ln.startswith("╭") and "answer" in ln:
            assert "(last of 3 rounds)" in ln, ln
            break
    assert events == [("pre", "read_file"), ("post", "read_file"), ("permission", "edit_file"),
                      ("pre", "edit_file"), ("post", "edit_file")], part
    diff = panel(out, "permission: edit_file")
    assert '│ -    return "Helo, " + name + "!"' in "\n".join(diff) and "answering allow_once" in diff[-1], diff
    summary = " ".join(out[out.index("demo ok"):].split())
    assert "edit: 4 tool events, 1 permission request(s) answered;" in summary  # the events shown above
    # a tool's output is cut short here, one line per event (the whole diff has its own panel):
    # not read_file's whole JSON
    lines = [ln for ln in part if re.match(r"tool #\d+ ", ln)]
    assert all(len(ln) <= 80 for ln in lines), lines
    text = " ".join(lines)
    assert '"nextOffset"' not in text and '"added"' not in text and text.count("…") >= 2, lines


def test_the_usage_lines_give_the_local_models_tokens_and_say_the_scripted_one_reads_none(piped_run):
    """The local model's operate counts its tokens; the scripted edit part says it reads none,
    not "0 input + 0 output tokens, context 0", which reads as a broken count."""
    usage = [ln for ln in piped_run[0].stdout.splitlines() if ln.startswith("usage: ")]
    assert len(usage) == 2, usage
    m = re.match(r"usage: (\d+) input \+ (\d+) output tokens, context (\d+), 1 model call\(s\), 1 round\(s\)$",
                 usage[0])
    assert m and all(int(v) > 0 for v in m.groups()), usage[0]
    assert usage[1] == "usage: no tokens (a scripted model reads none), 3 model call(s), 3 round(s)", usage[1]


def test_a_failed_demo_shows_why_from_the_servers_stderr(tmp_path, monkeypatch, capsys):
    # the sidecar dies at start (a model that cannot load, a broken install): the demo says so with
    # the server's own words and where its whole stderr is, not only "the server closed its output"
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(demo.tempfile, "tempdir", None)

    def dying(argv, **kw):
        return SidecarClient([sys.executable, "-c", "import sys; sys.stderr.write('Traceback: llama model file not found\\n');"
                     " sys.exit(3)"], **kw)

    monkeypatch.setattr(demo, "SidecarClient", dying)
    assert demo.main() == 1
    out = capsys.readouterr().out
    assert "demo failed" in out and "│ Traceback: llama model file not found" in out, out
    # the log of this run, kept (the demo failed) and named
    log = re.search(rf"^the sidecar's whole stderr: ({re.escape(str(tmp_path))}/operate-sidecar-demo-\w+\.stderr\.log)$",
                    out, re.M)
    assert log and Path(log.group(1)).read_text() == "Traceback: llama model file not found\n", out
