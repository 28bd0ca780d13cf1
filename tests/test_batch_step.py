"""The compiled batch step (``drafter.core.batch_step``) against the per-row Python path it
replaced: ``merge_trees`` per row, ``select_chain`` on each merged tree; the growing sources'
compiled match against the numpy one it replaced; and the index's compiled batch draft against
the three steps a router composes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.datastore.bigram import SEP, BigramIndex
from rest_spec.datastore.index import Datastore, plan_draft, query_matrix, query_tokens, tree_from_rows
from rest_spec.datastore.trie import counted_tree
from rest_spec.drafter.core.batch_step import merge_rows
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import (
    MATCH_LENGTH_EDGES,
    Attribution,
    MergedTree,
    SourceCalibration,
    TreeNodes,
    length_class,
    merge_trees,
    sample_class,
)
from rest_spec.drafter.core.selection import select_chain
from tests.helpers import write_index
from tests.test_merge import source_trees
from tests.tiers import examples

maybe_empty = st.one_of(st.just(DraftTree.empty()), source_trees)


def chain_cost(seconds: list[float]) -> VerifyCost:
    """A verify cost whose chain of n tokens costs ``seconds[n - 1]``."""
    sizes = tuple(range(1, len(seconds) + 1))
    return VerifyCost(CostKey("test", "", 1, "cpu", "float32"), 256, sizes, tuple(seconds))


@settings(max_examples=examples(300), deadline=None)
@given(
    rows=st.integers(1, 6).flatmap(
        lambda s: st.lists(st.lists(maybe_empty, min_size=s, max_size=s), min_size=1, max_size=5)
    ),
    budget=st.integers(0, 30),
    data=st.data(),
)
def test_batch_step_equals_the_per_row_merge_and_chain(rows, budget, data):
    num_sources, depth = len(rows[0]), 6
    calibration = SourceCalibration(
        num_sources, prior=data.draw(st.lists(st.floats(0.1, 3.0), min_size=num_sources, max_size=num_sources))
    )
    match_len = np.array([[data.draw(st.integers(0, 20)) for _ in row] for row in rows])
    weights = calibration.weights_for(match_len, depth)
    # a rising chain cost: 1 token 1.0, then each draft token a random share of a step more
    seconds = np.cumsum([1.0, *data.draw(st.lists(st.floats(0.0, 1.5), min_size=depth, max_size=depth))])
    cost = chain_cost(seconds.tolist())
    merged, chains = merge_rows(rows, weights, budget, np.asarray(cost.chain(np.arange(1, depth + 2))))
    assert len(merged) == len(chains) == len(rows)
    for r, row in enumerate(rows):
        if not any(len(tree) for tree in row) or budget == 0:
            assert len(merged[r]) == 0 and len(chains[r]) == 0
            continue
        expected = merge_trees(row, weights[r], budget)
        assert isinstance(merged[r], MergedTree) and merged[r] == expected
        assert np.array_equal(merged[r].depths, expected.depths)
        assert merged[r].max_depth == int(expected.depths.max())  # the batch's, set for all rows at once
        assert chains[r] == select_chain(expected, cost)
        assert np.array_equal(chains[r].depths, np.arange(1, len(chains[r]) + 1))
    # without prices: the merged trees alone
    alone, none = merge_rows(rows, weights, budget)
    assert none is None and all(a == m for a, m in zip(alone, merged))


def test_batch_step_refuses_ragged_rows():
    tree = DraftTree(np.array([5], np.int32), np.array([-1], np.int32), np.array([1], np.int64), 1, 1, 1)
    weights = SourceCalibration(2).weights_for(np.array([[1, 0], [1, 0]]), 2)
    with pytest.raises(ValueError, match="every row needs 2 source trees"):
        merge_rows([[tree, tree], [tree]], weights, 4)


def reference_draft(index: BigramIndex, query: np.ndarray, config: DraftConfig, first: int, cap: int) -> DraftTree:
    """``BigramIndex.draft`` as it was written in numpy, before it was compiled."""
    if query.size < 2:
        return DraftTree.empty()
    key = np.uint64((int(query[1]) << 32) | int(query[0]))
    lo, hi = np.searchsorted(index._keys, key, "left"), np.searchsorted(index._keys, key, "right")
    tail = index._tail_ends[: index._tail_len][index._tail_keys[: index._tail_len] == key]
    ends = np.concatenate((index._ends[lo:hi], tail))
    ends = ends[ends >= first]
    match_len = 2 if ends.size else 0
    for j in range(2, query.size):
        longer = ends[index.tokens[ends - j] == query[j]]
        if longer.size == 0:
            break
        ends, match_len = longer, j + 1
    if match_len == 0 or match_len < config.n_min:
        return DraftTree.empty()
    counted = ends[-cap:]
    rows = index.tokens[counted[:, None] + np.arange(1, config.max_depth + 1)]
    rows[np.maximum.accumulate(rows == SEP, axis=1)] = SEP
    return counted_tree(rows, SEP, config.budget, match_len, int(ends.size))


@settings(max_examples=examples(300), deadline=None)
@given(
    documents=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=6),
    appended=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=20), max_size=3),
    queries=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=10), min_size=1, max_size=6),
    first=st.integers(0, 40),
    cap=st.integers(1, 8),
    n_min=st.integers(1, 4),
    max_depth=st.integers(1, 8),
)
def test_compiled_bigram_match_equals_the_numpy_one(documents, appended, queries, first, cap, n_min, max_depth):
    """Each query alone (``draft``), and all of them in one batch, as the numpy reference drafts each."""
    joined = [token for document in documents for token in (*document, SEP)][:-1]
    index = BigramIndex(np.array(joined, np.uint32))
    for tokens in appended:  # the newest positions sit in the unsorted tail
        index.append(np.array(tokens, np.uint32))
    config = DraftConfig(n_min=n_min, max_depth=max_depth, budget=16)
    expected = [reference_draft(index, np.array(q, np.uint32), config, first, cap) for q in queries]
    assert [index.draft(np.array(q, np.uint32), config, first, cap) for q in queries] == expected
    matrix, lengths = query_matrix([q[::-1] for q in queries], 10, SEP)  # contexts: oldest first
    assert index.draft_batch(matrix, lengths, config, first, cap) == expected


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    docs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=60), min_size=1, max_size=10),
    contexts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=6),
    cap=st.integers(1, 6),
    budget=st.integers(1, 20),
    n_min=st.integers(1, 3),
)
def test_one_shards_compiled_batch_draft_equals_the_three_steps(tmp_path, docs, contexts, cap, budget, n_min):
    """``Datastore.draft_batch`` on one shard (one compiled pass over the rows) answers, row by row,
    what ``match``, ``plan_draft`` (its seeded sample above the cap) and ``tree_from_rows`` do: what
    a router and an index of several shards compute."""
    write_index(tmp_path / "idx", docs, vocab_size=4)
    config = DraftConfig(budget=budget, max_depth=5, n_max=6, n_min=n_min)
    with Datastore.open(tmp_path / "idx", max_candidates=cap) as store:
        expected = []
        for context in contexts:
            query = query_tokens(context, config.n_max, store.vocab_size)
            plan = plan_draft(store.match(query, n_min), query, n_min, cap)
            if plan is None:
                expected.append(DraftTree.empty())
                continue
            rows = plan.rows(lambda m, ranks: store.rows(m.shard, ranks, 5), 5, np.dtype(store.manifest.token_dtype))
            expected.append(tree_from_rows(rows, store.manifest.separator, budget, plan))
        assert store.draft_batch(contexts, config) == expected
        assert [store.draft(context, config) for context in contexts] == expected


def test_a_bad_context_in_a_batch_is_named():
    with pytest.raises(ValueError, match=r"context\[1\] = 9 is outside the vocabulary \[0, 5\)"):
        query_matrix([[1, 2], [3, 9]], 4, 5)
    with pytest.raises(ValueError, match="non-empty"):
        query_matrix([[1, 2], []], 4, 5)
    with pytest.raises(ValueError, match="integer"):
        query_matrix([[1, 2], [1.5]], 4, 5)


def with_match_len(tree: DraftTree, match_len: int) -> DraftTree:
    return DraftTree(tree.tokens, tree.parents, tree.counts, match_len, tree.num_matches, tree.num_sampled)


# a step's rows: each two sources' trees (with their match lengths) and the tokens that followed
counted_rows = st.lists(
    st.tuples(
        st.lists(st.tuples(source_trees, st.integers(0, 20)), min_size=2, max_size=2),
        st.lists(st.integers(0, 3), max_size=6),
    ),
    min_size=1,
    max_size=6,
)


def merged_and_followed(rows) -> tuple[list[MergedTree], list[list[int]], list[np.ndarray], list[int]]:
    """Each row's trees merged, the tokens that followed, the paths they ran along and a verified count."""
    merged = [merge_trees([with_match_len(tree, n) for tree, n in sources], [1.0, 0.7], 12) for sources, _ in rows]
    followed = [tokens for _, tokens in rows]
    paths = [tree.accepted_nodes(tokens) for tree, tokens in zip(merged, followed)]
    return merged, followed, paths, [min(len(path), n % 3) for n, path in enumerate(paths)]


@settings(max_examples=examples(200), deadline=None)
@given(rows=counted_rows)
def test_a_steps_rows_counted_at_once_equal_them_counted_in_turn(rows):
    """``observe_nodes`` and ``observe_hindsight_nodes`` (the advance of a step's rows) count as
    ``observe`` and ``observe_hindsight`` tree by tree do."""
    merged, followed, paths, verified = merged_and_followed(rows)
    at_once, in_turn = SourceCalibration(2), SourceCalibration(2)
    nodes = TreeNodes(merged, paths, 2)
    at_once.observe_nodes(nodes)
    for tree, path in zip(merged, paths):
        in_turn.observe(tree, path)
    np.testing.assert_allclose(at_once.observed, in_turn.observed, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(at_once.predicted, in_turn.predicted, rtol=1e-12, atol=1e-12)
    together, apart = Attribution(["a", "b"]), Attribution(["a", "b"])
    together.observe_nodes(nodes)
    together.observe_hindsight_nodes(nodes, verified)
    for tree, path, tokens, accepted in zip(merged, paths, followed, verified):
        apart.observe(tree, path)
        apart.observe_hindsight(tree, tokens, accepted)
    assert together.counts() == apart.counts()


def numpy_counts(trees, paths, verified, num_sources):
    """The calibration's and the attribution's counts of ``trees`` as the vectorized numpy code
    did before the counting was compiled: (observed, predicted, verified counts, hindsight counts)."""
    sizes = np.array([len(tree) for tree in trees])
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    owner = np.repeat(np.arange(len(trees)), sizes)
    parents = np.concatenate([tree.parents for tree in trees]).astype(np.int64)
    parents = np.where(parents >= 0, parents + offsets[owner], -1)
    depths = np.concatenate([tree.depths for tree in trees])
    probs = np.concatenate([tree.source_probs for tree in trees])
    samples = np.concatenate([tree.source_samples for tree in trees])
    match_len = np.stack([tree.source_match_len for tree in trees])
    count = np.array([len(path) for path in paths])
    start = np.cumsum(count) - count
    accepted_owner = np.repeat(np.arange(len(trees)), count)
    accepted = np.concatenate([np.asarray(path, np.int64) for path in paths]) + offsets[accepted_owner]
    is_accepted = np.zeros(offsets[-1] + 1, bool)
    is_accepted[accepted], is_accepted[-1] = True, True
    tried = np.flatnonzero(is_accepted[parents])

    calibration = SourceCalibration(num_sources)
    node, source = np.nonzero(probs[tried] > 0)
    node = tried[node]
    _, lengths, classes = calibration.observed.shape
    length = length_class(match_len[owner[node], source] + depths[node] - 1)
    cell = (source * lengths + length) * classes + sample_class(samples[node, source], classes)
    age = calibration.decay ** (len(trees) - 1 - owner[node])
    shape = calibration.observed.shape
    observed = np.bincount(cell, weights=is_accepted[node] * age, minlength=calibration.observed.size).reshape(shape)
    predicted = np.bincount(cell, weights=probs[node, source] * age, minlength=calibration.observed.size).reshape(shape)

    proposed, edges = probs > 0, len(MATCH_LENGTH_EDGES)

    def counted(values):
        roots = np.flatnonzero(parents == -1)
        first = np.zeros((len(trees), num_sources), bool)
        np.logical_or.at(first, owner[roots], proposed[roots])
        tree, source = np.nonzero(first)
        cells = source * edges + length_class(match_len[tree, source])
        out = np.zeros((len(values), num_sources * edges), np.int64)
        stacked = np.stack([np.broadcast_to(value, first.shape)[tree, source] for value in values])
        np.add.at(out, (slice(None), cells), stacked)
        return out.reshape(len(values), num_sources, edges)

    shape = (len(trees), num_sources)
    accepted_by, verified_by, first_accepted = (
        np.zeros(shape, np.int64),
        np.zeros(shape, np.int64),
        np.zeros(shape, bool),
    )
    np.add.at(accepted_by, accepted_owner, proposed[accepted])
    np.add.at(verified_by, owner, proposed)
    some = count > 0
    first_accepted[some] = proposed[accepted[start[some]]]
    held = np.repeat(count[:, None], num_sources, axis=1)
    place = np.arange(accepted.size) - np.repeat(start, count)
    step, source = np.nonzero(probs[accepted] <= 0)
    np.minimum.at(held, (accepted_owner[step], source), place[step])
    verified = np.asarray(verified, np.int64)[:, None]
    return (
        observed,
        predicted,
        counted((1, first_accepted, accepted_by, verified_by)),
        counted((1, held, held > verified)),
    )


@settings(max_examples=examples(200), deadline=None)
@given(rows=counted_rows)
def test_the_compiled_counting_equals_the_numpy_counting_it_replaced(rows):
    """``TreeNodes.along`` finds ``accepted_nodes``' paths, and the calibration's and the
    attribution's compiled counts equal the vectorized numpy ones they replaced, on random trees."""
    merged, followed, paths, verified = merged_and_followed(rows)
    nodes = TreeNodes.along(merged, followed, 2)
    assert nodes.accepted.tolist() == np.concatenate(paths).tolist()
    assert nodes.accepted_count.tolist() == [len(path) for path in paths]
    calibration, attribution = SourceCalibration(2), Attribution(["a", "b"])
    calibration.observe_nodes(nodes)
    attribution.observe_nodes(TreeNodes(merged, paths, 2))
    attribution.observe_hindsight_nodes(nodes, verified)
    observed, predicted, verified_counts, hindsight_counts = numpy_counts(merged, paths, verified, 2)
    np.testing.assert_allclose(calibration.observed, observed, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(calibration.predicted, predicted, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(attribution._verified, verified_counts)
    np.testing.assert_array_equal(attribution._hindsight, hindsight_counts)
    assert int(attribution.tree_held) == sum(len(path) for path in paths)


def test_accepted_nodes_out_of_a_tree_are_refused():
    tree = merge_trees(
        [DraftTree(np.array([1, 2], np.int32), np.array([-1, 0], np.int32), np.array([2, 1]), 1, 2, 2)], [1.0], 4
    )
    with pytest.raises(ValueError, match=r"accepted node indices must be in \[0, 2\)"):
        TreeNodes([tree], [[0, 2]], 1)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    docs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=8),
    outputs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), max_size=4),
    contexts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=2, max_size=5),
    shard_tokens=st.sampled_from([16, 1 << 20]),
)
def test_a_steps_sources_parsed_once_equal_each_contexts_own(tmp_path, docs, outputs, contexts, shard_tokens):
    """``LocalDrafter.draft_sources_batch`` parses the contexts once for the index and the store of
    outputs (``draft_queries``): every row's trees are what drafting that context alone gives, on an
    index of one shard (the compiled pass) or several (the planned draft per row)."""
    write_index(tmp_path / "idx", docs, vocab_size=4, shard_tokens=shard_tokens)
    config = DraftConfig(budget=12, max_depth=4, n_max=6, n_min=1)
    with LocalDrafter.open(tmp_path / "idx", outputs_max_tokens=1000) as drafter:
        for output in outputs:
            drafter.add_output(output)
        alone = [drafter.draft_sources(context, config) for context in contexts]
        assert drafter.draft_sources_batch(contexts, config) == alone


def test_parsed_contexts_handed_back_are_checked_before_any_kernel_reads_them(tmp_path):
    """``draft_queries`` takes ``query_matrix``'s rows from its caller: ids outside the vocabulary,
    lengths past the row or an array of another type are refused, naming the problem."""
    write_index(tmp_path / "idx", [[1, 2, 3, 1, 2]], vocab_size=4)
    config = DraftConfig(n_max=4, n_min=1)
    with LocalDrafter.open(tmp_path / "idx", outputs_max_tokens=100) as drafter:
        queries, lengths = query_matrix([[1, 2], [3]], config.n_max, 4)
        for source in (drafter.datastore, drafter.outputs):
            assert len(source.draft_queries(queries, lengths, config)) == 2
        bad_id = queries.copy()
        bad_id[0, 0] = 4
        with pytest.raises(ValueError, match=r"query token ids must be in \[0, 4\)"):
            drafter.datastore.draft_queries(bad_id, lengths, config)
        for source in (drafter.datastore, drafter.outputs):
            with pytest.raises(ValueError, match=r"query lengths must be in \[1, 4\]"):
                source.draft_queries(queries, np.array([2, 5]), config)
            with pytest.raises(ValueError, match="queries must be int64"):
                source.draft_queries(queries.astype(np.int32), lengths, config)
        with pytest.raises(ValueError, match="query token ids"):
            drafter.outputs.draft_queries(np.full((1, 4), -1), np.array([1]), config)
