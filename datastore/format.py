"""The on-disk index format: the only module that knows file names, dtypes, the manifest and its version.

An index is a directory::

    manifest.json                 format version, tokenizer, dtypes, provenance, per-shard file list
    shard-00000.tokens.npy        token ids: SEP doc_0 SEP doc_1 SEP ... doc_last SEP
    shard-00000.sa.npy            suffix array of the *reversed* token array, restricted to the
                                  positions that have a continuation (int32, int64 past 2^31)
    shard-00001.tokens.npy ...

Tokens are ``<u2`` while the vocabulary leaves room for the separator (the dtype's maximum value),
else ``<u4``. The separator is never a real token id, so no match crosses a document boundary and
every continuation stops at its document's end; because the array also starts and ends with one,
neither a continuation nor a backward extension of a match can run off the array.

The suffix array keeps only the reversed suffixes that start at a real token followed by another
real token: a match ending on a separator or on a document's last token has nothing to draft.
Dropping those entries keeps the array sorted, makes every counted match useful, and keeps the
index at 6 bytes per corpus token with a vocabulary under 65,535 (2 for the token, 4 for its
suffix-array entry; each document costs one 2-byte separator and saves its last token's entry).
Document boundaries are the separators themselves; no other file is needed.

Why the reversed array: the suffixes of the reversed corpus that start with ``reversed(q)`` are the
positions where ``q`` *ends* in the corpus. Extending the query one token further back narrows the
rank range of the previous, shorter query, so one pass finds the longest matching context suffix
and the next token after each match is at ``len - rank_position``.

All arrays are ``.npy`` files (little-endian, dtype in the header) and are memory-mapped at open.

Every index is untrusted input: the manifest is type- and range-checked field by field and may
name only the canonical files of this directory; open checks sizes, ``.npy`` headers and spot
digests in O(1); ``check_shard`` checks every array's structure in O(n) (at build time, in
``verify``, and at open on request), and the search kernels bounds-check what they read from disk.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import stat
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pydivsufsort

from rest_spec.common.cache import numba_cached

numba = numba_cached()

FORMAT_NAME = "rest-index"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
ROLES = ("tokens", "sa")
_SPOT_BYTES = 1 << 16
# The largest real vocabularies hold ~260k ids; 2^24 leaves 64x room while keeping every id exact
# in the int32 of a draft tree and the per-shard memo of first-token ranges (8 bytes per id,
# touched lazily) at most 128 MiB of address space.
MAX_VOCAB_SIZE = 1 << 24
# A manifest is a few hundred bytes per shard: 64 MiB is 100k+ shards, and caps what a damaged
# or hostile one makes us read and parse.
MAX_MANIFEST_BYTES = 64 << 20
_MAX_COUNT = 1 << 62  # token, document and byte counts: far beyond any disk, still exact in int64
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NPY_LENGTH_FIELDS = {b"\x93NUMPY\x01\x00": "<H", b"\x93NUMPY\x02\x00": "<I"}  # magic + version -> header length
_NPY_MAX_HEADER = 4096  # np.save writes ~120 bytes for a 1-D array


class IndexFormatError(ValueError):
    """An index directory is missing, incomplete, corrupt or of another format version."""


class IndexCorruptError(IndexFormatError):
    """An index file's content is damaged: a digest mismatch at open, the structural check, or a
    kernel's bounds check while drafting (which the server answers with DATA_LOSS)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype whose maximum is free for the separator."""
    if vocab_size < 0xFFFF:
        return np.dtype("<u2")
    if vocab_size < 0xFFFFFFFF:
        return np.dtype("<u4")
    raise IndexFormatError(f"vocabulary of {vocab_size} ids does not fit in uint32")


def separator(dtype: np.dtype) -> int:
    return int(np.iinfo(dtype).max)


def sa_dtype(array_len: int) -> np.dtype:
    return np.dtype("<i4") if array_len < 2**31 else np.dtype("<i8")


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def shard_file(shard: int, role: str) -> str:
    return f"{shard_name(shard)}.{role}.npy"


def spot_digest(path: Path) -> str:
    """sha256 of the size, the first and the last 64 KiB: cheap enough to check at every open,
    and catches truncation, a replaced file and a damaged header."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_SPOT_BYTES))
        f.seek(max(0, size - _SPOT_BYTES))
        h.update(f.read(_SPOT_BYTES))
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    sha256: str
    spot_sha256: str

    @classmethod
    def of(cls, path: Path) -> FileEntry:
        return cls(path.name, path.stat().st_size, file_digest(path), spot_digest(path))


@dataclass(frozen=True)
class ShardEntry:
    name: str
    num_tokens: int  # corpus tokens, separators excluded
    num_documents: int
    files: dict[str, FileEntry]

    @property
    def array_len(self) -> int:
        """Length of the shard's token array: its tokens and one separator per document plus one."""
        return self.num_tokens + self.num_documents + 1


@dataclass(frozen=True)
class TokenizerEntry:
    name: str
    fingerprint: str
    vocab_size: int


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerEntry
    token_dtype: str
    separator: int
    shards: tuple[ShardEntry, ...]
    corpus: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(f.bytes for s in self.shards for f in s.files.values())

    def to_json(self) -> str:
        data = asdict(self)
        data["num_tokens"], data["num_documents"] = self.num_tokens, self.num_documents
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST) -> Manifest:
        """Parse and check a manifest; every problem is one ``IndexFormatError`` line
        ``"<source>: <field>: <problem>"``."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, digit limits, deep nesting
            raise IndexFormatError(f"{source}: not valid JSON: {exc}") from None
        return _ManifestParser(source).manifest(data)


def _short(value: object) -> str:
    """``repr(value)`` cut to one short line: a hostile manifest's values go into error messages."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _json_type(value: object) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


class _ManifestParser:
    """Checks a decoded manifest field by field: exact JSON types (a boolean is not an integer),
    ranges, agreement between fields, and file names that are exactly the canonical ones, so a
    damaged or hand-edited manifest can neither name a file outside the index nor ask for an
    absurd allocation."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> IndexFormatError:
        return IndexFormatError(f"{self.source}: {where}: {problem}")

    def obj(self, value: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        """``value`` as a JSON object holding every ``required`` field and nothing unknown."""
        if type(value) is not dict:
            raise self.fail(where or "manifest", f"expected an object, got {_json_type(value)}")
        for key in required:
            if key not in value:
                raise self.fail(f"{where}.{key}" if where else key, "missing")
        unknown = sorted(set(value) - set(required) - set(optional))
        if unknown:
            raise self.fail(where or "manifest", f"unknown field {_short(unknown[0])}")
        return value

    def of_type(self, value: object, kind: type, where: str):
        if type(value) is not kind:
            raise self.fail(where, f"expected {_json_type(kind())}, got {_json_type(value)}")
        return value

    def count(self, value: object, where: str, lo: int = 0, hi: int = _MAX_COUNT) -> int:
        if not lo <= self.of_type(value, int, where) <= hi:
            raise self.fail(where, f"{_short(value)} is outside [{lo}, {'2^62' if hi == _MAX_COUNT else hi}]")
        return value

    def equal(self, value: object, expected: object, where: str, why: str) -> None:
        if value != expected or type(value) is not type(expected):
            raise self.fail(where, f"{_short(value)} is not {expected!r} ({why})")

    def manifest(self, data: object) -> Manifest:
        # format and version first: another version's manifest may have other fields
        if type(data) is not dict:
            raise self.fail("manifest", f"expected an object, got {_json_type(data)}")
        if data.get("format") != FORMAT_NAME:
            raise self.fail("format", f"{_short(data.get('format'))}: not a {FORMAT_NAME} manifest")
        version = data.get("format_version")
        if version != FORMAT_VERSION or type(version) is not int:
            raise self.fail(
                "format_version",
                f"index format version {_short(version)} is not supported "
                f"(this build reads version {FORMAT_VERSION}); rebuild the index with build_index",
            )
        data = self.obj(
            data,
            "",
            ("format", "format_version", "tokenizer", "token_dtype", "separator", "shards"),
            ("corpus", "build", "num_tokens", "num_documents"),
        )
        tokenizer = self.tokenizer(data["tokenizer"])
        dtype = token_dtype(tokenizer.vocab_size)
        self.equal(data["token_dtype"], dtype.str, "token_dtype", f"the dtype for {tokenizer.vocab_size} ids")
        self.equal(data["separator"], separator(dtype), "separator", f"the largest {dtype.str} value")
        shards = self.of_type(data["shards"], list, "shards")
        if not shards:
            raise self.fail("shards", "empty: an index has at least one shard")
        manifest = Manifest(
            tokenizer=tokenizer,
            token_dtype=dtype.str,
            separator=separator(dtype),
            shards=tuple(self.shard(i, s) for i, s in enumerate(shards)),
            corpus=self.of_type(data.get("corpus", {}), dict, "corpus"),
            build=self.of_type(data.get("build", {}), dict, "build"),
        )
        for total in ("num_tokens", "num_documents"):
            if total in data:
                self.equal(data[total], getattr(manifest, total), total, "the sum over the shards")
        return manifest

    def tokenizer(self, value: object) -> TokenizerEntry:
        data = self.obj(value, "tokenizer", ("name", "fingerprint", "vocab_size"))
        return TokenizerEntry(
            self.of_type(data["name"], str, "tokenizer.name"),
            self.of_type(data["fingerprint"], str, "tokenizer.fingerprint"),
            self.count(data["vocab_size"], "tokenizer.vocab_size", 1, MAX_VOCAB_SIZE),
        )

    def shard(self, i: int, value: object) -> ShardEntry:
        where = f"shards[{i}]"
        data = self.obj(value, where, ("name", "num_tokens", "num_documents", "files"))
        self.equal(data["name"], shard_name(i), f"{where}.name", f"shard {i}'s name")
        num_documents = self.count(data["num_documents"], f"{where}.num_documents", 1)
        # the writer skips empty documents: every document has a token
        num_tokens = self.count(data["num_tokens"], f"{where}.num_tokens", num_documents)
        files = self.obj(data["files"], f"{where}.files", ROLES)
        return ShardEntry(
            shard_name(i),
            num_tokens,
            num_documents,
            {role: self.file(files[role], i, role, f"{where}.files.{role}") for role in ROLES},
        )

    def file(self, value: object, shard: int, role: str, where: str) -> FileEntry:
        data = self.obj(value, where, ("name", "bytes", "sha256", "spot_sha256"))
        # only the canonical name: never a path, '..', an absolute name or another index's file
        self.equal(data["name"], shard_file(shard, role), f"{where}.name", "the canonical file name")
        for digest in ("sha256", "spot_sha256"):
            if not _SHA256.fullmatch(self.of_type(data[digest], str, f"{where}.{digest}")):
                raise self.fail(f"{where}.{digest}", "not a sha256 hex digest")
        return FileEntry(data["name"], self.count(data["bytes"], f"{where}.bytes"), data["sha256"], data["spot_sha256"])


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The ``sa`` array of a shard's ``tokens`` (separators included, first and last): the suffix
    array of ``tokens[::-1]`` without the entries whose position has no continuation."""
    sep = separator(tokens.dtype)
    full = pydivsufsort.divsufsort(np.ascontiguousarray(tokens[::-1]))
    # has_next[i]: tokens[i] and tokens[i + 1] are both real; reversed suffix r starts at i = len-1-r
    has_next = np.zeros(tokens.size, dtype=bool)
    np.logical_and(tokens[:-1] != sep, tokens[1:] != sep, out=has_next[:-1])
    return full[has_next[::-1][full]].astype(sa_dtype(tokens.size), copy=False)


def sa_length(num_tokens: int, num_documents: int) -> int:
    """Entries in a shard's ``sa``: every corpus token except each document's last."""
    return num_tokens - num_documents


# ---- structural check -----------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _scan_tokens(tokens, vocab_size, sep, counts):
    """Return the first position holding neither a token id below ``vocab_size`` nor ``sep``
    (-1: none); ``counts`` = (separators, positions followed by a real token, i.e. with a
    continuation)."""
    separators = 0
    with_next = 0
    for i in range(tokens.shape[0]):
        t = tokens[i]
        if t == sep:
            separators += 1
        elif t >= vocab_size:
            return i
        elif i + 1 < tokens.shape[0] and tokens[i + 1] != sep:
            with_next += 1
    counts[0], counts[1] = separators, with_next
    return -1


@numba.njit(nogil=True, cache=True)
def _scan_sa(tokens, sa, sep, seen):
    """Return (rank, problem) of the first bad suffix-array entry, problem 0 when all are sound:
    1 not a position with a continuation, 2 a position seen before, 3 out of order by its first
    two tokens. ``seen`` is a zeroed bitmap of len(tokens) bits."""
    n = tokens.shape[0]
    prev_first, prev_second = -1, -1
    for rank in range(sa.shape[0]):
        r = sa[rank]
        i = n - 1 - r  # reversed suffix r starts at tokens[i] and reads tokens[i - 1] next
        if r < 0 or r >= n or i < 1 or i + 1 >= n or tokens[i] == sep or tokens[i + 1] == sep:
            return rank, 1
        if seen[r >> 3] & (1 << (r & 7)):
            return rank, 2
        seen[r >> 3] |= 1 << (r & 7)
        first, second = np.int64(tokens[i]), np.int64(tokens[i - 1])
        if first < prev_first or (first == prev_first and second < prev_second):
            return rank, 3
        prev_first, prev_second = first, second
    return -1, 0


def shard_problem(tokens: np.ndarray, sa: np.ndarray, vocab_size: int, num_documents: int) -> tuple[str, str] | None:
    """The first structural fault of one shard's arrays as (role of the bad file, problem), None
    if sound; O(len) time and len/8 bytes. Sound means: the token array starts and ends with the
    separator, holds ids below ``vocab_size`` and ``num_documents + 1`` separators; the suffix
    array is a permutation of the positions that have a continuation, ordered by their first two
    reversed tokens (a partial sortedness check)."""
    sep = separator(tokens.dtype)
    for end in (0, tokens.shape[0] - 1):
        if tokens[end] != sep:
            return "tokens", f"token {end} = {tokens[end]} is not the separator {sep}"
    counts = np.zeros(2, dtype=np.int64)
    bad = _scan_tokens(tokens, vocab_size, tokens.dtype.type(sep), counts)
    if bad >= 0:
        return "tokens", (
            f"token {bad} = {tokens[bad]} is outside the vocabulary [0, {vocab_size}) and not the separator {sep}"
        )
    separators, with_next = counts.tolist()
    if separators != num_documents + 1:
        return "tokens", f"{separators} separators, expected {num_documents + 1} for {num_documents} documents"
    if with_next != sa.shape[0]:
        return "sa", f"{sa.shape[0]} suffix-array entries for {with_next} positions with a continuation"
    rank, problem = _scan_sa(tokens, sa, tokens.dtype.type(sep), np.zeros((tokens.shape[0] >> 3) + 1, np.uint8))
    if not problem:
        return None
    what = {
        1: f"is not a position (of {tokens.shape[0]} tokens) that has a continuation",
        2: "repeats an earlier entry's position",
        3: f"is out of order after entry {rank - 1} = {sa[rank - 1]}",
    }[problem]
    return "sa", f"suffix-array entry {rank} = {sa[rank]} {what}"


def check_shard(directory: Path, shard: ShardEntry, tokens: np.ndarray, sa: np.ndarray, vocab_size: int) -> None:
    """``shard_problem`` for a shard's arrays as ``open_shard`` maps them (lengths checked);
    raises ``IndexCorruptError`` naming the bad file."""
    found = shard_problem(tokens, sa, vocab_size, shard.num_documents)
    if found:
        role, problem = found
        raise IndexCorruptError(f"index file {directory / shard.files[role].name} is corrupt: {problem}")


# ---- writing ----------------------------------------------------------------------------------


def write_shard(
    directory: Path, shard: int, tokens: np.ndarray, sa: np.ndarray, *, vocab_size: int | None = None
) -> ShardEntry:
    """Write one shard's arrays, fsync them, check the files as read back from disk (a bad write
    is caught before the index is published) and describe them for the manifest.

    tokens      [len] token dtype, documents between separators
    sa          ``suffix_array(tokens)``
    vocab_size  ids the tokens must stay below (None: any id but the separator)
    """
    for role, array in (("tokens", tokens), ("sa", sa)):
        with open(directory / shard_file(shard, role), "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
    n_docs = int(np.count_nonzero(tokens == separator(tokens.dtype))) - 1
    entry = ShardEntry(
        shard_name(shard),
        int(tokens.shape[0] - n_docs - 1),
        n_docs,
        {role: FileEntry.of(directory / shard_file(shard, role)) for role in ROLES},
    )
    on_disk = _map_shard(directory, entry, tokens.dtype)
    check_shard(directory, entry, *on_disk, separator(tokens.dtype) if vocab_size is None else vocab_size)
    return entry


def write_manifest(directory: Path, manifest: Manifest) -> None:
    path = directory / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def fsync_directory(path: Path) -> None:
    """Make the names created, renamed or cut in the directory ``path`` durable (its files' own
    contents need their own fsync). Raises ``OSError``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading ----------------------------------------------------------------------------------


def _regular_file(directory: Path, name: str) -> Path:
    """``directory / name``, refused unless it is a regular file (a FIFO would block the read,
    a device never ends) that stays inside ``directory`` when symlinks are resolved."""
    path = directory / name
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise IndexFormatError(f"index file missing: {path}") from None
    except OSError as exc:  # a symlink loop, a name too long, no permission
        raise IndexFormatError(f"index file {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise IndexFormatError(f"index file {path} is not a regular file")
    if not path.resolve().is_relative_to(directory.resolve()):
        raise IndexFormatError(f"index file {path} is a link to {path.resolve()}, outside the index directory")
    return path


def read_manifest(directory: Path) -> Manifest:
    """The checked manifest of the index at ``directory``; raises ``IndexFormatError``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise IndexFormatError(f"index directory not found: {directory}")
    if not (directory / MANIFEST).exists():
        raise IndexFormatError(f"{directory} is not an index: {MANIFEST} is missing")
    path = _regular_file(directory, MANIFEST)
    with open(path, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise IndexFormatError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes; not a manifest we wrote")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IndexFormatError(f"{path}: not UTF-8 text: {exc}") from None
    return Manifest.from_json(text, str(path))


def _npy_header(f) -> dict:
    """The header of the ``.npy`` file open in ``f``, left at the data's start; ``ValueError``
    unless it is a dict of exactly what ``np.save`` writes. numpy's own reader is not used: on
    damaged bytes it can raise nearly anything (its Python 2 fallback raises ``TokenError``)."""
    magic = f.read(8)
    if magic not in _NPY_LENGTH_FIELDS:
        raise ValueError(f"not a .npy file of format 1.0 or 2.0 (it starts with {_short(magic)})")
    length_format = _NPY_LENGTH_FIELDS[magic]
    length_field = f.read(struct.calcsize(length_format))
    if len(length_field) != struct.calcsize(length_format):
        raise ValueError("the file ends inside the header")
    (length,) = struct.unpack(length_format, length_field)
    if length > _NPY_MAX_HEADER:
        raise ValueError(f"a header of {length} bytes is longer than np.save writes")
    text = f.read(length)
    if b"\\" in text:  # np.save writes none; Python would warn of an invalid escape before refusing it
        raise ValueError("the header holds a backslash, which np.save never writes")
    try:
        header = ast.literal_eval(text.decode("latin-1"))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"the header is not a Python literal ({type(exc).__name__})") from None
    if type(header) is not dict or set(header) != {"descr", "fortran_order", "shape"}:
        raise ValueError(f"the header {_short(header)} is not a dict of descr, fortran_order and shape")
    return header


def _map_array(path: Path, dtype: np.dtype, length: int) -> np.ndarray:
    """Memory-map the 1-D ``.npy`` array at ``path`` after checking its header holds exactly
    ``dtype[length]`` and the file is exactly that header plus that data."""
    with open(path, "rb") as f:
        try:
            header = _npy_header(f)
        except ValueError as exc:
            raise IndexFormatError(f"index file {path} is not a valid .npy array: {exc}") from None
        offset = f.tell()
    if header != {"descr": dtype.str, "fortran_order": False, "shape": (length,)}:
        raise IndexFormatError(
            f"index file {path} holds {_short(header['descr'])} {_short(header['shape'])} (fortran_order="
            f"{_short(header['fortran_order'])}), the manifest describes '{dtype.str}' ({length},)"
        )
    size = path.stat().st_size
    if size != offset + length * dtype.itemsize:
        raise IndexFormatError(
            f"index file {path} has {size} bytes, its header describes {offset + length * dtype.itemsize}"
        )
    # a plain ndarray view of the memory map: np.memmap's subclass hooks cost more than the search
    return np.asarray(np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(length,)))


def _map_shard(directory: Path, shard: ShardEntry, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    return (
        _map_array(directory / shard.files["tokens"].name, dtype, shard.array_len),
        _map_array(
            directory / shard.files["sa"].name,
            sa_dtype(shard.array_len),
            sa_length(shard.num_tokens, shard.num_documents),
        ),
    )


def open_shard(
    directory: Path, shard: ShardEntry, manifest: Manifest, full_check: bool = False, check: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map one shard's (tokens, sa), checking file types, sizes, digests, headers and
    lengths in O(1). ``full_check`` hashes whole files (slow for big indexes; otherwise only the
    spot digest), ``check`` runs ``check_shard`` (O(n)). Raises ``IndexFormatError``."""
    for role in ROLES:
        entry = shard.files[role]
        path = _regular_file(directory, entry.name)
        if path.stat().st_size != entry.bytes:
            raise IndexFormatError(f"index file {path} has {path.stat().st_size} bytes, manifest says {entry.bytes}")
        digest_ok = (file_digest(path) == entry.sha256) if full_check else (spot_digest(path) == entry.spot_sha256)
        if not digest_ok:
            raise IndexCorruptError(f"index file {path} is corrupt (sha256 mismatch)")
    tokens, sa = _map_shard(directory, shard, np.dtype(manifest.token_dtype))
    if check:
        check_shard(directory, shard, tokens, sa, manifest.tokenizer.vocab_size)
    return tokens, sa
