"""RemoteDrafter against a real server: the same trees as the in-process engine (index and output
store), and clear errors."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from rest_spec.common.tokenizer import TokenizerMismatchError, check_tokenizer
from rest_spec.common.types import DraftConfig, SourceTrees
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.outputs import OutputStore
from rest_spec.datastore.server import DatastoreServer, ServerConfig
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.protocol import Drafter, SourceDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from tests.helpers import CORPUS_VOCAB as VOCAB
from tests.helpers import TIME_SCALE, UNSEEN, contexts_from, synthetic_corpus, write_index

DOCS = synthetic_corpus()
CONFIGS = [
    DraftConfig(),
    DraftConfig(budget=1, max_depth=1),
    DraftConfig(budget=200, max_depth=30, n_max=32, n_min=1),
    DraftConfig(budget=7, max_depth=3, n_max=4, n_min=4),
]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return write_index(tmp_path_factory.mktemp("remote") / "idx", DOCS, VOCAB, shard_tokens=10_000)


@pytest.fixture(scope="module")
def store(index):
    with Datastore.open(index) as store:
        yield store


# outputs: recurring phrases of their own plus stretches of the corpus, so both sources match
OUTPUTS = [doc[5:60] for doc in DOCS[::7]] + np.random.default_rng(11).integers(0, UNSEEN, (20, 30)).tolist()
OUTPUTS_MAX_TOKENS = 1500  # the first outputs are evicted by the last ones


@pytest.fixture(scope="module")
def outputs():
    with OutputStore(OUTPUTS_MAX_TOKENS, vocab_size=VOCAB) as outputs:
        yield outputs


@pytest.fixture(scope="module")
def server(store, outputs):
    # the smallest context limit a server may have: the client must send only the tail
    with DatastoreServer(store, ServerConfig(port=0, workers=2, max_context_tokens=64), outputs) as server:
        yield server


@pytest.fixture(scope="module")
def remote(server):
    with RemoteDrafter(server.address) as remote:
        yield remote


def _cases():
    """(context, config) pairs: corpus slices, a 1-token context, a context longer than the server's
    limit, and contexts that match nothing, under several configs."""
    long = [t for doc in DOCS[:5] for t in doc]
    assert len(long) > 64
    contexts = contexts_from(DOCS, 12, seed=3) + [[DOCS[5][0]], long, [1, UNSEEN], [UNSEEN]]
    return [(c, config) for config in CONFIGS for c in contexts]


CASES = _cases()


@pytest.mark.parametrize("context, config", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_remote_trees_equal_local_trees(store, remote, context, config):
    assert remote.draft(context, config) == store.draft(context, config)


def test_batch_equals_local_trees(store, remote):
    for config in CONFIGS:
        contexts = [c for c, cfg in CASES if cfg == config]
        assert remote.draft_batch(contexts, config) == [store.draft(c, config) for c in contexts]


def test_most_cases_draft_something(store):
    """Guards the equality test against vacuity (all trees empty)."""
    assert sum(len(store.draft(c, config)) > 0 for c, config in CASES) >= len(CASES) // 2


@pytest.fixture(scope="module")
def local_and_remote_with_outputs(index, remote):
    """A LocalDrafter and the remote one, both handed OUTPUTS in the same order (the server's
    store is its own, filled over AddOutput)."""
    with LocalDrafter.open(index, outputs_max_tokens=OUTPUTS_MAX_TOKENS) as local:
        for seq, output in enumerate(OUTPUTS):
            assert local.add_output(output) == remote.add_output(np.array(output)) == seq
        yield local, remote


def test_remote_source_trees_equal_local_source_trees(local_and_remote_with_outputs):
    local, remote = local_and_remote_with_outputs
    found = 0
    for context, config in CASES:
        trees = remote.draft_sources(context, config)
        assert trees == local.draft_sources(context, config)
        assert trees.index == remote.draft(context, config)
        found += len(trees.outputs) > 0
    assert found >= len(CASES) // 4  # guards against vacuity: the output store drafts too
    for config in CONFIGS:
        contexts = [c for c, cfg in CASES if cfg == config]
        assert remote.draft_sources_batch(contexts, config) == local.draft_sources_batch(contexts, config)


def test_drafters_are_source_drafters(store, remote):
    assert isinstance(remote, SourceDrafter)
    local = LocalDrafter(store)  # not closed: the store belongs to the module
    assert isinstance(local, SourceDrafter)
    trees = local.draft_sources(CASES[0][0], DraftConfig())
    assert isinstance(trees, SourceTrees) and len(trees.outputs) == 0  # no output store


def test_bad_outputs_are_value_errors_with_the_same_message(local_and_remote_with_outputs):
    local, remote = local_and_remote_with_outputs
    for bad, message in (
        ([1, VOCAB], r"tokens\[1\] = 500 is outside the vocabulary \[0, 500\)"),
        ([], "empty"),
        ([1] * (OUTPUTS_MAX_TOKENS + 1), "exceeds the store's max_tokens=1500"),
    ):
        with pytest.raises(ValueError, match=message) as remote_error:
            remote.add_output(bad)
        with pytest.raises(ValueError, match=message) as local_error:
            local.add_output(bad)
        assert str(remote_error.value) == str(local_error.value)


def test_outputs_to_a_drafter_without_a_store_are_refused(store, index):
    with DatastoreServer(store, ServerConfig(port=0, workers=1)) as server, RemoteDrafter(server.address) as remote:
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: this server keeps no outputs"):
            remote.add_output([1, 2])
        trees = remote.draft_sources_batch([CASES[0][0]] * 2, DraftConfig())
        assert [len(t.outputs) for t in trees] == [0, 0] and len(trees[0].index) > 0
    with LocalDrafter.open(index, outputs_max_tokens=0) as local, pytest.raises(RuntimeError, match="keeps no outputs"):
        local.add_output([1, 2])
    with pytest.raises(ValueError, match="outputs_max_tokens is 0"):
        LocalDrafter.open(index, outputs_max_tokens=0, outputs_dir=index / "outputs")


def test_context_types(store, remote):
    context = np.array(CASES[0][0], dtype=np.int64)
    assert remote.draft(context) == remote.draft(context.tolist()) == store.draft(context)


def test_is_a_drafter_and_reports_the_index(store, remote):
    assert isinstance(remote, Drafter)
    assert remote.info() == store.info()


def test_tokenizer_check(remote):
    check_tokenizer(remote, "sha256:test")
    with pytest.raises(TokenizerMismatchError, match="test-tok"):
        check_tokenizer(remote, "sha256:another-tokenizer")


def test_tokenizer_mismatch_is_refused_on_connect(server, index):
    RemoteDrafter(server.address, expected_fingerprint="sha256:test").close()
    LocalDrafter.open(index, expected_fingerprint="sha256:test").close()
    with pytest.raises(TokenizerMismatchError, match="rebuild the index"):
        RemoteDrafter(server.address, expected_fingerprint="sha256:another-tokenizer")
    with pytest.raises(TokenizerMismatchError, match="rebuild the index"):
        LocalDrafter.open(index, expected_fingerprint="sha256:another-tokenizer")


def test_invalid_request_is_a_value_error_with_the_servers_message(remote):
    with pytest.raises(ValueError, match=r"context\[1\] = 500 is outside the vocabulary \[0, 500\)"):
        remote.draft([1, VOCAB])
    with pytest.raises(ValueError, match="context is empty"):
        remote.draft([])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_server_fails_fast_naming_the_address():
    address = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"cannot reach datastore at {address}: .*refused"):
        RemoteDrafter(address, timeout=0.5)
    assert time.monotonic() - start < 3 * TIME_SCALE


def test_server_gone_after_connect_is_a_connection_error(store):
    with DatastoreServer(store, ServerConfig(port=0)) as server, RemoteDrafter(server.address, timeout=2) as remote:
        assert len(remote.draft(CASES[0][0])) > 0
        server.stop(grace=0)
        with pytest.raises(ConnectionError, match=server.address):
            remote.draft(CASES[0][0])
