"""Ours behind ``rest-datastore serve`` (draftretriever has no server): the gRPC round trip with one
client and the throughput of 1, 2 and 4 client processes."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO
from benchmarks.retrieval import CLIENT_SETUP_SECONDS, CLIENTS, GRPC_BUDGET, WARMUP_QUERIES
from benchmarks.retrieval.engines import latency_ms
from rest_spec.common.types import DraftConfig

log = logging.getLogger(__name__)


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


def start_server(index: Path) -> tuple[subprocess.Popen, str]:
    """``rest-datastore serve`` on a free port; returns the process and the address it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rest_spec.datastore", "serve", "--index", str(index), "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"rest-datastore serve --index {index} did not start (exit {proc.returncode}): {line!r}")
    return proc, line.split()[-1]


def grpc_figures(index: Path, queries: list[list[int]], seconds: float) -> dict:
    """Round trip and throughput with 1, 2 and 4 concurrent client processes (budget 64)."""
    ctx = multiprocessing.get_context("spawn")
    proc, address = start_server(index)
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
