"""The adaptive drafter on real parts: a real index and output store, the real request matcher,
merge and selection; crediting what the verifier accepted; the decoding loop unchanged and its
output identical to plain greedy decoding (tiny random models, and SmolLM2 on the stdlib index)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.harness.sets import humaneval_inputs
from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.server import DatastoreServer, ServerConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import SourceCalibration
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.core.steps import SUFFIX_CUTS
from rest_spec.drafter.hf.generate import generate
from tests.helpers import MODEL_VOCAB, tiny_causal_lm, tree_from_paths, write_index

KEY = CostKey("synthetic", "", 0, "test", "float32")
# a CPU-like cost: 1.9x t(1) at 8 tokens, 4x at 64
CPU_COST = VerifyCost(KEY, 512, (1, 2, 4, 8, 16, 32, 64), (1.0, 1.15, 1.4, 1.9, 2.0, 2.5, 4.0))
PROHIBITIVE = VerifyCost(KEY, 512, (1, 2), (1.0, 100.0))  # one extra token costs 100 steps: nothing pays
CONFIG = DraftConfig(budget=64, max_depth=10)
REPO = Path(__file__).resolve().parents[1]

# index documents (token ids < MODEL_VOCAB): after (1, 2) come 3 4 5 / 3 4 6 / 7 8
DOCS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 1, 2, 7, 8], list(range(20, 60))]


@pytest.fixture
def index(tmp_path):
    return write_index(tmp_path / "idx", DOCS, MODEL_VOCAB)


@pytest.fixture
def base(index):
    with LocalDrafter.open(index) as base:
        yield base


def test_accepted_nodes_follow_the_committed_tokens_down_the_tree():
    tree = tree_from_paths([(3, 4, 5), (3, 4, 6), (7, 8)])  # BFS: 3 7 | 4 8 | 5 6
    paths = tree.paths()
    assert [paths[i] for i in tree.accepted_nodes([3, 4, 6, 99])] == [(3,), (3, 4), (3, 4, 6)]
    assert [paths[i] for i in tree.accepted_nodes([7, 5])] == [(7,)]  # 5 is no child of 7: the bonus token
    assert tree.accepted_nodes([5]).size == 0
    assert DraftTree.empty().accepted_nodes([3]).size == 0


def test_calibration_observes_the_nodes_the_verifier_accepted(base):
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index",))
    tree = drafter.draft([30, 1, 2], CONFIG)
    paths = tree.paths()
    assert set(paths) == {(3,), (7,), (3, 4), (7, 8), (3, 4, 5), (3, 4, 6)}
    conditional = {p: float(tree.source_probs[i, 0]) for i, p in enumerate(paths)}
    assert conditional[(3,)] == pytest.approx(2 / 3) and conditional[(3, 4, 6)] == pytest.approx(1 / 2)
    assert not drafter.calibration.observed.any()  # nothing verified yet

    # the verifier accepted 3 4 6 and added its own token 11: the next call's context says so
    drafter.draft([30, 1, 2, 3, 4, 6, 11], CONFIG)
    # tried = the root's children (3, 7) and the children of accepted nodes (4; 5, 6; none under 6)
    tried = [(3,), (7,), (3, 4), (3, 4, 5), (3, 4, 6)]
    assert drafter.calibration.observed.sum() == 3.0
    assert drafter.calibration.predicted.sum() == pytest.approx(sum(conditional[p] for p in tried))
    # and the attribution counts the step under the index's match (of 30 1 2, it holds 1 2)
    (cell,) = drafter.attribution.report()
    assert (cell["source"], cell["match_len"], cell["steps"], cell["first_accepted"]) == ("index", "2", 1, 1)
    assert (cell["accepted"], cell["verified"]) == (3, 6)
    # in hindsight, the whole tree was verified: it held the 3 tokens that followed, all accepted
    assert (cell["offered"], cell["held"], cell["passed_over"]) == (1, 3, 0)
    assert drafter.attribution.hindsight() == {"steps": 1, "held_per_step": 3.0, "accepted_per_step": 3.0}


def test_the_engines_committed_tokens_are_what_is_credited_and_a_disagreement_is_counted(base, caplog):
    """Where the engine reports the tokens it committed (vLLM's sampled token ids, the transformers
    loop's), they are what the verifier accepted; a report that disagrees with the context's growth
    is credited as reported, counted and logged once."""
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index",))
    (tree,) = drafter.draft_batch([[30, 1, 2]], CONFIG, ["a"])
    assert {(3, 4, 6), (7, 8)} <= set(tree.paths())
    drafter.advance([[30, 1, 2, 3, 4, 6, 11]], ["a"], accepted=[[3, 4, 6, 11]])  # as the context says
    assert drafter.accepted_mismatches == 0
    assert drafter.attribution.report()[0]["accepted"] == 3

    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index",))
    drafter.draft_batch([[30, 1, 2]], CONFIG, ["a"])
    with caplog.at_level("WARNING"):
        drafter.advance([[30, 1, 2, 3, 4, 6, 11]], ["a"], accepted=[[7, 8, 12, 13]])
        drafter.advance([[30, 1, 2, 3, 4, 6, 11, 5]], ["a"], accepted=[[9]])
    assert drafter.accepted_mismatches == 2
    assert [r.message.count("the engine reports committing") for r in caplog.records] == [1]
    assert drafter.attribution.report()[0]["accepted"] == 2  # 7 8: the engine's word, not the context's
    # a report that does not cover all the context gained (a row that skipped steps) is not used
    drafter.advance([[30, 1, 2, 3, 4, 6, 11, 5, 6, 7]], ["a"], accepted=[[7]])
    assert drafter.accepted_mismatches == 2


class FirstToken(AdaptiveDrafter):
    """Verifies the first token of each merged tree only (a chain cut short)."""

    def draft_rows(self, sessions, shared, config):
        _, merged = super().draft_rows(sessions, shared, config)
        first = [tree.subset(np.flatnonzero(tree.parents == -1)[:1]) if len(tree) else tree for tree in merged]
        return first, merged


def test_trees_counted_in_batches_equal_them_counted_every_step(base, monkeypatch):
    """The counting waits for ``COUNT_EVERY`` trees; what is read then (attribution, calibration)
    equals counting each step as it came, and the weights drafted by lag at most that many trees."""
    import rest_spec.drafter.core.adaptive as adaptive

    def run(count_every: int) -> AdaptiveDrafter:
        monkeypatch.setattr(adaptive, "COUNT_EVERY", count_every)
        drafter = AdaptiveDrafter(base, cost=None, config=CONFIG)
        contexts = {0: [30, 1, 2], 1: [20, 21, 22]}
        for step in range(12):
            trees = drafter.draft_batch(list(contexts.values()), CONFIG, list(contexts))
            for request, tree in zip(contexts, trees):  # accept the first branch's first token, then a miss
                contexts[request] += [int(tree.tokens[0]) if len(tree) else 50 + step, 61]
        waiting = len(drafter._verified[0]) + len(drafter._matured[0])
        assert waiting < count_every
        return drafter

    each, batched = run(1), run(1000)
    assert batched._verified[0] and batched._matured[0]  # nothing counted while drafting
    assert batched.attribution.counts() == each.attribution.counts()
    assert not batched._verified[0] and not batched._matured[0]  # reading counted it all
    np.testing.assert_allclose(batched.calibration.observed, each.calibration.observed)
    np.testing.assert_allclose(batched.calibration.predicted, each.calibration.predicted)
    assert each.calibration.observed.any()


def test_hindsight_waits_for_the_tokens_after_a_tree_and_counts_what_selection_passed_over(base):
    """The verified part of a merged tree is its first token only (a chain cut short); the tokens
    that follow show the merged tree held three: counted once the context has grown by its depth."""

    drafter = FirstToken(base, cost=None, config=CONFIG, sources=("index",))
    assert [tuple(p) for p in drafter.draft([30, 1, 2], CONFIG).paths()] == [(3,)]
    drafter.draft([30, 1, 2, 3], CONFIG)  # accepted 3, no bonus token: 1 of the tree's 3 levels known
    assert drafter.attribution.hindsight()["steps"] == 0
    drafter.draft([30, 1, 2, 3, 4, 6], CONFIG)  # now all 3, and both of the next tree's (4, then 5 or 6)
    assert drafter.attribution.hindsight() == {"steps": 2, "held_per_step": 2.5, "accepted_per_step": 1.0}
    cells = {cell["match_len"]: cell for cell in drafter.attribution.report()}  # matches of 1 2, of 1 2 3
    assert [(c["offered"], c["held"], c["passed_over"]) for c in (cells["2"], cells["3"])] == [(1, 3, 1), (1, 2, 1)]


def test_calibration_learns_in_hindsight_from_branches_the_selection_passed_over(base):
    """Only the first token of each merged tree is verified, yet the calibration learns from every
    node of it that what followed would have tried: a branch never verified is calibrated too."""

    drafter = FirstToken(base, cost=None, config=CONFIG, sources=("index",))
    drafter.draft([30, 1, 2], CONFIG)  # merged: 3 7 | 4 8 | 5 6, verified: 3
    drafter.draft([30, 1, 2, 3], CONFIG)  # merged: 4 | 5 6, verified: 4
    assert not drafter.calibration.observed.any()  # the first tree is 3 deep: 1 token known
    drafter.draft([30, 1, 2, 3, 4, 6], CONFIG)
    # both trees in hindsight: 3 4 6 of the first (2 of them never verified), 4 6 of the second;
    # verified alone, each would have taught one accepted token
    assert drafter.calibration.observed.sum() == pytest.approx(3 * drafter.calibration.decay + 2)
    # tried: 3 7 4 5 6 of the first (4 of 3, 5 and 6 of 4; 7 rejected), 4 5 6 of the second
    assert drafter.calibration.predicted.sum() == pytest.approx(
        (2 / 3 + 1 / 3 + 1 + 1 / 2 + 1 / 2) * drafter.calibration.decay + 1 + 1 / 2 + 1 / 2
    )


def test_a_context_that_does_not_continue_the_last_is_a_new_request(base):
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index",))
    drafter.draft([30, 1, 2], CONFIG)
    drafter.draft([31, 1, 2, 3], CONFIG)  # another prompt: no credit
    drafter.draft([31, 1, 2, 3], CONFIG)  # the same context again: not one step later either
    assert not drafter.calibration.observed.any() and not drafter.calibration.predicted.any()


def test_batch_rows_keep_their_own_request_as_rows_finish(base):
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("request",))
    row_a, row_b = [40, 41, 42, 43, 40, 41], [50, 51, 52, 50, 51]
    trees = drafter.draft_batch([row_a, row_b], CONFIG, requests=["a", "b"])
    assert (42,) in trees[0].paths() and (52,) in trees[1].paths()  # each row copies from itself
    assert trees[1].paths() == [(52,), (52, 50), (52, 50, 51)]
    # row a finished; row b accepted 52 50 and got the bonus token 77: credited to row b's tree
    drafter.draft_batch([row_b + [52, 50, 77]], CONFIG, requests=["b"])
    assert drafter.calibration.observed[0, :, 0].sum() == 2.0  # each rests on one occurrence: class 0
    assert drafter.calibration.predicted[0, :, 0].sum() == 3.0  # tried 52, 50 and 51, each certain
    assert drafter.calibration.predicted.sum() == 3.0


def test_named_rows_may_come_in_any_order_and_unnamed_ones_are_their_positions(base):
    """Sessions follow the engine's names, not the rows' order; without names a row is its
    position, and a context that does not continue its position's session is a new request."""
    row_a, row_b = [40, 41, 42, 43, 40, 41], [50, 51, 52, 50, 51]
    named = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("request",))
    named.draft_batch([row_a, row_b], CONFIG, requests=["a", "b"])
    named.draft_batch([row_b + [52, 50, 77], row_a + [42, 43, 9]], CONFIG, requests=["b", "a"])
    # b's tree (52 50 51) is calibrated on once its context has grown by its depth, 3; a's (42 43 40 41) not yet
    assert named.calibration.observed.sum() == 2.0
    named.draft_batch([row_a + [42, 43, 9, 10]], CONFIG, requests=["a"])
    assert named.calibration.observed.sum() == pytest.approx(4.0, abs=0.02)  # 52 50 for b, 42 43 for a (decayed)

    unnamed = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("request",))
    unnamed.draft_batch([row_a, row_b], CONFIG)
    unnamed.draft_batch([row_b + [52, 50, 77]], CONFIG)  # row b at row a's position: a new request
    assert not unnamed.calibration.observed.any() and not unnamed.calibration.predicted.any()


def test_an_ended_request_loses_its_session_and_sessions_are_bounded(base, monkeypatch):
    import rest_spec.drafter.core.adaptive as adaptive

    row = [50, 51, 52, 50, 51]
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("request",))
    drafter.draft_batch([row], CONFIG, requests=["b"])
    drafter.finish(["b", "never seen"])
    drafter.draft_batch([row + [52, 50, 77]], CONFIG, requests=["b"])  # a new session: nothing to credit
    assert not drafter.calibration.predicted.any()

    monkeypatch.setattr(adaptive, "MAX_SESSIONS", 2)
    for name in ("c", "d", "b"):  # b seen last; c the longest unseen, dropped for the third
        drafter.draft_batch([row], CONFIG, requests=[name])
    assert list(drafter._sessions) == ["d", "b"]


def test_contexts_are_read_in_place_and_not_kept(base):
    """An engine's buffer (vLLM's token array) handed as views and written on after the call:
    the drafter credits the same as with copies, since it reads each context when called."""
    row = [50, 51, 52, 50, 51]
    copies = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("request",))
    copies.draft_batch([row], CONFIG)
    copies.draft_batch([row + [52, 50, 77]], CONFIG)

    views = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("request",))
    buffer = np.zeros(16, np.int64)
    buffer[:5] = row
    views.draft_batch([buffer[:5]], CONFIG, requests=["r"])
    buffer[5:] = 99  # the engine writes on past the context (pending tokens, padding)
    buffer[5:8] = [52, 50, 77]
    views.draft_batch([buffer[:8]], CONFIG, requests=["r"])
    assert views.calibration.observed.sum() == copies.calibration.observed.sum() == 2.0
    assert np.array_equal(views.calibration.predicted, copies.calibration.predicted)


def test_request_source_drafts_a_repeated_identifier_from_the_prompt(base):
    """REST cannot copy from the prompt; the request source does."""
    identifier = [200, 201, 202, 203, 204]  # in no index document
    prompt = [60, 61, *identifier, 62, 63, 64, *identifier[:2]]
    drafter = AdaptiveDrafter(base, cost=CPU_COST, config=CONFIG)
    assert len(base.draft(prompt, CONFIG)) == 0  # the index has nothing
    tree = drafter.draft(prompt, CONFIG)
    assert (202, 203, 204) in tree.paths()


def test_outputs_source_drafts_from_added_outputs(base):
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index", "outputs"))
    assert len(drafter.draft([70, 300, 301], CONFIG)) == 0
    assert drafter.add_output([300, 301, 302, 303]) == 0
    assert (302, 303) in drafter.draft([71, 300, 301], CONFIG).paths()


def test_selection_verifies_nothing_when_nothing_pays(base):
    context = [30, 1, 2]
    assert len(AdaptiveDrafter(base, cost=None, config=CONFIG).draft(context, CONFIG)) == 6
    assert len(AdaptiveDrafter(base, cost=CPU_COST, config=CONFIG).draft(context, CONFIG)) > 0
    assert len(AdaptiveDrafter(base, cost=PROHIBITIVE, config=CONFIG).draft(context, CONFIG)) == 0


def test_the_loops_config_caps_the_tree(base):
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG)
    tree = drafter.draft([30, 1, 2], DraftConfig(budget=3, max_depth=2))
    assert len(tree) == 3 and tree.max_depth <= 2


def test_bad_arguments_are_refused(base):
    with pytest.raises(ValueError, match="sources must be distinct names among index, request, outputs"):
        AdaptiveDrafter(base, cost=None, sources=("index", "corpus"))
    with pytest.raises(ValueError, match="calibration has 2 sources, expected 3"):
        AdaptiveDrafter(base, cost=None, calibration=SourceCalibration(2))


def test_shorter_suffixes_are_sources_where_the_context_matches_longer(base):
    """After a 6-token match every cut (4, 2, 1 tokens) adds its shorter match as a source; where
    the index matches one token (under n_min) only the cut to one token does, and it drafts."""
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, suffixes=SUFFIX_CUTS)
    assert drafter.calibration.num_sources == 6  # index, request, outputs, then the cuts to 4, 2, 1
    long = drafter.draft([20, 21, 22, 23, 24, 25], CONFIG)
    assert long.source_probs.any(axis=0).tolist() == [True, False, False, True, True, True]
    short = drafter.draft([30, 40, 2], CONFIG)  # "40 2" is nowhere; "2" is followed by 3 4 5 / 3 4 6 / 7 8
    assert short.source_probs.any(axis=0).tolist() == [False, False, False, False, False, True]
    assert {path[:1] for path in short.paths()} == {(3,), (7,)}
    assert len(AdaptiveDrafter(base, cost=None, config=CONFIG).draft([30, 40, 2], CONFIG)) == 0
    with pytest.raises(ValueError, match="suffixes must be distinct positive lengths"):
        AdaptiveDrafter(base, cost=None, suffixes=(1, 2))


def test_a_remote_base_answers_the_cuts_as_a_local_one(index):
    """The cuts travel in the base's one batch call (one RPC): remote and local give one tree."""
    contexts = [[20, 21, 22, 23, 24, 25], [30, 40, 2]]
    with (
        Datastore.open(index) as store,
        DatastoreServer(store, ServerConfig(port=0, workers=2)) as server,
        RemoteDrafter(server.address) as remote,
        LocalDrafter.open(index) as local,
    ):
        remote_trees, local_trees = (
            AdaptiveDrafter(b, cost=None, config=CONFIG, suffixes=SUFFIX_CUTS).draft_batch(contexts, CONFIG)
            for b in (remote, local)
        )
    assert remote_trees == local_trees and all(len(tree) for tree in local_trees)


@pytest.mark.parametrize(
    "cost, suffixes", [(None, ()), (CPU_COST, ()), (CPU_COST, SUFFIX_CUTS)], ids=["budget", "cost", "suffixes"]
)
def test_batched_greedy_generation_equals_plain_decoding(base, cost, suffixes):
    model = tiny_causal_lm("llama")
    prompts = [[5, 6, 7, 8, 5, 6], [1, 2, 3], [20, 21, 22, 23, 24, 25, 26]]
    expected = generate(model, prompts, None, max_new_tokens=24).output_ids
    drafter = AdaptiveDrafter(base, cost=cost, config=CONFIG, suffixes=suffixes)
    result = generate(model, prompts, drafter, max_new_tokens=24, config=CONFIG)
    assert result.output_ids == expected
    assert result.mean_accepted > 1  # a random tiny model repeats itself: the request source drafts it


@pytest.mark.model
def test_greedy_generation_on_smollm2_equals_plain_and_learns_from_outputs(smollm2, stdlib_index):
    """On real parts: SmolLM2, the stdlib index, two HumanEval prompts. The second time a prompt
    is decoded, its first output is in the output store and drafts most of it."""
    model, tokenizer = smollm2
    with LocalDrafter.open(stdlib_index) as local:
        drafter = AdaptiveDrafter(local, cost=CPU_COST, config=CONFIG)
        for ids in humaneval_inputs(tokenizer, 2):
            plain = generate(model, ids, None, max_new_tokens=32)
            first = generate(model, ids, drafter, max_new_tokens=32, config=CONFIG)
            assert first.output_ids == plain.output_ids
            drafter.add_output(first.output_ids)
            again = generate(model, torch.tensor([ids]), drafter, max_new_tokens=32, config=CONFIG)
            assert again.output_ids == plain.output_ids
            assert again.mean_accepted > max(2.0, first.mean_accepted)
        assert len(local.outputs) == 2
        assert np.all(drafter.calibration.predicted.sum(axis=(1, 2)) > 0)  # every source was tried and credited
        cells = drafter.attribution.report()
        assert {cell["source"] for cell in cells} == set(drafter.sources)
        assert sum(cell["first_accepted"] for cell in cells if cell["source"] == "outputs") > 0


def test_sampled_rows_learn_source_weights_of_their_own_and_greedy_ones_keep_theirs(base):
    """A request sampled at temperature 0.7 through the decoding loop: its merged trees are learned
    from by the calibration of that setting, made from the greedy one's priors; the greedy one learns
    nothing from it, and a greedy request after it learns into the greedy one only."""
    from transformers import GenerationConfig

    from rest_spec.drafter.core.chain_calibration import setting_class

    model = tiny_causal_lm("llama")
    drafter = AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index", "request"))
    sampled = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
    prompt = [30, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    generate(
        model, prompt, drafter, max_new_tokens=24, generation_config=sampled, generator=torch.Generator().manual_seed(0)
    )
    calibrations = drafter.calibrations
    assert set(calibrations) == {0, setting_class(0.7)}
    hot = calibrations[setting_class(0.7)]
    assert hot.predicted.sum() > 0 and calibrations[0].predicted.sum() == 0
    np.testing.assert_array_equal(hot.prior, calibrations[0].prior)
    learned = hot.predicted.copy()
    generate(model, prompt, drafter, max_new_tokens=24)
    assert drafter.calibration.predicted.sum() > 0
    np.testing.assert_array_equal(drafter.calibrations[setting_class(0.7)].predicted, learned)


WARM_UP_SCRIPT = """
import importlib, json, sys
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.batch_cost import BatchCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.scheduler import NO_OVERLAP, DraftScheduler
from rest_spec.drafter.core.suffix_cache import available

MODULES = ("datastore.index", "datastore.bigram", "datastore.trie", "drafter.core.batch_step",
           "drafter.core.merge", "drafter.core.request_matcher", "drafter.core.selection")

def loaded():
    kernels = {}
    for name in MODULES:
        module = importlib.import_module("rest_spec." + name)
        for attr, value in vars(module).items():
            if hasattr(value, "signatures") and hasattr(value, "py_func"):  # a numba dispatcher
                kernels[f"{name}.{attr}"] = len(value.signatures)
    return kernels

config = DraftConfig(max_depth=8)
base = LocalDrafter.open(sys.argv[1])
sources = ("index", "request", "outputs", "suffix") if available() else ("index", "request", "outputs")
drafter = AdaptiveDrafter(base, cost=BatchCost(), config=config, sources=sources, chains=True)
before = loaded()
drafter.warm_up()
warm = loaded()
base.add_output([1, 2, 3, 4, 5, 1, 2, 3])
scheduler = DraftScheduler(drafter, config, NO_OVERLAP)
context = [9, 1, 2]
for step in range(80):  # past the counting's batch of verified trees (COUNT_EVERY)
    [tree] = scheduler.step([context], ["r"], step_seconds=None if step == 0 else 0.05)
    context += [int(tree.tokens[0]) if len(tree) else 3, step % 7 + 1]
print(json.dumps([before, warm, loaded()]))
"""


@pytest.mark.cli
def test_warm_up_loads_every_kernel_a_step_runs(index):
    """In a fresh process (a vLLM engine's), ``warm_up`` loads every compiled kernel that drafting
    steps then run -- the sources', the request's match, the merge, its counting, the batch step --
    so none is loaded during a request (~70 ms each on a 2-core CPU: ~0.5 s in an engine's first
    steps before ``RestProposer.load_model`` called it)."""
    proc = subprocess.run(
        [sys.executable, "-c", WARM_UP_SCRIPT, str(index)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, warm, after = json.loads(proc.stdout)
    assert not any(before.values())  # a fresh process: nothing loaded yet
    assert after == warm  # the steps loaded nothing more
    used = {name for name, count in after.items() if count}
    # the steps ran the index's, the store's and the request's matches, the merge and its counting
    assert {
        "datastore.index._draft_rows",
        "datastore.bigram._draft_rows",
        "drafter.core.request_matcher._request_rows",
        "drafter.core.batch_step._merge_rows",
        "drafter.core.merge._calibrate",
    } <= used
