"""``build_index --ray``: the same index, built on a Ray cluster.

Ray Data reads the corpus through the builder's own readers (``corpora.open_corpus``: every kind
of corpus, the same records, held-out records and counts) and tokenizes it in parallel with a
stateless function and a tokenizer cached per worker process (an actor pool holding every CPU
can starve the read task), in order. The driver packs the token arrays into shards with the
``IndexWriter``'s own packing, so the shard boundaries are the plain build's, and each shard's
suffix array is built and written by one Ray task (with a ``memory`` request) into the writer's
temporary directory; the writer writes the manifest last and publishes as in the plain build, so
atomicity, ``--overwrite`` and stop signals behave the same. The shard files are byte-identical to
the plain build's; the manifest differs only in its ``build`` entry (arguments and timings).

The temporary directory sits beside ``--out`` and the corpus paths are read where the tasks run:
on a cluster of several machines both must be on storage every node mounts at the same path (and
every node needs ``rest-spec`` installed). Through Ray Client (``ray://``), whose driver cannot run
Ray Data, the whole build runs as one task on the cluster. ``ray`` is imported only here, when a
build asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import signal
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rest_spec.build_index.corpora import open_corpus
from rest_spec.build_index.corpus import Corpus, CorpusError, CorpusSpec, ReadStats
from rest_spec.build_index.job import (
    BuildConfig,
    BuildInputError,
    BuildInterrupted,
    BuildReport,
    RayTarget,
    progress_bar,
)
from rest_spec.build_index.tokenize import TokenizeConfig, backend_json, encode_texts, rebuild_tokenizer
from rest_spec.build_index.writer import IndexWriteError, IndexWriter, build_shard
from rest_spec.common.cli import first_line
from rest_spec.common.signals import STOP_SIGNALS, stop_signals_deferred

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rest-spec[ray]'"
_BLOCK_BYTES = 1 << 20  # Ray Data blocks of ~1 MiB: one block is one task's work, so many keep every CPU busy
# A shard's peak while its suffix array is built: tokens, their reversed copy, divsufsort's full
# array, two masks and the filtered array (int32 entries; int64 past 2^31 tokens doubles them).
_SHARD_BYTES_PER_TOKEN = 20
_SHARD_BYTES_EXTRA = 256 << 20  # the interpreter, numpy, numba


class RayBuildError(Exception):
    """The Ray cluster failed the build (unreachable, a task or worker died); one line."""


def require_ray() -> None:
    """A ``BuildInputError`` saying how to install Ray unless ``ray.data`` imports."""
    try:
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise BuildInputError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from exc


@contextlib.contextmanager
def ray_session(target: RayTarget) -> Iterator[None]:
    """Ray for the block. A process that already called ``ray.init`` keeps its session (neither
    another is started nor this one shut down); otherwise ``target`` is started or connected to
    here and shut down after, with stop signals held across both (a cluster half started cannot
    be shut down cleanly) and the caller's handlers kept (``ray.init`` installs its own)."""
    import ray

    if ray.is_initialized():
        yield
        return
    environ = {name: os.environ.get(name) for name in ("RAY_USAGE_STATS_ENABLED", "RAY_AUTH_TOKEN")}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict = {"logging_level": logging.WARNING}
    if target.kind == "local":
        kwargs.update(num_cpus=target.num_cpus, include_dashboard=False)
        if not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(os.environ):
            # Ray 2.60 starts a local cluster with token auth and saves a new token in ~/.ray: this
            # cluster's token lives only in the environment of its processes, which inherit ours.
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    where = "a new local cluster" if target.kind == "local" else target.address
    log.info("starting Ray (%s)", where)
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        with stop_signals_deferred():
            if target.kind == "local":
                # A terminal's hang-up reaches the whole process group, and a cluster process that
                # died of it would take this one down before its handler removes the partial
                # index: the cluster's processes (which keep ignored signals) leave it to this one,
                # which shuts them down. (SIGINT they handle themselves.)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
            try:
                # (its warning that it chose token auth for a local cluster: it is this build's own)
                with _quiet("ray._private.authentication.authentication_token_setup"):
                    ray.init(address=target.address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise RayBuildError(f"cannot start or reach Ray ({where}): {first_line(exc)}") from exc
            finally:
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
        try:
            yield
        finally:
            with stop_signals_deferred():
                ray.shutdown()
    finally:
        for name, value in environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def build_through_client(config: BuildConfig, build: Callable[[BuildConfig], BuildReport]) -> BuildReport:
    """``build(config)`` (``build.build``, passed in by it) through Ray Client, whose driver cannot run a Ray Data pipeline: the whole
    build runs as one task on the cluster (as ``--ray auto`` there, so paths are the cluster's)
    while this process waits. A stop signal here (``BuildInterrupted``, raised by the caller's
    ``_StopSignals``) cancels the task, which cleans up as a stopped build does, and is passed on,
    unless the task had already published its index."""
    import ray

    if config.out is None or not config.out.is_absolute():
        raise BuildInputError(f"--ray {config.ray} builds on the cluster: give --out as an absolute path there")
    with ray_session(RayTarget.parse(config.ray)):
        remote = ray.remote(build).options(num_cpus=0, max_retries=0)
        ref = remote.remote(dataclasses.replace(config, ray="auto", progress=False))
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise _cause(exc) from exc
        except BuildInterrupted as stopped:
            with stop_signals_deferred():
                ray.cancel(ref)  # a KeyboardInterrupt in the task: its `with` blocks remove its partial index
                ray.wait([ref], timeout=60)
            try:
                report = ray.get(ref, timeout=0)
            except Exception:  # cancelled (or still stopping): it published nothing
                raise stopped from None
            log.warning(
                "%s arrived after the new index was written to %s", signal.Signals(stopped.signum).name, report.out
            )
            return report


class RayBackend:
    """The ``--ray`` backend of ``build.build`` (see ``build._LocalBackend`` for the interface): a
    Ray session for the build (``ray_session``), the Ray Data pipeline and a writer whose shards
    are Ray tasks."""

    def __init__(self, target: str, tokenizer, config: TokenizeConfig) -> None:
        self.target = RayTarget.parse(target)
        self.config = config
        self._tokenizer_json = backend_json(tokenizer)
        self._tokenizer_key = hashlib.sha256(self._tokenizer_json.encode()).hexdigest()
        self._session = contextlib.ExitStack()
        self.node_memory = 0  # the largest node's schedulable memory, bytes
        self.cpus = 1  # the cluster's

    def __enter__(self) -> RayBackend:
        import ray

        with self._session as session:
            session.enter_context(ray_session(self.target))
            nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
            self.node_memory = int(max((node.get("memory", 0) for node in nodes), default=0))
            self.cpus = max(1, int(sum(node.get("CPU", 0) for node in nodes)))
            self._session = session.pop_all()
        log.info("Ray: %d CPUs, largest node memory %.1f GiB", self.cpus, self.node_memory / 2**30)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._session.__exit__(exc_type, exc, tb)

    def writer(self, out: Path, **args) -> IndexWriter:
        return _RayIndexWriter(out, backend=self, **args)

    def index(self, corpus: Corpus, writer: IndexWriter, progress: bool) -> int:
        """Stream the corpus through Ray Data into ``writer``, in order; sets ``corpus.stats``
        from the read task's counts."""
        import ray.data

        read = {
            "spec": json.dumps(corpus.spec.to_dict()),
            "log_level": logging.getLogger("rest_spec").getEffectiveLevel(),
        }
        dataset = (
            ray.data.from_items([read])
            # The read asks for no CPU: it is light beside the tokenizers and mostly waits for
            # them, which get every CPU. The different asks also keep Ray Data from fusing the
            # two steps into one task, which would tokenize in the read task alone.
            .flat_map(_read_corpus, num_cpus=0)
            .map_batches(
                _tokenize,
                batch_size=self.config.batch_size,
                batch_format="pyarrow",
                num_cpus=1,
                fn_kwargs={"key": self._tokenizer_key, "tokenizer_json": self._tokenizer_json},
            )
        )
        context = dataset.context
        context.execution_options.preserve_order = True
        context.target_max_block_size = _BLOCK_BYTES
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        tokens = 0
        batches = _unwrapped(iter(dataset.iter_batches(batch_size=None, batch_format="pyarrow")))
        try:
            with progress_bar(corpus, progress) as bar, _quiet("ray.data"):  # the build has its own bar
                for batch in batches:
                    for row in batch.to_pylist():
                        flat = np.frombuffer(row["ids"], dtype=np.uint32)
                        lengths = np.frombuffer(row["lengths"], dtype=np.int64)
                        for ids in np.split(flat, np.cumsum(lengths[:-1])) if lengths.size else ():
                            writer.add_document(ids)
                            tokens += ids.size
                        bar.update(row["records"])
                        if row["stats"] is not None:
                            corpus.stats = ReadStats(**json.loads(row["stats"]))
        finally:
            batches.close()  # stops the pipeline's tasks when the build stops early
        return tokens


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Nothing from Ray's logger ``name`` in the block unless this module logs debug (``-vv``): what
    it would say the build says itself, in one line (a failed task's error, its own progress bar)."""
    logger = logging.getLogger(name)
    level = logger.level
    if not log.isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _unwrapped(batches: Iterator) -> Iterator:
    """``batches``, with an error raised in a Ray task re-raised as the builder's own (``_cause``)."""
    try:
        yield from batches
    except Exception as exc:
        raise _cause(exc) from exc


def _cause(exc: BaseException) -> BaseException:
    """The error a Ray task raised, unwrapped from Ray's wrappers: an ``OSError``, an
    ``IndexWriteError`` or a ``RayBuildError`` as itself, a ``CorpusError`` or ``BuildInputError``
    as its first line (Ray Data appends notes on retries), anything else as a ``RayBuildError``."""
    seen = exc
    for _ in range(8):  # RayTaskError(UserCodeException(cause)) and the like
        if type(seen).__module__ != "ray.exceptions":
            if isinstance(seen, (CorpusError, BuildInputError)):
                return type(seen)(first_line(seen))
            if isinstance(seen, (OSError, IndexWriteError, RayBuildError)):  # FileExistsError is an OSError
                return seen
        inner = getattr(seen, "cause", None) or seen.__cause__
        if inner is None:
            break
        seen = inner
    return RayBuildError(f"the Ray build failed: {first_line(seen)}")


# ---- in Ray tasks ---------------------------------------------------------------------------------


def _read_corpus(read: dict) -> Iterator[dict]:
    """The read task: one row per record to index (its documents), then one row of the read's
    counts. The readers' warnings (files skipped, a file cut off) reach the driver's stderr
    through Ray at the driver's level (none with ``--quiet``)."""
    logging.getLogger("rest_spec").setLevel(read["log_level"])
    corpus = open_corpus(CorpusSpec.from_dict(json.loads(read["spec"])))
    for record in corpus.records():
        yield {"texts": record.documents(corpus.spec.turns), "stats": None}
    yield {"texts": [], "stats": json.dumps(asdict(corpus.stats))}


_tokenizers: dict[str, object] = {}  # per worker process: tokenizer key -> the rebuilt tokenizer


def _tokenize(batch, key: str, tokenizer_json: str):
    """A batch of record rows -> one row: the documents' ids (uint32 bytes), their lengths (int64
    bytes), the records in the batch and the read's counts if the batch ends with them."""
    import pyarrow as pa

    tokenizer = _tokenizers.get(key)
    if tokenizer is None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a task has one CPU; Rust threads would contend
        tokenizer = _tokenizers[key] = rebuild_tokenizer(tokenizer_json)
    stats = [s for s in batch.column("stats").to_pylist() if s is not None]
    texts = [text for texts in batch.column("texts").to_pylist() for text in texts]
    flat, lengths = encode_texts(tokenizer, texts)
    return pa.table(
        {
            "ids": pa.array([flat.tobytes()], pa.large_binary()),
            "lengths": pa.array([lengths.tobytes()], pa.large_binary()),
            "records": pa.array([batch.num_rows - len(stats)], pa.int64()),
            "stats": pa.array(stats[-1:] or [None], pa.string()),
        }
    )


def _build_shard_task(directory: str, shard: int, tokens: np.ndarray, vocab_size: int):
    """One shard's suffix array and files, on whichever node runs the task."""
    if not os.path.isdir(directory):
        raise OSError(
            f"{directory} does not exist on this Ray node: --out must be on storage every node mounts at the same path"
        )
    return build_shard(Path(directory), shard, tokens, vocab_size)


# ---- the driver's writer ------------------------------------------------------------------------


class _RayIndexWriter(IndexWriter):
    """An ``IndexWriter`` whose shards are built by Ray tasks, at most one per CPU in flight (each
    holds its token array in the object store); their entries are taken in shard order."""

    def __init__(self, out_dir: Path, *, backend: RayBackend, **args) -> None:
        super().__init__(out_dir, **args)
        self._backend = backend
        self._in_flight: deque = deque()  # ObjectRefs of the shard tasks, in shard order

    def _write_shard(self, shard: int, tokens: np.ndarray) -> None:
        import ray

        memory = _SHARD_BYTES_PER_TOKEN * tokens.size + _SHARD_BYTES_EXTRA
        if memory > self._backend.node_memory:
            raise RayBuildError(
                f"a shard of {tokens.size:,} tokens needs ~{memory / 2**30:.1f} GiB to build, and the largest "
                f"Ray node offers {self._backend.node_memory / 2**30:.1f} GiB: lower --shard-tokens"
            )
        # Ray retries a task whose worker or node died (a preempted node): writing a shard again
        # writes the same bytes to the same files.
        task = ray.remote(_build_shard_task).options(num_cpus=1, memory=memory)
        self._in_flight.append(task.remote(str(self._tmp), shard, tokens, self.vocab_size))
        while len(self._in_flight) > self._backend.cpus:
            self._take_oldest()

    def _take_oldest(self) -> None:
        import ray

        with self._writing():  # an OSError of the task's files, or a shard that reads back wrong
            try:
                entry, sa_seconds = ray.get(self._in_flight[0])
            except ray.exceptions.RayError as exc:
                raise _cause(exc) from exc
        self._in_flight.popleft()
        self._shard_written(entry, sa_seconds)

    def _wait_for_shards(self) -> None:
        while self._in_flight:
            self._take_oldest()

    def abort(self) -> None:
        """Stop the shard tasks still running before their directory is removed."""
        import ray

        if self._in_flight:
            with stop_signals_deferred():
                for ref in self._in_flight:
                    ray.cancel(ref, force=True)
                ray.wait(list(self._in_flight), num_returns=len(self._in_flight), timeout=60)
                self._in_flight.clear()
        super().abort()
