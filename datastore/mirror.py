"""A fleet's store of outputs, copied into this process, so that drafting from it costs no call.

A fleet's replicas share one ``rest-datastore serve`` store of outputs: each sends what it
generated there (AddOutput), and each drafts from what all of them generated. Asking the server
for the store's tree on every decoding step puts a round trip (and, on a busy host, a wait for
the server's threads) on the step; an index opened in the worker puts none. ``OutputsMirror``
keeps a copy of the store in the replica: a background thread reads what was stored since its
last read (ReadOutputs) every ``interval`` seconds into an in-memory ``OutputStore``, which the
replica drafts from as it drafts from its index. An output this replica adds goes to the server
and into the copy at once; the other replicas' reach it within ``interval``.

The copy is a cache: a server that stops answering leaves it as it was (drafting goes on from it,
and reading resumes where it stopped once the server answers); a server that restarted without
``--outputs-dir`` counts afresh and is read again from its start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.datastore.client import DatastoreClient
from rest_spec.datastore.outputs import DEFAULT_OUTPUTS_MAX_TOKENS, OutputStore

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 0.5  # seconds between reads: another replica's output is drafted from this late at most
MAX_PAGES = 64  # replies one ``sync`` reads at most (256 MB at the default reply limit): the rest wait for the next
ADD_TIMEOUT = 1.0  # seconds an AddOutput may take (it runs off the engine's step, see drafter.core.uploads)


class OutputsMirror:
    """An ``OutputStore``'s ``draft`` / ``add`` / ``close`` over a copy of the store of the server
    at ``address``, kept up to date by a background thread (see the module docstring).

    ``vocab_size``: the model's (outputs outside it are refused as a hostile server's);
    ``max_tokens``: the copy's size (the oldest whole outputs are evicted past it, as the server
    evicts); ``expected_fingerprint``: the tokenizer the server's index must have been built with
    (``TokenizerMismatchError`` otherwise). The first read runs here: an unreachable server
    (``ConnectionError``) or one that keeps no outputs (``NoOutputStoreError``) fails now."""

    def __init__(
        self,
        address: str,
        *,
        vocab_size: int,
        max_tokens: int = DEFAULT_OUTPUTS_MAX_TOKENS,
        interval: float = DEFAULT_INTERVAL,
        expected_fingerprint: str | None = None,
        tls_ca: str | None = None,
        auth_token: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.address, self.interval = address, interval
        self.client = DatastoreClient(
            address, timeout=timeout, expected_fingerprint=expected_fingerprint, tls_ca=tls_ca, auth_token=auth_token
        )
        self.store = OutputStore(max_tokens, vocab_size=vocab_size)
        self._lock = threading.Lock()  # orders this replica's adds against the reads
        self._next_seq = 0  # the server's number to read from next
        self._own: set[int] = set()  # numbers this replica added (and copied) not yet read back
        self._failing = False
        self._stop = threading.Event()
        try:
            self.copied = self.sync()
        except BaseException:
            self.client.close()
            raise
        self._thread = threading.Thread(target=self._run, name="rest-outputs-mirror", daemon=True)
        self._thread.start()

    @property
    def max_tokens(self) -> int:
        return self.store.max_tokens

    @property
    def num_tokens(self) -> int:
        return self.store.num_tokens

    def __len__(self) -> int:
        return len(self.store)

    def sync(self) -> int:
        """Copy what the server stored since the last read, reading until it has no more (or
        ``MAX_PAGES`` replies: a server that keeps answering one more page, whatever it says,
        never holds a reader here for good); returns the outputs copied. Errors as
        ``DatastoreClient.read_outputs`` raises them."""
        copied = 0
        for _ in range(MAX_PAGES):
            start = self._next_seq
            documents, next_seq, end_seq = self.client.read_outputs(start, self.store.vocab_size)
            if end_seq < start:  # the server counts afresh: everything it holds is new to us
                log.info("the store of outputs at %s restarted: reading it again from its start", self.address)
                with self._lock:
                    self._next_seq = 0
                    self._own.clear()
                continue
            with self._lock:
                for seq, tokens in documents:
                    if seq in self._own:
                        self._own.discard(seq)
                    elif tokens.size <= self.store.max_tokens:
                        self.store.add(tokens)
                        copied += 1
                self._next_seq = next_seq  # not behind ``start``: the reply was checked (wire.outputs_from_reply)
                if self._own:  # numbers read past (the server evicted them first) never come back
                    self._own = {seq for seq in self._own if seq >= self._next_seq}
            if not documents or next_seq >= end_seq:  # a reply without outputs comes only at the end
                return copied
        return copied

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.copied += self.sync()
            except (OSError, RuntimeError, ValueError) as exc:  # a cache: draft from what is here
                if not self._failing:
                    log.warning(
                        "cannot read the store of outputs at %s (drafting from the copy): %s", self.address, exc
                    )
                self._failing = True
            else:
                if self._failing:
                    log.info("reading the store of outputs at %s again", self.address)
                self._failing = False

    def draft(self, context: Sequence[int] | np.ndarray, config: DraftConfig = DraftConfig()) -> DraftTree:
        """The copy's tree for ``context`` (``OutputStore.draft``): no call to the server."""
        return self.store.draft(context, config)

    def draft_batch(
        self, contexts: Sequence[Sequence[int] | np.ndarray], config: DraftConfig = DraftConfig()
    ) -> list[DraftTree]:
        """``draft`` of every context in one pass (``OutputStore.draft_batch``)."""
        return self.store.draft_batch(contexts, config)

    def draft_queries(self, queries: np.ndarray, lengths: np.ndarray, config: DraftConfig) -> list[DraftTree]:
        """``OutputStore.draft_queries`` of the copy."""
        return self.store.draft_queries(queries, lengths, config)

    def read(self, from_seq: int, max_tokens: int) -> tuple[list[tuple[int, np.ndarray]], int, int]:
        """``OutputStore.read`` of the copy (numbered in the order copied, not the server's)."""
        return self.store.read(from_seq, max_tokens)

    def add(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Store ``tokens`` on the server (so every replica drafts from them) and in the copy at
        once; returns the server's sequence number. Errors as ``DatastoreClient.add_output``."""
        with self._lock:
            seq = self.client.add_output(tokens, timeout=min(self.client.timeout, ADD_TIMEOUT))
            if seq >= self._next_seq:  # not read back yet: copy it now, skip it when read
                self.store.add(tokens)
                self._own.add(seq)
        return seq

    def close(self) -> None:
        """Stop reading, then close the connection and the copy."""
        self._stop.set()
        self._thread.join()
        self.client.close()
        self.store.close()

    def __enter__(self) -> OutputsMirror:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
