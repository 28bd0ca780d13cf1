"""The request's own text as a draft source: prompt lookup, drafted like the index.

REST cannot copy from the prompt (its paper: "no in-context ability"), which is exactly where
prompt lookup gains most. ``RequestMatcher`` keeps one request's tokens as they are committed and
drafts like the index (longest suffix, the continuations of its earlier occurrences,
``top_c_tree``), so ``drafter.core.merge`` can combine its tree with the index's. It lives on the
decoder's side: nothing of it crosses the wire.

A request's text is short (its prompt and what it generated: thousands of tokens, not millions),
so its match is a scan of the text in a compiled pass, as vLLM's n-gram proposer scans: no table
to keep up per token. ``draft_requests`` drafts every row of a step in one such pass (at 16 rows a
step, the matcher's Python per row was a third of the drafting), and ``extend_requests`` checks a
step's new tokens of all rows in one numpy pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from rest_spec.common.cache import numba_cached
from rest_spec.common.types import DraftConfig, DraftTree, token_ids
from rest_spec.datastore.bigram import SEP
from rest_spec.datastore.index import DEFAULT_MAX_CANDIDATES
from rest_spec.datastore.trie import _put_tree, _tree_buffers, trees_from_buffers

numba = numba_cached()
_NO_EXTRA = np.zeros(0, np.uint32)


class RequestMatcher:
    """Drafts from one request's own tokens: the prompt and everything generated so far.

    ``draft(context, config)`` takes the whole live context each step but keeps only the tokens
    added since the previous call, then counts the continuations of earlier occurrences of the
    context's longest suffix of 2..``n_max`` tokens (the occurrence that *is* the suffix has none;
    one shared token predicts little, so ``n_min`` 1 acts as 2, as in the store of outputs). Above
    ``max_candidates`` occurrences the most recent ones are counted. One per request."""

    def __init__(self, max_candidates: int = DEFAULT_MAX_CANDIDATES) -> None:
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be positive, got {max_candidates}")
        self.max_candidates = max_candidates
        self._tokens = np.empty(256, np.uint32)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def tokens(self) -> np.ndarray:
        """The request's tokens seen so far (a read-only view)."""
        view = self._tokens[: self._size]
        view.flags.writeable = False
        return view

    def _unseen(self, context: Sequence[int] | np.ndarray) -> Sequence[int] | np.ndarray:
        """The part of ``context`` (the whole live context) this matcher has not seen, unchecked."""
        seen = self._size
        if len(context) < seen or (seen and context[seen - 1] != self._tokens[seen - 1]):
            raise ValueError(
                "context does not extend the tokens this matcher has seen; use one RequestMatcher per request"
            )
        if len(context) == 0:
            raise ValueError("context must be a non-empty 1-D sequence of token ids")
        return context[seen:]

    def _append(self, tokens: np.ndarray) -> None:
        """Append checked ids (``token_ids``: in [0, ``SEP``))."""
        stop = self._size + tokens.size
        if stop > self._tokens.size:
            grown = np.empty(max(2 * self._tokens.size, stop), np.uint32)
            grown[: self._size] = self._tokens[: self._size]
            self._tokens = grown
        self._tokens[self._size : stop] = tokens
        self._size = stop

    def extend(self, context: Sequence[int] | np.ndarray) -> None:
        """Keep the tokens of ``context`` (the whole live context) added since the last call."""
        extend_requests([self], [context])

    def draft(self, context: Sequence[int] | np.ndarray, config: DraftConfig = DraftConfig()) -> DraftTree:
        self.extend(context)
        return self.draft_ahead((), config)

    def draft_ahead(self, extra: Sequence[int], config: DraftConfig = DraftConfig()) -> DraftTree:
        """The draft for the kept context continued by ``extra``, tokens not committed yet (a path
        the verifier may accept): they take part in the match but are not kept, so the matcher's
        state is unchanged and any number of such drafts can be asked for."""
        extra = token_ids(extra, "extra", SEP).astype(np.uint32) if len(extra) else _NO_EXTRA
        return draft_requests([self], config, extra, np.array([0, extra.size], np.int64))[0]


def extend_requests(matchers: Sequence[RequestMatcher], contexts: Sequence[Sequence[int] | np.ndarray]) -> None:
    """``matcher.extend(context)`` for each pair, the new tokens of all checked in one pass (a bad
    id fails as that context's own check names it); nothing is kept when any is bad."""
    unseen = [matcher._unseen(context) for matcher, context in zip(matchers, contexts)]
    lengths = [len(part) for part in unseen]
    parts = [np.asarray(part) for part, n in zip(unseen, lengths) if n]
    if not parts:
        return
    flat = None
    if all(part.ndim == 1 and part.dtype.kind in "iu" for part in parts):
        flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if flat is None or flat.min() < 0 or flat.max() >= SEP:
        for context, n in zip(contexts, lengths):  # the first bad context fails with its own check's message
            token_ids(context, "context", SEP, last=n)
    flat = flat.astype(np.uint32, copy=False)
    at = 0
    for matcher, n in zip(matchers, lengths):
        if n:
            matcher._append(flat[at : at + n])
            at += n


def draft_requests(
    matchers: Sequence[RequestMatcher],
    config: DraftConfig,
    extras: np.ndarray = _NO_EXTRA,
    extra_offsets: np.ndarray | None = None,
) -> list[DraftTree]:
    """``matcher.draft_ahead(extra, config)`` for every matcher, in one compiled pass (no Python
    between rows): ``extras`` (uint32) from ``extra_offsets[i]`` to ``extra_offsets[i + 1]`` is
    matcher i's ``extra``; none by default."""
    if not matchers:
        return []
    sizes = np.fromiter((m._size for m in matchers), np.int64, len(matchers))
    offsets = np.zeros(len(matchers) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    texts = np.concatenate([m._tokens[: m._size] for m in matchers])
    if extra_offsets is None:
        extra_offsets = np.zeros(len(matchers) + 1, np.int64)
    candidates = np.fromiter((m.max_candidates for m in matchers), np.int64, len(matchers))
    return trees_from_buffers(
        _request_rows(
            texts,
            offsets,
            extras,
            extra_offsets,
            candidates,
            config.n_max,
            config.n_min,
            config.max_depth,
            config.budget,
        )
    )


@numba.njit(nogil=True, cache=True)
def _request_rows(texts, offsets, extras, extra_offsets, max_candidates, n_max, n_min, max_depth, budget):
    """``draft_requests``' pass. Row r's text is ``texts[offsets[r]:offsets[r + 1]]``; its query,
    the last ``n_max`` tokens of the text then its extra, newest first. An occurrence ends at a
    text position e with a successor in the text (e + 1 < the text's end), matching the query's
    two newest tokens there and as far back as the text goes; the longest matches count, the
    latest ``max_candidates[r]`` of them read up to ``max_depth`` tokens of what followed (to the
    text's end), put as tree r (``_put_tree``) when the match reaches 2 and ``n_min`` tokens."""
    rows = offsets.shape[0] - 1
    buffers = _tree_buffers(rows, budget)
    tree_offsets = buffers[5]
    sep = np.uint32(SEP)
    query = np.empty(n_max, np.uint32)
    for r in range(rows):
        tree_offsets[r + 1] = tree_offsets[r]
        lo, hi = offsets[r], offsets[r + 1]
        n = 0
        for i in range(extra_offsets[r + 1] - 1, extra_offsets[r] - 1, -1):
            if n == n_max:
                break
            query[n] = extras[i]
            n += 1
        for i in range(hi - 1, lo - 1, -1):
            if n == n_max:
                break
            query[n] = texts[i]
            n += 1
        if n < 2:
            continue
        found = np.empty(max(hi - lo - 2, 0), np.int32)  # offsets from lo
        newest, hits = query[0], 0
        for e in range(1, hi - lo - 1):  # branch-free, so it vectorizes: where the newest token recurs
            found[hits] = e
            hits += texts[lo + e] == newest
        best, count = 0, 0
        for i in range(hits):
            e = lo + found[i]
            if texts[e - 1] != query[1]:
                continue
            m = 2
            while m < n and e - m >= lo and texts[e - m] == query[m]:
                m += 1
            if m > best:
                best, count = m, 0
            if m == best:
                found[count] = e - lo
                count += 1
        if best == 0 or best < n_min:
            continue
        start = max(count - max_candidates[r], 0)
        continuations = np.full((count - start, max_depth), sep, np.uint32)
        for i in range(count - start):
            e = lo + found[start + i]
            for d in range(min(max_depth, hi - e - 1)):
                continuations[i, d] = texts[e + 1 + d]
        _put_tree(buffers, r, continuations, sep, budget, best, count)
    return buffers


def compile_kernels() -> float:
    """Compile the matcher's pass into numba's on-disk cache (``drafter.core.kernels``); returns
    the seconds it took."""
    start = time.perf_counter()
    matcher = RequestMatcher()
    matcher.draft([5, 6, 7, 5, 6], DraftConfig())
    matcher.draft_ahead([8], DraftConfig())
    return time.perf_counter() - start
