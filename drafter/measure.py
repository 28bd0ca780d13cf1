"""Measuring t(n), the cost model's input (``drafter.cost.VerifyCost``), and caching it.

t(n) is measured once per model, device and dtype with the real verifier (``verify_trees`` on top
of a KV cache of realistic length, medians of several runs), cached as JSON under
``$REST_CACHE_DIR`` or ``~/.cache/rest-spec``, and re-measured by ``rest-measure-cost`` (``python
-m rest_spec.drafter.measure``). torch is imported only inside the functions that time, so
``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rest_spec.datastore.errors import first_line
from rest_spec.datastore.types import DraftTree
from rest_spec.drafter.cost import BlockShape, CostKey, VerifyCost, check_sizes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
DEFAULT_CONTEXT_LENGTH = 512
_BRANCHING = 4


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


def check_timing(repeats: int, warmup: int, context_length: int) -> None:
    """``ValueError`` unless a timing has runs to keep (repeats >= 1), warmup >= 0 and a context."""
    if repeats < 1 or warmup < 0 or context_length < 1:
        raise ValueError(
            f"need repeats >= 1, warmup >= 0, context_length >= 1; got {repeats}, {warmup}, {context_length}"
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

    from rest_spec.drafter.hf_internals import DynamicCache, forward_with_cache
    from rest_spec.drafter.kv_cache import CacheRows, compact_cache, new_cache
    from rest_spec.drafter.verify import verify_trees

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


def measure_verify_cost(
    model: PreTrainedModel,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    repeats: int = 5,
    warmup: int = 2,
) -> VerifyCost:
    """Median wall time of one ``verify_trees`` step with a tree of ``n - 1`` nodes, and with a
    chain of ``n - 1`` nodes, for each n in ``sizes`` (``verify_timer``). Trees are timed in both
    layouts of the linear layers (``drafter.linear_layout``); the faster is kept, and chains are
    timed in it."""
    check_sizes(sizes)
    median_seconds = verify_timer(model, context_length, repeats, warmup)
    trees, chains, layouts = [], [], []
    for n in sizes:
        tree = measured_tree(n)
        plain, transposed = median_seconds(tree, False), median_seconds(tree, True)
        layouts.append(transposed < plain)
        trees.append(min(plain, transposed))
        # n = 1 is the empty tree either way: plain decoding's step, timed once
        chains.append(median_seconds(measured_tree(n, chain=True), layouts[-1]) if n > 1 else trees[0])
        log.info(
            "t(%d) = %.3f ms tree (%.3f ms in PyTorch's layout, %.3f ms transposed), %.3f ms chain",
            n,
            1e3 * trees[-1],
            1e3 * plain,
            1e3 * transposed,
            1e3 * chains[-1],
        )
    return VerifyCost(
        cost_key(model), context_length, tuple(int(n) for n in sizes), tuple(trees), tuple(chains), tuple(layouts)
    )


def cache_dir() -> Path:
    """``$REST_CACHE_DIR``, or ``~/.cache/rest-spec``."""
    return Path(os.environ.get("REST_CACHE_DIR") or Path.home() / ".cache" / "rest-spec")


def load_or_measure(
    model: PreTrainedModel, *, directory: Path | None = None, remeasure: bool = False, **measure_options
) -> VerifyCost:
    """The cached cost for this model, device and dtype, measured and cached when missing (or
    when ``remeasure``). ``measure_options`` go to ``measure_verify_cost``."""
    return cached_cost(
        cost_key(model), lambda: measure_verify_cost(model, **measure_options), directory=directory, remeasure=remeasure
    )


def cached_cost(
    key: CostKey, measure: Callable[[], VerifyCost], *, directory: Path | None = None, remeasure: bool = False
) -> VerifyCost:
    """The cost cached for ``key`` under ``directory`` (default ``cache_dir()``), or ``measure()``'s,
    cached atomically, when there is none, it is unreadable or for another key, or ``remeasure``."""
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
    cost = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(cost.to_json())
    os.replace(temporary, path)  # readers never see half a file
    log.info("wrote %s", path)
    return cost


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rest-measure-cost",
        description="Measure how long one tree-verification step takes for n tokens on this model, device "
        "and dtype; the drafter sizes its trees from it. Results are cached under $REST_CACHE_DIR "
        "or ~/.cache/rest-spec.",
        epilog="exit status: 0 done; 2 usage error (an unknown flag, malformed --sizes); 1 failure (model not "
        "found, sizes or timing refused, cache not writable).",
    )
    parser.add_argument(
        "--model",
        metavar="SPEC",
        help="Hugging Face id, model directory or .gguf file (default: the packaged SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), help="weights dtype (default: the checkpoint's)"
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=DEFAULT_CONTEXT_LENGTH,
        metavar="L",
        help="tokens in the KV cache under the verified tree (default: %(default)s)",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        metavar="N,N,...",
        help="verified token counts to time, starting at 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per size; the median is kept (default: %(default)s)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, help="cache directory (default: $REST_CACHE_DIR or ~/.cache/rest-spec)"
    )
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
        cost = load_or_measure(
            model,
            directory=args.cache_dir,
            remeasure=True,
            sizes=sizes,
            context_length=args.context_length,
            repeats=args.repeats,
        )
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {first_line(exc)}", file=sys.stderr)
        return 1
    print(cost.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
