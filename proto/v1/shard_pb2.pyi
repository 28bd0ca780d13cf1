from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("index_id", "shards", "num_shards", "token_dtype", "separator", "vocab_size")
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEPARATOR_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    index_id: str
    shards: _containers.RepeatedScalarFieldContainer[int]
    num_shards: int
    token_dtype: str
    separator: int
    vocab_size: int
    def __init__(self, index_id: _Optional[str] = ..., shards: _Optional[_Iterable[int]] = ..., num_shards: _Optional[int] = ..., token_dtype: _Optional[str] = ..., separator: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("index_id", "contexts", "n_max", "n_min", "max_depth", "inline_rows")
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    N_MAX_FIELD_NUMBER: _ClassVar[int]
    N_MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INLINE_ROWS_FIELD_NUMBER: _ClassVar[int]
    index_id: str
    contexts: _containers.RepeatedCompositeFieldContainer[Tokens]
    n_max: int
    n_min: int
    max_depth: int
    inline_rows: int
    def __init__(self, index_id: _Optional[str] = ..., contexts: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., n_max: _Optional[int] = ..., n_min: _Optional[int] = ..., max_depth: _Optional[int] = ..., inline_rows: _Optional[int] = ...) -> None: ...

class ShardHit(_message.Message):
    __slots__ = ("shard", "match_len", "lo", "count", "rows")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    LO_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    match_len: int
    lo: int
    count: int
    rows: bytes
    def __init__(self, shard: _Optional[int] = ..., match_len: _Optional[int] = ..., lo: _Optional[int] = ..., count: _Optional[int] = ..., rows: _Optional[bytes] = ...) -> None: ...

class ContextHits(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[ShardHit]
    def __init__(self, hits: _Optional[_Iterable[_Union[ShardHit, _Mapping]]] = ...) -> None: ...

class MatchReply(_message.Message):
    __slots__ = ("contexts",)
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    contexts: _containers.RepeatedCompositeFieldContainer[ContextHits]
    def __init__(self, contexts: _Optional[_Iterable[_Union[ContextHits, _Mapping]]] = ...) -> None: ...

class GatherItem(_message.Message):
    __slots__ = ("context", "shard", "ranks")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    context: int
    shard: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, context: _Optional[int] = ..., shard: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class GatherRequest(_message.Message):
    __slots__ = ("index_id", "contexts", "n_max", "max_depth", "items")
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    N_MAX_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    index_id: str
    contexts: _containers.RepeatedCompositeFieldContainer[Tokens]
    n_max: int
    max_depth: int
    items: _containers.RepeatedCompositeFieldContainer[GatherItem]
    def __init__(self, index_id: _Optional[str] = ..., contexts: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., n_max: _Optional[int] = ..., max_depth: _Optional[int] = ..., items: _Optional[_Iterable[_Union[GatherItem, _Mapping]]] = ...) -> None: ...

class GatherReply(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rows: _Optional[_Iterable[bytes]] = ...) -> None: ...
