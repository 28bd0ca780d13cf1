"""vLLM's step time by the draft tokens it verifies: the shape ``BatchCost`` must price.

    .venv-vllm/bin/python -m benchmarks.step_shape --sets code --prompts 63 --concurrency 1,4

The oracle proposer (``benchmarks.harness.engines.OracleProposer``) drafts the next d tokens of each
held-out prompt's greedy output (``benchmarks.harness.streams``: ``benchmarks.fleet``'s streams and
cached outputs), d fixed per prompt
(prompt i: ``--depths``[i mod their count]), so every draft is accepted and each step verifies
exactly the draft tokens it was given; it times each step by the batch's draft tokens
(``StepShape``), a step being the time from one call of the proposer to the next. One engine (k the
deepest depth) runs the prompts at each ``--concurrency`` in turn. Reports, per set and concurrency,
t(d) in ms (the mean over its steps, with their count) and t(d) - t(0), and on the one-row steps
three shapes fitted by least squares weighted by steps, each with its RMS residual in ms:

- ``linear``: a + b d (what ``BatchCost`` fits, per row count);
- ``set_up``: a + j [d > 0] + b d (a step that verifies any draft pays j once: vLLM's rejection
  sampling and the logits of the draft positions);
- ``set_up_and_curve``: a + j [d > 0] + b d + c d^2.

Timing: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.report import RESULTS, benchmark_parser, comma_list, positive_int, save_report, start_run
from benchmarks.harness.sets import ensure_index

log = logging.getLogger("benchmarks.step_shape")
SHAPES = {
    "linear": lambda d: [np.ones_like(d), d],
    "set_up": lambda d: [np.ones_like(d), (d > 0).astype(float), d],
    "set_up_and_curve": lambda d: [np.ones_like(d), (d > 0).astype(float), d, d**2],
}


def fit_shapes(depths: np.ndarray, ms: np.ndarray, steps: np.ndarray) -> dict:
    """Each of ``SHAPES`` fitted to t(d) = ``ms`` at ``depths``, weighted by ``steps``: its
    coefficients and RMS residual (ms); a shape with more coefficients than points is left out."""
    out = {}
    weights = np.sqrt(steps.astype(float))
    for name, features in SHAPES.items():
        design = np.stack(features(depths.astype(float)), axis=1)
        if design.shape[1] > depths.size:
            continue
        coefficients, *_ = np.linalg.lstsq(design * weights[:, None], ms * weights, rcond=None)
        residual = ms - design @ coefficients
        out[name] = {
            "coefficients": [round(float(c), 4) for c in coefficients],
            "rms_ms": round(float(np.sqrt(np.average(residual**2, weights=steps))), 4),
        }
    return out


def shape_table(shape: dict) -> list[dict]:
    """A run's ``StepShape`` difference as rows: d, steps, t(d) in ms, and t(d) - t(0)."""
    rows = [
        {"draft_tokens": d, "steps": n, "ms": 1e3 * seconds / n}
        for d, (n, seconds) in enumerate(zip(shape["steps"], shape["step_seconds"]))
        if n
    ]
    plain = next((row["ms"] for row in rows if row["draft_tokens"] == 0), None)
    for row in rows:
        row["ms_over_no_draft"] = None if plain is None else row["ms"] - plain
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser(
        __doc__, prompts=63, prompts_help="held-out prompts per set", sets=("code", "chat"), concurrency="1,4"
    )
    p.set_defaults(sets="code")
    p.add_argument(
        "--depths",
        type=comma_list(item=int),
        default="0,1,2,3,4,5,6,7,8",
        help="draft tokens per step, one per prompt in turn (default: %(default)s)",
    )
    p.add_argument("--warmup-concurrency", type=positive_int, default=32, help="requests at once decoding outputs")
    p.add_argument("--out", type=Path, default=RESULTS / "step_shape.json")
    args = p.parse_args(argv)
    if min(args.depths) < 0 or max(args.depths) < 1:
        p.error("--depths: counts >= 0, one at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report = start_run("step_shape", argv)
    from benchmarks.harness.engines import ENGINE_MODEL, ENGINE_TIMEOUT, job, run_job
    from benchmarks.harness.sets import INDEXES, set_prompts
    from benchmarks.harness.streams import STREAMS, warmup_outputs
    from rest_spec.common.tokenizer import load_tokenizer
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")
    tokenizer = load_tokenizer(None)
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["sets"] = {}
    for name in args.sets:
        stream = STREAMS[name]
        index = ensure_index(*INDEXES[stream.set])
        prompts = set_prompts(stream.set, tokenizer, index, args.prompts, 1024, stream.skip)
        outputs, _ = warmup_outputs(prompts, args)
        depths = [args.depths[i % len(args.depths)] for i in range(len(prompts))]
        spec = job(
            "oracle",
            prompts,
            args.max_new_tokens,
            args.concurrency[0],
            k=max(args.depths),
            oracle=[[p, o] for p, o in zip(prompts, outputs)],
            oracle_depths=depths,
        )
        spec["runs"] = [{**spec["runs"][0], "concurrency": c} for c in args.concurrency]
        result = run_job(spec, timeout=ENGINE_TIMEOUT)
        by_concurrency = {}
        for c, run in zip(args.concurrency, result["runs"]):
            table = shape_table(run["proposer"])
            figures = {"table": table, "equal_to_reference": sum(o == r for o, r in zip(run["outputs"], outputs))}
            if c == 1 and table:
                figures["fits"] = fit_shapes(
                    np.array([row["draft_tokens"] for row in table]),
                    np.array([row["ms"] for row in table]),
                    np.array([row["steps"] for row in table]),
                )
            by_concurrency[str(c)] = figures
            line = ", ".join(f"{row['draft_tokens']}: {row['ms']:.1f}" for row in table)
            print(f"{name}, concurrency {c}: ms a step by draft tokens: {line}", file=sys.stderr)
        report["sets"][name] = {"prompts": len(prompts), "concurrency": by_concurrency}
        for fit, figures in by_concurrency.get("1", {}).get("fits", {}).items():
            print(f"  {fit}: {figures['coefficients']} (RMS {figures['rms_ms']:.2f} ms)", file=sys.stderr)
        save_report(report, args.out, echo=False)
    save_report(report, args.out)


if __name__ == "__main__":
    main()
