"""The one interface every draft source implements: "draft for this context with this budget"."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from datastore.types import DraftConfig, DraftTree, IndexInfo


class TokenizerMismatchError(ValueError):
    """The datastore was built with a different tokenizer than the model uses."""


@runtime_checkable
class Drafter(Protocol):
    """Answers draft trees for token contexts. ``LocalDrafter`` (an opened index) and
    ``RemoteDrafter`` (a gRPC client) return identical trees for the same index."""

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree: ...

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]: ...

    def info(self) -> IndexInfo: ...

    def close(self) -> None: ...


def check_tokenizer(drafter: Drafter, fingerprint: str) -> None:
    """Refuse a datastore whose tokenizer fingerprint differs from the model's."""
    info = drafter.info()
    if info.tokenizer_fingerprint != fingerprint:
        raise TokenizerMismatchError(
            f"datastore tokenizer {info.tokenizer_name!r} ({info.tokenizer_fingerprint[:19]}...) does not "
            f"match the model's tokenizer ({fingerprint[:19]}...): rebuild the index with "
            "`build_index --tokenizer <the model>`"
        )
