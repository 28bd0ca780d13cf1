"""Batch tokenization with the fast (Rust) tokenizer, in parallel over worker processes.

The tokenizer is loaded once, by the caller; workers rebuild it from its JSON serialization
(``backend_tokenizer.to_str()``), which is quick and needs neither ``transformers`` nor the model
files. Documents are encoded without special tokens (the index separates documents itself) and
come back in input order as ``uint32`` arrays, whatever the number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import chain, islice

import numpy as np
from tokenizers import Tokenizer

from rest_spec.common.signals import stop_signals_deferred

DEFAULT_BATCH_SIZE = 64
# How long a stopped build waits for the worker pool's manager thread to end by itself (see `_terminate`).
_MANAGER_GRACE_S = 2.0


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class TokenizeConfig:
    workers: int = 1  # 1 = encode in this process
    batch_size: int = DEFAULT_BATCH_SIZE  # documents per batch sent to a worker

    def __post_init__(self) -> None:
        if self.workers < 1 or self.batch_size < 1:
            raise ValueError(f"workers and batch_size must be positive, got {self.workers} and {self.batch_size}")


def backend_json(tokenizer) -> str:
    """The Rust tokenizer's JSON, from a ``transformers`` fast tokenizer or a ``tokenizers.Tokenizer``."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer).to_str()


def rebuild_tokenizer(tokenizer_json: str) -> Tokenizer:
    """The Rust tokenizer from ``backend_json``, set to encode documents whole (in a worker process,
    here or on a Ray node)."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    # A serialized tokenizer may carry the padding/truncation a caller last used; documents are
    # encoded whole and unpadded.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """One batch -> (all ids concatenated, uint32; per-document lengths, int64): two arrays
    pickle far faster than one list per document."""
    ids = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


# Set by the pool initializer in each worker process only; the parent never reads it.
_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer
    # The pool gives each process one core; Rust threads on top would only contend for it.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # A terminal's Ctrl-C and hang-up reach the whole process group; they are the parent's to
    # handle: it stops the workers and removes the partial index. (SIGTERM stays at its default,
    # which is how the parent stops them, and how anyone can stop a worker left alone.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _worker_tokenizer = rebuild_tokenizer(tokenizer_json)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_worker_tokenizer, texts)


def _terminate(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's workers, whatever they are doing, so that ``shutdown`` does not wait for them.

    The executor has no public way to do this before Python 3.14 (``terminate_workers``), and
    two pipes would then block its threads for ever. A worker killed while sending a result leaves
    half a message in the result pipe, which the pool's manager thread would wait on: the parent's
    end of that pipe is closed, so the manager thread reads end-of-file and shuts the pool down as
    broken, as it does when a worker dies. And a batch larger than a pipe's buffer (64 KiB) that the
    call queue's feeder thread is writing when the workers die is never read to its end, so the
    manager thread's shutdown, which joins the feeder, would hang (a CI run caught a stopped build
    waiting there). CPython releases with the fix for gh-94777 (3.11.7 has it, Debian 12's 3.11.2
    does not) close the parent's reading end of the call queue in that shutdown, so the write fails
    at once; the manager thread then ends. Where it has not ended after ``_MANAGER_GRACE_S``, this
    closes that end itself. Only then: closing it while the manager thread closes it too races on
    one file descriptor (a CI run on 3.11.7 saw ``EBADF``)."""
    processes = list((pool._processes or {}).values())
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()
    pool._result_queue._writer.close()
    manager = pool._executor_manager_thread
    if manager is not None:
        manager.join(_MANAGER_GRACE_S)
        if manager.is_alive() and not pool._call_queue._reader.closed:
            pool._call_queue._reader.close()


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(texts)
    while batch := list(islice(it, size)):
        yield batch


class BatchTokenizer:
    """Encodes a stream of documents in batches, over ``config.workers`` processes.

    Use as a context manager (it owns the worker pool). Workers are spawned, so a script that
    uses more than one needs the usual ``if __name__ == "__main__":`` guard::

        with BatchTokenizer(tokenizer, TokenizeConfig(workers=4)) as encoder:
            for ids in encoder.encode(texts):   # uint32 [len(text's tokens)], in input order
                ...
    """

    def __init__(self, tokenizer, config: TokenizeConfig = TokenizeConfig()) -> None:
        self.config = config
        self._json = backend_json(tokenizer)
        self._pool: ProcessPoolExecutor | None = None
        self._local: Tokenizer | None = None

    def __enter__(self) -> BatchTokenizer:
        if self.config.workers == 1:
            self._local = rebuild_tokenizer(self._json)
        else:
            # spawn, not fork: the parent may hold threads (progress bar, dataset streaming) and
            # Rust thread pools, which a fork would copy in an undefined state. An executor, not
            # multiprocessing.Pool: a worker that dies raises BrokenProcessPool instead of hanging.
            try:
                with stop_signals_deferred():
                    self._pool = ProcessPoolExecutor(
                        self.config.workers,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=_init_worker,
                        initargs=(self._json,),
                    )
                    # Start every worker now (one no-op each; the pool starts a process per submit
                    # while none is idle), with stop signals held: a process stopped halfway through
                    # its start dies with a traceback and leaves a pool that cannot shut down.
                    for _ in range(self.config.workers):
                        self._pool.submit(os.getpid)
            except BaseException as exc:  # a signal held above, delivered now: no `with` body to exit
                self.__exit__(type(exc), exc, exc.__traceback__)
                raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """After an error or a stop signal the results are not wanted: the workers are terminated
        at once instead of finishing their batches."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        if exc_type is not None:
            _terminate(pool)
        pool.shutdown(wait=True, cancel_futures=exc_type is not None)

    def encode(self, texts: Iterable[str]) -> Iterator[np.ndarray]:
        """Token ids of each text, in order."""
        batches = _batches(texts, self.config.batch_size)
        if self._pool is None and self._local is None:
            raise RuntimeError("BatchTokenizer.encode() outside its `with` block")
        results = map(lambda b: encode_texts(self._local, b), batches) if self._pool is None else self._ordered(batches)
        for flat, lengths in results:
            yield from np.split(flat, np.cumsum(lengths[:-1]))

    def _ordered(self, batches: Iterator[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Worker results in submission order with at most ``2 * workers`` batches in flight.

        Unlike ``Pool.imap`` or ``Executor.map``, which take the whole input at once, this reads
        the corpus only as fast as the workers encode it, so memory stays bounded on large streams."""
        pending = deque()
        for batch in batches:
            pending.append(self._pool.submit(_encode_in_worker, batch))
            if len(pending) >= 2 * self.config.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
