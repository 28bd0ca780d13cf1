"""A retrieval engine timed: ours (a ``Datastore``) and REST's ``draftretriever`` in process -- the
query windows (``sample_queries``), draft latency in alternating rounds (``compare_latency``), draft
nodes, open time and the resident memory opening adds (``open_figures``) -- and ours behind
``rest-datastore serve`` (draftretriever has no server): the gRPC round trip with one client and the
throughput of 1, 2 and 4 client processes (``grpc_figures``). ``benchmarks.retrieval`` runs them all;
``benchmarks.code_scale`` and ``benchmarks.sharded`` some."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.harness.draftretriever import REST_N_MAX, open_draftretriever, rest_nodes, rest_paths, rest_search
from benchmarks.harness.servers import start_datastore
from rest_spec.build_index.corpora import CorpusSpec, held_out_records
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore

log = logging.getLogger(__name__)

QUERY_TOKENS = REST_N_MAX  # the longest suffix either engine looks at
BUDGETS = (16, 64)
NODES_BUDGET = 64
GRPC_BUDGET = 64
GROWTH_BUDGET = 64
WARMUP_QUERIES = 200
ROUNDS = 3
OPEN_REPEATS = 10
REFERENCE_OPEN_REPEATS = 3  # draftretriever builds its suffix array at every load: seconds each
CLIENTS = (1, 2, 4)
CLIENT_SETUP_SECONDS = 300  # a client process's start, imports and warm-up, at most

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


def grpc_client(address: str, queries: list[list[int]], offset: int, seconds: float, barrier, results) -> None:
    """One client process: warm up, wait for the others, then draft round-robin from ``offset``
    for ``seconds``; puts (calls, elapsed seconds, per-call seconds) on ``results``."""
    from rest_spec.datastore.client import DatastoreClient

    config = DraftConfig(budget=GRPC_BUDGET)
    with DatastoreClient(address) as client:
        for query in queries[:WARMUP_QUERIES]:
            client.draft(query, config)
        barrier.wait()
        latencies, i = [], offset
        start = time.perf_counter()
        deadline = start + seconds
        while (now := time.perf_counter()) < deadline:
            client.draft(queries[i % len(queries)], config)
            latencies.append(time.perf_counter() - now)
            i += 1
        elapsed = time.perf_counter() - start
    results.put((len(latencies), elapsed, latencies))


def grpc_figures(index: Path, queries: list[list[int]], seconds: float) -> dict:
    """Round trip and throughput with 1, 2 and 4 concurrent client processes (budget 64)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryFile("w+") as server_log:
        proc, address = start_datastore(["serve", "--index", index, "--port", 0], server_log)
    figures = {"budget": GRPC_BUDGET, "seconds_per_run": seconds, "clients": {}}
    try:
        for clients in CLIENTS:
            barrier, results = ctx.Barrier(clients), ctx.Queue()
            workers = [
                ctx.Process(
                    target=grpc_client, args=(address, queries, k * len(queries) // clients, seconds, barrier, results)
                )
                for k in range(clients)
            ]
            for worker in workers:
                worker.start()
            try:  # a client that fails prints its traceback and never reports
                outcomes = [results.get(timeout=seconds + CLIENT_SETUP_SECONDS) for _ in workers]
            except queue.Empty:
                for worker in workers:
                    worker.terminate()
                raise RuntimeError(f"a gRPC client of {address} did not report (its traceback is above)") from None
            for worker in workers:
                worker.join()
            latencies = np.concatenate([np.asarray(lat) for _, _, lat in outcomes])
            figures["clients"][str(clients)] = {
                "requests_per_second": sum(calls / elapsed for calls, elapsed, _ in outcomes),
                "round_trip": latency_ms(latencies),
            }
            log.info(
                "gRPC %d client(s): %.0f requests/s", clients, figures["clients"][str(clients)]["requests_per_second"]
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    single = figures["clients"]["1"]["requests_per_second"]
    for entry in figures["clients"].values():
        entry["throughput_vs_1_client"] = entry["requests_per_second"] / single
    return figures
