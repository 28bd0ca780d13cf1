"""``python -m rest_spec.drafter.core.kernels``: compile every numba kernel drafting runs (the index's
retrieval, the adaptive drafter's merge and chain choice) into this environment's numba cache, so that no server
start, build, engine or first draft pays for it later. The setup scripts run it; benchmarks run it
before they time anything (an edit of a kernel's module invalidates its cache)."""

from __future__ import annotations

from rest_spec.datastore.index import compile_kernels as compile_retrieval
from rest_spec.drafter.core.cost import compile_kernels as compile_chains
from rest_spec.drafter.core.merge import compile_kernels as compile_merge


def compile_kernels() -> float:
    """Compile them all; returns the seconds it took (under a second once cached)."""
    return compile_retrieval() + compile_merge() + compile_chains()


if __name__ == "__main__":
    print(f"kernels compiled in {compile_kernels():.1f} s")
