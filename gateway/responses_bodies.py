"""The Responses API's request body (``POST /v1/responses``) and its input items as pydantic models.

Strict types as in ``openai_bodies`` (JSON's true is not 1, a number is not a string); None (JSON
null) is a field left out; unknown fields are ignored, except those this server does not implement,
which are refused unless they ask for nothing (``_NO_OP``). Tools are function tools in the Responses
shape (flat: ``{"type": "function", "name", "description", "parameters", "strict"}``); input items are
messages (``input_text`` / ``output_text`` parts), ``function_call`` and ``function_call_output``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from .openai_bodies import Speculation, _one_error

Count = Annotated[int, Field(strict=True, ge=1)]
CallId = Annotated[StrictStr, Field(min_length=1, max_length=128)]


class TextPart(BaseModel):
    """A text content part: ``input_text`` (what users and tools say) or ``output_text`` (the model's)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr


Content = Annotated[
    StrictStr | list[TextPart],
    _one_error("expected a string or an array of input_text / output_text parts (this server reads text only)"),
]


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made (an earlier response's output, sent back as history)."""

    type: Literal["function_call"]
    call_id: CallId
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr  # JSON text of an object
    id: StrictStr | None = None


class FunctionCallOutputItem(BaseModel):
    """A call's result, for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: CallId
    output: Content
    id: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None

    def chat(self) -> dict:
        """The tool as chat completions nests it (what the chat template and the call grammar read)."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}

    def echo(self) -> dict:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}  # fmt: skip


class NamedFunction(BaseModel):
    """A ``tool_choice`` that names the function the model must call (Responses shape: flat)."""

    type: Literal["function"]
    name: StrictStr


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedFunction,
    _one_error('expected "none", "auto", "required" or {"type": "function", "name": ...}'),
]


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise PydanticCustomError("missing", 'schema: required with type "json_schema"')
        return self

    def echo(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        out = {"type": "json_schema", "name": self.name or "response", "schema": self.schema_}
        return out | {"strict": self.strict, "description": self.description}


class TextConfig(BaseModel):
    format: TextFormat | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
Metadata = Annotated[
    dict[MetadataKey, Annotated[StrictStr, Field(max_length=512)]], Field(max_length=16)
]  # OpenAI's bounds

# Fields this server does not implement, with the values that ask for nothing (refused otherwise).
_NO_OP = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "truncation": ("disabled",),
    "top_logprobs": (0,),
    "reasoning": ({}, {"effort": None}, {"effort": None, "summary": None}),
}
_NO_INCLUDE = ("message.output_text.logprobs",)  # an include that asks for what is not served


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: Annotated[StrictStr, Field(min_length=1)]
    input: Annotated[
        Annotated[StrictStr, Field(min_length=1)] | Annotated[list[dict], Field(min_length=1)],
        _one_error("expected a string or an array of input items (objects)"),
    ]
    instructions: StrictStr | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, lt=2**31)] | None = None  # extension, as chat's
    seed: Annotated[int, Field(strict=True, ge=-(2**63), lt=2**63)] | None = None  # extension, as chat's
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    metadata: Metadata | None = None
    stream: StrictBool | None = None
    include: list[StrictStr] | None = None
    speculation: Speculation | None = None
    share: StrictBool | None = None  # False: the turn stays out of the tenant corpus
    return_token_ids: StrictBool | None = None  # extension: the output's token ids in ``token_ids``

    @model_validator(mode="after")
    def _no_ops(self):
        for name, ok in _NO_OP.items():
            v = (self.model_extra or {}).get(name)
            if v is not None and v not in ok:
                raise PydanticCustomError(
                    "unsupported_parameter", "{name}: not supported by this server", {"name": name}
                )
        if any(i in _NO_INCLUDE for i in self.include or ()):
            raise PydanticCustomError(
                "unsupported_parameter", "{name}: not supported by this server", {"name": "include"}
            )
        return self

    @property
    def format(self) -> TextFormat:
        return (self.text.format if self.text else None) or TextFormat(type="text")
