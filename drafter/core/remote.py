"""The remote draft source: the datastore service's gRPC client, with a circuit breaker.

``RemoteDrafter("127.0.0.1:50051")`` returns the same trees as ``LocalDrafter.open(index)`` on the
same index (and, from ``draft_sources``, the same output-store trees once both were given the same
outputs); ``RemoteDrafter(address, tls_ca="ca.pem", auth_token=...)`` reaches a server started
with ``--tls-cert``/``--auth-token``. See ``datastore.client.DatastoreClient`` for timeouts and errors.

Its ``breaker`` (``drafter.core.breaker.CircuitBreaker``) outlives generations: the decoding loop
(``drafter.core.scheduler.DraftScheduler``) stops asking a datastore that failed a few calls in a row and probes
it until it answers again, and the outputs added after each prompt are not sent while it is open.
"""

from __future__ import annotations

from collections.abc import Sequence

from rest_spec.common.types import SourceTrees
from rest_spec.datastore.client import DatastoreClient
from rest_spec.drafter.core.breaker import CircuitBreaker
from rest_spec.drafter.core.protocol import Pending
from rest_spec.drafter.core.steps import DraftSource

__all__ = ["ADD_OUTPUT_TIMEOUT", "RemoteDrafter"]

# Seconds an output may take to be stored: an append of one generation takes milliseconds (fsync
# included), and a datastore that froze in a prompt's last steps must not hold up the next prompt
# for the client's whole timeout.
ADD_OUTPUT_TIMEOUT = 1.0


class RemoteDrafter(DatastoreClient, DraftSource):
    """A ``DatastoreClient`` (same arguments) whose ``breaker`` the decoding loop shares across
    generations, and whose batches are RPCs started at once."""

    reads_suffixes = True

    def __init__(self, address: str, **kwargs) -> None:
        super().__init__(address, **kwargs)
        self.breaker = CircuitBreaker(f"datastore at {address}")

    def start_sources(self, contexts, config, *, outputs=False, timeout=None) -> Pending[list[SourceTrees]]:
        """One ``DraftBatch`` RPC in flight (``DatastoreClient.draft_batch_future``)."""
        return self.draft_batch_future(contexts, config, include_outputs=outputs, timeout=timeout)

    def add_output(self, tokens: Sequence[int]) -> int:
        """``DatastoreClient.add_output``, waiting at most ``ADD_OUTPUT_TIMEOUT`` (or the client's
        timeout, if shorter); while the breaker is open, ``ConnectionError`` at once, nothing sent."""
        if not self.breaker.closed:
            raise ConnectionError(f"{self.breaker.name} is not answering: output not sent")
        return super().add_output(tokens, timeout=min(self.timeout, ADD_OUTPUT_TIMEOUT))
