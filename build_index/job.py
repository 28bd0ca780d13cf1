"""A build as the pipeline and its backends see it: what to build (``BuildConfig``, and with
``--ray`` where: ``RayTarget``), what came of it (``BuildReport``), how it fails on bad input or
stops on a signal (``BuildInputError``, ``BuildInterrupted``) and the progress bar it shows. Both
``build_index.build`` (the pipeline, which picks a backend) and ``build_index.ray_build`` (the Ray
backend) build on this module, so neither imports the other's names."""

from __future__ import annotations

import contextlib
import re
import signal
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rest_spec.build_index.corpus import Corpus, CorpusSpec, Record
from rest_spec.build_index.tokenize import TokenizeConfig
from rest_spec.build_index.writer import DEFAULT_SHARD_TOKENS

if TYPE_CHECKING:
    from tqdm import tqdm

_LOCAL = re.compile(r"local(?::(?P<cpus>\d+))?")
_CLIENT = re.compile(r"ray://(?P<host>[^:/\s]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})")


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
            RayTarget.parse(self.ray)  # a ValueError naming the forms
            if self.corpus.max_tokens is not None:  # Ray's readers cannot see the tokens written
                raise BuildInputError("--max-tokens does not apply with --ray")

    def build_args(self) -> dict:
        """The settings for the manifest's ``build`` entry (the corpus spec goes under ``corpus``)."""
        args = {**asdict(self), "out": None if self.out is None else str(self.out)}
        del args["corpus"]
        return args


@dataclass(frozen=True)
class RayTarget:
    """Where ``--ray`` builds: a new local cluster (``local``, ``local:N`` CPUs), the running
    cluster this machine belongs to (``auto``) or one reached through Ray Client (``ray://HOST:PORT``)."""

    kind: str  # "local", "auto" or "client"
    address: str  # ray.init's ("local" starts a new cluster even where one runs already)
    num_cpus: int | None = None  # local: the CPUs to give it (None: all of this machine's)

    @classmethod
    def parse(cls, text: str) -> RayTarget:
        if text == "auto":
            return cls("auto", "auto")
        if match := _LOCAL.fullmatch(text):
            cpus = None if match["cpus"] is None else int(match["cpus"])
            if cpus == 0:
                raise ValueError(f"--ray {text}: a local cluster needs at least 1 CPU")
            return cls("local", "local", cpus)
        if (match := _CLIENT.fullmatch(text)) and 1 <= int(match["port"]) <= 65535:
            return cls("client", text)
        raise ValueError(f"--ray takes auto, ray://HOST:PORT or local[:N] (N CPUs), got {text!r}")


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


@contextlib.contextmanager
def progress_bar(corpus: Corpus, progress: bool, records: Iterable[Record] | None = None) -> Iterator[tqdm]:
    """A bar counting the corpus's records on stderr (only on a terminal), iterating ``records``
    if given (else counted with ``update``); log lines go above it, not through it."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(records, desc=corpus.slug, unit=" records", file=sys.stderr, disable=None if progress else True)
    with logging_redirect_tqdm(), bar:
        yield bar
