"""Loading the target model from a spec (shared by the CLI, tests and benchmarks); the tokenizer
for the same spec comes from ``common.tokenizer.load_tokenizer``.

A spec is what ``common.tokenizer.split_model_spec`` accepts: a Hugging Face id, a local
directory, a ``.gguf`` file, or ``None`` for the packaged SmolLM2-135M-Instruct GGUF.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

from rest_spec.common.cache import converted, load_converted
from rest_spec.common.tokenizer import packaged_smollm2, split_model_spec


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
    file is loaded from ``hf_checkpoint``'s conversion: dequantizing takes seconds, reading the
    converted weights a tenth of one, and they are the same weights.
    """
    name, kwargs = split_model_spec(spec)
    if "gguf_file" in kwargs:
        gguf = Path(name) / kwargs["gguf_file"]
        model = load_converted(
            gguf,
            _checkpoint_kind(_dtype_name(dtype or torch.float32)),
            lambda out: _dequantize(gguf, out, dtype or torch.float32),
            lambda directory: _from_pretrained(str(directory), {}),
        )
    else:
        model = _from_pretrained(name, {"dtype": dtype} if dtype is not None else {})
    return model.to(device or default_device()).eval()


def hf_checkpoint(gguf: str | Path | None = None, *, dtype: str = "float32") -> Path:
    """The directory of the safetensors checkpoint (weights, config, tokenizer) dequantized from
    ``gguf`` (default: the packaged SmolLM2), converted on first use and cached
    (``common.cache.converted``): what ``load_model`` reads for a GGUF file, and what vLLM, which
    has no GGUF loader in-tree, loads."""
    source = packaged_smollm2() if gguf is None else Path(gguf)
    if source.suffix != ".gguf":
        raise ValueError(f"{source} is not a .gguf file; a checkpoint directory is loaded as it is")
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file not found: {source}")
    return converted(source, _checkpoint_kind(dtype), lambda out: _dequantize(source, out, getattr(torch, dtype)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _checkpoint_kind(dtype: str) -> str:
    """A converted checkpoint's directory name: its dtype and the transformers that dequantized it
    (each environment converts with its own, as CI's lower-bound run must)."""
    return f"{dtype}-transformers-{transformers.__version__}"


def _from_pretrained(name: str, kwargs: dict) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except OSError as exc:
        label = name + (f"/{kwargs['gguf_file']}" if "gguf_file" in kwargs else "")
        raise OSError(f"cannot load model {label!r}: {exc}") from exc


def _dequantize(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """Write ``gguf`` as a safetensors checkpoint in ``dtype`` (with its tokenizer) to ``out``;
    the config's GGUF quantizer marker is dropped first, or saving refuses."""
    from rest_spec.common.tokenizer import load_tokenizer

    model = _from_pretrained(str(gguf.parent), {"gguf_file": gguf.name, "dtype": dtype})
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out)
    load_tokenizer(gguf).save_pretrained(out)
