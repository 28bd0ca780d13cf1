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
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pydivsufsort

FORMAT_NAME = "rest-index"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
ROLES = ("tokens", "sa")
_SPOT_BYTES = 1 << 16


class IndexFormatError(ValueError):
    """An index directory is missing, incomplete, corrupt or of another format version."""


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


def shard_file(shard: int, role: str) -> str:
    return f"shard-{shard:05d}.{role}.npy"


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
    def of(cls, path: Path) -> "FileEntry":
        return cls(path.name, path.stat().st_size, file_digest(path), spot_digest(path))


@dataclass(frozen=True)
class ShardEntry:
    name: str
    num_tokens: int  # corpus tokens, separators excluded
    num_documents: int
    files: dict[str, FileEntry]


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
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        if data.get("format") != FORMAT_NAME:
            raise IndexFormatError(f"not a {FORMAT_NAME} manifest (format={data.get('format')!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise IndexFormatError(
                f"index format version {data.get('format_version')} is not supported "
                f"(this build reads version {FORMAT_VERSION}); rebuild the index with build_index"
            )
        shards = tuple(
            ShardEntry(
                s["name"],
                int(s["num_tokens"]),
                int(s["num_documents"]),
                {role: FileEntry(**s["files"][role]) for role in ROLES},
            )
            for s in data["shards"]
        )
        return cls(
            tokenizer=TokenizerEntry(**data["tokenizer"]),
            token_dtype=data["token_dtype"],
            separator=int(data["separator"]),
            shards=shards,
            corpus=data.get("corpus", {}),
            build=data.get("build", {}),
        )


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


def write_shard(directory: Path, shard: int, tokens: np.ndarray, sa: np.ndarray) -> ShardEntry:
    """Write one shard's arrays, fsync them and describe them for the manifest.

    tokens      [len] token dtype, documents between separators
    sa          ``suffix_array(tokens)``
    """
    entries = {}
    for role, array in (("tokens", tokens), ("sa", sa)):
        path = directory / shard_file(shard, role)
        with open(path, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        entries[role] = FileEntry.of(path)
    n_docs = int(np.count_nonzero(tokens == separator(tokens.dtype))) - 1
    return ShardEntry(f"shard-{shard:05d}", int(tokens.shape[0] - n_docs - 1), n_docs, entries)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    path = directory / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise IndexFormatError(f"index directory not found: {directory}")
    if not path.is_file():
        raise IndexFormatError(f"{directory} is not an index: {MANIFEST} is missing")
    try:
        return Manifest.from_json(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise IndexFormatError(f"corrupt manifest {path}: {exc}") from exc


def _load(path: Path, entry: FileEntry, dtype: np.dtype | None, length: int | None, full_check: bool) -> np.ndarray:
    if not path.is_file():
        raise IndexFormatError(f"index file missing: {path}")
    if path.stat().st_size != entry.bytes:
        raise IndexFormatError(f"index file {path} has {path.stat().st_size} bytes, manifest says {entry.bytes}")
    digest_ok = (file_digest(path) == entry.sha256) if full_check else (spot_digest(path) == entry.spot_sha256)
    if not digest_ok:
        raise IndexFormatError(f"index file {path} is corrupt (sha256 mismatch)")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise IndexFormatError(f"index file {path} is not a valid .npy array: {exc}") from exc
    if array.ndim != 1 or (dtype is not None and array.dtype != dtype) or (length is not None and array.shape[0] != length):
        raise IndexFormatError(f"index file {path} holds {array.dtype}{list(array.shape)}, which the manifest does not describe")
    return array


def open_shard(directory: Path, shard: ShardEntry, manifest: Manifest, full_check: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map one shard's (tokens, sa), checking sizes, digests, dtypes and lengths.

    ``full_check`` hashes whole files (slow for big indexes); otherwise only the spot digest."""
    files = shard.files
    length = shard.num_tokens + shard.num_documents + 1
    tokens = _load(directory / files["tokens"].name, files["tokens"], np.dtype(manifest.token_dtype), length, full_check)
    sa = _load(directory / files["sa"].name, files["sa"], sa_dtype(length), sa_length(shard.num_tokens, shard.num_documents), full_check)
    return tokens, sa
