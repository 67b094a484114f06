"""The VS Code extension (clients/vscode), tested for real.

Set-up once per module: clients/vscode/scripts/setup.sh (npm ci, apt chromium/ripgrep/libkrb5-dev
when missing, code-server@4.99.4 in itest-host/). Then, each as its own test:
  (a) node --test of the protocol client against the real Python server (scripted model)
  (b) tsc --noEmit typecheck of the extension (plus a negative control)
  (c) vsce package -> .vsix (contents checked)
  (d) the extension-host integration test: the unpacked .vsix inside code-server's real extension
      host, driven by headless chromium; its interactive paths (input boxes, quick picks) answer from
      scripted replacements of the extension's own window.showInputBox/showQuickPick, and Cancel is
      the real progress notification's button; Delete Branch from the palette asks first (a modal naming
      the chat); the chat command, the diff review (WorkspaceEdit in the
      buffer, undo), restart on a settings change and a server that dies at start; bad settings, Stop
      while the server starts, a server that never answers initialize, a server killed mid-reply; a palette
      command whose request fails shows one error message (the extension's) and resolves, so the workbench
      adds no "Command '...' resulted in an error" of its own; a server that dies during an Operate from the
      palette or a chat turn shows one error message, its exit notice (not also the Operate's own); a
      diff review that fails to open, or an fs handler that throws (the API's test seam `faults`), is
      one error naming it, the call denied or failed, nothing left waiting; a review's diff editor closed
      without deciding denies the call; a file deleted or renamed on disk during its review is not
      re-created by Accept; a file that is not UTF-8 text is not edited through the editor; a server that
      dies while a review waits leaves nothing waiting (no diff editor, badge or "waiting for you").
  (d2) the same harness in a multi-root workspace (--suite multi-root): paths of the second folder.
  (d3) the same harness in a window with no folder open (--suite no-folder, user settings).
  (e) through the real browser: the chat view (a webview) and the diff editor driven by mouse clicks
      and key presses over Chromium's DevTools protocol (also the chat hidden and shown again while a
      review waits, keyboard-only use and the extension's keybindings: Ctrl+Backspace / Ctrl+Enter
      in the diff editor, the Open Chat shortcut, Escape (also before the view reported its focus); Stop /
      Cancel in the command palette only while something runs; long lines wrap, Hebrew reads right to left; a redraw keeps the focus and a selection
      in the turns it did not change; the input's label and the live region; a call waiting for a decision said in
      the turn, the live region and the activity bar's badge; a window reload while a review waits, the stopped
      turns kept through it, the turn it ended marked as interrupted (Retry, no Copy, its call not answered); Retry on a stopped turn and on a failed one, the input's history on Up / Down,
      Ctrl+Enter / Ctrl+Backspace on a request without a diff; Retry on a turn stopped after its first
      round sends no context, the branch has it; the running turn's status line and the live region
      read the repair attempt while a reply not in the expected format is asked for again); screenshots
      land in .test-results/.
Every subprocess has a finite timeout; timings go to clients/vscode/.test-results/pytest-timings.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from tied import run_tied

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "clients" / "vscode"
BIN = EXT / "node_modules" / ".bin"
OUT = EXT / "out"
RESULTS = EXT / ".test-results"      # reports, logs, timings (gitignored, not packaged)

SETUP_TIMEOUT = 1200      # cold: about 2.5 min here (apt chromium + 2 npm ci)
NODE_TEST_TIMEOUT = 300
TSC_TIMEOUT = 180
VSCE_TIMEOUT = 300
ITEST_TIMEOUT = 420       # the harness itself gives up after 300 s
UI_TIMEOUT = 420          # run-ui-test.mjs gives up after 300 s
# pytest-timeout (make test passes --timeout=180) covers fixture set-up too: raise it for this module.
pytestmark = pytest.mark.timeout(SETUP_TIMEOUT + ITEST_TIMEOUT + UI_TIMEOUT + 120)

TIMINGS: dict[str, float] = {}


def run(argv: list[str], timeout: float, name: str, cwd: Path = EXT, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPERATE_SIDECAR_PYTHON=str(ROOT / ".venv" / "bin" / "python")
               if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable)
    env.pop("NODE_OPTIONS", None)
    t0 = time.monotonic()
    try:
        return run_tied(argv, timeout, cwd=cwd, env=env, stdin=subprocess.DEVNULL, text=True, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name}: timed out after {timeout}s\n{(e.stdout or '')[-3000:]}\n{(e.stderr or '')[-3000:]}")
    finally:
        TIMINGS[name] = round(time.monotonic() - t0, 1)


def tail(p: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"rc={p.returncode}\n--- stdout\n{p.stdout[-n:]}\n--- stderr\n{p.stderr[-n:]}"


@pytest.fixture(scope="module", autouse=True)
def setup_done():
    for tool in ("node", "npm", "bash"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is required for the VS Code client tests")
    p = run(["bash", str(EXT / "scripts" / "setup.sh")], SETUP_TIMEOUT, "setup.sh")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "setup-log.txt").write_text(p.stdout + p.stderr)
    assert p.returncode == 0, f"setup.sh failed\n{tail(p)}"
    yield
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pytest-timings.json").write_text(json.dumps(TIMINGS, indent=2))


@pytest.fixture(scope="module")
def vsix(setup_done, tmp_path_factory) -> dict:
    """vsce package (its vscode:prepublish compiles src/ with tsc), once."""
    out = tmp_path_factory.mktemp("vsix") / "operate-sidecar.vsix"
    # --no-rewrite-relative-links: the README's screenshot is packaged (media/) and shown from there
    p = run([str(BIN / "vsce"), "package", "--allow-missing-repository", "--skip-license", "--no-rewrite-relative-links",
             "--out", str(out)],
            VSCE_TIMEOUT, "(c) vsce package")
    return {"proc": p, "path": out}


def test_a_protocol_client_against_the_real_server_with_node_test():
    build = run([str(BIN / "tsc"), "-p", "."], TSC_TIMEOUT, "(a) tsc build")
    assert build.returncode == 0, tail(build)
    report = RESULTS / "node-test-report.json"
    report.unlink(missing_ok=True)
    p = run(["node", "--test", "--test-timeout=60000",
             "--test-reporter=spec", "--test-reporter-destination=stdout",
             "--test-reporter=./scripts/json-reporter.mjs", f"--test-reporter-destination={report}",
             "out/test/"], NODE_TEST_TIMEOUT, "(a) node --test")
    assert report.exists(), f"no JSON report\n{tail(p)}"
    r = json.loads(report.read_text())
    failed = [(t["name"], t.get("error")) for t in r["tests"] if t["status"] != "pass"]
    assert p.returncode == 0 and not failed, f"{failed}\n{r.get('diagnostics')}\n{tail(p)}"
    assert r["fail"] == r["skip"] == r["todo"] == 0 and r["pass"] == r["total"] >= 12, r
    names = " | ".join(t["name"] for t in r["tests"])
    for topic in ("initialize", "$/progress", "toolEvents", "requestToolPermission", "invokeClientTool",
                  "cancel mid model call", "error codes", "dies", "fs/readTextFile and fs/writeTextFile",
                  "structured replies show their prose fields", "sanitized", "tool cards",
                  'plain text starting with "{"', "refusesField", "no empty message bubble",
                  "the status line of a running turn says what it does", "a repair attempt",
                  "StreamMarkdown", "a long streamed reply reaches the view as what changed", "after a window reload ended a turn",
                  "the file list of a multi-root workspace", "a diff review whose file changes meanwhile"):
        assert topic in names, f"missing test about {topic!r}: {names}"


def test_b_typecheck_of_the_extension_against_types_vscode(tmp_path):
    p = run([str(BIN / "tsc"), "-p", ".", "--noEmit", "--pretty", "false"], TSC_TIMEOUT, "(b) tsc --noEmit")
    assert p.returncode == 0 and "error TS" not in p.stdout, tail(p)
    # negative control: the same check rejects a misuse of the vscode API
    shutil.copytree(EXT / "src", tmp_path / "src")
    shutil.copy(EXT / "tsconfig.json", tmp_path / "tsconfig.json")
    (tmp_path / "node_modules").symlink_to(EXT / "node_modules")
    with open(tmp_path / "src" / "extension.ts", "a") as f:
        f.write("\nexport const broken: number = vscode.window.showInputBox();\n")
    bad = run([str(BIN / "tsc"), "-p", ".", "--noEmit", "--pretty", "false"], TSC_TIMEOUT, "(b) negative control",
              cwd=tmp_path)
    assert bad.returncode != 0 and "extension.ts" in bad.stdout and "error TS2322" in bad.stdout, tail(bad)


def test_c_vsce_package_produces_a_complete_vsix(vsix):
    p = vsix["proc"]
    assert p.returncode == 0 and vsix["path"].exists(), tail(p)
    with zipfile.ZipFile(vsix["path"]) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("extension/package.json"))
    for required in ("extension/package.json", "extension/readme.md", "extension/out/extension.js",
                     "extension/out/rpcClient.js", "extension/out/chatView.js", "extension/out/chatModel.js",
                     "extension/out/diffReview.js", "extension/out/branchStore.js", "extension/out/context.js",
                     "extension/out/sidecar-client/index.js", "extension/out/sidecar-client/generated/protocol.js",
                     "extension/media/chat.js", "extension/media/chat.css", "extension/media/chat.svg",
                     "extension/node_modules/vscode-jsonrpc/package.json",
                     "extension/node_modules/vscode-jsonrpc/lib/node/main.js",
                     "extension/node_modules/markdown-it/package.json", "extension/media/chat-diff-review.png",
                     "extension.vsixmanifest"):
        assert required in names, f"{required} missing from the vsix"
    top = {n.split("/")[1] if n.startswith("extension/") else n for n in names}
    assert top == {"[Content_Types].xml", "extension.vsixmanifest", "package.json", "readme.md", "out", "node_modules",
                   "media"}, top
    modules = {n.split("/")[2] for n in names if n.startswith("extension/node_modules/")}
    assert modules == {"vscode-jsonrpc", "markdown-it", "argparse", "entities", "linkify-it", "mdurl", "punycode.js",
                       "uc.micro"}, f"only the runtime dependencies are bundled: {modules}"
    leaked = [n for n in names if n.startswith(("extension/out/test/", "extension/out/itest/"))
              or (n.startswith("extension/out/") and not n.endswith(".js"))]
    assert not leaked, f"dev files in the vsix: {sorted(leaked)[:20]}"
    assert manifest["engines"]["vscode"] == "^1.90.0" and manifest["devDependencies"]["@types/vscode"] == "1.90.0"
    assert {c["command"] for c in manifest["contributes"]["commands"]} == {
        f"operateSidecar.{c}" for c in ("operate", "cancel", "showMessages", "newBranch", "forkBranch", "deleteBranch",
                                         "listTools", "restart", "openChat", "chat", "stop", "newChat", "pickBranch",
                                         "pickModel", "attachFile", "attachSelection", "exportChat", "acceptEdit",
                                         "rejectEdit", "alwaysAllowEdit")}
    # the chat view in its own activity-bar container; Accept/Reject in the diff editor's title behind a context key
    c = manifest["contributes"]
    assert c["viewsContainers"]["activitybar"][0]["id"] == "operateSidecar"
    assert c["views"]["operateSidecar"] == [{"type": "webview", "id": "operateSidecar.chat", "name": "Chat"}]
    # the chat view's title: New Chat and Switch Chat as buttons, Export Chat in its "..." menu
    assert [(m["command"], m["group"]) for m in c["menus"]["view/title"] if m["when"] == "view == operateSidecar.chat"] == [
        ("operateSidecar.newChat", "navigation@1"), ("operateSidecar.pickBranch", "navigation@2"),
        ("operateSidecar.exportChat", "1_chat@1")], c["menus"]["view/title"]
    title = {m["command"]: m["when"] for m in c["menus"]["editor/title"]}
    assert set(title) == {"operateSidecar.acceptEdit", "operateSidecar.rejectEdit", "operateSidecar.alwaysAllowEdit"}
    assert all("operateSidecar.reviewPending" in w for w in title.values()), title
    # keyboard shortcuts: each runs a contributed command, has a macOS variant, and all but Open Chat
    # (a chord no default uses) are scoped by a `when` to where they apply
    commands = {x["command"] for x in c["commands"]}
    keys = {k["command"]: k for k in c["keybindings"]}
    assert len(keys) == len(c["keybindings"]) and set(keys) <= commands, c["keybindings"]
    assert set(keys) == {f"operateSidecar.{k}" for k in ("openChat", "acceptEdit", "rejectEdit", "stop")}, set(keys)
    assert all(k["key"] and k["mac"] for k in keys.values()), keys
    for decide in ("operateSidecar.acceptEdit", "operateSidecar.rejectEdit"):
        when = keys[decide]["when"]
        assert "operateSidecar.reviewPending" in when and "resourceScheme == operate-sidecar-proposed" in when, when
    assert keys["operateSidecar.stop"]["when"] == "operateSidecar.chatRunning && operateSidecar.chatFocus && !inputFocus"
    # the command palette offers a command only where it can work: Stop / Cancel while something runs, the
    # decisions while a review waits; Send to Chat (it needs its text) never
    palette = {m["command"]: m["when"] for m in c["menus"]["commandPalette"]}
    assert palette == {"operateSidecar.stop": "operateSidecar.chatRunning", "operateSidecar.cancel": "operateSidecar.busy",
                       "operateSidecar.chat": "false", "operateSidecar.attachSelection": "editorHasSelection",
                       **{f"operateSidecar.{d}": "operateSidecar.reviewPending"
                          for d in ("acceptEdit", "rejectEdit", "alwaysAllowEdit")}}, palette
    # the context menus: Attach File on a file (Explorer, editor tab), Add the Selection on a selection
    assert [(m["command"], m["when"]) for m in c["menus"]["explorer/context"] + c["menus"]["editor/title/context"]
            + c["menus"]["editor/context"]] == [
        ("operateSidecar.attachFile", "!explorerResourceIsFolder"), ("operateSidecar.attachFile", "resourceScheme == file"),
        ("operateSidecar.attachSelection", "editorHasSelection && resourceScheme != operate-sidecar-proposed")]
    readme = (EXT / "README.md").read_text()
    shot = EXT / "media" / "chat-diff-review.png"
    assert readme.startswith("# operate-sidecar for VS Code\n\n![") and "(media/chat-diff-review.png)" in readme.split("\n")[2]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size < 300_000, "the README screenshot stays small"
    props = c["configuration"]["properties"]
    assert props["operateSidecar.maxRounds"]["default"] == 4 and props["operateSidecar.toolPolicy"]["type"] == "object"
    # a dropdown setting: each choice described, the empty one labelled (not a blank entry)
    answer = props["operateSidecar.permissionAnswer"]
    assert answer["enum"][0] == answer["default"] == "" and answer["enumItemLabels"][0] == "(ask)", answer
    assert len(answer["enumDescriptions"]) == len(answer["enumItemLabels"]) == len(answer["enum"]), answer
    assert all(d.strip() for d in answer["enumDescriptions"]) and "(ask)" in answer["markdownDescription"], answer


def run_itest_suite(vsix, tmp_path, label, *suite):
    """Run ``run-itest.mjs`` (``--suite ...`` when given) on the unpacked .vsix; assert it ran
    green on that very extension; return (summary, report)."""
    assert vsix["proc"].returncode == 0, f"packaging failed, nothing to load\n{tail(vsix['proc'])}"
    with zipfile.ZipFile(vsix["path"]) as z:
        z.extractall(tmp_path)
    ext_dir = tmp_path / "extension"
    p = run(["node", "scripts/run-itest.mjs", "--ext", str(ext_dir), *suite, "--timeout", "300"], ITEST_TIMEOUT, label)
    try:
        summary = json.loads(p.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"the harness printed no JSON\n{tail(p)}")
    report = summary.get("report") or {}
    bad = [c for c in report.get("checks", []) if not c["ok"]]
    # the failed checks first, then the browser's console (a page that never loaded says why there), then the rest
    assert p.returncode == 0 and summary["ok"] is True, json.dumps(
        {"checks_failed": bad, "chromiumLog": summary.get("chromiumLog"), **summary}, indent=1)[:12000]
    assert Path(report["extensionPath"]).resolve() == ext_dir.resolve(), "the unpacked vsix was the extension loaded"
    assert not bad and report.get("fatal") is None, report["checks"]
    return summary, report


def test_d_extension_host_integration_on_the_unpacked_vsix(vsix, tmp_path):
    summary, report = run_itest_suite(vsix, tmp_path, "(d) extension-host itest")
    TIMINGS["(d) code-server ready"] = round(summary.get("timings", {}).get("codeServerReadyMs", 0) / 1000, 1)
    assert report["vscodeVersion"] == "1.99.3" and report["appName"] == "code-server", report
    assert len(report["checks"]) == 53, report["checks"]
    assert "[tool post] shout" in report["outputChannel"] and "=== cancelled:" in report["outputChannel"]
    names = " | ".join(c["name"] for c in report["checks"])
    for topic in ("asks for the instruction", "answered allow_once", "answered deny_once", "answered allow_always",
                  "answered deny_always", "dismissed (= deny_once)", "set-policy command", "asks for the system prompt",
                  "Cancel on the progress notification", "Cancel while the permission quick pick is open",
                  "chat command", "acceptEdit lands as a WorkspaceEdit", "rejectEdit denies", "restarts the server by itself",
                  "dies at start", "Always for this branch", "#selection (file, language, line range), #problems",
                  "invalid maxRounds", "command given as a string", "Stop pressed twice while the server is starting",
                  "never answers initialize", "crashes mid-reply", "program is missing", "nobody answers times out",
                  "rendered and shown in batches", "reviewed one after the other", "running tool card shows its arguments",
                  "the status bar says stopped (why in its tooltip) and its click restarts", "the status bar says stopped; the next turn",
                  "outputText() is the channel's last 200 000 characters",
                  "waiting for your decision says so where you look", "a long chat stays light",
                  "Delete Branch from the command palette (no argument) asks first",
                  "the chat picker's delete button asks first, the same modal as Delete Branch",
                  "with two reviews waiting and no diff editor focused: a quick pick names them",
                  "from the palette whose request fails shows one error message, not two",
                  "the server dies during an Operate from the palette: one error message, the exit notice",
                  "a diff review that fails to open", "an fs handler that throws",
                  "a model stuck on the same failing call: the chat's rounds stop after 3 in a row",
                  "closing a review's diff editor without deciding denies the call once",
                  "a file deleted or renamed on disk while its edit waits for review: Accept fails the call",
                  "a file that is not UTF-8 text (Latin-1) is neither edited nor its bytes replaced",
                  "the server dies while an edit waits for review (a chat turn, an Operate): the review is withdrawn"):
        assert topic in names, f"missing extension-host check about {topic!r}: {names}"


def test_d2_extension_host_multi_root_workspace(vsix, tmp_path):
    """The unpacked .vsix in a multi-root workspace (run-itest.mjs --suite multi-root: folders ws, second)."""
    _, report = run_itest_suite(vsix, tmp_path, "(d2) extension-host itest, multi-root", "--suite", "multi-root")
    assert len(report["checks"]) == 3, report["checks"]
    names = " | ".join(c["name"] for c in report["checks"])
    for topic in ("multi-root workspace", "sent as second/src/app.py", "lands in the second folder"):
        assert topic in names, f"missing multi-root check about {topic!r}: {names}"


def test_d3_extension_host_with_no_folder_open(vsix, tmp_path):
    """The unpacked .vsix in a window with no folder (run-itest.mjs --suite no-folder: user settings)."""
    _, report = run_itest_suite(vsix, tmp_path, "(d3) extension-host itest, no folder open", "--suite", "no-folder")
    assert len(report["checks"]) == 4 and report["shown"] == [], report
    names = " | ".join(c["name"] for c in report["checks"])
    for topic in ("no folder open", "answers a plain question", "no file tools are offered", "say why nothing was attached"):
        assert topic in names, f"missing no-folder check about {topic!r}: {names}"


def test_d4_extension_host_chats_switched_deleted_changed(vsix, tmp_path):
    """The unpacked .vsix with chats switched while a turn runs, a chat deleted elsewhere and the
    picked model removed from the settings (run-itest.mjs --suite chats)."""
    _, report = run_itest_suite(vsix, tmp_path, "(d4) extension-host itest, chats", "--suite", "chats")
    assert len(report["checks"]) == 5, report["checks"]
    names = " | ".join(c["name"] for c in report["checks"])
    for topic in ("stopped while another chat was picked", "failed while another chat was picked",
                  "deleted elsewhere", "removed from the settings"):
        assert topic in names, f"missing chats check about {topic!r}: {names}"


def test_e_chat_view_and_diff_review_through_the_browser(vsix, tmp_path):
    """The chat webview and the diff editor, driven like a user over Chromium's DevTools protocol."""
    assert vsix["proc"].returncode == 0, f"packaging failed, nothing to load\n{tail(vsix['proc'])}"
    with zipfile.ZipFile(vsix["path"]) as z:
        z.extractall(tmp_path)
    ext_dir = tmp_path / "extension"
    shots = RESULTS / "ui"
    shutil.rmtree(shots, ignore_errors=True)
    p = run(["node", "scripts/run-ui-test.mjs", "--ext", str(ext_dir), "--out", str(shots), "--timeout", "300"],
            UI_TIMEOUT, "(e) chat view through the browser")
    try:
        summary = json.loads(p.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"the harness printed no JSON\n{tail(p)}")
    bad = [c for c in summary.get("checks", []) if not c["ok"]]
    assert p.returncode == 0 and summary["ok"] is True, json.dumps({**summary, "checks_failed": bad}, indent=1)[:8000]
    names = " | ".join(c["name"] for c in summary["checks"])
    assert len(summary["checks"]) == 25, names
    for topic in ("prose streams in", "Insert on a code block", "diff editor opens", "Ctrl+Z undoes it",
                  "rejected from the diff editor title", "switch back through the chat picker", "pick a model",
                  "Stop a running turn", "hidden and shown again while it waits", "Attach file (+ File under the input)",
                  "Open Chat from the editor puts the cursor in the chat input", "stopped turns stay in the chat",
                  "Ctrl+Backspace in its left (file) side rejects", "Ctrl+Enter in its right (proposed) side accepts",
                  "its shortcut, Ctrl+Shift+Alt+/", "Escape in the editor leaves the turn running",
                  "the input has a label and a polite live region", "replaces only what changed",
                  "the activity bar badge counts it while the chat is hidden",
                  "the window reloaded while a review waits", "its stopped turns in place (marked, with Retry)",
                  "Retry on a stopped turn", "not the selection in the editor now", "Edit puts a message back into the input",
                  "input history: Up on the first line", "Down goes back to the draft", "kept when the chat is hidden and shown again",
                  "without a diff (shout, policy ask)", "Ctrl+Enter in the input accepts",
                  "an editor tab dragged for real", "a folder alone: a message",
                  "also before the view has reported its focus", "Retry on a failed turn", "the failed turn stays in its place",
                  "Retry on a turn stopped after its first round", "the model reads the file once",
                  'what the turn does ("writing…")', "read the repair attempt", "both go when the turn ends"):
        assert topic in names, f"missing browser check about {topic!r}: {names}"
    for shot in ("chat.png", "diff-review.png", "chat-final.png"):
        png = shots / shot
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, png
