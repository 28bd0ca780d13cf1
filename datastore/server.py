"""The gRPC datastore service: a thin servicer over an opened ``Datastore`` and an optional
``OutputStore`` of recent generations, and ``serve``.

The servicer only converts (``datastore.wire``) and calls the engines; the index is opened once at
start and shared by all worker threads (drafting is read-only; the output store locks itself).
Besides ``rest.datastore.v1``, the server implements the standard health service and server
reflection, so stock tools (``grpc_health_probe``, ``grpcurl``) work against it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from datastore import wire
from datastore.index import Datastore
from datastore.sources import DEFAULT_OUTPUTS_MAX_TOKENS, OutputStore, check_outputs_options, open_output_store
from datastore.types import DraftConfig
from rest_proto.v1 import datastore_pb2 as pb
from rest_proto.v1 import datastore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Datastore"].full_name  # "rest.datastore.v1.Datastore"


@dataclass(frozen=True)
class ServerConfig:
    """Where and how to serve. ``port`` 0 picks a free port; ``max_context_tokens`` caps each
    context a request may carry; ``grace_seconds`` is how long in-flight calls may finish at stop.
    ``outputs_max_tokens`` sizes the store of recent outputs (0: keep none) and ``outputs_dir``,
    if given, makes it persistent (``serve`` opens it; ``DatastoreServer`` takes an opened one)."""

    host: str = "127.0.0.1"
    port: int = 50051
    workers: int = 8
    max_context_tokens: int = 4096
    grace_seconds: float = 5.0
    outputs_max_tokens: int = DEFAULT_OUTPUTS_MAX_TOKENS
    outputs_dir: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.max_context_tokens < wire.MIN_CONTEXT_LIMIT:
            raise ValueError(
                f"max_context_tokens must be at least {wire.MIN_CONTEXT_LIMIT} (the longest suffix a "
                f"client may ask to match), got {self.max_context_tokens}"
            )
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be non-negative, got {self.grace_seconds}")
        check_outputs_options(self.outputs_max_tokens, self.outputs_dir)


class NoOutputStoreError(RuntimeError):
    """An output was sent to a server that keeps none (FAILED_PRECONDITION on the wire)."""


def _status_on_error(method):
    """Answer a bad request with INVALID_ARGUMENT, an output sent to a server without an output
    store with FAILED_PRECONDITION and a failure with INTERNAL (traceback in the log), so one
    call's exception never takes the server down."""

    @functools.wraps(method)
    def wrapper(self, request, context: grpc.ServicerContext):
        try:
            return method(self, request, context)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoOutputStoreError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed on the server (see its log)")

    return wrapper


class DatastoreServicer(pb_grpc.DatastoreServicer):
    """Message -> engine -> message, nothing else. ``outputs`` None: the server keeps no outputs."""

    def __init__(self, store: Datastore, max_context_tokens: int, outputs: OutputStore | None = None) -> None:
        self._store = store
        self._outputs = outputs
        self._vocab_size = store.vocab_size
        self._max_context_tokens = max_context_tokens
        self._info = wire.info_to_message(store.info())

    def _output_trees(self, include: bool, contexts: Sequence, config: DraftConfig) -> list[pb.DraftTree]:
        """The output store's tree per context when asked for and kept; else none (read as empty)."""
        if not include or self._outputs is None:
            return []
        return [wire.tree_to_message(self._outputs.draft(c, config)) for c in contexts]

    @_status_on_error
    def Draft(self, request: pb.DraftRequest, context: grpc.ServicerContext) -> pb.DraftReply:
        tokens, config = wire.parse_draft_request(request, self._vocab_size, self._max_context_tokens)
        outputs = self._output_trees(request.include_outputs, [tokens], config)
        return pb.DraftReply(tree=wire.tree_to_message(self._store.draft(tokens, config)), outputs=next(iter(outputs), None))

    @_status_on_error
    def DraftBatch(self, request: pb.DraftBatchRequest, context: grpc.ServicerContext) -> pb.DraftBatchReply:
        contexts, config = wire.parse_draft_batch_request(request, self._vocab_size, self._max_context_tokens)
        return pb.DraftBatchReply(
            trees=[wire.tree_to_message(t) for t in self._store.draft_batch(contexts, config)],
            outputs=self._output_trees(request.include_outputs, contexts, config),
        )

    @_status_on_error
    def AddOutput(self, request: pb.AddOutputRequest, context: grpc.ServicerContext) -> pb.AddOutputReply:
        if self._outputs is None:
            raise NoOutputStoreError("this server keeps no outputs (it was started with --outputs-max-tokens 0)")
        return pb.AddOutputReply(seq=self._outputs.add(wire.output_from_message(request)))

    @_status_on_error
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        return self._info


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class DatastoreServer:
    """A running gRPC server answering from ``store`` and ``outputs`` (which the caller keeps and
    closes; None: no output store, whatever ``config.outputs_max_tokens`` says).

    Binds and starts on construction; ``port`` is the port actually bound (useful with port 0).
    Raises ``OSError`` when the address cannot be bound."""

    def __init__(
        self, store: Datastore, config: ServerConfig = ServerConfig(), outputs: OutputStore | None = None
    ) -> None:
        self.config = config
        # so_reuseport off: a second server on a busy port must fail, not silently share it
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="datastore"),
            options=[("grpc.so_reuseport", 0)],
        )
        servicer = DatastoreServicer(store, config.max_context_tokens, outputs)
        pb_grpc.add_DatastoreServicer_to_server(servicer, self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        target = format_address(config.host, config.port)
        try:
            self.port = self._server.add_insecure_port(target)
        except RuntimeError:
            raise OSError(
                f"cannot listen on {target}: the port is in use or the host is not an address of this machine"
            ) from None
        self._server.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.address = format_address(config.host, self.port)
        log.info("datastore service listening on %s (%d workers, %s)", self.address, config.workers,
                 "no output store" if outputs is None else f"output store of {outputs.max_tokens} tokens")

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight ones finish for ``grace`` seconds
        (default: the config's), then return."""
        self._health.enter_graceful_shutdown()
        self._server.stop(self.config.grace_seconds if grace is None else grace).wait()
        log.info("datastore service on %s stopped", self.address)

    def __enter__(self) -> "DatastoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(
    index_path: str | Path, config: ServerConfig = ServerConfig(), *, ready: Callable[[str], None] | None = None
) -> None:
    """Serve the index at ``index_path`` (and the output store ``config`` asks for) until SIGTERM
    or SIGINT, then stop gracefully and return; a persistent output store has then written every
    acknowledged output.

    ``ready`` is called with the bound ``host:port`` once the server accepts calls. Must run in the
    main thread (signal handlers). Raises ``IndexFormatError``, ``OutputStoreError`` or ``OSError``."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.ExitStack() as resources:  # closed in reverse: server, outputs, index
            store = resources.enter_context(Datastore.open(index_path))
            outputs = open_output_store(config.outputs_max_tokens, config.outputs_dir, vocab_size=store.vocab_size)
            if outputs is not None:
                resources.enter_context(outputs)
            server = resources.enter_context(DatastoreServer(store, config, outputs))
            if ready is not None:
                ready(server.address)
            stop.wait()
            log.info("signal received: stopping (grace %.1f s)", config.grace_seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
