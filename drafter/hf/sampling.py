"""The model's next token at every draft-tree position, chosen exactly as ``model.generate`` would.

``model.generate`` (transformers ``_sample``) turns the last logits into a token in two steps: the
``LogitsProcessorList`` that ``model.generate`` builds from the ``GenerationConfig``
(repetition penalty, no-repeat n-grams, minimum length, bad words, ..., and when sampling,
temperature, top-k, top-p, min-p, typical-p, ...) applied to ``(input_ids, float32 scores)``, then
argmax or one multinomial draw. ``TokenChooser`` does the same at every position of a verification
block: the processors at a position see the row's committed tokens plus the draft path down to
that position, i.e. the ``input_ids`` plain decoding would have had there. Each row gets the list
``model.generate`` builds for that prompt decoded alone, so length-dependent processors count from
the row's own prompt length.

Processors that read the scores only (temperature, top-k, ...) run once over all positions of all
rows; any other list runs once per (row, depth) on [positions, context + depth] input_ids.

Sampled, the draw is keyed by the output position, not by the tree node: a row's n-th new token is
drawn by inverting the processed distribution's CDF at one uniform number ``u[n]``, drawn for the
row before decoding starts. Every tree position at depth d of a step whose pending token is the
row's g-th new token uses ``u[g + d]``. ``verify.accept_path`` visits one node per depth, so each
committed token gets a fresh uniform of its own: exactly the distribution of plain sampling (the
lossless tree rule of speculative sampling over trees, SpecInfer, Miao et al., 2023). And more:
a token depends only on the text before it and its own ``u[n]``, so with the same generator the
output is the same with or without drafts, whatever the drafts were, but where ``u[n]`` falls
within float rounding of the edge between two tokens (a block of several positions rounds the
logits unlike a one-token step: at temperature 1.0, about one 128-token output in 16 parts so).
Decoding's output under a seed is then known in advance, which makes the best possible draft
(that output) a true ceiling to measure a drafter against (``benchmarks/e2e.py``'s oracle mode).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from rest_spec.common.nucleus import nucleus
from rest_spec.drafter.hf import internals as hf_internals
from rest_spec.drafter.hf.tree_attention import TreeInputs


class SortFreeTopP(TopPLogitsWarper):
    """``TopPLogitsWarper``'s nucleus found without sorting the vocabulary (``common.nucleus``):
    transformers sorts all of it at every position, 2-3 ms per position for SmolLM2's 49,152 tokens
    on a 2-core CPU, as much as the model's forward for a 16-node tree."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        keep = nucleus(scores.softmax(dim=-1), self.top_p, self.min_tokens_to_keep)
        return scores.masked_fill(~keep, self.filter_value)


# Processors whose output depends on the scores alone, never on input_ids (checked against the
# transformers source): they may run on all tree positions of all rows in one call.
SCORE_ONLY_PROCESSORS = (
    SortFreeTopP,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    SuppressTokensLogitsProcessor,
)


def prepare_generation_config(
    model: PreTrainedModel,
    generation_config: GenerationConfig | None,
    eos_token_id: int | Sequence[int] | None,
) -> GenerationConfig:
    """The config ``model.generate`` would decode with: a copy of ``generation_config`` (default:
    the model's) completed from the model's and the global defaults, ``eos_token_id`` (if given)
    replacing its eos ids, special-token tensors prepared. Refuses what tree decoding cannot do."""
    if eos_token_id is not None and not isinstance(eos_token_id, int):
        eos_token_id = [int(t) for t in eos_token_id]
    config = hf_internals.prepare_generation_config(model, generation_config, eos_token_id)
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"REST decoding does greedy search and sampling only; this generation config asks for {mode}")
    if config.num_return_sequences not in (None, 1):
        raise ValueError(f"num_return_sequences must be 1, got {config.num_return_sequences}")
    if config.guidance_scale not in (None, 1.0):
        raise ValueError("guidance_scale (classifier-free guidance) is not supported with draft trees")
    if config.encoder_repetition_penalty not in (None, 1.0) or config.encoder_no_repeat_ngram_size not in (None, 0):
        raise ValueError("encoder_repetition_penalty and encoder_no_repeat_ngram_size are not supported")
    if config.stop_strings is not None:
        raise ValueError(
            "stop_strings need the tokenizer: pass stopping_criteria="
            "StoppingCriteriaList([StopStringCriteria(tokenizer, stop_strings)]) instead"
        )
    return config


def row_logits_processors(
    model: PreTrainedModel,
    config: GenerationConfig,
    prompt_length: int,
    max_new_tokens: int,
    logits_processor: LogitsProcessorList | None,
) -> LogitsProcessorList:
    """The list ``model.generate`` builds for one unpadded prompt of ``prompt_length`` tokens and
    ``max_new_tokens`` (lengths set as its ``_prepare_generated_length`` sets them); processors in
    ``logits_processor`` replace the built ones of the same type, as in ``generate``. A top-p warper
    runs as ``SortFreeTopP``."""
    config = copy.copy(config)
    config.max_length = prompt_length + max_new_tokens
    if config.min_new_tokens is not None:
        config.min_length = prompt_length + config.min_new_tokens
    processors = hf_internals.logits_processors(
        model, config, prompt_length, logits_processor if logits_processor is not None else LogitsProcessorList()
    )
    return LogitsProcessorList(
        SortFreeTopP(p.top_p, p.filter_value, p.min_tokens_to_keep) if type(p) is TopPLogitsWarper else p
        for p in processors
    )


def _apply(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processors(input_ids, scores)`` without its per-call ``inspect.signature`` of every
    processor (which costs more than a small processor itself, and runs once per row and depth
    here). Without extra keyword arguments that check only rejects processors that need them;
    calling those without them fails here too."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


@dataclass(frozen=True)
class TokenChooser:
    """An ``AcceptanceRule`` (see ``verify``): per tree position, ``model.generate``'s processed
    scores, then argmax (``do_sample`` False) or the draw of the output position it decides (see
    the module's docstring).

    processors      one list per batch row, in the order of the rows passed to ``__call__``
    prompt_lengths  each row's prompt length: where its new tokens start
    uniforms        float32 [rows, max(max_new_tokens, 1)] where sampling: row b's n-th new token is
                    drawn at ``uniforms[b, n]``
    """

    processors: tuple[LogitsProcessorList, ...]
    do_sample: bool
    prompt_lengths: tuple[int, ...] = ()
    uniforms: torch.Tensor | None = None

    @classmethod
    def for_prompts(
        cls,
        model: PreTrainedModel,
        config: GenerationConfig,
        prompt_lengths: Sequence[int],
        max_new_tokens: int,
        logits_processor: LogitsProcessorList | None = None,
        generator: torch.Generator | None = None,
    ) -> TokenChooser:
        """One row per prompt, from a config made by ``prepare_generation_config``; sampled, every
        uniform number the decoding will use is drawn now from ``generator`` (None: torch's global
        generator, as ``model.generate`` uses)."""
        processors = tuple(
            row_logits_processors(model, config, length, max_new_tokens, logits_processor) for length in prompt_lengths
        )
        uniforms = None
        if config.do_sample:
            shape = (len(prompt_lengths), max(max_new_tokens, 1))
            uniforms = torch.rand(shape, generator=generator, device=model.device, dtype=torch.float32)
        return cls(processors, bool(config.do_sample), tuple(int(n) for n in prompt_lengths), uniforms)

    def select_rows(self, keep: Sequence[int]) -> TokenChooser:
        """The chooser for rows ``keep`` only (same order), e.g. once other rows have finished."""
        return replace(
            self,
            processors=tuple(self.processors[i] for i in keep),
            prompt_lengths=tuple(self.prompt_lengths[i] for i in keep),
            uniforms=None if self.uniforms is None else self.uniforms[list(keep)],
        )

    @property
    def temperatures(self) -> list[float]:
        """Each row's sampling temperature (0: greedy; 1 where sampling sets none): what the drafter
        calibrates its trees by (``AdaptiveDrafter.advance``)."""
        if not self.do_sample:
            return [0.0] * len(self.processors)
        return [
            next((float(p.temperature) for p in row if isinstance(p, TemperatureLogitsWarper)), 1.0)
            for row in self.processors
        ]

    @property
    def score_only(self) -> bool:
        return all(type(p) in SCORE_ONLY_PROCESSORS for row in self.processors for p in row)

    def scores(self, logits: torch.Tensor, inputs: TreeInputs, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """float32 [B, q, V]: the processed scores after every flat position (padding: raw)."""
        batch, q, vocab = logits.shape
        scores = logits.float()
        if not any(self.processors):
            return scores
        if self.score_only:  # one call for everything; the input_ids are never read
            flat = _apply(self.processors[0], inputs.input_ids.reshape(-1, 1), scores.reshape(-1, vocab))
            return flat.view(batch, q, vocab)
        scores = scores.clone()  # written in place below; keep the caller's logits intact
        for row, (processors, context) in enumerate(zip(self.processors, contexts)):
            if not processors:
                continue
            context_ids = np.asarray(context, dtype=np.int64)
            for depth in range(int(inputs.host_depths(row).max()) + 1):
                positions, path = inputs.paths(row, depth)
                ids = np.concatenate(
                    [np.broadcast_to(context_ids, (positions.shape[0], context_ids.shape[0])), path], axis=1
                )  # [m, len(context) + depth]: the input_ids plain decoding would have here
                index = torch.from_numpy(positions).to(scores.device)
                scores[row, index] = _apply(processors, torch.from_numpy(ids).to(scores.device), scores[row, index])
        return scores

    def pick(self, scores: torch.Tensor, inputs: TreeInputs, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """int64 [B, q]: argmax, or at each position the draw of the output position it decides:
        the first token whose cumulative probability exceeds that position's uniform (tokens of
        probability zero are never drawn)."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        if self.uniforms is None:
            raise ValueError("a sampling TokenChooser needs its uniforms: build it with TokenChooser.for_prompts")
        generated = torch.tensor(
            [len(context) - length for context, length in zip(contexts, self.prompt_lengths)], device=scores.device
        )
        position = (generated[:, None] + inputs.depths.clamp(min=0)).clamp(max=self.uniforms.shape[1] - 1)
        cdf = torch.softmax(scores, dim=-1).cumsum_(dim=-1)  # [B, q, V]
        threshold = self.uniforms.gather(1, position) * cdf[..., -1]  # [B, q]
        drawn = torch.searchsorted(cdf, threshold[..., None], right=True)[..., 0]
        return drawn.clamp_(max=scores.shape[-1] - 1)

    def __call__(self, logits: torch.Tensor, inputs: TreeInputs, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        if not self.do_sample and not any(self.processors):
            return logits.argmax(dim=-1)  # plain greedy: float32 scores would not change the argmax
        return self.pick(self.scores(logits, inputs, contexts), inputs, contexts)
