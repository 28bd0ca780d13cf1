"""Fill the download cache of ``build_index --corpus pypi`` ahead of a build, and measure it.

    python -m rest_spec.build_index.fetch_pypi --packages 2000 [--cache-dir DIR] [--download-jobs N]

Reads the corpus as a build would (the same downloads, archives and filters; no tokenizer) and
prints one JSON object: the packages fetched and skipped, the archives' size, and the files and
bytes of Python a build would index, with the files dropped by reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time

from rest_spec.build_index.corpora import open_corpus
from rest_spec.build_index.corpus import CorpusError, CorpusSpec
from rest_spec.build_index.pypi import DEFAULT_DOWNLOAD_JOBS


def measure(spec: CorpusSpec) -> dict:
    """Read every record of the pypi corpus ``spec``; its provenance, less the package list, with
    the totals."""
    start = time.perf_counter()
    corpus = open_corpus(spec)
    files = size = 0
    for record in corpus.records():
        files += 1
        size += len(record.turns[0].text.encode("utf-8"))
    provenance = corpus.provenance()
    packages = provenance.pop("packages")
    archives = sum((corpus.cache_root / "archives" / p["archive"]).stat().st_size for p in packages)
    return {
        "packages_requested": provenance["requested"],
        "packages_fetched": len(packages),
        "packages_indexed": provenance["packages_indexed"],
        "packages_skipped": {why: len(items) for why, items in provenance["packages_skipped"].items()},
        "archives_mb": round(archives / 1e6, 1),
        "files": files,
        "python_mb": round(size / 1e6, 1),
        "dropped": provenance["dropped"],
        "seconds": round(time.perf_counter() - start, 1),
        "cache": provenance["cache"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rest_spec.build_index.fetch_pypi", description=__doc__.split("\n\n")[0])
    p.add_argument("--packages", metavar="N|FILE", help="as build_index --packages (default: the whole list)")
    p.add_argument("--exclude-packages", default="", metavar="NAME,...")
    p.add_argument("--pip-args", default="", metavar="ARGS")
    p.add_argument("--cache-dir", metavar="DIR")
    p.add_argument("--download-jobs", type=int, default=DEFAULT_DOWNLOAD_JOBS, metavar="N")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    spec = CorpusSpec(
        "pypi",
        packages=args.packages,
        exclude_packages=tuple(n.strip() for n in args.exclude_packages.split(",") if n.strip()),
        pip_args=tuple(shlex.split(args.pip_args)),
        cache_dir=args.cache_dir,
        download_jobs=args.download_jobs,
    )
    try:
        print(json.dumps(measure(spec)))
    except CorpusError as exc:
        print(f"fetch_pypi: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
