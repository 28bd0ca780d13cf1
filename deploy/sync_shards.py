"""Copy the files of some shards of an index to a shard server's local disk.

    python sync_shards.py --source /index-source/index --dest /data/index --shards 4-5

The init container of every shard-server pod runs this (deploy/k8s/shard-server.yaml): ``--source``
is the whole published index as any volume mounts it (NFS, a bucket mount, a read-only volume),
``--dest`` the pod's own disk, where the server (``rest-datastore serve --shards``, given the same
spec) memory-maps the shard files. The source's manifest is
checked field by field before anything is copied; each file is copied to a temporary name, checked
against the manifest's size and spot digest, and renamed into place, and the manifest is written
last, so a server never starts from a half-copied index. A file already at ``--dest`` with the
manifest's size and spot digest is kept: a restarted pod copies only what changed (a new index
replaces every file). Exit status 0 done, 2 usage error, 1 failure (a bad or unreadable source, a
range outside the index, a copy that does not match the manifest, a full disk).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import stat
import sys
from pathlib import Path

from rest_spec.common.cli import exit_statuses, run_command, setup_logging
from rest_spec.datastore.format import MANIFEST, FileEntry, Manifest, fsync_directory, read_manifest, spot_digest
from rest_spec.datastore.index import check_shard_numbers
from rest_spec.datastore.shards import parse_shard_spec

log = logging.getLogger("sync_shards")


def _matches(path: Path, entry: FileEntry) -> bool:
    """Whether ``path`` is a regular file with the manifest entry's size and spot digest."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == entry.bytes and spot_digest(path) == entry.spot_sha256


def _copy(source: Path, dest: Path, entry: FileEntry) -> None:
    """Copy ``source`` to ``dest`` through a temporary file, durable and checked before the rename."""
    if not stat.S_ISREG(source.stat().st_mode):  # a FIFO or a device would block or never end
        raise ValueError(f"{source} is not a regular file")
    part = dest.with_name(f".{dest.name}.part")
    try:
        shutil.copyfile(source, part)
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        if not _matches(part, entry):
            raise ValueError(
                f"{source} does not match the manifest (size or spot digest): a damaged or changing source"
            )
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)


def _publish_manifest(dest: Path, manifest: Manifest) -> None:
    """Write ``manifest`` (as checked) to ``dest``, atomically and durably."""
    part = dest / f".{MANIFEST}.part"
    part.write_text(manifest.to_json(), encoding="utf-8")
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    part.replace(dest / MANIFEST)
    fsync_directory(dest)


def sync_shards(source: Path, dest: Path, shards: list[int]) -> tuple[int, int]:
    """Make ``dest`` hold the manifest of ``source`` and the files of the shards numbered
    ``shards``; returns (files copied, files already in place). Raises ``IndexFormatError`` or
    ``ValueError`` for a bad source or shard numbers, ``OSError`` for I/O."""
    manifest = read_manifest(source)
    try:
        numbers = check_shard_numbers(shards, len(manifest.shards))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    dest.mkdir(parents=True, exist_ok=True)
    copied = kept = 0
    for number in numbers:
        for entry in manifest.shards[number].files.values():
            if _matches(dest / entry.name, entry):
                kept += 1
                continue
            if not copied:  # until every file is in place, dest is no index: a server refuses it
                (dest / MANIFEST).unlink(missing_ok=True)
            log.info("copying %s (%d bytes)", entry.name, entry.bytes)
            _copy(source / entry.name, dest / entry.name, entry)
            copied += 1
    _publish_manifest(dest, manifest)
    return copied, kept


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sync_shards",
        description="Copy a range of an index's shards (and its manifest) to local disk for a shard server.",
        epilog=exit_statuses(["bad source", "range outside the index", "I/O error"]),
    )
    p.add_argument("--source", type=Path, required=True, help="the whole index, as mounted (read only)")
    p.add_argument("--dest", type=Path, required=True, help="the local index directory the shard server opens")
    p.add_argument(
        "--shards", type=_spec, required=True, metavar="SPEC", help="manifest shard numbers, e.g. 0-3,7 (as serve's)"
    )
    return p


def _spec(text: str) -> list[int]:
    try:
        return parse_shard_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(logging.INFO)

    def body() -> None:
        copied, kept = sync_shards(args.source, args.dest, args.shards)
        log.info("%d shards in %s: %d files copied, %d already in place", len(args.shards), args.dest, copied, kept)

    return run_command("sync_shards", body, failures=(OSError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
