"""The drafting protocol: what this project's decoding loops ask of a drafter, declared once.

Three layers, each a small typed interface:

- ``Drafter``: "draft for this context with this budget" -- all a drafter a user writes must
  answer (``draft``, ``draft_batch``, ``info``, ``close``).
- ``SourceDrafter``: a ``Drafter`` over an index and a store of outputs, whose trees it answers
  apart (``draft_sources``) and which takes new outputs (``add_output``). The datastores this
  project ships (``LocalDrafter``, ``RemoteDrafter``) are one, and declare on top what a scheduler
  may use (``drafter.core.steps.DraftSource``: ``reads_suffixes``, ``start_sources`` answering a
  ``Pending``, a ``breaker``).
- ``StepDrafter``: the per-step sequence a scheduler (``drafter.core.scheduler``) runs for a batch
  of live contexts, one call each::

      sessions = advance(rows, requests)          # each row's request session, credited
      config = candidates(loop_config)            # how the sources draft this step
      shared = start_shared(rows, config)         # index and output trees: one call, maybe async
      trees, merged = draft_rows(sessions, shared, config)  # merged with each request's own, selected
      trees = admit(trees)                        # the engine's batch rule, if any
      record(trees, merged)                       # what the next advance credits
      finish(ended)                               # requests the engine says have ended

  An engine names each row's request (vLLM's request id, the loop's row) and the requests that
  ended; the drafter keeps a session per request (its matcher, where its context stood, the tree
  last verified) and reads only what each context gained since (``drafter.core.steps.Mark``): no
  whole-context copies, no matching of rows by prefix. Without names, a row's position is its
  request, and a context that does not continue its position's session starts a new one.

  ``AdaptiveDrafter`` implements it; ``drafter.core.steps`` runs it (``draft_step``,
  ``finish_step``) and drives any other ``Drafter`` through it (``PlainSteps``, ``steps_for``).

This module is the contract alone; the names that lived here beside it are in ``drafter.core.steps``
(and still answer here, as aliases).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo, SourceTrees

if TYPE_CHECKING:
    from rest_spec.drafter.core.cost import StepCost

__all__ = ["BatchRule", "Drafter", "Pending", "SourceDrafter", "StepDrafter"]

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
        ``NoOutputStoreError`` when the drafter keeps no outputs."""
        ...


class Pending(Protocol[T]):
    """Drafts asked for now and collected later (``RemoteDrafter.start_sources``: an RPC in
    flight; ``Deferred``: work done when collected)."""

    def result(self, timeout: float | None = None) -> T:
        """The answer, waiting at most ``timeout`` seconds (``TimeoutError`` after that)."""
        ...

    def cancel(self) -> bool:
        """Give up on the answer (and stop the work where it runs elsewhere)."""
        ...


@runtime_checkable
class StepDrafter(Protocol):
    """The per-step sequence of the module docstring. ``source`` is where the shared trees come
    from (its capabilities are the scheduler's to read); ``cost``, where the drafter sizes trees
    by a measured verification cost, is corrected by the loop from the steps it times."""

    source: Drafter  # a drafter.core.steps.DraftSource (steps imports this module: not the other way)
    cost: StepCost | None

    def advance(
        self,
        rows: Sequence[Sequence[int]],
        requests: Sequence[Hashable],
        accepted: Sequence[Sequence[int]] | None = None,
        temperatures: Sequence[float] | None = None,
    ) -> list[Any]:
        """Each row's request session, whose ``mark`` (a ``steps.Mark``) is where the row's
        context stands now: the one record of where each request stands, which the scheduler's
        speculation reads too. Given its live context (read now, not kept: the engine may change
        it after the call), the name of its request and, where the engine reports them,
        ``accepted``: the tokens it committed for the row at its last step (the draft tokens it
        accepted and its own; None: what each context gained tells), and ``temperatures``: each
        row's sampling temperature (None: greedy)."""
        ...

    def finish(self, requests: Sequence[Hashable]) -> None:
        """These requests ended: their sessions go."""
        ...

    def candidates(self, config: DraftConfig) -> DraftConfig:
        """How the sources draft under the loop's ``config``."""
        ...

    def start_shared(
        self, rows: Sequence[Sequence[int]], config: DraftConfig, timeout: float | None = None
    ) -> Pending[list[SourceTrees]]:
        """The source trees of ``rows`` (contexts, or their tails for a source that
        ``reads_suffixes``), one call to the source, collected later. Also called for
        hypothetical contexts by speculation: touches no request state."""
        ...

    def draft_rows(
        self, sessions: Sequence[Any], shared: Sequence[SourceTrees], config: DraftConfig
    ) -> tuple[list[DraftTree], list[DraftTree]]:
        """Each row's shared trees merged with its request's own into one tree of at most
        ``config.budget`` nodes, and the part of it worth verifying: (selected, merged), per row.
        All rows at once, so a drafter may run them in one compiled pass."""
        ...

    def record(self, trees: Sequence[DraftTree], merged: Sequence[DraftTree]) -> None:
        """The trees verified for the rows of the last ``advance``, and the merged trees they were
        selected from."""
        ...


BatchRule = Callable[[list[DraftTree]], list[DraftTree]]  # a batch's trees -> the parts its step verifies
