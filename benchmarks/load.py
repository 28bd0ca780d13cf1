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
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, RESULTS, ensure_index, save_report, start_run

log = logging.getLogger("benchmarks.load")

CALL_TIMEOUT = 10.0
SETUP_SECONDS = 120.0  # for client processes to start, and the server to print its address
DRAFT_METHOD = "/rest.datastore.v1.Datastore/Draft"


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


def server_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def start_datastore(args: Sequence, log_file) -> tuple[subprocess.Popen, str]:
    """``rest-datastore ARGS`` (``serve ...``, ``route ...``; give it ``--port 0`` for a free port),
    its log to ``log_file``; returns the process and the address it printed once ready."""
    command = [str(arg) for arg in args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rest_spec.datastore", *command],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        log_file.seek(0)
        raise RuntimeError(f"rest-datastore {' '.join(command)} did not start: {log_file.read().strip()}")
    return proc, line.split()[-1]


def start_server(index: Path, workers: int, log_file, port: int = 0) -> tuple[subprocess.Popen, str]:
    """``rest-datastore serve`` of ``index`` on loopback ``port`` (0: a free one), as ``start_datastore``."""
    return start_datastore(["serve", "--index", index, "--port", port, "--workers", workers], log_file)


def client_process(
    address: str, requests: list[bytes], clients: int, first: int, warmup: float, seconds: float, barrier, results
) -> None:
    """``clients`` threads drafting round-robin (client k starting at ``first + k`` requests in);
    after the barrier, ``warmup`` seconds unmeasured, then ``seconds`` measured. Puts (calls,
    {status: count} of failed calls, latencies in seconds) on ``results``."""
    import grpc

    channels = [grpc.insecure_channel(address) for _ in range(clients)]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=SETUP_SECONDS)
    barrier.wait()
    start = time.monotonic() + warmup
    end = start + seconds
    outcomes: list[tuple[int, Counter, list[float]]] = []

    def client(channel: grpc.Channel, i: int) -> None:
        draft = channel.unary_unary(DRAFT_METHOD)  # bytes in and out: the client side stays cheap
        calls, errors, latencies = 0, Counter(), []
        while (began := time.monotonic()) < end:
            try:
                draft(requests[i % len(requests)], timeout=CALL_TIMEOUT)
                failed = None
            except grpc.RpcError as exc:
                failed = exc.code().name
            i += 1
            if began >= start:
                calls += 1
                latencies.append(time.monotonic() - began)
                if failed:
                    errors[failed] += 1
        outcomes.append((calls, errors, latencies))

    threads = [threading.Thread(target=client, args=(channel, first + k)) for k, channel in enumerate(channels)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for channel in channels:
        channel.close()
    results.put(
        (
            sum(o[0] for o in outcomes),
            sum((o[1] for o in outcomes), Counter()),
            [latency for o in outcomes for latency in o[2]],
        )
    )


def drive(
    address: str,
    requests: list[bytes],
    pids: Sequence[int],
    *,
    clients: int,
    seconds: float,
    processes: int,
    warmup: float,
) -> dict:
    """The figures of ``clients`` clients in ``processes`` processes sending ``requests`` (serialized
    Draft requests) to the server at ``address`` for ``seconds`` after ``warmup`` seconds; the
    resident memory is that of the processes ``pids`` together (the server, or a router and its
    shard servers)."""
    processes = min(processes, clients)
    shares = [clients // processes + (k < clients % processes) for k in range(processes)]
    spawn = multiprocessing.get_context("spawn")  # no gRPC state forked into the clients
    barrier, results = spawn.Barrier(processes + 1), spawn.Queue()
    pool = [
        spawn.Process(
            target=client_process,
            args=(address, requests, share, sum(shares[:k]) * 97, warmup, seconds, barrier, results),
        )
        for k, share in enumerate(shares)
    ]
    for p in pool:
        p.start()
    try:
        barrier.wait(timeout=SETUP_SECONDS)
        time.sleep(warmup)
        rss_before = sum(map(server_rss_mb, pids))
        time.sleep(seconds)
        rss_after = sum(map(server_rss_mb, pids))
        try:  # a client that fails prints its traceback and never reports
            outcomes = [results.get(timeout=CALL_TIMEOUT + SETUP_SECONDS) for _ in pool]
        except queue.Empty:
            raise RuntimeError(f"a client process of {address} did not report (its traceback is above)") from None
    finally:
        for p in pool:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    calls = sum(o[0] for o in outcomes)
    errors = sum((o[1] for o in outcomes), Counter())
    latencies_ms = np.array([latency for o in outcomes for latency in o[2]]) * 1000
    return {
        "clients": clients,
        "client_processes": processes,
        "warmup_seconds": warmup,
        "seconds": seconds,
        "requests": calls,
        "requests_per_second": round(calls / seconds, 1),
        "errors": sum(errors.values()),
        "errors_by_status": dict(errors),
        "latency_ms": {
            q: round(float(np.percentile(latencies_ms, p)), 2) if calls else None
            for q, p in (("p50", 50), ("p99", 99), ("max", 100))
        },
        "server_rss_mb": {
            "after_warmup": round(rss_before, 1),
            "after": round(rss_after, 1),
            "growth": round(rss_after - rss_before, 1),
        },
    }


def draft_requests(contexts: list[list[int]], config=None) -> list[bytes]:
    """Serialized Draft requests of ``contexts`` with ``config`` (default: the default parameters)."""
    from rest_spec.common.types import DraftConfig
    from rest_spec.datastore import wire

    return [wire.draft_request(c, config or DraftConfig()).SerializeToString() for c in contexts]


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
