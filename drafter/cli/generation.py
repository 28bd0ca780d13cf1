"""What every generation command shares (``rest-generate``, ``rest-chat``): the model arguments and
their parsing into a ``DraftConfig``, the sampling arguments (``--temperature``, ``--top-p``,
``--top-k``, ``--seed``; ``rest-fill-outputs`` takes them too) and the ``GenerationConfig`` they make,
the exit statuses, the command shell, and opening the parts (``drafter.hf.session.load_parts``) from
the parsed arguments."""

from __future__ import annotations

import argparse
import copy
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rest_spec.common.cli import exit_statuses, run_command, setup_logging
from rest_spec.common.errors import UsageError
from rest_spec.common.types import DEFAULT_CONFIG, DraftConfig
from rest_spec.datastore.client import add_connection_arguments

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedModel

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


# --- sampling ------------------------------------------------------------------------------------

SAMPLING_ONLY = ("top_p", "top_k", "seed")  # the flags that mean nothing to greedy decoding
SEED_LIMIT = 2**32  # llama.cpp's seed is 32 bits (and -1 there means "random"); torch and vLLM take these


def _number(kind: type, text: str) -> float | int:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def temperature_value(text: str) -> float:
    value = _number(float, text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text}")
    return value


def top_p_value(text: str) -> float:
    value = _number(float, text)
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1: the whole distribution), got {text}")
    return value


def top_k_value(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no top-k cut), got {value}")
    return value


def seed_value(text: str) -> int:
    value = _number(int, text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, {SEED_LIMIT - 1}], got {value}")
    return value


# Each token is drawn at a uniform number of its own position (drafter.hf.sampling.TokenChooser), so a seed's
# text does not depend on the drafts, or on how measured times size the steps.
DRAFTED_SEED_NOTE = (
    ", with drafts or without (each token is drawn at a number of its own position; a draw within float rounding "
    "of the edge between two tokens may fall otherwise)"
)
DRAFTED_TEMPERATURE_NOTE = (
    ". Drafting keeps the model's distribution exactly: it changes the speed, not what is drawn from"
)


def add_sampling_arguments(
    parser: argparse.ArgumentParser, *, top_k: bool = True, from_model: bool = False, drafted: bool = False
) -> None:
    """``--temperature``, ``--top-p``, ``--top-k`` (unless not ``top_k``: an engine without one) and
    ``--seed``, each refusing a value out of range (status 2, naming the flag). Greedy by default;
    ``from_model``: each flag not given is the model's generation config's (``sampling_config``).
    ``drafted``: a command that drafts, whose help says what drafting does to sampling.
    ``check_sampling`` refuses sampling flags given to greedy decoding."""
    group = parser.add_argument_group(
        "sampling",
        "greedy unless --temperature is above 0"
        if not from_model
        else "each flag not given is the model's generation config's, as model.generate reads it (the packaged "
        "SmolLM2's decodes greedily; given a --temperature above 0 it samples at top-k 50)",
    )
    parser.set_defaults(sampling_from_model=from_model)
    default = "the model's" if from_model else None
    group.add_argument(
        "--temperature",
        type=temperature_value,
        default=None if from_model else 0.0,
        metavar="T",
        help="sample at this temperature; 0 decodes greedily (default: "
        + (default or "%(default)s, greedy")
        + ")"
        + (DRAFTED_TEMPERATURE_NOTE if drafted else ""),
    )
    group.add_argument(
        "--top-p",
        type=top_p_value,
        metavar="P",
        help=f"sampling: keep the smallest set of tokens whose probability adds up to P (default: {default or 1})",
    )
    if top_k:
        group.add_argument(
            "--top-k",
            type=top_k_value,
            metavar="K",
            help=f"sampling: keep the K likeliest tokens; 0: no cut (default: {default or 0})",
        )
    group.add_argument(
        "--seed",
        type=seed_value,
        metavar="S",
        help="sampling: seed the random draws, so that the same command with the same seed draws the same text"
        + (DRAFTED_SEED_NOTE if drafted else "")
        + " (default: unseeded)",
    )


def given_sampling_flags(args: argparse.Namespace) -> list[str]:
    """The sampling-only flags (``SAMPLING_ONLY``) given on the command line."""
    return ["--" + name.replace("_", "-") for name in SAMPLING_ONLY if getattr(args, name, None) is not None]


def sampling_only_error(flags: Sequence[str], why: str = "") -> UsageError:
    """The usage error for sampling-only ``flags`` given to greedy decoding."""
    names = " and ".join(flags) if len(flags) < 3 else ", ".join(flags[:-1]) + " and " + flags[-1]
    verb = "applies" if len(flags) == 1 else "apply"
    return UsageError(f"{names} {verb} to sampling: set --temperature above 0{why}")


def check_sampling(args: argparse.Namespace) -> None:
    """``UsageError`` for sampling-only flags given with ``--temperature`` 0 (given or the default);
    a ``--temperature`` left to the model is checked by ``sampling_config``, once it is loaded."""
    flags = given_sampling_flags(args)
    if args.temperature == 0 and flags:
        raise sampling_only_error(flags)


def sampling_config(model: PreTrainedModel, args: argparse.Namespace) -> GenerationConfig:
    """A copy of ``model``'s generation config decoding as ``add_sampling_arguments``' flags say:
    greedy at ``--temperature`` 0, else sampling at it, with ``--top-p`` and ``--top-k``; a flag not
    given is 1 (``--top-p``) or 0 (``--top-k``: no cut), or, where the flags default to the model's,
    the model's own value (its ``do_sample`` for ``--temperature``). The rest of the model's config
    (eos ids, repetition penalty, ...) is kept. ``UsageError`` for sampling-only flags when the
    result decodes greedily."""
    config = copy.deepcopy(model.generation_config)
    from_model = getattr(args, "sampling_from_model", False)
    sample = bool(config.do_sample) if args.temperature is None else args.temperature > 0
    if not sample:
        flags = given_sampling_flags(args)
        if flags:
            raise sampling_only_error(flags, " (the model's generation config decodes greedily)")
        config.do_sample = False
        return config
    config.do_sample = True
    if args.temperature is not None:
        config.temperature = args.temperature
    for name, unset in (("top_p", 1.0), ("top_k", 0)):
        value = getattr(args, name, None)
        if value is not None:
            setattr(config, name, value)
        elif not from_model:
            setattr(config, name, unset)
    return config


def seeded_generator(model: PreTrainedModel, seed: int | None) -> torch.Generator | None:
    """A generator on ``model``'s device seeded with ``seed``; None (torch's global, unseeded
    generator) without one."""
    if seed is None:
        return None
    import torch

    return torch.Generator(device=model.device).manual_seed(seed)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s arguments (it has ``add_model_arguments`` and ``add_sampling_arguments``) with
    ``config``, their ``DraftConfig``, built once for the drafter and every generation. A value the
    config refuses, or sampling flags given to greedy decoding (``check_sampling``), is a usage
    error, like one argparse refuses (status 2, with the usage line)."""
    args = parser.parse_args(argv)
    try:
        args.config = DraftConfig(budget=args.budget, max_depth=args.max_depth)
        check_sampling(args)
    except (ValueError, UsageError) as exc:
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
