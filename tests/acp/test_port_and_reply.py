"""The front-end seam and the streamed reply text, in-process (real objects, no mocks)."""

from __future__ import annotations

import json
import os

import pytest

from operate_sidecar.server.acp.port import AcpPort, tool_kind
from operate_sidecar.server.acp.reply import ReplyText, message_of
from operate_sidecar.server.rpc import settings as S
from operate_sidecar.server.service.port import ClientInfo, ClientPort


def test_both_front_ends_implement_the_client_port():
    port = AcpPort(S.finalize(S.merge(S.DEFAULTS, {})))
    assert isinstance(port, ClientPort) and isinstance(port.conn, ClientInfo)
    from operate_sidecar.server.rpc.server import SidecarServer
    from operate_sidecar.server.rpc.stdio import Wire
    from operate_sidecar.server.rpc.transport import Connection

    conn = Connection(Wire(os.open(os.devnull, os.O_WRONLY)), base_settings={}, version="0")
    server = SidecarServer(conn)
    assert isinstance(server, ClientPort) and isinstance(server.conn, ClientInfo)
    assert server.service.rpc is server  # the service holds its port, nothing else of the front end


@pytest.mark.parametrize("message", ["plain", 'quote " and \\ backslash', "line\nbreak\ttab", "é ü 😀 end", ""])
def test_reply_text_streams_the_message_field_decoded(message):
    raw = json.dumps({"action_required": False, "message": message, "action_requests": []})
    r = ReplyText()
    shown = "".join(r.feed(ch) for ch in raw)  # one character per delta: escapes split anywhere
    assert shown == message and r.rest(json.loads(raw)) == ""


@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
def test_reply_text_streams_the_replys_own_message_not_a_message_key_nested_before_it(step):
    """A reply whose tool calls come before its ``message`` and carry a ``message`` argument
    (a commit, a chat tool): the user was shown that argument as the reply, and the reply's
    own text never (the stream had shown something, so the result's text was not sent)."""
    reply = {"action_required": True, "plan": [{"content": "commit", "message": "not this"}],
             "action_requests": [{"function": "git_commit", "arguments": {"message": "fix: typo", "n": [1, {}]}}],
             "reason": "the \"message\": \"trap\" in a string", "message": 'Committed it: "fix".'}
    for raw in (json.dumps(reply), "```json\n" + json.dumps(reply, indent=2) + "\n```"):
        r = ReplyText()
        shown = "".join(r.feed(raw[i:i + step]) for i in range(0, len(raw), step))
        assert shown == 'Committed it: "fix".' and message_of(raw) == shown


def test_reply_text_shows_a_reply_that_is_not_json_as_it_streams():
    r = ReplyText()
    assert [r.feed(d) for d in ("  Hel", "lo", "!")] == ["  Hel", "lo", "!"]


def test_reply_text_falls_back_to_the_result_when_nothing_streamed():
    assert ReplyText().rest({"kind": "model", "result": {"message": "whole"}, "model": "Reply"}) == "whole"
    assert message_of('{"message": "from a recorded reply"}') == "from a recorded reply"
    assert message_of("not json") == "not json"


def test_tool_kinds():
    assert [tool_kind(n) for n in ("read_file", "edit_file", "write_file", "search_text", "fetch_url", "echo")] == \
        ["read", "edit", "edit", "search", "fetch", "other"]
