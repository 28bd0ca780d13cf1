"""End to end, side by side: plain decoding, Hugging Face ``generate`` with and without prompt lookup, paper REST
and the adaptive drafter.

    python -m benchmarks.e2e --prompts 40 --max-new-tokens 128 --sets humaneval,sharegpt \
        --modes plain,plain-layout,hf,pld,paper,adaptive,oracle

Prompt sets, each with its index: ``humaneval``, the first N HumanEval prompts (raw code to
complete), and ``humaneval-chat``, the same prompts as a user turn rendered with the chat template,
both with the ``python-stdlib`` index; ``sharegpt``, the first user turn of the first N held-out
ShareGPT conversations (rendered with the chat template; never in the index, which is built with
``--skip-last``) with the ``sharegpt`` index. Greedy decoding (unless ``--temperature``), N new
tokens. Modes:

- ``plain``: the REST loop without drafts (one token per step), the reference output;
- ``plain-layout``: the same at the fastest layout the measured cost names for one token (the
  verifier's linear layers transposed where that is faster): what ``rest-generate --no-draft`` runs
  once a cost table is cached; the adaptive mode against it is drafting's own share of the speed-up;
- ``hf``: ``model.generate`` (greedy);
- ``pld``: ``model.generate(..., prompt_lookup_num_tokens=10)``, transformers' prompt lookup decoding
  (greedy): what a Hugging Face user tries first, with one argument;
- ``paper``: REST as published: the static index only, a fixed tree of ``--budget`` nodes;
- ``adaptive``: ``AdaptiveDrafter``: index + the request's own text + recent outputs, merged by
  calibrated acceptance scores, sized each step by the measured verification cost t(n). Its output
  store starts empty and receives every ``adaptive``-mode output of the run (``add_output`` after each
  prompt), as a service would; its calibration carries over from prompt to prompt within a set.

For every prompt the modes run back to back (interleaved), so drift in machine speed hits all of
them alike. Per mode: mean accepted length (new tokens / verification steps), mean verified
tokens per step (tree nodes + 1), median per-prompt tokens/s, the median of per-prompt speed
ratios against plain, draft time per step, and how many outputs equal plain decoding (every
output must: the run exits with status 1 otherwise); per set, the median of per-prompt speed
ratios of the adaptive mode against pld, against the loop at its fastest layout (drafting's own
share) and against ``model.generate`` (the speed-up a user sees). The hf and pld modes count a step per model forward and
draft no trees of their own (draft time 0). Prints one JSON object, saves it under
benchmarks/results/, and plots accepted length and speed per mode (needs matplotlib).

Sampled (``--temperature T`` above 0, ``--top-p P``, ``--seed S``; top-k off): every mode samples,
the loop's modes through ``generate``'s generator and ``hf``/``pld`` through ``model.generate``
(``do_sample``, torch's generator seeded first), prompt i of a set with seed S + i in every mode.
The loop draws each new token at a uniform number of its own output position, so with one seed
its modes give plain's text with drafts or without, but where a draw falls within float rounding
of the edge between two tokens: a step of several positions rounds the logits unlike a one-token
step, and the draw may go to the neighbour (rare at temperature 0.7 with top-p; about one prompt
in 16 over 128 tokens at 1.0, where unlikely tokens are drawn). Their outputs are compared and
counted (``same_as_plain``), not checked: a difference is rounding, not a loss. The oracle drafts
the text the run will commit (drafting's ceiling, sampled too). ``model.generate`` draws
otherwise, so the hf and pld outputs are not compared (``same_as_plain`` null). No greedy target
is checked; the speed ratios are against plain *sampled* decoding, as greedy ones are against
plain greedy decoding. The figures go under ``sampled_sets`` (greedy ones under ``sets``).
``--beside-greedy`` runs every mode both ways on the same prompts, interleaved prompt by prompt
(each decoding with its own adaptive drafter and store of outputs), and reports per set what sampling keeps of each greedy gain (``kept_gain``: (sampled
speed-up - 1) / (greedy speed-up - 1), each against plain decoding of its own kind, per mode against
``plain`` and per side-by-side pair, e.g. ``adaptive_vs_hf``), checked against the target of
``targets.json`` (``sampled_kept_gain``)::

    python -m benchmarks.e2e --sets humaneval --prompts 20 --modes hf,pld,adaptive \
        --temperature 0.7 --top-p 0.95 --seed 0 --beside-greedy --out benchmarks/results/e2e_sampled.json

The verification cost t(n) comes from ``rest_spec.drafter.hf.measure.load_or_measure`` (cached per
model, device and dtype); measure it on the machine that runs the benchmark, quiet, with
``rest-measure-cost`` or ``--remeasure``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness.generation import Run, generation_config, hf_run
from benchmarks.harness.replay import greedy_path, save_greedy_outputs
from benchmarks.harness.report import (
    GREEDY,
    RESULTS,
    Decoding,
    add_sampling_arguments,
    benchmark_parser,
    check,
    comma_list,
    decoding_arguments,
    kept_gain,
    load_targets,
    mode_bars,
    pyplot,
    save_figure,
    save_report,
    start_run,
)
from benchmarks.harness.sets import DEFAULT_SETS, SETS, add_set_arguments, set_index, set_prompts
from rest_spec.common.tokenizer import load_tokenizer, tokenizer_fingerprint
from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo
from rest_spec.drafter.cli.generation import seeded_generator
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.corrected_cost import CorrectedCost
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.protocol import Drafter
from rest_spec.drafter.core.selection import select_chain
from rest_spec.drafter.hf.generate import GenerationResult, generate
from rest_spec.drafter.hf.measure import load_or_measure
from rest_spec.drafter.hf.model import load_model

log = logging.getLogger("benchmarks.e2e")

MODES = ("plain", "plain-layout", "hf", "pld", "paper", "adaptive", "oracle")
GENERATE_MODES = ("hf", "pld")  # decoded by model.generate; the others by the loop (``generate``)
# (mode, baseline) pairs whose per-prompt speed ratios each set reports as medians
SIDE_BY_SIDE = (
    ("adaptive", "pld"),
    ("adaptive", "plain-layout"),
    ("adaptive", "hf"),
    ("plain-layout", "hf"),
    ("oracle", "plain-layout"),
)
PROMPT_LOOKUP_TOKENS = 10  # the pld mode's prompt_lookup_num_tokens


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, sets=SETS, default_sets=DEFAULT_SETS)
    p.add_argument(
        "--modes",
        type=comma_list(MODES),
        default=",".join(MODES),
        help="comma-separated, of %(default)s (plain always runs)",
    )
    add_set_arguments(p)
    p.add_argument(
        "--budget", type=int, default=64, help="paper mode's tree size; the adaptive mode's candidates (default 64)"
    )
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--model", default=None, help="model spec (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--remeasure", action="store_true", help="measure t(n) again instead of using the cached cost")
    p.add_argument("--out", type=Path, default=RESULTS / "e2e.json")
    p.add_argument("--plot", type=Path, default=None, help="the plot (default: --out with .png)")
    add_sampling_arguments(p)
    args = p.parse_args(argv)
    args.decodings = decoding_arguments(p, args)
    args.plot = args.plot or args.out.with_suffix(".png")
    args.modes = [m for m in MODES if m in args.modes or m == "plain"]  # plain is the reference
    return args


# ---- modes ------------------------------------------------------------------------------------


class TreeSizes:
    """A ``Drafter`` that forwards to ``drafter`` and records the size of every tree it answers
    (the loop asks once per step at batch size 1)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.sizes = drafter, []

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        tree = self.drafter.draft(context, config)
        self.sizes.append(len(tree))
        return tree

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
        return [self.draft(context, config) for context in contexts]

    def info(self) -> IndexInfo:
        return self.drafter.info()

    def close(self) -> None:
        pass  # the wrapped drafter belongs to the caller


class Oracle:
    """A ``Drafter`` that knows the output: a chain of the next ``max_depth`` tokens of ``output``
    (plain decoding's, after ``prompt``), every score 1, cut to the length ``cost`` says is fastest
    (``select_chain``), as long as the text follows ``output`` (nothing once it has parted from it).
    Nothing drafts better in this loop: the oracle mode is drafting's ceiling, greedy and sampled
    (with one seed the loop commits the same text with drafts or without, ``drafter.hf.sampling``),
    at the chain length the cost prices best."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int], cost: CorrectedCost) -> None:
        self.prompt_length, self.output, self.cost = len(prompt), list(output), cost

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        at = len(context) - self.prompt_length
        if list(context[self.prompt_length :]) != self.output[:at]:
            return DraftTree.empty()
        tokens = self.output[at : at + config.max_depth]
        chain = DraftTree(tokens, np.arange(len(tokens)) - 1, np.ones(len(tokens)), scores=np.ones(len(tokens)))
        return select_chain(chain, self.cost, config.max_depth)

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
        return [self.draft(context, config) for context in contexts]

    def info(self) -> IndexInfo:
        raise TypeError("the oracle drafts from plain decoding's output: it has no index to describe")

    def close(self) -> None:
        pass


def loop_run(
    model,
    ids: list[int],
    drafter: Drafter | None,
    max_new_tokens: int,
    config: DraftConfig,
    cost: VerifyCost | CorrectedCost | None = None,
    decoding: Decoding = GREEDY,
    seed: int | None = None,
) -> Run:
    """``generate`` on one prompt, at the block shapes ``cost`` names (default: the drafter's cost,
    which the recorder would hide; none: PyTorch's layout); sampled (``decoding``), with a generator
    seeded with ``seed``."""
    recorder = TreeSizes(drafter) if drafter is not None else None
    if cost is None:
        cost = getattr(drafter, "cost", None)
    result: GenerationResult = generate(
        model,
        ids,
        recorder,
        max_new_tokens=max_new_tokens,
        config=config,
        cost=cost,
        generation_config=generation_config(model, decoding),
        generator=seeded_generator(model, seed) if decoding.sampled else None,
    )
    nodes = sum(recorder.sizes) if recorder is not None else 0
    return Run(result.output_ids, result.seconds, result.steps, result.steps + nodes, result.draft_seconds)


class SetRun:
    """Every mode of one set decoded one way (``decoding``), prompt by prompt (``prompt``): its own
    adaptive drafter (output store and calibration carry over between the set's prompts, not
    between decodings) and its rows; ``result`` the set's figures."""

    def __init__(self, base: LocalDrafter, model, cost: VerifyCost, args: argparse.Namespace, decoding: Decoding):
        self.base, self.model, self.cost, self.args, self.decoding = base, model, cost, args, decoding
        self.config = DraftConfig(budget=args.budget, max_depth=args.max_depth)
        self.adaptive = AdaptiveDrafter(base, cost=cost, config=self.config)
        self.layout_cost = CorrectedCost(cost)  # what rest-generate --no-draft runs at: corrected over the set
        self.oracle_cost = CorrectedCost(cost)
        self.rows: dict[str, list[dict]] = {mode: [] for mode in args.modes}
        self.plain_outputs: list[list[int]] = []

    def run(self, mode: str, ids: list[int], seed: int, plain: Run | None = None) -> Run:
        """``mode`` on one prompt, drawing with ``seed`` where sampled (only the oracle reads plain's run)."""
        model, n, config, decoding = self.model, self.args.max_new_tokens, self.config, self.decoding
        if mode in GENERATE_MODES:
            lookup = PROMPT_LOOKUP_TOKENS if mode == "pld" else None
            return hf_run(model, ids, n, lookup, decoding=decoding, seed=seed)
        drafter, cost = {
            "plain": (None, None),
            "plain-layout": (None, self.layout_cost),
            "paper": (self.base, None),
            "adaptive": (self.adaptive, None),
            "oracle": (Oracle(ids, plain.output_ids, self.oracle_cost) if plain else None, None),
        }[mode]
        return loop_run(model, ids, drafter, n, config, cost, decoding=decoding, seed=seed)

    def warm_up(self, ids: list[int]) -> None:
        """Compiled kernels, caches, allocator: every mode on the start of ``ids``; no outputs added."""
        warm = ids[: min(len(ids), 32)]
        loop_run(self.model, warm, AdaptiveDrafter(self.base, cost=self.cost, config=self.config), 8, self.config)
        warm_plain = self.run("plain", warm, 0)
        for mode in self.args.modes:
            if mode not in ("plain", "adaptive"):
                self.run(mode, warm, 0, warm_plain)

    def prompt(self, i: int, ids: list[int]) -> None:
        """Every mode on prompt ``i``, plain first (the reference), each drawing with its seed."""
        seed = self.decoding.seed_of(i)
        reference = self.run("plain", ids, seed)
        self.plain_outputs.append(reference.output_ids)
        for mode in self.args.modes:
            run = reference if mode == "plain" else self.run(mode, ids, seed, reference)
            compared = not self.decoding.sampled or mode not in GENERATE_MODES  # model.generate draws otherwise
            self.rows[mode].append({"prompt": i, "prompt_tokens": len(ids), **run.row(reference, compared)})
            if mode == "adaptive":
                self.adaptive.add_output(run.output_ids)

    def result(self, prompts: list[list[int]]) -> dict:
        rows, adaptive = self.rows, self.adaptive
        result = {
            "index": str(self.base.datastore.path),
            "prompts": len(prompts),
            **({} if not self.decoding.sampled else {"decoding": self.decoding.describe()}),
            "modes": {mode: summarize(mode_rows) for mode, mode_rows in rows.items()},
            "adaptive_mode_source_weights": dict(zip(adaptive.sources, adaptive.calibration.weights.round(4).tolist())),
            "adaptive_mode_attribution": {
                "cells": adaptive.attribution.report(),
                "hindsight": adaptive.attribution.hindsight(),
            },
            "per_prompt": rows,
        }
        for mode, baseline in SIDE_BY_SIDE:  # prompt by prompt, as the speeds against plain
            if mode in rows and baseline in rows:
                result[f"median_speed_{mode}_vs_{baseline}"] = statistics.median(
                    a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(rows[mode], rows[baseline])
                )
        return result


def run_decodings(
    name: str,
    prompts: list[list[int]],
    bases: Sequence[LocalDrafter],
    model,
    cost: VerifyCost,
    args: argparse.Namespace,
    decodings: Sequence[Decoding] = (GREEDY,),
) -> dict[str, dict]:
    """Every mode of every decoding on every prompt of one set, interleaved (per prompt, each
    decoding's modes in turn, so drift in the machine's speed hits them alike), each decoding with
    its own opened index in ``bases`` (one per decoding: the store of outputs its adaptive mode
    fills is its own, so the sampled runs never draft a greedy output of the same prompt); per
    decoding (``Decoding.name``), per-prompt rows and per-mode summaries."""
    if len(bases) != len(decodings):
        raise ValueError(f"one opened index per decoding: {len(bases)} for {len(decodings)}")
    sessions = [SetRun(base, model, cost, args, decoding) for base, decoding in zip(bases, decodings)]
    for session in sessions:
        session.warm_up(prompts[0])
    for i, ids in enumerate(prompts):
        for session in sessions:
            session.prompt(i, ids)
            rows = session.rows
            log.info(
                "%s %d/%d%s: %s",
                name,
                i + 1,
                len(prompts),
                f" {session.decoding.name}" if len(sessions) > 1 or session.decoding.sampled else "",
                ", ".join(
                    f"{mode} {rows[mode][-1]['mean_accepted']:.2f} tok/step x{rows[mode][-1]['speed_vs_plain']:.2f}"
                    for mode in args.modes
                ),
            )
    for session in sessions:
        if not session.decoding.sampled:  # plain mode is the replay benchmarks' greedy reference: cached for them
            save_greedy_outputs(
                greedy_path(model, name, prompts, args.max_new_tokens), list(zip(prompts, session.plain_outputs))
            )
    return {session.decoding.name: session.result(prompts) for session in sessions}


def run_set(
    name: str,
    prompts: list[list[int]],
    base: LocalDrafter,
    model,
    cost: VerifyCost,
    args: argparse.Namespace,
    decoding: Decoding = GREEDY,
) -> dict:
    """Every mode on every prompt of one set, interleaved, decoded as ``decoding`` says; per-prompt
    rows and per-mode summaries."""
    return run_decodings(name, prompts, [base], model, cost, args, [decoding])[decoding.name]


def kept_gains(greedy: dict, sampled: dict) -> dict:
    """What sampling keeps of each greedy gain on one set (two ``run_set`` results of the same
    prompts): per mode its median speed against plain decoding of its own kind (``MODE_vs_plain``),
    and per side-by-side pair (``SIDE_BY_SIDE``, e.g. ``adaptive_vs_hf``: against ``model.generate``
    of its own kind), the greedy and sampled speed-ups and ``kept`` (``benchmarks.harness.report.kept_gain``)."""
    pairs = {
        f"{mode}_vs_plain": (greedy["modes"][mode]["median_speed_vs_plain"], figures["median_speed_vs_plain"])
        for mode, figures in sampled["modes"].items()
        if mode != "plain" and mode in greedy["modes"]
    }
    for mode, baseline in SIDE_BY_SIDE:
        key = f"median_speed_{mode}_vs_{baseline}"
        if key in greedy and key in sampled:
            pairs[f"{mode}_vs_{baseline}"] = (greedy[key], sampled[key])
    return {
        name: {"greedy_speedup": g, "sampled_speedup": s, "kept": kept_gain(g, s)} for name, (g, s) in pairs.items()
    }


def summarize(rows: list[dict]) -> dict:
    tokens, steps = sum(r["new_tokens"] for r in rows), sum(r["steps"] for r in rows)
    return {
        "mean_accepted": tokens / steps,  # all new tokens / all verification steps
        "mean_verified_per_step": sum(r["verified_per_step"] * r["steps"] for r in rows) / steps,
        "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows),
        "median_speed_vs_plain": statistics.median(r["speed_vs_plain"] for r in rows),
        "median_draft_ms_per_step": statistics.median(r["draft_ms_per_step"] for r in rows),
        # outputs equal to plain decoding's; None where not compared (model.generate's, sampled)
        "same_as_plain": None
        if any(r["same_as_plain"] is None for r in rows)
        else sum(r["same_as_plain"] for r in rows),
    }


def targets(report: dict) -> dict:
    """The targets of benchmarks/targets.json, checked on this run's figures (left out where a
    needed mode did not run): the greedy ones on the greedy sets (``sets``), and whether every
    output there equals plain decoding (None where nothing ran greedy; sampled outputs are counted,
    not checked: see the module's docstring); with both decodings, what sampling keeps of the
    adaptive mode's gain (``kept_gain``)."""
    limits, out = load_targets("e2e"), {}
    accepted, verified = limits["accepted_vs_paper"], limits["verified_per_step_vs_paper"]
    for name, result in report["sets"].items():
        modes = result["modes"]
        adaptive, paper = modes.get("adaptive"), modes.get("paper")
        if adaptive and paper:
            out[f"{name}: adaptive accepted length >= {accepted['min']}x paper"] = check(
                adaptive["mean_accepted"] / paper["mean_accepted"], accepted
            )
            out[f"{name}: adaptive verifies no more tokens per step than paper"] = check(
                adaptive["mean_verified_per_step"] / paper["mean_verified_per_step"], verified
            )
        if adaptive:
            speed = limits.get(f"median_speed_vs_plain_{name}", limits["median_speed_vs_plain"])
            out[f"{name}: adaptive median speed >= {speed['min']}x plain"] = check(
                adaptive["median_speed_vs_plain"], speed
            )
        if "median_speed_adaptive_vs_pld" in result:
            speed = limits["median_speed_vs_pld"]
            out[f"{name}: adaptive median speed >= {speed['min']}x pld"] = check(
                result["median_speed_adaptive_vs_pld"], speed
            )
    kept = limits["sampled_kept_gain"]
    for name, gains in report.get("kept_gain", {}).items():
        adaptive = gains.get("adaptive_vs_plain")
        if adaptive and adaptive["kept"] is not None:
            out[f"{name}: sampled, adaptive keeps >= {kept['min']} of its greedy gain over plain"] = check(
                adaptive["kept"], kept
            )
    out["every output equals plain decoding"] = (
        all(
            mode["same_as_plain"] == result["prompts"]
            for result in report["sets"].values()
            for mode in result["modes"].values()
        )
        if report["sets"]
        else None
    )
    return out


def plot(report: dict, path: Path) -> bool:
    """Bar charts of mean accepted length and median speed vs plain, per set and mode, a row per
    decoding (greedy: ``sets``, sampled: ``sampled_sets``); False (and a warning) when matplotlib is
    not installed."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [
        (kind, {"sets": report[key]})
        for kind, key in (("greedy", "sets"), ("sampled", "sampled_sets"))
        if report.get(key)
    ]
    figure, axes = plt.subplots(len(rows), 2, figsize=(10, 4 * len(rows)), squeeze=False)
    for (kind, sets), (accepted, speed) in zip(rows, axes):
        mode_bars(accepted, sets, MODES, "mean_accepted", f"{kind}: mean accepted length (tokens / step)")
        mode_bars(speed, sets, MODES, "median_speed_vs_plain", f"{kind}: speed vs plain {kind} decoding (median)")
        accepted.legend()
    sampling = report["config"]["decoding"]
    figure.suptitle(
        f"{report['config']['model']}, "
        + (
            "greedy"
            if sampling["decoding"] == "greedy"
            else f"temperature {sampling['temperature']}, top-p {sampling['top_p']}"
        )
        + f", {report['config']['max_new_tokens']} new tokens, {report['machine']['device']}",
        fontsize=9,
    )
    save_figure(figure, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("e2e", argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    fingerprint = tokenizer_fingerprint(tokenizer)
    cost = load_or_measure(model, remeasure=args.remeasure)
    report = {
        **header,
        "config": {
            "model": args.model or "SmolLM2-135M-Instruct (packaged GGUF, fp32)",
            "greedy": args.decodings[-1] is GREEDY,  # every mode greedy (with --beside-greedy: besides sampled)
            "decoding": args.decodings[-1].describe(),
            "beside_greedy": args.beside_greedy,
            "prompts_per_set": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "budget": args.budget,
            "max_depth": args.max_depth,
            "max_prompt_tokens_sharegpt": args.max_prompt_tokens,
            "modes": args.modes,
            "adaptive_mode": "AdaptiveDrafter(sources=index,request,outputs, cost=measured t(n)); its output "
            "store starts empty and gets each adaptive-mode output after its prompt (add_output); its "
            "calibration (per source and sample class) carries over between prompts of a set",
            "humaneval_prompts": "raw code to complete",
            "humaneval_chat_prompts": "the HumanEval prompts as a user turn, chat template",
            "sharegpt_prompts": "first user turn of held-out conversations, chat template",
            "oracle_mode": "drafts plain decoding's output of the same seed (the text every loop mode commits), "
            "cut to the chain length the cost prices best: drafting's ceiling, greedy and sampled",
        },
        "verify_cost": {
            "sizes": list(cost.sizes),
            "relative_to_one_token": [s / cost.seconds[0] for s in cost.seconds],
            "chain_relative_to_one_token": [s / cost.seconds[0] for s in cost.chain_seconds],
            "one_token_ms": 1e3 * cost.seconds[0],
            "key": dataclasses.asdict(cost.key),
        },
        "sets": {},  # greedy figures (with --temperature above 0 only with --beside-greedy)
    }
    if args.decodings[-1].sampled:
        report["sampled_sets"] = {}  # sampled figures: speeds against plain sampled decoding
    if len(args.decodings) > 1:
        report["kept_gain"] = {}  # per set: (sampled speed-up - 1) / (greedy speed-up - 1)
    report["machine"].update(torch_threads=torch.get_num_threads(), device=str(model.device))
    for name in args.sets:
        index = set_index(name, args)
        prompts = set_prompts(name, tokenizer, index, args.prompts, args.max_prompt_tokens, args.skip_prompts)
        with contextlib.ExitStack() as stack:  # an opened index per decoding: their stores of outputs apart
            bases = [
                stack.enter_context(LocalDrafter.open(index, expected_fingerprint=fingerprint)) for _ in args.decodings
            ]
            results = run_decodings(name, prompts, bases, model, cost, args, args.decodings)
        if "greedy" in results:
            report["sets"][name] = results["greedy"]
        if "sampled" in results:
            report["sampled_sets"][name] = results["sampled"]
        if len(results) > 1:
            report["kept_gain"][name] = kept_gains(results["greedy"], results["sampled"])
    report["targets"] = targets(report)
    report["plot"] = str(args.plot) if plot(report, args.plot) else None
    save_report(report, args.out)
    if report.get("kept_gain"):
        log.info("%s", kept_gain_lines(report["kept_gain"]))
    if report["targets"]["every output equals plain decoding"] is False:
        log.error("some outputs differ from plain decoding (see same_as_plain)")
        return 1
    return 0


def kept_gain_lines(gains: dict[str, dict]) -> str:
    """``kept_gains`` per set as a table: greedy and sampled speed-ups, and the share kept."""
    lines = [f"{'set':<16} {'speed-up of':<24} {'greedy':>7} {'sampled':>8} {'kept':>6}"]
    for name, pairs in gains.items():
        for pair, g in pairs.items():
            kept = "-" if g["kept"] is None else f"{g['kept']:.2f}"
            lines.append(f"{name:<16} {pair:<24} {g['greedy_speedup']:>7.2f} {g['sampled_speedup']:>8.2f} {kept:>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
