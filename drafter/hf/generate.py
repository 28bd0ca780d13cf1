"""The REST decoding loop: draft a tree per row, verify all rows in one forward, compact the cache,
commit, repeat.

Invariant between steps: for every unfinished row the KV cache holds every committed token except
the last one, the "pending" token, which is fed as the first position of the row's next
verification block. With no drafter (or an empty tree) a step is exactly one token of plain
decoding per row, through the same code path.

Tokens are chosen as ``model.generate`` chooses them (``sampling.TokenChooser``: its logits
processors, then argmax or one draw per tree position), so greedy output is token for token
``model.generate``'s and sampled output has exactly its distribution. Rows of a batch are decoded
as if each were alone: their own tree, positions, processors and stopping; the cache layout that
makes this work is described in ``kv_cache``. A finished row leaves the batch (its cache row is
dropped) and the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import MaxTimeCriteria
from transformers.generation.streamers import BaseStreamer

from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.corrected_cost import CorrectedCost
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.core.protocol import Drafter
from rest_spec.drafter.core.scheduler import NO_OVERLAP, DraftingStats, DraftScheduler, OverlapConfig
from rest_spec.drafter.core.selection import select_batch_trees
from rest_spec.drafter.hf import internals as hf_internals
from rest_spec.drafter.hf.kv_cache import CacheRows, compact_cache, new_cache, select_rows
from rest_spec.drafter.hf.sampling import TokenChooser, prepare_generation_config
from rest_spec.drafter.hf.tree_attention import padded_prefill_mask
from rest_spec.drafter.hf.verify import verify_trees


@dataclass(frozen=True, kw_only=True)
class CallTimes:
    """What a ``generate`` call cost, for one prompt or a batch.

    seconds            wall-clock time of the whole call, prefill included
    prefill_seconds    the prompts' forward pass
    draft_seconds      time the loop spent drafting: waiting for drafts, starting the next ones
    verify_seconds     forward + acceptance + cache compaction
    drafting           how drafting overlapped verification (``DraftingStats.summary()``: share
                       of steps whose draft was ready, waits, fallbacks, cancellations)
    """

    seconds: float
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    drafting: DraftingStats = field(default_factory=DraftingStats)

    def times(self) -> dict:
        """The fields above, to build another result with the same costs."""
        return {name: getattr(self, name) for name in CallTimes.__dataclass_fields__}


@dataclass(frozen=True)
class GenerationResult(CallTimes):
    """What one ``generate`` call on one prompt produced (and, as ``CallTimes``, what it cost).

    output_ids         new tokens only (the prompt excluded), cut after the first eos or stop
    steps              verification forward passes (the prefill not counted)
    accepted_per_step  draft tokens accepted at each step (the bonus token not counted)
    """

    output_ids: list[int]
    steps: int
    accepted_per_step: list[int]

    @property
    def mean_accepted(self) -> float:
        """New tokens per verification step (REST's "mean accepted length", bonus included)."""
        return len(self.output_ids) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class BatchGenerationResult(CallTimes):
    """What one ``generate`` call on B prompts produced (and, as ``CallTimes``, what the whole
    batch cost).

    output_ids         per row: its new tokens, cut as in ``GenerationResult``
    accepted_per_step  per row: draft tokens accepted at each step the row took part in (a row
                       leaves the batch when it finishes, so rows have different step counts)
    steps              batched verification forward passes (the prefill not counted)
    """

    output_ids: list[list[int]]
    accepted_per_step: list[list[int]]
    steps: int

    @property
    def new_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_ids)

    @property
    def mean_accepted(self) -> float:
        """New tokens per row and step (bonus included), over all rows."""
        row_steps = sum(len(steps) for steps in self.accepted_per_step)
        return self.new_tokens / row_steps if row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens of all rows per second of the whole call."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def row(self, index: int) -> GenerationResult:
        """Row ``index`` as a ``GenerationResult`` (with the whole batch's timings)."""
        return GenerationResult(
            output_ids=self.output_ids[index],
            steps=len(self.accepted_per_step[index]),
            accepted_per_step=self.accepted_per_step[index],
            **self.times(),
        )


def eos_ids(config: GenerationConfig) -> frozenset[int]:
    """The stop ids of a generation config (int, list or tensor; may be empty)."""
    if config.eos_token_id is None:
        return frozenset()
    return frozenset(torch.as_tensor(config.eos_token_id).flatten().tolist())


def prompt_rows(
    input_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[list[list[int]], bool]:
    """Each prompt's ids without padding, and whether the input was a batch of more than one.

    ``input_ids``: a list of ids or an [L] / [1, L] tensor (one prompt); a [B, L] tensor,
    left-padded where ``attention_mask`` [B, L] is 0; or a list of B id lists (any lengths).
    """
    if attention_mask is not None:
        ids, mask = torch.as_tensor(input_ids), torch.as_tensor(attention_mask)
        if ids.ndim == 1:
            ids, mask = ids[None], mask.reshape(1, -1)
        if ids.ndim != 2 or mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
        mask = mask != 0
        if (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError("attention_mask must be left padding (zeros, then ones) in every row")
        rows = [row[keep].tolist() for row, keep in zip(ids, mask)]
    elif isinstance(input_ids, torch.Tensor):
        if input_ids.ndim not in (1, 2):
            raise ValueError(f"input_ids must be [L] or [B, L], got shape {tuple(input_ids.shape)}")
        rows = input_ids.tolist() if input_ids.ndim == 2 else [input_ids.tolist()]
    elif len(input_ids) and not isinstance(input_ids[0], (int, np.integer)):
        rows = [[int(t) for t in row] for row in input_ids]
    else:
        rows = [[int(t) for t in input_ids]]
    if not rows:
        raise ValueError("input_ids holds no prompts")
    for index, row in enumerate(rows):
        if not row:
            raise ValueError(
                "the prompt must contain at least one token" if len(rows) == 1 else f"prompt {index} has no tokens"
            )
    return rows, len(rows) > 1


@torch.inference_mode()
def prefill(model: PreTrainedModel, cache: hf_internals.DynamicCache, prompts: Sequence[Sequence[int]]) -> CacheRows:
    """Fill an empty ``cache`` with every prompt but its last token (the first pending token),
    left-padded to a common length; returns where each row's tokens are.

    Without padding the model builds its usual causal mask; with padding, an explicit mask hides
    the padding and position ids count each row's own tokens. Only the cache is wanted, so models
    that support it compute logits for one position instead of all of them.
    """
    lengths = np.array([len(prompt) - 1 for prompt in prompts], dtype=np.int64)
    width = int(lengths.max())
    rows = CacheRows(start=width - lengths, end=np.full(len(prompts), width, dtype=np.int64))
    if width == 0:
        return rows
    packed = np.zeros((2, len(prompts), width), dtype=np.int64)  # ids, positions: one copy
    for row, prompt in enumerate(prompts):
        packed[0, row, rows.start[row] :] = prompt[:-1]
    packed[1] = np.maximum(np.arange(width) - rows.start[:, None], 0)
    ids, positions = torch.from_numpy(packed).to(model.device)
    mask = None
    if rows.start.any():
        start = torch.from_numpy(rows.start).to(model.device)
        mask = padded_prefill_mask(start, width, model.dtype)
    extra = {"logits_to_keep": 1} if hf_internals.forward_takes(model, "logits_to_keep") else {}
    hf_internals.forward_with_cache(model, cache, input_ids=ids, attention_mask=mask, position_ids=positions, **extra)
    return rows


@dataclass(frozen=True)
class StopConditions:
    """When a row is done, decided as ``model.generate`` decides it: after ``max_new_tokens`` new
    tokens, after the first ``eos`` id, or after the first token at which one of ``criteria``
    fires (each is checked after every committed token, on the row's ids up to that token)."""

    max_new_tokens: int
    eos: frozenset[int] = frozenset()
    criteria: StoppingCriteriaList = field(default_factory=StoppingCriteriaList)
    device: torch.device | str = "cpu"

    def commit(self, context: Sequence[int], generated: int, new_tokens: Sequence[int]) -> tuple[list[int], bool]:
        """The part of ``new_tokens`` a row keeps after ``context`` (which holds ``generated`` new
        tokens already), and whether the row is done."""
        kept = list(new_tokens[: self.max_new_tokens - generated])
        done = generated + len(kept) >= self.max_new_tokens
        for i, token in enumerate(kept):
            if token in self.eos:
                kept, done = kept[: i + 1], True
                break
        if self.criteria:
            ids = torch.tensor([[*context, *kept]], device=self.device)
            for i in range(len(kept)):
                if bool(self.criteria(ids[:, : len(context) + i + 1], None).any()):
                    return kept[: i + 1], True
        return kept, done


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None,
    *,
    chooser: TokenChooser,
    stop: StopConditions,
    config: DraftConfig = DraftConfig(),
    overlap: OverlapConfig = NO_OVERLAP,
    cost: VerifyCost | CorrectedCost | None = None,
    on_step: Callable[[list[list[int]]], None] | None = None,
) -> BatchGenerationResult:
    """The loop behind ``generate``: one row per prompt (unpadded ids); ``chooser`` has one row per
    prompt too. ``on_step`` receives, after every step, the tokens each row committed in it
    (empty for rows that had finished). Drafts come through ``drafter.core.scheduler.DraftScheduler``
    (deadlines, local fallback; with ``overlap`` enabled, the next step's drafts fetched during
    each forward; where the drafter has a cost, no drafts at a step where drafting does not pay,
    ``DraftScheduler.step``); with a ``cost`` (default: the drafter's, ``StepDrafter.cost``), each step runs
    at the block shape it says is fastest, and a ``CorrectedCost`` is told how long each one-row
    step took."""
    start = time.perf_counter()
    contexts = [list(prompt) for prompt in prompts]  # prompt + committed tokens, per row
    prompt_lengths = [len(prompt) for prompt in prompts]
    accepted: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts))) if stop.max_new_tokens > 0 else []  # rows in the cache, in order
    cache = new_cache(model)
    rows = prefill(model, cache, prompts) if active else CacheRows.full(0, 0)
    prefill_seconds = time.perf_counter() - start

    steps = 0
    draft_seconds = verify_seconds = 0.0
    drafting = DraftScheduler(drafter, config, overlap, step_seconds=prefill_seconds, cost=cost)
    cost = drafting.cost
    # rows verified together pay for the widest row's block: the batch's width by its cost
    admit = None if cost is None else lambda trees: select_batch_trees(trees, cost)
    ended: list[int] = []  # rows that finished at the last step
    committed: list[list[int]] | None = None  # each row's tokens of the last step (none before the first)
    try:
        while active:
            t0 = time.perf_counter()
            live = [contexts[row] for row in active]  # read by the drafter now, not kept
            told = None if committed is None else [committed[row] for row in active]
            # each row's request: its prompt's number; the next step's drafts start during this forward
            trees = drafting.step(
                live, active, ended=ended, admit=admit, accepted=told, temperatures=chooser.temperatures
            )
            t1 = time.perf_counter()
            shape = None if cost is None else cost.block_shape(trees)
            verdicts = verify_trees(model, cache, rows, live, trees, chooser, shape)
            rows = compact_cache(cache, rows, [verdict.keep for verdict in verdicts])
            t2 = time.perf_counter()
            drafting.verified(t2 - t1)  # the deadlines and the cost (a CorrectedCost learns from one-row steps)
            verify_seconds += t2 - t1
            draft_seconds += t1 - t0
            steps += 1

            committed = [[] for _ in prompts]
            unfinished = []  # indices into ``active``
            for index, (row, verdict) in enumerate(zip(active, verdicts)):
                accepted[row].append(len(verdict.accepted_tokens))
                generated = len(contexts[row]) - prompt_lengths[row]
                committed[row], done = stop.commit(contexts[row], generated, verdict.new_tokens)
                contexts[row].extend(committed[row])
                if not done:
                    unfinished.append(index)
            if on_step is not None:
                on_step(committed)
            ended = sorted(set(active) - {active[index] for index in unfinished})
            if ended:
                if unfinished:
                    rows = select_rows(cache, rows, np.array(unfinished))
                    chooser = chooser.select_rows(unfinished)
                active = [active[index] for index in unfinished]
        drafting.finish(ended)  # the last rows (no step follows to tell)
    finally:
        drafting.close()

    return BatchGenerationResult(
        output_ids=[context[length:] for context, length in zip(contexts, prompt_lengths)],
        accepted_per_step=accepted,
        steps=steps,
        seconds=time.perf_counter() - start,
        prefill_seconds=prefill_seconds,
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
        drafting=drafting.stats,
    )


def stream_to(streamer: BaseStreamer, batched: bool, pad_token_id: int | None) -> Callable[[list[list[int]]], None]:
    """An ``on_step`` that puts each step's committed tokens into ``streamer``: a LongTensor [k]
    for one prompt (what ``TextStreamer`` takes); [B, k] for a batch, rows with fewer tokens this
    step (or finished) right-filled with ``pad_token_id``, as ``model.generate`` pads finished rows.
    The prompt is not put: ``model.generate`` puts it before it calls a decoding method."""
    if batched and pad_token_id is None:
        raise ValueError("streaming a batch needs a pad_token_id (or eos_token_id) in the generation config")

    def put(committed: list[list[int]]) -> None:
        if not batched:
            streamer.put(torch.tensor(committed[0], dtype=torch.long))
            return
        step = torch.full((len(committed), max(map(len, committed))), pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(committed):
            step[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        streamer.put(step)

    return put


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    input_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    drafter: Drafter | None,
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    config: DraftConfig = DraftConfig(),
    attention_mask: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: BaseStreamer | None = None,
    generator: torch.Generator | None = None,
    overlap: OverlapConfig | bool = False,
    cost: VerifyCost | CorrectedCost | None = None,
) -> GenerationResult | BatchGenerationResult:
    """Decode ``input_ids`` with draft trees from ``drafter``: the output has exactly the
    distribution of ``model.generate``'s with the same arguments, and with greedy decoding it is
    token for token the same. Sampled, a seeded ``generator`` gives the same output whatever the
    drafter (None included), each token drawn at a number of its own position (``TokenChooser``),
    but where a draw falls within float rounding of the edge between two tokens.

    input_ids           one prompt (ids, [L] or [1, L]) -> ``GenerationResult``; B > 1 prompts
                        ([B, L] left-padded with ``attention_mask``, or B id lists) ->
                        ``BatchGenerationResult``. Each row is decoded as if it were alone.
    drafter             None decodes plainly through the same loop
    eos_token_id        replaces the generation config's eos ids; generation stops after the first
    generation_config   default ``model.generation_config``: do_sample, temperature, top_k, top_p,
                        repetition_penalty, no_repeat_ngram_size, ... as ``model.generate`` reads it
    logits_processor    extra processors, merged as ``model.generate`` merges them
    stopping_criteria   checked after every committed token (e.g. ``StopStringCriteria``)
    streamer            ``put`` with each step's committed tokens (see ``stream_to``), then ``end``
    generator           randomness of sampling, on the model's device; a fixed seed reproduces the
                        output, with this drafter or any other (but for rounding at a draw's edge)
    overlap             fetch each step's drafts during the previous forward (``drafter.core.scheduler``;
                        an ``OverlapConfig``, or True for its defaults). Off by default: the
                        fetch and its server take CPU from the forward it runs beside, and the
                        trees drafted from hypotheses accept less, so it pays only where the
                        round trip it hides costs more (measured by ``benchmarks/overlap.py``,
                        recorded in ``benchmarks/README.md`` under "Overlap").
                        Remote drafts have deadlines and a local fallback either way.
    cost                the measured verification cost (``drafter.hf.measure.load_or_measure``): each
                        step runs at the block size and linear-layer layout it measured fastest
                        (``VerifyCost.block_shape``; a step may be padded up to a faster size);
                        a ``CorrectedCost`` is corrected by the steps' times as they run.
                        Default: the drafter's own ``cost`` (``AdaptiveDrafter``'s), else none:
                        blocks as drafted, in PyTorch's layout, as ``model.generate`` runs them.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if generator is not None and generator.device.type != model.device.type:
        raise ValueError(f"the generator is on {generator.device}, the model on {model.device}")
    prompts, batched = prompt_rows(input_ids, attention_mask)
    generation = prepare_generation_config(model, generation_config, eos_token_id)
    chooser = TokenChooser.for_prompts(
        model, generation, [len(p) for p in prompts], max_new_tokens, logits_processor, generator
    )
    criteria = StoppingCriteriaList(stopping_criteria or [])
    if generation.max_time is not None:
        criteria.append(MaxTimeCriteria(generation.max_time))
    stop = StopConditions(max_new_tokens, eos_ids(generation), criteria, model.device)
    on_step = None
    if streamer is not None:
        pad = hf_internals.pad_token_tensor(generation)  # the pad id, else the first eos id (model.generate's rule)
        on_step = stream_to(streamer, batched, None if pad is None else int(pad))
    if isinstance(overlap, bool):
        overlap = OverlapConfig(enabled=overlap)
    result = decode(
        model,
        prompts,
        drafter,
        chooser=chooser,
        stop=stop,
        config=config,
        overlap=overlap,
        cost=cost,
        on_step=on_step,
    )
    if streamer is not None:
        streamer.end()
    return result if batched else result.row(0)
