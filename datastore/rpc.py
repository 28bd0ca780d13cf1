"""The gRPC plumbing every server of this package shares -- the datastore service (``datastore.server``),
the shard service (``datastore.shards``) and the router in front of shard servers (``datastore.router``):
``ServerConfig``; ``BoundedServicer``, whose handlers take requests as raw bytes and bound,
authenticate and log every call; the status a failure answers with (``status_of``); ``GrpcServer``,
one service with the standard health service, server reflection (v1 and v1alpha, so stock tools such
as ``grpc_health_probe`` and ``grpcurl`` work), TLS, limits and metrics; and ``run_until_signalled``.

Every client is treated as hostile: requests arrive as raw bytes and are parsed here (undecodable
bytes are INVALID_ARGUMENT), each call's work and reply are bounded by ``ServerConfig`` limits and
stop when its deadline passes or it is cancelled, and a refused call costs at most one short,
rate-limited log line.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import logging
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from rest_spec.common.cli import first_line
from rest_spec.common.errors import NoOutputStoreError
from rest_spec.datastore import wire
from rest_spec.datastore.format import IndexCorruptError
from rest_spec.datastore.index import RetrieverUnavailable
from rest_spec.datastore.metrics import ServerMetrics
from rest_spec.datastore.outputs import DEFAULT_OUTPUTS_MAX_TOKENS, OutputStoreWriteError, check_outputs_options

# Under the 4 MiB (4,194,304 bytes) that stock gRPC clients accept, with room to spare.
DEFAULT_MAX_REPLY_BYTES = 4_000_000
# Smallest request/reply limit: a Draft at the largest budget, with its output-store tree, fits.
MIN_MESSAGE_BYTES = 1 << 16
MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC's limits are C ints
AUTH_SCOPES = ("add-output", "all")
# errno values of an OutputStoreWriteError that mean "full" (retry once space is freed), not "broken"
_FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@dataclass(frozen=True)
class ServerConfig:
    """Where and how to serve. ``port`` 0 picks a free port; ``grace_seconds`` is how long
    in-flight calls may finish at stop. ``outputs_max_tokens`` sizes the store of recent outputs
    (0: keep none) and ``outputs_dir``, if given, makes it persistent (``outputs_salvage`` opens a
    log with damaged records by keeping every valid one; see ``OutputStore``); ``check_index`` runs the
    structural check of every index array at open (``server.serve`` opens both; ``DatastoreServer``
    takes them opened).

    Limits per call (defaults keep a 2-core machine responsive under hostile clients):
    ``max_context_tokens`` per context, ``max_batch_contexts`` per DraftBatch,
    ``max_request_bytes`` and ``max_reply_bytes`` per message, and ``max_concurrent_rpcs`` calls
    in flight (the rest are refused at once).

    Exposure: ``tls_cert``/``tls_key`` (PEM files, both or neither) serve over TLS; with
    ``auth_token``, calls in ``auth_scope`` ("add-output": AddOutput only, "all": every Datastore
    call; health and reflection stay open) need the metadata ``authorization: Bearer <token>``.

    ``metrics_port``: serve Prometheus metrics (``datastore.metrics``) over HTTP on ``host`` at
    that port (0: a free one); None: no metrics."""

    host: str = "127.0.0.1"
    port: int = 50051
    workers: int = 8
    max_context_tokens: int = 4096
    grace_seconds: float = 5.0
    outputs_max_tokens: int = DEFAULT_OUTPUTS_MAX_TOKENS
    outputs_dir: Path | None = None
    outputs_salvage: bool = False
    max_batch_contexts: int = 1024
    max_request_bytes: int = wire.STOCK_MESSAGE_LIMIT
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    max_concurrent_rpcs: int = 64
    check_index: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth_token: str | None = field(default=None, repr=False)  # never in a logged repr
    auth_scope: str = "add-output"
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
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
        for name in ("max_batch_contexts", "max_concurrent_rpcs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_request_bytes", "max_reply_bytes"):
            if not MIN_MESSAGE_BYTES <= getattr(self, name) <= MAX_MESSAGE_BYTES:
                raise ValueError(
                    f"{name} must be in [{MIN_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES}], got {getattr(self, name)}"
                )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (PEM files) or neither")
        if self.auth_token is not None:
            wire.bearer_metadata(self.auth_token)  # raises ValueError for a token metadata cannot carry
        if self.auth_scope not in AUTH_SCOPES:
            raise ValueError(f"auth_scope must be one of {', '.join(AUTH_SCOPES)}, got {self.auth_scope!r}")


class CallRefused(Exception):
    """The server refuses a call with the gRPC status ``code``; the message is the one line the
    client gets (a limit exceeded, a missing token)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class CallEnded(Exception):
    """The client stopped waiting (deadline passed or cancelled): stop working, answer nothing."""


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised ``exc`` answers with, and whose doing it was: "client" (a
    bad or excessive request), "server" (a corrupt index, a full or failing disk) or "bug"."""
    if isinstance(exc, CallRefused):
        return exc.code, "client"
    if isinstance(exc, RetrieverUnavailable):
        return grpc.StatusCode.UNAVAILABLE, "server"
    if isinstance(exc, IndexCorruptError):  # a ValueError, but not the client's
        return grpc.StatusCode.DATA_LOSS, "server"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, "client"
    if isinstance(exc, NoOutputStoreError):
        return grpc.StatusCode.FAILED_PRECONDITION, "client"
    if isinstance(exc, OutputStoreWriteError):
        full = exc.errno in _FULL_DISK
        return (grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.UNAVAILABLE), "server"
    return grpc.StatusCode.INTERNAL, "bug"


class LogBudget:
    """A token bucket for log lines: ``burst`` at once, then one per ``interval`` seconds, so a
    flood of bad requests costs a handful of lines. Thread-safe."""

    def __init__(self, burst: int = 10, interval: float = 6.0) -> None:
        self._burst, self._interval = burst, interval
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._suppressed = 0
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """None: stay silent; else log, mentioning this many lines suppressed since the last one."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) / self._interval)
            self._last = now
            if self._tokens < 1:
                self._suppressed += 1
                return None
            self._tokens -= 1
            suppressed, self._suppressed = self._suppressed, 0
            return suppressed


_LOG_LINE_CHARS = 200  # a client's values never make a long log line


def stop_if_ended(context: grpc.ServicerContext) -> None:
    """Raise ``CallEnded`` once the client's deadline has passed or it cancelled."""
    if not context.is_active():
        raise CallEnded()


def _authorization_values(context: grpc.ServicerContext) -> list[bytes]:
    """Every ``authorization`` metadata value of the call, as bytes."""
    return [value.encode() for key, value in context.invocation_metadata() or () if key == wire.AUTHORIZATION]


class BoundedServicer:
    """The handlers of one gRPC service, taking requests as raw bytes: each stops if the call
    already ended, authenticates (``needs_token``), parses, runs the method of this object named
    after the RPC, and turns any failure into a status (``status_of``) and at most one
    rate-limited log line, written to ``log`` (a subclass sets its own module's logger). Subclasses
    add the methods."""

    log = logging.getLogger(__name__)

    def __init__(self, service, config: ServerConfig) -> None:
        self._service = service  # a ServiceDescriptor
        self._config = config
        self._bearer = None if config.auth_token is None else wire.bearer_metadata(config.auth_token)[1].encode()
        self._refusal_log, self._failure_log = LogBudget(), LogBudget()

    def needs_token(self, method: str) -> bool:
        """Whether calls of ``method`` need the bearer token (when the server has one)."""
        return True

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """One handler per method of the service descriptor, taking the request as raw bytes."""
        return {
            method.name: grpc.unary_unary_rpc_method_handler(
                self._handler(method),
                response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
            )
            for method in self._service.methods
        }

    def _handler(self, method) -> Callable:
        name = method.name
        request_type = message_factory.GetMessageClass(method.input_type)
        run = getattr(self, name)
        needs_token = self._bearer is not None and self.needs_token(name)

        def handle(data: bytes, context: grpc.ServicerContext):
            try:
                stop_if_ended(context)  # a call that waited for a worker past its deadline
                if needs_token:
                    self._authenticate(context)
                try:
                    request = request_type.FromString(data)
                except Exception:  # DecodeError, or anything else the parser raises
                    raise CallRefused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"malformed {request_type.__name__}: the request bytes do not decode as {method.input_type.full_name}",
                    ) from None
                return run(request, context)
            except CallEnded:
                context.abort(grpc.StatusCode.CANCELLED, "the client stopped waiting")  # nobody reads it
            except Exception as exc:
                code, whose = status_of(exc)
                self._log_failure(name, context, code, whose, exc)
                details = f"{name} failed on the server (see its log)" if whose == "bug" else first_line(exc)
                context.abort(code, details)

        return handle

    def _authenticate(self, context: grpc.ServicerContext) -> None:
        """Raise UNAUTHENTICATED unless the call carries exactly this server's bearer token
        (compared in constant time)."""
        tokens = _authorization_values(context)
        if len(tokens) != 1 or not hmac.compare_digest(tokens[0], self._bearer):
            raise CallRefused(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token (metadata 'authorization: Bearer <token>')",
            )

    def _log_failure(self, name: str, context, code: grpc.StatusCode, whose: str, exc: Exception) -> None:
        """One log line, if the budget allows: a client's refusal at INFO, the server's own
        failure at ERROR, a bug with its traceback."""
        budget = self._refusal_log if whose == "client" else self._failure_log
        suppressed = budget.take()
        if suppressed is None:
            return
        note = f" ({suppressed} similar lines suppressed)" if suppressed else ""
        reason = first_line(exc)[:_LOG_LINE_CHARS]
        if whose == "client":
            self.log.info("%s from %s refused: %s: %s%s", name, context.peer(), code.name, reason, note)
        elif whose == "server":
            self.log.error("%s failed: %s: %s%s", name, code.name, reason, note)
        else:
            self.log.error("%s failed%s", name, note, exc_info=exc)


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, *, tls: bool, token: bool) -> str | None:
    """What travels in the clear when serving on ``host`` this way, or None when nothing does
    beyond this machine (loopback) or everything is encrypted (TLS)."""
    if tls:
        return None
    if not is_loopback(host):
        secrets = "requests, replies and the bearer token" if token else "requests and replies"
        return f"serving {host} without TLS: {secrets} are readable on the network (--tls-cert/--tls-key)"
    if token:
        return "a bearer token without TLS: it travels in the clear (--tls-cert/--tls-key)"
    return None


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    """TLS credentials from a PEM certificate (chain) and its PEM private key. Raises
    ``ValueError`` naming the files when one cannot be read or the key is not the certificate's."""
    try:
        pems = Path(key).read_bytes(), Path(cert).read_bytes()
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError is an OSError too
        raise ValueError(
            f"cannot serve TLS with certificate {cert} and key {key}: {wire.tls_file_error(exc)} (both must be "
            "PEM files, the key that of the certificate)"
        ) from None
    return grpc.ssl_server_credentials([pems])


def _register_reflection_v1() -> str:
    """Add ``grpc.reflection.v1``'s file to the default descriptor pool and return its service name.

    grpcio-reflection ships only v1alpha; v1 declares the same messages with the same field numbers
    under another package, so v1's file is v1alpha's renamed (which lets clients describe it too)."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = reflection_pb2.DESCRIPTOR.package, "grpc.reflection.v1"
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", new
    proto.ClearField("options")  # v1alpha's per-language package names
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(f".{old}.", f".{new}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
        method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    return (
        descriptor_pool.Default()
        .AddSerializedFile(proto.SerializeToString())
        .services_by_name["ServerReflection"]
        .full_name
    )


_reflection_v1_lock = threading.Lock()
_reflection_v1_name: str | None = None


def reflection_v1_service_name() -> str:
    """``grpc.reflection.v1.ServerReflection``, its file registered in the default descriptor pool
    (``_register_reflection_v1``) by the first call, once per process."""
    global _reflection_v1_name
    with _reflection_v1_lock:
        if _reflection_v1_name is None:
            _reflection_v1_name = _register_reflection_v1()
        return _reflection_v1_name


def enable_reflection(service_names: tuple[str, ...], server: grpc.Server) -> None:
    """Serve server reflection as both ``grpc.reflection.v1`` and ``v1alpha`` (tools that speak only
    v1, such as recent grpcurl, get UNIMPLEMENTED from v1alpha alone): one servicer answers both,
    since their messages are the same on the wire."""
    v1_name = reflection_v1_service_name()
    names = (*service_names, reflection.SERVICE_NAME, v1_name)
    servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_registered_method_handlers(
        v1_name,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )


class GrpcServer:
    """A running gRPC server of one service (``service_name``, answered by ``handlers``: a
    ``BoundedServicer``'s) with the standard health service and reflection, the limits, TLS and
    the bind of ``config``. Binds and starts on construction; ``port`` is the port actually bound
    (useful with port 0). Raises ``OSError`` when the address cannot be bound, ``ValueError`` for
    unusable TLS files. ``what`` describes the server in its log lines, written to ``log`` (a
    subclass sets its own module's logger)."""

    log = logging.getLogger(__name__)

    def __init__(
        self,
        service_name: str,
        handlers: dict[str, grpc.RpcMethodHandler],
        config: ServerConfig,
        what: str,
        role: str,
    ) -> None:
        self.config = config
        self._what = what
        # ``role`` (serve, shard, route) labels the metrics; subclasses report what they serve in them
        self.metrics = None if config.metrics_port is None else ServerMetrics(role)
        self.metrics_port: int | None = None  # the port /metrics is served on, once bound
        credentials = None if config.tls_cert is None else server_credentials(config.tls_cert, config.tls_key)
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="datastore"),
            interceptors=[] if self.metrics is None else [self.metrics.interceptor()],
            options=[
                ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not silently share it
                ("grpc.max_receive_message_length", config.max_request_bytes),
                ("grpc.max_send_message_length", config.max_reply_bytes),
            ],
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        )
        self._server.add_registered_method_handlers(service_name, handlers)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        enable_reflection((service_name, health.SERVICE_NAME), self._server)
        target = format_address(config.host, config.port)
        try:
            if credentials is None:
                self.port = self._server.add_insecure_port(target)
            else:
                self.port = self._server.add_secure_port(target, credentials)
        except RuntimeError:
            raise OSError(
                f"cannot listen on {target}: the port is in use or the host is not an address of this machine"
            ) from None
        if self.metrics is not None:
            try:
                self.metrics_port = self.metrics.serve(config.host, config.metrics_port)
            except OSError:
                self._server.stop(None)
                raise
            self.log.info("metrics on http://%s/metrics", format_address(config.host, self.metrics_port))
        self._server.start()
        for service in ("", service_name):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.address = format_address(config.host, self.port)
        self.log.info(
            "%s listening on %s (%s, %d workers)",
            what,
            self.address,
            "TLS" if credentials else "plaintext",
            config.workers,
        )
        warning = exposure_warning(config.host, tls=credentials is not None, token=config.auth_token is not None)
        if warning:
            self.log.warning("%s", warning)

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight ones finish for ``grace`` seconds
        (default: the config's), then return."""
        self._health.enter_graceful_shutdown()
        self._server.stop(self.config.grace_seconds if grace is None else grace).wait()
        if self.metrics is not None:
            self.metrics.stop()
        self.log.info("%s on %s stopped", self._what, self.address)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_until_signalled(
    start: Callable[[contextlib.ExitStack], GrpcServer], ready: Callable[[str], None] | None = None
) -> None:
    """``start(resources)``: open what a server needs into ``resources`` and return the started
    server; then ``ready(address)``, then wait for SIGTERM or SIGINT and close everything in
    reverse (the server first, stopping gracefully). Must run in the main thread (signal
    handlers).

    The wait takes no lock a handler could need: Python runs a handler in the main thread at the
    next bytecode, which may fall inside ``threading.Event.wait``'s own locked section, so a
    handler calling ``Event.set()`` can deadlock the process. Instead the signal's number goes
    to a socket (``signal.set_wakeup_fd``, written by the C-level handler) that the main thread
    reads; a signal that arrives before the read is waiting there."""
    wake_read, wake_write = socket.socketpair()
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    with wake_read, wake_write:
        wake_write.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
        try:
            with contextlib.ExitStack() as resources:
                server = start(resources)
                if ready is not None:
                    ready(server.address)
                while (signum := wake_read.recv(1)[0]) not in previous:
                    pass  # another signal with a Python handler of its own
                server.log.info(
                    "%s received: stopping (grace %.1f s)", signal.Signals(signum).name, server.config.grace_seconds
                )
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
