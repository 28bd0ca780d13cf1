"""The model's own corpus, built the way a user builds it: ``rest-fill-outputs`` then ``build_index``.

    .venv-vllm/bin/python -m benchmarks.own_corpus --sets code,chat --count 2000

For each set, the prompts of ``benchmarks.fleet``'s warm-up stream (function-completion prompts
mined from packages no index or evaluation set holds; ShareGPT first user turns outside the held-out
sets), never a held-out prompt of ``benchmarks.history`` / ``benchmarks.fleet``, are written as a
prompts file; ``rest-fill-outputs --engine vllm`` stores the model's greedy replies in a store of
outputs (resumable: a rerun skips what is stored), and ``build_index --corpus outputs:DIR`` turns
the store into an index (``indexes/own/<set>``). Reports each step's seconds and the sizes;
``benchmarks.history --own-index`` then measures what the index is worth on the held-out sets.

Decoding thousands of prompts takes hours on two cores, and ``benchmarks.history`` /
``benchmarks.fleet`` decode the same prompts' greedy outputs for their warm-up (cached). With
``--fill N`` the command decodes the first N prompts and the rest of the store is written from that
cache through the store's own API (``OutputStore.add``): the same outputs, checked equal to what
the command stored for the first N.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.engines import engine_env
from benchmarks.harness.report import REPO, RESULTS, benchmark_parser, positive_int, report_header, save_report
from benchmarks.harness.streams import greedy_outputs, set_streams
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.datastore.outputs import OutputStore, read_outputs

OWN = REPO / "indexes" / "own"
HELD_OUT = {"code": 64, "chat": 40}  # the held-out prompts benchmarks.history and benchmarks.fleet measure


def write_prompts(path: Path, tokenizer, prompts: Sequence[Sequence[int]]) -> None:
    """A ``--prompts`` file of ``prompts`` (token ids) as raw text (chat turns keep their template's
    special tokens, which the tokenizer reads back as such)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        for ids in prompts:
            file.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")


def timed(argv: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, check=True)
    return round(time.perf_counter() - start, 1)


def complete_from_cache(store: Path, warm: list[list[int]], filled: int, args: argparse.Namespace) -> int:
    """Add the greedy outputs of ``warm[filled:]`` (``benchmarks.harness.streams.greedy_outputs``' cache)
    to ``store``, after checking the command's ``filled`` outputs equal the cache's; returns how
    many it added."""
    outputs = greedy_outputs(warm, args)
    stored = [tokens.tolist() for _, tokens in read_outputs(store)]
    if stored[:filled] != outputs[:filled]:
        differ = sum(a != b for a, b in zip(stored, outputs[:filled]))
        raise SystemExit(f"{store}: {differ} of the first {filled} stored outputs differ from the cached ones")
    with OutputStore(10**9, store) as outputs_store:
        for output in outputs[len(stored) :]:
            outputs_store.add(output)
    return len(outputs) - len(stored)


def build_set(name: str, count: int, args: argparse.Namespace, tokenizer) -> dict:
    _, warm, _ = set_streams(name, tokenizer, count, HELD_OUT[name])
    filled = count if args.fill is None else min(args.fill, count)
    prompts, store, index = OWN / f"{name}-prompts.jsonl", OWN / f"{name}-outputs", OWN / name
    write_prompts(prompts, tokenizer, warm[:filled])
    bin_dir = Path(sys.executable).parent
    fill = [
        str(bin_dir / "rest-fill-outputs"), "--engine", "vllm", "--prompts", str(prompts), "--outputs-dir", str(store),
        "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.batch_size), "--dtype", "float32",
    ]  # fmt: skip
    fill_seconds = timed(fill, env=engine_env())
    from_cache = complete_from_cache(store, warm, filled, args) if filled < count else 0
    build = [str(bin_dir / "build_index"), "--corpus", f"outputs:{store}", "--out", str(index), "--overwrite"]
    build_seconds = timed([*build, "--json"])
    manifest = json.loads((index / "manifest.json").read_text())
    return {
        "prompts": len(warm),
        "prompts_file": str(prompts.relative_to(REPO)),
        "store": str(store.relative_to(REPO)),
        "index": str(index.relative_to(REPO)),
        "fill_command": " ".join(fill),
        "fill_seconds": fill_seconds,
        "decoded_by_the_command": filled,
        "added_from_the_cache": from_cache,
        "build_command": " ".join(build),
        "build_seconds": build_seconds,
        "tokens": sum(shard["num_tokens"] for shard in manifest["shards"]),
        "documents": sum(shard["num_documents"] for shard in manifest["shards"]),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = benchmark_parser(__doc__, prompts=None, sets=("code", "chat"))
    p.add_argument("--count", type=positive_int, default=2000, help="prompts per set (default: %(default)s)")
    p.add_argument(
        "--fill",
        type=int,
        default=None,
        metavar="N",
        help="decode the first N prompts with rest-fill-outputs, the rest from the warm-up cache (default: all)",
    )
    p.add_argument("--warmup-concurrency", type=int, default=32, help="requests at once decoding the cache's outputs")
    p.add_argument("--batch-size", type=int, default=32, help="requests vLLM decodes at once (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / "own_corpus.json")
    args = p.parse_args(argv)
    from benchmarks.harness.engines import ENGINE_MODEL
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")  # the cache's key
    tokenizer = load_tokenizer(None)
    report = report_header("own_corpus", argv)
    report["sets"] = {name: build_set(name, args.count, args, tokenizer) for name in args.sets}
    save_report(report, args.out)


if __name__ == "__main__":
    main()
