"""Cached step-cost tables: one JSON file per model, device and dtype (``drafter.core.cost.CostKey``),
under ``$REST_CACHE_DIR`` or ``~/.cache/rest-spec``, written atomically, read back only for the key
it was measured for. Every engine's table lives here: the transformers loop's (measured by
``drafter.hf.measure``), llama.cpp's and the one vLLM's proposer learns.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rest_spec.common.cache import cache_dir
from rest_spec.drafter.core.cost import CostKey, VerifyCost, shape_problems

if TYPE_CHECKING:
    from rest_spec.drafter.core.corrected_cost import CorrectedCost

log = logging.getLogger(__name__)


def check_timing(repeats: int, warmup: int, context_length: int) -> None:
    """``ValueError`` unless a timing has runs to keep (repeats >= 1), warmup >= 0 and a context."""
    if repeats < 1 or warmup < 0 or context_length < 1:
        raise ValueError(
            f"need repeats >= 1, warmup >= 0, context_length >= 1; got {repeats}, {warmup}, {context_length}"
        )


def note_unsettled(cost: VerifyCost, what: str) -> None:
    """One line at INFO (the decoding loop heals the table; a user need do nothing): ``what`` is
    wrong with ``cost``, the sizes that leaves unconfirmed (or implausible), and how to re-measure."""
    log.info(
        "%s; unconfirmed: n = %s (other work on this machine?); the decoding loop corrects it from the steps it "
        "times; re-measure on a quiet machine with rest-measure-cost",
        what,
        ", ".join(map(str, sorted(set(cost.unconfirmed) | set(shape_problems(cost))))),
    )


def check_cached(cost: VerifyCost, path: Path) -> None:
    """Say (at INFO) when the table cached at ``path`` is provisional or shaped like noise."""
    problems = shape_problems(cost)
    if cost.unconfirmed or problems:
        why = next(iter(problems.values()), "its times did not settle when measured")
        note_unsettled(cost, f"{path} holds a provisional verification cost ({why})")


def _cost_path(key: CostKey, directory: Path | None) -> Path:
    return (directory or cache_dir()) / "verify-cost" / key.file_name()


def _read_cached(path: Path, key: CostKey, otherwise: str) -> VerifyCost | None:
    """The table at ``path`` if it holds a measurement for ``key``; else None, with a warning that
    ends in ``otherwise`` when the file exists but is unreadable or for another key."""
    if not path.exists():
        return None
    try:
        cost = VerifyCost.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s); %s", path, exc, otherwise)
        return None
    if cost.key != key:
        log.warning("%s holds a measurement for another model or device; %s", path, otherwise)
        return None
    check_cached(cost, path)
    return cost


def cached_cost(
    key: CostKey, measure: Callable[[], VerifyCost], *, directory: Path | None = None, remeasure: bool = False
) -> VerifyCost:
    """The cost cached for ``key`` under ``directory`` (default ``cache_dir()``), or ``measure()``'s,
    cached atomically, when there is none, it is unreadable or for another key, or ``remeasure``."""
    cached = None if remeasure else read_cost(key, directory=directory)
    if cached is not None:
        return cached
    cost = measure()
    write_cost(cost, directory=directory)
    return cost


def read_cost(key: CostKey, *, directory: Path | None = None, otherwise: str = "measuring again") -> VerifyCost | None:
    """The cost cached for ``key`` under ``directory`` (default ``cache_dir()``), or None."""
    return _read_cached(_cost_path(key, directory), key, otherwise)


def write_cost(cost: VerifyCost, *, directory: Path | None = None) -> Path:
    """Cache ``cost`` for its key, atomically: readers never see half a file, and processes that
    write the same key at once (replicas closing together) each rename a whole file of their own
    into place, the last one winning; returns the path."""
    path = _cost_path(cost.key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with temporary.open("x") as file:  # created with the umask's permissions, as a plain write would be
            file.write(cost.to_json())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    log.info("wrote %s", path)
    return path


def keep_healed(cost: CorrectedCost, *, directory: Path | None = None) -> Path | None:
    """Cache what a loop's steps taught ``cost`` (``CorrectedCost.healed``) in place of the table it
    started from, so the next process starts healed: a table measured beside other work stays
    dear only until one run has timed its steps. Nothing is written when the steps taught nothing,
    or when the cache no longer holds that table (re-measured meanwhile: the newer one stays); a
    failed write is a warning. Returns the path written, or None."""
    healed = cost.healed()
    if healed is None or read_cost(cost.table.key, directory=directory, otherwise="not healing it") != cost.table:
        return None
    try:
        path = write_cost(healed, directory=directory)
    except OSError as exc:
        log.warning("the verification cost corrected by this run's steps was not cached: %s", exc)
        return None
    log.info(
        "cached the verification cost as this run's steps priced it: n = %s",
        ", ".join(str(n) for n, a, b in zip(healed.sizes, healed.seconds, cost.table.seconds) if a != b),
    )
    return path
