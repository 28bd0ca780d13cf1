"""``DraftScheduler.step``: the one place that decides whether a step drafts at all, and what a
skipped step means -- on a real ``AdaptiveDrafter`` over a real tiny index."""

from __future__ import annotations

import numpy as np
import pytest

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.batch_cost import BatchCost
from rest_spec.drafter.core.cost import BlockShape, CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.scheduler import NO_OVERLAP, DraftScheduler
from rest_spec.drafter.core.selection import select_batch_chains
from rest_spec.drafter.core.steps import draft_step
from rest_spec.drafter.core.worth import DraftingWorth
from tests.helpers import MODEL_VOCAB, write_index

# a CPU-like cost: 1.9x t(1) at 8 tokens, 4x at 64
CPU_COST = VerifyCost(
    CostKey("synthetic", "", 0, "test", "float32"), 512, (1, 2, 4, 8, 16, 32, 64), (1.0, 1.15, 1.4, 1.9, 2.0, 2.5, 4.0)
)
CONFIG = DraftConfig(budget=64, max_depth=10)
DOCS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 1, 2, 7, 8], list(range(20, 60))]
CONTEXT = [30, 1, 2]  # the index continues 1 2 with 3 4 5 / 3 4 6 / 7 8
VERIFIED = [*CONTEXT, 3, 4, 6, 11]  # the verifier accepted 3 4 6 and added its own token 11


class Scripted(DraftingWorth):
    """A ``DraftingWorth`` whose ``drafts`` answers are given, in turn (``weigh`` as usual)."""

    def __init__(self, *answers: bool) -> None:
        super().__init__()
        self.answers = list(answers)

    def drafts(self, rows: int = 1) -> bool:
        return self.answers.pop(0)


@pytest.fixture
def base(tmp_path):
    with LocalDrafter.open(write_index(tmp_path / "idx", DOCS, MODEL_VOCAB)) as base:
        yield base


def test_a_skipped_step_credits_the_tree_verified_before_it(base):
    drafter = AdaptiveDrafter(base, cost=CPU_COST, config=CONFIG, sources=("index",))
    scheduler = DraftScheduler(drafter, CONFIG, NO_OVERLAP)
    scheduler.worth = Scripted(True, False, True)
    (tree,) = scheduler.step([CONTEXT])
    accepted = tree.accepted_nodes(VERIFIED[len(CONTEXT) :])
    assert accepted.size > 0 and not drafter.calibration.observed.any()

    # the next step does not draft: the tree verified by the step before it is credited all the same
    assert scheduler.step([VERIFIED]) == [DraftTree.empty()]
    assert (scheduler.stats.steps, scheduler.stats.skipped) == (2, 1)
    assert drafter.calibration.observed.sum() == accepted.size
    (cell,) = drafter.attribution.report()
    assert (cell["steps"], cell["accepted"]) == (1, accepted.size)
    # and nothing is credited for the skipped step: the one after finds no tree recorded for it
    predicted = drafter.calibration.predicted.copy()
    scheduler.step([[*VERIFIED, 40]])
    assert drafter.calibration.observed.sum() == accepted.size
    assert (drafter.calibration.predicted == predicted).all()

    # the old order -- the recorded trees dropped (vLLM's ``forget()``) before the next ``advance``
    # took their credit -- lost the verified tree's acceptance
    old = AdaptiveDrafter(base, cost=CPU_COST, config=CONFIG, sources=("index",))
    assert draft_step(old, [CONTEXT], CONFIG) == [tree]
    old.record([DraftTree.empty()], [DraftTree.empty()])  # what ``forget()`` did
    old.advance([VERIFIED], [0])
    assert not old.calibration.observed.any() and not old.attribution.report()


def test_drafting_that_does_not_pay_is_skipped_until_every_request_has_ended(base):
    drafter = AdaptiveDrafter(base, cost=CPU_COST, config=CONFIG, sources=("index",))
    scheduler = DraftScheduler(drafter, CONFIG, NO_OVERLAP)
    assert len(scheduler.step([CONTEXT], ["a"])[0]) > 0
    scheduler.worth.weigh(1, 0.0, 1.0, 0.01)  # nothing expected for a second: the next step skips
    assert scheduler.step([VERIFIED], ["a"]) == [DraftTree.empty()] and scheduler.stats.skipped == 1
    scheduler.worth.weigh(1, 0.0, 1.0, 0.01)
    # a new request where the last one ended (llama.cpp's next prompt): weighed afresh, it drafts
    assert len(scheduler.step([[31, 1, 2]], ["b"], ended=["a"])[0]) > 0 and scheduler.stats.skipped == 1


def test_without_a_cost_every_step_drafts_and_a_batch_weighs_at_its_own_size(base):
    plain = DraftScheduler(AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index",)), CONFIG, NO_OVERLAP)
    plain.worth.weigh(1, 0.0, 1.0, 0.01)
    assert len(plain.step([CONTEXT])[0]) == 6 and plain.stats.skipped == 0
    assert DraftScheduler(None, CONFIG, NO_OVERLAP).step([CONTEXT]) == [DraftTree.empty()]

    # vLLM's case: a step of 4 rows of which one may draft, by an engine's batch cost
    cost = BatchCost()
    drafter = AdaptiveDrafter(base, cost=cost, config=CONFIG, sources=("index",), chains=True)
    scheduler = DraftScheduler(drafter, CONFIG, NO_OVERLAP)
    scheduler.worth.weigh(1, 0.0, 1.0, 0.01)  # one-row steps do not pay: four-row steps are weighed apart
    (chain,) = scheduler.step([CONTEXT], ["r"], batch=4, admit=lambda chains: select_batch_chains(chains, cost, 4))
    assert len(chain) > 0 and chain.is_chain() and scheduler.stats.skipped == 0
    assert scheduler.step([], [], batch=4) == [] and scheduler.stats.steps == 1  # no row may draft: no step


class Recording:
    """A ``StepCost`` that prices every step at one second and records what it is told."""

    def __init__(self) -> None:
        self.observed: list[tuple[list[int], float, int | None]] = []

    def step_seconds(self, trees, rows=None) -> float:
        return 1.0

    def observe_step(self, trees, seconds, rows=None) -> None:
        self.observed.append(([len(tree) for tree in trees], seconds, rows))


def test_the_scheduler_feeds_the_cost_what_each_step_verified(base):
    """Every engine tells the scheduler how long a step took; the scheduler tells the cost which
    trees that step verified, in how many rows, once."""
    cost = Recording()
    scheduler = DraftScheduler(AdaptiveDrafter(base, cost=None, config=CONFIG, sources=("index",)), CONFIG, cost=cost)
    assert scheduler.cost is cost
    scheduler.verified(0.5)  # the prefill: no trees handed yet
    trees = scheduler.step([CONTEXT, [31, 1, 2]], ["a", "b"], batch=3)
    assert all(len(tree) for tree in trees) and cost.observed == []
    scheduler.verified(0.25)
    scheduler.verified(0.125)  # told twice: observed once
    assert cost.observed == [([len(tree) for tree in trees], 0.25, 3)]
    # vLLM's way: the time told at the next step
    trees = scheduler.step([VERIFIED], ["a"], ended=["b"])
    scheduler.step([[*VERIFIED, 40]], ["a"], step_seconds=0.75)
    assert cost.observed[-1] == ([len(trees[0])], 0.75, 1)
    # llama.cpp's: the engine verified less than it was handed
    scheduler.verified(0.0625, [DraftTree.empty()])
    assert cost.observed[-1] == ([0], 0.0625, 1)
    assert (
        scheduler.step_seconds() == 0.1875
    )  # the deadlines follow every time told: the median of 0.1 (the start), 0.5 ... 0.0625


def test_llama_cpps_draft_model_follows_the_schedulers_rule(base):
    """``RestDraftModel`` (no llama.cpp needed to call it: its parts set as ``use_cost`` sets them)
    tells the scheduler its one request and when a new one starts; the scheduler skips."""
    from rest_spec.drafter.llamacpp.draft_model import DraftStats, RestDraftModel

    model = RestDraftModel.__new__(RestDraftModel)
    model.drafter, model.config, model.stats = base, CONFIG, DraftStats()
    model._options = {"config": CONFIG, "sources": ("index",), "suffixes": ()}
    model.adaptive = model.scheduler = None
    model._context_length, model._request = 0, 0
    model.last_chain, model._last_tree = np.zeros(0, np.intc), DraftTree.empty()
    model.use_cost(CPU_COST)  # t(1) 1 s: the first estimate of a step
    model.scheduler.worth = Scripted(True, False)
    chain = model(CONTEXT)
    assert len(chain) > 0 and model.stats.drafted == len(chain)
    seen = model.adaptive.cost.seen(BlockShape(1 + len(chain)), chain=True)
    model.observe(1 + len(chain), 0.002)  # llama.cpp evaluated the chain: the scheduler feeds the cost
    assert model.adaptive.cost.seen(BlockShape(1 + len(chain)), chain=True) == seen + 1
    assert len(model(VERIFIED)) == 0 and (model.stats.calls, model.stats.skipped) == (2, 1)
    assert model.scheduler.step_seconds() == pytest.approx((1.0 + 0.002) / 2)
    # the chain verified before the skip: its tokens up to the first the verifier did not take
    accepted = next(i for i, (ours, taken) in enumerate(zip([*chain, -1], VERIFIED[len(CONTEXT) :])) if ours != taken)
    assert accepted > 0 and sum(cell["accepted"] for cell in model.adaptive.attribution.report()) == accepted
    # a new request (a context no longer than the last): the rule starts over, the first step drafts
    model.scheduler.worth = DraftingWorth()
    model.scheduler.worth.weigh(1, 0.0, 1.0, 0.01)
    assert len(model(CONTEXT)) > 0 and model.stats.skipped == 1 and model._request == 1
