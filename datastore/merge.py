"""One draft tree from several sources, each node scored by its estimated acceptance probability.

Every source (the static index, the request itself, past outputs) answers its own tree. Under a
source, a node's probability is the product along its path of child count / parent count (=
count / root count; SuffixDecoding, NOTES section 6), and the expected number of tokens a tree
yields is the sum of its nodes' path probabilities (Sequoia, section 4) -- so nodes are selected
by that score, and ``drafter.budget.select_tree`` sizes the tree from it.

Sources are not equally trustworthy: a request whose suffix occurred twice claims certainty it
has not earned. Each source therefore has a weight, learned by ``SourceCalibration`` from the
acceptance actually observed, that scales its per-token probability: node i under source s gets
P_s(i) = prod over the path of min(1, w_s * c(node) / c(parent)). The weight is per token, not per
node, because acceptance is a sequence of per-token trials: a source that is overconfident is
overconfident at every depth, and w^depth captures the decay with depth that one factor per
node cannot.

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

from typing import Sequence

import numpy as np

from datastore.types import DraftTree


def conditional_probs(tree: DraftTree) -> np.ndarray:
    """float64 [n]: each node's probability given its parent, score / parent score (0 under a
    parent of score 0); = count / parent count for a tree of counts."""
    parent_scores = np.where(tree.parents >= 0, tree.scores[tree.parents], 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        probs = np.where(parent_scores > 0, tree.scores / parent_scores, 0.0)
    if np.any(probs > 1 + 1e-9):
        raise ValueError("a node's score exceeds its parent's: not a tree of counts or acceptance estimates")
    return np.minimum(probs, 1.0)


def merge_trees(trees: Sequence[DraftTree], weights: Sequence[float] | np.ndarray, budget: int) -> DraftTree:
    """The ``budget`` best-scored nodes of the union of ``trees`` (one per source), in BFS order.

    weights  float [S], >= 0: each source's per-token calibration (``SourceCalibration.weights``)
    returns  a tree whose ``scores`` are the noisy-OR of the weighted per-source path probabilities
             (see module docstring), ``source_probs`` [n, S] the sources' own conditional
             probabilities, ``counts`` the summed counts, ``num_matches`` / ``num_sampled`` the
             sums and ``match_len`` the longest match. Ties go to the earlier BFS node.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if not trees:
        raise ValueError("merge_trees needs at least one source tree")
    if weights.shape != (len(trees),):
        raise ValueError(f"weights must hold one weight per source ({len(trees)}), got shape {weights.shape}")
    if not np.all(weights >= 0) or not np.all(np.isfinite(weights)):
        raise ValueError(f"weights must be finite and non-negative, got {weights.tolist()}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")

    # All sources' nodes in one array, grouped by depth (each source is in BFS order already).
    sizes = np.array([len(t) for t in trees])
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    tokens = np.concatenate([t.tokens for t in trees]).astype(np.int64)
    depths = np.concatenate([t.depths for t in trees])
    parents = np.concatenate([np.where(t.parents >= 0, t.parents + o, -1) for t, o in zip(trees, offsets)])
    by_depth = np.argsort(depths, kind="stable")
    levels = np.searchsorted(depths[by_depth], np.arange(1, depths.max(initial=0) + 2))

    # Merged ids level by level: np.unique over (merged parent, token) keys deduplicates the
    # paths, and its sorted order (parent's BFS index, then token) is exactly BFS order.
    radix = int(tokens.max(initial=0)) + 1
    merged = np.empty(tokens.size, dtype=np.int64)
    keys = []
    for lo, hi in zip(levels[:-1], levels[1:]):
        at = by_depth[lo:hi]
        merged_parent = np.where(parents[at] >= 0, merged[parents[at]], -1)
        level_keys, inverse = np.unique((merged_parent + 1) * radix + tokens[at], return_inverse=True)
        merged[at] = sum(k.size for k in keys) + inverse.reshape(-1)
        keys.append(level_keys)
    bounds = np.cumsum([0] + [k.size for k in keys])  # merged depth d holds ids [bounds[d-1], bounds[d])
    flat_keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    merged_tokens, merged_parents = flat_keys % radix, flat_keys // radix - 1
    num_nodes = flat_keys.size

    source_probs = np.zeros((num_nodes, len(trees)))
    source = np.repeat(np.arange(len(trees)), sizes)
    source_probs[merged, source] = np.concatenate([conditional_probs(t) for t in trees])
    path_probs = np.minimum(1.0, source_probs * weights)  # calibrated per-token, then down the paths
    scores = np.empty(num_nodes)
    for depth, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
        up = merged_parents[lo:hi]
        if depth > 1:
            path_probs[lo:hi] *= path_probs[up]
        scores[lo:hi] = 1.0 - np.prod(1.0 - path_probs[lo:hi], axis=1)
        if depth > 1:  # exact in theory; the minimum keeps rounding from breaking monotonicity
            np.minimum(scores[lo:hi], scores[up], out=scores[lo:hi])
    counts = np.zeros(num_nodes, dtype=np.int64)
    np.add.at(counts, merged, np.concatenate([t.counts for t in trees]))

    union = DraftTree(
        merged_tokens,
        merged_parents,
        counts,
        match_len=max(t.match_len for t in trees),
        num_matches=sum(t.num_matches for t in trees),
        num_sampled=sum(t.num_sampled for t in trees),
        scores=scores,
        source_probs=source_probs,
    )
    if num_nodes <= budget:
        return union
    # A parent scores at least its child and precedes it in BFS order, so it always ranks first
    # and the kept set is prefix-closed.
    return union.subset(np.sort(np.lexsort((np.arange(num_nodes), -scores))[:budget]))


class SourceCalibration:
    """Per-source weights for ``merge_trees``, learned from the acceptance actually observed.

    Over the verified nodes the verifier actually tried -- children of the root and of accepted
    nodes -- a source's *observed* is how many it accepted among those it proposed, and its
    *predicted* the sum of its own conditional probabilities for them. The weight is the running
    ratio (observed + strength * prior) / (predicted + strength): the prior holds it while
    evidence is thin, and both sums decay by ``decay`` per step so it follows drift (roughly the
    last 1 / (1 - decay) steps count). One per decoding loop; not thread-safe.
    """

    def __init__(
        self, num_sources: int, prior: float | Sequence[float] = 1.0, strength: float = 4.0, decay: float = 0.98
    ) -> None:
        if num_sources < 1:
            raise ValueError(f"need at least one source, got {num_sources}")
        self.prior = np.broadcast_to(np.asarray(prior, dtype=np.float64), (num_sources,)).copy()
        if not np.all(self.prior >= 0):
            raise ValueError(f"priors must be non-negative, got {self.prior.tolist()}")
        if not strength > 0 or not 0 < decay <= 1:
            raise ValueError(f"strength must be > 0 and decay in (0, 1], got {strength} and {decay}")
        self.strength, self.decay = strength, decay
        self.observed = np.zeros(num_sources)
        self.predicted = np.zeros(num_sources)

    @property
    def weights(self) -> np.ndarray:
        """float64 [S]: each source's current per-token weight."""
        return (self.observed + self.strength * self.prior) / (self.predicted + self.strength)

    def observe(self, tree: DraftTree, accepted: Sequence[int] | np.ndarray) -> None:
        """Learn from one verified ``tree`` (from ``merge_trees``, possibly cut by
        ``select_tree``); ``accepted`` = indices of its accepted nodes (``Verification.keep[1:] - 1``)."""
        probs = tree.source_probs
        if probs is None or probs.shape[1] != self.prior.size:
            raise ValueError(f"tree must carry source_probs for {self.prior.size} sources (a merge_trees result)")
        accepted = np.asarray(accepted, dtype=np.int64)
        if accepted.size and (accepted.min() < 0 or accepted.max() >= len(tree)):
            raise ValueError(f"accepted node indices must be in [0, {len(tree)})")
        is_accepted = np.zeros(len(tree) + 1, dtype=bool)  # slot -1: the root, always reached
        is_accepted[accepted] = True
        is_accepted[-1] = True
        tried = is_accepted[tree.parents]
        self.observed = self.decay * self.observed + ((probs[tried] > 0) & is_accepted[:-1][tried, None]).sum(axis=0)
        self.predicted = self.decay * self.predicted + probs[tried].sum(axis=0)
