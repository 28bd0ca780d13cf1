"""Loading the target model from a spec (shared by the CLI, tests and benchmarks); the tokenizer
for the same spec comes from ``common.tokenizer.load_tokenizer``.

A spec is what ``common.tokenizer.split_model_spec`` accepts: a Hugging Face id, a local
directory, a ``.gguf`` file, or ``None`` for the packaged SmolLM2-135M-Instruct GGUF.
"""

from __future__ import annotations

from collections.abc import Callable
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
        kind, dequantize = _conversion(gguf, str(dtype or torch.float32).removeprefix("torch."))
        model = load_converted(gguf, kind, dequantize, lambda directory: _from_pretrained(str(directory), {}))
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
    return converted(source, *_conversion(source, dtype))


def _conversion(gguf: Path, dtype: str) -> tuple[str, Callable[[Path], None]]:
    """(kind, convert) of ``gguf``'s checkpoint in ``dtype`` for ``common.cache.converted``: the kind
    names the dtype and the transformers that dequantizes (each environment converts with its own,
    as CI's lower-bound run must)."""
    return f"{dtype}-transformers-{transformers.__version__}", lambda out: _dequantize(gguf, out, getattr(torch, dtype))


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
