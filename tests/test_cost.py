"""Tree selection against exhaustive search over prefix-closed subsets, and the cost model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.cost import BlockShape, CostKey, VerifyCost
from rest_spec.drafter.core.selection import select_batch_trees, select_chain, select_tree
from tests.tiers import examples

KEY = CostKey(model="synthetic", revision="", parameters=0, device="none", dtype="float32")


def cost_curve(seconds: list[float], chain_seconds: list[float] = ()) -> VerifyCost:
    return VerifyCost(KEY, 0, tuple(range(1, len(seconds) + 1)), tuple(seconds), tuple(chain_seconds))


@st.composite
def scored_trees(draw, max_nodes: int = 9) -> DraftTree:
    """Random BFS trees whose scores are products of per-edge probabilities (so they never grow
    down a path), as merged trees are."""
    n = draw(st.integers(0, max_nodes))
    parents = sorted(draw(st.integers(-1, i - 1)) for i in range(n))  # sorted parents: BFS order
    scores: list[float] = []
    for p in parents:
        edge = draw(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.9, 1.0]))
        scores.append(edge * (scores[p] if p >= 0 else 1.0))
    return DraftTree(np.arange(n), np.array(parents), np.ones(n), scores=np.array(scores))


def rate(tree: DraftTree, kept: list[int], cost: VerifyCost) -> float:
    return (1 + tree.scores[kept].sum()) / float(cost(1 + len(kept)))


def is_root_path(tree: DraftTree, kept: set[int]) -> bool:
    """Whether ``kept`` is one path down from the root (a chain, verified on the causal path)."""
    return all(sum(1 for j in kept if tree.parents[j] == parent) <= 1 for parent in [-1, *kept])


@settings(max_examples=examples(300), deadline=None)
@given(
    tree=scored_trees(),
    times=st.lists(st.tuples(st.floats(0.5, 5.0), st.floats(0.5, 5.0)), min_size=1, max_size=12),
    max_depth=st.none() | st.integers(1, 4),
)
def test_select_tree_is_the_best_prefix_closed_subset(tree, times, max_depth):
    """Exhaustive search: every prefix-closed subset at the tree cost, and every root path also at
    the chain cost."""
    tree_cost = cost_curve([t for t, _ in times])
    chain_times = [times[0][0]] + [c for _, c in times[1:]]  # no draft: one step, one time
    cost = cost_curve([t for t, _ in times], chain_times)
    chain_cost = cost_curve(chain_times)
    chosen = select_tree(tree, cost, max_depth)
    best = 0.0
    for size in range(len(tree) + 1):
        for subset in itertools.combinations(range(len(tree)), size):
            kept = set(subset)
            if all(tree.parents[i] < 0 or tree.parents[i] in kept for i in kept) and (
                max_depth is None or all(tree.depths[i] <= max_depth for i in kept)
            ):
                best = max(best, rate(tree, list(subset), tree_cost))
                if is_root_path(tree, kept):
                    best = max(best, rate(tree, list(subset), chain_cost))
    chosen_rate = rate(chosen, list(range(len(chosen))), tree_cost)
    if is_root_path(chosen, set(range(len(chosen)))):
        chosen_rate = max(chosen_rate, rate(chosen, list(range(len(chosen))), chain_cost))
    assert chosen_rate == pytest.approx(best, rel=1e-12)
    assert set(chosen.paths()) <= set(tree.paths())
    assert max_depth is None or chosen.max_depth <= max_depth


@settings(max_examples=examples(300), deadline=None)
@given(
    tree=scored_trees(),
    times=st.lists(st.floats(0.5, 5.0), min_size=1, max_size=12),
    max_depth=st.none() | st.integers(1, 4),
)
def test_select_chain_is_the_best_root_path(tree, times, max_depth):
    """Exhaustive search over every root path (and none) at the chain cost; the tree cost is
    ignored (an engine that verifies chains only)."""
    cost = cost_curve([9.0] * len(times), times)
    chosen = select_chain(tree, cost, max_depth)
    assert chosen.is_chain()
    paths = [[]] + [
        tree.path_to(node).tolist() for node in range(len(tree)) if max_depth is None or tree.depths[node] <= max_depth
    ]
    chain_cost = cost_curve(times)
    best = max(rate(tree, path, chain_cost) for path in paths)
    assert rate(chosen, list(range(len(chosen))), chain_cost) == pytest.approx(best, rel=1e-12)
    assert set(chosen.paths()) <= set(tree.paths())
    if len(chosen):  # a draft only where it beats verifying the pending token alone
        assert rate(chosen, list(range(len(chosen))), chain_cost) > 1 / times[0]


@settings(max_examples=examples(200), deadline=None)
@given(
    trees=st.lists(scored_trees(max_nodes=6), min_size=1, max_size=4),
    steps=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=24),
)
def test_a_batch_keeps_each_rows_best_nodes_at_the_width_that_pays_most(trees, steps):
    """Rows verified in one padded block: every row cut to its best w nodes (prefix-closed), w
    the common width of the highest (rows + kept scores) / t(rows x (1 + w)) of all widths."""
    cost = cost_curve(list(np.cumsum([1.0, *steps])))  # t(n) never decreases
    chosen = select_batch_trees(trees, cost)
    if len(trees) == 1:
        assert chosen == trees
        return
    width = max(len(tree) for tree in chosen)
    for tree, kept in zip(trees, chosen):
        assert set(kept.paths()) <= set(tree.paths()) and len(kept) == min(len(tree), width)
        best = np.sort(tree.scores)[::-1][: len(kept)]
        assert np.allclose(np.sort(kept.scores)[::-1], best)  # its best-scored nodes

    def batch_rate(w: int) -> float:
        gain = sum(np.sort(tree.scores)[::-1][:w].sum() for tree in trees)
        return (len(trees) + gain) / float(cost(len(trees) * (1 + w)))

    widest = max((len(tree) for tree in trees), default=0)
    assert batch_rate(width) >= max(batch_rate(w) for w in range(widest + 1)) * (1 - 1e-12)


def test_select_chain_drafts_nothing_from_an_empty_tree_or_when_nothing_pays():
    linear = cost_curve([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert len(select_chain(DraftTree.empty(), linear)) == 0
    sure = DraftTree(np.array([5, 6]), np.array([-1, 0]), np.ones(2), scores=np.array([1.0, 1.0]))
    assert len(select_chain(sure, linear)) == 0  # 3 tokens in 3 steps' time: no gain, so no draft
    cheaper = cost_curve([1.0, 1.5, 2.0], [1.0, 1.5, 2.0])
    assert select_chain(sure, cheaper).tokens.tolist() == [5, 6]


def test_a_cheap_causal_path_picks_the_deep_chain_over_the_bushy_tree():
    #            1 (0.9) - 3 (0.8) - 4 (0.7)
    #            2 (0.6)
    tree = DraftTree(
        np.array([1, 2, 3, 4]), np.array([-1, -1, 0, 2]), np.ones(4), scores=np.array([0.9, 0.6, 0.8, 0.7])
    )
    same = cost_curve([1.0, 1.2, 1.4, 1.6, 1.8])
    assert select_tree(tree, same).paths() == [(1,), (2,), (1, 3), (1, 3, 4)]  # all of it
    cheap_chains = cost_curve([1.0, 1.2, 1.4, 1.6, 1.8], [1.0, 1.1, 1.2, 1.3, 1.4])
    assert select_tree(tree, cheap_chains).paths() == [(1,), (1, 3), (1, 3, 4)]


def test_nothing_is_drafted_when_no_draft_pays_for_itself():
    tree = DraftTree(np.array([1, 2]), np.array([-1, -1]), np.ones(2), scores=np.array([0.1, 0.05]))
    linear = cost_curve([1.0, 2.0, 3.0])  # each token costs as much as a whole step
    assert len(select_tree(tree, linear)) == 0
    flat = cost_curve([1.0, 1.0, 1.0])
    assert select_tree(tree, flat).paths() == [(1,), (2,)]


def test_flat_cost_keeps_every_useful_node_and_no_useless_one():
    tree = DraftTree(np.array([1, 2, 3]), np.array([-1, -1, 0]), np.ones(3), scores=np.array([0.5, 0.0, 0.2]))
    assert select_tree(tree, cost_curve([1.0] * 8)).paths() == [(1,), (1, 3)]


def chain_of(nodes: int) -> DraftTree:
    return DraftTree(np.arange(nodes), np.arange(-1, nodes - 1), np.ones(nodes))


def bushy(nodes: int) -> DraftTree:
    return DraftTree(np.arange(nodes), np.full(nodes, -1), np.ones(nodes))


def test_cost_pads_to_a_cheaper_larger_block_interpolates_and_extrapolates():
    cost = VerifyCost(KEY, 0, (1, 2, 4, 8), (1.0, 2.0, 1.5, 3.0))  # 4 tokens run faster than 2
    np.testing.assert_allclose(cost(np.array([1, 2, 3, 4, 6, 8, 12])), [1.0, 1.5, 1.5, 1.5, 2.25, 3.0, 4.5])
    assert [cost.block_shape([bushy(k - 1)]).size for k in (1, 2, 3, 4, 6, 8, 12)] == [1, 4, 4, 4, 6, 8, 12]
    assert float(cost.chain(2)) == 1.5  # chains not measured: they cost what trees cost
    chains = VerifyCost(KEY, 0, (1, 2, 4, 8), (1.0, 2.0, 1.5, 3.0), (1.0, 1.2, 1.5, 2.0))
    np.testing.assert_allclose(chains.chain(np.array([2, 3, 16])), [1.2, 1.35, 3.0])
    assert chains.block_shape([chain_of(2)]).size == 3  # a chain is sized by the chain times
    assert chains.block_shape([bushy(2)]).size == 4
    assert chains.block_shape([bushy(2), bushy(2)]).size == 3  # a batch runs its own block
    for each in (cost, chains):
        assert VerifyCost.from_json(each.to_json()) == each


def test_block_shape_takes_the_layout_measured_for_the_rows_the_linear_layers_see():
    cost = VerifyCost(KEY, 0, (1, 2, 4, 8), (1.0, 0.6, 0.8, 1.2), transposed=(False, True, True, False))
    assert cost.block_shape([DraftTree.empty()]) == BlockShape(2, True)  # padded past the slow 1-row step
    assert cost.block_shape([bushy(5)]) == BlockShape(6, True)  # largest measured size <= 6 rows: 4
    assert cost.block_shape([bushy(2)] * 3) == BlockShape(3, False)  # 9 rows: as measured at 8
    assert VerifyCost.from_json(cost.to_json()) == cost
    assert VerifyCost(KEY, 0, (1, 2), (1.0, 0.5)).block_shape([DraftTree.empty()]) == BlockShape(2, False)


@settings(max_examples=examples(200), deadline=None)
@given(times=st.lists(st.floats(0.5, 5.0), min_size=1, max_size=8), gaps=st.lists(st.integers(1, 4), max_size=7))
def test_cost_never_decreases_and_prices_the_block_it_runs(times, gaps):
    """Whatever the measured curve, the priced cost grows with n (a larger tree can always run at
    a smaller tree's padded block), and a padded block costs exactly what was measured there."""
    sizes = tuple(int(s) for s in np.cumsum([1, *gaps[: len(times) - 1]]))
    times = times[: len(sizes)]
    cost = VerifyCost(KEY, 0, sizes, tuple(times))
    n = np.arange(1, 2 * sizes[-1] + 2)
    priced = cost(n)
    assert np.all(np.diff(priced) >= -1e-12)
    for k, price in zip(n, priced):
        block = cost.block_shape([bushy(int(k) - 1)]).size
        assert block >= k
        if block > k:
            assert price == times[sizes.index(block)] < float(np.interp(k, sizes, times))


@pytest.mark.parametrize(
    ("sizes", "seconds", "message"),
    [
        ((2, 4), (1.0, 2.0), "start at 1"),
        ((1, 1), (1.0, 2.0), "increase strictly"),
        ((1, 2), (1.0, 0.0), "positive"),
        ((1, 2), (1.0,), "one positive time per size"),
    ],
)
def test_cost_refuses_bad_measurements(sizes, seconds, message):
    with pytest.raises(ValueError, match=message):
        VerifyCost(KEY, 0, sizes, seconds)
    if len(seconds) == len(sizes) and sizes[0] == 1 and sizes == tuple(sorted(set(sizes))):
        with pytest.raises(ValueError, match="chain_seconds must be one positive time per size"):
            VerifyCost(KEY, 0, sizes, (1.0,) * len(sizes), seconds)
        with pytest.raises(ValueError, match="transposed must be one bool per size"):
            VerifyCost(KEY, 0, sizes, (1.0,) * len(sizes), (), (True,) * (len(sizes) + 1))


def test_every_cost_answers_the_step_cost_interface():
    """``StepCost``: a one-row table prices one row's tree (a chain by the chain times) and a batch
    by its block padded to the widest row; ``BatchCost`` by rows and draft tokens; a corrected table
    learns from one-row steps only, at the shape it runs them; a table learns nothing."""
    from rest_spec.drafter.core.batch_cost import BatchCost
    from rest_spec.drafter.core.corrected_cost import CorrectedCost
    from rest_spec.drafter.core.cost import StepCost
    from tests.helpers import scored_chain, tree_from_paths

    table = cost_curve([1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2], chain_seconds=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6])
    batch = BatchCost()
    corrected = CorrectedCost(table)
    for cost in (table, corrected, batch):
        assert isinstance(cost, StepCost)
    chain, tree = scored_chain([0.9, 0.5]), tree_from_paths([(3, 4), (5,)])
    assert table.step_seconds([]) == table.step_seconds([], rows=1) == table.step_seconds([DraftTree.empty()]) == 1.0
    assert table.step_seconds([chain]) == 1.2 and table.step_seconds([tree]) == 1.6  # 3 and 4 tokens
    assert table.step_seconds([chain, tree]) == table.step_seconds([tree, DraftTree.empty()]) == float(table(8))
    assert table.step_seconds([], rows=3) == 1.4
    assert corrected.step_seconds([tree]) == 1.6
    assert batch.step_seconds([chain, tree], rows=4) == float(batch.seconds(4, 5))
    assert batch.step_seconds([], rows=2) == batch.base(2)

    table.observe_step([tree], 9.0)  # nothing to learn
    corrected.observe_step([chain, tree], 9.0)  # a batch: nothing of one row's prices
    assert corrected.seen(corrected.block_shape([tree]), chain=False) == 0
    for _ in range(4):
        corrected.observe_step([tree], 3.2)
    assert corrected.seen(corrected.block_shape([tree]), chain=False) == 4 and corrected.step_seconds([tree]) == 3.2
    batch.observe_step([chain], 0.5, rows=3)  # the engine's first step of 5 tokens: its set-up, not counted
    assert batch.steps == 0
    batch.observe_step([chain], 0.5, rows=3)
    assert batch.steps == 1 and batch.base(3) == pytest.approx(0.5 - 2 * batch.per_token)
