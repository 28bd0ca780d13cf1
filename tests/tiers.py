"""What the run includes, as conftest.py set it, for test modules to read at import: kept apart
from ``helpers`` so that a module needing no torch imports none."""

from __future__ import annotations

FULL_EXAMPLES = False  # set by conftest.py: with --full (or REST_TESTS=full)


def examples(full: int, default: int | None = None) -> int:
    """Hypothesis examples for a property: ``full`` with --full, else ``default`` (a fifth of
    ``full``, at least 10 where ``full`` has them): the default run samples each property, the full
    suite (CI) searches it."""
    return full if FULL_EXAMPLES else (default if default is not None else min(full, max(10, full // 5)))
