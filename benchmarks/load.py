"""Load on the datastore service: many clients drafting at once from one ``rest-datastore serve``.

    python -m benchmarks.load                          # 32 clients, 30 s, indexes/python-stdlib
    python -m benchmarks.load --index DIR --clients 64 --seconds 60 --processes 8

The server runs as its own process with its default limits. ``--clients`` clients (threads with a
channel each, spread over ``--processes`` client processes so the client side is not the
bottleneck) send Draft calls (default parameters, a 10 s deadline) round-robin over contexts cut
from the index's own documents (1..32 tokens, fixed seed): first ``--warmup`` seconds unmeasured,
then ``--seconds`` measured. Reports requests, requests/s, errors by status, p50/p99/max latency,
and the server's resident memory (VmRSS) after the warm-up and at the end; saves
benchmarks/results/load.json. The python-stdlib index is built first if it is missing (as the quick
start builds it). Figures mean something only on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness.report import REPO, RESULTS, save_report, start_run
from benchmarks.harness.servers import draft_requests, drive, start_server
from benchmarks.harness.sets import ensure_index

log = logging.getLogger("benchmarks.load")


def sample_contexts(index: Path, count: int = 2000, seed: int = 0) -> list[list[int]]:
    """``count`` slices of 1..32 tokens of the index's documents, uniformly placed (fixed seed)."""
    from rest_spec.datastore.index import Datastore

    with Datastore.open(index) as store:
        docs = [doc for doc in store.documents() if doc.size >= 2]
    rng = np.random.default_rng(seed)
    contexts = []
    for _ in range(count):
        doc = docs[rng.integers(len(docs))]
        end = int(rng.integers(1, doc.size + 1))
        contexts.append(doc[max(0, end - int(rng.integers(1, 33))) : end].tolist())
    return contexts


def run_load(
    index: Path, *, clients: int = 32, seconds: float = 30.0, processes: int = 4, warmup: float = 5.0, workers: int = 8
) -> dict:
    """``drive``'s figures against a fresh server (``workers`` threads) on ``index``."""
    requests = draft_requests(sample_contexts(index))
    with tempfile.TemporaryFile("w+") as server_log:
        proc, address = start_server(index, workers, server_log)
        try:
            figures = drive(
                address, requests, [proc.pid], clients=clients, seconds=seconds, processes=processes, warmup=warmup
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return {**figures, "server_workers": workers}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--index",
        type=Path,
        default=REPO / "indexes" / "python-stdlib",
        help="index to serve (default: %(default)s, built from this Python's standard library if missing)",
    )
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--processes", type=int, default=4, help="client processes the clients are spread over")
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds first")
    p.add_argument("--workers", type=int, default=8, help="the server's request threads")
    p.add_argument("--out", type=Path, default=RESULTS / "load.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    header = start_run("load", argv, format="%(asctime)s %(name)s: %(message)s")
    ensure_index(args.index, ["--corpus", "python-stdlib"])
    figures = run_load(
        args.index,
        clients=args.clients,
        seconds=args.seconds,
        processes=args.processes,
        warmup=args.warmup,
        workers=args.workers,
    )
    report = {
        **header,
        "index": str(args.index),
        **figures,
    }
    report["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    save_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
