"""REST's own engine, ``draftretriever``, queried the way REST's code does (``rest_search``), and as a
drafter over exactly our tokens (``DraftRetriever``): what ``benchmarks.retrieval``,
``benchmarks.draft_quality``, ``benchmarks.tradeoff`` and ``benchmarks.merge_rules`` set ours against."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

REST_N_MAX = 16  # the longest context suffix REST looks up


REST_SUFFIX_LENGTHS = range(REST_N_MAX, 1, -1)  # REST's retrieval loop: 16 down to 2


REST_SEARCH = {"k": 5000, "long": 10}  # REST's draftretriever.search arguments (choices = budget)


def write_draftretriever(store, path: Path | str) -> None:
    """draftretriever's index file at ``path`` over every document of ``store`` (a ``Datastore``),
    in build order: REST's engine over exactly our tokens."""
    import draftretriever

    writer = draftretriever.Writer(file_path=str(path), vocab_size=store.vocab_size)
    for document in store.documents():
        writer.add_entry(document.tolist())
    writer.finalize()


def open_draftretriever(path: Path | str):
    """draftretriever's Reader of ``path`` (it decompresses the tokens and builds the suffix array
    at every load)."""
    import draftretriever

    return draftretriever.Reader(index_file_path=str(path))


def rest_search(reader, context: Sequence[int], budget: int) -> list[list[int]]:
    """REST's retrieval: the paths of the first suffix length from 16 down to 2 with any result
    (-2 pads short paths)."""
    for n in REST_SUFFIX_LENGTHS:
        if len(context) >= n:
            paths = reader.search(list(context[-n:]), choices=budget, **REST_SEARCH)[0]
            if paths:
                return paths
    return []


def rest_paths(reader, context: Sequence[int], budget: int) -> list[list[int]]:
    """``rest_search``'s non-empty paths without their padding."""
    paths = ([t for t in path if t >= 0] for path in rest_search(reader, context, budget))
    return [path for path in paths if path]


def rest_nodes(paths: list[list[int]]) -> int:
    """Nodes of the tree REST builds from ``rest_paths``: their distinct prefixes."""
    return len({tuple(path[:d]) for path in paths for d in range(1, len(path) + 1)})


class DraftRetriever:
    """REST's engine as a drafter (``draft(context, config)``) over the documents of a ``Datastore``:
    ``config.budget`` paths, made one tree (``top_c_tree`` keeps every distinct prefix)."""

    def __init__(self, store, workdir: Path) -> None:
        path = Path(workdir) / "draftretriever.idx"
        write_draftretriever(store, path)
        self.reader = open_draftretriever(path)

    def draft(self, context: Sequence[int], config):
        from rest_spec.common.types import DraftTree
        from rest_spec.datastore.bigram import SEP
        from rest_spec.datastore.trie import top_c_tree

        paths = rest_paths(self.reader, context, config.budget)
        if not paths:
            return DraftTree.empty()
        rows = np.full((len(paths), max(map(len, paths))), SEP, dtype=np.uint32)
        for row, path in zip(rows, paths):
            row[: len(path)] = path
        return DraftTree(*top_c_tree(rows, SEP, rows.size))
