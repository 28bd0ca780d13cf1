"""``rest-measure-cost`` (``python -m rest_spec.drafter.cli.measure_cost``): measure t(n) for a model
on this device and dtype (``drafter.hf.measure``) and cache it (``drafter.core.cost_cache``). torch
is imported only once the arguments are parsed, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from rest_spec.common.cli import exit_statuses, run_command, setup_logging
from rest_spec.common.logs import MESSAGE_FORMAT
from rest_spec.drafter.hf.measure import DEFAULT_CONTEXT_LENGTH, DEFAULT_ROUNDS, DEFAULT_SIZES, load_or_measure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rest-measure-cost",
        description="Measure how long one tree-verification step takes for n tokens on this model, device "
        "and dtype; the drafter sizes its trees from it. Results are cached under $REST_CACHE_DIR "
        "or ~/.cache/rest-spec.",
        epilog=exit_statuses(
            ("model not found", "sizes or timing refused", "cache not writable"),
            usage=("an unknown flag", "malformed --sizes"),
        ),
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
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="rounds timing every size in turn; a step's lowest round counts once a second agrees, and the "
        "steps that did not settle are timed again (default: %(default)s)",
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
    setup_logging(logging.INFO, text_format=MESSAGE_FORMAT)
    return run_command(parser.prog, lambda: _measure(args, sizes), failures=(OSError, ValueError), parser=parser)


def _measure(args: argparse.Namespace, sizes: tuple[int, ...]) -> None:
    """``rest-measure-cost`` after its arguments are parsed: measure, cache and print the table."""
    import torch

    from rest_spec.drafter.hf.model import load_model

    model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    cost = load_or_measure(
        model,
        directory=args.cache_dir,
        remeasure=True,
        sizes=sizes,
        context_length=args.context_length,
        rounds=args.rounds,
    )
    print(cost.to_json())


if __name__ == "__main__":
    sys.exit(main())
