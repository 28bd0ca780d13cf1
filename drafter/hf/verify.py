"""Verify one draft tree per batch row with one forward pass; per row, find the longest path the
model agrees with.

Acceptance is split in two so that the token rule can change without touching the walk:

1. an ``AcceptanceRule`` picks the model's next token at every flat position from the logits
   (``greedy_rule``: argmax; ``sampling.TokenChooser``: ``model.generate``'s logits processors,
   then argmax or a sample from the processed distribution at each position);
2. ``accept_path`` keeps a node iff the rule's token at its parent equals the node's token, for the
   node and all its ancestors, and returns the deepest such path plus the rule's token after it.

Step 2 with samples independent along every root path (``TokenChooser`` draws all positions of one
depth at one uniform number, fresh per depth) is exactly the "sample at the node, descend if the
sample is a child" walk of tree speculative sampling: only the samples on the visited path are ever used, and
each is drawn from the model's distribution given the context and the path above it, so every
committed token has exactly the distribution plain sampling gives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from transformers import PreTrainedModel

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.cost import BlockShape
from rest_spec.drafter.hf.internals import DynamicCache, forward_with_cache
from rest_spec.drafter.hf.kv_cache import CacheRows, cache_length
from rest_spec.drafter.hf.linear_layout import transposed_linears
from rest_spec.drafter.hf.tree_attention import TreeInputs, build_tree_inputs


class AcceptanceRule(Protocol):
    def __call__(self, logits: torch.Tensor, inputs: TreeInputs, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The model's chosen next token int64 [B, q] after each flat position, from the
        verification logits float [B, q, V], the tree inputs and each row's committed tokens
        (prompt included; the last one is the pending token at flat position 0)."""
        ...


def greedy_rule(logits: torch.Tensor, inputs: TreeInputs, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Greedy decoding without logits processors: the argmax token after each position, int64
    [B, q] (``inputs`` and ``contexts`` are not needed)."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying one row's tree.

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


def tree_logits(
    model: PreTrainedModel, cache: DynamicCache, inputs: TreeInputs, transposed: bool = False
) -> torch.Tensor:
    """One forward over the flattened trees; appends q slots to ``cache``. float [B, q, V].

    Chains on whole caches (``inputs.causal``) take the model's own causal path, no custom mask;
    ``transposed`` runs the linear layers as ``(W @ x.T).T`` (``drafter.hf.linear_layout``)."""
    with transposed_linears(model, transposed):
        output = forward_with_cache(
            model,
            cache,
            input_ids=inputs.input_ids,
            attention_mask=None if inputs.causal else inputs.attention_mask(model.dtype),
            position_ids=inputs.position_ids,
        )
    return output.logits


def accept_path(inputs: TreeInputs, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest accepted path per row, on the device. ``targets`` int64 [B, q] from an
    ``AcceptanceRule``.

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
    # The deepest accepted position ends the path (depth 0, the pending token, if none matched;
    # padding has depth -1, so it never ends one).
    deepest = torch.where(accepted, inputs.depths, -1).argmax(dim=-1, keepdim=True)  # [B, 1]
    path = inputs.ancestors.gather(1, deepest[..., None].expand(-1, 1, inputs.ancestors.shape[-1]))
    bonus = targets.gather(1, deepest)
    return path[:, 0], bonus[:, 0]


@torch.inference_mode()
def verify_trees(
    model: PreTrainedModel,
    cache: DynamicCache,
    rows: CacheRows,
    contexts: Sequence[Sequence[int]],
    trees: Sequence[DraftTree],
    rule: AcceptanceRule = greedy_rule,
    shape: BlockShape | None = None,
) -> list[Verification]:
    """Run ``[contexts[b][-1]] + trees[b]`` for every row through ``model`` on top of ``cache``
    (whose rows are laid out as ``rows``) and accept a path per row.

    ``shape`` (``VerifyCost.block_shape``) pads the block and picks the linear layers' layout;
    default: the block is q = max tree size + 1 positions, in PyTorch's layout. The cache grows by
    the block's size; pass each ``Verification.keep`` to ``kv_cache.compact_cache`` to keep only
    the committed slots. One device->host sync.
    """
    if cache_length(cache) != rows.length:
        raise ValueError(f"the cache holds {cache_length(cache)} slots but its rows end at {rows.length}")
    shape = shape or BlockShape(max((len(tree) for tree in trees), default=0) + 1)
    inputs = build_tree_inputs([context[-1] for context in contexts], trees, rows, model.device, shape.size)
    targets = rule(tree_logits(model, cache, inputs, shape.transposed), inputs, contexts)
    path, bonus = accept_path(inputs, targets)
    # The one sync per step: the path masks and the bonus tokens come back together.
    host = torch.cat([path.to(torch.int64), bonus[:, None]], dim=-1).cpu().numpy()
    verdicts = []
    for row, tree in zip(host, trees):
        keep = np.flatnonzero(row[:-1])
        verdicts.append(
            Verification(
                accepted_tokens=tuple(int(t) for t in tree.tokens[keep[1:] - 1]),
                bonus_token=int(row[-1]),
                keep=keep,
            )
        )
    return verdicts
