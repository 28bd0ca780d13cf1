"""Prometheus metrics and structured logs: a real gRPC server on a loopback port with the metrics
interceptor, called through a real channel, then scraped over HTTP from its own /metrics port; the
JSON log format in a fresh interpreter."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from rest_spec.common.logs import JsonFormatter, configure_logging
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.metrics import LATENCY_BUCKETS, ServerMetrics, start_metrics_server
from rest_spec.datastore.outputs import OutputStore
from rest_spec.datastore.server import SERVICE_NAME, DatastoreServer, DatastoreServicer, ServerConfig
from rest_spec.proto.v1 import datastore_pb2 as pb
from tests.helpers import CORPUS_VOCAB, synthetic_corpus, write_index

SLOW_SECONDS = 0.03


def _ok(request: bytes, context) -> bytes:
    return request


def _invalid(request: bytes, context) -> bytes:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")


def _raise(request: bytes, context) -> bytes:
    raise RuntimeError("a bug in the handler")


def _set_code(request: bytes, context) -> bytes:
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details("no such thing")
    return b""


def _slow(request: bytes, context) -> bytes:
    time.sleep(SLOW_SECONDS)
    return request


RELEASE = threading.Event()


def _block(request: bytes, context) -> bytes:
    RELEASE.wait(30)
    return request


def _stream(request: bytes, context):
    yield request
    yield request


REGISTERED = {
    name: grpc.unary_unary_rpc_method_handler(fn)
    for name, fn in (
        ("Ok", _ok),
        ("Invalid", _invalid),
        ("Raise", _raise),
        ("SetCode", _set_code),
        ("Slow", _slow),
        ("Block", _block),
    )
}
REGISTERED["Stream"] = grpc.unary_stream_rpc_method_handler(_stream)


@pytest.fixture
def metrics():
    metrics = ServerMetrics("shard")
    yield metrics
    metrics.stop()


@contextlib.contextmanager
def serving(metrics: ServerMetrics, **options):
    """A gRPC server with the interceptor: ``test.Echo`` registered as the datastore registers its
    service, ``test.Generic`` through a generic handler, and the health service; yields its address."""
    server = grpc.server(ThreadPoolExecutor(max_workers=4), interceptors=[metrics.interceptor()], **options)
    server.add_registered_method_handlers("test.Echo", REGISTERED)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Generic", {"Ok": REGISTERED["Ok"]}),))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


@pytest.fixture
def server(metrics):
    with serving(metrics) as address:
        yield address


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``http://127.0.0.1:port/metrics``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def call(channel: grpc.Channel, method: str) -> grpc.StatusCode:
    try:
        channel.unary_unary(method)(b"hello", timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_requests_counted_by_method_and_final_code(metrics, server):
    with grpc.insecure_channel(server) as channel:
        codes = {method: call(channel, f"/test.Echo/{method}") for method in ("Ok", "Invalid", "Raise", "SetCode")}
        call(channel, "/test.Echo/Ok")
        generic = call(channel, "/test.Generic/Ok")
        unknown = call(channel, "/test.Echo/Missing")
        streamed = list(channel.unary_stream("/test.Echo/Stream")(b"x", timeout=5))
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert codes == {
        "Ok": grpc.StatusCode.OK,
        "Invalid": grpc.StatusCode.INVALID_ARGUMENT,
        "Raise": grpc.StatusCode.UNKNOWN,
        "SetCode": grpc.StatusCode.NOT_FOUND,
    }
    assert generic == grpc.StatusCode.OK and unknown == grpc.StatusCode.UNIMPLEMENTED and streamed == [b"x", b"x"]

    samples = scrape(metrics.serve("127.0.0.1", 0))
    requests = {
        (dict(labels)["method"], dict(labels)["code"]): value
        for (name, labels), value in samples.items()
        if name == "rest_datastore_requests_total"
    }
    assert requests == {
        ("/test.Echo/Ok", "OK"): 2,
        ("/test.Echo/Invalid", "INVALID_ARGUMENT"): 1,
        ("/test.Echo/Raise", "UNKNOWN"): 1,
        ("/test.Echo/SetCode", "NOT_FOUND"): 1,
        ("/test.Generic/Ok", "OK"): 1,
        ("/grpc.health.v1.Health/Check", "OK"): 1,
    }  # the streaming call and the unknown method are not counted
    received = {
        dict(labels)["method"]: value
        for (name, labels), value in samples.items()
        if name == "rest_datastore_requests_received_total"
    }
    assert received == {method: sum(v for (m, _), v in requests.items() if m == method) for method, _ in requests}
    assert sample(samples, "rest_datastore_requests_in_flight", role="shard") == 0
    assert all(dict(labels)["role"] == "shard" for (name, labels) in samples if name.startswith("rest_datastore_"))
    ok = {"role": "shard", "method": "/test.Echo/Ok"}
    assert sample(samples, "rest_datastore_request_seconds_count", **ok) == 2
    assert sample(samples, "rest_datastore_request_seconds_bucket", **ok, le="+Inf") == 2
    assert 0 < sample(samples, "rest_datastore_request_seconds_sum", **ok) < 5
    raised = {"role": "shard", "method": "/test.Echo/Raise"}
    assert sample(samples, "rest_datastore_request_seconds_count", **raised) == 1


def test_calls_refused_over_the_concurrency_limit_are_received_not_answered(metrics):
    """gRPC refuses a call beyond maximum_concurrent_rpcs before its handler runs."""
    in_flight = {"name": "rest_datastore_requests_in_flight", "labels": {"role": "shard"}}
    RELEASE.clear()
    with serving(metrics, maximum_concurrent_rpcs=1) as address, grpc.insecure_channel(address) as channel:
        try:
            blocked = channel.unary_unary("/test.Echo/Block").future(b"first", timeout=30)
            deadline = time.monotonic() + 10
            while metrics.registry.get_sample_value(**in_flight) != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert metrics.registry.get_sample_value(**in_flight) == 1
            assert call(channel, "/test.Echo/Block") == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            RELEASE.set()
        assert blocked.result() == b"first"
    samples = scrape(metrics.serve("127.0.0.1", 0))
    block = {"role": "shard", "method": "/test.Echo/Block"}
    assert sample(samples, "rest_datastore_requests_received_total", **block) == 2
    assert sample(samples, "rest_datastore_requests_total", **block, code="OK") == 1
    assert (
        "rest_datastore_requests_total",
        tuple(sorted({**block, "code": "RESOURCE_EXHAUSTED"}.items())),
    ) not in samples
    assert sample(samples, "rest_datastore_requests_in_flight", role="shard") == 0


def test_latency_lands_in_its_bucket(metrics, server):
    with grpc.insecure_channel(server) as channel:
        for _ in range(3):
            assert call(channel, "/test.Echo/Slow") == grpc.StatusCode.OK
    samples = scrape(metrics.serve("127.0.0.1", 0))
    slow = {"role": "shard", "method": "/test.Echo/Slow"}
    buckets = {
        le: sample(samples, "rest_datastore_request_seconds_bucket", **slow, le=str(le)) for le in LATENCY_BUCKETS
    }
    assert all(count == 0 for le, count in buckets.items() if le < SLOW_SECONDS)
    assert buckets[5.0] == 3 and sample(samples, "rest_datastore_request_seconds_sum", **slow) >= 3 * SLOW_SECONDS


def test_gauges_shards_tokens_and_output_store_read_at_scrape(metrics):
    outputs = OutputStore(max_tokens=100, vocab_size=50)
    metrics.set_shards(3, 12_345)
    metrics.track_output_store(lambda: outputs.num_tokens)
    port = metrics.serve("127.0.0.1", 0)
    samples = scrape(port)
    assert sample(samples, "rest_datastore_shards", role="shard") == 3
    assert sample(samples, "rest_datastore_indexed_tokens", role="shard") == 12_345
    assert sample(samples, "rest_datastore_output_store_tokens", role="shard") == 0
    outputs.add([1, 2, 3, 4])
    outputs.add([5, 6])
    assert sample(scrape(port), "rest_datastore_output_store_tokens", role="shard") == 6
    assert any(name == "process_resident_memory_bytes" for name, _ in samples)


def test_output_store_failure_reads_nan_and_the_scrape_still_answers(metrics, caplog):
    def broken() -> int:
        raise RuntimeError("store closed")

    metrics.set_shards(1, 10)
    metrics.track_output_store(broken)
    samples = scrape(metrics.serve("127.0.0.1", 0))
    assert math.isnan(sample(samples, "rest_datastore_output_store_tokens", role="shard"))
    assert sample(samples, "rest_datastore_shards", role="shard") == 1
    assert "output store size unavailable: store closed" in caplog.text


def test_servers_in_one_process_keep_their_own_metrics(metrics):
    router = ServerMetrics("route")
    try:
        metrics.set_shards(2, 100)
        router.set_shards(8, 400)
        shard_samples, route_samples = scrape(metrics.serve("127.0.0.1", 0)), scrape(router.serve("127.0.0.1", 0))
    finally:
        router.stop()
    assert sample(shard_samples, "rest_datastore_shards", role="shard") == 2
    assert sample(route_samples, "rest_datastore_shards", role="route") == 8
    assert ("rest_datastore_shards", (("role", "route"),)) not in shard_samples


def test_serve_and_stop(metrics):
    port = metrics.serve("127.0.0.1", 0)
    with pytest.raises(RuntimeError, match=f"already served on port {port}"):
        metrics.serve("127.0.0.1", 0)
    with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1 port {port}"):
        ServerMetrics("route").serve("127.0.0.1", port)
    metrics.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    metrics.stop()  # stopping twice is harmless
    assert metrics.serve("127.0.0.1", port) == port  # the port was released


def test_start_metrics_server_on_a_given_registry():
    metrics = ServerMetrics("serve")
    metrics.set_shards(1, 7)
    server = start_metrics_server(0, "127.0.0.1", metrics.registry)
    try:
        assert sample(scrape(server.port), "rest_datastore_indexed_tokens", role="serve") == 7
    finally:
        server.stop()
    with pytest.raises(ConnectionError), socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass


def test_datastore_servicer_calls_and_refusals(metrics, tmp_path):
    """The real datastore handlers behind the interceptor: a draft, a malformed request and a
    token outside the vocabulary (refused with abort) are each counted under their status."""
    index = write_index(tmp_path / "idx", synthetic_corpus(), CORPUS_VOCAB, shard_tokens=10_000)
    with Datastore.open(index) as store:
        server = grpc.server(ThreadPoolExecutor(max_workers=2), interceptors=[metrics.interceptor()])
        server.add_registered_method_handlers(SERVICE_NAME, DatastoreServicer(store, ServerConfig()).handlers())
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                draft = f"/{SERVICE_NAME}/Draft"
                good = pb.DraftRequest(context=pb.Context(tokens=synthetic_corpus()[0][:8])).SerializeToString()
                assert channel.unary_unary(draft)(good, timeout=5)
                with pytest.raises(grpc.RpcError) as malformed:
                    channel.unary_unary(draft)(b"\xff\xff\xff", timeout=5)
                outside = pb.DraftRequest(context=pb.Context(tokens=[CORPUS_VOCAB + 7])).SerializeToString()
                with pytest.raises(grpc.RpcError) as out_of_vocab:
                    channel.unary_unary(draft)(outside, timeout=5)
        finally:
            server.stop(None).wait()
    assert malformed.value.code() == out_of_vocab.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    samples = scrape(metrics.serve("127.0.0.1", 0))
    assert sample(samples, "rest_datastore_requests_total", role="shard", method=draft, code="OK") == 1
    assert sample(samples, "rest_datastore_requests_total", role="shard", method=draft, code="INVALID_ARGUMENT") == 2
    assert sample(samples, "rest_datastore_request_seconds_count", role="shard", method=draft) == 3


def test_datastore_server_with_a_metrics_port(tmp_path):
    """``ServerConfig(metrics_port=0)``: the server itself counts its calls and reports its index
    and output store on its own metrics port, and stops serving them when it stops."""
    index = write_index(tmp_path / "idx", synthetic_corpus(), CORPUS_VOCAB, shard_tokens=2_000)
    config = ServerConfig(port=0, metrics_port=0)
    with Datastore.open(index) as store, OutputStore(10_000, vocab_size=CORPUS_VOCAB) as outputs:
        server = DatastoreServer(store, config, outputs)
        try:
            with grpc.insecure_channel(server.address) as channel:
                good = pb.DraftRequest(context=pb.Context(tokens=synthetic_corpus()[0][:8])).SerializeToString()
                channel.unary_unary(f"/{SERVICE_NAME}/Draft")(good, timeout=5)
                added = pb.AddOutputRequest(tokens=[1, 2, 3, 4]).SerializeToString()
                channel.unary_unary(f"/{SERVICE_NAME}/AddOutput")(added, timeout=5)
            samples = scrape(server.metrics_port)
        finally:
            server.stop(0)
        info = store.info()
    assert len(info.shards) > 1
    assert (
        sample(samples, "rest_datastore_requests_total", role="serve", method=f"/{SERVICE_NAME}/Draft", code="OK") == 1
    )
    assert sample(samples, "rest_datastore_shards", role="serve") == len(info.shards)
    assert sample(samples, "rest_datastore_indexed_tokens", role="serve") == info.num_tokens
    assert sample(samples, "rest_datastore_output_store_tokens", role="serve") == 4
    with pytest.raises(urllib.error.URLError):
        scrape(server.metrics_port)


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role must be one of serve, shard, route, got 'proxy'"):
        ServerMetrics("proxy")


# ---- structured logs --------------------------------------------------------------------------

LOGGING_SCRIPT = """
import logging, sys
from rest_spec.common.logs import configure_logging
configure_logging(logging.INFO, sys.argv[1])
log = logging.getLogger("rest_spec.datastore.server")
log.debug("not shown")
log.info("listening on %s", "127.0.0.1:1", extra={"peer": "ipv4:127.0.0.1:5", "shards": [0, 1], "obj": object()})
log.warning("two\\nlines", extra={"level": "overridden?"})
try:
    1 / 0
except ZeroDivisionError:
    log.exception("failed")
"""


def run_logging(fmt: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", LOGGING_SCRIPT, fmt], capture_output=True, text=True, timeout=60, check=True
    )
    return proc.stderr.splitlines()


def test_json_logs_one_object_per_line_with_extra_fields():
    lines = run_logging("json")
    records = [json.loads(line) for line in lines]
    assert len(records) == 3
    first, second, third = records
    assert first["level"] == "INFO" and first["logger"] == "rest_spec.datastore.server"
    assert first["message"] == "listening on 127.0.0.1:1"
    assert first["peer"] == "ipv4:127.0.0.1:5" and first["shards"] == [0, 1]
    assert first["obj"].startswith("<object object at")
    assert first["time"].endswith("+00:00") and "T" in first["time"]
    assert second["message"] == "two\nlines" and second["level"] == "WARNING"  # the fixed fields win
    assert third["message"] == "failed" and "ZeroDivisionError: division by zero" in third["exception"]
    assert not {"args", "msg", "exc_info", "levelno", "pathname"} & set(first)


def test_text_logs_stay_human_readable():
    lines = run_logging("text")
    assert lines[0].endswith(" INFO rest_spec.datastore.server: listening on 127.0.0.1:1")
    assert "Traceback (most recent call last):" in lines


def test_log_format_is_checked():
    with pytest.raises(ValueError, match="log format must be one of text, json, got 'xml'"):
        configure_logging("INFO", "xml")


def test_json_formatter_on_a_record():
    record = logging.makeLogRecord({"name": "x", "levelname": "ERROR", "msg": "a %s", "args": ("b",), "shard": 3})
    assert json.loads(JsonFormatter().format(record))["shard"] == 3
