"""Configuration, command line and environment as a user meets them: what a config holds reaches the
editor without its credentials, every configured model is checked at start, paths mean what a person
wrote (``~`` expanded, a relative path the working directory's wherever it is given, reported absolute), a process
id no process can have is refused or ignored with a word, an empty flag is said, secrets given inline
or with a trailing newline are masked. The real server over real pipes where the behaviour is on the
wire; the pure functions on their own."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_support import SERVER, cli, one_line_error  # tests/ is on sys.path
from openai_stub import StubHandler, loopback
from operate_sidecar.clients.python.client import RpcError, SidecarClient

sys.path.insert(0, str(Path(__file__).resolve().parent / "acp"))
from acp_support import Raw, req  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def env_with(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


# --- 1. the model menu's descriptions carry no credentials -----------------------------------------

def test_describe_shows_no_userinfo_query_or_key_shaped_argument():
    from operate_sidecar.server.models.config import command_shown, describe, url_shown

    assert url_shown("https://alice:SuperSecretPw123@llm.example.com/v1?api_key=QueryKey98765#frag") \
        == "https://llm.example.com/v1"
    assert url_shown("http://h:8080?token=abc") == "http://h:8080"
    line = describe({"provider": "openai", "model": "gpt-x",
                     "baseUrl": "https://alice:SuperSecretPw123@llm.example.com/v1?api_key=QueryKey98765"})
    assert line == "gpt-x at https://llm.example.com/v1 (OpenAI-compatible API)", line
    shown = command_shown(["llm", "--key=sk-proj-abcdefghijkl123456", "-m", "gpt", "--token", "T0kenValue99",
                           "--max-tokens", "400", "AIzaSyA1234567890abcdefghijklmnopqrstu",
                           "--base-url", "https://u:pw123456@h/v1?key=q1w2e3r4"])
    for secret in ("sk-proj-abcdefghijkl123456", "T0kenValue99", "AIzaSyA1234567890", "pw123456", "q1w2e3r4"):
        assert secret not in shown, shown
    assert shown.startswith("llm --key=[REDACTED] -m gpt --token [REDACTED] --max-tokens 400 [REDACTED]"), shown
    assert "https://h/v1" in shown, shown
    line = describe({"provider": "cli", "profile": "llm", "command": "llm --api-key=hf_abcdefghijklmnopqrstuvwxyz12"})
    assert "hf_abcdefghijklmnopqrstuvwxyz12" not in line and line.endswith("llm --api-key=[REDACTED]"), line



def test_a_key_in_a_base_url_path_is_not_shown():
    from operate_sidecar.server.models.config import describe, url_shown

    assert url_shown("https://h/v1/key/sk-abcdef123456") == "https://h/v1/key/[REDACTED]"
    assert url_shown("https://h/v1;key=PathParamKey4321/chat") == "https://h/v1/chat"
    line = describe({"provider": "openai", "model": "m", "baseUrl": "https://h/v1/key/sk-abcdef123456"})
    assert "sk-abcdef123456" not in line, line


def test_ordinary_options_of_a_command_are_shown():
    from operate_sidecar.server.models.config import command_shown

    argv = ["prog", "--tokenizer", "bpe", "--sort-keys", "{prompt}", "--keyword", "kw1", "--author", "ann",
            "--api-key-env", "MY_KEY_VAR", "--max-tokens", "400"]
    assert command_shown(argv) == " ".join(argv)
    assert command_shown(["prog", "--token", "{prompt}", "--api-key={prompt}"]) == "prog --token {prompt} --api-key={prompt}"
    shown = command_shown(["prog", "--hf-token", "Tk1-value", "--client-secret", "Cs2-value", "--apiKey", "Ak3-value",
                           "--password=Pw4-value", "--auth", "Au5-value", "--credentials", "Cr6-value"])
    assert shown == ("prog --hf-token [REDACTED] --client-secret [REDACTED] --apiKey [REDACTED] "
                     "--password=[REDACTED] --auth [REDACTED] --credentials [REDACTED]"), shown

def test_acp_session_new_model_option_descriptions_carry_no_credentials(tmp_path):
    (tmp_path / "s.toml").write_text(
        '[models.gpt]\nprovider = "openai"\nmodel = "gpt-x"\n'
        'baseUrl = "https://alice:SuperSecretPw123@llm.example.com/v1?api_key=QueryKey98765"\n'
        '[models.c]\nprovider = "cli"\nprofile = "llm"\ncommand = ["llm", "--key=sk-proj-abcdefghijkl123456", "-m", "gpt"]\n')
    a = Raw(str(tmp_path / "s.toml"))
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}),
               req(2, "session/new", cwd=str(tmp_path), mcpServers=[]))
        answer = a.answer(2)
    finally:
        a.close()
    out = json.dumps(a.seen)
    for secret in ("SuperSecretPw123", "QueryKey98765", "sk-proj-abcdefghijkl123456"):
        assert secret not in out, out
    text = json.dumps(answer["result"])
    assert "https://llm.example.com/v1" in text and "--key=[REDACTED]" in text, text


# --- 2. every provider's options are checked at start ---------------------------------------------

@pytest.mark.parametrize("options, why", [
    ("{ n = 2 }", "models.m: options.n must be 1"),
    ('{ model = "y" }', "models.m: options.model is set by the provider"),
    ('{ extraHeaders = { "X-A" = "a\\nb" } }', "models.m: options.extraHeaders['X-A'] holds a line break"),
    ("{ timeout = -1 }", "models.m: options.timeout must be a positive number of seconds"),
])
def test_bad_openai_options_stop_the_server_at_start(tmp_path, options, why):
    (tmp_path / "s.toml").write_text(f'[models.m]\nprovider = "openai"\nmodel = "x"\nbaseUrl = "http://127.0.0.1:9/v1"\n'
                                     f"options = {options}\n")
    line = one_line_error(cli("--config", "s.toml", cwd=tmp_path))
    assert line.startswith(f"operate-sidecar: bad configuration: {why}"), line


def test_bad_openai_options_are_refused_at_initialize():
    with SidecarClient([*SERVER]) as c:
        with pytest.raises(RpcError) as e:
            c.request("initialize", {"settings": {"models": {"m": {"provider": "openai", "model": "x",
                                                                   "options": {"n": 3}}}}}, timeout=30)
        assert e.value.code == -32602 and "models.m: options.n must be 1" in e.value.message, e.value.message


def test_the_start_check_of_openai_options_imports_no_sdk():
    code = ("import sys; from operate_sidecar.server.models.config import config_problem; "
            "p = config_problem({'provider': 'openai', 'model': 'x', 'options': {'n': 2}}); "
            "assert p.startswith('options.n must be 1'), p; "
            "assert 'openai' not in sys.modules and 'operate_sidecar.server.models.openai_compat' not in sys.modules; "
            "print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout == "ok\n"


# --- 3. paths: ~ expanded, relative ones the working directory's, reported absolute -----

def _initialize_state_dir(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    with SidecarClient([*SERVER, *args], cwd=str(cwd), env=env) as c:
        state_dir = c.request("initialize", {}, timeout=30)["capabilities"]["stateDir"]
        c.request("createBranch", {}, timeout=30)
    return state_dir


def test_state_dir_tilde_is_expanded_in_the_config_file_and_the_flag(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = env_with(HOME=str(home))
    (work / "s.toml").write_text('stateDir = "~/state-a"\n')
    assert _initialize_state_dir(["--config", "s.toml"], work, env) == str(home / "state-a")
    assert (home / "state-a" / "state.sqlite3").exists()
    assert _initialize_state_dir(["--state-dir", "~/state-b"], work, env) == str(home / "state-b")  # (no shell)
    assert (home / "state-b" / "state.sqlite3").exists()
    assert not (work / "~").exists()


def test_relative_paths_are_the_working_directorys_wherever_they_are_given(tmp_path):
    """Not the config file's folder: a state directory a user has does not move (an editor starts
    the server in the project's folder; a shared config's ``stateDir = "st"`` is each project's)."""
    conf, work = tmp_path / "conf", tmp_path / "work"
    conf.mkdir()
    work.mkdir()
    (conf / "s.toml").write_text('stateDir = "st"\n')
    assert _initialize_state_dir(["--config", str(conf / "s.toml")], work, env_with()) == str(work / "st")
    assert (work / "st" / "state.sqlite3").exists() and not (conf / "st").exists()
    assert _initialize_state_dir(["--state-dir", "flag-st"], work, env_with()) == str(work / "flag-st")
    with SidecarClient([*SERVER], cwd=str(work)) as c:  # initialize's own: the working directory
        caps = c.request("initialize", {"settings": {"stateDir": "init-st"}}, timeout=30)["capabilities"]
        assert caps["stateDir"] == str(work / "init-st")


def test_a_missing_local_model_file_is_named_by_the_absolute_path_checked(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "s.toml").write_text('[models.l]\nprovider = "local"\npath = "~/models/none.gguf"\n'
                                     '[models.r]\nprovider = "local"\npath = "rel/none.gguf"\n')
    with SidecarClient([*SERVER, "--config", "s.toml"], cwd=str(tmp_path), env=env_with(HOME=str(home))) as c:
        c.request("initialize", {}, timeout=30)
        for name, where in (("l", home / "models" / "none.gguf"), ("r", tmp_path / "rel" / "none.gguf")):
            branch = c.request("createBranch", {"chatModel": name}, timeout=30)["branchId"]
            with pytest.raises(RpcError) as e:
                c.request("operate", {"branchId": branch, "instruction": "hi"}, timeout=60)
            assert e.value.code == -32011 and f"the local model file {where} does not exist" in e.value.message, \
                e.value.message


def test_model_paths_given_inline_are_expanded(tmp_path, monkeypatch):
    from operate_sidecar.server.models.cli import CLIModel
    from operate_sidecar.server.models.config import local_file_problem

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"GGUF" + b"\0" * 16)
    assert local_file_problem("~/models/x.gguf", False) is None
    assert f"{tmp_path}/models/y.gguf does not exist" in (local_file_problem("~/models/y.gguf", False) or "")
    model = CLIModel.from_config("c", {"provider": "cli", "profile": "llm", "cwd": "~/models"})
    assert model.cwd == str(tmp_path / "models")


# --- 4. a process id no process can have ----------------------------------------------------------

def test_a_client_process_id_out_of_range_is_refused_on_the_command_line():
    line = one_line_error(cli("--client-process-id", str(2**31)))
    assert "not a process id: '2147483648' (a PID is at most 2147483647)" in line, line


def test_process_alive_never_raises():
    from operate_sidecar.server.rpc.watchdog import process_alive

    for pid in (2**31, 2**63, -1, 0):
        assert process_alive(pid) is False
    assert process_alive(os.getpid()) is True


def test_watch_parent_ignores_a_pid_out_of_range_with_a_warning(caplog):
    from operate_sidecar.server.rpc.watchdog import watch_parent

    dead: list[int] = []
    asyncio.run(asyncio.wait_for(watch_parent(2**31, lambda: dead.append(1), interval=0.01), 10))
    assert dead == []
    assert any("processId 2147483648 is not a process id" in r.getMessage() for r in caplog.records)


def test_an_initialize_process_id_out_of_range_is_ignored_with_a_warning(tmp_path):
    with open(tmp_path / "err.txt", "wb") as err, SidecarClient([*SERVER], stderr=err) as c:
        c.request("initialize", {"processId": 2**31}, timeout=30)
        deadline = time.monotonic() + 30
        while b"is not a process id" not in (tmp_path / "err.txt").read_bytes():
            assert time.monotonic() < deadline, (tmp_path / "err.txt").read_text()
            c.request("ping", {}, timeout=30)
        assert c.request("ping", {}, timeout=30) == {}  # the server runs on
    text = (tmp_path / "err.txt").read_text()
    assert "OverflowError" not in text and "Traceback" not in text, text


# --- 5. --config "" -------------------------------------------------------------------------------

def test_an_empty_config_flag_is_refused():
    line = one_line_error(cli("--config", ""))
    assert line.startswith("operate-sidecar: --config: no file name given"), line


# --- 6. secrets of a model given inline ------------------------------------------------------------

INLINE_SECRET = "HeaderSecret-0099-abcdef"


class _EchoKey(StubHandler):
    """An API server that echoes the key header in its 401."""

    def do_POST(self):  # noqa: N802
        self.request_body()
        self.answer(401, json.dumps({"error": {"message": "bad key " + self.headers.get("x-api-key", "")}}).encode())


@pytest.fixture
def echo_server():
    with loopback(_EchoKey) as url:
        yield url


def _db_bytes(state: Path) -> bytes:
    """The state database's files (``state.sqlite3`` and its ``-wal``, ``-shm``), as stored."""
    return b"".join(f.read_bytes() for f in state.iterdir() if f.name.startswith("state.sqlite3"))


def _refused_after_restart(state: Path, branch: str) -> str:
    """A server started again on ``state`` refuses to operate ``branch`` (-32011), naming
    settings.models; the error's message."""
    with SidecarClient([*SERVER, "--state-dir", str(state)]) as c:
        c.request("initialize", {}, timeout=30)
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": branch, "instruction": "hi"}, timeout=60)
    assert e.value.code == -32011 and "settings.models" in e.value.message, e.value.message
    return e.value.message


def test_a_secret_header_of_an_inline_model_is_masked_on_the_wire_in_logs_and_the_store(tmp_path, echo_server):
    model = {"provider": "openai", "model": "m", "baseUrl": echo_server, "maxRetries": 0,
             "options": {"extraHeaders": {"X-Api-Key": INLINE_SECRET}}}
    state = tmp_path / "state"
    with open(tmp_path / "err.txt", "wb") as err, \
            SidecarClient([*SERVER, "--state-dir", str(state), "--log-level", "debug"], stderr=err) as c:
        c.request("initialize", {}, timeout=30)
        branch = c.request("createBranch", {"chatModel": model}, timeout=30)["branchId"]
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": branch, "instruction": "hi"}, timeout=60)
        assert e.value.code == -32011 and "bad key [REDACTED]" in e.value.message, e.value.message
        assert INLINE_SECRET not in json.dumps(c.notifications)
    assert INLINE_SECRET not in (tmp_path / "err.txt").read_text()
    assert INLINE_SECRET.encode() not in _db_bytes(state)
    # what is stored is the masked value (docs/SECURITY.md, Known limits): after a restart the
    # branch's model says so, before anything is sent, rather than sending the mask as a key
    with sqlite3.connect(state / "state.sqlite3") as conn:
        assert any("[REDACTED]" in str(row) for row in conn.execute("select * from branches"))
    message = _refused_after_restart(state, branch)
    assert "extraHeaders['X-Api-Key'] is [REDACTED]" in message, message



def test_an_empty_api_key_env_sends_no_key_to_a_loopback_server(tmp_path):
    seen: list[str] = []

    class KeepAuth(StubHandler):
        """An API server that keeps the Authorization header of each request and answers 401."""

        def do_POST(self):  # noqa: N802
            self.request_body()
            seen.append(self.headers.get("authorization", ""))
            self.answer(401, b'{"error": {"message": "no"}}')

    with loopback(KeepAuth) as url:
        model = {"provider": "openai", "model": "m", "baseUrl": url, "apiKeyEnv": "", "maxRetries": 0}
        with SidecarClient([*SERVER], env=env_with(OPENAI_API_KEY="sk-probe-EnvKeyNotToBeSent")) as c:
            c.request("initialize", {"settings": {"models": {"m": model}}}, timeout=30)
            branch = c.request("createBranch", {"chatModel": "m"}, timeout=30)["branchId"]
            with pytest.raises(RpcError) as e:
                c.request("operate", {"branchId": branch, "instruction": "hi"}, timeout=60)
            assert e.value.code == -32011, e.value.message
    assert seen and set(seen) == {"Bearer no-key-required"}, seen
    from operate_sidecar.server.models.config import config_problem

    problem = config_problem({"provider": "openai", "model": "m", "apiKeyEnv": "",
                              "baseUrl": "https://alice:pw12345678@llm.example.com/v1"})
    assert problem and problem.startswith("apiKeyEnv is empty: no API key is sent") and "  " not in problem \
        and "https://llm.example.com/v1 needs one" in problem and "pw12345678" not in problem, problem


def test_a_restored_inline_cli_model_with_a_masked_env_secret_says_so_before_it_runs(tmp_path):
    state, ran = tmp_path / "state", tmp_path / "ran"
    model = {"provider": "cli", "profile": "jsonl", "env": {"PROBE_API_KEY": "CliEnvSecret-0042-xyz"},
             "command": [sys.executable, "-c", f"open({str(ran)!r}, 'w').close()"]}
    with SidecarClient([*SERVER, "--state-dir", str(state)]) as c:
        c.request("initialize", {}, timeout=30)
        branch = c.request("createBranch", {"chatModel": model}, timeout=30)["branchId"]
    message = _refused_after_restart(state, branch)
    assert "env['PROBE_API_KEY'] is [REDACTED]" in message, message
    assert not ran.exists()  # (the program never started)



CMD_SECRET = "CliCmdSecret-0042-probe"
URL_SECRET = "UrlPassw0rd-0042-probe"


def test_an_inline_models_command_option_and_url_password_are_masked_and_refused_after_restart(tmp_path):
    state, ran = tmp_path / "state", tmp_path / "ran"
    code = (f"import json, sys; sys.stdin.read(); open({str(ran)!r}, 'a').write('x'); "
            "print(json.dumps({'type': 'text', 'text': 'my key is ' + sys.argv[2]}))")
    model = {"provider": "cli", "profile": "jsonl", "command": [sys.executable, "-c", code, "--api-key", CMD_SECRET]}
    remote = {"provider": "openai", "model": "m", "baseUrl": f"http://alice:{URL_SECRET}@127.0.0.1:9/v1",
              "apiKeyEnv": "", "maxRetries": 0}
    with SidecarClient([*SERVER, "--state-dir", str(state)]) as c:
        c.request("initialize", {}, timeout=30)
        branch = c.request("createBranch", {"chatModel": model}, timeout=30)["branchId"]
        remote_branch = c.request("createBranch", {"chatModel": remote}, timeout=30)["branchId"]
        out = c.request("operate", {"branchId": branch, "instruction": "hi"}, timeout=60)
        wire = json.dumps([out, c.notifications, c.request("listBranches", {}, timeout=30)])
        assert "my key is [REDACTED]" in json.dumps(out) and CMD_SECRET not in wire and URL_SECRET not in wire, wire
    db = _db_bytes(state)
    assert CMD_SECRET.encode() not in db and URL_SECRET.encode() not in db
    assert ran.read_text() == "x"
    message = _refused_after_restart(state, branch)
    assert "command[4] is [REDACTED]" in message, message
    assert ran.read_text() == "x"  # (the program did not start again)
    # the restored openai model would send the mask as the password of its baseUrl: said before
    # anything is sent (its apiKeyEnv "" on a loopback server is no problem of its own)
    message = _refused_after_restart(state, remote_branch)
    assert "baseUrl is [REDACTED]" in message and URL_SECRET not in message, message


def test_a_no_flag_takes_no_value():
    from operate_sidecar.server.models.config import command_shown
    from operate_sidecar.server.redaction import command_secret_values

    argv = ["prog", "--no-auth", "chat", "--no_token", "run", "--api-key", "Ak3-value", "--key=K4-value"]
    assert command_shown(argv) == "prog --no-auth chat --no_token run --api-key [REDACTED] --key=[REDACTED]"
    assert command_secret_values(argv) == ["Ak3-value", "K4-value"]


# --- 7. a secret with a trailing newline, a secret of several lines --------------------------------

def test_a_secret_is_registered_as_programs_use_it():
    from operate_sidecar.server import redaction

    redaction.remember_secret("Tr41lingNewlineSecret-unit\n")
    assert redaction.redact("login with Tr41lingNewlineSecret-unit failed") == "login with [REDACTED] failed"
    redaction.remember_secret("-----BEGIN KEY-----\nMultiLineSecretLine1-abc\nMultiLineSecretLine2-def\n-----END KEY-----\n")
    text = redaction.redact("bad key: -----BEGIN KEY-----\nMultiLineSecretLine1-abc\nMultiLineSecretLine2-def\n-----END KEY-----")
    assert text == "bad key: [REDACTED]", text



PEM_BODY = ["MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQDProbeKeyLine01",
            "q7X9zR2mN4pL6vB8cT1wY3hJ5kF0dS2aG7uE9iO4rQ6tZ8xC1vN3bM5lK7jH9gfA",
            "Ab3dE9fG"]


def test_a_multi_line_secret_is_masked_whole_and_its_lines_are_not_registered_alone():
    """A secret of several lines is registered whole and stripped, not line by line: its lines
    would be dozens of forms searched in every frame, and the ordinary ones (PEM armour,
    ``NODE_ENV=production``, a host name, a project id) would mask ordinary text."""
    from operate_sidecar.server import redaction

    pem = "-----BEGIN PRIVATE KEY-----\n" + "\n".join(PEM_BODY) + "\n-----END PRIVATE KEY-----\n"
    account = json.dumps({"type": "service_account", "project_id": "probe-project", "private_key_id":
                          "0f1e2d3c4b5a69788796a5b4c3d2e1f0probe999", "private_key": pem.replace("ProbeKeyLine01",
                                                                                                  "ProbeKeyLine02"),
                          "client_email": "probe@probe-project.iam.gserviceaccount.com",
                          "token_uri": "https://oauth2.googleapis.com/token",
                          "universe_domain": "googleapis.com"}, indent=2)
    env_file = "NODE_ENV=production\nDATABASE_HOST=db.internal.example.com\nPROBE_TOKEN=EnvFileToken-0042-probe\n"
    before = set(redaction.known_secrets())
    for secret in (pem, account, env_file):
        redaction.remember_secret(secret)
    # each whole, and without its trailing newline: no line of one alone
    assert set(redaction.known_secrets()) - before == {pem, pem.strip(), account, env_file, env_file.strip()}
    ordinary = ('pem.startswith("-----BEGIN PRIVATE KEY-----") and pem.endswith("-----END PRIVATE KEY-----")\n'
                '"type": "service_account",\n"universe_domain": "googleapis.com"\nprobe-project\n'
                "https://oauth2.googleapis.com/token probe@probe-project.iam.gserviceaccount.com\n"
                '"start": "NODE_ENV=production node server.js" on db.internal.example.com')
    assert redaction.redact(ordinary) == ordinary
    for secret in (pem, account, env_file):
        assert redaction.redact(f"bad key: {secret}!") == "bad key: [REDACTED]!"
        assert redaction.redact(f"bad key: {secret.strip()}!") == "bad key: [REDACTED]!"
        frame = json.dumps({"text": f"read: {secret}"}).encode()
        assert redaction.redact_bytes(frame) == b'{"text": "read: [REDACTED]"}'


def test_exception_line_redacts_before_it_cuts():
    from operate_sidecar.server import redaction
    from operate_sidecar.server.core.errors import exception_line

    redaction.remember_secret("k3y!\nq9z#")
    assert exception_line(RuntimeError("the key k3y!\nq9z# was refused")) == "the key [REDACTED] was refused"


def test_a_secret_env_value_ending_in_a_newline_is_masked_as_programs_use_it(tmp_path):
    (tmp_path / "probe_tool_mod.py").write_text(
        'import os\nraise RuntimeError("could not log in with " + os.environ["PROBE_SEC"].strip())\n')
    (tmp_path / "s.toml").write_text('secretEnv = ["PROBE_SEC"]\ntoolModules = ["probe_tool_mod"]\n')
    env = env_with(PROBE_SEC="Tr41lingNewlineSecret-xyz\n", PYTHONPATH=str(tmp_path))
    with open(tmp_path / "err.txt", "wb") as err, \
            SidecarClient([*SERVER, "--config", "s.toml"], cwd=str(tmp_path), env=env, stderr=err) as c:
        c.request("initialize", {}, timeout=30)
        try:
            c.request("listTools", {}, timeout=60)
        except RpcError as e:
            assert "Tr41lingNewlineSecret-xyz" not in e.message, e.message
        assert c.wait_for(lambda ns: "could not log in with" in json.dumps(ns), timeout=30), c.notifications
        assert "Tr41lingNewlineSecret-xyz" not in json.dumps(c.notifications)
        assert "could not log in with [REDACTED]" in json.dumps(c.notifications)
    assert "Tr41lingNewlineSecret-xyz" not in (tmp_path / "err.txt").read_text()


# --- 8. smaller mistakes at start -----------------------------------------------------------------

GROQ_KEY = "gsk_Probe0123456789abcdefghijKLMNOPQRstuvwxyz0123456789AB"
MISTRAL_KEY = "Xq7bN2kLm9PzR4tVw8YcJ3dHf6GsA1eU"
HEX_KEY = "3f9a1c7e5b2d8f0a4c6e9b1d3f5a7c9e0b2d4f6a8c1e3b5d7f9a0c2e4b6d8f1a"


@pytest.mark.parametrize("model, why", [
    ('provider = "openai"\nmodel = "x"\napiKeyEnv = "sk-proj-AbCdEf0123456789xyz"',
     "models.m: apiKeyEnv looks like a key, not a variable name"),
    ('provider = "openai"\nmodel = "x"\napiKeyEnv = "AIzaSyA1234567890abcdefghijklmnopqrstu"',
     "models.m: apiKeyEnv looks like a key, not a variable name"),
    ('provider = "openai"\nmodel = "x"\napiKeyEnv = "hf_abcdefghijklmnopqrstuvwxyz12"',
     "models.m: apiKeyEnv looks like a key, not a variable name"),
    (f'provider = "openai"\nmodel = "x"\napiKeyEnv = "{GROQ_KEY}"',
     "models.m: apiKeyEnv looks like a key, not a variable name"),
    (f'provider = "openai"\nmodel = "x"\napiKeyEnv = "{MISTRAL_KEY}"',
     "models.m: apiKeyEnv looks like a key, not a variable name"),
    (f'provider = "openai"\nmodel = "x"\napiKeyEnv = "{HEX_KEY}"',
     "models.m: apiKeyEnv looks like a key, not a variable name"),
    ('provider = "openai"\nmodel = "x"\napiKeyEnv = "pplx-NotANameAtAll"',
     "models.m: apiKeyEnv must be an environment variable's name: letters, digits and '_'"),
    ('provider = "openai"\nmodel = "x"\napiKeyEnv = ""',
     "models.m: apiKeyEnv is empty: no API key is sent, which only a server on this machine (a loopback baseUrl) "
     "accepts, and the OpenAI API needs one"),
    ('provider = "cli"\nprofile = "llm"\ncwd = ""', "models.m: cwd must be a folder's path, not empty"),
    ('provider = "local"\npath = ""', "models.m: path must be the path of a GGUF file, not empty"),
])
def test_a_model_field_that_cannot_work_stops_the_server_at_start(tmp_path, model, why):
    (tmp_path / "s.toml").write_text(f"[models.m]\n{model}\n")
    proc = cli("--config", "s.toml", cwd=tmp_path)
    line = one_line_error(proc)
    assert line.startswith(f"operate-sidecar: bad configuration: {why}"), line
    for key in ("sk-proj-AbCdEf", "AIzaSyA1234567890", "hf_abcdefghij", GROQ_KEY[:12], MISTRAL_KEY[:12],
                HEX_KEY[:12], "NotANameAtAll"):
        assert key not in proc.stderr, proc.stderr


def test_a_key_of_no_known_shape_as_api_key_env_is_refused_unshown_and_a_real_name_is_not():
    from operate_sidecar.server.models.config import config_problem
    from operate_sidecar.server.redaction import looks_like_key, model_secrets

    for key in (GROQ_KEY, MISTRAL_KEY, HEX_KEY):
        problem = config_problem({"provider": "openai", "model": "m", "apiKeyEnv": key})
        assert problem and problem.startswith("apiKeyEnv looks like a key") and key not in problem, problem
        assert model_secrets({"provider": "openai", "apiKeyEnv": key}) == ([], [key])  # (known as a secret)
    for name in ("OPENAI_API_KEY", "AZURE_OPENAI_API_KEY_2024", "GROQ_API_KEY", "openai_key", "_KEY1"):
        assert not looks_like_key(name), name
        assert config_problem({"provider": "openai", "model": "m", "apiKeyEnv": name}) is None, name


def test_an_empty_default_model_is_refused(tmp_path):
    (tmp_path / "s.toml").write_text('defaultModel = ""\n')
    line = one_line_error(cli("--config", "s.toml", cwd=tmp_path))
    assert line.startswith("operate-sidecar: bad configuration: defaultModel must be a model name, not empty"), line


def test_an_unknown_settings_field_names_the_config_file(tmp_path):
    (tmp_path / "s.toml").write_text('defaultModle = "x"\n')
    line = one_line_error(cli("--config", "s.toml", cwd=tmp_path))
    assert line == "operate-sidecar: bad configuration: unknown settings field(s): defaultModle (in s.toml)", line
