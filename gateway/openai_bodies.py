"""The OpenAI request bodies as pydantic models: ``ChatBody`` (``/v1/chat/completions``),
``CompletionBody`` (``/v1/completions``) and their parts, with the checks each field's type makes.

Strict types: JSON's true is not 1, 1.0 is not an integer and a number is not a string. None (JSON
null) is the field left out. Unknown fields are ignored (kept aside only to refuse the ones this
server does not implement, ``_NO_OP``).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError


def _one_error(message: str):
    """A union's errors (one per branch) as one error that says what the field takes."""

    def wrap(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid", message) from None

    return WrapValidator(wrap)


def _only(message: str, ok):
    """A value that passes its type but not ``ok``: one error with ``message``."""

    def check(value):
        if not ok(value):
            raise PydanticCustomError("invalid", message)
        return value

    return AfterValidator(check)


def _single_prompt(value):
    """A one-item array of prompts is that prompt (one prompt per call)."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)) else value


TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**31)]
Count = Annotated[int, Field(strict=True, ge=1)]
Prompt = Annotated[
    StrictStr | Annotated[list[TokenId], Field(min_length=1)],
    _one_error("expected a string or an array of token ids >= 0 (one prompt per call)"),
    BeforeValidator(_single_prompt),
]


class _Part(BaseModel):
    type: Literal["text"]
    text: StrictStr


class _FunctionCall(BaseModel):
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr  # JSON text of an object, as the API returned it


class _ToolCall(BaseModel):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[StrictStr | list[_Part], _one_error("expected a string or an array of text parts")] | None = None
    tool_calls: list[_ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool's answer: to which call
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing", "content: Field required")
        return self

    def pair(self) -> tuple[str, str]:
        """(role, text): developer is system, parts are joined."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return ("system" if self.role == "developer" else self.role), text

    def extra(self) -> str:
        """The keys the chat template reads beyond role and content, as JSON ("" none)."""
        out: dict = {}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return json.dumps(out, ensure_ascii=False) if out else ""


def _args(c: _ToolCall):
    """A call's arguments as the object templates render (its JSON text when it is not one)."""
    try:
        value = json.loads(c.function.arguments)
    except ValueError:
        return c.function.arguments
    return value if isinstance(value, dict) else c.function.arguments


class _Function(BaseModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: _Function


class NamedToolChoice(BaseModel):
    """A ``tool_choice`` that names one function: the call the model must make."""

    class _Name(BaseModel):
        name: StrictStr

    type: Literal["function"]
    function: _Name


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    _one_error('expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'),
]


class Speculation(BaseModel):
    mode: StrictStr = ""  # "": racer
    budget: StrictInt = 0  # 0: adaptive
    forced: StrictBool = True  # the tokens a grammar forces are drafted as a path of their own


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _JsonSchema(BaseModel):
    name: StrictStr = "response"
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", 'json_schema: required with type "json_schema"')
        return self


# Fields this server does not implement, with the values that ask for nothing (refused otherwise).
_NO_OP = {
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "best_of": (1,),
}


class _Body(BaseModel):
    """What both endpoints read."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: Annotated[StrictStr, Field(min_length=1)]
    n: Annotated[StrictInt, _only("only 1 is supported", lambda n: n == 1)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_completion_tokens: Count | None = None  # wins over max_tokens
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), lt=2**63)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, lt=2**31)] | None = None  # -1: off, as vLLM spells it
    stop: Annotated[StrictStr | list[StrictStr], _one_error("expected a string or an array of strings")] | None = None
    speculation: Speculation | None = None
    session_id: StrictStr | None = None
    return_token_ids: StrictBool | None = None
    share: StrictBool | None = None  # False: the turn stays out of the tenant corpus
    response_format: ResponseFormat | None = None
    presence_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(strict=True, ge=-100, le=100)]]
        | None
    ) = None

    @model_validator(mode="after")
    def _no_ops(self):
        for name, ok in _NO_OP.items():
            v = (self.model_extra or {}).get(name)
            if v is not None and v not in ok:
                raise PydanticCustomError(
                    "unsupported_parameter", "{name}: not supported by this server", {"name": name}
                )
        return self


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None


class CompletionBody(_Body):
    prompt: Prompt
    echo: StrictBool | None = None  # the prompt before the completion (with its log-probabilities)
    logprobs: Annotated[int, Field(strict=True, ge=0, le=5)] | None = None
