"""The KV cache's slots: compaction after verification, batch rows, in-place appends.

Tree verification appends the pending token and all tree nodes to the KV cache; afterwards only
the pending token and the accepted path are real context. ``compact_cache`` moves those slots down
in place and drops the rest, so the next forward sees exactly the cache plain decoding would have
built.

Batches: the cache is one rectangular [B, H, S, D] tensor per layer, but rows hold different
numbers of tokens (prompts of different lengths, different accepted lengths per step).
``CacheRows`` records where each row's tokens are: slots ``[start[b], end[b])``, contiguous. Slots
before ``start`` are left padding, slots from ``end`` to S are holes left by rows that accepted
fewer tokens than the longest row; both are masked out of attention (``tree_attention``) and
position ids count only a row's own tokens. Every verification block is appended at slot S for
all rows, and compaction moves each row's accepted slots down to its own ``end``, so holes never
pile up inside a row: S is always the longest row's end, the least a rectangular cache can hold.

Supported: a ``DynamicCache`` whose layers are all plain ``DynamicLayer`` (transformers 5:
``cache.layers[i].keys / .values``, float [B, H, S, D]), or this module's ``ReservedLayer``.
Sliding-window layers evict old positions and renumber slots, and quantized / linear-attention
layers keep state outside ``.keys``, so compacting them by slot index would be wrong: they are
refused.

``new_cache`` builds its layers as ``ReservedLayer``: ``DynamicLayer`` appends a step's q slots by
concatenating, which copies the whole cache every forward, a cost that grows with the context
(measured by ``benchmarks/verify_cost.py``'s profile, recorded in ``benchmarks/README.md`` under
"The verifier's cost"); a ``ReservedLayer`` writes the q slots into spare capacity in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from rest_spec.drafter.hf.internals import DynamicCache, DynamicLayer


class UnsupportedCacheError(TypeError):
    """The cache cannot be compacted by slot index (see module docstring)."""


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` and ``values`` are leading slices of buffers with spare
    slots: an update writes its slots in place, and only a full buffer is copied (into one half
    again as long). Everything else, the slicing crop of ``compact_cache`` included, works on the slices
    exactly as on ``DynamicLayer``'s tensors; a slice that is not a prefix of the buffer (after
    ``select_rows``, say) just starts a new buffer."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_buffer = _append(self.keys, self._key_buffer, key_states)
        self.values, self._value_buffer = _append(self.values, self._value_buffer, value_states)
        return self.keys, self.values


def _append(states: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cat([states, new], dim=2)`` as a slice of ``buffer`` (or of a new, larger buffer)."""
    length = states.shape[2] if states.dim() == 4 else 0
    needed = length + new.shape[2]
    in_buffer = (
        buffer is not None
        and length > 0
        and states.data_ptr() == buffer.data_ptr()
        and states.stride() == buffer.stride()
        and buffer.shape[:2] == new.shape[:2]
        and buffer.shape[2] >= needed
    )
    if not in_buffer:
        batch, heads, _, dim = new.shape
        buffer = new.new_empty(batch, heads, needed + max(needed // 2, 64), dim)
        if length:
            buffer[:, :, :length] = states
    buffer[:, :, length:needed] = new
    return buffer[:, :, :needed], buffer


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for ``model`` of ``ReservedLayer``s, refused up front if the model's layer
    types (read from its config) cannot be compacted."""
    cache = DynamicCache(config=model.config)
    check_cache(cache)
    cache.layers = [ReservedLayer() for _ in cache.layers]
    return cache


def check_cache(cache: object) -> None:
    """Raise ``UnsupportedCacheError`` unless ``cache`` is a DynamicCache of plain DynamicLayers."""
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(f"tree verification needs a DynamicCache, got {type(cache).__name__}")
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise UnsupportedCacheError(
                f"layer {index} uses sliding-window attention ({type(layer).__name__}); tree "
                "verification supports full-attention layers only"
            )
        if type(layer) not in (DynamicLayer, ReservedLayer):
            raise UnsupportedCacheError(
                f"layer {index} has an unsupported cache layer type {type(layer).__name__}; "
                "tree verification supports plain DynamicLayer (or ReservedLayer) only"
            )


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by the cache (0 before the first forward)."""
    return cache.get_seq_length()


@dataclass(frozen=True, eq=False)
class CacheRows:
    """Where each batch row's tokens are in the cache: row ``b`` holds slots ``[start[b], end[b])``.

    start  int64 [B]  first slot of the row (its left padding comes before)
    end    int64 [B]  one past the row's last slot; slots from here to ``length`` are holes
    """

    start: np.ndarray
    end: np.ndarray

    @classmethod
    def full(cls, batch: int, length: int) -> CacheRows:
        """``batch`` rows that all fill slots ``[0, length)`` (no padding, no holes)."""
        return cls(np.zeros(batch, np.int64), np.full(batch, length, np.int64))

    @property
    def batch(self) -> int:
        return int(self.start.shape[0])

    @property
    def length(self) -> int:
        """Slots in the cache tensors: the longest row's end (0 for an empty cache)."""
        return int(self.end.max(initial=0))

    @property
    def positions(self) -> np.ndarray:
        """int64 [B]: tokens each row holds, i.e. the position id of its next token."""
        return self.end - self.start


@torch.inference_mode()  # the cache holds inference tensors; in-place writes need the mode
def compact_cache(cache: DynamicCache, rows: CacheRows, keep: Sequence[np.ndarray]) -> CacheRows:
    """Keep each row's accepted slots of the verification block and drop the rest of the block.

    The block of q slots starts at ``S = rows.length`` (the same slot for every row). ``keep[b]``
    int [k_b]: ascending offsets into the block of the slots row ``b`` keeps (offset 0 is the
    pending token); they move to ``rows.end[b] + i``. Afterwards the cache holds
    ``max(end + k)`` slots; returns the new ``CacheRows``. Slots already in place are not moved;
    the rest are gathered (which allocates, so source and destination never alias) and scattered
    back, all rows in one ``gather`` + ``scatter_`` per tensor.
    """
    past_length = rows.length
    counts = np.array([len(k) for k in keep], dtype=np.int64)
    width = int(counts.max(initial=0))
    # dst[b, i] = end[b] + i. Row b's padding columns i >= k_b copy slot end[b] + i onto itself:
    # a harmless no-op on a hole (or a dropped block slot) that no real entry of the row writes.
    dst = rows.end[:, None] + np.arange(width)  # [B, width]
    src = dst.copy()
    for b, offsets in enumerate(keep):
        src[b, : counts[b]] = past_length + np.asarray(offsets, dtype=np.int64)
    moving = np.flatnonzero((src != dst).any(axis=0))  # columns where some row's slot moves
    if moving.size:
        src, dst = src[:, moving[0] :], dst[:, moving[0] :]
    new_rows = CacheRows(rows.start, rows.end + counts)
    new_length = new_rows.length
    indices: tuple[torch.Tensor, torch.Tensor] | None = None
    for layer in cache.layers:
        if not layer.is_initialized:  # layers sharing another layer's KV hold nothing
            continue
        if moving.size:
            batch, heads, _, dim = layer.keys.shape  # [B, H, S + q, D]
            if indices is None:  # one host->device copy of both indices, shared by all layers
                both = torch.from_numpy(np.stack([src, dst])).to(layer.keys.device)
                indices = both[0], both[1]
            shape = (batch, heads, src.shape[1], dim)
            src_index, dst_index = (i[:, None, :, None].expand(shape) for i in indices)
            for states in (layer.keys, layer.values):
                states.scatter_(2, dst_index, states.gather(2, src_index))
        # Crop by slicing: DynamicLayer.crop's argument changed meaning within transformers 5.x
        # (absolute length -> negative count); the next update() concatenates onto the view.
        layer.keys = layer.keys[:, :, :new_length]
        layer.values = layer.values[:, :, :new_length]
    return new_rows


@torch.inference_mode()
def select_rows(cache: DynamicCache, rows: CacheRows, keep: np.ndarray) -> CacheRows:
    """Keep only batch rows ``keep`` (int [B'], ascending, not empty) of the cache, e.g. to drop
    finished rows; slots that no kept row uses (padding all of them share, trailing holes) go too.
    Returns the kept rows' ``CacheRows``, in the order of ``keep``."""
    keep = np.asarray(keep, dtype=np.int64)
    start, end = rows.start[keep], rows.end[keep]
    first, last = int(start.min()), int(end.max())
    index: torch.Tensor | None = None
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if index is None:
            index = torch.from_numpy(keep).to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, index)[:, :, first:last]
        layer.values = layer.values.index_select(0, index)[:, :, first:last]
    return CacheRows(start - first, end - first)
