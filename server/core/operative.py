"""D2: one generated Operative separates model-request and runtime-response fields.

``Step.request_operative`` builds the spec set (caller base model, ``reason``,
``action_required``/``action_requests``/``action_responses``, named field
specs) with ``request_exclude={"action_responses"}`` when actions are on;
``Step.respond_operative`` materializes the response model. The request model
is what the provider is shown; the response model (a subclass of the request
model, so of the caller's model too) is what parsing and the caller get.
Generated classes are cached by their spec so repeated calls build nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, WithJsonSchema, create_model, field_validator

from .params import HashableModel


class ActionRequestModel(HashableModel):
    # One requested call (no docstring: it would be the schema's description, shown to the
    # model). The schema is {function: string | null, arguments: object | null}, but a value
    # of another type is kept as it came: act() answers it with that call's tool error (an
    # unknown tool, arguments that are not an object), so one malformed call neither hides the
    # reply's other calls nor leaves the model without an answer to correct.

    function: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "null"}]})] = Field(
        None, description="Name of a tool listed under Tools.")
    arguments: Annotated[Any, WithJsonSchema({"anyOf": [{"additionalProperties": True, "type": "object"},
                                                        {"type": "null"}]})] = Field(
        None, description="Arguments for the tool, matching its parameters.")

    @field_validator("arguments", mode="before")
    @classmethod
    def _json_string_arguments(cls, v: Any) -> Any:
        """Function-calling APIs send arguments as a JSON string; accept it."""
        if isinstance(v, str):
            import json

            try:
                parsed = json.loads(v)
            except ValueError:
                return v
            if isinstance(parsed, dict):
                return parsed
        return v


class ActionResponseModel(HashableModel):
    function: str = Field(default_factory=str)
    arguments: dict[str, Any] = Field(default_factory=dict)
    output: Any = None


class Reason(HashableModel):
    title: str | None = None
    content: str | None = None
    confidence_score: float | None = None

    @field_validator("confidence_score", mode="before")
    @classmethod
    def _score(cls, v: Any) -> Any:
        """A number in 0..1 rounded to 3 places; anything else becomes -1."""
        if v is None:
            return None
        try:
            x = float(v)
        except (TypeError, ValueError):
            return -1.0
        return round(x, 3) if 0.0 <= x <= 1.0 else -1.0


def _unique_requests(v: list[ActionRequestModel] | None) -> list[ActionRequestModel]:
    """``action_requests`` after validation: an explicit null is ``[]``, and a
    call the model repeats (same function, same arguments) is kept once, in first-seen order."""
    if not v:
        return []
    import json

    seen: set[str] = set()
    out = []
    for r in v:
        key = json.dumps([r.function, r.arguments], sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _false_if_null(v: bool | None) -> bool:
    """``action_required``: an explicit null means False."""
    return bool(v)


_MISSING = object()


@dataclass(slots=True, frozen=True)
class Spec:
    """A named field: annotation, default, description. ``nullable`` wraps the
    annotation in ``| None`` (default None); ``listable`` in ``list[...]``."""

    name: str
    annotation: Any = Any
    default: Any = _MISSING
    description: str | None = None
    nullable: bool = False
    listable: bool = False
    json_schema_extra: dict | None = None
    after: Any = None  # an after-validator for explicit values (not the default)

    def resolved_annotation(self) -> Any:
        ann = self.annotation
        if self.listable:
            ann = list[ann]  # type: ignore[valid-type]
        if self.nullable:
            ann = ann | None  # type: ignore[operator]
        if self.after is not None:
            ann = Annotated[ann, AfterValidator(self.after)]
        return ann

    def to_field(self) -> tuple[Any, Any]:
        default = self.default
        if default is _MISSING:
            default = None if self.nullable else ...
        kw: dict[str, Any] = {}
        if self.description:
            kw["description"] = self.description
        if self.json_schema_extra:
            kw["json_schema_extra"] = self.json_schema_extra
        return self.resolved_annotation(), Field(default, **kw)

    def key(self) -> tuple:
        try:
            hash(self.annotation)
            ann: Any = self.annotation
        except TypeError:
            ann = ("id", id(self.annotation))
        default = self.default if self.default is _MISSING else repr(self.default)
        return (self.name, ann, default, self.description, self.nullable, self.listable,
                repr(self.json_schema_extra), self.after)


@dataclass(slots=True)
class FieldModel:
    """The older field declaration; converted with ``to_spec()``."""

    name: str
    annotation: Any = Any
    default: Any = _MISSING
    description: str | None = None
    nullable: bool = False
    listable: bool = False

    def to_spec(self) -> Spec:
        return Spec(name=self.name, annotation=self.annotation, default=self.default,
                    description=self.description, nullable=self.nullable, listable=self.listable)


REASON_SPEC = Spec("reason", Reason, nullable=True,
                   description="Your reasoning: a short title, the content, and a confidence score from 0 to 1.")
ACTION_REQUIRED_SPEC = Spec("action_required", bool, nullable=True,
                            description="True when tools must be called to complete the task.", after=_false_if_null)
ACTION_REQUESTS_SPEC = Spec("action_requests", ActionRequestModel, nullable=True, listable=True,
                            description="Tool calls to make, each with a function name from Tools and its arguments.",
                            after=_unique_requests)
ACTION_RESPONSES_SPEC = Spec("action_responses", ActionResponseModel, nullable=True, listable=True,
                             description="Filled by the runtime with the outputs of executed tool calls.")


#: generated (request, response) types by spec, least recently used first; bounded: a server
#: that sees ever new response formats keeps only the latest (a type still in use lives on)
_cache: "OrderedDict[tuple, tuple[type[BaseModel], type[BaseModel]]]" = OrderedDict()
CACHE_LIMIT = 512
_cache_lock = threading.Lock()
# response type -> (request type, request_exclude); parse uses it to drop runtime-only keys.
_request_of: "weakref.WeakKeyDictionary[type, tuple[type[BaseModel], frozenset[str]]]" = weakref.WeakKeyDictionary()


def request_info(response_type: Any) -> tuple[type[BaseModel], frozenset[str]] | None:
    """The request model and excluded field names of a generated response type."""
    try:
        return _request_of.get(response_type)
    except TypeError:
        return None


@dataclass(slots=True)
class Operative:
    name: str | None = None
    base_type: type[BaseModel] | None = None
    fields: dict[str, Spec] = field(default_factory=dict)
    request_exclude: frozenset[str] = frozenset()
    adapter: Literal["pydantic"] = "pydantic"
    max_retries: int = 3
    auto_retry_parse: bool = True
    response_model: BaseModel | None = None
    _types: tuple[type[BaseModel], type[BaseModel]] | None = None

    @property
    def model_name(self) -> str:
        return self.name or (self.base_type.__name__ if self.base_type else "Operative")

    def _materialize(self) -> tuple[type[BaseModel], type[BaseModel]]:
        if self._types is not None:
            return self._types
        key = (self.model_name, self.base_type, tuple(s.key() for s in self.fields.values()),
               tuple(sorted(self.request_exclude)))
        with _cache_lock:
            types = _cache.get(key)
            if types is None:
                types = self._build()
                _cache[key] = types
                _request_of[types[1]] = (types[0], self.request_exclude)
                while len(_cache) > CACHE_LIMIT:
                    _cache.popitem(last=False)
            else:
                _cache.move_to_end(key)
        self._types = types
        return types

    def _build(self) -> tuple[type[BaseModel], type[BaseModel]]:
        base = self.base_type or BaseModel
        req_fields = {n: s.to_field() for n, s in self.fields.items() if n not in self.request_exclude}
        resp_fields = {n: s.to_field() for n, s in self.fields.items() if n in self.request_exclude}
        request_type = create_model(f"{self.model_name}Request", __base__=base, **req_fields)  # type: ignore[call-overload]
        response_type = create_model(f"{self.model_name}Response", __base__=request_type, **resp_fields)  # type: ignore[call-overload]
        return request_type, response_type

    @property
    def request_type(self) -> type[BaseModel]:
        return self._materialize()[0]

    @property
    def response_type(self) -> type[BaseModel]:
        return self._materialize()[1]

    def update_response_model(self, text: str | None = None, data: dict | None = None) -> BaseModel:
        if text is None and data is None:
            raise ValueError("Either text or data must be provided")
        if data is None:
            import json

            data = json.loads(text)  # type: ignore[arg-type]
        if self.response_model is not None:
            merged = {**self.response_model.model_dump(), **data}
        else:
            merged = data
        self.response_model = self.response_type.model_validate(merged)
        return self.response_model


class Step:
    @staticmethod
    def request_operative(
        *,
        name: str | None = None,
        operative_name: str | None = None,
        adapter: Literal["pydantic"] = "pydantic",
        reason: bool = False,
        actions: bool = False,
        fields: dict[str, Spec] | None = None,
        field_models: list | None = None,
        max_retries: int = 3,
        auto_retry_parse: bool = True,
        base_type: type[BaseModel] | None = None,
        **kwargs: Any,
    ) -> Operative:
        if adapter != "pydantic":
            raise ValueError(f"unsupported operative adapter {adapter!r}; the only adapter is 'pydantic'")
        # field order: reason, the action fields, then the caller's field models
        # and fields; a later entry with the same name overrides an earlier one
        specs: dict[str, Spec] = {}
        if reason:
            specs["reason"] = REASON_SPEC
        exclude: frozenset[str] = frozenset()
        if actions:
            specs["action_required"] = ACTION_REQUIRED_SPEC
            specs["action_requests"] = ACTION_REQUESTS_SPEC
            specs["action_responses"] = ACTION_RESPONSES_SPEC
            exclude = frozenset({"action_responses"})
        for fm in field_models or ():
            spec = to_spec(fm)
            if spec.name:
                specs[spec.name] = spec
        if fields:
            specs.update({n: s for n, s in fields.items() if n})
        return Operative(name=name or operative_name, base_type=base_type, fields=specs, request_exclude=exclude,
                         adapter=adapter, max_retries=max_retries, auto_retry_parse=auto_retry_parse)

    @staticmethod
    def respond_operative(operative: Operative, additional_fields: dict[str, Spec] | None = None) -> Operative:
        if additional_fields:
            operative = Operative(name=operative.name, base_type=operative.base_type,
                                  fields={**operative.fields, **additional_fields},
                                  request_exclude=operative.request_exclude, adapter=operative.adapter,
                                  max_retries=operative.max_retries, auto_retry_parse=operative.auto_retry_parse)
        operative._materialize()
        return operative


def to_spec(fm: Any) -> Spec:
    """D1/D2: FieldModel or Spec; anything else is a TypeError."""
    if isinstance(fm, Spec):
        return fm
    if isinstance(fm, FieldModel):
        return fm.to_spec()
    raise TypeError(f"Expected FieldModel or Spec, got {type(fm)}")


def specs_from_field_models(field_models: list | None) -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    for fm in field_models or ():
        spec = to_spec(fm)
        if spec.name:
            out[spec.name] = spec
    return out
