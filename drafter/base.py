"""The interfaces draft sources implement: ``Drafter`` ("draft for this context with this budget"),
all the decoding loop needs, and ``SourceDrafter``, a datastore that also answers its sources one
by one (static index, store of recent outputs) and takes new outputs -- what
``drafter.adaptive.AdaptiveDrafter`` merges and scores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from rest_spec.datastore.types import DraftConfig, DraftTree, IndexInfo, SourceTrees

__all__ = ["Drafter", "SourceDrafter", "SourceTrees"]


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
