"""The frequency-weighted trie of retrieved continuations and its top-c draft tree, vectorized.

REST counts, for every prefix of every retrieved continuation, how many continuations start with
it, and keeps the c heaviest prefixes. A child's count never exceeds its parent's, so with ties
broken by (shallower first, then lexicographic path) the kept set is prefix-closed: a tree.

Instead of building a pointer trie, the continuations are sorted lexicographically; then the trie
node "path of length d starting at sorted row i" exists exactly where row i starts a new run of
equal d-prefixes, and its count is the run's length. Everything is a handful of numpy calls over a
[k, m] array, with no Python loop over nodes.
"""

from __future__ import annotations

import numpy as np


def top_c_tree(continuations: np.ndarray, sep: int, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``budget`` heaviest trie nodes of ``continuations`` in BFS order.

    continuations  [k, m] unsigned ints; a row ends at its first ``sep`` (everything after it is
                   ``sep`` as well), ``sep`` being larger than every token id
    returns        (tokens int32 [n], parents int32 [n] (-1 = child of the root), counts int64 [n]),
                   n = min(budget, number of distinct prefixes); siblings in ascending token order
    """
    k, m = continuations.shape
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64))
    if k == 0 or m == 0 or budget <= 0:
        return empty
    rows = continuations[np.lexsort(continuations.T[::-1])]  # lexicographic row order

    # first[i] = first column where sorted rows i and i+1 differ (m if identical)
    differs = rows[1:] != rows[:-1]
    first = np.where(differs.any(axis=1), differs.argmax(axis=1), m)
    # run_start[d, i]: sorted row i starts a new run of equal (d+1)-prefixes
    run_start = np.ones((m, k), dtype=bool)
    run_start[:, 1:] = first[None, :] < np.arange(1, m + 1)[:, None]
    starts = np.flatnonzero(run_start)  # flat position d*k + i, in BFS order (depth, then path)
    counts = np.diff(np.append(starts, m * k))  # column 0 of each depth is a start: runs stay in their depth
    depth0, row = np.divmod(starts, k)
    tokens = rows[row, depth0]
    real = tokens != sep  # runs of rows that already ended are not nodes
    starts, counts, depth0, row, tokens = starts[real], counts[real], depth0[real], row[real], tokens[real]
    if starts.size == 0:
        return empty

    # Heaviest first; ties: shallower first, then lexicographic path (= sorted row). Parents win
    # every tie with their children, so the kept set is prefix-closed.
    keep = np.lexsort((row, depth0, -counts))[:budget]
    keep.sort()  # back to flat-position order = BFS order
    kept_starts, kept_depth0, kept_row = starts[keep], depth0[keep], row[keep]
    # A node's parent is the run one level up that contains its first row: the last start at or
    # before flat position (depth0 - 1) * k + row. It is kept, so it is found among kept starts.
    parent_flat = (kept_depth0 - 1) * k + kept_row
    parents = np.searchsorted(kept_starts, parent_flat, side="right") - 1
    parents[kept_depth0 == 0] = -1
    return tokens[keep].astype(np.int32), parents.astype(np.int32), counts[keep].astype(np.int64)
