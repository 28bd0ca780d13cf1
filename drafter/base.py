"""The one interface every draft source implements: "draft for this context with this budget"."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from datastore.types import DraftConfig, DraftTree, IndexInfo


@runtime_checkable
class Drafter(Protocol):
    """Answers draft trees for token contexts. ``LocalDrafter`` (an opened index) and
    ``RemoteDrafter`` (a gRPC client) return identical trees for the same index."""

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree: ...

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]: ...

    def info(self) -> IndexInfo: ...

    def close(self) -> None: ...
