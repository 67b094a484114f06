"""`operate-sidecar --record FILE`: a served session written as a script that replays green,
with the embedded local model and then with no model at all (`replay --scripted`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operate_sidecar.clients.python.client import RpcError, SidecarClient

TIMEOUT = 300
INLINE = {"provider": "local", "maxTokens": 12}
ANSWER = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def record(path: Path, session, *server_args: str) -> None:
    argv = [sys.executable, "-m", "operate_sidecar.server", "--record", str(path), *server_args]
    with SidecarClient(argv=argv, stderr=subprocess.DEVNULL) as c:
        session(c)
        assert c.close() == 0


def replay(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "operate_sidecar.server", "replay", *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)


def lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def no_llama_env(tmp_path: Path) -> dict:
    """An environment in which llama.cpp cannot be imported: the replay must not need it."""
    shim = tmp_path / "no-llama" / "llama_cpp"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text("raise ImportError('llama.cpp is not available in this replay')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim.parent), env.get("PYTHONPATH", "")])
    return env


def test_a_session_with_the_local_model_replays_green_without_any_model(tmp_path):
    rec = tmp_path / "local.jsonl"

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"clientInfo": {"name": "rec"}}, timeout=60)
        bid = c.request("createBranch", {"system": "Answer briefly."})["branchId"]
        c.request("operate", {"branchId": bid, "instruction": "What is 2+2?", "responseFormat": ANSWER,
                              "workDoneToken": "t1", "modelOptions": {"temperature": 0, "seed": 1, "max_tokens": 24}},
                  timeout=TIMEOUT)
        c.request("operate", {"branchId": bid, "instruction": "And 3+3?",
                              "modelOptions": {"temperature": 0, "seed": 1, "max_tokens": 16}}, timeout=TIMEOUT)
        c.request("branchMessages", {"branchId": bid}, timeout=30)
        # a model given inline (not by a configured name) is recorded and replaced too
        other = c.request("createBranch", {"chatModel": INLINE})["branchId"]
        c.request("operate", {"branchId": other, "instruction": "Say hi.", "modelOptions": {"temperature": 0}},
                  timeout=TIMEOUT)

    record(rec, session)
    steps = lines(rec)
    (models,) = [s["recordedModels"] for s in steps if "recordedModels" in s]
    assert sorted(models) == ["inline-local-1", "local"] and len(models["local"]["responses"]) == 2
    assert models["inline-local-1"]["inline"] == INLINE and len(models["inline-local-1"]["responses"]) == 1
    assert all(isinstance(r.get("text"), str) and r["text"] for m in models.values() for r in m["responses"])
    create = next(s for s in steps if s.get("request") == "createBranch")
    assert create["save"] == {"branch1": "branchId"} and create["expect"] == {"result": {"branchId": "*"}}
    operates = [s for s in steps if s.get("request") == "operate"]
    assert [s["params"]["branchId"] for s in operates] == ["${branch1}", "${branch1}", "${branch2}"]
    assert operates[0]["expect"]["result"]["usage"] == "*"
    assert {"expectNotification": "$/progress", "match": {"token": "t1", "value": {"kind": "end", "message": "completed",
                                                                                   "usage": "*"}}} in steps

    out = replay("--scripted", rec, env=no_llama_env(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == f"all {len(steps) - 1} steps passed (local.jsonl)"
    # the shim is effective: without --scripted the recorded operate needs llama.cpp and fails
    head = tmp_path / "head.jsonl"
    head.write_text("".join(ln + "\n" for ln in rec.read_text().splitlines()[:3]))
    real = replay(head, env=no_llama_env(tmp_path))
    assert real.returncode == 1 and 'FAIL line 3: request operate: expected result' in real.stdout
    assert '"code": -32011' in real.stdout


def test_answers_to_permission_requests_are_recorded_as_standing_answers(tmp_path):
    rec = tmp_path / "perm.jsonl"
    ws = tmp_path / "ws"
    ws.mkdir()
    write = {"json": {"action_requests": [{"function": "write_file", "arguments": {"path": "n.txt", "content": "x"}}]}}
    decisions = iter(["deny_once", "allow_once"])

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"capabilities": {"toolPermission": True}, "workspaceFolders": [str(ws)],
                                 "settings": {"models": {"m": {"provider": "scripted", "responses": [write, write]}},
                                              "toolPolicy": {"write_file": "ask"}}}, timeout=60)
        c.on_request("requestToolPermission", lambda _p: {"decision": next(decisions)})
        bid = c.request("createBranch", {})["branchId"]
        for _ in range(2):
            c.request("operate", {"branchId": bid, "instruction": "write", "actions": True}, timeout=60)

    record(rec, session)
    assert (ws / "n.txt").read_text() == "x"
    (ws / "n.txt").unlink()
    kinds = [next(iter(s)) + ":" + str(s.get("request") or s.get("respond") or "") for s in lines(rec)
             if "request" in s or "respond" in s]
    assert kinds == ["request:initialize", "request:createBranch", "respond:requestToolPermission",
                     "request:operate", "respond:requestToolPermission", "request:operate", "request:shutdown"]
    answers = [s["result"] for s in lines(rec) if "respond" in s]
    assert answers == [{"decision": "deny_once"}, {"decision": "allow_once"}]
    out = replay(rec)   # the scripted model is part of the settings: a plain replay reproduces it
    assert out.returncode == 0, out.stdout + out.stderr
    assert (ws / "n.txt").read_text() == "x"


def test_a_cancelled_operate_is_recorded_so_that_its_replay_is_cancelled_too(tmp_path):
    rec = tmp_path / "cancel.jsonl"
    slow = {"provider": "scripted", "responses": [{"text": "never seen", "delayMs": 30000}, "done"]}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"processId": os.getpid(), "settings": {"models": {"slow": slow}}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        pending = c.request_async("operate", {"branchId": bid, "instruction": "slow", "skipValidation": True,
                                              "workDoneToken": "w"})
        assert c.wait_for(lambda notes: any(m == "$/progress" for m, _ in notes), timeout=30)
        c.cancel(pending.id)
        try:
            pending.result(30)
        except Exception as e:  # noqa: BLE001 - the cancelled answer
            assert getattr(e, "code", None) == -32800
        assert c.request("operate", {"branchId": bid, "instruction": "again", "skipValidation": True},
                         timeout=30)["result"] == "done"

    record(rec, session)
    steps = lines(rec)
    init = next(s for s in steps if s.get("request") == "initialize")
    assert "processId" not in init["params"]          # the recording client's pid means nothing later
    op = next(s for s in steps if s.get("request") == "operate")
    assert op["wait"] is False and op["expect"] == {"error": {"code": -32800}}
    assert {"notify": "$/cancelRequest", "params": {"id": op["id"]}} in steps
    (models,) = [s["recordedModels"] for s in steps if "recordedModels" in s]
    assert models["slow"]["responses"][0]["delayMs"] >= 60000 and models["slow"]["responses"][1] == {"text": "done"}
    out = replay("--scripted", rec)
    assert out.returncode == 0, out.stdout + out.stderr


def test_requests_the_client_did_not_wait_for_overlap_in_the_replay_too(tmp_path):
    rec = tmp_path / "overlap.jsonl"
    slow = {"provider": "scripted", "responses": [{"text": "late", "delayMs": 1500}]}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": {"slow": slow}}}, timeout=60)
        bid = c.request("createBranch", {"name": "b"})["branchId"]
        pending = c.request_async("operate", {"branchId": bid, "instruction": "x", "skipValidation": True})
        # asked while the operate runs: the branch holds only what was settled before it
        assert c.request("listBranches", timeout=30)["branches"][0]["messageCount"] == 0
        assert pending.result(30)["result"] == "late"

    record(rec, session)
    steps = [s for s in lines(rec) if "request" in s]
    assert [(s["request"], s.get("wait", True)) for s in steps] == [
        ("initialize", True), ("createBranch", True), ("operate", False), ("listBranches", True), ("shutdown", True)]
    out = replay(rec)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS line 3: request operate: result matched" in out.stdout.splitlines()[3]  # judged before shutdown


def test_client_tool_answers_are_recorded_per_call_and_replay_in_any_order(tmp_path):
    rec = tmp_path / "client-tools.jsonl"
    calls = {"json": {"action_requests": [{"function": "lookup", "arguments": {"key": k}} for k in ("a", "b", "c")]}}
    tool = {"name": "lookup", "description": "look a key up in the editor",
            "inputSchema": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"capabilities": {"clientTools": True},
                                 "settings": {"models": {"m": {"provider": "scripted", "responses": [calls]}}}},
                  timeout=60)
        c.request("registerClientTools", {"tools": [tool]})
        c.on_request("invokeClientTool", lambda p: {"output": p["arguments"]["key"].upper() * 2})
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "look up", "actions": True}, timeout=60)
        assert [r["output"] for r in out["result"]["action_responses"]] == ["AA", "BB", "CC"]

    record(rec, session)
    responds = [s for s in lines(rec) if "respond" in s]
    assert sorted(((s["match"], s["result"]) for s in responds), key=json.dumps) == [
        ({"tool": "lookup", "arguments": {"key": k}}, {"output": k.upper() * 2}) for k in ("a", "b", "c")]
    out = replay(rec)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_recording_holds_no_known_secret(tmp_path):
    rec = tmp_path / "secret.jsonl"
    secret = "sk-test-0123456789abcdefghij"
    models = {"m": {"provider": "scripted", "responses": [f"the key is {secret}"]},
              "api": {"provider": "openai", "model": "x", "apiKeyEnv": "RECORD_TEST_KEY"}}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": models, "defaultModel": "m"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "key?", "skipValidation": True}, timeout=60)
        assert secret not in json.dumps(out)

    argv = [sys.executable, "-m", "operate_sidecar.server", "--record", str(rec)]
    with SidecarClient(argv=argv, stderr=subprocess.DEVNULL, env={**os.environ, "RECORD_TEST_KEY": secret}) as c:
        session(c)
        assert c.close() == 0
    text = rec.read_text()
    assert "the key is [REDACTED]" in text and secret not in text


def test_a_reasoning_models_session_is_recorded_with_its_thoughts_and_replays_green_without_it(tmp_path):
    """A reasoning model (a loopback stand-in of a remote API that streams ``reasoning_content``:
    tests/openai_stub.py) answers an operate with progress: the recording keeps its thoughts as
    the scripted turn's ``thinking`` (redacted), so ``replay --scripted`` streams the same
    "thinking" report before the reply's text, with the stand-in gone."""
    from openai_stub import openai_stub, reasoning_stream

    rec = tmp_path / "reasoning.jsonl"
    secret = "tok-5be1c08a77d24f39"
    with openai_stub(reasoning_stream(["Weighing it; token ", secret, "."], "Yes.")) as (url, _):
        models = {"r": {"provider": "openai", "model": "r1", "baseUrl": url}}

        def session(c: SidecarClient) -> None:
            c.request("initialize", {"settings": {"models": models, "defaultModel": "r", "secretEnv": ["REC_TOKEN"]}},
                      timeout=60)
            bid = c.request("createBranch", {})["branchId"]
            out = c.request("operate", {"branchId": bid, "instruction": "ok?", "workDoneToken": "w"}, timeout=60)
            assert out["result"] == "Yes."

        argv = [sys.executable, "-m", "operate_sidecar.server", "--record", str(rec)]
        with SidecarClient(argv=argv, stderr=subprocess.DEVNULL, env={**os.environ, "REC_TOKEN": secret}) as c:
            session(c)
            assert c.close() == 0
    steps = lines(rec)
    (recorded,) = [s["recordedModels"] for s in steps if "recordedModels" in s]
    assert recorded["r"]["responses"] == [{"text": "Yes.", "thinking": "Weighing it; token [REDACTED]."}], recorded
    said = [s["match"]["value"] for s in steps if s.get("expectNotification") == "$/progress"]
    assert {"kind": "report", "message": "*", "phase": "stream"} in said, said   # the thinking report
    out = replay("--scripted", rec)   # the stand-in is gone: only the recorded turns can answer
    assert out.returncode == 0, out.stdout + out.stderr


def test_literal_dollar_brace_text_is_recorded_escaped_and_replays_as_it_was(tmp_path):
    rec = tmp_path / "dollar.jsonl"
    reply = 'Use "${HOME}/bin" (not $${HOME}) in your PATH.'
    models = {"m": {"provider": "scripted", "responses": [reply]}}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": models}}, timeout=60)
        bid = c.request("createBranch", {"name": "shell ${USER}"})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "How do I add ${HOME}/bin to PATH?",
                                    "skipValidation": True}, timeout=60)
        assert out["result"] == reply

    record(rec, session)
    steps = lines(rec)
    create = next(s for s in steps if s.get("request") == "createBranch")
    assert create["params"] == {"name": "shell $${USER}"}          # a literal ${ is written as $${
    op = next(s for s in steps if s.get("request") == "operate")
    assert op["params"]["branchId"] == "${branch1}"                 # the recorder's own reference is not
    assert op["params"]["instruction"] == "How do I add $${HOME}/bin to PATH?"
    assert op["expect"]["result"]["result"] == 'Use "$${HOME}/bin" (not $$${HOME}) in your PATH.'
    (recorded,) = [s["recordedModels"] for s in steps if "recordedModels" in s]
    assert recorded["m"]["responses"] == [{"text": 'Use "$${HOME}/bin" (not $$${HOME}) in your PATH.'}]
    for args in ((rec,), ("--scripted", rec)):   # the settings' model, then the recorded turns
        out = replay(*args)
        assert out.returncode == 0, out.stdout + out.stderr


SLOW_THEN_DONE = {"provider": "scripted", "responses": [{"text": "never seen", "delayMs": 30000}, "done"]}
#: the first reply does not validate; the repair turn (the operate's second model call) is cancelled
REPAIR_THEN_DONE = {"provider": "scripted", "responses": [
    "not JSON", {"json": {"answer": "late"}, "delayMs": 30000}, {"json": {"answer": "4"}}]}


@pytest.mark.parametrize("model, extra, calls", [
    (SLOW_THEN_DONE, {"skipValidation": True}, 1),
    (REPAIR_THEN_DONE, {"responseFormat": ANSWER, "handleValidation": "raise"}, 2),
], ids=["chat-turn", "repair-turn"])
def test_a_cancelled_operate_without_progress_takes_the_same_model_turns_when_replayed(tmp_path, model, extra, calls):
    """No workDoneToken, so no step between the request and its cancel: the replay must still
    not cancel before the server has started the turns it had started when recorded (else the
    cancelled turn, which waits to be cancelled, is the next operate's)."""
    rec = tmp_path / "cancel-quiet.jsonl"

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": {"slow": model}}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        pending = c.request_async("operate", {"branchId": bid, "instruction": "slow", **extra})
        time.sleep(1.5)  # the server reaches the slow turn (it waits 30 s)
        c.cancel(pending.id)
        with pytest.raises(RpcError) as e:
            pending.result(30)
        assert e.value.code == -32800
        again = c.request("operate", {"branchId": bid, "instruction": "again", **extra}, timeout=30)["result"]
        assert again == ("done" if calls == 1 else {"answer": "4"})

    record(rec, session)
    steps = lines(rec)
    op = next(s for s in steps if s.get("request") == "operate")
    assert op["wait"] is False and op["cancelAfterModelCalls"] == calls and "workDoneToken" not in op["params"]
    assert steps[steps.index(op) + 1] == {"notify": "$/cancelRequest", "params": {"id": op["id"]}}
    for args in (("--scripted", rec), (rec,)):   # the recorded turns, then the settings' model
        out = replay("--timeout", "20", *args)
        assert out.returncode == 0, out.stdout + out.stderr


def test_overlapping_requests_are_awaited_where_the_client_got_their_answers(tmp_path):
    """Two operates on two branches overlap, the client waits for both, then lists the branches:
    the replay must not send the list while the operates still run (it overlapped with nothing)."""
    rec = tmp_path / "interleaved.jsonl"
    models = {name: {"provider": "scripted", "responses": [{"text": name.upper(), "delayMs": 600}]} for name in "ab"}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": models}}, timeout=60)
        ids = [c.request("createBranch", {"chatModel": name})["branchId"] for name in "ab"]
        ops = [c.request_async("operate", {"branchId": b, "instruction": "x", "skipValidation": True}) for b in ids]
        assert [p.result(30)["result"] for p in ops] == ["A", "B"]
        counts = [b["messageCount"] for b in c.request("listBranches", timeout=30)["branches"]]
        assert counts == [2, 2]

    record(rec, session)
    steps = lines(rec)
    ops = [s for s in steps if s.get("request") == "operate"]
    # the first was still running when the second was sent; nothing was sent while the second ran
    assert [s.get("wait", True) for s in ops] == [False, True] and "id" in ops[0]
    listing = steps.index(next(s for s in steps if s.get("request") == "listBranches"))
    assert [s["await"] for s in steps[:listing] if "await" in s] == [ops[0]["id"]]
    out = replay(rec)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == f"all {len(steps) - 1} steps passed (interleaved.jsonl)"


def test_a_client_that_leaves_mid_operate_is_replayed_leaving_the_same_way(tmp_path):
    """The client closes the connection while an operate waits for its model: the recording ends
    there (nothing the server sent afterwards reached it) and replays green at once, with the
    recorded model turns and with the settings' model."""
    rec = tmp_path / "gone.jsonl"
    models = {"m": {"provider": "scripted", "responses": ["first", {"text": "late", "delayMs": 3000}]}}
    argv = [sys.executable, "-m", "operate_sidecar.server", "--record", str(rec)]
    with SidecarClient(argv=argv, stderr=subprocess.DEVNULL) as c:
        c.request("initialize", {"settings": {"models": models}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        assert c.request("operate", {"branchId": bid, "instruction": "1", "skipValidation": True})["result"] == "first"
        c.request_async("operate", {"branchId": bid, "instruction": "2", "skipValidation": True, "workDoneToken": "w"})
        assert c.wait_for(lambda notes: any(p["value"].get("phase") == "request" for m, p in notes
                                            if m == "$/progress"), timeout=30)
        c.proc.stdin.close()
        assert c.proc.wait(30) == 1
    steps = lines(rec)
    last = [s for s in steps if "request" in s][-1]
    assert last["request"] == "operate" and last["wait"] is False and last["answered"] is False
    assert "expect" not in last
    assert not any(s.get("match", {}).get("value", {}).get("message") == "cancelled" for s in steps)
    for args in (("--scripted", rec), (rec,)):
        started = time.monotonic()
        out = replay("--timeout", "20", *args)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "not judged (its client left before the answer)" in out.stdout
        assert time.monotonic() - started < 15   # it ends as the client did: no waiting for the answer


def test_a_cancel_for_a_request_already_answered_does_not_cancel_it_when_replayed(tmp_path):
    rec = tmp_path / "late-cancel.jsonl"
    models = {"m": {"provider": "scripted", "responses": [{"text": "one", "delayMs": 500}, "two"]}}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": models}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        first = c.request_async("operate", {"branchId": bid, "instruction": "1", "skipValidation": True})
        assert first.result(30)["result"] == "one"
        c.cancel(first.id)  # too late: a client racing its own answer
        assert c.request("operate", {"branchId": bid, "instruction": "2", "skipValidation": True})["result"] == "two"

    record(rec, session)
    op = next(s for s in lines(rec) if s.get("request") == "operate")
    assert "wait" not in op and op["expect"]["result"]["result"] == "one"
    out = replay(rec)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_session_recorded_in_one_checkout_replays_in_another(tmp_path):
    """Paths under the server's working directory (a relative workspace folder made absolute, the
    path of an fs/readTextFile request, the workspace root in tool descriptions) are written as
    ${cwd}, which the replay defines as its own server's working directory."""
    rec = tmp_path / "moved.jsonl"
    read = {"json": {"action_requests": [{"function": "read_file", "arguments": {"path": "a.txt"}}]}}
    here, there = tmp_path / "checkout-a", tmp_path / "checkout-b"
    for root in (here, there):
        (root / "ws").mkdir(parents=True)
        (root / "ws" / "a.txt").write_text("on disk\n")
    argv = [sys.executable, "-m", "operate_sidecar.server", "--record", str(rec)]
    with SidecarClient(argv=argv, stderr=subprocess.DEVNULL, cwd=str(here)) as c:
        c.request("initialize", {"capabilities": {"fs": True}, "workspaceFolders": ["ws"],
                                 "settings": {"models": {"m": {"provider": "scripted", "responses": [read]}}}},
                  timeout=60)
        c.on_request("fs/readTextFile", lambda p: {"text": "in the editor\n"})
        bid = c.request("createBranch", {})["branchId"]
        out = c.request("operate", {"branchId": bid, "instruction": "read", "actions": True}, timeout=60)
        assert out["result"]["action_responses"][0]["output"]["content"] == "in the editor\n"
        c.request("branchMessages", {"branchId": bid})
        assert c.close() == 0
    text = rec.read_text()
    assert str(here) not in text and "${cwd}/ws/a.txt" in text and "workspace root ${cwd}/ws." in text
    for args in ((rec,), ("--scripted", rec)):
        out = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "replay", *map(str, args)],
                             capture_output=True, text=True, timeout=TIMEOUT, cwd=there)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("cwd, text, written", [
    ("/home/me/proj", "/home/me/proj", "${cwd}"),
    ("/home/me/proj", "see /home/me/proj/src/a.py.", "see ${cwd}/src/a.py."),
    ("/home/me/proj", "root /home/me/proj.", "root ${cwd}."),
    ("/home/me/proj", "/home/me/project/x /home/me/proj.bak /x/home/me/proj", "/home/me/project/x /home/me/proj.bak "
                                                                                "/x/home/me/proj"),
    ("/", "/etc/passwd", "/etc/passwd"),
])
def test_the_working_directory_is_written_only_where_it_is_a_whole_path(tmp_path, monkeypatch, cwd, text, written):
    from operate_sidecar.server.script.recorder import Recorder

    monkeypatch.setattr(os, "getcwd", lambda: cwd)
    assert Recorder(str(tmp_path / "r.jsonl"))._text(text) == written


def test_a_recording_replays_against_a_later_release_that_offers_more_methods(tmp_path):
    """What a release offers (its version, the methods and notifications ``initialize`` lists)
    is not part of the recorded session: a server that offers one method more replays it."""
    rec = tmp_path / "release.jsonl"
    models = {"m": {"provider": "scripted", "responses": [{"text": "hi"}]}}
    record(rec, lambda c: (c.request("initialize", {"settings": {"models": models}}, timeout=60),
                           c.request("operate", {"branchId": c.request("createBranch", {})["branchId"],
                                                 "instruction": "hi"}, timeout=60)))
    caps = lines(rec)[0]["expect"]["result"]["capabilities"]
    assert caps["methods"] == "*" and caps["notifications"] == "*" and caps["models"] == ["m"], caps
    later = ("import sys; import operate_sidecar.server.rpc.transport as t; "
             "t.REQUEST_METHODS = (*t.REQUEST_METHODS, 'someLaterMethod'); "
             "t.SERVER_NOTIFICATIONS = (*t.SERVER_NOTIFICATIONS, 'someLaterNotification'); "
             "from operate_sidecar.server.__main__ import main; sys.exit(main())")
    out = replay("--scripted", rec, "--", sys.executable, "-c", later)
    assert out.returncode == 0, out.stdout + out.stderr


def _serve_recording(target: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "operate_sidecar.server", "--record", target], cwd=cwd,
                          input="", capture_output=True, text=True, timeout=60)


def test_a_record_file_that_cannot_be_written_is_one_line_and_exit_2_at_start(tmp_path):
    """A missing folder said "[Errno 2] No such file or directory: '<the file>'", as if the file
    had to exist; a file the recorder could open but not write beside (it writes a file next to
    it, then renames it) was served and recorded nothing, with a warning per request; ``--record
    ""`` recorded nothing and said nothing."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "dir").mkdir()
    long_name = "r" * 245 + ".jsonl"  # the name fits; the name of the file written beside it does not
    for target, problem in [
            (str(tmp_path / "no" / "r.jsonl"), f"its folder {tmp_path}/no does not exist (create it first)"),
            (str(tmp_path / "a-file" / "r.jsonl"), f"{tmp_path}/a-file is not a folder"),
            ("dir", "it is a folder; give the name of a file"),
            ("", "no file name given"),
            (long_name, f"cannot write {long_name}.tmp"),
    ]:
        out = _serve_recording(target, tmp_path)
        assert out.returncode == 2 and not out.stdout, (target, out.stdout + out.stderr)
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, (target, out.stderr)
        assert out.stderr.startswith(f"operate-sidecar: cannot record to {target}: {problem}"), (target, out.stderr)
    assert not (tmp_path / long_name).exists()


def test_the_record_file_is_overwritten_as_the_help_and_the_readme_say(tmp_path):
    """An editor relaunches the server with the same argv: the last session is the one kept."""
    rec = tmp_path / "r.jsonl"
    rec.write_text('{"request": "earlier session"}\n')
    out = _serve_recording(str(rec), tmp_path)
    assert out.returncode in (0, 1) and rec.read_text() == "", out.stderr
    help_text = subprocess.run([sys.executable, "-m", "operate_sidecar.server", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    record_help = help_text.split("\n  --record FILE", 1)[1].split("Session scripts:", 1)[0]
    assert "an existing FILE is overwritten" in " ".join(record_help.split()), help_text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert "an existing FILE is overwritten" in " ".join(readme.split()), "README"


_PIECES = ["${", "$${", "$", "{", "}", "cwd}", "${cwd}", "x", "/", ".", "-", " ", "a.py", "\\"]


@pytest.mark.parametrize("cwd", ["/home/me/proj", "/tmp/a$b", "/tmp/a$", "/tmp/x.y", "/tmp/{d}", "/w/$$"])
def test_any_text_recorded_replays_as_it_was_whatever_the_working_directory(tmp_path, monkeypatch, cwd):
    """What ``--record`` writes for a string (``$${`` for a literal ``${``, ``${cwd}`` for the
    working directory) substitutes back to that string in the replay, which defines ``cwd``
    as its own server's working directory: texts made of the working directory and the
    pieces the two rules work on, in any order."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from operate_sidecar.server.script.matcher import substitute
    from operate_sidecar.server.script.recorder import Recorder

    monkeypatch.setattr(os, "getcwd", lambda: cwd)
    rec = Recorder(str(tmp_path / "r.jsonl"))

    @settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from([cwd, cwd + "/", *_PIECES]) | st.text(max_size=3), max_size=8).map("".join))
    def round_trip(text):
        written = rec._text(text)
        assert substitute(written, {"cwd": cwd}) == text, (text, written)

    round_trip()


def test_a_record_file_that_is_a_symlink_is_followed_and_a_special_file_refused(tmp_path):
    """The recording was written beside FILE and renamed onto it: a symlink was replaced by a
    regular file (its target never got the recording), and so was a named pipe (and, as root, a
    device). Now a symlink is followed, the file it points to rewritten; a FILE that exists and is
    no regular file is refused at start, one line and exit 2, and left as it was."""
    import stat

    target = tmp_path / "recordings" / "real.jsonl"
    target.parent.mkdir()
    target.write_text('{"request": "earlier session"}\n')
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "recordings" / "new.jsonl")
    for path, points_to in ((link, target), (dangling, tmp_path / "recordings" / "new.jsonl")):
        record(path, lambda c: c.request("initialize", {"settings": {
            "models": {"m": {"provider": "scripted", "responses": ["a"]}}, "defaultModel": "m"}}, timeout=60))
        assert path.is_symlink() and os.readlink(path) == str(points_to)
        assert lines(points_to)[0]["request"] == "initialize", points_to.read_text()
    assert sorted(p.name for p in target.parent.iterdir()) == ["new.jsonl", "real.jsonl"]  # nothing left beside
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path / "to-pipe.jsonl"):
        if path != fifo:
            path.symlink_to(fifo)
        out = _serve_recording(str(path), tmp_path)
        assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"operate-sidecar: cannot record to {path}: it is a named pipe, "
                                     "not a regular file"), out.stderr
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name) == []


#: a ``claude -p --output-format stream-json --verbose`` stand-in whose run makes its own tool
#: calls (one with an input that is no object), then answers; or, with "fail", stops after a tool
#: call and some text with exit status 3
TOOL_CLAUDE = """
import json, sys
def emit(e):
    print(json.dumps(e), flush=True)
emit({"type": "system", "subtype": "init", "session_id": "s-1", "model": "claude-fake"})
emit({"type": "assistant", "message": {"content": [{"type": "text", "text": "Looking."},
      {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls ${HOME}"}}]}})
emit({"type": "user", "message": {"content": [{"type": "tool_result", "tool_use_id": "toolu_1",
      "content": [{"type": "text", "text": "a\\nb"}]}]}})
if sys.argv[1] == "fail":
    emit({"type": "assistant", "message": {"content": [{"type": "text", "text": "half"}]}})
    sys.exit(3)
emit({"type": "assistant", "message": {"content": [{"type": "tool_use", "id": "toolu_2", "name": "Bash",
      "input": "not an object"}]}})
emit({"type": "user", "message": {"content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
      "content": "denied"}]}})
emit({"type": "assistant", "message": {"content": [{"type": "text", "text": "done"}]}})
emit({"type": "result", "subtype": "success", "is_error": False, "result": "done"})
"""


def test_a_cli_run_with_its_own_tool_calls_is_recorded_with_them_and_replays_green(tmp_path):
    """A claude-code run's tool_use and tool_result events are action_request and action_response
    messages of the branch: the recording kept only the run's text, and the scripted replay failed
    at branchMessages. Now the run is recorded as its ``events``, and ``replay --scripted`` replays
    them (a run that failed after some of them too)."""
    program = tmp_path / "claude.py"
    program.write_text(TOOL_CLAUDE)
    models = {"cc": {"provider": "cli", "profile": "claude-code", "command": [sys.executable, str(program), "ok"]},
              "bad": {"provider": "cli", "profile": "claude-code", "command": [sys.executable, str(program), "fail"]}}
    rec = tmp_path / "tools.jsonl"

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": models, "defaultModel": "cc"}}, timeout=60)
        bid = c.request("createBranch", {})["branchId"]
        assert c.request("operate", {"branchId": bid, "instruction": "go", "skipValidation": True},
                         timeout=60)["result"] == "Looking.\n\ndone"
        kinds = [m["kind"] for m in c.request("branchMessages", {"branchId": bid})["messages"]]
        assert kinds.count("action_request") == 2 and kinds.count("action_response") == 2, kinds
        bad = c.request("createBranch", {"chatModel": "bad"})["branchId"]
        with pytest.raises(RpcError) as e:
            c.request("operate", {"branchId": bad, "instruction": "go"}, timeout=60)
        assert e.value.code == -32011
        c.request("branchMessages", {"branchId": bad})

    record(rec, session)
    (recorded,) = [s["recordedModels"] for s in lines(rec) if "recordedModels" in s]
    (run,) = recorded["cc"]["responses"]
    assert run == {"events": [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls $${HOME}"}},
        {"type": "tool_result", "id": "toolu_1", "output": "a\nb"},
        {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"value": "not an object"}},
        {"type": "tool_result", "id": "toolu_2", "output": "denied", "is_error": True},
        {"type": "text", "text": "done"}]}, run
    (failed,) = recorded["bad"]["responses"]
    assert [e["type"] for e in failed["events"]] == ["text", "tool_use", "tool_result", "text"]
    assert "exited with status 3" in failed["error"]
    out = replay("--scripted", rec)
    assert out.returncode == 0, out.stdout + out.stderr


def test_scripted_events_are_checked_and_belong_to_a_cli_model():
    from operate_sidecar.server.models import ModelConfigError, make_model

    ok = {"events": [{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "ls", "input": {}},
                     {"type": "tool_result", "id": "t", "output": [1], "is_error": False}]}
    make_model({"provider": "scripted", "cli": True, "responses": [ok]}, name="s")
    for config, why in [
            ({"cli": False, "responses": [ok]}, 'responses[0].events is a CLI run\'s: the model needs "cli": true'),
            ({"cli": True, "responses": [{"events": {}}]}, "responses[0].events must be a list, not an object"),
            ({"cli": True, "responses": [{"events": [{"type": "tool"}]}]},
             "responses[0].events[0].type must be one of 'text', 'tool_use', 'tool_result', not 'tool'"),
            ({"cli": True, "responses": [{"events": [{"type": "text", "txt": "a"}]}]},
             "responses[0].events[0]: unknown field 'txt' (a text event accepts: text)"),
            ({"cli": True, "responses": [{"events": [{"type": "tool_use", "input": []}]}]},
             "responses[0].events[0].input must be an object, not a list"),
    ]:
        with pytest.raises(ModelConfigError) as e:
            make_model({"provider": "scripted", **config}, name="s")
        assert why in str(e.value), str(e.value)
