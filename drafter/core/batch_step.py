"""The compiled batch step: every row's merge and chain choice in one compiled pass.

At 16 rows a step, REST's drafting was Python per row and phase (a merge call, a chain call, a
subset, each building arrays and trees: 0.1 ms a row for these two phases alone). Here the rows'
source trees go to the kernel as one set of flat arrays, and it merges each row's sources
(``drafter.core.merge._merge``, the same kernel a single merge runs) and, for engines that verify
chains, picks the root path that pays most (``best_chain``, which ``drafter.core.selection.select_chain``
runs too). Python only slices the flat results into each row's trees.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from rest_spec.common.cache import numba_cached
from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.merge import MergedTree, _merge

numba = numba_cached()

_NO_CHAIN = np.zeros(0, np.float64)  # ``prices`` when the rows want merged trees only
_CHAIN_MARGIN = 1 + 1e-12  # a chain must beat verifying the pending token alone by more than rounding


@numba.njit(nogil=True, cache=True)
def best_chain(parents, scores, depths, prices):
    """The node whose root path has the highest (1 + path score sum) / ``prices[depth]`` (the
    chain cost of verifying 1 + depth tokens), at most ``len(prices) - 1`` deep, and that rate;
    (-1, 0.0) when no node is that shallow. Of equal rates the first in BFS order (the shallowest)."""
    deepest = prices.shape[0] - 1
    sums = np.empty(parents.shape[0], np.float64)
    best, best_rate = -1, 0.0
    for i in range(parents.shape[0]):  # parents precede children
        sums[i] = scores[i] + (sums[parents[i]] if parents[i] >= 0 else 0.0)
        if depths[i] <= deepest:
            rate = (1.0 + sums[i]) / prices[depths[i]]
            if best < 0 or rate > best_rate:
                best, best_rate = i, rate
    return best, best_rate


@numba.njit(nogil=True, cache=True)
def _merge_rows(tokens, parents, counts, scores, sizes, num_sampled, weights, budget, prices):
    """``_merge`` per row over the rows' source trees concatenated (row-major, sources in order;
    ``sizes`` and ``num_sampled`` [R, S], ``weights`` [R, S, D, K]), then, with ``prices``, the best
    chain of each merged tree. Returns the merged trees' columns concatenated, ``offsets`` [R + 1]
    into them, and the chains' nodes (indices into those columns, root first) concatenated with
    ``chain_offsets`` [R + 1] into them (a row without a chain that pays, or without ``prices``: none)."""
    rows, num_sources = sizes.shape
    capacity = rows * budget
    out_tokens = np.empty(capacity, np.int32)
    out_parents = np.empty(capacity, np.int32)
    out_counts = np.empty(capacity, np.int64)
    out_scores = np.empty(capacity, np.float64)
    out_probs = np.empty((capacity, num_sources), np.float64)
    out_samples = np.empty((capacity, num_sources), np.int64)
    out_depths = np.empty(capacity, np.int32)
    offsets = np.zeros(rows + 1, np.int64)
    chain_nodes = np.empty(rows * max(prices.shape[0] - 1, 0), np.int64)
    chain_offsets = np.zeros(rows + 1, np.int64)
    start, used, chained = 0, 0, 0
    for r in range(rows):
        stop = start + sizes[r].sum()
        if stop > start:
            t, p, c, s, probs, samples, d = _merge(
                tokens[start:stop],
                parents[start:stop],
                counts[start:stop],
                scores[start:stop],
                sizes[r],
                num_sampled[r],
                weights[r],
                budget,
            )
            n = t.shape[0]
            out_tokens[used : used + n] = t
            out_parents[used : used + n] = p
            out_counts[used : used + n] = c
            out_scores[used : used + n] = s
            out_probs[used : used + n] = probs
            out_samples[used : used + n] = samples
            out_depths[used : used + n] = d
            if prices.shape[0] > 1 and n > 0:
                end, rate = best_chain(p, s, d, prices)
                if end >= 0 and rate > _CHAIN_MARGIN / prices[0]:
                    depth = d[end]
                    for i in range(depth - 1, -1, -1):  # the root path, written leaf first
                        chain_nodes[chained + i] = used + end
                        end = p[end]
                    chained += depth
            used += n
        offsets[r + 1] = used
        chain_offsets[r + 1] = chained
        start = stop
    return (
        out_tokens[:used],
        out_parents[:used],
        out_counts[:used],
        out_scores[:used],
        out_probs[:used],
        out_samples[:used],
        out_depths[:used],
        offsets,
        chain_nodes[:chained],
        chain_offsets,
    )


def merge_rows(
    rows: Sequence[Sequence[DraftTree]], weights: np.ndarray, budget: int, prices: np.ndarray | None = None
) -> tuple[list[DraftTree], list[DraftTree] | None]:
    """Each row's source trees merged as ``merge_trees`` merges them (``budget`` nodes; weights
    float64 [R, S, D, K], a row's as ``SourceCalibration.weights_for(..., D)`` gives them), an
    empty tree where no source proposed anything; with ``prices`` (float64 [D + 1]: the chain cost
    of verifying 1..D + 1 tokens), also each row's chain as ``select_chain`` picks it. Returns
    (merged trees, chains or None)."""
    if not rows:
        return [], None if prices is None else []
    num_sources = len(rows[0])
    flat = [tree for row in rows for tree in row]
    if len(flat) != len(rows) * num_sources or weights.shape[:2] != (len(rows), num_sources):
        raise ValueError(f"every row needs {num_sources} source trees and weights [rows, sources, depths, classes]")
    sizes = np.fromiter((tree.tokens.shape[0] for tree in flat), np.int64, len(flat)).reshape(len(rows), num_sources)
    match_len = np.fromiter((tree.match_len for tree in flat), np.int64, len(flat)).reshape(sizes.shape)
    num_sampled = np.fromiter((tree.num_sampled for tree in flat), np.int64, len(flat)).reshape(sizes.shape)
    num_matches = np.fromiter((tree.num_matches for tree in flat), np.int64, len(flat)).reshape(sizes.shape)
    columns = _merge_rows(
        np.concatenate([tree.tokens for tree in flat]),
        np.concatenate([tree.parents for tree in flat]),
        np.concatenate([tree.counts for tree in flat]),
        np.concatenate([tree.scores for tree in flat]),
        sizes,
        num_sampled,
        np.ascontiguousarray(weights, dtype=np.float64),
        budget,
        _NO_CHAIN if prices is None else np.asarray(prices, np.float64),
    )
    *columns, offsets, chain_nodes, chain_offsets = columns
    stats = (
        match_len,
        match_len.max(axis=1).tolist(),
        num_matches.sum(axis=1).tolist(),
        num_sampled.sum(axis=1).tolist(),
    )
    match_len.setflags(write=False)
    merged = _views(columns, offsets.tolist(), stats)
    if prices is None:
        return merged, None
    tokens, _, counts, scores, probs, samples, _ = columns
    # a chain's node at position i (from 0) has parent i - 1 and depth i + 1
    position = np.arange(chain_nodes.size) - np.repeat(chain_offsets[:-1], np.diff(chain_offsets))
    position = position.astype(np.int32)
    chain_columns = (tokens[chain_nodes], position - 1, counts[chain_nodes], scores[chain_nodes])
    chain_columns += (probs[chain_nodes], samples[chain_nodes], position + 1)
    return merged, _views(chain_columns, chain_offsets.tolist(), stats)


def _views(columns: Sequence[np.ndarray], bounds: list[int], stats: tuple) -> list[DraftTree]:
    """One ``MergedTree`` per row, each a view of ``columns`` (tokens, parents, counts, scores,
    source probabilities and samples, depths; frozen here, once) from ``bounds[r]`` to ``bounds[r +
    1]``, with the row's match statistics ``stats`` (source match lengths [R, S], then per row the
    longest, the matches and the samples) and its depth, all rows' in one call; the empty tree
    where a row has no nodes. Unchecked: the kernel built them valid (BFS order, scores that
    never grow down a path)."""
    for column in columns:
        column.setflags(write=False)
    tokens, parents, counts, scores, probs, samples, depths = columns
    source_match_len, longest, num_matches, num_sampled = stats
    starts = [lo for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
    deepest = iter(np.maximum.reduceat(depths, starts).tolist() if starts else ())
    trees = []
    for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if lo == hi:
            trees.append(DraftTree.empty())
            continue
        tree = MergedTree._frozen_view(
            max_depth=next(deepest),
            tokens=tokens[lo:hi],
            parents=parents[lo:hi],
            counts=counts[lo:hi],
            depths=depths[lo:hi],
            match_len=longest[r],
            num_matches=num_matches[r],
            num_sampled=num_sampled[r],
            scores=scores[lo:hi],
            source_probs=probs[lo:hi],
            source_samples=samples[lo:hi],
            source_match_len=source_match_len[r],
        )
        trees.append(tree)
    return trees


def compile_kernels() -> float:
    """Compile the batch step's kernel for the arrays ``merge_rows`` passes into numba's on-disk
    cache (``drafter.core.kernels``); returns the seconds it took."""
    from rest_spec.drafter.core.merge import SourceCalibration

    start = time.perf_counter()
    tree = DraftTree(np.array([5], np.int32), np.array([-1], np.int32), np.array([1], np.int64), 1, 1, 1)
    weights = SourceCalibration(2).weights_for(np.array([[1, 0]]), 2)
    merge_rows([[tree, DraftTree.empty()]], weights, 4, np.ones(3))
    best_chain(tree.parents, tree.scores, tree.depths, np.ones(2))  # ``select_chain``'s call
    return time.perf_counter() - start
