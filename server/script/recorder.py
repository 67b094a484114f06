"""``operate-sidecar --record FILE``: write the session being served as a replayable script.

The recorder sees every frame body in both directions (the transport hands it the bytes;
it never changes them) and every model invocation (``wrap_model``), and writes:

- each client request as a ``request`` step whose ``expect`` is the answer it got, with the
  values that differ from run to run replaced: ``branchId``s the server made up are saved
  (``"save": {"branch1": "branchId"}``) and later steps refer to them as ``${branch1}``;
  timestamps, durations, token usage, message and call ids, the server's version and the
  methods and notifications its release offers become ``"*"``;
- each client notification as a ``notify`` step;
- each notification the client got as an ``expectNotification`` step (of a ``$/progress``
  stream only the first report per phase is kept, its ``delta`` as ``"*"``, since how a
  model's text is cut into deltas is not part of the contract); one that came long after the
  step before it was done (a slow model's text and end while the client went on, not waiting
  for the answer) with a ``timeoutMs`` covering that wait (:meth:`Recorder._timed`), when the
  replay's default wait would not;
- each answer the client gave to a server-to-client request, when it differs from the
  previous answer to the same call, as a ``respond`` step placed before the request that was
  in flight: a standing answer that ``match``es the call (tool and arguments for permission
  and client-tool requests, the path for the client's file system), so calls answered
  differently within one operate are answered the same way when replayed, in any order; the
  same call answered differently (a file read again after an edit) as one respond line per
  answer, in a row, which the replay gives in turn (an answer given several times before
  another written as often); a
  request the client had not answered when the server withdrew it (``$/cancelRequest``: a
  permission prompt timed out, its operate cancelled) or the session ended as ``"unanswered":
  true`` (an answer that came after the withdrawal reached no one: not written);
- a request still unanswered when the client sent its next one with ``"wait": false`` and its
  ``id`` (the replay does not wait for it either, so the same requests overlap, and a later
  ``$/cancelRequest`` can name it), and an ``{"await": id}`` step where its answer came (the
  replay sends the steps after it only once that answer came, as the client did: without it
  a later request overlapped with more than it had when recorded);
- a request still unanswered when the session ended (the client closed the connection or sent
  ``exit`` first) with ``"answered": false``: what the server sent after the end reached no
  client, so it is not written, and the replay ends the same way instead of waiting for it;
- for a cancelled request, how far it had got: ``"cancelAfterModelCalls": n`` when it had
  started ``n`` model invocations by the time the cancel came (counted per request: the
  invocations made in that request's task). The replay sends that cancel only once the server
  has started the request's ``n``-th model invocation (it watches the request's ``$/progress``,
  giving it a ``workDoneToken`` of its own when it has none), so the request takes exactly the
  model turns it took when recorded, never the next request's; and, when a server-to-client
  request was open as the cancel came (a permission prompt), ``"cancelAfterServerRequests": n``,
  the number of those the server had sent, so the replay cancels while that one is open too.
  A model invocation cancelled mid-answer is recorded with a long ``delayMs``, so the replayed
  one is still running when the cancel comes, as it was. A request cancelled before it reached its model is cancelled at
  once (as before: no model turn is recorded for it, and none is taken in the replay);
- a literal ``"*"`` in an expectation or a ``match`` as ``"$*"`` (else it would match anything);
- a line the replay would refuse (what a faulty client sent: params that are not an object, an
  answer of another shape than the protocol's) with ``"raw": true``, sent as written;
- every path under the server's working directory (physical, or as ``$PWD`` names it through a
  symlink) with ``${cwd}`` in its place (the replay
  defines it as its server's working directory), so a session recorded in one checkout
  replays in another (workspace folders, the paths of ``fs/*`` requests, tool descriptions);
- a last line ``{"recordedModels": {name: {"responses": [...], "cli"?: true, "inline"?: spec}}}``
  with the text of every model invocation (and a reasoning model's thoughts, as ``thinking``),
  per model, in order, so ``replay --scripted`` can
  replay the session with ``scripted`` models instead of the real ones. A CLI run that made its
  own tool calls (claude-code's tool_use and tool_result, which the branch keeps as
  action_request and action_response messages), or that failed after writing, is recorded as
  its ``events`` (its text and tool events, in order, as the ``jsonl`` profile writes them) in
  place of its text, with its ``error`` if it failed: the scripted replay streams them the same.
  Any other invocation that failed after streaming (its connection lost, an error event, a
  refusal after some text) is recorded as its ``text`` (and ``thinking``) with its ``error``
  (a refusal's says the model declined, which the scripted replay raises as that refusal):
  replayed, it streams the same, then fails the same.

Every known secret value is masked in the file (``redaction.redact_bytes``; each line stays
JSON), among them those the settings of every recorded ``initialize`` name or hold, of one the
server refused too.

The file is rewritten (atomically) after every answered request and when the server stops; an
existing file is overwritten at start, and one that cannot be written (its folder missing, the
file written beside it refused) is an ``OSError`` in words then, before anything is served. A
symlink is followed (the file it points to is rewritten, beside it, and the link stays); a path
that exists and is no regular file (a named pipe, a device, a socket) is refused the same way,
never replaced.
"""

from __future__ import annotations

import asyncio
import json
import os
import math
import re
import threading
import time
import weakref
from typing import Any, AsyncIterator

from .matcher import escape, escape_pattern

#: keys whose values differ between two runs of the same session
VOLATILE_KEYS = frozenset({"createdAt", "durationMs", "usage", "callId", "requestId", "stateDir", "seq",
                           "processId", "elapsedMs", "timestamp"})
#: keys volatile only beside particular keys: message ids, the server's version, the model name a
#: provider reports in an assistant_response (a scripted replay reports its configured name), and
#: the methods and notifications a server release offers (``initialize``: a later release that adds
#: one still replays the session)
_VOLATILE_IN = {"id": ("kind", "role"), "version": ("name",), "model": ("text",),
                "methods": ("notifications",), "notifications": ("methods",)}
_ID_RESULTS = {"createBranch": "branch", "forkBranch": "branch"}
#: a model invocation that was cancelled when recorded waits this long when replayed (cancellable)
CANCELLED_DELAY_MS = 600_000
#: an ``expectNotification`` whose notification came long after the step before it was done (a
#: slow model's text and end, while the client went on) is written with a ``timeoutMs`` of that
#: wait times this, plus :data:`NOTIFICATION_HEADROOM_S`, in whole seconds, when that is more
#: than the replay's default wait (10 s): a replay as slow again still passes
NOTIFICATION_HEADROOM = 2
NOTIFICATION_HEADROOM_S = 5.0


def _remember_secrets(settings: Any) -> None:
    """Register the secret values an ``initialize``'s settings name or hold (as the server does
    when it takes them) before they are recorded: the script keeps the settings of an
    ``initialize`` the server refused too (an unknown field, say), which it never took."""
    if isinstance(settings, dict):
        from operate_sidecar.server import redaction
        from operate_sidecar.server.rpc.settings import secret_values

        for value in secret_values(settings):
            redaction.remember_secret(value)


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self.steps: list[dict[str, Any]] = []
        self._pending: dict[Any, dict[str, Any]] = {}       # client request id -> its step
        self._ids: dict[Any, Any] = {}                      # client request id (key) -> the id as sent
        self._out: dict[Any, tuple[str, Any]] = {}          # server request id -> (method, match)
        self._withdrawn: set[str] = set()   # server requests the server cancelled before the client answered
        self._server_requests = 0           # server-to-client requests so far
        self._standing: dict[tuple[str, str], Any] = {}     # (method, match) -> the answer standing
        #: (method, match) -> (its latest respond step, the request in flight each time its answer was given again since)
        self._given: dict[tuple[str, str], tuple[dict[str, Any], list[Any]]] = {}
        self._saved: dict[str, str] = {}                    # volatile value -> save name
        self._counts: dict[str, int] = {}
        self._progress_seen: set[tuple] = set()
        #: id of a step -> when it was recorded (a request: sent; a notification: received; an await:
        #: its answer received), and id of a request step -> when its answer came
        self._at: dict[int, float] = {}
        self._answered_at: dict[int, float] = {}
        self._started = time.monotonic()
        self.models: dict[str, dict[str, Any]] = {}
        self._model_calls: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # task -> started
        self._conn: Any = None
        self._closed = False
        self._cwd = _cwd_pattern(*_working_directories())
        self._write(at_start=True)  # a file that cannot be written fails at start, not at the end (nor in silence)

    # ------------------------------------------------------------------ wiring
    def attach(self, conn: Any, wire: Any) -> None:
        conn.recorder = self
        self._conn = conn
        wire.tap = self.outgoing

    # ------------------------------------------------------------------ frames
    def incoming(self, body: bytes) -> None:
        msg = _decode(body)
        if msg is None:
            return
        with self._lock:
            method = msg.get("method")
            if isinstance(method, str) and "id" in msg:
                step: dict[str, Any] = {"request": method}
                params = msg.get("params")
                if method == "initialize" and isinstance(params, dict):
                    _remember_secrets(params.get("settings"))
                    if "processId" in params:
                        params = {k: v for k, v in params.items() if k != "processId"}  # the recording client's pid
                if params not in (None, {}):
                    step["params"] = self._template(params)
                for key, earlier in self._pending.items():  # still unanswered: the client did not wait for it
                    if earlier["request"] not in _ID_RESULTS and earlier.get("wait", True):
                        earlier["id"] = self._ids[key]
                        earlier["wait"] = False
                self._append(step)
                self._pending[_key(msg["id"])] = step
                self._ids[_key(msg["id"])] = msg["id"]
            elif isinstance(method, str):
                params = msg.get("params")
                if method == "$/cancelRequest" and isinstance(params, dict):
                    target = self._pending.get(_key(params.get("id")))
                    if target is not None:  # in flight: the replay sends it without waiting, and cancels it by its id
                        target["id"] = params.get("id")
                        target["wait"] = False
                        started = self._started_model_calls(params.get("id"))
                        if started:  # ... once its model invocations have started as they had here
                            target["cancelAfterModelCalls"] = started
                        if self._out:  # ... and once the server has asked what the client was being asked
                            target["cancelAfterServerRequests"] = self._server_requests
                step = {"notify": method}
                if params not in (None, {}):
                    step["params"] = self._template(params)
                self._append(step)
            elif "id" in msg:  # the client's answer to a server-to-client request
                out = self._out.pop(_key(msg["id"]), None)
                if out is None:  # (an answer after the server withdrew the request reached no one: not written)
                    return
                answer = {"result": msg.get("result")} if "error" not in msg else {"error": msg.get("error")}
                self._respond(*out, self._template(answer))

    def _respond(self, method: str, match: Any, answer: dict[str, Any]) -> None:
        """A ``respond`` step for an answer (or ``{"unanswered": True}``) that differs from the
        standing one, placed before the request that was in flight. Respond lines with the same
        call in a row are given in turn by the replay, the last one repeating: when the same
        call was answered alike, then otherwise (within one operate), the earlier answer is
        written once per time it was given, so that each call gets its own."""
        key = (method, json.dumps(match, sort_keys=True))
        given = self._given.get(key)
        at, before = self._respond_at()
        if self._standing.get(key) == answer:
            if given is not None:
                given[1].append(before)
            return
        self._standing[key] = answer
        step = {"respond": method, **({"match": match} if match is not None else {}), **answer}
        if given is not None:  # the earlier answer, as often as it was given again in this place, then this one
            again = sum(1 for b in given[1] if b is before)
            self.steps[at:at] = [dict(given[0]) for _ in range(again)]
            at += again
        self.steps.insert(at, step)
        self._given[key] = (step, [])

    def _respond_at(self) -> tuple[int, Any]:
        """Where a respond step goes: before the first request in flight (its index, and its step),
        else at the end (None)."""
        first = min(self._pending.values(), key=self._index, default=None)
        return (len(self.steps), None) if first is None else (self._index(first), first)

    def _ended(self) -> bool:
        """The session is over (end of input, ``exit``, a signal): nothing sent now reaches the client."""
        return getattr(self._conn, "exit_code", None) is not None

    def outgoing(self, body: bytes) -> None:
        msg = _decode(body)
        if msg is None or self._ended():
            return
        with self._lock:
            method = msg.get("method")
            if isinstance(method, str) and "id" in msg:
                self._server_requests += 1
                self._out[_key(msg["id"])] = (method, self._template(_answer_match(method, msg.get("params")),
                                                                     pattern=True))
                return
            if isinstance(method, str):
                params = msg.get("params")
                if method == "$/cancelRequest" and isinstance(params, dict):
                    out = self._out.pop(_key(params.get("id")), None)
                    if out is not None:  # withdrawn unanswered (timed out, its operate cancelled): so in the replay
                        self._respond(*out, {"unanswered": True})
                self._notification(method, params)
                return
            step = self._pending.pop(_key(msg.get("id")), None)
            if step is None:
                return
            self._answered_at[id(step)] = time.monotonic()
            if "error" in msg:
                err = msg.get("error") or {}
                step["expect"] = {"error": {"code": err.get("code")}}
            else:
                result = msg.get("result")
                expected = self._volatile(result)
                prefix = _ID_RESULTS.get(step["request"])
                if prefix and isinstance(result, dict) and isinstance(result.get("branchId"), str):
                    name = self._new_name(prefix)
                    step["save"] = {name: "branchId"}
                    self._saved[result["branchId"]] = name
                    expected["branchId"] = "*"  # (after _volatile: this "*" is a pattern's, not a literal one)
                step["expect"] = {"result": expected}
            if step.get("wait") is False:  # the client had gone on: the replay waits for it here
                self._append({"await": step["id"]})
            self.write()

    def _notification(self, method: str, params: Any) -> None:
        cut: tuple[str, ...] = ()   # keys of a progress report's value that match anything
        if method == "$/progress" and isinstance(params, dict) and isinstance(params.get("value"), dict):
            value = params["value"]
            if value.get("kind") == "report":
                key = (json.dumps(params.get("token")), value.get("phase"), "delta" in value)
                if key in self._progress_seen:
                    return
                self._progress_seen.add(key)
                cut = tuple(k for k in ("delta", "message") if k in value)
        step: dict[str, Any] = {"expectNotification": method}
        if params is not None:
            step["match"] = self._volatile(params)
            for k in cut:  # (after _volatile: these "*" are a pattern's, not literal ones)
                step["match"]["value"][k] = "*"
        self._append(step)

    def _append(self, step: dict[str, Any]) -> None:
        self.steps.append(step)
        self._at[id(step)] = time.monotonic()

    def _timed(self) -> list[dict[str, Any]]:
        """The steps, each ``expectNotification`` whose notification came long after the step
        before it would be done in the replay (:func:`_notification_timeout_ms`) with a
        ``timeoutMs``. A step is done when it was recorded, but a request the replay waits for
        (``"wait"`` not false) when its answer came: the notifications that came before that
        answer are there when the replay's step for them runs (one still unanswered: not yet)."""
        done = self._started
        out = []
        for step in self.steps:
            at = self._at.get(id(step))
            if at is None:  # a respond step: answers at once
                out.append(step)
                continue
            if "expectNotification" in step:
                timeout_ms = _notification_timeout_ms(at - done)
                if timeout_ms:
                    step = {**step, "timeoutMs": timeout_ms}
            elif "request" in step and step.get("wait", True) is not False:
                at = self._answered_at.get(id(step), float("inf"))
            done = max(done, at)
            out.append(step)
        return out

    # ------------------------------------------------------------------ models
    def wrap_model(self, model: Any, config: dict[str, Any], name: str, *, inline: bool) -> Any:
        with self._lock:
            entry = self.models.setdefault(name, {"responses": []})
            if getattr(model, "is_cli", False):
                entry["cli"] = True
            if inline:
                entry["inline"] = config
        return RecordingModel(model, self, name)

    def _model_call_started(self) -> None:
        """A model invocation starts: counted for the request whose task runs it."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        if task is not None:
            with self._lock:
                self._model_calls[task] = self._model_calls.get(task, 0) + 1

    def _started_model_calls(self, msg_id: Any) -> int:
        """How many model invocations the client request ``msg_id`` has started (0 when it has
        not started one, is not running, or cannot be told)."""
        app = getattr(self._conn, "app", None)
        futures = getattr(getattr(app, "protocol", None), "_request_futures", None)  # pygls: id -> task
        if not isinstance(futures, dict) or isinstance(msg_id, (dict, list)):
            return 0
        task = futures.get(msg_id)
        try:
            return self._model_calls.get(task, 0) if task is not None else 0
        except TypeError:  # not weakly referenceable: not a task of ours
            return 0

    def _reserve(self, name: str) -> int:
        with self._lock:
            responses = self.models.setdefault(name, {"responses": []})["responses"]
            responses.append(None)
            return len(responses) - 1

    def _fill(self, name: str, slot: int, entry: Any) -> None:
        with self._lock:
            self.models[name]["responses"][slot] = entry

    # ------------------------------------------------------------------ values
    def _new_name(self, prefix: str) -> str:
        self._counts[prefix] = self._counts.get(prefix, 0) + 1
        return f"{prefix}{self._counts[prefix]}"

    def _template(self, value: Any, pattern: bool = False) -> Any:
        """Client-sent values: the server's made-up ids become ``${name}`` references; any other
        string is written escaped (a literal ``${`` as ``$${``), so it replays as it was. In a
        ``pattern`` (an ``expect``, a ``match``) a literal ``"*"`` is written ``"$*"``: as it
        came, it would match anything."""
        if isinstance(value, str):
            name = self._saved.get(value)
            if name:
                return "${%s}" % name
            return escape_pattern(value) if pattern and escape_pattern(value) != escape(value) else self._text(value)
        if isinstance(value, dict):
            return {k: self._template(v, pattern) for k, v in value.items()}
        if isinstance(value, list):
            return [self._template(v, pattern) for v in value]
        return value

    def _text(self, text: str) -> str:
        """A string as a script writes it: a literal ``${`` as ``$${``, the working directory as ``${cwd}``."""
        if self._cwd is None:
            return escape(text)
        out, last = [], 0
        for m in self._cwd.finditer(text):  # (found in the text as it is: an escape never splits the folder)
            out += [escape(text[last:m.start()]), CWD_REF]
            last = m.end()
        out.append(escape(text[last:]))
        return "".join(out)

    def _escaped(self, value: Any) -> Any:
        """``value`` with every string written as a script writes it (:meth:`_text`): the model
        turns and inline specs are substituted like the steps they are put into."""
        if isinstance(value, str):
            return self._text(value)
        if isinstance(value, dict):
            return {k: self._escaped(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escaped(v) for v in value]
        return value

    def _volatile(self, value: Any) -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if k in VOLATILE_KEYS or (k in _VOLATILE_IN and any(c in value for c in _VOLATILE_IN[k])):
                    out[k] = "*"
                else:
                    out[k] = self._volatile(v)
            return out
        if isinstance(value, list):
            return [self._volatile(v) for v in value]
        return self._template(value, pattern=True)

    def _index(self, step: dict) -> int:
        for i, s in enumerate(self.steps):
            if s is step:
                return i
        return len(self.steps)

    # ------------------------------------------------------------------ output
    def lines(self) -> list[str]:
        with self._lock:
            out = [_json_line(_raw_if_malformed(s)) for s in self._timed()]
            models = {name: self._escaped({**m, "responses": [r if r is not None else {"error": "(not finished when recorded)"}
                                                         for r in m["responses"]]})
                      for name, m in self.models.items()}
            if models:
                out.append(_json_line({"recordedModels": models}))
        return out

    def write(self) -> None:
        self._write(at_start=False)

    def _write(self, at_start: bool) -> None:
        """Write the script as recorded so far: to a file beside ``path``, then renamed to it.
        ``at_start`` (the empty script, an existing file overwritten): an ``OSError`` saying in
        words why it cannot be written; later a warning only (recording never breaks serving)."""
        from operate_sidecar.server import redaction

        data = "".join(line + "\n" for line in self.lines()).encode("utf-8")
        data = redaction.redact_bytes(data)  # no known secret leaves the process in a recording either (each
        # line stays JSON: a number that is a secret becomes "[REDACTED]")
        # a symlink is followed: the recording replaces the file it points to (written beside that
        # file), not the link
        target = os.path.realpath(self.path) if self.path else self.path
        tmp = f"{target}.tmp{os.getpid()}"
        try:
            if not self.path:
                raise FileNotFoundError("no file name given")
            if os.path.isdir(target):  # else said as the file beside it failing
                raise IsADirectoryError("it is a folder")
            kind = _special_kind(target)
            if kind:  # a named pipe or a device is never replaced by a regular file
                raise _NotAFile(f"it is {kind}, not a regular file; give the name of a file")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except OSError as e:
            try:
                if not isinstance(e, _NotAFile):
                    os.unlink(tmp)
            except OSError:
                pass
            if at_start:
                raise OSError(str(e) if isinstance(e, _NotAFile) else _unwritable(target, tmp, e)) from None
            import logging

            logging.getLogger("operate_sidecar.server.script").warning("could not write %s: %s", self.path, e)

    def close(self) -> None:
        with self._lock:
            # server-to-client requests the client had not answered when the session ended
            for out in list(self._out.values()):
                self._respond(*out, {"unanswered": True})
            self._out.clear()
            # requests still unanswered when the session ended: their client never saw an answer
            for step in self._pending.values():
                step["wait"] = False
                step["answered"] = False
            self._pending.clear()
            self.write()
            self._closed = True


class RecordingModel:
    """A model that records the text of each invocation, then behaves exactly like ``inner``."""

    def __init__(self, inner: Any, recorder: Recorder, name: str) -> None:
        self._inner = inner
        self._recorder = recorder
        self._rec_name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    async def stream(self, request: Any) -> AsyncIterator[Any]:
        self._recorder._model_call_started()
        slot = self._recorder._reserve(self._rec_name)
        parts: list[str] = []
        thoughts: list[str] = []
        # a CLI run's events, in order: each stretch of text between its tool events as the
        # index in ``parts`` where it begins (joined once, at the end)
        events: list[Any] | None = [] if getattr(self._inner, "is_cli", False) else None
        entry: dict[str, Any] | None = None
        try:
            async for chunk in self._inner.stream(request):
                if chunk.type == "text":
                    if events is not None and chunk.text and not (events and isinstance(events[-1], int)):
                        events.append(len(parts))
                    parts.append(chunk.text)
                elif chunk.type == "thinking" and chunk.text:
                    thoughts.append(chunk.text)
                elif chunk.type in ("tool_use", "tool_result") and events is not None:
                    events.append(_event(chunk))
                elif chunk.type == "error":
                    entry = {"error": chunk.text or "model reported an error"}
                yield chunk
        except Exception as e:
            entry = {"error": str(e) or type(e).__name__}
            from ..core.errors import ModelRefused  # (loaded: a model ran)

            if isinstance(e, ModelRefused):  # replayed as that refusal (its data.refusal, ACP's stop reason)
                entry["refusal"] = e.refusal
            raise
        except asyncio.CancelledError:  # cancelled mid-answer: the replayed invocation waits to be cancelled too
            entry = {"text": "".join(parts), "delayMs": CANCELLED_DELAY_MS}
            raise
        finally:
            if entry is None or ("error" in entry and events is None and parts):
                # a reply, or what a model streamed before it failed (a stream lost, an error event, a
                # refusal after some text): the scripted replay streams the same, then fails the same
                entry = {"text": "".join(parts), **(entry or {})}
                if len(parts) > 1:
                    entry["chunks"] = len(parts)
            if thoughts:  # (replayed as one stretch of thoughts, before the text; before the failure too)
                entry["thinking"] = "".join(thoughts)
            tools = events is not None and any(isinstance(e, dict) for e in events)
            if events and "delayMs" not in entry and (tools or "error" in entry):
                # a CLI run that made its own tool calls (or failed after writing): the branch holds
                # what it streamed, in its order, so the replay streams the same (docs/PROTOCOL.md §2)
                entry.pop("text", None)
                entry.pop("chunks", None)
                entry["events"] = _events(events, parts)
            self._recorder._fill(self._rec_name, slot, entry)

    async def invoke(self, request: Any) -> Any:
        from operate_sidecar.server.core.imodel import collect

        return await collect(self, request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _notification_timeout_ms(waited_s: float) -> int | None:
    """The ``timeoutMs`` of an ``expectNotification`` whose notification came ``waited_s``
    seconds after the step before it was done (the replay waits for it from then), or None when
    the replay's default wait covers it (with headroom: :data:`NOTIFICATION_HEADROOM`). The
    replay waits only until the notification comes: a long time-out costs time only when it
    does not come."""
    from .runner import DEFAULT_NOTIFICATION_TIMEOUT_S, MAX_TIMEOUT_MS

    needed = waited_s * NOTIFICATION_HEADROOM + NOTIFICATION_HEADROOM_S
    if needed <= DEFAULT_NOTIFICATION_TIMEOUT_S:
        return None
    return min(MAX_TIMEOUT_MS, math.ceil(needed) * 1000)


def _events(events: list[Any], parts: list[str]) -> list[dict[str, Any]]:
    """A run's events as a scripted entry's ``events``: each text stretch (an index in ``parts``,
    up to the next tool event's) one ``text`` event."""
    out: list[dict[str, Any]] = []
    starts = [e for e in events if isinstance(e, int)] + [len(parts)]
    n = 0
    for e in events:
        if isinstance(e, int):
            n += 1
            text = "".join(parts[e:starts[n]])
            if text:
                out.append({"type": "text", "text": text})
        else:
            out.append(e)
    return out


def _event(chunk: Any) -> dict[str, Any]:
    """A run's ``tool_use`` / ``tool_result`` chunk as the ``jsonl`` profile's event (and a
    scripted entry's ``events`` item): its fields that are set."""
    if chunk.type == "tool_use":
        event = {"type": "tool_use", "id": chunk.id, "name": chunk.name, "input": chunk.input}
    else:
        event = {"type": "tool_result", "id": chunk.id, "output": chunk.output}
        if chunk.is_error:
            event["is_error"] = True
    return {k: v for k, v in event.items() if v is not None or k == "output"}


#: server-to-client requests: the params a recorded answer is tied to (the call, not its ids)
_MATCH_KEYS = {"requestToolPermission": ("tool", "arguments"), "invokeClientTool": ("tool", "arguments"),
               "fs/readTextFile": ("path",), "fs/writeTextFile": ("path", "text")}


def _answer_match(method: str, params: Any) -> Any:
    keys = _MATCH_KEYS.get(method)
    if keys is None or not isinstance(params, dict):
        return None
    return {k: params[k] for k in keys if k in params}


#: how a recording writes the server's working directory (the replay defines ``cwd``)
CWD_REF = "${cwd}"


def _working_directories() -> list[str]:
    """The server's working directory as its clients may write it: the physical path, and the
    logical one (``$PWD``, the path its launcher reached it by, through a symlink) when it names
    the same folder; a client that was given one of them sends that one."""
    physical = os.getcwd()
    logical = os.environ.get("PWD", "")
    try:
        same = os.path.isabs(logical) and logical != physical and os.path.samefile(logical, physical)
    except OSError:
        same = False
    return [physical, logical] if same else [physical]


def _cwd_pattern(*cwds: str) -> re.Pattern | None:
    """Any of the working directory's paths ``cwds`` where it is a whole path (or a path's head),
    not part of a longer name, and not right after a ``$`` (``$${cwd}`` would be the literal text
    ``${cwd}``); ``None`` for the root, which is the head of every path."""
    paths = [p for p in (c.rstrip("/\\") for c in cwds) if p and "${" not in p]
    if not paths:
        return None
    alternatives = "|".join(re.escape(c) for c in sorted(set(paths), key=len, reverse=True))  # the longest first
    return re.compile(r"(?<![\w.$-])(?:" + alternatives + r")(?![\w-]|\.[\w-])")  # a sentence's full stop may follow


def _json_line(value: Any) -> str:
    """``value`` as one line of JSON, its text as it is where it is Unicode; a string holding a
    lone surrogate (a client's ``\\ud83d``: JSON.stringify of a string cut in the middle of an
    emoji, which the server serves) has no UTF-8 form, so that line is written with escapes: the
    same strings read back. (Written as it was, the recording failed to encode and took the
    server's answers with it.)"""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def _raw_if_malformed(step: dict[str, Any]) -> dict[str, Any]:
    """A step a replay would refuse to load (what a faulty client sent: params that are not an
    object, an answer of another shape than the protocol's) marked ``"raw": true``: the replay
    sends it as written, as the client did, so a session testing such a client replays."""
    from .runner import step_problem

    kind = next((k for k in ("request", "notify", "respond") if k in step), None)
    if kind is None or not step_problem(kind, step[kind], step):
        return step
    return {**step, "raw": True}


class _NotAFile(OSError):
    """The recording's file exists and is no regular file (a named pipe, a device, a socket)."""


def _special_kind(path: str) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a folder, in words; else None."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # (not there yet, or not to be looked at: the write says why)
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _unwritable(path: str, tmp: str, error: OSError) -> str:
    """Why the recording cannot be written to ``path``, in words (not "[Errno 2] ..." naming the file)."""
    if not path:
        return "no file name given"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "it is a folder; give the name of a file"
    if not os.path.exists(folder):
        return f"its folder {folder} does not exist (create it first)"
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    why = "permission denied" if isinstance(error, PermissionError) else (error.strerror or str(error))
    return (f"cannot write {os.path.basename(tmp)} in {folder} ({why}); the recording is written to that file, "
            "then renamed to the file given")


def _decode(body: bytes) -> dict | None:
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return msg if isinstance(msg, dict) else None


def _key(msg_id: Any) -> str:
    return json.dumps(msg_id)
