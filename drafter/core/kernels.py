"""``python -m rest_spec.drafter.core.kernels``: compile every numba kernel drafting runs (the index's
retrieval, the store of outputs' and the request's own text's matches, the adaptive drafter's merge,
chain choice and batch step) into this environment's numba cache, so that no server start, build,
engine or first draft pays for it later. The setup scripts run it; benchmarks run it
before they time anything (an edit of a kernel's module invalidates its cache).

numba compiles on one thread, so the command spreads the modules over processes of their own, one
per core the process may use (``--processes``): a fresh install on two cores compiles in a little
more than half the time of one process (the quick start's longest step after pip). Processes
compiling at once are safe: numba writes each cache entry to a file of its own and renames it into
place."""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

# Each module's ``compile_kernels()``, the dearest first so that processes finish together.
KERNEL_GROUPS = (
    "rest_spec.datastore.index",
    "rest_spec.drafter.core.batch_step",
    "rest_spec.drafter.core.merge",
    "rest_spec.drafter.core.request_matcher",
    "rest_spec.datastore.bigram",
)


def compile_group(module: str) -> float:
    """``module``'s kernels compiled into the cache; the seconds it took."""
    return importlib.import_module(module).compile_kernels()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_kernels(processes: int = 1) -> float:
    """Compile them all, in this process (``processes`` 1, as the benchmarks call it: under a second
    once cached) or spread over up to ``processes`` fresh ones; returns the wall seconds it took."""
    start = time.perf_counter()
    processes = max(1, min(processes, len(KERNEL_GROUPS)))
    if processes == 1:
        for module in KERNEL_GROUPS:
            compile_group(module)
    else:  # spawned, not forked: a fresh interpreter per process, no inherited numba or thread state
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(compile_group, KERNEL_GROUPS))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rest_spec.drafter.core.kernels",
        description="Compile every numba kernel drafting runs into this environment's numba cache.",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=usable_cores(),
        help="compile in up to this many processes at once (default: the cores this process may use)",
    )
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    print(f"kernels compiled in {compile_kernels(args.processes):.1f} s")


if __name__ == "__main__":
    main()
