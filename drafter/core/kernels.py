"""``python -m rest_spec.drafter.core.kernels``: compile every numba kernel drafting runs (the index's
retrieval, the store of outputs' and the request's own text's matches, the adaptive drafter's merge,
chain choice and batch step) into this environment's numba cache, so that no server start, build,
engine or first draft pays for it later. The setup scripts run it; benchmarks run it
before they time anything (an edit of a kernel's module invalidates its cache)."""

from __future__ import annotations

from rest_spec.datastore.bigram import compile_kernels as compile_bigram
from rest_spec.datastore.index import compile_kernels as compile_retrieval
from rest_spec.drafter.core.batch_step import compile_kernels as compile_batch_step
from rest_spec.drafter.core.merge import compile_kernels as compile_merge
from rest_spec.drafter.core.request_matcher import compile_kernels as compile_request_matcher


def compile_kernels() -> float:
    """Compile them all; returns the seconds it took (under a second once cached)."""
    return compile_retrieval() + compile_bigram() + compile_request_matcher() + compile_merge() + compile_batch_step()


if __name__ == "__main__":
    print(f"kernels compiled in {compile_kernels():.1f} s")
