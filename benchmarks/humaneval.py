"""Mean accepted length and speed of REST on HumanEval prompts, against plain decoding in the same run.

    python -m benchmarks.humaneval --index indexes/python-stdlib --prompts 10 --max-new-tokens 128 --budget 64

For every prompt: plain greedy decoding through the same loop (no drafts), then REST drafting from
the index; the two outputs must be identical (the run fails otherwise). Prints one JSON object
(config, hardware, per-prompt figures, medians) to stdout and saves it under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import humaneval_inputs, save_report
from rest_spec.datastore.tokenizer import load_tokenizer, tokenizer_fingerprint
from rest_spec.datastore.types import DraftConfig
from rest_spec.datastore.tokenizer import check_tokenizer
from rest_spec.drafter.generate import generate
from rest_spec.drafter.local import LocalDrafter
from rest_spec.drafter.model import load_model

RESULTS = Path(__file__).parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True, help="index directory (e.g. built with `build_index --corpus python-stdlib`)")
    p.add_argument("--model", default=None, help="model spec (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=10, help="first N HumanEval prompts (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=64, help="draft tree size c (default 64)")
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user turn with the chat template (default: raw completion)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=RESULTS / "humaneval_stdlib.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    config = DraftConfig(budget=args.budget, max_depth=args.max_depth)
    rows = []
    with LocalDrafter.open(args.index) as drafter:
        check_tokenizer(drafter, tokenizer_fingerprint(tokenizer))
        generate(model, tokenizer("def f(x):").input_ids, drafter, max_new_tokens=8)  # warm-up
        for i, ids in enumerate(humaneval_inputs(tokenizer, args.prompts, chat=args.chat)):
            plain = generate(model, ids, None, max_new_tokens=args.max_new_tokens)
            rest = generate(model, ids, drafter, max_new_tokens=args.max_new_tokens, config=config)
            if rest.output_ids != plain.output_ids:
                raise SystemExit(f"prompt {i}: REST output differs from plain decoding")
            rows.append({
                "prompt": i,
                "new_tokens": len(rest.output_ids),
                "steps": rest.steps,
                "mean_accepted": rest.mean_accepted,
                "plain_tokens_per_second": plain.tokens_per_second,
                "rest_tokens_per_second": rest.tokens_per_second,
                "speedup": rest.tokens_per_second / plain.tokens_per_second,
                "draft_ms_per_step": 1e3 * rest.draft_seconds / rest.steps,
                "verify_ms_per_step": 1e3 * rest.verify_seconds / rest.steps,
                "plain_ms_per_step": 1e3 * plain.verify_seconds / plain.steps,
            })
            print(f"prompt {i}: accepted {rest.mean_accepted:.2f}, speed x{rows[-1]['speedup']:.2f}", file=sys.stderr)
    tokens, steps = sum(r["new_tokens"] for r in rows), sum(r["steps"] for r in rows)
    report = {
        "benchmark": "humaneval",
        "command": "python -m benchmarks.humaneval " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {"index": str(args.index), "model": args.model or "SmolLM2-135M-Instruct (packaged GGUF, fp32)",
                   "prompts": args.prompts, "chat_template": args.chat, "max_new_tokens": args.max_new_tokens, "budget": args.budget,
                   "max_depth": args.max_depth},
        "hardware": {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                     "torch_threads": torch.get_num_threads(), "device": str(model.device)},
        "date": time.strftime("%Y-%m-%d"),
        "outputs_identical_to_plain": True,
        "mean_accepted": tokens / steps,  # all new tokens / all verification steps
        "median_mean_accepted": statistics.median(r["mean_accepted"] for r in rows),
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "median_draft_ms_per_step": statistics.median(r["draft_ms_per_step"] for r in rows),
        "median_verify_ms_per_step": statistics.median(r["verify_ms_per_step"] for r in rows),
        "median_plain_ms_per_step": statistics.median(r["plain_ms_per_step"] for r in rows),
        "per_prompt": rows,
    }
    save_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
