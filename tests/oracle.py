"""Brute-force reference implementations the engine is checked against (plain Python, no numpy tricks)."""

from __future__ import annotations

from collections import Counter


def brute_draft(docs, context, *, budget, max_depth, n_max, n_min):
    """REST's draft by exhaustive scan: longest context suffix (n_max..n_min) found inside a document,
    every continuation up to the document end, prefix counts, top-budget by (-count, depth, path),
    BFS order. Returns (tokens, parents, counts, match_len, num_matches)."""
    q = [int(t) for t in context][-n_max:]
    for n in range(len(q), n_min - 1, -1):
        suffix = q[-n:]
        conts = [
            tuple(doc[p + n : p + n + max_depth])
            for doc in docs
            for p in range(len(doc) - n + 1)
            if list(doc[p : p + n]) == suffix
        ]
        if conts:
            break
    else:
        return [], [], [], 0, 0
    counts = Counter(c[:d] for c in conts for d in range(1, len(c) + 1))
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]
    nodes = sorted(ranked, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(nodes)}
    tokens = [p[-1] for p in nodes]
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in nodes]
    return tokens, parents, [counts[p] for p in nodes], n, len(conts)
