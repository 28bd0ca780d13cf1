"""The request's own text as a draft source: prompt lookup, drafted like the index.

REST cannot copy from the prompt (its paper: "no in-context ability"), which is exactly where
prompt lookup gains most. ``RequestMatcher`` indexes one request's tokens in a
``datastore.bigram.BigramIndex`` as they are committed and drafts like the index (longest suffix,
the continuations of its earlier occurrences, ``top_c_tree``), so ``drafter.core.merge`` can combine its
tree with the index's. It lives on the decoder's side: nothing of it crosses the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rest_spec.common.types import DraftConfig, DraftTree, token_ids
from rest_spec.datastore.bigram import SEP, BigramIndex
from rest_spec.datastore.index import DEFAULT_MAX_CANDIDATES


class RequestMatcher:
    """Drafts from one request's own tokens: the prompt and everything generated so far.

    ``draft(context, config)`` takes the whole live context each step but indexes only the tokens
    added since the previous call, then counts the continuations of earlier occurrences of the
    context's longest suffix (the occurrence that *is* the suffix has none). One per request."""

    def __init__(self, max_candidates: int = DEFAULT_MAX_CANDIDATES) -> None:
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be positive, got {max_candidates}")
        self.max_candidates = max_candidates
        self._index = BigramIndex()

    def __len__(self) -> int:
        return self._index.size - 1

    def extend(self, context: Sequence[int] | np.ndarray) -> None:
        """Index the tokens of ``context`` (the whole live context) added since the last call."""
        seen = len(self)
        if len(context) < seen or (seen and context[seen - 1] != self._index.tokens[seen]):
            raise ValueError(
                "context does not extend the tokens this matcher has seen; use one RequestMatcher per request"
            )
        if len(context) == 0:
            raise ValueError("context must be a non-empty 1-D sequence of token ids")
        self._index.append(token_ids(context, "context", SEP, last=len(context) - seen).astype(np.uint32))

    def draft(self, context: Sequence[int] | np.ndarray, config: DraftConfig = DraftConfig()) -> DraftTree:
        self.extend(context)
        return self.draft_ahead((), config)

    def draft_ahead(self, extra: Sequence[int], config: DraftConfig = DraftConfig()) -> DraftTree:
        """The draft for the indexed context continued by ``extra``, tokens not committed yet (a
        path the verifier may accept): they take part in the match but are not indexed, so the
        matcher's state is unchanged and any number of such drafts can be asked for."""
        size = self._index.size
        query = self._index.tokens[max(1, size - config.n_max) : size]
        if len(extra):
            query = np.concatenate((query, token_ids(extra, "extra", SEP).astype(np.uint32)))[-config.n_max :]
        return self._index.draft(query[::-1], config, 1, self.max_candidates)
