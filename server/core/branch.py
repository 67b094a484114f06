"""``Branch``: one conversation — messages, tools, models, hooks, context
providers, an event log, and ``authorize()`` — with the ``operate`` facade."""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any, Awaitable, Callable

from .act import AuthorizationResult, ToolInvocation, act
from .hooks import HookBus
from .messages import Message, MessageLog, new_id
from .operate import operate as _operate
from .params import ActionParam, AlcallParams, DEFAULT_ACTION_ALCALL
from .prepare import prepare_operate_kw
from .tools import ToolRegistry

Authorizer = Callable[[ToolInvocation], Awaitable["AuthorizationResult | bool"]]

DEFAULT_SYSTEM = None
EVENT_LOG_LIMIT = 1000
MAX_TOOL_OUTPUT_CHARS = 100_000  # a tool output larger than this (as JSON) is kept as a preview


#: ``Branch.operate``'s signature: ``prepare_operate_kw``'s (the parameter list exists once,
#: there), its branch as ``self``; and the names of those parameters, left out when None
_PREPARER = inspect.signature(prepare_operate_kw)
_BRANCH, *_PARAMS = _PREPARER.parameters.values()
_FACADE_SIGNATURE = _PREPARER.replace(
    parameters=[_BRANCH.replace(name="self", annotation=inspect.Parameter.empty), *_PARAMS], return_annotation="Any")
_PREPARE_NAMES = frozenset(p.name for p in _PARAMS if p.kind is not inspect.Parameter.VAR_KEYWORD)


class Branch:
    def __init__(self, *, system: str | None = None, chat_model: Any = None, parse_model: Any = None,
                 name: str | None = None, tools: ToolRegistry | None = None, id: str | None = None,
                 user: str = "user", messages: MessageLog | None = None) -> None:
        self.id = id or new_id()
        self.name = name
        self.user = user
        self.messages = messages if messages is not None else MessageLog()
        if system and messages is None:
            self.messages.add("system", {"text": system}, sender="system", recipient=self.id)
        self.chat_model = chat_model
        self._parse_model = parse_model
        self.tools = tools if tools is not None else ToolRegistry()
        self.hooks = HookBus()
        self.providers: list[Any] = []
        self.logs: deque[dict[str, Any]] = deque(maxlen=EVENT_LOG_LIMIT)
        self.authorizer: Authorizer | None = None
        self.metadata: dict[str, Any] = {}
        self.max_tool_output_chars: int | None = MAX_TOOL_OUTPUT_CHARS
        self.default_tool_timeout: float | None = None  # seconds, for tools without their own time-out

    # ------------------------------------------------------------------ models
    @property
    def parse_model(self) -> Any:
        return self._parse_model or self.chat_model

    @parse_model.setter
    def parse_model(self, value: Any) -> None:
        self._parse_model = value

    @property
    def acts(self) -> ToolRegistry:  # another name for the tool registry
        return self.tools

    @property
    def system(self) -> str | None:
        first = self.messages.items[0] if len(self.messages) else None
        return first.content.get("text") if first is not None and first.kind == "system" else None

    # ------------------------------------------------------------ governance
    async def authorize(self, invocation: ToolInvocation) -> AuthorizationResult:
        if self.authorizer is None:
            return AuthorizationResult(True)
        out = await self.authorizer(invocation)
        if isinstance(out, AuthorizationResult):
            return out
        return AuthorizationResult(bool(out))

    def log_event(self, event: dict[str, Any]) -> None:
        self.logs.append(event)

    # ------------------------------------------------------------ operations
    async def operate(self, **kw: Any) -> Any:
        """The Python facade: ``prepare_operate_kw``'s parameters (its signature is this one's,
        with the branch as ``self``), by name. One of them given as None is left out, so its
        default applies: ``action_strategy`` defaults to the truthy ``"concurrent"`` and is always
        forwarded, so an ``Instruct``'s own strategy cannot win here (a seam, docs/PIPELINE.md);
        pass it explicitly. Other names go to the model call as they are."""
        params = {k: v for k, v in kw.items() if v is not None or k not in _PREPARE_NAMES}
        return await _operate(self, **prepare_operate_kw(self, **params))

    operate.__signature__ = _FACADE_SIGNATURE  # type: ignore[attr-defined]

    async def act(self, action_request: Any, *, strategy: str = "concurrent", verbose_action: bool = False,
                  suppress_errors: bool = True, call_params: AlcallParams | None = None, tools: Any = None) -> list:
        param = ActionParam(action_call_params=call_params or DEFAULT_ACTION_ALCALL, tools=tools,
                            strategy=strategy, suppress_errors=suppress_errors,  # type: ignore[arg-type]
                            verbose_action=verbose_action)
        return await act(self, action_request, param)

    # ------------------------------------------------------------ lifecycle
    def fork(self, *, id: str | None = None, messages: list[Message] | None = None) -> "Branch":
        """A copy of the messages (or of ``messages``: e.g. the branch as it was before an
        operate still running on it) and policy (shares tools and models)."""
        log = self.messages.copy() if messages is None else MessageLog(messages)
        b = Branch(chat_model=self.chat_model, parse_model=self._parse_model, name=self.name, tools=self.tools,
                   id=id, user=self.user, messages=log)
        b.authorizer = self.authorizer
        b.providers = list(self.providers)
        b.metadata = dict(self.metadata)
        b.max_tool_output_chars = self.max_tool_output_chars
        b.default_tool_timeout = self.default_tool_timeout
        return b

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "user": self.user,
            "chat_model": getattr(self.chat_model, "name", None),
            "parse_model": getattr(self._parse_model, "name", None),
            "metadata": self.metadata,
            "messages": [m.to_record() for m in self.messages],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, tools: ToolRegistry | None = None, chat_model: Any = None,
                  parse_model: Any = None) -> "Branch":
        log = MessageLog([Message.from_record(r) for r in data.get("messages", [])])
        b = cls(id=data["id"], name=data.get("name"), user=data.get("user") or "user", tools=tools,
                chat_model=chat_model, parse_model=parse_model, messages=log)
        b.metadata = dict(data.get("metadata") or {})
        return b
