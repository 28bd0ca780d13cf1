"""benchmarks.merge_rules: the published merge rules on hand-made source trees, and every drafter
replayed over a real index."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import merge_rules
from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.datastore.bigram import SEP
from rest_spec.datastore.trie import top_c_tree
from tests.test_adaptive import CPU_COST

CONFIG = DraftConfig(budget=4)


def counted_tree(continuations: list[list[int]], match_len: int = 2) -> DraftTree:
    """A source tree as the engines build it: ``top_c_tree`` over the continuations."""
    width = max(map(len, continuations))
    rows = np.full((len(continuations), width), SEP, dtype=np.uint32)
    for row, continuation in zip(rows, continuations):
        row[: len(continuation)] = continuation
    return DraftTree(*top_c_tree(rows, SEP, 64), match_len, len(rows), len(rows))


def test_arctic_keeps_the_source_tree_expecting_most_tokens():
    """One deep certain path (expects 3 tokens) beats three shallow guesses (expect 1 token)."""
    deep = counted_tree([[1, 2, 3]] * 4)
    wide = counted_tree([[5], [6], [7]])
    kept = merge_rules.arctic({"index": wide, "request": deep, "outputs": DraftTree.empty()}, CONFIG)
    assert kept.paths() == [(1,), (1, 2), (1, 2, 3)]


def test_sglang_ranks_the_more_specific_source_first():
    """Equal confidence, so the source that matched a longer suffix wins the budget."""
    specific = counted_tree([[1, 2], [3, 4]], match_len=8)
    vague = counted_tree([[5, 6], [7, 8]], match_len=2)
    kept = merge_rules.sglang({"index": vague, "request": specific, "outputs": DraftTree.empty()}, CONFIG)
    assert set(kept.paths()) == {(1,), (1, 2), (3,), (3, 4)}
    has_parent = kept.parents >= 0
    assert np.all(kept.scores <= 1) and np.all(kept.scores[has_parent] <= kept.scores[kept.parents[has_parent]])


def test_llama_cpp_falls_back_by_tier_and_boosts_what_the_static_cache_knows():
    """The request's tree is the tier while it has nodes; among its nodes the one the static
    (two-token) tree also proposes outranks a more frequent one it does not."""
    request = counted_tree([[1], [1], [1], [2]])
    static = counted_tree([[2]])
    sources = {"index": counted_tree([[9]]), "request": request, "outputs": counted_tree([[8]])}
    assert merge_rules.llama_cpp(sources, DraftConfig(budget=1), static).paths() == [(2,)]
    sources["request"] = DraftTree.empty()
    assert merge_rules.llama_cpp(sources, CONFIG, static).paths() == [(8,)]  # outputs before the index


def test_top_by_is_prefix_closed_even_when_a_child_outscores_its_parent():
    tree = counted_tree([[1, 2], [3]])
    kept = merge_rules.top_by(tree, np.array([0.1, 0.5, 0.9]), 2)  # nodes (1,), (3,), (1, 2)
    assert kept.paths() == [(1,), (3,)]
    np.testing.assert_allclose(kept.scores, [0.1, 0.5])


@pytest.fixture(scope="module")
def example(stdlib_index):
    """A prompt and its "output": a stretch of a real stdlib document, so the index has matches."""
    from rest_spec.datastore.index import Datastore

    with Datastore.open(stdlib_index) as store:
        document = next(d for d in store.documents() if len(d) > 200).tolist()
    return document[:80], document[80:140]


def test_every_drafter_replays_on_a_real_index_within_the_budget(stdlib_index, example):
    results = merge_rules.run_set([example], stdlib_index, DraftConfig(budget=16), CPU_COST)
    assert set(results) == {*merge_rules.drafters(DraftConfig(), CPU_COST), "rest"}
    for label, row in results.items():
        assert row["mean_accepted"] >= 1, label
        assert label == "rest" or row["verified_per_step"] <= 17, label
    # the shorter suffixes add candidates: at a fixed budget, as many or more nodes are verified
    assert results["ours+suffixes"]["verified_per_step"] >= results["ours"]["verified_per_step"]
