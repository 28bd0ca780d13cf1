"""The errors that cross the project's boundaries, each meaning one thing wherever it is raised:
the in-process index and the gRPC client raise the same type for the same problem, and the
command-line shell (``common.cli``) maps them to exit statuses."""

from __future__ import annotations


class UsageError(Exception):
    """A command line the command cannot run (a flag value out of range): reported like
    argparse's own errors, with the usage line and exit status 2."""


class CliError(Exception):
    """A user-facing problem a command reports as one line, exit status 1."""


class TokenizerMismatchError(ValueError):
    """The datastore was built with a different tokenizer than the model uses."""


class NoOutputStoreError(RuntimeError):
    """An output was given to a datastore that keeps none: an index opened with
    ``outputs_max_tokens=0``, or a server started with ``--outputs-max-tokens 0``
    (``FAILED_PRECONDITION`` on the wire)."""
