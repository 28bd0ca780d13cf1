"""The REST decoding loop: draft a tree, verify it in one forward, compact the cache, repeat.

Invariant between steps: the KV cache holds every committed token except the last one, the
"pending" token, which is fed as the first position of the next verification forward. With no
drafter (or an empty tree) each step is exactly one token of plain greedy decoding, through the
same code path.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from datastore.types import DraftConfig, DraftTree
from drafter.base import Drafter
from drafter.kv_cache import compact_cache, new_cache
from drafter.verify import verify_tree


@dataclass(frozen=True)
class GenerationResult:
    """What one ``generate`` call produced and what it cost.

    output_ids         new tokens only (the prompt excluded), truncated after the first eos
    steps              verification forward passes (the prefill not counted)
    accepted_per_step  draft tokens accepted at each step (the bonus token not counted)
    seconds            wall-clock time of the whole call, prefill included
    prefill_seconds    the prompt's forward pass
    draft_seconds      time inside ``drafter.draft``
    verify_seconds     forward + acceptance + cache compaction
    """

    output_ids: list[int]
    steps: int
    accepted_per_step: list[int]
    seconds: float
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float

    @property
    def mean_accepted(self) -> float:
        """New tokens per verification step (REST's "mean accepted length", bonus included)."""
        return len(self.output_ids) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else 0.0


def eos_ids(model: PreTrainedModel, eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The stop ids: ``eos_token_id`` if given, else the model's generation config (may be empty)."""
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(t) for t in eos_token_id)


def prompt_ids(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """A 1-D list of ids from a list or a [L] / [1, L] tensor; refuses empty prompts and batches."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.ndim != 1:
            raise ValueError(f"input_ids must be [L] or [1, L], got shape {tuple(input_ids.shape)}")
        input_ids = input_ids.tolist()
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("the prompt must contain at least one token")
    return ids


@torch.inference_mode()
def prefill(model: PreTrainedModel, cache: DynamicCache, tokens: Sequence[int]) -> None:
    """Fill an empty ``cache`` with ``tokens`` (plain causal attention). Only the cache is wanted,
    so models that support it compute logits for one position instead of all of them."""
    ids = torch.tensor([tokens], dtype=torch.long, device=model.device)  # [1, P]
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    model(
        input_ids=ids,
        position_ids=torch.arange(len(tokens), device=model.device)[None],
        past_key_values=cache,
        use_cache=True,
        **extra,
    )


def _truncate(new_tokens: Sequence[int], room: int, stop: frozenset[int]) -> tuple[list[int], bool]:
    """Cut ``new_tokens`` to ``room`` tokens and after the first stop id; True if a stop id was hit."""
    kept = list(new_tokens[:room])
    for i, token in enumerate(kept):
        if token in stop:
            return kept[: i + 1], True
    return kept, False


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    input_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | None,
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    config: DraftConfig = DraftConfig(),
) -> GenerationResult:
    """Greedy decoding of ``input_ids`` with draft trees from ``drafter``; the output is token for
    token ``model.generate(input_ids, do_sample=False, max_new_tokens=...)``.

    ``drafter=None`` decodes plainly through the same loop. ``eos_token_id`` defaults to the
    model's generation config; generation stops after the first of them or ``max_new_tokens``.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stop = eos_ids(model, eos_token_id)
    context = prompt_ids(input_ids)  # prompt + committed tokens; what the drafter matches against
    prompt_length = len(context)
    start = time.perf_counter()

    cache = new_cache(model)
    if prompt_length > 1:
        prefill(model, cache, context[:-1])
    prefill_seconds = time.perf_counter() - start

    accepted_per_step: list[int] = []
    draft_seconds = verify_seconds = 0.0
    done = max_new_tokens == 0
    while not done:
        t0 = time.perf_counter()
        # The drafter sees the live context list; it must not keep a reference across steps.
        tree = drafter.draft(context, config) if drafter is not None else DraftTree.empty()
        t1 = time.perf_counter()
        verdict = verify_tree(model, cache, context[-1], tree)  # context[-1]: the pending token
        compact_cache(cache, len(context) - 1, verdict.keep)
        verify_seconds += time.perf_counter() - t1
        draft_seconds += t1 - t0

        accepted_per_step.append(len(verdict.accepted_tokens))
        room = max_new_tokens - (len(context) - prompt_length)
        committed, hit_eos = _truncate(verdict.new_tokens, room, stop)
        context.extend(committed)
        done = hit_eos or len(context) - prompt_length >= max_new_tokens

    return GenerationResult(
        output_ids=context[prompt_length:],
        steps=len(accepted_per_step),
        accepted_per_step=accepted_per_step,
        seconds=time.perf_counter() - start,
        prefill_seconds=prefill_seconds,
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
    )
