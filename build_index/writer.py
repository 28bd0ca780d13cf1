"""Writes tokenized documents into shards (token array + reversed suffix array) through ``datastore.format``.

The build happens in a temporary directory beside the target and is renamed into place only when
every shard and the manifest are on disk, so an interrupted build never leaves a half index under the
final name, and an existing index is replaced only when ``overwrite`` is set.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from datastore import format as fmt

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 28  # 268M tokens: ~1.6 GB on disk, ~3 GB peak to build


@dataclass(frozen=True)
class BuildSummary:
    path: Path
    documents: int
    tokens: int
    shards: int
    bytes_on_disk: int
    suffix_array_seconds: float


class IndexWriter:
    """Accumulates documents and writes a shard each time ``shard_tokens`` would be exceeded.

    Use as a context manager; ``finish()`` publishes the index, leaving the block without it (or
    with an exception) removes the temporary directory and leaves any existing index untouched.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        tokenizer_name: str,
        tokenizer_fingerprint: str,
        vocab_size: int,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        overwrite: bool = False,
    ) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.out_dir = Path(out_dir)
        self.overwrite = overwrite
        self.check_target(self.out_dir, overwrite)
        self.shard_tokens = shard_tokens
        self.dtype = fmt.token_dtype(vocab_size)
        self.sep = fmt.separator(self.dtype)
        self.vocab_size = vocab_size
        self._tokenizer = fmt.TokenizerEntry(tokenizer_name, tokenizer_fingerprint, vocab_size)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.out_dir.parent / f".{self.out_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir()
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._shards: list[fmt.ShardEntry] = []
        self._sa_seconds = 0.0
        self._closed = False

    @staticmethod
    def check_target(out_dir: Path, overwrite: bool) -> None:
        """Refuse an existing target unless ``overwrite`` (callers check before hours of work)."""
        if Path(out_dir).exists() and not overwrite:
            raise FileExistsError(f"{out_dir} already exists; pass --overwrite to replace it")

    def __enter__(self) -> "IndexWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._closed:
            self.abort()

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (token ids); documents longer than a shard are split."""
        doc = np.asarray(tokens)
        if doc.ndim != 1:
            raise ValueError("a document must be a 1-D sequence of token ids")
        if doc.size == 0:
            return
        if doc.min() < 0 or doc.max() >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size}) in document")
        doc = doc.astype(self.dtype, copy=False)
        for start in range(0, doc.size, self.shard_tokens):
            piece = doc[start : start + self.shard_tokens]
            if self._pending_tokens + piece.size > self.shard_tokens:
                self._flush()
            self._pending.append(piece)
            self._pending_tokens += piece.size

    def add_documents(self, docs: Iterable[Sequence[int] | np.ndarray]) -> None:
        for doc in docs:
            self.add_document(doc)

    def _flush(self) -> None:
        if not self._pending:
            return
        lengths = np.fromiter((d.size for d in self._pending), dtype=np.int64, count=len(self._pending))
        doc_seps = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths + 1, out=doc_seps[1:])  # each document is followed by its separator
        tokens = np.full(int(doc_seps[-1]) + 1, self.sep, dtype=self.dtype)
        for doc, sep_pos in zip(self._pending, doc_seps[:-1]):
            tokens[sep_pos + 1 : sep_pos + 1 + doc.size] = doc
        t0 = time.perf_counter()
        sa = fmt.suffix_array(tokens)
        self._sa_seconds += time.perf_counter() - t0
        entry = fmt.write_shard(self._tmp, len(self._shards), tokens, sa)
        self._shards.append(entry)
        log.info("wrote %s: %d documents, %d tokens", entry.name, entry.num_documents, entry.num_tokens)
        self._pending, self._pending_tokens = [], 0

    def finish(self, corpus: dict | None = None, build: dict | None = None) -> BuildSummary:
        """Write the last shard and the manifest, then move the index into place atomically.

        ``corpus`` (provenance) and ``build`` (arguments, timings) go into the manifest as given;
        the writer adds its own ``suffix_array_seconds`` to ``build``."""
        self._flush()
        if not self._shards:
            raise ValueError("no documents to index: every document was empty or none was given")
        manifest = fmt.Manifest(
            tokenizer=self._tokenizer,
            token_dtype=self.dtype.str,
            separator=self.sep,
            shards=tuple(self._shards),
            corpus=dict(corpus or {}),
            build={**(build or {}), "suffix_array_seconds": round(self._sa_seconds, 3)},
        )
        fmt.write_manifest(self._tmp, manifest)
        self._publish()
        self._closed = True
        return BuildSummary(
            self.out_dir, manifest.num_documents, manifest.num_tokens, len(self._shards), manifest.num_bytes, self._sa_seconds
        )

    def _publish(self) -> None:
        self.check_target(self.out_dir, self.overwrite)
        old = self.out_dir.parent / f".{self.out_dir.name}.old-{os.getpid()}"
        if self.out_dir.exists():
            os.replace(self.out_dir, old)
        os.replace(self._tmp, self.out_dir)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything written so far; the target is untouched."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._closed = True
