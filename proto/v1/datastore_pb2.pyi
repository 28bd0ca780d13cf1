from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftParams(_message.Message):
    __slots__ = ("budget", "max_depth", "n_max", "n_min")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    N_MAX_FIELD_NUMBER: _ClassVar[int]
    N_MIN_FIELD_NUMBER: _ClassVar[int]
    budget: int
    max_depth: int
    n_max: int
    n_min: int
    def __init__(self, budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., n_max: _Optional[int] = ..., n_min: _Optional[int] = ...) -> None: ...

class Context(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("context", "params", "include_outputs")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    context: Context
    params: DraftParams
    include_outputs: bool
    def __init__(self, context: _Optional[_Union[Context, _Mapping]] = ..., params: _Optional[_Union[DraftParams, _Mapping]] = ..., include_outputs: _Optional[bool] = ...) -> None: ...

class DraftBatchRequest(_message.Message):
    __slots__ = ("contexts", "params", "include_outputs")
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    contexts: _containers.RepeatedCompositeFieldContainer[Context]
    params: DraftParams
    include_outputs: bool
    def __init__(self, contexts: _Optional[_Iterable[_Union[Context, _Mapping]]] = ..., params: _Optional[_Union[DraftParams, _Mapping]] = ..., include_outputs: _Optional[bool] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "counts", "match_len", "num_matches", "num_sampled", "scores")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    match_len: int
    num_matches: int
    num_sampled: int
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., match_len: _Optional[int] = ..., num_matches: _Optional[int] = ..., num_sampled: _Optional[int] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("tree", "outputs")
    TREE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTree
    outputs: DraftTree
    def __init__(self, tree: _Optional[_Union[DraftTree, _Mapping]] = ..., outputs: _Optional[_Union[DraftTree, _Mapping]] = ...) -> None: ...

class DraftBatchReply(_message.Message):
    __slots__ = ("trees", "outputs")
    TREES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[DraftTree]
    outputs: _containers.RepeatedCompositeFieldContainer[DraftTree]
    def __init__(self, trees: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ...) -> None: ...

class AddOutputRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AddOutputReply(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ReadOutputsRequest(_message.Message):
    __slots__ = ("from_seq",)
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    def __init__(self, from_seq: _Optional[int] = ...) -> None: ...

class StoredOutput(_message.Message):
    __slots__ = ("seq", "tokens")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadOutputsReply(_message.Message):
    __slots__ = ("outputs", "next_seq", "end_seq")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    END_SEQ_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[StoredOutput]
    next_seq: int
    end_seq: int
    def __init__(self, outputs: _Optional[_Iterable[_Union[StoredOutput, _Mapping]]] = ..., next_seq: _Optional[int] = ..., end_seq: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Shard(_message.Message):
    __slots__ = ("name", "num_tokens", "num_documents")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_tokens: int
    num_documents: int
    def __init__(self, name: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_documents: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("format_version", "tokenizer_name", "tokenizer_fingerprint", "vocab_size", "num_tokens", "num_documents", "shards")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    tokenizer_name: str
    tokenizer_fingerprint: str
    vocab_size: int
    num_tokens: int
    num_documents: int
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    def __init__(self, format_version: _Optional[int] = ..., tokenizer_name: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_documents: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ...) -> None: ...
