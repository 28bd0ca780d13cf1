"""Overlapped drafting (``drafter.core.scheduler``): the pieces it rests on (``DraftTree.after``,
``RequestMatcher.draft_ahead``), its bookkeeping driven step by step with a scripted datastore
(foreseen outcomes, stale speculation, deadlines, falling back to local sources), and generation
on real parts -- SmolLM2, a real index of Python code, a real gRPC server in process and as a
``rest-datastore serve`` subprocess that is killed mid-generation, a datastore one second away --
always token for token plain decoding."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from benchmarks.harness.latency_proxy import LatencyProxy
from benchmarks.harness.sets import humaneval_inputs
from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo, SourceTrees
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.server import DatastoreServer, ServerConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import MergedTree
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.core.request_matcher import RequestMatcher
from rest_spec.drafter.core.scheduler import (
    DraftingStats,
    DraftScheduler,
    OverlapConfig,
    ahead_config,
    likely_outcomes,
)
from rest_spec.drafter.core.steps import SUFFIX_CUTS
from rest_spec.drafter.hf.generate import BatchGenerationResult, generate
from tests.helpers import (
    CORPUS_VOCAB,
    ScriptedDrafter,
    contexts_from,
    request_oracle,
    synthetic_corpus,
    tiny_causal_lm,
    tree_from_paths,
    write_index,
)
from tests.tiers import examples

ROOT = Path(__file__).resolve().parents[1]
DOCS = synthetic_corpus()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real index of the synthetic corpus (recurring phrases: deep, branching trees), 3 shards."""
    path = write_index(tmp_path_factory.mktemp("overlap") / "synthetic", DOCS, CORPUS_VOCAB, shard_tokens=5_000)
    with Datastore.open(path) as store:
        yield store


# ---- DraftTree.after -------------------------------------------------------------------------------


def assert_checks_pass(tree: DraftTree) -> None:
    """A tree derived without the checks (``subset``, ``after``) is the tree its fields build
    through them: same depths, dtypes, scores, read-only arrays."""
    fields = {
        name: getattr(tree, name)
        for name in ("tokens", "parents", "counts", "match_len", "num_matches", "num_sampled", "scores")
    }
    if isinstance(tree, MergedTree):
        fields |= {name: getattr(tree, name) for name in ("source_probs", "source_samples", "source_match_len")}
    checked = type(tree)(**fields)
    assert checked == tree
    for name in ("tokens", "parents", "counts", "scores", "depths"):
        ours, theirs = getattr(tree, name), getattr(checked, name)
        np.testing.assert_array_equal(ours, theirs)
        assert ours.dtype == theirs.dtype and not ours.flags.writeable and ours.flags.c_contiguous


def assert_after_is_the_subtree(tree: DraftTree) -> None:
    """For every root child b: ``after(b)`` is exactly the nodes below b (paths with b stripped,
    BFS order kept), scores divided by b's, counts and source columns carried; None for a token
    that is no root child."""
    paths = tree.paths()
    roots = np.flatnonzero(tree.parents == -1)
    for top in roots:
        b = int(tree.tokens[top])
        below = [i for i, path in enumerate(paths) if path[0] == b and len(path) > 1]
        sub = tree.after(b)
        assert sub is not None
        assert_checks_pass(sub)
        assert sub.paths() == [paths[i][1:] for i in below]
        assert sub.counts.tolist() == tree.counts[below].tolist()
        expected = tree.scores[below] / tree.scores[top] if tree.scores[top] > 0 else np.zeros(len(below))
        np.testing.assert_array_equal(sub.scores, np.minimum(expected, 1.0))
        assert (sub.num_matches, sub.num_sampled) == (int(tree.counts[top]), int(tree.counts[top]))
        assert sub.match_len == (tree.match_len + 1 if tree.match_len else 0)
        assert isinstance(sub, MergedTree) == isinstance(tree, MergedTree)
        if isinstance(tree, MergedTree):
            for name in ("source_probs", "source_samples"):
                np.testing.assert_array_equal(getattr(sub, name), getattr(tree, name)[below])
        if not below:  # a leaf: the empty tree, not None
            assert len(sub) == 0
    root_tokens = set(tree.tokens[roots].tolist())
    for token in set(tree.tokens.tolist()) - root_tokens:  # deeper nodes only: no root child
        assert tree.after(token) is None
    assert tree.after(CORPUS_VOCAB + 12345) is None


def test_after_on_index_trees_is_the_subtree_under_each_root_child(store):
    configs = [DraftConfig(), DraftConfig(budget=200, max_depth=30, n_min=1), DraftConfig(budget=5, max_depth=2)]
    checked = 0
    for config in configs:
        for context in contexts_from(DOCS, 40, seed=21):
            tree = store.draft(context, config)
            assert_after_is_the_subtree(tree)
            checked += len(tree) > 0
    assert checked > 60  # most contexts matched: real trees were checked
    assert DraftTree.empty().after(5) is None


def test_after_on_merged_trees_carries_scores_and_source_columns(store):
    """The trees the overlap prepares from: merged (explicit scores, per-source columns)."""
    drafter = AdaptiveDrafter(LocalDrafter(store), cost=None, sources=("index", "request"))
    merged = 0
    for context in contexts_from(DOCS, 30, seed=22):
        tree = drafter.draft(context + context[-6:], DraftConfig())  # the repeat feeds the request source
        assert isinstance(tree, MergedTree) or len(tree) == 0  # nothing to merge: the empty tree
        assert_after_is_the_subtree(tree)
        merged += len(tree) > 0
    assert merged > 20


def test_subsets_of_index_and_merged_trees_are_checked_trees(store):
    """``subset`` keeps any prefix-closed part of a tree: its paths, and fields that pass the checks."""
    rng = np.random.default_rng(23)
    drafter = AdaptiveDrafter(LocalDrafter(store), cost=None, sources=("index", "request"))
    subsets = 0
    for context in contexts_from(DOCS, 30, seed=24):
        for tree in (store.draft(context, DraftConfig()), drafter.draft(context + context[-6:], DraftConfig())):
            keep = np.zeros(len(tree) + 1, dtype=bool)
            keep[-1] = True  # slot -1: the root, always kept
            for node in range(len(tree)):  # BFS order: a parent is decided before its children
                keep[node] = keep[tree.parents[node]] and rng.random() < 0.7
            nodes = np.flatnonzero(keep[:-1])
            part = tree.subset(nodes)
            assert_checks_pass(part)
            assert part.paths() == [tree.paths()[i] for i in nodes]
            subsets += len(part) > 0
    assert subsets > 20


def test_after_on_a_hand_built_tree():
    tree = DraftTree(
        np.array([3, 7, 4, 8, 5, 6]),  # 3 7 | 4 (under 3) 8 (under 7) | 5 6 (under 4)
        np.array([-1, -1, 0, 1, 2, 2]),
        np.array([6, 2, 5, 1, 3, 2]),
        match_len=4,
        num_matches=8,
        num_sampled=8,
    )
    sub = tree.after(3)
    assert sub.paths() == [(4,), (4, 5), (4, 6)]
    np.testing.assert_allclose(sub.scores, [5 / 6, 3 / 6, 2 / 6])
    assert (sub.match_len, sub.num_matches, sub.num_sampled) == (5, 6, 6)
    assert tree.after(7).paths() == [(8,)]
    assert tree.after(4) is None and tree.after(9) is None
    assert len(tree.after(3).after(4).after(5)) == 0


@settings(max_examples=examples(150), deadline=None)
@given(
    data=st.data(),
    max_depth=st.integers(1, 5),
    n_max=st.integers(2, 8),
    n_min=st.integers(1, 3),
)
def test_after_a_deeper_tree_is_the_tree_drafted_one_token_later(store, data, max_depth, n_max, n_min):
    """What the overlap relies on: drafting ``context`` one level deeper and taking ``after(b)``
    gives the tree drafted for ``context + [b]`` -- same paths, same counts, match one longer --
    whenever that longer match is what ``context + [b]`` matches (the match was below ``n_max``),
    nothing was sampled or cut by the budget, and some occurrence continues after b. The scores
    agree too unless some occurrence of the longer match ends a document (it counts under b but
    has nothing to continue, so the direct draft leaves it out of its denominator)."""
    doc = DOCS[data.draw(st.integers(0, len(DOCS) - 1))]
    end = data.draw(st.integers(1, len(doc)))
    # a slice of a document matches in full up to n_max: drawn shorter than n_max, as the property needs
    context = doc[max(0, end - data.draw(st.integers(1, n_max - 1))) : end]
    config = DraftConfig(budget=1024, max_depth=max_depth, n_max=n_max, n_min=min(n_min, n_max))
    deeper = store.draft(context, dataclasses.replace(config, max_depth=max_depth + 1))
    assume(len(deeper) > 0 and len(deeper) < config.budget)
    assume(deeper.match_len < n_max and deeper.num_matches <= store.max_candidates)
    for top in np.flatnonzero(deeper.parents == -1):
        b = int(deeper.tokens[top])
        ahead, direct = deeper.after(b), store.draft([*context, b], config)
        if len(ahead) == 0:  # every occurrence of the longer match ends a document
            assert direct.match_len != deeper.match_len + 1 or len(direct) == 0
            continue
        assert direct.match_len == ahead.match_len == deeper.match_len + 1
        assert direct.paths() == ahead.paths()
        assert direct.counts.tolist() == ahead.counts.tolist()
        assert direct.num_matches <= ahead.num_matches
        if direct.num_matches == ahead.num_matches:
            np.testing.assert_allclose(direct.scores, ahead.scores, rtol=1e-12)


# ---- RequestMatcher.draft_ahead -----------------------------------------------------------------


matcher_configs = st.tuples(st.integers(1, 3), st.integers(0, 4)).flatmap(
    lambda n: st.builds(
        DraftConfig, budget=st.integers(1, 30), max_depth=st.integers(1, 6), n_min=st.just(n[0]), n_max=st.just(sum(n))
    )
)
token_lists = st.lists(st.integers(0, 4), min_size=1, max_size=10)


@settings(max_examples=examples(200), deadline=None)
@given(
    chunks=st.lists(token_lists, min_size=1, max_size=6),
    extras=st.lists(st.lists(st.integers(0, 6), max_size=8), min_size=1, max_size=4),
    more=token_lists,
    config=matcher_configs,
    max_candidates=st.sampled_from([1, 3, 4096]),
)
def test_draft_ahead_matches_the_uncommitted_tokens_and_changes_nothing(chunks, extras, more, config, max_candidates):
    matcher, context = RequestMatcher(max_candidates), []
    for chunk in chunks:  # the decoding loop: the matcher sees the context grow
        context.extend(chunk)
        matcher.draft(context, config)
        for extra in extras:  # speculation between steps: any number of drafts ahead
            assert matcher.draft_ahead(extra, config) == request_oracle(context, config, max_candidates, extra)
            assert len(matcher) == len(context)
        fresh = RequestMatcher(max_candidates)
        assert matcher.draft_ahead((), config) == fresh.draft(context, config)
        assert matcher.draft(context, config) == fresh.draft(context, config)
    context.extend(more)  # and decoding goes on as if nothing had been asked ahead
    assert matcher.draft(context, config) == RequestMatcher(max_candidates).draft(context, config)


@settings(max_examples=examples(200), deadline=None)
@given(
    context=st.lists(st.integers(0, 3), min_size=6, max_size=30),  # long and repetitive: the condition
    extra=st.lists(st.integers(0, 4), min_size=1, max_size=4),  # holds for non-empty trees too
    config=st.builds(
        DraftConfig, budget=st.integers(1, 30), max_depth=st.integers(1, 4), n_max=st.integers(2, 6), n_min=st.just(2)
    ),
)
def test_draft_ahead_equals_a_fresh_matcher_when_nothing_it_counts_reaches_into_extra(context, extra, config):
    """The exact condition: a fresh matcher over ``context + extra`` counts the same occurrences
    with the same continuations when every occurrence of the final bigram ends at least
    ``max_depth`` tokens before the end of ``context`` (none inside ``extra``, on the context's
    last token, or with a continuation running into ``extra``)."""
    full = [*context, *extra]
    ends = [e for e in range(1, len(full) - 1) if full[e - 1 : e + 1] == full[-2:]]
    assume(all(e + config.max_depth <= len(context) - 1 for e in ends))
    matcher = RequestMatcher()
    matcher.draft(context, config)
    assert matcher.draft_ahead(extra, config) == RequestMatcher().draft(full, config)


def test_draft_ahead_never_counts_occurrences_inside_the_uncommitted_tokens():
    """Tokens of ``extra`` absent from the context are not enough for the two to agree: a
    repeat inside ``extra`` is an occurrence for a fresh matcher over context + extra, not for
    ``draft_ahead`` (extra is matched, never indexed)."""
    config = DraftConfig(budget=8, max_depth=4)
    context, extra = [1, 2, 3, 4], [7, 8, 9, 7, 8]
    matcher = RequestMatcher()
    matcher.draft(context, config)
    assert len(matcher.draft_ahead(extra, config)) == 0
    assert RequestMatcher().draft(context + extra, config).paths() == [(9,), (9, 7), (9, 7, 8)]
    # an occurrence in the context continued by extra: the continuation stops where the context does
    matcher = RequestMatcher()
    matcher.draft([5, 6, 1, 2, 3], config)
    assert matcher.draft_ahead([5, 6], config).paths() == [(1,), (1, 2), (1, 2, 3)]
    assert RequestMatcher().draft([5, 6, 1, 2, 3, 5, 6], config).paths() == [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 5)]


# ---- likely_outcomes ------------------------------------------------------------------------------


def scored_tree(paths: list[tuple[int, ...]], scores: dict[tuple[int, ...], float]) -> DraftTree:
    """The BFS tree of ``paths`` with explicit ``scores`` per path."""
    tree = tree_from_paths(paths)
    return DraftTree(
        tree.tokens, tree.parents, tree.counts, 2, 10, 10, scores=np.array([scores[p] for p in tree.paths()])
    )


def test_likely_outcomes_rank_accepted_paths_by_probability():
    # P(path ends at v) = score(v) - sum of its children's: root .1, 10: .1, (10, 11): .5, 12: .3
    tree = scored_tree([(10, 11), (12,)], {(10,): 0.6, (12,): 0.3, (10, 11): 0.5})
    outcomes = likely_outcomes(tree, 4)
    assert [h.path for h in outcomes] == [(10, 11), (12,), (), (10,)]
    assert [h.path for h in likely_outcomes(tree, 2)] == [(10, 11), (12,)]
    assert [h.path for h in likely_outcomes(DraftTree.empty(), 4)] == [()]


# ---- DraftScheduler, step by step, with a scripted datastore ------------------------------------------------


class ScriptedPending:
    """A DraftBatch call in flight: answers at once, or (``held``) never until cancelled."""

    def __init__(self, answer: list[SourceTrees], held: bool) -> None:
        self.answer, self.cancelled = answer, False
        self._released = threading.Event()
        if not held:
            self._released.set()

    def result(self, timeout: float | None = None) -> list[SourceTrees]:
        if not self._released.wait(timeout):
            raise TimeoutError(f"no reply within {timeout} s")
        if self.cancelled:
            raise CancelledError("cancelled")
        return self.answer

    def cancel(self) -> bool:
        if self._released.is_set():  # answered (or cancelled) already
            return False
        self.cancelled = True
        self._released.set()
        return True


class ScriptedDatastore(RemoteDrafter):
    """A remote datastore as the overlap sees it (a ``RemoteDrafter``: one that reads only
    suffixes, so speculation is on; its ``draft_batch_future``): each context's tree is
    ``trees[its last token]`` (empty if none); while ``hold`` is set, calls never answer. Every
    call is kept in ``calls`` as (contexts, config, timeout, pending). Connects nowhere."""

    def __init__(self, trees: dict[int, DraftTree]) -> None:
        self.address, self.trees, self.hold, self.calls = "scripted", trees, False, []

    def draft_batch_future(self, contexts, config, *, include_outputs=False, timeout=None) -> ScriptedPending:
        answer = [
            SourceTrees(self.trees.get(context[-1], DraftTree.empty()), DraftTree.empty()) for context in contexts
        ]
        pending = ScriptedPending(answer, self.hold)
        self.calls.append(([list(c) for c in contexts], config, timeout, pending))
        return pending

    def draft(self, context, config):
        raise AssertionError("the overlap drafts through draft_batch_future")

    draft_batch = draft

    def info(self) -> IndexInfo:
        return IndexInfo(1, "scripted", "sha256:scripted", 1000, 0, 0, ())

    def close(self) -> None:
        pass


LOOP = DraftConfig(budget=16, max_depth=4, n_max=4)
# at a context ending in 3: the chain 10 11, most likely fully accepted (P = .8)
STEP_ONE = scored_tree([(10, 11)], {(10,): 0.9, (10, 11): 0.8})
# one level deeper at a context ending in 11 (the foreseen outcome): bonus 20 or 21, then more
AHEAD = scored_tree([(20, 22, 23), (21, 24)], {(20,): 0.6, (21,): 0.3, (20, 22): 0.5, (20, 22, 23): 0.4, (21, 24): 0.2})


def scripted(overlap: OverlapConfig, step_seconds: float) -> tuple[ScriptedDatastore, DraftScheduler]:
    remote = ScriptedDatastore({3: STEP_ONE, 11: AHEAD, 20: tree_from_paths([(90,)]), 55: tree_from_paths([(91,)])})
    return remote, DraftScheduler(remote, LOOP, overlap, step_seconds=step_seconds)


def first_step(remote: ScriptedDatastore, drafting: DraftScheduler) -> None:
    trees = drafting.trees([[1, 2, 3]])
    assert trees == [STEP_ONE]  # nothing prepared yet: drafted now
    drafting.speculate(trees)
    contexts, config, timeout, _ = remote.calls[-1]
    # one hypothesis, the whole chain accepted: its tail within the suffix bound (n_max - 1), then
    # the shorter matches of the ladder
    assert contexts == [[3, 10, 11], [10, 11], [11]]
    assert config == ahead_config(LOOP) and config.max_depth == LOOP.max_depth + 1  # the bonus token's level
    assert 0 < timeout <= 10 * 1.25
    drafting.verified(0.001)


@pytest.mark.parametrize("bonus", [20, 21])
def test_a_foreseen_outcome_gets_the_tree_prepared_during_the_forward(bonus):
    remote, drafting = scripted(OverlapConfig(hypotheses=1), step_seconds=10.0)
    first_step(remote, drafting)
    drafting._ahead.job.result(timeout=5)  # the forward outlasted the preparation
    trees = drafting.trees([[1, 2, 3, 10, 11, bonus]])  # accepted 10 11, bonus token
    assert trees == [AHEAD.after(bonus)]
    assert len(remote.calls) == 2  # no call after the forward
    drafting.close()
    stats = drafting.stats
    assert (stats.steps, stats.predicted, stats.fresh, stats.fallbacks, stats.cancelled) == (2, 1, 1, 0, 0)
    assert stats.ready_steps == 1 and len(stats.waits) == 2 and len(stats.launches) == 1


def test_named_rows_find_their_foreseen_outcomes_in_any_order():
    """Rows named by their requests (as vLLM's are) may come back in another order, or with a
    row gone: each finds the outcome foreseen for its own request."""
    remote, drafting = scripted(OverlapConfig(hypotheses=1), step_seconds=10.0)
    trees = drafting.trees([[1, 2, 3], [5, 6, 3], [7, 8, 3]], ["a", "b", "c"])
    assert trees == [STEP_ONE] * 3
    drafting.speculate(trees)
    drafting._ahead.job.result(timeout=5)
    drafting.finish(["c"])
    trees = drafting.trees([[5, 6, 3, 10, 11, 20], [1, 2, 3, 10, 11, 21]], ["b", "a"])
    assert trees == [AHEAD.after(20), AHEAD.after(21)]
    assert len(remote.calls) == 2  # both foreseen: no call after the forward
    drafting.close()
    assert (drafting.stats.predicted, drafting.stats.fresh) == (2, 3)


def test_a_bonus_token_the_prepared_tree_lacks_is_drafted_fresh():
    remote, drafting = scripted(OverlapConfig(hypotheses=1), step_seconds=10.0)
    first_step(remote, drafting)
    trees = drafting.trees([[1, 2, 3, 10, 11, 55]])  # foreseen path, but 55 is no root child of AHEAD
    assert trees == [tree_from_paths([(91,)])]
    assert remote.calls[-1][0] == [[1, 2, 3, 10, 11, 55]]  # the whole live context
    drafting.close()
    assert (drafting.stats.predicted, drafting.stats.fresh, drafting.stats.fallbacks) == (0, 2, 0)


def test_stale_speculation_is_cancelled_before_its_deadline():
    """The outcome was not foreseen (10 accepted, 11 rejected): the call in flight is given up at
    once -- for a real client that cancels the RPC server-side -- not left to its deadline."""
    remote, drafting = scripted(OverlapConfig(hypotheses=1), step_seconds=10.0)  # deadline: 12.5 s
    trees = drafting.trees([[1, 2, 3]])
    remote.hold = True  # the speculative call never answers by itself
    drafting.speculate(trees)
    speculation = remote.calls[-1][3]
    remote.hold = False
    start = time.perf_counter()
    trees = drafting.trees([[1, 2, 3, 10, 55]])
    assert time.perf_counter() - start < 5  # not the 12.5 s deadline
    assert speculation.cancelled
    assert trees == [tree_from_paths([(91,)])]  # fresh, from the datastore
    drafting.close()
    stats = drafting.stats
    assert (stats.predicted, stats.fresh, stats.fallbacks, stats.cancelled) == (0, 2, 0, 1)


def test_a_late_reply_costs_one_step_its_datastore_sources_then_it_is_asked_again():
    remote, drafting = scripted(OverlapConfig(hypotheses=1, deadline=0.25), step_seconds=0.05)
    trees = drafting.trees([[1, 2, 3]])
    remote.hold = True
    drafting.speculate(trees)
    speculation = remote.calls[-1][3]
    calls = len(remote.calls)
    start = time.perf_counter()
    trees = drafting.trees([[1, 2, 3, 10, 11, 20]])  # foreseen, but the reply never came
    assert time.perf_counter() - start < 5
    assert speculation.cancelled  # given up at the deadline
    assert trees == [DraftTree.empty()]  # a plain drafter has no local source: no draft
    assert len(remote.calls) == calls  # the datastore just failed: this step does not ask again
    assert (drafting.stats.fallbacks, drafting.stats.cancelled) == (1, 1)
    remote.hold = False
    drafting.speculate(trees)  # the next step asks again
    assert len(remote.calls) == calls + 1
    drafting.verified(0.05)
    assert drafting.trees([[1, 2, 3, 10, 11, 20, 30]]) == [DraftTree.empty()]  # fresh: nothing under 30
    assert drafting.trees([[1, 2, 3, 10, 11, 20, 30, 20]]) == [tree_from_paths([(90,)])]
    drafting.close()
    assert (drafting.stats.fallbacks, drafting.stats.cancelled) == (1, 1)


def test_a_fresh_draft_waits_a_share_of_a_step_then_drafts_from_the_request_alone():
    """An adaptive drafter falls back on the request's own text."""
    remote = ScriptedDatastore({})
    remote.hold = True
    drafter = AdaptiveDrafter(remote, cost=None, sources=("index", "request"))
    drafting = DraftScheduler(drafter, LOOP, OverlapConfig(deadline=0.5), step_seconds=0.04)
    context = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    start = time.perf_counter()
    (tree,) = drafting.trees([context])
    assert time.perf_counter() - start < 5
    assert remote.calls[-1][2] == pytest.approx(0.02)  # the call's own deadline: half a step
    assert remote.calls[-1][3].cancelled
    assert set(tree.paths()) == set(RequestMatcher().draft(context, LOOP).paths()) != set()
    drafting.close()
    assert (drafting.stats.fallbacks, drafting.stats.cancelled, drafting.stats.fresh) == (1, 1, 1)


def test_close_cancels_speculation_in_flight():
    remote, drafting = scripted(OverlapConfig(hypotheses=2), step_seconds=10.0)
    trees = drafting.trees([[1, 2, 3]])
    remote.hold = True
    drafting.speculate(trees)
    start = time.perf_counter()
    drafting.close()
    assert time.perf_counter() - start < 5  # not the 12.5 s deadline
    assert remote.calls[-1][3].cancelled and drafting.stats.cancelled == 1
    assert [3, 10, 11] in remote.calls[-1][0] and [1, 2, 3] in remote.calls[-1][0]  # both hypotheses, one call


class RecordingDrafter(ScriptedDrafter):
    """A plain ``Drafter`` (no datastore) that keeps every context it is asked about, drafts nothing."""

    def __init__(self) -> None:
        self.contexts: list[list[int]] = []

    def draft(self, context, config: DraftConfig) -> DraftTree:
        self.contexts.append(list(context))
        return DraftTree.empty()


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_a_drafter_reading_whole_contexts_gets_them_and_no_speculation(overlap):
    """Speculation sends contexts cut to their suffixes: only this project's datastores (which
    read nothing else) get them; any other ``Drafter`` is asked for the whole live context of
    each step, between forwards."""
    model = tiny_causal_lm("llama")
    prompt = list(range(1, 41))  # longer than n_max
    drafter = RecordingDrafter()
    result = generate(model, prompt, drafter, max_new_tokens=6, overlap=overlap)
    full = prompt + result.output_ids
    assert drafter.contexts == [full[: len(prompt) + i] for i in range(6)]
    assert result.drafting.launches == [] and result.drafting.fresh == 6


# ---- DraftScheduler on a real index: what a foreseen outcome gets ------------------------------------------

STEP = DraftConfig(budget=8, max_depth=4, n_max=6, n_min=2)


def foreseen_steps(store: Datastore):
    """For corpus contexts: a step's tree there is verified, the likeliest outcome's accepted path
    is accepted, and each token b that can follow that path on the index at one of the suffix
    bounds asked ahead (and is no child of the path's end, so can be a bonus token) comes as the
    bonus token. Yields (level, b, prepared, own): ``level`` the tree fetched ahead that b extends
    (the longest), ``prepared`` the tree ``DraftScheduler`` hands the next step from what it fetched
    during the forward (None when the outcome was not foreseen), ``own`` the tree that step would
    draft itself."""
    deeper = ahead_config(STEP)
    for context in contexts_from(DOCS, 60, seed=31):
        drafting = DraftScheduler(LocalDrafter(store), STEP, OverlapConfig(hypotheses=1), step_seconds=10.0)
        (tree,) = drafting.trees([context])
        drafting.speculate([tree])
        (hypothesis,) = likely_outcomes(tree, 1)
        drafting.close()
        path = list(hypothesis.path)
        end = -1
        for token in path:
            end = int(np.flatnonzero((tree.parents == end) & (tree.tokens == token))[0])
        children = set(tree.tokens[tree.parents == end].tolist())
        tail = (context + path)[-deeper.n_max :]
        bounds = [len(tail), *(n for n in SUFFIX_CUTS if n < len(tail))]
        levels = [store.draft(tail[-n:], deeper) for n in bounds]
        bonuses = sorted({int(t) for level in levels for t in level.tokens[level.parents == -1]} - children)
        for bonus in bonuses:
            level = next(level for level in levels if level.after(bonus) is not None)
            drafting = DraftScheduler(LocalDrafter(store), STEP, OverlapConfig(hypotheses=1), step_seconds=10.0)
            (tree,) = drafting.trees([context])
            drafting.speculate([tree])
            (prepared,) = drafting.trees([context + path + [bonus]])
            foreseen = drafting.stats.predicted == 1
            drafting.close()
            yield level, bonus, prepared if foreseen else None, store.draft(context + path + [bonus], STEP)


def test_the_prepared_tree_is_the_steps_own_tree_when_the_match_extends(store):
    """``ahead_config``'s promise: drafted one level deeper with the suffix bounds one token
    shorter, the subtree under the bonus token is the tree the step would draft after it whenever
    the step's match is the fetched one extended by it -- and nothing was sampled, and the fetched
    tree was not cut by its own budget (then the subtree of a less likely bonus token is starved:
    fewer nodes than the step's tree). With the ladder, a bonus token that breaks the longest
    match still finds a shorter one it extends."""
    compared = 0
    for level, _, prepared, own in foreseen_steps(store):
        assert prepared is not None  # every bonus that can follow the path was foreseen
        extends = own.match_len == level.match_len + 1 and level.num_matches <= store.max_candidates
        uncut = len(level) < ahead_config(STEP).budget
        if extends and uncut:
            assert prepared.paths() == own.paths()
            assert prepared.counts.tolist() == own.counts.tolist()
            compared += len(own) > 0
    assert compared > 20


def test_a_prepared_tree_keeps_to_the_loops_budget(store):
    """The hypothesis trees are AHEAD_WIDTH times wider than a step's: the subtree under the bonus
    token can hold more nodes than the loop's budget, and must be cut to it."""
    sizes = [(len(level.after(bonus)), len(prepared)) for level, bonus, prepared, _ in foreseen_steps(store)]
    assert max(size for size, _ in sizes) > STEP.budget  # the cut was needed
    assert max(size for _, size in sizes) <= STEP.budget


# ---- generation on real parts: SmolLM2, an index of Python code, real servers ------------------------

KEY = CostKey("synthetic", "", 0, "test", "float32")
# a CPU-like cost (as in test_adaptive): 1.9x t(1) at 8 tokens, 4x at 64, so selected trees are small
CPU_COST = VerifyCost(KEY, 512, (1, 2, 4, 8, 16, 32, 64), (1.0, 1.15, 1.4, 1.9, 2.0, 2.5, 4.0))
CONFIG = DraftConfig(budget=64, max_depth=10)
PAPER = DraftConfig(budget=16, max_depth=6)  # REST's plain tree, smaller: 64 nodes verify slowly on a CPU
NEW_TOKENS = 32
STDLIB_MODULES = (
    "abc argparse bisect contextlib csv dataclasses datetime decimal difflib enum fnmatch fractions functools glob "
    "heapq inspect os random shutil statistics string subprocess tempfile textwrap typing json/decoder json/encoder "
    "collections/__init__ logging/__init__"
).split()


@pytest.fixture(scope="module")
def code_index(smollm2, tmp_path_factory):
    """A real index of some thirty standard-library modules tokenized for SmolLM2: the python-stdlib
    corpus in miniature (a second to build, not half a minute)."""
    model, tokenizer = smollm2
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [stdlib / f"{name}.py" for name in STDLIB_MODULES]
    docs = [tokenizer(path.read_text(encoding="utf-8")).input_ids for path in sources if path.exists()]
    assert len(docs) >= 20
    return write_index(tmp_path_factory.mktemp("overlap") / "code", docs, model.config.vocab_size)


@pytest.fixture(scope="module")
def code_store(code_index):
    with Datastore.open(code_index) as store:
        yield store


@pytest.fixture(scope="module")
def prompts(smollm2):
    """Three HumanEval prompts (code to complete) of different lengths."""
    prompts = humaneval_inputs(smollm2[1], 3)
    assert len({len(p) for p in prompts}) == 3
    return prompts


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    """Plain decoding (no drafter) of the first prompt: what every drafted generation must produce."""
    result = generate(smollm2[0], prompts[0], None, max_new_tokens=NEW_TOKENS)
    assert result.drafting == DraftingStats()  # nothing drafted, nothing counted
    return result.output_ids


def assert_coherent(result, overlap: bool) -> DraftingStats:
    """The drafting figures agree with the loop's: one entry per step, every row-step drafted
    either ahead or fresh, nothing ahead without overlap."""
    stats = result.drafting
    batched = isinstance(result, BatchGenerationResult)
    row_steps = sum(map(len, result.accepted_per_step)) if batched else len(result.accepted_per_step)
    assert stats.steps == result.steps
    assert stats.predicted + stats.fresh == row_steps
    assert len(stats.waits) == stats.steps and all(w >= 0 for w in stats.waits)
    assert 0 <= stats.ready_steps <= stats.steps and 0 <= stats.fallbacks <= row_steps
    if overlap:
        assert len(stats.launches) == stats.steps
    else:
        assert (stats.predicted, stats.ready_steps, stats.launches, stats.cancelled) == (0, 0, [], 0)
    summary = stats.summary()
    assert summary["steps"] == stats.steps and 0 <= summary["predicted_share"] <= 1
    return stats


def generate_from(model, prompt, base, adaptive: bool, overlap: bool):
    """``NEW_TOKENS`` from ``prompt`` drafted by ``base`` (a local or remote datastore) as the paper
    drafts, or through an ``AdaptiveDrafter`` over it."""
    drafter = AdaptiveDrafter(base, cost=CPU_COST, config=CONFIG) if adaptive else base
    config = CONFIG if adaptive else PAPER
    return generate(model, prompt, drafter, max_new_tokens=NEW_TOKENS, config=config, overlap=overlap)


@pytest.mark.model
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["paper", "adaptive"])
def test_local_drafting_is_lossless_with_and_without_overlap(smollm2, code_index, prompts, plain, adaptive, overlap):
    model, _ = smollm2
    with LocalDrafter.open(code_index) as local:
        result = generate_from(model, prompts[0], local, adaptive, overlap)
    assert result.output_ids == plain
    stats = assert_coherent(result, overlap)
    assert stats.fallbacks == 0  # in process: never late, never failing
    assert result.steps < NEW_TOKENS  # drafts were accepted
    if overlap and adaptive:
        assert stats.predicted > 0  # some steps' trees were prepared during the previous forward


@pytest.mark.model
def test_a_batch_of_prompts_of_different_lengths_is_lossless_with_overlap(smollm2, code_index, prompts):
    model, _ = smollm2
    expected = generate(model, prompts, None, max_new_tokens=24).output_ids
    for overlap in (False, True):
        with LocalDrafter.open(code_index) as local:
            drafter = AdaptiveDrafter(local, cost=CPU_COST, config=CONFIG)
            result = generate(model, prompts, drafter, max_new_tokens=24, config=CONFIG, overlap=overlap)
        assert result.output_ids == expected
        stats = assert_coherent(result, overlap)
        assert stats.fallbacks == 0
        if overlap:
            assert stats.predicted > 0


@pytest.fixture(scope="module")
def server(code_store):
    with DatastoreServer(code_store, ServerConfig(port=0, workers=2)) as server:
        yield server


@pytest.mark.model
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["paper", "adaptive"])
def test_remote_drafting_is_lossless_with_and_without_overlap(smollm2, server, prompts, plain, adaptive, overlap):
    model, _ = smollm2
    with RemoteDrafter(server.address) as remote:
        result = generate_from(model, prompts[0], remote, adaptive, overlap)
    assert result.output_ids == plain
    assert_coherent(result, overlap)
    assert result.steps < NEW_TOKENS


class ServeProcess:
    """``python -m rest_spec.datastore serve --index INDEX --port PORT`` with its output drained
    (so its log never blocks it); ``address`` once it printed "listening on"."""

    def __init__(self, index: Path, port: int = 0) -> None:
        argv = [sys.executable, "-m", "rest_spec.datastore", "serve", "--index", str(index), "--port", str(port)]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        listening = threading.Event()

        def drain() -> None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("listening on "):
                    listening.set()
            listening.set()

        threading.Thread(target=drain, daemon=True).start()
        listening.wait(60)
        match = re.fullmatch(r"listening on (\S+:\d+)", self.lines[-1] if self.lines else "")
        assert match, "\n".join(self.lines)
        self.address = match.group(1)
        self.port = int(self.address.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


class AtToken(StoppingCriteria):
    """Never stops generation; runs ``action`` once, when the ``at``-th new token is committed."""

    def __init__(self, at: int, action) -> None:
        self.at, self.action, self.calls = at, action, 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.calls += 1
        if self.calls == self.at:
            self.action()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.model
def test_a_server_killed_mid_generation_costs_drafts_not_the_generation(smollm2, code_index, prompts, plain):
    """A real ``rest-datastore serve`` is killed (SIGKILL) after a few steps: no exception, the
    same output, steps drafted from the request's own text; a server started again on the same
    port is drafted from again by the same client."""
    model, _ = smollm2
    # a generous deadline (5 steps): whatever falls back here does so because the server is gone
    overlap = OverlapConfig(deadline=5.0)
    first = ServeProcess(code_index)
    second = None
    try:
        with RemoteDrafter(first.address) as remote:
            drafter = AdaptiveDrafter(remote, cost=CPU_COST, config=CONFIG)
            killer = AtToken(8, first.kill)
            result = generate(
                model,
                prompts[0],
                drafter,
                max_new_tokens=NEW_TOKENS,
                config=CONFIG,
                overlap=overlap,
                stopping_criteria=StoppingCriteriaList([killer]),
            )
            assert killer.calls >= NEW_TOKENS and first.proc.returncode == -signal.SIGKILL
            assert result.output_ids == plain
            stats = assert_coherent(result, overlap=True)
            assert stats.fallbacks > 0

            second = ServeProcess(code_index, port=first.port)
            give_up = time.monotonic() + 30  # gRPC reconnects by itself, after its backoff
            while True:
                again = generate(model, prompts[0], drafter, max_new_tokens=16, config=CONFIG, overlap=overlap)
                assert again.output_ids == plain[:16]
                stats = assert_coherent(again, overlap=True)
                if stats.fallbacks == 0 or time.monotonic() > give_up:
                    break
                time.sleep(0.5)
            assert stats.fallbacks == 0, stats.summary()  # every step had the server's sources again
    finally:
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.model
def test_a_datastore_one_second_away_costs_drafts_not_seconds(smollm2, server, prompts, plain):
    """Behind a 1 s round trip every reply is late: the deadlines give up on each (cancelling the
    call), steps draft from the request alone, and the generation takes nowhere near a second a step."""
    model, _ = smollm2
    rtt = 1.0
    with LatencyProxy(server.address, rtt=rtt) as proxy, RemoteDrafter(proxy.address, timeout=30) as remote:
        drafter = AdaptiveDrafter(remote, cost=CPU_COST, config=CONFIG)
        result = generate(model, prompts[0], drafter, max_new_tokens=24, config=CONFIG, overlap=True)
    assert result.output_ids == plain[:24]
    stats = assert_coherent(result, overlap=True)
    assert stats.fallbacks > 0 and stats.cancelled > 0
    assert result.seconds < 0.5 * result.steps * rtt, (result.seconds, result.steps, stats.summary())


def test_a_pending_remote_call_can_be_cancelled(server):
    """What giving up on speculation relies on with a real client: a DraftBatch in flight is
    cancelled (the RPC itself: gRPC tells the server) and its result says so; a reply still on
    its way times out for the caller, and the call can then be cancelled."""
    with LatencyProxy(server.address, rtt=1.0) as proxy, RemoteDrafter(proxy.address, timeout=30) as remote:
        pending = remote.draft_batch_future([[1, 2, 3]], CONFIG, timeout=20)
        time.sleep(0.1)
        assert pending.cancel()
        with pytest.raises(CancelledError):
            pending.result(timeout=5)
        late = remote.draft_batch_future([[1, 2, 3]], CONFIG, timeout=20)
        with pytest.raises(TimeoutError):
            late.result(timeout=0.2)
        assert late.cancel()


@pytest.mark.model
def test_sampling_with_overlap_finishes_and_a_seed_reproduces_it(smollm2, code_index, prompts):
    """A seed reproduces a sampled run where the steps verify the same trees. Which trees they
    verify depends on time only through the deadlines and drafting's own time in the worth rule,
    so both are put out of reach here: a deadline of a million steps (on a busy machine the
    background drafting thread may not even start within the default quarter step, and that step
    then drafts from the request alone), and a cost whose steps take a thousand times the table's
    seconds."""
    model, tokenizer = smollm2
    sampling = GenerationConfig(do_sample=True, temperature=0.8, top_k=50)
    slow = dataclasses.replace(CPU_COST, seconds=tuple(1000 * s for s in CPU_COST.seconds))
    outputs = []
    for _ in range(2):
        with LocalDrafter.open(code_index) as local:
            drafter = AdaptiveDrafter(local, cost=slow, config=CONFIG)
            result = generate(
                model,
                prompts[1],
                drafter,
                max_new_tokens=24,
                config=CONFIG,
                generation_config=sampling,
                generator=torch.Generator().manual_seed(7),
                overlap=OverlapConfig(enabled=True, deadline=1e6),
            )
        ids = result.output_ids
        assert 0 < len(ids) <= 24 and all(0 <= t < model.config.vocab_size for t in ids)
        assert len(ids) == 24 or ids[-1] in {tokenizer.eos_token_id}
        stats = assert_coherent(result, overlap=True)
        assert stats.fallbacks == 0, stats.summary()  # no step drafted from the request alone
        outputs.append(ids)
    assert outputs[0] == outputs[1]  # the same trees, the same draws
