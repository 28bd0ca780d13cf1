"""How vLLM's step cost is learned inside a real engine: every step the REST proposer times, traced.

    .venv-vllm/bin/python -m benchmarks.cost_trace --sets chat,code --concurrency 8 --prompts 64

One engine per set (vLLM, SmolLM2 fp32, k 8) runs REST with the set's index in the worker on its
held-out prompts (``benchmarks.harness.streams``' sets: ShareGPT from the 41st, HumanEval from the 101st),
``--concurrency`` at a time, greedy, ``--max-new-tokens`` each. Every step the proposer times goes
to its ``drafter.core.batch_cost.BatchCost``; the engine's process records each (rows, draft tokens,
seconds) and the price of a draft token the cost holds after it. Reports, per set:

- ``set_up``: each step's time over a line fitted on the steps of token counts (rows + draft tokens)
  the engine had run before (per row count, one slope), for the first step of a new token count, the
  first of a new (rows, drafted) cell of a token count run before, and the rest: what a shape's
  one-time set-up costs;
- ``by_phase``: the same slope on the steps of each phase of the run (the first 100, the next 200, the
  rest) and the share of each phase's steps that drafted nothing: what a fresh engine pays early;
- ``per_token_ms``: the learned price of a draft token along the run (after 25, 50, 100, 200, 400
  steps and at the end): ``live``, as the engine had it, and replayed on the same steps by
  ``BatchCost`` as it is (a token count's first step not counted) and counting every step
  (``count_set_up``, as before 2026-11-28), beside the slope of the repeated shapes; and for each,
  the first step from which it stays within 25% of that slope;
- ``engines``: the proposer's counters (steps skipped, rows drafted: what the learned price
  decided), the engine's tokens per second and its learned price along the run, for engines whose
  cost leaves a token count's first step out (``rule``) and engines whose cost counts every step
  (``counting_every_step``), alternating, ``--repeats`` of each, all from the same prior (no cached
  cost: ``remeasure``); the analysis above is the first ``rule`` engine's.

Timing, so run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.engines import engine_env
from benchmarks.harness.report import REPO, benchmark_parser, positive_int, save_report, start_run

RESULTS = Path(__file__).with_name("results") / "cost_trace.json"
CHECKPOINTS = (25, 50, 100, 200, 400)
PHASES = (0, 100, 300)  # the run's steps from each of these to the next (the last: to its end)
WITHIN = 0.25  # a learned price within this share of the repeated shapes' slope has settled
# the engines run per set, one after the other: the rule, then every step counted (as before 2026-11-28)
ENGINES = (("rule", False), ("counting_every_step", True))


def engine(job: dict) -> dict:
    """In the engine's own process: run ``job`` with every ``BatchCost.observe`` recorded."""
    from rest_spec.drafter.core.batch_cost import BatchCost

    trace: list[list[float]] = []
    priors: list[float] = []
    observe = BatchCost.observe

    def traced(cost, rows: int, drafted: int, seconds: float) -> None:
        if not priors:
            priors.append(cost.prior_slope)
            cost.count_set_up = job["count_set_up"]
        observe(cost, rows, drafted, seconds)
        trace.append([rows, drafted, seconds, cost.per_token])

    BatchCost.observe = traced
    from vllm import LLM, SamplingParams, TokensPrompt

    from benchmarks.harness.engines import drafter_stats, speculative_config

    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        max_num_seqs=job["concurrency"],
        speculative_config=speculative_config({"method": "rest", "k": 8}),
        additional_config={
            "rest": {"datastore": job["index"], "remeasure": True, "calibration_file": "none"}
        },  # the same prior for every engine
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), job["concurrency"]):
        done = llm.generate(prompts[i : i + job["concurrency"]], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in done)
    return {
        "trace": trace,
        "prior_slope": priors[0] if priors else None,
        "proposer": llm.collective_rpc(drafter_stats)[0],
        "tokens_per_second": tokens / (time.perf_counter() - start),
    }


def repeated_slope(rows: np.ndarray, drafted: np.ndarray, seconds: np.ndarray, repeated: np.ndarray) -> float:
    """The price of a draft token over the steps of token counts run before: one slope, a level
    per row count (fixed effects), least squares."""
    x, y = [], []
    for r in np.unique(rows[repeated]):
        m = repeated & (rows == r)
        x.append(drafted[m] - drafted[m].mean())
        y.append(seconds[m] - seconds[m].mean())
    x, y = np.concatenate(x), np.concatenate(y)
    return float((x * y).sum() / (x * x).sum())


def by_phase(rows: np.ndarray, drafted: np.ndarray, seconds: np.ndarray, repeated: np.ndarray) -> dict:
    """Per phase of the run (``PHASES``): the repeated shapes' slope on that phase's steps alone
    (None where no row count has two draft sizes there) and the share of its steps that drafted
    nothing. A fresh engine's drafted steps can cost more than later ones; the skip rule then
    prices drafting out, and a step that drafts nothing teaches the cost nothing."""
    step, phases = np.arange(len(rows)), {}
    for start, end in zip(PHASES, [*PHASES[1:], len(rows)]):
        if start >= len(rows):
            break
        inside = (step >= start) & (step < end)
        slope = None
        if any(np.unique(drafted[inside & repeated & (rows == r)]).size > 1 for r in np.unique(rows[inside])):
            slope = round(1e3 * repeated_slope(rows, drafted, seconds, inside & repeated), 3)
        phases[f"{start}-{min(end, len(rows))}"] = {
            "slope_ms": slope,
            "drafting_nothing": round(float(np.mean(drafted[inside] == 0)), 3),
        }
    return phases


def at_checkpoints(prices: Sequence[float]) -> dict[str, float]:
    """A run's learned prices (seconds) after each of ``CHECKPOINTS`` steps it ran, in ms."""
    return {str(c): round(1e3 * float(prices[c - 1]), 3) for c in CHECKPOINTS if c <= len(prices)}


def settled(prices: np.ndarray, slope: float) -> int | None:
    """The first step from which ``prices`` stay within ``WITHIN`` of ``slope`` (None: never)."""
    off = np.flatnonzero(np.abs(prices - slope) > WITHIN * slope)
    if off.size == 0:
        return 0
    return None if off[-1] == prices.size - 1 else int(off[-1] + 1)


def analyse(trace: list[list[float]], prior_slope: float | None) -> dict:
    from rest_spec.drafter.core.batch_cost import BatchCost

    steps = np.array(trace, dtype=np.float64)
    rows, drafted, seconds, live = steps[:, 0].astype(int), steps[:, 1].astype(int), steps[:, 2], steps[:, 3]
    totals, cells = set(), set()
    new_total, new_cell = np.zeros(len(steps), bool), np.zeros(len(steps), bool)
    for i, (r, d) in enumerate(zip(rows.tolist(), drafted.tolist())):
        new_total[i], new_cell[i] = r + d not in totals, (r, d) not in cells
        totals.add(r + d)
        cells.add((r, d))
    slope = repeated_slope(rows, drafted, seconds, ~new_total)
    levels = {r: float(np.median(seconds[(rows == r) & ~new_total] - slope * drafted[(rows == r) & ~new_total]))
              for r in np.unique(rows[~new_total]).tolist()}  # fmt: skip
    excess = np.array([seconds[i] - levels.get(r, np.nan) - slope * drafted[i] for i, r in enumerate(rows.tolist())])

    def summary(mask: np.ndarray) -> dict:
        values = excess[mask & ~np.isnan(excess)]
        return {
            "steps": int(mask.sum()),
            "median_ms": round(1e3 * float(np.median(values)), 2) if values.size else None,
            "max_ms": round(1e3 * float(values.max()), 1) if values.size else None,
        }

    prices = {"live": live}
    for name, count_set_up in (("replayed", False), ("replayed_counting_every_step", True)):
        cost = BatchCost(count_set_up=count_set_up)
        if prior_slope is not None:
            cost.prior_slope = cost.per_token = prior_slope  # the engine's prior (its cached table's)
        replay = []
        for r, d, s in zip(rows.tolist(), drafted.tolist(), seconds.tolist()):
            cost.observe(r, d, s)
            replay.append(cost.per_token if cost.steps else np.nan)  # nothing counted: no price in seconds
        prices[name] = np.array(replay)
    return {
        "steps": len(steps),
        "repeated_shapes_slope_ms": round(1e3 * slope, 3),
        "by_phase": by_phase(rows, drafted, seconds, ~new_total),
        "set_up": {
            "first_of_a_token_count": summary(new_total),
            "first_of_a_cell_of_a_token_count_run_before": summary(new_cell & ~new_total),
            "the_rest": summary(~new_cell),
        },
        "per_token_ms": {
            name: {
                **at_checkpoints(p),
                "end": round(1e3 * float(p[-1]), 3),
                "settled_at_step": settled(np.nan_to_num(p, nan=np.inf), slope),
            }
            for name, p in prices.items()
        },
    }


def run_engine(job: dict, job_file: Path) -> dict:
    """``job`` in an engine process of its own (``engine``): what it returned."""
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job))
    env = {**engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the recorded cost is this process's
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.cost_trace", "--engine", str(job_file)],
            cwd=REPO, env=env, capture_output=True, text=True,
        )  # fmt: skip
    finally:
        job_file.unlink()
    if done.returncode != 0:
        raise RuntimeError(f"the engine failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__,
        prompts=64,
        prompts_help="held-out prompts per set",
        sets=("code", "chat"),
        default_sets=("chat", "code"),
    )
    parser.add_argument("--concurrency", type=positive_int, default=8, help="requests at a time (default 8)")
    parser.add_argument(
        "--repeats", type=positive_int, default=2, help="engines of each kind per set, alternating (default 2)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"default {RESULTS.relative_to(REPO)}")
    parser.add_argument("--engine", type=Path, help=argparse.SUPPRESS)  # the engine's process: its job file
    args = parser.parse_args(argv)
    if args.engine is not None:
        print(json.dumps(engine(json.loads(args.engine.read_text()))))
        return 0
    report = start_run("cost_trace", argv)
    from benchmarks.harness.streams import set_streams
    from rest_spec.common.tokenizer import load_tokenizer
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    tokenizer, model = load_tokenizer(None), str(hf_checkpoint(None, dtype="float32"))
    report["sets"] = {}
    for name in args.sets:
        index, _, held = set_streams(name, tokenizer, 0, args.prompts)
        job = {"model": model, "index": str(index), "prompts": [list(map(int, p)) for p in held]}
        job.update(concurrency=args.concurrency, max_new_tokens=args.max_new_tokens)
        report["sets"][name] = {"concurrency": args.concurrency, "prompts": len(held)}
        for repeat in range(args.repeats):
            for engine_name, count_set_up in ENGINES:
                result = run_engine({**job, "count_set_up": count_set_up}, args.out.with_suffix(f".{name}.job.json"))
                figures = {key: result["proposer"][key] for key in ("calls", "skipped", "rows_drafted", "drafted")}
                figures["rows_drafted_share"] = round(
                    result["proposer"]["rows_drafted"] / result["proposer"]["rows"], 3
                )
                figures["tokens_per_second"] = round(result["tokens_per_second"], 1)
                figures["per_token_ms_at"] = at_checkpoints([step[3] for step in result["trace"]])
                if repeat == 0 and not count_set_up:
                    report["sets"][name].update(analyse(result["trace"], result["prior_slope"]))
                report["sets"][name].setdefault("engines", {}).setdefault(engine_name, []).append(figures)
    save_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
