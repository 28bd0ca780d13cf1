"""The only module that touches ``transformers`` cache internals.

Tree verification appends the pending token and all ``n`` tree nodes to the KV cache; afterwards
only the pending token and the accepted path are real context. ``compact_cache`` moves those slots
down in place and drops the rest, so the next forward sees exactly the cache plain decoding would
have built.

Supported: a ``DynamicCache`` whose layers are all plain ``DynamicLayer`` (transformers 5:
``cache.layers[i].keys / .values``, float [B, H, S, D]). Sliding-window layers evict old positions
and renumber slots, and quantized / linear-attention layers keep state outside ``.keys``, so
compacting them by slot index would be wrong: they are refused.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


class UnsupportedCacheError(TypeError):
    """The cache cannot be compacted by slot index (see module docstring)."""


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty ``DynamicCache`` for ``model``, refused up front if the model's layer types
    (read from its config) cannot be compacted."""
    cache = DynamicCache(config=model.config)
    check_cache(cache)
    return cache


def check_cache(cache: object) -> None:
    """Raise ``UnsupportedCacheError`` unless ``cache`` is a DynamicCache of plain DynamicLayers."""
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"tree verification needs a DynamicCache, got {type(cache).__name__}"
        )
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise UnsupportedCacheError(
                f"layer {index} uses sliding-window attention ({type(layer).__name__}); tree "
                "verification supports full-attention layers only"
            )
        if type(layer) is not DynamicLayer:
            raise UnsupportedCacheError(
                f"layer {index} has an unsupported cache layer type {type(layer).__name__}; "
                "tree verification supports plain DynamicLayer only"
            )


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by the cache (0 before the first forward)."""
    return cache.get_seq_length()


@torch.inference_mode()  # the cache holds inference tensors; in-place writes need the mode
def compact_cache(cache: DynamicCache, past_length: int, keep: Sequence[int] | np.ndarray) -> None:
    """Keep slots ``[0, L)`` and ``L + keep[i]``, moved to ``L + i``; drop everything after.

    ``keep`` int [k]: ascending offsets of the slots to keep, relative to ``past_length`` = L (the
    verified block starts at L; offset 0 is the pending token). Afterwards every layer holds
    L + k positions. The leading run with ``keep[i] == i`` is already in place and is not copied;
    the rest is gathered (``index_select`` allocates, so source and destination never alias) and
    written back with ``copy_``.
    """
    offsets = np.asarray(keep, dtype=np.int64)
    new_length = past_length + offsets.shape[0]
    misplaced = np.flatnonzero(offsets != np.arange(offsets.shape[0]))
    first = int(misplaced[0]) if misplaced.size else offsets.shape[0]
    index: torch.Tensor | None = None
    for layer in cache.layers:
        if not layer.is_initialized:  # layers sharing another layer's KV hold nothing
            continue
        if first < offsets.shape[0]:
            if index is None:  # one host->device copy of the gather index, shared by all layers
                index = torch.from_numpy(past_length + offsets[first:]).to(layer.keys.device)
            for states in (layer.keys, layer.values):  # [B, H, S, D]
                states[:, :, past_length + first : new_length].copy_(states.index_select(2, index))
        # Crop by slicing: DynamicLayer.crop's argument changed meaning within transformers 5.x
        # (absolute length -> negative count); the next update() concatenates onto the view.
        layer.keys = layer.keys[:, :, :new_length]
        layer.values = layer.values[:, :, :new_length]
