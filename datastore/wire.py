"""The only conversions between gRPC messages (``rest_spec.proto.v1``) and the datastore's types, and
what else both ends of the wire must agree on: the message size every stock client accepts, a
reply's size before it is serialized, the bearer-token metadata, why a TLS file is unusable.

The server and the client both go through these functions, so a tree survives the round trip
unchanged and a bad request fails the same way everywhere: ``ValueError`` naming the field. The
functions are plain and tested without a network.
"""

from __future__ import annotations

import itertools
import ssl
from collections.abc import Callable, Sequence

import numpy as np

from rest_spec.common.types import (
    DEFAULT_CONFIG,
    MAX_SUFFIX,
    DraftConfig,
    DraftTree,
    IndexInfo,
    ShardInfo,
    token_ids,
)
from rest_spec.proto.v1 import datastore_pb2 as pb

# A server accepts at least this many context tokens, so a client sending its last n_max tokens
# is always within the limit.
MIN_CONTEXT_LIMIT = MAX_SUFFIX
# The largest message every stock gRPC client and server accepts unless told otherwise (4 MiB).
STOCK_MESSAGE_LIMIT = 4 << 20
# The call metadata key of a bearer token.
AUTHORIZATION = "authorization"


# ---- requests -------------------------------------------------------------------------------


def params_to_message(config: DraftConfig) -> pb.DraftParams:
    """Every field explicit (on the wire 0 means "server default"; ``DraftConfig`` never holds 0)."""
    return pb.DraftParams(budget=config.budget, max_depth=config.max_depth, n_max=config.n_max, n_min=config.n_min)


def config_from_message(params: pb.DraftParams) -> DraftConfig:
    """A validated ``DraftConfig``; 0 (unset) fields take the defaults. Raises ``ValueError``
    naming the first field out of range."""
    return DraftConfig(
        budget=params.budget or DEFAULT_CONFIG.budget,
        max_depth=params.max_depth or DEFAULT_CONFIG.max_depth,
        n_max=params.n_max or DEFAULT_CONFIG.n_max,
        n_min=params.n_min or DEFAULT_CONFIG.n_min,
    )


def context_to_message(context: Sequence[int] | np.ndarray, n_max: int) -> pb.Context:
    """The last ``n_max`` tokens of ``context``: the server never looks further back."""
    return pb.Context(tokens=token_ids(context, "context", last=n_max).tolist())


def context_from_message(message: pb.Context, vocab_size: int, max_tokens: int, field: str = "context") -> np.ndarray:
    """uint32 [n] token ids, checked: non-empty, at most ``max_tokens``, every id < ``vocab_size``."""
    tokens = np.array(message.tokens, dtype=np.uint32)
    if tokens.size == 0:
        raise ValueError(f"{field} is empty: send at least one token id")
    if tokens.size > max_tokens:
        raise ValueError(
            f"{field} has {tokens.size} tokens, more than this server's limit of {max_tokens} (--max-context-tokens)"
        )
    return token_ids(tokens, field, vocab_size)


def contexts_from_messages(
    messages: Sequence[pb.Context],
    vocab_size: int,
    max_tokens: int,
    *,
    field: str = "contexts",
    stop: Callable[[], None] | None = None,
    chunk: int = 4096,
) -> list[np.ndarray]:
    """uint32 token arrays of ``messages``, each checked as ``context_from_message`` checks one
    (the first bad one is named ``field[i]``), in chunks checked with one numpy pass each:
    a 1024-context batch parses in milliseconds. ``stop``, called before each chunk of ``chunk``
    contexts, may raise to end the parse (a server's check that its client is still waiting)."""
    contexts: list[np.ndarray] = []
    for start in range(0, len(messages), chunk):
        if stop is not None:
            stop()
        token_lists = [list(m.tokens) for m in messages[start : start + chunk]]
        lengths = np.fromiter(map(len, token_lists), np.int64, len(token_lists))
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), np.uint32, int(lengths.sum()))
        ends = np.cumsum(lengths)
        bad = np.flatnonzero((lengths == 0) | (lengths > max_tokens))
        out_of_vocabulary = np.flatnonzero(flat >= vocab_size)
        if out_of_vocabulary.size:
            bad = np.append(bad, np.searchsorted(ends, out_of_vocabulary[0], side="right"))
        if bad.size:  # the first bad context fails with its own message
            i = int(bad.min())
            context_from_message(messages[start + i], vocab_size, max_tokens, field=f"{field}[{start + i}]")
        contexts.extend(np.split(flat, ends[:-1]))
    return contexts


def draft_request(
    context: Sequence[int] | np.ndarray, config: DraftConfig, include_outputs: bool = False
) -> pb.DraftRequest:
    return pb.DraftRequest(
        context=context_to_message(context, config.n_max),
        params=params_to_message(config),
        include_outputs=include_outputs,
    )


def draft_batch_request(
    contexts: Sequence[Sequence[int]], config: DraftConfig, include_outputs: bool = False
) -> pb.DraftBatchRequest:
    return pb.DraftBatchRequest(
        contexts=[context_to_message(c, config.n_max) for c in contexts],
        params=params_to_message(config),
        include_outputs=include_outputs,
    )


def add_output_request(tokens: Sequence[int] | np.ndarray) -> pb.AddOutputRequest:
    return pb.AddOutputRequest(tokens=token_ids(tokens, "tokens").tolist())


def output_from_message(request: pb.AddOutputRequest) -> np.ndarray:
    """int64 [n] token ids of an output to store; the ``OutputStore`` checks them (non-empty,
    within its size and the vocabulary) with the same messages in and out of process."""
    return np.array(request.tokens, dtype=np.int64)


# bytes a ReadOutputs reply spends per token at most (a uint32 varint), and beside its outputs
READ_BYTES_PER_TOKEN, READ_REPLY_SLACK = 5, 64


def read_outputs_reply(documents: Sequence[tuple[int, np.ndarray]], next_seq: int, end_seq: int) -> pb.ReadOutputsReply:
    return pb.ReadOutputsReply(
        outputs=[pb.StoredOutput(seq=seq, tokens=tokens.tolist()) for seq, tokens in documents],
        next_seq=next_seq,
        end_seq=end_seq,
    )


def outputs_from_reply(
    reply: pb.ReadOutputsReply, from_seq: int, vocab_size: int
) -> tuple[list[tuple[int, np.ndarray]], int, int]:
    """(documents, next_seq, end_seq) of a ReadOutputs reply to a read from ``from_seq``, checked as
    a hostile server's: numbers ascending from ``from_seq`` and below ``next_seq``, every document
    non-empty within the vocabulary, ``next_seq`` not behind ``from_seq`` (``ValueError`` naming
    what is wrong)."""
    documents, last = [], from_seq - 1
    for i, output in enumerate(reply.outputs):
        if output.seq <= last or output.seq >= reply.next_seq:
            raise ValueError(
                f"outputs[{i}].seq {output.seq} is out of order (after {last}, before next_seq {reply.next_seq})"
            )
        tokens = np.array(output.tokens, dtype=np.int64)
        if tokens.size == 0 or tokens.max() >= vocab_size:
            raise ValueError(f"outputs[{i}] (seq {output.seq}) is empty or holds ids outside [0, {vocab_size})")
        documents.append((output.seq, tokens))
        last = output.seq
    if reply.next_seq < from_seq and reply.end_seq >= from_seq:
        raise ValueError(f"next_seq {reply.next_seq} is behind the read's from_seq {from_seq}")
    return documents, reply.next_seq, reply.end_seq


def parse_draft_request(request: pb.DraftRequest, vocab_size: int, max_tokens: int) -> tuple[np.ndarray, DraftConfig]:
    """(context, config) of a request, validated (``ValueError`` naming the field)."""
    config = config_from_message(request.params)
    return context_from_message(request.context, vocab_size, max_tokens), config


def parse_draft_batch_request(
    request: pb.DraftBatchRequest,
    vocab_size: int,
    max_tokens: int,
    *,
    max_contexts: int,
    stop: Callable[[], None] | None = None,
) -> tuple[list[np.ndarray], DraftConfig]:
    """(contexts, config) of a batch request of at most ``max_contexts`` contexts; a bad context
    is named ``contexts[i]``; ``stop`` as in ``contexts_from_messages``."""
    if len(request.contexts) > max_contexts:
        raise ValueError(
            f"contexts has {len(request.contexts)} entries, more than this server's limit of {max_contexts} "
            "(--max-batch-contexts): split the batch"
        )
    config = config_from_message(request.params)
    return contexts_from_messages(request.contexts, vocab_size, max_tokens, stop=stop), config


def bearer_metadata(token: str) -> tuple[str, str]:
    """The call metadata entry that carries ``token``: (``authorization``, ``Bearer <token>``).
    Raises ``ValueError`` unless the token is printable ASCII without spaces (what metadata carries)."""
    if not token or not all("!" <= c <= "~" for c in token):
        raise ValueError("an auth token must be a non-empty string of printable ASCII characters without spaces")
    return AUTHORIZATION, f"Bearer {token}"


def tls_file_error(exc: OSError) -> str:
    """Why a TLS file could not be used, in a few words: the OS's reason for an unreadable file,
    OpenSSL's (e.g. KEY_VALUES_MISMATCH) for one that holds no usable PEM (``ssl.SSLError``)."""
    reason = exc.reason if isinstance(exc, ssl.SSLError) else exc.strerror
    return reason or type(exc).__name__


# ---- trees ----------------------------------------------------------------------------------


def tree_to_message(tree: DraftTree) -> pb.DraftTree:
    """Every field, the scores exact (float64)."""
    return pb.DraftTree(
        tokens=tree.tokens.tolist(),
        parents=tree.parents.tolist(),
        counts=tree.counts.tolist(),
        scores=tree.scores.tolist(),
        match_len=tree.match_len,
        num_matches=tree.num_matches,
        num_sampled=tree.num_sampled,
    )


def field_size(message: pb.DraftTree) -> int:
    """Bytes ``message`` adds to a reply as one element of its repeated field (tag, length, body),
    so a reply's size can be added up before it is serialized."""
    size = message.ByteSize()
    return 1 + max(1, (size.bit_length() + 6) // 7) + size  # field numbers < 16: one tag byte


def tree_from_message(message: pb.DraftTree) -> DraftTree:
    """The tree a message carries, its exact scores included (derived from counts when a writer
    predating ``scores`` sent none). Raises ``ValueError`` when the arrays do not form a
    BFS-ordered tree or the scores are not one valid score per node."""
    return DraftTree(
        np.array(message.tokens, dtype=np.int32),
        np.array(message.parents, dtype=np.int32),
        np.array(message.counts, dtype=np.int64),
        message.match_len,
        message.num_matches,
        message.num_sampled,
        scores=np.array(message.scores, dtype=np.float64) if message.scores else None,
    )


# ---- info -----------------------------------------------------------------------------------


def info_to_message(info: IndexInfo) -> pb.InfoReply:
    return pb.InfoReply(
        format_version=info.format_version,
        tokenizer_name=info.tokenizer_name,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        vocab_size=info.vocab_size,
        num_tokens=info.num_tokens,
        num_documents=info.num_documents,
        shards=[pb.Shard(name=s.name, num_tokens=s.num_tokens, num_documents=s.num_documents) for s in info.shards],
    )


def info_from_message(message: pb.InfoReply) -> IndexInfo:
    return IndexInfo(
        format_version=message.format_version,
        tokenizer_name=message.tokenizer_name,
        tokenizer_fingerprint=message.tokenizer_fingerprint,
        vocab_size=message.vocab_size,
        num_tokens=message.num_tokens,
        num_documents=message.num_documents,
        shards=tuple(ShardInfo(s.name, s.num_tokens, s.num_documents) for s in message.shards),
    )
