"""Both engines in process: the query windows, draft latency, draft nodes, open time and the
resident memory opening adds."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common import open_draftretriever, rest_nodes, rest_paths, rest_search
from benchmarks.retrieval import (
    BUDGETS,
    GROWTH_BUDGET,
    NODES_BUDGET,
    OPEN_REPEATS,
    QUERY_TOKENS,
    REFERENCE_OPEN_REPEATS,
    ROUNDS,
    WARMUP_QUERIES,
)
from rest_spec.build_index.corpora import CorpusSpec, held_out_records
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore

DraftFn = Callable[[list[int], int], object]  # (context, budget) -> a draft, result unused


def sample_queries(spec: CorpusSpec, count: int, seed: int, tokenizer) -> list[list[int]]:
    """``count`` windows of ``QUERY_TOKENS`` tokens of the held-out records of ``spec`` (never
    indexed), ending at positions drawn uniformly over all held-out text (seeded)."""
    texts = [text for record in held_out_records(spec) for text in record.documents(spec.turns)]
    ids = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
    docs = [np.asarray(doc, dtype=np.int64) for doc in ids]
    windows = np.array([max(d.size - QUERY_TOKENS + 1, 0) for d in docs], dtype=np.int64)
    if windows.sum() == 0:
        raise ValueError(
            f"{spec.corpus}: the {spec.skip_last} held-out records hold no {QUERY_TOKENS}-token "
            "window; hold out more records"
        )
    flat, starts = np.concatenate(docs), np.concatenate(([0], np.cumsum([d.size for d in docs])[:-1]))
    ends = np.cumsum(windows)
    picks = np.random.default_rng(seed).integers(ends[-1], size=count)
    doc = np.searchsorted(ends, picks, side="right")  # window `pick` lies in document `doc`
    first = starts[doc] + picks - (ends[doc] - windows[doc])
    return flat[first[:, None] + np.arange(QUERY_TOKENS)].tolist()


def our_engine(store: Datastore) -> DraftFn:
    configs = {budget: DraftConfig(budget=budget) for budget in {*BUDGETS, GROWTH_BUDGET}}
    return lambda context, budget: store.draft(context, configs[budget])


def reference_engine(reader) -> DraftFn:
    return lambda context, budget: rest_search(reader, context, budget)


def time_calls(draft: DraftFn, queries: list[list[int]], budget: int) -> np.ndarray:
    """Seconds of each ``draft(query, budget)`` call."""
    seconds = np.empty(len(queries))
    for i, query in enumerate(queries):
        start = time.perf_counter()
        draft(query, budget)
        seconds[i] = time.perf_counter() - start
    return seconds


def latency_ms(seconds: np.ndarray) -> dict:
    return {
        "median_ms": 1e3 * float(np.median(seconds)),
        "p99_ms": 1e3 * float(np.percentile(seconds, 99)),
        "calls": int(seconds.size),
    }


def compare_latency(engines: dict[str, DraftFn], queries: list[list[int]], budgets: Sequence[int]) -> dict:
    """Per budget and engine, latency over ``ROUNDS`` alternating rounds (every engine over all
    queries, in turn), after each engine's warm-up on the first ``WARMUP_QUERIES`` queries."""
    for draft in engines.values():
        for budget in budgets:
            time_calls(draft, queries[:WARMUP_QUERIES], budget)
    figures = {}
    for budget in budgets:
        pooled: dict[str, list[np.ndarray]] = {name: [] for name in engines}
        for _ in range(ROUNDS):
            for name, draft in engines.items():
                pooled[name].append(time_calls(draft, queries, budget))
        figures[f"budget_{budget}"] = {name: latency_ms(np.concatenate(runs)) for name, runs in pooled.items()}
    return figures


def node_counts(store: Datastore, reader, queries: list[list[int]]) -> dict:
    """Draft nodes each engine returns for a budget of ``NODES_BUDGET`` on ``queries``."""
    config = DraftConfig(budget=NODES_BUDGET)
    ours = np.array([len(store.draft(q, config)) for q in queries])
    theirs = np.array([rest_nodes(rest_paths(reader, q, NODES_BUDGET)) for q in queries])

    def stats(nodes: np.ndarray) -> dict:
        return {
            "mean": float(nodes.mean()),
            "median": float(np.median(nodes)),
            "empty_percent": 100 * float(np.mean(nodes == 0)),
        }

    return {"budget": NODES_BUDGET, "ours": stats(ours), "draftretriever": stats(theirs)}


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def open_rss(engine: str, path: str) -> int:
    """Resident bytes added by opening ``path`` with ``engine`` ("ours" or "draftretriever"),
    from /proc/self/status after the imports; run in a fresh process."""
    if engine != "ours":
        import draftretriever  # noqa: F401 (imported before measuring, like ours)

    before = _vm_rss()
    opened = Datastore.open(path) if engine == "ours" else open_draftretriever(path)  # noqa: F841
    return _vm_rss() - before


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def rss_in_fresh_process(engine: str, path: Path) -> int:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(open_rss, engine, str(path)).result()


def open_figures(index: Path, index_bytes: int, reference: Path | None = None) -> dict:
    """Open time (median) and resident memory added by opening, for ours and, given its file,
    draftretriever's Reader."""
    figures = {
        "ours": {
            "open_seconds": median_seconds(lambda: Datastore.open(index).close(), OPEN_REPEATS),
            "rss_added_bytes": rss_in_fresh_process("ours", index),
            "index_bytes": index_bytes,
        }
    }
    if reference is not None:
        figures["draftretriever"] = {
            "open_seconds": median_seconds(lambda: open_draftretriever(reference), REFERENCE_OPEN_REPEATS),
            "rss_added_bytes": rss_in_fresh_process("draftretriever", reference),
            "index_bytes": reference.stat().st_size,
        }
    for engine in figures.values():
        engine["rss_added_percent_of_index"] = 100 * engine["rss_added_bytes"] / engine["index_bytes"]
    return figures
