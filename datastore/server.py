"""The gRPC datastore service (``rest.datastore.v1.Datastore``): ``DatastoreServicer``, a thin
servicer over a ``Retriever`` (``datastore.index``: an opened ``Datastore``, or a ``Router``
over shard servers, ``datastore.router``) and an optional ``OutputStore`` of recent generations;
``DatastoreServer``, which runs it on the shared gRPC plumbing (``datastore.rpc``: limits, auth,
TLS, health, reflection, metrics); and ``serve``.

The servicer only converts (``datastore.wire``) and calls the retriever; the index is opened once at
start and shared by all worker threads (drafting is read-only; the output store locks itself). The
retrieval kernels are compiled before the server reports SERVING, so the first call is as fast as
any other.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from rest_spec.common.errors import NoOutputStoreError
from rest_spec.common.types import DraftConfig
from rest_spec.datastore import wire
from rest_spec.datastore.index import Datastore, Retriever
from rest_spec.datastore.outputs import OutputStore, open_output_store
from rest_spec.datastore.rpc import (
    BoundedServicer,
    CallRefused,
    GrpcServer,
    ServerConfig,
    run_until_signalled,
    stop_if_ended,
)
from rest_spec.proto.v1 import datastore_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Datastore"]
SERVICE_NAME = SERVICE.full_name  # "rest.datastore.v1.Datastore"
# the default of ``DatastoreServer`` and ``serve`` (a frozen dataclass: one shared instance is safe)


class DatastoreServicer(BoundedServicer):
    """Message -> retriever -> message, nothing else. ``outputs`` None: the server keeps no outputs.
    Each method takes a parsed request and returns a reply message; ``handlers`` wraps them into
    the bounded, authenticated, raw-bytes handlers the server registers."""

    log = log  # its refused and failed calls are logged as this module's

    def __init__(self, store: Retriever, config: ServerConfig, outputs: OutputStore | None = None) -> None:
        super().__init__(SERVICE, config)
        self._store = store
        self._outputs = outputs
        self._vocab_size = store.vocab_size
        self._info = wire.info_to_message(store.info())

    def needs_token(self, method: str) -> bool:
        # reading the store whole is reading other clients' generations: as guarded as adding
        return self._config.auth_scope == "all" or method in ("AddOutput", "ReadOutputs")

    def _output_tree(self, include: bool, context, config: DraftConfig) -> pb.DraftTree | None:
        """The output store's tree for ``context`` when asked for and kept; else None (read as empty)."""
        if not include or self._outputs is None:
            return None
        return wire.tree_to_message(self._outputs.draft(context, config))

    def Draft(self, request: pb.DraftRequest, context: grpc.ServicerContext) -> pb.DraftReply:
        tokens, config = wire.parse_draft_request(request, self._vocab_size, self._config.max_context_tokens)
        return pb.DraftReply(
            tree=wire.tree_to_message(next(self._store.drafts([tokens], config, context.time_remaining()))),
            outputs=self._output_tree(request.include_outputs, tokens, config),
        )

    def DraftBatch(self, request: pb.DraftBatchRequest, context: grpc.ServicerContext) -> pb.DraftBatchReply:
        """Context by context, stopping as soon as the client is gone or the reply would exceed
        ``max_reply_bytes``: a hostile batch costs bounded work."""
        limit = self._config.max_reply_bytes
        contexts, config = wire.parse_draft_batch_request(
            request,
            self._vocab_size,
            self._config.max_context_tokens,
            max_contexts=self._config.max_batch_contexts,
            stop=lambda: stop_if_ended(context),
        )
        trees, outputs, size = [], [], 0
        drafted = self._store.drafts(contexts, config, context.time_remaining())
        for i, tokens in enumerate(contexts):
            stop_if_ended(context)
            trees.append(wire.tree_to_message(next(drafted)))
            size += wire.field_size(trees[-1])
            output = self._output_tree(request.include_outputs, tokens, config)
            if output is not None:
                outputs.append(output)
                size += wire.field_size(output)
            if size > limit:
                raise CallRefused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the reply to {len(contexts)} contexts exceeds this server's limit of {limit} bytes after "
                    f"{i + 1} (--max-reply-bytes): send fewer contexts or ask for smaller trees",
                )
        return pb.DraftBatchReply(trees=trees, outputs=outputs)

    def AddOutput(self, request: pb.AddOutputRequest, context: grpc.ServicerContext) -> pb.AddOutputReply:
        if self._outputs is None:
            raise NoOutputStoreError("this server keeps no outputs (it was started with --outputs-max-tokens 0)")
        return pb.AddOutputReply(seq=self._outputs.add(wire.output_from_message(request)))

    def ReadOutputs(self, request: pb.ReadOutputsRequest, context: grpc.ServicerContext) -> pb.ReadOutputsReply:
        if self._outputs is None:
            raise NoOutputStoreError("this server keeps no outputs (it was started with --outputs-max-tokens 0)")
        fits = (self._config.max_reply_bytes - wire.READ_REPLY_SLACK) // wire.READ_BYTES_PER_TOKEN
        documents, next_seq, end_seq = self._outputs.read(request.from_seq, fits)
        reply = wire.read_outputs_reply(documents, next_seq, end_seq)
        while len(reply.outputs) > 1 and reply.ByteSize() > self._config.max_reply_bytes:  # short outputs' overhead
            del reply.outputs[len(reply.outputs) // 2 :]
            reply.next_seq = reply.outputs[-1].seq + 1
        return reply

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        return self._info


class DatastoreServer(GrpcServer):
    """A running datastore service answering from ``store`` (a ``Retriever``) and ``outputs`` (which
    the caller keeps and closes; None: no output store, whatever ``config.outputs_max_tokens``
    says). Readies the retriever (compiles the retrieval kernels), then binds and starts, so it
    answers at full speed once constructed."""

    log = log  # its start and stop are logged as this module's

    def __init__(
        self,
        store: Retriever,
        config: ServerConfig = ServerConfig(),
        outputs: OutputStore | None = None,
        role: str = "serve",
    ) -> None:
        log.info("retrieval kernels ready in %.2f s", store.warm_up())
        kept = "no output store" if outputs is None else f"output store of {outputs.max_tokens} tokens"
        super().__init__(
            SERVICE_NAME,
            DatastoreServicer(store, config, outputs).handlers(),
            config,
            f"datastore service ({kept})",
            role,
        )
        if self.metrics is not None:
            info = store.info()
            self.metrics.set_shards(len(info.shards), info.num_tokens)
            if outputs is not None:
                self.metrics.track_output_store(lambda: outputs.num_tokens)


def start_datastore(
    resources: contextlib.ExitStack, store: Retriever, config: ServerConfig, role: str = "serve"
) -> DatastoreServer:
    """The datastore service over ``store`` with the output store ``config`` asks for, both
    entered into ``resources`` (``role`` as ``DatastoreServer``'s). Raises ``OutputStoreError``,
    ``OSError``, ``ValueError``."""
    outputs = open_output_store(
        config.outputs_max_tokens, config.outputs_dir, vocab_size=store.vocab_size, salvage=config.outputs_salvage
    )
    if outputs is not None:
        resources.enter_context(outputs)
    return resources.enter_context(DatastoreServer(store, config, outputs, role))


def serve(
    index_path: str | Path | Sequence[str | Path],
    config: ServerConfig = ServerConfig(),
    *,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the index at ``index_path`` (or several as one: ``Datastore.open``) and the output
    store ``config`` asks for until SIGTERM or SIGINT, then stop gracefully and return; a
    persistent output store has then written every acknowledged output.

    ``ready`` is called with the bound ``host:port`` once the server accepts calls at full speed
    (kernels compiled). Must run in the main thread (signal handlers). Raises
    ``IndexFormatError``, ``OutputStoreError``, ``OSError`` or ``ValueError`` (TLS files)."""
    run_until_signalled(
        lambda resources: start_datastore(
            resources, resources.enter_context(Datastore.open(index_path, check=config.check_index)), config
        ),
        ready,
    )
