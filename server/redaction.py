"""Secret redaction: the one place that knows which values are secret.

Secret *values* are registered with :func:`remember_secret` (the sidecar registers the
environment variables named by every model's ``apiKeyEnv`` and by the ``secretEnv``
setting at start and at ``initialize``). :func:`redact` removes every registered value
(and, with ``patterns=True``, anything that looks like a key or a bearer token) from a
text; :func:`redact_value` does the same through a JSON-like value. The server applies
them wherever it emits or stores text, always *before* any truncation, so a cut can
never leave part of a key behind: :func:`redact_cut` masks a text, then cuts it; where a cut
must come first (a window read from the end of a file, a line read up to a bound),
:func:`redact_piece` leaves out the piece of a known secret that the cut left at the text's
edge. Imports nothing but the standard library.

A registered value is masked as written and in the forms a text commonly carries it in:
JSON-escaped, URL-encoded (``quote`` and ``quote_plus``) and base64 (standard and URL-safe,
at any of the three byte alignments, so a key inside ``base64("user:" + key)`` of a Basic
``Authorization`` header is masked too; the one or two characters at each edge that mix
with the neighbouring bytes stay). Values shorter than :data:`MIN_SECRET_CHARS` are not
registered: masking them would garble ordinary text; nor is a word of letters only of at most
:data:`PLACEHOLDER_MAX_CHARS` (7) characters (``none``, ``EMPTY``, ``dummy``, ``ollama``: the
placeholder a local server takes for a key), which is no secret, and whose masking would rewrite
protocol words (``"kind": "none"``); nor a number of digits only of at most
:data:`SHORT_NUMBER_MAX_CHARS` (7) digits (``4096``, ``8080``, ``300000``: a count, a limit, a
port, a time-out), which is no key (real keys are long: 20 characters and more), and whose
masking would rewrite every such number on the wire, request ids, line numbers and sizes. An
environment value is taken for a secret by its variable's name (:func:`secret_env_values`), but
for a number under a name that says it counts (``MAX_TOKENS``, ``TOKEN_LIMIT``, ``AUTH_PORT``).

A number whose JSON text is a registered value (a PIN, an account number) is masked too, as the
string ``"[REDACTED]"``: in values (:func:`redact_value`) and in JSON text (:func:`redact_bytes`),
which always stays valid JSON: a value is masked within its string, or a number replaced whole,
never the bytes of a number or of the structure around it. On the wire (``keep_id``), a JSON-RPC
message keeps its ``id`` as it is, whatever it holds: an answer must carry the id of the request
it answers (the client chose it, or the server counted it), or it answers nothing.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any, Callable, Iterable

MASK = "[REDACTED]"
MIN_SECRET_CHARS = _MIN_LEN = 4
#: a value of letters only (A-Z, a-z) this long or shorter is a placeholder, not a secret
PLACEHOLDER_MAX_CHARS = 7
#: a value of digits only this long or shorter is a number (a count, a limit, a port), not a secret:
#: every port (5 digits), token limits up to a million and time-outs in milliseconds up to 2.7
#: hours fit, and no real key is that short (API keys have 20 characters and more); 8 digits and
#: more (an account number, a PIN written as a date) may be one
SHORT_NUMBER_MAX_CHARS = 7
_MIN_B64 = 16  # a base64 form shorter than this could occur by chance in an unrelated blob
_MASK_B = MASK.encode()
_MASK_JSON = b'"' + _MASK_B + b'"'   # a masked number: the mask as a JSON string
_DEPTH = 200  # how deep the walk of a value recurses; what lies deeper is walked with a stack

_KNOWN: set[str] = set()
_ORDERED: tuple[str, ...] = ()   # longest first, so a key containing another is masked whole

#: the shapes of API keys and tokens as their issuers write them: OpenAI's and Anthropic's ``sk-...``,
#: Google's ``AIza...``, Hugging Face's ``hf_...``, Groq's ``gsk_...``, GitHub's ``ghp_...`` and
#: ``github_pat_...``, GitLab's ``glpat-...``, Slack's ``xoxb-...``
KEY_SHAPE = re.compile(r"\b(?:sk-[A-Za-z0-9_\-\*\.]{4,}|AIza[0-9A-Za-z_\-]{20,}|hf_[A-Za-z0-9]{20,}|gsk_[A-Za-z0-9]{20,}"
                       r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_\-]{20,}"
                       r"|xox[abposr]-[A-Za-z0-9\-]{10,})")

_PATTERNS = (
    (KEY_SHAPE, lambda m: MASK),                                                  # API keys by their shape
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9_\-\.=:/+]{6,}"), lambda m: "Bearer " + MASK),
    (re.compile(r"(?i)(api[_-]?key['\"]?\s*[:=]\s*['\"]?)[^\s'\",}]{6,}"), lambda m: m.group(1) + MASK),
    (re.compile(r"(?i)(://)[^/@\s:]+:[^/@\s]+@"), lambda m: m.group(1) + MASK + "@"),  # user:password@
)


#: an environment variable (``mcpServers.*.env``, a CLI model's ``env``) whose name says it holds a secret
SECRET_ENV_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)
#: the words of a variable's name that say its value is a count, a limit, a size or a port
#: (``MAX_TOKENS``, ``TOKEN_LIMIT``, ``KEYCLOAK_PORT``, ``maxOutputTokens``), whatever
#: ``SECRET_ENV_NAME`` finds in the name
COUNT_ENV_WORDS = frozenset({"MAX", "MIN", "LIMIT", "COUNT", "NUM", "SIZE", "PORT", "TIMEOUT", "TTL", "LEN",
                             "LENGTH", "RETRIES", "BUDGET", "TOKENS"})
_NUMBER_VALUE = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def secret_env_values(env: Any) -> list[str]:
    """The values of an ``env`` object (an MCP server's, a CLI model's) whose names say they are
    secret (``SECRET_ENV_NAME``); not every value: masking ``debug`` or ``1`` would garble text.
    Nor a number under a name that says it counts (:func:`_counts`): ``MAX_TOKENS=4096`` holds
    ``TOKEN`` but no secret, and masking ``4096`` would rewrite every 4096 on the wire."""
    if not isinstance(env, dict):
        return []
    return [v for k, v in env.items() if isinstance(k, str) and isinstance(v, str) and SECRET_ENV_NAME.search(k)
            and not (_counts(k) and _NUMBER_VALUE.fullmatch(v.strip()))]


#: an HTTP header (a model's ``options.extraHeaders``) whose name says it carries a secret
SECRET_HEADER_NAME = re.compile(r"auth|api[-_]?key|token|secret|password|credential|cookie", re.IGNORECASE)


def model_secrets(config: Any) -> tuple[list[str], list[str]]:
    """The secrets one ModelConfig names or holds: the names of the environment variables that
    hold one (the ``apiKeyEnv``, ``OPENAI_API_KEY`` for an ``openai`` model without one), and the
    values written into it under a name that says they are secret: a CLI model's ``env`` entry
    (:func:`secret_env_values`) and ``command`` option (:func:`command_secret_values`), the
    password of a ``user:password@`` and the value of a query (or path) parameter named like a
    secret (``?key=``, ``api_key=``, ``access_token=``) in a ``baseUrl`` (:func:`url_secrets`), a
    header of ``options.extraHeaders`` named like
    :data:`SECRET_HEADER_NAME` (whole, and without its scheme: ``Bearer``, ``Basic``), and a key
    pasted as the ``apiKeyEnv`` (:func:`looks_like_key`). A config of any shape gives what can
    be read of it. The same for a model of the settings and one given inline (``chatModel``)."""
    names: list[str] = []
    values: list[str] = []
    if not isinstance(config, dict):
        return names, values
    env = config.get("apiKeyEnv")
    if isinstance(env, str) and env:
        if looks_like_key(env):
            values.append(env.strip())
        else:
            names.append(env)
    elif config.get("provider") == "openai":
        names.append("OPENAI_API_KEY")
    if config.get("provider") == "cli":
        values.extend(secret_env_values(config.get("env")))
        values.extend(command_secret_values(config.get("command")))
    if isinstance(config.get("baseUrl"), str):
        values.extend(url_secrets(config["baseUrl"]))
    options = config.get("options")
    if isinstance(options, dict):
        for key, headers in options.items():
            if isinstance(key, str) and key.replace("_", "").lower() == "extraheaders" and isinstance(headers, dict):
                for name, value in headers.items():
                    if isinstance(name, str) and isinstance(value, str) and SECRET_HEADER_NAME.search(name):
                        values.append(value.strip())
                        scheme, _, credential = value.strip().partition(" ")
                        if credential.strip() and scheme.isalpha():
                            values.append(credential.strip())
    return names, [v for v in values if v]


def masked_fields(config: Any, *, anywhere: bool = False) -> list[str]:
    """Where a ModelConfig holds the mask in a field that is masked when it is stored: the path
    of each, in order (``env['PROBE_API_KEY']``, ``command[4]``, ``baseUrl``,
    ``options.extraHeaders['X-Api-Key']``). A model given inline (``chatModel``) is stored with
    its secrets masked (:func:`model_secrets`, docs/SECURITY.md, Known limits): restored after a
    restart, such a model would send or pass the mask in place of each. Only those fields are
    looked at: a CLI model's ``env`` value named like a secret (:func:`secret_env_values`) and
    ``command`` option named like one (:func:`secret_args`), the password and the query values
    named like a secret of a ``baseUrl`` (:func:`url_secrets`), and a header of
    ``options.extraHeaders`` named like one (:data:`SECRET_HEADER_NAME`); the text
    ``[REDACTED]`` elsewhere (a scripted reply, a CLI argument saying what to write in place of
    a credential) is the config's own, and the model works as given.

    ``anywhere``: every string of the config holding the mask, in order (``command[2]``,
    ``responses[0]``, ``options.extraHeaders['X-Note']``; the config's fields and its
    ``options``' dotted, other keys and indices subscripted), for a model restored from the store
    (``createBranch.chatModel`` of a branch stored before a restart): the store masks every
    known secret wherever it is in a record (``state.store``), so a secret the server knew,
    written in a field of no secret name (``command: ["llm", "-k", KEY]``, a path of its
    ``baseUrl``), is the mask there too."""
    found: list[str] = []
    if anywhere:
        stack: list[tuple[str, Any, bool]] = [("", config, True)]  # (path, value, whether its keys are fields)
        while stack:
            path, value, fields = stack.pop()
            if isinstance(value, str):
                if MASK in value:
                    found.append(path)
            elif isinstance(value, dict):
                stack.extend(reversed([((f"{path}.{k}" if path else str(k)) if fields else f"{path}[{k!r}]", v,
                                        not path and k == "options") for k, v in value.items()]))
            elif isinstance(value, (list, tuple)):
                stack.extend(reversed([(f"{path}[{i}]", v, False) for i, v in enumerate(value)]))
        return found
    if not isinstance(config, dict):
        return found
    if config.get("provider") == "cli":
        env = config.get("env")
        if isinstance(env, dict):
            found.extend(f"env[{k!r}]" for k, v in env.items() if isinstance(v, str) and MASK in v
                         and v in secret_env_values({k: v}))
        found.extend(f"command[{i}]" for i, value in secret_args(config.get("command")) if MASK in value)
    url = config.get("baseUrl")
    if isinstance(url, str) and any(MASK in value for value in url_secrets(url)):
        found.append("baseUrl")
    options = config.get("options")
    if isinstance(options, dict):
        for key, headers in options.items():
            if isinstance(key, str) and key.replace("_", "").lower() == "extraheaders" and isinstance(headers, dict):
                found.extend(f"options.{key}[{name!r}]" for name, value in headers.items()
                             if isinstance(name, str) and isinstance(value, str) and SECRET_HEADER_NAME.search(name)
                             and MASK in value)
    return found


#: the last word of a command-line option's name that says its value is secret (``--key``,
#: ``--hf-token``, ``--client-secret``, ``--api-key``, ``--apiKey``); ``--api-key-env`` (it
#: names a variable), ``--max-tokens``, ``--tokenizer``, ``--sort-keys`` and ``--author`` end
#: in none of them
SECRET_OPTION_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "auth", "authorization",
                                 "credential", "credentials"})

#: the last word of a URL's query parameter that says its value is secret besides those of
#: :data:`SECRET_OPTION_WORDS`: a signature that is the credential (an Azure SAS ``sig=``, an
#: S3 presigned ``X-Amz-Signature=``); not ``code`` (an OAuth code, but a word of many queries)
URL_SECRET_WORDS = frozenset({"sig", "signature"})

#: an option's value that names a file (``--ssl-key /certs/client.key``, ``--tls-key ./key.pem``,
#: ``--credentials ~/gcp.json``): it begins like a path (``/``, ``./``, ``../``, ``~/``, ``~user/``,
#: a drive ``C:\``) or ends in the extension of a key, certificate or credentials file; a path
#: is no secret, and masked it would garble every text naming that file
PATH_VALUE = re.compile(r"(?:/|\.\.?[/\\]|~[\w.-]*(?:/|$)|[A-Za-z]:[/\\]|\\\\)"
                        r"|.+\.(?:pem|key|crt|cer|der|csr|p12|pfx|jks|keystore|pub|json|txt|env|asc|gpg)$", re.I)


def secret_option(name: str, words: frozenset[str] = SECRET_OPTION_WORDS) -> bool:
    """Whether a command-line option's name (without its dashes) says that its value is secret:
    its last word (split at ``-``, ``_``, ``.`` and where a lower case letter meets an upper case
    one) is one of ``words`` (:data:`SECRET_OPTION_WORDS`), a whole word; but for a flag that
    turns a thing off (``--no-auth``, ``--no_token``), which takes no value."""
    if re.match(r"(?i)no[-_]", name):
        return False
    found = re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)
    return bool(found) and found[-1].lower() in words


def command_args(command: Any) -> list[Any] | None:
    """A command line as its arguments: a list as it is, a string split as a shell would (at
    white space when its quotes do not close); None for anything else."""
    if isinstance(command, str):
        import shlex

        try:
            return shlex.split(command)
        except ValueError:
            return command.split()
    return list(command) if isinstance(command, (list, tuple)) else None


def secret_args(command: Any) -> list[tuple[int, str]]:
    """Where a command line (a CLI model's ``command``: :func:`command_args`) gives a value to an
    option whose name says it is secret (:func:`secret_option`), and the value: ``--key=VALUE``
    (that argument) and ``--api-key VALUE`` (the next argument, unless it is an option); never
    one holding the ``{prompt}`` placeholder, nor one that names a file (:data:`PATH_VALUE`:
    ``--ssl-key /certs/client.key``). The one reading of :func:`command_secret_values` (registered
    as secrets: a CLI model's, an MCP server's), :func:`masked_fields` and
    ``models.config.command_shown`` (masked where shown)."""
    out: list[tuple[int, str]] = []
    take_next = False
    for i, arg in enumerate(command_args(command) or ()):
        if not isinstance(arg, str):
            take_next = False
            continue
        if take_next and not arg.startswith("-") and "{prompt}" not in arg:
            if not PATH_VALUE.match(arg):
                out.append((i, arg))
            take_next = False
            continue
        flag, eq, value = arg.partition("=")
        take_next = flag.startswith("-") and secret_option(flag.lstrip("-")) and not eq
        if (flag.startswith("-") and eq and value and "{prompt}" not in value and secret_option(flag.lstrip("-"))
                and not PATH_VALUE.match(value)):
            out.append((i, value))
    return out


def command_secret_values(command: Any) -> list[str]:
    """The values a command line gives options whose name says they are secret (:func:`secret_args`)."""
    return [value for _, value in secret_args(command)]


def url_passwords(url: str) -> list[str]:
    """The password of a ``user:password@`` in ``url``, as written there (percent-encoded) and
    decoded, or nothing."""
    m = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)@", url.strip())
    if not m or ":" not in m.group(1):
        return []
    from urllib.parse import unquote

    password = m.group(1).split(":", 1)[1]  # (up to the authority's last "@")
    return list(dict.fromkeys([password, unquote(password)]))


_URL_WORDS = SECRET_OPTION_WORDS | URL_SECRET_WORDS


def url_secrets(url: str) -> list[str]:
    """The secrets a URL (a model's ``baseUrl``) holds: the password of its ``user:password@``
    (:func:`url_passwords`) and the value of each query parameter (``?key=``, ``&api_key=``,
    ``access_token=``) and path parameter (``;key=``) whose name says it is secret by the rule
    of a command line's options (:func:`secret_option`: its last word is ``key``, ``token``,
    ``secret``, ``password`` ...) or is a signature (:data:`URL_SECRET_WORDS`: ``sig=``), each as
    written there and decoded: what a model menu leaves out (``models.config.url_shown``) is
    masked wherever else the URL shows."""
    from urllib.parse import unquote, unquote_plus, urlsplit

    values = url_passwords(url)
    try:
        parts = urlsplit(url.strip())
    except ValueError:  # (no URL: what it holds is read by the patterns a provider's error text goes through)
        return values
    params = [(p, unquote_plus) for p in re.split(r"[&;]", parts.query)]
    params += [(p, unquote) for segment in parts.path.split("/") for p in segment.split(";")[1:]]
    for param, decode in params:
        name, eq, value = param.partition("=")
        if eq and value and secret_option(decode(name).strip().lstrip("-"), _URL_WORDS):
            values.extend(v for v in (value, decode(value)) if v not in values)
    return values


def mcp_server_secrets(spec: Any) -> list[str]:
    """The secrets an MCP server's configuration (``{command, env}``: an ``mcpServers`` entry of
    the settings, a server a front end's session passed) holds: its ``env`` values named like a
    secret (:func:`secret_env_values`) and the values its ``command`` gives options named like
    one (``--token VALUE``, ``--password=VALUE``: :func:`command_secret_values`, the same reading
    as a CLI model's). A configuration of any shape gives what can be read of it."""
    if not isinstance(spec, dict):
        return []
    return secret_env_values(spec.get("env")) + command_secret_values(spec.get("command"))


def env_value(name: str) -> str | None:
    """The environment's value of ``name``; None when unset, or when no environment can hold
    the name (a lone surrogate)."""
    import os

    try:
        return os.environ.get(name)
    except ValueError:
        return None


def remember_model_secrets(config: Any) -> None:
    """Register the secrets a ModelConfig names or holds (:func:`model_secrets`): a model given
    inline (``createBranch.chatModel``) is masked as one of the settings is."""
    names, values = model_secrets(config)
    for value in [env_value(n) for n in names] + values:
        remember_secret(value)


#: a name this long that has a digit and lower case letters mixed with upper case ones, or no
#: ``_``, or many digits, is taken for a key of no known shape (:func:`looks_like_key`)
KEY_LIKE_NAME_CHARS = 20


def looks_like_key(text: str) -> bool:
    """Whether ``text`` is, as a whole, a key or token of a shape its issuer writes
    (:data:`KEY_SHAPE`), a bearer credential, or a key of no known shape (Mistral's, Together's):
    :data:`KEY_LIKE_NAME_CHARS` characters or more with a digit, and upper and lower case letters
    mixed, or no ``_``, or a third of them digits; an environment variable's name is written in
    capitals and ``_`` (``AZURE_OPENAI_KEY_2``). What a person pastes where the name of the
    variable that holds it belongs (a model's ``apiKeyEnv``)."""
    text = text.strip()
    if KEY_SHAPE.fullmatch(text) or re.fullmatch(r"(?i)bearer\s+\S{6,}", text):
        return True
    digits = sum(c.isdigit() for c in text)
    if len(text) < KEY_LIKE_NAME_CHARS or not digits or any(c.isspace() for c in text):
        return False
    mixed = any(c.isupper() for c in text) and any(c.islower() for c in text)
    return mixed or "_" not in text or digits * 3 >= len(text)


def _counts(name: str) -> bool:
    """Whether a variable's name has a word that says it counts (``COUNT_ENV_WORDS``); its words
    are split at ``_``, ``-``, ``.`` and where a lower case letter meets an upper case one."""
    words = re.split(r"[^A-Za-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name))
    return any(w.upper() in COUNT_ENV_WORDS for w in words)


_NOT_SECRETS: set[str] = set()  # placeholder words and short numbers seen (each said once, on the debug log)


def _is_placeholder(value: str) -> bool:
    """A word of letters only, shorter than 8 characters (``none``, ``EMPTY``, ``dummy``,
    ``ollama``): what a local server is given for a key it does not check. No secret, and
    masking it would rewrite protocol words in the frames."""
    return len(value) <= PLACEHOLDER_MAX_CHARS and value.isascii() and value.isalpha()


def _is_short_number(value: str) -> bool:
    """Digits only, at most ``SHORT_NUMBER_MAX_CHARS`` (7) of them (``4096``, ``8080``): a count,
    a limit, a port, no key. Masking it would rewrite that number wherever the wire has it: a
    request id (its answer would answer nothing), a line number or a size (a typed field would
    become a string)."""
    return len(value) <= SHORT_NUMBER_MAX_CHARS and value.isascii() and value.isdigit()


def _not_secret(value: str) -> bool:
    return _is_placeholder(value) or _is_short_number(value)


def remember_secret(value: str | None) -> None:
    """Register a secret value; every later :func:`redact` removes it. It is registered as
    written, and without the white space at its ends (a secret mounted from a file ends in a
    newline, which the program that reads it strips). A secret of several lines (a PEM key, a
    JSON credential) is masked where it appears whole; its lines are not registered on their own:
    a line of it shown alone is not masked (docs/SECURITY.md, Known limits). Its lines would be
    many short forms (a 4096-bit key has some fifty), each searched for in every frame, and the
    ordinary ones among them (``NODE_ENV=production``, a host name, a project id) would put
    ``[REDACTED]`` in ordinary text. A value (or form) shorter than :data:`MIN_SECRET_CHARS`, a
    placeholder word (:func:`_is_placeholder`) or a short number (:func:`_is_short_number`) is not
    registered."""
    if not isinstance(value, str):
        return
    _remember(value)
    if value.strip() != value:
        _remember(value.strip())


def _remember(value: str) -> None:
    global _ORDERED
    if len(value) >= _MIN_LEN and value not in _KNOWN and value != MASK:  # (a secret stored masked: no secret)
        if _not_secret(value):
            if value not in _NOT_SECRETS:
                _NOT_SECRETS.add(value)
                import logging  # (loaded already: the server's logging is set up before any settings)

                if value.isalpha():
                    logging.getLogger("operate_sidecar.server.redaction").debug(
                        "a secret value of %d letters is not masked: a word of letters only under 8 characters is a "
                        "placeholder key (such as none, EMPTY, dummy), not a secret", len(value))
                else:
                    logging.getLogger("operate_sidecar.server.redaction").debug(
                        "a secret value of %d digits is not masked: a number of digits only under 8 characters is "
                        "a count, a limit or a port (such as 4096 or 8080), not a key", len(value))
            return
        _KNOWN.add(value)
        _ORDERED = tuple(sorted(_KNOWN, key=len, reverse=True))


def known_secrets() -> tuple[str, ...]:
    return _ORDERED


def has_secrets() -> bool:
    return bool(_ORDERED)


def redact(text: Any, secrets: Iterable[str | None] = (), *, patterns: bool = False) -> str:
    """``text`` with every registered secret (and ``secrets``) replaced by ``[REDACTED]``;
    with ``patterns``, key-looking tokens too (for error texts from providers)."""
    out = text if isinstance(text, str) else str(text)
    extra = [s for s in secrets
             if isinstance(s, str) and len(s) >= _MIN_LEN and s not in _KNOWN and not _not_secret(s)]
    forms = _text_forms_of(extra) + _known_text_forms() if extra else _known_text_forms()
    for f in forms:
        if f in out:
            out = out.replace(f, MASK)
    if patterns:
        for rx, repl in _PATTERNS:
            out = rx.sub(repl, out)
    return out


#: how many characters past its cut :func:`redact_cut` reads of a long text, beyond the longest
#: form of a known secret (a key-shaped token, a ``user:password@``, is found whole in them)
CUT_MARGIN = 1024


def redact_cut(text: str, limit: int, *, more: str = "", patterns: bool = False) -> str:
    """The first ``limit`` characters of ``text`` redacted (:func:`redact`), masked before the
    cut (docs/SECURITY.md G6), with ``more`` (``"…"``) after them when the text went on. Of a
    long text only the first ``limit`` characters and a margin are read (the longest form of a
    known secret and :data:`CUT_MARGIN`): a secret that begins before the cut ends in them, and
    a piece of one at the margin's end is left out (:func:`redact_piece`), looked for only when
    it could reach into the first ``limit`` (masked, the window is shorter than ``limit`` and the
    longest form: such a piece is shorter than that form)."""
    forms = _known_text_forms()
    longest = len(forms[0]) if forms else 0
    window = limit + longest + CUT_MARGIN
    if len(text) > window:
        out = redact(text[:window], patterns=patterns)
        if forms and len(out) < limit + longest:
            out = out[:_open_end(out, forms)]
        return out[:limit] + more
    out = redact(text, patterns=patterns)
    return out[:limit] + more if len(out) > limit else out


def redact_piece(text: str, *, cut_before: bool = False, cut_after: bool = False, patterns: bool = False) -> str:
    """``text``, a piece of a longer text that had to be cut before it could be redacted (a
    window read from the end of a file, a line read up to a bound), redacted (:func:`redact`),
    and without the piece of a known secret (in any of its forms) that a cut ran through, which
    no mask finds: ``cut_before`` (its beginning was cut off), its longest beginning that ends a
    form is left out; ``cut_after`` (its end was cut off), its longest end that begins one. Such
    a piece is left out rather than masked: it sits where the text is cut anyway, and a
    character or two that only may begin a secret (one of ten, with a few secrets known) would
    put ``[REDACTED]`` at the edge of every other cut text."""
    out = redact(text, patterns=patterns)
    forms = _known_text_forms()
    if not forms or not out:
        return out
    if cut_after:
        out = out[:_open_end(out, forms)]
    if cut_before:
        out = out[_open_start(out, forms):]
    return out


def _open_end(text: str, forms: tuple[str, ...]) -> int:
    """Where the longest end of ``text`` that is a proper beginning of one of ``forms`` (longest
    first) begins; ``len(text)`` when none is. Such a beginning ends with the text's last
    character: each form is searched for it from the longest beginning that could be one down,
    and the first that ``text`` ends with is that form's longest (time in proportion to the
    forms' length, not to their length times their number, as a scan of every end of ``text``
    against every form took: 200 ms of the event loop with a private key and 50 secrets)."""
    if not text:
        return 0
    last, best = text[-1], 0
    for f in forms:
        if len(f) - 1 <= best:  # (none after it is longer: forms are longest first)
            break
        k = f.rfind(last, best, min(len(f) - 1, len(text)))  # (k + 1: a beginning's length, longer than best)
        while k != -1:
            if text.endswith(f[:k + 1]):
                best = k + 1
                break
            k = f.rfind(last, best, k)
    return len(text) - best


def _open_start(text: str, forms: tuple[str, ...]) -> int:
    """Where the longest beginning of ``text`` that is a proper end of one of ``forms`` (longest
    first) ends; 0 when none is. The mirror of :func:`_open_end`: such an end of a form begins
    with the text's first character, searched for in each form from the longest end that could
    be one."""
    if not text:
        return 0
    first, best = text[0], 0
    for f in forms:
        if len(f) - 1 <= best:  # (none after it is longer)
            break
        p = f.find(first, max(1, len(f) - len(text)), len(f) - best)  # (len(f) - p: an end's length, longer than best)
        while p != -1:
            if text.startswith(f[p:]):
                best = len(f) - p
                break
            p = f.find(first, p + 1, len(f) - best)
    return best


def redact_value(value: Any) -> Any:
    """``value`` (a JSON-like structure, nested to any depth) with every registered secret
    redacted in every string, keys included, and every number whose JSON text is a registered
    value replaced by ``[REDACTED]``. Returns ``value`` itself when nothing is registered or found."""
    if not _ORDERED:
        return value
    return _walk(value, 0, _numeric_secrets()[0])


def _walk(v: Any, depth: int, numbers: frozenset[str]) -> Any:
    if isinstance(v, str):
        return redact(v) if any(f in v for f in _known_text_forms()) else v
    if depth > _DEPTH and isinstance(v, (dict, list, tuple)):
        return _walk_deep(v, numbers)
    # a container is copied only when a secret was found in it: with a key configured, every tool
    # output passes here, and one with nothing to hide is kept as it is (not copied whole)
    if isinstance(v, dict):
        pairs = [((_walk(k, depth + 1, numbers) if isinstance(k, str) else k), _walk(x, depth + 1, numbers))
                 for k, x in v.items()]
        if all(k2 is k and x2 is x for (k2, x2), (k, x) in zip(pairs, v.items())):
            return v
        return dict(pairs)
    if isinstance(v, (list, tuple)):
        items = [_walk(x, depth + 1, numbers) for x in v]
        return v if all(a is b for a, b in zip(items, v)) else items
    if numbers and (type(v) is int or type(v) is float) and repr(v) in numbers:  # (its JSON text)
        return MASK
    return v


def _walk_deep(root: dict | list | tuple, numbers: frozenset[str]) -> Any:
    """:func:`_walk` for what lies deeper than it recurses, with the same result, by an explicit
    stack (any depth). A container met again inside itself (a cycle, which no JSON holds) is
    left as it is there: it is walked where it was first met."""
    def frame(node: Any) -> list:  # [node, its items, next index, the items walked, changed]
        return [node, list(node.items()) if isinstance(node, dict) else list(node), 0, [], False]

    stack = [frame(root)]
    open_ = {id(root)}
    done: Any = None
    while stack:
        top = stack[-1]
        node, items, i, out = top[0], top[1], top[2], top[3]
        is_dict = isinstance(node, dict)
        if done is not None:  # a child container just finished: it is item i
            child, value = done
            done = None
            if is_dict:
                k = items[i][0]
                k2 = _walk(k, 0, numbers) if isinstance(k, str) else k
                out.append((k2, value))
                top[4] = top[4] or k2 is not k or value is not child
            else:
                out.append(value)
                top[4] = top[4] or value is not child
            i += 1
        while i < len(items):
            k, x = items[i] if is_dict else (None, items[i])
            if isinstance(x, (dict, list, tuple)) and id(x) not in open_:
                break
            x2 = x if isinstance(x, (dict, list, tuple)) else _walk(x, 0, numbers)
            if is_dict:
                k2 = _walk(k, 0, numbers) if isinstance(k, str) else k
                out.append((k2, x2))
                top[4] = top[4] or k2 is not k or x2 is not x
            else:
                out.append(x2)
                top[4] = top[4] or x2 is not x
            i += 1
        top[2] = i
        if i < len(items):  # descend into item i
            stack.append(frame(x))
            open_.add(id(x))
            continue
        stack.pop()
        open_.discard(id(node))
        done = (node, (dict(out) if is_dict else out) if top[4] else node)
    return done[1]


def redact_bytes(data: bytes, *, keep_id: bool = False) -> bytes:
    """JSON text (a frame, or lines of JSON) with every registered secret masked (the last net
    before the wire): the value in every form :func:`redact` knows, and as JSON escapes each.
    The result is as valid JSON as ``data`` was: a value found in a string is masked within it
    (:func:`_masked_string` when the plain replacement would break an escape), a number whose
    text is a registered value becomes ``"[REDACTED]"``, and a value found in the structure
    otherwise (in a longer number, say) is left there. With ``keep_id`` (the wire's writers),
    a JSON-RPC message (an object with an ``id``) keeps its ``id`` as it was, whatever is masked
    (:func:`_id_kept`): an answer whose id is rewritten answers nothing, and the client's answer
    to a request of the server's would not be matched. With no value found (the usual case),
    ``data`` itself is returned after one search per form."""
    if not _ORDERED:
        return data
    forms = _known_byte_forms()
    for form in forms:
        if form in data:
            break
    else:
        return data
    if b"\n" not in data:
        return _redact_json(data, forms, keep_id)
    return b"\n".join(_redact_json(line, forms, keep_id) for line in data.split(b"\n"))


def redact_keeping(msg: dict, key: str, dumps: Callable[[Any], bytes]) -> bytes:
    """``dumps(msg)`` through :func:`redact_bytes` (keeping its ``id``: it is a request of the
    server's that goes on the wire), but for ``msg["params"][key]``, which goes out as it is:
    the text a client is asked to write into a file (``fs/writeTextFile``'s ``text``, ACP's
    ``fs/write_text_file`` ``content``), which must be what the tool wrote, as the file written
    on disk is. ``dumps`` writes compact JSON (no spaces)."""
    params = msg.get("params")
    if not _ORDERED or not isinstance(params, dict) or key not in params:
        return redact_bytes(dumps(msg), keep_id=True)
    rest = dict(params)
    kept = rest.pop(key)
    body = redact_bytes(dumps({**{k: v for k, v in msg.items() if k != "params"}, "params": rest}), keep_id=True)
    if not body.endswith(b"}}"):  # (not the compact JSON this expects: nothing is kept)
        return redact_bytes(dumps(msg), keep_id=True)
    head = body[:-2]
    return head + (b"" if head.endswith(b"{") else b",") + dumps(key) + b":" + dumps(kept) + b"}}"


# one JSON string token and one number token, as the bytes of a JSON text hold them, and the
# text of a JSON number: compiled when first needed (a secret was found, or registered), not at start
_JSON_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_JSON_NUMBER = rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
_NUMBER_TEXT = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"


def _replaced(data: bytes, forms: tuple[bytes, ...]) -> bytes:
    for form in forms:
        if form in data:
            data = data.replace(form, _MASK_B)
    return data


def _redact_json(text: bytes, forms: tuple[bytes, ...], keep_id: bool = False) -> bytes:
    """One JSON text (a line) with the registered values masked: every form replaced, when the
    result still reads as JSON (the usual case: a value inside a string); else token by token.
    With ``keep_id``, a message keeps its ``id`` (:func:`_id_kept`)."""
    out = _replaced(text, forms)
    if out is text:
        return text
    msg: Any = _UNREAD
    try:
        msg = json.loads(out)
    except (ValueError, RecursionError):
        out = _redact_tokens(text, forms)
    return _id_kept(text, out, msg, forms) if keep_id and b'"id"' in text else out


_UNREAD = object()  # (a masked text not parsed yet)


def _id_kept(text: bytes, masked: bytes, msg: Any = _UNREAD, forms: tuple[bytes, ...] | None = None) -> bytes:
    """``masked`` (``text``, a JSON-RPC message, with the registered values masked; ``msg``, it
    parsed, when it was already) with the ``id`` that ``text`` has, when masking changed it (a
    request id that is, or holds, a registered value): the message is written again (compact
    JSON) with that id. An id is the client's own (it chose it: nothing is told that it does not
    know) or the server's count; rewritten, the answer would answer nothing. ``text`` is parsed
    only when masking may have touched the id (:func:`_id_touched`), not for every message in
    which a secret was masked."""
    try:
        msg = json.loads(masked) if msg is _UNREAD else msg
    except (ValueError, RecursionError):
        return masked
    if not isinstance(msg, dict) or not _id_touched(msg, _known_byte_forms() if forms is None else forms):
        return masked
    try:
        was = json.loads(text)
    except (ValueError, RecursionError):
        return masked
    if not isinstance(was, dict) or "id" not in was \
            or (type(msg.get("id")) is type(was["id"]) and msg.get("id") == was["id"]):
        return masked
    msg["id"] = was["id"]
    try:
        return json.dumps(msg, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: written escaped, as it came
        return json.dumps(msg, separators=(",", ":")).encode("ascii")
    except (ValueError, RecursionError):
        return masked


def _id_touched(msg: dict, forms: tuple[bytes, ...]) -> bool:
    """Whether masking may have changed the ``id`` of a message (``msg``, parsed masked). A form
    with no quote and no backslash is masked within one string or number (else the text is no
    JSON, and is masked token by token), so the message keeps its shape, and an id it touched
    holds the mask; one with a quote or a backslash may have masked across the JSON around the
    id (or broken an escape): then the original is read, to be sure."""
    if any(b'"' in form or b"\\" in form for form in forms):
        return True
    if "id" not in msg:
        return False
    value = msg["id"]
    try:
        return MASK in (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return True


def _redact_tokens(text: bytes, forms: tuple[bytes, ...]) -> bytes:
    """``text`` with each string token masked as a string (:func:`_masked_string`) and each
    number token whose text is a registered value replaced by ``"[REDACTED]"``; the bytes
    between tokens are kept. A string left open at the end (a line cut short) has its forms
    replaced."""
    numbers = _numeric_secrets()[1]
    out: list[bytes] = []
    pos = 0
    for m in re.finditer(_JSON_STRING, text, re.S):
        out += [_masked_gap(text[pos:m.start()], forms, numbers), _masked_string(m.group(), forms)]
        pos = m.end()
    out.append(_masked_gap(text[pos:], forms, numbers))
    return b"".join(out)


def _masked_gap(gap: bytes, forms: tuple[bytes, ...], numbers: frozenset[bytes]) -> bytes:
    """The structure between two strings: numbers, ``true``, punctuation ..."""
    quote = gap.find(b'"')
    if quote != -1:  # a string that does not end in this text
        return _masked_gap(gap[:quote], forms, numbers) + _replaced(gap[quote:], forms)
    if not numbers or not any(form in gap for form in forms):
        return gap
    return re.sub(_JSON_NUMBER, lambda m: _MASK_JSON if m.group() in numbers else m.group(), gap)


def _masked_string(token: bytes, forms: tuple[bytes, ...]) -> bytes:
    """A JSON string token with the registered values masked: the forms replaced in its bytes,
    or, when that breaks an escape sequence, its text redacted and written again."""
    out = _replaced(token, forms)
    if out is token:
        return token
    try:
        if isinstance(json.loads(out), str):
            return out
    except ValueError:
        pass
    try:
        text = json.loads(token)
    except ValueError:  # (no JSON string to begin with)
        return out
    masked = json.dumps(redact(text), ensure_ascii=False)
    try:
        return masked.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: written escaped, as it came
        return json.dumps(redact(text)).encode("ascii")


class StreamRedactor:
    """Redacts a text that arrives in pieces (a model's streamed reply), so a secret split
    across pieces is masked too. :meth:`feed` returns what is pending plus the new piece,
    redacted, but for the shortest end that could still begin a registered secret (in any of
    its forms) or that a secret found in the text runs into: that end waits, as written, for
    the next piece. :meth:`flush` returns it, redacted, once the text has ended. With no
    secret registered, ``feed`` returns each piece as it came."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = ""

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def feed(self, piece: str) -> str:
        if not _ORDERED and not self._pending:
            return piece
        text = self._pending + piece
        cut = _safe_cut(text, _known_text_forms())
        self._pending = text[cut:]
        return redact(text[:cut]) if cut else ""

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return redact(rest) if rest else rest


def _safe_cut(text: str, forms: tuple[str, ...]) -> int:
    """Where ``text`` can be cut so that what is before the cut can be redacted alone: before
    its longest end that is a proper beginning of one of ``forms`` (what may still become a
    secret with what comes next), and before any form found in the text that runs across
    that point (one secret can end inside another, or begin inside another's beginning)."""
    if not forms or not text:
        return len(text)
    cut = _open_end(text, forms)
    moved = cut < len(text)
    while moved:
        moved = False
        for f in forms:
            i = text.find(f, max(0, cut - len(f) + 1))
            if i != -1 and i < cut:  # it starts before the cut and ends after it
                cut, moved = i, True
    return cut


# the forms of the registered secrets, longest first, computed once per set of secrets
# (keyed by the ``_ORDERED`` tuple itself, so restoring it restores them too)
_TEXT_CACHE: tuple[Any, tuple[str, ...]] = (None, ())
_BYTE_CACHE: tuple[Any, tuple[bytes, ...]] = (None, ())
_NUMBER_CACHE: tuple[Any, tuple[frozenset[str], frozenset[bytes]]] = (None, (frozenset(), frozenset()))


def _numeric_secrets() -> tuple[frozenset[str], frozenset[bytes]]:
    """The registered values that are the JSON text of a number (as text, and as bytes)."""
    global _NUMBER_CACHE
    key, found = _NUMBER_CACHE
    if key is not _ORDERED:
        texts = frozenset(s for s in _ORDERED if re.fullmatch(_NUMBER_TEXT, s))
        found = (texts, frozenset(s.encode("ascii") for s in texts))
        _NUMBER_CACHE = (_ORDERED, found)
    return found


def _known_text_forms() -> tuple[str, ...]:
    global _TEXT_CACHE
    key, forms = _TEXT_CACHE
    if key is not _ORDERED:
        forms = _text_forms_of(_ORDERED)
        _TEXT_CACHE = (_ORDERED, forms)
    return forms


def _known_byte_forms() -> tuple[bytes, ...]:
    global _BYTE_CACHE
    key, forms = _BYTE_CACHE
    if key is not _ORDERED:
        out: dict[bytes, None] = {}
        for f in _known_text_forms():
            out[f.encode("utf-8", "surrogatepass")] = None
            for esc in (json.dumps(f, ensure_ascii=False)[1:-1], json.dumps(f)[1:-1]):
                out[esc.encode("utf-8", "surrogatepass")] = None
        forms = tuple(sorted(out, key=len, reverse=True))
        _BYTE_CACHE = (_ORDERED, forms)
    return forms


def _text_forms_of(secrets: Iterable[str]) -> tuple[str, ...]:
    out: dict[str, None] = {}
    for s in secrets:
        out.update(dict.fromkeys(_forms(s)))
    return tuple(sorted(out, key=len, reverse=True))


def _forms(s: str) -> tuple[str, ...]:
    """``s`` as written, JSON-escaped, URL-encoded and base64-encoded (see the module)."""
    from urllib.parse import quote, quote_plus  # here: urllib.parse (and ipaddress) cost ~1.6 ms at start

    try:
        raw = s.encode("utf-8", "surrogateescape")  # the bytes of an environment value
    except UnicodeEncodeError:
        raw = s.encode("utf-8", "surrogatepass")
    forms = [s, json.dumps(s, ensure_ascii=False)[1:-1], json.dumps(s)[1:-1],
             quote(raw, safe=""), quote(raw, safe="/"), quote_plus(raw, safe="")]
    for shift in range(3):  # where the value starts within a 3-byte base64 group
        enc = base64.b64encode(b"\0" * shift + raw).decode("ascii")
        first, end = -(-shift // 3), (shift + len(raw)) // 3  # the groups made of the value's bytes only
        core = enc[4 * first:4 * end]
        if len(core) >= _MIN_B64:
            forms += [core, core.replace("+", "-").replace("/", "_")]
    return tuple(dict.fromkeys(f for f in forms if len(f) >= _MIN_LEN))


__all__ = ["MASK", "MIN_SECRET_CHARS", "PLACEHOLDER_MAX_CHARS", "SHORT_NUMBER_MAX_CHARS", "StreamRedactor",
           "KEY_SHAPE", "SECRET_OPTION_WORDS", "looks_like_key", "secret_option", "command_args", "secret_args",
           "command_secret_values", "url_passwords", "url_secrets", "mcp_server_secrets", "masked_fields",
           "model_secrets", "remember_model_secrets", "remember_secret", "known_secrets", "has_secrets", "redact",
           "redact_cut", "redact_piece", "redact_value", "redact_bytes", "redact_keeping"]
