"""The retrieval engine: longest-suffix exact match of a context, continuation candidates, draft tree.

``Datastore.open`` memory-maps every shard (nothing is read beyond a few header bytes and spot
digests), so opening a multi-GB index is instant and concurrent ``draft`` calls from many threads
share the page cache. A draft follows REST (NOTES section 1) with three corrections: matches never
cross a document and continuations stop at the document's end; when more positions match than
``max_candidates``, a uniform random sample (seeded by the query, so the same input always gives
the same tree) is counted instead of the lexicographically first ones; and the tree holds exactly
``min(budget, distinct prefixes)`` nodes with deterministic tie-breaking.

Search: each shard stores the suffix array of its *reversed* token array, so the positions where
the last ``j`` context tokens occur form one rank range, and matching one more token further back
narrows that range. One pass over at most ``n_max`` tokens finds the longest match in every shard.
"""

from __future__ import annotations

import logging
import zlib
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from datastore import format as fmt
from datastore.trie import top_c_tree
from datastore.types import DraftConfig, DraftTree, IndexInfo, ShardInfo

log = logging.getLogger(__name__)

DEFAULT_MAX_CANDIDATES = 4096
# Below this many ranks a narrowing step gathers all keys and uses np.searchsorted; above it,
# a scalar binary search touches only log2(range) entries of the memory map.
_GATHER_LIMIT = 1024


@dataclass(frozen=True)
class _Shard:
    """One memory-mapped shard: token array, suffix array of the reversed tokens, separators."""

    tokens: np.ndarray
    sa: np.ndarray
    doc_seps: np.ndarray

    def __post_init__(self) -> None:
        # memoryviews give Python ints at C speed for the scalar binary search
        object.__setattr__(self, "_tok", memoryview(self.tokens))
        object.__setattr__(self, "_sa", memoryview(self.sa))

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """Sub-range of ranks [lo, hi) whose reversed suffix has ``token`` at offset ``depth``.

        Within a range that shares its first ``depth`` tokens, the next tokens are sorted, so this
        is a binary search for ``token`` among ``R[sa[r] + depth]``, R = tokens[::-1]."""
        last = self.size - 1 - depth  # R[p + depth] == tokens[last - p]
        if hi - lo <= _GATHER_LIMIT:
            keys = self.tokens[last - self.sa[lo:hi]]
            return lo + int(np.searchsorted(keys, token, "left")), lo + int(np.searchsorted(keys, token, "right"))
        tok, sa = self._tok, self._sa
        key = lambda r: tok[last - sa[r]]  # noqa: E731
        return bisect_left(range(hi), token, lo, hi, key=key), bisect_right(range(hi), token, lo, hi, key=key)

    def match_ranges(self, query_reversed: Sequence[int]) -> list[tuple[int, int]]:
        """Rank ranges of the longest prefix of ``query_reversed`` (the context read backwards):
        element j is the range for the last j+1 context tokens, stopping before the first miss."""
        ranges = []
        lo, hi = 0, self.size
        for depth, token in enumerate(query_reversed):
            lo, hi = self.narrow(lo, hi, depth, token)
            if lo == hi:
                break
            ranges.append((lo, hi))
        return ranges

    def continuations(self, ranks: np.ndarray, length: int, sep: int) -> np.ndarray:
        """[len(ranks), length] tokens following each match, ``sep`` from the document end on."""
        starts = self.size - self.sa[ranks].astype(np.int64)  # first token after the match
        window = np.minimum(starts[:, None] + np.arange(length), self.size - 1)  # last token is a separator
        out = self.tokens[window]
        ended = np.maximum.accumulate(out == sep, axis=1)
        out[ended] = sep
        return out


class Datastore:
    """An opened index: answers draft trees for token contexts. Thread-safe and read-only."""

    def __init__(self, path: Path, manifest: fmt.Manifest, shards: list[_Shard], max_candidates: int) -> None:
        self.path = path
        self.manifest = manifest
        self._shards = shards
        self.max_candidates = max_candidates
        self._sep = manifest.separator
        self._closed = False

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = False, max_candidates: int = DEFAULT_MAX_CANDIDATES) -> "Datastore":
        """Memory-map the index at ``path``; ``verify`` hashes every file in full (slow on big
        indexes; the default checks sizes, dtypes and spot digests). Raises ``IndexFormatError``."""
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be positive, got {max_candidates}")
        path = Path(path)
        manifest = fmt.read_manifest(path)
        if not manifest.shards:
            raise fmt.IndexFormatError(f"index {path} has no shards")
        shards = [
            # plain ndarray views of the memory maps: np.memmap's subclass hooks cost more than the search
            _Shard(*(np.asarray(a) for a in fmt.open_shard(path, entry, manifest, full_check=verify)))
            for entry in manifest.shards
        ]
        log.info("opened %s: %d tokens in %d shards", path, manifest.num_tokens, len(shards))
        return cls(path, manifest, shards, max_candidates)

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    def info(self) -> IndexInfo:
        m = self.manifest
        return IndexInfo(
            format_version=m.format_version,
            tokenizer_name=m.tokenizer.name,
            tokenizer_fingerprint=m.tokenizer.fingerprint,
            vocab_size=m.tokenizer.vocab_size,
            num_tokens=m.num_tokens,
            num_documents=m.num_documents,
            shards=tuple(ShardInfo(s.name, s.num_tokens, s.num_documents) for s in m.shards),
        )

    def documents(self) -> Iterator[np.ndarray]:
        """Every indexed document's tokens, in build order (for exports and engine comparisons)."""
        for shard in self._shards:
            seps = shard.doc_seps.tolist()
            for start, end in zip(seps[:-1], seps[1:]):
                yield shard.tokens[start + 1 : end]

    def _query(self, context: Sequence[int] | np.ndarray, n_max: int) -> list[int]:
        ctx = np.asarray(context)
        if ctx.ndim != 1 or ctx.size == 0:
            raise ValueError("context must be a non-empty 1-D sequence of token ids")
        if not np.issubdtype(ctx.dtype, np.integer):
            raise ValueError(f"context must hold integer token ids, got {ctx.dtype}")
        if ctx.min() < 0 or ctx.max() >= self.vocab_size:
            bad = int(ctx[(ctx < 0) | (ctx >= self.vocab_size)][0])
            raise ValueError(f"context token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return [int(t) for t in ctx[: -n_max - 1 : -1]]  # last n_max tokens, newest first

    def draft(self, context: Sequence[int] | np.ndarray, config: DraftConfig = DraftConfig()) -> DraftTree:
        """The draft tree continuing ``context`` (token ids; only the last ``n_max`` are used)."""
        if self._closed:
            raise RuntimeError("datastore is closed")
        query = self._query(context, config.n_max)
        per_shard = [shard.match_ranges(query) for shard in self._shards]
        match_len = max(len(r) for r in per_shard)
        if match_len < config.n_min:
            return DraftTree.empty()
        hits = [(shard, r[match_len - 1]) for shard, r in zip(self._shards, per_shard) if len(r) == match_len]
        sizes = np.array([hi - lo for _, (lo, hi) in hits], dtype=np.int64)
        num_matches = int(sizes.sum())
        picked = self._sample(num_matches, query[:match_len])
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        blocks = []
        for i, (shard, (lo, _)) in enumerate(hits):
            ranks = picked[(picked >= offsets[i]) & (picked < offsets[i + 1])] - offsets[i] + lo
            blocks.append(shard.continuations(ranks, config.max_depth, self._sep))
        continuations = np.concatenate(blocks)
        tokens, parents, counts = top_c_tree(continuations, self._sep, config.budget)
        return DraftTree(tokens, parents, counts, match_len, num_matches, int(continuations.shape[0]))

    def _sample(self, num_matches: int, matched_reversed: list[int]) -> np.ndarray:
        """Indices into the concatenated match ranges to count: all of them, or a uniform sample
        of ``max_candidates`` seeded by the matched tokens (same query, same sample)."""
        if num_matches <= self.max_candidates:
            return np.arange(num_matches, dtype=np.int64)
        seed = zlib.crc32(np.asarray(matched_reversed, dtype=np.int64).tobytes())
        picked = np.random.default_rng(seed).choice(num_matches, self.max_candidates, replace=False)
        picked.sort()
        return picked

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig = DraftConfig()) -> list[DraftTree]:
        return [self.draft(context, config) for context in contexts]

    def close(self) -> None:
        """Drop the memory maps (the OS unmaps once no array refers to them)."""
        self._closed = True
        self._shards = []

    def __enter__(self) -> "Datastore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
