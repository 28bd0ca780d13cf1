"""The small typed values that cross module boundaries: draft trees and draft requests.

A draft tree is what a datastore answers and what a verifier consumes, whether it came from an
in-process index or over gRPC. Nodes are in BFS order (parents before children, siblings grouped
under their parent in ascending token order), so position ``i`` of every array describes node ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Request bounds shared by the engine, the service and the clients.
MAX_BUDGET = 1024
MAX_DEPTH = 64
MAX_SUFFIX = 64


@dataclass(frozen=True)
class DraftConfig:
    """How to draft: at most ``budget`` nodes, at most ``max_depth`` tokens deep, matching the
    longest context suffix between ``n_min`` and ``n_max`` tokens (REST: c=64, m=10, 2..16)."""

    budget: int = 64
    max_depth: int = 10
    n_max: int = 16
    n_min: int = 2

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that is out of range."""
        if not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in [1, {MAX_BUDGET}], got {self.budget}")
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth}")
        if not 1 <= self.n_min <= MAX_SUFFIX:
            raise ValueError(f"n_min must be in [1, {MAX_SUFFIX}], got {self.n_min}")
        if not self.n_min <= self.n_max <= MAX_SUFFIX:
            raise ValueError(f"n_max must be in [n_min={self.n_min}, {MAX_SUFFIX}], got {self.n_max}")


def _int_array(values, dtype) -> np.ndarray:
    array = np.ascontiguousarray(values, dtype=dtype)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A prefix-closed tree of draft tokens that continue a context.

    tokens   int32 [n]  token id of each node
    parents  int32 [n]  index of the parent node, -1 for a child of the root (the context itself)
    counts   int64 [n]  how many retrieved continuations start with the node's path
    match_len           length of the context suffix that was matched (0: no match, n == 0)
    num_matches         corpus positions that matched that suffix (over all shards)
    num_sampled         continuations actually counted; < num_matches when the match count was
                        over the engine's cap and a uniform random sample was taken
    """

    tokens: np.ndarray
    parents: np.ndarray
    counts: np.ndarray
    match_len: int = 0
    num_matches: int = 0
    num_sampled: int = 0
    depths: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tokens = _int_array(self.tokens, np.int32)
        parents = _int_array(self.parents, np.int32)
        counts = _int_array(self.counts, np.int64)
        n = tokens.shape[0]
        if tokens.ndim != 1 or parents.shape != (n,) or counts.shape != (n,):
            raise ValueError("tokens, parents and counts must be 1-D arrays of one length")
        if n and (np.any(parents >= np.arange(n)) or np.any(parents < -1)):
            raise ValueError("every parent must be -1 or an earlier node (BFS order)")
        # depth = 1 + depth(parent); iterating to the fixed point takes max-depth vectorized rounds
        depths = np.ones(n, dtype=np.int32)
        has_parent = parents >= 0
        while n:
            updated = np.where(has_parent, depths[parents] + 1, 1).astype(np.int32)
            if np.array_equal(updated, depths):
                break
            depths = updated
        depths.setflags(write=False)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "depths", depths)

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def scores(self) -> np.ndarray:
        """float64 [n]: the fraction of counted continuations that start with each node's path."""
        if self.num_sampled == 0:
            return np.zeros(len(self), dtype=np.float64)
        return self.counts / float(self.num_sampled)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0

    def paths(self) -> list[tuple[int, ...]]:
        """The token path from the root to each node (for tests and debugging)."""
        out: list[tuple[int, ...]] = []
        for i in range(len(self)):
            p = int(self.parents[i])
            out.append((out[p] if p >= 0 else ()) + (int(self.tokens[i]),))
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftTree):
            return NotImplemented
        return (
            np.array_equal(self.tokens, other.tokens)
            and np.array_equal(self.parents, other.parents)
            and np.array_equal(self.counts, other.counts)
            and (self.match_len, self.num_matches, self.num_sampled)
            == (other.match_len, other.num_matches, other.num_sampled)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class ShardInfo:
    name: str
    num_tokens: int
    num_documents: int


@dataclass(frozen=True)
class IndexInfo:
    """What a datastore says about itself (the ``Info`` RPC carries exactly this)."""

    format_version: int
    tokenizer_name: str
    tokenizer_fingerprint: str
    vocab_size: int
    num_tokens: int
    num_documents: int
    shards: tuple[ShardInfo, ...]
