"""Measuring t(n) for a transformers model, the cost model's input (``drafter.core.cost.VerifyCost``).

t(n) is measured once per model, device and dtype with the real verifier (``verify_trees`` on top
of a KV cache of realistic length, in interleaved rounds checked for noise: ``measure_verify_cost``),
cached by ``drafter.core.cost_cache`` and re-measured by ``rest-measure-cost``
(``drafter.cli.measure_cost``). torch is imported only inside the functions that time.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.corrected_cost import StepShape
from rest_spec.drafter.core.cost import BlockShape, CostKey, VerifyCost, check_sizes, shape_problems
from rest_spec.drafter.core.cost_cache import cached_cost, check_timing, note_unsettled, read_cost

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
DEFAULT_CONTEXT_LENGTH = 512
DEFAULT_ROUNDS = 4
SETTLED = 0.1  # a step's time has settled when its two lowest rounds agree within this fraction
EXTRA_ROUNDS = 4  # rounds of their own, at most, for the steps that did not settle ...
RETIME_SHARE = 0.5  # ... taking at most about this share of the first rounds' time
_BRANCHING = 4

StepTimer = Callable[[DraftTree, bool], float]  # seconds of one step of a tree, transposed or not


def cost_key(model: PreTrainedModel) -> CostKey:
    """What ``model`` as loaded (device, dtype, threads) would be measured as."""
    import torch

    device = model.device
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{device.type}-{platform.machine()}-{torch.get_num_threads()}threads"
    return CostKey(
        model=str(model.config.name_or_path),
        revision=str(getattr(model.config, "_commit_hash", None) or ""),
        parameters=sum(p.numel() for p in model.parameters()),
        device=device_name,
        dtype=str(model.dtype).removeprefix("torch."),
    )


def verify_timer(
    model: PreTrainedModel,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    repeats: int = 5,
    warmup: int = 2,
    plain_cache: bool = False,
) -> Callable[[DraftTree, bool], float]:
    """A function timing one ``verify_trees`` step of a tree (median wall seconds of ``repeats``
    runs after ``warmup``), in PyTorch's layout or transposed, on a cache of ``context_length``
    random tokens that is cut back after every run. ``plain_cache``: the ``DynamicCache`` that
    ``model.generate`` builds (concatenating) instead of ``kv_cache.new_cache``'s, for baselines."""
    import torch

    from rest_spec.drafter.hf.internals import DynamicCache, forward_with_cache
    from rest_spec.drafter.hf.kv_cache import CacheRows, compact_cache, new_cache
    from rest_spec.drafter.hf.verify import verify_trees

    check_timing(repeats, warmup, context_length)
    vocab = int(model.config.vocab_size)
    context = torch.randint(vocab, (1, context_length + 1), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config) if plain_cache else new_cache(model)
    with torch.inference_mode():
        forward_with_cache(model, cache, input_ids=context[:, :-1].to(model.device))
    rows = CacheRows.full(1, context_length)
    contexts = context.tolist()
    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None

    def median_seconds(tree: DraftTree, transposed: bool) -> float:
        times = []
        for _ in range(warmup + repeats):
            synchronize()
            start = time.perf_counter()
            # ends in the step's one device->host sync
            verify_trees(model, cache, rows, contexts, [tree], shape=BlockShape(len(tree) + 1, transposed))
            times.append(time.perf_counter() - start)
            compact_cache(cache, rows, [np.zeros(0, np.int64)])  # back to the context alone
        return statistics.median(times[warmup:])

    return median_seconds


def measured_tree(n: int, chain: bool = False) -> DraftTree:
    """The tree timed for n verified tokens: n - 1 nodes, a complete 4-ary BFS tree or a chain
    (only n matters, not the shape)."""
    index = np.arange(n - 1)
    return DraftTree(index % _BRANCHING + 1, index - 1 if chain else index // _BRANCHING - 1, np.ones(n - 1))


def measured_steps(sizes: Sequence[int]) -> list[StepShape]:
    """The steps a measurement of ``sizes`` times: a tree and a chain of each size in both layouts
    (size 1, the empty tree, once per layout)."""
    return [
        StepShape(n, chain, transposed)
        for n in sizes
        for chain in ((False,) if n == 1 else (False, True))
        for transposed in (False, True)
    ]


def settled(times: Sequence[float]) -> bool:
    """Whether a step's lowest time is confirmed: its second lowest agrees within ``SETTLED``."""
    return len(times) > 1 and sorted(times)[1] <= (1 + SETTLED) * min(times)


def lowest_cost(key: CostKey, context_length: int, samples: Mapping[StepShape, Sequence[float]]) -> VerifyCost:
    """The table of each step's lowest time (every step of ``measured_steps``): per size the
    faster layout's tree, and the chain in that layout."""
    lowest = {step: min(times) for step, times in samples.items()}
    sizes = sorted({step.size for step in samples})
    trees, chains, layouts = [], [], []
    for n in sizes:
        plain, transposed = lowest[StepShape(n, False, False)], lowest[StepShape(n, False, True)]
        layouts.append(transposed < plain)
        trees.append(min(plain, transposed))
        chains.append(lowest[StepShape(n, True, layouts[-1])] if n > 1 else trees[-1])
    return VerifyCost(key, context_length, tuple(sizes), tuple(trees), tuple(chains), tuple(layouts))


def measure_verify_cost(
    model: PreTrainedModel,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    rounds: int = DEFAULT_ROUNDS,
    timer: StepTimer | None = None,
) -> VerifyCost:
    """Wall time of one ``verify_trees`` step with a tree of ``n - 1`` nodes, and with a chain of
    ``n - 1`` nodes, for each n in ``sizes``, in both layouts of the linear layers
    (``drafter.hf.linear_layout``); per size the faster layout's tree is kept, and its chain.

    Other work on the machine only adds time, in bursts, so each step is timed once per round, a
    round going over every step in turn (a burst then costs a few sizes one round each, instead of
    one size all its runs), and the lowest round counts; it has settled when a second round agrees
    within ``SETTLED``. The steps that did not settle, and every step of a size whose times no
    machine explains (``drafter.core.cost.shape_problems``), are timed again in up to ``EXTRA_ROUNDS``
    rounds of their own, for at most about ``RETIME_SHARE`` of the first rounds' time (on a machine
    that stays busy, more rounds only make the first run longer). Sizes still unsettled are left
    ``unconfirmed`` with a line at INFO: the table is provisional, and the decoding loop corrects it
    (``drafter.core.corrected_cost.CorrectedCost``), so nothing is asked of the user.

    ``timer`` times one step (``StepTimer``); default: one run of ``verify_timer``'s.
    """
    check_sizes(sizes)
    if rounds < 2:
        raise ValueError(f"need rounds >= 2 (a second round confirms a time), got {rounds}")
    time_step = timer or verify_timer(model, context_length, repeats=1, warmup=0)
    key = cost_key(model)
    samples: dict[StepShape, list[float]] = {step: [] for step in measured_steps(sizes)}

    def time_round(steps: Sequence[StepShape]) -> float:
        """Time ``steps`` once each; returns the seconds they took."""
        for step in steps:
            samples[step].append(time_step(measured_tree(step.size, step.chain), step.transposed))
        return sum(samples[step][-1] for step in steps)

    def unsettled() -> list[StepShape]:
        implausible = shape_problems(lowest_cost(key, context_length, samples))
        return [step for step, times in samples.items() if step.size in implausible or not settled(times)]

    budget = RETIME_SHARE * sum(time_round(list(samples)) for _ in range(rounds))
    for _ in range(EXTRA_ROUNDS):
        retime = unsettled()
        if not retime or budget <= 0:
            break
        budget -= time_round(retime)
    cost = lowest_cost(key, context_length, samples)
    for n, tree, chain in zip(cost.sizes, cost.seconds, cost.chain_seconds):
        log.info(
            "t(%d) = %.3f ms tree (%.3f ms in PyTorch's layout, %.3f ms transposed), %.3f ms chain",
            n,
            1e3 * tree,
            1e3 * min(samples[StepShape(n, False, False)]),
            1e3 * min(samples[StepShape(n, False, True)]),
            1e3 * chain,
        )
    left = unsettled()
    cost = dataclasses.replace(cost, unconfirmed=tuple(sorted({step.size for step in left})))
    if left:
        step, problems = left[0], shape_problems(cost)
        best = sorted(samples[step])[:2]
        problem = next(
            iter(problems.values()),
            f"{'chain' if step.chain else 'tree'} t({step.size}){' transposed' if step.transposed else ''} "
            f"took {1e3 * best[0]:.1f} and {1e3 * best[1]:.1f} ms in its best rounds",
        )
        note_unsettled(cost, f"the verification cost did not settle in {len(samples[step])} rounds ({problem})")
    return cost


def load_or_measure(
    model: PreTrainedModel, *, directory: Path | None = None, remeasure: bool = False, **measure_options
) -> VerifyCost:
    """The cached cost for this model, device and dtype, measured and cached when missing (or
    when ``remeasure``). ``measure_options`` go to ``measure_verify_cost``."""
    return cached_cost(
        cost_key(model), lambda: measure_verify_cost(model, **measure_options), directory=directory, remeasure=remeasure
    )


def load_cached(model: PreTrainedModel, *, directory: Path | None = None) -> VerifyCost | None:
    """The cost cached for this model, device and dtype, or None when there is none (nothing is
    measured): for plain decoding, which runs at the table's fastest one-token block when one exists."""
    key = cost_key(model)
    return read_cost(key, directory=directory, otherwise="not using it")
