"""A growable bigram index over token documents, the structure behind the drafting sources that grow.

REST cannot copy from the prompt (its paper: "no in-context ability"), which is exactly where
prompt lookup and SuffixDecoding gain most, together with a model's earlier outputs.
The sources built on ``BigramIndex`` -- ``drafter.core.request_matcher.RequestMatcher`` (the request's own
text, client side) and ``datastore.outputs.OutputStore`` (recent outputs, service side) -- draft like the index:
the longest context suffix of ``n_min..n_max`` tokens, the continuations that follow its
occurrences, ``top_c_tree`` -- so their trees mean the same thing and ``drafter.core.merge`` can
combine them with the index's.

``BigramIndex`` is a growable token buffer (documents separated by ``SEP``) and a sorted table
from each position's last two tokens to that position, so a lookup costs O(log N + occurrences),
never a scan of the buffer; appends land in a small unsorted tail that is merged in when it grows.
Lookups start from a bigram, so these sources never match fewer than two tokens (``n_min`` 1 acts
as 2: one shared token predicts little).
"""

from __future__ import annotations

import math

import numpy as np

from rest_spec.common.types import MAX_DEPTH, DraftConfig, DraftTree
from rest_spec.datastore import format as fmt
from rest_spec.datastore.trie import counted_tree

SEP = fmt.separator(np.dtype(np.uint32))  # the index's separator of uint32 tokens, as top_c_tree needs
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
        that now have a successor."""
        start, stop = self.size, self.size + tokens.size
        if stop + MAX_DEPTH >= self.tokens.size:
            grown = np.full(2 * (stop + MAX_DEPTH), SEP, np.uint32)
            grown[:start] = self.tokens[:start]
            self.tokens = grown
        self.tokens[start:stop] = tokens
        self.size = stop
        ends = np.arange(max(start - 1, 1), stop - 1)  # the previous last token gained a successor
        real = (self.tokens[ends - 1] != SEP) & (self.tokens[ends] != SEP)
        ends = ends[real]
        self._add_to_tail(_bigram_keys(self.tokens[ends - 1], self.tokens[ends]), ends)

    def end_document(self) -> None:
        self.size += 1  # the slot already holds SEP

    def _add_to_tail(self, keys: np.ndarray, ends: np.ndarray) -> None:
        used = self._tail_len + keys.size
        if used > self._tail_keys.size:  # double the capacity
            spare = max(self._tail_keys.size, keys.size)
            self._tail_keys = np.concatenate((self._tail_keys, np.zeros(spare, np.uint64)))
            self._tail_ends = np.concatenate((self._tail_ends, np.zeros(spare, np.int64)))
        self._tail_keys[self._tail_len : used] = keys
        self._tail_ends[self._tail_len : used] = ends
        self._tail_len = used
        # A lookup scans the tail linearly and a merge moves the whole table: a tail of
        # ~sqrt(N) balances the two (O(sqrt N) per lookup and per appended token, amortized).
        if used > max(_MIN_TAIL, 8 * math.isqrt(self._keys.size)):
            keys, ends = self._tail_keys[:used], self._tail_ends[:used]
            order = np.argsort(keys, kind="stable")
            at = np.searchsorted(self._keys, keys[order], side="right")  # after older equal keys
            self._keys = np.insert(self._keys, at, keys[order])
            self._ends = np.insert(self._ends, at, ends[order])
            self._tail_len = 0

    def ends_of(self, first: int, second: int) -> np.ndarray:
        """int64 ascending: the indexed positions e with t[e-1] == first and t[e] == second."""
        key = np.uint64((first << 32) | second)
        lo, hi = np.searchsorted(self._keys, key, "left"), np.searchsorted(self._keys, key, "right")
        tail = self._tail_ends[: self._tail_len][self._tail_keys[: self._tail_len] == key]
        return np.concatenate((self._ends[lo:hi], tail))  # the tail holds the newest positions

    def draft(self, query: np.ndarray, config: DraftConfig, first: int, max_candidates: int) -> DraftTree:
        """The draft for the context whose last tokens, newest first, are ``query`` (uint32),
        counting only occurrences that end at position ``first`` or later. Above ``max_candidates``
        occurrences the most recent ones are counted (recent text is the most relevant here)."""
        if query.size < 2:
            return DraftTree.empty()
        ends = self.ends_of(int(query[1]), int(query[0]))
        ends = ends[ends >= first]
        match_len = 2 if ends.size else 0
        for j in range(2, query.size):  # one token further back per round, on the survivors only
            longer = ends[self.tokens[ends - j] == query[j]]  # a SEP (or position 0) ends the match
            if longer.size == 0:
                break
            ends, match_len = longer, j + 1
        if match_len == 0 or match_len < config.n_min:
            return DraftTree.empty()
        counted = ends[-max_candidates:]
        rows = self.tokens[counted[:, None] + np.arange(1, config.max_depth + 1)]  # [k, max_depth]
        rows[np.maximum.accumulate(rows == SEP, axis=1)] = SEP  # a continuation stops at its document's end
        return counted_tree(rows, SEP, config.budget, match_len, int(ends.size))
