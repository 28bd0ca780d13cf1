"""What verifying n tokens costs, and the draft tree that pays off most: used every decoding step.

Sequoia: verification time t(n) is not constant -- nearly flat up to tens of tokens on a GPU for a
small model, but several times t(1) at 64 on a CPU -- so the best tree size depends on the machine.
With node scores that estimate acceptance probabilities (``drafter.merge``),
keeping nodes K yields 1 + sum_K score tokens per step (the accepted ones plus the model's own
bonus token) in t(1 + |K|) seconds. For each size the best prefix-closed set is the top |K| nodes
by score, since scores never grow down a path; scanning the size is exact. Chains are verified on
the model's plain causal path, without the tree mask, and have their own measured cost; the
selection weighs the best chain against the best tree.

t(n) is priced as the cheapest way to run n tokens: as they are, or padded to a larger measured
block that runs faster (``BlockShape``, which the verifier follows), so a curve that dips (a CPU's
kernel choice by shape) is used, not smoothed away. It is measured once per model, device and
dtype by ``drafter.measure``; this module needs neither torch nor transformers.
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

import numpy as np

from rest_spec.datastore.types import DraftTree


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


def _cheapest(sizes: Sequence[int], seconds: Sequence[float], n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest way to verify ``n`` tokens, and the block size it runs at: ``n`` itself
    (``seconds`` at the measured sizes, interpolated linearly between them and continued along
    the last segment past the largest), or ``n`` padded up to a larger measured size that costs
    less (the curve is not monotone on a CPU: on this project's machine 4 tokens cost less than 2).
    Returns float64 seconds and int64 block sizes, both shaped like ``n``."""
    cheapest_from = _cheapest_from(tuple(sizes), tuple(seconds))
    sizes, seconds = np.asarray(sizes, np.int64), np.asarray(seconds, np.float64)
    as_is = np.interp(n, sizes, seconds)
    if sizes.size > 1:
        slope = max(0.0, (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]))
        as_is = np.where(n > sizes[-1], seconds[-1] + slope * (n - sizes[-1]), as_is)
    first = np.searchsorted(sizes, n, side="left")  # the first measured size >= n
    padded_index = cheapest_from[np.minimum(first, sizes.size - 1)]
    padded = np.where(first < sizes.size, seconds[padded_index], np.inf)
    pad = padded < as_is
    return np.where(pad, padded, as_is), np.where(pad, sizes[padded_index], np.asarray(n, np.int64))


@dataclass(frozen=True)
class BlockShape:
    """How the verifier runs one step: ``size`` positions per row (the pending token, the tree,
    then padding), with the model's linear layers computed as ``(W @ x.T).T`` (``transposed``) or
    as PyTorch's ``x @ W.T``; see ``drafter.linear_layout``."""

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

    Queries price the cheapest way to run n tokens (``_cheapest``): as they are, or padded to a
    larger measured size that is faster; ``block_shape`` tells the verifier which it is.
    """

    key: CostKey
    context_length: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    chain_seconds: tuple[float, ...] = ()
    transposed: tuple[bool, ...] = ()

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

    def __call__(self, n: int | np.ndarray) -> np.ndarray:
        """float64 seconds for a tree of ``n`` (>= 1) verified tokens; same shape as ``n``."""
        return _cheapest(self.sizes, self.seconds, np.asarray(n, dtype=np.float64))[0]

    def chain(self, n: int | np.ndarray) -> np.ndarray:
        """float64 seconds for a chain of ``n`` (>= 1) verified tokens; same shape as ``n``."""
        return _cheapest(self.sizes, self.chain_seconds or self.seconds, np.asarray(n, dtype=np.float64))[0]

    def block_shape(self, trees: Sequence[DraftTree]) -> BlockShape:
        """How to verify one step of ``trees`` (one per row). One row runs at the cheapest block
        for its size (a chain by the chain times); a batch runs its own block (the times are for
        one row). The layout is the one measured at the largest size up to the rows the linear
        layers see (rows x block)."""
        size = max((len(tree) for tree in trees), default=0) + 1
        if len(trees) == 1:
            seconds = self.chain_seconds if self.chain_seconds and trees[0].is_chain() else self.seconds
            size = int(_cheapest(self.sizes, seconds, np.asarray(size))[1])
        if not self.transposed:
            return BlockShape(size)
        below = np.searchsorted(self.sizes, len(trees) * size, side="right") - 1
        return BlockShape(size, self.transposed[below])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> VerifyCost:
        data = json.loads(text)
        return cls(
            CostKey(**data["key"]),
            data["context_length"],
            tuple(data["sizes"]),
            tuple(data["seconds"]),
            tuple(data["chain_seconds"]),
            tuple(data["transposed"]),
        )


def select_tree(tree: DraftTree, cost: VerifyCost, max_depth: int | None = None) -> DraftTree:
    """The prefix-closed part of ``tree`` maximizing expected tokens per second,
    (1 + sum of kept scores) / cost of verifying 1 + kept tokens, keeping only nodes at most
    ``max_depth`` deep; no nodes at all when no draft beats verifying the pending token alone.

    Two kinds of candidates compete: for each size k, the top k nodes by score at the tree cost
    ``cost(1 + k)``; and for each node, the chain from the root to it at the chain cost
    ``cost.chain(1 + depth)`` (the causal path, no custom mask). Of equally good choices the
    smaller, and then the tree, wins."""
    candidates = np.arange(len(tree)) if max_depth is None else np.flatnonzero(tree.depths <= max_depth)
    ranked = candidates[np.lexsort((candidates, -tree.scores[candidates]))]  # a parent before its children
    gain = 1.0 + np.concatenate(([0.0], np.cumsum(tree.scores[ranked])))  # [k + 1]: keeping the top 0..k
    rate = gain / cost(1 + np.arange(ranked.size + 1))
    best = int(np.argmax(rate))
    chain_end, chain_rate = _best_chain(tree, cost, candidates)
    if chain_rate > rate[best] * (1 + 1e-12):
        return tree.subset(path_to(tree, chain_end))
    if best == len(tree):
        return tree  # all of it: no copy
    return tree.subset(np.sort(ranked[:best]))


def select_chain(tree: DraftTree, cost: VerifyCost, max_depth: int | None = None) -> DraftTree:
    """The path from the root maximizing expected tokens per second, (1 + sum of its scores) /
    ``cost.chain(1 + its length)``, at most ``max_depth`` long; empty when no path beats verifying
    the pending token alone. For engines that verify chains only (llama.cpp)."""
    candidates = np.arange(len(tree)) if max_depth is None else np.flatnonzero(tree.depths <= max_depth)
    end, rate = _best_chain(tree, cost, candidates)
    if rate <= (1 + 1e-12) / float(cost.chain(1)):
        return DraftTree.empty()
    return tree.subset(path_to(tree, end))


def _best_chain(tree: DraftTree, cost: VerifyCost, candidates: np.ndarray) -> tuple[int, float]:
    """The node among ``candidates`` whose root path has the highest (1 + path score sum) / chain
    cost, and that rate (-1 and 0.0 without candidates); of equal rates the shallowest wins."""
    if candidates.size == 0:
        return -1, 0.0
    rate = (1.0 + path_sums(tree)[candidates]) / cost.chain(1 + tree.depths[candidates])
    best = int(np.argmax(rate))
    return int(candidates[best]), float(rate[best])


def path_to(tree: DraftTree, node: int) -> np.ndarray:
    """int64 [depth]: the nodes from the root's child down to ``node``, in order."""
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(int(tree.parents[path[-1]]))
    return np.array(path[::-1], dtype=np.int64)


def path_sums(tree: DraftTree) -> np.ndarray:
    """float64 [n]: the sum of the scores on the path from the root to each node, itself included
    (one vectorized step per depth level; parents precede children)."""
    sums = np.asarray(tree.scores, dtype=np.float64).copy()
    depths = tree.depths
    for depth in range(2, int(depths.max(initial=0)) + 1):
        level = np.flatnonzero(depths == depth)
        sums[level] += sums[tree.parents[level]]
    return sums
