from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterOpen(_message.Message):
    __slots__ = ("session_id", "tenant", "history", "history_topk", "topk", "cost", "overhead_ms", "no_share", "no_corpus", "corpus_tokens", "plain_overhead_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    NO_SHARE_FIELD_NUMBER: _ClassVar[int]
    NO_CORPUS_FIELD_NUMBER: _ClassVar[int]
    CORPUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    history: _containers.RepeatedScalarFieldContainer[int]
    history_topk: _containers.RepeatedScalarFieldContainer[int]
    topk: int
    cost: _common_pb2.CostCurve
    overhead_ms: float
    no_share: bool
    no_corpus: bool
    corpus_tokens: int
    plain_overhead_ms: float
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., history: _Optional[_Iterable[int]] = ..., history_topk: _Optional[_Iterable[int]] = ..., topk: _Optional[int] = ..., cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., overhead_ms: _Optional[float] = ..., no_share: _Optional[bool] = ..., no_corpus: _Optional[bool] = ..., corpus_tokens: _Optional[int] = ..., plain_overhead_ms: _Optional[float] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "step", "end_turn")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    END_TURN_FIELD_NUMBER: _ClassVar[int]
    open: DrafterOpen
    step: DraftStep
    end_turn: EndTurn
    def __init__(self, open: _Optional[_Union[DrafterOpen, _Mapping]] = ..., step: _Optional[_Union[DraftStep, _Mapping]] = ..., end_turn: _Optional[_Union[EndTurn, _Mapping]] = ...) -> None: ...

class DraftStep(_message.Message):
    __slots__ = ("tree_topk", "accepted", "commit", "root", "budget", "mode", "batch_rows", "forced", "plain", "plain_topk")
    TREE_TOPK_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FIELD_NUMBER: _ClassVar[int]
    PLAIN_TOPK_FIELD_NUMBER: _ClassVar[int]
    tree_topk: _containers.RepeatedScalarFieldContainer[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    commit: int
    root: int
    budget: int
    mode: str
    batch_rows: int
    forced: _containers.RepeatedScalarFieldContainer[int]
    plain: _containers.RepeatedScalarFieldContainer[int]
    plain_topk: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tree_topk: _Optional[_Iterable[int]] = ..., accepted: _Optional[_Iterable[int]] = ..., commit: _Optional[int] = ..., root: _Optional[int] = ..., budget: _Optional[int] = ..., mode: _Optional[str] = ..., batch_rows: _Optional[int] = ..., forced: _Optional[_Iterable[int]] = ..., plain: _Optional[_Iterable[int]] = ..., plain_topk: _Optional[_Iterable[int]] = ...) -> None: ...

class EndTurn(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "retrieval_nodes")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_NODES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    retrieval_nodes: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., retrieval_nodes: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "tokens", "restored_from", "elapsed_ms", "rest")
    TREE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    REST_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTree
    tokens: int
    restored_from: str
    elapsed_ms: float
    rest: int
    def __init__(self, tree: _Optional[_Union[DraftTree, _Mapping]] = ..., tokens: _Optional[int] = ..., restored_from: _Optional[str] = ..., elapsed_ms: _Optional[float] = ..., rest: _Optional[int] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("session_id", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DropResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class DrafterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterSessionStats(_message.Message):
    __slots__ = ("session_id", "tenant", "tokens", "nodes", "memory_bytes", "streaming")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    tokens: int
    nodes: int
    memory_bytes: int
    streaming: bool
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., tokens: _Optional[int] = ..., nodes: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., streaming: _Optional[bool] = ...) -> None: ...

class DrafterStatsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[DrafterSessionStats]
    def __init__(self, sessions: _Optional[_Iterable[_Union[DrafterSessionStats, _Mapping]]] = ...) -> None: ...

class EraseCorpusRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class EraseCorpusResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
