"""Draft trees as the tensors of one verification forward pass (tree attention), one tree per row.

The verifier runs ``q`` query positions per row at once: the pending token (the row's last
committed token, not yet in the KV cache) at flat position 0, then the row's ``n`` tree nodes in
BFS order at flat positions ``1..n`` (node ``i`` of the tree is flat position ``i + 1``), then
padding up to ``q = max n + 1`` over the batch. A position may attend to its row's cached tokens
(``kv_cache.CacheRows``: not the row's left padding or holes), to itself and to its ancestors; the
pending token is every node's ancestor. Position ids are the row's token count plus the depth
(pending at depth 0), so each node sees exactly the positions and keys it would see if its path
had been decoded one token at a time. A padding position sees its row's cache and itself, and no
position sees it.

When every row's tree is a chain and every row's cache is whole (no left padding, no holes), that
mask is plain causal attention for every position that matters (a row's padding trails its chain,
so no node sees it, and what padding sees is never used); ``TreeInputs.causal`` says so, and the
verifier then lets the model build its own causal mask (its native decoding path, which fused
attention kernels serve best) instead of passing a custom one. A block may be padded past its
longest tree (``size``) when the measured cost says a larger block runs faster.

Everything is built on the host in numpy (the trees arrive there from the drafter) and crosses to
the device as ONE packed int64 copy; the float mask is expanded on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rest_spec.common.types import DraftTree
from rest_spec.drafter.hf.kv_cache import CacheRows

# Columns of the packed host buffer, before the q ancestor columns.
_IDS, _POSITIONS, _PARENTS, _DEPTHS, _CACHE_START, _CACHE_END, _ANCESTORS = range(7)
PADDING_DEPTH = -1


def ancestor_matrix(parents: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """bool [q, q], q = n + 1: ``a[i, j]`` is True iff flat position ``j`` is ``i`` or an ancestor of
    ``i``; column 0 (the pending token) is True in every row.

    ``parents`` int32 [n] (-1 = child of the root) and ``depths`` int32 [n] (root children = 1) come
    from a ``DraftTree``. Built one depth level at a time: a node's row is its parent's row plus
    itself, and every parent's row is complete once the level above is done (<= max_depth steps of
    fancy indexing instead of a walk per node).
    """
    n = parents.shape[0]
    parent_flat = parents.astype(np.int64) + 1  # [n]; the root (-1) becomes the pending token (0)
    ancestors = np.eye(n + 1, dtype=bool)
    ancestors[:, 0] = True  # depth-1 rows are now complete: self + pending
    for depth in range(2, int(depths.max(initial=0)) + 1):
        rows = np.flatnonzero(depths == depth) + 1
        ancestors[rows] |= ancestors[parent_flat[rows - 1]]
    return ancestors


@dataclass(frozen=True, eq=False)
class TreeInputs:
    """Device tensors for verifying one draft tree per batch row, plus their packed host copy.

    input_ids     int64 [B, q]     pending token, the tree tokens in BFS order, padding (0)
    position_ids  int64 [B, q]     the row's token count + depth (padding: + 0)
    parent_index  int64 [B, q]     flat position of each position's parent (0 for the pending token
                                   and for padding)
    depths        int64 [B, q]     0 for the pending token, 1 for children of the root, ...;
                                   ``PADDING_DEPTH`` (-1) for padding
    ancestors     bool  [B, q, q]  see ``ancestor_matrix``; a padding position has itself only
    cache_start   int64 [B, 1]     the row's cached tokens are slots [cache_start, cache_end)
    cache_end     int64 [B, 1]
    past_length   int              S, slots in the KV cache (the same for every row)
    causal        bool             causal attention is exact: every row is a chain on a cache
                                   without padding or holes
    host          int64 [B, q, 6 + q] the same values on the host, packed (see ``paths``)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent_index: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    cache_start: torch.Tensor
    cache_end: torch.Tensor
    past_length: int
    causal: bool
    host: np.ndarray

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The 4D additive mask ``[B, 1, q, S + q]`` in ``dtype`` (see ``tree_attention_mask``)."""
        slots = torch.arange(self.past_length, device=self.input_ids.device)
        visible = (slots >= self.cache_start) & (slots < self.cache_end)  # [B, S]
        return tree_attention_mask(self.ancestors, visible, dtype)

    def host_depths(self, row: int) -> np.ndarray:
        """int64 [q]: the depths of row ``row`` on the host (``PADDING_DEPTH`` for padding)."""
        return self.host[row, :, _DEPTHS]

    def paths(self, row: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions of row ``row`` at ``depth`` >= 0 and the draft tokens on their paths.

        Returns ``(positions, tokens)``: int64 [m] flat positions, and int64 [m, depth] the tokens
        from the root's child down to each position itself (the pending token excluded), i.e.
        what plain decoding would have appended to the context before predicting there.
        """
        positions = np.flatnonzero(self.host_depths(row) == depth)
        on_path = self.host[row, positions, _ANCESTORS + 1 :].astype(bool)  # [m, q - 1]
        # Ancestors come before descendants in flat order, so row-major selection is path order.
        ids = np.broadcast_to(self.host[row, 1:, _IDS], on_path.shape)
        return positions, ids[on_path].reshape(positions.shape[0], depth)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, ``finfo(dtype).min`` elsewhere. Additive floats work for eager
    attention (scores + mask) and SDPA (a float ``attn_mask`` is added to the scores); ``min``
    rather than ``-inf`` keeps a softmax row finite even where a row is fully masked (a padding
    query of a left-padded prompt)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def tree_attention_mask(ancestors: torch.Tensor, cache_visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask float ``dtype`` [B, 1, q, S + q] for a verification block.

    ``ancestors`` bool [B, q, q] (who sees whom inside the block) and ``cache_visible`` bool [B, S]
    (which cache slots each row's positions see: its own tokens, not padding or holes).
    """
    batch, q, _ = ancestors.shape
    allowed = torch.cat([cache_visible[:, None, :].expand(batch, q, -1), ancestors], dim=-1)
    return additive_mask(allowed[:, None], dtype)


def padded_prefill_mask(start: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask float ``dtype`` [B, 1, P, P] for a left-padded prompt block of P slots:
    causal, and no query sees the padding before its row's ``start`` (int64 [B])."""
    slots = torch.arange(length, device=start.device)
    causal = slots[None, :] <= slots[:, None]  # [P, P]: key <= query
    allowed = causal[None] & (slots >= start[:, None])[:, None, :]  # [B, P, P]
    return additive_mask(allowed[:, None], dtype)


def build_tree_inputs(
    pending: Sequence[int],
    trees: Sequence[DraftTree],
    rows: CacheRows,
    device: torch.device | str,
    size: int | None = None,
) -> TreeInputs:
    """Flatten ``[pending[b]] + trees[b]`` for every row into ``TreeInputs`` on ``device``, in a
    block of ``size`` positions per row (default and minimum: the largest tree + 1).

    ``rows`` says where each row's tokens are in the cache (its token count gives the positions).
    The ids, positions, parents, depths, cache spans and ancestor matrices are packed into one
    int64 host array [B, q, 6 + q] so the batch crosses to the device in a single copy.
    """
    if not len(pending) == len(trees) == rows.batch:
        raise ValueError(f"{len(pending)} pending tokens, {len(trees)} trees and {rows.batch} cache rows")
    q = max((len(tree) for tree in trees), default=0) + 1
    if size is not None:
        if size < q:
            raise ValueError(f"a block of {size} positions cannot hold a tree of {q - 1} nodes and its pending token")
        q = size
    packed = np.zeros((len(trees), q, _ANCESTORS + q), dtype=np.int64)
    packed[:, :, _DEPTHS] = PADDING_DEPTH
    packed[:, :, _POSITIONS] = rows.positions[:, None]
    packed[:, :, _CACHE_START] = rows.start[:, None]
    packed[:, :, _CACHE_END] = rows.end[:, None]
    packed[:, :, _ANCESTORS:] = np.eye(q, dtype=np.int64)  # padding rows: themselves only
    for row, (token, tree) in enumerate(zip(pending, trees)):
        n = len(tree)
        packed[row, 0, _IDS] = token
        packed[row, 1 : n + 1, _IDS] = tree.tokens
        packed[row, 1 : n + 1, _POSITIONS] += tree.depths
        packed[row, 1 : n + 1, _PARENTS] = tree.parents + 1
        packed[row, 0, _DEPTHS] = 0
        packed[row, 1 : n + 1, _DEPTHS] = tree.depths
        packed[row, : n + 1, _ANCESTORS : _ANCESTORS + n + 1] = ancestor_matrix(tree.parents, tree.depths)
    on_device = torch.from_numpy(packed).to(device)
    packed.setflags(write=False)
    return TreeInputs(
        input_ids=on_device[..., _IDS],
        position_ids=on_device[..., _POSITIONS],
        parent_index=on_device[..., _PARENTS],
        depths=on_device[..., _DEPTHS],
        ancestors=on_device[..., _ANCESTORS:].bool(),
        cache_start=on_device[:, :1, _CACHE_START],
        cache_end=on_device[:, :1, _CACHE_END],
        past_length=rows.length,
        causal=bool(np.all(rows.start == 0) and np.all(rows.end == rows.length))
        and all(tree.is_chain() for tree in trees),
        host=packed,
    )
