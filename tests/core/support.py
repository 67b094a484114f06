"""Shared helpers for the core conformance suite: real tools that record
their invocations and branches driven by the real ScriptedModel."""

from __future__ import annotations

import json
from typing import Any

import anyio
from pydantic import BaseModel

from operate_sidecar.server.core import AlcallParams, Branch, Tool
from operate_sidecar.server.models.scripted import ScriptedModel

# Parse repair with no back-off, so failing parses stay fast.
NO_REPAIR = AlcallParams(retry_attempts=0)


class Answer(BaseModel):
    answer: int


class RecordingTool:
    """A real Python tool: ``name(x: int = 0, note: str = "")`` records each
    invocation and returns ``{"doubled": 2x}`` (or raises ``fail``)."""

    def __init__(self, name: str = "record", *, fail: str | None = None) -> None:
        self.name = name
        self.fail = fail
        self.calls: list[dict[str, Any]] = []

        async def fn(x: int = 0, note: str = "") -> dict:
            """Record an invocation.

            Args:
                x: a number to double.
                note: free text.
            """
            self.calls.append({"x": x, "note": note})
            if self.fail is not None:
                raise RuntimeError(self.fail)
            return {"doubled": 2 * x}

        self.tool = Tool.from_function(fn, name=name)

    @property
    def ran(self) -> bool:
        return bool(self.calls)


def make_branch(responses: list[Any] | None = None, *, cli: bool = False, tools: tuple[RecordingTool, ...] = (),
                system: str | None = None, name: str = "scripted") -> tuple[Branch, ScriptedModel]:
    model = ScriptedModel(name, list(responses or []), cli=cli)
    branch = Branch(system=system, chat_model=model)
    for t in tools:
        branch.tools.register(t.tool)
    return branch, model


def call(function: str = "record", **arguments: Any) -> dict[str, Any]:
    return {"function": function, "arguments": arguments}


def reply(answer: Any = None, *requests: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A scripted entry whose text is a JSON object."""
    body: dict[str, Any] = dict(extra)
    if answer is not None:
        body["answer"] = answer
    if requests:
        body["action_requests"] = list(requests)
    return {"json": body}


def kinds(branch: Branch) -> list[str]:
    return [m.kind for m in branch.messages]


def action_outputs(branch: Branch) -> list[Any]:
    return [m.content["output"] for m in branch.messages if m.kind == "action_response"]


def request_text(model: ScriptedModel, i: int = 0) -> str:
    r = model.requests[i]
    return json.dumps({"messages": r.messages, "schema": r.response_schema, "tools": r.tool_schemas})


def interleaving_tools() -> tuple[list[tuple[str, str]], list[Tool]]:
    """Two real tools, "first" and "second", that log start/end around two checkpoints."""
    log: list[tuple[str, str]] = []
    tools = []

    def make(name: str):
        async def fn() -> str:
            log.append(("start", name))
            await anyio.sleep(0)
            await anyio.sleep(0)
            log.append(("end", name))
            return name

        return Tool.from_function(fn, name=name)

    for name in ("first", "second"):
        tools.append(make(name))
    return log, tools


def overlapped(log: list[tuple[str, str]]) -> bool:
    return log.index(("start", "second")) < log.index(("end", "first"))
