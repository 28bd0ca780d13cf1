"""Retrieval engine performance: our datastore against REST's ``draftretriever``, in one run.

    python -m benchmarks.retrieval --workdir indexes/bench --reuse --queries 1000 --growth 1 6 24

Two indexes, both with the packaged SmolLM2 tokenizer and built by the real ``build_index`` CLI:
the embedded ``sharegpt`` corpus less a held-out tail of conversations, and ``python-stdlib`` less
a held-out tail of files. ``draftretriever`` is built over exactly the same documents (read back
with ``Datastore.documents()``) and queried the way REST does (suffix lengths 16 down to 2,
k=5000, choices=budget, long=10).

Queries are 16-token windows of held-out text only, ending at uniformly random positions of it
(fixed seed). Figures per index, ours and theirs side by side with the ratio ours/theirs:
in-process draft latency (median, p99) at budgets 16 and 64, measured in alternating rounds after
a warm-up; draft nodes at budget 64; open time; resident memory added by opening (a fresh
process); bytes on disk per token; build time split into tokenization and suffix arrays. Ours
only (draftretriever has no server): gRPC round trip with one client and throughput with 1, 2 and
4 client processes against ``rest-datastore serve``. Growth: the ShareGPT token stream replicated
``f`` times (each copy in its own shuffled document order), latency at budget 64 against ``f=1``.

Indexes live in ``--workdir`` (``--reuse`` keeps those that match the settings; each has a
``NAME.build.json`` beside it recording how it was built and how long that took). Prints a
markdown table to stdout and saves every figure, the targets and pass/fail to
benchmarks/results/retrieval.json. Timings are only meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import (REPO, REST_N_MAX, REST_SEARCH, RESULTS, open_draftretriever, report_header,
                               rest_nodes, rest_paths, rest_search, save_report, write_draftretriever)
from rest_spec.build_index.corpora import CorpusSpec, held_out_records, iter_records
from rest_spec.build_index.writer import IndexWriter
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.tokenizer import load_tokenizer
from rest_spec.datastore.types import DraftConfig

log = logging.getLogger("benchmarks.retrieval")

QUERY_TOKENS = REST_N_MAX  # the longest suffix either engine looks at
BUDGETS = (16, 64)
NODES_BUDGET = 64
GRPC_BUDGET = 64
GROWTH_BUDGET = 64
WARMUP_QUERIES = 200
ROUNDS = 3
OPEN_REPEATS = 10
REFERENCE_OPEN_REPEATS = 3  # draftretriever builds its suffix array at every load: seconds each
CLIENTS = (1, 2, 4)
CLIENT_SETUP_SECONDS = 300  # a client process's start, imports and warm-up, at most
GROWTH_SEED = 1234
BUILD_RECORD_VERSION = 1  # of the NAME.build.json files; older ones are not reused

DraftFn = Callable[[list[int], int], object]  # (context, budget) -> a draft, result unused


@dataclass(frozen=True)
class IndexSpec:
    """One benchmarked index: a named corpus less its last ``held_out`` records."""

    name: str
    corpus: str
    held_out: int

    def corpus_spec(self, max_records: int | None) -> CorpusSpec:
        return CorpusSpec(corpus=self.corpus, skip_last=self.held_out, max_docs=max_records)


# ----------------------------------------------------------------------------------------- builds


@dataclass(frozen=True)
class Measured:
    """A finished child process: its stdout, wall seconds and peak resident memory in bytes (the
    largest of the process and the children it waited for)."""

    stdout: str
    seconds: float
    peak_rss_bytes: int


# Runs argv[2:] and writes its peak RSS (KiB) to argv[1]. A child's ru_maxrss starts from the RSS
# of the process that forked it, so the measured command is forked from this small interpreter,
# not from the benchmark (whose own hundreds of MB would be counted).
_PEAK_RSS_LAUNCHER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[2:])\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(code)\n"
)


def run_measured(cmd: Sequence[str]) -> Measured:
    """Run ``cmd`` from the repository root; raise ``RuntimeError`` with its stderr if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp, "peak_rss_kib")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _PEAK_RSS_LAUNCHER, str(peak), *cmd], cwd=REPO,
                              capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return Measured(proc.stdout, seconds, int(peak.read_text()) * 1024)  # Linux reports KiB


def run_function(name: str, *args: str) -> tuple[dict, Measured]:
    """Call ``benchmarks.retrieval.<name>(*args)`` in a fresh interpreter (for its own peak
    memory); the function returns a JSON-able dict."""
    code = f"import json, sys; from benchmarks.retrieval import {name}; print(json.dumps({name}(*sys.argv[1:])))"
    measured = run_measured([sys.executable, "-c", code, *args])
    return json.loads(measured.stdout), measured


def build_ours(spec: IndexSpec, out: Path, max_records: int | None) -> dict:
    """Build with the real CLI; its JSON summary plus the build's peak memory."""
    cmd = [sys.executable, "-m", "rest_spec.build_index", "--corpus", spec.corpus, "--skip-last", str(spec.held_out),
           "--out", str(out), "--overwrite", "--json", "--quiet"]
    if max_records is not None:
        cmd += ["--max-docs", str(max_records)]
    measured = run_measured(cmd)
    summary = json.loads(measured.stdout)
    return {**summary, "command": " ".join(cmd[2:]), "peak_rss_bytes": measured.peak_rss_bytes,
            "suffix_array_tokens_per_second": summary["tokens"] / summary["suffix_array_seconds"]}


def build_draftretriever(index: str, out: str) -> dict:
    """draftretriever's Writer over every document of our index at ``index``, in build order, to
    ``out``; then one Reader, which decompresses the tokens and builds the suffix array (it does
    so at every load). Run through ``run_function``."""
    with Datastore.open(index) as store:
        start = time.perf_counter()
        write_draftretriever(store, out)
        writer_seconds = time.perf_counter() - start
    start = time.perf_counter()
    open_draftretriever(out)
    return {"writer_seconds": writer_seconds, "reader_seconds": time.perf_counter() - start,
            "bytes_on_disk": os.path.getsize(out)}


def rest_tokenize(spec: CorpusSpec) -> dict:
    """Tokenization the way REST builds its datastore: one process, ``tokenizer.encode`` per
    document, over the same records (reading included, as in our build's tokenize time)."""
    start = time.perf_counter()
    tokenizer = load_tokenizer(None)
    load_seconds = time.perf_counter() - start
    start = time.perf_counter()
    tokens = sum(len(tokenizer.encode(text, add_special_tokens=False))
                 for record in iter_records(spec) for text in record.documents(spec.turns))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "load_tokenizer_seconds": load_seconds, "tokens": tokens,
            "tokens_per_second": tokens / seconds,
            "method": "one process, tokenizer.encode(text) per document, same records as our build"}


def _read_sidecar(path: Path) -> dict | None:
    """The build record at ``path``, or None when missing or written by another version."""
    record = json.loads(path.read_text()) if path.is_file() else None
    return record if record and record.get("version") == BUILD_RECORD_VERSION else None


def _write_sidecar(path: Path, record: dict) -> None:
    path.write_text(json.dumps({"version": BUILD_RECORD_VERSION, **record}, indent=2) + "\n")


def _sidecar(index: Path) -> Path:
    return index.with_name(index.name + ".build.json")


def prepare_index(spec: IndexSpec, workdir: Path, reuse: bool, max_records: int | None) -> tuple[Path, dict]:
    """The index of ``spec`` in ``workdir`` and its build record (ours and draftretriever's):
    reused when ``reuse`` and the recorded settings match, else (re)built and timed."""
    out, reference = workdir / spec.name, workdir / f"{spec.name}.draftretriever.idx"
    corpus = spec.corpus_spec(max_records)
    record = _read_sidecar(_sidecar(out))
    same = record is not None and CorpusSpec.from_dict(record["corpus_spec"]) == corpus
    if reuse and same and _opens(out) and reference.is_file():
        log.info("%s: reusing %s (built %s)", spec.name, out, record["date"])
        return out, record
    log.info("%s: building with build_index (%s)", spec.name, corpus)
    ours = build_ours(spec, out, max_records)
    log.info("%s: %d tokens in %.1f s; building draftretriever over the same documents", spec.name,
             ours["tokens"], ours["seconds"])
    theirs, measured = run_function("build_draftretriever", str(out), str(reference))
    theirs["peak_rss_bytes"] = measured.peak_rss_bytes
    log.info("%s: timing REST's tokenization (one process)", spec.name)
    theirs["tokenize"] = rest_tokenize(corpus)
    record = {"corpus_spec": corpus.to_dict(), "date": time.strftime("%Y-%m-%d %H:%M"), "ours": ours,
              "draftretriever": theirs}
    _write_sidecar(_sidecar(out), record)
    return out, record


def _opens(path: Path) -> bool:
    """Whether ``path`` is an index this engine reads (a format change makes old ones stale)."""
    try:
        Datastore.open(path).close()
    except (OSError, ValueError):
        return False
    return True


def build_replicated(source: str, out: str, factor: str, seed: str) -> dict:
    """Every document of the index at ``source``, ``factor`` times, each copy in its own shuffled
    order, written with ``IndexWriter`` (default shard size) to ``out``. Run through ``run_function``."""
    factor_, rng = int(factor), np.random.default_rng(int(seed))
    with Datastore.open(source) as store:
        documents = list(store.documents())  # views of the memory map, nothing copied
        tokenizer = store.manifest.tokenizer
    with IndexWriter(out, tokenizer_name=tokenizer.name, tokenizer_fingerprint=tokenizer.fingerprint,
                     vocab_size=tokenizer.vocab_size, overwrite=True) as writer:
        for _ in range(factor_):
            for i in rng.permutation(len(documents)):
                writer.add_document(documents[i])
        summary = writer.finish(corpus={"replicated_from": source, "factor": factor_, "seed": int(seed)})
    return {"tokens": summary.tokens, "shards": summary.shards, "bytes_on_disk": summary.bytes_on_disk,
            "suffix_array_seconds": summary.suffix_array_seconds}


def prepare_growth_index(source: Path, factor: int, workdir: Path, reuse: bool) -> tuple[Path, dict]:
    """The ShareGPT index replicated ``factor`` times, reused when ``reuse`` and built from the
    same source; factor 1 is the source itself."""
    if factor == 1:
        return source, {"factor": 1, "source": str(source)}
    out = workdir / f"{source.name}-x{factor}"
    record = _read_sidecar(_sidecar(out))
    with Datastore.open(source) as store:  # the source's content, so a rebuilt source is noticed
        digests = [shard.files["tokens"].sha256 for shard in store.manifest.shards]
    source_record = {"source": str(source), "source_tokens_sha256": digests, "seed": GROWTH_SEED}
    if reuse and record and all(record.get(k) == v for k, v in source_record.items()) and _opens(out):
        log.info("growth x%d: reusing %s", factor, out)
        return out, record
    log.info("growth x%d: building %s with IndexWriter (minutes for big factors)", factor, out)
    built, measured = run_function("build_replicated", str(source), str(out), str(factor), str(GROWTH_SEED))
    record = {"factor": factor, **source_record, **built, "seconds": measured.seconds,
              "peak_rss_bytes": measured.peak_rss_bytes, "date": time.strftime("%Y-%m-%d %H:%M")}
    _write_sidecar(_sidecar(out), record)
    log.info("growth x%d: %d tokens, %d shards, %.0f s, peak %.2f GB", factor, built["tokens"], built["shards"],
             measured.seconds, measured.peak_rss_bytes / 1e9)
    return out, record


def check_disk_space(workdir: Path, source: Path, factors: Sequence[int], reuse: bool) -> dict:
    """Refuse to start growth builds that cannot fit on the disk (index bytes scale with tokens)."""
    with Datastore.open(source) as store:
        source_bytes = store.manifest.num_bytes
    built = [f for f in factors if reuse and _read_sidecar(_sidecar(workdir / f"{source.name}-x{f}"))]
    to_build = [f for f in factors if f > 1 and f not in built]
    needed = int(1.1 * source_bytes * sum(to_build))
    free = shutil.disk_usage(workdir).free
    if needed > free:
        raise SystemExit(f"growth factors {to_build} need about {needed / 1e9:.1f} GB in {workdir}, "
                         f"only {free / 1e9:.1f} GB free: pass smaller --growth factors or another --workdir")
    return {"needed_bytes": needed, "free_bytes": free}


# ---------------------------------------------------------------------------------------- queries


def sample_queries(spec: CorpusSpec, count: int, seed: int, tokenizer) -> list[list[int]]:
    """``count`` windows of ``QUERY_TOKENS`` tokens of the held-out records of ``spec`` (never
    indexed), ending at positions drawn uniformly over all held-out text (seeded)."""
    texts = [text for record in held_out_records(spec) for text in record.documents(spec.turns)]
    ids = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
    docs = [np.asarray(doc, dtype=np.int64) for doc in ids]
    windows = np.array([max(d.size - QUERY_TOKENS + 1, 0) for d in docs], dtype=np.int64)
    if windows.sum() == 0:
        raise ValueError(f"{spec.corpus}: the {spec.skip_last} held-out records hold no {QUERY_TOKENS}-token "
                         "window; hold out more records")
    flat, starts = np.concatenate(docs), np.concatenate(([0], np.cumsum([d.size for d in docs])[:-1]))
    ends = np.cumsum(windows)
    picks = np.random.default_rng(seed).integers(ends[-1], size=count)
    doc = np.searchsorted(ends, picks, side="right")  # window `pick` lies in document `doc`
    first = starts[doc] + picks - (ends[doc] - windows[doc])
    return flat[first[:, None] + np.arange(QUERY_TOKENS)].tolist()


# ----------------------------------------------------------------------------- in-process engines


def our_engine(store: Datastore) -> DraftFn:
    configs = {budget: DraftConfig(budget=budget) for budget in {*BUDGETS, GROWTH_BUDGET}}
    return lambda context, budget: store.draft(context, configs[budget])


def reference_engine(reader) -> DraftFn:
    return lambda context, budget: rest_search(reader, context, budget)


def time_calls(draft: DraftFn, queries: list[list[int]], budget: int) -> np.ndarray:
    """Seconds of each ``draft(query, budget)`` call."""
    seconds = np.empty(len(queries))
    for i, query in enumerate(queries):
        start = time.perf_counter()
        draft(query, budget)
        seconds[i] = time.perf_counter() - start
    return seconds


def latency_ms(seconds: np.ndarray) -> dict:
    return {"median_ms": 1e3 * float(np.median(seconds)), "p99_ms": 1e3 * float(np.percentile(seconds, 99)),
            "calls": int(seconds.size)}


def compare_latency(engines: dict[str, DraftFn], queries: list[list[int]], budgets: Sequence[int]) -> dict:
    """Per budget and engine, latency over ``ROUNDS`` alternating rounds (every engine over all
    queries, in turn), after each engine's warm-up on the first ``WARMUP_QUERIES`` queries."""
    for draft in engines.values():
        for budget in budgets:
            time_calls(draft, queries[:WARMUP_QUERIES], budget)
    figures = {}
    for budget in budgets:
        pooled: dict[str, list[np.ndarray]] = {name: [] for name in engines}
        for _ in range(ROUNDS):
            for name, draft in engines.items():
                pooled[name].append(time_calls(draft, queries, budget))
        figures[f"budget_{budget}"] = {name: latency_ms(np.concatenate(runs)) for name, runs in pooled.items()}
    return figures


def node_counts(store: Datastore, reader, queries: list[list[int]]) -> dict:
    """Draft nodes each engine returns for a budget of ``NODES_BUDGET`` on ``queries``."""
    config = DraftConfig(budget=NODES_BUDGET)
    ours = np.array([len(store.draft(q, config)) for q in queries])
    theirs = np.array([rest_nodes(rest_paths(reader, q, NODES_BUDGET)) for q in queries])

    def stats(nodes: np.ndarray) -> dict:
        return {"mean": float(nodes.mean()), "median": float(np.median(nodes)),
                "empty_percent": 100 * float(np.mean(nodes == 0))}

    return {"budget": NODES_BUDGET, "ours": stats(ours), "draftretriever": stats(theirs)}


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def open_rss(engine: str, path: str) -> int:
    """Resident bytes added by opening ``path`` with ``engine`` ("ours" or "draftretriever"),
    from /proc/self/status after the imports; run in a fresh process."""
    import draftretriever  # noqa: F401 (imported before measuring, like ours)

    before = _vm_rss()
    opened = Datastore.open(path) if engine == "ours" else open_draftretriever(path)  # noqa: F841
    return _vm_rss() - before


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def rss_in_fresh_process(engine: str, path: Path) -> int:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(open_rss, engine, str(path)).result()


def open_figures(index: Path, index_bytes: int, reference: Path | None = None) -> dict:
    """Open time (median) and resident memory added by opening, for ours and, given its file,
    draftretriever's Reader."""
    figures = {"ours": {"open_seconds": median_seconds(lambda: Datastore.open(index).close(), OPEN_REPEATS),
                        "rss_added_bytes": rss_in_fresh_process("ours", index), "index_bytes": index_bytes}}
    if reference is not None:
        figures["draftretriever"] = {
            "open_seconds": median_seconds(lambda: open_draftretriever(reference), REFERENCE_OPEN_REPEATS),
            "rss_added_bytes": rss_in_fresh_process("draftretriever", reference),
            "index_bytes": reference.stat().st_size,
        }
    for engine in figures.values():
        engine["rss_added_percent_of_index"] = 100 * engine["rss_added_bytes"] / engine["index_bytes"]
    return figures


# ------------------------------------------------------------------------------------------- gRPC


def grpc_client(address: str, queries: list[list[int]], offset: int, seconds: float, barrier, results) -> None:
    """One client process: warm up, wait for the others, then draft round-robin from ``offset``
    for ``seconds``; puts (calls, elapsed seconds, per-call seconds) on ``results``."""
    from rest_spec.datastore.client import DatastoreClient

    config = DraftConfig(budget=GRPC_BUDGET)
    with DatastoreClient(address) as client:
        for query in queries[:WARMUP_QUERIES]:
            client.draft(query, config)
        barrier.wait()
        latencies, i = [], offset
        start = time.perf_counter()
        deadline = start + seconds
        while (now := time.perf_counter()) < deadline:
            client.draft(queries[i % len(queries)], config)
            latencies.append(time.perf_counter() - now)
            i += 1
        elapsed = time.perf_counter() - start
    results.put((len(latencies), elapsed, latencies))


def start_server(index: Path) -> tuple[subprocess.Popen, str]:
    """``rest-datastore serve`` on a free port; returns the process and the address it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "rest_spec.datastore", "serve", "--index", str(index), "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"rest-datastore serve --index {index} did not start (exit {proc.returncode}): {line!r}")
    return proc, line.split()[-1]


def grpc_figures(index: Path, queries: list[list[int]], seconds: float) -> dict:
    """Round trip and throughput with 1, 2 and 4 concurrent client processes (budget 64)."""
    ctx = multiprocessing.get_context("spawn")
    proc, address = start_server(index)
    figures = {"budget": GRPC_BUDGET, "seconds_per_run": seconds, "clients": {}}
    try:
        for clients in CLIENTS:
            barrier, results = ctx.Barrier(clients), ctx.Queue()
            workers = [ctx.Process(target=grpc_client,
                                   args=(address, queries, k * len(queries) // clients, seconds, barrier, results))
                       for k in range(clients)]
            for worker in workers:
                worker.start()
            try:  # a client that fails prints its traceback and never reports
                outcomes = [results.get(timeout=seconds + CLIENT_SETUP_SECONDS) for _ in workers]
            except queue.Empty:
                for worker in workers:
                    worker.terminate()
                raise RuntimeError(f"a gRPC client of {address} did not report (its traceback is above)") from None
            for worker in workers:
                worker.join()
            latencies = np.concatenate([np.asarray(lat) for _, _, lat in outcomes])
            figures["clients"][str(clients)] = {
                "requests_per_second": sum(calls / elapsed for calls, elapsed, _ in outcomes),
                "round_trip": latency_ms(latencies),
            }
            log.info("gRPC %d client(s): %.0f requests/s", clients,
                     figures["clients"][str(clients)]["requests_per_second"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    single = figures["clients"]["1"]["requests_per_second"]
    for entry in figures["clients"].values():
        entry["throughput_vs_1_client"] = entry["requests_per_second"] / single
    return figures


# ------------------------------------------------------------------------------------ per index


def benchmark_index(spec: IndexSpec, index: Path, build: dict, queries: list[list[int]], args) -> dict:
    """Every figure of one index, ours and draftretriever's, in one process."""
    reference = args.workdir / f"{spec.name}.draftretriever.idx"
    with Datastore.open(index) as store:
        manifest = store.manifest
        log.info("%s: in-process latency (%d queries, %d rounds)", spec.name, len(queries), ROUNDS)
        reader = open_draftretriever(reference)
        latency = compare_latency({"ours": our_engine(store), "draftretriever": reference_engine(reader)},
                                  queries, BUDGETS)
        nodes = node_counts(store, reader, queries)
        del reader
    for figures in latency.values():
        figures["speedup"] = figures["draftretriever"]["median_ms"] / figures["ours"]["median_ms"]
    log.info("%s: open time and memory", spec.name)
    opening = open_figures(index, manifest.num_bytes, reference)
    ours, theirs = build["ours"], build["draftretriever"]
    their_seconds = sum((theirs["tokenize"]["load_tokenizer_seconds"], theirs["tokenize"]["seconds"],
                         theirs["writer_seconds"], theirs["reader_seconds"]))
    result = {
        "tokens": manifest.num_tokens,
        "documents": manifest.num_documents,
        "shards": len(manifest.shards),
        "queries": len(queries),
        "in_process_latency": latency,
        "draft_nodes": nodes,
        "open": opening,
        "bytes_per_token": {"ours": manifest.num_bytes / manifest.num_tokens,
                            "draftretriever": theirs["bytes_on_disk"] / manifest.num_tokens,
                            "note": "draftretriever's file holds only the tokens, compressed; its Reader "
                                    "rebuilds the suffix array in memory at every load"},
        "build": {
            "ours": {"seconds": ours["seconds"], "tokenize_tokens_per_second": ours["tokenize_tokens_per_second"],
                     "suffix_array_tokens_per_second": ours["suffix_array_tokens_per_second"],
                     "peak_rss_bytes": ours["peak_rss_bytes"], "command": ours["command"]},
            "draftretriever": {
                "seconds": their_seconds,
                "tokenize_tokens_per_second": theirs["tokenize"]["tokens_per_second"],
                "suffix_array_tokens_per_second": manifest.num_tokens / theirs["reader_seconds"],
                "writer_seconds": theirs["writer_seconds"], "reader_seconds": theirs["reader_seconds"],
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
        rows.append({"factor": factor, "tokens": manifest.num_tokens, "shards": len(manifest.shards),
                     "bytes_on_disk": manifest.num_bytes, **latency[f"budget_{GROWTH_BUDGET}"]["ours"],
                     "open_seconds": opening["open_seconds"], "rss_added_bytes": opening["rss_added_bytes"],
                     "rss_added_percent_of_index": opening["rss_added_percent_of_index"],
                     "build_seconds": build.get("seconds"), "build_peak_rss_bytes": build.get("peak_rss_bytes")})
        log.info("growth x%d: %d tokens, median %.3f ms", factor, manifest.num_tokens, rows[-1]["median_ms"])
    base = next((r for r in rows if r["factor"] == 1), rows[0])
    for row in rows:
        row["median_vs_base"] = row["median_ms"] / base["median_ms"]
    return {"budget": GROWTH_BUDGET, "disk": disk, "sizes": rows,
            "note": "factor f = every ShareGPT document f times, each copy shuffled (seed "
                    f"{GROWTH_SEED}); pessimistic for latency, since every match count is multiplied by f; "
                    "factor 1 is the ShareGPT index itself; page cache warm after the warm-up"}


# ------------------------------------------------------------------------------- targets and table


def evaluate_targets(report: dict) -> list[dict]:
    """The issue's targets, each with the measured value and pass (None when not measured)."""
    chat = report["indexes"].get("sharegpt")
    targets: list[dict] = []

    def add(name: str, value: float | None, limit: float, at_most: bool = True) -> None:
        passed = None if value is None else bool(value <= limit if at_most else value >= limit)
        targets.append({"target": name, "value": value, "limit": limit, "at_most": at_most, "pass": passed})

    b64 = chat["in_process_latency"]["budget_64"] if chat else None
    add("sharegpt in-process draft, budget 64, median ms", b64 and b64["ours"]["median_ms"], 0.25)
    add("sharegpt in-process draft, budget 64, p99 ms", b64 and b64["ours"]["p99_ms"], 1.0)
    add("sharegpt in-process speedup over draftretriever (median, budget 64)", b64 and b64["speedup"], 2.0,
        at_most=False)
    grpc = chat.get("grpc") if chat else None
    add("sharegpt gRPC round trip, 1 client, median ms", grpc and grpc["clients"]["1"]["round_trip"]["median_ms"], 1.0)
    add("sharegpt gRPC throughput, 2 clients / 1 client", grpc and grpc["clients"]["2"]["throughput_vs_1_client"],
        1.6, at_most=False)
    sized = [(name, fig["open"]["ours"]) for name, fig in report["indexes"].items()]
    sized += [(f"sharegpt x{row['factor']}", row) for row in (report.get("growth") or {}).get("sizes", [])
              if row["factor"] != 1]
    for name, fig in sized:
        add(f"{name} open seconds", fig["open_seconds"], 0.2)
        add(f"{name} resident memory added by open, % of index bytes", fig["rss_added_percent_of_index"], 5.0)
    for name, fig in report["indexes"].items():
        add(f"{name} bytes on disk per token", fig["bytes_per_token"]["ours"], 6.0)
        add(f"{name} end-to-end build seconds, ours / draftretriever's",
            fig["build"]["ours"]["seconds"] / fig["build"]["draftretriever"]["seconds"], 1.0)
    growth = report.get("growth")
    if growth:
        largest = max(growth["sizes"], key=lambda row: row["tokens"])
        big_enough = largest["tokens"] >= 500_000_000
        add(f"growth: median at {largest['tokens'] / 1e6:.0f}M tokens / at the ShareGPT index "
            "(target needs >= 500M tokens)", largest["median_vs_base"] if big_enough else None, 1.5)
    return targets


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_table(report: dict) -> str:
    """Markdown tables (per-index figures, gRPC, growth, targets) for the README."""
    names = list(report["indexes"])
    header = "| figure | " + " | ".join(f"{n}: ours | draftretriever | ours/theirs" for n in names) + " |"
    lines = [header, "|---|" + "---:|" * (3 * len(names))]

    def row(label: str, get: Callable[[dict, str], float | None], digits: int = 3) -> None:
        cells = []
        for name in names:
            fig = report["indexes"][name]
            ours, theirs = get(fig, "ours"), get(fig, "draftretriever")
            ratio = ours / theirs if ours is not None and theirs else None
            cells += [_fmt(ours, digits), _fmt(theirs, digits), _fmt(ratio, 2)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for budget in BUDGETS:
        for stat in ("median_ms", "p99_ms"):
            row(f"draft, budget {budget}, {stat.replace('_ms', '')} (ms)",
                lambda f, e, b=budget, s=stat: f["in_process_latency"][f"budget_{b}"][e][s])
    row(f"draft nodes at budget {NODES_BUDGET}, mean", lambda f, e: f["draft_nodes"][e]["mean"], 1)
    row(f"draft nodes at budget {NODES_BUDGET}, median", lambda f, e: f["draft_nodes"][e]["median"], 1)
    row("drafts with no node (%)", lambda f, e: f["draft_nodes"][e]["empty_percent"], 1)
    row("open (s)", lambda f, e: f["open"][e]["open_seconds"])
    row("resident memory added by open (MB)", lambda f, e: f["open"][e]["rss_added_bytes"] / 1e6, 1)
    row("... as % of index bytes", lambda f, e: f["open"][e]["rss_added_percent_of_index"], 2)
    row("bytes on disk per token", lambda f, e: f["bytes_per_token"][e], 2)
    row("build: tokenization (tokens/s)", lambda f, e: f["build"][e]["tokenize_tokens_per_second"], 0)
    row("build: suffix arrays (tokens/s)", lambda f, e: f["build"][e]["suffix_array_tokens_per_second"], 0)
    row("build: end to end (s)", lambda f, e: f["build"][e]["seconds"], 1)
    row("build: peak memory (MB)", lambda f, e: f["build"][e]["peak_rss_bytes"] / 1e6, 0)

    with_grpc = [n for n in names if "grpc" in report["indexes"][n]]
    if with_grpc:
        lines += ["", f"| gRPC, budget {GRPC_BUDGET} (ours) | " + " | ".join(with_grpc) + " |",
                  "|---|" + "---:|" * len(with_grpc)]
        grpcs = [report["indexes"][n]["grpc"]["clients"] for n in with_grpc]
        for stat in ("median_ms", "p99_ms"):
            lines.append(f"| round trip, 1 client, {stat.replace('_ms', '')} (ms) | "
                         + " | ".join(_fmt(g["1"]["round_trip"][stat]) for g in grpcs) + " |")
        for clients in CLIENTS:
            lines.append(f"| throughput, {clients} client(s) (requests/s) | " + " | ".join(
                f"{g[str(clients)]['requests_per_second']:,.0f} (x{g[str(clients)]['throughput_vs_1_client']:.2f})"
                for g in grpcs) + " |")

    growth = report.get("growth")
    if growth:
        lines += ["", ("| growth (ShareGPT x f) | tokens | shards | median (ms) | p99 (ms) | median / x1 "
                       "| open (s) | build (s) | build peak (MB) |"), "|---|" + "---:|" * 8]
        for r in growth["sizes"]:
            peak = r["build_peak_rss_bytes"] and r["build_peak_rss_bytes"] / 1e6
            lines.append(f"| x{r['factor']} | {r['tokens']:,} | {r['shards']} | {_fmt(r['median_ms'])} | "
                         f"{_fmt(r['p99_ms'])} | {_fmt(r['median_vs_base'], 2)} | {_fmt(r['open_seconds'])} | "
                         f"{_fmt(r['build_seconds'], 1)} | {_fmt(peak, 0)} |")

    lines += ["", "| target | value | limit | pass |", "|---|---:|---:|:---:|"]
    for t in report["targets"]:
        verdict = {True: "yes", False: "**no**", None: "n/a"}[t["pass"]]
        limit = f"{'<=' if t['at_most'] else '>='} {t['limit']:g}"
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {limit} | {verdict} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=REPO / "indexes" / "bench", help="where indexes are built")
    p.add_argument("--reuse", action="store_true", help="reuse indexes in --workdir built with the same settings")
    p.add_argument("--queries", type=int, default=1000, help="query windows per index (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="query sampling seed")
    p.add_argument("--held-out-sharegpt", type=int, default=400, help="ShareGPT conversations held out for queries")
    p.add_argument("--held-out-stdlib", type=int, default=60, help="stdlib files held out for queries")
    p.add_argument("--max-records", type=int, default=None,
                   help="read only the first N records of each corpus (quick runs and tests)")
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
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    args.workdir.mkdir(parents=True, exist_ok=True)
    specs = (IndexSpec("sharegpt", "sharegpt", args.held_out_sharegpt),
             IndexSpec("python-stdlib", "python-stdlib", args.held_out_stdlib))
    tokenizer = load_tokenizer(None)
    indexes, query_sets = {}, {}
    for spec in specs:
        index, build = prepare_index(spec, args.workdir, args.reuse, args.max_records)
        query_sets[spec.name] = sample_queries(spec.corpus_spec(args.max_records), args.queries, args.seed, tokenizer)
        indexes[spec.name] = benchmark_index(spec, index, build, query_sets[spec.name], args)
    report = {
        **report_header("retrieval", argv),
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "indexes": [asdict(s) for s in specs], "query_tokens": QUERY_TOKENS, "budgets": BUDGETS,
                   "warmup_queries": WARMUP_QUERIES, "rounds": ROUNDS, "open_repeats": OPEN_REPEATS,
                   "draftretriever_open_repeats": REFERENCE_OPEN_REPEATS,
                   "draftretriever_search": {"suffix_lengths": f"{QUERY_TOKENS}..2", **REST_SEARCH,
                                             "choices": "budget"},
                   "tokenizer": "SmolLM2-135M-Instruct (packaged)"},
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
