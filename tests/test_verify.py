"""Acceptance against a brute-force greedy walk; KV compaction against the cache a plain run
builds; refusal of caches that cannot be compacted by slot index."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DynamicCache, MistralConfig, PreTrainedModel, StaticCache

from datastore.types import DraftTree
from drafter.kv_cache import UnsupportedCacheError, cache_length, check_cache, compact_cache, new_cache
from drafter.tree_attention import build_tree_inputs
from drafter.verify import accept_path, greedy_rule, verify_tree
from tests.helpers import FAMILIES, tiny_causal_lm, tree_from_paths
from tests.helpers import MODEL_VOCAB as VOCAB

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


@settings(max_examples=300, deadline=None)
@given(tree=trees_with_distinct_siblings(), data=st.data())
def test_accept_path_matches_greedy_walk(tree: DraftTree, data: st.DataObject) -> None:
    q = len(tree) + 1
    targets = data.draw(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=q, max_size=q))
    inputs = build_tree_inputs(pending_token=7, tree=tree, past_length=5, device="cpu")
    path, bonus = accept_path(inputs, torch.tensor([targets]))
    expected_path, expected_bonus = greedy_walk(tree, targets)
    assert path[0].nonzero().flatten().tolist() == expected_path
    assert bonus.tolist() == [expected_bonus]


def test_greedy_rule_is_argmax() -> None:
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, -1.0, 0.0]]])
    assert greedy_rule(logits).tolist() == [[1, 0]]


# --- KV cache compaction -------------------------------------------------------------------------


def prefilled(model: PreTrainedModel, tokens: Sequence[int]) -> DynamicCache:
    """A cache holding ``tokens`` run plainly (causal attention, default positions)."""
    cache = new_cache(model)
    model(input_ids=torch.tensor([list(tokens)]), past_key_values=cache, use_cache=True)
    return cache


def assert_same_cache(actual: DynamicCache, expected: DynamicCache) -> None:
    assert cache_length(actual) == cache_length(expected)
    for got, want in zip(actual.layers, expected.layers, strict=True):
        assert torch.allclose(got.keys, want.keys, atol=1e-5)
        assert torch.allclose(got.values, want.values, atol=1e-5)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny_causal_lm(request.param)


@pytest.mark.parametrize("seed", range(4))
@torch.inference_mode()
def test_compacted_cache_equals_plain_run(model: PreTrainedModel, seed: int) -> None:
    """Keep the path to any node: the cache must equal a plain run over prefix + that path."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist()
    tree = tree_from_paths([rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist() for _ in range(8)])
    for node in (len(tree) - 1, int(rng.integers(len(tree))), 0):
        cache = prefilled(model, prefix[:-1]) if len(prefix) > 1 else new_cache(model)
        past_length = len(prefix) - 1
        verify_tree(model, cache, prefix[-1], tree)
        assert cache_length(cache) == past_length + len(tree) + 1
        keep = [0]  # the pending token, then the path root -> node
        parent = node
        while parent >= 0:
            keep.insert(1, parent + 1)
            parent = int(tree.parents[parent])
        compact_cache(cache, past_length, keep)
        path = list(tree.paths()[node])
        assert_same_cache(cache, prefilled(model, prefix + path))


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
    verdict = verify_tree(model, cache, prefix[-1], tree)
    assert list(verdict.accepted_tokens) == future[:3]
    assert verdict.bonus_token == future[3]
    compact_cache(cache, len(prefix) - 1, verdict.keep)
    assert_same_cache(cache, prefilled(model, prefix + future[:3]))


@torch.inference_mode()
def test_empty_tree_is_one_plain_step(model: PreTrainedModel) -> None:
    prefix = [3, 1, 4, 1, 5]
    cache = prefilled(model, prefix[:-1])
    verdict = verify_tree(model, cache, prefix[-1], DraftTree.empty())
    assert verdict.accepted_tokens == ()
    assert verdict.bonus_token == int(model(input_ids=torch.tensor([prefix])).logits[0, -1].argmax())
    assert verdict.keep.tolist() == [0]


# --- refused caches ------------------------------------------------------------------------------


def test_sliding_window_layers_are_refused() -> None:
    config = MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, sliding_window=4,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedCacheError, match="sliding-window"):
        new_cache(model)


def test_non_dynamic_cache_is_refused(model: PreTrainedModel) -> None:
    with pytest.raises(UnsupportedCacheError, match="DynamicCache"):
        check_cache(StaticCache(config=model.config, max_cache_len=16))
