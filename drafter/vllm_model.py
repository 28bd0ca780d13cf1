"""A GGUF model as the safetensors checkpoint vLLM loads (vLLM 0.32 has no GGUF loader in-tree).

transformers dequantizes the GGUF (``from_pretrained(dir, gguf_file=...)``) and ``save_pretrained``
writes model, config and tokenizer; the config's GGUF quantizer marker is dropped first, or saving
refuses. The result is cached (``$REST_VLLM_MODELS``, default ``~/.cache/rest-spec/models``) and
written to a temporary directory renamed into place, so a crash never leaves half a checkpoint.

``python -m rest_spec.drafter.vllm_model [--model X.gguf]`` converts and prints the directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from rest_spec.common.tokenizer import packaged_smollm2

MODELS_ENV = "REST_VLLM_MODELS"


def models_dir() -> Path:
    return Path(os.environ.get(MODELS_ENV) or Path.home() / ".cache" / "rest-spec" / "models")


def hf_checkpoint(gguf: str | Path | None = None, *, dtype: str = "float32") -> Path:
    """Directory of the safetensors checkpoint for ``gguf`` (default: the packaged SmolLM2),
    converted on first use."""
    source = packaged_smollm2() if gguf is None else Path(gguf)
    if source.suffix != ".gguf":
        raise ValueError(f"{source} is not a .gguf file; a checkpoint directory is loaded by vLLM as it is")
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file not found: {source}")
    out = models_dir() / f"{source.stem}-{dtype}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        kwargs = {"gguf_file": source.name}
        model = AutoModelForCausalLM.from_pretrained(source.parent, dtype=getattr(torch, dtype), **kwargs)
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source.parent, **kwargs).save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rest_spec.drafter.vllm_model",
        description="Write a GGUF model as a safetensors checkpoint vLLM can load; print its directory.",
    )
    parser.add_argument("--model", help="a .gguf file (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(hf_checkpoint(args.model, dtype=args.dtype))


if __name__ == "__main__":
    main()
