"""The small typed values that cross module boundaries: token ids, draft trees and draft requests.

A draft tree is what a datastore answers and what a verifier consumes, whether it came from an
in-process index or over gRPC. Nodes are in BFS order (parents before children, siblings grouped
under their parent in ascending token order), so position ``i`` of every array describes node ``i``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Request bounds shared by the engine, the service and the clients.
MAX_BUDGET = 1024
MAX_DEPTH = 64
MAX_SUFFIX = 64


def token_ids(
    values: Sequence[int] | np.ndarray, what: str, vocab_size: int | None = None, *, last: int | None = None
) -> np.ndarray:
    """``values`` -- only the ``last`` ones if given (a context's tail: a long Python list is not
    converted whole) -- as a 1-D integer array (its own dtype; may be empty), every id in
    [0, ``vocab_size``), or only >= 0 without a ``vocab_size``.

    The one check every entry point (index, output store, request matcher, wire, index writer)
    makes, so a bad id fails with the same ``ValueError`` everywhere, naming ``what`` and the
    id's position in it."""
    start = 0 if last is None else max(len(values) - last, 0)
    array = np.asarray(values[start:])
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {array.shape}")
    if array.size == 0:
        return array
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must hold integer token ids, got {array.dtype}")
    bad = np.flatnonzero((array < 0) if vocab_size is None else (array < 0) | (array >= vocab_size))
    if bad.size:
        i = int(bad[0])
        where = f"{what}[{start + i}] = {int(array[i])}"
        raise ValueError(
            f"{where} is negative" if vocab_size is None else f"{where} is outside the vocabulary [0, {vocab_size})"
        )
    return array


@dataclass(frozen=True)
class DraftConfig:
    """How to draft: at most ``budget`` nodes, at most ``max_depth`` tokens deep, matching the
    longest context suffix between ``n_min`` and ``n_max`` tokens (REST: c=64, m=10, 2..16)."""

    budget: int = 64
    max_depth: int = 10
    n_max: int = 16
    n_min: int = 2

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the first field that is out of range (frozen: checked once)."""
        if not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in [1, {MAX_BUDGET}], got {self.budget}")
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth}")
        if not 1 <= self.n_min <= MAX_SUFFIX:
            raise ValueError(f"n_min must be in [1, {MAX_SUFFIX}], got {self.n_min}")
        if not self.n_min <= self.n_max <= MAX_SUFFIX:
            raise ValueError(f"n_max must be in [n_min={self.n_min}, {MAX_SUFFIX}], got {self.n_max}")


# What a request's unset fields and the command lines' omitted flags mean.
DEFAULT_CONFIG = DraftConfig()


def frozen_array(values, dtype) -> np.ndarray:
    """``values`` as a contiguous read-only array of ``dtype``: trees are immutable once built."""
    array = np.ascontiguousarray(values, dtype=dtype)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A prefix-closed tree of draft tokens that continue a context.

    tokens        int32 [n]  token id of each node
    parents       int32 [n]  index of the parent node, -1 for a child of the root (the context itself)
    counts        int64 [n]  how many retrieved continuations start with the node's path
    match_len                length of the context suffix that was matched (0: no match, n == 0)
    num_matches              corpus positions that matched that suffix (over all shards)
    num_sampled              continuations actually counted; < num_matches when the match count was
                             over the engine's cap and a uniform random sample was taken
    scores        float64 [n]  estimated probability that the verifier accepts the node's whole
                             path; None (the default) derives it as counts / num_sampled. Explicit
                             scores (merged trees) must lie in [0, 1] and never grow down a path,
                             so the top-k nodes by score always form a tree.

    This is what crosses the wire. A drafter's own per-node data (``drafter.core.merge.MergedTree``'s
    per-source columns) lives in subclasses, which ``subset`` and ``after`` preserve through
    ``_take``.
    """

    tokens: np.ndarray
    parents: np.ndarray
    counts: np.ndarray
    match_len: int = 0
    num_matches: int = 0
    num_sampled: int = 0
    scores: np.ndarray | None = None
    depths: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tokens = frozen_array(self.tokens, np.int32)
        parents = frozen_array(self.parents, np.int32)
        counts = frozen_array(self.counts, np.int64)
        n = tokens.shape[0]
        if tokens.ndim != 1 or parents.shape != (n,) or counts.shape != (n,):
            raise ValueError("tokens, parents and counts must be 1-D arrays of one length")
        if n and (np.any(parents >= np.arange(n)) or np.any(parents < -1)):
            raise ValueError("every parent must be -1 or an earlier node (BFS order)")
        # depth = 1 + depth(parent), by pointer doubling: every round adds the depth gathered so
        # far at each node's current ancestor and jumps to that ancestor's, so log2(max depth)
        # vectorized rounds suffice (trees are rebuilt every decoding step)
        depths = np.ones(n, dtype=np.int32)
        jump = parents.astype(np.int64)
        climbing = np.flatnonzero(jump >= 0)
        while climbing.size:
            ancestor = jump[climbing]
            depths[climbing] += depths[ancestor]
            jump[climbing] = jump[ancestor]
            climbing = climbing[jump[climbing] >= 0]
        depths.setflags(write=False)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "scores", self._checked_scores())

    def _checked_scores(self) -> np.ndarray:
        """The explicit scores, validated, or counts / num_sampled (all 0 when nothing was sampled)."""
        n = len(self)
        if self.scores is None:
            derived = self.counts / float(self.num_sampled) if self.num_sampled else np.zeros(n)
            return frozen_array(derived, np.float64)
        scores = frozen_array(self.scores, np.float64)
        if scores.shape != (n,):
            raise ValueError(f"scores must be a 1-D array of the {n} node scores, got shape {scores.shape}")
        if not np.all((scores >= 0) & (scores <= 1)):  # False for NaN as well
            raise ValueError("scores must lie in [0, 1]")
        has_parent = self.parents >= 0
        if np.any(scores[has_parent] > scores[self.parents[has_parent]]):
            raise ValueError("a node's score must not exceed its parent's")
        return scores

    @classmethod
    def empty(cls) -> DraftTree:
        """The tree of no nodes ("no match"): one shared instance (trees are immutable), since
        sources answer it on most steps and building a tree costs tens of microseconds."""
        return _EMPTY_TREE

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @functools.cached_property
    def max_depth(self) -> int:
        """The deepest node's depth (0 for no nodes); a batch that builds trees may set it."""
        return int(self.depths.max()) if len(self) else 0

    def is_chain(self) -> bool:
        """Whether every node is the previous node's only child (BFS order makes that ``parents ==
        [-1, 0, 1, ...]``): such a tree is verified on the model's plain causal path."""
        return bool(np.array_equal(self.parents, np.arange(-1, len(self) - 1)))

    def _take(self, keep: np.ndarray, parents: np.ndarray, depths: np.ndarray, **fields) -> DraftTree:
        """A tree of this one's nodes ``keep`` under new ``parents`` at ``depths``, with ``fields``
        (match statistics, scores); a subclass carries its own per-node columns along.

        Not checked again: ``subset`` and ``after`` derive a valid tree from this valid one (BFS
        order, parents and monotone scores are kept), and they run several times per row and
        step, where the checks would cost as much as the rest of the drafting."""
        return self._derived(
            tokens=self.tokens[keep], parents=parents, counts=self.counts[keep], depths=depths, **fields
        )

    def _same_match(self, keep: np.ndarray, parents: np.ndarray, depths: np.ndarray, scores: np.ndarray) -> DraftTree:
        """``_take`` of nodes of this tree drafted from the same match: its match statistics kept."""
        return self._take(
            keep,
            parents,
            depths,
            match_len=self.match_len,
            num_matches=self.num_matches,
            num_sampled=self.num_sampled,
            scores=scores,
        )

    @classmethod
    def counted_batch(
        cls,
        tokens: np.ndarray,
        parents: np.ndarray,
        counts: np.ndarray,
        depths: np.ndarray,
        scores: np.ndarray,
        offsets: Sequence[int],
        stats: Sequence[Sequence[int]],
    ) -> list[DraftTree]:
        """The trees a trie kernel built (``datastore.trie``: int32 tokens, parents and depths, int64
        counts, float64 scores = counts / num_sampled, BFS order by construction), laid end to end:
        tree i is nodes ``offsets[i]:offsets[i + 1]`` with ``stats[i]`` = (match_len, num_matches,
        num_sampled), the empty tree where nothing was sampled. Without the checks: they cost as
        much as drafting the tree, and every source drafts one every step. The trees are views of
        the five arrays, frozen once, not per tree (a batch kernel answers every row of a step)."""
        end = offsets[-1]
        tokens, parents, counts, depths, scores = tokens[:end], parents[:end], counts[:end], depths[:end], scores[:end]
        for array in (tokens, parents, counts, depths, scores):
            array.setflags(write=False)
        trees = []
        for start, stop, (match_len, num_matches, num_sampled) in zip(offsets[:-1], offsets[1:], stats):
            if not num_sampled:
                trees.append(_EMPTY_TREE)
                continue
            tree = cls._frozen_view(
                tokens=tokens[start:stop],
                parents=parents[start:stop],
                counts=counts[start:stop],
                depths=depths[start:stop],
                match_len=match_len,
                num_matches=num_matches,
                num_sampled=num_sampled,
                scores=scores[start:stop],
            )
            trees.append(tree)
        return trees

    @classmethod
    def _frozen_view(cls, **values) -> DraftTree:
        """``_derived`` for arrays that are views of arrays frozen once already (a batch kernel's
        buffers, set read-only once per step): nothing set per array of every tree."""
        tree = object.__new__(cls)
        tree.__dict__.update(values)
        return tree

    @classmethod
    def _derived(cls, **values) -> DraftTree:
        """An instance of ``cls`` holding ``values`` (every field, arrays of the field's dtype)
        without ``__post_init__``'s checks: only for parts of a tree already checked."""
        tree = object.__new__(cls)
        for name, value in values.items():
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
            object.__setattr__(tree, name, value)
        return tree

    def subset(self, keep: np.ndarray) -> DraftTree:
        """The tree of nodes ``keep`` (ascending indices; every kept node's parent kept too), with
        their counts and scores (and a subclass's columns); the match statistics are unchanged."""
        keep = np.asarray(keep, dtype=np.int64)
        if keep.ndim != 1 or np.any(np.diff(keep) <= 0) or (keep.size and not 0 <= keep[0] <= keep[-1] < len(self)):
            raise ValueError(f"keep must be ascending distinct node indices in [0, {len(self)})")
        new_index = np.full(len(self) + 1, -1, dtype=np.int64)  # slot -1 (the root) stays -1
        new_index[keep] = np.arange(keep.size)
        old_parents = self.parents[keep]
        parents = new_index[old_parents]
        if np.any((old_parents >= 0) & (parents < 0)):
            raise ValueError("keep is not prefix-closed: a kept node's parent is dropped")
        return self._same_match(keep, parents.astype(np.int32), self.depths[keep], self.scores[keep])

    def after(self, token: int) -> DraftTree | None:
        """The tree for the context extended by ``token``: the subtree under the root child
        ``token``, re-rooted, its scores conditioned on that child (divided by its score), the
        match one token longer; None when no root child is ``token``. A tree drafted one token
        ahead of a context this way equals, on the index, the tree drafted after the token
        whenever the longer match exists -- what ``drafter.core.scheduler`` prepares during a forward."""
        child = np.flatnonzero((self.parents == -1) & (self.tokens == token))
        if child.size == 0:
            return None
        top = int(child[0])
        inside = np.zeros(len(self) + 1, dtype=bool)  # slot -1: the root, never inside
        inside[top] = True
        depths = self.depths
        for depth in range(2, self.max_depth + 1):  # one vectorized step per level
            level = np.flatnonzero(depths == depth)
            inside[level] = inside[self.parents[level]]
        keep = np.flatnonzero(inside[:-1])[1:]  # below ``top``, BFS order kept
        new_index = np.full(len(self) + 1, -1, dtype=np.int64)
        new_index[keep] = np.arange(keep.size)
        parents = np.where(self.parents[keep] == top, -1, new_index[self.parents[keep]])
        top_score = float(self.scores[top])
        scores = self.scores[keep] / top_score if top_score > 0 else np.zeros(keep.size)
        return self._take(
            keep,
            parents.astype(np.int32),
            depths[keep] - 1,
            match_len=self.match_len + 1 if self.match_len else 0,
            num_matches=int(self.counts[top]),
            num_sampled=int(self.counts[top]),
            scores=np.minimum(scores, 1.0).astype(np.float64),
        )

    def path_to(self, node: int) -> np.ndarray:
        """int64 [depth]: the nodes from the root's child down to ``node``, in order."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(int(self.parents[path[-1]]))
        return np.array(path[::-1], dtype=np.int64)

    def chain_to(self, node: int) -> DraftTree:
        """The chain of the nodes from the root's child down to ``node``, with their counts and
        scores (and a subclass's columns): ``subset(path_to(node))`` without its checks, which a
        root path passes by construction."""
        path = self.path_to(node)
        return self._same_match(
            path,
            np.arange(-1, path.size - 1, dtype=np.int32),
            np.arange(1, path.size + 1, dtype=np.int32),
            self.scores[path],
        )

    def first(self, n: int) -> DraftTree:
        """The tree of the first ``n`` nodes: ``subset(arange(n))`` without its checks, which BFS
        order passes by construction (every node's parent comes before it); a chain's prefix."""
        if n >= len(self):
            return self
        keep = np.arange(max(n, 0))
        return self._same_match(keep, self.parents[: keep.size], self.depths[: keep.size], self.scores[: keep.size])

    def rescored(self, scores: np.ndarray) -> DraftTree:
        """This tree with ``scores`` (float64 [n], in [0, 1], never growing down a path: the
        caller's to keep, as a calibration's running products are) in place of its own."""
        scores = np.asarray(scores, np.float64)
        if scores.shape != self.scores.shape:
            raise ValueError(f"scores must be [{len(self)}], got shape {scores.shape}")
        keep = np.arange(len(self))
        return self._same_match(keep, self.parents, self.depths, scores)

    def accepted_nodes(self, appended: Sequence[int]) -> np.ndarray:
        """int64 [k]: the nodes on the longest path from the root that ``appended`` (the tokens
        committed since this tree was drafted) follows, root first: the nodes the verifier
        accepted. The token after them, the verifier's own, matches no child by construction.

        One pass in BFS order: a node's children come after it, so the path's next node is the
        first later node under the current one with the next token (every row, every step: a scan
        of the whole tree per token cost five times as much)."""
        want = appended.tolist() if isinstance(appended, np.ndarray) else list(appended)
        path: list[int] = []
        node = -1
        if want:
            for i, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
                if parent == node and token == want[len(path)]:
                    path.append(i)
                    node = i
                    if len(path) == len(want):
                        break
        return np.array(path, dtype=np.int64)

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
            and np.array_equal(self.scores, other.scores)
        )

    __hash__ = None  # type: ignore[assignment]


_EMPTY_TREE = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64))


@dataclass(frozen=True)
class SourceTrees:
    """One context's trees from a datastore's shared sources, answered together (one RPC per
    step): the static ``index`` and the store of recent ``outputs`` (empty when it keeps none)."""

    index: DraftTree
    outputs: DraftTree


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
