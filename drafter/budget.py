"""What verifying n tokens costs on this hardware, and the draft tree that pays off most.

Sequoia (NOTES section 4): verification time t(n) is not constant -- nearly flat up to ~64 tokens
on a GPU for a small model, but 1.9x at 8 tokens and 4x at 64 on this CPU (section 8) -- so the
best tree size depends on the machine. With node scores that estimate acceptance probabilities
(``drafter.merge``), keeping nodes K yields 1 + sum_K score tokens per step (the accepted ones
plus the model's own bonus token) in t(1 + |K|) seconds. For each size the best prefix-closed set
is the top |K| nodes by score, since scores never grow down a path; scanning the size is exact.
Chains are verified on the model's plain causal path, without the tree mask, and have their own
measured cost; the selection weighs the best chain against the best tree.

t(n) is measured once per model, device and dtype with the real verifier (``verify_tree`` on top
of a KV cache of realistic length, medians of several runs), cached as JSON under
``$REST_CACHE_DIR`` or ``~/.cache/rest-spec``, and re-measured by
``python -m rest_spec.drafter.budget measure``. torch and transformers are imported only where measuring
needs them, so ``--help`` and ``select_tree`` stay light.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from rest_spec.datastore.errors import first_line
from rest_spec.datastore.types import DraftTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DEFAULT_CONTEXT_LENGTH = 512
_BRANCHING = 4  # the measured trees are complete 4-ary BFS trees (only n matters, not the shape)


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


def _interpolate(sizes: Sequence[int], seconds: Sequence[float], n: np.ndarray) -> np.ndarray:
    """Running maximum of ``seconds`` at ``sizes``, interpolated linearly at ``n`` and continued
    along the last segment past the largest size."""
    sizes, seconds = np.asarray(sizes, np.float64), np.maximum.accumulate(np.asarray(seconds, np.float64))
    inside = np.interp(n, sizes, seconds)
    if sizes.size == 1:
        return inside
    slope = max(0.0, (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]))
    return np.where(n > sizes[-1], seconds[-1] + slope * (n - sizes[-1]), inside)


@dataclass(frozen=True)
class VerifyCost:
    """Measured seconds of one verification step of ``sizes[i]`` tokens (the pending token
    included, so a tree of k nodes costs ``self(k + 1)``), over a KV cache of ``context_length``:
    ``seconds`` for branching trees (custom tree mask), ``chain_seconds`` for chains, which the
    verifier runs on the model's plain causal path (``tree_attention.TreeInputs.causal``); empty
    when not measured, and chains then cost what trees cost.

    Queries use the running maximum of the measurements (verifying more tokens never costs less;
    a noisy dip would otherwise pull every tree to that size), interpolated linearly between
    sizes and continued along the last segment past the largest.
    """

    key: CostKey
    context_length: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    chain_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        check_sizes(self.sizes)
        for name, times in (("seconds", self.seconds), ("chain_seconds", self.chain_seconds or self.seconds)):
            times = np.asarray(times, dtype=np.float64)
            if times.shape != (len(self.sizes),) or not np.all(np.isfinite(times) & (times > 0)):
                raise ValueError(f"{name} must be one positive time per size, got {list(times)}")

    def __call__(self, n: int | np.ndarray) -> np.ndarray:
        """float64 seconds for a tree of ``n`` (>= 1) verified tokens; same shape as ``n``."""
        return _interpolate(self.sizes, self.seconds, np.asarray(n, dtype=np.float64))

    def chain(self, n: int | np.ndarray) -> np.ndarray:
        """float64 seconds for a chain of ``n`` (>= 1) verified tokens; same shape as ``n``."""
        return _interpolate(self.sizes, self.chain_seconds or self.seconds, np.asarray(n, dtype=np.float64))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "VerifyCost":
        data = json.loads(text)
        return cls(CostKey(**data["key"]), data["context_length"], tuple(data["sizes"]), tuple(data["seconds"]),
                   tuple(data["chain_seconds"]))


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
    chain_rate = (1.0 + path_sums(tree)[candidates]) / cost.chain(1 + tree.depths[candidates])
    if chain_rate.size and chain_rate.max() > rate[best] * (1 + 1e-12):
        return tree.subset(path_to(tree, int(candidates[np.argmax(chain_rate)])))
    if best == len(tree):
        return tree  # all of it: no copy
    return tree.subset(np.sort(ranked[:best]))


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


# ---- measurement (torch) ----------------------------------------------------------------------


def cost_key(model: "PreTrainedModel") -> CostKey:
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


def measure_verify_cost(
    model: "PreTrainedModel",
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    repeats: int = 5,
    warmup: int = 2,
) -> VerifyCost:
    """Median wall time of one ``verify_trees`` step with a tree of ``n - 1`` nodes, and with a
    chain of ``n - 1`` nodes, for each n in ``sizes``, on a cache of ``context_length`` random
    tokens that is cut back after every run."""
    import torch

    from rest_spec.drafter.kv_cache import CacheRows, compact_cache, new_cache
    from rest_spec.drafter.verify import verify_trees

    check_sizes(sizes)
    if repeats < 1 or warmup < 0 or context_length < 1:
        raise ValueError(
            f"need repeats >= 1, warmup >= 0, context_length >= 1; got {repeats}, {warmup}, {context_length}"
        )
    vocab = int(model.config.vocab_size)
    context = torch.randint(vocab, (1, context_length + 1), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=context[:, :-1].to(model.device), past_key_values=cache, use_cache=True)
    rows = CacheRows.full(1, context_length)
    contexts = context.tolist()
    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None

    def median_seconds(tree: DraftTree) -> float:
        times = []
        for _ in range(warmup + repeats):
            synchronize()
            start = time.perf_counter()
            verify_trees(model, cache, rows, contexts, [tree])  # ends in the step's one device->host sync
            times.append(time.perf_counter() - start)
            compact_cache(cache, rows, [np.zeros(0, np.int64)])  # back to the context alone
        return statistics.median(times[warmup:])

    trees, chains = [], []
    for n in sizes:
        index = np.arange(n - 1)
        trees.append(median_seconds(DraftTree(index % _BRANCHING + 1, index // _BRANCHING - 1, np.ones(n - 1))))
        # n = 1 is the empty tree either way: plain decoding's step, timed once
        chains.append(median_seconds(DraftTree(index % _BRANCHING + 1, index - 1, np.ones(n - 1))) if n > 1 else trees[0])
        log.info("t(%d) = %.3f ms tree, %.3f ms chain", n, 1e3 * trees[-1], 1e3 * chains[-1])
    return VerifyCost(cost_key(model), context_length, tuple(int(n) for n in sizes), tuple(trees), tuple(chains))


def cache_dir() -> Path:
    """``$REST_CACHE_DIR``, or ``~/.cache/rest-spec``."""
    return Path(os.environ.get("REST_CACHE_DIR") or Path.home() / ".cache" / "rest-spec")


def load_or_measure(
    model: "PreTrainedModel", *, directory: Path | None = None, remeasure: bool = False, **measure_options
) -> VerifyCost:
    """The cached cost for this model, device and dtype, measured and cached when missing (or
    when ``remeasure``). ``measure_options`` go to ``measure_verify_cost``."""
    key = cost_key(model)
    path = (directory or cache_dir()) / "verify-cost" / key.file_name()
    if path.exists() and not remeasure:
        try:
            cost = VerifyCost.from_json(path.read_text())
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s is unreadable (%s); measuring again", path, exc)
        else:
            if cost.key == key:
                return cost
            log.warning("%s holds a measurement for another model or device; measuring again", path)
    cost = measure_verify_cost(model, **measure_options)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(cost.to_json())
    os.replace(temporary, path)  # readers never see half a file
    log.info("wrote %s", path)
    return cost


# ---- CLI --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rest_spec.drafter.budget",
        description="Measure how long one tree-verification step takes for n tokens on this model, device "
        "and dtype; the drafter sizes its trees from it. Results are cached under $REST_CACHE_DIR "
        "or ~/.cache/rest-spec.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("measure", help="measure t(n) (again) and write it to the cache")
    measure.add_argument("--model", metavar="SPEC", help="Hugging Face id, model directory or .gguf file "
                         "(default: the packaged SmolLM2-135M-Instruct)")
    measure.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    measure.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                         help="weights dtype (default: the checkpoint's)")
    measure.add_argument("--context-length", type=int, default=DEFAULT_CONTEXT_LENGTH, metavar="L",
                         help="tokens in the KV cache under the verified tree (default: %(default)s)")
    measure.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), metavar="N,N,...",
                         help="verified token counts to time, starting at 1 (default: %(default)s)")
    measure.add_argument("--repeats", type=int, default=5, help="timed runs per size; the median is kept "
                         "(default: %(default)s)")
    measure.add_argument("--cache-dir", type=Path,
                         help="cache directory (default: $REST_CACHE_DIR or ~/.cache/rest-spec)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    import torch

    from rest_spec.drafter.model import load_model

    try:
        model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
        cost = load_or_measure(model, directory=args.cache_dir, remeasure=True, sizes=sizes,
                               context_length=args.context_length, repeats=args.repeats)
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {first_line(exc)}", file=sys.stderr)
        return 2
    print(cost.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
