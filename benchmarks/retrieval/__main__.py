"""python -m benchmarks.retrieval: every figure of both indexes and the growth curve, in one report."""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict
from pathlib import Path

import benchmarks.retrieval as retrieval
from benchmarks.harness.draftretriever import REST_SEARCH, open_draftretriever
from benchmarks.harness.report import REPO, RESULTS, save_report, start_run
from benchmarks.harness.retrieval_timing import (
    BUDGETS,
    GROWTH_BUDGET,
    OPEN_REPEATS,
    QUERY_TOKENS,
    REFERENCE_OPEN_REPEATS,
    ROUNDS,
    WARMUP_QUERIES,
    compare_latency,
    grpc_figures,
    node_counts,
    open_figures,
    our_engine,
    reference_engine,
    sample_queries,
)
from benchmarks.retrieval import GROWTH_SEED
from benchmarks.retrieval.builds import IndexSpec, check_disk_space, prepare_growth_index, prepare_index
from benchmarks.retrieval.report import evaluate_targets, format_table
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.datastore.index import Datastore

log = logging.getLogger("benchmarks.retrieval")


def benchmark_index(spec: IndexSpec, index: Path, build: dict, queries: list[list[int]], args) -> dict:
    """Every figure of one index, ours and draftretriever's, in one process."""
    reference = args.workdir / f"{spec.name}.draftretriever.idx"
    with Datastore.open(index) as store:
        manifest = store.manifest
        log.info("%s: in-process latency (%d queries, %d rounds)", spec.name, len(queries), ROUNDS)
        reader = open_draftretriever(reference)
        latency = compare_latency(
            {"ours": our_engine(store), "draftretriever": reference_engine(reader)}, queries, BUDGETS
        )
        nodes = node_counts(store, reader, queries)
        del reader
    for figures in latency.values():
        figures["speedup"] = figures["draftretriever"]["median_ms"] / figures["ours"]["median_ms"]
    log.info("%s: open time and memory", spec.name)
    opening = open_figures(index, manifest.num_bytes, reference)
    ours, theirs = build["ours"], build["draftretriever"]
    their_seconds = sum(
        (
            theirs["tokenize"]["load_tokenizer_seconds"],
            theirs["tokenize"]["seconds"],
            theirs["writer_seconds"],
            theirs["reader_seconds"],
        )
    )
    result = {
        "tokens": manifest.num_tokens,
        "documents": manifest.num_documents,
        "shards": len(manifest.shards),
        "queries": len(queries),
        "in_process_latency": latency,
        "draft_nodes": nodes,
        "open": opening,
        "bytes_per_token": {
            "ours": manifest.num_bytes / manifest.num_tokens,
            "draftretriever": theirs["bytes_on_disk"] / manifest.num_tokens,
            "note": "draftretriever's file holds only the tokens, compressed; its Reader "
            "rebuilds the suffix array in memory at every load",
        },
        "build": {
            "ours": {
                "seconds": ours["seconds"],
                "tokenize_tokens_per_second": ours["tokenize_tokens_per_second"],
                "suffix_array_tokens_per_second": ours["suffix_array_tokens_per_second"],
                "peak_rss_bytes": ours["peak_rss_bytes"],
                "command": ours["command"],
            },
            "draftretriever": {
                "seconds": their_seconds,
                "tokenize_tokens_per_second": theirs["tokenize"]["tokens_per_second"],
                "suffix_array_tokens_per_second": manifest.num_tokens / theirs["reader_seconds"],
                "writer_seconds": theirs["writer_seconds"],
                "reader_seconds": theirs["reader_seconds"],
                "peak_rss_bytes": theirs["peak_rss_bytes"],
                "tokenize_method": theirs["tokenize"]["method"],
                "tokenized_tokens_match_index": theirs["tokenize"]["tokens"] == manifest.num_tokens,
                "note": "seconds = tokenizer load + REST-style tokenization + Writer (compresses and writes "
                "the tokens) + one Reader construction (decompresses, builds the suffix array: the "
                "suffix-array tokens/s). Peak memory is the Writer and Reader's process. Ours: seconds = "
                "the build_index CLI's total; suffix-array seconds from its summary.",
            },
            "date": build["date"],
        },
    }
    if not args.skip_grpc:
        log.info("%s: gRPC, %g s per client count", spec.name, args.seconds)
        result["grpc"] = grpc_figures(index, queries, args.seconds)
    return result


def benchmark_growth(source: Path, queries: list[list[int]], args) -> dict:
    """Latency at budget 64 on the same queries for the source index replicated at each factor."""
    disk = check_disk_space(args.workdir, source, args.growth, args.reuse)
    rows = []
    for factor in args.growth:
        index, build = prepare_growth_index(source, factor, args.workdir, args.reuse)
        with Datastore.open(index) as store:
            manifest = store.manifest
            latency = compare_latency({"ours": our_engine(store)}, queries, (GROWTH_BUDGET,))
        opening = open_figures(index, manifest.num_bytes)["ours"]
        rows.append(
            {
                "factor": factor,
                "tokens": manifest.num_tokens,
                "shards": len(manifest.shards),
                "bytes_on_disk": manifest.num_bytes,
                **latency[f"budget_{GROWTH_BUDGET}"]["ours"],
                "open_seconds": opening["open_seconds"],
                "rss_added_bytes": opening["rss_added_bytes"],
                "rss_added_percent_of_index": opening["rss_added_percent_of_index"],
                "build_seconds": build.get("seconds"),
                "build_peak_rss_bytes": build.get("peak_rss_bytes"),
            }
        )
        log.info("growth x%d: %d tokens, median %.3f ms", factor, manifest.num_tokens, rows[-1]["median_ms"])
    base = next((r for r in rows if r["factor"] == 1), rows[0])
    for row in rows:
        row["median_vs_base"] = row["median_ms"] / base["median_ms"]
    return {
        "budget": GROWTH_BUDGET,
        "disk": disk,
        "sizes": rows,
        "note": "factor f = every ShareGPT document f times, each copy shuffled (seed "
        f"{GROWTH_SEED}); pessimistic for latency, since every match count is multiplied by f; "
        "factor 1 is the ShareGPT index itself; page cache warm after the warm-up",
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.retrieval",
        description=retrieval.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", type=Path, default=REPO / "indexes" / "bench", help="where indexes are built")
    p.add_argument("--reuse", action="store_true", help="reuse indexes in --workdir built with the same settings")
    p.add_argument("--queries", type=int, default=1000, help="query windows per index (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="query sampling seed")
    p.add_argument("--held-out-sharegpt", type=int, default=400, help="ShareGPT conversations held out for queries")
    p.add_argument("--held-out-stdlib", type=int, default=60, help="stdlib files held out for queries")
    p.add_argument(
        "--max-records",
        type=int,
        default=None,
        help="read only the first N records of each corpus (quick runs and tests)",
    )
    p.add_argument("--growth", type=int, nargs="+", default=[1, 6, 24], help="ShareGPT replication factors")
    p.add_argument("--skip-growth", action="store_true")
    p.add_argument("--skip-grpc", action="store_true")
    p.add_argument("--seconds", type=float, default=5.0, help="gRPC measuring time per client count")
    p.add_argument("--out", type=Path, default=RESULTS / "retrieval.json")
    args = p.parse_args(argv)
    if args.queries < 1 or args.seconds <= 0 or min(args.growth) < 1:
        p.error("--queries, --seconds and --growth factors must be positive")
    if args.held_out_sharegpt < 1 or args.held_out_stdlib < 1:
        p.error("--held-out-sharegpt and --held-out-stdlib must be at least 1 (queries come from held-out text)")
    args.growth = sorted(set(args.growth))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    header = start_run("retrieval", argv, level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    args.workdir.mkdir(parents=True, exist_ok=True)
    specs = (
        IndexSpec("sharegpt", "sharegpt", args.held_out_sharegpt),
        IndexSpec("python-stdlib", "python-stdlib", args.held_out_stdlib),
    )
    tokenizer = load_tokenizer(None)
    indexes, query_sets = {}, {}
    for spec in specs:
        index, build = prepare_index(spec, args.workdir, args.reuse, args.max_records)
        query_sets[spec.name] = sample_queries(spec.corpus_spec(args.max_records), args.queries, args.seed, tokenizer)
        indexes[spec.name] = benchmark_index(spec, index, build, query_sets[spec.name], args)
    report = {
        **header,
        "config": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "indexes": [asdict(s) for s in specs],
            "query_tokens": QUERY_TOKENS,
            "budgets": BUDGETS,
            "warmup_queries": WARMUP_QUERIES,
            "rounds": ROUNDS,
            "open_repeats": OPEN_REPEATS,
            "draftretriever_open_repeats": REFERENCE_OPEN_REPEATS,
            "draftretriever_search": {"suffix_lengths": f"{QUERY_TOKENS}..2", **REST_SEARCH, "choices": "budget"},
            "tokenizer": "SmolLM2-135M-Instruct (packaged)",
        },
        "queries": "windows of held-out text only (records the index never saw), ending at uniformly random positions",
        "indexes": indexes,
    }
    if not args.skip_growth:
        report["growth"] = benchmark_growth(args.workdir / "sharegpt", query_sets["sharegpt"], args)
    report["targets"] = evaluate_targets(report)
    save_report(report, args.out, echo=False)
    print(format_table(report))
    log.info("saved %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
