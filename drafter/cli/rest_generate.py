"""``rest-generate`` and the building blocks every generation CLI shares (``rest-chat`` too):
argument groups, prompt reading and encoding, opening the drafter and the model, error exits.

``main`` is a thin layer over ``drafter.hf.generate.generate``: parse arguments, read prompts, open
the datastore, load tokenizer and model, print results; exit statuses as every command's
(``EXIT_STATUSES``). Heavy imports (torch, transformers) happen after argument parsing so
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rest_spec.common.cli import exit_statuses, run_command, setup_logging
from rest_spec.common.errors import CliError, NoOutputStoreError
from rest_spec.common.types import DEFAULT_CONFIG, DraftConfig, DraftTree
from rest_spec.datastore.client import add_connection_arguments
from rest_spec.drafter.cli.prompts import CHAT_HELP, PROMPTS_FILE_HELP, Prompt, as_chat, encode_prompt, read_prompts
from rest_spec.drafter.core.sources import open_datastore

if TYPE_CHECKING:
    from rest_spec.drafter.core.protocol import Drafter
    from rest_spec.drafter.hf.generate import GenerationResult
    from rest_spec.drafter.llamacpp.draft_model import LlamaGeneration

log = logging.getLogger("rest_spec.drafter.cli.rest_generate")

# HOST:PORT, with HOST a name, an IPv4 address or a bracketed IPv6 address.


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


EXIT_STATUSES = exit_statuses(
    (
        "prompts file unreadable or malformed",
        "datastore missing or unreachable",
        "tokenizer mismatch",
        "model not found",
    )
)
# What a generation command reports as one line besides CliError (TokenizerMismatchError is a ValueError).
FAILURES = (OSError, ValueError)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every generation CLI takes: where drafts come from, the model, the draft tree,
    the length of a reply, verbosity (shared by ``rest-generate`` and ``rest-chat``)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--datastore",
        metavar="DIR|HOST:PORT",
        help="an index directory (opened in-process; several, comma-separated, answer as one index) or the "
        "address of a rest-datastore server",
    )
    source.add_argument(
        "--no-draft",
        action="store_true",
        help="plain decoding through the same loop (baseline), at the fastest layout of this machine's cached "
        "verify-cost table when one exists (rest-measure-cost; --adaptive measures it on first use)",
    )
    add_connection_arguments(parser, "--datastore HOST:PORT")
    parser.add_argument(
        "--model",
        metavar="SPEC",
        help="Hugging Face id, model directory or .gguf file (default: the packaged SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N", help="default: %(default)s")
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_CONFIG.budget,
        metavar="C",
        help="draft tree size in nodes (default: %(default)s)",
    )
    parser.add_argument(
        "--max-depth",
        type=_positive_int,
        default=DEFAULT_CONFIG.max_depth,
        metavar="M",
        help="draft tree depth in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="draft from the index, the request's own text and recent outputs, merged by calibrated "
        "acceptance scores, and verify the tree size that pays on this hardware (the verify cost is "
        "measured once per model, device and dtype and cached; --budget caps the candidates)",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="fetch each step's drafts during the previous forward pass, hiding a remote datastore's "
        "round trip (on a small CPU it costs more than it saves; output is the same either way)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (and error tracebacks) to stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rest-generate",
        description="Greedy generation with retrieval-based speculative decoding (REST). Output is "
        "token-identical to plain greedy decoding; the datastore only changes the speed.",
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
        type=_positive_int,
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
        "end with one line: both speeds and whether every output is the same; both are warmed up before "
        "anything is timed and take turns going first, so the machine's noise falls on both alike",
    )
    return parser


def open_drafter(spec: str, *, tls_ca: str | None = None, auth_token: str | None = None) -> Drafter:
    """The datastore ``--datastore`` names (``drafter.core.sources.open_datastore``): an index
    directory or HOST:PORT, asked for its ``info()`` now, so an unreachable server or a broken
    index fails here with a ``CliError``."""
    try:
        return open_datastore(spec, where="--datastore", tls_ca=tls_ca, auth_token=auth_token)
    except ValueError as exc:
        log.debug("opening %s failed", spec, exc_info=True)
        raise CliError(str(exc)) from exc


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


def load_parts(args: argparse.Namespace):
    """(tokenizer, model, drafter or None) for the ``parse_args`` of ``add_model_arguments``
    (``--adaptive`` drafts with ``args.config``); the drafter is opened first (a bad datastore
    fails before the slow model load) and checked against the tokenizer. The caller closes the
    drafter."""
    from rest_spec.common.tokenizer import check_tokenizer, load_tokenizer, tokenizer_fingerprint
    from rest_spec.drafter.hf.model import load_model

    drafter = None if args.no_draft else open_drafter(args.datastore, tls_ca=args.tls_ca, auth_token=args.auth_token)
    try:
        started = time.perf_counter()
        tokenizer = load_tokenizer(args.model)
        if drafter is not None:
            check_tokenizer(drafter, tokenizer_fingerprint(tokenizer))
        model = load_model(args.model, device=args.device)
    except BaseException:
        if drafter is not None:
            drafter.close()
        raise
    log.info("loaded %s on %s in %.1f s", type(model).__name__, model.device, time.perf_counter() - started)
    if args.adaptive and drafter is not None:
        from rest_spec.drafter.core.adaptive import AdaptiveDrafter
        from rest_spec.drafter.hf.measure import load_or_measure

        drafter = AdaptiveDrafter(drafter, cost=load_or_measure(model), config=args.config)
    return tokenizer, model, drafter


def remember_output(drafter, output_ids: list[int]) -> None:
    """Add a finished generation to the drafter's store of recent outputs (``load_parts`` opens
    drafters that take them; None: --no-draft)."""
    if drafter is None or not output_ids:
        return
    try:
        drafter.add_output(output_ids)
    except NoOutputStoreError as exc:  # a store started with --outputs-max-tokens 0 keeps none, by design
        log.debug("output not stored: %s", exc)
    except (RuntimeError, ConnectionError) as exc:
        # any other refusal (a token, a full disk, a dead server) is worth a line, not the generation
        log.warning("output not stored: %s", exc)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s arguments (it has ``add_model_arguments``) with ``config``, their
    ``DraftConfig``, built once for the drafter and every generation. A value the config refuses
    is a usage error, like one argparse refuses (status 2, with the usage line)."""
    args = parser.parse_args(argv)
    try:
        args.config = DraftConfig(budget=args.budget, max_depth=args.max_depth)
    except ValueError as exc:
        parser.error(str(exc))
    return args


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

    def decode(ids: list[int], drafted: bool, max_new_tokens: int = args.max_new_tokens) -> GenerationResult:
        # with drafts, the drafter's own cost (--adaptive's measured table) sizes each step
        return generate(model, ids, drafter if drafted else None, max_new_tokens=max_new_tokens, config=args.config,
                        overlap=args.overlap, cost=None if drafted else plain_cost)  # fmt: skip

    try:
        encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
        comparison = Comparison() if args.compare else None
        if comparison is not None:  # first calls pay for allocations, kernels and connections: neither way times them
            decode(encoded[0], True, WARM_UP_TOKENS)
            decode(encoded[0], False, WARM_UP_TOKENS)
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
                timings += (
                    f"; without drafts {baseline.seconds:.2f} s ({baseline.tokens_per_second:.1f} tok/s), "
                    f"{'the same output' if record['without_drafts']['same_output'] else 'A DIFFERENT OUTPUT'}"
                )
            print_result(args, record, number, len(prompts), timings)
    finally:
        if drafter is not None:
            drafter.close()
    if comparison is not None:
        print(comparison.summary(args.datastore), file=sys.stderr, flush=True)
        if comparison.differing:
            raise CliError(f"drafting changed the output of prompt(s) {', '.join(map(str, comparison.differing))}: "
                           "please report this, with the prompt and the model")  # fmt: skip


def no_draft_cost(model):
    """The cached verify-cost table's fastest one-token block for decoding without drafts (the same
    output, faster), corrected by the steps' times as --adaptive's is; None where no table is cached
    (only --adaptive measures one: its drafter holds it)."""
    from rest_spec.drafter.core.cost import CorrectedCost
    from rest_spec.drafter.hf.measure import load_cached

    table = load_cached(model)
    if table is None:
        return None
    cost = CorrectedCost(table)
    shape = cost.current.block_shape([DraftTree.empty()])  # the table's choice, not a step checking it
    log.info("no drafts: steps of %d position(s), linear layers %s (the cached verify-cost table)",
             shape.size, "transposed" if shape.transposed else "as PyTorch lays them out")  # fmt: skip
    return cost


class Comparison:
    """``--compare``'s tally: tokens and seconds with drafts and without, and the prompts whose
    outputs differ (greedy decoding with drafts is token for token the model's own)."""

    def __init__(self) -> None:
        self.tokens = self.seconds = self.baseline_seconds = 0.0
        self.prompts = 0
        self.differing: list[int] = []

    def add(self, number: int, result: GenerationResult, baseline: GenerationResult) -> dict:
        """Count prompt ``number``; returns the ``--json`` record of its run without drafts."""
        same = result.output_ids == baseline.output_ids
        if not same:
            self.differing.append(number)
        self.prompts += 1
        self.tokens += len(result.output_ids)
        self.seconds += result.seconds
        self.baseline_seconds += baseline.seconds
        return {
            "seconds": round(baseline.seconds, 4),
            "tokens_per_second": round(baseline.tokens_per_second, 2),
            "steps": baseline.steps,
            "same_output": same,
        }

    def summary(self, datastore: str) -> str:
        """One plain line: both speeds, the ratio, and whether the outputs matched."""
        rate, baseline_rate = self.tokens / self.seconds, self.tokens / self.baseline_seconds
        same = self.prompts - len(self.differing)
        return (
            f"REST (drafts from {datastore}): {self.tokens:.0f} tokens in {self.seconds:.1f} s ({rate:.1f} tok/s); "
            f"the model alone: {self.baseline_seconds:.1f} s ({baseline_rate:.1f} tok/s). "
            f"{rate / baseline_rate:.2f}x the speed, the same output on {same} of {self.prompts} prompt(s)."
        )


def run_llama(args: argparse.Namespace, prompts: list[Prompt]) -> None:
    """``run`` on llama.cpp: the GGUF file's own tokenizer (read by transformers) encodes the prompts
    and decodes the replies; llama-cpp-python decodes greedily, drafting with ``RestDraftModel``."""
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
        if drafter is None:
            llm = llama_cpp.Llama(str(path), **options)
        else:
            llm = rest_llama(path, drafter, config=args.config, **options)
        for number, ids in enumerate(encoded, start=1):
            drafted = llm.draft_model.stats.seconds if drafter is not None else 0.0
            result = llama_generate(llm, ids, args.max_new_tokens)
            draft_seconds = llm.draft_model.stats.seconds - drafted if drafter is not None else 0.0
            remember_output(drafter, result.output_ids)
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            record = result_record(result, text, draft_seconds, engine="llama.cpp")
            print_result(args, record, number, len(encoded), f"draft {draft_seconds:.3f} s (llama.cpp)")
    finally:
        if drafter is not None:
            drafter.close()


def run_cli(prog: str, args: argparse.Namespace, body: Callable[[argparse.Namespace], None]) -> int:
    """Run ``body(args)`` in the command shell (``common.cli.run_command``: ``CliError`` and
    ``FAILURES`` become one line and exit status 1), this project's loggers -- not every library's
    -- at DEBUG with ``--verbose`` (failures' tracebacks included), else at WARNING."""
    setup_logging(logging.DEBUG if args.verbose else logging.WARNING, only="rest_spec")
    return run_command(prog, lambda: body(args), failures=FAILURES)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("rest-generate", parse_args(build_parser(), argv), run)
