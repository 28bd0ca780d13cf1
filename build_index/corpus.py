"""What a corpus is to the build: its spec (``CorpusSpec``), its records (``Record`` of ``Turn``s,
or token ids), an opened source (``Corpus``: fresh record iterators, provenance, the counts of the
last read) and the error a bad one raises. The sources themselves, and how a spec picks one, are
``build_index.corpora``'s (see its docstring for the rules); a source kept in a module of its own
(``build_index.pypi``) builds on this one, as ``corpora`` does, so neither imports the other."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice

TURN_CHOICES = ("assistant", "all")
TEXT = "text"  # the role of a non-chat record's single turn; always a document
DEFAULT_MAX_FILE_MIB = 32


class CorpusError(ValueError):
    """Bad corpus input (unknown name, missing path, wrong field, unreachable Hub); the message is
    one line meant for the user."""


@dataclass(frozen=True)
class CorpusSpec:
    """What to read and which part of it to index (see the module docstring)."""

    corpus: str
    data_files: tuple[str, ...] = ()
    field: str | None = None
    split: str = "train"
    config: str | None = None
    turns: str = "assistant"
    extensions: tuple[str, ...] = ()
    max_docs: int | None = None  # records read from the start of the source
    skip_last: int = 0  # records held out from the end of those
    max_file_mib: int = DEFAULT_MAX_FILE_MIB  # directories: larger files are skipped; 0 = no limit
    max_tokens: int | None = None  # stop reading once the build has indexed this many tokens
    # pypi only (build_index.pypi): the top N packages or a requirements file, names left out,
    # more pip download arguments, the download cache (None: $REST_CACHE_DIR/pypi) and pip runs at a time
    packages: str | None = None
    exclude_packages: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()
    cache_dir: str | None = None
    download_jobs: int | None = None
    outputs_salvage: bool = False  # outputs:DIR: skip a damaged log's bad bytes instead of refusing it

    def __post_init__(self) -> None:
        if self.turns not in TURN_CHOICES:
            raise CorpusError(f"turns must be one of {', '.join(TURN_CHOICES)}, got {self.turns!r}")
        if self.max_file_mib < 0:
            raise CorpusError(f"max_file_mib must be >= 0 (0: no limit), got {self.max_file_mib}")
        if self.max_docs is not None and self.max_docs < 1:
            raise CorpusError(f"max_docs must be positive, got {self.max_docs}")
        if self.skip_last < 0:
            raise CorpusError(f"skip_last must be >= 0, got {self.skip_last}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise CorpusError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.download_jobs is not None and self.download_jobs < 1:
            raise CorpusError(f"download_jobs must be positive, got {self.download_jobs}")
        exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in self.extensions if e)
        object.__setattr__(self, "extensions", exts)
        for name in ("data_files", "exclude_packages", "pip_args"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CorpusSpec:
        """The inverse of ``to_dict`` (JSON turns tuples into lists)."""
        data = dict(data)
        for key in ("data_files", "extensions", "exclude_packages", "pip_args"):
            data[key] = tuple(data.get(key) or ())
        return cls(**data)


@dataclass(frozen=True)
class Turn:
    role: str  # "user", "assistant", "system", another source role, or TEXT for non-chat items
    text: str


@dataclass(frozen=True)
class Record:
    """One source item; ``id`` is its path, conversation id or row number. A pre-tokenized
    record (``outputs:DIR``) has no turns and is one document of ``tokens``."""

    id: str
    turns: tuple[Turn, ...]
    tokens: Sequence[int] | None = None

    def documents(self, turns: str = "assistant") -> list[str]:
        """The non-empty texts to index under the turn policy ``turns`` ("assistant" or "all")."""
        return [t.text for t in self.turns if t.text and (turns == "all" or t.role in (TEXT, "assistant"))]


@dataclass
class ReadStats:
    """Counts a reader only learns while reading, for the log and the manifest."""

    records: int = 0  # records handed out for indexing
    held_out: int = 0
    skipped: int = 0  # files not indexed: binary, not UTF-8, special, too large, unreadable
    recovered: int | None = None  # tolerant JSON: complete elements read
    truncated: bool | None = None  # tolerant JSON: the file ends inside an element
    max_tokens_reached: bool | None = None  # the read stopped at spec.max_tokens
    tokens: int | None = None  # pre-tokenized records: the token ids handed out


Reader = Callable[[ReadStats], Iterator[Record]]


class Corpus:
    """An opened source: fresh record iterators, its provenance and the counts of the last read."""

    def __init__(
        self, spec: CorpusSpec, kind: str, location: dict, read: Reader, slug: str, tokenized: bool = False
    ) -> None:
        self.spec = spec
        self.tokenized = tokenized  # records carry token ids (``Record.tokens``), not text
        self.kind = kind
        self.location = location
        self.slug = slug  # a short name for default output paths
        self._read = read
        self.stats = ReadStats()

    def all_records(self) -> Iterator[Record]:
        """Every record of the source, ignoring ``max_docs`` and ``skip_last``."""
        return self._read(ReadStats())

    def records(self, tokens: Callable[[], int] | None = None) -> Iterator[Record]:
        """The records to index: the first ``max_docs``, less the last ``skip_last`` of those;
        given ``tokens`` (the tokens indexed so far), none after ``tokens()`` reaches
        ``spec.max_tokens``.

        Works on streams: the last ``skip_last`` records seen are held back in a deque until a
        newer one pushes them out. Counts go to ``self.stats``."""
        self.stats = stats = ReadStats()
        held = deque()
        limit = self.spec.max_tokens if tokens is not None else None
        for record in islice(self._read(stats), self.spec.max_docs):
            held.append(record)
            if len(held) > self.spec.skip_last:
                if limit is not None and tokens() >= limit:
                    stats.max_tokens_reached = True
                    return
                stats.records += 1
                record = held.popleft()
                if record.tokens is not None:
                    stats.tokens = (stats.tokens or 0) + len(record.tokens)
                yield record
        stats.held_out = len(held)

    def held_out(self) -> list[Record]:
        """The records ``records()`` holds back, in source order (reads the whole window)."""
        if not self.spec.skip_last:
            return []
        return list(deque(islice(self.all_records(), self.spec.max_docs), maxlen=self.spec.skip_last))

    def provenance(self) -> dict:
        """Source, settings and the counts of the last ``records()`` pass, for the manifest."""
        counts = {k: v for k, v in asdict(self.stats).items() if v is not None}
        return {"name": self.spec.corpus, "kind": self.kind, **self.location, "spec": self.spec.to_dict(), **counts}
