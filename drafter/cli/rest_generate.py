"""``rest-generate``: generation for prompts given on the command line or in a file, greedy unless
``--temperature`` says to sample.

A thin layer over ``drafter.hf.generate.generate`` (or llama.cpp with ``--engine llama.cpp``): parse
arguments, read prompts, open the parts (``drafter.hf.session``), print results; the arguments,
exit statuses and command shell it shares with ``rest-chat`` are ``drafter.cli.generation``'s.
Heavy imports (torch, transformers) happen after argument parsing so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rest_spec.common.errors import CliError
from rest_spec.drafter.cli.generation import (
    EXIT_STATUSES,
    add_model_arguments,
    add_sampling_arguments,
    load_parts,
    parse_args,
    positive_int,
    run_cli,
    sampling_config,
    seeded_generator,
)
from rest_spec.drafter.cli.prompts import CHAT_HELP, PROMPTS_FILE_HELP, Prompt, as_chat, encode_prompt, read_prompts
from rest_spec.drafter.hf.session import no_draft_cost, open_drafter, remember_output

if TYPE_CHECKING:
    import torch

    from rest_spec.drafter.hf.generate import GenerationResult
    from rest_spec.drafter.llamacpp.draft_model import LlamaGeneration

log = logging.getLogger("rest_spec.drafter.cli.rest_generate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rest-generate",
        description="Generation with retrieval-based speculative decoding (REST). Greedy by default, and then "
        "token-identical to plain greedy decoding; with --temperature above 0 it samples, each token drawn from "
        "exactly the model's own distribution. Either way the datastore only changes the speed.",
        epilog="For an interactive chat that streams the replies, run rest-chat (python -m rest_spec.drafter.cli.chat). "
        + EXIT_STATUSES,
    )
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="one raw-text prompt")
    prompts.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        type=Path,
        help=PROMPTS_FILE_HELP,
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help=CHAT_HELP,
    )
    add_model_arguments(parser)
    add_sampling_arguments(parser, drafted=True)
    parser.add_argument(
        "--engine",
        choices=("transformers", "llama.cpp"),
        default="transformers",
        help="what runs the model: transformers (tree drafts) or llama.cpp through llama-cpp-python (--model "
        "FILE.gguf; chain drafts sized by llama.cpp's own measured cost, always adaptive; needs the llama "
        "extra) (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="llama.cpp threads, for one-token steps and batches alike (default: every core)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt on stdout instead of text"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also decode each prompt without drafts (the same model in the same loop, at its fastest layout) and "
        "end with one line: both speeds and whether every output is the same: greedy, where a difference exits 1, "
        "or sampled with --seed (one seed draws one text, with drafts or without, but where a draw falls within "
        "float rounding of the edge between two tokens); sampled without --seed the two draw different texts "
        "and only speeds are compared. Both are warmed up before anything is timed "
        "and take turns going first, so the machine's noise falls on both alike",
    )
    return parser


def result_record(result: GenerationResult | LlamaGeneration, text: str, draft_seconds: float, **extra) -> dict:
    """The ``--json`` object for one prompt (``extra``: what only one engine reports)."""
    return {
        "output_ids": result.output_ids,
        "text": text,
        "new_tokens": len(result.output_ids),
        "steps": result.steps,
        "mean_accepted": round(result.mean_accepted, 4),
        "seconds": round(result.seconds, 4),
        "tokens_per_second": round(result.tokens_per_second, 2),
        "draft_seconds": round(draft_seconds, 4),
        **extra,
    }


def print_result(args: argparse.Namespace, record: dict, number: int, total: int, timings: str) -> None:
    """One prompt's result: its ``record`` as JSON with ``--json``; else its text, and on stderr a
    statistics line ending in ``timings``."""
    if args.json:
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    print(record["text"], flush=True)
    print(
        f"[{number}/{total}] {record['new_tokens']} tokens in {record['seconds']:.2f} s "
        f"({record['tokens_per_second']:.1f} tok/s), {record['steps']} steps, mean accepted "
        f"{record['mean_accepted']:.2f}, {timings}",
        file=sys.stderr,
    )


WARM_UP_TOKENS = 16  # --compare: tokens each way decodes before anything is timed


def run(args: argparse.Namespace) -> None:
    """Everything after argument parsing; raises on errors."""
    from rest_spec.drafter.hf.generate import generate

    prompts = [Prompt(text=args.prompt)] if args.prompt is not None else read_prompts(args.prompts)
    if args.chat:
        prompts = [as_chat(prompt) for prompt in prompts]
    if args.compare and (args.no_draft or args.engine != "transformers"):
        raise CliError("--compare decodes with drafts from --datastore and without them: it needs --datastore and "
                       "the transformers engine")  # fmt: skip
    if args.engine == "llama.cpp":
        run_llama(args, prompts)
        return
    if args.threads is not None:
        raise CliError("--threads is for --engine llama.cpp (transformers follows OMP_NUM_THREADS)")

    tokenizer, model, drafter = load_parts(args)
    plain_cost = no_draft_cost(model) if drafter is None or args.compare else None

    def decode(
        ids: list[int],
        drafted: bool,
        max_new_tokens: int = args.max_new_tokens,
        generator: torch.Generator | None = None,
    ) -> GenerationResult:
        # with drafts, the drafter's own cost (--adaptive's measured table) sizes each step
        return generate(model, ids, drafter if drafted else None, max_new_tokens=max_new_tokens, config=args.config,
                        generation_config=generation, overlap=args.overlap, cost=None if drafted else plain_cost,
                        generator=streams[drafted] if generator is None else generator)  # fmt: skip

    try:
        generation = sampling_config(model, args)
        # --seed: decoding with drafts and without draw from streams of their own, seeded alike, so each prompt
        # draws the same text both ways and --compare changes neither's; the warm-ups draw from a third
        streams = {drafted: seeded_generator(model, args.seed) for drafted in (True, False)}
        encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
        comparison = Comparison(bool(generation.do_sample), seeded=args.seed is not None) if args.compare else None
        if comparison is not None:  # first calls pay for allocations, kernels and connections: neither way times them
            warm_up = seeded_generator(model, 0)
            decode(encoded[0], True, WARM_UP_TOKENS, warm_up)
            decode(encoded[0], False, WARM_UP_TOKENS, warm_up)
        for number, ids in enumerate(encoded, start=1):
            log.info("generating %d/%d from %d prompt tokens", number, len(prompts), len(ids))
            if comparison is None:
                result, baseline = decode(ids, drafter is not None), None
            elif number % 2:
                result, baseline = decode(ids, True), decode(ids, False)
            else:
                baseline, result = decode(ids, False), decode(ids, True)
            remember_output(drafter, result.output_ids)
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            record = result_record(
                result,
                text,
                result.draft_seconds,
                verify_seconds=round(result.verify_seconds, 4),
                drafting=result.drafting.summary(),
            )
            timings = f"draft {result.draft_seconds:.3f} s, verify {result.verify_seconds:.2f} s"
            if comparison is not None:
                record["without_drafts"] = comparison.add(number, result, baseline)
                same = record["without_drafts"]["same_output"]
                timings += (
                    f"; without drafts {len(baseline.output_ids)} tokens in {baseline.seconds:.2f} s "
                    f"({baseline.tokens_per_second:.1f} tok/s), "
                    + ("outputs not compared (sampled without --seed)" if same is None else "the same output"
                       if same else "another output (a draw at a rounding edge)" if comparison.sampled
                       else "A DIFFERENT OUTPUT")
                )  # fmt: skip
            print_result(args, record, number, len(prompts), timings)
    finally:
        if drafter is not None:
            drafter.close()
    if comparison is not None:
        print(comparison.summary(args.datastore), file=sys.stderr, flush=True)
        if comparison.differing and not comparison.sampled:
            raise CliError(f"drafting changed the output of prompt(s) {', '.join(map(str, comparison.differing))}: "
                           "please report this, with the prompt and the model")  # fmt: skip


class Comparison:
    """``--compare``'s tally: tokens and seconds with drafts and without, and, where both ways draw
    alike, the prompts whose outputs differ. Greedy, decoding with drafts is token for token the
    model's own: a difference is an error. Sampled with one seed (``seeded``), each token is drawn at
    a number of its own position both ways: the same text, but where a draw falls within float
    rounding of the edge between two tokens (a step of several positions rounds the logits unlike a
    one-token step), so a difference is counted, not an error. Sampled without a seed, the two runs
    draw different texts: only the speeds are compared."""

    def __init__(self, sampled: bool = False, seeded: bool = False) -> None:
        self.sampled = sampled
        self.compare_outputs = not sampled or seeded
        self.tokens = self.seconds = self.baseline_tokens = self.baseline_seconds = 0.0
        self.prompts = 0
        self.differing: list[int] = []

    def add(self, number: int, result: GenerationResult, baseline: GenerationResult) -> dict:
        """Count prompt ``number``; returns the ``--json`` record of its run without drafts
        (``same_output`` null where not compared)."""
        same = result.output_ids == baseline.output_ids if self.compare_outputs else None
        if same is False:
            self.differing.append(number)
        self.prompts += 1
        self.tokens += len(result.output_ids)
        self.seconds += result.seconds
        self.baseline_tokens += len(baseline.output_ids)
        self.baseline_seconds += baseline.seconds
        return {
            "new_tokens": len(baseline.output_ids),
            "seconds": round(baseline.seconds, 4),
            "tokens_per_second": round(baseline.tokens_per_second, 2),
            "steps": baseline.steps,
            "same_output": same,
        }

    def summary(self, datastore: str) -> str:
        """One plain line: both speeds, the ratio, and whether the outputs matched (or that they
        were not compared)."""
        rate, baseline_rate = self.tokens / self.seconds, self.baseline_tokens / self.baseline_seconds
        speeds = (
            f"REST (drafts from {datastore}): {self.tokens:.0f} tokens in {self.seconds:.1f} s ({rate:.1f} tok/s); "
            f"the model alone: "
        )
        if self.compare_outputs:
            same = self.prompts - len(self.differing)
            parted = (
                " (sampled: the others parted where a draw fell within float rounding of the edge between two tokens)"
                if self.sampled and self.differing
                else ""
            )
            return (
                f"{speeds}{self.baseline_seconds:.1f} s ({baseline_rate:.1f} tok/s). "
                f"{rate / baseline_rate:.2f}x the speed, the same output on {same} of {self.prompts} prompt(s){parted}."
            )
        return (
            f"{speeds}{self.baseline_tokens:.0f} tokens in {self.baseline_seconds:.1f} s ({baseline_rate:.1f} tok/s). "
            f"{rate / baseline_rate:.2f}x the speed in tokens per second over {self.prompts} prompt(s); outputs not "
            "compared: decoding is sampled without --seed, so the two runs draw different texts."
        )


def run_llama(args: argparse.Namespace, prompts: list[Prompt]) -> None:
    """``run`` on llama.cpp: the GGUF file's own tokenizer (read by transformers) encodes the prompts
    and decodes the replies; llama-cpp-python decodes (greedily unless ``--temperature``), drafting
    with ``RestDraftModel``."""
    import os

    from rest_spec.common.tokenizer import load_tokenizer, packaged_smollm2
    from rest_spec.drafter.llamacpp.draft_model import llama_generate, require_llama_cpp, rest_llama

    if args.overlap or args.device:
        raise CliError("--overlap and --device are for the transformers engine")
    try:
        require_llama_cpp()
    except ImportError as exc:
        raise CliError(str(exc)) from exc
    import llama_cpp

    path = packaged_smollm2() if args.model is None else Path(args.model)
    if path.suffix != ".gguf" or not path.is_file():
        raise CliError(f"--engine llama.cpp needs --model FILE.gguf; {path} is not a GGUF file")
    # greedy at temperature 0; else the flags alone (llama-cpp-python's own defaults add top-k 40 and min-p 0.05)
    sampling = {"temp": args.temperature, "top_p": args.top_p or 1.0, "top_k": args.top_k or 0, "min_p": 0.0}
    drafter = None if args.no_draft else open_drafter(args.datastore, tls_ca=args.tls_ca, auth_token=args.auth_token)
    try:
        tokenizer = load_tokenizer(path)
        encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
        threads = args.threads or os.cpu_count() or 1
        options = {
            # room for the longest prompt, its reply and a draft past the reply's end
            "n_ctx": max(map(len, encoded)) + args.max_new_tokens + args.max_depth + 1,
            "n_threads": threads,
            "n_threads_batch": threads,
            "verbose": False,
        }
        if args.seed is not None:
            options["seed"] = args.seed
        if drafter is None:
            llm = llama_cpp.Llama(str(path), **options)
        else:
            llm = rest_llama(path, drafter, config=args.config, **options)
        for number, ids in enumerate(encoded, start=1):
            drafted = llm.draft_model.stats.seconds if drafter is not None else 0.0
            result = llama_generate(llm, ids, args.max_new_tokens, **sampling)
            draft_seconds = llm.draft_model.stats.seconds - drafted if drafter is not None else 0.0
            remember_output(drafter, result.output_ids)
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            record = result_record(result, text, draft_seconds, engine="llama.cpp")
            print_result(args, record, number, len(encoded), f"draft {draft_seconds:.3f} s (llama.cpp)")
    finally:
        if drafter is not None:
            drafter.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("rest-generate", parse_args(build_parser(), argv), run)
