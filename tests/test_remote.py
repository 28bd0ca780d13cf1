"""RemoteDrafter against a real server: the same trees as the in-process engine, and clear errors."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from datastore.index import Datastore
from datastore.server import DatastoreServer, ServerConfig
from datastore.types import DraftConfig
from datastore.tokenizer import TokenizerMismatchError, check_tokenizer
from drafter.base import Drafter
from drafter.local import LocalDrafter
from drafter.remote import RemoteDrafter
from tests.helpers import CORPUS_VOCAB as VOCAB
from tests.helpers import UNSEEN, contexts_from, synthetic_corpus, write_index

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


@pytest.fixture(scope="module")
def server(store):
    # the smallest context limit a server may have: the client must send only the tail
    with DatastoreServer(store, ServerConfig(port=0, workers=2, max_context_tokens=64)) as server:
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
    assert time.monotonic() - start < 3


def test_server_gone_after_connect_is_a_connection_error(store):
    with DatastoreServer(store, ServerConfig(port=0)) as server, RemoteDrafter(server.address, timeout=2) as remote:
        assert len(remote.draft(CASES[0][0])) > 0
        server.stop(grace=0)
        with pytest.raises(ConnectionError, match=server.address):
            remote.draft(CASES[0][0])
