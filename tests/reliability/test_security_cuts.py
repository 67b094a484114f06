"""Known secrets are masked before any cut (docs/SECURITY.md G6): every text the server shortens
is masked first, and where a cut must come first (a window read from the end of a file, a line
read only so far) the piece of a secret at that edge is left out. Also: what else holds a secret
is a known one (an MCP server's secret command-line option, a secret-named query value of a
``baseUrl``), and only the fields of an inline model that are stored masked say it was restored
masked. The real server over real pipes, each with a known secret right across the cut; the
helpers of ``server/redaction.py`` on their own."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
from pathlib import Path

import pytest
from openai_stub import StubHandler, loopback

from .support import TIMEOUT, calls, scripted

pytestmark = pytest.mark.timeout(120)


def _emitted(c, state: Path | None = None) -> str:
    """Everything the server sent, wrote on stderr and stored (``c`` is closed)."""
    c.close()
    parts = [json.dumps(m) for m in c.wire_log] + [c.stderr_text()]
    for root, _, files in os.walk(state or "/nonexistent"):
        for f in files:
            parts.append(Path(root, f).read_bytes().decode("utf-8", "replace"))
    return "\n".join(parts)


def _no_piece(text: str, secret: str, n: int = 6) -> None:
    """Neither ``secret`` nor any piece of it ``n`` characters long is in ``text``."""
    pieces = {secret[i:i + n] for i in range(len(secret) - n + 1)}
    found = sorted(p for p in pieces if p in text)
    assert not found, (found, text[-3000:])


# --- the helpers ---------------------------------------------------------------------------------

def test_redact_cut_masks_first_and_redact_piece_leaves_out_a_cut_secrets_piece():
    from operate_sidecar.server import redaction

    secret = "CutSecret0123456789abcdefXYZ"
    redaction.remember_secret(secret)
    text = "x" * 150 + " " + secret + " and more"
    assert redaction.redact_cut(text, 160, more="…") == "x" * 150 + " [REDACTED…"
    assert redaction.redact_cut("short " + secret, 160) == "short [REDACTED]"
    long = "y" * 5000 + secret * 3
    assert redaction.redact_cut(long, 4990, more="…") == "y" * 4990 + "…"
    # a piece cut before it could be masked: its end that begins the secret, its start that ends it
    assert redaction.redact_piece("head " + secret[:11], cut_after=True) == "head "
    assert redaction.redact_piece(secret[9:] + " tail", cut_before=True) == " tail"
    assert redaction.redact_piece(secret[9:] + " " + secret + " " + secret[:5], cut_before=True,
                                  cut_after=True) == " [REDACTED] "
    # not cut there: kept as it is
    assert redaction.redact_piece("ends in Cut") == "ends in Cut"


def test_url_secrets_and_mcp_server_secrets():
    from operate_sidecar.server.redaction import mcp_server_secrets, url_secrets

    assert url_secrets("https://bob:p%40ss1234@h/v1;key=PathKey99/x?api_key=Q%2BKey1&api-version=2024&"
                       "access_token=Tok+99&keyword=visible#f") \
        == ["p%40ss1234", "p@ss1234", "Q%2BKey1", "Q+Key1", "Tok+99", "Tok 99", "PathKey99"]
    assert url_secrets("http://127.0.0.1:8080/v1?model=x") == []
    assert mcp_server_secrets({"command": ["srv", "--token", "TokVal1234", "--password=PwVal5678", "--tokenizer",
                                           "bpe", "--no-auth", "x"], "env": {"GH_TOKEN": "EnvVal9999", "LEVEL": "d"}}) \
        == ["EnvVal9999", "TokVal1234", "PwVal5678"]
    assert mcp_server_secrets("not a config") == []


def test_masked_fields_looks_only_at_the_fields_stored_masked():
    from operate_sidecar.server.redaction import masked_fields

    assert masked_fields({"provider": "scripted", "responses": ["The log line reads: token=[REDACTED]"]}) == []
    assert masked_fields({"provider": "cli", "command": ["echo", "-s", "write [REDACTED] instead", "{prompt}"],
                          "env": {"LEVEL": "[REDACTED]"}}) == []
    assert masked_fields({"provider": "openai", "model": "m", "baseUrl": "http://h/v1?note=[REDACTED]",
                          "options": {"extraHeaders": {"X-Note": "[REDACTED]"}}}) == []
    assert masked_fields({"provider": "cli", "command": ["p", "--api-key", "[REDACTED]"],
                          "env": {"PROBE_API_KEY": "[REDACTED]"}}) == ["env['PROBE_API_KEY']", "command[2]"]
    assert masked_fields({"provider": "openai", "model": "m", "baseUrl": "http://h/v1?key=[REDACTED]",
                          "options": {"extraHeaders": {"Authorization": "Bearer [REDACTED]"}}}) \
        == ["baseUrl", "options.extraHeaders['Authorization']"]
    # read back from the store, which masks a known secret in any field: every field is looked at
    assert masked_fields({"provider": "cli", "command": ["llm", "-k", "[REDACTED]"], "env": {"LEVEL": "[REDACTED]"},
                          "options": {"extraHeaders": {"X-Note": "a [REDACTED]"}}}, anywhere=True) \
        == ["command[2]", "env['LEVEL']", "options.extraHeaders['X-Note']"]


def test_an_unexpected_errors_first_line_is_masked_before_it_is_cut():
    from operate_sidecar.server import redaction
    from operate_sidecar.server.service.errors import map_exception

    secret = "ShortSecret0123456789abcdXYZ"
    redaction.remember_secret(secret)
    code, message, _ = map_exception(RuntimeError("w" * 290 + secret + " rest"))
    assert code == -32603 and message.startswith("internal error: RuntimeError: www"), message
    _no_piece(message, secret, 4)


def test_an_mcp_servers_unreadable_message_is_masked_before_it_is_quoted():
    """An MCP server's line that is JSON but no JSON-RPC message is quoted, cut at 200
    characters, in its start failure: masked before that cut."""
    from pydantic import BaseModel, ValidationError

    from operate_sidecar.server import redaction
    from operate_sidecar.server.tools.mcp_source import _unread_text

    secret = "UnreadSecret0123456789abcXYZ"
    redaction.remember_secret(secret)

    class Message(BaseModel):
        jsonrpc: int

    try:
        Message.model_validate({"jsonrpc": {"note": "n" * 170 + secret + " rest"}})
    except ValidationError as e:
        text = _unread_text(e)
    assert text.startswith("not a JSON-RPC message: "), text
    _no_piece(text, secret, 4)


# --- on the wire ---------------------------------------------------------------------------------

def _failed_to_start(c) -> str:
    """An ``operate`` on a new branch, then the warning (``window/logMessage``, bounded wait) that
    an MCP server failed to start."""
    bid = c.branch()
    c.request("operate", {"branchId": bid, "instruction": "x"}, timeout=60)

    def warned(_):
        return any("failed to start" in p.get("message", "") for p in c.of("window/logMessage"))

    assert c.wait_for(warned, TIMEOUT), c.of("window/logMessage")
    return next(p["message"] for p in c.of("window/logMessage") if "failed to start" in p["message"])


MCP_TOKEN = "Zq7tok3nValueXYZ"


#: an MCP server that says on its stderr the value its command line gives ``--token`` (or
#: ``--api-token``), then exits before it answers anything
ECHOING_SERVER = "import sys; sys.stderr.write('using ' + sys.argv[2] + '\\n'); sys.exit(3)"


def test_an_mcp_servers_secret_command_option_is_a_known_secret(spawn):
    """Masked in why it did not start (its command line) and in its stderr, which is relayed:
    a known secret from the moment the settings name it."""
    c = spawn()
    c.init(models={"s": scripted("hi")},
           mcpServers={"gh": {"command": [sys.executable, "-c", ECHOING_SERVER, "--token", MCP_TOKEN,
                                          "--password=" + MCP_TOKEN + "2"]}})
    warning = _failed_to_start(c)
    assert "--token [REDACTED] --password=[REDACTED]" in warning and "using [REDACTED]" in warning, warning
    _no_piece(_emitted(c), MCP_TOKEN)


def test_an_acp_sessions_mcp_server_secret_argument_is_a_known_secret(tmp_path, capfd):
    import acp
    from acp.schema import EnvVariable, McpServerStdio

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "acp"))
    from acp_support import RecordingClient, bounded, reply, run, write_config
    from acp_support import scripted as acp_scripted
    from acp_support import spawn as acp_spawn

    arg = "ArgTokenVal31337xyz"
    ws = tmp_path / "ws"
    ws.mkdir()
    config = write_config(tmp_path / "s.toml", {"models": {"s": acp_scripted(reply("hello"))}})
    server = McpServerStdio(name="gh", command=sys.executable, args=["-c", ECHOING_SERVER, "--api-token", arg],
                            env=[EnvVariable(name="LEVEL", value="debug")])

    async def main():
        c = RecordingClient()
        async with acp_spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("go")]), 60)
            said = repr(c.updates)
            assert "failed to start" in said and "--api-token [REDACTED]" in said, said
            return "\n".join(json.dumps(m) for m in conn.tap.incoming)

    wire = run(main())
    err = capfd.readouterr().err
    assert "using [REDACTED]" in err, err[-2000:]   # (its stderr, relayed to ours)
    _no_piece(wire + err, arg)


KEY = "Pk9x7Qm2Lr8Vt4Wn6Yb3Zc5Hd1Jf0Gs"   # shaped like no known key: only the known value masks it
KEY_ENV = "CUTS_PROBE_KEY"


class _BodyQuotingKey(StubHandler):
    """An endpoint whose body quotes the key it was sent right where the server's sample of it
    is cut (``mode``: a 401 in plain text, a 500 HTML page, a 200 that is no event stream)."""

    mode = "text"

    def do_POST(self):  # noqa: N802
        self.request_body()
        key = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if self.mode == "text":
            self.answer(401, ("Unauthorized. " + "x" * 126 + " key was: " + key).encode(), "text/plain")
        elif self.mode == "html":
            self.answer(500, ("<html><head><title>Denied " + "y" * 140 + " " + key + "</title></head></html>").encode(),
                        "text/html")
        else:
            self.answer(200, ("Here " + "z" * 140 + " " + key + " more").encode(), "text/plain")


@pytest.mark.parametrize("mode", ["text", "html", "not-a-stream"])
def test_a_providers_unexpected_body_is_masked_before_its_sample_is_cut(spawn, tmp_path, mode):
    _BodyQuotingKey.mode = mode
    state = tmp_path / "state"
    with loopback(_BodyQuotingKey) as url:
        c = spawn(env={KEY_ENV: KEY})
        c.init(models={"m": {"provider": "openai", "model": "x", "baseUrl": url, "apiKeyEnv": KEY_ENV,
                             "maxRetries": 0, "timeoutS": 10}}, stateDir=str(state))
        bid = c.branch(chatModel="m")
        err = c.error_of("operate", {"branchId": bid, "instruction": "hi", "skipValidation": True})
        assert err.code == -32011 and ("xxxx" in err.message or "yyyy" in err.message or "zzzz" in err.message), err
        _no_piece(_emitted(c, state), KEY)


def test_a_body_sample_leaves_out_the_piece_of_a_key_its_scan_cuts():
    """Only the first SAMPLE_SCAN_CHARS characters of a body are read for its sample: an HTML
    page of tags says only the words at their end, where a key the scan cuts in two may be."""
    from operate_sidecar.server import redaction
    from operate_sidecar.server.models.openai_compat import SAMPLE_SCAN_CHARS, _sample

    redaction.remember_secret(KEY)
    head = "<html><body>" + "<br>" * ((SAMPLE_SCAN_CHARS - 100) // 4)
    page = head + " " * (SAMPLE_SCAN_CHARS - 10 - len(head)) + KEY + "</body></html>"   # 10 characters of it read
    sample = _sample(page)
    assert sample.startswith("an HTML page"), sample
    _no_piece(sample, KEY)


CLI_KEY = "Qw3rTy7Uio9PasDf2GhJk4LzXc6VbNm8Lq1Wx5Ez"


def test_a_cli_models_stderr_tail_holds_no_piece_of_a_key(spawn):
    """The program writes its key over and over on stderr, then fails: the tail quoted in the
    error is read as a window from the end of that output, which begins inside a key; masked,
    the window is shorter than the tail, and the piece of a key it began with is left out."""
    script = ('import os, sys\nsys.stderr.write(os.environ["PROBE_API_KEY"] * 100 + "\\n")\nsys.exit(1)\n')
    c = spawn()
    c.init(models={"m": {"provider": "cli", "profile": "jsonl", "command": [sys.executable, "-c", script],
                         "env": {"PROBE_API_KEY": CLI_KEY}}})
    bid = c.branch(chatModel="m")
    err = c.error_of("operate", {"branchId": bid, "instruction": "hi", "skipValidation": True}, timeout=60)
    assert err.code == -32011, err
    said = err.message.split("exited with status 1: ", 1)[1]
    assert re.fullmatch(r"(\[REDACTED\])+", said), said[:200]
    _no_piece(_emitted(c), CLI_KEY)


SEC = "SrchSecretAbcdef0123456789XYZ"
SEC_ENV = "CUTS_MY_SECRET"


def _tool_run(spawn, tmp_path, call: dict, **settings) -> tuple[dict, str]:
    ws = tmp_path / "ws"
    c = spawn(env={SEC_ENV: SEC})
    c.request("initialize", {"clientInfo": {"name": "pytest"}, "workspaceFolders": [str(ws)],
                             "settings": {"secretEnv": [SEC_ENV], "stateDir": str(tmp_path / "state"),
                                          "models": {"m": scripted(call, "done")}, **settings}}, timeout=TIMEOUT)
    bid = c.branch(chatModel="m")
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=60)
    return out["result"]["action_responses"][0]["output"], _emitted(c, tmp_path / "state")


def test_search_text_masks_a_long_line_before_it_cuts_it(spawn, tmp_path):
    (tmp_path / "ws").mkdir()
    line = "config = {" + "'opt': 1, " * 26 + "'apikey': '" + SEC + "'}"   # the secret runs across column 300
    assert line.index(SEC) < 300 < line.index(SEC) + len(SEC)
    (tmp_path / "ws" / "settings.py").write_text(line + "\n")
    out, emitted = _tool_run(spawn, tmp_path, calls(("search_text", {"pattern": "config"})))
    shown = out["matches"][0]["text"]
    assert shown.endswith("'apikey': '[REDACTED]'}") or shown.endswith("…"), shown
    assert "[REDACTED]" in shown, shown
    _no_piece(emitted, SEC)


def test_read_file_ends_a_cut_first_line_before_a_piece_of_a_secret(spawn, tmp_path):
    """A page's first line longer than the page (half of maxToolOutputChars) is read only so far:
    the read cuts the secret it runs into, and that piece of it is left out."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "blob.txt").write_text("x" * 490 + SEC + "y" * 600 + "\n")
    out, emitted = _tool_run(spawn, tmp_path, calls(("read_file", {"path": "blob.txt"})), maxToolOutputChars=1000)
    assert out["truncated"] is True and out["content"] == "x" * 490, out
    _no_piece(emitted, SEC)


def test_read_file_through_the_clients_buffers_cuts_a_first_line_as_the_disks_does(spawn, tmp_path):
    """The same page cut when the editor's buffer is read (``fs/readTextFile``)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "blob.txt").write_text("on disk\n")
    c = spawn(env={SEC_ENV: SEC})
    c.request("initialize", {"clientInfo": {"name": "pytest"}, "workspaceFolders": [str(ws)], "capabilities": {"fs": True},
                             "settings": {"secretEnv": [SEC_ENV], "maxToolOutputChars": 1000,
                                          "models": {"m": scripted(calls(("read_file", {"path": "blob.txt"})), "done")}}},
              timeout=TIMEOUT)
    c.on_request("fs/readTextFile", lambda p: {"text": "x" * 490 + SEC + "y" * 600 + "\n"})
    bid = c.branch(chatModel="m")
    out = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=60)
    out = out["result"]["action_responses"][0]["output"]
    assert out["truncated"] is True and out["content"] == "x" * 490, out
    _no_piece(_emitted(c), SEC)


def test_an_mcp_servers_failure_reason_is_masked_before_it_is_cut(spawn, tmp_path):
    """A server that refuses ``initialize`` with an error quoting its token across the 500th
    character of the reason."""
    token = "SvcTokenValue0123456789abcdefXYZ"
    server = tmp_path / "refusing_server.py"
    server.write_text(
        "import json, os, sys\n"
        "for line in sys.stdin:\n"
        "    msg = json.loads(line)\n"
        "    if msg.get('method') == 'initialize':\n"
        "        err = {'code': -32000, 'message': 'authentication failed: ' + 'detail ' * 65 + 'token='\n"
        "               + os.environ['SVC_TOKEN'] + ' rejected'}\n"
        "        print(json.dumps({'jsonrpc': '2.0', 'id': msg['id'], 'error': err}), flush=True)\n")
    c = spawn()
    c.init(models={"s": scripted("hi")},
           mcpServers={"svc": {"command": [sys.executable, str(server)], "env": {"SVC_TOKEN": token}}})
    warning = _failed_to_start(c)
    assert "detail token=[REDACTED]" in warning, warning
    _no_piece(_emitted(c), token)


def test_a_reply_failing_validation_is_masked_before_it_is_quoted(spawn):
    secret = "RcvSecretValue0123456789ABCD"
    reply = "Sure. " + "w" * 185 + " " + secret + " done"   # the secret runs across character 200
    schema = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"]}
    c = spawn(env={"CUTS_RS": secret})
    c.init(models={"m": scripted(*[reply] * 6)}, secretEnv=["CUTS_RS"])
    bid = c.branch(chatModel="m")
    err = c.error_of("operate", {"branchId": bid, "instruction": "x", "responseFormat": schema,
                                 "handleValidation": "raise",
                                 "parseOptions": {"retryAttempts": 0, "retryInitialDelay": 0}})
    assert err.code == -32010 and "Received (truncated): 'Sure. www" in err.message, err
    assert str(err.data["received"]).startswith("Sure. www"), err.data
    _no_piece(err.message + json.dumps(err.data), secret, 4)
    _no_piece(_emitted(c), secret)


def test_an_inline_model_holding_the_mask_text_outside_its_secret_fields_works(spawn):
    c = spawn()
    c.init(models={"d": scripted("x")})
    said = "The log line reads: token=[REDACTED]"
    bid = c.branch(chatModel={"provider": "scripted", "responses": [said]})
    assert c.request("operate", {"branchId": bid, "instruction": "hi"}, timeout=TIMEOUT)["result"] == said
    code = "import sys; print(sys.argv[1])"
    bid = c.branch(chatModel={"provider": "cli", "profile": "llm",
                              "command": [sys.executable, "-c", code, "Never print credentials; write [REDACTED] instead",
                                          "{prompt}"]})
    out = c.request("operate", {"branchId": bid, "instruction": "hi", "skipValidation": True}, timeout=60)
    assert out["result"].strip() == "Never print credentials; write [REDACTED] instead", out


QUERY_KEY = "QueryKey11zzTOPq7X"


class _EchoPath(StubHandler):
    """Answers 401 quoting the path (and query) it was asked for."""

    def do_POST(self):  # noqa: N802
        self.request_body()
        self.answer(401, json.dumps({"error": {"message": "denied for " + self.path}}).encode())


def test_a_secret_query_value_of_a_base_url_is_masked_and_stored_masked(spawn, tmp_path):
    state = tmp_path / "state"
    with loopback(_EchoPath) as url:
        model = {"provider": "openai", "model": "x", "baseUrl": f"{url}?key={QUERY_KEY}&api-version=2024",
                 "apiKeyEnv": "", "maxRetries": 0, "timeoutS": 10}
        c = spawn("--debug")
        c.init(models={"d": scripted("x")}, stateDir=str(state))
        bid = c.branch(chatModel=model)
        err = c.error_of("operate", {"branchId": bid, "instruction": "hi", "skipValidation": True})
        assert err.code == -32011 and "?key=[REDACTED]&api-version=2024" in err.message, err.message
        _no_piece(_emitted(c, state), QUERY_KEY)
    with sqlite3.connect(state / "state.sqlite3") as conn:
        assert any("?key=[REDACTED]" in str(row) for row in conn.execute("select * from branches"))
    # restored, the model would send the mask as its key: said before anything is sent
    c = spawn()
    c.init(models={"d": scripted("x")}, stateDir=str(state))
    err = c.error_of("operate", {"branchId": bid, "instruction": "hi"})
    assert err.code == -32011 and "baseUrl is [REDACTED]" in err.message, err.message


RESTORED_KEY = "Zx9Rk0042qqTw7Vm"
RESTORED_ENV = "CUTS_RESTORED_KEY"


def test_a_restored_inline_model_holding_a_known_secret_in_another_field_says_so(spawn, tmp_path):
    """The store masks every known secret wherever it is in a record: a key the server knew
    (``secretEnv``) written in a field of no secret name (``-k KEY``, a path of a ``baseUrl``)
    is ``[REDACTED]`` there after a restart, and the restored model says so (``-32011`` naming
    the field) rather than run with the mask."""
    state, ran = tmp_path / "state", tmp_path / "ran"
    code = (f"import json, sys; sys.stdin.read(); open({str(ran)!r}, 'a').write('x'); "
            "print(json.dumps({'type': 'text', 'text': 'ran'}))")
    model = {"provider": "cli", "profile": "jsonl", "command": [sys.executable, "-c", code, "-k", RESTORED_KEY]}
    remote = {"provider": "openai", "model": "m", "baseUrl": f"http://127.0.0.1:9/key/{RESTORED_KEY}/v1",
              "apiKeyEnv": "", "maxRetries": 0}
    c = spawn(env={RESTORED_ENV: RESTORED_KEY})
    c.init(models={"d": scripted("x")}, stateDir=str(state), secretEnv=[RESTORED_ENV])
    bid = c.branch(chatModel=model)
    remote_bid = c.branch(chatModel=remote)
    out = c.request("operate", {"branchId": bid, "instruction": "hi", "skipValidation": True}, timeout=60)
    assert out["result"] == "ran", out
    _no_piece(_emitted(c, state), RESTORED_KEY)
    c = spawn(env={RESTORED_ENV: RESTORED_KEY})
    c.init(models={"d": scripted("x")}, stateDir=str(state), secretEnv=[RESTORED_ENV])
    err = c.error_of("operate", {"branchId": bid, "instruction": "hi", "skipValidation": True}, timeout=60)
    assert err.code == -32011 and "command[4] is [REDACTED]" in err.message, err.message
    assert ran.read_text() == "x"  # (the program did not start again)
    err = c.error_of("operate", {"branchId": remote_bid, "instruction": "hi", "skipValidation": True}, timeout=60)
    assert err.code == -32011 and "baseUrl is [REDACTED]" in err.message, err.message
    c.close()


def _open_end_plain(text: str, forms: list[str]) -> int:
    """Every end of ``text`` against every form: where the longest that is a proper beginning of one begins."""
    for i in range(len(text)):
        if any(len(f) > len(text) - i and f.startswith(text[i:]) for f in forms):
            return i
    return len(text)


def _open_start_plain(text: str, forms: list[str]) -> int:
    """Every beginning of ``text`` against every form: where the longest that is a proper end of one ends."""
    for j in range(len(text), 0, -1):
        if any(len(f) > j and f.endswith(text[:j]) for f in forms):
            return j
    return 0


def test_the_piece_a_cut_leaves_is_found_as_a_plain_scan_of_every_edge_finds_it(monkeypatch):
    """``_open_end`` and ``_open_start`` search each form for the text's last (first) character
    rather than try every end of the text against every form: the same answers, on random texts
    and forms of a small alphabet (many overlaps), and ``redact_cut`` the same as masking its
    window and leaving out the open end found by the plain scan."""
    import random

    from operate_sidecar.server import redaction

    rng = random.Random(45)
    for _ in range(5000):
        forms = sorted({"".join(rng.choice("ab1") for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 6))},
                       key=len, reverse=True)
        text = "".join(rng.choice(forms + ["a", "b", "1", "x"]) for _ in range(rng.randint(0, 6)))
        if rng.random() < 0.5:
            text += rng.choice(forms)[:rng.randint(0, 12)]
        if rng.random() < 0.5:
            text = rng.choice(forms)[-rng.randint(1, 12):] + text
        assert redaction._open_end(text, tuple(forms)) == _open_end_plain(text, forms), (text, forms)
        assert redaction._open_start(text, tuple(forms)) == _open_start_plain(text, forms), (text, forms)

    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    monkeypatch.setattr(redaction, "CUT_MARGIN", 3)
    for _ in range(8):
        redaction.remember_secret("".join(rng.choice("ab12") for _ in range(rng.randint(8, 16))) + "1")
    forms = list(redaction._known_text_forms())
    for _ in range(2000):
        text = "".join(rng.choice([*forms, "a", "b", "1", "2", " "]) for _ in range(rng.randint(0, 12)))
        limit = rng.randint(0, 60)
        window = limit + len(forms[0]) + 3
        if len(text) > window:
            out = redaction.redact(text[:window])
            expected = out[:_open_end_plain(out, forms)][:limit] + "…"
        else:
            out = redaction.redact(text)
            expected = out[:limit] + "…" if len(out) > limit else out
        assert redaction.redact_cut(text, limit, more="…") == expected, (text, limit)
        both = redaction.redact(text)
        both = both[:_open_end_plain(both, forms)]
        both = both[_open_start_plain(both, forms):]
        assert redaction.redact_piece(text, cut_before=True, cut_after=True) == both, text


def test_a_body_head_read_up_to_its_bound_leaves_out_the_piece_of_a_key_it_ends_in():
    """A 200 that is no event stream is read up to HEAD_BYTES: an HTML page that fills them with
    tags and ends inside a key (its text shorter than SAMPLE_SCAN_CHARS, once its leading white
    space is gone) is known to be cut there, and the piece of the key is left out of its sample."""
    from operate_sidecar.server import redaction
    from operate_sidecar.server.models.openai_compat import HEAD_BYTES, _not_a_stream

    redaction.remember_secret(KEY)
    start = "\n" * 50 + "<html><body>"
    body = start + "<br>" * ((HEAD_BYTES - len(start) - 100) // 4)
    head = (body + " " * (HEAD_BYTES - 12 - len(body)) + KEY[:12]).encode()
    assert len(head) == HEAD_BYTES
    seen = _not_a_stream("text/html", head)
    assert seen is not None and seen.sample.startswith("an HTML page"), seen
    _no_piece(seen.sample, KEY)


def test_a_key_written_with_html_entities_in_a_pages_title_is_masked_in_its_sample():
    """The title's words are masked again once their entities are read (``&#x50;`` is ``P``)."""
    from operate_sidecar.server import redaction
    from operate_sidecar.server.models.openai_compat import _sample

    redaction.remember_secret(KEY)
    page = "<html><head><title>Denied for &#x50;" + KEY[1:] + "</title></head><body>no</body></html>"
    sample = _sample(page)
    assert sample == 'an HTML page, "Denied for [REDACTED]"', sample


def test_an_option_value_that_names_a_file_is_no_secret():
    """``--ssl-key /certs/client.key`` names a file: no secret (masked, every ``read_file`` of a
    config naming it would read ``[REDACTED]``); the same rule for a CLI model's command."""
    from operate_sidecar.server.models.config import command_shown
    from operate_sidecar.server.redaction import command_secret_values, mcp_server_secrets

    command = ["srv", "--ssl-key", "/certs/client.key", "--tls-key=./key.pem", "--ca-key", "../ca/ca.key",
               "--ssh-key", "~/.ssh/id_ed25519", "--credentials", "gcp-creds.json", "--key", "C:\\keys\\k",
               "--token", "TokVal1234", "--api-key=Key.With.Dots99"]
    assert mcp_server_secrets({"command": command}) == ["TokVal1234", "Key.With.Dots99"]
    assert command_secret_values(command) == ["TokVal1234", "Key.With.Dots99"]
    assert command_shown(command) == ("srv --ssl-key /certs/client.key --tls-key=./key.pem --ca-key ../ca/ca.key "
                                      "--ssh-key ~/.ssh/id_ed25519 --credentials gcp-creds.json --key C:\\keys\\k "
                                      "--token [REDACTED] --api-key=[REDACTED]")


def test_a_signature_in_a_base_urls_query_is_a_secret():
    from operate_sidecar.server.redaction import url_secrets

    assert url_secrets("https://acct.blob.core.windows.net/c?sv=2022-11-02&se=2030&sig=Ab%2FSig99%3D&code=abc") \
        == ["Ab%2FSig99%3D", "Ab/Sig99="]
    assert url_secrets("https://s3.example/b/o?X-Amz-Signature=f00dfeed99&X-Amz-Date=2024") == ["f00dfeed99"]


def test_a_validation_error_a_repair_turn_quotes_is_masked_before_it_is_cut():
    """A parse repair turn tells the parse model why the previous attempt did not validate,
    the first 800 characters of pydantic's error: masked before that cut."""
    import asyncio

    from pydantic import BaseModel

    from operate_sidecar.server import redaction
    from operate_sidecar.server.core import AlcallParams, Branch, FuzzyMatchKeysParams, ParseParam, parse
    from operate_sidecar.server.models.scripted import ScriptedModel

    secret = "RepairSecret0123456789abcXYZ"
    redaction.remember_secret(secret)

    class Holder(BaseModel):
        items: dict[str, int]

    head = "1 validation error for Holder\nitems."
    key = "k" * (790 - len(head)) + secret   # the error names the key: the secret runs across character 800
    reply = json.dumps({"items": {key: "v"}})
    model = ScriptedModel("p", [reply, reply])
    param = ParseParam(response_format=Holder, imodel=model, handle_validation="return_value",
                       alcall_params=AlcallParams(retry_attempts=1), fuzzy_match_params=FuzzyMatchKeysParams())
    asyncio.run(parse(Branch(chat_model=ScriptedModel("c", [])), "not json", param))
    guidance = model.requests[1].messages[-1]["content"]
    assert "did not validate: " + head + "kkk" in guidance, guidance[:300]
    _no_piece(guidance, secret, 4)


def test_a_clients_error_data_is_masked_before_it_is_cut():
    from operate_sidecar.server import redaction
    from operate_sidecar.server.service.port import ClientRequestError, client_error_reason

    secret = "ClientDataSecret0123456789XYZ"
    redaction.remember_secret(secret)
    reason = client_error_reason(ClientRequestError(-32603, "Internal error", "d" * 490 + secret + " more"))
    assert reason.startswith("Internal error (ddd"), reason
    _no_piece(reason, secret, 4)
