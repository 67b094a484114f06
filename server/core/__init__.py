"""The composed operate pipeline (docs/PIPELINE.md) as a transport-free async library."""

from .act import DENIED, AuthorizationResult, ToolInvocation, act
from .alcall import alcall
from .branch import Branch
from .context import ContextProvider
from .errors import (
    ConfigurationError,
    ModelError,
    ModelRefused,
    OperateError,
    ParseError,
    RemovedArgumentError,
    ToolArgumentError,
    ToolNotRegistered,
    ToolTimeout,
    ValidationFailed,
)
from .hooks import HookBus, HookEvent, HookEventType
from .imodel import BaseModelProvider, ModelRequest, ModelResponse, StreamChunk, iModel
from .messages import Message, MessageLog
from .middle import Middle, communicate, run_and_collect
from .operate import operate
from .operative import (
    ActionRequestModel,
    ActionResponseModel,
    FieldModel,
    Operative,
    Reason,
    Spec,
    Step,
)
from .params import (
    DEFAULT_PARSE_ALCALL,
    ActionParam,
    AlcallParams,
    ChatParam,
    FuzzyMatchKeysParams,
    Instruct,
    ParseParam,
    RunParam,
    make_parse_param,
)
from .parse import UnparsedResponse, extract_json, parse
from .prepare import prepare_operate_kw
from .progress import ProgressSink, current_progress
from .tools import Tool, ToolCallContext, ToolRegistry, tool

__all__ = [name for name in dir() if not name.startswith("_")]
