"""The frequency-weighted trie of retrieved continuations and its top-c draft tree, compiled.

REST counts, for every prefix of every retrieved continuation, how many continuations start with
it, and keeps the c heaviest prefixes. A child's count never exceeds its parent's, so with ties
broken by (shallower first, then lexicographic path) the kept set is prefix-closed: a tree.

No pointer trie is built, and most of it is never looked at. A node is a range of rows that share
its path; expanding it groups its rows by their next token into the children's ranges. Because a
child never outranks its parent, popping nodes best-first from a heap (seeded with the root's
children, every popped node's children pushed) yields exactly the c heaviest nodes after c pops,
and only the rows under popped nodes are ever sorted. The kernel is compiled with numba and runs
without the GIL, so concurrent drafts in a server's threads run on all cores.
"""

from __future__ import annotations

import heapq

import numpy as np

from rest_spec.common.cache import numba_cached
from rest_spec.common.types import DraftTree

numba = numba_cached()


def top_c_tree(continuations: np.ndarray, sep: int, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``budget`` heaviest trie nodes of ``continuations`` in BFS order.

    continuations  [k, m] unsigned ints; a row ends at its first ``sep`` (everything after it is
                   ``sep`` as well), ``sep`` being larger than every token id
    returns        (tokens int32 [n], parents int32 [n] (-1 = child of the root), counts int64 [n]),
                   n = min(budget, number of distinct prefixes); siblings in ascending token order
    """
    k, m = continuations.shape
    if k == 0 or m == 0 or budget <= 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64)
    return _top_c_tree(np.ascontiguousarray(continuations), sep, budget)[:3]


def counted_tree(continuations: np.ndarray, sep: int, budget: int, match_len: int, num_matches: int) -> DraftTree:
    """``top_c_tree`` of ``continuations`` as the ``DraftTree`` a source answers: drawn from a match of
    ``match_len`` tokens found ``num_matches`` times, its rows the continuations counted."""
    k, m = continuations.shape
    if k == 0 or m == 0 or budget <= 0:
        return DraftTree(*top_c_tree(continuations, sep, budget), match_len, num_matches, k)
    tokens, parents, counts, depths = _top_c_tree(np.ascontiguousarray(continuations), sep, budget)
    # _put_tree's scores; not through _put_tree: called from Python it compiles a specialization no
    # warm-up covers, seconds on a server's first draft (a 5 s deadline missed in CI)
    scores = counts / float(k)
    return DraftTree.counted_batch(
        tokens, parents, counts, depths, scores, [0, tokens.size], [(match_len, num_matches, k)]
    )[0]


@numba.njit(nogil=True, cache=True)
def _tree_buffers(num_rows, budget):
    """Room for ``num_rows`` trees of at most ``budget`` nodes laid end to end (``_put_tree``):
    tokens, parents, counts, depths, scores, offsets [num_rows + 1] and stats [num_rows, 3]
    (match_len, 0 for no tree; num_matches; num_sampled)."""
    size = num_rows * budget
    return (
        np.empty(size, np.int32),
        np.empty(size, np.int32),
        np.empty(size, np.int64),
        np.empty(size, np.int32),
        np.empty(size, np.float64),
        np.zeros(num_rows + 1, np.int64),
        np.zeros((num_rows, 3), np.int64),
    )


@numba.njit(nogil=True, cache=True)
def _put_tree(buffers, row, continuations, sep, budget, match_len, num_matches):
    """The ``budget`` heaviest trie nodes of ``continuations`` as tree ``row`` of ``buffers``
    (rows are put in order; ``offsets[row]`` is where this one starts), each scored its count over
    the rows counted."""
    tokens, parents, counts, depths, scores, offsets, stats = buffers
    start = offsets[row]
    t, p, c, d = _top_c_tree(continuations, sep, budget)
    stop = start + t.shape[0]
    tokens[start:stop], parents[start:stop], counts[start:stop], depths[start:stop] = t, p, c, d
    scores[start:stop] = c / float(max(continuations.shape[0], 1))
    offsets[row + 1] = stop
    stats[row, 0], stats[row, 1], stats[row, 2] = match_len, num_matches, continuations.shape[0]


def trees_from_buffers(buffers) -> list[DraftTree]:
    """The trees a batch kernel put in ``buffers`` (``_tree_buffers``), the empty tree where a
    row had no match (nothing sampled)."""
    tokens, parents, counts, depths, scores, offsets, stats = buffers
    return DraftTree.counted_batch(tokens, parents, counts, depths, scores, offsets.tolist(), stats.tolist())


@numba.njit(nogil=True, cache=True)
def _group_children(rows, perm, depth, start, stop, sep, heap, span):
    """Sort ``perm[start:stop]`` by the token in column ``depth`` and push one heap key per group
    of equal real tokens: the children of the node whose rows these are."""
    k = rows.shape[0]
    if stop - start == 1:  # one row (most nodes of a small tree): its next token is the only child
        if rows[perm[start], depth] != sep:
            heapq.heappush(heap, (k - 1) * span + depth * k + start)
        return
    keys = np.empty(stop - start, dtype=rows.dtype)
    for i in range(stop - start):
        keys[i] = rows[perm[start + i], depth]
    order = np.argsort(keys)
    perm[start:stop] = perm[start:stop][order]
    i = 0
    while i < stop - start:
        token = keys[order[i]]
        j = i + 1
        while j < stop - start and keys[order[j]] == token:
            j += 1
        if token != sep:
            # one int64 orders (-count, depth, first row): heaviest first, then shallower, then
            # lexicographic path (children ranges are laid out in token order inside their parent's)
            heapq.heappush(heap, (k - (j - i)) * span + depth * k + start + i)
        i = j


@numba.njit(nogil=True, cache=True)
def _top_c_tree(rows, sep, budget):
    k, m = rows.shape
    span = m * k  # key = (k - count) * span + depth * k + first_row
    perm = np.arange(k)
    heap = [np.int64(0)]  # typed by its seed, emptied at once
    heap.pop()
    _group_children(rows, perm, 0, 0, k, sep, heap, span)
    kept = np.empty(min(budget, span), dtype=np.int64)
    n = 0
    while n < kept.shape[0] and len(heap) > 0:
        key = heapq.heappop(heap)
        kept[n] = key
        n += 1
        position = key % span
        depth, start = position // k, position % k
        if depth + 1 < m and n < kept.shape[0]:
            _group_children(rows, perm, depth + 1, start, start + k - key // span, sep, heap, span)
    kept = kept[:n]
    positions = kept % span
    order = np.argsort(positions)  # (depth, first row) = BFS order, siblings by token
    positions = positions[order]
    counts = (k - kept[order] // span).astype(np.int64)
    tokens = np.empty(n, dtype=np.int32)
    parents = np.empty(n, dtype=np.int32)
    depths = np.empty(n, dtype=np.int32)
    for i in range(n):
        depth, start = positions[i] // k, positions[i] % k
        tokens[i] = rows[perm[start], depth]
        depths[i] = depth + 1
        # the parent is the kept node one level up whose rows contain this node's first row
        parents[i] = np.searchsorted(positions, positions[i] - k, side="right") - 1 if depth > 0 else -1
    return tokens, parents, counts, depths
