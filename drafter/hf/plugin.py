"""The transformers plug-in: REST draft trees inside ``model.generate``.

Two ways in, the same decoding loop (``drafter.hf.generate.generate``):

``model.generate(ids, custom_generate=rest_generate, drafter=drafter, max_new_tokens=128)``
    transformers prepares everything as for its own loop (generation config, ``max_length``, eos and pad
    ids, attention mask, logits processors, stopping criteria) and hands the decoding to
    ``rest_generate``. transformers (5.x) gives such a callable neither the ``streamer`` nor the
    ``tokenizer`` (so no ``stop_strings``) nor an ``assistant_model``; use the second way for those.

``model.generate(ids, custom_generate=REST_GENERATE_DIR, trust_remote_code=True, drafter=drafter, ...)``
    transformers runs ``custom_generate/generate.py`` from the directory shipped in this package, which is
    ``generate_with_drafts``: it receives every argument, so streamers and stop strings work too.

The drafter (``LocalDrafter.open(index)`` or ``RemoteDrafter("host:port")``) is a keyword argument of
``generate``; ``draft_config=DraftConfig(...)`` sets the tree size. Both return what ``model.generate``
returns: a LongTensor [B, prompt + new] (rows that stop early padded with the pad id), or with
``return_dict_in_generate=True`` a ``RestGenerateOutput``, a ``GenerateDecoderOnlyOutput`` that also
carries the loop's statistics.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import (
    BaseStreamer,
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.protocol import Drafter
from rest_spec.drafter.core.scheduler import OverlapConfig
from rest_spec.drafter.hf import internals as hf_internals
from rest_spec.drafter.hf.generate import BatchGenerationResult, GenerationResult, generate
from rest_spec.drafter.hf.sampling import row_logits_processors

log = logging.getLogger(__name__)

REST_GENERATE_DIR = str(Path(__file__).with_name("hf_custom_generate"))
"""A local "repository" holding ``custom_generate/generate.py``, for ``custom_generate=REST_GENERATE_DIR``."""

# Inputs transformers prepares for its own loop that ours recomputes (positions, cache, logits slicing).
_RECOMPUTED_MODEL_INPUTS = frozenset({"position_ids", "logits_to_keep", "use_cache", "cache_position"})


@dataclass
class RestGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` (``sequences`` only) plus ``rest``: the decoding loop's result
    (verification steps, accepted tokens per step, timings)."""

    rest: GenerationResult | BatchGenerationResult | None = None


def rest_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    drafter: Drafter | None,
    draft_config: DraftConfig = DraftConfig(),
    overlap: OverlapConfig | bool = False,
    streamer: BaseStreamer | None = None,
    **model_kwargs,
) -> torch.LongTensor | RestGenerateOutput:
    """The decoding loop for ``model.generate(..., custom_generate=rest_generate, drafter=...)``.

    transformers calls it with its prepared inputs: ``input_ids`` [B, L] (left-padded when B > 1), the
    resolved ``generation_config`` (``max_length`` already includes the prompt), the logits processors
    and stopping criteria it built, and model inputs (``attention_mask``; ``None`` when all ones).
    ``drafter=None`` decodes without drafts through the same loop (a baseline); ``overlap`` as in
    ``drafter.hf.generate.generate`` (drafts prepared during forwards; ``.rest.drafting`` of the
    dict output says how well that went). ``streamer`` is for
    ``generate_with_drafts`` to bind: transformers never passes one to a callable.
    """
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(
            "drafter must be a Drafter, e.g. LocalDrafter.open('indexes/python-stdlib') or "
            f"RemoteDrafter('127.0.0.1:50051'), got {type(drafter).__name__}"
        )
    _check_supported(generation_config, model_kwargs)
    prompt_width = input_ids.shape[1]  # generate set max_length to this + max_new_tokens
    max_new_tokens = max(0, generation_config.max_length - prompt_width)
    result = generate(
        model,
        input_ids,
        drafter,
        max_new_tokens=max_new_tokens,
        config=draft_config,
        overlap=overlap,
        attention_mask=model_kwargs.get("attention_mask"),
        generation_config=generation_config,  # eos ids, sampling: our loop reads them from here
        logits_processor=_user_processors(model, logits_processor, generation_config, prompt_width, max_new_tokens),
        stopping_criteria=_user_criteria(stopping_criteria, generation_config),
        streamer=streamer,
    )
    log.debug("rest_generate: %d steps, mean accepted %.2f, %.2f s", result.steps, result.mean_accepted, result.seconds)
    rows = result.output_ids if isinstance(result, BatchGenerationResult) else [result.output_ids]
    sequences = _sequences(input_ids, rows, hf_internals.pad_token_tensor(generation_config))
    if generation_config.return_dict_in_generate:
        return RestGenerateOutput(sequences=sequences, rest=result)
    return sequences


def generate_with_drafts(
    model: PreTrainedModel,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: BaseStreamer | None = None,
    *,
    drafter: Drafter | None,
    draft_config: DraftConfig = DraftConfig(),
    overlap: OverlapConfig | bool = False,
    tokenizer=None,
    stop_strings: str | Sequence[str] | None = None,
    **generate_kwargs,
) -> torch.LongTensor | RestGenerateOutput:
    """``model.generate`` with REST drafts and every argument ``model.generate`` takes, streamers and
    ``stop_strings`` (with ``tokenizer=``) included: what ``custom_generate=REST_GENERATE_DIR`` runs.

    It calls ``model.generate`` with ``custom_generate=rest_generate`` itself, handing over the two
    things transformers does not pass to a callable: the streamer, and stop strings (turned into a
    ``StopStringCriteria`` here, since that needs the tokenizer).
    """
    if generate_kwargs.get("assistant_model") is not None:
        raise ValueError("assistant_model: with REST the drafts come from the drafter; pass no assistant model")
    criteria = StoppingCriteriaList(stopping_criteria or [])
    configured = (generation_config.stop_strings if generation_config is not None else None) or (
        model.generation_config.stop_strings
    )
    stop_strings = stop_strings if stop_strings is not None else configured
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer= to generate")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    if configured:
        generate_kwargs["stop_strings"] = None  # stopped on above; transformers would want the tokenizer
    decode = functools.partial(
        rest_generate, drafter=drafter, draft_config=draft_config, overlap=overlap, streamer=streamer
    )
    return model.generate(
        inputs,
        generation_config=generation_config,
        stopping_criteria=criteria,
        streamer=streamer,  # transformers puts the prompt, as for its own loop; ours puts the new tokens
        custom_generate=decode,
        **generate_kwargs,
    )


def _user_processors(
    model: PreTrainedModel,
    prepared: LogitsProcessorList,
    generation_config: GenerationConfig,
    prompt_length: int,
    max_new_tokens: int,
) -> LogitsProcessorList:
    """The processors the caller passed to ``generate``: what transformers prepared minus the types
    our loop builds itself from the same config (it builds them per row). A caller's replacement for
    one of those built types is therefore not used; ``generate`` warns about such replacements."""
    built = row_logits_processors(model, generation_config, prompt_length, max_new_tokens, None)
    built_types = {type(processor) for processor in built}
    return LogitsProcessorList(p for p in prepared if type(p) not in built_types)


def _user_criteria(prepared: StoppingCriteriaList, generation_config: GenerationConfig) -> StoppingCriteriaList:
    """The stopping criteria our loop does not derive from the config itself (it stops at
    ``max_length``, on eos ids and after ``max_time`` on its own): the caller's, and stop strings."""
    own = (MaxLengthCriteria, EosTokenCriteria) + ((MaxTimeCriteria,) if generation_config.max_time is not None else ())
    return StoppingCriteriaList(c for c in prepared if not isinstance(c, own))


def _check_supported(generation_config: GenerationConfig, model_kwargs: dict) -> None:
    """Refuse, naming the option, what only ``model.generate``'s own loop returns or takes (the decoding
    modes our loop cannot do it refuses itself)."""
    per_step = [
        name
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
        if getattr(generation_config, name)
    ]
    if per_step:
        raise ValueError(
            f"rest_generate cannot return {', '.join(per_step)}: drafted tokens are verified several at a "
            "time in one tree forward, not one forward per token; only sequences are returned"
        )
    cache = hf_internals.prepared_cache(model_kwargs)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("rest_generate starts from an empty cache: the cache passed to generate must not hold tokens")
    unknown = set(model_kwargs) - _RECOMPUTED_MODEL_INPUTS - {"attention_mask", *hf_internals.CACHE_KEYWORDS}
    if unknown:
        raise ValueError(f"rest_generate takes token ids and an attention mask only; unsupported: {sorted(unknown)}")


def _sequences(
    input_ids: torch.LongTensor, new_tokens: Sequence[Sequence[int]], pad_token_id: torch.Tensor | None
) -> torch.LongTensor:
    """[B, L + longest row]: each prompt row followed by its new tokens, shorter rows padded with
    ``pad_token_id`` (what ``model.generate`` returns for rows that stop early)."""
    width = max(map(len, new_tokens))
    if pad_token_id is None and any(len(row) < width for row in new_tokens):
        raise ValueError("rows stopped at different lengths and the generation config has no pad_token_id to pad them")
    out = input_ids.new_full((input_ids.shape[0], width), 0 if pad_token_id is None else int(pad_token_id))
    for row, tokens in enumerate(new_tokens):
        out[row, : len(tokens)] = torch.tensor(tokens, dtype=out.dtype)
    return torch.cat([input_ids, out], dim=1)
