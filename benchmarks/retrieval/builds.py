"""Building the compared indexes: ours with the real ``build_index`` CLI, draftretriever's over the
same documents, REST's tokenization timed its way, and the replicated indexes of the growth curve;
each build in its own process for its peak memory, recorded in a ``NAME.build.json`` beside it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.harness.draftretriever import open_draftretriever, write_draftretriever
from benchmarks.harness.report import REPO
from benchmarks.retrieval import BUILD_RECORD_VERSION, GROWTH_SEED
from rest_spec.build_index.corpora import CorpusSpec, iter_records
from rest_spec.build_index.writer import IndexWriter
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.datastore.index import Datastore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexSpec:
    """One benchmarked index: a named corpus less its last ``held_out`` records."""

    name: str
    corpus: str
    held_out: int

    def corpus_spec(self, max_records: int | None) -> CorpusSpec:
        return CorpusSpec(corpus=self.corpus, skip_last=self.held_out, max_docs=max_records)


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
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS_LAUNCHER, str(peak), *cmd],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return Measured(proc.stdout, seconds, int(peak.read_text()) * 1024)  # Linux reports KiB


def run_function(name: str, *args: str) -> tuple[dict, Measured]:
    """Call ``benchmarks.retrieval.builds.<name>(*args)`` in a fresh interpreter (for its own peak
    memory); the function returns a JSON-able dict."""
    code = f"import json, sys; from benchmarks.retrieval.builds import {name}; print(json.dumps({name}(*sys.argv[1:])))"
    measured = run_measured([sys.executable, "-c", code, *args])
    return json.loads(measured.stdout), measured


def build_ours(spec: IndexSpec, out: Path, max_records: int | None) -> dict:
    """Build with the real CLI; its JSON summary plus the build's peak memory."""
    cmd = [
        sys.executable,
        "-m",
        "rest_spec.build_index",
        "--corpus",
        spec.corpus,
        "--skip-last",
        str(spec.held_out),
        "--out",
        str(out),
        "--overwrite",
        "--json",
        "--quiet",
    ]
    if max_records is not None:
        cmd += ["--max-docs", str(max_records)]
    measured = run_measured(cmd)
    summary = json.loads(measured.stdout)
    return {
        **summary,
        "command": " ".join(cmd[2:]),
        "peak_rss_bytes": measured.peak_rss_bytes,
        "suffix_array_tokens_per_second": summary["tokens"] / summary["suffix_array_seconds"],
    }


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
    return {
        "writer_seconds": writer_seconds,
        "reader_seconds": time.perf_counter() - start,
        "bytes_on_disk": os.path.getsize(out),
    }


def rest_tokenize(spec: CorpusSpec) -> dict:
    """Tokenization the way REST builds its datastore: one process, ``tokenizer.encode`` per
    document, over the same records (reading included, as in our build's tokenize time)."""
    start = time.perf_counter()
    tokenizer = load_tokenizer(None)
    load_seconds = time.perf_counter() - start
    start = time.perf_counter()
    tokens = sum(
        len(tokenizer.encode(text, add_special_tokens=False))
        for record in iter_records(spec)
        for text in record.documents(spec.turns)
    )
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "load_tokenizer_seconds": load_seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "method": "one process, tokenizer.encode(text) per document, same records as our build",
    }


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
    log.info(
        "%s: %d tokens in %.1f s; building draftretriever over the same documents",
        spec.name,
        ours["tokens"],
        ours["seconds"],
    )
    theirs, measured = run_function("build_draftretriever", str(out), str(reference))
    theirs["peak_rss_bytes"] = measured.peak_rss_bytes
    log.info("%s: timing REST's tokenization (one process)", spec.name)
    theirs["tokenize"] = rest_tokenize(corpus)
    record = {
        "corpus_spec": corpus.to_dict(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "ours": ours,
        "draftretriever": theirs,
    }
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
    with IndexWriter(
        out,
        tokenizer_name=tokenizer.name,
        tokenizer_fingerprint=tokenizer.fingerprint,
        vocab_size=tokenizer.vocab_size,
        overwrite=True,
    ) as writer:
        for _ in range(factor_):
            for i in rng.permutation(len(documents)):
                writer.add_document(documents[i])
        summary = writer.finish(corpus={"replicated_from": source, "factor": factor_, "seed": int(seed)})
    return {
        "tokens": summary.tokens,
        "shards": summary.shards,
        "bytes_on_disk": summary.bytes_on_disk,
        "suffix_array_seconds": summary.suffix_array_seconds,
    }


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
    record = {
        "factor": factor,
        **source_record,
        **built,
        "seconds": measured.seconds,
        "peak_rss_bytes": measured.peak_rss_bytes,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    _write_sidecar(_sidecar(out), record)
    log.info(
        "growth x%d: %d tokens, %d shards, %.0f s, peak %.2f GB",
        factor,
        built["tokens"],
        built["shards"],
        measured.seconds,
        measured.peak_rss_bytes / 1e9,
    )
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
        raise SystemExit(
            f"growth factors {to_build} need about {needed / 1e9:.1f} GB in {workdir}, "
            f"only {free / 1e9:.1f} GB free: pass smaller --growth factors or another --workdir"
        )
    return {"needed_bytes": needed, "free_bytes": free}
