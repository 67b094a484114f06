"""Hostile input for the ACP front end (``operate-sidecar --acp``: newline-delimited JSON on
stdin and stdout): lines that are not messages, and random and mutated params of every
method the agent serves. After each input, what the native fuzz checks holds here too:

- every request is answered once, under its id: a result of the shape the ACP schema gives the
  method's response (checked with the schema the SDK ships, strictly), or an error of JSON-RPC's
  shape whose code the front end may answer bad input with; never -32603 (an internal error),
  never a traceback (in the answer or on stderr);
- a line that is no request gets at most one answer, with id null (-32700 not JSON, -32600 not a
  request); a notification and a stray answer get none;
- every line on stdout is a JSON-RPC 2.0 message of the schema's, in Unicode text; what the
  agent sends on its own (``session/update``) is the schema's ``SessionNotification``;
- the agent is alive and in sync: a ``session/list`` sent after the input is answered.

One agent process for the module, with the scripted model (each prompt that passes
validation is answered at once, so the turns run whole: render, model, parse, record). A
session of its own is made at the start and kept (prompts, loads, modes and options aim at
it); an input that kills the agent fails its example and the next gets a fresh process."""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frame_model import json_values
from fuzz_support import OUTCOMES, ServerDied, has_traceback, profile, run_example

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "acp"))
from acp_support import AGENT_REQUESTS, RESULTS, agent_env, not_utf8, reply, schema_errors, write_config  # noqa: E402
from acp import schema as S  # noqa: E402

ANSWER_TIMEOUT = 30.0   # a fuzzed request (a prompt runs a whole turn with the scripted model)
SYNC_TIMEOUT = 10.0     # the session/list after each input
REPLIES = 3000          # scripted replies (x3): more than the prompts of the stress run can take
#: one reply in three makes a tool call: a write, which asks the client first (in the ask mode),
#: the client refuses that request, so the write is denied and the turn goes on to its next round
WRITE = reply("", [("write_file", {"path": "b.txt", "content": "new\n"})])
#: the turns of the agent whose client has the fs capability: a read, an edit and a write, each
#: through the client (fs/read_text_file, fs/write_text_file) and the edits asked about first
FS_TURNS = [reply("", [("read_file", {"path": "a.txt"})]), reply("ok"),
            reply("", [("edit_file", {"path": "a.txt", "edits": [{"oldText": "old", "newText": "new"}]})]), reply("ok"),
            reply("", [("write_file", {"path": "c.txt", "content": "c\n"})]), reply("ok")]

#: the methods the agent serves (a request each; session/cancel is a notification)
METHODS = ["initialize", "authenticate", "session/new", "session/load", "session/resume", "session/fork",
           "session/close", "session/list", "session/set_config_option", "session/set_mode", "session/prompt"]
#: what bad params may be answered with: -32602 (what is wrong, named), -32002 (no such session
#: or file); a prompt's turn may also fail as the service's operate does (-32010 cancelled,
#: -32011 its model); authenticate has no method to authenticate with (-32602)
ALLOWED: dict[str, set[int]] = {m: {-32602, -32002} for m in METHODS}
ALLOWED["session/prompt"] |= {-32010, -32011}
FIELDS: dict[str, list[str]] = {
    "initialize": ["protocolVersion", "clientCapabilities", "clientInfo"],
    "authenticate": ["methodId"],
    "session/new": ["cwd", "mcpServers", "additionalDirectories"],
    "session/load": ["sessionId", "cwd", "mcpServers", "additionalDirectories"],
    "session/resume": ["sessionId", "cwd", "mcpServers", "additionalDirectories"],
    "session/fork": ["sessionId", "cwd", "mcpServers", "additionalDirectories"],
    "session/close": ["sessionId"],
    "session/list": ["cwd", "cursor", "additionalDirectories"],
    "session/set_config_option": ["sessionId", "configId", "value"],
    "session/set_mode": ["sessionId", "modeId"],
    "session/prompt": ["sessionId", "prompt"],
    "session/cancel": ["sessionId"],
}

LINE_PROFILES = [pytest.param(profile("fast", 60), id="fast"),
                 pytest.param(profile("stress", 1500), id="stress", marks=pytest.mark.slow)]
PARAM_PROFILES = [pytest.param(profile("fast", 150), id="fast"),
                  pytest.param(profile("stress", 3000), id="stress", marks=pytest.mark.slow)]


#: the answers once the plan has none left: the first option offered (allow once), a file not
#: found (a write goes on, an edit of it fails), a write done
FALLBACK = {"session/request_permission": ("select", 0), "fs/read_text_file": ("error", -32002, "not found"),
            "fs/write_text_file": ("result", None)}


def answer(request: dict, how: tuple) -> dict:
    """The client's answer to the agent's ``request``, as ``how`` says: ("select", k) the k-th
    option offered (a permission request; else a result of that shape all the same),
    ("cancelled",), ("content", text) (a read's), ("result", any JSON) or ("error", code, message)."""
    out: dict[str, Any] = {"jsonrpc": "2.0", "id": request["id"]}
    kind = how[0]
    if kind == "select":
        options = (request.get("params") or {}).get("options") or [{"optionId": "none"}]
        out["result"] = {"outcome": {"outcome": "selected", "optionId": options[how[1] % len(options)]["optionId"]}}
    elif kind == "cancelled":
        out["result"] = {"outcome": {"outcome": "cancelled"}}
    elif kind == "content":
        out["result"] = {"content": how[1]}
    elif kind == "result":
        out["result"] = how[1]
    else:
        out["error"] = {"code": how[1], "message": how[2]}
    return out


class FuzzAgent:
    """One ``--acp`` process over real pipes: a reader thread parses each stdout line; the
    agent's own requests to the client (a permission, a file when the client has the ``fs``
    capability) are answered as ``plan`` says, then as a client would (FALLBACK)."""

    def __init__(self, fs: bool = False) -> None:
        self.fs = fs
        #: how the client answers the agent's next requests (``answer``); refused once none is left
        self.plan: list[tuple] = []
        self.dir = tempfile.TemporaryDirectory(prefix="fuzz-acp-")
        root = Path(self.dir.name)
        self.ws = root / "ws"
        self.ws.mkdir()
        (self.ws / "a.txt").write_text("old text\n")
        self.config = write_config(root / "settings.toml", {
            "models": {"s": {"provider": "scripted", "responses": (FS_TURNS if fs else [reply("ok"), WRITE, reply("ok")])
                             * REPLIES},
                       "t": {"provider": "scripted", "responses": [reply("ok")] * 50}},
            "defaultModel": "s", "permissionTimeoutMs": 1000})
        self.ids = itertools.count(1)
        self.proc: subprocess.Popen | None = None
        self.start()

    # ------------------------------------------------------------------ the process
    def start(self) -> None:
        self.err = tempfile.TemporaryFile()
        self.err_seen = 0
        self.proc = subprocess.Popen([sys.executable, "-m", "operate_sidecar.server", "--acp", "--config", self.config],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, cwd=str(self.ws),
                                     env=agent_env())
        self.answers: dict[Any, list[dict]] = {}
        self.null_answers: list[dict] = []
        self.others: list[dict] = []          # notifications and the agent's requests
        self.bad_lines: list[str] = []        # stdout lines that are not JSON-RPC messages
        self.arrived = threading.Condition()
        self.tainted = False
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        self.call("initialize", {"protocolVersion": 1, "clientCapabilities": {
            "fs": {"readTextFile": True, "writeTextFile": True}} if self.fs else {}})
        new = self.call("session/new", {"cwd": str(self.ws), "mcpServers": []})
        self.sid = new["sessionId"]
        self.modes = [m["id"] for m in (new.get("modes") or {}).get("availableModes", [])] or ["ask"]
        self.spare = self.call("session/new", {"cwd": str(self.ws), "mcpServers": []})["sessionId"]

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                msg = None
            with self.arrived:
                if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
                    self.bad_lines.append(raw.decode("utf-8", "replace")[:300])
                elif "method" in msg:
                    self.others.append(msg)
                    if "id" in msg:  # a request of the agent's: answered as planned, else refused
                        self.write(answer(msg, self.plan.pop(0) if self.plan else FALLBACK.get(
                            msg["method"], ("error", -32601, "not in this test"))))
                elif msg.get("id") is None:
                    self.null_answers.append(msg)
                else:
                    self.answers.setdefault(json.dumps(msg["id"]), []).append(msg)
                self.arrived.notify_all()

    def write(self, msg: Any) -> None:
        self.write_line(json.dumps(msg, ensure_ascii=True).encode())

    def write_line(self, line: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the agent died: check_alive names it

    def wait_answer(self, msg_id: Any, timeout: float) -> dict | None:
        key = json.dumps(msg_id)
        deadline = time.monotonic() + timeout
        with self.arrived:
            while key not in self.answers:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc is not None and self.proc.poll() is not None):
                    return None
                self.arrived.wait(min(left, 0.5))
            return self.answers[key][0]

    def call(self, method: str, params: Any) -> Any:
        msg_id = f"setup-{next(self.ids)}"
        self.write({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        msg = self.wait_answer(msg_id, ANSWER_TIMEOUT)
        assert msg is not None and "result" in msg, f"{method} at the start: {msg}; stderr:\n{self.stderr_tail()}"
        return msg["result"]

    def stderr_tail(self, n: int = 3000) -> str:
        self.err.seek(0)
        return self.err.read().decode("utf-8", "replace")[-n:]

    def new_stderr(self) -> str:
        self.err.seek(self.err_seen)
        text = self.err.read().decode("utf-8", "replace")
        self.err_seen += len(text.encode("utf-8", "replace"))
        return text

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        try:
            if p.stdin:
                p.stdin.close()
            p.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait(10)

    def restart(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.start()

    # ------------------------------------------------------------------ per input (fuzz_support.run_example)
    def begin(self) -> None:
        """Before an input: a fresh process if the last one died or lost sync."""
        if self.tainted or self.dead():
            self.restart()

    def dead(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def check_alive(self) -> None:
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is not None:
            self.tainted = True
            raise ServerDied(f"the agent died (exit code {rc}); stderr tail:\n{self.stderr_tail()}")

    def sync(self) -> None:
        """A ``session/list`` with a fresh id is answered with a list: alive and in sync."""
        self.check_alive()
        msg_id = f"sync-{next(self.ids)}"
        self.write({"jsonrpc": "2.0", "id": msg_id, "method": "session/list", "params": {}})
        msg = self.wait_answer(msg_id, SYNC_TIMEOUT)
        if msg is None:
            self.tainted = True
            self.check_alive()
            raise AssertionError(f"session/list {msg_id!r} after the input was not answered within {SYNC_TIMEOUT} s: "
                                 "the stream is out of sync or the agent is stuck")
        assert "result" in msg and isinstance(msg["result"].get("sessions"), list), msg

    def checked(self, sent: list[tuple[Any, str]], shown: str) -> None:
        """What the agent wrote since the input: each request of ``sent`` (id, method) answered
        once, every line of stdout a message of the schema's, nothing on stderr of a crash."""
        for msg_id, method in sent:
            msg = self.wait_answer(msg_id, ANSWER_TIMEOUT)
            if msg is None:
                self.tainted = True
                self.check_alive()
                raise AssertionError(f"{method} {msg_id!r} was not answered within {ANSWER_TIMEOUT} s: {shown}")
        with self.arrived:
            bad, self.bad_lines = self.bad_lines, []
            others, self.others = self.others, []
            answers = {k: v for k, v in self.answers.items() if not k.startswith('"setup-')}
        assert bad == [], f"stdout carried something other than JSON-RPC messages: {bad!r} after {shown}"
        for msg_id, method in sent:
            got = answers.get(json.dumps(msg_id), [])
            assert len(got) == 1, f"{method} {msg_id!r} answered {len(got)} times: {got!r:.800} ({shown})"
        for msg in others:
            model = S.SessionNotification if msg["method"] == "session/update" and "id" not in msg \
                else AGENT_REQUESTS.get(msg["method"]) if "id" in msg else None
            assert model is not None, f"the agent sent {msg['method']}: {msg!r:.600} ({shown})"
            if "id" in msg:  # (how often the turns reached the client: printed with the outcomes)
                OUTCOMES[f"acp asked the client {msg['method']}"] = OUTCOMES.get(f"acp asked the client {msg['method']}", 0) + 1
            problems = schema_errors(model, msg.get("params")) + not_utf8(msg)
            assert problems == [], f"a {msg['method']} not of the schema: {problems} in {msg!r:.600} ({shown})"
        err = self.new_stderr()
        assert "Traceback" not in err, f"a traceback on stderr after {shown}:\n{err[-3000:]}"

    def judge(self, msg_id: Any, method: str, params: Any) -> None:
        """The answer to a fuzzed request: a result of the schema's, or an allowed error."""
        msg = self.answers[json.dumps(msg_id)][0]
        shown = f"{method} params {json.dumps(params, ensure_ascii=True)[:1500]}"
        outcome = "result" if "result" in msg else str((msg.get("error") or {}).get("code"))
        OUTCOMES[f"acp {method} {outcome}"] = OUTCOMES.get(f"acp {method} {outcome}", 0) + 1
        assert not_utf8(msg) == [], f"{shown}: an answer that is not Unicode text: {not_utf8(msg)}"
        if "result" in msg:
            model = RESULTS.get(method)
            problems = schema_errors(model, msg["result"]) if model else []
            assert problems == [], f"{shown}: a result not of the schema: {problems} in {msg['result']!r:.800}"
            return
        err = msg.get("error")
        assert isinstance(err, dict) and schema_errors(S.Error, err) == [], f"{shown}: not a JSON-RPC error: {msg}"
        assert not has_traceback(err), f"traceback in the error for {shown}: {err!r:.1500}"
        assert err["code"] != -32603, f"internal error on bad input: {shown} -> {err!r:.1500}"
        assert err["code"] in ALLOWED[method], f"{err['code']} is not a code {method} may answer bad params with: " \
                                               f"{shown} -> {err!r:.800}"


def _agent(fs: bool):
    a = FuzzAgent(fs)
    try:
        yield a
    finally:
        a.stop()
        a.dir.cleanup()


@pytest.fixture(scope="module")
def agent():
    yield from _agent(False)


@pytest.fixture(scope="module")
def fs_agent():
    """An agent whose client has the fs capability: its turns read and write through the client."""
    yield from _agent(True)


# ---------------------------------------------------------------------- lines
texts = st.text(max_size=30)
ids = st.integers(-2**31, 2**31) | st.text(max_size=10)


@st.composite
def junk_lines(draw) -> tuple[bytes, str]:
    """(a line, what it is): not JSON, not an object, an object that is no message, a stray
    answer, or a notification (of a method served, or not)."""
    kind = draw(st.sampled_from(["bytes", "text", "scalar", "array", "object", "answer", "notification"]))
    if kind == "bytes":
        line = draw(st.binary(max_size=120))
    elif kind == "text":
        line = draw(texts).encode("utf-8", "surrogatepass")
    elif kind == "scalar":
        line = json.dumps(draw(st.none() | st.booleans() | st.integers() | texts)).encode()
    elif kind == "array":
        line = json.dumps(draw(st.lists(json_values, max_size=3))).encode()
    elif kind == "object":  # no method, no id: an object that is not a request
        line = json.dumps(draw(st.dictionaries(texts.filter(lambda k: k not in ("method", "id")), json_values,
                                               max_size=3)), ensure_ascii=True).encode()
    elif kind == "answer":
        line = json.dumps({"jsonrpc": "2.0", "id": draw(ids),
                           draw(st.sampled_from(["result", "error"])): draw(json_values)}, ensure_ascii=True).encode()
    else:
        method = draw(st.sampled_from([*METHODS, "session/cancel", "_x/y", "", "nope"]) | texts)
        msg = {"jsonrpc": "2.0", "method": method}
        if draw(st.booleans()):
            msg["params"] = draw(json_values)
        line = json.dumps(msg, ensure_ascii=True).encode()
    return line.replace(b"\n", b" "), kind


@pytest.mark.parametrize("prof", LINE_PROFILES)
def test_lines_that_are_no_request_get_at_most_one_null_id_answer_and_the_agent_stays_in_sync(agent, prof):
    @prof
    @given(st.lists(junk_lines(), min_size=1, max_size=4))
    def inner(lines):
        def body() -> None:
            with agent.arrived:
                n0 = len(agent.null_answers)
            for line, _ in lines:
                agent.write_line(line)
            agent.sync()  # (the answers to the lines come before the sync's: one reader, in order)
            shown = f"lines {[line[:200] for line, _ in lines]!r}"
            agent.checked([], shown)
            with agent.arrived:
                new = agent.null_answers[n0:]
            assert len(new) <= len(lines), f"more answers than lines: {new!r:.800} ({shown})"
            for msg in new:
                err = msg.get("error") or {}
                assert err.get("code") in (-32700, -32600), f"{msg!r:.600} ({shown})"
                assert not has_traceback(err), f"{msg!r:.1500} ({shown})"
            # an answer or a notification is never answered (whatever its method)
            quiet = [line for line, kind in lines if kind in ("answer", "notification")]
            if len(quiet) == len(lines):
                assert new == [], f"a notification or a stray answer was answered: {new!r:.800} ({shown})"

        run_example(agent, "acp.lines", body)

    inner()


# ---------------------------------------------------------------------- params
@st.composite
def prompt_blocks(draw, ws: Path) -> list[dict]:
    choices = [{"type": "text", "text": draw(texts.filter(str.strip)) or "go"},
               {"type": "resource_link", "uri": (ws / "a.txt").as_uri(), "name": "a.txt"},
               {"type": "resource", "resource": {"uri": "file:///x/notes.md", "text": draw(texts), "mimeType": "text/markdown"}},
               {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}]
    blocks = draw(st.lists(st.sampled_from(choices), min_size=1, max_size=3))
    if not any(b["type"] == "text" for b in blocks):
        blocks.insert(0, choices[0])
    return blocks


@st.composite
def valid_params(draw, method: str, a: FuzzAgent) -> dict:
    ws = str(a.ws)
    if method == "initialize":
        return {"protocolVersion": 1, "clientCapabilities": draw(st.sampled_from(
            [{}, {"fs": {"readTextFile": False, "writeTextFile": False}}]))}
    if method == "authenticate":
        return {"methodId": draw(texts)}
    if method == "session/new":
        return {"cwd": ws, "mcpServers": []}
    if method in ("session/load", "session/resume", "session/fork"):
        return {"sessionId": a.sid, "cwd": ws, "mcpServers": []}
    if method == "session/close":
        return {"sessionId": a.spare}  # (not the session the other inputs aim at)
    if method == "session/list":
        return draw(st.sampled_from([{}, {"cwd": ws}]))
    if method == "session/set_config_option":
        return draw(st.sampled_from([{"sessionId": a.sid, "configId": "model", "value": "s"},
                                     {"sessionId": a.sid, "configId": "mode", "value": a.modes[0]}]))
    if method == "session/set_mode":
        return {"sessionId": a.sid, "modeId": draw(st.sampled_from(a.modes))}
    if method == "session/cancel":
        return {"sessionId": a.sid}
    assert method == "session/prompt"
    return {"sessionId": a.sid, "prompt": draw(prompt_blocks(a.ws))}


BAD = [None, "", "nope", 5, -1, 1.5, True, [], {}, "/", "relative/dir", "file:///etc/passwd", "\x00",
       "x" * 300, [{}], [None], {"type": "text"}, [{"type": "text"}], [{"type": "nonsense", "text": "x"}],
       [{"name": "m", "command": 5}], [{"type": "http", "name": "m", "url": 5, "headers": []}]]


@st.composite
def mutated_params(draw, method: str, a: FuzzAgent) -> Any:
    """Valid params with up to 3 mutations, or random JSON (mostly keyed by the method's fields)."""
    fields = FIELDS[method]
    if draw(st.integers(0, 4)) == 0:
        return draw(st.dictionaries(st.sampled_from(fields) | texts, json_values | texts, max_size=4)
                    | st.sampled_from([None, [], [1], "x", 5]))
    p = draw(valid_params(method, a))
    for _ in range(draw(st.integers(0, 3))):  # (none: the valid params themselves, a whole turn for a prompt)
        op = draw(st.sampled_from(["drop", "unknown", "wrong", "bad", "bad", "nested"]))
        if op == "drop" and p:
            p.pop(draw(st.sampled_from(sorted(p))))
        elif op == "unknown":
            k = draw(texts | st.sampled_from(["_meta", "session_id", "id", "jsonrpc", "mcp_servers"]))
            if k not in fields:
                p[k] = draw(json_values)
        elif op in ("wrong", "bad"):
            k = draw(st.sampled_from(fields))
            if k == "mcpServers" and op == "wrong":
                continue  # (random JSON could name a command to run: only the bad values below)
            p[k] = draw(json_values) if op == "wrong" else draw(st.sampled_from(BAD))
        elif op == "nested":
            lists = [k for k, v in p.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
            dicts = [k for k, v in p.items() if isinstance(v, dict)]
            if lists or dicts:
                k = draw(st.sampled_from(sorted(lists + dicts)))
                target = p[k] = copy.deepcopy(p[k])
                if isinstance(target, list):
                    target = target[draw(st.integers(0, len(target) - 1))]
                if not isinstance(target, dict):  # (an earlier mutation put a list of other things)
                    continue
                sub = draw(st.sampled_from(sorted(target) + ["__new__"]))
                if sub == "__new__":
                    target[draw(texts)] = draw(json_values)
                elif draw(st.booleans()):
                    target.pop(sub, None)
                else:
                    target[sub] = draw(json_values | st.sampled_from(BAD))
    return p


@pytest.mark.parametrize("prof", PARAM_PROFILES)
def test_mutated_and_random_params_of_every_method_get_a_schema_result_or_a_fitting_error(agent, prof):
    @prof
    @given(st.data())
    def inner(data):
        method = data.draw(st.sampled_from([*METHODS, "session/cancel"]), label="method")
        params = data.draw(mutated_params(method, agent), label="params")
        with_params = data.draw(st.integers(0, 9), label="params sent") > 0 or method == "session/list"

        def body() -> None:
            msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
            if with_params:
                msg["params"] = params
            sent: list[tuple[Any, str]] = []
            if method != "session/cancel":
                msg["id"] = f"fz-{next(agent.ids)}"
                sent.append((msg["id"], method))
            agent.write(msg)
            shown = f"{method} params {json.dumps(params, ensure_ascii=True)[:1500]}"
            agent.checked(sent, shown)
            if sent:
                agent.judge(msg["id"], method, msg.get("params"))

        run_example(agent, "acp.params", body)

    inner()


# ---------------------------------------------------------------------- the client's answers
ANSWER_PROFILES = [pytest.param(profile("fast", 40), id="fast"),
                   pytest.param(profile("stress", 800), id="stress", marks=pytest.mark.slow)]

answers = st.one_of(
    st.just(("content", "old text\n")),  # (the file as it is: the edit goes on to be asked about and written)
    st.tuples(st.just("select"), st.integers(0, 5)), st.just(("cancelled",)), st.just(("result", None)),
    st.tuples(st.just("content"), texts | st.sampled_from(["old text\n", "", "x" * 5000, "\x00bin"])),
    st.tuples(st.just("result"), json_values | st.sampled_from([
        None, {}, {"outcome": {}}, {"outcome": {"outcome": "selected"}}, {"outcome": {"outcome": "selected", "optionId": 5}},
        {"outcome": "allow"}, {"content": 5}, {"content": None}, {"content": ["x"]}, [], "ok"])),
    st.tuples(st.just("error"), st.sampled_from([-32002, -32601, -32603, -32602, -32000, 1, 0]),
              st.sampled_from(["", "not found", "No such file or directory", "boom"])))


@pytest.mark.parametrize("prof", ANSWER_PROFILES)
def test_whatever_the_client_answers_to_a_turns_requests_the_turn_ends_with_an_answer(fs_agent, prof):
    """A turn's permission requests and file reads and writes through the client, answered
    with the right shapes and the wrong ones, errors and cancels: the prompt is answered once
    (a stop reason, or an error the front end may answer with), and the agent stays in sync."""
    a = fs_agent

    @prof
    @given(st.lists(answers, min_size=1, max_size=6), st.sampled_from(["ask", "auto-edit", None]))
    def inner(plan, mode):
        def body() -> None:
            a.plan = list(plan)
            if mode is not None and mode in a.modes:
                a.call("session/set_mode", {"sessionId": a.sid, "modeId": mode})
            msg_id = f"fz-{next(a.ids)}"
            params = {"sessionId": a.sid, "prompt": [{"type": "text", "text": "go"}]}
            a.write({"jsonrpc": "2.0", "id": msg_id, "method": "session/prompt", "params": params})
            shown = f"a turn with the client's answers {plan!r:.1200}"
            a.checked([(msg_id, "session/prompt")], shown)
            a.judge(msg_id, "session/prompt", params)
            a.plan = []

        run_example(a, "acp.client answers", body)

    inner()
