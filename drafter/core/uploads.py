"""Finished outputs on their way to the store of outputs, off the engine's step.

An engine tells of a finished request on its step (vLLM's runner hook), and a store's disk write
(an ``outputs_dir``'s fsync) or an RPC to a fleet's datastore must not run there. ``OutputUploader``
hands each output to one background thread with at most ``max_pending`` waiting; past that an
output is dropped and counted. The store is a cache of past outputs: a lost one costs some drafts,
never an output, and a slow or dead datastore cannot grow the engine's memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rest_spec.common.errors import NoOutputStoreError
from rest_spec.drafter.core.protocol import SourceDrafter

log = logging.getLogger(__name__)

MAX_PENDING_OUTPUTS = 64


@dataclass
class UploadStats:
    """Outputs stored (``outputs_added``), refused by the store (``outputs_failed``: a failed call, a
    full disk) and dropped unsent, the queue full (``outputs_dropped``)."""

    outputs_added: int = 0
    outputs_failed: int = 0
    outputs_dropped: int = 0


class OutputUploader:
    """Stores outputs in ``store`` from a background thread, counting into ``stats``; thread-safe."""

    def __init__(
        self, store: SourceDrafter, stats: UploadStats | None = None, max_pending: int = MAX_PENDING_OUTPUTS
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.store, self.stats = store, stats if stats is not None else UploadStats()
        self._slots = threading.BoundedSemaphore(max_pending)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rest-outputs")

    def submit(self, tokens: Sequence[int]) -> bool:
        """Queue ``tokens`` for the store and return at once: False when the queue was full and they
        were dropped."""
        if not self._slots.acquire(blocking=False):
            self.stats.outputs_dropped += 1
            if self.stats.outputs_dropped == 1 or self.stats.outputs_dropped % 100 == 0:
                log.warning("outputs dropped, the store of outputs not keeping up: %d", self.stats.outputs_dropped)
            return False
        try:
            self._thread.submit(self._add, list(tokens))
        except RuntimeError:  # closed
            self._slots.release()
            self.stats.outputs_dropped += 1
            return False
        return True

    def _add(self, tokens: list[int]) -> None:
        try:
            self.store.add_output(tokens)
            self.stats.outputs_added += 1
        except NoOutputStoreError as exc:
            log.debug("output not stored: %s", exc)
        except (RuntimeError, OSError, ValueError) as exc:
            self.stats.outputs_failed += 1
            log.warning("output not stored: %s", exc)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Store what is queued, then stop the thread."""
        self._thread.shutdown(wait=True)
