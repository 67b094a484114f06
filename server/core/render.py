"""Rendering branch messages into a provider request.

Each message's rendered form is computed once and cached by message id, so
the per-call cost does not re-serialise the history. Schemas are rendered once
per model class. The system message is sent as a real system message; past
instructions are rendered without tools or schema; action responses are
folded into the next user turn as tool results; consecutive assistant turns
are merged.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from pydantic import BaseModel

from .imodel import ModelRequest
from .messages import Message, MessageLog
from .operative import request_info

_schema_cache: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, default=str)


#: id(tool schema dict) → (that dict, its JSON, its line in the tool list). A tool's schema is
#: built once and cached on the tool (``Tool.schema``), so the same dict comes back every call;
#: holding it here keeps its id from being reused while the entry lives. Bounded.
_tool_memo: dict[int, tuple[dict, str, str]] = {}


def _tool_rendered(ts: dict) -> tuple[str, str]:
    """(JSON of a tool schema, its line in the rendered tool list), computed once per schema."""
    hit = _tool_memo.get(id(ts))
    if hit is not None and hit[0] is ts:
        return hit[1], hit[2]
    fn = ts.get("function", ts)
    line = f"- {fn.get('name')}: {fn.get('description') or ''} parameters: {_dumps(fn.get('parameters') or {})}"
    if len(_tool_memo) >= 512:
        _tool_memo.clear()
    entry = (ts, _dumps(ts), line)
    _tool_memo[id(ts)] = entry
    return entry[1], entry[2]


def request_schema_of(response_format: Any, tool_schemas: list[dict] | None = None
                      ) -> tuple[dict | None, str | None, str | None]:
    """The JSON Schema shown to the model for a response format: the *request*
    model's for generated operatives (no ``action_responses``). With tool
    schemas, each ``action_requests`` item is narrowed to the offered tools
    (function name as a constant, arguments as that tool's parameters), so a
    grammar-constrained model can only propose calls that exist. Returns
    ``(schema, name, schema_json)``; cached per class and tool set."""
    if response_format is None:
        return None, None, None
    if isinstance(response_format, BaseModel):
        response_format = type(response_format)
    if isinstance(response_format, type) and issubclass(response_format, BaseModel):
        cached = _schema_cache.get(response_format)
        if cached is None:
            info = request_info(response_format)
            target = info[0] if info else response_format
            schema = target.model_json_schema()
            cached = {None: (schema, target.__name__, _dumps(schema))}
            _schema_cache[response_format] = cached
        if not tool_schemas or "action_requests" not in cached[None][0].get("properties", {}):
            return cached[None]
        key = tuple(_tool_rendered(t)[0] for t in tool_schemas)
        hit = cached.get(key)
        if hit is None:
            schema = _narrow_action_requests(cached[None][0], tool_schemas)
            hit = (schema, cached[None][1], _dumps(schema))
            if len(cached) > 64:
                for k in [k for k in cached if k is not None][:32]:
                    del cached[k]
            cached[key] = hit
        return hit
    if isinstance(response_format, dict):
        return response_format, str(response_format.get("title") or "Response"), _dumps(response_format)
    return None, None, None


def _narrow_action_requests(schema: dict, tool_schemas: list[dict]) -> dict:
    import copy

    out = copy.deepcopy(schema)
    defs = out.setdefault("$defs", {})
    variants = []
    for ts in tool_schemas:
        fn = ts.get("function", ts)
        params = copy.deepcopy(fn.get("parameters") or {"type": "object"})
        tool_defs = params.pop("$defs", None)
        if tool_defs:
            if any(k in defs for k in tool_defs):
                return schema  # cannot merge safely: keep the generic item schema
            defs.update(tool_defs)
        variants.append({"type": "object", "properties": {"function": {"const": fn.get("name")}, "arguments": params},
                         "required": ["function", "arguments"], "additionalProperties": False})
    if not variants:
        return schema
    prop = out["properties"]["action_requests"]
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "array":
            branch["items"] = item
    text = json.dumps(out)
    for name in [n for n in defs if f'"#/$defs/{n}"' not in text]:
        del defs[name]  # the generic item schema no longer referenced: keep the prompt lean
    if not defs:
        del out["$defs"]
    return out


def instruction_content(instruction: Any, guidance: Any, context: Any, response_format: Any,
                        tool_schemas: list[dict] | None) -> dict[str, Any]:
    schema, _, _ = request_schema_of(response_format, tool_schemas)
    return {
        "instruction": instruction,
        "guidance": guidance,
        "context": context,
        "responseSchema": schema,
        "toolSchemas": tool_schemas or None,
    }


def _tool_lines(tool_schemas: list[dict]) -> str:
    return "\n".join(_tool_rendered(ts)[1] for ts in tool_schemas)


def render_user_text(content: dict[str, Any], *, current: bool, schema_json: str | None = None,
                     tool_results: list[dict] | None = None) -> str:
    parts: list[str] = []
    if tool_results:
        parts.append("Tool results: " + _dumps(tool_results))
    if content.get("instruction") is not None:
        parts.append(f"Instruction: {content['instruction']}")
    if content.get("guidance") is not None:
        g = content["guidance"]
        parts.append(f"Guidance: {g if isinstance(g, str) else _dumps(g)}")
    if content.get("context") is not None:
        c = content["context"]
        parts.append(f"Context: {c if isinstance(c, str) else _dumps(c)}")
    if current:
        if content.get("toolSchemas"):
            parts.append("Tools (to call one, put it in action_requests as {\"function\": name, \"arguments\": {...}}):\n"
                         + _tool_lines(content["toolSchemas"]))
        if schema_json is not None:
            parts.append("Respond with only a JSON object that matches this JSON Schema:\n" + schema_json)
    return "\n\n".join(parts) if parts else "{}"


class _RenderState:
    """Incremental rendering state of one branch: the rendered turns so far,
    tool results not yet folded into a user turn, and how many messages of
    which log generation have been consumed."""

    __slots__ = ("out", "pending", "count", "generation", "log")

    def __init__(self) -> None:
        self.out: list[dict[str, str]] = []
        self.pending: list[dict] = []
        self.count = 0
        self.generation = -1
        self.log: Any = None


def _consume(state: _RenderState, m: Message) -> None:
    out = state.out
    kind = m.kind
    if kind == "action_request":
        return
    if kind == "action_response":
        c = m.content
        state.pending.append({"function": c.get("function"), "arguments": c.get("arguments"),
                              "output": c.get("output")})
        return
    if kind == "system":
        out.append({"role": "system", "content": str(m.content.get("text") or "")})
        return
    if kind == "instruction":
        entry = {"role": "user", "content": render_user_text(m.content, current=False,
                                                             tool_results=state.pending or None)}
        state.pending = []
        if out and out[-1]["role"] == "user":
            out[-1] = entry  # an instruction directly after another: keep the latest
        else:
            out.append(entry)
        return
    if kind == "assistant_response":
        text = str(m.content.get("text") or "")
        if out and out[-1]["role"] == "assistant":
            if text:  # (an empty one, such as a CLI run's closing usage record, adds nothing)
                out[-1] = {"role": "assistant", "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": "assistant", "content": text})


def _rendered(branch: Any) -> _RenderState:
    """The branch's rendering state, brought up to date: only new messages are rendered."""
    log = branch.messages
    state: _RenderState | None = getattr(branch, "_render_state", None)
    if state is None or state.log is not log or state.generation != log.generation or state.count > len(log):
        state = _RenderState()
        state.log = log
        state.generation = log.generation
        branch._render_state = state
    items = log.items
    for i in range(state.count, len(items)):
        _consume(state, items[i])
    state.count = len(items)
    return state


def render_history(branch: Any) -> tuple[list[dict[str, str]], list[dict]]:
    """The branch's history as chat turns plus the tool results still pending
    (to be folded into the next user turn). Only new messages are rendered."""
    state = _rendered(branch)
    return list(state.out), list(state.pending)


class _View:
    """A stand-in for a branch, for rendering only: what ``render_history`` reads of one (its
    messages, and their rendering so far: none, or one to carry on from)."""

    __slots__ = ("messages", "_render_state")

    def __init__(self, messages: MessageLog, state: _RenderState | None = None) -> None:
        self.messages = messages
        self._render_state = state


def cleared(branch: Any) -> Any:
    """``branch`` as ``clear_messages`` will leave it (its system message only), for rendering
    only: a model call's request is rendered from it, and the branch itself is cleared only once
    the call records something (docs/PIPELINE.md D3)."""
    return _View(MessageLog([m for m in branch.messages if m.kind == "system"][:1]))


def with_messages(base: Any, extra: list[Message]) -> Any:
    """``base`` (a branch, or a stand-in for one) as it will be once ``extra`` is recorded on it,
    for rendering only: a model call's parse-repair turn is shown the instruction and the reply
    it reformats, which are recorded only once the reply is parsed (docs/PIPELINE.md D3).
    ``base``'s rendering so far is reused (brought up to date, copied once): only ``extra`` is
    rendered anew, however long the branch."""
    src = _rendered(base)
    log = MessageLog([*base.messages, *extra])
    state = _RenderState()
    state.out, state.pending, state.count = list(src.out), list(src.pending), src.count
    state.log, state.generation = log, log.generation
    return _View(log, state)


def render_request(branch: Any, ins: Message, response_format: Any, tool_schemas: list[dict] | None,
                   options: dict[str, Any] | None, *, purpose: str = "chat") -> ModelRequest:
    schema, name, schema_json = request_schema_of(response_format, tool_schemas)
    messages, pending = render_history(branch)
    text = render_user_text(ins.content, current=True, schema_json=schema_json, tool_results=pending or None)
    _put_user(messages, text)
    return ModelRequest(messages=messages, response_schema=schema, schema_name=name, tool_schemas=tool_schemas,
                        options=dict(options or {}), purpose=purpose)  # type: ignore[arg-type]


def _put_user(messages: list[dict[str, str]], text: str) -> None:
    if messages and messages[-1]["role"] == "user":
        messages[-1] = {"role": "user", "content": text}
    else:
        messages.append({"role": "user", "content": text})


#: The instruction of a parse-repair (reformat) turn.
REFORMAT_INSTRUCTION = "reformat text into specified model or structure"


def render_repair_request(branch: Any, text: str, response_format: Any, guidance: str,
                          options: dict[str, Any] | None) -> ModelRequest:
    content = instruction_content(REFORMAT_INSTRUCTION, guidance, [{"text_to_format": text}], response_format, None)
    schema, name, schema_json = request_schema_of(response_format)
    messages, _ = render_history(branch)
    _put_user(messages, render_user_text(content, current=True, schema_json=schema_json))
    return ModelRequest(messages=messages, response_schema=schema, schema_name=name, options=dict(options or {}),
                        purpose="parse")
