"""The top-p nucleus without sorting the vocabulary, for every engine's verifier.

The nucleus of a distribution is the smallest set of its likeliest tokens whose probability adds
up to ``top_p``: transformers (``TopPLogitsWarper``) and vLLM (``apply_top_k_top_p``) keep a token
where the mass from it down (1 - the mass above it) is above ``1 - top_p``. Both find it by sorting
the whole vocabulary, at every position they sample or verify: 2-4 ms a position for SmolLM2's
49,152 tokens on a 2-core CPU, as much as a model's forward for a few drafted tokens. The nucleus
is among the likeliest tokens, so ``nucleus`` takes the ``k`` likeliest (``torch.topk``, which
does not sort the rest), ``k`` growing fourfold until every row's hold ``top_p`` of its mass.
Same set but where float rounding or a tie at the edge of the nucleus falls otherwise.
"""

from __future__ import annotations

import torch

FIRST_K = 64  # the likeliest tokens searched first


def nucleus(probs: torch.Tensor, top_p: torch.Tensor | float, min_keep: int = 1) -> torch.Tensor:
    """bool, the shape of ``probs`` (rows of probabilities over the last dimension): True where a
    token is in its row's nucleus for ``top_p`` (a float, or a tensor of one per row; a top-p of 1
    or more keeps the row whole), the ``min_keep`` likeliest always."""
    if not isinstance(top_p, torch.Tensor):
        top_p = torch.tensor(top_p, dtype=probs.dtype)
    top_p = top_p.to(probs.dtype).unsqueeze(-1)
    whole = top_p >= 1
    vocab = probs.shape[-1]
    k = min(vocab, max(FIRST_K, min_keep))
    while True:
        top, order = probs.topk(k, dim=-1)  # descending
        if k == vocab or bool(((top.sum(dim=-1, keepdim=True) >= top_p) | whole).all()):
            break  # every token past the k-th has top_p of the mass above it: not in the nucleus
        k = min(vocab, 4 * k)
    keep_sorted = 1 - (top.cumsum(dim=-1) - top) > 1 - top_p
    keep_sorted[..., :min_keep] = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)
    return keep | whole if bool(whole.any()) else keep
