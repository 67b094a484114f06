"""Branch: messages (docs/PROTOCOL.md §3), fork, clear, serialization, governance hook."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from operate_sidecar.server.core import AuthorizationResult, Branch, ToolInvocation
from operate_sidecar.server.models.scripted import ScriptedModel

from .support import Answer, call, kinds, make_branch, reply

pytestmark = pytest.mark.anyio

CONTENT_KEYS = {
    "system": {"text"},
    "instruction": {"instruction", "guidance", "context", "responseSchema", "toolSchemas"},
    "assistant_response": {"text", "model", "usage"},
    "action_request": {"callId", "function", "arguments"},
    "action_response": {"callId", "requestId", "function", "arguments", "output"},
}
ROLES = {"system": "system", "instruction": "user", "assistant_response": "assistant",
         "action_request": "action", "action_response": "action"}


async def operated_branch(record) -> Branch:
    b, _ = make_branch([reply(1, call(x=1))], tools=(record,), system="be brief")
    await b.operate(instruction="q", guidance="g", context={"c": 1}, response_format=Answer, actions=True)
    return b


async def test_messages_have_protocol_shape(record):
    """docs/PROTOCOL.md §3: Message = {id, kind, role, sender, recipient, createdAt, content}, content per kind."""
    b = await operated_branch(record)
    page = b.messages.page()
    assert [m["kind"] for m in page] == ["system", "instruction", "assistant_response", "action_request",
                                         "action_response"]
    for m in page:
        assert set(m) == {"id", "kind", "role", "sender", "recipient", "createdAt", "content"}
        assert m["role"] == ROLES[m["kind"]]
        assert set(m["content"]) == CONTENT_KEYS[m["kind"]]
        datetime.fromisoformat(m["createdAt"])
    json.dumps(page)  # wire-serializable


async def test_instruction_content_holds_what_was_sent(record):
    """docs/PROTOCOL.md §3: the instruction records instruction, guidance, context and the schema actually sent."""
    b = await operated_branch(record)
    ins = b.messages.page()[1]["content"]
    assert (ins["instruction"], ins["guidance"], ins["context"]) == ("q", "g", {"c": 1})
    assert ins["responseSchema"]["title"] == "AnswerRequest"
    assert [t["function"]["name"] for t in ins["toolSchemas"]] == ["record"]


async def test_action_messages_are_linked(record):
    """docs/PROTOCOL.md §3/§6: the action_response names its request and shares its callId."""
    b = await operated_branch(record)
    req, resp = b.messages.page()[3:]
    assert resp["content"]["requestId"] == req["id"]
    assert resp["content"]["callId"] == req["content"]["callId"]
    assert resp["content"]["output"] == {"doubled": 2}


async def test_page_offset_and_limit():
    """docs/PROTOCOL.md §3: branchMessages paging, oldest first."""
    b, _ = make_branch(["a", "b"], system="s")
    await b.operate(instruction="1")
    await b.operate(instruction="2")
    assert [m["kind"] for m in b.messages.page(1, 2)] == ["instruction", "assistant_response"]
    assert [m["content"].get("instruction") for m in b.messages.page(3, 10)] == ["2", None]


async def test_fork_copies_messages_and_policy_independently(record):
    """docs/PROTOCOL.md §3 forkBranch: a copy of its messages and policy; later changes do not leak."""
    b = await operated_branch(record)

    async def deny(inv):
        return False

    b.authorizer = deny
    f = b.fork()
    assert f.id != b.id
    assert [m.to_dict() for m in f.messages] == [m.to_dict() for m in b.messages]
    assert f.authorizer is deny and f.tools is b.tools and f.chat_model is b.chat_model
    f.messages.add("instruction", {"instruction": "only in fork"})
    f.messages[0].content["text"] = "changed in fork"
    assert len(b.messages) == 5 and b.messages[0].content["text"] == "be brief"


def test_clear_keeps_system():
    """D3/communicate: clearing messages keeps the system message."""
    b = Branch(system="keep me")
    b.messages.add("instruction", {"instruction": "x"})
    b.messages.add("assistant_response", {"text": "y"})
    b.messages.clear()
    assert kinds(b) == ["system"] and b.system == "keep me"
    plain = Branch()
    plain.messages.add("instruction", {"instruction": "x"})
    plain.messages.clear()
    assert len(plain.messages) == 0


async def test_operate_clear_messages_keeps_system():
    """D3: operate(clear_messages=True) lets the adapter clear history but keep the system message."""
    b, m = make_branch(["one", "two"], system="sys")
    await b.operate(instruction="first")
    await b.operate(instruction="second", clear_messages=True)
    assert kinds(b) == ["system", "instruction", "assistant_response"]
    assert "first" not in json.dumps(m.requests[1].messages)


async def test_to_dict_from_dict_round_trip(record):
    """Branch: to_dict/from_dict round-trips id, name, user, metadata and messages losslessly."""
    b = await operated_branch(record)
    b.name = "n"
    b.metadata["k"] = [1]
    data = json.loads(json.dumps(b.to_dict()))
    back = Branch.from_dict(data)
    assert (back.id, back.name, back.user, back.metadata) == (b.id, "n", b.user, {"k": [1]})
    assert [m.to_record() for m in back.messages] == [m.to_record() for m in b.messages]
    assert back.to_dict()["messages"] == data["messages"]
    assert back.system == "be brief"


def test_parse_model_falls_back_to_chat_model():
    """Branch: parse_model falls back to chat_model when none is set."""
    chat, parse = ScriptedModel("c", []), ScriptedModel("p", [])
    assert Branch(chat_model=chat).parse_model is chat
    assert Branch(chat_model=chat, parse_model=parse).parse_model is parse


async def test_authorize_defaults_to_allow_and_coerces_bools():
    """D4: branch.authorize allows without an authorizer; a bool answer becomes an AuthorizationResult."""
    b = Branch()
    inv = ToolInvocation(function="f", arguments={}, branch_id=b.id, call_id="c")
    assert (await b.authorize(inv)).allowed is True

    async def no(_):
        return False

    b.authorizer = no
    result = await b.authorize(inv)
    assert isinstance(result, AuthorizationResult) and result.allowed is False
