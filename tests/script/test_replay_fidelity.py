"""A recording replays as it was recorded (`--record`, then `replay` and `replay --scripted`):
an initialize without settings, a workDoneToken used again, a slow model the client did not
wait for, the same file read twice in one operate, an API model that failed after streaming;
and a script's saved values and notifications mean what they say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from operate_sidecar.clients.python.client import RpcError, SidecarClient

TIMEOUT = 180
ANSWER = {"title": "A", "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def record(path: Path, session, *server_args: str, cwd: Path | None = None) -> None:
    argv = [sys.executable, "-m", "operate_sidecar.server", "--record", str(path), *server_args]
    with SidecarClient(argv=argv, stderr=subprocess.DEVNULL, cwd=None if cwd is None else str(cwd)) as c:
        session(c)
        assert c.close() == 0


def replay(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "operate_sidecar.server", "replay", *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd)


def lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def write_script(path: Path, steps: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- replay --scripted and initialize
@pytest.mark.parametrize("params", [None, {}, {"processId": os.getpid()}, {"settings": None}],
                         ids=["no-params", "empty", "pid-only", "settings-null"])
def test_replay_scripted_puts_the_recorded_models_in_an_initialize_without_settings(tmp_path, params):
    """The models came from ``--config``; the client's initialize had no settings (no params, an
    LSP client's pid only, which the recording drops, ``"settings": null``). ``--scripted`` left
    the real model in place (no params), or crashed with a traceback (settings null)."""
    config = tmp_path / "settings.toml"
    config.write_text('defaultModel = "m"\n[models.m]\nprovider = "scripted"\nresponses = ["recorded answer"]\n')
    rec = tmp_path / "s.jsonl"

    def session(c: SidecarClient) -> None:
        c.request("initialize", params, timeout=60)
        b = c.request("createBranch")["branchId"]
        out = c.request("operate", {"branchId": b, "instruction": "x", "skipValidation": True}, timeout=60)
        assert out["result"] == "recorded answer"

    record(rec, session, "--config", str(config))
    config.write_text(config.read_text().replace("recorded answer", "CHANGED answer"))  # the real model now differs
    server = [sys.executable, "-m", "operate_sidecar.server", "--config", str(config)]
    out = replay("--scripted", "--quiet", rec, "--", *server)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert replay("--quiet", rec, "--", *server).returncode == 1   # the real model is asked without --scripted


def test_replay_scripted_takes_settings_that_are_null_or_no_object_and_refuses_a_reference_in_one_line(tmp_path):
    """``"settings": null`` crashed ``replay --scripted`` (and ``sidecar_script(..., scripted=True)``)
    with a traceback. Settings of another type are sent as written (the server refuses them, as
    when recorded); settings given by a ``${name}`` cannot take the models: one line, exit 2."""
    from operate_sidecar.testing import run_session_script

    models = {"recordedModels": {"m": {"responses": [{"text": "hi"}]}}}
    null = write_script(tmp_path / "null.jsonl", [
        {"request": "initialize", "params": {"settings": None}},
        {"request": "createBranch", "save": {"b": "branchId"}},
        {"request": "operate", "params": {"branchId": "${b}", "instruction": "x", "skipValidation": True},
         "expect": {"result": {"result": "hi"}}}, models])
    out = replay("--scripted", null)
    assert out.returncode == 0 and not out.stderr, out.stdout + out.stderr
    results = run_session_script(null, scripted=True)   # what the plugin's sidecar_script runs
    assert all(r.ok for r in results)
    wrong = write_script(tmp_path / "wrong.jsonl", [
        {"request": "initialize", "params": {"settings": "x"}, "expect": {"error": {"code": -32602}}}, models])
    out = replay("--scripted", wrong)
    assert out.returncode == 0 and not out.stderr, out.stdout + out.stderr
    ref = write_script(tmp_path / "ref.jsonl", [
        {"request": "ping", "save": {"s": "$"}},
        {"request": "initialize", "params": {"settings": "${s}"}}, models])
    out = replay("--scripted", ref)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        f"operate-sidecar replay: {ref}:2: replay --scripted puts the recorded models in initialize's "
        "params.settings.models, but params.settings is ${s}, known only once substituted; write it out as an "
        "object"], out.stderr


# --------------------------------------------------------------------------- cancelAfterModelCalls
def test_a_cancelled_operate_reusing_a_workdonetoken_is_cancelled_after_its_own_model_calls(tmp_path):
    """The replay counted every ``$/progress`` of the token, an earlier operate's too, so it
    cancelled the second operate before its repair turn started; the third operate then took
    the cancelled one's turn."""
    rec = tmp_path / "reuse.jsonl"
    responses = ["garbage", '{"answer": "1"}',                                   # op 1: a repair, 2 model calls
                 {"text": "garbage2", "delayMs": 1500}, {"text": '{"answer": "never"}', "delayMs": 30000},
                 '{"answer": "3"}']

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": {"m": {"provider": "scripted", "responses": responses}}}},
                  timeout=60)
        b = c.request("createBranch")["branchId"]
        op = {"branchId": b, "responseFormat": ANSWER, "workDoneToken": "tok"}
        assert c.request("operate", {**op, "instruction": "a"}, timeout=60)["result"] == {"answer": "1"}
        n = len(c.notifications)
        p = c.request_async("operate", {**op, "instruction": "b"})
        assert c.wait_for(lambda ns: any(m == "$/progress" and str(x["value"].get("message", "")).startswith("repair")
                                         for m, x in ns[n:]), 30)
        c.cancel(p.id)
        with pytest.raises(RpcError) as e:
            p.result(30)
        assert e.value.code == -32800
        assert c.request("operate", {**op, "instruction": "c"}, timeout=60)["result"] == {"answer": "3"}

    record(rec, session)
    cancelled = [s for s in lines(rec) if s.get("request") == "operate" and s.get("wait") is False]
    assert [s["cancelAfterModelCalls"] for s in cancelled] == [2]
    for args in ((rec,), ("--scripted", rec)):
        out = replay("--timeout", "20", *args)
        assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------- a slow model
def test_a_slow_operate_the_client_did_not_wait_for_replays_against_the_same_slow_model(tmp_path):
    """The client went on (listBranches) while an operate waited 11 s for its model: the
    operate's progress was written as expectNotification steps with no timeoutMs before its
    await, and the replay waits 10 s for one of those. Now they carry a timeoutMs that covers
    the wait recorded (twice it, and 5 s more); those of an operate the client waited for, or
    that came at once, carry none."""
    rec = tmp_path / "slow.jsonl"
    slow = {"provider": "scripted", "responses": [{"text": "late", "delayMs": 11000}, {"text": "waited", "delayMs": 4000}]}

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"settings": {"models": {"m": slow}}}, timeout=60)
        b = c.request("createBranch")["branchId"]
        p = c.request_async("operate", {"branchId": b, "instruction": "x", "skipValidation": True,
                                        "workDoneToken": "w"})
        c.request("listBranches")
        assert p.result(60)["result"] == "late"
        assert c.request("operate", {"branchId": b, "instruction": "y", "skipValidation": True, "workDoneToken": "v"},
                         timeout=60)["result"] == "waited"

    record(rec, session)
    out = replay("--quiet", rec)
    assert out.returncode == 0, out.stdout + out.stderr
    steps = lines(rec)
    text = next(s for s in steps if s.get("match", {}).get("value", {}).get("phase") == "stream")
    assert text["timeoutMs"] >= 27000, text   # the model's text came 11 s after listBranches was answered
    quick = next(s for s in steps if s.get("match", {}).get("value", {}).get("kind") == "begin")
    assert "timeoutMs" not in quick, quick   # what came at once keeps the replay's default
    waited = [s for s in steps if s.get("match", {}).get("token") == "v"]
    assert len(waited) == 4 and not any("timeoutMs" in s for s in waited), waited   # there before its answer


# --------------------------------------------------------------------------- saved values in patterns
@pytest.mark.parametrize("third, expect, passes", [
    ("something else", "${first}", False),
    ("*", "${first}", True),
    ("$*", "${dollar}${first}", True),   # a text made with saved values: "$*" would be a pattern's literal *
    ("*", "${dollar}${first}", False),
], ids=["whole-differs", "whole-same", "inside-same", "inside-differs"])
def test_a_saved_star_is_matched_as_the_text_it_is_not_as_a_wildcard(tmp_path, third, expect, passes):
    """A result saved as ``"*"`` and referred to in a later expect matched anything."""
    def operate(n: int) -> dict:
        return {"request": "operate", "params": {"branchId": "${b}", "instruction": str(n), "skipValidation": True}}

    script = write_script(tmp_path / "s.jsonl", [
        {"request": "initialize", "params": {"settings": {"models": {"m": {"provider": "scripted",
                                                                          "responses": ["$", "*", third]}}}}},
        {"request": "createBranch", "save": {"b": "branchId"}},
        {**operate(1), "save": {"dollar": "result"}},
        {**operate(2), "save": {"first": "result"}},
        {**operate(3), "expect": {"result": {"result": expect}}}])
    out = replay(script)
    assert out.returncode == (0 if passes else 1), out.stdout + out.stderr
    if not passes:
        want = json.dumps(expect.replace("${dollar}", "$").replace("${first}", "*"))
        assert f'FAIL line 5: request operate: at $.result.result: expected {want}, got "{third}"' in out.stdout


def test_substituted_values_are_literal_in_patterns_only():
    from operate_sidecar.server.script.matcher import first_mismatch, substitute

    saved = {"s": "*", "d": {"k": ["*", "$*", "a"]}, "n": 3}
    assert substitute("${s}", saved) == "*" and substitute("${d}", saved) == saved["d"]   # sent as they are
    assert substitute("${s}", saved, pattern=True) == "$*"
    assert substitute("${d}", saved, pattern=True) == {"k": ["$*", "$$*", "a"]}
    assert substitute("${n}", saved, pattern=True) == 3 and substitute("$*", saved, pattern=True) == "$*"
    assert first_mismatch(substitute({"a": "${d}"}, saved, pattern=True), {"a": saved["d"]}) is None
    assert first_mismatch(substitute({"a": "${d}"}, saved, pattern=True), {"a": {"k": ["x", "$*", "a"]}}) is not None


# --------------------------------------------------------------------------- server requests in recorded order
@pytest.mark.parametrize("read_before", [False, True], ids=["one-operate", "read-by-an-earlier-operate"])
def test_the_same_file_read_twice_in_one_operate_gets_each_recorded_text_in_turn(tmp_path, read_before):
    """An operate edits one file twice through the client's file system: the second read gets
    the first edit's text. Both answers were recorded with the same match, and the replay gave
    the later text to both reads, so the first edit failed. (``read_before``: an earlier
    operate read the file too, so the first answer of the second operate was the one standing.)"""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("alpha\nbeta\n")
    rec = tmp_path / "fs.jsonl"

    def edit(old: str, new: str) -> dict:
        return {"json": {"action_requests": [{"function": "edit_file", "arguments": {
            "path": "notes.txt", "edits": [{"oldText": old, "newText": new}]}}]}}

    buffers: dict[str, str] = {}

    read = {"json": {"action_requests": [{"function": "read_file", "arguments": {"path": "notes.txt"}}]}}
    first = [read, "read"] if read_before else []

    def session(c: SidecarClient) -> None:
        c.request("initialize", {"capabilities": {"fs": True}, "workspaceFolders": [str(ws)],
                                 "settings": {"models": {"m": {"provider": "scripted", "responses": [
                                     *first, edit("alpha", "ALPHA"), edit("beta", "BETA"), "done"]}},
                                     "toolPolicy": {"edit_file": "allow"}}}, timeout=60)
        c.on_request("fs/readTextFile", lambda p: {"text": buffers.get(p["path"], Path(p["path"]).read_text())})
        c.on_request("fs/writeTextFile", lambda p: buffers.__setitem__(p["path"], p["text"]) or {})
        b = c.request("createBranch")["branchId"]
        if read_before:
            c.request("operate", {"branchId": b, "instruction": "read", "actions": True, "maxRounds": 2}, timeout=60)
        out = c.request("operate", {"branchId": b, "instruction": "go", "actions": True, "maxRounds": 3}, timeout=60)
        assert out["rounds"] == 3

    record(rec, session, cwd=ws)
    assert list(buffers.values()) == ["ALPHA\nBETA\n"]
    reads = [s["result"]["text"] for s in lines(rec) if s.get("respond") == "fs/readTextFile"]
    assert reads[0] == "alpha\nbeta\n" and reads[-1] == "ALPHA\nbeta\n", reads
    out = replay("--quiet", rec, cwd=ws)
    assert out.returncode == 0, out.stdout + out.stderr


def test_respond_lines_in_a_row_for_the_same_call_answer_in_turn_and_a_later_one_replaces_them(tmp_path):
    """Three reads of one file: the first two respond lines (in a row) answer the first and
    second read, the second repeating for the third; a respond line after another step stands
    from there on, as documented."""
    ws = tmp_path / "ws"
    ws.mkdir()
    read = {"json": {"action_requests": [{"function": "read_file", "arguments": {"path": "a.txt"}}]}}
    match = {"path": "${cwd}/a.txt"}

    def outputs(n: int) -> dict:
        return {"result": {"result": {"action_responses": [{"output": {"content": t}} for t in n]}}}

    script = write_script(tmp_path / "s.jsonl", [
        {"request": "initialize", "params": {"capabilities": {"fs": True}, "workspaceFolders": ["${cwd}"],
                                             "settings": {"models": {"m": {"provider": "scripted",
                                                                           "responses": [read] * 4}}}}},
        {"request": "createBranch", "save": {"b": "branchId"}},
        {"respond": "fs/readTextFile", "match": match, "result": {"text": "one"}},
        {"respond": "fs/readTextFile", "match": {"path": "${cwd}/other.txt"}, "result": {"text": "other"}},
        {"respond": "fs/readTextFile", "match": match, "result": {"text": "two"}},
        *[{"request": "operate", "params": {"branchId": "${b}", "instruction": "read", "actions": True},
           "expect": outputs([text])} for text in ("one", "two", "two")],
        {"respond": "fs/readTextFile", "match": match, "result": {"text": "three"}},
        {"request": "operate", "params": {"branchId": "${b}", "instruction": "read", "actions": True},
         "expect": outputs(["three"])}])
    out = replay(script, cwd=ws)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("kind", ["progress", "toolEvent"])
def test_a_notification_its_answered_request_did_not_send_fails_without_waiting_out_its_time_out(tmp_path, kind):
    """Every ``$/progress`` of an operate precedes its answer (so do the tool events of an operate
    answered with a result): once it is answered, the step waited its full 10 s for what could
    no longer come."""
    ws = tmp_path / "ws"
    ws.mkdir()
    read = {"json": {"action_requests": [{"function": "read_file", "arguments": {"path": "missing.txt"}}]}}
    if kind == "progress":
        never = {"expectNotification": "$/progress", "match": {"token": "w", "value": {"kind": "report",
                                                                                      "message": "never said"}}}
        why = "the request whose workDoneToken it names (the operate on line 3) was answered without it"
    else:
        never = {"expectNotification": "toolEvent", "match": {"branchId": "${b}", "event": "never"}}
        why = "the operate on the branch it names (line 3) was answered without it"
    script = write_script(tmp_path / "s.jsonl", [
        {"request": "initialize", "params": {"workspaceFolders": ["${cwd}"], "settings": {"models": {"m": {
            "provider": "scripted", "responses": [read, "done"]}}}}},
        {"request": "createBranch", "save": {"b": "branchId"}},
        {"request": "operate", "id": 3, "wait": False, "params": {
            "branchId": "${b}", "instruction": "read", "actions": True, "maxRounds": 2, "workDoneToken": "w"}},
        never,
        {"await": 3}])
    out = replay(script, cwd=ws)
    assert out.returncode == 1, out.stdout + out.stderr
    (failed,) = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert failed.startswith(f"FAIL line 4: expectNotification {never['expectNotification']}: no "), failed
    assert "before its request was answered" in failed and failed.endswith(f"; it cannot come any more: {why}"), failed
    assert "PASS line 5: await 3" in out.stdout


# --------------------------------------------------------------------------- a model that failed mid-reply
def _failing_api():
    """A loopback stand-in of an OpenAI-compatible API whose reply, chosen by the path's first
    part, streams some text and then fails: the connection is cut, an ``event: error`` comes,
    the provider's content filter stops it."""
    from openai_stub import StubHandler, chunk, loopback

    def data(event: dict) -> bytes:
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    class Handler(StubHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.request_body()
            how = self.path.strip("/").split("/")[0]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            body = data(chunk({"role": "assistant", "content": ""}))
            body += b"".join(data(chunk({"content": w})) for w in ("this ", "stops ", "mid"))
            if how == "event":
                body += b"event: error\ndata: " + json.dumps({"error": {"message": "bad thing"}}).encode() + b"\n\n"
            elif how == "filter":
                body += data(chunk({}, finish="content_filter")) + b"data: [DONE]\n\n"
            self.wfile.write(body)   # "cut": no finish_reason, no [DONE], the connection closed

    return loopback(Handler)


def test_an_api_model_that_failed_after_streaming_text_is_recorded_with_that_text_and_replays(tmp_path):
    """The recording kept only the error of a model turn that had streamed text before it
    failed, so ``replay --scripted`` failed at its progress (the text's report never came); a
    refusal became a plain error (its ``data.refusal`` lost)."""
    rec = tmp_path / "midway.jsonl"
    with _failing_api() as url:
        root = url.rsplit("/", 1)[0]
        models = {how: {"provider": "openai", "model": "m", "baseUrl": f"{root}/{how}/v1", "maxRetries": 0}
                  for how in ("cut", "event", "filter")}

        def session(c: SidecarClient) -> None:
            c.request("initialize", {"settings": {"models": models}}, timeout=60)
            b = c.request("createBranch")["branchId"]
            for how in models:
                with pytest.raises(RpcError) as e:
                    c.request("operate", {"branchId": b, "instruction": "x", "chatModel": how, "workDoneToken": how},
                              timeout=60)
                assert e.value.code == -32011
                if how == "filter":
                    assert e.value.data == {"refusal": "stopped by the provider's content filter"}, e.value.data

        record(rec, session)
    steps = lines(rec)
    (recorded,) = [s["recordedModels"] for s in steps if "recordedModels" in s]
    for how in models:
        (entry,) = recorded[how]["responses"]
        assert entry["text"] == "this stops mid" and entry["error"], entry
    assert entry["error"] == "model 'filter' declined the request: stopped by the provider's content filter"
    assert entry["refusal"] == "stopped by the provider's content filter"
    assert all("refusal" not in recorded[how]["responses"][0] for how in ("cut", "event"))
    # the refusal's data is replayed too: asked of the operate on the filtered model
    op = [s for s in steps if s.get("request") == "operate"][-1]
    op["expect"]["error"]["data"] = {"refusal": "stopped by the provider's content filter"}
    write_script(rec, steps)
    out = replay("--scripted", rec)   # the stand-in is gone: only the recorded turns can answer
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_scripted_entry_with_text_and_an_error_streams_the_text_then_fails(tmp_path):
    """What ``--record`` writes for a model that failed mid-reply: the text is streamed first."""
    script = write_script(tmp_path / "s.jsonl", [
        {"request": "initialize", "params": {"settings": {"models": {"m": {"provider": "scripted", "responses": [
            {"text": "half a reply", "thinking": "hm", "error": "the stream was lost"},
            {"text": "some", "refusal": "not allowed"},
            {"error": "model 'x' declined the request: not allowed"}]}}}}},
        {"request": "createBranch", "save": {"b": "branchId"}},
        {"request": "operate", "params": {"branchId": "${b}", "instruction": "1", "workDoneToken": "w"},
         "expect": {"error": {"code": -32011, "message": "the stream was lost"}}},
        {"expectNotification": "$/progress", "match": {"token": "w", "value": {"message": "thinking"}}},
        {"expectNotification": "$/progress", "match": {"token": "w", "value": {"delta": "half a reply"}}},
        {"request": "operate", "params": {"branchId": "${b}", "instruction": "2"},
         "expect": {"error": {"code": -32011, "message": "model 'm' declined the request: not allowed",
                              "data": {"refusal": "not allowed"}}}},
        {"request": "operate", "params": {"branchId": "${b}", "instruction": "3"},
         "expect": {"error": {"code": -32011, "message": "model 'x' declined the request: not allowed"}}}])
    out = replay(script)
    assert out.returncode == 0, out.stdout + out.stderr
