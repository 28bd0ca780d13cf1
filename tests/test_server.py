"""The gRPC service end to end: a real server on a loopback port over a real index built with
IndexWriter, called through the generated stubs; and the ``rest-datastore`` CLI."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.datastore import wire
from rest_spec.datastore.__main__ import main as cli
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.outputs import OutputStore
from rest_spec.datastore.server import SERVICE_NAME, DatastoreServer, ServerConfig
from rest_spec.proto.v1 import datastore_pb2 as pb
from rest_spec.proto.v1 import datastore_pb2_grpc as pb_grpc
from tests.helpers import CORPUS_VOCAB as VOCAB
from tests.helpers import UNSEEN, contexts_from, synthetic_corpus, write_index

MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    docs = synthetic_corpus()
    return write_index(tmp_path_factory.mktemp("server") / "idx", docs, VOCAB, shard_tokens=10_000), docs


@pytest.fixture(scope="module")
def store(index):
    with Datastore.open(index[0]) as store:
        yield store


@pytest.fixture(scope="module")
def server(store):
    with DatastoreServer(store, ServerConfig(port=0, workers=4, max_context_tokens=MAX_CONTEXT)) as server:
        yield server


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.DatastoreStub(channel)


def request(context, **params):
    return pb.DraftRequest(context=pb.Context(tokens=context), params=pb.DraftParams(**params))


def test_binds_a_free_port(server):
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"


def test_draft_answers_what_the_engine_answers(index, store, stub):
    config = DraftConfig(budget=32, max_depth=8)
    trees = []
    for context in contexts_from(index[1], 20):
        reply = stub.Draft(wire.draft_request(context, config))
        trees.append(wire.tree_from_message(reply.tree))
        assert trees[-1] == store.draft(context, config)
    assert sum(len(t) > 0 for t in trees) >= 15


def test_unset_params_use_the_defaults(index, store, stub):
    context = index[1][0][:30]
    assert wire.tree_from_message(stub.Draft(request(context)).tree) == store.draft(context, DraftConfig())


def test_no_match_is_an_empty_tree(stub):
    reply = stub.Draft(request([1, 2, UNSEEN]))
    assert len(reply.tree.tokens) == 0 and reply.tree.match_len == 0


def test_draft_batch_replies_in_order(index, store, stub):
    contexts = contexts_from(index[1], 12, seed=1) + [[3, UNSEEN]]
    config = DraftConfig(budget=16)
    reply = stub.DraftBatch(wire.draft_batch_request(contexts, config))
    assert [wire.tree_from_message(t) for t in reply.trees] == [store.draft(c, config) for c in contexts]
    assert len(stub.DraftBatch(pb.DraftBatchRequest()).trees) == 0


def test_info_describes_the_index(store, stub):
    info = wire.info_from_message(stub.Info(pb.InfoRequest()))
    assert info == store.info()
    assert (info.tokenizer_name, info.vocab_size, len(info.shards)) == ("test-tok", VOCAB, 2)


BAD_REQUESTS = {
    "empty context": (request([]), "context is empty"),
    "context too long": (request(list(range(MAX_CONTEXT + 1))), f"limit of {MAX_CONTEXT}"),
    "token out of vocabulary": (request([1, VOCAB]), r"context\[1\] = 500 is outside the vocabulary"),
    "budget": (request([1, 2], budget=5000), "budget"),
    "max_depth": (request([1, 2], max_depth=65), "max_depth"),
    "n_max": (request([1, 2], n_max=65), "n_max"),
    "n_min": (request([1, 2], n_min=65), "n_min"),
    "n_min above n_max": (request([1, 2], n_min=9, n_max=4), "n_max"),
}


@pytest.mark.parametrize("bad, message", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_invalid_argument_and_the_server_keeps_serving(index, stub, bad, message):
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() and re.search(message, err.value.details())
    assert len(stub.Draft(request(index[1][0][:20])).tree.tokens) > 0


def test_bad_context_in_a_batch_is_named(stub):
    batch = pb.DraftBatchRequest(contexts=[pb.Context(tokens=[1]), pb.Context(tokens=[2, 9999])])
    with pytest.raises(grpc.RpcError) as err:
        stub.DraftBatch(batch)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("contexts[1][1] = 9999")


def test_engine_failure_is_internal_logged_and_not_fatal(index, caplog):
    """A closed store makes every draft fail inside the engine: INTERNAL, traceback in the log."""
    store = Datastore.open(index[0])
    with DatastoreServer(store, ServerConfig(port=0)) as server, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.DatastoreStub(channel)
        store.close()
        with caplog.at_level(logging.ERROR, logger="rest_spec.datastore.server"), pytest.raises(grpc.RpcError) as err:
            stub.Draft(request([1, 2]))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert any(r.exc_info and "closed" in str(r.exc_info[1]) for r in caplog.records)
        assert stub.Info(pb.InfoRequest()).vocab_size == VOCAB


def test_health_is_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_every_service(channel, version):
    # v1 and v1alpha messages are the same on the wire; a v1-only client differs by the method path.
    info = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    [listing] = info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in listing.list_services_response.service}
    assert names == {
        SERVICE_NAME,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    replies = info(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=n) for n in sorted(names)]))
    for name, reply in zip(sorted(names), replies):
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in reply.file_descriptor_response.file_descriptor_proto
        ]
        package, service = name.rsplit(".", 1)
        assert any(f.package == package and service in {s.name for s in f.service} for f in files), name


def test_concurrent_clients_get_their_own_answers(index, store, server):
    contexts = contexts_from(index[1], 48, seed=2)
    config = DraftConfig(budget=24)
    expected = [store.draft(c, config) for c in contexts]

    def client(part: int) -> list:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.DatastoreStub(channel)
            return [
                (i, wire.tree_from_message(stub.Draft(wire.draft_request(contexts[i], config)).tree))
                for i in range(part, len(contexts), 6)
            ]

    with ThreadPoolExecutor(6) as pool:
        answers = [pair for part in pool.map(client, range(6)) for pair in part]
    assert len(answers) == len(contexts)
    assert all(tree == expected[i] for i, tree in answers)


def test_a_busy_port_is_refused(store, server):
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        DatastoreServer(store, ServerConfig(port=server.port))


@pytest.mark.parametrize(
    "field, value",
    [("port", 70000), ("workers", 0), ("max_context_tokens", 10), ("grace_seconds", -1), ("outputs_max_tokens", -1)],
)
def test_server_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


# ---- the output store ---------------------------------------------------------------------------

OUTPUT = [7, 8, 9, 10, 11, 7, 8, 12]


@pytest.fixture
def outputs_stub(store):
    """A stub of a server with an empty output store of 100 tokens, and the store."""
    with (
        OutputStore(100, vocab_size=VOCAB) as outputs,
        DatastoreServer(store, ServerConfig(port=0), outputs) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        yield pb_grpc.DatastoreStub(channel), outputs


def test_added_outputs_are_drafted_in_the_same_reply_as_the_index(index, store, outputs_stub):
    stub, outputs = outputs_stub
    assert stub.AddOutput(pb.AddOutputRequest(tokens=OUTPUT)).seq == 0
    assert stub.AddOutput(pb.AddOutputRequest(tokens=[1, 2, 3])).seq == 1
    context = [*index[1][0][:10], 7, 8]
    config = DraftConfig(budget=16)
    reply = stub.Draft(wire.draft_request(context, config, include_outputs=True))
    assert wire.tree_from_message(reply.tree) == store.draft(context, config)
    drafted = wire.tree_from_message(reply.outputs)
    assert drafted == outputs.draft(context, config)
    assert drafted.paths() == [(9,), (12,)] + [tuple(OUTPUT[2:k]) for k in range(4, 9)]  # both 7 8 of OUTPUT
    assert not stub.Draft(wire.draft_request(context, config)).HasField("outputs")  # only when asked for
    batch = stub.DraftBatch(wire.draft_batch_request([context, [1, 2]], config, include_outputs=True))
    assert [wire.tree_from_message(t) for t in batch.outputs] == [drafted, outputs.draft([1, 2], config)]
    assert len(stub.DraftBatch(wire.draft_batch_request([context], config)).outputs) == 0


BAD_OUTPUTS = {
    "empty": ([], "tokens is empty"),
    "out of vocabulary": ([1, VOCAB], r"tokens\[1\] = 500 is outside the vocabulary \[0, 500\)"),
    "longer than the store": ([1] * 101, "a document of 101 tokens exceeds the store's max_tokens=100"),
}


@pytest.mark.parametrize("tokens, message", BAD_OUTPUTS.values(), ids=BAD_OUTPUTS.keys())
def test_bad_output_is_invalid_argument_and_the_server_keeps_serving(outputs_stub, tokens, message):
    stub, outputs = outputs_stub
    with pytest.raises(grpc.RpcError) as err:
        stub.AddOutput(pb.AddOutputRequest(tokens=tokens))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, err.value.details())
    assert len(outputs) == 0
    assert stub.AddOutput(pb.AddOutputRequest(tokens=OUTPUT)).seq == 0


def test_a_server_without_output_store_refuses_outputs_and_drafts_none(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.AddOutput(pb.AddOutputRequest(tokens=OUTPUT))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--outputs-max-tokens 0" in err.value.details()
    reply = stub.Draft(wire.draft_request([7, 8], DraftConfig(), include_outputs=True))
    assert wire.tree_from_message(reply.outputs) == DraftTree.empty()


# ---- the CLI ------------------------------------------------------------------------------------


def _console_script() -> str:
    script = shutil.which("rest-datastore", path=str(Path(sys.executable).parent))
    assert script, "rest-datastore is not installed: pip install -e ."
    return script


def _start_server(argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A `rest-datastore serve` process and the address it printed."""
    proc = subprocess.Popen(
        [_console_script(), "serve", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    line = [None]
    reader = threading.Thread(target=lambda: line.__setitem__(0, proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(30)
    if not (line[0] and line[0].startswith("listening on ")):
        proc.kill()
        raise AssertionError(f"no address printed: {line[0]!r} {proc.communicate()[1]}")
    return proc, line[0].split()[-1]


def _stop_server(proc: subprocess.Popen) -> str:
    """SIGTERM, a clean exit within 20 s, and its stderr."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"no exit 20 s after SIGTERM; the server logged:\n{proc.communicate()[1]}")
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    return stderr


def test_serve_prints_its_address_and_exits_cleanly_on_sigterm(index):
    proc, address = _start_server(["--index", str(index[0]), "--port", "0", "--workers", "2"])
    try:
        assert address.startswith("127.0.0.1:")
        with grpc.insecure_channel(address) as channel:
            assert pb_grpc.DatastoreStub(channel).Info(pb.InfoRequest(), timeout=10).vocab_size == VOCAB
        stderr = _stop_server(proc)
        assert "SIGTERM received: stopping" in stderr and "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SIGNAL_AT_ANY_MOMENT = """
import os, random, signal, sys, threading
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.rpc import ServerConfig, run_until_signalled
from rest_spec.datastore.server import start_datastore

sys.setswitchinterval(1e-6)  # the GIL changes hands at almost every bytecode of the wait
signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # someone else's signal: not a stop

def strike(spins):
    for _ in range(spins):
        pass
    if random.random() < 0.5:
        os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), random.choice([signal.SIGTERM, signal.SIGINT]))

config = ServerConfig(port=0, workers=1, grace_seconds=0)
with Datastore.open(sys.argv[1]) as store:
    for _ in range(int(sys.argv[2])):
        ready = lambda address: threading.Thread(target=strike, args=(random.randrange(300),)).start()
        run_until_signalled(lambda resources: start_datastore(resources, store, config), ready)
print("stopped every time")
"""


def test_a_stop_signal_at_any_moment_stops_the_server(index):
    """SIGTERM or SIGINT while ``ready`` runs or while the server waits, after a signal it does
    not stop for: each stops it. (A handler taking a lock the wait holds can deadlock; this one
    takes none.)"""
    result = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_ANY_MOMENT, str(index[0]), "300"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "stopped every time" in result.stdout, result.stderr[-2000:]


def test_outputs_survive_a_restart_with_an_outputs_dir(index, tmp_path):
    """Acknowledged outputs are on disk: a restarted server (directory from $REST_OUTPUTS_DIR the
    second time) drafts from them and goes on counting."""
    directory = tmp_path / "outputs"
    proc, address = _start_server(["--index", str(index[0]), "--port", "0", "--outputs-dir", str(directory)])
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.DatastoreStub(channel)
            assert [stub.AddOutput(pb.AddOutputRequest(tokens=t)).seq for t in (OUTPUT, [3, 4, 5])] == [0, 1]
            request = wire.draft_request([7, 8], DraftConfig(), include_outputs=True)
            before = wire.tree_from_message(stub.Draft(request).outputs)
        assert len(before) == 7
    finally:
        stderr = _stop_server(proc)
    assert "Traceback" not in stderr
    env = {**os.environ, "REST_OUTPUTS_DIR": str(directory)}
    proc, address = _start_server(["--index", str(index[0]), "--port", "0"], env=env)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.DatastoreStub(channel)
            assert wire.tree_from_message(stub.Draft(request).outputs) == before
            assert stub.AddOutput(pb.AddOutputRequest(tokens=[6])).seq == 2
    finally:
        _stop_server(proc)


def test_cli_refuses_an_outputs_dir_without_outputs_as_a_usage_error(index, tmp_path, capsys):
    argv = ["serve", "--index", str(index[0]), "--outputs-max-tokens", "0", "--outputs-dir", str(tmp_path)]
    assert cli(argv) == 2
    usage, error = capsys.readouterr().err.split("\nrest-datastore serve: error: ")
    assert usage.startswith("usage: rest-datastore serve ")
    assert error == "outputs_dir is set but outputs_max_tokens is 0 (no outputs are kept)\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve"], "no index given: pass --index DIR (or set REST_INDEX)"),
        (["draft", "--tokens", "1"], "no index given"),
        (["draft", "--index", "idx", "--tokens", "1", "--budget", "0"], "budget must be in [1, "),
        (["serve", "--index", "idx", "--port", "70000"], "port must be in [0, 65535]"),
    ],
    ids=["serve-without-index", "draft-without-index", "budget", "port"],
)
def test_cli_usage_errors_exit_2_with_the_usage_line(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("REST_INDEX", raising=False)
    assert cli(argv) == 2
    usage, error = capsys.readouterr().err.split(f"\nrest-datastore {argv[0]}: error: ")
    assert usage.startswith(f"usage: rest-datastore {argv[0]} ") and error.startswith(message)


def test_cli_serve_reads_the_environment(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("REST_INDEX", str(tmp_path / "missing"))
    monkeypatch.setenv("REST_PORT", "0")
    assert cli(["serve"]) == 1
    missing = tmp_path / "missing"
    assert capsys.readouterr().err.strip() == f"rest-datastore: error: index directory not found: {missing}"


def test_cli_info_local_and_remote_agree(index, server, capsys):
    assert cli(["info", "--index", str(index[0])]) == 0
    local = json.loads(capsys.readouterr().out)
    assert cli(["info", "--server", server.address]) == 0
    assert json.loads(capsys.readouterr().out) == local
    assert local["vocab_size"] == VOCAB and len(local["shards"]) == 2


def test_cli_draft_prints_the_tree(index, server, capsys):
    tokens = ",".join(map(str, index[1][0][:20]))
    assert cli(["draft", "--server", server.address, "--tokens", tokens, "--budget", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("match_len=") and lines[0].endswith("nodes=5") and len(lines) == 6


def test_cli_verify_passes_then_catches_corruption(index, tmp_path, capsys):
    copy = tmp_path / "idx"
    shutil.copytree(index[0], copy)
    assert cli(["verify", "--index", str(copy)]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is True
    tokens = copy / "shard-00000.tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[len(data) // 2] ^= 0xFF  # within the spot-digest window of a small file: caught either way
    tokens.write_bytes(bytes(data))
    assert cli(["verify", "--index", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupt" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["info", "--index", "/nonexistent/idx"], "index directory not found"),
        (["draft", "--index", "/nonexistent/idx", "--tokens", "1"], "index directory not found"),
        (["info", "--server", "127.0.0.1:1", "--timeout", "0.5"], "cannot reach datastore at 127.0.0.1:1"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("REST_INDEX", raising=False)
    assert cli(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_port_in_use_is_one_line(index, server, capsys):
    assert cli(["serve", "--index", str(index[0]), "--port", str(server.port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rest-datastore: error: cannot listen on 127.0.0.1:{server.port}")
