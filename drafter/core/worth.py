"""Whether drafting pays for itself at all, per batch size (``DraftingWorth``): the one rule every
engine's scheduler follows for when not to draft."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

WORTH_WINDOW = 16  # recent drafting steps per batch size whose expected gain and cost are weighed
MAX_SKIP = 16  # the most steps drafting is skipped at a batch size before it is weighed again


class DraftingWorth:
    """Whether drafting pays for itself at a batch size: every engine's one rule for when not to
    draft at all (the sizing rules of ``drafter.core.selection`` decide how much, once it does),
    applied by the scheduler for every engine (``drafter.core.scheduler.DraftScheduler.step``).

    After each step that drafted, the scheduler says what it expected to gain (the kept scores:
    tokens beyond the one a plain step makes, over all rows) and what the step cost beyond a plain
    one (the draft tokens' verification by the engine's cost, and the drafting's own time). Over
    the recent such steps at that batch size, drafting pays where the extra tokens per row
    outweigh the extra time per plain step; where it does not, the next 1, then 2, 4 ... up to
    ``MAX_SKIP`` steps at that size skip drafting (no datastore call, no merge), then it is weighed
    again. An empty draft expects nothing and costs its drafting time, so a source that keeps
    finding nothing is asked less and less often.

    The extra time of the recent steps is their median step's, times their number: a stall (a cold
    index's first page faults, a thread starting, a collection) says nothing of what drafting
    costs, yet one stalled second summed in would outweigh sixteen steps of gains and, weighed again
    and again while it stays in the window, skip drafting at that size for a hundred steps (in vLLM,
    HumanEval at 8 requests: half the steps skipped, after a 1.3 s first step). A step priced
    before the cost knows a plain step's time (0 s) is not weighed.

    A step's extra time is priced when it is weighed, by the cost as it stood then; a cost that
    learns (vLLM's ``BatchCost``) may price the same draft tokens at a third of that a few steps
    later. So a step weighed with ``reprice`` (its extra time by the cost as it stands) is priced
    again before the recent steps can skip drafting: in vLLM on HumanEval at 8 requests the first
    steps, priced by the cost's prior at 1.66 ms a draft token, skipped drafting until the 58th
    step though the cost had learned 0.63 ms at the 14th (``benchmarks.cost_trace``)."""

    def __init__(self) -> None:
        # rows -> (expected tokens, extra seconds, their pricing by the cost as it stands or None)
        self._recent: dict[int, deque[tuple[float, float, Callable[[], float] | None]]] = {}
        self._skip: dict[int, tuple[int, int]] = {}  # rows -> (steps still skipped, the next skip's length)

    def drafts(self, rows: int = 1) -> bool:
        """Whether a step of ``rows`` rows drafts (counts a skipped step)."""
        left, length = self._skip.get(rows, (0, 1))
        if left:
            self._skip[rows] = (left - 1, length)
            return False
        return True

    def weigh(
        self, rows: int, expected: float, extra: float, plain: float, reprice: Callable[[], float] | None = None
    ) -> None:
        """A step of ``rows`` rows drafted, expecting ``expected`` extra tokens for ``extra``
        seconds beyond a plain step of ``plain`` seconds (``reprice``: those seconds by the cost
        as it will stand, asked before the recent steps skip drafting)."""
        if plain <= 0:
            return
        recent = self._recent.setdefault(rows, deque(maxlen=WORTH_WINDOW))
        recent.append((expected, extra, reprice))
        pays = self._pays(recent, rows, plain)
        if not pays and any(again is not None for _, _, again in recent):
            repriced = [(gain, cost if again is None else again(), again) for gain, cost, again in recent]
            recent.clear()
            recent.extend(repriced)
            pays = self._pays(recent, rows, plain)
        _, length = self._skip.get(rows, (0, 1))
        self._skip[rows] = (0, 1) if pays else (length, min(2 * length, MAX_SKIP))

    @staticmethod
    def _pays(recent: deque[tuple[float, float, Callable[[], float] | None]], rows: int, plain: float) -> bool:
        """Whether the recent steps' extra tokens per row outweigh their extra time per plain step."""
        gained = sum(gain for gain, _, _ in recent)
        spent = statistics.median(cost for _, cost, _ in recent) * len(recent)
        return gained / rows >= spent / plain

    def reset(self) -> None:
        """Start over (a new request where an engine runs one at a time): draft at once."""
        self._recent.clear()
        self._skip.clear()
