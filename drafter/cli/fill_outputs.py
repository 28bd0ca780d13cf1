"""``rest-fill-outputs``: the model's own corpus -- its replies to a file of prompts, stored in a store
of outputs, resumably. A thin layer over ``drafter.outputs_corpus``: parse arguments, read and
encode the prompts, open the store and its journal, decode what the journal does not hold, print a
summary. Heavy imports (torch, transformers) happen after argument parsing, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from rest_spec.common.cli import EXIT_INTERRUPTED, exit_statuses, run_command, setup_logging
from rest_spec.common.errors import UsageError
from rest_spec.datastore.client import add_connection_arguments
from rest_spec.drafter.cli.generation import add_sampling_arguments, check_sampling
from rest_spec.drafter.cli.prompts import CHAT_HELP, PROMPTS_FILE_HELP, as_chat, encode_prompt, read_prompts
from rest_spec.drafter.outputs_corpus import (
    DEFAULT_BATCH_SIZE,
    ENGINES,
    JOURNAL_NAME,
    FillInterrupted,
    FillSettings,
    FillStats,
    Journal,
    Sampling,
    check_store_directory,
    eviction_warning,
    fill_outputs,
    model_identity,
    open_engine,
    open_store,
    pending_prompts,
    require_engine,
)

PROG = "rest-fill-outputs"
log = logging.getLogger("rest_spec.drafter.cli.fill_outputs")

EXIT_STATUSES = exit_statuses(
    (
        "prompts file unreadable or malformed",
        "--outputs-dir not an output store, or in use",
        "datastore unreachable, refusing outputs or of another tokenizer",
        "engine not installed",
        "model not found",
    ),
    usage=("an unknown flag", "a value out of range", "flags that do not go together"),
)
# What this command reports as one line: file and connection errors (OSError), bad values and tokenizer
# mismatches (ValueError), refusals by the store, the server (RuntimeError as the datastore client raises
# it: UNAUTHENTICATED, FAILED_PRECONDITION, ...) or the journal, and a missing engine. -v logs tracebacks.
FAILURES = (OSError, ValueError, RuntimeError)

_EPILOG = f"""\
what is stored:
  One document per prompt: the tokens the engine generated for it (the prompt excluded unless
  --with-prompt), up to and including the eos token that ended the reply, exactly as returned.
  A prompt given twice is generated (and stored) twice.

resuming:
  A journal records each prompt (a hash of its tokens and of every setting that decides its reply:
  engine, model, tokenizer, dtype, --max-new-tokens, sampling, --with-prompt) once the store has
  acknowledged its output. A rerun of the same command skips what the journal holds and decodes the
  rest; a run with other settings skips nothing. Ctrl-C abandons the batch being decoded and exits
  with status 130, saying how many outputs were stored. With --outputs-dir the journal is
  DIR/{JOURNAL_NAME} (the store reads only its own files); with --datastore it is --journal
  (default: the prompts file's path + ".done"): give each server its own.

the store's size:
  A store drops its oldest outputs beyond its --outputs-max-tokens. --outputs-dir is opened with no
  limit unless you give one (an existing store holding more is refused, a limit the run may exceed
  is warned about); a server keeps its own limit (rest-datastore serve --outputs-max-tokens, default
  1,000,000), and keeps them across its restarts only if started with --outputs-dir. build_index
  --corpus outputs:DIR reads every output of a store; to serve the filled store itself, give the
  server --outputs-max-tokens at least its size, or opening it evicts the oldest.
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fill a store of outputs with the model's own replies to a file of prompts (plain decoding,\n"
        "greedy by default): the corpus `build_index --corpus outputs:DIR` indexes. Resumable: a\n"
        "rerun skips the prompts already stored.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG + "\n" + EXIT_STATUSES,
    )
    parser.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        type=Path,
        required=True,
        help=PROMPTS_FILE_HELP,
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help=CHAT_HELP,
    )
    store = parser.add_mutually_exclusive_group(required=True)
    store.add_argument(
        "--outputs-dir", metavar="DIR", type=Path, help="the store of outputs to fill (created if missing)"
    )
    store.add_argument(
        "--datastore", metavar="HOST:PORT", help="a rest-datastore server whose store to fill (AddOutput)"
    )
    parser.add_argument(
        "--outputs-max-tokens",
        type=_positive_int,
        metavar="N",
        help="--outputs-dir's size in tokens, beyond which its oldest outputs are evicted (default: no limit)",
    )
    parser.add_argument(
        "--journal",
        metavar="FILE",
        type=Path,
        help=f'with --datastore: the record of prompts stored (default: FILE.jsonl + ".done"; with --outputs-dir it '
        f"is DIR/{JOURNAL_NAME})",
    )
    add_connection_arguments(parser, "--datastore")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="transformers",
        help="what decodes: transformers (batched), llama.cpp through llama-cpp-python (--model FILE.gguf; the llama "
        "extra), or vLLM (installed in .venv-vllm) (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        metavar="SPEC",
        help="Hugging Face id, model directory or .gguf file (default: the packaged SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", help="transformers: torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="transformers and vLLM: the weights' dtype (default: the checkpoint's; a GGUF file's is float32)",
    )
    parser.add_argument("--threads", type=_positive_int, metavar="N", help="llama.cpp threads (default: every core)")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM: run the model eagerly, as vLLM's flag of that name does: the engine starts in seconds instead of "
        "compiling the model first (about a minute on a small CPU, which pays off only on long runs where compiled "
        "steps are faster; on CPUs eager steps are often as fast) (default: vLLM's own, compiled)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        metavar="N",
        help="prompts decoded together (default: "
        + ", ".join(f"{engine} {size}" for engine, size in DEFAULT_BATCH_SIZE.items())
        + "); Ctrl-C abandons at most one batch",
    )
    parser.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N", help="default: %(default)s")
    add_sampling_arguments(parser, top_k=False)  # the engines sample without a top-k cut
    parser.add_argument(
        "--with-prompt", action="store_true", help="store each prompt's tokens before its reply (default: the reply)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (and error tracebacks) to stderr")
    return parser


def check_arguments(args: argparse.Namespace) -> Sampling:
    """``args``' sampling; ``UsageError`` for flags that do not go together."""
    if args.journal is not None and args.outputs_dir is not None:
        raise UsageError(f"--journal is for --datastore: the journal of --outputs-dir is DIR/{JOURNAL_NAME}")
    if args.outputs_max_tokens is not None and args.outputs_dir is None:
        raise UsageError("--outputs-max-tokens is for --outputs-dir (a server keeps its own limit)")
    if args.threads is not None and args.engine != "llama.cpp":
        raise UsageError("--threads is for --engine llama.cpp")
    if args.device is not None and args.engine != "transformers":
        raise UsageError("--device is for --engine transformers")
    if args.enforce_eager and args.engine != "vllm":
        raise UsageError("--enforce-eager is for --engine vllm")
    if args.engine == "llama.cpp" and args.model is not None and not args.model.endswith(".gguf"):
        raise UsageError(f"--engine llama.cpp needs --model FILE.gguf, not {args.model}")
    if args.dtype != "auto" and args.engine == "llama.cpp":
        raise UsageError("--dtype is for --engine transformers and vllm (a GGUF file has its own)")
    check_sampling(args)  # the values themselves argparse checked
    return Sampling(args.temperature, 1.0 if args.top_p is None else args.top_p, args.seed)


def run(args: argparse.Namespace) -> int | None:
    """Everything after argument parsing; raises on errors."""
    sampling = check_arguments(args)
    require_engine(args.engine)
    prompts = read_prompts(args.prompts)
    if args.chat:
        prompts = [as_chat(prompt) for prompt in prompts]

    from rest_spec.common.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size

    tokenizer = load_tokenizer(args.model)
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    settings = FillSettings(
        engine=args.engine,
        model=model_identity(args.model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        dtype=args.dtype,
        with_prompt=args.with_prompt,
    )
    closing = []
    try:
        client, journal = open_target(args, settings, closing)
        where = args.datastore if client is not None else str(args.outputs_dir)
        todo = [encoded[i] for i in pending_prompts(encoded, settings, journal)]
        stats, store = FillStats(prompts=len(encoded), skipped=len(encoded) - len(todo)), None
        try:
            if todo:  # the engine before the store: see open_engine
                engine = open_engine(
                    args.engine,
                    args.model,
                    max_new_tokens=args.max_new_tokens,
                    sampling=sampling,
                    longest_prompt=max(map(len, todo)),
                    device=args.device,
                    dtype=args.dtype,
                    threads=args.threads,
                    enforce_eager=args.enforce_eager,
                )
                closing.append(engine)
            if client is None:
                store = open_store(
                    args.outputs_dir, vocab_size=vocab_size(tokenizer), max_tokens=args.outputs_max_tokens
                )
                closing.append(store)
                planned = sum(args.max_new_tokens + (len(p) if args.with_prompt else 0) for p in todo)
                warning = eviction_warning(store, planned)
                if warning is not None:
                    log.warning("%s", warning)
            if todo:
                add = client.add_output if client is not None else store.add
                stats = fill(args, encoded, stats.skipped, engine, add, journal, settings)
        except KeyboardInterrupt as exc:  # while loading (nothing stored yet) or filling
            done = exc.stats if isinstance(exc, FillInterrupted) else stats
            print(
                f"{PROG}: interrupted: {done.stored} output(s) stored in {where} this run, {done.remaining} of "
                f"{done.prompts} prompt(s) left; run the same command again to resume",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
        print(summary(stats, where, store.num_tokens if store is not None else None))
    finally:
        for thing in reversed(closing):
            thing.close()
    return None


def open_target(args: argparse.Namespace, settings: FillSettings, closing: list):
    """(the ``DatastoreClient`` of --datastore or None, the journal) for ``args``, each appended
    to ``closing``. --outputs-dir is checked and created, its store opened later (``open_store``)."""
    if args.outputs_dir is not None:
        check_store_directory(args.outputs_dir)
        args.outputs_dir.mkdir(parents=True, exist_ok=True)
        closing.append(Journal(args.outputs_dir / JOURNAL_NAME))
        return None, closing[-1]
    from rest_spec.datastore.client import DatastoreClient

    client = DatastoreClient(
        args.datastore,
        expected_fingerprint=settings.tokenizer_fingerprint,
        tls_ca=args.tls_ca,
        auth_token=args.auth_token,
    )
    closing.append(client)
    closing.append(Journal(args.journal or Path(f"{args.prompts}.done")))
    return client, closing[-1]


def fill(args, encoded, skipped, engine, add, journal, settings) -> FillStats:
    """``fill_outputs`` under a progress bar over the prompts, the ``skipped`` ones counted in."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(
        total=len(encoded), initial=skipped, unit=" prompts", file=sys.stderr, disable=True if args.quiet else None
    )
    tokens = 0

    def stored(count: int) -> None:
        nonlocal tokens
        tokens += count
        bar.set_postfix(tokens=tokens, refresh=False)
        bar.update()

    with logging_redirect_tqdm(), bar:
        return fill_outputs(
            encoded,
            engine,
            add,
            journal,
            settings,
            batch_size=args.batch_size or DEFAULT_BATCH_SIZE[args.engine],
            on_output=stored,
        )


def summary(stats: FillStats, where: str, held_tokens: int | None) -> str:
    """The closing line: prompts done and skipped, tokens stored, seconds; and, for a store larger
    than a server's default size, the limit to serve or read it with."""
    from rest_spec.datastore.outputs import DEFAULT_OUTPUTS_MAX_TOKENS

    line = (
        f"{stats.stored} output(s) stored in {where} ({stats.tokens:,} tokens), {stats.skipped} of {stats.prompts} "
        f"prompt(s) skipped as already stored"
        + (f", {stats.empty} empty reply(ies) not stored" if stats.empty else "")
        + f", in {stats.seconds:.1f} s"
    )
    if held_tokens is not None and held_tokens > DEFAULT_OUTPUTS_MAX_TOKENS:
        line += (
            f". The store holds {held_tokens:,} tokens: serve it with --outputs-max-tokens {held_tokens:,} or more, "
            "or opening it evicts the oldest"
        )
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.WARNING, only="rest_spec")
    return run_command(PROG, lambda: run(args), failures=FAILURES, parser=parser)


if __name__ == "__main__":
    sys.exit(main())
