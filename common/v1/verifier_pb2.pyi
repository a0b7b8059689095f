from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class VerifierOpen(_message.Message):
    __slots__ = ("session_id", "tenant", "history", "sampling", "reserve_tokens", "cache_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    history: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    reserve_tokens: int
    cache_scope: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., history: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., reserve_tokens: _Optional[int] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class VerifyTree(_message.Message):
    __slots__ = ("tokens", "parents")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("open", "tree")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    open: VerifierOpen
    tree: VerifyTree
    def __init__(self, open: _Optional[_Union[VerifierOpen, _Mapping]] = ..., tree: _Optional[_Union[VerifyTree, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("next_token", "accepted", "topk", "topk_width", "reused_tokens", "cache_tokens", "elapsed_ms", "cost", "batch_rows", "prefix_tokens")
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    next_token: int
    accepted: _containers.RepeatedScalarFieldContainer[int]
    topk: _containers.RepeatedScalarFieldContainer[int]
    topk_width: int
    reused_tokens: int
    cache_tokens: int
    elapsed_ms: float
    cost: _common_pb2.CostCurve
    batch_rows: int
    prefix_tokens: int
    def __init__(self, next_token: _Optional[int] = ..., accepted: _Optional[_Iterable[int]] = ..., topk: _Optional[_Iterable[int]] = ..., topk_width: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., cache_tokens: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., batch_rows: _Optional[int] = ..., prefix_tokens: _Optional[int] = ...) -> None: ...

class VerifierDropRequest(_message.Message):
    __slots__ = ("session_id", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class VerifierDropResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class VerifierStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierSessionStats(_message.Message):
    __slots__ = ("session_id", "tenant", "cache_tokens", "streaming", "idle_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    cache_tokens: int
    streaming: bool
    idle_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., cache_tokens: _Optional[int] = ..., streaming: _Optional[bool] = ..., idle_seconds: _Optional[float] = ...) -> None: ...

class VerifierStatsResponse(_message.Message):
    __slots__ = ("sessions", "cache_tokens", "cost", "saturation", "streaming", "draining", "prefix_blocks", "prefix_block_tokens", "epoch")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    SATURATION_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[VerifierSessionStats]
    cache_tokens: int
    cost: _common_pb2.CostCurve
    saturation: float
    streaming: int
    draining: bool
    prefix_blocks: _containers.RepeatedScalarFieldContainer[int]
    prefix_block_tokens: int
    epoch: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[VerifierSessionStats, _Mapping]]] = ..., cache_tokens: _Optional[int] = ..., cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., saturation: _Optional[float] = ..., streaming: _Optional[int] = ..., draining: _Optional[bool] = ..., prefix_blocks: _Optional[_Iterable[int]] = ..., prefix_block_tokens: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...
