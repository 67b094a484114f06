"""``operate-sidecar --acp`` from a plain newline-delimited JSON client that sends what the SDK
takes in ways a client can turn against the agent: ``_meta`` keys in a request's params, an
answer to one of the agent's requests whose ``error`` is not an object or whose ``id`` is not
an id, a request whose method or id is not JSON-RPC's, and an answer longer than
``maxMessageBytes`` whose ``id`` comes after its large member."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acp_support import Logged, open_session, reply, req, scripted, write_config
from acp_support import prompt as raw_prompt

from operate_sidecar.server.acp.run import tail_id


class Client(Logged):
    """``Logged`` with the session updates of one session, or of all, read out."""

    def tool_updates(self, sid: str) -> list[dict]:
        with self._cond:
            return [m["params"]["update"] for m in self.seen if m.get("method") == "session/update"
                    and m["params"]["sessionId"] == sid
                    and m["params"]["update"].get("sessionUpdate") == "tool_call_update"]

    def session_ids_updated(self, after: int = 0) -> set[str]:
        with self._cond:
            return {m["params"]["sessionId"] for m in self.seen[after:] if m.get("method") == "session/update"}


def start(tmp_path: Path, ws: Path, *responses, fs: bool = False, **settings) -> tuple[Client, str]:
    config = write_config(tmp_path / "settings.toml", {"models": {"s": scripted(*responses)},
                                                       "stateDir": str(tmp_path / "state"), **settings})
    a = Client(config, tmp_path)
    return a, open_session(a, ws, fs=fs)


def allow(asked: dict) -> dict:
    option = next(o["optionId"] for o in asked["params"]["options"] if o["kind"] == "allow_once")
    return {"jsonrpc": "2.0", "id": asked["id"], "result": {"outcome": {"outcome": "selected", "optionId": option}}}


def assert_clean(a: Logged) -> None:
    """No traceback on stderr, and no ERROR line (a failed tool call is a WARNING line)."""
    err = a.stderr()
    assert "Traceback" not in err, err
    assert not [line for line in err.splitlines() if "ERROR" in line], err


# ---------------------------------------------------------------- _meta
def test_meta_keys_never_replace_a_request_s_own_params(tmp_path, ws):
    """The SDK passes the keys of a request's ``params._meta`` to its handler as keyword
    arguments, over the validated params: ``session/new`` made its session in the ``_meta``'s
    ``cwd``, a prompt ran on the session its ``_meta`` named, ``set_config_option`` took its
    ``_meta``'s value, and ``_meta: {"self": 1}`` was -32603 with a traceback. The SDK's models
    also take ``_meta`` under its Python name, ``field_meta``, and a JSON key spelt with escapes
    is the same key: none of them changes what a request does."""
    other = tmp_path / "other"
    other.mkdir()
    a, sid = start(tmp_path, ws, reply("one"), reply("two"))
    try:
        made = []
        for i, meta_key, meta in ((10, "_meta", {"cwd": str(other)}), (11, "field_meta", {"cwd": str(other)}),
                                  (12, "_meta", {"self": 1})):
            a.send(req(i, "session/new", cwd=str(ws), mcpServers=[], **{meta_key: meta}))
            answer = a.answer(i)
            assert "result" in answer, answer
            made.append(answer["result"]["sessionId"])
        escaped = json.dumps(req(13, "session/new", cwd=str(ws), mcpServers=[], _meta={"cwd": str(other)}))
        a.send_line(escaped.replace('"_meta"', '"\\u005fmeta"').encode())
        made.append(a.answer(13)["result"]["sessionId"])
        a.send(req(14, "session/list"))
        cwd = {s["sessionId"]: s["cwd"] for s in a.answer(14)["result"]["sessions"]}
        assert [cwd[s] for s in made] == [str(ws)] * 4, cwd

        b = made[0]
        mark = len(a.seen)
        a.send(req(15, "session/prompt", sessionId=sid, prompt=[{"type": "text", "text": "hi"}],
                   _meta={"session_id": b}))
        assert a.answer(15)["result"]["stopReason"] == "end_turn"
        assert a.session_ids_updated(mark) == {sid}

        a.send(req(16, "session/set_config_option", sessionId=sid, configId="mode", value="read-only",
                   _meta={"value": "bogus", "config_id": "model"}))
        mode = next(o for o in a.answer(16)["result"]["configOptions"] if o["id"] == "mode")
        assert mode["currentValue"] == "read-only"
    finally:
        a.close()
    assert_clean(a)


def test_a_cancel_whose_meta_names_another_session_cancels_only_its_own(tmp_path, ws):
    """``session/cancel`` to session B whose ``_meta`` says ``session_id: A`` cancelled A's turn
    (and ``_meta: {"self": 1}`` logged a traceback): A's turn, waiting on its permission request
    meanwhile, goes on and ends ``end_turn`` with the file written."""
    a, sid = start(tmp_path, ws, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("done"))
    try:
        a.send(req(3, "session/new", cwd=str(ws), mcpServers=[]))
        other = a.answer(3)["result"]["sessionId"]
        a.send(raw_prompt(4, sid, "write"))
        asked = a.request_seen("session/request_permission")
        a.send({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": other, "_meta": {"session_id": sid}}},
               {"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": other, "_meta": {"self": 1}}},
               req(5, "session/list"))
        a.answer(5)  # (the cancels before it are dispatched)
        a.send(allow(asked))
        assert a.answer(4)["result"]["stopReason"] == "end_turn"
        assert (ws / "a.txt").read_text() == "new\n"
    finally:
        a.close()
    assert_clean(a)


# ---------------------------------------------------------------- answers the SDK cannot take
@pytest.mark.parametrize("error", ["user said no", 5, [1, 2], None])
def test_a_permission_answer_whose_error_is_not_an_object_denies_and_the_connection_goes_on(tmp_path, ws, error):
    """The SDK reads an error answer's ``error`` as an object: a string, a number or an array
    there stopped its receive loop (a traceback; the prompt never answered, the agent exiting 0
    with its input still open). It is taken as an error answer: the permission is denied, with
    one warning line showing what came, and the agent goes on serving."""
    a, sid = start(tmp_path, ws, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("after"))
    try:
        a.send(raw_prompt(3, sid, "write"))
        asked = a.request_seen("session/request_permission")
        a.send({"jsonrpc": "2.0", "id": asked["id"], "error": error})
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        done = a.tool_updates(sid)[-1]
        assert done["status"] == "failed" and "denied" in done["rawOutput"]["error"], done
        assert "invalid error answer from the client" in done["rawOutput"]["reason"], done
        assert (ws / "a.txt").read_text() == "old text\n"
        a.send(req(4, "session/list"))
        assert "result" in a.answer(4)
        warnings = a.warnings()
        assert len(warnings) == 1 and "error that is not an object" in warnings[0], warnings
        assert repr(error) in warnings[0], warnings
    finally:
        a.close()
    assert_clean(a)


def test_a_read_answered_with_an_error_that_is_a_string_fails_that_read(tmp_path, ws):
    a, sid = start(tmp_path, ws, reply("", [("read_file", {"path": "a.txt"})]), reply("after"), fs=True)
    try:
        a.send(raw_prompt(3, sid, "read"))
        asked = a.request_seen("fs/read_text_file")
        a.send_line(b'{"jsonrpc": "2.0", "id": %d, "error": "E484: Can\'t open file"}' % asked["id"])
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        done = a.tool_updates(sid)[-1]
        assert done["status"] == "failed" and "E484" in json.dumps(done["rawOutput"]), done
        assert a.text() == "after"
    finally:
        a.close()
    assert_clean(a)


def test_an_answer_whose_id_is_not_an_id_is_dropped_and_the_real_answer_still_counts(tmp_path, ws):
    """An answer with an id the SDK cannot look up (an array, an object) stopped its receive
    loop; ``true``, which Python hashes as 1, would answer request 1. Each is dropped with one
    warning line (it answers nothing the agent sent), and the right answer after them is taken."""
    a, sid = start(tmp_path, ws, reply("", [("write_file", {"path": "a.txt", "content": "new\n"})]), reply("after"))
    try:
        a.send(raw_prompt(3, sid, "write"))
        asked = a.request_seen("session/request_permission")
        bad = [{"jsonrpc": "2.0", "id": [asked["id"]], "result": {}},
               {"jsonrpc": "2.0", "id": {"id": asked["id"]}, "error": {"code": 1, "message": "x"}},
               {"jsonrpc": "2.0", "id": True, "result": {"outcome": {"outcome": "cancelled"}}}]
        a.send(*bad)
        a.send(allow(asked))
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        assert (ws / "a.txt").read_text() == "new\n" and a.text() == "after"
        warnings = a.warnings()
        assert len(warnings) == 3 and all("whose id is not a string, a number or null" in w for w in warnings), \
            warnings
    finally:
        a.close()
    assert_clean(a)


def test_a_request_whose_method_or_id_is_not_json_rpc_s_is_an_invalid_request(tmp_path, ws):
    """A request whose id is an array, an object or a boolean was served and answered with that
    id (not an id a client can match); one whose method is not a string was -32603 with a
    traceback. Both are -32600 (id null when the id is the bad part), with one warning line."""
    a, sid = start(tmp_path, ws, reply("x"))
    try:
        a.send({"jsonrpc": "2.0", "id": [5], "method": "session/list", "params": {}},
               {"jsonrpc": "2.0", "id": {"a": 1}, "method": "session/list", "params": {}},
               {"jsonrpc": "2.0", "id": False, "method": "session/list", "params": {}},
               {"jsonrpc": "2.0", "id": 7, "method": ["session/list"], "params": {}},
               req(8, "session/list"))
        assert "result" in a.answer(8)
        with a._cond:
            errors = [(m["id"], m["error"]["code"]) for m in a.seen if "error" in m]
            assert not [m for m in a.seen if "result" in m and m["id"] not in (1, 2, 8)], a.seen
        assert errors == [(None, -32600)] * 3 + [(7, -32600)], errors
        assert len(a.warnings()) == 4, a.warnings()
    finally:
        a.close()
    assert_clean(a)


# ---------------------------------------------------------------- maxMessageBytes: the id at the end
def test_tail_id_finds_only_a_top_level_id():
    assert tail_id(b'www"},"id":7}\n') == 7
    assert tail_id(b'ww"},"id":"r-1", "jsonrpc": "2.0"}') == "r-1"
    assert tail_id(b'ww","id":7}}') is None            # a nested object's
    assert tail_id(b'ww","id":7}],"x":1}') is None     # in an array
    assert tail_id(b'ww\\"id\\":7"}') is None          # in a string
    assert tail_id(b'ww","id":7},"id":8}') == 8
    assert tail_id(b'wwww"}}') is None


@pytest.mark.parametrize("kind", ["read", "permission"])
def test_an_answer_over_max_message_bytes_with_its_id_last_fails_its_request_at_once(tmp_path, ws, kind):
    """An answer longer than ``maxMessageBytes`` fails the request it answers at once, also
    when its ``id`` comes after its large member (``{"result": {…}, "id": 0}``, as a client
    that writes members in any order may send): its id was read from the line's first bytes
    only, so the answer was dropped unmatched and the request waited out its time-out."""
    call = ("read_file", {"path": "a.txt"}) if kind == "read" else ("write_file", {"path": "a.txt", "content": "x\n"})
    a, sid = start(tmp_path, ws, reply("", [call]), reply("after"), fs=kind == "read", maxMessageBytes=65536,
                   toolTimeoutMs=20_000, permissionTimeoutMs=20_000)  # (a wait out: "timed out", not -32600)
    try:
        a.send(raw_prompt(3, sid, "go"))
        method = "fs/read_text_file" if kind == "read" else "session/request_permission"
        asked = a.request_seen(method)
        big = {"content": "w" * 100_000} if kind == "read" else \
            {"outcome": {"outcome": "selected", "optionId": "allow_once"}, "pad": "p" * 100_000}
        a.send_line(b'{"jsonrpc": "2.0", "result": %s, "id": %d}' % (json.dumps(big).encode(), asked["id"]))
        assert a.answer(3)["result"]["stopReason"] == "end_turn"
        done = a.tool_updates(sid)[-1]
        assert done["status"] == "failed" and "larger than maxMessageBytes (65536)" in json.dumps(done["rawOutput"])
        assert (ws / "a.txt").read_text() == "old text\n"
        # (the failed call's own line aside: "Error invoking action")
        warnings = [w for w in a.warnings() if "Error invoking action" not in w]
        assert len(warnings) == 1 and f"(id {asked['id']})" in warnings[0], warnings
    finally:
        a.close()
    assert_clean(a)


def test_a_request_over_max_message_bytes_with_its_id_last_is_answered_with_its_id(tmp_path, ws):
    """A request longer than ``maxMessageBytes`` is answered -32600 with its id, also when the
    id is its last member (it was answered with id null, which the client cannot match)."""
    a, sid = start(tmp_path, ws, reply("x"), maxMessageBytes=65536)
    try:
        a.send_line(b'{"jsonrpc": "2.0", "method": "session/list", "params": {"cwd": "%s"}, "id": 77}' % (b"d" * 70_000))
        a.until(lambda: [m for m in a.seen if "error" in m], "an error answer")
        answer = next(m for m in a.seen if "error" in m)
        assert answer["id"] == 77 and answer["error"]["code"] == -32600, answer
        assert "maxMessageBytes" in answer["error"]["message"], answer
        a.send(req(78, "session/list"))
        assert "result" in a.answer(78)
    finally:
        a.close()
    assert_clean(a)
