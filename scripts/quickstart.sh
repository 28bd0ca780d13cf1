#!/usr/bin/env bash
# The quick start: install, build a REST index from a packaged corpus (this Python's standard
# library, tokenized with the packaged SmolLM2 tokenizer), serve it over gRPC, and generate with the
# packaged SmolLM2 model drafting from the server. Prints the output and the speculative-decoding stats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
INDEX=${INDEX:-indexes/python-stdlib}
PORT=${PORT:-50051}
[ -f "$INDEX/manifest.json" ] || build_index --corpus python-stdlib --out "$INDEX"
rest-datastore serve --index "$INDEX" --host 127.0.0.1 --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do rest-datastore info --server "127.0.0.1:$PORT" >/dev/null 2>&1 && break; sleep 0.5; done
PROMPTS=$(mktemp --suffix=.jsonl)
python - "$PROMPTS" <<'PY'
import json, sys
from benchmarks.data import humaneval_prompts
with open(sys.argv[1], "w") as f:
    f.write(json.dumps({"prompt": humaneval_prompts(1)[0]}) + "\n")
PY
rest-generate --datastore "127.0.0.1:$PORT" --prompts "$PROMPTS" --max-new-tokens 128 --budget 64
