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


def test_no_workspace_is_left_behind(piped_run, tmp_path, monkeypatch):
    assert not list(piped_run[1].glob("operate-demo-*"))                  # a run that went well
    # ... one that fails or is interrupted (Ctrl-C) removes it too
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(demo.tempfile, "tempdir", None)
    seen = []
    for exc in (KeyboardInterrupt, RuntimeError):
        def run(workspace: Path, exc=exc) -> int:
            seen.append(workspace)
            assert workspace.is_dir() and workspace.name.startswith("operate-demo-")
            raise exc("stop")
        monkeypatch.setattr(demo, "run", run)
        with pytest.raises(exc):
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
    assert "answered allow_once" in panel(out, "edit_file")[-1]


def test_the_edit_part_shows_its_tool_events_and_permission_in_order(piped_run):
    out = piped_run[0].stdout
    lines = panel(out, "tool events and permissions")
    assert "(3 rounds)" in lines[0], lines[0]
    events = [(m.group(2), m.group(3)) if m.group(1) is None else ("permission", m.group(1))
              for m in (re.match(r"│ (?:permission asked: (\w+)\(|tool #\d+ +(pre|post) (\w+)\()", ln) for ln in lines)
              if m]
    assert events == [("pre", "read_file"), ("post", "read_file"), ("permission", "edit_file"),
                      ("pre", "edit_file"), ("post", "edit_file")], lines
    summary = " ".join(out[out.index("demo ok"):].split())
    assert "edit: 4 tool events, 1 permission request(s) answered;" in summary  # the events shown above
    # a tool's output is cut short here (the whole diff has its own panel): not read_file's whole JSON
    text = " ".join(ln.strip("│ ") for ln in lines)
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
    real = demo.SidecarClient

    def dying(argv, **kw):
        return real([sys.executable, "-c", "import sys; sys.stderr.write('Traceback: llama model file not found\\n');"
                     " sys.exit(3)"], **kw)

    monkeypatch.setattr(demo, "SidecarClient", dying)
    assert demo.main() == 1
    out = capsys.readouterr().out
    assert "demo failed" in out and "│ Traceback: llama model file not found" in out, out
    assert f"the sidecar's whole stderr: {tmp_path / 'operate-sidecar-demo.stderr.log'}\n" in out, out
