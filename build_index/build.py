"""The build pipeline: corpus records -> documents -> token arrays -> shards on disk.

A pre-tokenized corpus (``Corpus.tokenized``: the store of the model's outputs) enters at the
token arrays: its records' ids are checked against the tokenizer's vocabulary instead of encoded.

``build(config)`` is the library entry point; it raises on bad input and never exits
(``build_index.__main__`` is the CLI over it).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rest_spec.build_index.corpora import Corpus, CorpusError, CorpusSpec, Record, open_corpus
from rest_spec.build_index.tokenize import BatchTokenizer, TokenizeConfig
from rest_spec.build_index.writer import DEFAULT_SHARD_TOKENS, IndexWriter
from rest_spec.common.cli import first_line
from rest_spec.common.signals import STOP_SIGNALS
from rest_spec.common.tokenizer import load_tokenizer, tokenizer_fingerprint, tokenizer_name, vocab_size

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger(__name__)


class BuildInputError(ValueError):
    """Bad build input outside the corpus itself: an unreadable tokenizer, nothing to index."""


class BuildInterrupted(BaseException):
    """A stop signal ended the build before the new index was in place. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it; ``out`` is the
    target, once known, which the interrupted build left as it was."""

    def __init__(self, signum: int, out: Path | None = None) -> None:
        super().__init__(signum, out)
        self.signum, self.out = signum, out

    def __str__(self) -> str:
        unchanged = f"; {self.out} is unchanged" if self.out else ""
        return f"interrupted ({signal.Signals(self.signum).name}); no index was written{unchanged}"


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


@dataclass(frozen=True)
class BuildConfig:
    corpus: CorpusSpec
    out: Path | None = None  # None = indexes/<corpus>
    tokenizer: str | None = None  # HF id, directory or .gguf; None = the packaged SmolLM2
    tokenize: TokenizeConfig = TokenizeConfig()
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    overwrite: bool = False
    progress: bool = True  # a progress bar over records on stderr
    ray: str | None = None  # build on Ray: "auto", "ray://HOST:PORT", "local" or "local:N"; None = here

    def __post_init__(self) -> None:
        if self.shard_tokens < 1:
            raise BuildInputError(f"shard_tokens must be positive, got {self.shard_tokens}")
        if self.ray is not None:
            from rest_spec.build_index.ray_build import RayTarget

            RayTarget.parse(self.ray)  # a ValueError naming the forms
            if self.corpus.max_tokens is not None:  # Ray's readers cannot see the tokens written
                raise BuildInputError("--max-tokens does not apply with --ray")

    def build_args(self) -> dict:
        """The settings for the manifest's ``build`` entry (the corpus spec goes under ``corpus``)."""
        args = {**asdict(self), "out": None if self.out is None else str(self.out)}
        del args["corpus"]
        return args


@dataclass(frozen=True)
class BuildReport:
    out: str
    corpus: str
    records: int  # records indexed
    held_out: int  # records skipped at the end (--skip-last)
    skipped: int  # files not indexed: binary, not UTF-8, special, too large or unreadable
    documents: int
    tokens: int
    shards: int
    bytes_on_disk: int
    seconds: float
    tokenize_seconds: float  # reading and tokenizing (and any full shard written on the way)
    suffix_array_seconds: float
    recovered_conversations: int | None = None  # ShareGPT: complete conversations read
    truncated: bool | None = None  # ShareGPT: the file was cut off mid-conversation

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokenize_tokens_per_second(self) -> float:
        return self.tokens / self.tokenize_seconds if self.tokenize_seconds else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_on_disk / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        derived = ("tokens_per_second", "tokenize_tokens_per_second", "bytes_per_token")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}

    def format(self) -> str:
        lines = [
            f"index      {self.out}: {self.shards} shard(s), {self.bytes_on_disk / 1e6:,.1f} MB, "
            f"{self.bytes_per_token:.2f} bytes/token",
            f"records    {self.records:,} indexed, {self.held_out:,} held out, {self.skipped:,} files skipped",
            f"documents  {self.documents:,}",
            f"tokens     {self.tokens:,}",
            f"time       {self.seconds:.1f} s, {self.tokens_per_second:,.0f} tokens/s overall; "
            f"reading + tokenizing {self.tokenize_seconds:.1f} s ({self.tokenize_tokens_per_second:,.0f} tokens/s), "
            f"suffix arrays {self.suffix_array_seconds:.1f} s",
        ]
        if self.recovered_conversations is not None:
            cut = ", file cut off mid-conversation" if self.truncated else ""
            lines.append(f"sharegpt   {self.recovered_conversations:,} complete conversations recovered{cut}")
        return "\n".join(lines)


def build(config: BuildConfig) -> BuildReport:
    """Read, tokenize and write one index; the target appears only if everything succeeded, and
    any failure or interruption leaves it as it was.

    Raises ``CorpusError``/``BuildInputError``/``FileExistsError`` on bad input,
    ``IndexWriteError`` when the index cannot be written and ``BuildInterrupted`` on SIGINT,
    SIGTERM or SIGHUP (see ``_StopSignals``)."""
    start = time.perf_counter()
    if config.ray is not None:
        from rest_spec.build_index.ray_build import RayTarget, build_through_client, require_ray

        require_ray()  # before any work
        if RayTarget.parse(config.ray).kind == "client":
            with _StopSignals() as stop:
                stop.out = config.out
                return build_through_client(config)
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
            _engine(config, tokenizer, corpus) as engine,
            engine.writer(
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
            tokens = engine.index(corpus, writer, config.progress)
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


def _engine(config: BuildConfig, tokenizer, corpus: Corpus):
    """The engine that tokenizes and writes: worker processes here, or a Ray cluster (``--ray``);
    for a pre-tokenized corpus, this process alone (nothing to encode)."""
    if corpus.tokenized:
        if config.ray is not None:
            raise BuildInputError(f"--ray does not apply to corpus {config.corpus.corpus!r}: its records are token ids")
        return _LocalEngine(tokenizer, TokenizeConfig(workers=1), tokenizer_name(config.tokenizer))
    if config.ray is None:
        return _LocalEngine(tokenizer, config.tokenize, tokenizer_name(config.tokenizer))
    from rest_spec.build_index.ray_build import RayEngine

    return RayEngine(config.ray, tokenizer, config.tokenize)


class _LocalEngine:
    """Tokenizes over ``config.workers`` processes of this machine and writes every shard here.

    An engine is a context manager (it owns its workers) with ``writer(out, **args)``, the
    ``IndexWriter`` to use, and ``index(corpus, writer, progress)``, which streams the corpus's
    documents, in order, as token arrays into ``writer.add_document`` and returns the tokens."""

    def __init__(self, tokenizer, config: TokenizeConfig, name: str) -> None:
        self._encoder = BatchTokenizer(tokenizer, config)
        self._vocab_size, self._name = vocab_size(tokenizer), name

    def __enter__(self) -> _LocalEngine:
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


@contextlib.contextmanager
def progress_bar(corpus: Corpus, progress: bool, records: Iterable[Record] | None = None) -> Iterator[tqdm]:
    """A bar counting the corpus's records on stderr (only on a terminal), iterating ``records``
    if given (else counted with ``update``); log lines go above it, not through it."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(records, desc=corpus.slug, unit=" records", file=sys.stderr, disable=None if progress else True)
    with logging_redirect_tqdm(), bar:
        yield bar


def _load_tokenizer(spec: str | None):
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        reason = first_line(exc.__cause__ or exc)  # load_tokenizer wraps the library's error
        raise BuildInputError(f"cannot load tokenizer {spec or 'SmolLM2 (packaged)'}: {reason}") from exc
