"""What verifying n tokens costs, and the draft tree that pays off most: used every decoding step.

Sequoia: verification time t(n) is not constant -- nearly flat up to tens of tokens on a GPU for a
small model, but several times t(1) at 64 on a CPU -- so the best tree size depends on the machine.
With node scores that estimate acceptance probabilities (``drafter.core.merge``),
keeping nodes K yields 1 + sum_K score tokens per step (the accepted ones plus the model's own
bonus token) in t(1 + |K|) seconds. For each size the best prefix-closed set is the top |K| nodes
by score, since scores never grow down a path; scanning the size is exact. Chains are verified on
the model's plain causal path, without the tree mask, and have their own measured cost; the
selection weighs the best chain against the best tree.

t(n) is priced as the cheapest way to run n tokens: as they are, or padded to a larger measured
block that runs faster (``BlockShape``, which the verifier follows), so a curve that dips (a CPU's
kernel choice by shape) is used, not smoothed away. It is measured once per model, device and
dtype by ``drafter.hf.measure``, which flags a table it could not measure cleanly (``unconfirmed``);
``shape_problems`` finds the shapes noise leaves in a table, and ``CorrectedCost`` corrects a table
by the steps a decoding loop times. This module needs neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from rest_spec.common.types import DraftTree


@dataclass(frozen=True)
class CostKey:
    """What a measurement is valid for: the model (name or path, revision, parameter count, so
    two checkpoints at one path differ), the device (GPU name, or CPU and thread count) and dtype."""

    model: str
    revision: str
    parameters: int
    device: str
    dtype: str

    def file_name(self) -> str:
        """A readable, unique JSON file name for this key."""
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        readable = re.sub(r"[^A-Za-z0-9.]+", "-", f"{Path(self.model).name}-{self.device}-{self.dtype}").strip("-")
        return f"{readable[:80]}-{digest}.json"


def check_sizes(sizes: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``sizes`` start at 1 (t(1) is the baseline) and increase strictly."""
    array = np.asarray(sizes)
    if array.ndim != 1 or array.size == 0 or array[0] != 1 or np.any(np.diff(array) <= 0):
        raise ValueError(f"sizes must start at 1 and increase strictly, got {list(sizes)}")


@functools.lru_cache(maxsize=64)
def _cheapest_from(sizes: tuple[int, ...], seconds: tuple[float, ...]) -> np.ndarray:
    """int64 [len(sizes)]: [i] the index of the cheapest measured size at i or above (per cost
    table, once: every decoding step prices sizes)."""
    cheapest = np.empty(len(sizes), np.int64)
    cheapest[-1] = len(sizes) - 1
    for i in range(len(sizes) - 2, -1, -1):
        above = cheapest[i + 1]
        cheapest[i] = i if seconds[i] <= seconds[above] else above
    cheapest.flags.writeable = False
    return cheapest


def _as_is(sizes: np.ndarray, seconds: np.ndarray, n: np.ndarray | float) -> np.ndarray:
    """``seconds`` for ``n`` tokens run as they are: interpolated linearly between the measured
    ``sizes`` and continued along the last segment past the largest."""
    as_is = np.interp(n, sizes, seconds)
    if sizes.size > 1:
        slope = max(0.0, (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]))
        as_is = np.where(n > sizes[-1], seconds[-1] + slope * (n - sizes[-1]), as_is)
    return as_is


def _cheapest(sizes: Sequence[int], seconds: Sequence[float], n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest way to verify ``n`` tokens, and the block size it runs at: ``n`` itself
    (``seconds`` at the measured sizes, interpolated linearly between them and continued along
    the last segment past the largest), or ``n`` padded up to a larger measured size that costs
    less (the curve is not monotone on a CPU: on this project's machine 4 tokens cost less than 2).
    Returns float64 seconds and int64 block sizes, both shaped like ``n``."""
    cheapest_from = _cheapest_from(tuple(sizes), tuple(seconds))
    sizes, seconds = np.asarray(sizes, np.int64), np.asarray(seconds, np.float64)
    as_is = _as_is(sizes, seconds, n)
    first = np.searchsorted(sizes, n, side="left")  # the first measured size >= n
    padded_index = cheapest_from[np.minimum(first, sizes.size - 1)]
    padded = np.where(first < sizes.size, seconds[padded_index], np.inf)
    pad = padded < as_is
    return np.where(pad, padded, as_is), np.where(pad, sizes[padded_index], np.asarray(n, np.int64))


@runtime_checkable
class StepCost(Protocol):
    """What a scheduler and a decoding loop ask of an engine's verification cost, whatever it is
    (a measured one-row table, ``VerifyCost``; one corrected by the steps a loop times,
    ``CorrectedCost``; vLLM's step by rows and draft tokens, ``BatchCost``): the price of a step,
    and what a step took. A step is described by what it verified -- ``trees``, one per row that
    drafts (empty: no draft), in a step of ``rows`` rows (default: one per tree) -- since a
    one-row table prices a chain and a tree apart, and a batch by its widest row."""

    def step_seconds(self, trees: Sequence[DraftTree], rows: int | None = None) -> float:
        """Seconds of one step verifying ``trees`` (``[]``: a plain step of ``rows`` rows)."""
        ...

    def observe_step(self, trees: Sequence[DraftTree], seconds: float, rows: int | None = None) -> None:
        """The step that verified ``trees`` took ``seconds`` (a cost that does not learn ignores it)."""
        ...


@dataclass(frozen=True)
class BlockShape:
    """How the verifier runs one step: ``size`` positions per row (the pending token, the tree,
    then padding), with the model's linear layers computed as ``(W @ x.T).T`` (``transposed``) or
    as PyTorch's ``x @ W.T``; see ``drafter.hf.linear_layout``."""

    size: int
    transposed: bool = False


@dataclass(frozen=True)
class VerifyCost:
    """Measured seconds of one verification step of ``sizes[i]`` tokens (the pending token
    included, so a tree of k nodes costs ``self(k + 1)``), over a KV cache of ``context_length``:
    ``seconds`` for branching trees (custom tree mask), ``chain_seconds`` for chains, which the
    verifier runs on the model's plain causal path (``tree_attention.TreeInputs.causal``); empty
    when not measured, and chains then cost what trees cost. ``transposed[i]``: size ``sizes[i]``
    was faster, and timed, with the linear layers transposed (``BlockShape``); empty = never.
    ``unconfirmed``: the sizes whose times did not settle when measured (``drafter.hf.measure``: other
    work on the machine); a table with any is provisional.

    Queries price the cheapest way to run n tokens (``_cheapest``): as they are, or padded to a
    larger measured size that is faster; ``block_shape`` tells the verifier which it is.
    """

    key: CostKey
    context_length: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    chain_seconds: tuple[float, ...] = ()
    transposed: tuple[bool, ...] = ()
    unconfirmed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_sizes(self.sizes)
        for name, times in (("seconds", self.seconds), ("chain_seconds", self.chain_seconds or self.seconds)):
            times = np.asarray(times, dtype=np.float64)
            if times.shape != (len(self.sizes),) or not np.all(np.isfinite(times) & (times > 0)):
                raise ValueError(f"{name} must be one positive time per size, got {list(times)}")
        if self.transposed and (
            len(self.transposed) != len(self.sizes) or not all(isinstance(t, bool) for t in self.transposed)
        ):
            raise ValueError(f"transposed must be one bool per size, got {list(self.transposed)}")
        if not set(self.unconfirmed) <= set(self.sizes):
            raise ValueError(f"unconfirmed must be measured sizes, got {list(self.unconfirmed)}")

    def __call__(self, n: int | np.ndarray) -> np.ndarray:
        """float64 seconds for a tree of ``n`` (>= 1) verified tokens; same shape as ``n``."""
        return _cheapest(self.sizes, self.seconds, np.asarray(n, dtype=np.float64))[0]

    def chain(self, n: int | np.ndarray) -> np.ndarray:
        """float64 seconds for a chain of ``n`` (>= 1) verified tokens; same shape as ``n``."""
        return _cheapest(self.sizes, self.chain_seconds or self.seconds, np.asarray(n, dtype=np.float64))[0]

    def step_seconds(self, trees: Sequence[DraftTree], rows: int | None = None) -> float:
        """``StepCost.step_seconds``: one row prices its tree (a chain by the chain times); a batch
        its block padded to the widest row, one row's time for all its tokens (the transformers
        loop, ``select_batch_trees``)."""
        rows = len(trees) if rows is None else rows
        if rows == 1 and len(trees) <= 1:
            tree = trees[0] if trees else DraftTree.empty()
            return float((self.chain if tree.is_chain() else self)(1 + len(tree)))
        return float(self(rows * (1 + max((len(tree) for tree in trees), default=0))))

    def observe_step(self, trees: Sequence[DraftTree], seconds: float, rows: int | None = None) -> None:
        """A measured table learns nothing from the steps it prices (``CorrectedCost`` does)."""

    def block_shape(self, trees: Sequence[DraftTree]) -> BlockShape:
        """How to verify one step of ``trees`` (one per row). One row runs at the cheapest block
        for its size (a chain by the chain times); a batch runs its own block (the times are for
        one row). The layout is the one measured at the largest size up to the rows the linear
        layers see (rows x block)."""
        size = max((len(tree) for tree in trees), default=0) + 1
        if len(trees) == 1:
            seconds = self.chain_seconds if self.chain_seconds and trees[0].is_chain() else self.seconds
            size = int(_cheapest(self.sizes, seconds, np.asarray(size))[1])
        return BlockShape(size, self.transposed_at(len(trees) * size))

    def measured_at(self, rows: int) -> int:
        """The largest measured size up to ``rows`` (>= 1): the measurement that speaks for a block
        of that many rows."""
        return self.sizes[np.searchsorted(self.sizes, rows, side="right") - 1]

    def transposed_at(self, rows: int) -> bool:
        """The layout for linear layers that see ``rows`` rows: the one measured at ``measured_at``."""
        below = np.searchsorted(self.sizes, rows, side="right") - 1
        return bool(self.transposed) and self.transposed[below]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> VerifyCost:
        """The table ``to_json`` wrote; ``KeyError`` for one written before its fields were (a
        table measured before noise checks has no ``unconfirmed``)."""
        data = json.loads(text)
        return cls(
            CostKey(**data["key"]),
            data["context_length"],
            tuple(data["sizes"]),
            tuple(data["seconds"]),
            tuple(data["chain_seconds"]),
            tuple(data["transposed"]),
            tuple(data["unconfirmed"]),
        )


# A smaller block may cost more than a larger one -- kernels are chosen by shape, and one row runs a
# matrix-vector product -- but not this many times more; nor does a block cost this many times more
# per token than a smaller one (the work is linear in the tokens, and more rows use the hardware
# better); a chain and a tree of one size do the same work under different masks.
DEARER_THAN_LARGER = 2.5
DEARER_PER_TOKEN = 2.0
CHAIN_VS_TREE = 1.5


def shape_problems(cost: VerifyCost) -> dict[int, str]:
    """The measured sizes whose times no machine explains, each with what is wrong (``{}`` for a
    plausible table): what other work running during the measurement leaves. Interference only adds
    time, so of two times that disagree, the dearer is blamed."""
    sizes = np.asarray(cost.sizes, np.float64)
    curves = {"t": np.asarray(cost.seconds, np.float64)}
    if cost.chain_seconds:
        curves["chain t"] = np.asarray(cost.chain_seconds, np.float64)
    problems: dict[int, str] = {}

    def time(name: str, i: int) -> str:
        return f"{name}({cost.sizes[i]}) = {1e3 * curves[name][i]:.1f} ms"

    for name, seconds in curves.items():
        per_token = seconds / sizes
        for i in range(len(sizes)):
            if i + 1 < len(sizes):
                j = i + 1 + int(np.argmin(seconds[i + 1 :]))
                if seconds[i] > DEARER_THAN_LARGER * seconds[j]:
                    problems.setdefault(
                        cost.sizes[i], f"{time(name, i)} is {seconds[i] / seconds[j]:.1f}x {time(name, j)}"
                    )
            if i > 0:
                j = int(np.argmin(per_token[:i]))
                if per_token[i] > DEARER_PER_TOKEN * per_token[j]:
                    ratio = per_token[i] / per_token[j]
                    problems.setdefault(
                        cost.sizes[i], f"{time(name, i)} costs {ratio:.1f}x per token what {time(name, j)} does"
                    )
    if cost.chain_seconds:
        for i, (tree, chain) in enumerate(zip(cost.seconds, cost.chain_seconds)):
            dearer, cheaper = ("chain t", "t") if chain > tree else ("t", "chain t")
            if max(tree, chain) > CHAIN_VS_TREE * min(tree, chain):
                ratio = max(tree, chain) / min(tree, chain)
                problems.setdefault(cost.sizes[i], f"{time(dearer, i)} is {ratio:.1f}x {time(cheaper, i)}")
    return dict(sorted(problems.items()))


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
    observed follow the table scaled by the median ratio of observed to tabled times: interference
    inflates a table unevenly, so no single size sets the scale, and measured sizes ``untrusted``
    (unconfirmed, or implausible) set none where others were observed. Where the ratios differ by more than ``CONSISTENT`` times,
    the table's shape is noise too: sizes between observed ones are priced by interpolating those.
    Per size the cheaper layout is kept: the table's, or the other one where it was observed.
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
    scale = statistics.median(trusted or ratios.values()) if ratios else 1.0

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
                if transposed != table_layout[size]:
                    continue  # never timed in this layout
                tree, chain = guess
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
    layers is slower. The shape a step runs at never changes its output. ``pads`` False: for engines
    that run exactly the tokens given (llama.cpp; see ``corrected_cost``), which check nothing.
    """

    def __init__(self, table: VerifyCost, *, pads: bool = True) -> None:
        self.table, self.pads, self.current = table, pads, table
        self.untrusted = frozenset(table.unconfirmed) | frozenset(shape_problems(table))
        self._times: dict[StepShape, deque[float]] = {}
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
            shape = self.block_shape(trees) if self.pads else BlockShape(len(trees[0]) + 1)
            self.observe(shape, trees[0].is_chain(), seconds)

    def block_shape(self, trees: Sequence[DraftTree]) -> BlockShape:
        """``VerifyCost.block_shape`` by the corrected prices, or, for one row, the alternative to a
        claim still being checked (see the class)."""
        shape = self.current.block_shape(trees)
        if len(trees) != 1 or not self.pads:
            return shape
        chain, own = trees[0].is_chain(), len(trees[0]) + 1
        if shape.size > own:
            as_is = BlockShape(own, self.current.transposed_at(own))
            if self.seen(as_is, chain) < OBSERVED_MIN:
                return as_is
        if self.table.transposed and self.table.measured_at(shape.size) in self.untrusted:
            other = BlockShape(shape.size, not shape.transposed)
            if self.seen(shape, chain) >= OBSERVED_MIN > self.seen(other, chain):
                return other
        return shape

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
        self._since_refresh += 1
        if len(times) == OBSERVED_MIN or self._since_refresh >= OBSERVED_REFRESH:
            self.refresh()

    def refresh(self) -> None:
        """Re-price ``current`` from the steps observed so far."""
        self._since_refresh = 0
        self.current = corrected_cost(self.table, self.observed(), pads=self.pads, untrusted=self.untrusted)

    def observed(self) -> dict[StepShape, float]:
        """The median of the recent times of each shape seen ``OBSERVED_MIN`` times or more."""
        return {shape: statistics.median(times) for shape, times in self._times.items() if len(times) >= OBSERVED_MIN}


def select_tree(tree: DraftTree, cost: VerifyCost | CorrectedCost, max_depth: int | None = None) -> DraftTree:
    """The prefix-closed part of ``tree`` maximizing expected tokens per second,
    (1 + sum of kept scores) / cost of verifying 1 + kept tokens, keeping only nodes at most
    ``max_depth`` deep; no nodes at all when no draft beats verifying the pending token alone.

    Two kinds of candidates compete: for each size k, the top k nodes by score at the tree cost
    ``cost(1 + k)``; and for each node, the chain from the root to it at the chain cost
    ``cost.chain(1 + depth)`` (the causal path, no custom mask). Of equally good choices the
    smaller, and then the tree, wins. With a ``CorrectedCost``, a smaller size whose price it
    still has to check (``CorrectedCost.unchecked_below``) is kept instead: its top nodes."""
    candidates = np.arange(len(tree)) if max_depth is None else np.flatnonzero(tree.depths <= max_depth)
    ranked = candidates[np.lexsort((candidates, -tree.scores[candidates]))]  # a parent before its children
    gain = 1.0 + np.concatenate(([0.0], np.cumsum(tree.scores[ranked])))  # [k + 1]: keeping the top 0..k
    rate = gain / cost(1 + np.arange(ranked.size + 1))
    best = int(np.argmax(rate))
    chain_end, chain_rate = _best_chain(tree, cost, max_depth)
    chain_wins = chain_rate > rate[best] * (1 + 1e-12)
    if isinstance(cost, CorrectedCost):  # a size the loop still has to time: this step runs it
        probe = cost.unchecked_below(1 + (int(tree.depths[chain_end]) if chain_wins else best))
        if probe is not None and probe - 1 <= ranked.size:
            best, chain_wins = probe - 1, False
    if chain_wins:
        return tree.chain_to(chain_end)
    if best == len(tree):
        return tree  # all of it: no copy
    return tree.subset(np.sort(ranked[:best]))


def select_chain(tree: DraftTree, cost: VerifyCost | CorrectedCost, max_depth: int | None = None) -> DraftTree:
    """The path from the root maximizing expected tokens per second, (1 + sum of its scores) /
    ``cost.chain(1 + its length)``, at most ``max_depth`` long; empty when no path beats verifying
    the pending token alone. For engines that verify chains only (vLLM, llama.cpp)."""
    end, rate = _best_chain(tree, cost, max_depth)
    if end < 0 or rate <= (1 + 1e-12) / float(cost.chain(1)):
        return DraftTree.empty()
    return tree.chain_to(end)


def _best_chain(tree: DraftTree, cost: VerifyCost | CorrectedCost, max_depth: int | None) -> tuple[int, float]:
    """The node at most ``max_depth`` deep whose root path has the highest (1 + path score sum) /
    chain cost, and that rate (-1 and 0.0 without one); of equal rates the first in BFS order (the
    shallowest). Every row, every step: one compiled pass (``drafter.core.batch_step.best_chain``,
    imported here: importing this module imports no numba), the chain prices looked up once."""
    from rest_spec.drafter.core.batch_step import best_chain

    deepest = tree.max_depth if max_depth is None else min(max_depth, tree.max_depth)
    if deepest < 1:
        return -1, 0.0
    prices = np.asarray(cost.chain(np.arange(1, deepest + 2)), dtype=np.float64)  # [d]: a chain of d drafts
    end, rate = best_chain(tree.parents, tree.scores, tree.depths, prices)
    return int(end), float(rate)


def select_batch_chains(chains: Sequence[DraftTree], cost: BatchCost, rows: int) -> list[DraftTree]:
    """Prefixes of ``chains`` (one per drafted row, each a chain in root-to-leaf order) for a step of
    ``rows`` rows that verifies them all at once, in ``cost.seconds(rows, drafted)``: draft slots
    (row, depth) admitted in order of expected acceptance (their scores) while they raise the
    batch's expected tokens per second, (rows + sum of kept scores) / seconds. A slot that pays
    for one row alone may not pay in a batch, where the step costs every row's time: a step with
    nothing that pays drafts nothing. The same rule at every batch size, one row included."""
    if not chains:
        return []
    scores = np.concatenate([np.asarray(chain.scores, np.float64) for chain in chains])
    owners = np.repeat(np.arange(len(chains)), [len(chain) for chain in chains])
    depths = np.concatenate([np.arange(len(chain)) for chain in chains])
    order = np.lexsort((depths, -scores))  # within a row scores never grow: every cut keeps prefixes
    gain = rows + np.concatenate(([0.0], np.cumsum(scores[order])))
    rate = gain / cost.seconds(rows, np.arange(order.size + 1))
    kept = np.bincount(owners[order[: int(np.argmax(rate))]], minlength=len(chains))
    return [chain if n == len(chain) else chain.subset(np.arange(n)) for chain, n in zip(chains, kept)]


PROVISIONAL_SLOPE = (
    0.05  # a drafted token's share of a step where nothing better is known (optimistic: it drafts, and learns)
)
CELL_WINDOW = 16  # recent steps per (rows, drafted) kept; their median prices the cell
REFIT_EVERY = 8  # steps between refits
HALF_LIFE = 512  # steps after which a cell not seen again counts half: old evidence yields to the prior
PRIOR_WEIGHT = 8.0  # the prior slope counts as this many steps one drafted token from a row count's mean
FORGET_AFTER = 12 * HALF_LIFE  # steps after which a cell not seen again is dropped (it counts 1/4096)


@dataclasses.dataclass
class _Cell:
    """One (rows, drafted) cell of ``BatchCost``: its recent step times and when it was last seen."""

    times: deque[float]
    last_seen: int = 0


class BatchCost:
    """An engine's step time as a function of the rows it runs and the draft tokens it verifies
    beside them, ``base(rows) + per_token * drafted``, learned from every step the engine runs.

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
    Drafting starts on the first step and never runs filler to measure."""

    def __init__(self, prior: VerifyCost | None = None) -> None:
        if prior is not None and len(prior.sizes) > 1:
            t1, last = float(prior.chain(1)), int(prior.sizes[-1])
            self.prior_slope = max(float(prior.chain(last)) - t1, 0.0) / (last - 1) / t1
        else:
            self.prior_slope = PROVISIONAL_SLOPE
        self._cells: dict[tuple[int, int], _Cell] = {}  # (rows, drafted) -> its recent steps
        self.steps = 0
        self._since_fit = 0
        self.per_token = self.prior_slope
        self._rows = np.ones(1)
        self._bases = np.ones(1)

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """A step of ``rows`` rows and ``drafted`` draft tokens took ``seconds``."""
        cell = self._cells.setdefault((rows, drafted), _Cell(deque(maxlen=CELL_WINDOW)))
        cell.times.append(seconds)
        cell.last_seen = self.steps
        self.steps += 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or len(cell.times) == 1:
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
        total = np.bincount(inverse, weights)
        mean_d = np.bincount(inverse, weights * cells[:, 1]) / total
        mean_t = np.bincount(inverse, weights * medians) / total
        spread = cells[:, 1] - mean_d[inverse]
        plain = medians[cells[:, 1] == 0]
        reference = float(np.median(plain if plain.size else medians))
        prior = self.prior_slope * reference
        slope = (np.sum(weights * spread * (medians - mean_t[inverse])) + PRIOR_WEIGHT * prior) / (
            np.sum(weights * spread**2) + PRIOR_WEIGHT
        )
        self.per_token = max(float(slope), 0.0)
        self._rows, self._bases = rows, np.maximum(mean_t - self.per_token * mean_d, 1e-9)

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
        return self.base(rows) + self.per_token * np.asarray(drafted, np.float64)

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


WORTH_WINDOW = 16  # recent drafting steps per batch size whose expected gain and cost are weighed
MAX_SKIP = 16  # the most steps drafting is skipped at a batch size before it is weighed again


class DraftingWorth:
    """Whether drafting pays for itself at a batch size: every engine's one rule for when not to
    draft at all (the sizing rules above decide how much, once it does), applied by the scheduler
    for every engine (``drafter.core.scheduler.DraftScheduler.step``).

    After each step that drafted, the scheduler says what it expected to gain (the kept scores:
    tokens beyond the one a plain step makes, over all rows) and what the step cost beyond a plain
    one (the draft tokens' verification by the engine's cost, and the drafting's own time). Over
    the recent such steps at that batch size, drafting pays where the extra tokens per row
    outweigh the extra time per plain step; where it does not, the next 1, then 2, 4 ... up to
    ``MAX_SKIP`` steps at that size skip drafting (no datastore call, no merge), then it is weighed
    again. An empty draft expects nothing and costs its drafting time, so a source that keeps
    finding nothing is asked less and less often."""

    def __init__(self) -> None:
        self._recent: dict[int, deque[tuple[float, float]]] = {}  # rows -> (expected tokens, extra seconds)
        self._skip: dict[int, tuple[int, int]] = {}  # rows -> (steps still skipped, the next skip's length)

    def drafts(self, rows: int = 1) -> bool:
        """Whether a step of ``rows`` rows drafts (counts a skipped step)."""
        left, length = self._skip.get(rows, (0, 1))
        if left:
            self._skip[rows] = (left - 1, length)
            return False
        return True

    def weigh(self, rows: int, expected: float, extra: float, plain: float) -> None:
        """A step of ``rows`` rows drafted, expecting ``expected`` extra tokens for ``extra``
        seconds beyond a plain step of ``plain`` seconds."""
        recent = self._recent.setdefault(rows, deque(maxlen=WORTH_WINDOW))
        recent.append((expected, extra))
        gained, spent = (sum(values) for values in zip(*recent))
        _, length = self._skip.get(rows, (0, 1))
        if gained / rows >= spent / plain:
            self._skip[rows] = (0, 1)
        else:
            self._skip[rows] = (length, min(2 * length, MAX_SKIP))

    def reset(self) -> None:
        """Start over (a new request where an engine runs one at a time): draft at once."""
        self._recent.clear()
        self._skip.clear()


def select_batch_trees(trees: Sequence[DraftTree], cost: VerifyCost | CorrectedCost) -> list[DraftTree]:
    """Parts of ``trees`` (one per row, each already what pays verified alone) for a step that
    verifies every row in one block padded to the widest (the transformers loop): each row keeps
    its ``w`` best-scored nodes (prefix-closed), ``w`` the width that maximizes the batch's
    expected tokens per second, (rows + sum of kept scores) / ``cost(rows * (1 + w))`` (one row's
    time for the block's token count: the work is linear in the tokens the linear layers see).
    One row keeps its tree."""
    if len(trees) < 2:
        return list(trees)
    widest = max(len(tree) for tree in trees)
    if widest == 0:
        return list(trees)
    gains, ranked = np.zeros(widest + 1), []
    for tree in trees:
        order = np.lexsort((np.arange(len(tree)), -tree.scores))  # a parent before its children
        kept = np.concatenate(([0.0], np.cumsum(tree.scores[order])))
        gains += np.concatenate((kept, np.full(widest - len(tree), kept[-1])))
        ranked.append(order)
    width = int(np.argmax((len(trees) + gains) / cost(len(trees) * (1 + np.arange(widest + 1)))))
    return [tree if len(tree) <= width else tree.subset(np.sort(order[:width])) for tree, order in zip(trees, ranked)]
