"""One-off check (benchmarks/README.md, "A noisy cost table", run 7): does a 16-token verification
step of the packaged SmolLM2 cost more when the tree fills the block than when it is padded to it?
Times ``verify_trees`` as ``drafter.hf.measure.verify_timer`` does (transposed layout, the cache cut
back after each run), median of 9 runs after 3.

    .venv/bin/python benchmarks/results/cost_noise_pad_check.py
"""

import statistics
import time

import numpy as np
import torch

from rest_spec.drafter.core.cost import BlockShape
from rest_spec.drafter.hf.internals import forward_with_cache
from rest_spec.drafter.hf.kv_cache import CacheRows, compact_cache, new_cache
from rest_spec.drafter.hf.measure import measured_tree
from rest_spec.drafter.hf.model import load_model
from rest_spec.drafter.hf.verify import verify_trees


def milliseconds(cache, rows: CacheRows, contexts: list[list[int]], n: int, block: int) -> float:
    times = []
    for _ in range(12):
        start = time.perf_counter()
        verify_trees(model, cache, rows, contexts, [measured_tree(n)], shape=BlockShape(block, True))
        compact_cache(cache, rows, [np.zeros(0, np.int64)])
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[3:])


model = load_model(None)
for context_length in (256, 768):
    context = torch.randint(
        int(model.config.vocab_size), (1, context_length + 1), generator=torch.Generator().manual_seed(0)
    )
    cache = new_cache(model)
    with torch.inference_mode():
        forward_with_cache(model, cache, input_ids=context[:, :-1])
    rows, contexts = CacheRows.full(1, context_length), context.tolist()
    for n in (5, 11, 16):
        print(
            f"context {context_length}: a tree of {n - 1} nodes at block 16 "
            f"{milliseconds(cache, rows, contexts, n, 16):.1f} ms, at its own block {n} "
            f"{milliseconds(cache, rows, contexts, n, n):.1f} ms"
        )
