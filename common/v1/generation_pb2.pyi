from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("mode", "budget")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    mode: str
    budget: int
    def __init__(self, mode: _Optional[str] = ..., budget: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "chat", "prompt_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_ids", "speculation", "system", "share")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    chat: ChatMessages
    prompt_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    speculation: Speculation
    system: str
    share: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_ids: _Optional[_Iterable[int]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., system: _Optional[str] = ..., share: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "session_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    session_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., session_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "drafted", "accepted", "mat", "prefill_ms", "draft_ms", "verify_ms", "total_ms", "tokens_per_second")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MAT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted: int
    accepted: int
    mat: float
    prefill_ms: float
    draft_ms: float
    verify_ms: float
    total_ms: float
    tokens_per_second: float
    def __init__(self, rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., mat: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "finish_reason", "usage", "stats")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "turns", "tokens", "drafter", "verifier", "created_unix", "last_used_unix", "closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turns: int
    tokens: int
    drafter: str
    verifier: str
    created_unix: float
    last_used_unix: float
    closed: bool
    def __init__(self, session_id: _Optional[str] = ..., turns: _Optional[int] = ..., tokens: _Optional[int] = ..., drafter: _Optional[str] = ..., verifier: _Optional[str] = ..., created_unix: _Optional[float] = ..., last_used_unix: _Optional[float] = ..., closed: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...
