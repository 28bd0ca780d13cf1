"""Trees -> tensors: ancestor matrix, positions, paths and 4D masks against explicit ancestor walks,
for one tree and for padded batches of trees over left-padded caches with holes; and the tree
forward against plain per-path forwards on tiny models (sdpa and eager attention), alone and in a
batch whose rows have different prefix lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from rest_spec.common.types import DraftTree
from rest_spec.drafter.hf.generate import prefill
from rest_spec.drafter.hf.kv_cache import CacheRows, new_cache
from rest_spec.drafter.hf.tree_attention import PADDING_DEPTH, ancestor_matrix, build_tree_inputs, padded_prefill_mask
from rest_spec.drafter.hf.verify import tree_logits
from tests.helpers import FAMILIES, tiny_causal_lm, tree_from_paths
from tests.helpers import MODEL_VOCAB as VOCAB
from tests.tiers import examples


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


@settings(max_examples=examples(200), deadline=None)
@given(tree=trees())
def test_ancestor_matrix_matches_walk(tree: DraftTree) -> None:
    matrix = ancestor_matrix(tree.parents, tree.depths)
    assert matrix.shape == (len(tree) + 1,) * 2 and matrix.dtype == np.bool_
    assert [np.flatnonzero(row).tolist() for row in matrix] == walk_ancestors(tree)


@settings(max_examples=examples(100), deadline=None)
@given(tree=trees(), past_length=st.integers(0, 20), pending=st.integers(0, VOCAB - 1))
def test_tree_inputs_match_walk(tree: DraftTree, past_length: int, pending: int) -> None:
    inputs = build_tree_inputs([pending], [tree], CacheRows.full(1, past_length), "cpu")
    walked = walk_ancestors(tree)
    q = len(tree) + 1
    assert inputs.input_ids.tolist() == [[pending, *tree.tokens.tolist()]]
    # position = L + depth, and depth = number of strict ancestors below the pending token
    assert inputs.position_ids.tolist() == [[past_length + len(row) - 1 for row in walked]]
    assert inputs.depths.tolist() == [[len(row) - 1 for row in walked]]
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
    paths = tree.paths()
    for depth in range(tree.max_depth + 1):
        positions, tokens = inputs.paths(0, depth)
        assert positions.tolist() == [i for i, row in enumerate(walked) if len(row) - 1 == depth]
        assert [tuple(t) for t in tokens.tolist()] == [paths[i - 1] if i else () for i in positions]


@settings(max_examples=examples(50), deadline=None)
@given(
    batch=st.lists(st.tuples(trees(max_nodes=12), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
    holes=st.integers(0, 3),
)
def test_batch_inputs_pad_trees_and_hide_padding_and_holes(batch, holes: int) -> None:
    """Rows with different trees, left padding and trailing holes: every row's positions count its
    own tokens, its mask shows exactly its own cached slots and ancestors, and padding positions
    see only themselves (and their row's cache) and are seen by no one."""
    tree_list = [tree for tree, _, _ in batch]
    start = np.array([pad for _, pad, _ in batch])
    end = start + np.array([tokens for _, _, tokens in batch])
    end[0] += holes  # make sure the longest row is not every row
    rows = CacheRows(start, end)
    past = rows.length
    inputs = build_tree_inputs(list(range(len(batch))), tree_list, rows, "cpu")
    q = max(len(t) for t in tree_list) + 1
    mask = inputs.attention_mask(torch.float32)
    assert mask.shape == (len(batch), 1, q, past + q)
    for b, tree in enumerate(tree_list):
        walked = walk_ancestors(tree)
        n = len(tree) + 1
        assert inputs.position_ids[b, :n].tolist() == [end[b] - start[b] + len(row) - 1 for row in walked]
        assert inputs.depths[b, n:].tolist() == [PADDING_DEPTH] * (q - n)
        allowed = torch.zeros(q, past + q, dtype=torch.bool)
        allowed[:, start[b] : end[b]] = True
        for i, row in enumerate(walked):
            allowed[i, [past + j for j in row]] = True
        for i in range(n, q):
            allowed[i, past + i] = True
        assert torch.equal(mask[b, 0] == 0, allowed)


@settings(max_examples=examples(100), deadline=None)
@given(
    batch=st.lists(st.tuples(trees(max_nodes=6), st.integers(0, 2), st.integers(1, 4)), min_size=1, max_size=3),
    chains=st.booleans(),
)
def test_causal_exactly_when_the_mask_is_plain_causal(batch, chains: bool) -> None:
    """``TreeInputs.causal`` (the verifier then drops the custom mask) holds iff, for every
    position that is not padding, the mask is ordinary causal attention over the whole cache (what
    padding sees is never used, and no other position sees padding)."""
    if chains:  # make chains likely: hypothesis rarely draws them
        batch = [(tree_from_paths([[7] * len(tree)] if len(tree) else []), pad, tokens) for tree, pad, tokens in batch]
    start = np.array([pad for _, pad, _ in batch])
    rows = CacheRows(start, start + np.array([tokens for _, _, tokens in batch]))
    inputs = build_tree_inputs([0] * len(batch), [tree for tree, _, _ in batch], rows, "cpu")
    q, past = inputs.input_ids.shape[1], rows.length
    causal = torch.ones(q, past + q, dtype=torch.bool).tril(diagonal=past)
    agrees = (inputs.attention_mask(torch.float32)[:, 0] == 0) == causal  # [B, q, S + q]
    assert inputs.causal == bool(agrees[inputs.depths >= 0].all())


def test_a_block_pads_to_the_size_asked_and_refuses_a_smaller_one() -> None:
    tree = tree_from_paths([[5, 6], [7]])
    inputs = build_tree_inputs([1], [tree], CacheRows.full(1, 4), "cpu", size=8)
    assert inputs.input_ids.shape == (1, 8) and inputs.depths[0, 4:].tolist() == [-1] * 4
    assert not inputs.causal  # a branching tree keeps its mask
    chain = build_tree_inputs([1], [tree_from_paths([[5, 6]])], CacheRows.full(1, 4), "cpu", size=6)
    assert chain.causal  # a chain padded at its end still runs on the causal path
    with pytest.raises(ValueError, match="cannot hold a tree of 3 nodes"):
        build_tree_inputs([1], [tree], CacheRows.full(1, 4), "cpu", size=3)


def test_padded_prefill_mask_is_causal_after_each_rows_start() -> None:
    mask = padded_prefill_mask(torch.tensor([0, 2]), 4, torch.float32) == 0
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.equal(mask[0, 0], causal)
    assert torch.equal(mask[1, 0], causal & torch.tensor([False, False, True, True]))


def plain_last_logits(model: PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    """float [V]: the next-token logits after ``tokens`` with ordinary causal attention, no cache."""
    return model(input_ids=torch.tensor([list(tokens)])).logits[0, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_tree_forward_equals_per_path_forward(family: str, attn: str) -> None:
    """Every flat position of one batched tree forward gets the logits of its own path decoded
    plainly; the rows' prefixes have different lengths (left padding) and trees different sizes."""
    model = tiny_causal_lm(family, attn)
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(0, VOCAB, n).tolist() for n in (9, 1, 4)]
    trees = []
    for size in (6, 2, 0):
        paths = [rng.integers(0, VOCAB, rng.integers(1, 5)).tolist() for _ in range(size)]
        paths += [paths[0][:1] + rng.integers(0, VOCAB, 3).tolist()] if paths else []  # a shared root child
        trees.append(tree_from_paths(paths))

    cache = new_cache(model)
    rows = prefill(model, cache, prefixes)
    inputs = build_tree_inputs([p[-1] for p in prefixes], trees, rows, "cpu")
    logits = tree_logits(model, cache, inputs)  # [B, q, V]

    for b, (prefix, tree) in enumerate(zip(prefixes, trees)):
        assert torch.allclose(logits[b, 0], plain_last_logits(model, prefix), atol=1e-5)
        for i, path in enumerate(tree.paths(), start=1):
            assert torch.allclose(logits[b, i], plain_last_logits(model, prefix + list(path)), atol=1e-5), path


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_chain_takes_the_causal_path_with_the_same_logits(family: str, attn: str) -> None:
    """A chain on a whole cache is verified without a custom mask, and every position still gets
    the logits of its own prefix decoded plainly."""
    model = tiny_causal_lm(family, attn)
    prefix, chain = [3, 1, 4, 1, 5], [9, 2, 6, 5]
    cache = new_cache(model)
    rows = prefill(model, cache, [prefix])
    inputs = build_tree_inputs([prefix[-1]], [tree_from_paths([chain])], rows, "cpu")
    assert inputs.causal
    logits = tree_logits(model, cache, inputs)
    for i in range(len(chain) + 1):
        assert torch.allclose(logits[0, i], plain_last_logits(model, prefix + chain[:i]), atol=1e-5), i
