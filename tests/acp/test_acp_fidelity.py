"""What the client is shown is what it was sent, live and on ``session/load``: numbers stay
numbers and answers keep their ids however the wire is masked, a reply's lone surrogate
escape is one U+FFFD, a diff is split at ``\\n`` only, a resource keeps its fields. The ACP
SDK's own client (and a plain JSON-lines one, to choose the request ids) over real pipes."""

from __future__ import annotations

import json
import sys

import acp
from acp.schema import McpServerStdio

from acp_support import MCP_SERVER, Raw, RecordingClient, agent_env, bounded, cfg, reply, req, run, spawn
from acp_support import sdk_prompt as prompt

PIN = "20240917"            # a number long enough to be a secret (an account number)
PIN_ENV = "FIDELITY_PIN"
KEY = "fidelityKeyA1b2C3d4E5f6G7h8"
KEY_ENV = "FIDELITY_KEY"


# ---------------------------------------------------------------- secrets and numbers
def test_a_count_in_an_mcp_servers_env_is_no_secret_and_every_number_on_the_wire_stays_a_number(tmp_path, ws):
    """An MCP server passed with ``MAX_TOKENS=4096`` (the name holds ``TOKEN``) and
    ``TOKEN_LIMIT=100000000`` (a count, however long), and ``secretEnv`` naming a variable of
    4096 (a number of fewer than 8 digits): none is a secret, so a read from line 4096 is shown
    with its line and offset as numbers (the schema's types), the reply says "line 4096", and
    nothing on the wire is masked; a real token in the same env still is."""
    (ws / "big.txt").write_text("".join(f"line {i}\n" for i in range(1, 5001)))
    token = "ghpTok9Z8y7X6w5V4u3T2s1R0q"
    config = cfg(tmp_path, reply("Reading from line 4096 of 5000, limit 100000000.",
                                 [("read_file", {"path": "big.txt", "offset": 4096})]),
                 reply(f"done: 4096 is a power of two; the token was {token}"), secretEnv=["FIDELITY_SHORT"])
    server = McpServerStdio(name="fx", command=sys.executable, args=[MCP_SERVER, "fx"],
                            env=[acp.schema.EnvVariable(name="MAX_TOKENS", value="4096"),
                                 acp.schema.EnvVariable(name="TOKEN_LIMIT", value="100000000"),
                                 acp.schema.EnvVariable(name="GITHUB_TOKEN", value=token)])

    async def main():
        c = RecordingClient()
        async with spawn(c, config, env={"FIDELITY_SHORT": "4096"}) as (conn, _):  # (schema-checked at the end)
            sid = (await bounded(conn.new_session(cwd=str(ws), mcp_servers=[server]))).session_id
            assert (await prompt(conn, sid, "read big.txt from line 4096")).stop_reason == "end_turn"
            call, = c.of("tool_call")
            assert call.raw_input == {"path": "big.txt", "offset": 4096}
            assert [loc.line for loc in call.locations] == [4096]
            assert c.text() == ("Reading from line 4096 of 5000, limit 100000000.\n\n"
                                "done: 4096 is a power of two; the token was [REDACTED]")
            wire = json.dumps(conn.tap.incoming)
            assert wire.count("[REDACTED]") == 1 and token not in wire

    run(main())


def test_an_answer_keeps_the_id_it_answers_whatever_the_wire_masks(tmp_path, ws):
    """Request ids that are, or hold, a known secret (a number of 8 digits, a key inside a
    string) and one that is a count from an MCP server's env (``MAX_TOKENS=4096``): each answer
    carries the id of its request, as it was sent, while the same values elsewhere in the
    answers are masked (the secrets) or kept (the count)."""
    config = cfg(tmp_path, reply("hi"), secretEnv=[PIN_ENV, KEY_ENV])
    a = Raw(config, agent_env(**{PIN_ENV: PIN, KEY_ENV: KEY}))
    try:
        a.send(req(1, "initialize", protocolVersion=1, clientCapabilities={}))
        a.answer(1)
        a.send(req(2, "session/new", cwd=str(ws), mcpServers=[{
            "name": "fx", "command": sys.executable, "args": [MCP_SERVER, "fx"],
            "env": [{"name": "MAX_TOKENS", "value": "4096"}]}]))
        a.answer(2)
        ids = [4095, 4096, int(PIN), f"ask-{KEY}", KEY]
        a.send(*(req(i, "session/list") for i in ids),
               req(f"bad-{KEY}", "session/set_mode", sessionId=f"no-{PIN}-{KEY}", modeId="x"))
        for i in ids:
            assert "result" in a.answer(i), i
        error = a.answer(f"bad-{KEY}")["error"]  # (the message names the session: masked there)
        assert error["code"] == -32602 and PIN not in json.dumps(error) and KEY not in json.dumps(error), error
        assert "[REDACTED]" in json.dumps(error)
        answered = [m["id"] for m in a.seen if "method" not in m]
        assert answered == [1, 2, *ids, f"bad-{KEY}"], answered
    finally:
        a.close()


# ---------------------------------------------------------------- a reply's surrogate escapes
def _shown(message: str) -> str:
    """``message`` as the client is shown it: each lone surrogate a U+FFFD."""
    return message.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def test_a_lone_surrogate_escape_in_a_reply_is_one_replacement_character_live_and_on_load(tmp_path, ws):
    """A reply's message with a lone high surrogate escape (``\\ud83d`` before text, before the
    string's end, before a pair), a lone low one and a pair: shown with one U+FFFD for each lone
    half and the text after it as it is, live (the reply in one delta, and one character a
    delta, so that a pair's halves arrive apart) and replayed by ``session/load``."""
    messages = ["emoji \ud83d lone", "a \ud83d", "x \udc00 y", "\ud83d\ude00 ok", "two \ud83d\ud83d\ude00 end"]
    replies = []
    for message in messages:
        text = json.dumps({"message": message, "action_required": False, "action_requests": []})
        assert "\\ud83d" in text or "\\udc00" in text
        replies += [{"text": text}, {"text": text, "chunks": len(text)}]  # (chunks: one character each)
    state = str(tmp_path / "state")
    config = cfg(tmp_path, *replies)

    async def main():
        c = RecordingClient()
        live = []
        async with spawn(c, config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            for _ in replies:
                c.updates.clear()
                assert (await prompt(conn, sid)).stop_reason == "end_turn"
                live.append(c.text())
        assert live == [_shown(m) for m in messages for _ in range(2)]
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
        replayed = [u.content.text for u in c2.of("agent_message_chunk")]
        assert replayed == live

    run(main())


def test_a_high_surrogate_escape_split_after_its_first_half_waits_for_the_second(tmp_path, ws):
    """A reply streamed in two deltas, the first ending right after ``\\ud83d`` (or after part
    of the ``\\ude00`` that follows): the pair is one character, not a U+FFFD and the rest."""
    def split_after(cut_at: str) -> dict:
        """A reply in two deltas (the scripted model's halves, the first one longer by one at
        most) whose first one ends with ``cut_at``."""
        for pad in range(400):
            text = json.dumps({"message": "p" * pad + " \ud83d\ude00 end", "action_required": False,
                               "action_requests": []})
            first = (len(text) + 1) // 2
            if text[:first].endswith(cut_at):
                return {"text": text, "chunks": 2}
        raise AssertionError(cut_at)

    cuts = ["\\ud83d", "\\ud83d\\", "\\ud83d\\u", "\\ud83d\\ude0"]
    config = cfg(tmp_path, *[split_after(cut) for cut in cuts])

    async def main():
        c = RecordingClient()
        async with spawn(c, config) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            for cut in cuts:
                c.updates.clear()
                assert (await prompt(conn, sid)).stop_reason == "end_turn"
                assert c.text().lstrip("p") == " \U0001F600 end", (cut, c.text())

    run(main())


# ---------------------------------------------------------------- replayed diffs
def test_a_replayed_diff_keeps_lines_holding_a_form_feed_a_lone_cr_or_a_line_separator(tmp_path, ws):
    """Edits to files whose lines hold a form feed, U+2028, a lone CR, ``\\x1e`` and U+0085
    (``str.splitlines`` breaks at each; a diff's lines end at ``\\n`` only): ``session/load``
    shows the same ``diff`` content as the live turn did, whole lines included."""
    # (the edited line in the middle: its hunk's context is the whole file, as the live diff is)
    old = "section\x0ctwo\nform\u2028feed\nlone\rcr\nline three\nrec\x1esep\nnext\x85line\nline four\n"
    (ws / "f.txt").write_bytes(old.encode())
    (ws / "g.txt").write_bytes(old.encode())
    config = cfg(tmp_path, reply("", [("write_file", {"path": "f.txt", "content": old.replace("four", "FOUR")}),
                                      ("edit_file", {"path": "g.txt",
                                                     "edits": [{"oldText": "line three", "newText": "LINE 3"}]})]),
                 reply("ok"), toolPolicy={"write_file": "allow", "edit_file": "allow"})
    state = str(tmp_path / "state")

    def diffs(client):  # the diff content of each call's last update (its final status)
        return [[c.model_dump(exclude_none=True) for c in u.content or [] if c.type == "diff"]
                for u in client.of("tool_call_update") if u.status in ("completed", "failed")]

    async def main():
        c = RecordingClient()
        async with spawn(c, config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            assert (await prompt(conn, sid)).stop_reason == "end_turn"
        assert (ws / "g.txt").read_bytes().decode() == old.replace("line three", "LINE 3")
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
        replayed = diffs(c2)
        assert replayed == diffs(c)
        assert sorted(replayed, key=lambda d: d[0]["path"]) == [
            [{"type": "diff", "path": str(ws / "f.txt"), "old_text": old, "new_text": old.replace("four", "FOUR")}],
            [{"type": "diff", "path": str(ws / "g.txt"), "old_text": old,
              "new_text": old.replace("line three", "LINE 3")}]]

    run(main())


def test_the_recorded_diff_of_lines_holding_line_breaks_other_than_newline_is_rebuilt_whole():
    """``recorded_diff`` on a ``write_file`` and an ``edit_file`` whose texts hold every
    character ``str.splitlines`` breaks at but ``\\n``: the old text and each hunk are whole."""
    from operate_sidecar.server.acp.port import recorded_diff
    from operate_sidecar.server.tools.edits import unified_diff

    odd = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\r"
    old = "".join(f"l{i}{c}x\n" for i, c in enumerate(odd)) + "end"
    new = old.replace("l4", "L4")
    diff = unified_diff(old, new, "f.txt")
    whole, = recorded_diff("/w/f.txt", {"content": new}, {"diff": diff})
    assert (whole.old_text, whole.new_text) == (old, new)
    hunk, = recorded_diff("/w/f.txt", {"edits": []}, {"diff": diff})
    assert hunk.old_text.replace("l4", "L4") == hunk.new_text and "l1\x0cx\n" in hunk.old_text


# ---------------------------------------------------------------- replayed resources
def test_a_replayed_resource_keeps_its_title_description_mime_type_and_size(tmp_path, ws):
    """``session/load`` shows a ``resource_link`` as it was sent (title, description, MIME type,
    size), an embedded text resource with its MIME type, an embedded blob as a link with its
    MIME type; a description longer than 1000 characters is kept cut, with "…"."""
    from operate_sidecar.server.acp.agent import RESOURCE_FIELD_LIMIT

    link = acp.resource_link_block("a.txt", f"file://{ws}/a.txt", mime_type="text/plain", size=9, title="A file",
                                   description="the a file")
    embedded = acp.resource_block(acp.embedded_text_resource(f"file://{ws}/z.py", "print(1)\n",
                                                             mime_type="text/x-python"))
    blob = acp.resource_block(acp.embedded_blob_resource(f"file://{ws}/p.png", "iVBORw0KGgo=", mime_type="image/png"))
    long = acp.resource_link_block("b.txt", "https://example.com/b.txt", description="d" * 5000)
    state = str(tmp_path / "state")
    config = cfg(tmp_path, reply("ok"))

    async def main():
        async with spawn(RecordingClient(), config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            blocks = [acp.text_block("see"), link, embedded, blob, long]
            assert (await bounded(conn.prompt(session_id=sid, prompt=blocks))).stop_reason == "end_turn"
        c2 = RecordingClient()
        async with spawn(c2, config, state_dir=state) as (conn, _):
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
        replayed = [u.content.model_dump(exclude_none=True) for u in c2.of("user_message_chunk")]
        assert replayed[:3] == [b.model_dump(exclude_none=True) for b in blocks[:3]]
        assert replayed[3] == acp.resource_link_block("p.png", f"file://{ws}/p.png",
                                                      mime_type="image/png").model_dump(exclude_none=True)
        assert replayed[4]["description"] == "d" * (RESOURCE_FIELD_LIMIT - 1) + "…"

    run(main())
