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
from benchmarks.common import humaneval_prompts
with open(sys.argv[1], "w") as f:
    f.write(json.dumps({"prompt": humaneval_prompts(1)[0]}) + "\n")
PY
# REST: the adaptive drafter (the server's index, the prompt's own text, recent outputs), its trees
# sized by this machine's measured verification cost (measured once, about a minute, then cached)
rest-generate --datastore "127.0.0.1:$PORT" --prompts "$PROMPTS" --max-new-tokens 128 --adaptive
echo "the same prompt without drafts (the model alone, through the same loop at its fastest layout), for comparison:"
rest-generate --prompts "$PROMPTS" --max-new-tokens 128 --no-draft >/dev/null  # its statistics line only (stderr)
# The same GGUF file through llama.cpp (llama-cpp-python), drafting from the same server: chains sized
# by llama.cpp's own measured step cost (measured once, about ten seconds), then without drafts.
echo "the same prompt through llama.cpp, drafting from the server, then without drafts:"
rest-generate --engine llama.cpp --datastore "127.0.0.1:$PORT" --prompts "$PROMPTS" --max-new-tokens 128 >/dev/null
rest-generate --engine llama.cpp --prompts "$PROMPTS" --max-new-tokens 128 --no-draft >/dev/null
