"""The one module that reaches into transformers' internals, and absorbs the names that move.

Tree decoding needs more than transformers' public ``generate`` offers: a forward that reads and
extends a KV cache the loop owns, the cache's layer classes (``kv_cache`` compacts them in place),
and the private helpers ``model.generate`` prepares its generation config, special tokens and
logits processors with (``sampling`` reproduces ``generate``'s token choice with them). Those are
not stable API: the cache keyword of a model's ``forward`` was ``past_key_values`` through the
early 5.x releases and is ``cache`` in the newer ones (the old name deprecated, with a warning on
every call), and a ``custom_generate`` callable receives its cache under either name. Every other
module of the project goes through the functions here, so that the next rename is one edit.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicLayer

__all__ = [
    "CACHE_KEYWORDS",
    "DynamicCache",
    "DynamicLayer",
    "forward_with_cache",
    "forward_takes",
    "logits_processors",
    "pad_token_tensor",
    "prepare_generation_config",
    "prepared_cache",
]

CACHE_KEYWORDS = ("cache", "past_key_values")
"""The names transformers has given the KV cache, newest first: of a model's ``forward`` argument,
and of the entry ``model.generate`` hands a ``custom_generate`` callable among its model inputs."""


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def forward_takes(model: PreTrainedModel, name: str) -> bool:
    """Whether ``model.forward`` has a parameter ``name`` (e.g. ``logits_to_keep``)."""
    return name in _forward_parameters(type(model))


def _cache_keyword(model: PreTrainedModel) -> str:
    """The newest cache keyword ``model.forward`` takes: each model class follows the rename on its
    own schedule, so the signature decides, not the transformers version."""
    return next((name for name in CACHE_KEYWORDS if forward_takes(model, name)), CACHE_KEYWORDS[-1])


def forward_with_cache(model: PreTrainedModel, cache: DynamicCache, **inputs: Any) -> Any:
    """``model(**inputs)`` attending to ``cache`` and appending the new positions to it."""
    return model(**inputs, use_cache=True, **{_cache_keyword(model): cache})


def prepared_cache(model_inputs: dict[str, Any]) -> DynamicCache | None:
    """The cache among the model inputs ``model.generate`` prepared for a ``custom_generate``
    callable, under whichever name this transformers uses; None when it prepared none."""
    return next((model_inputs[name] for name in CACHE_KEYWORDS if model_inputs.get(name) is not None), None)


def prepare_generation_config(
    model: PreTrainedModel, generation_config: GenerationConfig | None, eos_token_id: int | list[int] | None = None
) -> GenerationConfig:
    """The config ``model.generate`` would decode with, special-token tensors prepared: a copy of
    ``generation_config`` (default: the model's) completed from the model's and global defaults,
    its eos ids replaced by ``eos_token_id`` when given."""
    config, _ = model._prepare_generation_config(generation_config)
    if eos_token_id is not None:
        config.eos_token_id = eos_token_id
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
    return config


def logits_processors(
    model: PreTrainedModel, config: GenerationConfig, prompt_length: int, logits_processor: LogitsProcessorList
) -> LogitsProcessorList:
    """The list ``model.generate`` builds from ``config`` for a prompt of ``prompt_length`` tokens,
    with the processors in ``logits_processor`` replacing built ones of the same type."""
    return model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_length,
        logits_processor=logits_processor,
        device=model.device,
    )


def pad_token_tensor(config: GenerationConfig) -> torch.Tensor | None:
    """The pad id ``model.generate`` pads finished rows with (the first eos id when the config has
    none), as prepared by ``prepare_generation_config``."""
    return config._pad_token_tensor
