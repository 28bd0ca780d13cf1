"""``BatchCost``: an engine's step time by rows and draft tokens, learned from the steps it runs
(what vLLM's proposer sizes its batches by, ``select_batch_chains``); ``DraftingWorth``: when the
engines do not draft at all."""

from __future__ import annotations

import numpy as np
import pytest

from rest_spec.drafter.core.batch_cost import CELL_WINDOW, FORGET_AFTER, HALF_LIFE, PROVISIONAL_SLOPE, BatchCost
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.selection import select_batch_chains
from rest_spec.drafter.core.worth import MAX_SKIP, DraftingWorth
from tests.helpers import scored_chain

KEY = CostKey("m", "r", 1, "cpu", "float32")


def step(rows: int, drafted: int) -> float:
    """The engine this test pretends to be: 40 ms, 3 ms per row beyond the first, 2 ms a draft token."""
    return 0.040 + 0.003 * (rows - 1) + 0.002 * drafted


def test_it_learns_each_row_counts_base_and_the_shared_per_token_price():
    cost = BatchCost()
    rng = np.random.default_rng(0)
    for _ in range(400):
        rows = int(rng.choice([1, 2, 4, 8]))
        drafted = int(rng.integers(0, 4 * rows + 1))
        cost.observe(rows, drafted, step(rows, drafted))
    cost.fit()
    assert cost.per_token == pytest.approx(0.002, rel=0.02)
    for rows in (1, 2, 4, 8):
        assert cost.base(rows) == pytest.approx(step(rows, 0), rel=0.02)
    assert cost.base(3) == pytest.approx((cost.base(2) + cost.base(4)) / 2)  # between row counts it saw
    assert cost.base(16) == pytest.approx(cost.base(8))  # past them, the nearest
    np.testing.assert_allclose(cost.seconds(4, np.array([0, 5])), [step(4, 0), step(4, 5)], rtol=0.02)
    np.testing.assert_allclose(cost.chain(np.array([1, 9])), [step(1, 0), step(1, 8)], rtol=0.02)


def test_a_steps_overhead_for_drafting_at_all_is_learned_beside_the_per_token_price():
    """vLLM's step on a 2-core CPU: a step that drafts anything pays once for it (rejection sampling,
    the draft positions' logits) beside each token's price. Learned apart, the first draft token is
    priced at what it costs, not at the line's average; where a row count never drafts nothing,
    nothing tells the overhead from the base and it stays at its prior, none."""
    cost = BatchCost()
    rng = np.random.default_rng(1)
    for _ in range(400):
        rows = int(rng.choice([1, 4]))
        drafted = int(rng.integers(0, 4 * rows + 1))
        cost.observe(rows, drafted, step(rows, drafted) + 0.005 * (drafted > 0))
    cost.fit()
    assert cost.overhead == pytest.approx(0.005, rel=0.1) and cost.per_token == pytest.approx(0.002, rel=0.05)
    np.testing.assert_allclose(cost.seconds(4, np.array([0, 1, 6])), [0.049, 0.056, 0.066], rtol=0.02)
    # a pending token and one draft cost the overhead too: a chain of one must pay for it
    assert cost.chain(2) - cost.chain(1) == pytest.approx(0.007, rel=0.1)

    always = BatchCost()
    for _ in range(100):
        drafted = int(rng.integers(1, 9))  # every step drafts: the overhead is the base's part
        always.observe(1, drafted, step(1, drafted) + 0.005)
    always.fit()
    assert always.overhead == pytest.approx(0.0, abs=1e-4) and always.per_token == pytest.approx(0.002, rel=0.05)


def test_a_stalled_step_moves_no_price():
    cost = BatchCost()
    for _ in range(8):
        for drafted in range(6):
            cost.observe(2, drafted, step(2, drafted))
    cost.fit()
    before = (cost.base(2), cost.per_token)
    cost.observe(2, 5, 10 * step(2, 5))  # one step stalled by something else on the machine
    cost.fit()
    assert (cost.base(2), cost.per_token) == pytest.approx(before, rel=1e-3)  # the cell median held


def test_a_shapes_first_step_is_its_set_up_and_sets_no_price():
    """The first step of each token count pays a one-time set-up (in vLLM on this CPU: 2-3 ms over
    the line in the median, 53 ms at worst, measured): not counted, so one large draft timed at the
    start does not price drafting for hundreds of steps; a new (rows, drafted) cell of a token count
    run before is counted at once."""
    cost = BatchCost()
    cost.observe(8, 56, 3 * step(8, 56))  # 64 tokens, a shape never run: its set-up
    for i in range(64):
        drafted = i % 9
        cost.observe(8, drafted, step(8, drafted) + (0.004 if i < 9 else 0.0))  # each shape's first slow
    cost.fit()
    assert cost.steps == 64 - 9 and (8, 56) not in cost._cells
    assert cost.per_token == pytest.approx(0.002, rel=0.02) and cost.base(8) == pytest.approx(step(8, 0), rel=0.02)
    cost.observe(7, 1, step(7, 1))  # 8 tokens, run before as 8 rows drafting nothing: counted
    assert cost.steps == 56 and (7, 1) in cost._cells


def test_before_any_step_the_prior_slope_prices_drafting():
    assert BatchCost().per_token == PROVISIONAL_SLOPE  # relative to a base of 1: only ratios matter
    table = VerifyCost(KEY, 0, (1, 2, 5), (0.050, 0.052, 0.060))
    cost = BatchCost(table)
    assert cost.prior_slope == pytest.approx(0.010 / 4 / 0.050)
    # one plain step of 50 ms sets the scale (the second: the first of a shape is its set-up); the
    # slope is the table's, relative to it
    cost.observe(1, 0, 0.500)
    assert cost.per_token == pytest.approx(0.010 / 4 / 0.050)  # nothing counted yet: the prior, relative
    cost.observe(1, 0, 0.050)
    assert cost.per_token == pytest.approx(0.0025, rel=0.01)
    assert float(cost.chain(5)) == pytest.approx(0.060, rel=0.01)


def test_drafting_priced_out_by_a_noisy_spell_resumes_once_old_steps_fade():
    cost = BatchCost()
    for _ in range(16):  # a spell where every drafted step was slow: 20 ms a draft token
        for drafted in (0, 4, 8):
            cost.observe(4, drafted, 0.050 + 0.020 * drafted)
    likely = [scored_chain([0.8, 0.7, 0.6])] * 4
    assert all(len(c) == 0 for c in select_batch_chains(likely, cost, rows=4))
    # drafting nothing, the engine only times plain steps; the slow drafted steps fade toward
    # the (optimistic) prior, and drafting is tried again
    steps = 0
    while all(len(c) == 0 for c in select_batch_chains(likely, cost, rows=4)):
        cost.observe(4, 0, 0.050)
        steps += 1
        assert steps < 20 * HALF_LIFE
    assert steps > HALF_LIFE  # not at the first plain step: evidence is forgotten slowly


def test_the_learned_cost_caches_as_a_one_row_table_that_is_its_own_prior():
    cost = BatchCost()
    for _ in range(4):
        for drafted in range(9):
            cost.observe(1, drafted, step(1, drafted))
    table = cost.one_row_table(KEY, (1, 2, 5, 9))
    assert table.sizes == (1, 2, 5, 9) and float(table.chain(9)) == pytest.approx(step(1, 8))
    assert BatchCost(table).prior_slope == pytest.approx(0.002 / 0.040)


def test_cells_not_seen_for_long_are_dropped_and_the_price_holds():
    """An engine that ran many batch sizes once keeps no record of them forever: a cell unseen
    for ``FORGET_AFTER`` steps is gone, and the price is what the live cells say."""
    cost = BatchCost()
    for rows in range(2, 60):  # a burst of batch sizes, each seen once (after its shape's first step)
        cost.observe(rows, rows, step(rows, rows))
        cost.observe(rows, rows, step(rows, rows))
    assert len(cost._cells) == 58
    for i in range(FORGET_AFTER + 16):
        cost.observe(1, i % 4, step(1, i % 4))
    assert set(cost._cells) == {(1, 0), (1, 1), (1, 2), (1, 3)}
    assert cost.per_token == pytest.approx(0.002, rel=0.05)


def test_drafting_that_does_not_pay_is_skipped_longer_each_time_until_it_pays():
    worth = DraftingWorth()
    drafted = []
    for step_number in range(80):  # empty drafts: nothing expected, a millisecond of drafting each
        if worth.drafts(4):
            drafted.append(step_number)
            worth.weigh(4, 0.0, 0.001, 0.040)
    gaps = np.diff(drafted).tolist()
    assert gaps[:5] == [2, 3, 5, 9, 17] and set(gaps[4:]) == {MAX_SKIP + 1}
    assert worth.drafts(1)  # another batch size is weighed on its own
    waited = 0
    while not worth.drafts(4):  # the current skip runs out
        waited += 1
    assert waited <= MAX_SKIP
    for _ in range(8):  # drafts that pay (2 tokens a row expected for a fifth of a step): every step drafts
        worth.weigh(4, 8.0, 0.008, 0.040)
        assert worth.drafts(4)
    worth.weigh(4, 0.0, 0.001, 0.040)  # one empty draft among paying ones skips nothing
    assert worth.drafts(4)


def test_steps_priced_by_a_cost_that_has_since_learned_are_priced_again_before_they_skip():
    """Eight rows, 8 draft tokens a step expecting 2.4 tokens: at a prior of 1.66 ms a token against
    a 25 ms plain step that does not pay, at the 0.63 ms the engine learns it does. Steps weighed
    with their pricing by the cost as it stands are priced again before they skip: drafting resumes
    at the first step weighed after the cost learned, where numbers fixed when weighed keep skipping."""
    cost = BatchCost()
    for drafted in (0, 8, 0, 8, 8):  # the engine as the prior priced it, each token count's second step counted
        cost.observe(8, drafted, 0.025 + 0.00166 * drafted)
        cost.observe(8, drafted, 0.025 + 0.00166 * drafted)
    cost.fit()
    assert cost.per_token == pytest.approx(0.00166, rel=0.05)
    trees = [scored_chain([0.5, 0.3, 0.1])] * 2 + [scored_chain([0.4, 0.2])]  # 8 draft tokens

    def extra() -> float:
        return cost.step_seconds(trees, 8) - cost.step_seconds([], 8)

    repriced, fixed = DraftingWorth(), DraftingWorth()
    for _ in range(4):  # priced out: both skip
        for worth in (repriced, fixed):
            worth.weigh(8, 2.4, extra(), cost.step_seconds([], 8), reprice=extra if worth is repriced else None)
    assert not repriced.drafts(8) and not fixed.drafts(8)
    for _ in range(CELL_WINDOW):  # the engine's steps now say 0.63 ms a token
        for drafted in (0, 8):
            cost.observe(8, drafted, 0.025 + 0.00063 * drafted)
    cost.fit()
    assert cost.per_token == pytest.approx(0.00063, rel=0.1)
    for worth in (repriced, fixed):
        while not worth.drafts(8):  # the skip runs out
            pass
    for worth in (repriced, fixed):
        worth.weigh(8, 2.4, extra(), cost.step_seconds([], 8), reprice=extra if worth is repriced else None)
    assert repriced.drafts(8)  # the window priced again: it pays
    assert not fixed.drafts(8)  # four steps priced at 1.66 ms outweigh one at 0.63


def test_a_stalled_step_does_not_stop_drafting_that_pays():
    """A drafting step that stalled for a second (a cold index's page faults) among steps that
    pay skips a step or two while it is most of what is known, then nothing while it stays in the
    window; a step priced before the cost knew a plain step (0 s) is not weighed."""
    worth = DraftingWorth()
    worth.weigh(8, 0.0, 0.003, 0.0)  # the cost knows nothing yet: not weighed
    assert worth.drafts(8)
    worth.weigh(8, 12.0, 1.3, 0.025)  # stalled: 52 plain steps of extra time
    skipped = []
    for step_number in range(40):
        if worth.drafts(8):
            worth.weigh(8, 12.0, 0.018, 0.025)  # 1.5 tokens a row for 0.7 of a plain step
        else:
            skipped.append(step_number)
    assert skipped == [0, 2, 3]  # then the median is a paying step's, and the sum would still be the stall's
    slow = DraftingWorth()  # drafting that is slow at every step is skipped
    for _ in range(4):
        slow.weigh(8, 12.0, 0.060, 0.025)
    assert not slow.drafts(8)


def test_a_reset_drafts_at_once():
    worth = DraftingWorth()
    worth.weigh(1, 0.0, 0.001, 0.040)
    assert not worth.drafts(1)
    worth.reset()
    assert worth.drafts(1)
