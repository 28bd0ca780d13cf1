"""A growable bigram index over token documents, the structure behind the store of outputs.

SuffixDecoding's gains come from a model's earlier outputs. The store built on ``BigramIndex``
(``datastore.outputs.OutputStore``: recent outputs, service side) drafts like the index, as the
request's own text does (``drafter.core.request_matcher``, which scans its short text instead): the
longest context suffix of ``n_min..n_max`` tokens, the continuations that follow its occurrences,
``top_c_tree`` -- so their trees mean the same thing and ``drafter.core.merge`` can combine them
with the index's.

``BigramIndex`` is a growable token buffer (documents separated by ``SEP``) and a sorted table
from each position's last two tokens to that position, so a lookup costs O(log N + occurrences),
never a scan of the buffer; appends land in a small unsorted tail that is merged in when it grows.
Lookups start from a bigram, so these sources never match fewer than two tokens (``n_min`` 1 acts
as 2: one shared token predicts little).
"""

from __future__ import annotations

import math
import time

import numpy as np

from rest_spec.common.cache import numba_cached
from rest_spec.common.types import MAX_DEPTH, DraftConfig, DraftTree
from rest_spec.datastore import format as fmt
from rest_spec.datastore.trie import _put_tree, _tree_buffers, trees_from_buffers

SEP = fmt.separator(np.dtype(np.uint32))  # the index's separator of uint32 tokens, as top_c_tree needs
numba = numba_cached()
_MIN_TAIL = 4096  # unsorted bigram entries a lookup scans before they are merged into the table


def _bigram_keys(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    return (first.astype(np.uint64) << np.uint64(32)) | second.astype(np.uint64)


class BigramIndex:
    """Token buffer + bigram table. Position 0 holds ``SEP``, documents are separated by ``SEP``,
    and every slot past ``size`` holds ``SEP`` for at least ``MAX_DEPTH`` slots, so continuations
    are gathered without bounds checks and backward matching stops at a separator by itself.
    Position e is in the table under (t[e-1], t[e]) once t[e-1], t[e] and t[e+1] are all tokens:
    as in the index, a match with nothing after it (a document's last token, the request's
    newest) has nothing to draft and does not count."""

    def __init__(self, tokens: np.ndarray | None = None) -> None:
        """Start from ``tokens`` (uint32, documents separated by ``SEP``), indexed in one sort."""
        tokens = np.zeros(0, np.uint32) if tokens is None else tokens
        self.size = 1 + tokens.size
        self.tokens = np.full(self.size + MAX_DEPTH + 1024, SEP, np.uint32)
        self.tokens[1 : self.size] = tokens
        prev, cur, after = self.tokens[: self.size - 1], self.tokens[1 : self.size], self.tokens[2 : self.size + 1]
        ends = np.flatnonzero((prev != SEP) & (cur != SEP) & (after != SEP)) + 1
        keys = _bigram_keys(self.tokens[ends - 1], self.tokens[ends])
        order = np.argsort(keys, kind="stable")  # stable: positions stay ascending within a key
        self._keys, self._ends = keys[order], ends[order]
        self._tail_keys, self._tail_ends = np.zeros(_MIN_TAIL, np.uint64), np.zeros(_MIN_TAIL, np.int64)
        self._tail_len = 0

    def append(self, tokens: np.ndarray) -> None:
        """Append ``tokens`` (uint32, no ``SEP``) to the last document and index the positions
        that now have a successor (one compiled pass)."""
        start, stop = self.size, self.size + tokens.size
        if stop + MAX_DEPTH >= self.tokens.size:
            grown = np.full(2 * (stop + MAX_DEPTH), SEP, np.uint32)
            grown[:start] = self.tokens[:start]
            self.tokens = grown
        self._reserve_tail(tokens.size + 1)
        self._tail_len = _append(self.tokens, start, tokens, self._tail_keys, self._tail_ends, self._tail_len)
        self.size = stop
        self._merge_tail_if_long()

    def end_document(self) -> None:
        self.size += 1  # the slot already holds SEP

    def _reserve_tail(self, entries: int) -> None:
        """Room for ``entries`` more tail entries (the capacity doubles)."""
        if self._tail_len + entries > self._tail_keys.size:
            spare = max(self._tail_keys.size, entries)
            self._tail_keys = np.concatenate((self._tail_keys, np.zeros(spare, np.uint64)))
            self._tail_ends = np.concatenate((self._tail_ends, np.zeros(spare, np.int64)))

    def _merge_tail_if_long(self) -> None:
        # A lookup scans the tail linearly and a merge moves the whole table: a tail of
        # ~sqrt(N) balances the two (O(sqrt N) per lookup and per appended token, amortized).
        used = self._tail_len
        if used > max(_MIN_TAIL, 8 * math.isqrt(self._keys.size)):
            keys, ends = self._tail_keys[:used], self._tail_ends[:used]
            order = np.argsort(keys, kind="stable")
            at = np.searchsorted(self._keys, keys[order], side="right")  # after older equal keys
            self._keys = np.insert(self._keys, at, keys[order])
            self._ends = np.insert(self._ends, at, ends[order])
            self._tail_len = 0

    def draft(self, query: np.ndarray, config: DraftConfig, first: int, max_candidates: int) -> DraftTree:
        """The draft for the context whose last tokens, newest first, are ``query``, counting only
        occurrences that end at position ``first`` or later. Above ``max_candidates`` occurrences
        the most recent ones are counted (recent text is the most relevant here)."""
        queries = np.asarray(query, dtype=np.int64)[None]
        return self.draft_batch(queries, np.array([queries.shape[1]], np.int64), config, first, max_candidates)[0]

    def draft_batch(
        self, queries: np.ndarray, lengths: np.ndarray, config: DraftConfig, first: int, max_candidates: int
    ) -> list[DraftTree]:
        """``draft`` of every row of ``queries`` (int64 [R, n], row i's first ``lengths[i]`` tokens
        newest first: ``datastore.index.query_matrix``), in one compiled pass: the match and the
        continuations (``_continuations``) and the trie, with no Python between rows."""
        return trees_from_buffers(
            _draft_rows(
                self.tokens,
                self._keys,
                self._ends,
                self._tail_keys[: self._tail_len],
                self._tail_ends[: self._tail_len],
                np.ascontiguousarray(queries, dtype=np.int64),
                np.ascontiguousarray(lengths, dtype=np.int64),
                first,
                config.n_min,
                config.max_depth,
                config.budget,
                max_candidates,
            )
        )


@numba.njit(nogil=True, cache=True)
def _append(buffer, start, tokens, tail_keys, tail_ends, tail_len):
    """``BigramIndex.append``'s pass: ``tokens`` written at ``start`` (the buffer has room), and
    every position from ``start - 1`` on that now has a successor, under its bigram, added to the
    tail (room for ``tokens.size + 1`` entries); returns the tail's new length."""
    sep = np.uint32(SEP)
    buffer[start : start + tokens.shape[0]] = tokens
    for end in range(max(start - 1, 1), start + tokens.shape[0] - 1):
        if buffer[end - 1] != sep and buffer[end] != sep:
            tail_keys[tail_len] = (np.uint64(buffer[end - 1]) << np.uint64(32)) | np.uint64(buffer[end])
            tail_ends[tail_len] = end
            tail_len += 1
    return tail_len


@numba.njit(nogil=True, cache=True)
def _draft_rows(
    tokens, keys, ends, tail_keys, tail_ends, queries, lengths, first, n_min, max_depth, budget, max_candidates
):
    """``BigramIndex.draft_batch``'s pass: each row's match (``_continuations``), its tree put
    in the batch's ``_tree_buffers``."""
    buffers = _tree_buffers(queries.shape[0], budget)
    offsets = buffers[5]
    for r in range(queries.shape[0]):
        offsets[r + 1] = offsets[r]
        if lengths[r] < 2:
            continue
        rows, match_len, num_matches = _continuations(
            tokens, keys, ends, tail_keys, tail_ends, queries[r, : lengths[r]], first, max_depth, max_candidates
        )
        if match_len > 0 and match_len >= n_min:
            _put_tree(buffers, r, rows, np.uint32(SEP), budget, match_len, num_matches)
    return buffers


@numba.njit(nogil=True, cache=True)
def _continuations(tokens, keys, ends, tail_keys, tail_ends, query, first, max_depth, max_candidates):
    """``BigramIndex.draft``'s match: the positions ending the longest match of ``query`` (newest
    token first; its last two tokens found in the table and the tail, then one token further back
    per round on the survivors, a ``SEP`` ending every match) at ``first`` or later; returns the
    continuations of the latest ``max_candidates`` of them (uint32 [k, max_depth], each ``SEP``
    from its document's end on), the match length (0: none) and the number of positions."""
    sep = np.uint32(SEP)
    key = (np.uint64(query[1]) << np.uint64(32)) | np.uint64(query[0])
    lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
    found = np.empty(hi - lo + tail_keys.shape[0], np.int64)
    n = 0
    for i in range(lo, hi):
        if ends[i] >= first:
            found[n] = ends[i]
            n += 1
    for i in range(tail_keys.shape[0]):  # the tail holds the newest positions
        if tail_keys[i] == key and tail_ends[i] >= first:
            found[n] = tail_ends[i]
            n += 1
    match_len = 2 if n else 0
    for j in range(2, query.shape[0]):
        kept = 0
        for i in range(n):
            if tokens[found[i] - j] == query[j]:  # a SEP (or position 0) ends the match
                kept += 1
        if kept == 0:
            break
        m = 0
        for i in range(n):
            if tokens[found[i] - j] == query[j]:
                found[m] = found[i]
                m += 1
        n, match_len = m, j + 1
    start = max(n - max_candidates, 0)
    rows = np.full((n - start, max_depth), sep, np.uint32)
    for r in range(n - start):
        for d in range(max_depth):
            token = tokens[found[start + r] + 1 + d]
            if token == sep:
                break
            rows[r, d] = token
    return rows, match_len, n


def compile_kernels() -> float:
    """Compile ``BigramIndex.draft``'s kernels into numba's on-disk cache (``drafter.core.kernels``);
    returns the seconds it took."""
    start = time.perf_counter()
    index = BigramIndex(np.array([5, 6, 7, 5, 6, 8], np.uint32))
    index.append(np.array([5, 6], np.uint32))
    index.draft(np.array([6, 5], np.uint32), DraftConfig(), 1, 64)
    return time.perf_counter() - start
