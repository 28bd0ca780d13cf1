"""The processes a benchmark serves drafts from, and the load it drives at them: ``rest-datastore``
servers and routers (``start_datastore``, ``start_server``), the latency proxy in front of one
(``start_proxy``, ``benchmarks.harness.latency_proxy``), stopping any of them (``stop``), and
clients in processes of their own sending Draft calls (``draft_requests``, ``drive``)."""

from __future__ import annotations

import multiprocessing
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.report import REPO

CALL_TIMEOUT = 10.0
SETUP_SECONDS = 120.0  # for client processes to start, and the server to print its address
DRAFT_METHOD = "/rest.datastore.v1.Datastore/Draft"


def start_proxy(target: str, rtt_ms: float) -> tuple[subprocess.Popen, str]:
    """A ``benchmarks.harness.latency_proxy`` process adding ``rtt_ms`` in front of ``target``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.harness.latency_proxy", "--target", target, "--rtt-ms", str(rtt_ms)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"latency proxy for {target} did not start")
    return proc, line.split()[-1]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
