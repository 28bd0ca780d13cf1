"""The shell every command-line tool runs in, so that all of them keep one contract:

* exit status 0 when done; 2 for a usage error (argparse's own, or a ``UsageError``: the usage
  line, then ``<prog>: error: <message>``); 1 for a failure (one line, ``<prog>: error: <first
  line of the message>``, its traceback only in a debug log); 128 + N when stopped by signal N
  (130 for Ctrl-C);
* ``exit_statuses`` writes that contract into a command's ``--help`` epilog, naming its failures;
* ``run_command`` runs a command's body and maps its errors to that line and status;
* ``setup_logging`` sends log records to stderr in one of ``common.logs``'s formats.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rest_spec.common.errors import CliError, UsageError
from rest_spec.common.logs import TEXT_FORMAT, configure_logging

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
# A command stopped by signal N exits with 128 + N, as a shell reports a process the signal killed.
EXIT_SIGNAL_BASE = 128
EXIT_INTERRUPTED = EXIT_SIGNAL_BASE + signal.SIGINT  # Ctrl-C: 130

# What a usage error is, unless a command names its own.
USAGE_ERRORS = ("an unknown flag", "a value out of range")

log = logging.getLogger(__name__)


def first_line(exc: BaseException) -> str:
    """An exception's message cut to one line (its type name if empty), for one-line CLI errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def signal_status(signum: int) -> int:
    """The exit status of a command that stopped on signal ``signum``: 128 + ``signum``."""
    return EXIT_SIGNAL_BASE + signum


def exit_statuses(failures: Iterable[str], *, usage: Iterable[str] = USAGE_ERRORS, signals: bool = False) -> str:
    """A command's exit-status sentence for its ``--help`` epilog: 0, 2 with ``usage`` (what makes
    a usage error), 1 with ``failures`` (what makes a failure), and 130 for Ctrl-C, or, with
    ``signals`` (a command that stops cleanly on other signals too), 128 + N for signal N."""
    stopped = (
        f"{EXIT_SIGNAL_BASE}+N stopped by signal N ({EXIT_INTERRUPTED} Ctrl-C)"
        if signals
        else f"{EXIT_INTERRUPTED} Ctrl-C"
    )
    return (
        f"exit status: {EXIT_OK} done; {EXIT_USAGE} usage error ({', '.join(usage)}); "
        f"{EXIT_FAILURE} failure ({', '.join(failures)}); {stopped}."
    )


def run_command(
    prog: str,
    body: Callable[[], int | None],
    *,
    failures: tuple[type[BaseException], ...],
    explain: Mapping[type[BaseException], Callable[[Any], str]] | None = None,
    parser: argparse.ArgumentParser | None = None,
) -> int:
    """Run ``body`` (a command after its arguments are parsed) and return the command's exit status:

    * ``body``'s own return value (None: ``EXIT_OK``), for a command that ends otherwise without
      an error (build_index stopped by a signal);
    * ``EXIT_USAGE`` for a ``UsageError``: ``parser``'s usage line, then ``<parser's prog>: error:
      <message>`` (``prog`` without a parser);
    * ``EXIT_FAILURE`` for a ``CliError`` or an instance of ``failures`` or of a key of ``explain``:
      the one line ``<prog>: error: <text>``, the text being ``explain[type](exc)`` for the first
      key ``exc`` is an instance of, else ``first_line(exc)``; the traceback is logged at debug
      level only;
    * ``EXIT_INTERRUPTED`` for Ctrl-C (``KeyboardInterrupt``), nothing printed.

    Any other exception propagates, with its traceback: it is a bug, not a failure to report."""
    explain = explain or {}
    reported = (CliError, *failures, *explain)
    try:
        status = body()
    except UsageError as exc:
        if parser is not None:
            parser.print_usage(sys.stderr)
        print(f"{parser.prog if parser is not None else prog}: error: {first_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except reported as exc:
        log.debug("%s failed", prog, exc_info=True)
        text = next((describe(exc) for kind, describe in explain.items() if isinstance(exc, kind)), None)
        print(f"{prog}: error: {first_line(exc) if text is None else text}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK if status is None else status


def setup_logging(
    level: int | str, fmt: str = "text", *, text_format: str = TEXT_FORMAT, only: str | None = None
) -> None:
    """Log to stderr (``common.logs.configure_logging``): records at ``level`` and above, as
    ``fmt`` ("text": lines of ``text_format``; "json"). With ``only``, a logger name such as
    "rest_spec", ``level`` applies to that logger and its children; every other library's
    records still need WARNING."""
    if only is None:
        configure_logging(level, fmt, text_format=text_format)
        return
    configure_logging(logging.WARNING, fmt, text_format=text_format)
    logging.getLogger(only).setLevel(level)
