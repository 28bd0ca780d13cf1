#!/usr/bin/env bash
# The quick start: install, build a REST index from a packaged corpus (this Python's standard
# library, tokenized with the packaged SmolLM2 tokenizer), serve it over gRPC, and complete the first
# four HumanEval prompts with the packaged SmolLM2 model drafting from the server. Prints each output
# and its statistics, then one line: REST's speed against the same model without drafts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
INDEX=${INDEX:-indexes/python-stdlib}
PORT=${PORT:-50051}
[ -f "$INDEX/manifest.json" ] || build_index --corpus python-stdlib --out "$INDEX"

# The server prints "listening on HOST:PORT" only once its kernels are loaded and it answers at full
# speed; wait for that line, and stop at once with its error if it exits instead.
SERVER_LOG=$(mktemp)
PROMPTS=$(mktemp --suffix=.jsonl)
rest-datastore serve --index "$INDEX" --host 127.0.0.1 --port "$PORT" >"$SERVER_LOG" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$SERVER_LOG" "$PROMPTS"' EXIT
for _ in $(seq 600); do
    grep -q "^listening on" "$SERVER_LOG" && break
    kill -0 $SERVER 2>/dev/null || { wait $SERVER || true; echo "quickstart: the datastore server exited (see above)" >&2; exit 1; }
    sleep 0.2
done
grep -q "^listening on" "$SERVER_LOG" || { echo "quickstart: the datastore server did not start within 120 s" >&2; exit 1; }

python - "$PROMPTS" <<'PY'
import json, sys
from benchmarks.harness.sets import humaneval_prompts
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"prompt": prompt}) + "\n" for prompt in humaneval_prompts(4))
PY
# REST: the adaptive drafter (the server's index, the prompt's own text, recent outputs), its trees
# sized by this machine's measured verification cost (measured once, about a minute, then cached),
# against the same model decoding without drafts: both warmed up first, taking turns, outputs compared.
rest-generate --datastore "127.0.0.1:$PORT" --prompts "$PROMPTS" --max-new-tokens 128 --adaptive --compare
