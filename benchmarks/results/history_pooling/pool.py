"""A rejected experiment, kept as run (benchmarks/README.md, "Pooling the store into the index's tree").

Where the index and the store of outputs matched the context equally long, their trees are pooled
into one, as one index of both texts would count them: the store's counts times ``REST_POOL``
added to the index's, the store's tree left empty. Applied in ``AdaptiveDrafter._row_trees`` by
``adaptive_pool.diff`` (with this file on ``sys.path``).
"""

import dataclasses
import os

import numpy as np

from rest_spec.common.types import DraftTree, SourceTrees


def pool_trees(index: DraftTree, store: DraftTree, weight: int = 1) -> DraftTree:
    """The union of two trees of the same match, counts summed (the store's times ``weight``)."""
    nodes: dict[tuple[int, int], int] = {}  # (pooled parent, token) -> pooled node
    tokens, parents, counts = [], [], []
    for tree, scale in ((index, 1), (store, weight)):
        pooled_of = []
        for i in range(len(tree)):
            parent = -1 if tree.parents[i] < 0 else pooled_of[tree.parents[i]]
            key = (parent, int(tree.tokens[i]))
            if key not in nodes:
                nodes[key] = len(tokens)
                tokens.append(key[1])
                parents.append(parent)
                counts.append(0)
            counts[nodes[key]] += scale * int(tree.counts[i])
            pooled_of.append(nodes[key])
    depth = np.zeros(len(tokens), np.int64)
    for i, parent in enumerate(parents):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    order = np.argsort(depth, kind="stable")  # BFS order: parents first
    renumbered = np.empty(len(tokens), np.int64)
    renumbered[order] = np.arange(len(tokens))
    ordered_parents = np.array(parents)[order]
    return DraftTree(
        np.array(tokens)[order],
        np.where(ordered_parents < 0, -1, renumbered[np.maximum(ordered_parents, 0)]),
        np.array(counts)[order],
        index.match_len,
        index.num_matches + weight * store.num_matches,
        index.num_sampled + weight * store.num_sampled,
    )


def pooled(shared: SourceTrees) -> SourceTrees:
    if shared.index.match_len and shared.index.match_len == shared.outputs.match_len:
        weight = int(os.environ["REST_POOL"])
        return dataclasses.replace(
            shared, index=pool_trees(shared.index, shared.outputs, weight), outputs=DraftTree.empty()
        )
    return shared
