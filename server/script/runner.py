"""Run a session script against a fresh server and report every step.

A script is JSON Lines; each line is one step:

- ``{"request": method, "params"?: {...}, "expect"?: {"result": M} | {"error": M}, "save"?: {name: path},
  "timeoutMs"?: n, "id"?: id, "wait"?: true, "cancelAfterModelCalls"?: n, "cancelAfterServerRequests"?: n,
  "raw"?: true}``: send a request and
  wait for its answer. Without ``expect`` any result passes (an error answer fails the step); a
  failing ``expect`` lists its differences (the first few, then how many more). One
  not answered in time is cancelled (``$/cancelRequest``) and fails naming the time-out to raise.
  ``save`` keeps values of the result for later steps. ``"wait": false`` sends it and goes on
  (so that a later step can cancel it by its ``id``); its answer is checked before
  ``shutdown``/``exit`` or at the end. ``cancelAfterModelCalls`` (written by ``--record`` for a
  cancelled operate): a later ``$/cancelRequest`` for this ``id`` is sent only once the server
  has started that many model invocations for the request (seen in its ``$/progress``; a request
  without a ``workDoneToken`` is given one, whose notifications no step sees).
  ``cancelAfterServerRequests`` (a cancel recorded while a server-to-client request was open):
  ... and once the server has sent that many requests to the client in the session.
  ``"answered": false`` (written by ``--record`` for a request its client left before the answer
  came): sent without waiting and never judged; when it is still unanswered at the end, the
  script ends as that client did, by closing the server's input.
- ``{"await": id, "timeoutMs"?: n}``: wait here for the answer to the earlier ``"wait": false``
  request with that ``id`` and judge it (``--record`` writes one where its client got the
  answer, so that later steps are sent only once it came, as they were).
- ``{"notify": method, "params"?: {...}, "raw"?: true}``: send a notification.
- ``{"expectNotification": method, "match"?: M, "timeoutMs"?: n, "save"?: {name: path}}``: wait
  for a notification of that method, not matched by an earlier step, whose params match ``M``;
  one that timed out names the nearest miss and, as a request does, the time-out to raise. One
  that can no longer come fails at once: a ``$/progress`` of a ``workDoneToken`` whose requests
  have all been answered (an operate's progress precedes its answer), a ``toolEvent`` of a
  branch whose operates have all been answered with a result.
- ``{"respond": method, "match"?: M, "result": {...}}`` (or ``"error": {"code", "message"}``): the
  standing answer to that server-to-client request from here on; with ``match``, only to those
  whose params match ``M`` (the latest standing answer that matches is given; respond lines of
  the same method and ``match`` in a row, only respond lines between them, answer in turn, the
  last one repeating, as ``--record`` writes a call answered differently each time). The ``result`` of
  a request protocol/ declares (``requestToolPermission``, ``invokeClientTool``,
  ``fs/readTextFile``, ``fs/writeTextFile``) must have the shape it declares for it, checked when
  the script loads, except where a ``${name}`` stands (known only once substituted). A request of
  those four no standing answer fits is refused (-32601) and fails the step running when it came;
  so does a ``requestToolPermission`` answered with a ``decision`` not among its ``options`` (given
  by a ``${name}``; answered as written: the server takes it as a deny). Such a request that comes
  after the last step (as the session ends) fails the end of the session: a result of its own,
  after the steps', whose step is of the kind ``END`` (not a step of the script). A request of any
  other method (this server sends none) is judged only when a respond line names it: else the
  client refuses it (-32601, method not found) and no step fails. ``"unanswered": true`` instead
  of a result leaves the requests it fits unanswered for the rest of the session.

``"raw": true`` (written by ``--record`` on what a faulty client sent) takes a request, notify or
respond line as written: its fields' types and shapes are not checked, nor a permission answer
against the request's options.

Patterns are matched by :mod:`.matcher` (``"$*"`` is a literal ``*``); ``${name}`` anywhere in a
step is a saved value (in a pattern, ``expect`` or ``match``, it matches as itself: a saved ``"*"``
is no wildcard), and ``$${`` a literal ``${``. ``${cwd}`` is defined from the start: the
server's working directory.
A line ``{"recordedModels": {...}}`` (written by ``--record``) is not a step: it holds the
recorded model turns, used by ``replay --scripted`` to replay without the real models; they are
held to what a ``scripted`` model takes when the script loads (a malformed turn is a
:class:`ScriptError` naming the file, the line and the turn; a lone ``"${name}"`` is taken
wherever it stands, substituted with the request that carries the model).
"""

from __future__ import annotations

import codecs
import copy
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

from .matcher import (ANY, Mismatch, PathError, UnknownName, describe_mismatches, did_you_mean, first_mismatch,
                      get_path, is_name, literal, mismatches, misspelt, nearest, notification_miss, references, short,
                      substitute, whole_reference)

DEFAULT_STEP_TIMEOUT_S = 60.0
#: the longest a step may wait (``timeoutMs``, ``--timeout``): one day; a longer wait is a typo
#: (``1e300``), and the clock's waits refuse one past what ``time_t`` holds
MAX_TIMEOUT_MS = 86_400_000
#: expectNotification without timeoutMs: most notifications a script waits for came before the
#: answer to the request that caused them, so a long wait only delays the report of a miss
DEFAULT_NOTIFICATION_TIMEOUT_S = 10.0
DIVERGED_WAIT_S = 1.0   # how long expectNotification waits once an earlier step has failed
#: the end of a replay (a script that ends without stopping the server itself): how long the
#: replay waits for the answer to its ``shutdown`` (at most the step time-out)
SHUTDOWN_WAIT_S = 5.0
#: ... then for the server to exit after ``exit`` and the end of its input (it answered, or was not
#: asked: it may be flushing its state)
EXIT_WAIT_S = 10.0
#: ... for a server that did not answer ``shutdown``: it is killed this long after ``exit``
EXIT_GRACE_S = 1.0
#: interrupted (Ctrl+C): SIGTERM to the server (as the terminal would have sent it SIGINT), SIGKILL this long after
INTERRUPT_GRACE_S = 2.0
#: once the server has ended: how long the replay waits for the client to have read the rest of its
#: output and answered the server-to-client requests on it (at once, unless something else holds
#: the server's output open), so that one that came as the session ended is judged too
END_DRAIN_S = 1.0
#: the kind of the result that judges what came after the last step (a server-to-client request
#: no respond line answers, or answered with what it did not offer): not a step of the script
END = "end"
STEP_KINDS = ("request", "notify", "expectNotification", "respond", "await")
_STEP_KEYS = {
    "request": {"request", "params", "expect", "save", "timeoutMs", "id", "wait", "cancelAfterModelCalls",
                "cancelAfterServerRequests", "answered", "raw"},
    "await": {"await", "timeoutMs"},
    "notify": {"notify", "params", "raw"},
    "expectNotification": {"expectNotification", "match", "timeoutMs", "save"},
    "respond": {"respond", "match", "result", "error", "unanswered", "raw"},
}
#: the fields that hold one value only: (field, value, what it says)
_FLAGS = (("raw", True, "the step is sent as written, unchecked"),
          ("unanswered", True, "the request is left unanswered"),
          ("answered", False, "a request whose answer is not judged"))
#: the fields of a step that are patterns (:mod:`.matcher`)
_PATTERN_KEYS = ("expect", "match")
MODELS_KEY = "recordedModels"
#: the workDoneToken the replay gives a request it must watch (cancelAfterModelCalls) when it has none
WATCH_TOKEN_PREFIX = "operate-sidecar replay: request "


class ScriptError(ValueError):
    """The script itself is malformed (reported before anything runs)."""


@dataclass
class Step:
    line: int
    kind: str
    method: str
    data: dict[str, Any]

    @property
    def label(self) -> str:
        if self.kind == END:
            return f"the end of the session (after line {self.line})"
        if self.kind == "await":
            return f"line {self.line}: await {short(self.data['await'], 60)}"
        return f"line {self.line}: {self.kind} {self.method}"


@dataclass
class StepResult:
    step: Step
    ok: bool
    detail: str = ""                 # one line: what was expected and what came
    mismatch: Mismatch | None = None
    got: Any = None

    def line(self) -> str:
        word = "PASS" if self.ok else "FAIL"
        text = f"{word} {self.step.label}" + (f": {self.detail}" if self.detail else "")
        # (a lone surrogate a script's string holds, half an emoji, is shown as its escape: it has no UTF-8 form)
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class Script:
    steps: list[Step]
    recorded_models: dict[str, Any] = field(default_factory=dict)


def parse_script(lines: Iterable[str], source: str = "script") -> Script:
    steps: list[Step] = []
    models: dict[str, Any] = {}
    unawaited: dict[str, int] = {}   # id (JSON) of a "wait": false request -> its line
    saved = {"cwd"}                  # the names a step may refer to: ${cwd} and those earlier lines save
    for n, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text, parse_constant=_not_a_number)
        except json.JSONDecodeError as e:
            raise ScriptError(f"{source}:{n}: not JSON: {_not_json(text, e)}") from None
        except ValueError as e:  # NaN, Infinity: Python reads them, JSON has no such number, nor can the step send one
            raise ScriptError(f"{source}:{n}: not JSON: {e}") from None
        except RecursionError:
            raise ScriptError(f"{source}:{n}: not a script step: nested too deeply (more than "
                              f"{MAX_DEPTH} arrays or objects inside each other)") from None
        if _depth(obj) > MAX_DEPTH:  # deep enough to fail later (substituted, matched, sent): refused now
            raise ScriptError(f"{source}:{n}: not a script step: nested too deeply (more than "
                              f"{MAX_DEPTH} arrays or objects inside each other)")
        if not isinstance(obj, dict):
            hint = "; a JSON array of steps is not a script: write each step on a line of its own" \
                if isinstance(obj, list) and obj and all(isinstance(o, dict) for o in obj) else ""
            raise ScriptError(f"{source}:{n}: a step must be a JSON object, got {short(obj, 60)}{hint}")
        if MODELS_KEY in obj:
            if not isinstance(obj[MODELS_KEY], dict):
                raise ScriptError(f"{source}:{n}: {MODELS_KEY} must be an object")
            for name, recorded in obj[MODELS_KEY].items():
                problem = _recorded_model_problem(name, recorded)
                if problem:
                    raise ScriptError(f"{source}:{n}: {problem}")
            models.update(obj[MODELS_KEY])
            continue
        kinds = [k for k in STEP_KINDS if k in obj]
        if len(kinds) != 1:
            if kinds:
                found = f" (found {', '.join(kinds)})"
            else:  # name what is there: a misspelt kind, or a step of a kind that does not exist
                found = f" (found none; its key(s): {', '.join(map(str, obj)) or 'none'})"
                meant = next(filter(None, (did_you_mean(k, STEP_KINDS) for k in obj)), None)
                found += f"; did you mean {meant}?" if meant else ""
            raise ScriptError(f"{source}:{n}: a step has exactly one of " + ", ".join(STEP_KINDS) + found)
        kind = kinds[0]
        method = obj[kind]
        if kind == "await":
            key = json.dumps(method)
            if isinstance(method, bool) or not isinstance(method, (int, str)) or key not in unawaited:
                raise ScriptError(f"{source}:{n}: await names the id of an earlier request sent with "
                                  f'"wait": false and not awaited yet, got {short(method, 60)}')
            method = f"line {unawaited.pop(key)}"
        elif not isinstance(method, str) or not method:
            raise ScriptError(f"{source}:{n}: {kind} must name a method")
        elif kind in ("respond", "expectNotification"):
            problem = _misspelt_method(kind, method)
            if problem:
                raise ScriptError(f"{source}:{n}: {problem}")
        unknown = sorted(set(obj) - _STEP_KEYS[kind])
        if unknown:
            raise ScriptError(f"{source}:{n}: unknown field(s) for a {kind} step: "
                              + ", ".join(misspelt(k, _STEP_KEYS[kind]) for k in unknown))
        if kind == "request" and "expect" in obj:
            exp = obj["expect"]
            if not isinstance(exp, dict) or len(set(exp) & {"result", "error"}) != 1 or set(exp) - {"result", "error"}:
                raise ScriptError(f'{source}:{n}: expect must be {{"result": ...}} or {{"error": ...}}')
        if "save" in obj and (not isinstance(obj["save"], dict)
                              or not all(isinstance(v, str) for v in obj["save"].values())):
            raise ScriptError(f'{source}:{n}: save must be {{"name": "path.in.result"}}')
        for flag, value, meaning in _FLAGS:
            if flag in obj and obj[flag] is not value:
                raise ScriptError(f"{source}:{n}: {flag} can only be {json.dumps(value)} ({meaning})")
        if "unanswered" in obj:
            if "result" in obj or "error" in obj:
                raise ScriptError(f"{source}:{n}: a respond with unanswered true has no result or error")
        elif kind == "respond" and ("result" in obj) == ("error" in obj):
            raise ScriptError(f"{source}:{n}: respond needs a result or an error (or \"unanswered\": true)")
        if "timeoutMs" in obj and (not isinstance(obj["timeoutMs"], (int, float)) or isinstance(obj["timeoutMs"], bool)
                                   or not 0 < obj["timeoutMs"] <= MAX_TIMEOUT_MS):
            raise ScriptError(f"{source}:{n}: timeoutMs must be a positive number of milliseconds, at most "
                              f"{MAX_TIMEOUT_MS} (one day), got {short(obj['timeoutMs'], 60)}")
        for field_ in ("cancelAfterModelCalls", "cancelAfterServerRequests"):
            if field_ not in obj:
                continue
            calls = obj[field_]
            if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
                raise ScriptError(f"{source}:{n}: {field_} must be a positive integer")
            if "id" not in obj:
                raise ScriptError(f"{source}:{n}: {field_} needs the request's id (the cancel names it)")
        if "answered" in obj and ("expect" in obj or "save" in obj):
            raise ScriptError(f"{source}:{n}: a request with answered false has no expect or save")
        problem = None if obj.get("raw") else step_problem(kind, method, obj)
        if problem:
            raise ScriptError(f"{source}:{n}: {problem}")
        if kind == "request" and "id" in obj and json.dumps(obj["id"]) in unawaited:
            raise ScriptError(f"{source}:{n}: id {short(obj['id'], 60)} is the id of the request of line "
                              f"{unawaited[json.dumps(obj['id'])]}, still in flight (not awaited yet); "
                              "give this one another id")
        if kind == "request" and obj.get("wait") is False and "id" in obj and "answered" not in obj:
            unawaited[json.dumps(obj["id"])] = n
        for name in sorted(references(obj) - saved):  # a misspelt name, or one saved only later
            meant = did_you_mean(name, saved)
            raise ScriptError(f"{source}:{n}: ${{{name}}} is not saved by an earlier line"
                              + (f" (did you mean ${{{meant}}}?)" if meant else "")
                              + "; names it may use: " + ", ".join(sorted(saved))
                              + f" (a step's \"save\" names a value; $${{{name}}} is the text ${{{name}}} itself)")
        saved |= set(obj.get("save") or ())
        steps.append(Step(n, kind, method, obj))
    if not steps:  # an empty file (a recording of a session that sent nothing): it would pass checking nothing
        raise ScriptError(f"{source}: no steps: a session script has at least one step (one JSON object per line)")
    return Script(steps, models)


#: how deeply a step's arrays and objects may nest: the matcher, the substitution and the JSON
#: encoder recurse, and Python's recursion limit is 1000 frames
MAX_DEPTH = 200


def _not_a_number(word: str) -> NoReturn:
    raise ValueError(f"{word} is not a JSON number")


def _depth(value: Any) -> int:
    """How deeply ``value``'s arrays and objects nest (level by level, not recursing: a deep one
    is what is looked for), counted up to one more than :data:`MAX_DEPTH`."""
    depth, level = 0, [value]
    while depth <= MAX_DEPTH:
        containers = [x for x in level if isinstance(x, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]
    return depth


def step_problem(kind: str, method: Any, obj: dict[str, Any]) -> str | None:
    """What is wrong, as far as can be known when the script loads, with the types and shapes of
    a step's fields (:func:`_shape_problem`, a ``respond`` line's result or error); None when
    nothing. ``--record`` marks a step of which this finds something ``"raw": true``: what a
    faulty client sent, which the replay sends as written."""
    shape = _shape_problem(kind, method, obj, references_taken=True)
    if shape:
        return shape[0]
    if kind == "respond" and "error" in obj:
        return _error_problem(obj["error"])
    return _result_problem(method, obj["result"]) if kind == "respond" and "result" in obj else None


#: the fields of a recorded model's entry in a ``recordedModels`` line (as ``--record`` writes it)
_RECORDED_MODEL_KEYS = ("responses", "cli", "inline")


def _recorded_model_problem(name: str, recorded: Any) -> str | None:
    """What is wrong with the recorded turns of the model ``name`` (its entry in a
    ``recordedModels`` line: ``{"responses": [...], "cli"?: true, "inline"?: {...}}``); None
    when nothing. Its ``responses`` are held to what a ``scripted`` model takes, by the check the
    server's ``initialize`` makes (docs/PROTOCOL.md §2): a malformed turn (``txt`` for ``text``)
    is refused when the script loads, naming it, instead of failing ``initialize`` with -32602
    under ``replay --scripted`` and every later step with it. A lone ``"${name}"`` is taken
    wherever it stands, as ``inline``, ``responses`` or ``cli``, as a turn, or in a turn or a
    CLI run's event (known only once substituted: :func:`_unsubstituted`)."""
    from operate_sidecar.server.models.config import config_problem

    where = f"{MODELS_KEY}.{name}"
    if not isinstance(recorded, dict):
        return (f'{where} must be an object, {{"responses": [the model\'s turns], "cli"?: true, "inline"?: {{...}}}}, '
                f"got {short(recorded, 60)}")
    unknown = sorted(set(recorded) - set(_RECORDED_MODEL_KEYS))
    if unknown:
        return f"{where}: unknown field(s) " + ", ".join(misspelt(k, _RECORDED_MODEL_KEYS) for k in unknown)
    inline = recorded.get("inline")
    if inline is not None and not isinstance(inline, dict) and not whole_reference(inline):
        return f"{where}.inline must be an object, the model spec given inline, got {short(inline, 60)}"
    responses, cli = recorded.get("responses"), recorded.get("cli")
    config = {"provider": "scripted", "responses": None if whole_reference(responses) else _unsubstituted(responses),
              "cli": True if whole_reference(cli) else cli}  # (a CLI run's events are taken with cli: true)
    problem = config_problem(config)
    return f"{where}.{problem}" if problem else None


def _unsubstituted(responses: Any) -> Any:
    """A recorded model's ``responses`` as they can be checked before they are substituted: a lone
    ``"${name}"`` stands for any value, so it is left out where the check would take it for a
    string of its own: a turn or an event that is one, a field of a turn or of an event whose
    value is one and that holds something else than a string (``delayMs``, ``events``, a
    ``tool_use``'s ``input``), an event whose ``type`` is one (what it holds depends on its
    type). In a string's place it stays (a string, as written); so does a misspelt field, named."""
    from operate_sidecar.server.models.config import ENTRY_FIELDS, EVENT_FIELDS

    def fields(obj: dict[str, Any], kinds: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in obj.items() if not (whole_reference(v) and kinds.get(k, "string") not in
                                                     ("string", "any"))}

    def event(e: Any) -> Any:
        return fields(e, EVENT_FIELDS.get(e.get("type"), {})) if isinstance(e, dict) else e

    if not isinstance(responses, list):
        return responses
    out = []
    for entry in responses:
        if whole_reference(entry):
            continue
        if isinstance(entry, dict):
            entry = fields(entry, ENTRY_FIELDS)
            if isinstance(entry.get("events"), list):
                entry["events"] = [event(e) for e in entry["events"] if not whole_reference(e)
                                   and not (isinstance(e, dict) and whole_reference(e.get("type")))]
        out.append(entry)
    return out


def _misspelt_method(kind: str, method: str) -> str | None:
    """A ``respond`` or ``expectNotification`` method that is no method the server sends but is
    close to one (``requestToolPermision``): said when the script loads. Such a respond line
    was taken as a standing answer that nothing ever asked for (reported PASS), and such a wait
    ran out its whole time-out; the failure that followed did not say why. A name far from
    every known one is left alone (a server of another protocol, after ``--``)."""
    from operate_sidecar.protocol import NOTIFICATIONS, SERVER_NOTIFICATIONS, SERVER_TO_CLIENT_REQUESTS

    known = set(SERVER_TO_CLIENT_REQUESTS) if kind == "respond" else set(SERVER_NOTIFICATIONS) | set(NOTIFICATIONS)
    if method in known:
        return None
    meant = did_you_mean(method, known)
    if meant is None:
        return None
    what = "request" if kind == "respond" else "notification"
    return f"{kind} {json.dumps(method)}: the server sends no such {what}; did you mean {meant}?"


def _error_problem(err: Any) -> str | None:
    if not isinstance(err, dict) or not isinstance(err.get("code"), int) or isinstance(err.get("code"), bool) \
            or not isinstance(err.get("message"), str) or set(err) - {"code", "message", "data"}:
        return f'a respond error is a JSON-RPC error, {{"code": integer, "message": "text", "data"?: any}}, ' \
               f"got {short(err, 60)}"
    return None


def _shape_problem(kind: str, method: Any, obj: dict[str, Any],
                   references_taken: bool) -> tuple[str, tuple[str, ...]] | None:
    """What is wrong with the type of a field of a step whose type the protocol fixes (an object
    where it says ``{...}``, an id, ``wait``, the names ``save`` gives), and the field's path in
    the step; None when nothing. A pattern may be ``"*"`` (anything); with ``references_taken``
    (when the script loads) a string that is exactly ``"${name}"`` stands for any type: the
    step checks it again once substituted."""
    def an_object(value: Any, pattern: bool = False) -> bool:
        return (isinstance(value, dict) or (pattern and value == ANY)
                or (references_taken and whole_reference(value)))

    if "match" in obj and not an_object(obj["match"], pattern=True):
        whose = "notification's" if kind == "expectNotification" else "request's"
        out = "for any params" if kind == "expectNotification" else f"to answer every {method}"
        return (f"match must be a JSON object, a pattern for the {whose} params (the keys it names must match; "
                f"leave match out {out}), got {short(obj['match'], 60)}", ("match",))
    # params: JSON-RPC's are an object or an array (the server answers an array itself, with an
    # error a script may expect); a respond result may be null (what a client answers to a
    # request whose result holds nothing, fs/writeTextFile, and --record writes it so)
    if "params" in obj and not (an_object(obj["params"]) or isinstance(obj["params"], list)):
        whose = "request's" if kind == "request" else "notification's"
        return (f"params must be a JSON object, the {whose} named parameters (leave params out for none), "
                f"got {short(obj['params'], 60)}", ("params",))
    if kind == "respond" and "result" in obj and not (an_object(obj["result"]) or obj["result"] is None):
        return ('a respond result must be a JSON object, the result the client answers with (requestToolPermission: '
                f'{{"decision": "allow_once"}}), got {short(obj["result"], 60)}', ("result",))
    expect = obj.get("expect")
    if isinstance(expect, dict) and "error" in expect and not an_object(expect["error"], pattern=True):
        return ('expect\'s error must be a JSON object, a pattern for the error answer ({"code": -32012}; "*" for '
                f"any error), got {short(expect['error'], 60)}", ("expect", "error"))
    if kind == "request" and "id" in obj and (isinstance(obj["id"], bool) or not isinstance(obj["id"], (int, str))):
        return f"id must be a string or an integer (the request's JSON-RPC id), got {short(obj['id'], 60)}", ("id",)
    if "wait" in obj and not isinstance(obj["wait"], bool):
        return f"wait must be true or false, got {short(obj['wait'], 60)}", ("wait",)
    save = obj.get("save")
    for name in save if isinstance(save, dict) else ():
        if not is_name(name):
            return ("save names a value that a later ${name} refers to: letters, digits, _, . and -, starting "
                    f"with a letter or _, got {name!r}", ("save",))
    return None


def _result_problem(method: str, result: Any) -> str | None:
    """What is wrong, as far as can be known when the script loads, with the ``result`` a
    ``respond`` line gives to the server-to-client request ``method``: it is held to the result
    type protocol/ declares for that request (``SERVER_TO_CLIENT_REQUESTS``: ``{"decision":
    ...}``, ``{"output": ...}``, ``{"text": ...}``, ``{}``), field by field, with the protocol's
    own converter. A value that holds a ``${name}`` is what it is only once substituted: a lone
    ``"${name}"`` stands for any value, a longer string for a string. None when nothing is
    wrong, or when the protocol declares no such request. Without it, a result of another shape
    is sent as written and the server takes it as an error or a failed tool (a permission
    answer as a deny, a file read as failed): the script would test that path unawares."""
    from operate_sidecar.protocol import SERVER_TO_CLIENT_REQUESTS

    if method not in SERVER_TO_CLIENT_REQUESTS or whole_reference(result) or not isinstance(result, (dict, type(None))):
        return None   # not a request the protocol declares; a lone ${name}; not an object (said by _shape_problem)
    cls = SERVER_TO_CLIENT_REQUESTS[method][1]
    problems = _wire_problems(cls, {} if result is None else result, "result")  # null: a result that holds nothing
    if not problems:
        return None
    return (f"a respond result for {method} must be {_wire_shape(cls)}, as docs/PROTOCOL.md declares it, got "
            f"{short(result, 60)}: " + "; ".join(problems))


def _wire_problems(cls: type, value: dict[str, Any], path: str) -> list[str]:
    """Every field of ``value`` that the wire type ``cls`` does not take (a missing one, with
    the unknown fields beside it, a value of another type), named by its path; values holding a
    ``${name}`` are taken (see :func:`_result_problem`)."""
    import attrs

    from operate_sidecar.protocol import ParamsError, describe_type
    from operate_sidecar.protocol.convert import wire_fields

    fields = wire_fields(cls)
    known = {f.key for f in fields}
    # a field the type does not know is named only beside a missing one (a misspelt field): on
    # its own the server ignores it, and a client's answer recorded with one (--record) must load
    unknown = [f"{path}.{k}: unknown field" + (f" (did you mean {meant}?)" if (meant := did_you_mean(k, known))
                                               else "") for k in value if k not in known]
    problems: list[str] = []
    for f in fields:
        where = f"{path}.{f.key}"
        if f.key not in value:
            if f.required:
                problems += [*unknown, f"{where}: missing"]
                unknown = []
            continue
        v = value[f.key]
        if references(v) or f.hook is None:  # known once substituted (a lone ${name} may be of any type)
            continue
        v = substitute(v, {})  # $${ is a literal ${
        if v is None and not f.any_json:
            if not f.nullable:
                problems.append(f"{where}: expected {describe_type(f.type)}, got null")
            continue
        if attrs.has(f.type) and isinstance(v, dict):
            problems += _wire_problems(f.type, v, where)
            continue
        try:
            f.hook(v, f.type)
        except ParamsError as e:
            inner = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
            problems.append(f"{where}{inner}: {e.detail}")
    return problems


def _wire_shape(cls: type) -> str:
    """A wire type's fields in words, from its declaration: ``{"text": string}``."""
    from operate_sidecar.protocol import describe_type
    from operate_sidecar.protocol.convert import wire_fields

    return "{" + ", ".join(f'"{f.key}"{"" if f.required else "?"}: {describe_type(f.type)}'
                           for f in wire_fields(cls)) + "}"


def _not_json(text: str, error: json.JSONDecodeError) -> str:
    """Why a line of a script is not JSON, in words for the usual mistakes: a pretty-printed
    (multi-line) step, a comment, a comma between steps."""
    if text.startswith(("#", "//")):
        return "a session script has no comments (JSON Lines: one JSON object per line, nothing else)"
    if text.endswith(","):
        try:
            json.loads(text[:-1])
            return "a comma after the step; JSON Lines have nothing between the lines' objects"
        except ValueError:
            pass
    if error.pos >= len(text):  # the line ends inside a value: the step goes on on the next lines
        return ("the line ends inside a JSON value; each step must be one whole JSON object on one line "
                "(JSON Lines: a pretty-printed, multi-line object is not; write each step with json.dumps(), "
                "or jq -c)")
    return f"{error.msg} at column {error.colno}"


def load_script(path: str | os.PathLike[str], shown: str | None = None) -> Script:
    """Read and parse a script (a UTF-8 byte-order mark at its start is ignored); text that is not
    UTF-8 is a :class:`ScriptError` naming the line. ``shown`` is the name its errors give the
    file (``path`` by default; a file that cannot be read is named by ``path``, as opened)."""
    shown = os.fspath(path) if shown is None else shown
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:  # in words: the path as given and where that is, not "[Errno 2] ..."
        raise ScriptError(_unreadable(path, e)) from None
    raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark, as Windows editors write one
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        before = raw[:e.start].decode("utf-8")  # line breaks as reading the file as text counts them
        line = before.replace("\r\n", "\n").replace("\r", "\n").count("\n") + 1
        raise ScriptError(f"{shown}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}: "
                          f"{e.reason}); a session script is UTF-8 JSON Lines") from None
    return parse_script(io.StringIO(text, newline=None), shown)


def _unreadable(path: str | os.PathLike[str], error: OSError) -> str:
    """Why the script file cannot be read: the path as given, and for a relative one the path it
    is from the working directory."""
    given = os.fspath(path)
    where = "" if os.path.isabs(given) else \
        f" ({os.path.abspath(given)}: a relative path is from the working directory, {os.getcwd()})"
    if isinstance(error, FileNotFoundError):
        return f"no session script {given!r}{where}"
    why = {IsADirectoryError: "it is a directory, not a file", PermissionError: "permission denied"}.get(
        type(error), error.strerror or str(error))
    return f"cannot read the session script {given!r}{where}: {why}"


# --------------------------------------------------------------------------- --scripted
def scripted_models(recorded: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict]]:
    """Recorded model turns → (``settings.models`` entries by configured name,
    {canonical inline spec JSON: scripted config}) for ``replay --scripted``."""
    named: dict[str, Any] = {}
    inline: dict[str, dict] = {}
    for name, rec in recorded.items():
        responses, cli = rec.get("responses"), rec.get("cli")
        # a lone ${name} is put in as it is: substituted with the request that carries the model
        config: dict[str, Any] = {"provider": "scripted",
                                  "responses": responses if whole_reference(responses) else list(responses or [])}
        if cli:
            config["cli"] = cli if whole_reference(cli) else True
        if rec.get("inline") is not None:
            inline[_canon(rec["inline"])] = config
        else:
            named[name] = config
    return named, inline


def _canon(spec: Any) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def apply_scripted(script: Script, source: str = "script") -> None:
    """Rewrite the script's requests so that every recorded model is a ``scripted`` one: the
    models configured by name go into every ``initialize``'s ``settings.models`` (an
    ``initialize`` without params, with ``{}`` or with ``"settings": null`` gets them too: the
    server takes those as no settings), a model given inline is replaced where it is given. An
    ``initialize`` whose ``settings`` (or ``settings.models``) is neither an object nor null is
    sent as written: the server refuses it, as it did when recorded. One whose params, settings
    or models are a lone ``"${name}"`` (known only once substituted) is a :class:`ScriptError`
    (``source`` names the file): the models cannot be put in."""
    if not script.recorded_models:
        raise ScriptError(f"{source}: the script holds no recorded model turns, no {MODELS_KEY} line "
                          "(record it with --record)")
    named, inline = scripted_models(script.recorded_models)
    for step in script.steps:
        if step.kind != "request":
            continue
        if step.method == "initialize" and named:
            _put_models(step, named, source)
        params = step.data.get("params")
        if not isinstance(params, dict):
            continue
        for key in ("chatModel", "parseModel"):
            spec = params.get(key)
            if isinstance(spec, dict) and _canon(spec) in inline:
                params[key] = copy.deepcopy(inline[_canon(spec)])


def _put_models(step: Step, named: dict[str, Any], source: str) -> None:
    """Put the scripted ``named`` models in an ``initialize`` step's ``settings.models`` (see
    :func:`apply_scripted`)."""
    where: list[str] = []
    holder: Any = step.data
    for key in ("params", "settings", "models"):
        value = holder.get(key)
        if whole_reference(value):
            path = ".".join([*where, key])
            raise ScriptError(f"{source}:{step.line}: replay --scripted puts the recorded models in initialize's "
                              f"params.settings.models, but {path} is {value}, known only once substituted; "
                              "write it out as an object")
        if value is None:  # none, or null: the server takes either as none
            value = holder[key] = {}
        if not isinstance(value, dict):  # refused by the server, as when recorded: sent as written
            return
        where.append(key)
        holder = value
    holder.update(copy.deepcopy(named))


# --------------------------------------------------------------------------- running
@dataclass
class _Answers:
    """The standing answer of one respond line, or of several in a row with the same method and
    the same ``match`` (``--record`` writes one per answer when a call was answered differently
    within one operate): given in turn, the first to the first request that fits, the last to
    every request after those."""
    match: Any
    answers: list[tuple[dict[str, Any], int]]   # (answer, line)
    given: int = 0

    def next(self) -> tuple[dict[str, Any], int]:
        answer = self.answers[min(self.given, len(self.answers) - 1)]
        self.given += 1
        return answer


class _Standing:
    def __init__(self) -> None:
        self.answers: dict[str, list[_Answers]] = {}   # method -> its standing answers, in the script's order
        self.seen: list[tuple[str, Any]] = []
        #: server-to-client requests no ``respond`` line answered (they got -32601): each fails the
        #: step reported next, the one that was running when it came (after the last step: the end)
        self.unanswered: list[tuple[str, Any, str, int]] = []   # (method, params, why, nearest line)
        #: answers a respond line gave that the request did not offer (a decision not among its
        #: options): each fails the step reported next, as an unanswered request does
        self.wrong: list[str] = []
        self.lock = threading.Lock()

    def refuse(self, method: str, params: Any, why: str, near: int = 0) -> NoReturn:
        """Answer a server-to-client request the script has no answer for with -32601, and keep it
        for the report (the step it came during fails: the session went another way). ``near``:
        the respond line whose match came nearest, when some were held to it."""
        from operate_sidecar.clients.python.client import RpcError

        with self.lock:
            self.unanswered.append((method, params, why, near))
        raise RpcError(-32601, f"the session script has no answer to {method}: {why}")


def _same(a: Any, b: Any) -> bool:
    """Two ``match`` patterns (substituted) are the same."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _not_offered(method: str, params: Any, answer: dict[str, Any], line: int) -> str:
    """Why the answer of the respond line ``line`` is not one the request offered (``""`` when it
    is): a ``requestToolPermission`` answer's ``decision`` must be one of the request's
    ``options``; any other (a typo, ``"allow"``, none) the server takes as a deny, so a script
    that meant to allow would test the deny path unawares."""
    if method != "requestToolPermission" or "result" not in answer or not isinstance(params, dict):
        return ""
    offered = params.get("options")
    if not isinstance(offered, list):  # a server that offers no list: nothing to hold the answer to
        return ""
    result = answer["result"]
    decision = result.get("decision") if isinstance(result, dict) else None
    if isinstance(decision, str) and decision in offered:
        return ""
    given = f"decision {short(decision, 60)}" if isinstance(result, dict) and "decision" in result \
        else f"no decision ({short(result, 60)})"
    tool = f" (tool {params['tool']})" if isinstance(params.get("tool"), str) else ""
    return (f"line {line} answered {method}{tool} with {given}, not one of the decisions it offered: "
            f"{', '.join(map(str, offered))}; the server took it as a deny (to deny, answer \"deny_once\" or "
            "an error)")


def _bad_exit(code: int | None, shutdown: bool, line: int, ending: str | None) -> str:
    """How the server ended after the script's own ``exit`` (line ``line``) when that is not as
    docs/PROTOCOL.md says (code 0 after ``shutdown``, 1 without), in words; ``""`` when it is."""
    expected = 0 if shutdown else 1
    if ending:  # it did not exit in time: killed
        return f"after the script's exit (line {line}), {ending}"
    if code == expected:
        return ""
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return (f"after the script's exit (line {line}), the server {how} (expected {expected}: exit "
            f"{'after' if shutdown else 'without'} shutdown)")


class ServerStartError(OSError):
    """The server command could not be started."""


def default_server_argv() -> list[str]:
    return [sys.executable, "-m", "operate_sidecar.server"]


class Runner:
    """Runs one script against one fresh server process."""

    def __init__(self, script: Script, server_argv: list[str] | None = None, *,
                 step_timeout: float = DEFAULT_STEP_TIMEOUT_S, env: dict[str, str] | None = None,
                 cwd: str | None = None, on_result: Callable[[StepResult], None] | None = None,
                 timeout_option: str = "run with --timeout S") -> None:
        self.script = script
        self.timeout_option = timeout_option  # how the user of the runner sets step_timeout, for a time-out's hint
        self.argv = list(server_argv or default_server_argv())
        self.step_timeout = step_timeout
        self.env = env
        self.cwd = cwd
        self.on_result = on_result
        # ${cwd}: the server's working directory (a recording writes the paths under its own with it)
        self.saved: dict[str, Any] = {"cwd": os.path.abspath(cwd) if cwd else os.getcwd()}
        self.results: list[StepResult] = []
        self._standing = _Standing()
        self._matched: dict[int, int] = {}  # index into client.notifications -> line of the step that matched it
        self.stderr_tail = ""
        self._unawaited: list[tuple[Step, dict, Any]] = []   # "wait": false requests in flight
        self._abandoned: list[Any] = []     # "answered": false requests: never judged
        # cancelAfterModelCalls, cancelAfterServerRequests: request id (JSON) -> (its workDoneToken, the
        # number of notifications when it was sent, model calls to wait for, server-to-client requests
        # of the session to wait for, pending, the operates of its token it waits for: ``_ahead``, its line)
        self._watched: dict[str, tuple[Any, int, int, int, Any, list[Any], int]] = {}
        self._hidden_tokens: set[str] = set()   # tokens the replay added: their $/progress is no step's
        self._sent: list[tuple[Step, Any, Any]] = []   # every request sent: (its step, params as sent, pending)
        self._server_requests = 0           # server-to-client requests so far (under client._cond)
        self._exit_line = 0                 # the line the script sent ``exit`` on itself (0: it did not)
        self._shutdown_sent = False         # the script sent ``shutdown`` itself (then exit is code 0)
        #: how the server ended after the script's own ``exit``, when not as the protocol says
        #: (code 0 after shutdown, else 1): it fails the end of the session
        self._bad_exit = ""
        #: how the server ended when that was not clean (it did not answer shutdown, did not exit
        #: and was killed), for the report; None when it exited by itself
        self.ending: str | None = None
        taken = {json.dumps(s.data["id"]) for s in script.steps if "id" in s.data}
        taken |= {json.dumps(s.data["params"].get("id")) for s in script.steps  # a cancel never hits another
                  if s.kind == "notify" and s.method == "$/cancelRequest" and isinstance(s.data.get("params"), dict)}
        self._ids = (i for i in itertools.count(1) if json.dumps(i) not in taken)  # never a scripted id

    # ------------------------------------------------------------------ public
    def run(self) -> bool:
        from operate_sidecar.clients.python.client import SidecarClient
        from operate_sidecar.protocol.methods import CLIENT_REQUESTS

        with tempfile.TemporaryFile() as err:
            if self.cwd is not None and not os.path.isdir(self.cwd):  # else said as the server command missing
                raise ServerStartError(f"cannot start the server in {os.fspath(self.cwd)!r}: "
                                       f"{'not a directory' if os.path.exists(self.cwd) else 'no such directory'} "
                                       f"(the working directory given for the server)")
            try:
                self.client = SidecarClient(argv=self.argv, env=self.env, cwd=self.cwd, stderr=err)
            except OSError as e:
                hint = ""
                if self.argv[0].startswith("-"):  # flags for this sidecar, given without the command
                    hint = ("; the server command starts with its program, then its flags: "
                            "operate-sidecar --config settings.toml after --, or "
                            "server_command('--config', 'settings.toml') from operate_sidecar.testing in a test")
                raise ServerStartError(f"cannot start the server {' '.join(self.argv)!r}: {e}{hint}") from None
            for method in CLIENT_REQUESTS:  # until a respond line answers it: refused, and the step fails
                self.client.on_request(method, self._unscripted(method))
            interrupted = True
            try:
                for step in self.script.steps:
                    if step.method in ("shutdown", "exit") and step.kind in ("request", "notify"):
                        self._judge_unawaited()  # their answers come before the server stops
                    res = self._run_step(step)
                    if res is None:  # a request sent without waiting: judged later
                        continue
                    self._report(res)
                self._judge_unawaited()
                self.results.sort(key=lambda r: r.step.line)
                interrupted = False
            finally:
                self._close(interrupted)
                err.seek(0)
                self.stderr_tail = "\n".join(err.read().decode("utf-8", "replace").splitlines()[-30:])
            self._report_end()
        return all(r.ok for r in self.results)

    def _unscripted(self, method: str) -> Callable[[Any], Any]:
        def handler(params: Any) -> Any:
            self._asked()
            self._standing.refuse(method, params, "no respond line answers it")
        return handler

    def _problems(self, line: int | None) -> list[str]:
        """The server-to-client requests since the last report that no respond line answered, or
        answered with what they did not offer, in words (and takes them): those that came while
        the step of ``line`` ran, or (None) after the last step, as the session ended."""
        standing = self._standing
        with standing.lock:
            unanswered, standing.unanswered = standing.unanswered, []
            wrong, standing.wrong = standing.wrong, []
        after = " after the last step" if line is None else ""
        problems = []
        if unanswered:  # the server asked the client something the script does not answer
            method, params, why, near = unanswered[0]
            more = f" (and {len(unanswered) - 1} more such request(s))" if len(unanswered) > 1 else ""
            where = f"line {line}" if line is not None else "the request that leads to it"
            problems.append(f"the server asked {method} {short(params, 400)}{after} and {why}, so it was refused "
                            f"(-32601){more}; {f'fix the match of line {near}, or ' if near else ''}"
                            f"add a line {{\"respond\": \"{method}\", \"result\": ...}} before {where}")
        if wrong:  # a respond line answered with what the request did not offer
            problems.append(after.lstrip() + ", " * bool(after) + wrong[0]
                            + (f" (and {len(wrong) - 1} more such answer(s))" if len(wrong) > 1 else ""))
        return problems

    def _report(self, res: StepResult) -> None:
        problems = self._problems(res.step.line)
        if problems:
            problem = "; ".join(problems)
            res = StepResult(res.step, False, f"{res.detail}; {problem}" if not res.ok else problem,
                             mismatch=res.mismatch, got=res.got)
        self.results.append(res)
        if self.on_result is not None:
            self.on_result(res)

    def _report_end(self) -> None:
        """Once the server has ended: a server-to-client request that came after the last step
        was reported (while the replay ended the session, or as the server ended it) and that no
        respond line answered, or answered with what it did not offer, fails the end of the
        session, as it would have failed a step running when it came. Waits (bounded) for the
        client to have read the server's output to its end and answered what it read."""
        self.client.wait_answered(END_DRAIN_S)
        problems = self._problems(None) + ([self._bad_exit] if self._bad_exit else [])
        if not problems:
            return
        res = StepResult(Step(self.script.steps[-1].line, END, "", {}), False, "; ".join(problems))
        self.results.append(res)
        if self.on_result is not None:
            self.on_result(res)

    def _judge_unawaited(self) -> None:
        unawaited, self._unawaited = self._unawaited, []
        for step, data, pending in unawaited:
            self._report(self._judge(step, data, pending))

    @property
    def failed(self) -> list[StepResult]:
        return [r for r in self.results if not r.ok]

    # ------------------------------------------------------------------ steps
    def _timeout(self, step: Step, diverged: bool = True) -> float:
        """How long ``step`` waits (``diverged=False``: as if no earlier step had failed)."""
        ms = step.data.get("timeoutMs")
        if ms:
            timeout = float(ms) / 1000.0
        elif step.kind == "expectNotification":
            timeout = min(self.step_timeout, DEFAULT_NOTIFICATION_TIMEOUT_S)
        else:
            timeout = self.step_timeout
        if diverged and step.kind == "expectNotification" and self.failed:
            # the session has already gone another way: do not wait out every later notification
            timeout = min(timeout, DIVERGED_WAIT_S)
        return timeout

    def _run_step(self, step: Step) -> StepResult | None:
        try:
            # in a pattern (expect, match) a saved value matches as itself: a saved "*" is no wildcard
            data = {k: substitute(v, self.saved, pattern=k in _PATTERN_KEYS) for k, v in step.data.items()}
        except UnknownName as e:
            savers = [s.line for s in self.script.steps
                      if s.line < step.line and e.args[0] in (s.data.get("save") or {})]
            failed = {r.step.line for r in self.results if not r.ok}
            why = ""
            if savers and savers[-1] in failed:  # say so: the step that failed is the one to look at
                why = f": line {savers[-1]}, which saves it, failed"
            return StepResult(step, False, str(e) + why)
        shape = None if data.get("raw") else _shape_problem(step.kind, step.method, data, references_taken=False)
        if shape:  # a whole "${name}" that stood for a value of another type
            written: Any = step.data
            for key in shape[1]:
                written = written.get(key) if isinstance(written, dict) else None
            return StepResult(step, False, shape[0] + (f" (the value of {written})" if whole_reference(written) else ""))
        if self.client.proc.poll() is not None and step.kind in ("request", "notify", "expectNotification"):
            if not (step.kind == "expectNotification" and self._find(step.method, data.get("match"))[0] is not None):
                return StepResult(step, False, f"the server has exited (code {self.client.proc.returncode})")
        try:
            return getattr(self, "_" + step.kind)(step, data)
        except (BrokenPipeError, OSError) as e:
            return StepResult(step, False, f"the server is gone ({type(e).__name__}: {e})")

    def _request(self, step: Step, data: dict) -> StepResult | None:
        msg_id = data["id"] if "id" in data else next(self._ids)
        params = data.get("params")
        if step.method == "shutdown":
            self._shutdown_sent = True
        calls = data.get("cancelAfterModelCalls")
        token = None
        if calls and isinstance(params, (dict, type(None))):  # watch its model calls in its $/progress
            params = dict(params or {})
            if params.get("workDoneToken") is None:
                params["workDoneToken"] = WATCH_TOKEN_PREFIX + json.dumps(msg_id)
                self._hidden_tokens.add(json.dumps(params["workDoneToken"]))
            token = params["workDoneToken"]
        with self.client._cond:  # its own $/progress comes after this (an earlier operate's with its token before)
            since = len(self.client.notifications)
        ahead = self._ahead(token, params) if token is not None else []
        pending = self.client.request_async(step.method, params, msg_id)
        self._sent.append((step, params, pending))
        asked = data.get("cancelAfterServerRequests") or 0
        if token is not None or asked:
            self._watched[json.dumps(msg_id)] = (token, since, int(calls or 0), int(asked), pending, ahead,
                                                step.line)
        if data.get("answered") is False:  # its recorded client left before the answer: never judged
            self._abandoned.append(pending)
            return StepResult(step, True, "sent; not judged (its client left before the answer)")
        if data.get("wait") is False:
            self._unawaited.append((step, data, pending))
            return None
        return self._judge(step, data, pending)

    def _await(self, step: Step, data: dict) -> StepResult:
        """The answer to an earlier ``"wait": false`` request, judged here (reported on its line)."""
        key = json.dumps(data["await"])
        for i, (req, req_data, pending) in enumerate(self._unawaited):
            if "id" in req_data and json.dumps(req_data["id"]) == key:
                del self._unawaited[i]
                break
        else:  # the parser checked it names one: only a request that was never sent gets here
            return StepResult(step, False, f"no request with id {short(data['await'])} is in flight")
        res = self._judge(req, req_data, pending, limit=step if "timeoutMs" in data else None)
        self._report(res)
        return StepResult(step, res.ok, f"line {req.line} {'passed' if res.ok else 'failed'}")

    def _judge(self, step: Step, data: dict, pending: Any, limit: Step | None = None) -> StepResult:
        """The answer to ``step``'s request, waited for as long as ``limit`` (the ``await`` step
        with a ``timeoutMs``; by default the request's own step) says."""
        from operate_sidecar.clients.python.client import NoAnswer, RpcError

        limit = step if limit is None else limit
        timeout = self._timeout(limit)
        deadline = time.monotonic() + timeout
        try:
            while True:  # in slices, so that a server that died fails the step at once
                try:
                    result = pending.result(max(0.0, min(0.25, deadline - time.monotonic())))
                    break
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        return StepResult(step, False, self._timed_out(limit, timeout, pending.id))
                    if self.client.proc.poll() is not None and not self.client._reader.is_alive():
                        return StepResult(step, False, f"the server exited (code {self.client.proc.returncode}) "
                                                       "without answering")
            got: dict[str, Any] = {"result": result}
        except RpcError as e:
            if isinstance(e, NoAnswer):  # the client's own: the server gave none
                return StepResult(step, False, self._unanswered(e.message))
            err: dict[str, Any] = {"code": e.code, "message": e.message}
            if e.data is not None:
                err["data"] = e.data
            got = {"error": err}
        expect = data.get("expect")
        if expect is None:
            if "error" in got:
                return StepResult(step, False, f"expected a result, got error {short(got['error'])}", got=got)
            res = StepResult(step, True, "result " + short(got["result"], 100), got=got)
        else:
            which = "result" if "result" in expect else "error"
            if which not in got:
                other = "error" if which == "result" else "result"
                return StepResult(step, False, f"expected {which} {short(expect[which], 100)}, "
                                                f"got {other} {short(got[other], 200)}", got=got)
            found = list(mismatches(expect[which], got[which], f"$.{which}"))
            if found:
                return StepResult(step, False, describe_mismatches(found), mismatch=found[0], got=got)
            res = StepResult(step, True, f"{which} matched", got=got)
        problem = self._save(data.get("save"), got.get("result"))
        if problem:
            return StepResult(step, False, problem, got=got)
        return res

    def _timed_out(self, limit: Step, timeout: float, msg_id: Any) -> str:
        """A request not answered in time: cancelled, so that the server stops working on it (its
        -32800 answer is dropped) and the end of the replay does not wait for it; and how to
        give it longer."""
        if self.client.proc.poll() is None:
            try:
                self.client.cancel(msg_id)
            except OSError:  # its input is closed: it is exiting anyway
                pass
        return (f"no answer within {timeout:g} s, so it was cancelled ($/cancelRequest); "
                f"{self._wait_longer(limit, timeout)}")

    def _wait_longer(self, limit: Step, timeout: float) -> str:
        """How to give a step that waited ``timeout`` s in vain (a request, an ``await``, an
        ``expectNotification``) longer: the ``timeoutMs`` of ``limit`` (the step whose time-out it
        was), or the option that sets the step time-out (``timeout_option``) when that is what
        limited it (an expectNotification without timeoutMs waits 10 s at most, however long that is)."""
        if self._timeout(limit, diverged=False) > timeout:  # cut short: waiting longer would not help
            return f"it waited {timeout:g} s only, as an earlier step failed (the session went another way)"
        ms = limit.data.get("timeoutMs")
        if ms:
            return f'to wait longer, raise the "timeoutMs" ({ms:g})' + (
                f" of line {limit.line}" if limit.kind == "await" else "")
        option = limit.kind != "expectNotification" or self.step_timeout < DEFAULT_NOTIFICATION_TIMEOUT_S
        return 'to wait longer, give the step a "timeoutMs" (milliseconds)' + (
            f" or {self.timeout_option}" if option else "")

    def _unanswered(self, reason: str) -> str:
        """Why a request got no answer once the client stopped reading the server's output."""
        if not self.client.stream_errors:  # its output closed, it is exiting: name its exit code (briefly waited for)
            try:
                return f"the server exited (code {self.client.proc.wait(5)}) without answering"
            except subprocess.TimeoutExpired:
                pass
        return f"no answer: {reason}"

    def _save(self, save: dict[str, str] | None, value: Any) -> str:
        for name, path in (save or {}).items():
            try:
                self.saved[name] = get_path(value, path)
            except PathError as e:
                return f"save {name}: {e}"
        return ""

    def _notify(self, step: Step, data: dict) -> StepResult:
        params = data.get("params")
        problem = ""
        if step.method == "$/cancelRequest" and isinstance(params, dict):
            problem = self._await_model_calls(step, params.get("id"))
        self.client.notify(step.method, params)
        if step.method == "exit":
            self._exit_line = step.line
        return StepResult(step, not problem, problem)

    def _ahead(self, token: Any, params: Any) -> list[Any]:
        """The operates sent so far with this workDoneToken on the branch of ``params`` (an
        operate's about to be sent) that are not answered yet: it waits for them to end before
        its turn comes (docs/PROTOCOL.md §3), and their ``begin`` and reports, which may still be
        to come, are not its own."""
        branch = json.dumps(params.get("branchId")) if isinstance(params, dict) else None
        key = json.dumps(token)
        return [p for s, sent, p in self._sent if s.method == "operate" and isinstance(sent, dict) and not p.done()
                and json.dumps(sent.get("workDoneToken")) == key and json.dumps(sent.get("branchId")) == branch]

    def _model_calls_started(self, token: Any, since: int = 0, ahead: Iterable[Any] = ()) -> int:
        """How many model invocations the operate with this workDoneToken has started: its
        ``request`` reports (one before each chat or run call) and its repair attempts, counted
        from its own ``begin``. An earlier operate may have used the same token, and its reports
        are not this one's: those answered before it was sent are before index ``since`` (where
        the notifications stood then); those on its branch still unanswered then (``ahead``,
        :meth:`_ahead`) run before it, so until they are all answered it has started none, and
        then its ``begin`` is the last of the token from ``since`` on. (Operates of one token on
        two branches at once interleave their reports: no count tells them apart.)"""
        if any(not p.done() for p in ahead):
            return 0
        key = json.dumps(token)
        n = 0
        began = False
        for m, params in self.client.notifications[since:]:
            if m != "$/progress" or not isinstance(params, dict) or json.dumps(params.get("token")) != key:
                continue
            value = params.get("value")
            if isinstance(value, dict) and value.get("kind") == "begin":
                began, n = True, 0  # (a later begin of the token: this one's, the earlier were those ahead's)
            elif began and isinstance(value, dict) and value.get("kind") == "report" and (
                    value.get("phase") == "request"
                    or (value.get("phase") == "parse" and str(value.get("message", "")).startswith("repair"))):
                n += 1
        return n

    def _await_model_calls(self, step: Step, msg_id: Any) -> str:
        """Before cancelling a request recorded with ``cancelAfterModelCalls`` (or
        ``cancelAfterServerRequests``): wait until the server has started as many model
        invocations for it as it had when recorded (so that it takes the same model turns), and
        has sent as many requests to the client in the session (so that the one the recorded
        cancel came during is open), unless it has been answered or the server is gone."""
        watched = self._watched.pop(json.dumps(msg_id), None)
        if watched is None:
            return ""
        token, since, calls, asked, pending, ahead, line = watched
        timeout = self._timeout(step)
        deadline = time.monotonic() + timeout

        def started() -> int:
            return self._model_calls_started(token, since, ahead) if calls else 0

        def ready() -> bool:
            return ((started() >= calls and self._server_requests >= asked) or pending.done()
                    or self.client.proc.poll() is not None)

        with self.client._cond:  # woken by every notification and request; in slices for the answer and the exit
            while not ready() and time.monotonic() < deadline:
                self.client._cond.wait_for(ready, max(0.0, min(0.25, deadline - time.monotonic())))
            if ready():
                return ""  # (an answer before the cancel: the request's own step reports the difference)
            if started() < calls:
                return (f"the request of line {line} (id {short(msg_id)}) had started {started()} of the {calls} "
                        f"model invocation(s) it had started when recorded within {timeout:g} s; cancelled anyway")
            return (f"the server had sent {self._server_requests} of the {asked} request(s) to the client it had "
                    f"sent when the cancel of the request of line {line} (id {short(msg_id)}) was recorded, within "
                    f"{timeout:g} s; cancelled anyway")

    def _of(self, method: str) -> Iterable[tuple[int, Any]]:
        """(index, params) of every ``method`` notification so far that is the script's."""
        for i, (m, params) in enumerate(self.client.notifications):
            if m != method:
                continue
            if (self._hidden_tokens and m == "$/progress" and isinstance(params, dict)
                    and json.dumps(params.get("token")) in self._hidden_tokens):
                continue  # the replay's own token (cancelAfterModelCalls): not the script's
            yield i, params

    def _find(self, method: str, pattern: Any) -> tuple[int | None, list[tuple[int, Mismatch]]]:
        near: list[tuple[int, Mismatch]] = []
        for i, params in self._of(method):
            if i in self._matched:
                continue
            mm = first_mismatch(pattern, params, "$.params") if pattern is not None else None
            if mm is None:
                return i, near
            near.append((i, mm))
        return None, near

    def _senders(self, method: str, pattern: Any) -> list[tuple[Step, Any]]:
        """The requests sent so far (their steps and pending answers) that the notification ``method`` whose
        params match ``pattern`` can only come from, and only before their answers: an operate's
        ``$/progress`` all precede its answer (docs/PROTOCOL.md §6), so those of a
        ``workDoneToken`` come from the requests sent with it; the ``toolEvent`` of a branch
        from the operates on it, before an answer with a result (a cancelled one's tool may still
        be running). Empty when the pattern names no such token or branch (or ``"*"``), or
        when no request was sent with it: the notification may come at any time."""
        key = {"$/progress": "token", "toolEvent": "branchId"}.get(method)
        if key is None or not isinstance(pattern, dict) or key not in pattern or pattern[key] == ANY:
            return []
        want = json.dumps(literal(pattern[key]))
        param = "workDoneToken" if key == "token" else "branchId"
        return [(s, p) for s, params, p in self._sent
                if isinstance(params, dict) and json.dumps(params.get(param)) == want
                and (key == "token" or s.method == "operate")]

    def _cannot_come(self, method: str, senders: list[tuple[Step, Any]]) -> bool:
        """Every request the notification could come from (:meth:`_senders`) has been answered
        (a ``toolEvent``: with a result): what came before those answers is all there is."""
        if not senders or not all(p.done() for _, p in senders):
            return False
        return method != "toolEvent" or all("result" in (p._msg or {}) for _, p in senders)

    def _expectNotification(self, step: Step, data: dict) -> StepResult:  # noqa: N802 - the step's name
        pattern = data.get("match")
        timeout = self._timeout(step)
        deadline = time.monotonic() + timeout
        senders = self._senders(step.method, pattern)
        late = False    # the requests it could come from were answered without it

        def over() -> bool:
            nonlocal late
            if self._find(step.method, pattern)[0] is not None or self.client.proc.poll() is not None:
                return True
            late = self._cannot_come(step.method, senders)
            return late

        with self.client._cond:  # the client's reader notifies it on every notification (not on answers: in slices)
            while not over() and time.monotonic() < deadline:
                self.client._cond.wait_for(over, max(0.0, min(0.25, deadline - time.monotonic())))
            index, near = self._find(step.method, pattern)
        if index is not None:
            self._matched[index] = step.line
            params = self.client.notifications[index][1]
            problem = self._save(data.get("save"), params)
            if problem:
                return StepResult(step, False, problem, got=params)
            return StepResult(step, True, "got " + short(params, 100), got=params)
        # the server exited or its request was answered (waiting longer would not help), else how to wait longer
        if self.client.proc.poll() is not None:
            end = f"; the server exited (code {self.client.proc.returncode})"
        elif late:  # those requests named by their lines, as every step is (their ids are the replay's own)
            many = len(senders) > 1
            if step.method == "$/progress":
                what = (f"request{'s' * many} whose workDoneToken it names ("
                        + ", ".join(f"the {s.method} on line {s.line}" for s, _ in senders) + ")")
            else:
                what = (f"operate{'s' * many} on the branch it names (line{'s' * many} "
                        + ", ".join(str(s.line) for s, _ in senders) + ")")
            end = f"; it cannot come any more: the {what} {'were' if many else 'was'} answered without it"
        else:
            end = "; " + self._wait_longer(step, timeout)
        within = "before its request was answered" if late else f"within {timeout:g} s"
        # what came instead: the nearest of those no step took, and those earlier steps took (their lines)
        miss = notification_miss(pattern, [(params, self._matched.get(i)) for i, params in self._of(step.method)])
        if not near:
            expected = "any params" if pattern is None else short(pattern, 100)
            return StepResult(step, False, f"no {step.method} notification {within}"
                                           f" (expected {expected}){'; ' + miss if miss else ''}{end}")
        return StepResult(step, False, f"no matching {step.method} {within}; {miss}{end}",
                          mismatch=nearest(near, pattern, dict(self._of(step.method)))[1])

    def _respond(self, step: Step, data: dict) -> StepResult:
        from operate_sidecar.clients.python.client import RpcError

        answer = {k: data[k] for k in ("result", "error", "unanswered", "raw") if k in data}
        standing = self._standing
        with standing.lock:
            first = step.method not in standing.answers
            entries = standing.answers.setdefault(step.method, [])
            same = next((e for e in reversed(entries) if _same(e.match, data.get("match"))), None)
            if same is not None and self._in_a_row(same.answers[-1][1], step.line):  # the next answer to those calls
                same.answers.append((answer, step.line))
            else:
                entries.append(_Answers(data.get("match"), [(answer, step.line)]))
        if first:
            method = step.method

            def handler(params: Any) -> Any:
                self._asked()
                with standing.lock:
                    standing.seen.append((method, params))
                    fits = next((e for e in reversed(standing.answers[method])
                                 if e.match is None or first_mismatch(e.match, params) is None), None)
                    ans, line = fits.next() if fits is not None else (None, 0)
                if ans is None:
                    # the line whose match came nearest, and where it parted (a typo in a tool's name, say)
                    with standing.lock:
                        held = [(e.answers[0][1], first_mismatch(e.match, params, "$.params"))
                                for e in standing.answers[method] if e.match is not None]
                    held = [(n, mm) for n, mm in held if mm is not None]
                    if held:
                        near, mm = nearest(held, None, None)
                        standing.refuse(method, params, f"no respond line's match fits it (nearest: line {near}'s, "
                                                        f"{mm.describe(80)})", near)
                    standing.refuse(method, params, "no respond line's match fits it")
                if ans.get("unanswered"):  # as its recorded client did: no answer while the session lasts
                    self._leave_unanswered()
                    return None  # (the server's input is closed or it is gone: this reaches nobody)
                # a raw answer is what a faulty client gave: sent as written, as it was when recorded
                problem = "" if ans.get("raw") else _not_offered(method, params, ans, line)
                if problem:  # answered as written all the same: the server does with it what it does
                    with standing.lock:
                        standing.wrong.append(problem)
                if "error" in ans:
                    e = ans["error"] if isinstance(ans["error"], dict) else {}
                    raise RpcError(int(e.get("code", -32000)), str(e.get("message", "refused")), e.get("data"))
                return copy.deepcopy(ans["result"])

            self.client.on_request(method, handler)
        where = f" when params match {short(data['match'], 80)}" if data.get("match") is not None else ""
        if data.get("unanswered"):
            return StepResult(step, True, "leaves it unanswered" + where)
        return StepResult(step, True, "standing answer " + short(answer, 100) + where)

    def _in_a_row(self, earlier: int, line: int) -> bool:
        """Only respond lines stand between the lines ``earlier`` and ``line``."""
        return all(s.kind == "respond" for s in self.script.steps if earlier < s.line < line)

    def _asked(self) -> None:
        """A server-to-client request came (counted for ``cancelAfterServerRequests``)."""
        with self.client._cond:
            self._server_requests += 1
            self.client._cond.notify_all()

    def _leave_unanswered(self) -> None:
        """Wait (in a handler's thread of its own) until the session is over: the server's input
        closed or the server gone."""
        while not self.client.proc.stdin.closed and self.client.proc.poll() is None:
            time.sleep(0.05)

    def _close(self, interrupted: bool = False) -> None:
        """End the server: every wait bounded, and a server that does not end in time is killed
        with every process of its session (a wrapper that forked it included)."""
        client = self.client
        try:
            if interrupted:  # Ctrl+C (or a failure of the replay itself): stop it now
                client.terminate(INTERRUPT_GRACE_S)
                return
            # no shutdown when the script sent exit itself (only its exit is waited for), nor when
            # a request its recorded client left unanswered is still running: the session ends as
            # that client ended it, with the end of the server's input
            ask = not self._exit_line and all(p.done() for p in self._abandoned)
            code = client.close(EXIT_WAIT_S, shutdown=ask, answer_within=min(self.step_timeout, SHUTDOWN_WAIT_S),
                                unanswered_grace=EXIT_GRACE_S)
            self.ending = client.ending
            if self._exit_line:  # how the server shuts down is what such a script checks
                self._bad_exit = _bad_exit(code, self._shutdown_sent, self._exit_line, client.ending)
        except BaseException as e:  # whatever went wrong in ending it (a second Ctrl+C too): nothing is left running
            client.kill()
            if not isinstance(e, Exception):  # an interrupt still interrupts
                raise


# --------------------------------------------------------------------------- report
def summary(runner: Runner, where: str) -> str:
    """The verdict in one line: ``where`` is the script (`` in PATH``, `` (NAME)``). The end of
    the session (a server request that came after the last step, unanswered or answered wrongly)
    is said apart: it is not a step of the script."""
    steps = [r for r in runner.results if r.step.kind != END]
    failed = [r for r in steps if not r.ok]
    end = any(not r.ok for r in runner.results if r.step.kind == END)
    if not failed:
        if end:
            return f"the end of the session failed{where}, after all {len(steps)} steps passed"
        return f"all {len(steps)} steps passed{where}"
    return (f"{len(failed)} of {len(steps)} steps failed{where}" + (", and the end of the session" if end else "")
            + f"; first: {failed[0].step.label}")


def first_failure(runner: Runner, path: str) -> str:
    """The first failure in one line, led by the script's ``path``: ``tests/s.jsonl line 5:
    expectNotification $/progress: no matching ...`` (the end of the session when no step
    failed), and how many more failed. What a reader who sees one line only (pytest's short test
    summary, the first line of an exception's message) needs; :func:`format_report` has the rest."""
    steps = [r for r in runner.results if r.step.kind != END]
    failed = [r for r in steps if not r.ok] or [r for r in runner.results if not r.ok]
    if not failed:
        return f"{path}: {summary(runner, '')}"
    first = failed[0]
    where = f"{path} {first.step.label}" if first.step.kind != END else f"{path}, {first.step.label}"
    more = len([r for r in runner.results if not r.ok]) - 1
    return (f"{where}" + (f": {first.detail}" if first.detail else "")
            + (f" (and {more} more failure(s), below)" if more else ""))


def format_report(runner: Runner, path: str = "script") -> str:
    lines = [r.line() for r in runner.results]
    lines.append(summary(runner, f" in {path}"))
    if runner.ending:
        lines.append(f"note: {runner.ending}")
    return "\n".join(lines)


def replay(path: str | os.PathLike[str], server_argv: list[str] | None = None, *, scripted: bool = False,
           step_timeout: float = DEFAULT_STEP_TIMEOUT_S, env: dict[str, str] | None = None,
           cwd: str | None = None, out: Any = None, timeout_option: str = "run with --timeout S",
           shown: str | None = None) -> Runner:
    """Load and run a script; stream one line per step to ``out`` (when given). ``timeout_option``
    says how the caller sets ``step_timeout``, in the hint of a request step that timed out;
    ``shown`` is the name the script's errors give the file (``path`` by default)."""
    shown = os.fspath(path) if shown is None else shown
    script = load_script(path, shown)
    if scripted:
        apply_scripted(script, shown)

    def emit(res: StepResult) -> None:
        if out is not None:
            print(res.line(), file=out, flush=True)

    runner = Runner(script, server_argv, step_timeout=step_timeout, env=env, cwd=cwd, on_result=emit,
                    timeout_option=timeout_option)
    runner.run()
    return runner


def _positive_seconds(text: str) -> float:
    """``--timeout``: a positive number of seconds (like a step's ``timeoutMs``)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and value * 1000 <= MAX_TIMEOUT_MS):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, at most {MAX_TIMEOUT_MS // 1000} "
                                         f"(one day), got {text}")
    return value


def main(argv: list[str]) -> int:
    """``operate-sidecar replay SCRIPT.jsonl [--scripted] [--timeout S] [--quiet] [-- SERVER ARGV...]``"""
    import argparse

    server_argv: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, server_argv = argv[:cut], argv[cut + 1:]
        if not server_argv:
            print("operate-sidecar replay: nothing after --", file=sys.stderr)
            return 2
    p = argparse.ArgumentParser(
        prog="operate-sidecar replay",
        usage="%(prog)s [-h] [--scripted] [--timeout S] [--quiet] SCRIPT.jsonl [-- SERVER ARGV...]",
        description="Run a session script (JSON Lines) against a fresh server and report every step; "
                    "exit 0 only when every step passed. The server is this one (same interpreter) "
                    "unless a command follows -- (a wrapper that forks it is fine: the server runs in a "
                    f"session of its own, ended as a whole). At the end the server gets shutdown (its answer "
                    f"waited for {SHUTDOWN_WAIT_S:g} s at most) and exit; one that does not end is killed, and "
                    "a note says so.")
    p.add_argument("script", metavar="SCRIPT.jsonl", help="the session script (JSON Lines)")
    p.add_argument("--scripted", action="store_true",
                   help="replace every recorded model with a scripted one that replays its recorded turns "
                        "(no real model needed)")
    p.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_STEP_TIMEOUT_S, metavar="S",
                   help=f"time-out of a request step in seconds unless it sets timeoutMs (default "
                        f"{DEFAULT_STEP_TIMEOUT_S:g}); expectNotification steps wait at most "
                        f"{DEFAULT_NOTIFICATION_TIMEOUT_S:g} s unless they set timeoutMs")
    p.add_argument("--quiet", action="store_true", help="print only failing steps and the summary")
    args = p.parse_args(argv)
    try:
        script = load_script(args.script)
        if args.scripted:
            apply_scripted(script, args.script)
    except (OSError, ScriptError) as e:
        print(f"operate-sidecar replay: {e}", file=sys.stderr)
        return 2

    def emit(res: StepResult) -> None:
        if res.ok and args.quiet:
            return
        _say(res.line())

    runner = Runner(script, server_argv, step_timeout=args.timeout, on_result=emit)
    _stop_on_signals()
    try:
        ok = runner.run()
    except ServerStartError as e:
        print(f"operate-sidecar replay: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # the server was stopped (run() ends it: it is not in the terminal's job)
        signum = getattr(e, "signum", signal.SIGINT)
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"operate-sidecar replay: {how} after {len(runner.results)} step(s)", file=sys.stderr)
        return 128 + signum
    if runner.ending:
        _say(f"note: {runner.ending}")
    _say(summary(runner, f" ({Path(args.script).name})"))
    if ok:
        return 0
    if runner.stderr_tail:
        _say("server stderr (last lines):\n" + "\n".join("  " + ln for ln in runner.stderr_tail.splitlines()))
    return 1


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a CI job's time-out, ``kill``, the terminal closed): the replay stops as
    on Ctrl+C, its server (in a session of its own, which the signal does not reach) ended too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals() -> None:
    def stop(signum: int, _frame: Any) -> None:
        raise _Stopped(signum)

    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, stop)


def _say(text: str) -> None:
    """A line of the report on stdout. Its reader may have left (``| head``, ``| grep -m1 FAIL``):
    the replay then goes on to its end (the server ended as usual, its exit code) unprinted,
    not with a traceback. A lone surrogate (half an emoji a script's string holds) is shown as
    its escape."""
    try:
        print(text.encode("utf-8", "backslashreplace").decode("utf-8"), flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
