"""Merging per-source draft trees: the union, noisy-OR scores against a path-by-path oracle,
prefix-closed selection; per-source calibration from observed acceptance."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.datastore.bigram import SEP
from rest_spec.datastore.outputs import OutputStore
from rest_spec.datastore.trie import top_c_tree
from rest_spec.drafter.core.merge import Attribution, MergedTree, SourceCalibration, merge_trees
from rest_spec.drafter.core.request_matcher import RequestMatcher
from rest_spec.drafter.hf.internals import forward_with_cache
from rest_spec.drafter.hf.kv_cache import CacheRows, new_cache
from rest_spec.drafter.hf.verify import verify_trees
from tests.helpers import tiny_causal_lm
from tests.tiers import examples


def counted_tree(continuations: list[list[int]], budget: int) -> DraftTree:
    """A source tree as the engines build it: ``top_c_tree`` over the continuations."""
    width = max(map(len, continuations))
    rows = np.full((len(continuations), width), SEP, dtype=np.uint32)
    for row, continuation in zip(rows, continuations):
        row[: len(continuation)] = continuation
    return DraftTree(*top_c_tree(rows, SEP, budget), match_len=2, num_matches=len(rows), num_sampled=len(rows))


source_trees = st.builds(
    counted_tree,
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=5), min_size=1, max_size=12).filter(lambda c: any(c)),
    st.integers(1, 20),
)


def oracle_scores(trees: list[DraftTree], weights: list[list[float]]) -> dict[tuple[int, ...], float]:
    """Path -> merged score, one path at a time: per source the product over the path of
    min(1, w[class] * count / parent count), the class being floor(log2(parent count)) capped at
    the last, noisy-OR over sources, then the minimum over ancestors."""
    per_source = [dict(zip(t.paths(), t.counts)) for t in trees]
    union = sorted({p for source in per_source for p in source}, key=lambda p: (len(p), p))
    combined = {}
    for path in union:
        miss = 1.0
        for tree, source, w in zip(trees, per_source, weights):
            prob = 1.0
            for d in range(1, len(path) + 1):
                parent = source.get(path[: d - 1], 0) if d > 1 else tree.num_sampled
                klass = min(int(np.log2(parent)), len(w) - 1) if parent else 0
                prob *= min(1.0, w[klass] * source.get(path[:d], 0) / parent) if parent else 0.0
            miss *= 1.0 - prob
        combined[path] = 1.0 - miss
    return {p: min(combined[p[:d]] for d in range(1, len(p) + 1)) for p in union}


@settings(max_examples=examples(200), deadline=None)
@given(
    trees=st.lists(source_trees, min_size=1, max_size=3),
    data=st.data(),
    budget=st.integers(0, 40),
    classes=st.integers(1, 4),
)
def test_merge_scores_and_selection_match_the_path_oracle(trees, data, budget, classes):
    weights = data.draw(
        st.lists(
            st.lists(st.floats(0.0, 3.0), min_size=classes, max_size=classes), min_size=len(trees), max_size=len(trees)
        )
    )
    merged = merge_trees(trees, np.array(weights) if classes > 1 else [w[0] for w in weights], budget)
    expected = oracle_scores(trees, weights)
    paths = merged.paths()
    assert len(merged) == min(budget, len(expected))
    assert len(set(paths)) == len(paths)
    np.testing.assert_allclose(merged.scores, [expected[p] for p in paths], rtol=1e-9, atol=1e-12)
    # built without the checks (the kernel lays it out): it passes them, depths included
    checked = MergedTree(
        merged.tokens,
        merged.parents,
        merged.counts,
        merged.match_len,
        merged.num_matches,
        merged.num_sampled,
        scores=merged.scores,
        source_probs=merged.source_probs,
        source_samples=merged.source_samples,
        source_match_len=merged.source_match_len,
    )
    assert checked == merged and np.array_equal(checked.depths, merged.depths) and merged.depths.dtype == np.int32
    # prefix-closed, BFS order, scores never grow down a path
    assert [(len(p), p) for p in paths] == sorted((len(p), p) for p in paths)
    has_parent = merged.parents >= 0
    assert np.all(merged.scores[has_parent] <= merged.scores[merged.parents[has_parent]])
    # the best nodes are kept: nothing dropped scores above anything kept
    dropped = [s for p, s in expected.items() if p not in set(paths)]
    if dropped and paths:
        assert max(dropped) <= merged.scores.min() + 1e-12
    # counts add up over sources; each source's conditional probability and its parent count
    # are carried per node
    for i, path in enumerate(paths):
        sources = [dict(zip(t.paths(), t.counts)) for t in trees]
        assert merged.counts[i] == sum(s.get(path, 0) for s in sources)
        for s, source in enumerate(sources):
            parent = source.get(path[:-1], 0) if len(path) > 1 else trees[s].num_sampled
            proposed = path in source
            assert merged.source_probs[i, s] == pytest.approx(source[path] / parent if proposed else 0.0)
            assert merged.source_samples[i, s] == (parent if proposed else 0)
    assert merged.num_sampled == sum(t.num_sampled for t in trees)


def test_one_source_at_weight_one_is_that_source():
    tree = counted_tree([[1, 2, 3], [1, 2, 4], [1, 5], [6]], budget=10)
    merged = merge_trees([tree], [1.0], budget=10)
    assert (merged.paths(), merged.counts.tolist()) == (tree.paths(), tree.counts.tolist())
    np.testing.assert_allclose(merged.scores, tree.scores, rtol=1e-12)


def test_agreeing_sources_score_above_each_and_a_weight_discounts_per_token():
    a = counted_tree([[1, 2], [3, 4]], budget=10)  # 1 -> 0.5, (1, 2) -> 0.5
    b = counted_tree([[1, 2], [5, 6]], budget=10)
    both = merge_trees([a, b], [1.0, 1.0], budget=10)
    scores = dict(zip(both.paths(), both.scores))
    assert scores[(1,)] == pytest.approx(0.75) and scores[(3,)] == pytest.approx(0.5)
    halved = merge_trees([a], [0.5], budget=10)
    expected = {(1,): 0.25, (3,): 0.25, (1, 2): 0.125, (3, 4): 0.125}
    assert dict(zip(halved.paths(), halved.scores)) == pytest.approx(expected)
    chain = merge_trees([counted_tree([[7, 8, 9]], budget=10)], [0.5], budget=10)
    assert chain.scores.tolist() == pytest.approx([0.5, 0.25, 0.125])  # w ** depth


def test_merge_refuses_bad_weights():
    tree = counted_tree([[1]], budget=1)
    with pytest.raises(
        ValueError, match=r"one weight \(or one per sample class, or per depth and class\) per source \(2\)"
    ):
        merge_trees([tree, tree], [1.0], budget=4)
    with pytest.raises(ValueError, match="per source"):
        merge_trees([tree], np.ones((1, 2, 2, 2)), budget=4)
    with pytest.raises(ValueError, match="per source"):
        merge_trees([tree], np.ones((1, 0, 2)), budget=4)
    with pytest.raises(ValueError, match="non-negative"):
        merge_trees([tree], [-1.0], budget=4)
    with pytest.raises(ValueError, match="at least one source"):
        merge_trees([], [], budget=4)


def test_empty_sources_merge_to_an_empty_tree():
    merged = merge_trees([DraftTree.empty(), DraftTree.empty()], [1.0, 1.0], budget=8)
    assert len(merged) == 0 and merged.source_probs.shape == (0, 2)


# ---- attribution --------------------------------------------------------------------------------


def test_attribution_counts_per_source_and_match_length():
    """Index (match 5) proposes 1-2-3 and 9; request (match 17) proposes 1-2-4. The verifier
    accepts 1, 2 and then 4: both sources proposed the first accepted token, the index carried
    two accepted tokens and the request three."""
    index = dataclasses.replace(counted_tree([[1, 2, 3], [1, 2, 3], [9]], budget=10), match_len=5)
    request = dataclasses.replace(counted_tree([[1, 2, 4]], budget=10), match_len=17)
    silent = DraftTree.empty()
    merged = merge_trees([index, request, silent], [1.0, 1.0, 1.0], budget=10)
    assert merged.source_match_len.tolist() == [5, 17, 0]
    assert merged.subset(np.arange(3)).source_match_len.tolist() == [5, 17, 0]  # kept through select
    attribution = Attribution(["index", "request", "outputs"])
    attribution.observe(merged, merged.accepted_nodes([1, 2, 4, 7]))
    attribution.observe(merged, merged.accepted_nodes([9, 7]))
    attribution.observe(merged, merged.accepted_nodes([5]))
    by_source = {cell["source"]: cell for cell in attribution.report()}
    assert set(by_source) == {"index", "request"}  # outputs proposed nothing
    assert by_source["index"] == {
        "source": "index", "match_len": "4-5", "steps": 3, "first_accepted": 2, "accepted": 3,
        "verified": 12, "first_token_acceptance": round(2 / 3, 4), "accepted_per_step": 1.0,
        "offered": 0, "held": 0, "passed_over": 0, "held_per_offer": 0.0, "passed_over_share": 0.0,
    }  # fmt: skip
    assert by_source["request"]["match_len"] == "16+"
    assert (by_source["request"]["first_accepted"], by_source["request"]["accepted"]) == (1, 3)
    before = Attribution.from_counts(json.loads(json.dumps(attribution.counts())))
    attribution.observe(merged, merged.accepted_nodes([1, 7]))
    since = attribution - before
    assert [(c["source"], c["steps"], c["accepted"]) for c in since.report()] == [("index", 1, 1), ("request", 1, 1)]
    with pytest.raises(ValueError, match="for 3 sources \\(merge_trees results\\)"):
        attribution.observe(index, [])


def test_hindsight_counts_how_deep_each_source_ran_along_what_followed():
    """The same merged tree. 1 2 4 followed: the index held 1 2, the request 1 2 4, and the
    verified chain (9) got nothing accepted, so both were passed over. Then 9 5 followed with 9
    accepted: the index held 9 and lost nothing; the request offered 1, which held nothing."""
    index = dataclasses.replace(counted_tree([[1, 2, 3], [1, 2, 3], [9]], budget=10), match_len=5)
    request = dataclasses.replace(counted_tree([[1, 2, 4]], budget=10), match_len=17)
    merged = merge_trees([index, request, DraftTree.empty()], [1.0, 1.0, 1.0], budget=10)
    attribution = Attribution(["index", "request", "outputs"])
    attribution.observe_hindsight(merged, [1, 2, 4, 7], accepted=0)
    attribution.observe_hindsight(merged, [9, 5, 5], accepted=1)
    by_source = {cell["source"]: cell for cell in attribution.report()}
    assert set(by_source) == {"index", "request"}
    assert [by_source["index"][k] for k in ("steps", "offered", "held", "passed_over")] == [0, 2, 3, 1]
    assert [by_source["request"][k] for k in ("offered", "held", "passed_over", "held_per_offer")] == [2, 3, 1, 1.5]
    assert attribution.hindsight() == {"steps": 2, "held_per_step": 2.0, "accepted_per_step": 0.5}
    since = attribution - Attribution.from_counts(json.loads(json.dumps(attribution.counts())))
    assert since.hindsight()["steps"] == 0 and not since.report()
    with pytest.raises(ValueError, match="for 3 sources \\(merge_trees results\\)"):
        attribution.observe_hindsight(index, [1], accepted=0)


# ---- calibration --------------------------------------------------------------------------------


def test_only_tried_nodes_count():
    """Under a rejected node nothing was tried: the chain 1-2-3 with nothing accepted teaches
    only that node 1 failed."""
    calibration = SourceCalibration(1, prior=1.0, strength=1.0, decay=1.0, classes=1, lengths=(1,))
    chain = merge_trees([counted_tree([[1, 2, 3]], budget=3)], calibration.weights_for([2]), budget=3)
    calibration.observe(chain, [])
    assert (calibration.observed.tolist(), calibration.predicted.tolist()) == ([[[0.0]]], [[[1.0]]])
    assert calibration.weights.tolist() == [[[0.5]]]  # (0 + 1 * 1) / (1 + 1)
    calibration.observe(chain, [0, 1])  # 1 and 2 accepted, 3 tried and rejected
    assert (calibration.observed.tolist(), calibration.predicted.tolist()) == ([[[2.0]]], [[[4.0]]])


def test_calibration_learns_each_sources_acceptance_rate():
    """Simulated verifier: after the context, the next token is a1 with probability 0.5, b1 with
    0.25; down a's chain each next token matches with 0.5, down b's with 0.9. Both sources claim
    certainty (one continuation each). A node d deep continues its source's 2-token match by d - 1
    tokens, so each depth has a match-length class of its own: the weights converge per depth to
    each source's accepted / tried there -- b's first token 0.25, its later ones 0.9 (pooled over
    depths they were 0.51, a first token rated twice as likely as it is)."""
    rng = np.random.default_rng(0)
    a = counted_tree([[10, 11, 12, 13]], budget=4)
    b = counted_tree([[20, 21, 22, 23]], budget=4)
    calibration = SourceCalibration(2, prior=1.0, strength=4.0, decay=1.0)
    for _ in range(3000):
        tree = merge_trees([a, b], calibration.weights_for([a.match_len, b.match_len]), budget=8)
        u = rng.random()
        chain, rate = (a, 0.5) if u < 0.5 else (b, 0.9) if u < 0.75 else (None, 0.0)
        accepted = []
        if chain is not None:
            depth = 1
            while depth < 4 and rng.random() < rate:
                depth += 1
            by_path = {p: i for i, p in enumerate(tree.paths())}
            accepted = [by_path[tuple(chain.tokens[:d])] for d in range(1, depth + 1)]
        calibration.observe(tree, accepted)
    weights = calibration.weights_for([a.match_len, b.match_len], depths=4)[:, :, 0]  # one sample each
    np.testing.assert_allclose(weights, [[0.5] * 4, [0.25, 0.9, 0.9, 0.9]], atol=0.04)
    assert np.array_equal(calibration.weights_for([2, 2])[:, 0], weights[:, 0])  # without depths: the first level's
    # merged with them, b's chain is about 0.25 likely at its first token and 0.25 * 0.9 ** 3 at its fourth
    merged = merge_trees([a, b], calibration.weights_for([2, 2], depths=4), budget=8)
    scores = dict(zip(merged.paths(), merged.scores))
    assert scores[(20,)] == pytest.approx(weights[1, 0])
    assert scores[(20, 21, 22, 23)] == pytest.approx(np.prod(weights[1]))
    assert scores[(20, 21, 22, 23)] == pytest.approx(0.25 * 0.9**3, abs=0.03)


def test_calibration_tells_one_occurrence_from_many():
    """One source, two kinds of certainty: a continuation seen once (accepted 30% of the time)
    and one seen 64 times out of 64 (accepted 80%). Both have ratio 1; the weights of sample
    classes 0 (one) and 6 (64-127) converge to each rate, and the other classes keep the prior."""
    rng = np.random.default_rng(1)
    once, often = counted_tree([[10]], budget=1), counted_tree([[20]] * 64, budget=1)
    calibration = SourceCalibration(1, prior=1.0, strength=4.0, decay=1.0, classes=8)
    for step in range(4000):
        source, rate = (once, 0.3) if step % 2 else (often, 0.8)
        tree = merge_trees([source], calibration.weights_for([source.match_len]), budget=1)
        calibration.observe(tree, [0] if rng.random() < rate else [])
    weights = calibration.weights_for([2])[0]
    np.testing.assert_allclose(weights[[0, 6]], [0.3, 0.8], atol=0.04)
    assert weights[[1, 2, 3, 4, 5, 7]].tolist() == [1.0] * 6


def test_calibration_tells_a_long_match_from_a_short_one():
    """One source, one occurrence behind every draft (one sample class): drafted from a 16-token
    match it is accepted 90% of the time, from a 2-token match 10%. Each length class converges
    to its own rate; a length class never seen keeps the source's pooled weight."""
    rng = np.random.default_rng(2)
    calibration = SourceCalibration(1, prior=1.0, strength=4.0, decay=1.0)
    for step in range(4000):
        length, rate = (16, 0.9) if step % 2 else (2, 0.1)
        source = dataclasses.replace(counted_tree([[10 + step % 2]], budget=1), match_len=length)
        tree = merge_trees([source], calibration.weights_for([length]), budget=1)
        calibration.observe(tree, [0] if rng.random() < rate else [])
    long, short, unseen = (calibration.weights_for([n])[0, 0] for n in (16, 2, 5))
    np.testing.assert_allclose([long, short], [0.9, 0.1], atol=0.04)
    assert unseen == pytest.approx(0.5, abs=0.04)  # both lengths pooled: half of the drafts accepted
    with pytest.raises(ValueError, match="lengths must be ascending distinct match lengths from 1"):
        SourceCalibration(1, lengths=(2, 4))


def test_calibration_refuses_trees_without_source_probabilities():
    calibration = SourceCalibration(2)
    with pytest.raises(ValueError, match="source_probs and source_samples for 2 sources"):
        calibration.observe(counted_tree([[1]], budget=1), [])
    merged = merge_trees([counted_tree([[1]], budget=1)] * 2, [1.0, 1.0], budget=1)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        calibration.observe(merged, [1])


def test_request_and_output_store_drafts_verified_on_a_real_model():
    """The whole path with real parts: two sources merged, verified by a tiny model, observed.
    The model's own greedy continuation is put in the store, so the store's branch is accepted."""
    model = tiny_causal_lm("llama")
    prompt = [5, 6, 7, 8, 5, 6]
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
    store = OutputStore(max_tokens=1000)
    store.add(prompt[-2:] + greedy)
    config = DraftConfig(budget=16, max_depth=4)
    trees = [RequestMatcher().draft(prompt, config), store.draft(prompt, config)]
    calibration = SourceCalibration(2)
    lengths = [tree.match_len for tree in trees]
    tree = merge_trees(trees, calibration.weights_for(lengths), config.budget)

    cache = new_cache(model)
    with torch.inference_mode():
        forward_with_cache(model, cache, input_ids=torch.tensor([prompt[:-1]]))
    verdict = verify_trees(model, cache, CacheRows.full(1, len(prompt) - 1), [prompt], [tree])[0]
    assert list(verdict.accepted_tokens) == greedy[: len(verdict.accepted_tokens)]
    assert len(verdict.accepted_tokens) == 4
    calibration.observe(tree, verdict.keep[1:] - 1)
    # the store proposed all 4 accepted tokens; the request's (7, 8, ...) branch was tried at the root
    assert calibration.observed[1].sum() == 4
    weights = calibration.weights_for(lengths)
    assert weights[1, 0] > weights[0, 0]  # both rest on one occurrence


DRAFTER_SCRIPT = """
import json, sys
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import _merge, compile_kernels
from tests.helpers import CORPUS_VOCAB, synthetic_corpus, write_index
docs = synthetic_corpus()
index = write_index(sys.argv[1], docs, CORPUS_VOCAB, shard_tokens=10_000)
compile_kernels()
before = len(_merge.signatures)
with LocalDrafter.open(index) as base:
    drafter = AdaptiveDrafter(base, cost=None, suffixes=(4, 2, 1))
    base.add_output(docs[1][:40])
    for end in range(8, 40, 4):
        drafter.draft(docs[0][:end] + docs[1][:end], DraftConfig())
print(json.dumps([before, len(_merge.signatures)]))
"""


@pytest.mark.cli
def test_compile_kernels_covers_the_adaptive_drafters_merges(tmp_path):
    """``compile_kernels`` (setup.sh runs it to fill numba's cache) leaves nothing for an adaptive
    drafter's steps to compile: a fresh install's first generation does not spend seconds on it."""
    proc = subprocess.run(
        [sys.executable, "-c", DRAFTER_SCRIPT, str(tmp_path / "idx")],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = json.loads(proc.stdout)
    assert before >= 1 and after == before


@settings(max_examples=examples(300), deadline=None)
@given(tree=source_trees, appended=st.lists(st.integers(0, 4), max_size=7), as_array=st.booleans())
def test_accepted_nodes_are_the_longest_root_path_the_tokens_follow(tree, appended, as_array):
    paths = tree.paths()
    followed = [i for i, path in enumerate(paths) if tuple(appended[: len(path)]) == path]
    got = tree.accepted_nodes(np.array(appended, np.int64) if as_array else appended)
    assert got.dtype == np.int64
    if not followed:
        assert got.size == 0
    else:
        deepest = paths[max(followed, key=lambda i: len(paths[i]))]
        assert [paths[i] for i in got] == [deepest[: k + 1] for k in range(len(deepest))]
