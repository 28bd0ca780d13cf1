"""The gRPC service end to end: a real server on a loopback port over a real index built with
IndexWriter, called through the generated stubs; and the ``rest-datastore`` CLI."""

from __future__ import annotations

import json
import logging
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
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from datastore import wire
from datastore.__main__ import main as cli
from datastore.index import Datastore
from datastore.server import SERVICE_NAME, DatastoreServer, ServerConfig
from datastore.types import DraftConfig
from rest_proto.v1 import datastore_pb2 as pb
from rest_proto.v1 import datastore_pb2_grpc as pb_grpc
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
        with caplog.at_level(logging.ERROR, logger="datastore.server"), pytest.raises(grpc.RpcError) as err:
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


def test_reflection_lists_the_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_concurrent_clients_get_their_own_answers(index, store, server):
    contexts = contexts_from(index[1], 48, seed=2)
    config = DraftConfig(budget=24)
    expected = [store.draft(c, config) for c in contexts]

    def client(part: int) -> list:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.DatastoreStub(channel)
            return [(i, wire.tree_from_message(stub.Draft(wire.draft_request(contexts[i], config)).tree))
                    for i in range(part, len(contexts), 6)]

    with ThreadPoolExecutor(6) as pool:
        answers = [pair for part in pool.map(client, range(6)) for pair in part]
    assert len(answers) == len(contexts)
    assert all(tree == expected[i] for i, tree in answers)


def test_a_busy_port_is_refused(store, server):
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        DatastoreServer(store, ServerConfig(port=server.port))


@pytest.mark.parametrize(
    "field, value", [("port", 70000), ("workers", 0), ("max_context_tokens", 10), ("grace_seconds", -1)]
)
def test_server_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


# ---- the CLI ------------------------------------------------------------------------------------


def _console_script() -> str:
    script = shutil.which("rest-datastore", path=str(Path(sys.executable).parent))
    assert script, "rest-datastore is not installed: pip install -e ."
    return script


def test_serve_prints_its_address_and_exits_cleanly_on_sigterm(index):
    proc = subprocess.Popen(
        [_console_script(), "serve", "--index", str(index[0]), "--port", "0", "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = [None]
        reader = threading.Thread(target=lambda: line.__setitem__(0, proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        assert line[0] and line[0].startswith("listening on 127.0.0.1:"), proc.stderr.read() if proc.poll() else line
        address = line[0].split()[-1]
        with grpc.insecure_channel(address) as channel:
            assert pb_grpc.DatastoreStub(channel).Info(pb.InfoRequest(), timeout=10).vocab_size == VOCAB
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
