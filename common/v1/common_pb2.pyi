from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CostCurve(_message.Message):
    __slots__ = ("sizes", "ms", "context", "ms_per_token")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    ms: _containers.RepeatedScalarFieldContainer[float]
    context: int
    ms_per_token: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ..., ms: _Optional[_Iterable[float]] = ..., context: _Optional[int] = ..., ms_per_token: _Optional[_Iterable[float]] = ...) -> None: ...
