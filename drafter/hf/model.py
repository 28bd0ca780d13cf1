"""Loading the target model from a spec (shared by the CLI, tests and benchmarks); the tokenizer
for the same spec comes from ``common.tokenizer.load_tokenizer``.

A spec is what ``common.tokenizer.split_model_spec`` accepts: a Hugging Face id, a local
directory, a ``.gguf`` file, or ``None`` for the packaged SmolLM2-135M-Instruct GGUF.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from rest_spec.common.cache import load_converted
from rest_spec.common.checkpoint import conversion, from_pretrained
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

    ``dtype`` None keeps the checkpoint's default (GGUF weights are dequantized to float32). A GGUF
    file is loaded from ``common.checkpoint.hf_checkpoint``'s conversion: dequantizing takes
    seconds, reading the converted weights a tenth of one, and they are the same weights.
    """
    name, kwargs = split_model_spec(spec)
    if "gguf_file" in kwargs:
        gguf = Path(name) / kwargs["gguf_file"]
        kind, dequantize = conversion(gguf, str(dtype or torch.float32).removeprefix("torch."))
        model = load_converted(gguf, kind, dequantize, lambda directory: from_pretrained(str(directory), {}))
    else:
        model = from_pretrained(name, {"dtype": dtype} if dtype is not None else {})
    return model.to(device or default_device()).eval()
