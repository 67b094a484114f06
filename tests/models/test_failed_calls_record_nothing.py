"""A model call that fails or is cancelled records nothing of its reply (fail before effect,
docs/PROTOCOL.md §2, §5, §7 and §13; docs/PIPELINE.md D3): the branch is as it was before the
call, unless a CLI-backed model's run used tools first, whose calls (real effects) stay recorded
with their results. Its parse-repair turns are part of the call. Real processes throughout: the
server as a subprocess over real pipes, and small Python programs as the CLI models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_models_cli import script  # (the provider's own tests: same helpers)
from test_models_cli_wire import PY, server, wait_until

from operate_sidecar.clients.python.client import RpcError, SidecarClient

#: a jsonl CLI model: ``exit`` writes part of a reply and exits 3; ``tools`` uses a tool (with its
#: result), writes part of a reply and exits 3; ``hang`` writes part of a reply (``tool``: after a
#: tool use with no result), notes it started in ``<dir>/started``, and waits for ever
PROGRAM = """
import json, os, sys, time
sys.stdin.read()
mode, where = sys.argv[1], sys.argv[2]
def emit(**event):
    print(json.dumps(event), flush=True)
if mode in ("tools", "tool-hang"):
    emit(type="text", text="let me look")
    emit(type="tool_use", id="t1", name="ls", input={"path": "."})
    if mode == "tools":
        emit(type="tool_result", id="t1", output="a.txt", is_error=False)
emit(type="text", text="HALF a reply")
if mode in ("exit", "tools"):
    sys.stderr.write("crashed midway\\n")
    sys.exit(3)
open(os.path.join(where, "started"), "w").close()
while True:
    time.sleep(1)
"""

ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def cli(tmp_path: Path, mode: str, **config) -> dict:
    return {"provider": "cli", "profile": "jsonl", "killGraceS": 1,
            "command": [PY, script(tmp_path, "program.py", PROGRAM), mode, str(tmp_path)], **config}


def models(tmp_path: Path) -> dict:
    return {"ok": {"provider": "scripted", "responses": ["first answer"] * 20},
            "exits": cli(tmp_path, "exit"),
            "times-out": cli(tmp_path, "hang", timeoutS=1, killGraceS=0.5),
            "errs": {"provider": "scripted", "cli": True, "responses": [{"text": "HALF a reply", "error": "boom"}] * 4},
            "tools": cli(tmp_path, "tools"),
            "hangs": cli(tmp_path, "hang"),
            "tool-hangs": cli(tmp_path, "tool-hang")}


def messages(c: SidecarClient, bid: str) -> list[dict]:
    return c.request("branchMessages", {"branchId": bid}, timeout=30)["messages"]


def with_a_turn(c: SidecarClient) -> tuple[str, list[dict]]:
    """A branch with a system message and one recorded turn, and its messages."""
    bid = c.request("createBranch", {"system": "be brief", "chatModel": "ok"})["branchId"]
    c.request("operate", {"branchId": bid, "instruction": "first"}, timeout=60)
    before = messages(c, bid)
    assert [m["kind"] for m in before] == ["system", "instruction", "assistant_response"]
    return bid, before


def cancelled(c: SidecarClient, params: dict, started) -> None:
    """Send an operate, cancel it once ``started()`` holds, and see it answered -32800."""
    call = c.request_async("operate", params)
    assert wait_until(started, 30), "the call did not start"
    c.cancel(call.id)
    with pytest.raises(RpcError) as e:
        call.result(30)
    assert e.value.code == -32800, e.value


def test_a_cli_call_that_fails_leaves_the_branch_as_it_was(tmp_path):
    """A program that exited non-zero, or timed out, after part of its reply, and a run that
    reported a model error: the call failed (-32011), yet its instruction and the reply so far
    were recorded (and a later model call shown them as a turn). Now nothing is recorded; with
    clearMessages the earlier turns are not cleared either."""
    with server(tmp_path, models(tmp_path)) as c:
        for model in ("exits", "times-out", "errs"):
            for clear in (False, True):
                bid, before = with_a_turn(c)
                with pytest.raises(RpcError) as e:
                    c.request("operate", {"branchId": bid, "instruction": "go", "chatModel": model,
                                          "clearMessages": clear}, timeout=60)
                assert e.value.code == -32011, e.value
                assert messages(c, bid) == before, (model, clear)


def test_a_cli_call_cancelled_leaves_the_branch_as_it_was(tmp_path):
    """A run cancelled after it wrote part of its reply kept the instruction and that part."""
    with server(tmp_path, models(tmp_path)) as c:
        for clear in (False, True):
            (tmp_path / "started").unlink(missing_ok=True)
            bid, before = with_a_turn(c)
            cancelled(c, {"branchId": bid, "instruction": "go", "chatModel": "hangs", "clearMessages": clear},
                      lambda: (tmp_path / "started").exists())
            assert messages(c, bid) == before, clear


def test_the_tool_uses_of_a_run_that_failed_or_was_cancelled_stay_recorded(tmp_path):
    """What a CLI run's tools did is real: its tool uses stay recorded, each with its result (or
    an error saying the run reported none), after the instruction and the text before them; the
    reply begun after them is not recorded."""
    with server(tmp_path, models(tmp_path)) as c:
        bid, before = with_a_turn(c)
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": bid, "instruction": "go", "chatModel": "tools"}, timeout=60)
        assert e.value.code == -32011, e.value
        bid2, before2 = with_a_turn(c)

        def past_the_tool_use() -> bool:
            # the text the run wrote after its tool use, streamed: the server has handled (and
            # recorded) the tool use before it (the program's ``started`` file may come sooner)
            return "HALF" in "".join(str(p["value"].get("delta", "")) for m, p in list(c.notifications)
                                     if m == "$/progress" and p["token"] == "t-tool-hangs")

        cancelled(c, {"branchId": bid2, "instruction": "go", "chatModel": "tool-hangs",
                      "workDoneToken": "t-tool-hangs"}, past_the_tool_use)
        for b, old, output in ((bid, before, "a.txt"),
                               (bid2, before2, {"error": "no result reported by the run", "function": "ls"})):
            now = messages(c, b)
            assert now[:3] == old
            new = now[3:]
            assert [m["kind"] for m in new] == ["instruction", "assistant_response", "action_request",
                                                "action_response"]
            assert new[1]["content"]["text"] == "let me look"
            assert new[3]["content"]["output"] == output
            assert "HALF" not in json.dumps(now)


def test_a_cancel_during_a_repair_turn_leaves_the_branch_as_it_was(tmp_path):
    """A reply that did not parse, then a repair turn (part of the model call) cancelled: the
    unparsed reply and its instruction stayed recorded. Now the branch is as it was, whichever
    adapter made the call; a repair turn that ends still records them (and was shown them)."""
    def repairing(cli: bool) -> dict:
        return {"provider": "scripted", "cli": cli,
                "responses": ["not json at all", {"json": {"answer": "x"}, "delayMs": 60000},
                              "not json at all", {"json": {"answer": "x"}}]}

    with server(tmp_path, {"ok": models(tmp_path)["ok"], "api": repairing(False), "run": repairing(True)}) as c:
        for model in ("api", "run"):
            bid, before = with_a_turn(c)
            token = f"t-{model}"

            def repair_began() -> bool:
                return any(m == "$/progress" and p["token"] == token
                           and str(p["value"].get("message", "")).startswith("repair attempt")
                           for m, p in list(c.notifications))

            cancelled(c, {"branchId": bid, "instruction": "go", "chatModel": model, "parseModel": model,
                          "responseFormat": ANSWER, "workDoneToken": token}, repair_began)
            assert messages(c, bid) == before, model
            # the script's next call: the same reply, then a repair turn that ends
            out = c.request("operate", {"branchId": bid, "instruction": "again", "chatModel": model,
                                        "parseModel": model, "responseFormat": ANSWER,
                                        "parseOptions": {"retryAttempts": 0}}, timeout=120)
            assert out["result"] == {"answer": "x"}, out
            new = messages(c, bid)[3:]
            assert [m["kind"] for m in new] == ["instruction", "assistant_response"], (model, new)
            assert new[0]["content"]["instruction"] == "again" and new[1]["content"]["text"] == "not json at all"


#: a jsonl CLI parse model: notes the prompt it was given in ``<dir>/prompt``, answers a JSON object
REFORMATTER = """
import json, os, sys
with open(os.path.join(sys.argv[1], "prompt"), "w") as f:
    f.write(sys.stdin.read())
print(json.dumps({"type": "text", "text": json.dumps({"answer": "x"})}), flush=True)
"""


def test_a_repair_turn_is_shown_the_instruction_and_reply_it_reformats(tmp_path):
    """The instruction and the reply are recorded once the reply is parsed; a repair turn before
    that is still shown them, as the last turn of the conversation, as when they were recorded
    first."""
    reformatter = {"provider": "cli", "profile": "jsonl",
                   "command": [PY, script(tmp_path, "reformatter.py", REFORMATTER), str(tmp_path)]}
    with server(tmp_path, {"ok": models(tmp_path)["ok"], "api": {"provider": "scripted",
                                                                  "responses": ["not json at all"]},
                           "reformatter": reformatter}) as c:
        bid, before = with_a_turn(c)
        out = c.request("operate", {"branchId": bid, "instruction": "the question", "chatModel": "api",
                                    "parseModel": "reformatter", "responseFormat": ANSWER}, timeout=120)
        assert out["result"] == {"answer": "x"}, out
        prompt = (tmp_path / "prompt").read_text()
        assert prompt.index("be brief") < prompt.index("first") < prompt.index("Instruction: the question") \
            < prompt.index("not json at all") < prompt.index("reformat text into specified model"), prompt
        assert [m["kind"] for m in messages(c, bid)[3:]] == ["instruction", "assistant_response"]
