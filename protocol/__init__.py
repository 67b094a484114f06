"""Wire types of the operate-sidecar protocol (docs/PROTOCOL.md v1), declared once as attrs classes.

    from operate_sidecar.protocol import structure, unstructure, ParamsError, OperateParams
    params = structure(OperateParams, raw_params)   # raises ParamsError (-32602)
    wire = unstructure(result)                      # camelCase plain JSON

Imports nothing from ``server`` and nothing heavier than attrs/cattrs.
"""

from . import methods
from ._base import OMITTED, Id, JsonObject, JsonSchema, JsonValue, Omitted, is_omitted, wire_name
from .branches import (CONTENT_BY_KIND, ActionRequestContent, ActionResponseContent,
                       AssistantResponseContent, BranchIdResult, BranchInfo, BranchMessagesParams,
                       BranchMessagesResult, BranchParams, CreateBranchParams, InstructionContent,
                       ListBranchesResult, Message, MessageContent, MessageKind, MessageRole,
                       SystemContent)
from .catalog import (NOTIFICATIONS, REQUESTS, SERVER_NOTIFICATIONS, SERVER_TO_CLIENT_REQUESTS,
                      params_type, result_type)
from .convert import converter, describe_type, structure, unstructure
from .errors import (BRANCH_NOT_FOUND, ERROR_CODES, INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST,
                     METHOD_NOT_FOUND, MODEL_ERROR, PARSE_ERROR, REQUEST_CANCELLED,
                     SERVER_NOT_INITIALIZED, VALIDATION_FAILED, ParamsError, RpcError)
from .lifecycle import (ClientCapabilities, ClientInfo, CliModelConfig, CliProfile, Decision, Empty,
                        ExitParams, InitializedParams, InitializeParams, InitializeResult,
                        LocalModelConfig, McpServerConfig, Model, ModelConfig, OpenAIModelConfig,
                        ScriptedEntry, ScriptedModelConfig, ServerCapabilities, ServerInfo, Settings)
from .notifications import (CancelParams, LogMessageParams, MessageType, ProgressParams,
                            ProgressEndMessage, ProgressPhase, ProgressValue, ToolEventKind, ToolEventParams,
                            WorkDoneProgressBegin, WorkDoneProgressEnd, WorkDoneProgressReport)
from .operate import (REMOVED_MODEL_OPTIONS, ActionStrategy, FieldModel, HandleValidation, Instruct,
                      OperateParams, OperateResult, ParseOptions, ResultKind, Usage, ValidationFailedData)
from .tools import (PERMISSION_OPTIONS, AuthorizeToolParams, AuthorizeToolResult, ClientToolSpec, DiffPreview,
                    InvokeClientToolParams, InvokeClientToolResult, ListToolsParams, ListToolsResult,
                    PermissionOption, ReadTextFileParams, ReadTextFileResult, RegisterClientToolsParams,
                    RegisterClientToolsResult, RequestToolPermissionParams, RequestToolPermissionResult,
                    ToolInfo, ToolSource, WriteTextFileParams)

PROTOCOL_VERSION = 1

__all__ = sorted(n for n in dir() if not n.startswith("_") and n not in {
    "branches", "lifecycle", "notifications", "operate", "tools", "convert", "errors", "catalog"})
