"""``make demo``: a scripted session against the real sidecar process with the
embedded local model (SmolLM2-135M-Instruct through llama.cpp).

It creates a branch, runs an ``operate`` with a ``responseFormat``,
``fieldModels``, ``reason`` and ``actions`` using the demo tools, shows the
streamed progress live and tool events as they arrive, answers the permission
request the server sends for a tool whose policy is ``ask``, then prints the
result and the branch's messages as a table, and a one-line summary.

Then an edit, in rounds (``maxRounds``): the model reads a file with ``read_file``, changes it
with ``edit_file`` and answers; the tool events are printed as they come, and the permission
request's preview (the diff) is printed by the permission handler before it answers, so the
output reads: preview, permission answered, the edit runs. The 135M local model cannot do this
reliably (it copies text from the tool descriptions instead of the file, see
tests/models/test_models_local.py), so this part uses a scripted model, and says so on screen.
The file before and after and the token usage of each operate are printed.

However the demo ends (done, failed, Ctrl-C, SIGTERM, a closed terminal's SIGHUP), the server is
killed and its workspace removed. The server's stderr goes to a file of this run's own
(``$TMPDIR/operate-sidecar-demo-*.stderr.log``), removed at the end unless the demo failed: then
its last lines are shown and its path named. Stopped by a signal, the demo says so in one line
on stderr and exits 128 + the signal's number (130 for Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO, Iterator

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from operate_sidecar.clients.python.client import RpcError, SidecarClient, StreamError

console = Console(stderr=False, highlight=False)

ANSWER_SCHEMA = {
    "title": "WeatherReport",
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city asked about", "maxLength": 40},
        "summary": {"type": "string", "description": "One sentence for the user", "maxLength": 160},
    },
    "required": ["city", "summary"],
}
EDIT_FILE = "greeting.py"
EDIT_BEFORE = 'def greet(name):\n    return "Helo, " + name + "!"\n'
EDIT_REPORT = {"title": "EditReport", "type": "object",
               "properties": {"summary": {"type": "string", "description": "What was changed"}},
               "required": ["summary"]}
#: the scripted replies of the edit part: read, edit, answer (one per round)
EDIT_SCRIPT = [
    {"json": {"summary": "Reading the file first.",
              "action_requests": [{"function": "read_file", "arguments": {"path": EDIT_FILE}}]}},
    {"json": {"summary": "Fixing the typo.",
              "action_requests": [{"function": "edit_file", "arguments": {
                  "path": EDIT_FILE, "edits": [{"oldText": '"Helo, "', "newText": '"Hello, "'}]}}]}},
    {"json": {"summary": "Fixed the typo 'Helo' -> 'Hello' in greeting.py.", "action_requests": []}},
]
FIELD_MODELS = [{"name": "confidence", "schema": {"type": "number", "minimum": 0, "maximum": 1},
                 "description": "How sure you are, from 0 to 1"}]


def tools_line(tools: list[dict]) -> str:
    """The tools and their policies, as console markup (``[ask]`` escaped: not a style tag)."""
    return "tools: " + ", ".join(f"{escape(t['name'])} {escape('[' + str(t['policy']) + ']')}" for t in tools)


class Screen:
    """A live panel: the streamed model text, the phase, and tool events and permission requests
    in the order they came. ``reset()`` starts the counts of the next part afresh."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self, echo: bool = False) -> None:
        """``echo``: print each tool event as it comes too (when no live panel shows them)."""
        self.echo = echo
        self.phase = "starting"
        self.stream = ""
        self.deltas = 0
        self.events: list[tuple[str, str]] = []  # (kind: "tool" | "permission", line), as they came

    def count(self, kind: str) -> int:
        with self.lock:
            return sum(1 for k, _ in self.events if k == kind)

    def render(self) -> Panel:
        with self.lock:
            body = Text()
            body.append(f"phase: {self.phase}   deltas: {self.deltas}\n", style="bold cyan")
            tail = self.stream[-600:]
            body.append(tail or "…waiting for the model…", style="white")
            for kind, line in self.events[-10:]:
                body.append("\n" + line, style="magenta" if kind == "permission" else "yellow")
        return Panel(body, title="operate (live)", border_style="cyan")

    def on_permission(self, params: dict, decision: str) -> str:
        line = f"permission asked: {params['tool']}({json.dumps(params['arguments'])[:120]}) → answering {decision}"
        with self.lock:
            self.events.append(("permission", line))
        return line

    def on_progress(self, params: dict) -> None:
        value = params.get("value") or {}
        with self.lock:
            kind = value.get("kind")
            if kind == "begin":
                self.phase = f"begin: {value.get('message')}"
            elif kind == "report":
                self.phase = value.get("phase") or self.phase
                if value.get("delta"):
                    self.stream += value["delta"]
                    self.deltas += 1
            elif kind == "end":
                self.phase = f"end: {value.get('message')}"

    def on_tool_event(self, p: dict) -> None:
        extra = p.get("error") or cut(p.get("resultSummary") or "")
        line = (f"tool #{p.get('seq')} {p.get('event'):>6} {p.get('tool')}"
                f"({cut(p.get('argsSummary') or '')}) {extra}".rstrip())
        with self.lock:
            self.events.append(("tool", line))
            echo = self.echo
        if echo:
            console.print(Text(line, style="yellow"), no_wrap=True, overflow="ellipsis")  # one line each


def cut(text: str, limit: int = 72) -> str:
    """A summary as one short line: a tool's whole output (a file, a diff) is in its own panel."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


#: the signals that stop the demo as Ctrl-C does: ``kill`` (SIGTERM), a closed terminal (SIGHUP)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


#: the signal that stopped the demo, once one did
stopped_by: int | None = None
_holding = False          # inside held() (never nested): a stop signal waits for its end
_held: int | None = None  # the signal that came inside held()


class Stopped(KeyboardInterrupt):
    """The demo was stopped by ``signum`` (a KeyboardInterrupt, so that everything that cleans up
    after Ctrl-C, the client's ``close`` included, does so for SIGTERM and SIGHUP too)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def say(text: str) -> None:
    """One line on stderr; nothing when stderr is gone (the terminal closed: SIGHUP)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def main() -> int:
    """Run the demo in a temporary workspace: it goes when the demo ends, however it ends (done,
    an error, Ctrl-C, SIGTERM, SIGHUP), and so does the server (``run``'s ``finally``). A signal
    ends it with one line and exit code 128 + its number; the first one only: the clean-up after
    it is not interrupted by another (it is short: a SIGKILL and the removal of a few files)."""

    global stopped_by, _held

    def stop(signum: int, frame: object) -> None:
        global stopped_by, _held
        if stopped_by is not None:  # stopping already
            return
        stopped_by = signum
        if _holding:
            _held = signum
            return
        raise Stopped(signum)

    stopped_by = _held = None
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        with tempfile.TemporaryDirectory(prefix="operate-demo-") as tmp:
            return run(Path(tmp))
    except KeyboardInterrupt as e:
        return interrupted(getattr(e, "signum", signal.SIGINT))
    except OSError as e:  # no usable temporary folder (the run's own errors are said in run())
        if stopped_by is not None:  # stopping, the terminal went (SIGHUP): writing to it failed
            return interrupted(stopped_by)
        say(f"demo failed: {e}")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A stop signal that comes inside is raised when it ends: rich's live display started or
    stopped halfway would leave stdout and stderr redirected to it (the last line said into it)
    and the cursor hidden."""
    global _holding, _held
    _holding = True
    try:
        yield
    finally:
        _holding = False
    if _held is not None:
        signum, _held = _held, None
        raise Stopped(signum)


def interrupted(signum: int) -> int:
    """Say that the demo was stopped by ``signum``; its exit code (128 + the signal's number)."""
    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    say(f"demo interrupted ({how}): the sidecar is stopped and the demo's files are removed")
    return 128 + signum


def run(workspace: Path) -> int:
    started = time.perf_counter()
    console.rule("[bold]operate-sidecar demo")
    console.print("Spawning the sidecar (python -m operate_sidecar.server) with the embedded local model…")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the server's stderr: a file of this run's own (two demos at once, or another user's, write
    # their own), next to the workspace; kept only when the demo fails, to be read
    log_fd, log_path = tempfile.mkstemp(prefix="operate-sidecar-demo-", suffix=".stderr.log")
    failed = True  # until the demo ends well (a stopped one, a KeyboardInterrupt, has set stopped_by)
    try:
        with os.fdopen(log_fd, "wb") as stderr_log:
            code = _run(workspace, env, stderr_log, log_path, started)
        failed = code != 0
        return code
    finally:
        if not failed or stopped_by is not None:
            try:
                os.unlink(log_path)
            except OSError:
                pass


def _run(workspace: Path, env: dict[str, str], stderr_log: BinaryIO, log_path: str, started: float) -> int:
    """The demo itself, its server's stderr written to ``stderr_log``; 0 when it went well."""
    client: SidecarClient | None = None
    screen = Screen()
    asked: list[dict] = []

    def on_permission(params: dict) -> dict:
        asked.append(params)
        line = screen.on_permission(params, "allow_once")
        # the change asked about, before the answer is given; a request without a preview, as a
        # line when no live panel shows it
        if not show_preview(params, workspace, "allow_once") and screen.echo:
            console.print(Text(line, style="magenta"), no_wrap=True, overflow="ellipsis")
        return {"decision": "allow_once"}

    try:
        client = SidecarClient([sys.executable, "-m", "operate_sidecar.server", "--log-level", "WARNING"],
                               env=env, stderr=stderr_log)
        client.on_notification("$/progress", screen.on_progress)
        client.on_notification("toolEvent", screen.on_tool_event)
        (workspace / EDIT_FILE).write_text(EDIT_BEFORE)
        client.on_request("requestToolPermission", on_permission)
        init = client.request("initialize", {
            "protocolVersion": 1,
            "clientInfo": {"name": "operate-sidecar-demo", "version": "1"},
            "capabilities": {"toolPermission": True},
            "workspaceFolders": [str(workspace)],
            "settings": {
                "models": {"local": {"provider": "local"},
                           "scripted-editor": {"provider": "scripted", "responses": EDIT_SCRIPT}},
                "defaultModel": "local",
                "toolModules": ["operate_sidecar.clients.python.demo_tools"],
                "toolPolicy": {"get_weather": "ask"},
            },
        }, timeout=60)
        client.notify("initialized", {})
        console.print(f"initialize → {init['serverInfo']['name']} {init['serverInfo']['version']}, "
                      f"models {init['capabilities']['models']}")
        tools = client.request("listTools", {}, timeout=30)["tools"]
        console.print(tools_line(tools))
        branch = client.request("createBranch", {
            "system": "You are a weather assistant. You call tools to get facts.",
            "name": "demo"}, timeout=30)["branchId"]
        params = {
            "branchId": branch,
            "instruction": "What is the weather in Paris? Use the get_weather tool.",
            "responseFormat": ANSWER_SCHEMA,
            "fieldModels": FIELD_MODELS,
            "reason": True,
            "actions": True,
            "tools": ["get_weather"],
            "modelOptions": {"temperature": 0, "seed": 7, "max_tokens": 200},
            "workDoneToken": "demo-1",
        }
        pending = client.request_async("operate", params)
        if console.is_terminal:
            live = Live(screen.render(), console=console, refresh_per_second=12, transient=False)
            try:  # (its start, updates and stop whole: see held())
                with held():
                    live.start(refresh=True)
                while True:
                    try:
                        out = pending.result(timeout=0.1)
                        break
                    except TimeoutError:
                        with held():
                            live.update(screen.render())
                with held():
                    live.update(screen.render())
            finally:
                with held():
                    live.stop()
        else:  # piped: no live redraws, the final panel once
            out = pending.result(timeout=600)
            console.print(screen.render())
        # the first operate's own figures (the edit part below counts afresh)
        first = {"deltas": screen.deltas, "tool_events": screen.count("tool"), "asked": len(asked)}
        console.print(Panel(json.dumps(out["result"], indent=2, ensure_ascii=False)[:2500],
                            title=f"result: kind={out['kind']} model={out['model']}", border_style="green"))
        console.print(usage_line(out))
        msgs = client.request("branchMessages", {"branchId": branch}, timeout=30)
        table = Table(title=f"branch {branch[:8]}… messages ({msgs['total']})")
        for col in ("#", "kind", "role", "content"):
            table.add_column(col, overflow="fold")
        for i, m in enumerate(msgs["messages"]):
            c = m["content"]
            if m["kind"] == "instruction":
                text = c.get("instruction") or ""
            elif m["kind"] in ("action_request", "action_response"):
                text = json.dumps({k: c.get(k) for k in ("function", "arguments", "output") if k in c})
            else:
                text = c.get("text") or ""
            table.add_row(str(i), m["kind"], m["role"], escape(text[:160]))
        console.print(table)
        result = out.get("result") or {}
        tool_runs = len(result.get("action_responses") or []) if isinstance(result, dict) else 0
        screen.reset(echo=True)
        edit_ok = edit_part(client, workspace, asked, screen)
        edit = {"tool_events": screen.count("tool"), "asked": len(asked) - first["asked"]}
        code = client.close()
        elapsed = time.perf_counter() - started
        figures = (f"operate kind={out['kind']} model={out['model']}: "
                   f"{first['deltas']} streamed deltas, {first['tool_events']} tool events, "
                   f"{first['asked']} permission request(s) answered, {tool_runs} tool result(s), "
                   f"{msgs['total']} messages; edit: {edit['tool_events']} tool events, "
                   f"{edit['asked']} permission request(s) answered; server exit {code}, {elapsed:.1f} s")
        if code == 0 and edit_ok:
            console.print(f"[bold green]demo ok[/]: {figures}")
            return 0
        why = "the edit part did not change the file" if not edit_ok else f"the server exited {code}"
        console.print(f"[bold red]demo failed[/]: {why}; {figures}")
        stderr_log.flush()
        show_server_log(log_path)
        return 1
    except (RpcError, TimeoutError, StreamError, OSError) as e:
        console.print(f"[bold red]demo failed[/]: {escape(str(e) or type(e).__name__)}")
        if client is not None:
            client.close()
        stderr_log.flush()
        show_server_log(log_path)
        return 1
    finally:
        if client is not None:
            client.kill()  # however the demo ends (Ctrl-C too), the server does not outlive it


def show_server_log(path: str, lines: int = 15) -> None:
    """The end of the server's stderr, where the reason a failed demo failed is (a model that did
    not load, a traceback), and where the whole of it is."""
    try:
        with open(path, "rb") as f:
            tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        tail = []
    if tail:
        console.print(Panel(Text("\n".join(tail)), title="the sidecar's stderr (last lines)", border_style="red"))
        console.print(f"the sidecar's whole stderr: {escape(path)}", soft_wrap=True)
    else:
        console.print(f"the sidecar wrote nothing on stderr ({escape(path)})", soft_wrap=True)


def usage_line(out: dict, scripted: bool = False) -> str:
    """The operate's usage in one line; ``scripted``: its model replays replies and reads no
    tokens, which the line says instead of counts of 0."""
    u = out.get("usage") or {}

    def n(v: object) -> str:
        return "n/a" if v is None else str(v)

    tokens = ("no tokens (a scripted model reads none)" if scripted else
              f"{n(u.get('inputTokens'))} input + {n(u.get('outputTokens'))} output tokens, "
              f"context {n(u.get('contextTokens'))}")
    return f"[dim]usage: {tokens}, {u.get('modelCalls', 0)} model call(s), {out.get('rounds', 1)} round(s)[/]"


def show_preview(params: dict, workspace: Path, decision: str) -> bool:
    """A permission request's preview (the diff of the change asked about), printed before it is
    answered; False for a request without one (a tool that is not a file edit): nothing shown."""
    preview = params.get("preview") or {}
    if not preview.get("diff"):
        return False
    shown = preview.get("path", "")
    try:
        shown = str(Path(shown).resolve().relative_to(workspace.resolve()))
    except ValueError:
        pass
    console.print(Panel(Syntax(preview["diff"], "diff"), title=escape(f"permission: {params['tool']} {shown}"),
                        subtitle=f"answering {decision}", border_style="magenta"))
    return True


def edit_part(client: SidecarClient, workspace: Path, asked: list[dict], screen: Screen) -> bool:
    """Read, preview, edit, answer: one operate with maxRounds (scripted model, see the docstring).
    The tool events are printed as they come (``screen.echo``), the preview by the permission
    handler, so they read in the order they happened."""
    console.rule("[bold]an edit, in rounds")
    console.print("[yellow]The 135M local model cannot edit files reliably; this part uses a scripted model "
                  "(provider 'scripted') that replays a read → edit → answer session.[/]")
    path = workspace / EDIT_FILE
    console.print(Panel(Syntax(path.read_text(), "python"), title=f"{EDIT_FILE} before", border_style="blue"))
    n_asked = len(asked)
    branch = client.request("createBranch", {"system": "You fix code with the workspace tools.",
                                             "chatModel": "scripted-editor", "name": "edit"}, timeout=30)["branchId"]
    console.print("tool events and permission requests, as they come:")
    out = client.request("operate", {
        "branchId": branch, "instruction": f"Fix the typo in {EDIT_FILE}: read it, then edit it.",
        "responseFormat": EDIT_REPORT, "actions": True, "tools": ["read_file", "edit_file"],
        "maxRounds": 4, "workDoneToken": "demo-edit"}, timeout=60)
    console.print(Panel(out["result"].get("summary", ""), title=f"answer (last of {out.get('rounds', 1)} rounds)",
                        border_style="green"))
    after = path.read_text()
    console.print(Panel(Syntax(after, "python"), title=f"{EDIT_FILE} after", border_style="blue"))
    console.print(usage_line(out, scripted=True))
    return after != EDIT_BEFORE and len(asked) > n_asked


if __name__ == "__main__":
    raise SystemExit(main())
