"""The in-process draft source: an opened index and a store of recent outputs (or a copy of a
fleet's), no call on the decoding step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rest_spec.common.errors import NoOutputStoreError
from rest_spec.common.tokenizer import require_tokenizer
from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo, SourceTrees
from rest_spec.datastore.index import Datastore, query_matrix
from rest_spec.datastore.outputs import (
    DEFAULT_OUTPUTS_MAX_TOKENS,
    OutputStore,
    check_outputs_options,
    open_output_store,
)
from rest_spec.drafter.core.steps import DraftSource

if TYPE_CHECKING:  # a local index never imports grpc (tests/test_protocol.py); only a copy of a server's store does
    from rest_spec.datastore.mirror import OutputsMirror


class LocalDrafter(DraftSource):
    """``SourceDrafter`` over a ``Datastore`` and an optional store of outputs in this process
    (an ``OutputStore``, or an ``OutputsMirror``: a copy of a fleet's server's); returns the same
    trees as the gRPC service. Owns both (``close`` closes them). Its batches are drafted when
    collected, in the thread that collects them."""

    reads_suffixes = True

    def __init__(self, datastore: Datastore, outputs: OutputStore | OutputsMirror | None = None) -> None:
        self.datastore = datastore
        self.outputs = outputs

    @classmethod
    def open(
        cls,
        path: str | Path | Sequence[str | Path],
        *,
        expected_fingerprint: str | None = None,
        outputs_max_tokens: int = DEFAULT_OUTPUTS_MAX_TOKENS,
        outputs_dir: str | Path | None = None,
        outputs_from: str | None = None,
        tls_ca: str | None = None,
        auth_token: str | None = None,
        **kwargs,
    ) -> LocalDrafter:
        """Open the index at ``path``, or the indexes at several paths as one (``kwargs`` and
        ``path`` go to ``Datastore.open``), with an output store of
        ``outputs_max_tokens`` tokens (0: none), persistent in ``outputs_dir`` if given, or a copy
        of that size of the store of the server at ``outputs_from`` (HOST:PORT; ``OutputsMirror``,
        reached with ``tls_ca`` and ``auth_token``); with ``expected_fingerprint`` (the model's
        ``tokenizer_fingerprint``), an index built with another tokenizer is refused with
        ``TokenizerMismatchError``."""
        check_outputs_options(outputs_max_tokens, outputs_dir)
        if outputs_from is not None and (outputs_dir is not None or outputs_max_tokens == 0):
            raise ValueError(
                "outputs_from copies a server's store of outputs: it takes no outputs_dir (the server keeps "
                "the store) and needs outputs_max_tokens > 0"
            )
        datastore = Datastore.open(path, **kwargs)
        try:
            require_tokenizer(datastore, expected_fingerprint)
            if outputs_from is not None:
                from rest_spec.datastore.mirror import OutputsMirror

                outputs = OutputsMirror(
                    outputs_from,
                    vocab_size=datastore.vocab_size,
                    max_tokens=outputs_max_tokens,
                    expected_fingerprint=datastore.info().tokenizer_fingerprint,
                    tls_ca=tls_ca,
                    auth_token=auth_token,
                )
            else:
                outputs = open_output_store(outputs_max_tokens, outputs_dir, vocab_size=datastore.vocab_size)
        except BaseException:
            datastore.close()
            raise
        return cls(datastore, outputs)

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        return self.datastore.draft(context, config)

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
        return self.datastore.draft_batch(contexts, config)

    def draft_sources(self, context: Sequence[int], config: DraftConfig) -> SourceTrees:
        outputs = DraftTree.empty() if self.outputs is None else self.outputs.draft(context, config)
        return SourceTrees(self.datastore.draft(context, config), outputs)

    def draft_sources_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[SourceTrees]:
        # parsed once for both: the index's vocabulary bounds the store's too
        queries, lengths = query_matrix(contexts, config.n_max, self.datastore.vocab_size)
        trees = self.datastore.draft_queries(queries, lengths, config)
        if self.outputs is None:
            return [SourceTrees(tree, DraftTree.empty()) for tree in trees]
        return [SourceTrees(*both) for both in zip(trees, self.outputs.draft_queries(queries, lengths, config))]

    def add_output(self, tokens: Sequence[int]) -> int:
        if self.outputs is None:
            raise NoOutputStoreError("this drafter keeps no outputs (it was opened with outputs_max_tokens=0)")
        return self.outputs.add(tokens)

    def outputs_in_process(
        self, from_seq: int, max_tokens: int
    ) -> tuple[list[tuple[int, np.ndarray]], int, int] | None:
        """``OutputStore.read`` of the store of outputs (of the fleet's copy, with a mirror)."""
        return None if self.outputs is None else self.outputs.read(from_seq, max_tokens)

    def warm_up(self) -> float:
        """The index's kernels for its dtypes (``Datastore.warm_up``) and the store of outputs'."""
        from rest_spec.datastore import bigram

        return self.datastore.warm_up() + (0.0 if self.outputs is None else bigram.compile_kernels())

    def info(self) -> IndexInfo:
        return self.datastore.info()

    def close(self) -> None:
        if self.outputs is not None:
            self.outputs.close()
        self.datastore.close()

    def __enter__(self) -> LocalDrafter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
