"""What a drafter learned, kept on disk, so that a restarted or a new replica starts where the last stopped.

``AdaptiveDrafter`` learns online how much its sources' trees and its chains are worth
(``SourceCalibration``, ``ChainCalibration``). A process that starts with none of it prices its
chains by the merged scores alone: in the replayed fleets (``benchmarks.history --restart``) every
replica restarted after 2,000 requests claimed 1.6-2.8x the tokens it got accepted at 16-64
replicas and drafted 3-4 tokens a step where warmed replicas drafted 2.4, and fell behind vLLM's
``suffix`` (0.95x at 64) though its store of outputs had survived the restart. Calibrations are
what serving taught, like the store of outputs, and outlive the process the same way.

``CalibrationMemory`` is one file (``.npz`` of plain arrays, never pickles) per model, tokenizer and
set of sources, under ``$REST_CACHE_DIR/calibration`` (``calibration_path``) or at a path the
engine names (a volume the fleet's hosts share). Replicas save what they learned every
``SAVE_EVERY`` seconds as requests finish and when they close, each writing a whole file of its
own and renaming it into place (the last writer wins: replicas of one fleet learn the same
thing); a new process starts from the newest. A file that is unreadable, of another format or
sources, or holds counts no run could have learned, is a warning and a fresh start: it is a
cache, never a reason not to serve.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rest_spec.common.cache import cache_dir

log = logging.getLogger(__name__)

FORMAT = 1  # of the file: its arrays' names and meaning
SAVE_EVERY = 60.0  # seconds between saves while serving (and one at close)
MAX_BYTES = 64 << 20  # a larger file is not a calibration (this one is ~0.3 MB for 5 sources)


def calibration_path(
    model: str, tokenizer_fingerprint: str, sources: Sequence[str], directory: Path | None = None
) -> Path:
    """Where the calibration of ``model`` drafting from ``sources`` with an index of this tokenizer
    is kept: ``<directory or cache_dir()>/calibration/<model's last name>-<digest>.npz``."""
    digest = hashlib.sha256(json.dumps([FORMAT, model, tokenizer_fingerprint, list(sources)]).encode()).hexdigest()
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(model.rstrip("/")).name)[:64] or "model"
    return (directory or cache_dir()) / "calibration" / f"{name}-{digest[:16]}.npz"


class CalibrationMemory:
    """The calibration file at ``path``: ``load`` what was saved (None where there is nothing
    usable, with a warning naming the file and the problem where it exists), ``save`` atomically."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, np.ndarray] | None:
        """The arrays saved, or None (no file; or a warning: unreadable, too large, another format)."""
        try:
            size = self.path.stat().st_size
            if size > MAX_BYTES:
                raise ValueError(f"{size} bytes, more than a calibration holds")
            with np.load(self.path, allow_pickle=False) as saved:
                arrays = {name: saved[name] for name in saved.files}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            log.warning("calibration %s is unreadable (%s); learning afresh", self.path, exc)
            return None
        version = arrays.pop("format", None)
        if version is None or version.shape != () or int(version) != FORMAT:
            log.warning("calibration %s is of another format; learning afresh", self.path)
            return None
        return arrays

    def save(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Write ``arrays`` in place of what was saved: a whole file of this process's renamed into
        place, so a reader never sees half of one. ``OSError`` where it cannot be written."""
        buffer = io.BytesIO()
        np.savez(buffer, format=np.int64(FORMAT), **arrays)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        try:
            temporary.write_bytes(buffer.getvalue())
            os.replace(temporary, self.path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
