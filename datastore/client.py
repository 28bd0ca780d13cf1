"""The gRPC client of the datastore service (``rest-datastore serve``); it is a ``SourceDrafter``.

It returns the same trees as an in-process ``LocalDrafter`` on the same index and outputs: both
sides convert through ``datastore.wire``. Only the last ``n_max`` context tokens are sent, since
the server never looks further back; one call per step answers both the index and the output store.
The channel options every client of this package's servers uses (``RECONNECT_OPTIONS``,
``auth_metadata``, ``open_channel``) are here too: the router (``datastore.router``) reaches its
shard servers with them.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Sequence
from concurrent.futures import CancelledError
from pathlib import Path

import grpc
import numpy as np

from rest_spec.common.errors import NoOutputStoreError
from rest_spec.common.tokenizer import require_tokenizer
from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo, SourceTrees
from rest_spec.datastore import wire
from rest_spec.proto.v1 import datastore_pb2 as pb
from rest_spec.proto.v1 import datastore_pb2_grpc as pb_grpc

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

# A server that went away is reconnected to within a quarter second once it is back (gRPC's
# default backoff grows to two minutes, during which every draft would fall back to local; a
# drafter's circuit breaker probes at most every half second on top), and each attempt may take a
# second (gRPC names that minimum "min_reconnect_backoff"): a handshake with a server far away
# takes longer than the backoff.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 1000),
)


def auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the bearer token (``wire.bearer_metadata``), or nothing.
    Raises ``ValueError`` for a token metadata cannot carry."""
    return () if auth_token is None else (wire.bearer_metadata(auth_token),)


def add_connection_arguments(parser: argparse.ArgumentParser, server_flag: str) -> None:
    """The flags every CLI that reaches a datastore server takes: ``--tls-ca`` and ``--auth-token``
    (env ``REST_TLS_CA``, ``REST_AUTH_TOKEN``), named after the CLI's ``server_flag``."""
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=os.environ.get("REST_TLS_CA"),
        help=f"connect to {server_flag} over TLS, trusting this CA certificate (default: $REST_TLS_CA)",
    )
    parser.add_argument(
        "--auth-token",
        metavar="TOKEN",
        default=os.environ.get("REST_AUTH_TOKEN"),
        help=f"bearer token for a {server_flag} started with --auth-token (default: $REST_AUTH_TOKEN)",
    )


def open_channel(address: str, tls_ca: str | Path | None = None, options: Sequence = ()) -> grpc.Channel:
    """A plaintext channel, or with ``tls_ca`` (a PEM file of the certificate authority that
    signed the server's certificate) a TLS one. Raises ``ValueError`` naming an unusable file."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=options)
    try:
        ssl.create_default_context(cafile=tls_ca)  # refuses a file that holds no PEM certificate
        root = Path(tls_ca).read_bytes()
    except OSError as exc:  # ssl.SSLError is an OSError too
        raise ValueError(
            f"cannot use TLS CA certificate {tls_ca}: {wire.tls_file_error(exc)} (expected a PEM file)"
        ) from None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root), options=options)


class DatastoreClient:
    """gRPC client of the datastore service; owns its channel (close it, or use ``with``).

    ``timeout`` (seconds) bounds the wait for the server at construction and every call (a host
    that silently drops packets can take twice that to be reported). Raises ``ConnectionError``
    naming the address when the server cannot be reached. With ``expected_fingerprint`` (the
    model's ``tokenizer_fingerprint``), a datastore built with another tokenizer is refused on
    connect with ``TokenizerMismatchError``.

    ``tls_ca`` (a PEM file) connects over TLS and checks the server's certificate against it;
    ``auth_token`` is sent as ``authorization: Bearer <token>`` with every call (servers started
    with ``--auth-token`` require it). Replies are accepted up to ``max_reply_bytes``, by default
    the 4 MiB every stock gRPC client accepts (a server's default reply limit is below it)."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 5.0,
        expected_fingerprint: str | None = None,
        tls_ca: str | Path | None = None,
        auth_token: str | None = None,
        max_reply_bytes: int = wire.STOCK_MESSAGE_LIMIT,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(auth_token)
        options = [("grpc.max_receive_message_length", max_reply_bytes), *RECONNECT_OPTIONS]
        self._channel = open_channel(address, tls_ca, options)
        self._stub = pb_grpc.DatastoreStub(self._channel)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            reason = self._unreachable_reason()
            self._channel.close()
            raise ConnectionError(f"cannot reach datastore at {address}: {reason}") from None
        require_tokenizer(self, expected_fingerprint)

    def _unreachable_reason(self) -> str:
        """Why the channel is not ready: a fail-fast call reports the last connection error
        (e.g. "Connection refused"), which the readiness wait does not."""
        try:
            self._stub.Info(pb.InfoRequest(), timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            return exc.details()
        return f"no connection within {self.timeout:g} s"

    def _error(self, exc: grpc.RpcError, failed_precondition: type[RuntimeError] = RuntimeError) -> Exception:
        """The exception a failed call raises: INVALID_ARGUMENT -> ValueError, unreachable ->
        ConnectionError, FAILED_PRECONDITION -> ``failed_precondition`` (the calls that have one
        name its type), else RuntimeError (e.g. UNAUTHENTICATED; RESOURCE_EXHAUSTED: a limit of the
        server), each with the server's message."""
        code, details = exc.code(), exc.details()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ValueError(details)
        if code in _UNREACHABLE:
            return ConnectionError(f"datastore at {self.address}: {code.name}: {details}")
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return failed_precondition(f"datastore at {self.address}: {code.name}: {details}")
        return RuntimeError(f"datastore at {self.address}: {code.name}: {details}")

    def _call(self, rpc, request, timeout: float | None = None, failed_precondition: type[RuntimeError] = RuntimeError):
        """One RPC, waiting at most ``timeout`` (default: the client's); errors as ``_error``."""
        try:
            return rpc(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, failed_precondition) from None

    def draft(self, context: Sequence[int], config: DraftConfig = DraftConfig()) -> DraftTree:
        reply = self._call(self._stub.Draft, wire.draft_request(context, config))
        return wire.tree_from_message(reply.tree)

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig = DraftConfig()) -> list[DraftTree]:
        """One call for all contexts; trees in the order of ``contexts``."""
        reply = self._call(self._stub.DraftBatch, wire.draft_batch_request(contexts, config))
        return [wire.tree_from_message(t) for t in reply.trees]

    def draft_sources(self, context: Sequence[int], config: DraftConfig = DraftConfig()) -> SourceTrees:
        """The index's and the output store's trees for ``context``, in one call."""
        reply = self._call(self._stub.Draft, wire.draft_request(context, config, include_outputs=True))
        return SourceTrees(wire.tree_from_message(reply.tree), wire.tree_from_message(reply.outputs))

    def draft_sources_batch(
        self, contexts: Sequence[Sequence[int]], config: DraftConfig = DraftConfig()
    ) -> list[SourceTrees]:
        """``draft_sources`` for every context, in one call; in the order of ``contexts``."""
        reply = self._call(self._stub.DraftBatch, wire.draft_batch_request(contexts, config, include_outputs=True))
        return self._source_trees(reply)

    def draft_batch_future(
        self,
        contexts: Sequence[Sequence[int]],
        config: DraftConfig = DraftConfig(),
        *,
        include_outputs: bool = False,
        timeout: float | None = None,
    ) -> PendingDrafts:
        """``draft_sources_batch`` (or, without ``include_outputs``, the index trees with empty
        output trees) started now and answered later: the call runs while the caller does other
        work (a forward pass). The server gives up at ``timeout`` (default: the client's), and
        ``cancel()`` stops it earlier."""
        request = wire.draft_batch_request(contexts, config, include_outputs=include_outputs)
        call = self._stub.DraftBatch.future(
            request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata
        )
        return PendingDrafts(self, call)

    def _source_trees(self, reply: pb.DraftBatchReply) -> list[SourceTrees]:
        trees = [wire.tree_from_message(t) for t in reply.trees]
        # a server without an output store answers no output trees: all empty
        outputs = [wire.tree_from_message(t) for t in reply.outputs] or [DraftTree.empty()] * len(trees)
        if len(outputs) != len(trees):
            raise RuntimeError(
                f"datastore at {self.address} answered {len(outputs)} output trees for {len(trees)} contexts"
            )
        return [SourceTrees(index, output) for index, output in zip(trees, outputs)]

    def add_output(self, tokens: Sequence[int], timeout: float | None = None) -> int:
        """Store one generation in the server's output store; returns its sequence number once
        stored (durable on a server with ``--outputs-dir``), waiting at most ``timeout`` (default:
        the client's). ``NoOutputStoreError`` (a ``RuntimeError``) when the server keeps no outputs:
        AddOutput's FAILED_PRECONDITION."""
        return self._call(self._stub.AddOutput, wire.add_output_request(tokens), timeout, NoOutputStoreError).seq

    def read_outputs(
        self, from_seq: int, vocab_size: int, timeout: float | None = None
    ) -> tuple[list[tuple[int, np.ndarray]], int, int]:
        """The server's stored outputs from ``from_seq`` on, as many as one reply holds:
        (documents as (seq, tokens), next_seq, end_seq), checked against ``vocab_size``
        (``wire.outputs_from_reply``; a malformed reply raises ``RuntimeError`` naming the server).
        ``NoOutputStoreError`` when the server keeps no outputs."""
        reply = self._call(
            self._stub.ReadOutputs, pb.ReadOutputsRequest(from_seq=from_seq), timeout, NoOutputStoreError
        )
        try:
            return wire.outputs_from_reply(reply, from_seq, vocab_size)
        except ValueError as exc:
            raise RuntimeError(f"datastore at {self.address} answered a malformed ReadOutputs reply: {exc}") from None

    def info(self) -> IndexInfo:
        return wire.info_from_message(self._call(self._stub.Info, pb.InfoRequest()))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DatastoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PendingDrafts:
    """A ``DraftBatch`` call in flight (``DatastoreClient.draft_batch_future``)."""

    def __init__(self, client: DatastoreClient, call: grpc.Future) -> None:
        self._client, self._call = client, call

    def result(self, timeout: float | None = None) -> list[SourceTrees]:
        """The trees, waiting at most ``timeout`` seconds for them (the call goes on after a
        ``TimeoutError``); errors as the blocking calls raise them, ``CancelledError`` after
        ``cancel``."""
        try:
            reply = self._call.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"no reply from datastore at {self._client.address} within {timeout:g} s") from None
        except grpc.FutureCancelledError:
            raise CancelledError(f"draft request to {self._client.address} was cancelled") from None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise CancelledError(f"draft request to {self._client.address} was cancelled") from None
            raise self._client._error(exc) from None
        return self._client._source_trees(reply)

    def cancel(self) -> bool:
        """Stop waiting and tell the server to stop working; False when it had answered already."""
        return self._call.cancel()
