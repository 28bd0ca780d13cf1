"""The router: the public ``Datastore`` service answered from shard servers, tree for tree what one
process holding every shard of the index answers.

``Router`` is a ``Retriever`` like ``Datastore``, so ``rest-datastore route`` is the same
``DatastoreServer`` (limits, auth, TLS, health, reflection, the output store) with the router
behind it. A draft splits as ``datastore.index`` splits it: the shard servers (``datastore.shards``)
match, the router makes the global choice (``plan_draft``: the longest match over every shard, the
seeded sample above the cap) and builds the tree (``tree_from_rows``) -- the same functions a
single ``Datastore`` calls, so the answers are the same.

A batch of contexts costs one ``Match`` per server, all in parallel; each hit shard inlines its rows
when its range holds at most ``inline_rows`` positions (by default the cap, so whenever the matches
to count fit the cap there is no second round). Only above the cap, or for ranges too large to
inline, one ``Gather`` per server fetches the sampled rows.

At start the router checks that the servers describe the manifest's index (same index id, dtype,
vocabulary) and cover each of its shards exactly once. Every reply is checked like a request
(shards the server serves, ranges inside the shard, row sizes, token ids): a server that is down,
late (``timeout`` per call) or answers nonsense makes the call UNAVAILABLE, or with
``allow_partial`` the router answers from the rest -- a context whose rows were lost after the
sample was drawn gets the empty tree. Drafts are verified by the model, so generation stays
lossless either way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo
from rest_spec.datastore import format as fmt
from rest_spec.datastore import wire
from rest_spec.datastore.client import RECONNECT_OPTIONS, auth_metadata, open_channel
from rest_spec.datastore.index import (
    DEFAULT_MAX_CANDIDATES,
    DraftPlan,
    RetrieverUnavailable,
    ShardMatch,
    index_id,
    index_info,
    plan_draft,
    query_tokens,
    tree_from_rows,
    warm_up_top_c_tree,
)
from rest_spec.datastore.rpc import MAX_MESSAGE_BYTES, LogBudget, ServerConfig, run_until_signalled
from rest_spec.datastore.server import DatastoreServer, start_datastore
from rest_spec.datastore.shards import MAX_ROWS, format_shard_spec, rows_from_bytes
from rest_spec.proto.v1 import shard_pb2 as spb
from rest_spec.proto.v1 import shard_pb2_grpc as spb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    """Where the shards are and how to ask them. ``shard_servers``: ``host:port`` of each shard
    server; ``timeout``: seconds one call to a shard server may take (then it counts as down);
    ``connect_timeout``: how long to wait at start for every server to describe itself;
    ``allow_partial``: answer from the servers that answered instead of UNAVAILABLE;
    ``max_candidates``: the cap on counted matches (a single index's default; the answers equal a
    ``Datastore`` opened with the same cap); ``inline_rows``: ranges of at most this many positions
    come with their rows in the first round (None: ``max_candidates``). ``tls_ca`` and
    ``auth_token`` reach shard servers started with TLS and a token."""

    shard_servers: tuple[str, ...]
    timeout: float = 2.0
    connect_timeout: float = 30.0
    allow_partial: bool = False
    max_candidates: int = DEFAULT_MAX_CANDIDATES
    inline_rows: int | None = None
    tls_ca: Path | None = None
    auth_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.shard_servers:
            raise ValueError("shard_servers is empty: give at least one HOST:PORT")
        if len(set(self.shard_servers)) != len(self.shard_servers):
            raise ValueError("shard_servers names a server twice")
        for name in ("timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.max_candidates <= MAX_ROWS:
            raise ValueError(f"max_candidates must be in [1, {MAX_ROWS}], got {self.max_candidates}")
        if self.inline_rows is not None and not 0 <= self.inline_rows <= MAX_ROWS:
            raise ValueError(f"inline_rows must be in [0, {MAX_ROWS}], got {self.inline_rows}")
        if self.auth_token is not None:
            wire.bearer_metadata(self.auth_token)


@dataclass(eq=False)
class _Server:
    """One shard server: its channel and the shards it described."""

    address: str
    channel: grpc.Channel
    stub: spb_grpc.ShardServiceStub
    shards: frozenset[int] = frozenset()

    @property
    def name(self) -> str:
        return f"shard server {self.address} (shards {format_shard_spec(sorted(self.shards)) or '?'})"


class _BadReply(ValueError):
    """A shard server's reply that does not fit the request or the index."""


# A context's hits: (match, its rows when inlined) per hit shard.
_Hits = list[tuple[ShardMatch, np.ndarray | None]]


def load_manifest(path: str | Path) -> fmt.Manifest:
    """The checked manifest at ``path``: an index's ``manifest.json`` or its directory (the shard
    files need not be there)."""
    path = Path(path)
    if path.is_dir():
        return fmt.read_manifest(path)
    if path.name != fmt.MANIFEST:
        raise fmt.IndexFormatError(f"{path} is not an index manifest: expected a file named {fmt.MANIFEST}")
    return fmt.read_manifest(path.parent)


class Router:
    """The ``Retriever`` over shard servers of the index ``manifest`` (``Router.connect`` checks
    them). Thread-safe: calls share the channels."""

    def __init__(self, manifest: fmt.Manifest, servers: list[_Server], config: RouterConfig) -> None:
        self.manifest = manifest
        self._servers = servers
        self._config = config
        self._cap = config.max_candidates
        self._inline_rows = config.max_candidates if config.inline_rows is None else config.inline_rows
        self._index_id = index_id(manifest)
        self._dtype = np.dtype(manifest.token_dtype)
        self._sep = manifest.separator
        self._owner: dict[int, _Server] = {}  # shard -> the server of it, set by _describe_all
        self._sa_lengths = [fmt.sa_length(s.num_tokens, s.num_documents) for s in manifest.shards]
        self._metadata = auth_metadata(config.auth_token)
        self._loss_log = LogBudget()
        self.calls: Counter[str] = Counter()  # fan-out rounds made, by method ("Match", "Gather")
        self._calls_lock = threading.Lock()

    @classmethod
    def connect(cls, manifest_path: str | Path, config: RouterConfig) -> Router:
        """Reach every shard server and check that together they serve the index of the manifest
        at ``manifest_path``: the same index id, dtype and vocabulary, every shard exactly once.
        Raises ``ConnectionError`` for a server that does not describe itself within
        ``connect_timeout``, ``ValueError`` (``IndexFormatError`` for the manifest) for servers
        that do not make up the index."""
        manifest = load_manifest(manifest_path)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *RECONNECT_OPTIONS]
        servers: list[_Server] = []
        try:
            for address in config.shard_servers:
                channel = open_channel(address, config.tls_ca, options)
                servers.append(_Server(address, channel, spb_grpc.ShardServiceStub(channel)))
            router = cls(manifest, servers, config)
            router._describe_all()
        except BaseException:
            for server in servers:
                server.channel.close()
            raise
        log.info("routing %d shards of %s over %d shard servers", len(manifest.shards), router._index_id, len(servers))
        return router

    def _describe_all(self) -> None:
        """Ask every server what it serves (waiting for it to come up) and check the answers."""
        calls = [
            server.stub.Describe.future(
                spb.DescribeRequest(),
                timeout=self._config.connect_timeout,
                wait_for_ready=True,
                metadata=self._metadata,
            )
            for server in self._servers
        ]
        m = self.manifest
        expected = {
            "index_id": self._index_id,
            "num_shards": len(m.shards),
            "token_dtype": m.token_dtype,
            "separator": m.separator,
            "vocab_size": m.tokenizer.vocab_size,
        }
        owners: dict[int, str] = {}
        for server, call in zip(self._servers, calls):
            try:
                reply = call.result()
            except grpc.RpcError as exc:
                raise ConnectionError(f"shard server {server.address}: {exc.code().name}: {exc.details()}") from None
            for name, value in expected.items():
                if getattr(reply, name) != value:
                    raise ValueError(
                        f"shard server {server.address} serves another index: its {name} is "
                        f"{str(getattr(reply, name))[:80]!r}, the manifest's {value!r}"
                    )
            for shard in reply.shards:
                if shard >= len(m.shards):
                    raise ValueError(f"shard server {server.address} serves shard {shard}, not in the index")
                if shard in owners:
                    raise ValueError(f"shard {shard} is served twice: by {owners[shard]} and {server.address}")
                owners[shard] = server.address
            server.shards = frozenset(reply.shards)
        missing = sorted(set(range(len(m.shards))) - set(owners))
        if missing:
            raise ValueError(f"no shard server serves shard(s) {format_shard_spec(missing)} of the index")
        self._owner = {shard: server for server in self._servers for shard in server.shards}

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    def info(self) -> IndexInfo:
        return index_info(self.manifest)

    def warm_up(self) -> float:
        """Compile ``top_c_tree`` for the index's rows and the output store's."""
        start = time.perf_counter()
        warm_up_top_c_tree(self._dtype)
        warm_up_top_c_tree(np.dtype("<u4"))
        return time.perf_counter() - start

    def drafts(self, contexts: Iterable, config: DraftConfig, timeout: float | None = None) -> Iterator[DraftTree]:
        """The trees of ``contexts``: one ``Match`` per server for all of them, one ``Gather`` per
        server if any sample needs rows that were not inlined, then the trees one by one. Both
        rounds together take at most ``timeout`` seconds (the client's deadline) where that is
        shorter than the config's per-call timeout."""
        queries = [query_tokens(c, config.n_max, self.vocab_size) for c in contexts]
        if not queries:
            return
        deadline = time.monotonic() + min(self._config.timeout, math.inf if timeout is None else timeout)
        hits = self._match(queries, config, deadline)
        plans = [plan_draft((m for m, _ in h), q, config.n_min, self._cap) for q, h in zip(queries, hits)]
        gathered = self._gather(queries, config, hits, plans, deadline)
        for i, plan in enumerate(plans):
            if plan is None or i not in gathered:
                yield DraftTree.empty()
                continue
            inline = {m.shard: rows for m, rows in hits[i] if rows is not None}
            got = gathered[i]

            def fetch(match: ShardMatch, ranks: np.ndarray, inline=inline, got=got) -> np.ndarray:
                return inline[match.shard][ranks - match.lo] if match.shard in inline else got[match.shard]

            yield tree_from_rows(plan.rows(fetch, config.max_depth, self._dtype), self._sep, config.budget, plan)

    def _tokens(self, query: np.ndarray) -> spb.Tokens:
        return spb.Tokens(tokens=query[::-1].tolist())  # the context's last n_max tokens, oldest first

    def _match(self, queries: list[np.ndarray], config: DraftConfig, deadline: float) -> list[_Hits]:
        """Every context's hits over every server that answered (checked)."""
        request = spb.MatchRequest(
            index_id=self._index_id,
            contexts=[self._tokens(q) for q in queries],
            n_max=config.n_max,
            n_min=config.n_min,
            max_depth=config.max_depth,
            inline_rows=self._inline_rows,
        )
        hits: list[_Hits] = [[] for _ in queries]
        for server, reply in self._call_all("Match", {server: request for server in self._servers}, deadline).items():
            try:
                parsed = self._parse_match(server, reply, queries, config)
            except _BadReply as exc:
                self._lost(server, "Match", str(exc))
                continue
            for context_hits, more in zip(hits, parsed):
                context_hits.extend(more)
        return hits

    def _parse_match(
        self, server: _Server, reply: spb.MatchReply, queries: list[np.ndarray], config: DraftConfig
    ) -> list[_Hits]:
        if len(reply.contexts) != len(queries):
            raise _BadReply(f"{len(reply.contexts)} answers for {len(queries)} contexts")
        parsed = []
        for i, (answer, query) in enumerate(zip(reply.contexts, queries)):
            context_hits: _Hits = []
            lengths, shards = set(), set()
            for hit in answer.hits:
                where = f"contexts[{i}], shard {hit.shard}"
                if hit.shard not in server.shards or hit.shard in shards:
                    raise _BadReply(f"{where}: not a shard it serves, or answered twice")
                if not config.n_min <= hit.match_len <= query.size:
                    raise _BadReply(f"{where}: match length {hit.match_len} outside [{config.n_min}, {query.size}]")
                if not 1 <= hit.count <= self._sa_lengths[hit.shard] - hit.lo:
                    raise _BadReply(f"{where}: ranks [{hit.lo}, {hit.lo}+{hit.count}) outside the shard")
                rows = None
                if hit.rows:
                    if hit.count > self._inline_rows:
                        raise _BadReply(f"{where}: {hit.count} rows inlined, more than asked")
                    try:
                        rows = rows_from_bytes(hit.rows, hit.count, config.max_depth, self._dtype, self.vocab_size)
                    except ValueError as exc:
                        raise _BadReply(f"{where}: {exc}") from None
                shards.add(hit.shard)
                lengths.add(hit.match_len)
                context_hits.append((ShardMatch(hit.shard, hit.match_len, hit.lo, hit.count), rows))
            if len(lengths) > 1:
                raise _BadReply(f"contexts[{i}]: hits of different match lengths")
            parsed.append(context_hits)
        return parsed

    def _gather(
        self,
        queries: list[np.ndarray],
        config: DraftConfig,
        hits: list[_Hits],
        plans: list[DraftPlan | None],
        deadline: float,
    ) -> dict[int, dict[int, np.ndarray]]:
        """Per context with a plan, the sampled rows of its hit shards that did not inline them
        (shard -> rows); a context whose rows were lost (``allow_partial``) is left out."""
        wanted: dict[_Server, list[tuple[int, int, np.ndarray]]] = defaultdict(list)  # (context, shard, ranks)
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            inline = {m.shard for m, rows in hits[i] if rows is not None}
            for match, ranks in plan.picks:
                if ranks.size and match.shard not in inline:
                    wanted[self._owner[match.shard]].append((i, match.shard, ranks))
        requests = {}
        for server, items in wanted.items():
            used = sorted({i for i, _, _ in items})
            local = {i: k for k, i in enumerate(used)}
            requests[server] = spb.GatherRequest(
                index_id=self._index_id,
                contexts=[self._tokens(queries[i]) for i in used],
                n_max=config.n_max,
                max_depth=config.max_depth,
                items=[spb.GatherItem(context=local[i], shard=s, ranks=r.tolist()) for i, s, r in items],
            )
        gathered: dict[int, dict[int, np.ndarray]] = {i: {} for i, plan in enumerate(plans) if plan is not None}
        replies = self._call_all("Gather", requests, deadline)
        for server, items in wanted.items():
            rows = self._parse_gather(server, replies[server], items, config) if server in replies else None
            for k, (i, shard, _) in enumerate(items):
                if rows is None:
                    gathered.pop(i, None)
                elif i in gathered:
                    gathered[i][shard] = rows[k]
        return gathered

    def _parse_gather(
        self, server: _Server, reply: spb.GatherReply, items: list[tuple[int, int, np.ndarray]], config: DraftConfig
    ) -> list[np.ndarray] | None:
        """The rows of each item, checked; None (after ``_lost``) when the reply is unusable."""
        try:
            if len(reply.rows) != len(items):
                raise _BadReply(f"{len(reply.rows)} answers for {len(items)} items")
            rows = []
            for k, ((_, _, ranks), data) in enumerate(zip(items, reply.rows)):
                try:
                    rows.append(rows_from_bytes(data, ranks.size, config.max_depth, self._dtype, self.vocab_size))
                except ValueError as exc:
                    raise _BadReply(f"items[{k}]: {exc}") from None
        except _BadReply as exc:
            self._lost(server, "Gather", str(exc))
            return None
        return rows

    def _call_all(self, method: str, requests: dict[_Server, object], deadline: float) -> dict[_Server, object]:
        """``method`` on every server of ``requests`` at once; the replies of those that answered
        before ``deadline`` (``time.monotonic()``). A failure raises ``RetrieverUnavailable`` (the
        other calls are cancelled) unless ``allow_partial``."""
        if not requests:
            return {}
        with self._calls_lock:
            self.calls[method] += 1
        timeout = max(0.0, deadline - time.monotonic())
        calls = {
            server: getattr(server.stub, method).future(request, timeout=timeout, metadata=self._metadata)
            for server, request in requests.items()
        }
        replies = {}
        try:
            for server, call in calls.items():
                try:
                    replies[server] = call.result()
                except grpc.RpcError as exc:
                    self._lost(server, method, f"{exc.code().name}: {exc.details()}")
        finally:
            for call in calls.values():
                call.cancel()  # no-op for the finished ones
        return replies

    def _lost(self, server: _Server, method: str, reason: str) -> None:
        """A server's answer is missing or unusable: UNAVAILABLE, or with ``allow_partial`` a
        rate-limited warning and an answer from the rest."""
        message = f"{server.name} failed {method}: {reason}"
        if not self._config.allow_partial:
            raise RetrieverUnavailable(message)
        suppressed = self._loss_log.take()
        if suppressed is not None:
            log.warning(
                "%s; answering from the other servers%s",
                message[:300],
                f" ({suppressed} similar lines suppressed)" if suppressed else "",
            )

    def close(self) -> None:
        for server in self._servers:
            server.channel.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def route(
    manifest_path: str | Path,
    router_config: RouterConfig,
    config: ServerConfig,
    *,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the public datastore service for the index of ``manifest_path`` from its shard
    servers (and the output store ``config`` asks for) until SIGTERM or SIGINT, as
    ``server.serve`` does. Raises ``ConnectionError`` / ``ValueError`` when the shard servers do not
    make up the index (``Router.connect``), else as ``serve``."""

    def start(resources: contextlib.ExitStack) -> DatastoreServer:
        router = resources.enter_context(Router.connect(manifest_path, router_config))
        return start_datastore(resources, router, config, role="route")

    run_until_signalled(start, ready)
