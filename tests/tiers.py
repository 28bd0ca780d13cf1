"""What the run includes, as conftest.py set it, for test modules to read at import: kept apart
from ``helpers`` so that a module needing no torch imports none."""

from __future__ import annotations

FULL_EXAMPLES = False  # set by conftest.py: with --full or --beyond-default (or REST_TESTS=full, beyond-default)


def default_examples(full: int, default: int | None = None) -> int:
    """The default run's count of a property's examples: ``default``, else a fifth of ``full`` (at
    least 10 where ``full`` has them)."""
    return default if default is not None else min(full, max(10, full // 5))


class Examples(int):
    """A property's full count of examples that knows the default run's share of it (``default``):
    ``--beyond-default`` runs the rest (tests/conftest.py)."""

    default: int


def examples(full: int, default: int | None = None) -> int:
    """Hypothesis examples for a property: ``full`` with --full, else ``default_examples``: the
    default run samples each property, the full suite (CI) searches it. With --beyond-default (CI,
    after the default run) conftest.py runs ``full`` less the default run's share."""
    if not FULL_EXAMPLES:
        return default_examples(full, default)
    count = Examples(full)
    count.default = default_examples(full, default)
    return count
