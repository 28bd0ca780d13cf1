"""Code at the paper's scale: what a bigger code index is worth on held-out problems, and what it costs.

    .venv-vllm/bin/python -m benchmarks.code_scale --index indexes/pypi-9m --index indexes/pypi-40m \
        --index indexes/pypi-150m --index indexes/python-stdlib

For each index (``build_index --corpus pypi --max-tokens N``; the stdlib's for reference), on
HumanEval 101-164 with the model's greedy outputs (plain vLLM, ``benchmarks.harness.streams``' cache):

- what it is worth, replayed without the engine (``benchmarks.harness.fleet_replay``, as
  ``benchmarks.history``): tokens per step of REST (index, request, store of outputs; a fresh
  replica) and vLLM's ``suffix``, at most k draft tokens a step, with REST's hindsight per source (tokens the index held of what followed, tokens of it
  accepted) -- REST's paper saw +0.14 accepted tokens per step per doubling of The Stack;
- what it costs: open time and resident memory (``benchmarks.retrieval``), retrieval latency p50/p99
  in process (budget 64, every query a held-out context: the prompt and a prefix of its output)
  and the gRPC round trip to a ``rest-datastore serve`` of it (one client).

Latency is timed: run it on a quiet machine. Prints one JSON object and saves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.fleet_replay import run_fleet
from benchmarks.harness.report import RESULTS, benchmark_parser, positive_int, save_report, start_run
from benchmarks.harness.retrieval_timing import compare_latency, grpc_figures, open_figures, our_engine
from benchmarks.harness.streams import greedy_outputs, set_streams
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.datastore import format as fmt
from rest_spec.datastore.index import Datastore

QUERY_STRIDE = 8  # a query every 8 tokens of each held-out output


def held_out_queries(held_out: list[tuple[list[int], list[int]]], limit: int) -> list[list[int]]:
    """Contexts a decoder drafts for: each prompt continued by prefixes of its greedy output."""
    queries = [prompt + output[:i] for prompt, output in held_out for i in range(0, len(output), QUERY_STRIDE)]
    return queries[:limit]


def measure(index: Path, held_out, args) -> dict:
    manifest = fmt.read_manifest(index)
    result = {
        "index": str(index),
        "tokens": sum(shard.num_tokens for shard in manifest.shards),
        "corpus": manifest.corpus.get("spec", {}).get("name") if isinstance(manifest.corpus, dict) else None,
        "replay": {d: run_fleet(d, args.k, index, [], held_out, 1) for d in ("suffix", "rest")},
    }
    if not args.skip_latency:
        queries = held_out_queries(held_out, args.queries)
        result["open"] = open_figures(index, manifest.num_bytes)["ours"]
        with Datastore.open(index) as store:
            store.warm_up()
            result["in_process_ms"] = compare_latency({"ours": our_engine(store)}, queries, (64,))["budget_64"]["ours"]
        grpc = grpc_figures(index, queries, args.seconds)
        result["grpc_ms"] = grpc["clients"]["1"]["round_trip"]
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = benchmark_parser(__doc__, prompts=64, prompts_help="HumanEval prompts from the 101st")
    p.add_argument("--index", type=Path, action="append", required=True, help="an index to measure (repeat)")
    p.add_argument("--k", type=positive_int, default=8, help="draft tokens per step at most (default: %(default)s)")
    p.add_argument("--queries", type=int, default=1000, help="latency queries per index (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=5.0, help="gRPC measuring time (default: %(default)s)")
    p.add_argument("--warmup-concurrency", type=positive_int, default=32, help="requests at once decoding outputs")
    p.add_argument("--skip-latency", action="store_true", help="the replay only (no timing)")
    p.add_argument("--out", type=Path, default=RESULTS / "code_scale.json")
    args = p.parse_args(argv)
    report = start_run("code_scale", argv, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from benchmarks.harness.engines import ENGINE_MODEL
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")
    _, _, held_prompts = set_streams("code", load_tokenizer(None), 0, args.prompts)
    held_out = list(zip(held_prompts, greedy_outputs(held_prompts, args)))
    report["held_out"] = f"HumanEval {101}-{100 + len(held_out)}"
    report["indexes"] = [measure(index, held_out, args) for index in args.index]
    save_report(report, args.out)


if __name__ == "__main__":
    main()
