"""An engine's step time by the rows it runs and the draft tokens it verifies beside them, learned
from every step it runs (``BatchCost``): how vLLM's steps are priced, where a one-row table
(``drafter.core.cost.VerifyCost``) serves only as a prior. Needs neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Sequence

import numpy as np

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.cost import CostKey, VerifyCost

PROVISIONAL_SLOPE = (
    0.05  # a drafted token's share of a step where nothing better is known (optimistic: it drafts, and learns)
)
CELL_WINDOW = 16  # recent steps per (rows, drafted) kept; their median prices the cell
REFIT_EVERY = 8  # steps between refits
HALF_LIFE = 512  # steps after which a cell not seen again counts half: old evidence yields to the prior
PRIOR_WEIGHT = 8.0  # the prior slope counts as this many steps one drafted token from a row count's mean
OVERHEAD_PRIOR_WEIGHT = 1.0  # no overhead counts as one step: a cell holds at most CELL_WINDOW of its own
FORGET_AFTER = 12 * HALF_LIFE  # steps after which a cell not seen again is dropped (it counts 1/4096)


@dataclasses.dataclass
class _Cell:
    """One (rows, drafted) cell of ``BatchCost``: its recent step times and when it was last seen."""

    times: deque[float]
    last_seen: int = 0


class BatchCost:
    """An engine's step time as a function of the rows it runs and the draft tokens it verifies
    beside them, ``base(rows) + overhead * [drafted > 0] + per_token * drafted``, learned from every
    step the engine runs.

    A step that verifies any draft at all pays ``overhead`` once beside each draft token's price:
    vLLM's rejection sampling and the logits of the draft positions (on a 2-core CPU a step
    drafting one token ran 6.9 ms over one drafting none, then 2.0 ms a token to 4: a line through
    those prices the first token at 3 ms and every later one too high). It is fitted beside the
    slope where a row count has steps with and without drafts, and held at 0 by a prior of
    ``OVERHEAD_PRIOR_WEIGHT`` steps where it has not.

    A step of r rows and d draft tokens is not a one-row step of r + d tokens: each row brings the
    engine's per-row work (sampling, rejection, bookkeeping), which a one-row table never shows, and
    an always-busy engine never runs one-row steps to measure. So each step timed counts for its
    cell (rows, drafted); a cell is priced by the median of its recent steps (a stalled step moves
    nothing); ``per_token`` is the slope shared by all row counts (fixed effects per row count, on
    the cell medians), pulled toward a prior (a one-row table's slope relative to its t(1), else
    ``PROVISIONAL_SLOPE``) with the weight of ``PRIOR_WEIGHT`` steps; ``base(rows)`` follows from
    each row count's cells, and from the nearest row counts where it has none. A cell not seen for
    ``HALF_LIFE`` steps counts half as much: should a noisy spell price drafting out, the prior,
    optimistic by design, wins again in time, drafting resumes, and its steps price it afresh.
    Drafting starts on the first step and never runs filler to measure.

    The first step of a token count (rows + drafted) the engine has not run before is not counted:
    it pays that shape's one-time set-up. In vLLM on a 2-core CPU (``benchmarks.cost_trace``: 8
    requests, ShareGPT and HumanEval) such steps ran 2.9-3.5 ms over the fitted line in the median and
    up to 53 ms, while a new (rows, drafted) cell of a token count run before ran on it (+0.2-0.3
    ms); counted, they held the learned price of a draft token at 1.5-2.5x its steady value for
    200-400 steps (left out: within 25% from the 15th step).

    Steps a request's prefill joined are not priced, nor spread over the steps that are: the
    prefill work is the same whatever is drafted, so the tokens per second of the decode steps
    alone are what drafting should raise. Spreading it (2026-12-02, ``benchmarks/README.md``, "The
    time of prefill steps") drafted a median 35% more tokens at 16 requests and ran no faster."""

    def __init__(self, prior: VerifyCost | None = None, *, count_set_up: bool = False) -> None:
        """``count_set_up``: count every step, a token count's first too (as before 2026-11-28:
        what ``benchmarks.cost_trace`` replays beside the rule)."""
        if prior is not None and len(prior.sizes) > 1:
            t1, last = float(prior.chain(1)), int(prior.sizes[-1])
            self.prior_slope = max(float(prior.chain(last)) - t1, 0.0) / (last - 1) / t1
        else:
            self.prior_slope = PROVISIONAL_SLOPE
        self._cells: dict[tuple[int, int], _Cell] = {}  # (rows, drafted) -> its recent steps
        self.steps = 0
        self._since_fit = 0
        self.per_token = self.prior_slope
        self.overhead = 0.0  # seconds a step pays for verifying any draft at all
        self._rows = np.ones(1)
        self._bases = np.ones(1)
        self._fitted_rows: set[int] = set()  # the row counts of the cells the last fit saw
        self._shapes: set[int] = set()  # the token counts (rows + drafted) of the steps run so far
        self.count_set_up = count_set_up

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """A step of ``rows`` rows and ``drafted`` draft tokens took ``seconds`` (not counted where
        it was the engine's first step of that many tokens: see the class)."""
        if rows + drafted not in self._shapes:
            self._shapes.add(rows + drafted)
            if not self.count_set_up:
                return
        cell = self._cells.setdefault((rows, drafted), _Cell(deque(maxlen=CELL_WINDOW)))
        cell.times.append(seconds)
        cell.last_seen = self.steps
        self.steps += 1
        self._since_fit += 1
        # a row count never seen is priced at once (its base would be a neighbour's); a new cell of
        # a known row count waits for the next refit (under load nearly every step is a new cell)
        if self._since_fit >= REFIT_EVERY or (len(cell.times) == 1 and rows not in self._fitted_rows):
            self.fit()

    def fit(self) -> None:
        """Re-price from the cells observed so far (see the class)."""
        self._since_fit = 0
        for key in [key for key, cell in self._cells.items() if self.steps - cell.last_seen > FORGET_AFTER]:
            del self._cells[key]  # its weight has faded to nothing: an engine's many batch sizes stay bounded
        if not self._cells:
            return
        cells = np.array(list(self._cells), np.float64)  # [c, 2]: rows, drafted
        medians = np.array([statistics.median(cell.times) for cell in self._cells.values()])
        ages = self.steps - np.array([cell.last_seen for cell in self._cells.values()], np.float64)
        weights = np.array([len(cell.times) for cell in self._cells.values()], np.float64) * 0.5 ** (ages / HALF_LIFE)
        rows, inverse = np.unique(cells[:, 0], return_inverse=True)
        drafted, any_draft = cells[:, 1], (cells[:, 1] > 0).astype(np.float64)
        total = np.bincount(inverse, weights)

        def within(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Each row count's weighted mean of ``values``, and the values less their row count's."""
            mean = np.bincount(inverse, weights * values) / total
            return mean, values - mean[inverse]

        mean_d, spread = within(drafted)
        mean_z, switched = within(any_draft)
        mean_t, residual = within(medians)
        plain = medians[cells[:, 1] == 0]
        reference = float(np.median(plain if plain.size else medians))
        prior = self.prior_slope * reference
        # the slope and the overhead by weighted least squares on the cells, each pulled toward its
        # prior (the slope's, with the weight of PRIOR_WEIGHT steps; none, of OVERHEAD_PRIOR_WEIGHT)
        normal = np.array(
            [
                [np.sum(weights * spread**2) + PRIOR_WEIGHT, np.sum(weights * spread * switched)],
                [np.sum(weights * spread * switched), np.sum(weights * switched**2) + OVERHEAD_PRIOR_WEIGHT],
            ]
        )
        slope, overhead = np.linalg.solve(
            normal, [np.sum(weights * spread * residual) + PRIOR_WEIGHT * prior, np.sum(weights * switched * residual)]
        )
        if overhead < 0:  # drafting cannot make a step cheaper: the line alone
            overhead = 0.0
            slope = (np.sum(weights * spread * residual) + PRIOR_WEIGHT * prior) / normal[0, 0]
        self.per_token, self.overhead = max(float(slope), 0.0), float(overhead)
        bases = mean_t - self.per_token * mean_d - self.overhead * mean_z
        self._rows, self._bases = rows, np.maximum(bases, 1e-9)
        self._fitted_rows = set(rows.astype(int).tolist())

    @property
    def largest_rows(self) -> int:
        """The most rows of a step seen (1 before any)."""
        return int(self._rows[-1])

    def base(self, rows: int) -> float:
        """Seconds of a step of ``rows`` rows drafting nothing (the nearest row counts' where it
        has no steps of its own)."""
        return float(np.interp(rows, self._rows, self._bases))

    def seconds(self, rows: int, drafted: int | np.ndarray) -> np.ndarray:
        """Seconds of a step of ``rows`` rows verifying ``drafted`` draft tokens beside them."""
        drafted = np.asarray(drafted, np.float64)
        return self.base(rows) + self.overhead * (drafted > 0) + self.per_token * drafted

    def chain(self, n: int | np.ndarray) -> np.ndarray:
        """One row verifying n tokens (its pending one and a chain of n - 1), as ``VerifyCost.chain``."""
        return self.seconds(1, np.asarray(n) - 1)

    def step_seconds(self, trees: Sequence[DraftTree], rows: int | None = None) -> float:
        """``StepCost.step_seconds``: ``seconds`` of the rows and the trees' draft tokens."""
        return float(self.seconds(len(trees) if rows is None else rows, sum(len(tree) for tree in trees)))

    def observe_step(self, trees: Sequence[DraftTree], seconds: float, rows: int | None = None) -> None:
        """``observe`` for the rows and the trees' draft tokens."""
        self.observe(len(trees) if rows is None else rows, sum(len(tree) for tree in trees), seconds)

    __call__ = chain

    def one_row_table(self, key: CostKey, sizes: Sequence[int]) -> VerifyCost:
        """The one-row chain times at ``sizes`` as a table (to cache as the next engine's prior)."""
        seconds = tuple(float(s) for s in self.chain(np.asarray(sizes)))
        return VerifyCost(key, 0, tuple(sizes), seconds, seconds)
