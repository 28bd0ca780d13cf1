"""The build pipeline: corpus records -> documents -> token arrays -> shards on disk.

A pre-tokenized corpus (``Corpus.tokenized``: the store of the model's outputs) enters at the
token arrays: its records' ids are checked against the tokenizer's vocabulary instead of encoded.

``build(config)`` is the library entry point; it raises on bad input and never exits
(``build_index.__main__`` is the CLI over it).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from rest_spec.build_index.corpora import open_corpus
from rest_spec.build_index.corpus import Corpus, CorpusError, Record
from rest_spec.build_index.job import (
    BuildConfig,
    BuildInputError,
    BuildInterrupted,
    BuildReport,
    RayTarget,
    progress_bar,
)
from rest_spec.build_index.tokenize import BatchTokenizer, TokenizeConfig
from rest_spec.build_index.writer import IndexWriter
from rest_spec.common.cli import first_line
from rest_spec.common.signals import STOP_SIGNALS
from rest_spec.common.tokenizer import load_tokenizer, tokenizer_fingerprint, tokenizer_name, vocab_size

log = logging.getLogger(__name__)


class _StopSignals:
    """While active, SIGINT, SIGTERM and SIGHUP raise ``BuildInterrupted``: the ``with`` blocks on
    the way out stop the tokenizer workers and remove the partial index. Once ``writer`` has put
    the new index in place a signal has nothing left to stop and is only logged; after the first
    one, the rest are ignored so that the clean-up runs to its end. A signal ignored when the build
    starts (``nohup``, a background job's SIGINT) stays ignored; outside the main thread, where
    Python cannot set handlers, nothing changes."""

    def __init__(self) -> None:
        self.out: Path | None = None
        self.writer: IndexWriter | None = None
        self._stopping = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.writer is not None and self.writer.published:
            log.warning("%s arrived after the new index was written to %s", signal.Signals(signum).name, self.out)
        elif not self._stopping:
            self._stopping = True
            raise BuildInterrupted(signum, self.out)


def build(config: BuildConfig) -> BuildReport:
    """Read, tokenize and write one index; the target appears only if everything succeeded, and
    any failure or interruption leaves it as it was.

    Raises ``CorpusError``/``BuildInputError``/``FileExistsError`` on bad input,
    ``IndexWriteError`` when the index cannot be written and ``BuildInterrupted`` on SIGINT,
    SIGTERM or SIGHUP (see ``_StopSignals``)."""
    start = time.perf_counter()
    if config.ray is not None:
        from rest_spec.build_index.ray_build import build_through_client, require_ray

        require_ray()  # before any work
        if RayTarget.parse(config.ray).kind == "client":
            with _StopSignals() as stop:
                stop.out = config.out
                return build_through_client(config, build)
    with _StopSignals() as stop:
        corpus = open_corpus(config.corpus)
        stop.out = out = config.out or Path("indexes") / corpus.slug
        try:  # before the tokenizer load and the whole read
            IndexWriter.check_target(out, config.overwrite)
        except FileExistsError:  # the refusals, already one line
            raise
        except OSError as exc:  # a parent that is a file, a loop of links, no permission
            raise BuildInputError(f"cannot use {out} as the index directory: {exc.strerror or exc}") from exc
        tokenizer = _load_tokenizer(config.tokenizer)
        with (
            _backend(config, tokenizer, corpus) as backend,
            backend.writer(
                out,
                tokenizer_name=tokenizer_name(config.tokenizer),
                tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                vocab_size=vocab_size(tokenizer),
                shard_tokens=config.shard_tokens,
                overwrite=config.overwrite,
            ) as writer,
        ):
            stop.writer = writer
            tokenize_start = time.perf_counter()
            tokens = backend.index(corpus, writer, config.progress)
            tokenize_seconds = time.perf_counter() - tokenize_start
            if tokens == 0:
                raise BuildInputError(
                    f"corpus {config.corpus.corpus!r} gave no text to index ({corpus.stats.records} records; "
                    "check --turns, --field, --skip-last)"
                )
            summary = writer.finish(
                corpus=corpus.provenance(),
                build={"args": config.build_args(), "tokenize_seconds": round(tokenize_seconds, 3)},
            )
    stats = corpus.stats
    return BuildReport(
        out=str(summary.path),
        corpus=config.corpus.corpus,
        records=stats.records,
        held_out=stats.held_out,
        skipped=stats.skipped,
        documents=summary.documents,
        tokens=summary.tokens,
        shards=summary.shards,
        bytes_on_disk=summary.bytes_on_disk,
        seconds=time.perf_counter() - start,
        tokenize_seconds=tokenize_seconds,
        suffix_array_seconds=summary.suffix_array_seconds,
        recovered_conversations=stats.recovered,
        truncated=stats.truncated,
    )


def _backend(config: BuildConfig, tokenizer, corpus: Corpus):
    """The backend that tokenizes and writes: worker processes here, or a Ray cluster (``--ray``);
    for a pre-tokenized corpus, this process alone (nothing to encode)."""
    if corpus.tokenized:
        if config.ray is not None:
            raise BuildInputError(f"--ray does not apply to corpus {config.corpus.corpus!r}: its records are token ids")
        return _LocalBackend(tokenizer, TokenizeConfig(workers=1), tokenizer_name(config.tokenizer))
    if config.ray is None:
        return _LocalBackend(tokenizer, config.tokenize, tokenizer_name(config.tokenizer))
    from rest_spec.build_index.ray_build import RayBackend

    return RayBackend(config.ray, tokenizer, config.tokenize)


class _LocalBackend:
    """Tokenizes over ``config.workers`` processes of this machine and writes every shard here.

    A backend is a context manager (it owns its workers) with ``writer(out, **args)``, the
    ``IndexWriter`` to use, and ``index(corpus, writer, progress)``, which streams the corpus's
    documents, in order, as token arrays into ``writer.add_document`` and returns the tokens."""

    def __init__(self, tokenizer, config: TokenizeConfig, name: str) -> None:
        self._encoder = BatchTokenizer(tokenizer, config)
        self._vocab_size, self._name = vocab_size(tokenizer), name

    def __enter__(self) -> _LocalBackend:
        self._encoder.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._encoder.__exit__(exc_type, exc, tb)

    writer = IndexWriter

    def index(self, corpus: Corpus, writer: IndexWriter, progress: bool) -> int:
        tokens = 0
        # The tokens written so far: the read stops at --max-tokens, late by the batches in flight.
        with progress_bar(corpus, progress, corpus.records(lambda: tokens)) as records:
            for ids in self._documents(corpus, records):
                writer.add_document(ids)
                tokens += ids.size
        return tokens

    def _documents(self, corpus: Corpus, records: Iterable[Record]) -> Iterator[np.ndarray]:
        """The records' documents as token arrays: encoded, or a pre-tokenized record's own ids."""
        if not corpus.tokenized:
            turns = corpus.spec.turns
            return self._encoder.encode(text for record in records for text in record.documents(turns))
        return (token_document(corpus, record, self._vocab_size, self._name) for record in records)


def token_document(corpus: Corpus, record: Record, vocab_size: int, tokenizer: str) -> np.ndarray:
    """A pre-tokenized record's ids, refused (``CorpusError``) unless the tokenizer the index is
    labelled with has every one of them: ids from another model's vocabulary would draft nonsense."""
    ids = np.asarray(record.tokens)
    outside = np.flatnonzero(ids >= vocab_size)
    if outside.size:
        raise CorpusError(
            f"corpus {corpus.spec.corpus!r}: record {record.id} holds token id {int(ids[outside[0]])}, outside the "
            f"vocabulary of tokenizer {tokenizer} ({vocab_size} ids); were these outputs of another model? "
            "(name its tokenizer with --tokenizer)"
        )
    return ids


def _load_tokenizer(spec: str | None):
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        reason = first_line(exc.__cause__ or exc)  # load_tokenizer wraps the library's error
        raise BuildInputError(f"cannot load tokenizer {spec or 'SmolLM2 (packaged)'}: {reason}") from exc
