"""Sharded serving as processes: ``rest-datastore serve --shards`` shard servers and a
``rest-datastore route`` router on loopback ports, reached like any datastore server.

The router's ``DraftBatch`` equals the single index's (above the candidate cap too), it keeps the
output store, a killed shard server makes it answer UNAVAILABLE (or, with --allow-partial, from the
rest), it refuses to start over servers that do not make up the index, and the shard service
refuses bad requests with INVALID_ARGUMENT and another index's with FAILED_PRECONDITION."""

from __future__ import annotations

import re

import grpc
import pytest

from rest_spec.common.types import DraftConfig
from rest_spec.datastore.__main__ import main
from rest_spec.datastore.client import DatastoreClient
from rest_spec.datastore.index import Datastore, index_id
from rest_spec.proto.v1 import shard_pb2 as spb
from rest_spec.proto.v1 import shard_pb2_grpc as spb_grpc
from tests.helpers import CORPUS_VOCAB as VOCAB
from tests.helpers import DatastoreProcess, contexts_from, synthetic_corpus, write_index

pytestmark = pytest.mark.server

REPEATED = [7, 8, 9]  # a phrase in 1,500 places: matching it samples


def corpus() -> list[list[int]]:
    return synthetic_corpus() + [REPEATED * 30 for _ in range(50)]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """An index of 6 shards."""
    path = write_index(tmp_path_factory.mktemp("sharded") / "idx", corpus(), VOCAB, shard_tokens=3000)
    with Datastore.open(path) as store:
        assert len(store.manifest.shards) == 6
    return path


def shard_server(index, spec: str, *args) -> DatastoreProcess:
    return DatastoreProcess("serve", "--index", index, "--shards", spec, "--port", 0, "--workers", 2, *args)


def router(index, servers, *args) -> DatastoreProcess:
    shard_servers = ",".join(s.address for s in servers)
    return DatastoreProcess(
        "route", "--manifest", index / "manifest.json", "--shard-servers", shard_servers, "--port", 0, *args
    )


def stopped(*processes: DatastoreProcess) -> None:
    for process in processes:
        process.stop()


CLUSTER = ("0-2", "3-5")  # the shards of the cluster's two servers


@pytest.fixture(scope="module")
def cluster(index):
    """Two shard servers (shards 0-2 and 3-5) and a router over them."""
    servers = [shard_server(index, spec) for spec in CLUSTER]
    try:
        for server in servers:
            assert server.wait().address, server.output
        front = router(index, servers, "--outputs-max-tokens", 1000).wait()
        assert front.address, front.output
        yield servers, front
        assert front.stop() == 0, front.output
    finally:
        stopped(*servers)
    assert all(s.exit_status() == 0 for s in servers), [s.output for s in servers]


def test_draft_batch_through_the_router_equals_the_single_index(index, cluster):
    _, front = cluster
    contexts = contexts_from(corpus(), 60, seed=4) + [REPEATED * 3, [1, 2], [499]]
    with Datastore.open(index) as store, DatastoreClient(front.address) as client:
        for config in (DraftConfig(), DraftConfig(budget=16, max_depth=4, n_max=6, n_min=1)):
            expected = store.draft_batch(contexts, config)
            assert client.draft_batch(contexts, config) == expected
            assert any(t.num_sampled < t.num_matches for t in expected)  # the second round ran
        assert client.info() == store.info()
        assert client.draft(REPEATED * 2) == store.draft(REPEATED * 2)


def test_the_output_store_lives_in_the_router(cluster):
    _, front = cluster
    with DatastoreClient(front.address) as client:
        assert client.add_output([3, 4, 5, 6]) == 0
        assert client.draft_sources([1, 3, 4], DraftConfig(n_min=2)).outputs.paths()[0] == (5,)


def test_bad_requests_to_the_shard_service_are_invalid_argument(index, cluster):
    servers, _ = cluster
    with Datastore.open(index) as store:
        own = index_id(store.manifest)
    ok = dict(index_id=own, contexts=[spb.Tokens(tokens=[1, 2])], n_max=4, n_min=1, max_depth=3)
    matches = [
        (dict(ok, contexts=[spb.Tokens(tokens=[])]), r"contexts\[0\] is empty"),
        (dict(ok, contexts=[spb.Tokens(tokens=[VOCAB])]), r"contexts\[0\]\[0\] = 500 is outside the vocabulary"),
        (dict(ok, contexts=[spb.Tokens(tokens=range(65))]), "more than this server's limit of 64"),
        (dict(ok, n_max=0), "n_max must be in"),
        (dict(ok, max_depth=65), "max_depth must be in"),
        (dict(ok, inline_rows=1025), "inline_rows must be in"),
    ]
    repeated = dict(ok, contexts=[spb.Tokens(tokens=REPEATED)])
    gathers = [
        (dict(repeated, items=[spb.GatherItem(context=1, shard=0, ranks=[0])]), r"items\[0\].context = 1"),
        (dict(repeated, items=[spb.GatherItem(context=0, shard=3, ranks=[0])]), r"shard = 3 is not served here"),
        (dict(repeated, items=[spb.GatherItem(context=0, shard=0, ranks=[2**64 - 1])]), "ranks outside it"),
        (dict(repeated, items=[spb.GatherItem(context=0, shard=0, ranks=range(1025))]), "more than 1024"),
    ]
    with grpc.insecure_channel(servers[0].address) as channel:
        stub = spb_grpc.ShardServiceStub(channel)
        for fields, message in matches:
            with pytest.raises(grpc.RpcError) as err:
                stub.Match(spb.MatchRequest(**fields), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert re.search(message, err.value.details()), err.value.details()
        for fields, message in gathers:
            del fields["n_min"]
            with pytest.raises(grpc.RpcError) as err:
                stub.Gather(spb.GatherRequest(**fields), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert re.search(message, err.value.details()), err.value.details()
        malformed = channel.unary_unary("/rest.shard.v1.ShardService/Match")
        with pytest.raises(grpc.RpcError) as err:
            malformed(b"\xff\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # another index's id: its ranks would mean nothing here
        with pytest.raises(grpc.RpcError) as err:
            stub.Match(spb.MatchRequest(**dict(ok, index_id="sha256:" + "0" * 64)), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # and the server keeps serving
        assert stub.Describe(spb.DescribeRequest(), timeout=10).shards == [0, 1, 2]
        hits = stub.Match(spb.MatchRequest(**dict(ok, inline_rows=4)), timeout=10).contexts[0].hits
        assert hits and all(len(h.rows) == h.count * 3 * 2 for h in hits if h.count <= 4)


def test_a_killed_shard_server_is_unavailable_or_left_out_with_allow_partial(index):
    servers = [shard_server(index, "0-2"), shard_server(index, "3-5")]
    fronts = []
    try:
        for server in servers:
            assert server.wait().address, server.output
        fronts = [router(index, servers, "--shard-timeout", 2), router(index, servers, "--allow-partial")]
        for front in fronts:
            assert front.wait().address, front.output
        servers[1].kill()
        contexts = contexts_from(corpus(), 20, seed=9)
        with DatastoreClient(fronts[0].address) as strict, pytest.raises(ConnectionError, match="UNAVAILABLE"):
            strict.draft_batch(contexts)
        with (
            DatastoreClient(fronts[1].address) as partial,
            Datastore.open(index, shards=[0, 1, 2]) as survivors,
        ):
            assert partial.draft_batch(contexts) == survivors.draft_batch(contexts, DraftConfig())
    finally:
        stopped(*fronts, *servers)
    assert "shard server" in fronts[1].output and "answering from the other servers" in fronts[1].output


@pytest.mark.parametrize(
    "specs, message",
    [
        (["0-2", "4-5"], r"no shard server serves shard\(s\) 3 of the index"),
        (["0-3", "3-5"], "shard 3 is served twice"),
    ],
)
def test_the_router_refuses_servers_that_do_not_make_up_the_index(index, cluster, specs, message):
    """The cluster's server of a spec where it has one (a refusing router leaves it as it was)."""
    running = dict(zip(CLUSTER, cluster[0]))
    own = {spec: shard_server(index, spec) for spec in specs if spec not in running}
    try:
        for server in own.values():
            assert server.wait().address, server.output
        front = router(index, [running.get(spec) or own[spec] for spec in specs]).wait()
        assert front.exit_status() == 1 and front.address is None
        assert re.search(f"rest-datastore: error: {message}", front.output), front.output
    finally:
        stopped(*own.values())


def test_the_router_refuses_a_server_of_another_index(index, cluster, tmp_path):
    """The cluster's server of shards 0-2 beside one of another index's shards 3-5."""
    other = write_index(tmp_path / "other", [doc[::-1] for doc in corpus()], VOCAB, shard_tokens=3000)
    foreign = shard_server(other, "3-5")
    try:
        assert foreign.wait().address, foreign.output
        front = router(index, [cluster[0][0], foreign]).wait()
        assert front.exit_status() == 1
        assert f"shard server {foreign.address} serves another index: its index_id" in front.output
    finally:
        stopped(foreign)


def test_cli_refuses_bad_shard_and_router_flags(index, capsys):
    assert main(["serve", "--index", str(index), "--shards", "0-x"]) == 2
    assert "'0-x' is not a shard number or a range" in capsys.readouterr().err
    assert main(["serve", "--index", str(index), "--shards", "0", "--outputs-salvage"]) == 2
    assert "the output store lives in the router" in capsys.readouterr().err
    assert main(["route", "--shard-servers", "127.0.0.1:1"]) == 2
    assert "no manifest given" in capsys.readouterr().err
    assert main(["route", "--manifest", str(index), "--shard-servers", "a:1,a:1"]) == 2
    assert "names a server twice" in capsys.readouterr().err
    assert main(["serve", "--index", str(index), "--shards", "9", "--port", "0"]) == 1
    assert "shard 9 is not in the index (its shards are 0..5)" in capsys.readouterr().err
