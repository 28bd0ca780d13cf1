"""The in-process draft source: an opened index, no network."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from datastore.index import Datastore
from datastore.tokenizer import require_tokenizer
from datastore.types import DraftConfig, DraftTree, IndexInfo


class LocalDrafter:
    """``Drafter`` over a ``Datastore`` in this process; returns the same trees as the gRPC service."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore

    @classmethod
    def open(cls, path: str | Path, *, expected_fingerprint: str | None = None, **kwargs) -> "LocalDrafter":
        """Open the index at ``path`` (``kwargs`` go to ``Datastore.open``); with
        ``expected_fingerprint`` (the model's ``tokenizer_fingerprint``), an index built with another
        tokenizer is refused with ``TokenizerMismatchError``."""
        drafter = cls(Datastore.open(path, **kwargs))
        require_tokenizer(drafter, expected_fingerprint)
        return drafter

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        return self.datastore.draft(context, config)

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
        return self.datastore.draft_batch(contexts, config)

    def info(self) -> IndexInfo:
        return self.datastore.info()

    def close(self) -> None:
        self.datastore.close()

    def __enter__(self) -> "LocalDrafter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
