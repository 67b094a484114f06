"""``make demo``: a scripted session against the real sidecar process with the
embedded local model (SmolLM2-135M-Instruct through llama.cpp).

It creates a branch, runs an ``operate`` with a ``responseFormat``,
``fieldModels``, ``reason`` and ``actions`` using the demo tools, shows the
streamed progress live and tool events as they arrive, answers the permission
request the server sends for a tool whose policy is ``ask``, then prints the
result and the branch's messages as a table, and a one-line summary.

Then an edit, in rounds (``maxRounds``): the model reads a file with ``read_file``, changes it
with ``edit_file`` (the permission request carries the diff preview, shown here before the
answer is given), and answers. The 135M local model cannot do this reliably (it copies text from
the tool descriptions instead of the file, see tests/models/test_models_local.py), so this part
uses a scripted model, and says so on screen. The file before and after and the token usage of
each operate are printed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

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

    def reset(self) -> None:
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

    def on_permission(self, params: dict, decision: str) -> None:
        with self.lock:
            self.events.append(("permission", f"permission asked: {params['tool']}"
                                              f"({json.dumps(params['arguments'])[:120]}) → answering {decision}"))

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
        with self.lock:
            extra = p.get("error") or cut(p.get("resultSummary") or "")
            self.events.append(("tool", f"tool #{p.get('seq')} {p.get('event'):>6} {p.get('tool')}"
                                        f"({cut(p.get('argsSummary') or '')}) {extra}".rstrip()))


def cut(text: str, limit: int = 72) -> str:
    """A summary as one short line: a tool's whole output (a file, a diff) is in its own panel."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def main() -> int:
    # the demo's workspace goes when it ends, however it ends (an error, Ctrl-C)
    with tempfile.TemporaryDirectory(prefix="operate-demo-") as tmp:
        return run(Path(tmp))


def run(workspace: Path) -> int:
    started = time.perf_counter()
    console.rule("[bold]operate-sidecar demo")
    console.print("Spawning the sidecar (python -m operate_sidecar.server) with the embedded local model…")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "operate-sidecar-demo.stderr.log")
    stderr_log = open(log_path, "wb")
    client = SidecarClient([sys.executable, "-m", "operate_sidecar.server", "--log-level", "WARNING"], env=env, stderr=stderr_log)
    screen = Screen()
    client.on_notification("$/progress", screen.on_progress)
    client.on_notification("toolEvent", screen.on_tool_event)
    asked: list[dict] = []
    (workspace / EDIT_FILE).write_text(EDIT_BEFORE)

    def on_permission(params: dict) -> dict:
        asked.append(params)
        screen.on_permission(params, "allow_once")
        return {"decision": "allow_once"}

    client.on_request("requestToolPermission", on_permission)
    try:
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
            with Live(screen.render(), console=console, refresh_per_second=12, transient=False) as live:
                while True:
                    try:
                        out = pending.result(timeout=0.1)
                        break
                    except TimeoutError:
                        live.update(screen.render())
                live.update(screen.render())
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
        screen.reset()
        edit_ok = edit_part(client, workspace, asked, screen)
        edit = {"tool_events": screen.count("tool"), "asked": len(asked) - first["asked"]}
        code = client.close()
        elapsed = time.perf_counter() - started
        console.print(f"[bold green]demo ok[/]: operate kind={out['kind']} model={out['model']}: "
                      f"{first['deltas']} streamed deltas, {first['tool_events']} tool events, "
                      f"{first['asked']} permission request(s) answered, {tool_runs} tool result(s), "
                      f"{msgs['total']} messages; edit: {edit['tool_events']} tool events, "
                      f"{edit['asked']} permission request(s) answered; server exit {code}, {elapsed:.1f} s")
        return 0 if code == 0 and edit_ok else 1
    except (RpcError, TimeoutError, StreamError, OSError) as e:
        console.print(f"[bold red]demo failed[/]: {escape(str(e) or type(e).__name__)}")
        client.close()
        stderr_log.flush()
        show_server_log(log_path)
        return 1
    finally:
        client.kill()  # however the demo ends (Ctrl-C too), the server does not outlive it
        stderr_log.close()


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


def edit_part(client: SidecarClient, workspace: Path, asked: list[dict], screen: Screen) -> bool:
    """Read, preview, edit, answer: one operate with maxRounds (scripted model, see the docstring)."""
    console.rule("[bold]an edit, in rounds")
    console.print("[yellow]The 135M local model cannot edit files reliably; this part uses a scripted model "
                  "(provider 'scripted') that replays a read → edit → answer session.[/]")
    path = workspace / EDIT_FILE
    console.print(Panel(Syntax(path.read_text(), "python"), title=f"{EDIT_FILE} before", border_style="blue"))
    n_asked = len(asked)
    branch = client.request("createBranch", {"system": "You fix code with the workspace tools.",
                                             "chatModel": "scripted-editor", "name": "edit"}, timeout=30)["branchId"]
    out = client.request("operate", {
        "branchId": branch, "instruction": f"Fix the typo in {EDIT_FILE}: read it, then edit it.",
        "responseFormat": EDIT_REPORT, "actions": True, "tools": ["read_file", "edit_file"],
        "maxRounds": 4, "workDoneToken": "demo-edit"}, timeout=60)
    with screen.lock:  # the tool events and the permission request, as they came, round after round
        events = list(screen.events)
    console.print(Panel(Text("\n".join(line for _, line in events) or "(none)"),
                        title=f"tool events and permissions ({out.get('rounds', 1)} rounds)", border_style="yellow"))
    for p in asked[n_asked:]:
        preview = p.get("preview") or {}
        shown = preview.get("path", "")
        try:
            shown = str(Path(shown).resolve().relative_to(workspace.resolve()))
        except ValueError:
            pass
        console.print(Panel(Syntax(preview.get("diff") or "(no preview)", "diff"),
                            title=escape(f"permission: {p['tool']} {shown}"),
                            subtitle="answered allow_once", border_style="magenta"))
    console.print(Panel(out["result"].get("summary", ""), title="answer (last round)", border_style="green"))
    after = path.read_text()
    console.print(Panel(Syntax(after, "python"), title=f"{EDIT_FILE} after", border_style="blue"))
    console.print(usage_line(out, scripted=True))
    return after != EDIT_BEFORE and len(asked) > n_asked


if __name__ == "__main__":
    raise SystemExit(main())
