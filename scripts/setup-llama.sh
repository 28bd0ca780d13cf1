#!/usr/bin/env bash
# llama.cpp for `rest-generate --engine llama.cpp` and rest_spec.drafter.llamacpp.draft_model (the llama extra),
# into .venv after scripts/setup.sh: llama-cpp-python compiles llama.cpp from source, here portably
# (no -march=native; AVX2/FMA/F16C on x86) and without llamafile's matrix kernels, whose batches round
# differently from one-token steps (drafting would then change greedy output at near-ties), and
# without the tools, tests and multimodal library nothing here uses: about two minutes on 2 cores.
# --no-cache-dir: pip would reuse a wheel built earlier with other flags. --no-warn-conflicts: the
# packaged model's metadata asks for llm, which nothing here uses (see setup.sh); pip would report
# that as an ERROR line although nothing failed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "setup-llama: run scripts/setup.sh first" >&2; exit 1; }
# The llama extra's requirement, as pyproject.toml declares it (only llama-cpp-python and what it needs
# are added: nothing installed already is rewritten, so tests may run from .venv meanwhile, as CI's do).
LLAMA=$(sed -n 's/^llama = \["\(llama-cpp-python[^"]*\)"\]$/\1/p' pyproject.toml)
[ -n "$LLAMA" ] || { echo "setup-llama: no llama = [\"llama-cpp-python...\"] in pyproject.toml" >&2; exit 1; }
CMAKE_ARGS="${CMAKE_ARGS:-$(cat scripts/llama-cpp-cmake-args)}" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --no-cache-dir "$LLAMA"
echo "llama.cpp ready: llama-cpp-python $(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
