"""Loading the target model from a spec (shared by the CLI, tests and benchmarks); the tokenizer
for the same spec comes from ``common.tokenizer.load_tokenizer``.

A spec is what ``common.tokenizer.split_model_spec`` accepts: a Hugging Face id, a local
directory, a ``.gguf`` file, or ``None`` for the packaged SmolLM2-135M-Instruct GGUF.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rest_spec.common.tokenizer import split_model_spec


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    spec: str | Path | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """The causal LM for ``spec`` in eval mode on ``device`` (default: ``default_device()``).

    ``dtype`` None keeps the checkpoint's default (GGUF weights are dequantized to float32).
    """
    name, kwargs = split_model_spec(spec)
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except OSError as exc:
        label = name + (f"/{kwargs['gguf_file']}" if "gguf_file" in kwargs else "")
        raise OSError(f"cannot load model {label!r}: {exc}") from exc
    return model.to(device or default_device()).eval()
