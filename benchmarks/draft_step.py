"""The drafting step's own time, phase by phase, at 1 to 16 rows: what REST's core adds to an engine's step.

    .venv-vllm/bin/python -m benchmarks.draft_step --sets code,chat --rows 1,4,8,16 --warmup 2000

The model's greedy outputs of the held-out sets (``benchmarks.harness.streams``' streams and cache: HumanEval
101-164 with the stdlib index, ShareGPT 41-80 with the sharegpt index) are replayed through the
adaptive drafter as vLLM's proposer runs it (index, the request's own text and a store of outputs
holding the first ``--warmup`` warm-up outputs; chains of at most ``--k`` tokens), R requests
decoded together, each row's chain accepted as far as its output follows it. Each phase of the step
(``drafter.core.steps.draft_step``'s sequence) is timed: ``advance`` (sessions, credit for what
was accepted, hindsight), ``sources`` (the index's and the store's trees), ``merge_select`` (the
request's own tree, the merge and the chain: ``draft_rows``, one compiled pass over the rows) and
``record``. Reports per R the median and p90 of a
step's milliseconds, per phase and in all, and per row; only steps where all R rows drafted count.
Timed: run it alone on a quiet machine. Prints one JSON object and saves it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.fleet_replay import accepted_length
from benchmarks.harness.report import RESULTS, benchmark_parser, comma_list, positive_int, save_report, start_run
from benchmarks.harness.streams import greedy_outputs, set_streams
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter

PHASES = ("advance", "sources", "merge_select", "record")


def timed_step(drafter: AdaptiveDrafter, rows: list[list[int]], requests: list[int], config: DraftConfig):
    """``draft_step``'s sequence for ``rows``, each phase timed: (chains, seconds per phase)."""
    clock = [time.perf_counter()]

    def lap() -> None:
        clock.append(time.perf_counter())

    sessions = drafter.advance(rows, requests)
    lap()
    candidates = drafter.candidates(config)
    shared = drafter.start_shared(rows, candidates).result()
    lap()
    chains, merged = drafter.draft_rows(sessions, shared, candidates)
    lap()
    drafter.record(chains, merged)
    lap()
    return chains, dict(zip(PHASES, np.diff(clock).tolist()))


def replay_rows(drafter: AdaptiveDrafter, examples, rows: int, k: int) -> list[dict[str, float]]:
    """The examples (prompt, greedy output) decoded ``rows`` at a time, each row's context handed
    as vLLM hands it (a view of an int32 token buffer, ``token_ids_cpu``); the phase times of
    every step where all ``rows`` rows drafted."""
    config, steps = DraftConfig(max_depth=k), []
    for first in range(0, len(examples) - rows + 1, rows):
        group = list(range(first, first + rows))
        width = max(len(examples[i][0]) + len(examples[i][1]) for i in group)
        buffer = np.zeros((len(group), width), np.int32)
        length, position = {}, dict.fromkeys(group, 1)
        for j, i in enumerate(group):
            prompt = list(examples[i][0]) + examples[i][1][:1]  # the prefill's token
            buffer[j, : len(prompt)], length[i] = prompt, len(prompt)
        while True:
            live = [j for j, i in enumerate(group) if position[i] < len(examples[i][1])]
            if not live:
                break
            requests = [group[j] for j in live]
            contexts = [buffer[j, : length[i]] for j, i in zip(live, requests)]
            chains, phases = timed_step(drafter, contexts, requests, config)
            if len(live) == rows:
                steps.append(phases)
            for j, i, chain in zip(live, requests, chains):
                output = examples[i][1]
                take = min(accepted_length(chain.tokens.tolist(), output[position[i] :]) + 1, len(output) - position[i])
                buffer[j, length[i] : length[i] + take] = output[position[i] : position[i] + take]
                length[i] += take
                position[i] += take
        drafter.finish(group)
    return steps


def summarize(steps: list[dict[str, float]], rows: int) -> dict:
    totals = [sum(step.values()) for step in steps]
    ms = {name: [1000 * step[name] for step in steps] for name in PHASES}
    return {
        "steps": len(steps),
        "step_ms_median": round(1000 * statistics.median(totals), 3),
        "step_ms_p90": round(1000 * float(np.percentile(totals, 90)), 3),
        "row_ms_median": round(1000 * statistics.median(totals) / rows, 3),
        "phase_ms_median": {name: round(statistics.median(values), 3) for name, values in ms.items()},
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = benchmark_parser(__doc__, prompts=64, prompts_help="held-out prompts per set, at most", sets=("code", "chat"))
    p.add_argument("--rows", type=comma_list(item=positive_int), default="1,4,8,16", help="(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2000, help="warm-up outputs in the store (default: %(default)s)")
    p.add_argument("--k", type=positive_int, default=8, help="draft tokens per row at most (default: %(default)s)")
    p.add_argument(
        "--warmup-concurrency", type=positive_int, default=32, help="requests at once decoding missing outputs"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "draft_step.json")
    args = p.parse_args(argv)
    report = start_run("draft_step", argv)
    from benchmarks.harness.engines import ENGINE_MODEL
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")
    tokenizer = load_tokenizer(None)
    flat = VerifyCost(CostKey("flat", "", 1, "cpu", "float32"), 256, tuple(range(1, args.k + 2)), (1.0,) * (args.k + 1))
    report["sets"] = {}
    for name in args.sets:
        index, warm_prompts, held = set_streams(name, tokenizer, args.warmup, args.prompts)
        examples = list(zip(held, greedy_outputs(held, args)))
        result = report["sets"][name] = {"index": str(index), "held_out": len(examples), "rows": {}}
        with LocalDrafter.open(index, outputs_max_tokens=50_000_000) as base:
            for output in greedy_outputs(warm_prompts, args):
                base.add_output(output)
            drafter = AdaptiveDrafter(base, cost=flat, chains=True)
            replay_rows(drafter, examples[: max(args.rows)], max(args.rows), args.k)  # compiled, calibrated
            for rows in args.rows:
                result["rows"][str(rows)] = summarize(replay_rows(drafter, examples, rows, args.k), rows)
                print(name, rows, result["rows"][str(rows)], flush=True)
    save_report(report, args.out)


if __name__ == "__main__":
    main()
