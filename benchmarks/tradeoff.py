"""Accepted length against speed: the adaptive drafter's cost-sized trees versus fixed sizes, replayed offline.

    python -m benchmarks.tradeoff --prompts 40 --max-new-tokens 128

The prompt sets and indexes of ``benchmarks.harness.sets`` (``benchmarks.e2e``'s). The model's plain
greedy outputs are computed once (and cached under ``$REST_CACHE_DIR/greedy``); then every drafter is replayed against them
without the model (``benchmarks.harness.replay``: accepted lengths equal a real run's). A step's time is
modeled as t(1 + tree nodes) from the measured verification cost (``rest_spec.drafter.hf.measure``),
so speed is relative to plain decoding, sum of t(1) per token over sum of step times; drafting
time is left out (``median_draft_ms`` reports it).

Drafters: ``rest`` (REST's own engine, ``draftretriever`` over the same index's documents, queried
as REST does for ``--budget`` paths: ``benchmarks.harness.draftretriever.DraftRetriever``), ``paper`` (the index
only, ``--budget`` nodes), ``adaptive`` (as in e2e: every source, sized each step by t(n)), and
``adaptive@k`` for each k in ``--sizes`` (every source, the k best-scored nodes each step, no
cost-based size). Each adaptive drafter has its own output store, fed with each greedy output
after its prompt, and its own calibration.

Prints a table (accepted length, also relative to ``paper`` and to ``rest``) and the targets of
benchmarks/targets.json ("tradeoff") with pass or fail, and saves JSON under benchmarks/results/. Minutes, not the half hour of e2e, so
it is the place to try drafting changes; e2e then measures the real thing.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.draftretriever import DraftRetriever
from benchmarks.harness.replay import Example, replay, set_examples
from benchmarks.harness.report import RESULTS, benchmark_parser, check, comma_list, load_targets, save_report, start_run
from benchmarks.harness.sets import DEFAULT_SETS, SETS
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.hf.measure import load_or_measure
from rest_spec.drafter.hf.model import load_model


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, sets=SETS, default_sets=DEFAULT_SETS)
    p.add_argument(
        "--sizes",
        type=comma_list(item=int),
        default="2,4,8,16,32,64",
        help="fixed tree sizes to compare; the target compares the one equal to --budget with rest "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=64,
        help="paper mode's tree size, rest's paths; the adaptive candidates (default 64)",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="as in benchmarks.e2e (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / "tradeoff.json")
    args = p.parse_args(argv)
    if min(args.sizes) < 1 or max(args.sizes) > args.budget:
        p.error("--sizes must be in [1, --budget]")
    return args


def run_set(examples: list[Example], index: Path, cost: VerifyCost, args: argparse.Namespace) -> dict:
    """Every drafter replayed on ``examples``: label -> the replay's figures and the accepted length
    relative to ``paper`` and to ``rest``."""
    config = DraftConfig(budget=args.budget)
    results = {}
    with LocalDrafter.open(index) as base, tempfile.TemporaryDirectory() as workdir:
        results["rest"] = replay(examples, DraftRetriever(base.datastore, Path(workdir)), config, cost)
        results["paper"] = replay(examples, base, config, cost)
    for label, size in [("adaptive", None)] + [(f"adaptive@{k}", k) for k in args.sizes]:
        with LocalDrafter.open(index) as base:  # its own output store
            drafter = AdaptiveDrafter(base, cost=cost if size is None else None, config=config)
            results[label] = replay(
                examples, drafter, DraftConfig(budget=size or args.budget), cost, drafter.add_output
            )
    for row in results.values():
        row["accepted_vs_paper"] = row["mean_accepted"] / results["paper"]["mean_accepted"]
        row["accepted_vs_rest"] = row["mean_accepted"] / results["rest"]["mean_accepted"]
    return results


def targets(report: dict, budget: int) -> dict:
    """The "tradeoff" targets of benchmarks/targets.json on this run's figures: name -> pass (left out
    where ``adaptive@budget`` was not replayed)."""
    limit, label = load_targets("tradeoff")["accepted_vs_rest"], f"adaptive@{budget}"
    return {
        f"{name}: {label} accepted length >= {limit['min']}x rest": check(results[label]["accepted_vs_rest"], limit)
        for name, results in report["sets"].items()
        if label in results
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("tradeoff", argv)
    model, tokenizer = load_model(None), load_tokenizer(None)
    cost = load_or_measure(model)
    report = {
        **header,
        "config": {
            "prompts_per_set": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "budget": args.budget,
            "speed": "modeled: t(1) per token / t(1 + tree nodes) per step, t from rest_spec.drafter.hf.measure",
        },
        "verify_cost": {
            "sizes": list(cost.sizes),
            "relative_to_one_token": [s / cost.seconds[0] for s in cost.seconds],
        },
        "sets": {},
    }
    for name in args.sets:
        index, examples = set_examples(name, model, tokenizer, args)
        results = run_set(examples, index, cost, args)
        report["sets"][name] = results
        print(f"{name}: {'drafter':<14} {'accepted':>9} {'x paper':>8} {'x rest':>7} {'verified':>9} {'speed':>7}")
        for label, row in results.items():
            print(
                f"{name}: {label:<14} {row['mean_accepted']:9.3f} {row['accepted_vs_paper']:8.3f} "
                f"{row['accepted_vs_rest']:7.3f} {row['verified_per_step']:9.2f} {row['modeled_speed_vs_plain']:7.3f}"
            )
    report["targets"] = targets(report, args.budget)
    for target, passed in report["targets"].items():
        print(f"target {target}: {'pass' if passed else 'FAIL'}")
    save_report(report, args.out, echo=False)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
