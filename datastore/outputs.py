"""The durable store of recent outputs a service drafts from (``OutputStore``), and its log.

It drafts like the index through ``datastore.bigram.BigramIndex``; the log (``_Log``) makes
every acknowledged output survive a restart. ``read_outputs`` reads a log without locking or
writing it: ``build_index --corpus outputs:DIR`` indexes the model's own outputs from it.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import stat
import struct
import threading
import zlib
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rest_spec.common.types import DraftConfig, DraftTree, token_ids
from rest_spec.datastore import format as fmt
from rest_spec.datastore.bigram import SEP, BigramIndex
from rest_spec.datastore.index import DEFAULT_MAX_CANDIDATES, checked_queries, query_matrix

log = logging.getLogger(__name__)

DEFAULT_OUTPUTS_MAX_TOKENS = 1_000_000  # an output store's default size (4 MB of tokens + 16 MB of table)


class OutputStoreError(RuntimeError):
    """The output store's log is unusable: foreign, damaged before its end, or locked."""


class OutputStoreWriteError(OSError):
    """Writing the log failed; what was being written is not stored and the log is as it was.
    ``errno`` is the cause's: ENOSPC, EDQUOT or EFBIG mean a full disk, quota or file-size limit
    (retry once space is freed), anything else (EIO, ...) a failing disk."""

    def __init__(self, cause: OSError, message: str) -> None:
        super().__init__(cause.errno if cause.errno is not None else errno.EIO, message)

    def __str__(self) -> str:
        return self.strerror  # one line, without OSError's "[Errno n]" prefix


class _Record(NamedTuple):
    seq: int
    tokens: np.ndarray  # uint32; empty for a marker that only carries the newest sequence number


class _Scan(NamedTuple):
    """A log read through: its valid records, and its damage (``_Log.scan``)."""

    records: list[_Record]
    damage: list[tuple[int, int, int]]  # damaged spans before valid records: (start, stop, records before)
    torn: int | None  # where a damaged tail (a torn last record) starts, if any
    size: int  # bytes read

    @property
    def damaged_bytes(self) -> int:
        return sum(stop - start for start, stop, _ in self.damage) + (0 if self.torn is None else self.size - self.torn)

    @property
    def places(self) -> int:
        return len(self.damage) + (self.torn is not None)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset``: a full disk or a file-size limit ends a write
    early and only the next one fails."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written == 0:
            raise OSError(errno.EIO, "the disk accepted no bytes")
        view, offset = view[written:], offset + written


class _Log:
    """The append-only file behind a persistent ``OutputStore``.

    ``outputs.log`` = magic, then one record per document: [u64 seq][u32 n][u32 crc32 of the
    12 bytes before it and the payload], payload n little-endian u32 tokens (n = 0: a marker
    holding only the newest sequence number given, written when no document holds it).

    The committed length -- the bytes of whole, fsynced records -- is tracked here, never taken
    from the file: a record is written at that offset and fsynced before it is committed (and
    before ``add`` acknowledges it). A failed write cuts the file back to the committed length
    (ftruncate + fsync); if even that fails, every later append retries the cut-back first and
    refuses until it succeeds. So after a crash only the last record can be torn, and replay
    drops it with a warning: it was never acknowledged. Damage followed by a valid record is
    damage to acknowledged data: opening refuses it, naming the offset and the records after
    it, unless asked to salvage them. Rewrites (compaction, salvage) go to a temporary file that
    is renamed over the log; a failed rewrite leaves the old log in use. A ``LOCK`` file keeps a
    second process out (a reader, ``read_outputs``, needs no lock: it only ``scan``s the bytes)."""

    MAGIC = b"RESTOUT1"
    NAME = "outputs.log"
    _HEADER = struct.Struct("<QII")
    # How far past the last good sequence number a record after damage is looked for: between
    # two records of one log lie fewer records than that (2**32 records take 64 GiB or more).
    _SEQ_WINDOW = 1 << 32
    _SCAN_CHUNK = 1 << 20  # bytes searched for a record per vectorized pass

    def __init__(self, directory: Path) -> None:
        """Lock ``directory`` (created if missing) and open its log, creating an empty one."""
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.path = directory, directory / self.NAME
        self._fd: int | None = None
        self._committed = 0  # set by ``rewrite`` or ``_recover``
        self._needs_cut_back = False  # a failed write may have left bytes past _committed
        self._lock_file = open(directory / "LOCK", "a")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise OutputStoreError(f"output store {directory} is open in another process") from None
        try:
            if self.path.exists():
                self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)  # a FIFO or device must not hang
                if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                    raise OutputStoreError(f"{self.path} is not a regular file")
            else:
                self.rewrite([])
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, directory: Path, salvage: bool = False) -> tuple[_Log, list[_Record]]:
        """The log in ``directory``, ready to append, and its records: a torn last one dropped,
        damaged ones before valid ones refused, or with ``salvage`` dropped (the log rewritten)."""
        opened = cls(directory)
        try:
            records = opened._recover(salvage)
        except BaseException:
            opened.close()
            raise
        return opened, records

    @staticmethod
    def encode(seq: int, tokens: np.ndarray) -> bytes:
        payload = tokens.astype("<u4").tobytes()
        head = struct.pack("<QI", seq, tokens.size)
        return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload

    @classmethod
    def _decode(cls, data: bytes, offset: int) -> tuple[_Record, int] | None:
        """The record at ``offset`` and the offset after it, or None if it is short or corrupt."""
        if offset + cls._HEADER.size > len(data):
            return None
        seq, n, crc = cls._HEADER.unpack_from(data, offset)
        start, end = offset + cls._HEADER.size, offset + cls._HEADER.size + 4 * n
        if end > len(data) or zlib.crc32(data[start:end], zlib.crc32(data[offset : start - 4])) != crc:
            return None
        return _Record(seq, np.frombuffer(data, "<u4", n, start).astype(np.uint32)), end

    @classmethod
    def _find_record(cls, data: bytes, start: int, after_seq: int) -> int | None:
        """The first offset >= ``start`` of a valid record numbered after ``after_seq``, or None.
        Every byte offset is tried (damage may have shifted the bytes), but only where the seq
        field is within ``_SEQ_WINDOW`` after ``after_seq``; those are found vectorized, a chunk
        at a time, so a search costs about the distance to the record it finds."""
        if after_seq + 1 >= 2**64:
            return None
        lo, hi = np.uint64(after_seq + 1), np.uint64(min(after_seq + cls._SEQ_WINDOW, 2**64 - 1))
        last = len(data) - cls._HEADER.size  # the last offset a header fits at
        for chunk in range(start, last + 1, cls._SCAN_CHUNK):
            chunk_last = min(chunk + cls._SCAN_CHUNK - 1, last)
            candidates = []
            for first in range(chunk, min(chunk + 8, chunk_last + 1)):  # seq fields at first + 8k
                seqs = np.frombuffer(data, "<u8", (chunk_last - first) // 8 + 1, first)
                candidates.append(first + 8 * np.flatnonzero((seqs >= lo) & (seqs <= hi)))
            for offset in np.sort(np.concatenate(candidates)):
                if cls._decode(data, int(offset)) is not None:
                    return int(offset)
        return None

    @classmethod
    def scan(cls, path: Path, data: bytes) -> _Scan:
        """The records of the log bytes ``data`` (read from ``path``) and where it is damaged;
        ``OutputStoreError`` for a foreign file or records out of order (no salvage mends those)."""
        if data[: len(cls.MAGIC)] != cls.MAGIC:
            raise OutputStoreError(f"{path} is not an output-store log (bad magic)")
        records: list[_Record] = []
        damage: list[tuple[int, int, int]] = []  # (start, stop, records before it)
        offset = len(cls.MAGIC)
        while offset < len(data):
            decoded = cls._decode(data, offset)
            if decoded is None:
                found = cls._find_record(data, offset + 1, records[-1].seq if records else -1)
                damage.append((offset, len(data) if found is None else found, len(records)))
                if found is None:
                    break
                offset = found
                continue
            record, next_offset = decoded
            if records and record.seq <= records[-1].seq:
                raise OutputStoreError(f"{path}: sequence number {record.seq} at byte {offset} is out of order")
            records.append(record)
            offset = next_offset
        torn = damage.pop()[0] if damage and damage[-1][1] == len(data) else None
        return _Scan(records, damage, torn, len(data))

    @staticmethod
    def refuse_damage(path: Path, scan: _Scan, salvage_hint: str) -> None:
        """Raise ``OutputStoreError`` naming the first damage before valid records, if any."""
        if scan.damage:
            start, _, before = scan.damage[0]
            records = scan.records
            raise OutputStoreError(
                f"{path}: corrupt record at byte {start}, followed by {len(records) - before} valid "
                f"records (seqs {records[before].seq}..{records[-1].seq}); {salvage_hint}"
            )

    def _recover(self, salvage: bool) -> list[_Record]:
        """Replay the log, deal with its damage (see ``open``) and set the committed length."""
        scan = self.scan(self.path, self.path.read_bytes())
        records = scan.records
        if not salvage:
            self.refuse_damage(
                self.path,
                scan,
                "open it with salvage (rest-datastore serve --outputs-salvage) to keep every valid record "
                "and drop the damaged bytes",
            )
        if scan.damage:
            log.warning(
                "%s: salvaged %d valid records; dropped %d damaged bytes in %d places (first at byte %d)",
                self.path,
                len(records),
                scan.damaged_bytes,
                scan.places,
                scan.damage[0][0],
            )
            self.rewrite([self.encode(r.seq, r.tokens) for r in records])
            return records
        self._committed = scan.size if scan.torn is None else scan.torn
        if scan.torn is not None:
            log.warning(
                "%s: dropping a torn last record (%d bytes at byte %d); it was never acknowledged",
                self.path,
                scan.size - scan.torn,
                scan.torn,
            )
            try:
                self._cut_back()
            except OSError as exc:
                raise OutputStoreWriteError(
                    exc, f"output store {self.directory}: cutting off the torn last record failed ({_reason(exc)})"
                ) from exc
        return records

    def append(self, record: bytes) -> None:
        """Write ``record`` at the committed length and fsync it, then commit it; on failure
        cut the file back and raise ``OutputStoreWriteError`` (the record is not stored)."""
        assert self._fd is not None, "append to a closed log"
        if self._needs_cut_back:
            try:
                self._cut_back()
            except OSError as exc:
                raise OutputStoreWriteError(
                    exc,
                    f"output store {self.directory}: the log cannot be cut back to its last acknowledged "
                    f"record after a failed write ({_reason(exc)}); the addition was NOT stored",
                ) from exc
        try:
            _write_all(self._fd, record, self._committed)
            os.fsync(self._fd)
        except BaseException as exc:
            self._needs_cut_back = True
            try:
                self._cut_back()
            except OSError as cut_exc:
                log.error(
                    "%s: cutting the log back after a failed write failed (%s); appends are refused "
                    "until a cut-back succeeds",
                    self.path,
                    _reason(cut_exc),
                )
            if isinstance(exc, OSError):
                raise OutputStoreWriteError(
                    exc,
                    f"output store {self.directory}: writing the log failed ({_reason(exc)}); "
                    "the addition was NOT stored",
                ) from exc
            raise
        self._committed += len(record)

    def _cut_back(self) -> None:
        """Make the file exactly its committed records, durably (name included)."""
        assert self._fd is not None
        os.ftruncate(self._fd, self._committed)
        os.fsync(self._fd)
        fmt.fsync_directory(self.directory)
        self._needs_cut_back = False

    def rewrite(self, records: list[bytes]) -> None:
        """Replace the log by ``records`` atomically (temporary file, fsync, rename, fsync dir);
        ``OutputStoreWriteError`` if that fails, the old log still in use and unchanged."""
        temporary = self.path.with_suffix(".tmp")
        data = self.MAGIC + b"".join(records)
        fd = None
        try:
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_all(fd, data, 0)
            os.fsync(fd)
            os.replace(temporary, self.path)
        except OSError as exc:
            if fd is not None:
                os.close(fd)
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise OutputStoreWriteError(
                exc,
                f"output store {self.directory}: rewriting the log failed ({_reason(exc)}); the old log is unchanged",
            ) from exc
        # The descriptor follows the renamed file, so appends cannot go to the replaced one.
        previous, self._fd, self._committed = self._fd, fd, len(data)
        if previous is not None:
            os.close(previous)
        try:
            fmt.fsync_directory(self.directory)
            self._needs_cut_back = False
        except OSError as exc:  # the rename may not be durable yet: appends wait until it is
            self._needs_cut_back = True
            log.error(
                "%s: syncing the directory after a rewrite failed (%s); appends are refused until it succeeds",
                self.path,
                _reason(exc),
            )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._lock_file.close()  # releases the flock


class _Document(NamedTuple):
    seq: int
    start: int  # buffer position of the first token
    length: int


class OutputStore:
    """A bounded, thread-safe store of recent generations that drafts like the index.

    ``add`` stores one document (a generation's tokens) and returns its sequence number; while
    more than ``max_tokens`` tokens are held the oldest whole documents are evicted. With a
    ``directory`` every document is appended to a log and fsynced before ``add`` returns, and
    opening replays the log (same documents, same evictions), so a restart loses nothing that
    was acknowledged. Evicted data stays in memory and in the log until it outweighs the live
    data; then both are rewritten with the live documents only (amortized O(1) per token).
    With ``vocab_size``, ``add`` refuses token ids outside the vocabulary (and opening refuses a
    log that holds any).

    An ``add`` whose write fails raises ``OutputStoreWriteError``: nothing of it is kept, in
    memory or on disk. Sequence numbers: each acknowledged ``add`` gets the previous one's plus
    one (0 first); a refused one gets none, so the next ``add`` gets the number it would have
    had -- no one was told that number, and no record holds it. The log always holds the newest
    number given (as its document, or as a marker once a smaller ``max_tokens`` evicts even
    that at open), so a reopened store counts on after it; a torn last record was never
    acknowledged, so its number is free. No number is ever given twice.

    A log with damage before valid records is refused (``OutputStoreError``); ``salvage``
    keeps every valid record, drops the damaged bytes and rewrites the log."""

    def __init__(
        self,
        max_tokens: int,
        directory: str | Path | None = None,
        *,
        vocab_size: int | None = None,
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
        salvage: bool = False,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be positive, got {max_candidates}")
        if vocab_size is not None and not 1 <= vocab_size <= SEP:
            raise ValueError(f"vocab_size must be in [1, {SEP}], got {vocab_size}")
        self.max_tokens, self.max_candidates = max_tokens, max_candidates
        self.vocab_size = SEP if vocab_size is None else vocab_size
        self._lock = threading.Lock()
        self._index = BigramIndex()
        self._documents: deque[_Document] = deque()  # live documents, oldest first
        self._live_tokens = self._evicted_tokens = 0
        self._next_seq = 0
        self._closed = False
        self._log: _Log | None = None
        if directory is not None:
            self._log, records = _Log.open(Path(directory), salvage)
            try:
                self._replay(records)
            except BaseException:
                self._log.close()
                raise
            self._compact_if_mostly_evicted()
            log.info("opened output store %s: %d documents, %d tokens", directory, len(self), self._live_tokens)

    def __len__(self) -> int:
        """Live documents."""
        return len(self._documents)

    @property
    def num_tokens(self) -> int:
        """Live tokens, at most ``max_tokens``: with ``documents``, how a caller (and the tests)
        see what eviction and replay left."""
        return self._live_tokens

    def add(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Store ``tokens`` as one document; returns its sequence number once it is durable."""
        array = token_ids(tokens, "tokens", self.vocab_size).astype(np.uint32)
        if array.size == 0:
            raise ValueError("tokens is empty: a document needs at least one token")
        if array.size > self.max_tokens:
            raise ValueError(f"a document of {array.size} tokens exceeds the store's max_tokens={self.max_tokens}")
        with self._lock:
            self._check_open()
            seq = self._next_seq
            if self._log is not None:
                self._log.append(_Log.encode(seq, array))
            self._insert(seq, array)
            self._compact_if_mostly_evicted()
        return seq

    def read(self, from_seq: int, max_tokens: int) -> tuple[list[tuple[int, np.ndarray]], int, int]:
        """What a copy of this store reads (``datastore.mirror``): (the live documents numbered
        ``from_seq`` or later, oldest first, as (seq, tokens copy), at most ``max_tokens`` tokens in
        all; where to read from next, past them and past any document of more than ``max_tokens``
        tokens, which no read returns; ``end_seq``)."""
        if from_seq < 0 or max_tokens < 1:
            raise ValueError(f"from_seq must be >= 0 and max_tokens >= 1, got {from_seq} and {max_tokens}")
        documents, next_seq, budget = [], from_seq, max_tokens
        with self._lock:
            self._check_open()
            start = bisect.bisect_left(self._documents, from_seq, key=lambda document: document.seq)
            for document in itertools.islice(self._documents, start, None):
                if document.length > max_tokens:  # can never be read whole: passed over
                    next_seq = document.seq + 1
                    continue
                if document.length > budget:
                    break
                tokens = self._index.tokens[document.start : document.start + document.length].copy()
                documents.append((document.seq, tokens))
                budget -= document.length
                next_seq = document.seq + 1
            else:  # read to the end
                if from_seq <= self._next_seq:
                    next_seq = self._next_seq
            return documents, next_seq, self._next_seq

    def documents(self) -> list[np.ndarray]:
        """The live documents' tokens, oldest first (copies): what a reopened store must hold again."""
        with self._lock:
            return [self._index.tokens[d.start : d.start + d.length].copy() for d in self._documents]

    def draft(self, context: Sequence[int] | np.ndarray, config: DraftConfig = DraftConfig()) -> DraftTree:
        """The draft tree continuing ``context`` from the live documents (as ``Datastore.draft``)."""
        return self.draft_batch([context], config)[0]

    def draft_batch(
        self, contexts: Sequence[Sequence[int] | np.ndarray], config: DraftConfig = DraftConfig()
    ) -> list[DraftTree]:
        """``draft`` of every context, in one compiled pass (``BigramIndex.draft_batch``)."""
        return self._draft_parsed(*query_matrix(contexts, config.n_max, SEP), config)

    def draft_queries(self, queries: np.ndarray, lengths: np.ndarray, config: DraftConfig) -> list[DraftTree]:
        """``draft_batch`` of contexts already parsed (``query_matrix``), checked again, as
        ``Datastore.draft_queries``."""
        return self._draft_parsed(*checked_queries(queries, lengths, SEP), config)

    def _draft_parsed(self, queries: np.ndarray, lengths: np.ndarray, config: DraftConfig) -> list[DraftTree]:
        with self._lock:
            self._check_open()
            index = self._index
            first_live = self._documents[0].start if self._documents else index.size
            return index.draft_batch(queries, lengths, config, first_live, self.max_candidates)

    def _replay(self, records: list[_Record]) -> None:
        assert self._log is not None
        for record in records:
            outside = record.tokens[record.tokens >= self.vocab_size]
            if outside.size:
                raise OutputStoreError(
                    f"{self._log.path}: the record with sequence number {record.seq} holds token id "
                    f"{int(outside[0])}, outside the vocabulary [0, {self.vocab_size}) (a log of another model?)"
                )
            if record.tokens.size:
                self._insert(record.seq, record.tokens)
            else:  # a marker: the newest number given, its document gone
                self._next_seq = record.seq + 1

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("output store is closed")

    def _insert(self, seq: int, tokens: np.ndarray) -> None:
        self._documents.append(_Document(seq, self._index.size, tokens.size))
        self._index.append(tokens)
        self._index.end_document()
        self._live_tokens += tokens.size
        self._next_seq = seq + 1
        while self._live_tokens > self.max_tokens:
            evicted = self._documents.popleft()
            self._live_tokens -= evicted.length
            self._evicted_tokens += evicted.length

    def _compact_if_mostly_evicted(self) -> None:
        if self._evicted_tokens <= self._live_tokens:
            return
        first_live = self._documents[0].start if self._documents else self._index.size
        shift = first_live - 1  # the separator before the first live document becomes position 0
        self._index = BigramIndex(self._index.tokens[first_live : self._index.size])
        self._documents = deque(d._replace(start=d.start - shift) for d in self._documents)
        self._evicted_tokens = 0
        if self._log is not None:
            self._rewrite_log()

    def _rewrite_log(self) -> None:
        """Rewrite the log with the live documents. If that fails the old log, a superset that
        replays to the same documents, stays: warn and try again at the next compaction."""
        assert self._log is not None
        tokens = self._index.tokens
        records = [_Log.encode(d.seq, tokens[d.start : d.start + d.length]) for d in self._documents]
        if self._next_seq and not self._documents:  # eviction is oldest first: the newest is gone only if all are
            records.append(_Log.encode(self._next_seq - 1, np.zeros(0, np.uint32)))
        try:
            self._log.rewrite(records)
        except OutputStoreWriteError as exc:
            log.warning("%s; it keeps the evicted documents until the next compaction", exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> OutputStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_outputs_options(max_tokens: int, directory: str | Path | None) -> None:
    """Raise ``ValueError`` unless ``max_tokens`` >= 0 (0: keep no outputs) and a ``directory``
    comes with a store to keep in it."""
    if max_tokens < 0:
        raise ValueError(f"outputs_max_tokens must be non-negative (0: keep no outputs), got {max_tokens}")
    if directory is not None and max_tokens == 0:
        raise ValueError("outputs_dir is set but outputs_max_tokens is 0 (no outputs are kept)")


def open_output_store(
    max_tokens: int, directory: str | Path | None = None, *, vocab_size: int | None = None, salvage: bool = False
) -> OutputStore | None:
    """The output store a drafter or server is configured with: ``max_tokens`` tokens, persistent
    in ``directory`` if given (``salvage``: see ``OutputStore``); None for ``max_tokens`` 0."""
    check_outputs_options(max_tokens, directory)
    return OutputStore(max_tokens, directory, vocab_size=vocab_size, salvage=salvage) if max_tokens else None


def read_outputs(directory: str | Path, *, salvage: bool = False) -> list[tuple[int, np.ndarray]]:
    """The outputs the store in ``directory`` had acknowledged when its log was read, oldest
    first, as (sequence number, uint32 tokens) pairs; every document the log holds, evicted
    ones not yet compacted away included. Read-only: no lock is taken and nothing is written,
    so a server may go on appending (``rest-datastore serve --outputs-dir``).

    A torn last record (never acknowledged, or being written now) is left out with a warning;
    damage before valid records raises ``OutputStoreError`` unless ``salvage``, which skips the
    damaged bytes (the log stays as it is). ``OSError`` if the log cannot be read."""
    path = Path(directory) / _Log.NAME
    if not path.exists():
        raise OutputStoreError(f"{directory} holds no output store ({_Log.NAME} not found)")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO or device must not hang
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputStoreError(f"{path} is not a regular file")
        data = f.read()
    scan = _Log.scan(path, data)
    if not salvage:
        _Log.refuse_damage(path, scan, "read it with salvage (build_index --outputs-salvage) to skip the damaged bytes")
    if scan.damage:
        damaged = sum(stop - start for start, stop, _ in scan.damage)
        log.warning("%s: skipped %d damaged bytes in %d place(s) (first at byte %d); the log is unchanged",
                    path, damaged, len(scan.damage), scan.damage[0][0])  # fmt: skip
    if scan.torn is not None:
        log.warning("%s: left out a torn last record (%d bytes at byte %d): never acknowledged, or being written now",
                    path, scan.size - scan.torn, scan.torn)  # fmt: skip
    return [(record.seq, record.tokens) for record in scan.records if record.tokens.size]  # markers hold no output
