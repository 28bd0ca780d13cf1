"""Acceptance against a brute-force greedy walk (one tree and padded batches of trees); KV
compaction against the cache a plain run builds, for one row and for batches whose rows have
different lengths and accept different paths; dropping finished rows; refusal of caches that
cannot be compacted by slot index."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DynamicCache, MistralConfig, PreTrainedModel, StaticCache

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.cost import BlockShape
from rest_spec.drafter.hf.generate import prefill
from rest_spec.drafter.hf.internals import forward_with_cache
from rest_spec.drafter.hf.kv_cache import (
    CacheRows,
    UnsupportedCacheError,
    cache_length,
    check_cache,
    compact_cache,
    new_cache,
    select_rows,
)
from rest_spec.drafter.hf.tree_attention import build_tree_inputs
from rest_spec.drafter.hf.verify import accept_path, greedy_rule, verify_trees
from tests.helpers import FAMILIES, tiny_causal_lm, tree_from_paths
from tests.helpers import MODEL_VOCAB as VOCAB
from tests.tiers import examples

SMALL_VOCAB = 3  # few token values, so random targets often match and paths get long


@st.composite
def trees_with_distinct_siblings(draw, max_nodes: int = 40) -> DraftTree:
    """Random parents-before-children trees whose siblings carry distinct tokens (as drafters
    guarantee), over a 3-token vocabulary."""
    n = draw(st.integers(0, max_nodes))
    tokens: list[int] = []
    parents: list[int] = []
    used: dict[int, set[int]] = {-1: set()}
    for i in range(n):
        open_parents = [p for p in range(-1, i) if len(used[p]) < SMALL_VOCAB]
        parent = draw(st.sampled_from(open_parents))
        token = draw(st.sampled_from(sorted(set(range(SMALL_VOCAB)) - used[parent])))
        used[parent].add(token)
        used[i] = set()
        tokens.append(token)
        parents.append(parent)
    return DraftTree(np.array(tokens), np.array(parents), np.ones(n))


def greedy_walk(tree: DraftTree, targets: Sequence[int]) -> tuple[list[int], int]:
    """Brute force: from the pending token, descend into the child whose token is the target at the
    current position until none is. Returns (flat positions visited, bonus token)."""
    path = [0]
    while True:
        children = [i + 1 for i in range(len(tree)) if tree.parents[i] + 1 == path[-1]]
        matching = [c for c in children if tree.tokens[c - 1] == targets[path[-1]]]
        if not matching:
            return path, int(targets[path[-1]])
        path.append(matching[0])


@settings(max_examples=examples(300), deadline=None)
@given(batch=st.lists(trees_with_distinct_siblings(), min_size=1, max_size=3), data=st.data())
def test_accept_path_matches_greedy_walk(batch: list[DraftTree], data: st.DataObject) -> None:
    """Per row of a padded batch: the accepted path and bonus of a brute-force walk; targets at
    padding positions are random too and must not matter."""
    q = max(len(tree) for tree in batch) + 1
    targets = [data.draw(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=q, max_size=q)) for _ in batch]
    inputs = build_tree_inputs([7] * len(batch), batch, CacheRows.full(len(batch), 5), "cpu")
    path, bonus = accept_path(inputs, torch.tensor(targets))
    for b, tree in enumerate(batch):
        expected_path, expected_bonus = greedy_walk(tree, targets[b])
        assert path[b].nonzero().flatten().tolist() == expected_path
        assert int(bonus[b]) == expected_bonus


def test_greedy_rule_is_argmax() -> None:
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, -1.0, 0.0]]])
    inputs = build_tree_inputs([0], [tree_from_paths([[1]])], CacheRows.full(1, 0), "cpu")
    assert greedy_rule(logits, inputs, [[0]]).tolist() == [[1, 0]]


# --- KV cache compaction -------------------------------------------------------------------------


def prefilled(model: PreTrainedModel, tokens: Sequence[int]) -> DynamicCache:
    """The cache plain decoding builds for ``tokens``: transformers' own ``DynamicCache``, causal
    attention, default positions."""
    cache = DynamicCache(config=model.config)
    forward_with_cache(model, cache, input_ids=torch.tensor([list(tokens)]))
    return cache


def assert_row_cache(actual: DynamicCache, rows: CacheRows, row: int, expected: DynamicCache) -> None:
    """Row ``row`` of ``actual`` holds, in its slots, exactly the single-row cache ``expected``."""
    span = slice(int(rows.start[row]), int(rows.end[row]))
    assert rows.end[row] - rows.start[row] == cache_length(expected)
    for got, want in zip(actual.layers, expected.layers, strict=True):
        assert torch.allclose(got.keys[row, :, span], want.keys[0], atol=1e-5)
        assert torch.allclose(got.values[row, :, span], want.values[0], atol=1e-5)


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Flat positions to keep for a path ending at ``node`` (-1: the pending token alone)."""
    keep = []
    while node >= 0:
        keep.insert(0, node + 1)
        node = int(tree.parents[node])
    return [0, *keep]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny_causal_lm(request.param)


@pytest.mark.parametrize("seed", range(4))
@torch.inference_mode()
def test_compacted_cache_equals_plain_run(model: PreTrainedModel, seed: int) -> None:
    """A batch of prefixes of different lengths (1 token: nothing cached), one tree each; each row
    keeps the path to some node (or none). Every row's slots must equal a plain run over its prefix
    + that path, twice in a row (the second step starts from a cache with holes)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, n).tolist() for n in (int(rng.integers(1, 8)), 1, 6)]
    cache = new_cache(model)
    rows = prefill(model, cache, prefixes)
    contexts = [list(p) for p in prefixes]
    for _ in range(2):
        trees = [
            tree_from_paths([rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist() for _ in range(5)])
            for _ in contexts
        ]
        verify_trees(model, cache, rows, contexts, trees)
        assert cache_length(cache) == rows.length + max(len(t) for t in trees) + 1
        nodes = [int(rng.integers(-1, len(tree))) for tree in trees]
        rows = compact_cache(cache, rows, [np.array(path_to(t, n)) for t, n in zip(trees, nodes)])
        assert cache_length(cache) == rows.length
        for b, (tree, node) in enumerate(zip(trees, nodes)):
            contexts[b] += list(tree.paths()[node]) if node >= 0 else []
            assert_row_cache(cache, rows, b, prefilled(model, contexts[b]))
            contexts[b].append(int(rng.integers(VOCAB)))  # the next pending token


@torch.inference_mode()
def test_verify_then_compact_equals_plain_greedy(model: PreTrainedModel) -> None:
    """One step with a tree holding the true greedy continuation (and wrong siblings): the accepted
    tokens and bonus are plain greedy's next tokens, and the compacted cache is the plain one."""
    prefix = [11, 22, 33, 44, 55]
    greedy = list(prefix)
    for _ in range(5):
        greedy.append(int(model(input_ids=torch.tensor([greedy])).logits[0, -1].argmax()))
    future = greedy[len(prefix) :]
    wrong = [(t + 1) % VOCAB for t in future]
    tree = tree_from_paths([future[:3], future[:1] + wrong[1:3], wrong[:1], future[:3] + wrong[3:4]])

    cache = prefilled(model, prefix[:-1])
    rows = CacheRows.full(1, len(prefix) - 1)
    (verdict,) = verify_trees(model, cache, rows, [prefix], [tree])
    assert list(verdict.accepted_tokens) == future[:3]
    assert verdict.bonus_token == future[3]
    rows = compact_cache(cache, rows, [verdict.keep])
    assert_row_cache(cache, rows, 0, prefilled(model, prefix + future[:3]))


@pytest.mark.parametrize("shape", [BlockShape(6, False), BlockShape(4, True), BlockShape(8, True)])
@pytest.mark.parametrize("chain", [False, True])
@torch.inference_mode()
def test_a_padded_or_transposed_block_verifies_as_the_plain_one(
    model: PreTrainedModel, shape: BlockShape, chain: bool
) -> None:
    """The shapes the cost model may pick (padding, the other linear layout) accept the same path
    and bonus and leave the same cache as the block the tree fills."""
    prefix = [11, 22, 33, 44, 55]
    greedy = list(prefix)
    for _ in range(3):
        greedy.append(int(model(input_ids=torch.tensor([greedy])).logits[0, -1].argmax()))
    future = greedy[len(prefix) :]
    tree = tree_from_paths([future[:3]] if chain else [future[:2], [(future[0] + 1) % VOCAB]])
    verdicts, caches = [], []
    for each in (None, shape):
        cache = prefilled(model, prefix[:-1])
        rows = CacheRows.full(1, len(prefix) - 1)
        (verdict,) = verify_trees(model, cache, rows, [prefix], [tree], shape=each)
        assert cache_length(cache) == rows.length + (len(tree) + 1 if each is None else each.size)
        compact_cache(cache, rows, [verdict.keep])
        verdicts.append(verdict)
        caches.append(cache)
    assert verdicts[0].accepted_tokens == verdicts[1].accepted_tokens == tuple(future[: 3 if chain else 2])
    assert verdicts[0].bonus_token == verdicts[1].bonus_token and verdicts[0].keep.tolist() == verdicts[1].keep.tolist()
    assert_row_cache(caches[1], CacheRows.full(1, cache_length(caches[0])), 0, caches[0])


@torch.inference_mode()
def test_empty_tree_is_one_plain_step(model: PreTrainedModel) -> None:
    prefix = [3, 1, 4, 1, 5]
    cache = prefilled(model, prefix[:-1])
    (verdict,) = verify_trees(model, cache, CacheRows.full(1, len(prefix) - 1), [prefix], [DraftTree.empty()])
    assert verdict.accepted_tokens == ()
    assert verdict.bonus_token == int(model(input_ids=torch.tensor([prefix])).logits[0, -1].argmax())
    assert verdict.keep.tolist() == [0]


@torch.inference_mode()
def test_select_rows_keeps_rows_and_trims_unused_slots(model: PreTrainedModel) -> None:
    prefixes = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]
    cache = new_cache(model)
    rows = prefill(model, cache, prefixes)
    rows = select_rows(cache, rows, np.array([1, 2]))  # the longest row leaves: its padding goes too
    assert rows.start.tolist() == [1, 0] and rows.end.tolist() == [3, 3] and cache_length(cache) == 3
    for b, prefix in enumerate(prefixes[1:]):
        assert_row_cache(cache, rows, b, prefilled(model, prefix[:-1]))


def test_verify_refuses_a_cache_that_does_not_match_its_rows(model: PreTrainedModel) -> None:
    cache = prefilled(model, [1, 2, 3])
    with pytest.raises(ValueError, match="3 slots but its rows end at 2"):
        verify_trees(model, cache, CacheRows.full(1, 2), [[1, 2, 3]], [DraftTree.empty()])


@torch.inference_mode()
def test_reserved_layers_append_in_place_and_hold_what_concatenation_does(model: PreTrainedModel) -> None:
    """Step by step (prefill, one token, a block of 5, compaction, dropping a row), the project's
    cache holds exactly transformers' concatenating cache, and appends within its spare slots
    without moving: the buffer under ``keys`` stays the same."""
    rng = np.random.default_rng(0)
    ours, theirs = new_cache(model), DynamicCache(config=model.config)
    for cache in (ours, theirs):
        check_cache(cache)
    positions = 0
    for width in (12, 1, 1, 5, 1):
        ids = torch.from_numpy(rng.integers(VOCAB, size=(2, width)))
        before = ours.layers[0].keys.data_ptr() if positions else None
        for cache in (ours, theirs):
            forward_with_cache(model, cache, input_ids=ids)
        positions += width
        if before is not None:
            assert ours.layers[0].keys.data_ptr() == before
        for got, want in zip(ours.layers, theirs.layers, strict=True):
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        if width == 5:  # keep the pending token and two of the block's slots, as a verification would
            rows = CacheRows.full(2, positions - width)
            keep = [np.array([0, 2]), np.array([0, 1, 3])]
            ours_rows = compact_cache(ours, rows, keep)
            compact_cache(theirs, rows, keep)
            positions = ours_rows.length
    select_rows(ours, CacheRows.full(2, positions), np.array([1]))
    select_rows(theirs, CacheRows.full(2, positions), np.array([1]))
    ids = torch.from_numpy(rng.integers(VOCAB, size=(1, 3)))
    for cache in (ours, theirs):
        forward_with_cache(model, cache, input_ids=ids)
    for got, want in zip(ours.layers, theirs.layers, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


# --- refused caches ------------------------------------------------------------------------------


def test_sliding_window_layers_are_refused() -> None:
    config = MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        sliding_window=4,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedCacheError, match="sliding-window"):
        new_cache(model)


def test_non_dynamic_cache_is_refused(model: PreTrainedModel) -> None:
    with pytest.raises(UnsupportedCacheError, match="DynamicCache"):
        check_cache(StaticCache(config=model.config, max_cache_len=16))
