"""One draft tree from several sources, each node scored by its estimated acceptance probability.

Every source (the static index, the request itself, past outputs) answers its own tree. Under a
source, a node's probability is the product along its path of child count / parent count (=
count / root count; SuffixDecoding), and the expected number of tokens a tree yields is the sum
of its nodes' path probabilities (Sequoia) -- so nodes are selected by that score, and
``drafter.core.selection.select_tree`` sizes the tree from it.

Sources are not equally trustworthy, and neither is every ratio: a suffix that occurred once
claims certainty it has not earned (on held-out chat text, index nodes with ratio 1 from a single
occurrence are accepted far less often than those near 1 from many occurrences). Each
source therefore has a weight per *sample class* -- the parent count c(parent) in powers of two:
1, 2-3, 4-7, ... -- learned by ``SourceCalibration`` from the acceptance actually observed, that
scales its per-token probability: node i under source s gets
P_s(i) = prod over the path of min(1, w_s[class(c(parent))] * c(node) / c(parent)). The weight
is per token, not per node, because acceptance is a sequence of per-token trials: a source that
is overconfident is overconfident at every depth, and the product captures the decay with depth
that one factor per node cannot. It is also per class of the match the token continues (the
source's match plus the path above it: a node d deep under a 2-token match continues a match of
d + 1), so a branch that has held for a few tokens is trusted as a longer match is.

Sources combine by noisy-OR, p = 1 - prod_s (1 - P_s):
- a node only one source proposes keeps exactly that source's probability (so a one-source merge
  is that source's tree, and the request's own identifiers, which no index holds, are not
  diluted as a weighted average would dilute them);
- agreement counts: a node several sources propose scores above each of them (``max`` ignores it);
- it stays in [0, 1] and grows with each P_s, so scores never increase down a path and the top-k
  nodes by score form a tree.
It overestimates when sources saw the same text (an output also in the index); that only
misranks a few nodes and never changes the output, which verification keeps exact.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rest_spec.common.cache import numba_cached
from rest_spec.common.types import DraftTree, frozen_array

numba = numba_cached()


@dataclass(frozen=True, eq=False)
class MergedTree(DraftTree):
    """A tree merged from S sources (``merge_trees``) with what the calibration learns from, kept
    through ``subset`` and ``after``; never sent anywhere.

    source_probs   float64 [n, S]: each source's own probability of the node given its parent
                   (0 where that source did not propose it)
    source_samples int64 [n, S]: how many continuations each of those rests on (the source's
                   count of the node's parent; 0 where it did not propose the node). One
                   occurrence claiming certainty is worth less than a hundred agreeing: the
                   calibration weighs sources per sample-size class.
    source_match_len int64 [S]: the length of the context suffix each source's tree was drafted
                   from (0: it matched nothing); what ``Attribution`` reports acceptance by
    """

    source_probs: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)), repr=False)
    source_samples: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int64), repr=False)
    source_match_len: np.ndarray | None = field(default=None, repr=False)  # None: zeros

    def __post_init__(self) -> None:
        super().__post_init__()
        probs = frozen_array(self.source_probs, np.float64)
        samples = frozen_array(self.source_samples, np.int64)
        if probs.ndim != 2 or probs.shape[0] != len(self):
            raise ValueError(f"source_probs must be [n={len(self)}, sources], got shape {probs.shape}")
        if not np.all((probs >= 0) & (probs <= 1)):
            raise ValueError("source_probs must lie in [0, 1]")
        if samples.shape != probs.shape:
            raise ValueError("source_samples must have source_probs' [n, sources] shape")
        if np.any(samples < 0):
            raise ValueError("source_samples must be non-negative")
        match_len = frozen_array(
            np.zeros(probs.shape[1], np.int64) if self.source_match_len is None else self.source_match_len, np.int64
        )
        if match_len.shape != (probs.shape[1],) or np.any(match_len < 0):
            raise ValueError(
                f"source_match_len must be {probs.shape[1]} non-negative lengths, got {match_len.tolist()}"
            )
        object.__setattr__(self, "source_probs", probs)
        object.__setattr__(self, "source_samples", samples)
        object.__setattr__(self, "source_match_len", match_len)

    def _take(self, keep: np.ndarray, parents: np.ndarray, depths: np.ndarray, **fields) -> MergedTree:
        return self._derived(
            tokens=self.tokens[keep],
            parents=parents,
            counts=self.counts[keep],
            depths=depths,
            **fields,
            source_probs=self.source_probs[keep],
            source_samples=self.source_samples[keep],
            source_match_len=self.source_match_len,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftTree):
            return NotImplemented
        return (
            isinstance(other, MergedTree)
            and super().__eq__(other)
            and np.array_equal(self.source_probs, other.source_probs)
            and np.array_equal(self.source_samples, other.source_samples)
            and np.array_equal(self.source_match_len, other.source_match_len)
        )

    __hash__ = None  # type: ignore[assignment]


@numba.vectorize(["int64(int64, int64)"], nopython=True, cache=True)
def sample_class(samples, classes):
    """The sample class of a parent count (>= 1): floor(log2), capped at ``classes - 1``
    (1 -> 0, 2-3 -> 1, 4-7 -> 2, ...). A ufunc: elementwise on arrays, and callable from the
    merge kernel."""
    return min(int(np.floor(np.log2(max(samples, 1)))), classes - 1)


def merge_trees(trees: Sequence[DraftTree], weights: Sequence[float] | np.ndarray, budget: int) -> MergedTree:
    """The ``budget`` best-scored nodes of the union of ``trees`` (one per source), in BFS order.

    weights  float [S], [S, K] or [S, D, K], >= 0: each source's per-token calibration, per sample
             class when 2-D (``SourceCalibration.weights``; ``sample_class``), and per depth when
             3-D (level d for nodes d + 1 deep, the last for any deeper; ``weights_for(...,
             depths)``); [S] is one class
    returns  a ``MergedTree`` whose ``scores`` are the noisy-OR of the weighted per-source path probabilities
             (see module docstring), ``source_probs`` [n, S] the sources' own conditional
             probabilities and ``source_samples`` [n, S] the parent counts behind them, ``counts``
             the summed counts, ``num_matches`` / ``num_sampled`` the sums and ``match_len`` the
             longest match. Ties go to the earlier BFS node.

    It runs every decoding step, so the work is one compiled pass (``_merge``), not a numpy
    call per tree level.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if not trees:
        raise ValueError("merge_trees needs at least one source tree")
    if weights.ndim == 1:
        weights = weights[:, None]
    if weights.ndim == 2:
        weights = weights[:, None, :]
    if weights.ndim != 3 or weights.shape[0] != len(trees) or weights.shape[1] < 1 or weights.shape[2] < 1:
        raise ValueError(
            f"weights must hold one weight (or one per sample class, or per depth and class) per source ({len(trees)}), "
            f"got shape {weights.shape}"
        )
    if not np.all(weights >= 0) or not np.all(np.isfinite(weights)):
        raise ValueError(f"weights must be finite and non-negative, got {weights.tolist()}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    tokens, parents, counts, scores, source_probs, source_samples, depths = _merge(
        np.concatenate([t.tokens for t in trees]),
        np.concatenate([t.parents for t in trees]),
        np.concatenate([t.counts for t in trees]),
        np.concatenate([t.scores for t in trees]),
        np.array([len(t) for t in trees], dtype=np.int64),
        np.array([t.num_sampled for t in trees], dtype=np.int64),
        weights,
        budget,
    )
    # built as the kernel laid it out (BFS order, monotone scores, depths): not checked again, as
    # ``DraftTree.counted_batch`` -- the checks would cost a third of the merge, every row and step
    return MergedTree._derived(
        tokens=tokens,
        parents=parents,
        counts=counts,
        depths=depths,
        match_len=max(t.match_len for t in trees),
        num_matches=sum(t.num_matches for t in trees),
        num_sampled=sum(t.num_sampled for t in trees),
        scores=scores,
        source_probs=source_probs,
        source_samples=source_samples,
        source_match_len=np.array([t.match_len for t in trees], dtype=np.int64),
    )


@numba.njit(nogil=True, cache=True)
def _merge(tokens, parents, counts, scores, sizes, num_sampled, weights, budget):
    """The merge on the sources' nodes concatenated (each source in BFS order, ``parents``
    local to its source): (tokens int32, parents int32, counts int64, scores float64,
    source_probs float64 [n, S], source_samples int64 [n, S], depths int32) of the kept nodes in
    BFS order."""
    n, num_sources, levels, classes = tokens.shape[0], weights.shape[0], weights.shape[1], weights.shape[2]
    root = n  # the slot of the root in ``first_child``

    # 1. The union trie, nodes numbered as first seen. A source lists parents before children,
    #    so a node's parent is always placed before the node itself.
    merged = np.empty(n, np.int64)  # source node -> trie node
    source = np.empty(n, np.int64)
    cond = np.empty(n, np.float64)  # the node's probability given its parent, under its source
    samples = np.empty(n, np.int64)  # the parent's count under its source
    node_token = np.empty(n, np.int64)
    node_parent = np.empty(n, np.int64)
    first_child = np.full(n + 1, -1, np.int64)
    next_sibling = np.full(n, -1, np.int64)
    m = 0
    offset = 0
    for s in range(num_sources):
        for i in range(offset, offset + sizes[s]):
            source[i] = s
            local = parents[i]
            parent_score = scores[local + offset] if local >= 0 else 1.0
            samples[i] = counts[local + offset] if local >= 0 else num_sampled[s]
            cond[i] = scores[i] / parent_score if parent_score > 0 else 0.0
            if cond[i] > 1 + 1e-9:
                raise ValueError("a node's score exceeds its parent's: not a tree of counts or acceptance estimates")
            up = merged[local + offset] if local >= 0 else root
            child = first_child[up]
            while child != -1 and node_token[child] != tokens[i]:
                child = next_sibling[child]
            if child == -1:
                child = m
                m += 1
                node_token[child] = tokens[i]
                node_parent[child] = up if up != root else -1
                next_sibling[child] = first_child[up]
                first_child[up] = child
            merged[i] = child
        offset += sizes[s]

    # 2. BFS order, siblings by ascending token.
    order = np.empty(m, np.int64)  # BFS index -> trie node
    siblings = np.empty(m, np.int64)
    head, tail, node = 0, 0, root
    while True:
        k = 0
        child = first_child[node]
        while child != -1:
            siblings[k] = child
            k += 1
            child = next_sibling[child]
        if k > 0:
            group = siblings[:k]
            order[tail : tail + k] = group[np.argsort(node_token[group])]
            tail += k
        if head == tail:
            break
        node = order[head]
        head += 1
    bfs = np.empty(m, np.int64)  # trie node -> BFS index
    bfs[order] = np.arange(m)

    # 3. Per node: counts summed, each source's conditional probability, the noisy-OR score of
    #    the weighted per-source path probabilities (parents come first in BFS order).
    bfs_parent = np.full(m, -1, np.int64)
    for b in range(m):
        if node_parent[order[b]] >= 0:
            bfs_parent[b] = bfs[node_parent[order[b]]]
    node_counts = np.zeros(m, np.int64)
    probs = np.zeros((m, num_sources), np.float64)
    node_samples = np.zeros((m, num_sources), np.int64)
    for i in range(n):  # a source proposes each path once (its tree is a trie)
        b = bfs[merged[i]]
        node_counts[b] += counts[i]
        probs[b, source[i]] = min(cond[i], 1.0)
        node_samples[b, source[i]] = samples[i]
    path = np.empty((m, num_sources), np.float64)
    node_scores = np.empty(m, np.float64)
    node_depth = np.empty(m, np.int64)
    for b in range(m):
        up = bfs_parent[b]
        node_depth[b] = node_depth[up] + 1 if up >= 0 else 1
        level = min(node_depth[b], levels) - 1
        miss = 1.0
        for s in range(num_sources):
            p = min(1.0, weights[s, level, sample_class(node_samples[b, s], classes)] * probs[b, s])
            if up >= 0:
                p *= path[up, s]
            path[b, s] = p
            miss *= 1.0 - p
        # exact in theory; the minimum keeps rounding from breaking monotonicity
        node_scores[b] = min(1.0 - miss, node_scores[up]) if up >= 0 else 1.0 - miss

    # 4. The best ``budget`` nodes. A parent scores at least its child and precedes it in BFS
    #    order, so a stable sort ranks it first and the kept set is prefix-closed.
    if m <= budget:
        keep = np.arange(m)
    else:
        keep = np.sort(np.argsort(-node_scores, kind="mergesort")[:budget])
    new_index = np.full(m, -1, np.int64)
    new_index[keep] = np.arange(keep.shape[0])
    out_parents = np.empty(keep.shape[0], np.int32)
    out_tokens = np.empty(keep.shape[0], np.int32)
    for j in range(keep.shape[0]):
        up = bfs_parent[keep[j]]
        out_parents[j] = new_index[up] if up >= 0 else -1
        out_tokens[j] = node_token[order[keep[j]]]
    out_depths = node_depth[keep].astype(np.int32)
    return out_tokens, out_parents, node_counts[keep], node_scores[keep], probs[keep], node_samples[keep], out_depths


def compile_kernels() -> float:
    """Compile ``merge_trees``'s kernel and the counting's for the arrays the drafters pass them
    (source trees as ``DraftTree`` holds them, a calibration's weights for their match lengths, the
    merged tree counted), filling numba's on-disk cache, so an adaptive drafter's first step on a
    fresh install does not spend seconds compiling; returns the seconds it took."""
    start = time.perf_counter()
    tree = DraftTree(np.array([5], np.int32), np.array([-1], np.int32), np.array([1], np.int64), 1, 1, 1)
    merged = merge_trees([tree, DraftTree.empty()], SourceCalibration(2).weights_for([1, 0]), 1)
    SourceCalibration(2).observe(merged, [0])
    attribution = Attribution(["a", "b"])
    attribution.observe(merged, [0])
    attribution.observe_hindsight(merged, [5], 1)
    return time.perf_counter() - start


MATCH_LENGTH_EDGES = (1, 2, 3, 4, 6, 8, 12, 16)  # the first length of each match-length class


def length_class(match_len: np.ndarray | Sequence[int], edges: Sequence[int] = MATCH_LENGTH_EDGES) -> np.ndarray:
    """The class of each match length among ``edges`` (0 and 1 share the first)."""
    return np.searchsorted(edges, np.maximum(np.asarray(match_len, dtype=np.int64), 1), side="right") - 1


_MATCH_LENGTH_EDGES = np.asarray(MATCH_LENGTH_EDGES, dtype=np.int64)  # as the counting kernels read them


@numba.njit(nogil=True, cache=True)
def _length_class(match_len, edges):
    """``length_class`` of one length, in a kernel."""
    length, found = max(match_len, 1), 0
    for j in range(1, edges.shape[0]):
        if length < edges[j]:
            break
        found = j
    return found


@numba.njit(nogil=True, cache=True)
def _followed_paths(tokens, parents, offsets, followed, followed_offsets):
    """``DraftTree.accepted_nodes`` of each tree (nodes ``offsets[t]:offsets[t + 1]``, ``parents``
    local) along its tokens ``followed[followed_offsets[t]:followed_offsets[t + 1]]``: the paths'
    nodes (local indices) concatenated, and their counts per tree."""
    trees = offsets.shape[0] - 1
    counts = np.zeros(trees, np.int64)
    path = np.empty(offsets[-1], np.int64)
    size = 0
    for t in range(trees):
        want, stop = followed_offsets[t], followed_offsets[t + 1]
        node = -1
        for i in range(offsets[t], offsets[t + 1]):
            if want == stop:
                break
            if parents[i] == node and tokens[i] == followed[want]:
                node = i - offsets[t]
                path[size] = node
                size += 1
                want += 1
        counts[t] = want - followed_offsets[t]
    return path[:size], counts


@numba.njit(nogil=True, cache=True)
def _reached(parents, offsets, accepted, accepted_offsets):
    """Per node of the trees: whether it is accepted, and whether it was tried (its parent reached:
    accepted, or the root)."""
    is_accepted = np.zeros(parents.shape[0], np.bool_)
    tried = np.zeros(parents.shape[0], np.bool_)
    for t in range(offsets.shape[0] - 1):
        for a in range(accepted_offsets[t], accepted_offsets[t + 1]):
            is_accepted[offsets[t] + accepted[a]] = True
        for i in range(offsets[t], offsets[t + 1]):
            tried[i] = parents[i] < 0 or is_accepted[offsets[t] + parents[i]]
    return is_accepted, tried


@numba.njit(nogil=True, cache=True)
def _calibrate(
    parents, depths, probs, samples, offsets, match_len, accepted, accepted_offsets, edges, decay, observed, predicted
):
    """``SourceCalibration.observe_nodes``' new (observed, predicted): every tried node's (source,
    match-length class, sample class) cell gains, decayed by the trees after its own, whether it was
    accepted (``observed``) and its source's probability (``predicted``); what came before decays by
    all. A node d deep continues its source's match by the d - 1 tokens above it."""
    trees, num_sources = offsets.shape[0] - 1, probs.shape[1]
    classes = observed.shape[2]
    is_accepted, tried = _reached(parents, offsets, accepted, accepted_offsets)
    gained_observed, gained_predicted = np.zeros(observed.shape), np.zeros(predicted.shape)
    for t in range(trees):
        age = decay ** float(trees - 1 - t)
        for i in range(offsets[t], offsets[t + 1]):
            if not tried[i]:
                continue
            for s in range(num_sources):
                if probs[i, s] > 0:
                    length = _length_class(match_len[t, s] + depths[i] - 1, edges)
                    sample = sample_class(samples[i, s], classes)
                    gained_observed[s, length, sample] += (1.0 if is_accepted[i] else 0.0) * age
                    gained_predicted[s, length, sample] += probs[i, s] * age
    kept = decay ** float(trees)
    return kept * observed + gained_observed, kept * predicted + gained_predicted


@numba.njit(nogil=True, cache=True)
def _count_cells(counts, parents, probs, offsets, match_len, edges, values):
    """Add ``values`` [V, trees, S] to the ``counts`` stack [V, S, L], in each tree's (source,
    match-length class) cell, for the sources that proposed a root child of it."""
    for t in range(offsets.shape[0] - 1):
        for s in range(probs.shape[1]):
            first = False
            for i in range(offsets[t], offsets[t + 1]):
                if parents[i] < 0 and probs[i, s] > 0:
                    first = True
                    break
            if first:
                length = _length_class(match_len[t, s], edges)
                for v in range(values.shape[0]):
                    counts[v, s, length] += values[v, t, s]


@numba.njit(nogil=True, cache=True)
def _attribute(counts, parents, probs, offsets, match_len, accepted, accepted_offsets, edges):
    """``Attribution.observe_nodes``: per tree and source, (1, whether the first accepted node was
    the source's, accepted nodes it proposed, nodes it proposed), counted."""
    trees, num_sources = offsets.shape[0] - 1, probs.shape[1]
    values = np.zeros((4, trees, num_sources), np.int64)
    for t in range(trees):
        for s in range(num_sources):
            values[0, t, s] = 1
            for a in range(accepted_offsets[t], accepted_offsets[t + 1]):
                if probs[offsets[t] + accepted[a], s] > 0:
                    values[2, t, s] += 1
                    if a == accepted_offsets[t]:
                        values[1, t, s] = 1
            for i in range(offsets[t], offsets[t + 1]):
                if probs[i, s] > 0:
                    values[3, t, s] += 1
    _count_cells(counts, parents, probs, offsets, match_len, edges, values)


@numba.njit(nogil=True, cache=True)
def _attribute_hindsight(counts, parents, probs, offsets, match_len, accepted, accepted_offsets, verified, edges):
    """``Attribution.observe_hindsight_nodes``: per tree and source, (1, how far along the path
    from the root the source proposed every node, whether that beats the ``verified`` tokens),
    counted."""
    trees, num_sources = offsets.shape[0] - 1, probs.shape[1]
    values = np.zeros((3, trees, num_sources), np.int64)
    for t in range(trees):
        for s in range(num_sources):
            held = 0
            for a in range(accepted_offsets[t], accepted_offsets[t + 1]):
                if probs[offsets[t] + accepted[a], s] <= 0:
                    break
                held += 1
            values[0, t, s], values[1, t, s], values[2, t, s] = 1, held, held > verified[t]
    _count_cells(counts, parents, probs, offsets, match_len, edges, values)


class SourceCalibration:
    """Per-source, per-sample-class weights for ``merge_trees``, learned from the acceptance
    actually observed.

    Over the tried nodes of a tree -- children of the root and of accepted nodes -- a
    (source, sample class) cell's *observed* is how many it accepted among those it
    proposed, and its *predicted* the sum of its own conditional probabilities for them. The
    weight is the running ratio (observed + strength * prior) / (predicted + strength): the prior
    holds it while evidence is thin, and all sums decay by ``decay`` per step so it follows
    drift (roughly the last 1 / (1 - decay) steps count). ``classes`` sample classes (parent
    counts 1, 2-3, 4-7, ..., the last open-ended); 1 gives one weight per source.

    Cells are also kept per class of the length of the match the source's tree was drafted from
    (``lengths``, the first length of each class): a 16-token match in the request's own text is
    far more reliable than a 2-token one, with the same single occurrence behind both. A node d
    deep continues that match by the d - 1 tokens above it, so it counts (and is weighted, through
    ``weights_for(..., depths)``) under the class of match_len + d - 1: a 2-token match's first
    token and the fourth token of its branch are not equally reliable. A
    (source, length, sample class) cell's prior is its (source, sample class) weight over every
    length, so a length class with little evidence follows the source's pooled weight and one
    with much evidence its own. One per decoding loop; not thread-safe.
    """

    def __init__(
        self,
        num_sources: int,
        prior: float | Sequence[float] = 1.0,
        strength: float = 4.0,
        decay: float = 0.995,
        classes: int = 8,
        lengths: Sequence[int] = MATCH_LENGTH_EDGES,
    ) -> None:
        self.lengths = tuple(lengths)
        if not self.lengths or self.lengths[0] != 1 or list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"lengths must be ascending distinct match lengths from 1, got {list(lengths)}")
        if num_sources < 1 or classes < 1:
            raise ValueError(f"need at least one source and one class, got {num_sources} and {classes}")
        self.prior = np.broadcast_to(np.asarray(prior, dtype=np.float64), (num_sources,)).copy()
        if not np.all(self.prior >= 0):
            raise ValueError(f"priors must be non-negative, got {self.prior.tolist()}")
        if not strength > 0 or not 0 < decay <= 1:
            raise ValueError(f"strength must be > 0 and decay in (0, 1], got {strength} and {decay}")
        self.strength, self.decay = strength, decay
        self.observed = np.zeros((num_sources, len(self.lengths), classes))
        self.predicted = np.zeros((num_sources, len(self.lengths), classes))
        self._weights: np.ndarray | None = None  # ``weights``, until the next ``observe``
        self._edges = np.asarray(self.lengths, dtype=np.int64)  # ``lengths`` as the counting kernel reads them

    @property
    def num_sources(self) -> int:
        return int(self.prior.size)

    def fresh(self) -> SourceCalibration:
        """A calibration of the same priors and parameters that has learned nothing."""
        return SourceCalibration(
            self.num_sources, self.prior, self.strength, self.decay, self.observed.shape[2], self.lengths
        )

    @property
    def weights(self) -> np.ndarray:
        """float64 [S, L, K]: each source's current per-token weight per match-length class and
        sample class (read-only; computed once per ``observe``: every row of a step merges by it)."""
        if self._weights is None:
            pooled = (self.observed.sum(axis=1) + self.strength * self.prior[:, None]) / (
                self.predicted.sum(axis=1) + self.strength
            )
            if len(self.lengths) == 1:
                weights = pooled[:, None, :]
            else:
                weights = (self.observed + self.strength * pooled[:, None, :]) / (self.predicted + self.strength)
            weights.setflags(write=False)
            self._weights = weights
        return self._weights

    def weights_for(self, match_len: Sequence[int] | np.ndarray, depths: int | None = None) -> np.ndarray:
        """The weights ``merge_trees`` takes for source trees drafted from matches of ``match_len``
        [S] tokens: float64 [S, depths, K], level d (from 0) those of a match d tokens longer --
        a node d deep continues a match that much longer -- or [S, K] without ``depths`` (those of
        the first level, for every depth). ``match_len`` [R, S], R rows' sources, gives [R, S, ...]
        (``drafter.core.batch_step.merge_rows``'s weights)."""
        if depths is None:
            return self.weights[np.arange(self.num_sources), length_class(match_len, self.lengths)]
        if depths < 1:
            raise ValueError(f"depths must be >= 1, got {depths}")
        longer = np.asarray(match_len, dtype=np.int64)[..., None] + np.arange(depths)
        return self.weights[np.arange(self.num_sources)[:, None], length_class(longer, self.lengths)]

    def arrays(self) -> dict[str, np.ndarray]:
        """What it learned (the faded observed and predicted acceptance per cell): what
        ``drafter.core.calibration_memory`` keeps for the next process (``load``)."""
        return {"observed": self.observed.copy(), "predicted": self.predicted.copy()}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Start from what ``arrays`` (an earlier ``arrays()``) learned; ``ValueError`` naming the
        problem for cells of another shape (other sources, lengths or classes) or counts no run could
        have learned (negative, not finite), leaving this one as it was."""
        tables = [np.asarray(arrays.get(name), dtype=np.float64) for name in ("observed", "predicted")]
        for name, table in zip(("observed", "predicted"), tables):
            if table.shape != self.observed.shape:
                raise ValueError(f"source calibration {name} has shape {table.shape}, expected {self.observed.shape}")
            if not np.all(np.isfinite(table)) or np.any(table < 0):
                raise ValueError(f"source calibration {name} holds negative or non-finite counts")
        self.observed, self.predicted = tables[0].copy(), tables[1].copy()
        self._weights = None

    def observe(self, tree: MergedTree, accepted: Sequence[int] | np.ndarray) -> None:
        """Learn from one ``tree`` (from ``merge_trees``, possibly cut by ``select_tree``);
        ``accepted`` = indices of its accepted nodes (``Verification.keep[1:] - 1``), or of the
        nodes that what followed would have accepted (``accepted_nodes``: a merged tree in hindsight,
        as ``AdaptiveDrafter`` calibrates)."""
        self.observe_nodes(TreeNodes([tree], [accepted], self.num_sources))

    def observe_nodes(self, nodes: TreeNodes) -> None:
        """``observe`` each of the trees of ``nodes`` in turn (each decays what came before it), in
        one compiled pass: a step's rows at once."""
        if not nodes.trees:
            return
        self._weights = None
        self.observed, self.predicted = _calibrate(
            nodes.parents, nodes.depths, nodes.probs, nodes.samples, nodes.offsets, nodes.match_len,
            nodes.accepted, nodes.accepted_offsets, self._edges, self.decay, self.observed, self.predicted,
        )  # fmt: skip


class TreeNodes:
    """The nodes of several merged trees as one (a step's rows), as the counting kernels take them:
    their per-node columns concatenated (tree t is nodes ``offsets[t]:offsets[t + 1]``, ``parents``
    local to it), each tree's match lengths (``match_len`` [trees, S]) and its ``accepted`` nodes
    (local indices, root first, concatenated; tree t's are ``accepted[accepted_offsets[t]:
    accepted_offsets[t + 1]]``): those the verifier accepted, or those what followed ran along
    (``along``). Built once per count of what the calibration (``SourceCalibration.observe_nodes``)
    and the attribution (``Attribution.observe_nodes``, ``observe_hindsight_nodes``) learn from."""

    def __init__(
        self,
        trees: Sequence[MergedTree],
        accepted: Sequence[Sequence[int] | np.ndarray],
        num_sources: int,
    ) -> None:
        if len(accepted) != len(trees):
            raise ValueError(f"one list of accepted nodes per tree, got {len(accepted)} for {len(trees)}")
        self._columns(trees, num_sources)
        if not trees:
            return
        local = [np.asarray(nodes, dtype=np.int64) for nodes in accepted]
        counts = np.fromiter((nodes.size for nodes in local), np.int64, len(local))
        self.accepted_offsets = np.concatenate(([0], np.cumsum(counts)))
        self.accepted = np.concatenate(local)
        sizes = np.repeat(np.diff(self.offsets), counts)
        outside = np.flatnonzero((self.accepted < 0) | (self.accepted >= sizes))
        if outside.size:
            raise ValueError(f"accepted node indices must be in [0, {sizes[outside[0]]})")

    @classmethod
    def along(cls, trees: Sequence[MergedTree], followed: Sequence[Sequence[int]], num_sources: int) -> TreeNodes:
        """The ``trees`` with, as accepted, the path each one's ``followed`` tokens run along
        (``DraftTree.accepted_nodes``, all trees in one compiled pass): the merged trees in hindsight."""
        if len(followed) != len(trees):
            raise ValueError(f"one list of followed tokens per tree, got {len(followed)} for {len(trees)}")
        nodes = cls.__new__(cls)
        nodes._columns(trees, num_sources)
        if trees:
            lengths = np.fromiter((len(tokens) for tokens in followed), np.int64, len(followed))
            flat = np.fromiter(itertools.chain.from_iterable(followed), np.int64, int(lengths.sum()))
            tokens = np.concatenate([tree.tokens for tree in trees])
            nodes.accepted, counts = _followed_paths(
                tokens, nodes.parents, nodes.offsets, flat, np.concatenate(([0], np.cumsum(lengths)))
            )
            nodes.accepted_offsets = np.concatenate(([0], np.cumsum(counts)))
        return nodes

    def _columns(self, trees: Sequence[MergedTree], num_sources: int) -> None:
        for tree in trees:
            if not isinstance(tree, MergedTree) or tree.source_probs.shape[1] != num_sources:
                raise ValueError(
                    f"trees must carry source_probs and source_samples for {num_sources} sources (merge_trees results)"
                )
        self.trees = len(trees)
        if not trees:
            return
        self.offsets = np.zeros(len(trees) + 1, np.int64)
        np.cumsum([tree.tokens.shape[0] for tree in trees], out=self.offsets[1:])
        self.parents = np.concatenate([tree.parents for tree in trees]).astype(np.int32, copy=False)
        self.depths = np.concatenate([tree.depths for tree in trees]).astype(np.int32, copy=False)
        self.probs = np.concatenate([tree.source_probs for tree in trees])
        self.samples = np.concatenate([tree.source_samples for tree in trees])
        self.match_len = np.concatenate([tree.source_match_len for tree in trees]).reshape(len(trees), num_sources)

    @property
    def accepted_count(self) -> np.ndarray:
        """int64 [trees]: each tree's accepted nodes."""
        return np.diff(self.accepted_offsets)


class Attribution:
    """Where accepted tokens come from: per source and per length of the match its tree was
    drafted from, over the verified trees (``observe``, as ``SourceCalibration`` sees them).

    Per (source, match-length class) cell, counted over steps where the source proposed a first
    token (a root child) of the verified tree:

    steps          such steps
    first_accepted steps where the token the verifier accepted first was one of the source's
    accepted       accepted tokens the source proposed (how deep it carries)
    verified       verified tokens the source proposed (what it cost)

    and in hindsight (``observe_hindsight``), over steps where the source proposed a first token of
    the *merged* tree, before selection cut it to what was verified:

    offered        such steps
    held           tokens of what actually followed that the source's part of the merged tree
                   drafted, from the root (how deep it would have carried had its path been verified)
    passed_over    steps where that was more than the verified tree got accepted: the selection (or
                   the batch's admission) took another path, or cut this one short, and lost tokens

    and for the whole merged tree: ``tree_steps``, ``tree_held`` (what the best path in it would have
    carried) and ``tree_accepted`` (what the verified part of it did): the gap between the two is
    what a better selection could win from these sources; below ``tree_held`` only better sources help.

    Plain sums, no decay: a report of a run, not a weight. Not thread-safe."""

    def __init__(self, sources: Sequence[str]) -> None:
        self.sources = tuple(sources)
        # the verified trees' counts and the hindsight's, each stack one array (one update a step)
        self._verified = np.zeros((4, len(self.sources), len(MATCH_LENGTH_EDGES)), np.int64)
        self._hindsight = np.zeros((3, len(self.sources), len(MATCH_LENGTH_EDGES)), np.int64)
        self.steps, self.first_accepted, self.accepted, self.verified = self._verified
        self.offered, self.held, self.passed_over = self._hindsight
        self.tree_steps, self.tree_held, self.tree_accepted = (np.zeros((), np.int64) for _ in range(3))

    COUNTS = (
        "steps", "first_accepted", "accepted", "verified", "offered", "held", "passed_over",
        "tree_steps", "tree_held", "tree_accepted",
    )  # fmt: skip

    def counts(self) -> dict:
        """The sources and every count, as lists: JSON, or across a process boundary."""
        return {"sources": list(self.sources), **{name: getattr(self, name).tolist() for name in self.COUNTS}}

    @classmethod
    def from_counts(cls, counts: dict) -> Attribution:
        """The inverse of ``counts``."""
        attribution = cls(counts["sources"])
        for name in cls.COUNTS:
            getattr(attribution, name)[...] = counts[name]
        return attribution

    def __sub__(self, earlier: Attribution) -> Attribution:
        """What was counted since ``earlier`` (a ``from_counts`` of this one's ``counts`` then)."""
        if earlier.sources != self.sources:
            raise ValueError(f"sources differ: {earlier.sources} and {self.sources}")
        since = Attribution(self.sources)
        for name in self.COUNTS:
            getattr(since, name)[...] = getattr(self, name) - getattr(earlier, name)
        return since

    def observe(self, tree: MergedTree, accepted: Sequence[int] | np.ndarray) -> None:
        """Count one verified ``tree``; ``accepted`` = indices of its accepted nodes."""
        self.observe_nodes(TreeNodes([tree], [accepted], len(self.sources)))

    def observe_nodes(self, nodes: TreeNodes) -> None:
        """``observe`` each of the trees of ``nodes`` (a step's rows), in one compiled pass."""
        if not nodes.trees:
            return
        _attribute(
            self._verified, nodes.parents, nodes.probs, nodes.offsets, nodes.match_len,
            nodes.accepted, nodes.accepted_offsets, _MATCH_LENGTH_EDGES,
        )  # fmt: skip

    def observe_hindsight(self, merged: MergedTree, followed: Sequence[int], accepted: int) -> None:
        """Count one merged tree against the tokens that ``followed`` its context (at least its
        depth of them), once they are known: how deep each source's part of it ran along them, and
        whether deeper than the ``accepted`` tokens of the part that was verified (0 where none was)."""
        self.observe_hindsight_nodes(TreeNodes.along([merged], [followed], len(self.sources)), [accepted])

    def observe_hindsight_nodes(self, nodes: TreeNodes, accepted: Sequence[int]) -> None:
        """``observe_hindsight`` for each merged tree of ``nodes``, whose accepted nodes are the
        path what followed it ran along (``DraftTree.accepted_nodes``), ``accepted`` the tokens its
        verified part got accepted; in one compiled pass."""
        if not nodes.trees:
            return
        verified = np.asarray(accepted, dtype=np.int64)
        _attribute_hindsight(
            self._hindsight, nodes.parents, nodes.probs, nodes.offsets, nodes.match_len,
            nodes.accepted, nodes.accepted_offsets, verified, _MATCH_LENGTH_EDGES,
        )  # fmt: skip
        self.tree_steps += nodes.trees
        self.tree_held += nodes.accepted.size
        self.tree_accepted += int(verified.sum())

    def report(self) -> list[dict]:
        """One dict per cell with steps or offers: source, match lengths ("4-5", "16+"), the
        counts, the first token's acceptance rate, accepted tokens per step, tokens held per offer
        and the share of offers passed over."""
        cells = []
        for source, bucket in zip(*np.nonzero(self.steps + self.offered)):
            low = MATCH_LENGTH_EDGES[bucket]
            high = MATCH_LENGTH_EDGES[bucket + 1] - 1 if bucket + 1 < len(MATCH_LENGTH_EDGES) else None
            steps, offered = int(self.steps[source, bucket]), int(self.offered[source, bucket])
            first, accepted = int(self.first_accepted[source, bucket]), int(self.accepted[source, bucket])
            held, passed_over = int(self.held[source, bucket]), int(self.passed_over[source, bucket])
            cells.append(
                {
                    "source": self.sources[source],
                    "match_len": f"{low}+" if high is None else str(low) if high == low else f"{low}-{high}",
                    "steps": steps,
                    "first_accepted": first,
                    "accepted": accepted,
                    "verified": int(self.verified[source, bucket]),
                    "first_token_acceptance": round(first / max(steps, 1), 4),
                    "accepted_per_step": round(accepted / max(steps, 1), 4),
                    "offered": offered,
                    "held": held,
                    "passed_over": passed_over,
                    "held_per_offer": round(held / max(offered, 1), 4),
                    "passed_over_share": round(passed_over / max(offered, 1), 4),
                }
            )
        return cells

    def hindsight(self) -> dict:
        """The merged trees in hindsight: steps, tokens the best path in each would have carried
        and tokens its verified part did, per step."""
        steps = int(self.tree_steps)
        return {
            "steps": steps,
            "held_per_step": round(int(self.tree_held) / max(steps, 1), 4),
            "accepted_per_step": round(int(self.tree_accepted) / max(steps, 1), 4),
        }
