"""The retrieval engine: longest-suffix exact match of a context, continuation candidates, draft tree.

``Datastore.open`` memory-maps every shard (nothing is read beyond a few header bytes and spot
digests), so opening a multi-GB index is instant and concurrent ``draft`` calls from many threads
share the page cache. A draft follows REST (He et al., 2023) with three corrections: matches never
cross a document and continuations stop at the document's end; when more positions match than
``max_candidates``, a uniform random sample (seeded by the query, so the same input always gives
the same tree) is counted instead of the lexicographically first ones; and the tree holds exactly
``min(budget, distinct prefixes)`` nodes with deterministic tie-breaking.

Search: each shard stores the suffix array of its *reversed* token array, so the positions where
the last ``j`` context tokens occur form one rank range, and matching one more token further back
narrows that range. One pass over at most ``n_max`` tokens finds the longest match in every shard.

A draft is three steps, each with one implementation, so a router over shard servers
(``datastore.router``) computes exactly what one process with every shard does: each shard's
longest match (``Datastore.match``), the global choice of what to count (``plan_draft``: the
longest match over all shards, the hit shards in manifest order, the seeded sample above the cap),
and the tree of the counted rows (``tree_from_rows``). ``Datastore`` and the router are both a
``Retriever``: what the datastore service (``datastore.server``) drafts from.

Several indexes open as one ``Datastore`` (``Datastore.open([a, b])``: the stdlib's and the
model's own outputs', say) when they share tokenizer, vocabulary, token dtype and separator: their
shards are numbered on from one index to the next, and the three steps run over all of them
unchanged, so the union answers tree for tree what one index holding those shards in that order
answers -- and, whenever a match's positions are all counted (at most ``max_candidates``), what
any one index of all their documents answers, since the trie counts the multiset of rows.

The binary searches, the continuation gather and the trie (``datastore.trie``) are numba-compiled
kernels that release the GIL: a draft costs a few Python-level calls, and a server's threads
draft in parallel on every core. On one shard, ``draft_batch`` runs the three steps for all of an
engine step's rows in one compiled pass (``_draft_rows``, composed of the same kernels). They
bounds-check every value read from disk, so a damaged index answers ``IndexCorruptError`` instead
of crashing the process; ``Datastore.warm_up`` compiles them (or loads them from numba's on-disk
cache) before a server reports ready.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from rest_spec.common.cache import numba_cached
from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo, ShardInfo, token_ids
from rest_spec.datastore import format as fmt
from rest_spec.datastore.trie import _put_tree, _tree_buffers, counted_tree, top_c_tree, trees_from_buffers

numba = numba_cached()

log = logging.getLogger(__name__)

# Positions counted per draft at most: 256 drafts what 1,024 and 4,096 do (the same accepted tokens per step to
# 0.1% on held-out code and chat, benchmarks/README.md) in less time where a short match is common.
DEFAULT_MAX_CANDIDATES = 256


# Kernel results: the count or status they return is negative for corruption, with the bad
# (index, value) read from disk in ``fault``. Every value that comes from disk is bounds-checked
# before it is used as an index, so a damaged or hostile file can never make a kernel read
# outside its arrays (a segmentation fault in the server) or put a non-token in a draft.
_BAD_SA_ENTRY = -1  # fault = (rank, suffix-array value)
_BAD_TOKEN = -2  # fault = (position, token)


@numba.njit(nogil=True, cache=True)
def _match_ranges(tokens, sa, single_token_ranges, query_reversed, ranges, fault):
    """Fill ``ranges[j]`` with the rank range [lo, hi) of the last j+1 context tokens and return
    how many tokens matched (the loop stops at the first miss), or ``_BAD_SA_ENTRY``.

    ``single_token_ranges[t]`` memoizes the first step, the one over the whole array, for token
    ``t``: ``(lo << 32 | (hi - lo)) + 1``, 0 while unknown (so the memo starts as zeroed pages the
    OS maps lazily). One 8-byte store, so threads that race to fill an entry write the same value
    and never expose half of it.

    Within a range that shares its first ``depth`` tokens, the next tokens are sorted, so each
    step is a binary search for the first and one past the last rank holding the token among
    ``R[sa[r] + depth]``, R = tokens[::-1]. The two searches run in lockstep: on an index far
    larger than the CPU caches every probe is a cache miss, and two independent probes per
    iteration let the CPU wait for both misses at once."""
    lo, hi = 0, sa.shape[0]
    for depth in range(query_reversed.shape[0]):
        token = query_reversed[depth]
        if depth == 0 and single_token_ranges[token] > 0:
            packed = single_token_ranges[token] - 1
            lo, hi = packed >> 32, (packed >> 32) + (packed & 0xFFFFFFFF)
            if lo == hi:
                return 0
            ranges[0, 0], ranges[0, 1] = lo, hi
            continue
        last = tokens.shape[0] - 1 - depth  # R[r + depth] == tokens[last - r], in bounds for 0 <= r <= last
        a_lo, a_hi = lo, hi  # first rank with key >= token lies in [a_lo, a_hi]
        b_lo, b_hi = lo, hi  # first rank with key > token lies in [b_lo, b_hi]
        while a_lo < a_hi or b_lo < b_hi:
            if a_lo < a_hi:
                mid = (a_lo + a_hi) >> 1
                r = sa[mid]
                if r < 0 or r > last:
                    fault[0], fault[1] = mid, r
                    return _BAD_SA_ENTRY
                if tokens[last - r] < token:
                    a_lo = mid + 1
                else:
                    a_hi = mid
            if b_lo < b_hi:
                mid = (b_lo + b_hi) >> 1
                r = sa[mid]
                if r < 0 or r > last:
                    fault[0], fault[1] = mid, r
                    return _BAD_SA_ENTRY
                if tokens[last - r] <= token:
                    b_lo = mid + 1
                else:
                    b_hi = mid
        if depth == 0 and b_lo < (1 << 31):  # shards past 2^31 tokens: not memoized
            single_token_ranges[token] = ((a_lo << 32) | (b_lo - a_lo)) + 1
        if a_lo == b_lo:
            return depth
        lo, hi = a_lo, b_lo
        ranges[depth, 0], ranges[depth, 1] = lo, hi
    return query_reversed.shape[0]


@numba.njit(nogil=True, cache=True)
def _continuations(tokens, sa, ranks, sep, vocab_size, out, fault):
    """``out[i]`` = the tokens after the match at rank ``ranks[i]``, ``sep`` from its document's
    end on (the array ends with a separator, so no window runs past a document unnoticed).
    Returns 0, or ``_BAD_SA_ENTRY`` / ``_BAD_TOKEN`` (a value that is neither an id below
    ``vocab_size`` nor ``sep``)."""
    n = tokens.shape[0]
    for i in range(ranks.shape[0]):
        r = sa[ranks[i]]
        if r < 1 or r > n:
            fault[0], fault[1] = ranks[i], r
            return _BAD_SA_ENTRY
        position = n - r  # first token after the match
        ended = False
        for j in range(out.shape[1]):
            if not ended and (position + j >= n or tokens[position + j] == sep):
                ended = True
            if ended:
                out[i, j] = sep
            else:
                token = tokens[position + j]
                if token >= vocab_size:
                    fault[0], fault[1] = position + j, token
                    return _BAD_TOKEN
                out[i, j] = token
    return 0


@dataclass(frozen=True)
class _Shard:
    """One memory-mapped shard: token array and the suffix array of the reversed tokens, with the
    paths of their files (a kernel that finds them corrupt names the file)."""

    tokens: np.ndarray
    sa: np.ndarray
    single_token_ranges: np.ndarray  # int64 [vocab], filled as tokens are first queried
    tokens_path: Path
    sa_path: Path

    def match_ranges(self, query_reversed: np.ndarray) -> np.ndarray:
        """int64 [j, 2] rank ranges of the longest prefix of ``query_reversed`` (the context read
        backwards, int64): row i is the range for the last i+1 context tokens."""
        ranges = np.empty((query_reversed.shape[0], 2), dtype=np.int64)
        fault = np.empty(2, dtype=np.int64)
        matched = _match_ranges(self.tokens, self.sa, self.single_token_ranges, query_reversed, ranges, fault)
        if matched < 0:
            raise self._corrupt(matched, fault)
        return ranges[:matched]

    def continuations(self, ranks: np.ndarray, sep: int, vocab_size: int, out: np.ndarray) -> None:
        """Fill ``out`` [len(ranks), length] with the tokens following each match, ``sep`` (the
        index's separator) from a document's end on."""
        fault = np.empty(2, dtype=np.int64)
        status = _continuations(self.tokens, self.sa, ranks, self.tokens.dtype.type(sep), vocab_size, out, fault)
        if status < 0:
            raise self._corrupt(status, fault)

    def draft_rows(
        self,
        queries: np.ndarray,
        lengths: np.ndarray,
        config: DraftConfig,
        max_candidates: int,
        sep: int,
        vocab_size: int,
    ) -> list[DraftTree]:
        """The draft of every row of ``queries`` (``query_matrix``) on this shard alone, in one
        compiled pass (``_draft_rows``)."""
        fault = np.empty(2, dtype=np.int64)
        status, buffers = _draft_rows(
            self.tokens, self.sa, self.single_token_ranges, queries, lengths, config.n_min, max_candidates,
            config.max_depth, config.budget, self.tokens.dtype.type(sep), vocab_size, fault,
        )  # fmt: skip
        if status < 0:
            raise self._corrupt(status, fault)
        return trees_from_buffers(buffers)

    def _corrupt(self, status: int, fault: np.ndarray) -> fmt.IndexCorruptError:
        where, value = fault.tolist()
        if status == _BAD_TOKEN:
            path, problem = self.tokens_path, f"token {where} = {value} is outside the vocabulary"
        elif 0 <= value < self.tokens.shape[0]:
            path, problem = self.sa_path, f"suffix-array entry {where} = {value} runs past the token array's end"
        else:
            path, problem = self.sa_path, f"suffix-array entry {where} = {value} is outside [0, {self.tokens.shape[0]})"
        return fmt.IndexCorruptError(
            f"index file {path} is corrupt: {problem}; run `rest-datastore verify --index {path.parent}`"
        )


@dataclass(frozen=True)
class ShardMatch:
    """One shard's longest match of a query: ``match_len`` tokens at suffix-array ranks
    [``lo``, ``lo + count``) of shard ``shard`` (its number in the manifest)."""

    shard: int
    match_len: int
    lo: int
    count: int


@dataclass(frozen=True)
class DraftPlan:
    """The global choice once every shard has matched: the longest match over all shards, how
    many positions match it, and per hit shard (manifest order) the ranks whose rows are counted."""

    match_len: int
    num_matches: int
    picks: tuple[tuple[ShardMatch, np.ndarray], ...]  # (hit shard, int64 ranks in [lo, lo + count))

    @property
    def num_sampled(self) -> int:
        return sum(ranks.size for _, ranks in self.picks)

    def rows(
        self, fetch: Callable[[ShardMatch, np.ndarray], np.ndarray], max_depth: int, dtype: np.dtype
    ) -> np.ndarray:
        """[num_sampled, max_depth] rows, hit shard after hit shard: ``fetch(match, ranks)`` answers
        one shard's rows (its tokens after each rank's match, separator-padded)."""
        rows = np.empty((self.num_sampled, max_depth), dtype=dtype)
        at = 0
        for match, ranks in self.picks:
            if ranks.size:  # a hit shard none of whose positions was sampled is never asked
                rows[at : at + ranks.size] = fetch(match, ranks)
                at += ranks.size
        return rows


def query_tokens(context: Sequence[int] | np.ndarray, n_max: int, vocab_size: int) -> np.ndarray:
    """The last ``n_max`` context tokens, newest first, as int64 (validated): what every shard
    matches and what seeds the sample."""
    tail = token_ids(context, "context", vocab_size, last=n_max)
    if tail.size == 0:
        raise ValueError("context must be a non-empty 1-D sequence of token ids")
    return tail[::-1].astype(np.int64)


def query_matrix(
    contexts: Sequence[Sequence[int] | np.ndarray], n_max: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``query_tokens`` of every context at once: (int64 [R, n_max], row i the last tokens of
    context i newest first, padded; int64 [R] their counts), checked in one vectorized pass. A
    context that fails the check is named by ``query_tokens``'s own error."""
    if len(contexts) == 1:  # one row (an engine at one request): the few numpy calls of one query
        query = query_tokens(contexts[0], n_max, vocab_size)
        return query[None], np.array([query.size], np.int64)
    tails = [context[-n_max:] for context in contexts]
    lengths = np.fromiter(map(len, tails), np.int64, len(tails))
    try:
        flat = np.concatenate(tails) if tails else np.zeros(0, np.int64)
    except ValueError:  # a context that is not 1-D
        flat = None
    if (
        flat is None
        or flat.ndim != 1
        or not np.issubdtype(flat.dtype, np.integer)
        or (lengths == 0).any()
        or (flat.size and (flat.min() < 0 or flat.max() >= vocab_size))
    ):
        for context in contexts:
            query_tokens(context, n_max, vocab_size)  # raises, naming the problem
        raise ValueError("contexts must be non-empty 1-D sequences of token ids")
    rows = np.repeat(np.arange(lengths.size), lengths)
    within = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    queries = np.zeros((lengths.size, n_max), np.int64)
    queries[rows, np.repeat(lengths, lengths) - 1 - within] = flat
    return queries, lengths


def checked_queries(queries: np.ndarray, lengths: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``query_matrix``'s answer as a caller hands it back to a draft (``draft_queries``): int64
    [R, n] of ids in [0, ``vocab_size``) and int64 [R] lengths in [1, n], else ``ValueError``
    naming what is not, before any kernel reads them."""
    queries, lengths = np.asarray(queries), np.asarray(lengths)
    if (
        queries.dtype != np.int64
        or lengths.dtype != np.int64
        or queries.ndim != 2
        or lengths.shape != queries.shape[:1]
    ):
        raise ValueError(
            f"queries must be int64 [rows, n] and lengths int64 [rows] (query_matrix), got "
            f"{queries.dtype} {queries.shape} and {lengths.dtype} {lengths.shape}"
        )
    if lengths.size and (lengths.min() < 1 or lengths.max() > queries.shape[1]):
        raise ValueError(f"query lengths must be in [1, {queries.shape[1]}]")
    if queries.size and (queries.min() < 0 or queries.max() >= vocab_size):
        raise ValueError(f"query token ids must be in [0, {vocab_size})")
    return np.ascontiguousarray(queries), lengths


def longest_matches(matches: Iterable[ShardMatch]) -> list[ShardMatch]:
    """The matches of the longest length (the only ones that can count), in manifest order."""
    matches = list(matches)
    longest = max((m.match_len for m in matches), default=0)
    return sorted((m for m in matches if m.match_len == longest and longest > 0), key=lambda m: m.shard)


def plan_draft(matches: Iterable[ShardMatch], query: np.ndarray, n_min: int, max_candidates: int) -> DraftPlan | None:
    """The global choice over every shard's match (``query`` from ``query_tokens``): None when the
    longest match is shorter than ``n_min`` (the empty tree), else the plan of what to count."""
    hits = longest_matches(matches)
    if not hits or hits[0].match_len < n_min:
        return None
    match_len = hits[0].match_len
    sizes = np.array([m.count for m in hits], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    picked = sample(int(offsets[-1]), query[:match_len], max_candidates)
    bounds = np.searchsorted(picked, offsets)
    picks = tuple((m, picked[bounds[i] : bounds[i + 1]] - offsets[i] + m.lo) for i, m in enumerate(hits))
    return DraftPlan(match_len, int(offsets[-1]), picks)


def sample(num_matches: int, matched_reversed: np.ndarray, max_candidates: int) -> np.ndarray:
    """Indices into the concatenated match ranges to count: all of them, or a uniform sample
    of ``max_candidates`` seeded by the matched tokens (same query, same sample), ascending."""
    return _sample(num_matches, np.ascontiguousarray(matched_reversed, dtype=np.int64), max_candidates)


@numba.njit(nogil=True, cache=True)
def _sample(num_matches, matched_reversed, max_candidates):
    """``sample``'s kernel, also called inside ``_draft_rows``: Floyd's draw of ``max_candidates``
    distinct indices below ``num_matches`` from splitmix64 seeded by the FNV-1a hash of the
    matched tokens (a modulo bias below 2^-24 for any index that fits in memory)."""
    if num_matches <= max_candidates:
        return np.arange(num_matches)
    state = np.uint64(0xCBF29CE484222325)
    for token in matched_reversed:
        state = (state ^ np.uint64(token)) * np.uint64(0x100000001B3)
    chosen = {np.int64(-1)}
    chosen.discard(np.int64(-1))
    picked = np.empty(max_candidates, np.int64)
    for i in range(max_candidates):
        j = num_matches - max_candidates + i
        state += np.uint64(0x9E3779B97F4A7C15)
        z = state
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        t = np.int64(z % np.uint64(j + 1))
        if t in chosen:
            t = j
        chosen.add(t)
        picked[i] = t
    picked.sort()
    return picked


@numba.njit(nogil=True, cache=True)
def _draft_rows(
    tokens, sa, single_token_ranges, queries, lengths, n_min, max_candidates, max_depth, budget, sep, vocab_size, fault
):
    """``Datastore.draft`` of every query row on one shard in one pass -- ``_match_ranges``, the
    plan's ``_sample``, ``_continuations`` and the trie -- as ``plan_draft`` and ``tree_from_rows``
    compose them for several shards, with no Python between rows. Returns (status, the trees'
    ``_tree_buffers``); status < 0: corruption, with the fault in ``fault``."""
    num_rows = queries.shape[0]
    buffers = _tree_buffers(num_rows, budget)
    offsets = buffers[5]
    ranges = np.empty((queries.shape[1], 2), np.int64)
    rows = np.empty((max_candidates, max_depth), tokens.dtype)
    for r in range(num_rows):
        query = queries[r, : lengths[r]]
        matched = _match_ranges(tokens, sa, single_token_ranges, query, ranges, fault)
        if matched < 0:
            return matched, buffers
        offsets[r + 1] = offsets[r]
        if matched > 0 and matched >= n_min:
            lo, hi = ranges[matched - 1, 0], ranges[matched - 1, 1]
            ranks = _sample(hi - lo, query[:matched], max_candidates) + lo
            status = _continuations(tokens, sa, ranks, sep, vocab_size, rows[: ranks.shape[0]], fault)
            if status < 0:
                return status, buffers
            _put_tree(buffers, r, rows[: ranks.shape[0]], sep, budget, matched, hi - lo)
    return 0, buffers


def tree_from_rows(rows: np.ndarray, sep: int, budget: int, plan: DraftPlan) -> DraftTree:
    """The draft tree of the counted rows (their order does not matter: the trie is of the multiset)."""
    return counted_tree(rows, sep, budget, plan.match_len, plan.num_matches)


def check_shard_numbers(shards: Iterable[int], num_shards: int) -> tuple[int, ...]:
    """``shards`` as ascending manifest shard numbers, each in [0, ``num_shards``) and given once;
    raises ``ValueError`` naming the first that is not."""
    seen: set[int] = set()
    for shard in shards:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in the index (its shards are 0..{num_shards - 1})")
        if shard in seen:
            raise ValueError(f"shard {shard} is given twice")
        seen.add(shard)
    if not seen:
        raise ValueError("no shards given")
    return tuple(sorted(seen))


def index_id(manifest: fmt.Manifest) -> str:
    """ "sha256:<hex>" of the manifest's shard list (names, sizes, file digests): servers that report
    the same id answer suffix-array ranks of the same files."""
    shards = json.dumps([dataclasses.asdict(s) for s in manifest.shards], sort_keys=True)
    return "sha256:" + hashlib.sha256(shards.encode()).hexdigest()


def index_info(manifest: fmt.Manifest) -> IndexInfo:
    """What ``Info`` says about the index of ``manifest`` (all its shards)."""
    m = manifest
    return IndexInfo(
        format_version=m.format_version,
        tokenizer_name=m.tokenizer.name,
        tokenizer_fingerprint=m.tokenizer.fingerprint,
        vocab_size=m.tokenizer.vocab_size,
        num_tokens=m.num_tokens,
        num_documents=m.num_documents,
        shards=tuple(ShardInfo(s.name, s.num_tokens, s.num_documents) for s in m.shards),
    )


class IncompatibleIndexesError(ValueError):
    """Indexes asked to answer as one that cannot: another tokenizer, vocabulary or token dtype."""


def index_paths(specs: str | Path | Iterable[str | Path]) -> list[Path]:
    """The index directories named by ``specs`` (one value or several, as ``--index`` flags): each
    an existing directory, taken whole, or a comma-separated list of them (empty items dropped)."""
    values = [specs] if isinstance(specs, (str, Path)) else list(specs)
    paths = []
    for value in values:
        if "," in str(value) and not Path(value).is_dir():
            paths.extend(Path(part.strip()) for part in str(value).split(",") if part.strip())
        elif str(value).strip():
            paths.append(Path(value))
    return paths


def union_manifest(paths: Sequence[Path], manifests: Sequence[fmt.Manifest]) -> fmt.Manifest:
    """The manifest of ``paths`` opened as one datastore: one index of every shard, in order, with
    each shard named by its directory (what ``info`` reports; no file holds it). Raises
    ``IncompatibleIndexesError`` naming two directories that differ, ``ValueError`` for one given twice."""
    first, base = paths[0], manifests[0]
    seen = {first.resolve(): first}
    for path, manifest in zip(paths[1:], manifests[1:]):
        if path.resolve() in seen:
            raise ValueError(f"index {path} is given twice (as {seen[path.resolve()]} and {path})")
        seen[path.resolve()] = path
        for what, ours, theirs in (
            ("tokenizer fingerprint", base.tokenizer.fingerprint, manifest.tokenizer.fingerprint),
            ("vocabulary size", base.tokenizer.vocab_size, manifest.tokenizer.vocab_size),
            ("token dtype", base.token_dtype, manifest.token_dtype),
            ("separator", base.separator, manifest.separator),
        ):
            if ours != theirs:
                raise IncompatibleIndexesError(
                    f"cannot open {first} and {path} as one datastore: their {what}s differ "
                    f"({str(ours)[:23]} vs {str(theirs)[:23]}; tokenizers {base.tokenizer.name!r} and "
                    f"{manifest.tokenizer.name!r})"
                )
    return dataclasses.replace(
        base,
        shards=tuple(
            dataclasses.replace(shard, name=f"{path}/{shard.name}")
            for path, manifest in zip(paths, manifests)
            for shard in manifest.shards
        ),
        corpus={"indexes": [{"path": str(path), "corpus": m.corpus} for path, m in zip(paths, manifests)]},
        build={},
    )


class RetrieverUnavailable(ConnectionError):
    """The retriever cannot answer now: a shard server behind a router is down, late or answered
    nonsense (UNAVAILABLE on the wire; retrying later may succeed)."""


class Retriever(Protocol):
    """What the datastore service (``datastore.server``) drafts from: an opened ``Datastore``, or a
    ``Router`` (``datastore.router``) that fans out to shard servers and merges their answers into
    the same trees."""

    @property
    def vocab_size(self) -> int: ...

    def info(self) -> IndexInfo: ...

    def warm_up(self) -> float:
        """Get ready to answer at full speed (compile kernels); returns the seconds it took."""
        ...

    def drafts(
        self, contexts: Iterable[np.ndarray], config: DraftConfig, timeout: float | None = None
    ) -> Iterator[DraftTree]:
        """The trees of ``contexts``, in order; the caller may stop asking at any one. ``timeout``:
        the seconds the client still waits (its deadline; None: none), which bounds what a retriever
        that calls other servers waits for them. Raises ``RetrieverUnavailable`` when the retriever
        cannot answer now."""
        ...


class Datastore:
    """An opened index, or some of its shards, or several indexes as one: answers draft trees for
    token contexts (over the shards it opened; a ``Retriever``), their shards' matches and rows.
    Thread-safe and read-only. ``paths``: its index directories (``path``, the first); ``manifest``:
    the index's, or for several their ``union_manifest``."""

    def __init__(
        self,
        path: Path,
        manifest: fmt.Manifest,
        shards: dict[int, _Shard],
        max_candidates: int,
        paths: tuple[Path, ...] | None = None,
    ) -> None:
        self.path = path
        self.paths = paths or (path,)
        self.manifest = manifest
        self._shards = shards  # manifest shard number -> shard, ascending
        self.max_candidates = max_candidates
        self._sep = manifest.separator
        self._token_dtype = np.dtype(manifest.token_dtype)
        self._closed = False

    @classmethod
    def open(
        cls,
        path: str | Path | Sequence[str | Path],
        *,
        verify: bool = False,
        check: bool = False,
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
        shards: Iterable[int] | None = None,
    ) -> Datastore:
        """Memory-map the index at ``path`` -- or the indexes at several paths as one (see the
        module docstring), their shards numbered on in order -- only the shards numbered
        ``shards`` if given (a shard server's part), checking manifests, file sizes, headers and
        spot digests. ``check`` adds the structural check of every array (``fmt.check_shard``,
        O(n)); ``verify`` hashes every file in full as well (slow on big indexes). Raises
        ``IndexFormatError`` (``IndexCorruptError`` for damaged content), ``ValueError`` for
        shard numbers the index does not have, ``IncompatibleIndexesError`` for indexes that
        cannot answer as one."""
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be positive, got {max_candidates}")
        paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
        if not paths:
            raise ValueError("no index directory given")
        manifests = [fmt.read_manifest(p) for p in paths]
        manifest = manifests[0] if len(paths) == 1 else union_manifest(paths, manifests)
        # global shard number -> (directory, its own manifest, its own entry)
        located = [(p, m, entry) for p, m in zip(paths, manifests) for entry in m.shards]
        numbers = range(len(located)) if shards is None else check_shard_numbers(shards, len(located))
        opened = {}
        for number in numbers:
            directory, own, entry = located[number]
            opened[number] = _Shard(
                *fmt.open_shard(directory, entry, own, full_check=verify, check=verify or check),
                # zeroed pages cost no memory until a first token's range is stored in them
                single_token_ranges=np.zeros(manifest.tokenizer.vocab_size, dtype=np.int64),
                tokens_path=directory / entry.files["tokens"].name,
                sa_path=directory / entry.files["sa"].name,
            )
        log.info(
            "opened %s: %d of %d shards, %d tokens",
            ", ".join(map(str, paths)),
            len(opened),
            len(manifest.shards),
            sum(manifest.shards[n].num_tokens for n in opened),
        )
        return cls(paths[0], manifest, opened, max_candidates, tuple(paths))

    def warm_up(self) -> float:
        """Compile (or load from numba's on-disk cache) every kernel a draft from this index uses,
        for its dtypes, and ``top_c_tree`` for the uint32 rows of the output store and the request
        matcher, so the first draft is as fast as any other; returns the seconds it took."""
        start = time.perf_counter()
        for shard in self._shards.values():
            _warm_up_shard(shard, self._sep, self.vocab_size)
        warm_up_top_c_tree(np.dtype("<u4"))
        return time.perf_counter() - start

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    @property
    def shard_numbers(self) -> tuple[int, ...]:
        """The manifest numbers of the opened shards, ascending."""
        return tuple(self._shards)

    def info(self) -> IndexInfo:
        return index_info(self.manifest)

    def documents(self) -> Iterator[np.ndarray]:
        """Every indexed document's tokens, in build order (for exports and engine comparisons)."""
        for shard in self._shards.values():
            seps = np.flatnonzero(shard.tokens == self._sep).tolist()
            for start, end in zip(seps[:-1], seps[1:]):
                yield shard.tokens[start + 1 : end]

    def match(self, query: np.ndarray, n_min: int = 1) -> list[ShardMatch]:
        """The opened shards' matches of ``query`` (from ``query_tokens``) at their longest length,
        if that is at least ``n_min`` (others can never be counted), in manifest order."""
        if self._closed:
            raise RuntimeError("datastore is closed")
        matches = []
        for number, shard in self._shards.items():
            ranges = shard.match_ranges(query)
            if len(ranges):
                lo, hi = ranges[-1].tolist()
                matches.append(ShardMatch(number, len(ranges), lo, hi - lo))
        return [m for m in longest_matches(matches) if m.match_len >= n_min]

    def rows(self, shard: int, ranks: np.ndarray, max_depth: int) -> np.ndarray:
        """[len(ranks), max_depth] token rows following the matches at ``ranks`` (int64, each a rank
        of the shard's suffix array: the caller checks) of shard ``shard``."""
        if self._closed:
            raise RuntimeError("datastore is closed")
        out = np.empty((ranks.size, max_depth), dtype=self._token_dtype)
        self._shards[shard].continuations(ranks, self._sep, self.vocab_size, out)
        return out

    def draft(self, context: Sequence[int] | np.ndarray, config: DraftConfig = DraftConfig()) -> DraftTree:
        """The draft tree continuing ``context`` (token ids; only the last ``n_max`` are used)."""
        return self.draft_batch([context], config)[0]

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig = DraftConfig()) -> list[DraftTree]:
        """The trees of ``contexts``, in order. One shard (an index built whole, or a shard
        server's part): one compiled pass over all of them. Several: the three steps per context."""
        return self._draft_parsed(*query_matrix(contexts, config.n_max, self.vocab_size), config)

    def draft_queries(self, queries: np.ndarray, lengths: np.ndarray, config: DraftConfig) -> list[DraftTree]:
        """``draft_batch`` of contexts already parsed: ``query_matrix(contexts, config.n_max,
        vocab_size)`` of this index's vocabulary (or of a smaller one), which a caller drafting the
        same contexts from several sources parses once; checked again, since they come from outside."""
        return self._draft_parsed(*checked_queries(queries, lengths, self.vocab_size), config)

    def _draft_parsed(self, queries: np.ndarray, lengths: np.ndarray, config: DraftConfig) -> list[DraftTree]:
        if self._closed:
            raise RuntimeError("datastore is closed")
        if len(self._shards) == 1:
            (shard,) = self._shards.values()
            return shard.draft_rows(queries, lengths, config, self.max_candidates, self._sep, self.vocab_size)
        return [self._planned_draft(query[:length], config) for query, length in zip(queries, lengths.tolist())]

    def _planned_draft(self, query: np.ndarray, config: DraftConfig) -> DraftTree:
        plan = plan_draft(self.match(query, config.n_min), query, config.n_min, self.max_candidates)
        if plan is None:
            return DraftTree.empty()
        rows = plan.rows(
            lambda match, ranks: self.rows(match.shard, ranks, config.max_depth), config.max_depth, self._token_dtype
        )
        return tree_from_rows(rows, self._sep, config.budget, plan)

    def drafts(
        self, contexts: Iterable[Sequence[int] | np.ndarray], config: DraftConfig, timeout: float | None = None
    ) -> Iterator[DraftTree]:
        """The trees of ``contexts`` one by one, each drafted only when asked for (a server stops
        asking once a reply is too large or its client is gone; ``timeout`` does not apply: a
        draft is local work, with no other server to wait for)."""
        for context in contexts:
            yield self.draft(context, config)

    def close(self) -> None:
        """Drop the memory maps (the OS unmaps once no array refers to them)."""
        self._closed = True
        self._shards = {}

    def __enter__(self) -> Datastore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warm_up_top_c_tree(dtype: np.dtype) -> None:
    """Compile ``top_c_tree`` for rows of ``dtype`` (trees of one node)."""
    sep = fmt.separator(dtype)
    top_c_tree(np.full((1, 1), sep, dtype), sep, 1)


def _warm_up_shard(shard: _Shard, sep: int, vocab_size: int) -> None:
    """Call every kernel a draft calls on ``shard``, through the same wrappers (so with the same
    argument types: numba compiles one specialization per type, read-only arrays included)."""
    shard.match_ranges(np.zeros(1, dtype=np.int64))  # token 0 is in every vocabulary
    shard.draft_rows(*query_matrix([[0]], 1, vocab_size), DraftConfig(n_min=1), 1, sep, vocab_size)
    sample(2, np.zeros(1, np.int64), 1)
    shard.continuations(np.zeros(0, dtype=np.int64), sep, vocab_size, np.empty((0, 1), shard.tokens.dtype))
    warm_up_top_c_tree(shard.tokens.dtype)


def compile_kernels() -> float:
    """Compile every specialization of the retrieval kernels and of the structural check that an
    index can need (tokens <u2 and <u4, suffix arrays <i4 and <i8; trie rows <u2 and <u4) on tiny
    read-only arrays like the memory maps, filling numba's on-disk cache (so a fresh install's
    first server start or build does not compile); returns the seconds it took."""
    start = time.perf_counter()
    for token_dtype, vocab_size in ((np.dtype("<u2"), 3), (np.dtype("<u4"), 0xFFFF)):
        sep = fmt.separator(token_dtype)
        tokens = np.array([sep, 0, 1, 2, sep], dtype=token_dtype)
        for sa_dtype in (np.dtype("<i4"), np.dtype("<i8")):
            sa = fmt.suffix_array(tokens).astype(sa_dtype)
            for array in (tokens, sa):
                array.setflags(write=False)
            fmt.shard_problem(tokens, sa, vocab_size, num_documents=1)
            shard = _Shard(
                tokens,
                sa,
                np.zeros(vocab_size, dtype=np.int64),
                tokens_path=Path("tiny.tokens.npy"),
                sa_path=Path("tiny.sa.npy"),
            )
            _warm_up_shard(shard, sep, vocab_size)
    return time.perf_counter() - start
