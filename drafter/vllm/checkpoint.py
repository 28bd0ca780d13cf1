"""A GGUF model as the safetensors checkpoint vLLM loads (vLLM 0.32 has no GGUF loader in-tree):
``common.checkpoint.hf_checkpoint``, the conversion ``drafter.hf.model.load_model`` reads too, cached under
``$REST_MODELS_DIR`` (default ``~/.cache/rest-spec/models``).

``python -m rest_spec.drafter.vllm.checkpoint [--model X.gguf]`` converts and prints the directory.
"""

from __future__ import annotations

import argparse

from rest_spec.common.checkpoint import hf_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rest_spec.drafter.vllm.checkpoint",
        description="Write a GGUF model as a safetensors checkpoint vLLM can load; print its directory.",
    )
    parser.add_argument("--model", help="a .gguf file (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(hf_checkpoint(args.model, dtype=args.dtype))


if __name__ == "__main__":
    main()
