"""Tree -> tensors: ancestor matrix, positions and 4D masks against explicit ancestor walks, and the
tree forward against plain per-path forwards on a tiny model (sdpa and eager attention).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from datastore.types import DraftTree
from drafter.kv_cache import new_cache
from drafter.tree_attention import ancestor_matrix, build_tree_inputs, tree_attention_mask
from drafter.verify import tree_logits
from tests.helpers import FAMILIES, tiny_causal_lm, tree_from_paths
from tests.helpers import MODEL_VOCAB as VOCAB

@st.composite
def trees(draw, max_nodes: int = 48, vocab: int = VOCAB) -> DraftTree:
    """Random trees in any parents-before-children order (BFS is a special case)."""
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return DraftTree(np.array(tokens), np.array(parents), np.ones(n))


def walk_ancestors(tree: DraftTree) -> list[list[int]]:
    """Brute force: for every flat position, the flat positions of itself and all its ancestors."""
    rows = [[0]]
    for i in range(len(tree)):
        chain, node = [i + 1], i
        while tree.parents[node] >= 0:
            node = int(tree.parents[node])
            chain.append(node + 1)
        rows.append(sorted(chain + [0]))
    return rows


@settings(max_examples=200, deadline=None)
@given(tree=trees())
def test_ancestor_matrix_matches_walk(tree: DraftTree) -> None:
    matrix = ancestor_matrix(tree.parents, tree.depths)
    assert matrix.shape == (len(tree) + 1,) * 2 and matrix.dtype == np.bool_
    assert [np.flatnonzero(row).tolist() for row in matrix] == walk_ancestors(tree)


@settings(max_examples=100, deadline=None)
@given(tree=trees(), past_length=st.integers(0, 20), pending=st.integers(0, VOCAB - 1))
def test_tree_inputs_match_walk(tree: DraftTree, past_length: int, pending: int) -> None:
    inputs = build_tree_inputs(pending, tree, past_length, "cpu")
    walked = walk_ancestors(tree)
    q = len(tree) + 1
    assert inputs.input_ids.tolist() == [[pending, *tree.tokens.tolist()]]
    # position = L + depth, and depth = number of strict ancestors below the pending token
    assert inputs.position_ids.tolist() == [[past_length + len(row) - 1 for row in walked]]
    assert inputs.parent_index.tolist() == [[0, *(tree.parents + 1).tolist()]]
    assert inputs.ancestors.shape == (1, q, q) and inputs.ancestors.dtype == torch.bool
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        mask = inputs.attention_mask(dtype)
        assert mask.shape == (1, 1, q, past_length + q) and mask.dtype == dtype
        allowed = torch.zeros(q, past_length + q, dtype=torch.bool)
        allowed[:, :past_length] = True  # the whole cached prefix
        for i, row in enumerate(walked):
            allowed[i, [past_length + j for j in row]] = True
        expected = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
        assert torch.equal(mask[0, 0], expected)


def test_mask_keeps_batch_dimension() -> None:
    ancestors = torch.rand(3, 5, 5) > 0.5
    mask = tree_attention_mask(ancestors, 4, torch.float32)
    assert mask.shape == (3, 1, 5, 9)
    assert torch.equal(mask[:, 0, :, 4:] == 0, ancestors)


def plain_last_logits(model: PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    """float [V]: the next-token logits after ``tokens`` with ordinary causal attention, no cache."""
    return model(input_ids=torch.tensor([list(tokens)])).logits[0, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_tree_forward_equals_per_path_forward(family: str, attn: str) -> None:
    """Every flat position of one tree forward gets the logits of its own path decoded plainly."""
    model = tiny_causal_lm(family, attn)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, VOCAB, 9).tolist()
    paths = [rng.integers(0, VOCAB, rng.integers(1, 5)).tolist() for _ in range(6)]
    paths += [paths[0][:1] + rng.integers(0, VOCAB, 3).tolist()]  # a branch sharing a root child
    tree = tree_from_paths(paths)

    cache = new_cache(model)
    model(input_ids=torch.tensor([prefix[:-1]]), past_key_values=cache, use_cache=True)
    inputs = build_tree_inputs(prefix[-1], tree, len(prefix) - 1, "cpu")
    logits = tree_logits(model, cache, inputs)[0]  # [q, V]

    assert torch.allclose(logits[0], plain_last_logits(model, prefix), atol=1e-5)
    for i, path in enumerate(tree.paths(), start=1):
        assert torch.allclose(logits[i], plain_last_logits(model, prefix + list(path)), atol=1e-5), path
