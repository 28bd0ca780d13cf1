"""The part of a draft tree worth verifying, by a step's cost: used every decoding step.

With node scores that estimate acceptance probabilities (``drafter.core.merge``), keeping nodes K
yields 1 + sum_K score tokens per step (the accepted ones plus the model's own bonus token) in
t(1 + |K|) seconds (``drafter.core.cost.VerifyCost``, or ``drafter.core.corrected_cost.CorrectedCost``).
For each size the best prefix-closed set is the top |K| nodes by score, since scores never grow down
a path; scanning the size is exact. Chains are verified on the model's plain causal path, without
the tree mask, and have their own measured cost; ``select_tree`` weighs the best chain against the
best tree, ``select_chain`` is for engines that verify chains only. A batch has its own admission
rules: ``select_batch_trees`` (one block padded to the widest row) and ``select_batch_chains``
(an engine priced by rows and draft tokens, ``drafter.core.batch_cost.BatchCost``). Importing this
module imports no numba (the compiled chain search is imported when first used).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.corrected_cost import CorrectedCost

if TYPE_CHECKING:
    from rest_spec.drafter.core.batch_cost import BatchCost
    from rest_spec.drafter.core.cost import VerifyCost


def select_tree(tree: DraftTree, cost: VerifyCost | CorrectedCost, max_depth: int | None = None) -> DraftTree:
    """The prefix-closed part of ``tree`` maximizing expected tokens per second,
    (1 + sum of kept scores) / cost of verifying 1 + kept tokens, keeping only nodes at most
    ``max_depth`` deep; no nodes at all when no draft beats verifying the pending token alone.

    Two kinds of candidates compete: for each size k, the top k nodes by score at the tree cost
    ``cost(1 + k)``; and for each node, the chain from the root to it at the chain cost
    ``cost.chain(1 + depth)`` (the causal path, no custom mask). Of equally good choices the
    smaller, and then the tree, wins. With a ``CorrectedCost``, a smaller size whose price it
    still has to check (``CorrectedCost.unchecked_below``) is kept instead: its top nodes."""
    candidates = np.arange(len(tree)) if max_depth is None else np.flatnonzero(tree.depths <= max_depth)
    ranked = candidates[np.lexsort((candidates, -tree.scores[candidates]))]  # a parent before its children
    gain = 1.0 + np.concatenate(([0.0], np.cumsum(tree.scores[ranked])))  # [k + 1]: keeping the top 0..k
    rate = gain / cost(1 + np.arange(ranked.size + 1))
    best = int(np.argmax(rate))
    chain_end, chain_rate = _best_chain(tree, cost, max_depth)
    chain_wins = chain_rate > rate[best] * (1 + 1e-12)
    if isinstance(cost, CorrectedCost):  # a size the loop still has to time: this step runs it
        probe = cost.unchecked_below(1 + (int(tree.depths[chain_end]) if chain_wins else best))
        if probe is not None and probe - 1 <= ranked.size:
            best, chain_wins = probe - 1, False
    if chain_wins:
        return tree.chain_to(chain_end)
    if best == len(tree):
        return tree  # all of it: no copy
    return tree.subset(np.sort(ranked[:best]))


def select_chain(tree: DraftTree, cost: VerifyCost | CorrectedCost, max_depth: int | None = None) -> DraftTree:
    """The path from the root maximizing expected tokens per second, (1 + sum of its scores) /
    ``cost.chain(1 + its length)``, at most ``max_depth`` long; empty when no path beats verifying
    the pending token alone. For engines that verify chains only (vLLM, llama.cpp)."""
    end, rate = _best_chain(tree, cost, max_depth)
    if end < 0 or rate <= (1 + 1e-12) / float(cost.chain(1)):
        return DraftTree.empty()
    return tree.chain_to(end)


def _best_chain(tree: DraftTree, cost: VerifyCost | CorrectedCost, max_depth: int | None) -> tuple[int, float]:
    """The node at most ``max_depth`` deep whose root path has the highest (1 + path score sum) /
    chain cost, and that rate (-1 and 0.0 without one); of equal rates the first in BFS order (the
    shallowest). Every row, every step: one compiled pass (``drafter.core.batch_step.best_chain``,
    imported here: importing this module imports no numba), the chain prices looked up once."""
    from rest_spec.drafter.core.batch_step import best_chain

    deepest = tree.max_depth if max_depth is None else min(max_depth, tree.max_depth)
    if deepest < 1:
        return -1, 0.0
    prices = np.asarray(cost.chain(np.arange(1, deepest + 2)), dtype=np.float64)  # [d]: a chain of d drafts
    end, rate = best_chain(tree.parents, tree.scores, tree.depths, prices)
    return int(end), float(rate)


def select_batch_chains(chains: Sequence[DraftTree], cost: BatchCost, rows: int) -> list[DraftTree]:
    """Prefixes of ``chains`` (one per drafted row, each a chain in root-to-leaf order) for a step of
    ``rows`` rows that verifies them all at once, in ``cost.seconds(rows, drafted)``: draft slots
    (row, depth) admitted in order of expected acceptance (their scores) while they raise the
    batch's expected tokens per second, (rows + sum of kept scores) / seconds. A slot that pays
    for one row alone may not pay in a batch, where the step costs every row's time: a step with
    nothing that pays drafts nothing. The same rule at every batch size, one row included."""
    if not chains:
        return []
    scores = np.concatenate([chain.scores for chain in chains])
    sizes = np.fromiter(map(len, chains), np.int64, len(chains))
    owners = np.repeat(np.arange(len(chains)), sizes)
    depths = np.arange(scores.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    order = np.lexsort((depths, -scores))  # within a row scores never grow: every cut keeps prefixes
    gain = rows + np.concatenate(([0.0], np.cumsum(scores[order])))
    rate = gain / cost.seconds(rows, np.arange(order.size + 1))
    kept = np.bincount(owners[order[: int(np.argmax(rate))]], minlength=len(chains)).tolist()
    return [chain.first(n) for chain, n in zip(chains, kept)]


def select_batch_trees(trees: Sequence[DraftTree], cost: VerifyCost | CorrectedCost) -> list[DraftTree]:
    """Parts of ``trees`` (one per row, each already what pays verified alone) for a step that
    verifies every row in one block padded to the widest (the transformers loop): each row keeps
    its ``w`` best-scored nodes (prefix-closed), ``w`` the width that maximizes the batch's
    expected tokens per second, (rows + sum of kept scores) / ``cost(rows * (1 + w))`` (one row's
    time for the block's token count: the work is linear in the tokens the linear layers see).
    One row keeps its tree."""
    if len(trees) < 2:
        return list(trees)
    widest = max(len(tree) for tree in trees)
    if widest == 0:
        return list(trees)
    gains, ranked = np.zeros(widest + 1), []
    for tree in trees:
        order = np.lexsort((np.arange(len(tree)), -tree.scores))  # a parent before its children
        kept = np.concatenate(([0.0], np.cumsum(tree.scores[order])))
        gains += np.concatenate((kept, np.full(widest - len(tree), kept[-1])))
        ranked.append(order)
    width = int(np.argmax((len(trees) + gains) / cost(len(trees) * (1 + np.arange(widest + 1)))))
    return [tree if len(tree) <= width else tree.subset(np.sort(order[:width])) for tree, order in zip(trees, ranked)]
