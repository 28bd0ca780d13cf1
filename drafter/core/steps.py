"""Running the drafting protocol (``drafter.core.protocol``): the step sequence, once
(``draft_step``) or from rows whose source trees are at hand (``finish_step``, which the scheduler
runs after its speculation); what a draft source declares to a scheduler, with defaults
(``DraftSource``); and what lets any ``Drafter`` be driven the same way (``as_source``,
``PlainSteps``, ``steps_for``). ``Mark`` is where a request's context stood at a step.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np

from rest_spec.common.types import MAX_SUFFIX, DraftConfig, DraftTree, IndexInfo, SourceTrees
from rest_spec.drafter.core.protocol import BatchRule, Drafter, Pending, StepDrafter

if TYPE_CHECKING:
    from rest_spec.drafter.core.breaker import CircuitBreaker

__all__ = [
    "SUFFIX_CUTS",
    "Deferred",
    "DraftSource",
    "Mark",
    "PlainSource",
    "PlainSteps",
    "as_source",
    "draft_step",
    "drafter_trees",
    "finish_step",
    "steps_for",
    "token_list",
]


# Context cuts, in tokens: a context cut to its last n tokens matches at most n, so the index's
# trees for these cuts are its shorter matches -- extra sources for ``AdaptiveDrafter(suffixes=)``
# (a longest match often has few continuations, or none), and what the scheduler's speculation asks
# for besides the longest match (a bonus token that does not continue the longest match may
# continue a shorter one).
SUFFIX_CUTS = (4, 2, 1)

V = TypeVar("V")


class Deferred(Generic[V]):
    """A ``Pending`` for work that runs where it is collected (an in-process index: nothing to
    wait for, so the work runs in whichever thread asks for the result, once). Work under way
    cannot be stopped: ``cancel`` then says so (False), and the result stands."""

    def __init__(self, work: Callable[[], V]) -> None:
        self._work: Callable[[], V] | None = work
        self._value: V | None = None
        self._cancelled = False
        self._lock = threading.Lock()  # held while the work runs: a second caller waits for it

    def result(self, timeout: float | None = None) -> V:
        with self._lock:
            if self._cancelled:
                raise CancelledError("the draft was cancelled")
            if self._work is not None:
                work, self._work = self._work, None
                self._value = work()
            return self._value  # type: ignore[return-value]

    def cancel(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False  # the work is running
        try:
            if self._work is None:
                return False
            self._cancelled, self._work = True, None
            return True
        finally:
            self._lock.release()


def drafter_trees(drafter: Drafter, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
    """One tree per context from ``drafter``: its single-context call for one context, one batch
    call (one RPC) for more."""
    if len(contexts) == 1:
        return [drafter.draft(contexts[0], config)]
    return list(drafter.draft_batch(contexts, config))


class DraftSource:
    """What a scheduler may rely on in a draft source, with the defaults of a source that
    declares nothing: it reads whole contexts, answers when collected, keeps no breaker.
    Subclasses implement ``Drafter`` (and ``SourceDrafter`` for ``outputs``)."""

    # drafts from a context's last ``n_max`` tokens alone: a context cut to them gets its tree
    reads_suffixes: ClassVar[bool] = False
    # the datastore's circuit breaker where it outlives a generation (None: one per generation)
    breaker: CircuitBreaker | None = None

    def start_sources(
        self,
        contexts: Sequence[Sequence[int]],
        config: DraftConfig,
        *,
        outputs: bool = False,
        timeout: float | None = None,
    ) -> Pending[list[SourceTrees]]:
        """The index trees of ``contexts`` (with the output store's where ``outputs``, else empty
        ones), asked for now and collected later, in one call; the source gives up at ``timeout``
        seconds where it can. Default: the work done when collected."""
        if outputs:
            if len(contexts) == 1:
                return Deferred(lambda: [self.draft_sources(contexts[0], config)])
            return Deferred(lambda: self.draft_sources_batch(contexts, config))
        empty = DraftTree.empty()
        return Deferred(lambda: [SourceTrees(tree, empty) for tree in drafter_trees(self, contexts, config)])

    def outputs_in_process(
        self, from_seq: int, max_tokens: int
    ) -> tuple[list[tuple[int, np.ndarray]], int, int] | None:
        """The outputs stored from number ``from_seq`` on, as ``OutputStore.read`` reads them, where
        this source holds them in this process (read without a call); None where it does not.
        Default: none."""
        return None

    def warm_up(self) -> float:
        """Load the compiled kernels this source's drafts run in this process (numba loads each
        from its on-disk cache at its first call), so that its first draft costs what any other
        does; the seconds it took. Default: none to load."""
        return 0.0


class PlainSource(DraftSource):
    """A ``Drafter`` that declares no capabilities, given the defaults."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        return self.drafter.draft(context, config)

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
        return self.drafter.draft_batch(contexts, config)

    def info(self) -> IndexInfo:
        return self.drafter.info()

    def close(self) -> None:
        self.drafter.close()


def as_source(drafter: Drafter) -> DraftSource:
    """``drafter`` itself where it declares its capabilities, else wrapped with the defaults."""
    return drafter if isinstance(drafter, DraftSource) else PlainSource(drafter)


def finish_step(
    steps: StepDrafter,
    sessions: Sequence[Any],
    shared: Sequence[SourceTrees],
    config: DraftConfig,
    admit: BatchRule | None = None,
) -> list[DraftTree]:
    """The end of a step once each row has its shared trees: merged with the request's own,
    selected (what pays for one row), admitted (what pays for the batch: the engine's rule,
    ``selection.select_batch_chains``, ``selection.select_batch_trees``), recorded."""
    trees, merged = steps.draft_rows(sessions, shared, config)
    if admit is not None:
        trees = admit(trees)
    steps.record(trees, merged)
    return trees


def draft_step(
    steps: StepDrafter,
    rows: Sequence[Sequence[int]],
    config: DraftConfig,
    requests: Sequence[Hashable] | None = None,
    admit: BatchRule | None = None,
) -> list[DraftTree]:
    """One step's trees for ``rows`` (their requests named by ``requests``; default: their
    positions), drafted now: the whole sequence, nothing ahead; cut by ``admit``, the engine's
    batch rule, where given (``finish_step``)."""
    sessions = steps.advance(rows, range(len(rows)) if requests is None else requests)
    candidates = steps.candidates(config)
    return finish_step(steps, sessions, steps.start_shared(rows, candidates).result(), candidates, admit)


def token_list(context: Sequence[int] | np.ndarray, start: int = 0, stop: int | None = None) -> list[int]:
    """``context[start:stop]`` as a list of ints (a copy of that part alone; numpy or list)."""
    part = context[start:stop]
    return part.tolist() if isinstance(part, np.ndarray) else list(part)


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where a request's context stood at a step: its ``length`` and its last tokens (``tail``, at
    most ``MAX_SUFFIX``: all a source that ``reads_suffixes`` ever reads). Enough to draft from,
    and to tell what a later context of the same request gained since, reading only that."""

    length: int
    tail: list[int]

    @classmethod
    def of(cls, context: Sequence[int] | np.ndarray) -> Mark:
        return cls(len(context), token_list(context, max(len(context) - MAX_SUFFIX, 0)))

    def continued_by(self, context: Sequence[int] | np.ndarray) -> bool:
        """Whether ``context`` is this one continued, as far as the tail tells: as long or longer,
        with the same tokens where this one ended."""
        return (
            len(context) >= self.length and token_list(context, self.length - len(self.tail), self.length) == self.tail
        )

    def gained(self, context: Sequence[int] | np.ndarray) -> list[int]:
        """The tokens ``context`` (which continues this one) added since."""
        return token_list(context, self.length)


@dataclasses.dataclass(frozen=True)
class PlainRow:
    """A ``PlainSteps`` row's session: where its context stands (it keeps nothing across steps)."""

    mark: Mark


class PlainSteps:
    """A ``Drafter`` driven step by step: one source, its tree verified as it comes (cut to the
    budget), nothing local to fall back on."""

    cost = None

    def __init__(self, drafter: Drafter) -> None:
        self.source = as_source(drafter)

    def advance(
        self,
        rows: Sequence[Sequence[int]],
        requests: Sequence[Hashable],
        accepted: Sequence[Sequence[int]] | None = None,
        temperatures: Sequence[float] | None = None,
    ) -> list[PlainRow]:
        return [PlainRow(Mark.of(row)) for row in rows]

    def finish(self, requests: Sequence[Hashable]) -> None:
        pass

    def record(self, trees: Sequence[DraftTree], merged: Sequence[DraftTree]) -> None:
        pass

    def candidates(self, config: DraftConfig) -> DraftConfig:
        return config

    def start_shared(
        self, rows: Sequence[Sequence[int]], config: DraftConfig, timeout: float | None = None
    ) -> Pending[list[SourceTrees]]:
        return self.source.start_sources(rows, config, timeout=timeout)

    def draft_rows(
        self, sessions: Sequence[PlainRow], shared: Sequence[SourceTrees], config: DraftConfig
    ) -> tuple[list[DraftTree], list[DraftTree]]:
        """Each row's index tree, cut to the budget (a tree under a bonus token comes from a wider one)."""
        trees = [
            tree
            if len(tree) <= config.budget
            else tree.subset(np.sort(np.argsort(-tree.scores, kind="stable")[: config.budget]))
            for tree in (both.index for both in shared)
        ]
        return trees, trees


def steps_for(drafter: Drafter) -> StepDrafter:
    """How a scheduler drives ``drafter``: by its own steps where it has them (``AdaptiveDrafter``),
    else as ``PlainSteps``."""
    return drafter if isinstance(drafter, StepDrafter) else PlainSteps(drafter)
