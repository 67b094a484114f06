"""The front-end seam and the streamed reply text, in-process (real objects, no mocks)."""

from __future__ import annotations

import asyncio
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


class _Sink(asyncio.Transport):
    """A write transport that keeps what it is given, one entry per write."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[bytes] = []
        self.closed = False

    def write(self, data) -> None:
        self.chunks.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return default


def _redacting_writer():
    from operate_sidecar.server.acp.run import RedactingWriter

    loop = asyncio.get_running_loop()
    sink = _Sink()
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    return RedactingWriter(sink, protocol, None, loop), sink


def test_the_acp_wire_masks_a_secret_split_across_writes_and_sends_each_line_whole(monkeypatch):
    from operate_sidecar.server import redaction

    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_ORDERED", ())
    secret = "hunter2-secret-value"

    async def main():
        writer, sink = _redacting_writer()
        writer.write(b'{"a":"no secret yet"}\n')
        assert sink.chunks == [b'{"a":"no secret yet"}\n']  # none registered: passes as it is
        redaction.remember_secret(secret)
        writer.write(b'{"x":"hunter2-se')
        writer.write(b'cret-value"}\n{"y":"hunt')
        writer.write(b'er2-secret-value"}\n')
        writer.write(b'{"z":"hunter2-')
        await writer.drain()  # a message written without its newline goes out at drain
        writer.write(b'tail')
        writer.close()
        out = b"".join(sink.chunks)
        assert secret.encode() not in out
        assert out.count(b"[REDACTED]") == 2
        assert out.startswith(b'{"a":"no secret yet"}\n{"x":"[REDACTED]"}\n{"y":"[REDACTED]"}\n')
        assert out.endswith(b'{"z":"hunter2-tail')
        assert all(c.endswith(b"\n") for c in sink.chunks[:3])

    asyncio.run(main())


def _line_bound(limit: int):
    from operate_sidecar.server.acp.run import LineBound

    fed: list[bytes] = []
    written: list[bytes] = []

    class Reader:
        def feed_data(self, data):
            fed.append(bytes(data))

        def feed_eof(self):
            pass

    class Writer:
        def write(self, data):
            written.append(bytes(data))

    return LineBound(Reader(), Writer(), limit), fed, written


def test_an_oversized_answer_of_the_client_fails_its_request_with_the_native_wording():
    bound, fed, written = _line_bound(100)
    line = json.dumps({"jsonrpc": "2.0", "id": 7, "result": {"content": "x" * 500}}).encode()
    bound.feed_data(line[:60])
    bound.feed_data(line[60:] + b"\n")
    assert written == []  # the client is sent nothing
    (frame,) = [json.loads(f) for f in fed]
    assert frame["id"] == 7 and frame["error"]["code"] == -32600
    assert frame["error"]["message"] == \
        f"the client's answer of {len(line)} bytes is larger than maxMessageBytes (100)"


def test_an_oversized_message_with_an_answer_key_and_others_is_answered_not_taken_for_an_answer():
    bound, fed, written = _line_bound(100)
    line = json.dumps({"jsonrpc": "2.0", "id": 7, "result": 1, "params": {"text": "x" * 500}}).encode()
    bound.feed_data(line + b"\n")
    assert fed == []
    (frame,) = [json.loads(w) for w in written]
    assert frame["id"] == 7 and frame["error"]["code"] == -32600


def test_writing_through_an_sdk_connection_without_send_request_warns_once(caplog):
    port = AcpPort(S.finalize(S.merge(S.DEFAULTS, {})))
    written = []

    class Client:  # no _conn.send_request: the typed call is the only way
        async def write_text_file(self, session_id, path, content):
            written.append((session_id, path, content))

    port.client = Client()

    async def main():
        for i in range(3):
            assert await port._write({"branchId": "s1", "path": "/w/a.txt", "text": str(i)}) == {}

    with caplog.at_level("WARNING", logger="operate_sidecar.server.acp"):
        asyncio.run(main())
    assert written == [("s1", "/w/a.txt", "0"), ("s1", "/w/a.txt", "1"), ("s1", "/w/a.txt", "2")]
    assert [r.getMessage() for r in caplog.records].count(
        "the ACP SDK's connection has no send_request: fs/write_text_file answers are not checked "
        "(an editor's failed write answered with a non-object is taken as written)") == 1


def test_a_link_names_a_file_by_a_local_file_uri_or_a_path():
    """``_link_path``: a local ``file:`` URI (percent-encoded) or a path; no other address."""
    from operate_sidecar.server.acp.agent import _link_path

    assert _link_path("file:///w/a%20b.txt") == "/w/a b.txt" == _link_path("file://localhost/w/a%20b.txt")
    assert _link_path("src/a.py") == "src/a.py"
    assert [_link_path(u) for u in ("https://x.org/a", "file://other-host/a", "zed:///agent/x", "")] == [None] * 4


def test_notices_errors_and_warnings_once_per_session_info_on_stderr_only():
    """What a turn starts with (``AcpPort.notices_for``): the errors and warnings the session
    was not told yet; info and log messages never; a problem of some sessions (the service keeps
    them: ``Service.branch_problems``) to those sessions only."""
    port = AcpPort(S.finalize(S.merge(S.DEFAULTS, {})))
    port.log_message(3, "an info")
    port.log_message(4, "a log line")
    assert port.notice_gen == 0 and port.noticed.get("a", 0) == port.notice_gen  # a turn checks no more
    port.log_message(2, "tool module 'm' could not be imported")
    port.log_message(1, "state directory /s unusable: gone")
    port.log_branch_problem(2, "branch b1: model 'x' is not configured; using the default model")
    port.log_branch_problem(2, "MCP server 'fx' unavailable: failed to start\nstderr (last lines):\nboom")
    problems = {"a": ["MCP server 'fx' unavailable: failed to start\nstderr (last lines):\nboom"],  # the service's
                "b1": ["branch b1: model 'x' is not configured; using the default model"]}
    said = port.notices_for("a", lambda sid: problems.get(sid, []))
    assert said is not None and port.noticed["a"] == port.notice_gen
    assert said.count("> ⚠ ") == 3 and "**Error:** state directory /s unusable: gone." in said, said
    assert "**Warning:** MCP server 'fx' unavailable: failed to start. Its tools are not available" in said
    assert "has the details" in said and "boom" not in said and "branch b1" not in said, said
    assert port.notices_for("a", lambda sid: problems.get(sid, [])) is None  # once
    port.log_message(2, "tool module 'm' could not be imported")  # said again: not told again
    assert port.notices_for("a", lambda sid: problems.get(sid, [])) is None
    b1 = port.notices_for("b1", lambda sid: problems.get(sid, []))
    assert b1 is not None and "branch b1: model 'x'" in b1 and "tool module 'm'" in b1 and "'fx'" not in b1, b1


def test_a_warning_over_and_said_again_is_a_new_occurrence_told_again_once():
    """A warning was told once per session by its words, so the same problem again (an MCP
    server that stopped, was started again and stopped again the same way) was never told again.
    Once the service says an occurrence is over (``log_problem_over``), the same words logged
    again are a new one: told once more to each session it concerns, those told the first
    included; until then, said again, it is not; nothing is pending meanwhile (a warm turn
    checks no more)."""
    port = AcpPort(S.finalize(S.merge(S.DEFAULTS, {})))
    wide, own = "MCP server 'cfg' stopped: it exited", "MCP server 'fl' stopped: it exited"
    problems: dict[str, list[str]] = {}

    def told(sid: str) -> str | None:
        return port.notices_for(sid, lambda s: problems.get(s, []))

    for round_ in (1, 2):
        port.log_message(2, wide)
        port.log_branch_problem(2, own)
        problems["a"] = [own]
        said = told("a")
        assert said is not None and said.count("> ⚠ ") == 2 and "'cfg'" in said and "'fl'" in said, (round_, said)
        port.log_message(2, wide)  # said again, the same occurrence: not told again
        port.log_branch_problem(2, own)
        assert told("a") is None, round_
        port.log_problem_over(wide)  # the servers started again: nothing new to tell
        port.log_problem_over(own)
        problems["a"] = []
        assert port.noticed["a"] == port.notice_gen, round_
    b = told("b")  # a session told neither: the server-wide one once, the other is not its own
    assert b is not None and b.count("> ⚠ ") == 1 and "'cfg'" in b, b
    assert told("b") is None
