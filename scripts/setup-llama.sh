#!/usr/bin/env bash
# llama.cpp for `rest-generate --engine llama.cpp` and rest_spec.drafter.llamacpp.draft_model (the llama extra),
# into .venv after scripts/setup.sh: llama-cpp-python compiles llama.cpp from source, here portably
# (no -march=native; AVX2/FMA/F16C on x86) and without llamafile's matrix kernels, whose batches round
# differently from one-token steps (drafting would then change greedy output at near-ties), and
# without the tools, tests, multimodal library and `common` library nothing here uses (scripts/llama-cpp-project.cmake):
# 213 s on 2 Zen 3 cores, download to install (544 s in CI with `common`).
# The wheel it builds is kept under $REST_CACHE_DIR/llama-wheels (default ~/.cache/rest-spec), in a
# folder named by a hash of the source archive, the CMake flags, the Python and the machine, and
# installed from there the next time: the same build, without the compile (pip's own cache is off,
# --no-cache-dir, since it would reuse a wheel built with other flags). --no-warn-conflicts: the
# packaged model's metadata asks for llm, which nothing here uses (see setup.sh); pip would report
# that as an ERROR line although nothing failed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "setup-llama: run scripts/setup.sh first" >&2; exit 1; }
# The llama extra's requirement, as pyproject.toml declares it (only llama-cpp-python and what it needs
# are added: nothing installed already is rewritten, so tests may run from .venv meanwhile, as CI's do).
LLAMA=$(sed -n 's/^llama = \["\(llama-cpp-python[^"]*\)"\]$/\1/p' pyproject.toml)
[ -n "$LLAMA" ] || { echo "setup-llama: no llama = [\"llama-cpp-python...\"] in pyproject.toml" >&2; exit 1; }
# scripts/llama-cpp-project.cmake leaves out llama.cpp's common library, which llama-cpp-python builds and never loads
PROJECT_INCLUDE="$PWD/scripts/llama-cpp-project.cmake"
export CMAKE_ARGS="${CMAKE_ARGS:-$(cat scripts/llama-cpp-cmake-args) -DCMAKE_PROJECT_llama.cpp_INCLUDE=$PROJECT_INCLUDE}"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
SOURCE=$(mktemp -d) PARTIAL=
trap 'rm -rf "$SOURCE" ${PARTIAL:+"$PARTIAL"}' EXIT  # an interrupted build leaves no partial folder either
"${PIP[@]}" download --quiet --no-deps --no-binary llama-cpp-python --dest "$SOURCE" "$LLAMA"
ARCHIVE=$(find "$SOURCE" -maxdepth 1 -name 'llama_cpp_python-*' -print -quit)
[ -n "$ARCHIVE" ] || { echo "setup-llama: pip downloaded no llama-cpp-python source archive" >&2; exit 1; }
# the key reads the project include by its content, not its path: a clone elsewhere finds the same wheel
KEY=$( { sha256sum "$ARCHIVE" | cut -d' ' -f1; echo "${CMAKE_ARGS//"$PWD"/.}"; cat "$PROJECT_INCLUDE"
    .venv/bin/python -c 'import sys; print(sys.version)'
    uname -m; grep -m1 '^flags' /proc/cpuinfo || true; } | sha256sum | cut -c1-16)
WHEELS="${REST_CACHE_DIR:-$HOME/.cache/rest-spec}/llama-wheels"
BUILT="$WHEELS/$KEY"
if ! compgen -G "$BUILT/llama_cpp_python-*.whl" >/dev/null; then
    echo "setup-llama: compiling $(basename "$ARCHIVE") (kept in $BUILT)"
    mkdir -p "$WHEELS"
    PARTIAL=$(mktemp -d "$WHEELS/.partial-XXXXXX")
    "${PIP[@]}" wheel --quiet --no-deps --no-cache-dir --wheel-dir "$PARTIAL" "$ARCHIVE"
    rm -rf "$BUILT" && mv "$PARTIAL" "$BUILT"  # whole, or not at all: an interrupted build leaves no wheel here
fi
"${PIP[@]}" install --quiet --no-warn-conflicts --no-cache-dir "$BUILT"/llama_cpp_python-*.whl
echo "llama.cpp ready: llama-cpp-python $(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
