"""The chain calibration: chains' scores brought to what such chains get accepted."""

from __future__ import annotations

import numpy as np
import pytest

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.batch_cost import BatchCost
from rest_spec.drafter.core.chain_calibration import CELLS, COLD_SHARE, ChainCalibration, setting_class
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import length_class
from rest_spec.drafter.core.selection import select_batch_chains
from rest_spec.drafter.core.steps import finish_step
from tests.helpers import MODEL_VOCAB, write_index


def chain(conditionals) -> DraftTree:
    """A chain whose tokens claim these conditional scores."""
    n = len(conditionals)
    return DraftTree(
        tokens=np.arange(1, n + 1),
        parents=np.arange(-1, n - 1),
        counts=np.ones(n, np.int64),
        scores=np.cumprod(conditionals),
    )


def accepted_of(truth: np.ndarray, rng: np.random.Generator) -> int:
    """Tokens accepted of a chain whose tokens are each accepted with probability ``truth``."""
    return int(np.argmin(np.append(rng.random(truth.size) < truth, False)))


def test_an_overconfident_source_is_brought_within_five_percent_of_what_it_gets_accepted():
    rng = np.random.default_rng(0)
    calibration = ChainCalibration()

    def claims():
        return rng.uniform(0.55, 1.0, 6)

    def truth(claimed):  # much less than claimed, and not in proportion
        return 0.75 * claimed**2

    for _ in range(3000):
        claimed = claims()
        drafted = chain(claimed)
        calibration.observe([calibration.claims(drafted)], [accepted_of(truth(claimed), rng)])
    raw = scored = got = 0.0
    for _ in range(3000):  # fresh chains from the same sources
        claimed = claims()
        drafted = chain(claimed)
        raw += drafted.scores.sum()
        scored += calibration.scores(drafted).sum()
        got += accepted_of(truth(claimed), rng)
    assert raw / got > 1.5  # the merged scores claim far more than is accepted
    assert scored / got == pytest.approx(1.0, abs=0.05)


def test_scores_never_grow_down_a_chain_and_the_map_never_falls_as_claims_rise():
    rng = np.random.default_rng(1)
    calibration = ChainCalibration()
    for _ in range(500):  # noisy, non-monotone truth: the map is pooled into order
        claimed = rng.uniform(0.0, 1.0, 8)
        truth = np.clip(claimed + rng.normal(0, 0.3, 8), 0, 1)
        calibration.observe([calibration.claims(chain(claimed))], [accepted_of(truth, rng)])
    assert calibration.trials > 500
    assert np.all(np.diff(calibration.table[0]) >= -1e-12)
    scores = calibration.scores(chain(rng.uniform(0.2, 1.0, 8)))
    assert np.all(np.diff(scores) <= 0) and np.all((scores >= 0) & (scores <= 1))


def test_with_nothing_observed_a_claim_is_taken_at_the_cold_share_within_a_cell():
    claimed = np.array([0.97, 0.5, 0.33])
    expected = np.cumprod(COLD_SHARE * claimed)
    assert ChainCalibration().scores(chain(claimed)) == pytest.approx(expected, abs=1 / CELLS)
    assert ChainCalibration().scores(DraftTree.empty()).size == 0


def test_each_leading_source_is_calibrated_apart_and_its_unseen_matches_follow_it():
    rng = np.random.default_rng(2)
    calibration = ChainCalibration(num_sources=2)
    for _ in range(2000):
        claimed = rng.uniform(0.6, 1.0, 4)
        for source, truth in ((0, claimed), (1, 0.3 * claimed)):  # source 1 claims three times too much
            group = np.full(4, source * calibration.lengths)  # the shortest matches of each
            calibration.observe([(claimed, group)], [accepted_of(truth, rng)])
    cell = CELLS - 3  # claims of 0.90-0.95
    assert calibration.table[0, cell] == pytest.approx(0.925, abs=0.05)
    assert calibration.table[calibration.lengths, cell] == pytest.approx(0.3 * 0.925, abs=0.05)
    # a longer match of source 1, never seen, follows what source 1's shorter ones taught
    assert calibration.table[calibration.lengths + 3, cell] == pytest.approx(0.3 * 0.925, abs=0.1)


def test_short_and_long_matches_of_one_source_are_calibrated_apart():
    rng = np.random.default_rng(3)
    calibration = ChainCalibration()
    for _ in range(2000):
        claimed = rng.uniform(0.6, 1.0, 3)
        for group, truth in ((0, 0.4 * claimed), (5, claimed)):  # 2-token matches err, long ones hold
            calibration.observe([(claimed, np.full(3, group))], [accepted_of(truth, rng)])
    cell = CELLS - 3
    assert calibration.table[0, cell] == pytest.approx(0.4 * 0.925, abs=0.06)
    assert calibration.table[5, cell] == pytest.approx(0.925, abs=0.06)


def test_sampled_rows_are_calibrated_apart_from_greedy_ones():
    """Sampled, a drafted token is accepted with the model's probability of it, not when it is the
    argmax: the same claims are worth less, and the hotter the sampling the less."""
    assert [setting_class(t) for t in (None, 0.0, 0.3, 0.7, 1.0)] == [0, 0, 1, 2, 3]
    rng = np.random.default_rng(4)
    calibration = ChainCalibration()
    for _ in range(2000):
        claimed = rng.uniform(0.6, 1.0, 3)
        drafted = chain(claimed)
        for temperature, truth in ((0.0, claimed), (0.7, 0.6 * claimed)):
            setting = setting_class(temperature)
            calibration.observe([calibration.claims(drafted, setting)], [accepted_of(truth, rng)])
    drafted = chain(np.full(3, 0.925))
    greedy, sampled = calibration.scores(drafted, 0), calibration.scores(drafted, setting_class(0.7))
    assert greedy[0] == pytest.approx(0.925, abs=0.05) and sampled[0] == pytest.approx(0.6 * 0.925, abs=0.05)
    unseen = calibration.scores(drafted, setting_class(1.0))[0]  # as its source errs at 0.7 and at 0.0
    assert sampled[0] - 0.05 < unseen < greedy[0] + 0.05


def test_a_token_after_the_first_rejected_is_no_trial():
    calibration = ChainCalibration()
    claimed = np.full(6, 0.9)
    calibration.observe([(claimed, np.zeros(6, np.int64))], [2])  # accepted 2, the third rejected
    assert calibration.trials == 3
    calibration.observe([(claimed[:3], np.zeros(3, np.int64))], [3])  # all verified tokens accepted
    assert calibration.trials == 6


def test_the_adaptive_drafter_learns_its_chains_from_what_was_accepted(tmp_path):
    """On a real index, a drafter whose chains keep failing past their first token learns to
    claim less of them: its calibrated scores fall, the merge's stay, and the batch admits less."""
    docs = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4 + [list(range(20, 60))]
    cost = BatchCost()
    config = DraftConfig(budget=64, max_depth=6)
    with LocalDrafter.open(write_index(tmp_path / "idx", docs, MODEL_VOCAB)) as base:
        drafter = AdaptiveDrafter(
            base, cost=cost, config=config, sources=("index",), chains=True, calibrate_chains=True
        )
        raw = AdaptiveDrafter(base, cost=cost, config=config, sources=("index",), chains=True)

        def step(which, context, request, temperature=0.0):
            sessions = which.advance([context], [request], temperatures=[temperature])
            shared = which.start_shared([context], config).result()
            return finish_step(which, sessions, shared, config)[0]

        first = step(drafter, [30, 1, 2], "r0")
        assert first.tokens.tolist()[:3] == [3, 4, 5]
        # each token's group: the index (source 0), and the match the chain was drafted from (1 2)
        groups = drafter.chain_calibration.claims(first)[1]
        assert groups.tolist() == [int(length_class([2])[0])] * len(first)
        claimed = float(first.scores.sum())
        unscaled = step(raw, [30, 1, 2], "r0").scores
        assert unscaled.tolist() == [1.0] * len(first)  # one continuation in the index: certain, it claims
        # before anything is learned, the claims at the cold share
        assert claimed == pytest.approx(float(np.cumprod(np.full(len(first), COLD_SHARE)).sum()), abs=0.2)
        for i in range(200):  # each time only the first token is right: 1 2 3, then 50
            step(drafter, [30, 1, 2], f"r{i}")
            step(drafter, [30, 1, 2, 3, 50], f"r{i}")
        learned = step(drafter, [30, 1, 2], "last")
        assert learned.tokens.tolist() == first.tokens.tolist()  # the same chain is chosen
        assert float(learned.scores.sum()) < 0.5 * claimed  # but priced at what it gets
        assert drafter.chain_calibration.trials > 200
        # admitted at a price of a third of a step a draft token: the raw chain is kept, the learned one cut
        cost.per_token = 0.3
        assert len(select_batch_chains([learned], cost, 1)[0]) < len(select_batch_chains([first], cost, 1)[0])
        # a sampled request's chains are priced apart: nothing learned for them yet
        sampled = step(drafter, [30, 1, 2], "hot", temperature=1.0)
        assert float(sampled.scores.sum()) == pytest.approx(claimed, abs=0.2)


def test_calibrate_chains_needs_chains(tmp_path):
    with LocalDrafter.open(write_index(tmp_path / "idx", [[1, 2, 3]], MODEL_VOCAB)) as base:
        with pytest.raises(ValueError, match="calibrate_chains needs chains"):
            AdaptiveDrafter(base, cost=BatchCost(), sources=("index",), calibrate_chains=True)
