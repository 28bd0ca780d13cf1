"""The interfaces draft sources implement: ``Drafter`` ("draft for this context with this budget"),
all the decoding loop needs, and ``SourceDrafter``, a datastore that also answers its sources one
by one (static index, store of recent outputs) and takes new outputs -- what
``drafter.adaptive.AdaptiveDrafter`` merges and scores."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Generic, Protocol, TypeVar, runtime_checkable

from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo, SourceTrees

__all__ = ["Deferred", "Drafter", "Pending", "SourceDrafter", "SourceTrees", "drafter_trees"]

T = TypeVar("T", covariant=True)


@runtime_checkable
class Drafter(Protocol):
    """Answers draft trees for token contexts. ``LocalDrafter`` (an opened index) and
    ``RemoteDrafter`` (a gRPC client) return identical trees for the same index."""

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree: ...

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]: ...

    def info(self) -> IndexInfo: ...

    def close(self) -> None: ...


@runtime_checkable
class SourceDrafter(Drafter, Protocol):
    """A ``Drafter`` over a static index and a bounded store of recent outputs. ``draft`` answers
    the index alone; ``draft_sources`` both trees for the same context in one call (one RPC for
    ``RemoteDrafter``). ``LocalDrafter`` and ``RemoteDrafter`` answer identical trees for the same
    index and the same outputs added in the same order."""

    def draft_sources(self, context: Sequence[int], config: DraftConfig) -> SourceTrees: ...

    def draft_sources_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[SourceTrees]: ...

    def add_output(self, tokens: Sequence[int]) -> int:
        """Store one generation (its new tokens) for later drafts; returns its sequence number.
        ``RuntimeError`` when the drafter keeps no outputs."""
        ...


def drafter_trees(drafter: Drafter, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
    """One tree per context from ``drafter``: its single-context call for one context, one batch
    call (one RPC) for more."""
    if len(contexts) == 1:
        return [drafter.draft(contexts[0], config)]
    return list(drafter.draft_batch(contexts, config))


class Pending(Protocol[T]):
    """Drafts asked for now and collected later (``RemoteDrafter.draft_batch_future``: an RPC in
    flight; ``Deferred``: work done when collected)."""

    def result(self, timeout: float | None = None) -> T:
        """The answer, waiting at most ``timeout`` seconds (``TimeoutError`` after that)."""
        ...

    def cancel(self) -> bool:
        """Give up on the answer (and stop the work where it runs elsewhere)."""
        ...


V = TypeVar("V")


class Deferred(Generic[V]):
    """A ``Pending`` for work that runs where it is collected (an in-process index: nothing to
    wait for, so the work runs in whichever thread asks for the result, once)."""

    def __init__(self, work: Callable[[], V]) -> None:
        self._work: Callable[[], V] | None = work
        self._value: V | None = None
        self._cancelled = False

    def result(self, timeout: float | None = None) -> V:
        if self._cancelled:
            raise CancelledError("the draft was cancelled")
        if self._work is not None:
            self._value, self._work = self._work(), None
        return self._value  # type: ignore[return-value]

    def cancel(self) -> bool:
        if self._work is None:
            return False
        self._cancelled, self._work = True, None
        return True
