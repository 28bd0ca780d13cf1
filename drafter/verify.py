"""Verify a draft tree with one forward pass and find the longest path the model agrees with.

Acceptance is split in two so that a sampling rule can replace greedy without touching the walk:

1. an ``AcceptanceRule`` picks the model's next token at every flat position from the logits
   (greedy: argmax; lossless sampling: one sample from the processed distribution per position);
2. ``accept_path`` keeps a node iff the rule's token at its parent equals the node's token, for the
   node and all its ancestors, and returns the deepest such path plus the rule's token after it.

Step 2 with independent per-position samples is exactly the "sample at the node, descend if the
sample is a child" walk (NOTES section 3): only the samples on the visited path are ever used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from datastore.types import DraftTree
from drafter.kv_cache import cache_length
from drafter.tree_attention import TreeInputs, build_tree_inputs

AcceptanceRule = Callable[[torch.Tensor], torch.Tensor]
"""logits float [B, q, V] -> the model's chosen next token int64 [B, q] after each flat position."""


def greedy_rule(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding: the argmax token after each position, int64 [B, q]."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying one tree (batch row 0).

    accepted_tokens  draft tokens the model agreed with, root to leaf
    bonus_token      the model's own next token after the accepted path
    keep             int64 [k + 1] flat positions whose KV slots stay: 0 (the pending token), then
                     the accepted nodes in path order (ascending, since parents precede children)
    """

    accepted_tokens: tuple[int, ...]
    bonus_token: int
    keep: np.ndarray

    @property
    def new_tokens(self) -> tuple[int, ...]:
        """Everything this step commits: the accepted tokens and the bonus token."""
        return self.accepted_tokens + (self.bonus_token,)


def tree_logits(model: PreTrainedModel, cache: DynamicCache, inputs: TreeInputs) -> torch.Tensor:
    """One forward over the flattened tree; appends q slots to ``cache``. float [B, q, V]."""
    output = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask(model.dtype),
        position_ids=inputs.position_ids,
        past_key_values=cache,
        use_cache=True,
    )
    return output.logits


def accept_path(inputs: TreeInputs, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest accepted path, on the device. ``targets`` int64 [B, q] from an ``AcceptanceRule``.

    Returns ``path`` bool [B, q] (the pending token and the accepted nodes) and ``bonus`` int64 [B]
    (the target after the path's last position).
    """
    # match[b, i]: node i is the token the model chose after its parent. The pending token is
    # committed already, so it always matches (its parent_index of 0 is a placeholder).
    match = inputs.input_ids == targets.gather(1, inputs.parent_index)
    match[:, 0] = True
    # accepted[b, i] = AND over j in ancestors-or-self(i) of match[b, j]; written as "no ancestor
    # mismatches". Sibling tokens are distinct and each parent has one target, so the accepted
    # nodes form a single chain from the root.
    accepted = ~(inputs.ancestors & ~match[:, None, :]).any(dim=-1)  # [B, q]
    # The deepest accepted position ends the path (depth 0, the pending token, if none matched).
    deepest = torch.where(accepted, inputs.depths, -1).argmax(dim=-1, keepdim=True)  # [B, 1]
    path = inputs.ancestors.gather(1, deepest[..., None].expand(-1, 1, inputs.ancestors.shape[-1]))
    bonus = targets.gather(1, deepest)
    return path[:, 0], bonus[:, 0]


@torch.inference_mode()
def verify_tree(
    model: PreTrainedModel,
    cache: DynamicCache,
    pending_token: int,
    tree: DraftTree,
    rule: AcceptanceRule = greedy_rule,
) -> Verification:
    """Run ``[pending_token] + tree`` through ``model`` on top of ``cache`` and accept a path.

    The cache grows by q = len(tree) + 1 slots; pass ``Verification.keep`` to
    ``kv_cache.compact_cache`` to keep only the committed ones. One device->host sync.
    """
    past_length = cache_length(cache)
    inputs = build_tree_inputs(pending_token, tree, past_length, model.device)
    targets = rule(tree_logits(model, cache, inputs))
    path, bonus = accept_path(inputs, targets)
    # The one sync per step: the path mask and the bonus token come back together.
    row = torch.cat([path.to(torch.int64), bonus[:, None]], dim=-1)[0].cpu().numpy()
    keep = np.flatnonzero(row[:-1])
    return Verification(
        accepted_tokens=tuple(int(t) for t in tree.tokens[keep[1:] - 1]),
        bonus_token=int(row[-1]),
        keep=keep,
    )
