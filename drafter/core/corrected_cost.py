"""A measured cost table corrected by the verification steps a decoding loop times.

A table (``drafter.core.cost.VerifyCost``) is timed once, on one context length, possibly beside
other work; the loop sees the real steps. ``corrected_cost`` re-prices a table from the typical
times of the step shapes (``StepShape``) observed, and ``CorrectedCost`` keeps those times as a
loop reports them and answers as a table does. Needs neither torch nor transformers.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.cost import BlockShape, VerifyCost, _as_is, shape_problems


class StepShape(NamedTuple):
    """One kind of verification step: a block of ``size`` positions, a chain (the model's causal
    path) or a branching tree, the linear layers transposed or not. What ``drafter.hf.measure`` times
    and a decoding loop observes."""

    size: int
    chain: bool
    transposed: bool


CONSISTENT = 2.0  # observed/tabled ratios within this factor of each other: the table's shape holds


def corrected_cost(
    table: VerifyCost,
    observed: Mapping[StepShape, float],
    *,
    pads: bool = True,
    untrusted: frozenset[int] = frozenset(),
) -> VerifyCost:
    """``table`` corrected by the typical seconds of the step shapes a loop observed.

    An observed shape prices itself, and the other kind of step of its size and layout (chain or
    tree) follows it by the table's chain/tree ratio there (1 where it is ``untrusted``). Sizes not
    observed follow the table scaled by the median ratio of observed to tabled times (interference
    inflates a table unevenly, so no single size sets the scale): over the sizes the table vouches
    for, or over all observed where that is lower. Where the ratios differ by more than
    ``CONSISTENT`` times, the table's shape is noise too: sizes between observed ones are priced by
    interpolating those. Per size the cheaper layout is kept: the table's, or the other one where it
    was observed or, at an ``untrusted`` size, where its steps at sizes on both sides price it.

    Where it must guess, it leans cheap: a loop runs a size priced too cheap and corrects it within
    ``OBSERVED_MIN`` steps, but never runs one priced too dear, which then stays dear for good (a
    busy table's t(1), the one size it vouched for, inflated half as much as its t(16), which no
    step then ran; a layout noise put first at 8, never run again once its steps priced 8 dear).

    ``pads`` False is for engines that run exactly the tokens given (llama.cpp): no size is then
    priced below a smaller one, since no block can be padded to a cheaper larger one."""
    sizes = sorted(set(table.sizes) | {shape.size for shape in observed})
    measured, at = np.asarray(table.sizes, np.float64), np.asarray(sizes, np.float64)
    tabled = {  # kind (chain?) -> {size: the table's seconds as is}
        chain: dict(zip(sizes, _as_is(measured, np.asarray(times, np.float64), at).tolist()))
        for chain, times in ((False, table.seconds), (True, table.chain_seconds or table.seconds))
    }
    table_layout = {size: table.transposed_at(size) for size in sizes}
    ratios = {
        shape: seconds / tabled[shape.chain][shape.size]
        for shape, seconds in observed.items()
        if shape.transposed == table_layout[shape.size]
    }
    trusted = [ratio for shape, ratio in ratios.items() if table.measured_at(shape.size) not in untrusted]
    scale = min((statistics.median(group) for group in (trusted, list(ratios.values())) if group), default=1.0)
    run_in = {  # layout -> {size: (tree, chain) seconds} of the sizes observed in it, either kind standing for both
        layout: {
            shape.size: (
                observed.get(StepShape(shape.size, False, layout), seconds),
                observed.get(StepShape(shape.size, True, layout), seconds),
            )
            for shape, seconds in observed.items()
            if shape.transposed == layout
        }
        for layout in (False, True)
    }

    def between(size: int, transposed: bool) -> tuple[float, float] | None:
        """(tree, chain) at ``size`` in layout ``transposed``, interpolated from its observed sizes
        on both sides; None where it was not observed on both sides."""
        steps = run_in[transposed]
        if not any(s < size for s in steps) or not any(s > size for s in steps):
            return None
        at = sorted(steps)
        trees, chains = zip(*(steps[s] for s in at))
        return float(np.interp(size, at, trees)), float(np.interp(size, at, chains))

    def scaled(size: int) -> tuple[float, float]:
        return scale * tabled[False][size], scale * tabled[True][size]

    def estimate(size: int, guess: tuple[float, float]) -> tuple[float, float, bool]:
        """(tree seconds, chain seconds, transposed) at ``size``; ``guess`` (tree, chain) stands
        for the table's layout where nothing was observed in it."""
        # a chain costs about a tree of its size (the causal path skips only the mask); the
        # table's own ratio is trusted where the table is
        trusted_here = table.measured_at(size) not in untrusted
        chain_per_tree = tabled[True][size] / tabled[False][size] if trusted_here else 1.0
        estimates = {}  # layout -> (tree, chain); the table's layout first, so it wins ties
        for transposed in (table_layout[size], not table_layout[size]):
            tree, chain = (observed.get(StepShape(size, kind, transposed)) for kind in (False, True))
            if tree is None and chain is None:
                if transposed == table_layout[size]:
                    tree, chain = guess
                elif table.transposed and not trusted_here and (neighbours := between(size, transposed)):
                    tree, chain = neighbours
                else:
                    continue  # never timed in this layout
            estimates[transposed] = (
                tree if tree is not None else chain / chain_per_tree,
                chain if chain is not None else tree * chain_per_tree,
            )
        layout = min(estimates, key=lambda transposed: estimates[transposed][0])
        return (*estimates[layout], layout)

    seen = sorted({shape.size for shape in observed})
    known = {size: estimate(size, scaled(size)) for size in seen}
    consistent = not ratios or max(ratios.values()) <= CONSISTENT * min(ratios.values())

    def guess(size: int) -> tuple[float, float]:
        if consistent or not seen[0] < size < seen[-1]:
            return scaled(size)
        trees, chains = zip(*(known[s][:2] for s in seen))
        return float(np.interp(size, seen, trees)), float(np.interp(size, seen, chains))

    trees, chains, layouts = zip(*(known[size] if size in known else estimate(size, guess(size)) for size in sizes))
    if not pads:
        trees, chains = np.maximum.accumulate(trees).tolist(), np.maximum.accumulate(chains).tolist()
    return VerifyCost(
        table.key,
        table.context_length,
        tuple(sizes),
        tuple(trees),
        tuple(chains),
        tuple(layouts) if table.transposed else (),
        table.unconfirmed,
    )


OBSERVED_MIN = 4  # steps of a shape before its own times price it
OBSERVED_WINDOW = 16  # a shape's recent steps, whose median prices it
OBSERVED_REFRESH = 16  # steps between re-pricings, besides a shape's OBSERVED_MIN-th
HEALED_BELOW = 0.9  # a size the steps priced this much below the table is cached at their price
CLEARLY_DEARER = 2.0  # a layout whose first step took this many times the other's typical step is not run again
DEARER = 1.25  # ... or whose two first steps both took this many times it (a shape's first step is its set-up)


class CorrectedCost:
    """A measured ``VerifyCost`` corrected by the verification steps a decoding loop times.

    A table is timed once, on one context length, possibly beside other work, which inflates some
    sizes more than others; the loop sees the real steps. Each step it reports (``observe``) counts
    for its shape; a shape seen ``OBSERVED_MIN`` times prices itself from then on, at the median of
    its last ``OBSERVED_WINDOW`` times (a stalled step moves no price), and the rest follows the
    table scaled (``corrected_cost``). ``current`` is re-priced when a shape reaches
    ``OBSERVED_MIN`` and every ``OBSERVED_REFRESH`` steps. It answers as a ``VerifyCost`` does
    (``select_tree``, ``select_chain``, ``block_shape``): the drafter sizes its trees and the loop
    shapes its blocks by the same corrected prices, and it lives as long as the drafter holding it
    (``AdaptiveDrafter``), across requests.

    A loop never runs what a table prices too high, so it would never learn otherwise:
    ``block_shape`` checks the table's claims the loop acts on, ``OBSERVED_MIN`` steps each, by
    running the alternative -- that padding a block to a larger size is cheaper than running it as
    is (a size noise made dear is exactly one padding avoids), and, at sizes the measurement did not
    confirm (``VerifyCost.unconfirmed``, ``shape_problems``), that the other layout of the linear
    layers is slower (settled by one step where that step is ``CLEARLY_DEARER``, by two where both are
    ``DEARER``, and by none between two settled sizes that found its layout faster). The shape a step
    runs at never changes its output. ``pads`` False: for engines that run exactly the tokens given
    (llama.cpp; see ``corrected_cost``), which check nothing.
    """

    def __init__(self, table: VerifyCost, *, pads: bool = True) -> None:
        self.table, self.pads, self.current = table, pads, table
        self.untrusted = frozenset(table.unconfirmed) | frozenset(shape_problems(table))
        self._times: dict[StepShape, deque[float]] = {}
        self._settled: set[int] = set()  # sizes whose layouts have both run enough to say which is faster
        self.check_steps = 0  # steps run at another shape than the prices chose, to check the table's claims
        self._since_refresh = 0

    def __call__(self, n: int | np.ndarray) -> np.ndarray:
        return self.current(n)

    def chain(self, n: int | np.ndarray) -> np.ndarray:
        return self.current.chain(n)

    def step_seconds(self, trees: Sequence[DraftTree], rows: int | None = None) -> float:
        """``VerifyCost.step_seconds`` by the corrected prices."""
        return self.current.step_seconds(trees, rows)

    def observe_step(self, trees: Sequence[DraftTree], seconds: float, rows: int | None = None) -> None:
        """A step of one row, run at ``block_shape(trees)`` (an engine that does not pad runs the
        tree's own tokens), took ``seconds`` (``observe``); a batch's steps tell nothing of one
        row's prices."""
        if len(trees) == 1 and rows in (None, 1):
            if self.pads:
                priced = self.current.block_shape(trees)
                shape = self._checking(trees, priced)
                self.check_steps += shape != priced
            else:
                shape = BlockShape(len(trees[0]) + 1)
            self.observe(shape, trees[0].is_chain(), seconds)

    def block_shape(self, trees: Sequence[DraftTree]) -> BlockShape:
        """``VerifyCost.block_shape`` by the corrected prices, or, for one row, the alternative to a
        claim still being checked (see the class)."""
        return self._checking(trees, self.current.block_shape(trees))

    def _checking(self, trees: Sequence[DraftTree], shape: BlockShape) -> BlockShape:
        """``shape``, the block the prices chose for ``trees``, or the alternative a check runs instead."""
        if len(trees) != 1 or not self.pads:
            return shape
        chain, own = trees[0].is_chain(), len(trees[0]) + 1
        if shape.size > own:
            as_is = BlockShape(own, self.current.transposed_at(own))
            if self.seen(as_is, chain) < OBSERVED_MIN:
                return as_is
        if self.table.transposed and self.table.measured_at(shape.size) in self.untrusted:
            other = BlockShape(shape.size, not shape.transposed)
            if self.seen(shape, chain) >= OBSERVED_MIN and not self._layout_checked(shape, other, chain):
                return other
        return shape

    def _layout_checked(self, shape: BlockShape, other: BlockShape, chain: bool) -> bool:
        """Whether the claim that ``shape`` is the faster layout at its size has been checked
        against ``other`` (``_checked_at``), or needs no check: the nearest sizes below and above
        whose checks settled, as a tree or a chain, found ``shape``'s layout faster. (The layouts'
        order changes with the size once at most, on every CPU measured here: checking each
        size between two that agree costs steps and finds nothing.)"""
        if self._checked_at(shape, other, chain):
            return True
        below = max((size for size in self._settled if size < shape.size), default=None)
        above = min((size for size in self._settled if size > shape.size), default=None)
        return (
            below is not None
            and above is not None
            and self.current.transposed_at(below) == self.current.transposed_at(above) == shape.transposed
        )

    def _checked_at(self, shape: BlockShape, other: BlockShape, chain: bool) -> bool:
        """Whether ``other`` ran long enough beside ``shape`` (of the same size) to say which is
        faster: ``OBSERVED_MIN`` steps, or one that already took ``CLEARLY_DEARER`` times
        ``shape``'s typical step, or two that both took ``DEARER`` times it. (Small blocks in the
        slower layout cost 2-3x on some CPUs: four such steps each cost more than a step saves; a
        new shape's first step is its set-up, so one step short of 2x settles nothing.) A stall
        can only make ``other`` look dearer, and then the table's layout, which ran as priced, stays."""
        times = self._times.get(StepShape(other.size, chain, other.transposed), ())
        if len(times) >= OBSERVED_MIN:
            return True
        typical = statistics.median(self._times[StepShape(shape.size, chain, shape.transposed)])
        return bool(times) and (
            min(times) >= CLEARLY_DEARER * typical or (len(times) >= 2 and min(times) >= DEARER * typical)
        )

    def unchecked_below(self, size: int) -> int | None:
        """The smallest measured size below ``size`` that the table does not vouch for (unconfirmed,
        or implausible) and that no step has run ``OBSERVED_MIN`` times yet, in any layout, as a
        tree or a chain; None when there is none (or the engine runs exactly the tokens given).
        Selection prices a larger block as cheaper than such a size only on the table's word,
        so it would never run it: ``select_tree`` runs it instead, ``OBSERVED_MIN`` steps each,
        once per cost -- a few steps of smaller trees -- and the prices follow what they took."""
        if not self.pads:
            return None
        for measured in sorted(self.untrusted):
            if measured >= size:
                return None
            counts = (
                self.seen(BlockShape(measured, layout), chain) for layout in (False, True) for chain in (False, True)
            )
            if max(counts) < OBSERVED_MIN:
                return measured
        return None

    def seen(self, shape: BlockShape, chain: bool) -> int:
        """Steps of ``shape`` (chains or trees) observed, up to ``OBSERVED_WINDOW``."""
        return len(self._times.get(StepShape(shape.size, chain, shape.transposed), ()))

    def observe(self, shape: BlockShape, chain: bool, seconds: float) -> None:
        """One step of one row at ``shape``, a chain or a tree, took ``seconds``."""
        key = StepShape(shape.size, chain, shape.transposed)
        times = self._times.setdefault(key, deque(maxlen=OBSERVED_WINDOW))
        times.append(seconds)
        if (  # only what ``block_shape`` checks needs it; a size settled stays settled
            self.pads
            and self.table.transposed
            and shape.size not in self._settled
            and any(
                self.seen(BlockShape(shape.size, layout), kind) >= OBSERVED_MIN
                and self._checked_at(BlockShape(shape.size, layout), BlockShape(shape.size, not layout), kind)
                for layout in (False, True)
                for kind in (False, True)
            )
        ):
            self._settled.add(shape.size)
        self._since_refresh += 1
        if len(times) == OBSERVED_MIN or self._since_refresh >= OBSERVED_REFRESH:
            self.refresh()

    def refresh(self) -> None:
        """Re-price ``current`` from the steps observed so far."""
        self._since_refresh = 0
        self.current = corrected_cost(self.table, self.observed(), pads=self.pads, untrusted=self.untrusted)

    def healed(self) -> VerifyCost | None:
        """The table with each of its sizes whose steps the loop timed (``OBSERVED_MIN`` of a
        shape) at under ``HEALED_BELOW`` of its price taking the corrected price and layout there,
        and confirmed: what the next process should start from (``cost_cache.keep_healed``). None
        when no size qualifies. Only cheaper: a price too cheap costs the next loop a few steps to
        correct, one too dear is never run again (see ``corrected_cost``); the margin keeps the
        noise of one run from ratcheting a good table down."""
        table, observed = self.table, self.observed()
        current = corrected_cost(table, observed, pads=self.pads, untrusted=self.untrusted)  # the latest steps too
        seen = {shape.size for shape in observed}
        trees, chains = list(table.seconds), list(table.chain_seconds or table.seconds)
        layouts, unconfirmed = list(table.transposed), set(table.unconfirmed)
        for i, size in enumerate(table.sizes):
            j = current.sizes.index(size)
            if size in seen and current.seconds[j] < HEALED_BELOW * trees[i]:
                trees[i], chains[i] = current.seconds[j], current.chain_seconds[j]
                if layouts:
                    layouts[i] = current.transposed[j]
                unconfirmed.discard(size)
        if trees == list(table.seconds):
            return None
        return VerifyCost(
            table.key, table.context_length, table.sizes, tuple(trees), tuple(chains), tuple(layouts),
            tuple(sorted(unconfirmed)),
        )  # fmt: skip

    def observed(self) -> dict[StepShape, float]:
        """The median of the recent times of each shape seen ``OBSERVED_MIN`` times or more."""
        return {shape: statistics.median(times) for shape, times in self._times.items() if len(times) >= OBSERVED_MIN}
