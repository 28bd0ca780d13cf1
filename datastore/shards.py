"""The shard service (``rest.shard.v1.ShardService``): some shards of an index, served to a router.

A shard server (``rest-datastore serve --index DIR --shards SPEC``) opens only the shards it is
given, numbered as in the manifest, and answers the parts of a draft that one shard can answer
alone (``Datastore.match`` and ``Datastore.rows``); the router (``datastore.router``) makes the
global choice and builds the tree. It serves nothing else besides health and reflection: the
public ``Datastore`` service and the output store live in the router.

Requests are hostile like any other: every field is checked (sizes, ranges, shard numbers, ranks
inside the match range of their shard) before a kernel sees it, and a request for another index
(its ranks would index another suffix array) is refused with FAILED_PRECONDITION. The packing of
rows on the wire (``rows_to_bytes`` / ``rows_from_bytes``) is here too, so both ends share it.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import numpy as np

from rest_spec.common.types import MAX_SUFFIX, DraftConfig
from rest_spec.datastore import format as fmt
from rest_spec.datastore import wire
from rest_spec.datastore.index import Datastore, ShardMatch, index_id, query_matrix
from rest_spec.datastore.rpc import (
    BoundedServicer,
    CallRefused,
    GrpcServer,
    ServerConfig,
    run_until_signalled,
    stop_if_ended,
)
from rest_spec.proto.v1 import shard_pb2 as spb

SERVICE = spb.DESCRIPTOR.services_by_name["ShardService"]
SERVICE_NAME = SERVICE.full_name  # "rest.shard.v1.ShardService"

# The most rows one hit inlines or one Gather item asks for: a router's candidate cap is at most this.
MAX_ROWS = 1024
_HIT_BYTES = 40  # a ShardHit without rows, framing included, at most
_SPEC_PART = re.compile(r"(\d+)(?:-(\d+))?")


def parse_shard_spec(spec: str) -> list[int]:
    """Shard numbers from a spec like ``0-3,7`` (ranges inclusive); ``ValueError`` for anything
    else. Whether the index has them is checked when it is opened."""
    shards: list[int] = []
    for part in spec.replace(" ", "").split(","):
        found = _SPEC_PART.fullmatch(part)
        if not found:
            raise ValueError(f"shard spec {spec!r}: {part!r} is not a shard number or a range like 0-3")
        first, last = int(found.group(1)), int(found.group(2) or found.group(1))
        if last < first:
            raise ValueError(f"shard spec {spec!r}: the range {part} is empty")
        if last - first >= 1 << 20:
            raise ValueError(f"shard spec {spec!r}: the range {part} is larger than any index")
        shards.extend(range(first, last + 1))
    return shards


def format_shard_spec(shards: Sequence[int]) -> str:
    """``parse_shard_spec``'s inverse for ascending numbers: [0, 1, 2, 3, 7] -> "0-3,7"."""
    parts, start = [], 0
    for i in range(1, len(shards) + 1):
        if i == len(shards) or shards[i] != shards[i - 1] + 1:
            first, last = shards[start], shards[i - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(parts)


def rows_to_bytes(rows: np.ndarray) -> bytes:
    """Rows of an index's little-endian token dtype, row after row."""
    return rows.tobytes()


def rows_from_bytes(data: bytes, num_rows: int, max_depth: int, dtype: np.dtype, vocab_size: int) -> np.ndarray:
    """[num_rows, max_depth] rows of ``dtype`` from ``data``; ``ValueError`` unless the size is
    exact and every value is a token id below ``vocab_size`` or the separator."""
    expected = num_rows * max_depth * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes of rows, expected {expected} ({num_rows} rows of {max_depth} {dtype.str})")
    rows = np.frombuffer(data, dtype=dtype).reshape(num_rows, max_depth)
    sep = fmt.separator(dtype)
    if np.any((rows >= vocab_size) & (rows != sep)):
        raise ValueError(f"rows hold a value that is neither a token id below {vocab_size} nor the separator")
    return rows


def _request_config(n_max: int, max_depth: int, n_min: int = 1) -> DraftConfig:
    """The request's match and row parameters, validated (``ValueError`` naming the field; all
    required: 0 is out of range here)."""
    return DraftConfig(budget=1, max_depth=max_depth, n_max=n_max, n_min=n_min)


class ShardServicer(BoundedServicer):
    """The shard service over ``store`` (some shards of an index). Every call needs the bearer
    token when the server has one."""

    log = logging.getLogger(__name__)

    def __init__(self, store: Datastore, config: ServerConfig) -> None:
        super().__init__(SERVICE, config)
        self._store = store
        self._index_id = index_id(store.manifest)
        self._served = frozenset(store.shard_numbers)
        self._itemsize = np.dtype(store.manifest.token_dtype).itemsize
        self._describe = spb.DescribeReply(
            index_id=self._index_id,
            shards=store.shard_numbers,
            num_shards=len(store.manifest.shards),
            token_dtype=store.manifest.token_dtype,
            separator=store.manifest.separator,
            vocab_size=store.vocab_size,
        )

    def Describe(self, request: spb.DescribeRequest, context: grpc.ServicerContext) -> spb.DescribeReply:
        return self._describe

    def _queries(self, request, n_max: int, context: grpc.ServicerContext) -> list[np.ndarray]:
        """The request's contexts as queries (``query_tokens`` of each, checked in one pass), after the
        index id is checked; stops parsing once the client is gone."""
        if request.index_id != self._index_id:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"index id {request.index_id[:80]!r} is not this server's {self._index_id}: it serves another index",
            )
        if len(request.contexts) > self._config.max_batch_contexts:
            raise CallRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"contexts has {len(request.contexts)} entries, more than this server's limit of "
                f"{self._config.max_batch_contexts} (--max-batch-contexts)",
            )
        contexts = wire.contexts_from_messages(
            request.contexts, self._store.vocab_size, MAX_SUFFIX, stop=lambda: stop_if_ended(context)
        )
        queries, lengths = query_matrix(contexts, n_max, self._store.vocab_size)  # one pass, not one per context
        return [query[:n] for query, n in zip(queries, lengths.tolist())]

    def Match(self, request: spb.MatchRequest, context: grpc.ServicerContext) -> spb.MatchReply:
        """Each context's longest matches among the served shards; the rows of a range of at most
        ``inline_rows`` positions while the reply stays within ``max_reply_bytes`` (beyond, the
        router gathers them)."""
        config = _request_config(request.n_max, request.max_depth, request.n_min)
        if request.inline_rows > MAX_ROWS:
            raise ValueError(f"inline_rows must be in [0, {MAX_ROWS}], got {request.inline_rows}")
        queries = self._queries(request, config.n_max, context)
        room = self._config.max_reply_bytes - 8 * len(queries)  # 8: one ContextHits' framing, at most
        reply = spb.MatchReply()
        for query in queries:
            stop_if_ended(context)
            hits = reply.contexts.add().hits
            for m in self._store.match(query, config.n_min):
                room -= _HIT_BYTES
                if room < 0:
                    raise CallRefused(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the reply to {len(queries)} contexts exceeds this server's limit of "
                        f"{self._config.max_reply_bytes} bytes (--max-reply-bytes): send fewer contexts",
                    )
                hit = hits.add(shard=m.shard, match_len=m.match_len, lo=m.lo, count=m.count)
                size = m.count * config.max_depth * self._itemsize
                if m.count <= request.inline_rows and size + 8 <= room:  # 8: the bytes field's framing, at most
                    ranks = np.arange(m.lo, m.lo + m.count, dtype=np.int64)
                    hit.rows = rows_to_bytes(self._store.rows(m.shard, ranks, config.max_depth))
                    room -= size + 8
        return reply

    def Gather(self, request: spb.GatherRequest, context: grpc.ServicerContext) -> spb.GatherReply:
        """The rows of each item's ranks, each checked to lie in its shard's longest match of its
        context (so every rank a kernel reads is one a Match could have answered)."""
        config = _request_config(request.n_max, request.max_depth)
        queries = self._queries(request, config.n_max, context)
        size = sum(len(item.ranks) for item in request.items) * config.max_depth * self._itemsize
        if size > self._config.max_reply_bytes:
            raise CallRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the rows asked for ({size} bytes) exceed this server's limit of {self._config.max_reply_bytes} "
                "bytes (--max-reply-bytes): ask for fewer",
            )
        matches: dict[int, dict[int, ShardMatch]] = {}  # context -> shard -> its longest match
        reply = spb.GatherReply()
        for i, item in enumerate(request.items):
            stop_if_ended(context)
            where = f"items[{i}]"
            if item.context >= len(queries):
                raise ValueError(f"{where}.context = {item.context} is not an index into contexts ({len(queries)})")
            if item.shard not in self._served:
                raise ValueError(f"{where}.shard = {item.shard} is not served here (shards {self._spec()})")
            if len(item.ranks) > MAX_ROWS:
                raise ValueError(f"{where}.ranks has {len(item.ranks)} entries, more than {MAX_ROWS}")
            if item.context not in matches:
                found = self._store.match(queries[item.context])
                matches[item.context] = {m.shard: m for m in found}
            m = matches[item.context].get(item.shard)
            ranks = np.array(item.ranks, dtype=np.uint64)
            if m is None or np.any((ranks < m.lo) | (ranks >= m.lo + m.count)):
                range_text = "no match" if m is None else f"[{m.lo}, {m.lo + m.count})"
                raise ValueError(
                    f"{where}.ranks: shard {item.shard}'s longest match of contexts[{item.context}] is {range_text}; "
                    "ranks outside it are not a Match's answer"
                )
            reply.rows.append(rows_to_bytes(self._store.rows(item.shard, ranks.astype(np.int64), config.max_depth)))
        return reply

    def _spec(self) -> str:
        return format_shard_spec(sorted(self._served))


class ShardServer(GrpcServer):
    """A running shard service over ``store`` (which the caller keeps and closes): compiles the
    retrieval kernels, then binds and starts."""

    log = logging.getLogger(__name__)

    def __init__(self, store: Datastore, config: ServerConfig) -> None:
        store.warm_up()
        spec = format_shard_spec(store.shard_numbers)
        super().__init__(
            SERVICE_NAME,
            ShardServicer(store, config).handlers(),
            config,
            f"shard service (shards {spec} of {len(store.manifest.shards)})",
            "shard",
        )
        if self.metrics is not None:
            served = [store.manifest.shards[number] for number in store.shard_numbers]
            self.metrics.set_shards(len(served), sum(shard.num_tokens for shard in served))


def serve_shards(
    index_path: str | Path,
    shards: Sequence[int],
    config: ServerConfig,
    *,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve shards ``shards`` of the index at ``index_path`` until SIGTERM or SIGINT (as
    ``server.serve``; the output store options of ``config`` do not apply). Raises
    ``IndexFormatError``, ``OSError`` or ``ValueError`` (shard numbers, TLS files)."""

    def start(resources: contextlib.ExitStack) -> ShardServer:
        store = resources.enter_context(Datastore.open(index_path, check=config.check_index, shards=shards))
        return resources.enter_context(ShardServer(store, config))

    run_until_signalled(start, ready)
