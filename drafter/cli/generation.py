"""What every generation command shares (``rest-generate``, ``rest-chat``): the model arguments and
their parsing into a ``DraftConfig``, the exit statuses, the command shell, and opening the parts
(``drafter.hf.session.load_parts``) from the parsed arguments."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

from rest_spec.common.cli import exit_statuses, run_command, setup_logging
from rest_spec.common.types import DEFAULT_CONFIG, DraftConfig
from rest_spec.datastore.client import add_connection_arguments

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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every generation CLI takes: where drafts come from, the model, the draft tree,
    the length of a reply, verbosity."""
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
    parser.add_argument(
        "--outputs-from",
        metavar="HOST:PORT",
        help="with an index directory as --datastore: copy the store of outputs of this rest-datastore server "
        "(a fleet's), draft from the copy in process, and send each finished output there",
    )
    add_connection_arguments(parser, "--datastore HOST:PORT and --outputs-from")
    parser.add_argument(
        "--model",
        metavar="SPEC",
        help="Hugging Face id, model directory or .gguf file (default: the packaged SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="default: %(default)s")
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_CONFIG.budget,
        metavar="C",
        help="draft tree size in nodes (default: %(default)s)",
    )
    parser.add_argument(
        "--max-depth",
        type=positive_int,
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


def load_parts(args: argparse.Namespace):
    """(tokenizer, model, drafter or None) for the arguments of ``add_model_arguments``
    (``drafter.hf.session.load_parts``); the caller closes the drafter."""
    from rest_spec.drafter.hf.session import load_parts as load

    return load(
        args.model,
        datastore=None if args.no_draft else args.datastore,
        device=args.device,
        adaptive=args.adaptive,
        config=args.config,
        tls_ca=args.tls_ca,
        auth_token=args.auth_token,
        outputs_from=args.outputs_from,
    )


def run_cli(prog: str, args: argparse.Namespace, body: Callable[[argparse.Namespace], None]) -> int:
    """Run ``body(args)`` in the command shell (``common.cli.run_command``: ``CliError`` and
    ``FAILURES`` become one line and exit status 1), this project's loggers -- not every library's
    -- at DEBUG with ``--verbose`` (failures' tracebacks included), else at WARNING."""
    setup_logging(logging.DEBUG if args.verbose else logging.WARNING, only="rest_spec")
    return run_command(prog, lambda: body(args), failures=FAILURES)
