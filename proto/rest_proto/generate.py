"""Regenerate the committed Python code for the .proto contract: ``python -m rest_proto.generate``.

protoc runs with ``-I proto`` so the generated modules import each other as ``rest_proto.v1...``
(never ``proto``, the import name of proto-plus). Pass an output directory to generate elsewhere,
e.g. to check that the committed files are up to date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent  # the directory holding rest_proto/
PROTOS = ("rest_proto/v1/datastore.proto",)


def generate(out_dir: str | Path = PROTO_ROOT) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto under ``out_dir``;
    returns the written paths. Raises ``RuntimeError`` when protoc fails."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    out = Path(out_dir)
    for proto in PROTOS:
        (out / proto).parent.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    stems = [proto.removesuffix(".proto") for proto in PROTOS]
    return [out / f"{stem}{suffix}" for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rest_proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=PROTO_ROOT, help="output root (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        for path in generate(args.out_dir):
            print(path)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
