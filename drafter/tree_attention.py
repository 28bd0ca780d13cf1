"""A draft tree as the tensors of one verification forward pass (tree attention).

The verifier runs ``q = n + 1`` query positions at once: the pending token (the last committed
token, not yet in the KV cache) at flat position 0, then the ``n`` tree nodes in BFS order at flat
positions ``1..n`` (node ``i`` of the tree is flat position ``i + 1``). A position may attend to the
whole cached prefix, to itself and to its ancestors; the pending token is every node's ancestor.
Position ids are ``L + depth`` (pending at depth 0), so each node sees exactly the positions and
keys it would see if its path had been decoded one token at a time.

Everything is built on the host in numpy (the tree arrives there from the drafter) and crosses to
the device as ONE packed int64 copy; the float mask is expanded on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from datastore.types import DraftTree

# Columns of the packed host buffer, before the q ancestor columns.
_IDS, _POSITIONS, _PARENTS, _ANCESTORS = 0, 1, 2, 3


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


@dataclass(frozen=True)
class TreeInputs:
    """Device tensors for verifying one draft tree per batch row (B = 1 for now).

    input_ids     int64 [B, q]     pending token, then the tree tokens in BFS order
    position_ids  int64 [B, q]     past_length + depth
    parent_index  int64 [B, q]     flat position of each position's parent (0 for the pending token)
    ancestors     bool  [B, q, q]  see ``ancestor_matrix``
    past_length   int              L, tokens already in the KV cache (same for every row)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent_index: torch.Tensor
    ancestors: torch.Tensor
    past_length: int

    @property
    def depths(self) -> torch.Tensor:
        """int64 [B, q]: 0 for the pending token, 1 for children of the root, ..."""
        return self.position_ids - self.past_length

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The 4D additive mask ``[B, 1, q, L + q]`` in ``dtype`` (see ``tree_attention_mask``)."""
        return tree_attention_mask(self.ancestors, self.past_length, dtype)


def tree_attention_mask(ancestors: torch.Tensor, past_length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask float ``dtype`` [B, 1, q, L + q] from ``ancestors`` bool [B, q, q].

    0 where a query may attend (the whole cached prefix ``[0, L)``, itself, its ancestors) and
    ``finfo(dtype).min`` elsewhere. Additive floats work for both eager attention (scores + mask) and
    SDPA (a float ``attn_mask`` is added to the scores); ``min`` rather than ``-inf`` keeps a softmax
    row finite even if it were fully masked, which tree rows never are.
    """
    batch, q, _ = ancestors.shape
    mask = torch.zeros((batch, 1, q, past_length + q), dtype=dtype, device=ancestors.device)
    mask[:, 0, :, past_length:].masked_fill_(~ancestors, torch.finfo(dtype).min)
    return mask


def build_tree_inputs(
    pending_token: int, tree: DraftTree, past_length: int, device: torch.device | str
) -> TreeInputs:
    """Flatten ``[pending_token] + tree`` into ``TreeInputs`` (B = 1) on ``device``.

    The ids, positions, parents and ancestor matrix are packed into one int64 host array
    [1, q, 3 + q] so the tree crosses to the device in a single copy.
    """
    n = len(tree)
    q = n + 1
    packed = np.empty((1, q, _ANCESTORS + q), dtype=np.int64)
    packed[0, 0, _IDS] = pending_token
    packed[0, 1:, _IDS] = tree.tokens
    packed[0, 0, _POSITIONS] = past_length
    packed[0, 1:, _POSITIONS] = past_length + tree.depths
    packed[0, 0, _PARENTS] = 0
    packed[0, 1:, _PARENTS] = tree.parents + 1
    packed[0, :, _ANCESTORS:] = ancestor_matrix(tree.parents, tree.depths)
    on_device = torch.from_numpy(packed).to(device)
    return TreeInputs(
        input_ids=on_device[..., _IDS],
        position_ids=on_device[..., _POSITIONS],
        parent_index=on_device[..., _PARENTS],
        ancestors=on_device[..., _ANCESTORS:].bool(),
        past_length=past_length,
    )
