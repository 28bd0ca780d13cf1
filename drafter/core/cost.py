"""What verifying n tokens costs, as measured: the table every decoding step prices its draft by.

Sequoia: verification time t(n) is not constant -- nearly flat up to tens of tokens on a GPU for a
small model, but several times t(1) at 64 on a CPU -- so the best tree size depends on the machine.
``VerifyCost`` holds t(n) for trees and, apart, for chains (verified on the model's plain causal
path, without the tree mask). t(n) is priced as the cheapest way to run n tokens: as they are, or
padded to a larger measured block that runs faster (``BlockShape``, which the verifier follows), so
a curve that dips (a CPU's kernel choice by shape) is used, not smoothed away. It is measured once
per model, device and dtype (``CostKey``) by ``drafter.hf.measure``, which flags a table it could
not measure cleanly (``unconfirmed``); ``shape_problems`` finds the shapes noise leaves in a table.
``StepCost`` is what a scheduler and a decoding loop ask of any engine's cost.

The rest of the cost model lives beside it: ``drafter.core.corrected_cost`` (a table corrected by
the steps a decoding loop times), ``drafter.core.selection`` (the part of a draft that pays off
most, for one row and for a batch), ``drafter.core.batch_cost`` (an engine's step time by rows and
draft tokens) and ``drafter.core.worth`` (whether drafting pays at all). Their names, once here,
still import from here, with a ``DeprecationWarning`` (``rest_spec._moved``). Importing any of them
imports neither torch, transformers nor numba (selection's compiled chain search comes when first used).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

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
    Returns float64 seconds and int64 block sizes, both shaped like ``n`` (read-only: remembered
    per table and ``n``, since every row of every step prices the same sizes)."""
    n = np.asarray(n, dtype=np.float64)
    return _cheapest_remembered(tuple(sizes), tuple(seconds), n.tobytes(), n.shape)


@functools.lru_cache(maxsize=256)
def _cheapest_remembered(
    sizes: tuple[int, ...], seconds: tuple[float, ...], n_bytes: bytes, shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    n = np.frombuffer(n_bytes, np.float64).reshape(shape)
    cheapest_from = _cheapest_from(sizes, seconds)
    sizes, seconds = np.asarray(sizes, np.int64), np.asarray(seconds, np.float64)
    as_is = _as_is(sizes, seconds, n)
    first = np.searchsorted(sizes, n, side="left")  # the first measured size >= n
    padded_index = cheapest_from[np.minimum(first, sizes.size - 1)]
    padded = np.where(first < sizes.size, seconds[padded_index], np.inf)
    pad = padded < as_is
    prices, blocks = np.where(pad, padded, as_is), np.where(pad, sizes[padded_index], n.astype(np.int64))
    prices.flags.writeable = blocks.flags.writeable = False
    return prices, blocks


@runtime_checkable
class StepCost(Protocol):
    """What a scheduler and a decoding loop ask of an engine's verification cost, whatever it is
    (a measured one-row table, ``VerifyCost``; one corrected by the steps a loop times,
    ``corrected_cost.CorrectedCost``; vLLM's step by rows and draft tokens,
    ``batch_cost.BatchCost``): the price of a step, and what a step took. A step is described by
    what it verified -- ``trees``, one per row that drafts (empty: no draft), in a step of ``rows``
    rows (default: one per tree) -- since a one-row table prices a chain and a tree apart, and a
    batch by its widest row."""

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
        loop, ``selection.select_batch_trees``)."""
        rows = len(trees) if rows is None else rows
        if rows == 1 and len(trees) <= 1:
            tree = trees[0] if trees else DraftTree.empty()
            return float((self.chain if tree.is_chain() else self)(1 + len(tree)))
        return float(self(rows * (1 + max((len(tree) for tree in trees), default=0))))

    def observe_step(self, trees: Sequence[DraftTree], seconds: float, rows: int | None = None) -> None:
        """A measured table learns nothing from the steps it prices (``corrected_cost.CorrectedCost`` does)."""

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
