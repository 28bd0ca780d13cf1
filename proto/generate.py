"""Regenerate the committed Python code for the .proto contracts: ``python -m rest_spec.proto.generate``.

protoc names generated modules after the .proto's path under its include root, so each contract is
staged as ``rest_spec/proto/v1/<name>.proto`` in a temporary root: the generated modules then
import each other as ``rest_spec.proto.v1...``, the name they are installed under (never a bare
``proto``, the import name of proto-plus). Pass an output directory to write the generated files
elsewhere, e.g. to check that the committed ones are up to date.

The generated ``*_pb2_grpc.py`` refuses to import under a grpcio older than the one it names
(``GRPC_GENERATED_VERSION``), which protoc sets to its grpcio-tools' own version: it is set to the
oldest grpcio ``pyproject.toml`` admits instead (``GRPC_FLOOR``), so that the code imports on that
floor (CI tests it) and is the same whichever grpcio-tools at or above the floor writes it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent  # this folder: rest_spec.proto
PACKAGE = Path("rest_spec/proto")  # where protoc must see the contract to name the modules right
PROTOS = ("v1/datastore.proto", "v1/shard.proto")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
GRPC_FLOOR = "1.85.1"  # pyproject.toml's grpcio>=X (a test checks they agree)
GENERATED_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M)


def generate(out_dir: str | Path = PROTO_DIR) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` of every proto under ``out_dir``
    (laid out as this folder is); returns the written paths. Raises ``RuntimeError`` when protoc
    fails or grpcio-tools is missing."""
    try:
        from grpc_tools import protoc  # a dev dependency: only needed to regenerate
    except ImportError:
        raise RuntimeError("grpcio-tools is not installed: pip install 'rest-spec[dev]' (or grpcio-tools)") from None

    out, written = Path(out_dir), []
    with tempfile.TemporaryDirectory() as staging:
        root = Path(staging)
        for proto in PROTOS:
            (root / PACKAGE / proto).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PROTO_DIR / proto, root / PACKAGE / proto)
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            *(str(PACKAGE / proto) for proto in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(PROTOS)}")
        for proto in PROTOS:
            stem = proto.removesuffix(".proto")
            for suffix in SUFFIXES:
                target = out / f"{stem}{suffix}"
                target.parent.mkdir(parents=True, exist_ok=True)
                text = (root / PACKAGE / f"{stem}{suffix}").read_text(encoding="utf-8")
                if suffix == "_pb2_grpc.py":
                    text = GENERATED_VERSION.sub(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", text)
                target.write_text(text, encoding="utf-8")
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rest_spec.proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=PROTO_DIR, help="output root (default: %(default)s)")
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
