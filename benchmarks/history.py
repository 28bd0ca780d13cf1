"""What a deployment's past outputs are worth to each drafter, replayed without the engine.

    .venv-vllm/bin/python -m benchmarks.history --sets code --prompts 64 --warmup 0,500,2000 --replicas 1,4

A replica that has served N earlier requests drafts the held-out requests that follow. Greedy
outputs do not depend on the drafter, so the model runs once (plain vLLM, many requests at a time;
cached under ``$REST_CACHE_DIR/greedy-vllm``) and every drafter is replayed on the same outputs:
at each step it drafts a chain of at most ``--k`` tokens from the context so far, the longest prefix
the greedy output follows is accepted plus one token, as vLLM's verifier does. No timing: tokens
per step only, so the comparison is exact and free of this machine's noise.

Drafters, each starting from the same history (the warm-up requests' prompts and outputs, served in
order, then each held-out request's output once it finished):

- ``suffix``: Arctic Inference's ``SuffixDecodingCache`` with vLLM's ``suffix`` settings (tree depth
  24, at most k tokens, spec factor 1, min token probability 0.1), fed as vLLM's proposer feeds it;
- ``rest``: the adaptive drafter vLLM's proposer runs (index, the request's own text and the store
  of outputs, merged and scored), its chain the root path of most expected tokens per step priced
  by ``--price``, admitted as the proposer admits it (``select_batch_chains``) on scores calibrated
  by the chains verified before (``drafter.core.chain_calibration``);
- ``rest-no-suffix``: ``rest`` without vLLM's ``suffix`` matcher among its sources, as before
  2026-12-06 (``rest`` has it, as vLLM's proposer does where Arctic Inference is installed:
  ``drafter.core.suffix_cache``, its cache of responses fed from the fleet's store of outputs);
- ``rest-no-index``: the same without the index (the request and the store only: suffix's sources);
- ``rest-outputs``: the store of outputs alone;
- ``rest-index-suffix``, ``rest-no-request``, ``rest-no-outputs``: ``rest`` with the index and suffix's
  matcher only, without the request's own text, without the store of outputs: what suffix's matcher
  leaves each of REST's own sources to add (2026-12-08: each still adds, ``notes/versus-suffix.md``);
- ``rest-raw``: ``rest`` with its chains scored by the merge alone (no ``ChainCalibration``), as
  before 2026-12-06: what the calibration of the chains changes;
- ``rest-own``: ``rest`` with the model's own corpus (``--own-index``, built by
  ``benchmarks.own_corpus``) opened with the set's index as one.

Sets and warm-up streams are ``benchmarks.fleet``'s (``benchmarks.harness.streams``), the replay
``benchmarks.harness.fleet_replay``'s (``run_fleet``): ``code`` holds out HumanEval from the 101st
problem, its warm-up function-completion prompts mined from packages no index holds; ``chat`` holds
out ShareGPT 41-80 (first user turns of the sharegpt index's held-out conversations), its warm-up
the held-out conversations from the 81st on, then conversations inside the index. F replicas
(``--replicas``) each serve their round-robin share, REST's replicas drafting theirs (not tallied);
past the held-out prompts' number a fleet is simulated (each replica's caches hold 1/F of the
warm-up's outputs, and only the replicas given a held-out prompt are replayed). ``--restart``
replays each warmed fleet again as if every engine had restarted after the warm-up: suffix's
caches empty; REST's durable store of outputs reloaded (its suffix source's responses replayed from
it) and each replica's calibrations recalled from the file it kept
(``drafter.core.calibration_memory``); ``--restart-forgets``: as before 17ad635, REST's
calibrations empty too. Reports, per set, F and warm-up size N, tokens per step and accepted tokens
per step of each drafter, their lift over no history, what their chains claimed against what they
got accepted (``claims``: the sum of a chain's scores over its accepted tokens, per leading source and match length; suffix's
``score``), and for the REST drafters their attribution in hindsight per source
(``drafter.core.merge.Attribution``: tokens each source held of what followed, tokens accepted).

``--price p`` prices a draft token at p of a row's plain step (vLLM on this CPU: about 0.04 at one
row, 0.5 at 16): REST's chains are sized by it, and every drafter's speed against plain is modeled as
tokens / (steps + p x draft tokens), drafting's own time left out -- what a drafter's chains can
reach under load, without the noise of timed runs.

``--versus-suffix`` replays suffix beside each REST replica on the same contexts: at every step both
draft, REST's chain is verified, and suffix's is set against it (``versus_suffix``: the share of steps
where REST's chain held at least what suffix's held, the tokens short a step, and per source that
led REST's chain the steps where suffix's held more).

``--tune M`` replays a tuning split instead, so the drafting core's choices are made without the
held-out sets: the held-out requests are the last M of the warm-up stream (drawn max(N) + M long,
their outputs cached with the warm-up's) and the warm-up the requests before them. It never decodes:
an output not cached already is an error (``max(N) + M`` within the 2,000 cached per set).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.fleet_replay import run_fleet
from benchmarks.harness.report import RESULTS, benchmark_parser, comma_list, positive_int, report_header, save_report
from benchmarks.harness.streams import (
    add_fleet_arguments,
    add_own_index_argument,
    greedy_outputs,
    require_own_index,
    set_streams,
)
from rest_spec.common.tokenizer import load_tokenizer

log = logging.getLogger("benchmarks.history")
SETS = ("code", "chat")  # benchmarks.fleet's streams
DRAFTERS = (
    "suffix",
    "rest",
    "rest-no-suffix",
    "rest-no-index",
    "rest-outputs",
    "rest-index-suffix",
    "rest-no-request",
    "rest-no-outputs",
    "rest-own",
    "rest-raw",
)


def tuning_split(warm: list[list[int]], tune: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up, held-out) of ``--tune``: the last ``tune`` requests of the warm-up stream held out."""
    if not 0 < tune <= len(warm):
        raise ValueError(f"--tune {tune} needs a warm-up stream of at least that many requests, got {len(warm)}")
    return warm[:-tune], warm[-tune:]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, prompts_help="held-out prompts per set", sets=SETS)
    add_fleet_arguments(p)
    p.add_argument("--k", type=positive_int, default=8, help="draft tokens per step at most (default: %(default)s)")
    p.add_argument(
        "--price",
        type=float,
        default=0.0,
        help="a draft token's cost as a share of a row's plain step: REST's chains are sized by it, and every "
        "drafter's modeled speed priced by it (vLLM on this CPU: about 0.05 at 1 row, 0.5 at 16; "
        "default: %(default)s, flat)",
    )
    p.add_argument("--warmup-concurrency", type=positive_int, default=32, help="requests at once decoding outputs")
    p.add_argument(
        "--drafters",
        type=comma_list(DRAFTERS),
        default=",".join(DRAFTERS[:-1]),
        help=f"comma-separated, of {','.join(DRAFTERS)} (default: %(default)s)",
    )
    add_own_index_argument(p, SETS, "the rest-own drafter")
    p.add_argument(
        "--tune",
        type=int,
        default=0,
        metavar="M",
        help="hold out the last M warm-up requests instead of the set's held-out prompts (a tuning split)",
    )
    p.add_argument(
        "--versus-suffix",
        action="store_true",
        help="replay suffix beside each REST replica on the same contexts: the share of steps where REST's chain "
        "held at least what suffix's held, and where not, which source led REST's chain",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="also replay each fleet with N > 0 after a restart of every engine: suffix's caches start empty, "
        "REST reloads its durable store of outputs and recalls its calibrations (reported as 'F=.. N=.. restart')",
    )
    p.add_argument(
        "--restart-forgets",
        action="store_true",
        help="with --restart: REST's calibrations start empty too, as before they were kept (17ad635)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "history.json")
    args = p.parse_args(argv)
    require_own_index(p, args, "rest-own", args.drafters)
    args.warmup, args.replicas = sorted(args.warmup), sorted(args.replicas)
    if args.price < 0:
        p.error("--price must be >= 0")
    if min(args.warmup) < 0 or min(args.replicas) < 1:
        p.error("--warmup >= 0, --replicas >= 1")
    if args.tune < 0 or 0 < args.tune < max(args.replicas):
        p.error("--tune M: M at least the largest --replicas")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from benchmarks.harness.engines import ENGINE_MODEL
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")  # as benchmarks.fleet
    tokenizer = load_tokenizer(None)
    report = report_header("history", argv)
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["config"]["own_index"] = {name: str(path) for name, path in args.own_index.items()}
    report["sets"] = {}
    for name in args.sets:
        index, warm_prompts, held_prompts = set_streams(name, tokenizer, max(args.warmup) + args.tune, args.prompts)
        if args.tune:
            warm_prompts, held_prompts = tuning_split(warm_prompts, args.tune)
        held_out = list(zip(held_prompts, greedy_outputs(held_prompts, args, cached_only=bool(args.tune))))
        result = report["sets"][name] = {"index": str(index), "held_out": len(held_out), "fleets": {}}
        if args.tune:
            result["tuning_split"] = f"warm-up requests {max(args.warmup) + 1}-{max(args.warmup) + args.tune} held out"
        if name in args.own_index:
            result["own_index"] = str(args.own_index[name])
        for n in args.warmup:  # the warm-up decoded as far as each N needs, so the small N report first
            warm = list(zip(warm_prompts[:n], greedy_outputs(warm_prompts[:n], args, cached_only=bool(args.tune))))
            restarts = (False, True) if args.restart and n > 0 else (False,)
            for f, restart in itertools.product(args.replicas, restarts):
                row = {
                    d: run_fleet(
                        d,
                        args.k,
                        [index, args.own_index[name]] if d == "rest-own" else index,
                        warm,
                        held_out,
                        f,
                        args.price,
                        shadow=args.versus_suffix and d != "suffix",
                        restart=restart,
                        forget=args.restart_forgets,
                    )
                    for d in args.drafters
                }
                cold = result["fleets"].get(f"F={f} N={args.warmup[0]}", row)
                for d, figures in row.items():
                    figures["lift_over_cold"] = round(figures["tokens_per_step"] / cold[d]["tokens_per_step"], 4)
                label = f"F={f} N={n}" + (" restart" if restart else "")
                result["fleets"][label] = row
                line = ", ".join(
                    f"{d} {r['tokens_per_step']:.3f} ({r['modeled_speed_vs_plain']:.3f}x"
                    + (
                        f"; >= suffix on {r['versus_suffix']['at_least_suffix']:.1%} of steps"
                        if "versus_suffix" in r
                        else ""
                    )
                    + ")"
                    for d, r in row.items()
                )
                print(f"{name} {label}: tokens/step (modeled speed at price {args.price}) {line}", file=sys.stderr)
                save_report(report, args.out, echo=False)  # what is measured so far, should a later N fail
    save_report(report, args.out)


if __name__ == "__main__":
    main()
