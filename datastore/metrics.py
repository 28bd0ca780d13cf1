"""Prometheus metrics of a datastore server (``serve``), a shard server (``shard``) or a router
(``route``), exposed over HTTP on ``--metrics-port``.

Each ``ServerMetrics`` keeps its own ``CollectorRegistry``, so several servers in one process (the
tests) never share or collide on a metric. Every metric carries a ``role`` label, so one scrape
configuration and one dashboard serve the three kinds of process:

    rest_datastore_requests_received_total{role,method}  calls received
    rest_datastore_requests_total{role,method,code}     calls answered by a handler, by final gRPC status
    rest_datastore_requests_in_flight{role}              calls in a handler now
    rest_datastore_request_seconds{role,method}          handler latency (50 us .. 5 s buckets)
    rest_datastore_shards{role}                          shards this process serves
    rest_datastore_indexed_tokens{role}                  corpus tokens in those shards
    rest_datastore_output_store_tokens{role}             live tokens of the output store, read at scrape

plus the process's own CPU, memory and file descriptors (``process_*``).

``method`` is the full gRPC method name (``/rest.datastore.v1.Datastore/Draft``), ``code`` the
status code's name (``OK``, ``INVALID_ARGUMENT``, ...). Only unary-unary calls to registered
methods are counted (the label values are the server's own method names, never a client's
bytes); streaming calls (reflection, health ``Watch``) pass through untouched. gRPC refuses calls
beyond ``--max-concurrent-rpcs`` (RESOURCE_EXHAUSTED) before their handler runs: they are
received but never answered, so received - answered - in flight counts them.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

log = logging.getLogger(__name__)

ROLES = ("serve", "shard", "route")
# From a draft on a warm index in process (tens to hundreds of microseconds:
# benchmarks/results/retrieval.json, in_process_latency) to a routed batch or a cold disk (seconds).
LATENCY_BUCKETS = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
    5.0,
)


class MetricsServer:
    """A running ``/metrics`` endpoint (``start_metrics_server``); ``port`` is the port actually
    bound (useful with port 0)."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd, self._thread = httpd, thread
        self.port: int = httpd.server_port

    def stop(self) -> None:
        """Stop answering and release the port; returns once the serving thread has ended."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` (port 0: a free one) on a daemon thread
    until ``stop()``. Raises ``OSError`` naming the address when it cannot be bound."""
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # the port is taken, the host is not an address of this machine
        raise OSError(f"cannot serve metrics on {host} port {port}: {exc.strerror or exc}") from None
    log.info("metrics on %s port %d (/metrics)", host, httpd.server_port)
    return MetricsServer(httpd, thread)


class _MetricsInterceptor(grpc.ServerInterceptor):
    """Times each unary-unary call and counts it by its final status: the code the handler set
    (``set_code``, or ``abort``, which sets it and raises), else OK when it returned and UNKNOWN
    when it raised (what gRPC answers then). The labelled children are looked up once per method
    and code (a ``labels`` call costs more than the update)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        role = metrics.role
        self._in_flight = metrics._in_flight.labels(role)
        self._per_method = functools.cache(
            lambda method: (metrics._received.labels(role, method), metrics._latency.labels(role, method))
        )
        self._answered = functools.cache(lambda method, code: metrics._answered.labels(role, method, code.name))

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method, behavior = handler_call_details.method, handler.unary_unary
        received, latency = self._per_method(method)
        received.inc()
        in_flight = self._in_flight

        def timed(request, context: grpc.ServicerContext):
            start = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            in_flight.inc()
            try:
                response = behavior(request, context)
                code = grpc.StatusCode.OK
                return response
            finally:
                in_flight.dec()
                latency.observe(time.perf_counter() - start)
                self._answered(method, context.code() or code).inc()

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class ServerMetrics:
    """The metrics of one server process in role ``serve``, ``shard`` or ``route``: pass
    ``interceptor()`` to ``grpc.server(interceptors=...)``, report what is served with
    ``set_shards``/``track_output_store``, and expose it all with ``serve(host, port)``."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role = role
        self.registry = CollectorRegistry() if registry is None else registry
        ProcessCollector(registry=self.registry)
        self._received = Counter(
            "rest_datastore_requests_received",
            "gRPC calls received, by method",
            ("role", "method"),
            registry=self.registry,
        )
        self._answered = Counter(
            "rest_datastore_requests",
            "gRPC calls answered by a handler, by method and final status code",
            ("role", "method", "code"),
            registry=self.registry,
        )
        self._in_flight = Gauge(
            "rest_datastore_requests_in_flight", "gRPC calls in a handler now", ("role",), registry=self.registry
        )
        self._in_flight.labels(role).set(0)  # a 0 from the start, not absent until the first call
        self._latency = Histogram(
            "rest_datastore_request_seconds",
            "time in the handler of a gRPC call, by method",
            ("role", "method"),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._shards = Gauge("rest_datastore_shards", "index shards served", ("role",), registry=self.registry)
        self._tokens = Gauge(
            "rest_datastore_indexed_tokens", "corpus tokens in the shards served", ("role",), registry=self.registry
        )
        self._outputs = Gauge(
            "rest_datastore_output_store_tokens",
            "live tokens in the output store of recent generations",
            ("role",),
            registry=self.registry,
        )
        self._server: MetricsServer | None = None
        self._lock = threading.Lock()

    def interceptor(self) -> grpc.ServerInterceptor:
        """A server interceptor that counts and times every unary-unary call."""
        return _MetricsInterceptor(self)

    def set_shards(self, shards: int, tokens: int) -> None:
        """This process serves ``shards`` shards holding ``tokens`` corpus tokens."""
        self._shards.labels(self.role).set(shards)
        self._tokens.labels(self.role).set(tokens)

    def track_output_store(self, num_tokens: Callable[[], int]) -> None:
        """Read the output store's size from ``num_tokens()`` at every scrape. A call that fails
        (the store is closing) reads as NaN rather than failing the whole scrape."""

        def read() -> float:
            try:
                return float(num_tokens())
            except Exception as exc:
                log.warning("output store size unavailable: %s", exc)
                return math.nan

        self._outputs.labels(self.role).set_function(read)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) until ``stop()``; returns the port
        bound. Raises ``OSError`` naming the address when it cannot be bound."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"metrics are already served on port {self._server.port}")
            self._server = start_metrics_server(port, host, self.registry)
            return self._server.port

    def stop(self) -> None:
        """Stop serving ``/metrics`` (a no-op when not serving)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()
