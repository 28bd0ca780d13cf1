"""Throughput of REST on batches of HumanEval prompts, against plain batched ``model.generate`` in the same run.

    python -m benchmarks.batch --index indexes/python-stdlib --batch-sizes 1,2,4,8 --prompts 8 --max-new-tokens 128
    python -m benchmarks.batch --adaptive ...   # the adaptive drafter, sized by the measured cost

The same prompts are decoded at every batch size B, in consecutive batches of B, greedily: first by
plain ``model.generate`` on left-padded batches, then by the REST loop drafting from the index (raw index trees of ``--budget`` nodes; with
``--adaptive``, ``AdaptiveDrafter`` over the index, the request's text and the outputs, each row's
tree and the batch's block sized by the measured cost, ``selection.select_batch_trees``). Per
batch size: tokens/s (all new tokens / wall time of all batches, median over ``--repeats``), the
ratio REST / plain, mean accepted length per row (its new tokens / the steps it took part in), and
whether every REST row equals its plain row. Prints a table on stderr and one JSON object (config,
hardware, figures) on stdout, saved under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness.report import RESULTS, benchmark_parser, comma_list, save_report, start_run
from benchmarks.harness.sets import humaneval_inputs
from rest_spec.common.tokenizer import load_tokenizer, tokenizer_fingerprint
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.hf.generate import BatchGenerationResult, GenerationResult, eos_ids, generate
from rest_spec.drafter.hf.measure import load_or_measure
from rest_spec.drafter.hf.model import load_model


def parse_args(argv=None) -> argparse.Namespace:
    p = benchmark_parser(
        __doc__, prompts=8, prompts_help="first N HumanEval prompts, decoded at every batch size; a multiple of each"
    )
    p.add_argument("--index", default="indexes/python-stdlib", help="index directory (default: %(default)s)")
    p.add_argument("--model", default=None, help="model spec (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument(
        "--batch-sizes",
        type=comma_list(item=int),
        default="1,2,4,8",
        help="comma-separated batch sizes (default: %(default)s)",
    )
    p.add_argument("--budget", type=int, default=64, help="draft tree size c (default 64)")
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch size and method (default 3)")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="draft with AdaptiveDrafter, sized by the verification cost (cached, else measured first)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="render each prompt as a user turn with the chat template (default: raw completion)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--out", type=Path, default=RESULTS / "batch_stdlib.json")
    args = p.parse_args(argv)
    bad = [b for b in args.batch_sizes if b < 1 or args.prompts % b]
    if bad:
        p.error(f"every batch size must be >= 1 and divide --prompts {args.prompts}: {bad}")
    return args


@dataclass(frozen=True)
class Run:
    """One pass over all prompts at one batch size: each row's new tokens (and, for REST, the
    verification steps it took part in) and the wall time of all batches."""

    outputs: list[list[int]]
    seconds: float
    row_steps: list[int] | None = None

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(prompts: Sequence[list[int]], size: int) -> list[list[list[int]]]:
    return [list(prompts[i : i + size]) for i in range(0, len(prompts), size)]


def cut_after_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """A plain ``generate`` row's new tokens up to its first eos (the rest is padding)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def run_plain(model, tokenizer, prompts, size: int, max_new_tokens: int, eos: frozenset[int]) -> Run:
    outputs = []
    sync(model.device)
    start = time.perf_counter()
    for batch in batches(prompts, size):
        padded = tokenizer.pad({"input_ids": batch}, padding_side="left", return_tensors="pt").to(model.device)
        out = model.generate(
            **padded, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
        width = padded.input_ids.shape[1]
        outputs += [cut_after_eos(row, eos) for row in out[:, width:].tolist()]
    sync(model.device)
    return Run(outputs, time.perf_counter() - start)


def rows_of(result: GenerationResult | BatchGenerationResult) -> list[GenerationResult]:
    if isinstance(result, BatchGenerationResult):
        return [result.row(i) for i in range(len(result.output_ids))]
    return [result]


def run_rest(model, drafter, prompts, size: int, max_new_tokens: int, config: DraftConfig) -> Run:
    rows: list[GenerationResult] = []
    sync(model.device)
    start = time.perf_counter()
    for batch in batches(prompts, size):
        rows += rows_of(generate(model, batch, drafter, max_new_tokens=max_new_tokens, config=config))
    sync(model.device)
    return Run([row.output_ids for row in rows], time.perf_counter() - start, [row.steps for row in rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    header = start_run("batch", argv, level=logging.WARNING, format=logging.BASIC_FORMAT)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device), load_tokenizer(args.model)
    eos = eos_ids(model.generation_config)
    config = DraftConfig(budget=args.budget, max_depth=args.max_depth)
    prompts = humaneval_inputs(tokenizer, args.prompts, chat=args.chat)
    results = []
    with LocalDrafter.open(args.index, expected_fingerprint=tokenizer_fingerprint(tokenizer)) as local:
        drafter = AdaptiveDrafter(local, cost=load_or_measure(model), config=config) if args.adaptive else local
        warm = prompts[: max(args.batch_sizes)]
        run_plain(model, tokenizer, warm, len(warm), 8, eos)
        run_rest(model, drafter, warm, len(warm), 8, config)
        for size in args.batch_sizes:
            plain_runs, rest_runs = [], []
            for _ in range(args.repeats):
                plain_runs.append(run_plain(model, tokenizer, prompts, size, args.max_new_tokens, eos))
                rest_runs.append(run_rest(model, drafter, prompts, size, args.max_new_tokens, config))
            plain_tps = statistics.median(r.tokens_per_second for r in plain_runs)
            rest_tps = statistics.median(r.tokens_per_second for r in rest_runs)
            rest = rest_runs[0]  # greedy: every repeat gives the same tokens and steps
            identical = [ours == theirs for ours, theirs in zip(rest.outputs, plain_runs[0].outputs)]
            accepted = [len(out) / steps for out, steps in zip(rest.outputs, rest.row_steps)]
            results.append(
                {
                    "batch_size": size,
                    "plain_tokens_per_second": plain_tps,
                    "rest_tokens_per_second": rest_tps,
                    "speedup": rest_tps / plain_tps,
                    "mean_accepted": sum(map(len, rest.outputs)) / sum(rest.row_steps),
                    "mean_accepted_per_row": accepted,
                    "rows_identical_to_plain": sum(identical),
                    "rows": len(identical),
                    "plain_seconds": [r.seconds for r in plain_runs],
                    "rest_seconds": [r.seconds for r in rest_runs],
                }
            )
            print(
                f"batch {size}: plain {plain_tps:.1f} tok/s, REST {rest_tps:.1f} tok/s "
                f"(x{rest_tps / plain_tps:.2f}), accepted {results[-1]['mean_accepted']:.2f}, "
                f"identical rows {sum(identical)}/{len(identical)}",
                file=sys.stderr,
            )

    print(
        f"\n{'batch':>5} {'plain tok/s':>12} {'REST tok/s':>11} {'ratio':>6} {'accepted':>9} {'identical':>10}",
        file=sys.stderr,
    )
    for r in results:
        print(
            f"{r['batch_size']:>5} {r['plain_tokens_per_second']:>12.1f} {r['rest_tokens_per_second']:>11.1f} "
            f"{r['speedup']:>6.2f} {r['mean_accepted']:>9.2f} {r['rows_identical_to_plain']:>5}/{r['rows']:<4}",
            file=sys.stderr,
        )
    report = {
        **header,
        "config": {
            "index": str(args.index),
            "model": args.model or "SmolLM2-135M-Instruct (packaged GGUF, fp32)",
            "prompts": args.prompts,
            "chat_template": args.chat,
            "batch_sizes": args.batch_sizes,
            "max_new_tokens": args.max_new_tokens,
            "budget": args.budget,
            "max_depth": args.max_depth,
            "repeats": args.repeats,
            "adaptive": args.adaptive,
            "decoding": "greedy",
        },
        "all_rows_identical_to_plain": all(r["rows_identical_to_plain"] == r["rows"] for r in results),
        "per_batch_size": results,
    }
    report["machine"].update(
        torch_threads=torch.get_num_threads(),
        device=str(model.device),
        gpu=torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
    )
    save_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
