"""D4: every tool call goes through ``act()`` → ``_act()``: selection and
authorization first, then argument validation, hooks (TOOL_PRE, then TOOL_POST
or TOOL_ERROR), invocation with its time-out, and message recording. Every
recorded ``action_request`` gets its ``action_response``, also when the call
is denied, fails, or is cancelled. A call whose authorization (a permission request to the
client) was still pending when its operate was cancelled is denied by the cancel: recorded as a
denied call (reason ``"cancelled"``) with its ``denied`` hook event, before the cancel goes on.

A tool's output is made JSON once, where it is produced, before anything records it
(``json_output``), so the branch, the answer and the store only ever hold JSON. An output
``json.dumps(..., allow_nan=False)`` writes is kept as it is (the common case: one dumps,
no walk, and one strict UTF-8 encode of its text); any other is converted: NaN and
±Infinity become the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``; bytes become UTF-8
text (invalid bytes replaced by U+FFFD); a lone surrogate in a string or a key (a file name
``os.listdir`` made of bytes that are not UTF-8, one per such byte) becomes U+FFFD, as in a
tool's error text; tuples and sets become arrays; keys that are not strings become strings (as ``json.dumps`` writes them, ``str()`` for the others); pydantic
models, dataclasses, enums and dates become their JSON form; any other object with a string
form of its own (``Decimal``, ``UUID``, ``Path``...) becomes that string. An output that
contains itself, nests deeper than ``MAX_OUTPUT_DEPTH`` levels, holds an integer too long to
write, or an object with no form but its address (``object()``, a generator, a function)
is the call's tool error naming the problem and where it is (``ToolOutputError``)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import BaseModel

from .errors import ConfigurationError, OperateError, ToolNotRegistered, ToolTimeout, exception_line, exception_text
from .hooks import HookEvent, HookEventType, summarize
from .messages import Message, new_id
from .operative import ActionRequestModel, ActionResponseModel
from .params import DEFAULT_ACTION_ALCALL, ActionParam
from .tools import ToolCallContext
from ..redaction import redact, redact_value

log = logging.getLogger(__name__)

DENIED = "denied by governance gate"
#: the reason of a call denied because its operate was cancelled while it was being authorized
CANCELLED = "cancelled"


@dataclass(slots=True, frozen=True)
class ToolInvocation:
    function: str
    arguments: dict[str, Any]
    branch_id: str
    call_id: str
    tool: Any = None


@dataclass(slots=True, frozen=True)
class AuthorizationResult:
    allowed: bool
    reason: str | None = None


def _normalize(req: Any) -> tuple[str | None, dict[str, Any]]:
    if isinstance(req, Message) and req.kind == "action_request":
        return req.content.get("function"), req.content.get("arguments") or {}
    if isinstance(req, BaseModel):
        fields = type(req).model_fields
        if "function" in fields and "arguments" in fields:
            return getattr(req, "function"), getattr(req, "arguments") or {}
    elif isinstance(req, dict) and "function" in req and "arguments" in req:
        return req["function"], req["arguments"] or {}
    raise ValueError("action_request must be an ActionRequest, BaseModel with 'function' and 'arguments', "
                     "or dict with 'function' and 'arguments'.")


def _selected(action_param: ActionParam, branch: Any) -> set[str] | None:
    """The names of the tools the calls may run (None: every tool): a name given as such is kept
    as it is, not looked up (a tool gone since the round's schemas were published, its source
    having listed its tools again, is then a call of a tool not registered, as any other, not a
    failure of the whole round after the model's reply); the rest of the selection resolved."""
    sel = action_param.tools
    if sel is None or sel is True:
        return None
    items = sel if isinstance(sel, (list, tuple, set)) else [sel]
    rest = [it for it in items if not isinstance(it, str)]
    return {it for it in items if isinstance(it, str)} | {t.name for t in branch.tools.resolve(rest)}


async def act(branch: Any, action_request: list | Any, action_param: ActionParam) -> list[ActionResponseModel]:
    items = action_request if isinstance(action_request, list) else [action_request]
    normalized = [_normalize(r) for r in items]  # any bad shape raises before any invocation
    selected = _selected(action_param, branch)

    async def one(req: tuple[str | None, dict[str, Any]]) -> ActionResponseModel | None:
        return await _act(branch, req[0], req[1], action_param, selected)

    if action_param.strategy == "concurrent":
        call = action_param.action_call_params or DEFAULT_ACTION_ALCALL
        if len(normalized) < 2:
            return await call(normalized, one)
        # A batch: one call's failure never cancels a sibling that is already running (its
        # effect would happen and its result be lost). A veto or a raising authorizer is that
        # call's error output; a re-raised tool error (suppress_errors=False) is raised once
        # every sibling has finished and been recorded.
        raised: list[BaseException] = []

        async def contained(req: tuple[str | None, dict[str, Any]]) -> ActionResponseModel | None:
            try:
                return await _act(branch, req[0], req[1], action_param, selected, contain=True)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:
                raised.append(e)
                return None

        out = await call(normalized, contained)
        if raised:
            raise raised[0]
        return out
    if action_param.strategy == "sequential":
        # a batch run in order: a veto or a raising authorizer is that call's error output, as
        # in a concurrent batch (it failed the operate after the calls before it had run, their
        # results never reaching the model), and the calls after it still run
        contain = len(normalized) > 1
        out = []
        for req in normalized:
            out.append(await _act(branch, req[0], req[1], action_param, selected, contain=contain))
        return out
    raise ConfigurationError("Invalid strategy. Choose 'concurrent' or 'sequential'.")


def _own_copy(value: Any) -> Any:
    """``value`` with its dicts and lists (what JSON arguments are made of) copied, the rest
    shared (strings, numbers: nothing to change in place). Made without recursion, so any
    depth the arguments came in with is copied; a list or dict met twice is copied once."""
    if not isinstance(value, (dict, list)):
        return value
    copies: dict[int, Any] = {}

    def fresh(v: Any) -> Any:
        c = {} if isinstance(v, dict) else [None] * len(v)
        copies[id(v)] = c
        todo.append((v, c))
        return c

    todo: list[tuple[Any, Any]] = []
    root = fresh(value)
    while todo:
        src, dst = todo.pop()
        for k, v in (src.items() if isinstance(src, dict) else enumerate(src)):
            if isinstance(v, (dict, list)):
                v = copies[id(v)] if id(v) in copies else fresh(v)
            dst[k] = v
    return root


def _record_request(branch: Any, call_id: str, function: Any, arguments: Any) -> Message:
    return branch.messages.add("action_request", {"callId": call_id, "function": function, "arguments": arguments},
                               sender=branch.id, recipient=branch.id)


def _record_response(branch: Any, req: Message, output: Any) -> None:
    c = req.content
    branch.messages.add("action_response", {"callId": c["callId"], "requestId": req.id, "function": c["function"],
                                            "arguments": c["arguments"], "output": output},
                        sender=branch.id, recipient=branch.id)


#: how deep a tool output that is not already plain JSON may nest (``json_output``)
MAX_OUTPUT_DEPTH = 500


class ToolOutputError(OperateError, ValueError):
    """A tool output that JSON cannot hold: it contains itself, nests too deeply, holds an
    integer too long to write or an object with no form but its address."""


def json_output(output: Any) -> tuple[Any, str | None]:
    """``output`` as JSON can hold it (see the module's docstring), and its JSON text when
    the output already was JSON (the common case: one ``json.dumps``, nothing walked; None
    otherwise). Raises :class:`ToolOutputError` for an output that cannot be made JSON."""
    try:
        text = json.dumps(output, ensure_ascii=False, allow_nan=False)
    except RecursionError:
        raise ToolOutputError("tool output is not JSON: it nests too deeply") from None
    except (TypeError, ValueError):
        pass
    else:
        try:
            text.encode("utf-8")  # Unicode text (the common case: nothing more to do)
            return output, text
        except UnicodeEncodeError:  # a lone surrogate: a file name that is not UTF-8 on disk
            pass
    try:
        return _jsonable(output, "$", set(), 0), None
    except RecursionError:
        raise ToolOutputError("tool output is not JSON: it nests too deeply") from None


def unicode_text(text: str) -> str:
    """``text`` with each lone surrogate as U+FFFD: a name ``os.listdir`` or ``os.fsdecode``
    made of bytes that are not UTF-8 holds one per such byte (``surrogateescape``), which JSON
    can only write as a ``\\udcXX`` escape that strict readers refuse. A surrogate pair held as
    two characters becomes the one character it stands for."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _jsonable(v: Any, path: str, active: set[int], depth: int) -> Any:
    if type(v) is str:
        return unicode_text(v)
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):  # a str subclass (a StrEnum...): its text
        return unicode_text(str.__str__(v))
    if isinstance(v, int):
        try:
            int.__repr__(v)
        except ValueError:
            raise ToolOutputError(f"tool output is not JSON: the integer at {path} has too many digits") from None
        return int(v)
    if isinstance(v, float):
        return float(v) if math.isfinite(v) else ("NaN" if v != v else "Infinity" if v > 0 else "-Infinity")
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, enum.Enum):
        return _jsonable(v.value, path, active, depth)
    if isinstance(v, (_dt.date, _dt.time)):
        return v.isoformat()
    container = isinstance(v, (Mapping, list, tuple, set, frozenset))
    if not container:
        if isinstance(v, BaseModel):
            try:
                v, container = v.model_dump(mode="json"), True
            except Exception as e:
                raise ToolOutputError(f"tool output is not JSON: {type(v).__name__} at {path}: "
                                      f"{_first_line(e)}") from None
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            v, container = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, True
        elif callable(getattr(v, "tolist", None)):  # numpy arrays and scalars
            try:
                v = v.tolist()
            except Exception as e:
                raise ToolOutputError(f"tool output is not JSON: {type(v).__name__} at {path}: "
                                      f"{_first_line(e)}") from None
            return _jsonable(v, path, active, depth)
        elif type(v).__str__ is not object.__str__:
            try:
                return unicode_text(str(v))
            except Exception as e:
                raise ToolOutputError(f"tool output is not JSON: {type(v).__name__} at {path} has no string "
                                      f"form ({type(e).__name__})") from None
        else:
            raise ToolOutputError(f"tool output is not JSON: {type(v).__name__} at {path} has no JSON form")
    if depth >= MAX_OUTPUT_DEPTH:
        raise ToolOutputError(f"tool output is not JSON: it nests deeper than {MAX_OUTPUT_DEPTH} levels")
    key = id(v)
    if key in active:
        raise ToolOutputError(f"tool output is not JSON: it contains itself at {path} (a circular reference)")
    active.add(key)
    try:
        if isinstance(v, Mapping):
            out = {}
            for k, x in v.items():
                k = _json_key(k, path)
                out[k] = _jsonable(x, f"{path}[{k!r}]", active, depth + 1)
            return out
        return [_jsonable(x, f"{path}[{i}]", active, depth + 1) for i, x in enumerate(v)]
    finally:
        active.discard(key)


def _first_line(e: BaseException) -> str:
    return exception_line(e)[:200]


def _json_key(k: Any, path: str) -> str:
    """An object key as ``json.dumps`` writes it; ``str()`` of any other key."""
    if isinstance(k, str):
        return unicode_text(k if type(k) is str else str.__str__(k))
    if k is None or isinstance(k, bool):
        return "null" if k is None else "true" if k else "false"
    if isinstance(k, (int, float)):
        value = _jsonable(k, path, set(), 0)
        return value if isinstance(value, str) else json.dumps(value)
    try:
        return unicode_text(str(k))
    except Exception as e:
        raise ToolOutputError(f"tool output is not JSON: a {type(k).__name__} key at {path} has no string "
                              f"form ({type(e).__name__})") from None


def bound_output(output: Any, limit: int | None, text: str | None = None) -> Any:
    """Tool output as kept in the message and the result: outputs whose JSON
    form exceeds ``limit`` characters are replaced by a truncated preview. ``text`` is
    the output's JSON form when the caller already has it."""
    if not limit:
        return output
    if text is None:
        try:
            text = json.dumps(output, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(output)
    if len(text) <= limit:
        return output
    return {"truncated": True, "originalChars": len(text), "preview": text[:limit]}


def _json_object(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _error_output(function: Any, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": message, "function": function, **extra}


def bound_text(text: str, limit: int | None) -> str:
    """An error text as kept in the message and the result: cut to ``limit`` characters (the
    tool output bound, ``maxToolOutputChars``), saying how long it was; it stays a string, so
    the output stays ``{"error": <text>, ...}``."""
    if not limit or len(text) <= limit:
        return text
    return f"{text[:limit]}…(truncated: {len(text)} characters)"


def _log_line(text: str, limit: int = 500) -> str:
    """A failed call's error text as one log line: its lines joined, cut to ``limit`` characters
    (the whole text is the call's output; a log line says what failed)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else f"{line[:limit]}…"


def _failure_text(e: BaseException) -> str:
    """The error text of a failed call, secrets removed (before anything shortens it)."""
    said = exception_text(e)
    if isinstance(e, Exception):
        text = said or type(e).__name__
    else:  # SystemExit, KeyboardInterrupt, ... raised by a tool: name the kind
        text = f"{type(e).__name__}: {said}" if said else type(e).__name__
    return redact(unicode_text(text))


async def _act(branch: Any, function: Any, arguments: Any, action_param: ActionParam,
               selected: set[str] | None, *, contain: bool = False) -> ActionResponseModel:
    call_id = new_id()
    if not isinstance(function, str):
        # a missing or null name is "" and a non-string one its text: an unknown tool (a tool
        # error), never a crash, and one name alike in the record, the events and the answer
        function = "" if function is None else str(function)
    if isinstance(arguments, str):  # a JSON-encoded object, as function-calling APIs send it
        arguments = _json_object(arguments)
    args = arguments if isinstance(arguments, dict) else {}
    bid = str(branch.id)
    hooks = branch.hooks
    limit = getattr(branch, "max_tool_output_chars", None)

    async def fail_before_start(stage: str, e: Exception) -> ActionResponseModel:
        # in a batch (contain=True): this call's error output; the tool never ran
        message = bound_text(f"{stage}: {_failure_text(e)}", limit)
        out = _error_output(function, message)
        req = _record_request(branch, call_id, function, redact_value(args))
        _record_response(branch, req, out)
        branch.log_event({"event": "error", "function": function, "callId": call_id, "error": message})
        if hooks:
            await hooks.emit(HookEvent(HookEventType.TOOL_ERROR, bid, call_id, function,
                                       summarize(redact_value(args)), error=summarize(message)))
        return ActionResponseModel(function=function or "", arguments=args, output=out)

    async def deny(reason: str | None) -> ActionResponseModel:
        output = {"error": DENIED, "function": function}
        if reason:
            output["reason"] = reason = bound_text(redact(reason), limit)
        req = _record_request(branch, call_id, function, redact_value(args))
        _record_response(branch, req, output)
        branch.log_event({"event": "denied", "function": function, "callId": call_id, "reason": reason})
        if hooks:
            await hooks.emit(HookEvent(HookEventType.TOOL_DENIED, bid, call_id, function,
                                       summarize(redact_value(args)), error=reason or DENIED))
        return ActionResponseModel(function=function or "", arguments=args, output=output)

    # 1. governance: a tool outside the call's selection is denied like a policy denial
    if selected is not None and function not in selected:
        return await deny("tool not selected for this call")
    tool = branch.tools._tools.get(function) if isinstance(function, str) else None

    # 2. authorization, before anything runs
    if tool is not None:
        try:
            decision = await branch.authorize(ToolInvocation(function=function, arguments=args, branch_id=bid,  # type: ignore[arg-type]
                                                             call_id=call_id, tool=tool))
        except anyio.get_cancelled_exc_class():
            # cancelled while being authorized (a permission request pending): the cancel is the
            # answer, deny. The call is recorded and evented as denied like any denied call
            # (its callId may already be the client's), shielded as a call cancelled while
            # running is answered below: the recording, then the TOOL_DENIED hook event, whose
            # async handlers are awaited in the shield (the cancel goes on once they return).
            with anyio.CancelScope(shield=True):
                await deny(CANCELLED)
            raise
        except Exception as e:
            if not contain:
                raise
            return await fail_before_start("authorization failed", e)
        if not decision.allowed:
            return await deny(decision.reason)

    if action_param.verbose_action:
        preview = str(args)
        log.info("invoking %s(%s)", function, preview[:50] + "..." if len(preview) > 50 else preview)

    # 3. TOOL_PRE: a handler that raises vetoes the call (propagates, nothing recorded)
    if hooks:
        try:
            await hooks.emit(HookEvent(HookEventType.TOOL_PRE, bid, call_id, function,
                                       summarize(redact_value(args))))
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as e:
            if not contain:
                raise
            return await fail_before_start("vetoed by a hook", e)

    req = _record_request(branch, call_id, function, redact_value(args))
    started = time.perf_counter()
    responded = False
    returned = False  # whether the tool returned (what fails after that is not the tool's doing)
    ctx: ToolCallContext | None = None
    try:
        try:
            if tool is None:
                raise ToolNotRegistered(function)
            # validate what was requested: a non-object is a tool error, never a call with {};
            # the tool gets its own copy: one that changes its arguments in place never
            # rewrites the record of what the model asked for
            valid = tool.validate_arguments(_own_copy(arguments) if arguments is not None else {})
            ctx = ToolCallContext(branch_id=bid, call_id=call_id)
            timeout = tool.timeout or getattr(branch, "default_tool_timeout", None)
            if timeout:
                try:
                    with anyio.fail_after(timeout):
                        output = await tool.call(valid, ctx)
                except TimeoutError:
                    raise ToolTimeout(f"tool {function} timed out after {timeout:g} s"
                                      + "".join(f"; {note}" for note in ctx.pending)) from None
            else:
                output = await tool.call(valid, ctx)
            if isinstance(output, BaseModel):
                output = output.model_dump(mode="json")
            returned = True
            # JSON once, here, before anything records it (ToolOutputError: this call's tool error);
            # then secrets out, then the size bound: a cut never leaves part of a key
            output, text = json_output(output)
            redacted = redact_value(output)
            output = bound_output(redacted, limit, text if redacted is output else None)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt ... from a tool too
            duration = (time.perf_counter() - started) * 1000
            # bounded like an output: the error text, and the arguments it repeats
            message = bound_text(_failure_text(e), limit)
            out = _error_output(function, message, arguments=bound_output(redact_value(args), limit))
            _record_response(branch, req, out)
            responded = True
            branch.log_event({"event": "error", "function": function, "callId": call_id, "error": message})
            if hooks:
                await hooks.emit(HookEvent(HookEventType.TOOL_ERROR, bid, call_id, function,
                                           summarize(redact_value(args)), error=summarize(message),
                                           duration_ms=duration))
            if not action_param.suppress_errors:
                if not isinstance(e, Exception):  # never let a tool's SystemExit end the process
                    raise RuntimeError(message) from None
                raise
            if returned and not isinstance(e, ToolOutputError):
                # the tool returned, and making its output JSON, masked and bounded failed
                # otherwise than as designed: a fault of the server, not of the tool
                log.error("Error recording the output of action '%s': %s", function, message, exc_info=e)
            else:
                # bad arguments from the model, a tool removed or failing, a time-out: the
                # model is answered with the error, the server is fine (one line, no traceback).
                # Its traceback goes to the debug log (--debug): a bug of the server raised before
                # the tool returned (in a builtin tool, or in the machinery calling the client's or
                # an MCP server's) is told apart only by it
                log.warning("Error invoking action '%s': %s", function, _log_line(message))
                log.debug("Traceback of the failed action '%s'", function, exc_info=e)
            return ActionResponseModel(function=function or "", arguments=args, output=out)
        duration = (time.perf_counter() - started) * 1000
        _record_response(branch, req, output)
        responded = True
        branch.log_event({"event": "post", "function": function, "callId": call_id, "durationMs": duration})
        if hooks:
            await hooks.emit(HookEvent(HookEventType.TOOL_POST, bid, call_id, function,
                                       summarize(redact_value(args)), result_summary=summarize(output),
                                       duration_ms=duration))
        return ActionResponseModel(function=function or "", arguments=args, output=output)
    finally:
        if not responded:  # cancelled mid-call: keep the branch consistent
            # (with what the call left pending, as a time-out says it: a write the client may still make)
            error = "cancelled" + ("".join(f"; {note}" for note in ctx.pending) if ctx is not None else "")
            with anyio.CancelScope(shield=True):
                _record_response(branch, req, {"error": error, "function": function})
                if hooks:
                    await hooks.emit(HookEvent(HookEventType.TOOL_ERROR, bid, call_id, function,
                                               summarize(redact_value(args)), error="cancelled",
                                               duration_ms=(time.perf_counter() - started) * 1000))


__all__ = ["act", "ToolInvocation", "AuthorizationResult", "ActionRequestModel", "ActionResponseModel", "DENIED",
           "ToolOutputError", "json_output", "bound_output", "bound_text"]
