"""Writes tokenized documents into shards (token array + reversed suffix array) through ``datastore.format``.

The build happens in a temporary directory beside the target and is renamed into place only when
every shard and the manifest are on disk, so an interrupted build never leaves a half index under the
final name. An existing target is replaced only when ``overwrite`` is set and it holds an index of
ours and nothing else (a build never removes what it did not create); the old index is removed only
after the new one is in place, and the two renames that publish it are not split by a stop signal.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import resource
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rest_spec.common.signals import stop_signals_deferred
from rest_spec.common.types import token_ids
from rest_spec.datastore import format as fmt

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 28  # 268M tokens: ~1.6 GB on disk, ~3 GB peak to build
# Every file any format version wrote into an index directory: version 1 also had shard-NNNNN.docs.npy.
_INDEX_FILE = re.compile(rf"shard-\d{{5,}}\.({'|'.join(sorted({*fmt.ROLES, 'docs'}))})\.npy")
_MAX_MANIFEST_BYTES = 64 << 20
_FULL_DISK_BYTES = 1 << 16  # less free space than this after a failed write: the disk is full


class IndexWriteError(Exception):
    """Writing the index failed (a full disk, a file-size limit, an I/O error); ``directory`` is the
    target, which the failed build left as it was."""

    def __init__(self, directory: Path, reason: str) -> None:
        super().__init__(f"cannot write index to {directory}: {reason}")
        self.directory, self.reason = directory, reason

    def __reduce__(self):  # pickled whole: a build run as a Ray task raises it to the client
        return type(self), (self.directory, self.reason)


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
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._shards: list[fmt.ShardEntry] = []  # the shards written, in order
        self._next_shard = 0  # the number of the next shard to write
        self._sa_seconds = 0.0
        self.published = False  # the new index is at out_dir (set inside the publishing section)
        self._closed = False
        with self._writing():
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            self._warn_about_leftovers()
            # A unique name: a leftover of a killed build (whose PID may come round again) is never in the way.
            self._tmp = Path(tempfile.mkdtemp(prefix=self._sibling("tmp"), dir=self.out_dir.parent))

    @staticmethod
    def check_target(out_dir: Path, overwrite: bool) -> None:
        """Refuse an existing target unless ``overwrite`` is set and it holds an index of ours and
        nothing else; the one-line message names the path and why. Callers check before hours of
        work, and ``finish`` again before it replaces anything."""
        try:
            target = os.lstat(out_dir)
        except FileNotFoundError:
            return
        problem = _not_an_index(Path(out_dir), target)
        if problem:
            raise FileExistsError(f"refusing to replace {out_dir}: {problem}")
        if not overwrite:
            raise FileExistsError(f"{out_dir} already exists; pass --overwrite to replace it")

    def _sibling(self, kind: str) -> str:
        """The name prefix of a temporary directory beside the target: ``.NAME.KIND-PID-``."""
        return f".{self.out_dir.name}.{kind}-{os.getpid()}-"

    def _warn_about_leftovers(self) -> None:
        """Name what a killed build (SIGKILL, a crash) left beside the target. They are not removed:
        a build removes only what it created, and an ``old`` one may hold the only copy of an index."""
        leftover = re.compile(rf"\.{re.escape(self.out_dir.name)}\.(?P<kind>tmp|old)-(?P<pid>\d+)(-\w+)?")
        for path in self.out_dir.parent.iterdir():
            match = leftover.fullmatch(path.name)
            if not match or _running(int(match["pid"])):
                continue
            if match["kind"] == "tmp":
                log.warning("%s is the partial output of a build that was killed; remove it", path)
            elif os.path.lexists(self.out_dir):
                log.warning("%s is an old index that a killed build had replaced; remove it", path)
            else:
                log.warning("%s is the index that was at %s until a build was killed while replacing it; "
                            "move it back", path, self.out_dir)  # fmt: skip

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """OSErrors of the index's own files, and a shard that reads back corrupt, become one
        ``IndexWriteError`` naming the target."""
        try:
            yield
        except OSError as exc:
            raise IndexWriteError(self.out_dir, _reason(exc, self.out_dir.parent)) from exc
        except fmt.IndexFormatError as exc:
            raise IndexWriteError(self.out_dir, f"the shard written reads back wrong: {exc}") from exc

    def __enter__(self) -> IndexWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._closed:
            self.abort()

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (token ids); documents longer than a shard are split."""
        doc = token_ids(tokens, "document", self.vocab_size)
        if doc.size == 0:
            return
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
        tokens = layout_shard(self._pending, self.sep)
        self._pending, self._pending_tokens = [], 0
        self._write_shard(self._next_shard, tokens)
        self._next_shard += 1

    def _write_shard(self, shard: int, tokens: np.ndarray) -> None:
        """Build and write shard number ``shard`` from its token array, then ``_shard_written``.
        Shards are written in order; a subclass may build them elsewhere (``ray_build``), as long
        as ``_shard_written`` sees them in order by the end of ``_wait_for_shards``."""
        with self._writing():
            entry, sa_seconds = build_shard(self._tmp, shard, tokens, self.vocab_size)
        self._shard_written(entry, sa_seconds)

    def _shard_written(self, entry: fmt.ShardEntry, sa_seconds: float) -> None:
        self._shards.append(entry)
        self._sa_seconds += sa_seconds
        log.info("wrote %s: %d documents, %d tokens", entry.name, entry.num_documents, entry.num_tokens)

    def _wait_for_shards(self) -> None:
        """Return once every shard given to ``_write_shard`` is written (here: at once)."""

    def finish(self, corpus: dict | None = None, build: dict | None = None) -> BuildSummary:
        """Write the last shard and the manifest, then move the index into place atomically.

        ``corpus`` (provenance) and ``build`` (arguments, timings) go into the manifest as given;
        the writer adds its own ``suffix_array_seconds`` to ``build``."""
        self._flush()
        self._wait_for_shards()
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
        with self._writing():
            fmt.write_manifest(self._tmp, manifest)
        self._publish()
        return BuildSummary(
            self.out_dir,
            manifest.num_documents,
            manifest.num_tokens,
            len(self._shards),
            manifest.num_bytes,
            self._sa_seconds,
        )

    def _publish(self) -> None:
        """Move the new index into place, then remove the old one; a failed rename puts the old one
        back. Stop signals wait until this is done (``published`` says whether it was)."""
        self.check_target(self.out_dir, self.overwrite)
        parent = self.out_dir.parent
        with stop_signals_deferred():
            with self._writing():
                old = None
                if os.path.lexists(self.out_dir):
                    # rename() replaces an empty directory: a fresh name, never a leftover's
                    old = Path(tempfile.mkdtemp(prefix=self._sibling("old"), dir=parent))
                    os.replace(self.out_dir, old)
                try:
                    os.replace(self._tmp, self.out_dir)
                except OSError:
                    if old is not None:
                        os.replace(old, self.out_dir)
                    raise
            self.published = self._closed = True
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            try:
                fmt.fsync_directory(parent)
            except OSError as exc:  # the index is in place; only its durability across a crash is in doubt
                log.warning("cannot fsync %s after renaming the index into place: %s", parent, exc)

    def abort(self) -> None:
        """Drop everything written so far; the target is untouched."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._closed = True


def layout_shard(docs: Sequence[np.ndarray], sep: int) -> np.ndarray:
    """A shard's token array: ``SEP doc_0 SEP doc_1 ... SEP``, in the documents' dtype."""
    lengths = np.fromiter((d.size for d in docs), dtype=np.int64, count=len(docs))
    doc_seps = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths + 1, out=doc_seps[1:])  # each document is followed by its separator
    tokens = np.full(int(doc_seps[-1]) + 1, sep, dtype=docs[0].dtype)
    for doc, sep_pos in zip(docs, doc_seps[:-1]):
        tokens[sep_pos + 1 : sep_pos + 1 + doc.size] = doc
    return tokens


def build_shard(directory: Path, shard: int, tokens: np.ndarray, vocab_size: int) -> tuple[fmt.ShardEntry, float]:
    """Build the suffix array of one laid-out shard and write the shard into ``directory``;
    returns its manifest entry and the seconds the suffix array took. Raises ``OSError`` and
    ``IndexFormatError`` (a shard that reads back wrong) as they come."""
    t0 = time.perf_counter()
    sa = fmt.suffix_array(tokens)
    sa_seconds = time.perf_counter() - t0
    return fmt.write_shard(directory, shard, tokens, sa, vocab_size=vocab_size), sa_seconds


def _not_an_index(path: Path, target: os.stat_result) -> str | None:
    """Why ``path`` (lstat ``target``) is not an index directory of ours holding only the files a
    build writes, or None when it is one. Nothing is opened but a regular manifest.json."""
    if stat.S_ISLNK(target.st_mode):
        return "it is a symbolic link, not an index directory"
    if not stat.S_ISDIR(target.st_mode):
        return "it is not a directory"
    manifest = path / fmt.MANIFEST
    try:
        info = os.lstat(manifest)
    except FileNotFoundError:
        return f"it has no {fmt.MANIFEST}, so it is not an index"
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_MANIFEST_BYTES:
        return f"its {fmt.MANIFEST} is not a regular file of at most {_MAX_MANIFEST_BYTES} bytes"
    try:
        declared = json.loads(manifest.read_bytes())
    except ValueError:  # not JSON, not UTF-8
        declared = None
    if not isinstance(declared, dict) or declared.get("format") != fmt.FORMAT_NAME:
        return f"its {fmt.MANIFEST} does not declare format {fmt.FORMAT_NAME!r}"
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name != fmt.MANIFEST and not _INDEX_FILE.fullmatch(entry.name):
                return f"it holds {entry.name!r}, which build_index does not write"
            if not entry.is_file(follow_symlinks=False):
                return f"its {entry.name} is not a regular file"
    return None


def _reason(error: OSError, directory: Path) -> str:
    """``[Errno N] what``. numpy reports a short write as "N requested and M written", without the
    errno; then the cause is named from what is left: no free space, or a file-size limit."""
    code = error.errno
    if code is None:
        if shutil.disk_usage(directory).free < _FULL_DISK_BYTES:
            code = errno.ENOSPC
        elif resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
            code = errno.EFBIG
        else:
            return str(error)
    return f"[Errno {code}] {os.strerror(code)}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
