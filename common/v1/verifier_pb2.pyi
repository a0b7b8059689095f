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
    __slots__ = ("session_id", "tenant", "history", "sampling", "reserve_tokens", "mask", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "echo", "generated_tokens", "cache_scope", "prompt_topk", "stop_ids", "prefix_source")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOPK_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    history: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    reserve_tokens: int
    mask: bytes
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    echo: bool
    generated_tokens: int
    cache_scope: str
    prompt_topk: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_source: PrefixSource
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., history: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., reserve_tokens: _Optional[int] = ..., mask: _Optional[bytes] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., echo: _Optional[bool] = ..., generated_tokens: _Optional[int] = ..., cache_scope: _Optional[str] = ..., prompt_topk: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ...) -> None: ...

class PrefixSource(_message.Message):
    __slots__ = ("address", "blocks", "session_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    blocks: int
    session_id: str
    def __init__(self, address: _Optional[str] = ..., blocks: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class PrefixBlocksRequest(_message.Message):
    __slots__ = ("tenant", "cache_scope", "tokens", "first_block", "block_tokens", "fingerprint", "max_bytes", "session_id", "hottest")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOTTEST_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    cache_scope: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    block_tokens: int
    fingerprint: str
    max_bytes: int
    session_id: str
    hottest: bool
    def __init__(self, tenant: _Optional[str] = ..., cache_scope: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., block_tokens: _Optional[int] = ..., fingerprint: _Optional[str] = ..., max_bytes: _Optional[int] = ..., session_id: _Optional[str] = ..., hottest: _Optional[bool] = ...) -> None: ...

class VerifierWarmRequest(_message.Message):
    __slots__ = ("source",)
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    source: str
    def __init__(self, source: _Optional[str] = ...) -> None: ...

class VerifierWarmResponse(_message.Message):
    __slots__ = ("blocks", "bytes", "refused")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    refused: str
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class PrefixBlocksHeader(_message.Message):
    __slots__ = ("fingerprint", "blocks", "block_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    blocks: int
    block_bytes: int
    def __init__(self, fingerprint: _Optional[str] = ..., blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class PrefixBlock(_message.Message):
    __slots__ = ("index", "key", "scope", "rows", "digest", "tokens", "parent")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    key: bytes
    scope: str
    rows: bytes
    digest: bytes
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parent: bytes
    def __init__(self, index: _Optional[int] = ..., key: _Optional[bytes] = ..., scope: _Optional[str] = ..., rows: _Optional[bytes] = ..., digest: _Optional[bytes] = ..., tokens: _Optional[_Iterable[int]] = ..., parent: _Optional[bytes] = ...) -> None: ...

class PrefixBlocksChunk(_message.Message):
    __slots__ = ("header", "block")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    header: PrefixBlocksHeader
    block: PrefixBlock
    def __init__(self, header: _Optional[_Union[PrefixBlocksHeader, _Mapping]] = ..., block: _Optional[_Union[PrefixBlock, _Mapping]] = ...) -> None: ...

class VerifyTree(_message.Message):
    __slots__ = ("tokens", "parents", "masks", "run")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    masks: bytes
    run: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., masks: _Optional[bytes] = ..., run: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("open", "tree")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    open: VerifierOpen
    tree: VerifyTree
    def __init__(self, open: _Optional[_Union[VerifierOpen, _Mapping]] = ..., tree: _Optional[_Union[VerifyTree, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("next_token", "accepted", "topk", "topk_width", "reused_tokens", "cache_tokens", "elapsed_ms", "cost", "batch_rows", "logprobs", "top_ids", "top_logprobs", "echo_logprobs", "echo_top_ids", "echo_top_logprobs", "prefix_tokens", "more", "fetched_tokens")
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    ECHO_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    next_token: int
    accepted: _containers.RepeatedScalarFieldContainer[int]
    topk: _containers.RepeatedScalarFieldContainer[int]
    topk_width: int
    reused_tokens: int
    cache_tokens: int
    elapsed_ms: float
    cost: _common_pb2.CostCurve
    batch_rows: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    echo_logprobs: _containers.RepeatedScalarFieldContainer[float]
    echo_top_ids: _containers.RepeatedScalarFieldContainer[int]
    echo_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prefix_tokens: int
    more: bool
    fetched_tokens: int
    def __init__(self, next_token: _Optional[int] = ..., accepted: _Optional[_Iterable[int]] = ..., topk: _Optional[_Iterable[int]] = ..., topk_width: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., cache_tokens: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., batch_rows: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., echo_logprobs: _Optional[_Iterable[float]] = ..., echo_top_ids: _Optional[_Iterable[int]] = ..., echo_top_logprobs: _Optional[_Iterable[float]] = ..., prefix_tokens: _Optional[int] = ..., more: _Optional[bool] = ..., fetched_tokens: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("sessions", "cache_tokens", "cost", "saturation", "streaming", "draining", "prefix_blocks", "prefix_block_tokens", "epoch", "setup")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    SATURATION_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[VerifierSessionStats]
    cache_tokens: int
    cost: _common_pb2.CostCurve
    saturation: float
    streaming: int
    draining: bool
    prefix_blocks: _containers.RepeatedScalarFieldContainer[int]
    prefix_block_tokens: int
    epoch: int
    setup: VerifierSetup
    def __init__(self, sessions: _Optional[_Iterable[_Union[VerifierSessionStats, _Mapping]]] = ..., cache_tokens: _Optional[int] = ..., cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., saturation: _Optional[float] = ..., streaming: _Optional[int] = ..., draining: _Optional[bool] = ..., prefix_blocks: _Optional[_Iterable[int]] = ..., prefix_block_tokens: _Optional[int] = ..., epoch: _Optional[int] = ..., setup: _Optional[_Union[VerifierSetup, _Mapping]] = ...) -> None: ...

class VerifierSetup(_message.Message):
    __slots__ = ("dtype", "backend", "native_isa_level", "native_quant_isa", "native_vector_bits", "kernel_checks", "kernel_check_seconds", "prefix_fingerprint")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NATIVE_ISA_LEVEL_FIELD_NUMBER: _ClassVar[int]
    NATIVE_QUANT_ISA_FIELD_NUMBER: _ClassVar[int]
    NATIVE_VECTOR_BITS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_CHECKS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_CHECK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    backend: str
    native_isa_level: str
    native_quant_isa: str
    native_vector_bits: int
    kernel_checks: _containers.RepeatedCompositeFieldContainer[KernelCheck]
    kernel_check_seconds: float
    prefix_fingerprint: str
    def __init__(self, dtype: _Optional[str] = ..., backend: _Optional[str] = ..., native_isa_level: _Optional[str] = ..., native_quant_isa: _Optional[str] = ..., native_vector_bits: _Optional[int] = ..., kernel_checks: _Optional[_Iterable[_Union[KernelCheck, _Mapping]]] = ..., kernel_check_seconds: _Optional[float] = ..., prefix_fingerprint: _Optional[str] = ...) -> None: ...

class KernelCheck(_message.Message):
    __slots__ = ("kernel", "ok", "detail")
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kernel: str
    ok: bool
    detail: str
    def __init__(self, kernel: _Optional[str] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...
