"""A GGUF model as a safetensors checkpoint (weights, config, tokenizer), converted once and cached
under ``$REST_MODELS_DIR`` (``common.cache.converted``): what ``drafter.hf.model.load_model`` reads
for a GGUF file, and what vLLM, which has no GGUF loader in-tree, loads
(``drafter.vllm.checkpoint``). Below both engines, so that neither imports the other. torch and
transformers are imported when a conversion or a load is asked for, not by importing this module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rest_spec.common.cache import converted
from rest_spec.common.tokenizer import packaged_smollm2


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
    return converted(source, *conversion(source, dtype))


def conversion(gguf: Path, dtype: str) -> tuple[str, Callable[[Path], None]]:
    """(kind, convert) of ``gguf``'s checkpoint in ``dtype`` for ``common.cache.converted``: the kind
    names the dtype and the transformers that dequantizes (each environment converts with its own,
    as CI's lower-bound run must)."""
    import transformers

    return f"{dtype}-transformers-{transformers.__version__}", lambda out: _dequantize(gguf, out, dtype)


def from_pretrained(name: str, kwargs: dict):
    """``AutoModelForCausalLM.from_pretrained(name, **kwargs)``; a model that cannot be loaded is an
    ``OSError`` naming it."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except OSError as exc:
        label = name + (f"/{kwargs['gguf_file']}" if "gguf_file" in kwargs else "")
        raise OSError(f"cannot load model {label!r}: {exc}") from exc


def _dequantize(gguf: Path, out: Path, dtype: str) -> None:
    """Write ``gguf`` as a safetensors checkpoint in ``dtype`` (with its tokenizer) to ``out``;
    the config's GGUF quantizer marker is dropped first, or saving refuses."""
    import torch

    from rest_spec.common.tokenizer import load_tokenizer

    model = from_pretrained(str(gguf.parent), {"gguf_file": gguf.name, "dtype": getattr(torch, dtype)})
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out)
    load_tokenizer(gguf).save_pretrained(out)
