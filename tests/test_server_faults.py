"""Fault injection for the gRPC service, every client hostile: a real server on 127.0.0.1 over a
real index answers oversized and malformed requests, expired and cancelled calls, more calls than
it admits, TLS and bearer-token clients, a corrupt index and a full disk with a clear status, a
few log lines and no traceback, and keeps serving; and it says it is ready only once it is."""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rest_spec.common.types import DraftConfig
from rest_spec.datastore import wire
from rest_spec.datastore.__main__ import main as cli
from rest_spec.datastore.client import DatastoreClient
from rest_spec.datastore.format import IndexCorruptError
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.outputs import OutputStore, OutputStoreWriteError, open_output_store
from rest_spec.datastore.rpc import MAX_MESSAGE_BYTES, LogBudget, ServerConfig, exposure_warning, is_loopback, status_of
from rest_spec.datastore.server import SERVICE, SERVICE_NAME, DatastoreServer
from rest_spec.proto.v1 import datastore_pb2 as pb
from rest_spec.proto.v1 import datastore_pb2_grpc as pb_grpc
from tests.helpers import CORPUS_VOCAB as VOCAB
from tests.helpers import contexts_from, synthetic_corpus, write_index

ROOT = Path(__file__).resolve().parents[1]
DOCS = synthetic_corpus()
# limits a test lifts to reach the deadline and cancellation checks with a huge batch
UNBOUNDED = dict(max_batch_contexts=10**6, max_request_bytes=MAX_MESSAGE_BYTES, max_reply_bytes=MAX_MESSAGE_BYTES)
TOKEN = "s3cr3t-T0ken"


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return write_index(tmp_path_factory.mktemp("faults") / "idx", DOCS, VOCAB, shard_tokens=10_000)


@pytest.fixture(scope="module")
def store(index):
    with Datastore.open(index) as store:
        yield store


@contextlib.contextmanager
def serving(store, outputs=None, **config):
    """A server on a free loopback port (``config``: ServerConfig fields) and a plaintext channel
    that accepts replies of any size, so a test sees what the server sends."""
    with (
        DatastoreServer(store, ServerConfig(port=0, **config), outputs) as server,
        grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", -1)]) as channel,
    ):
        yield server, channel


def raw(channel: grpc.Channel, method: str):
    """The method as bytes in, bytes out: what a client in any language (or a fuzzer) can send."""
    return channel.unary_unary(f"/{SERVICE_NAME}/{method}")


def refusal(call) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def small_draft(channel: grpc.Channel, timeout: float) -> pb.DraftReply:
    return pb_grpc.DatastoreStub(channel).Draft(wire.draft_request(DOCS[0][:20], DraftConfig()), timeout=timeout)


# ---- bounded work per call ------------------------------------------------------------------------

SHORT_CONTEXTS = [doc[:2] for doc in DOCS] * 100  # 20,000 contexts of 2 tokens: a 7 MB reply unchecked


def test_a_batch_of_20000_short_contexts_is_refused_naming_the_limit(store):
    request = wire.draft_batch_request(SHORT_CONTEXTS, DraftConfig()).SerializeToString()
    with serving(store) as (server, channel):
        code, details = refusal(lambda: raw(channel, "DraftBatch")(request, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            details == "contexts has 20000 entries, more than this server's limit of 1024 "
            "(--max-batch-contexts): split the batch"
        )
        assert len(small_draft(channel, timeout=10).tree.tokens) > 0


def _refused_after(details: str) -> int:
    """How many contexts a server drafted before refusing a reply over its limit."""
    match = re.fullmatch(
        r"the reply to (\d+) contexts exceeds this server's limit of (\d+) bytes after (\d+) \(--max-reply-bytes\): "
        r"send fewer contexts or ask for smaller trees",
        details,
    )
    assert match, details
    return int(match.group(3))


@pytest.mark.server
def test_a_reply_over_the_limit_is_refused_before_the_batch_is_drafted(store):
    """20,000 short contexts within a raised context limit, and 1,000 contexts with large trees
    within the default limits: RESOURCE_EXHAUSTED once the reply would pass 4,000,000 bytes, long
    before the last context (bounded work), never a reply a stock client refuses."""
    big = DraftConfig(budget=1024, max_depth=64, n_min=1)
    large = [
        c for c in contexts_from(DOCS, 200, seed=5) if wire.field_size(wire.tree_to_message(store.draft(c, big))) > 8000
    ]
    # budget 128: a 9 MB reply unchecked, so the 4 MB limit is reached before half of it
    cases = [
        (SHORT_CONTEXTS, DraftConfig(budget=128), {"max_batch_contexts": 20_000}),
        ((large * 1000)[:1000], big, {}),
    ]
    for contexts, config, limits in cases:
        with serving(store, **limits) as (server, channel):
            request = wire.draft_batch_request(contexts, config).SerializeToString()
            code, details = refusal(lambda: raw(channel, "DraftBatch")(request, timeout=60))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _refused_after(details) < len(contexts) / 2
            assert len(small_draft(channel, timeout=10).tree.tokens) > 0


def test_a_request_over_the_byte_limit_is_refused_by_the_transport(store):
    huge = pb.DraftRequest(context=pb.Context(tokens=[1] * 5_000_000)).SerializeToString()
    assert len(huge) > 4 << 20
    with serving(store) as (server, channel):
        code, details = refusal(lambda: raw(channel, "Draft")(huge, timeout=30))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and str(4 << 20) in details
    with serving(store, max_request_bytes=16 << 20) as (server, channel):
        code, details = refusal(lambda: raw(channel, "Draft")(huge, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == "context has 5000000 tokens, more than this server's limit of 4096 (--max-context-tokens)"


# ---- malformed requests and the log ---------------------------------------------------------------

GARBAGE = [b"\xff", b"garbage", b"\x0a\x05\x01", b"\x80" * 11, b"\x0a\xff\xff\xff\xff\x0f"]


def test_undecodable_bytes_are_invalid_argument_without_a_traceback(store, caplog):
    caplog.set_level(logging.DEBUG)
    with serving(store) as (server, channel):
        for method in SERVICE.methods:
            for data in GARBAGE:
                code, details = refusal(lambda: raw(channel, method.name)(data, timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert (
                    details == f"malformed {method.input_type.name}: the request bytes do not decode as "
                    f"{method.input_type.full_name}"
                )
        assert len(small_draft(channel, timeout=10).tree.tokens) > 0
    assert "Traceback" not in caplog.text


def test_a_flood_of_bad_requests_costs_a_few_short_log_lines(store, caplog):
    # the server's own logger, whatever level an earlier in-process CLI run left on "rest_spec"
    caplog.set_level(logging.DEBUG, logger="rest_spec.datastore.server")
    bad = [b"\xff", wire.draft_request([1, VOCAB + 5], DraftConfig()).SerializeToString()]
    started = time.monotonic()
    with serving(store) as (server, channel):
        for i in range(300):
            code, _ = refusal(lambda: raw(channel, "Draft")(bad[i % 2], timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
    allowed = 10 + (time.monotonic() - started) / 6 + 1  # LogBudget's default burst, then one line per 6 s
    lines = [
        r.getMessage() for r in caplog.records if r.name == "rest_spec.datastore.server" and "refused" in r.getMessage()
    ]
    assert 1 <= len(lines) <= allowed and all(len(line) < 400 and "\n" not in line for line in lines)
    assert "Traceback" not in caplog.text


def test_log_budget_allows_a_burst_then_counts_what_it_suppressed():
    budget = LogBudget(burst=2, interval=0.05)
    assert [budget.take() for _ in range(5)] == [0, 0, None, None, None]
    time.sleep(0.2)  # longer only refills more, up to the burst
    assert budget.take() == 3 and budget.take() == 0


@pytest.mark.parametrize(
    "exc, code",
    [
        (ValueError("context is empty"), grpc.StatusCode.INVALID_ARGUMENT),
        (IndexCorruptError("index file x.sa.npy is corrupt"), grpc.StatusCode.DATA_LOSS),
        (
            OutputStoreWriteError(OSError(errno.ENOSPC, "No space left on device"), "full"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            OutputStoreWriteError(OSError(errno.EDQUOT, "Disk quota exceeded"), "quota"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (OutputStoreWriteError(OSError(errno.EFBIG, "File too large"), "limit"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (OutputStoreWriteError(OSError(errno.EIO, "Input/output error"), "failing disk"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)
def test_each_failure_has_its_status(exc, code):
    assert status_of(exc)[0] == code


# ---- deadlines, cancellation, the concurrency cap --------------------------------------------------


@pytest.fixture(scope="module")
def endless_batch() -> bytes:
    """About 200,000 contexts of 4 tokens (2 MB): half a minute or more of drafting on this machine
    if nothing stopped it."""
    contexts = [doc[i : i + 4] for doc in DOCS for i in range(0, 18, 2)] * 111
    return wire.draft_batch_request(contexts, DraftConfig()).SerializeToString()


@pytest.mark.server
def test_work_stops_when_the_deadline_passes(store, endless_batch):
    """One worker: had the expired batch gone on, the next call would wait behind it and time out."""
    with serving(store, workers=1, **UNBOUNDED) as (server, channel):
        code, _ = refusal(lambda: raw(channel, "DraftBatch")(endless_batch, timeout=1))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(small_draft(channel, timeout=15).tree.tokens) > 0


def test_excess_calls_are_refused_and_cancelled_calls_stop(store, endless_batch):
    with serving(store, workers=3, max_concurrent_rpcs=2, **UNBOUNDED) as (server, channel):

        def send_batch():
            return raw(channel, "DraftBatch").future(endless_batch, timeout=120)

        calls = [send_batch() for _ in range(2)]
        for _ in range(200):  # until both batches are in flight
            # a probe admitted before a batch arrived crowds that batch out: send it again
            calls = [send_batch() if call.done() else call for call in calls]
            try:
                small_draft(channel, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert exc.details() == "Concurrent RPC limit exceeded!"
                break
            time.sleep(0.05)
        else:
            states = [f"{call.code()}: {call.details()}" if call.done() else "running" for call in calls]
            pytest.fail(f"the third call in flight was admitted; the two batches: {states}")
        for call in calls:
            call.cancel()
        deadline = time.monotonic() + 15  # far less than the batches would take
        while True:  # the slots free up once the cancelled batches stop
            try:
                assert len(small_draft(channel, timeout=10).tree.tokens) > 0
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
                time.sleep(0.1)


# ---- TLS and bearer tokens -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pem(tmp_path_factory) -> dict[str, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 with its key, and another pair."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    directory = tmp_path_factory.mktemp("pem")
    files = {}
    for name in ("server", "other"):
        files[name], files[f"{name}_key"] = directory / f"{name}.pem", directory / f"{name}.key"
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
                "-keyout",
                str(files[f"{name}_key"]),
                "-out",
                str(files[name]),
            ],
            check=True,
            capture_output=True,
        )
    return files


def test_tls_serves_a_client_that_trusts_the_certificate(store, pem):
    config = ServerConfig(port=0, tls_cert=pem["server"], tls_key=pem["server_key"])
    context = DOCS[3][:25]
    with DatastoreServer(store, config) as server, DatastoreClient(server.address, tls_ca=pem["server"]) as client:
        assert client.info() == store.info()
        assert client.draft(context) == store.draft(context)


@pytest.mark.server
def test_tls_refuses_another_ca_and_plaintext(store, pem):
    config = ServerConfig(port=0, tls_cert=pem["server"], tls_key=pem["server_key"])
    with DatastoreServer(store, config) as server:
        for tls_ca in (pem["other"], None):
            with pytest.raises(ConnectionError, match=f"cannot reach datastore at {server.address}"):
                DatastoreClient(server.address, tls_ca=tls_ca, timeout=1)


def test_unusable_tls_files_are_one_line_errors(store, pem, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    with pytest.raises(
        ValueError,
        match=r"cannot serve TLS with certificate .*server.pem and key .*other.key: "
        r"KEY_VALUES_MISMATCH",
    ):
        DatastoreServer(store, ServerConfig(port=0, tls_cert=pem["server"], tls_key=pem["other_key"]))
    with pytest.raises(ValueError, match=r"missing.pem .*: No such file or directory"):
        DatastoreServer(store, ServerConfig(port=0, tls_cert=tmp_path / "missing.pem", tls_key=pem["server_key"]))
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        ServerConfig(tls_cert=pem["server"])
    with pytest.raises(ValueError, match=r"cannot use TLS CA certificate .*not.pem: .*expected a PEM file"):
        DatastoreClient("127.0.0.1:1", tls_ca=not_pem)


def _metadata(token: str | None):
    return () if token is None else (wire.bearer_metadata(token),)


def test_a_bearer_token_guards_add_output(store):
    with OutputStore(100, vocab_size=VOCAB) as outputs, serving(store, outputs, auth_token=TOKEN) as (server, channel):
        stub = pb_grpc.DatastoreStub(channel)
        for token in (None, "wrong", TOKEN + "x"):
            code, details = refusal(
                lambda: stub.AddOutput(pb.AddOutputRequest(tokens=[1, 2]), metadata=_metadata(token))
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in details
        assert len(outputs) == 0
        assert stub.AddOutput(pb.AddOutputRequest(tokens=[1, 2]), metadata=_metadata(TOKEN)).seq == 0
        assert len(stub.Draft(wire.draft_request(DOCS[0][:20], DraftConfig())).tree.tokens) > 0  # drafts stay open
        with DatastoreClient(server.address, auth_token=TOKEN) as client:
            assert client.add_output([3, 4]) == 1
        with DatastoreClient(server.address) as client, pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            client.add_output([3, 4])


def test_a_bearer_token_for_all_calls_leaves_health_open(store):
    with serving(store, auth_token=TOKEN, auth_scope="all") as (server, channel):
        stub = pb_grpc.DatastoreStub(channel)
        for call in (
            lambda m: stub.Info(pb.InfoRequest(), metadata=m),
            lambda m: stub.Draft(wire.draft_request([1, 2], DraftConfig()), metadata=m),
        ):
            code, _ = refusal(lambda: call(_metadata(None)))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            call(_metadata(TOKEN))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with DatastoreClient(server.address) as client, pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            client.info()
        with DatastoreClient(server.address, auth_token=TOKEN) as client:
            assert client.info() == store.info()


def test_a_token_without_tls_is_warned_about_once(store, caplog):
    caplog.set_level(logging.WARNING, logger="rest_spec.datastore.server")
    with serving(store, auth_token=TOKEN):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["a bearer token without TLS: it travels in the clear (--tls-cert/--tls-key)"]
    assert TOKEN not in caplog.text


def test_generation_clis_reach_a_tls_server_with_a_token(store, pem, monkeypatch):
    """rest-generate and rest-chat: --tls-ca and --auth-token (or $REST_TLS_CA, $REST_AUTH_TOKEN)
    for a --datastore HOST:PORT."""
    from rest_spec.drafter.cli.rest_generate import build_parser
    from rest_spec.drafter.hf.session import open_drafter

    config = ServerConfig(port=0, tls_cert=pem["server"], tls_key=pem["server_key"], auth_token=TOKEN, auth_scope="all")
    with DatastoreServer(store, config) as server:
        monkeypatch.setenv("REST_AUTH_TOKEN", TOKEN)
        args = build_parser().parse_args(
            ["--prompt", "x", "--datastore", server.address, "--tls-ca", str(pem["server"])]
        )
        assert (args.tls_ca, args.auth_token) == (str(pem["server"]), TOKEN)
        with open_drafter(args.datastore, tls_ca=args.tls_ca, auth_token=args.auth_token) as drafter:
            assert drafter.draft(DOCS[4][:30], DraftConfig()) == store.draft(DOCS[4][:30], DraftConfig())


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("example.org", False),
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) == loopback


def test_exposure_warnings():
    assert (
        exposure_warning("0.0.0.0", tls=False, token=False)
        == "serving 0.0.0.0 without TLS: requests and replies are readable on the network (--tls-cert/--tls-key)"
    )
    assert "requests, replies and the bearer token are readable" in exposure_warning("10.0.0.1", tls=False, token=True)
    assert "bearer token without TLS" in exposure_warning("127.0.0.1", tls=False, token=True)
    assert exposure_warning("127.0.0.1", tls=False, token=False) is None
    assert exposure_warning("0.0.0.0", tls=True, token=True) is None


# ---- the server as a process: TLS and token from the CLI, a corrupt index, a full disk, readiness ---


def serve_argv(*args) -> list[str]:
    """``python -m rest_spec.datastore serve --port 0 ARGS``."""
    return [sys.executable, "-m", "rest_spec.datastore", "serve", "--port", "0", *map(str, args)]


def serve_until_exit(*args) -> subprocess.CompletedProcess:
    """A ``serve`` expected to refuse to start: its exit status and output."""
    return subprocess.run(serve_argv(*args), cwd=ROOT, capture_output=True, text=True, timeout=120)


class ServerProcess:
    """``python -m rest_spec.datastore serve ARGS`` with its merged stdout and stderr drained into ``lines``
    (so its log never blocks it); ``address`` once it printed "listening on", or ``error``."""

    def __init__(self, *args: str, startup_seconds: float = 120) -> None:
        self.proc = subprocess.Popen(
            serve_argv(*args),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        self._listening.wait(startup_seconds)
        self.address = self.lines[-1].split()[-1] if self._listening.is_set() else None

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("listening on "):
                self._listening.set()
        self._listening.set()  # exited without listening

    def stop(self) -> str:
        """SIGTERM, a clean exit, and everything it wrote."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=30) == 0, self.output
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.output

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


@pytest.mark.server
def test_cli_serves_tls_with_a_token_file_and_clients_pass_both(index, pem, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = ServerProcess(
        "--index",
        index,
        "--tls-cert",
        pem["server"],
        "--tls-key",
        pem["server_key"],
        "--auth-token-file",
        token_file,
        "--auth-scope",
        "all",
    )
    try:
        assert server.address, server.output
        secure = ["info", "--server", server.address, "--tls-ca", str(pem["server"])]
        assert cli([*secure, "--auth-token", TOKEN]) == 0
        assert '"vocab_size": 500' in capsys.readouterr().out
        assert cli(secure) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "UNAUTHENTICATED" in err
    finally:
        output = server.stop()
    assert "Traceback" not in output and TOKEN not in output and "without TLS" not in output


@pytest.fixture(scope="module")
def corrupt_index(tmp_path_factory) -> Path:
    """One shard of over 100,000 tokens whose suffix array holds out-of-range entries between 60 %
    and 80 % of its ranks: where the checks at open (sizes, headers, the first and last 64 KiB) do
    not look and the warm-up's search (token 0, the lowest ranks) does not reach, but where the
    second step of every search for a high token id lands."""
    path = write_index(tmp_path_factory.mktemp("corrupt") / "idx", DOCS * 10, VOCAB)
    sa = next(path.glob("*.sa.npy"))
    data = bytearray(sa.read_bytes())
    start, end = (int(len(data) * f) & ~7 for f in (0.6, 0.8))
    assert 1 << 16 < start and end < len(data) - (1 << 16)
    data[start:end] = b"\x7f" * (end - start)
    sa.write_bytes(bytes(data))
    return path


def test_a_corrupt_index_is_data_loss_and_the_server_keeps_serving(corrupt_index):
    server = ServerProcess("--index", corrupt_index, "--workers", "2")
    try:
        assert server.address, server.output
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.DatastoreStub(channel)
            for _ in range(3):
                code, details = refusal(
                    lambda: stub.Draft(wire.draft_request([7, VOCAB - 2], DraftConfig()), timeout=10)
                )
                assert code == grpc.StatusCode.DATA_LOSS
                assert re.match(r"index file \S+\.sa\.npy is corrupt: suffix-array entry \d+ = \d+", details), details
            assert stub.Info(pb.InfoRequest(), timeout=10).vocab_size == VOCAB
    finally:
        output = server.stop()
    assert "Traceback" not in output and "is corrupt" in output


def test_check_index_refuses_to_serve_a_corrupt_index(corrupt_index):
    result = serve_until_exit("--index", corrupt_index, "--check-index")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("rest-datastore: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert ".sa.npy" in result.stderr and "Traceback" not in result.stderr


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (root only; skipped where mounting is not permitted)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.server
def test_a_full_disk_refuses_additions_and_keeps_every_acknowledged_one(index, small_tmpfs):
    """Fill the disk under --outputs-dir: additions are refused with RESOURCE_EXHAUSTED; free
    space: they are acknowledged again; restart: exactly the acknowledged ones are there, and
    no sequence number comes twice."""
    directory, filler = small_tmpfs / "outputs", small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (200 << 10))
    outputs = [np.random.default_rng(i).integers(0, VOCAB, 1000).tolist() for i in range(100)]
    acknowledged, refused = [], 0
    server = ServerProcess("--index", index, "--outputs-dir", directory)
    try:
        assert server.address, server.output
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.DatastoreStub(channel)

            def add(tokens) -> bool:
                try:
                    acknowledged.append((stub.AddOutput(pb.AddOutputRequest(tokens=tokens), timeout=10).seq, tokens))
                    return True
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert "No space left on device" in exc.details()
                    return False

            pending = iter(outputs)
            while refused < 2:  # until two additions were refused
                refused += not add(next(pending))
            filler.unlink()
            assert all(add(next(pending)) for _ in range(3))
    finally:
        output = server.stop()
    assert len(acknowledged) >= 4 and "Traceback" not in output
    seqs = [seq for seq, _ in acknowledged]
    assert seqs == sorted(set(seqs))
    server = ServerProcess("--index", index, "--outputs-dir", directory)
    try:
        with grpc.insecure_channel(server.address) as channel:
            assert pb_grpc.DatastoreStub(channel).AddOutput(pb.AddOutputRequest(tokens=[1]), timeout=10).seq > seqs[-1]
    finally:
        server.stop()
    with open_output_store(10**6, directory, vocab_size=VOCAB) as store:
        assert [d.tolist() for d in store.documents()] == [tokens for _, tokens in acknowledged] + [[1]]


def test_ready_means_ready(index):
    """The kernels are compiled before the address is printed, and the first call is answered
    within the deadline every client uses by default."""
    server = ServerProcess("--index", index)
    try:
        assert server.address, server.output
        before = server.lines[:-1]
        assert any("retrieval kernels ready in" in line for line in before), server.output
        with DatastoreClient(server.address) as client:  # 5 s deadline, as the quick start's client
            started = time.perf_counter()
            assert len(client.draft(DOCS[2][:20])) > 0
            first = time.perf_counter() - started
        assert first < 5
    finally:
        server.stop()


@pytest.mark.server
def test_a_damaged_outputs_log_is_refused_until_serve_is_told_to_salvage_it(index, tmp_path):
    """A record damaged in the middle of --outputs-dir's log: `serve` refuses in one line naming
    --outputs-salvage; with the flag it serves every other acknowledged output."""
    directory = tmp_path / "outputs"
    documents = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with OutputStore(1000, directory, vocab_size=VOCAB) as store:
        for tokens in documents:
            store.add(tokens)
    log = directory / "outputs.log"
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the second record
    log.write_bytes(bytes(data))
    refused = serve_until_exit("--index", index, "--outputs-dir", directory)
    assert refused.returncode == 1 and refused.stdout == ""
    error = refused.stderr.splitlines()[-1]  # after serve's INFO log lines
    assert error.startswith("rest-datastore: error: ") and "--outputs-salvage" in error, refused.stderr
    assert "Traceback" not in refused.stderr
    assert log.read_bytes() == bytes(data)  # refusing changes nothing
    server = ServerProcess("--index", index, "--outputs-dir", directory, "--outputs-salvage")
    try:
        assert server.address, server.output
    finally:
        output = server.stop()
    assert "salvaged 2 valid records" in output and "Traceback" not in output
    with open_output_store(1000, directory, vocab_size=VOCAB) as store:
        assert [d.tolist() for d in store.documents()] == [documents[0], documents[2]]
