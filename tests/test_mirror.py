"""A fleet's store of outputs copied into each replica (``datastore.mirror``), against real servers
on loopback ports: the copy drafts what the server's store drafts, a replica's own outputs are
there at once and never twice, reading pages through small replies, survives a restarted or dead
server, and a hostile reply is refused."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_spec.common.errors import NoOutputStoreError
from rest_spec.common.tokenizer import TokenizerMismatchError
from rest_spec.common.types import DraftConfig
from rest_spec.datastore import wire
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.mirror import OutputsMirror
from rest_spec.datastore.outputs import OutputStore
from rest_spec.datastore.rpc import MIN_MESSAGE_BYTES
from rest_spec.datastore.server import DatastoreServer, ServerConfig
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.core.sources import open_datastore
from rest_spec.proto.v1 import datastore_pb2 as pb
from tests.helpers import CORPUS_VOCAB as VOCAB
from tests.helpers import contexts_from, synthetic_corpus, write_index
from tests.tiers import examples

DOCS = synthetic_corpus()
RNG = np.random.default_rng(5)
# outputs with recurring phrases of their own and stretches of the corpus
OUTPUTS = [doc[3:70] for doc in DOCS[::5]] + RNG.integers(0, VOCAB - 1, (30, 40)).tolist()
CONTEXTS = contexts_from(OUTPUTS, 20, seed=2) + contexts_from(DOCS, 10, seed=4)
CONFIG = DraftConfig(budget=32, max_depth=8)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return write_index(tmp_path_factory.mktemp("mirror") / "idx", DOCS, VOCAB, shard_tokens=10_000)


@pytest.fixture(scope="module")
def store(index):
    with Datastore.open(index) as store:
        yield store


def served(store, outputs_max_tokens=100_000, **config):
    """A server over ``store`` with a fresh store of outputs; the caller enters both."""
    outputs = OutputStore(outputs_max_tokens, vocab_size=VOCAB)
    return outputs, DatastoreServer(store, ServerConfig(**{"port": 0, "workers": 2, **config}), outputs)


def test_replicas_draft_from_copies_equal_to_the_servers_store(store, index):
    outputs, server = served(store)
    with outputs, server, RemoteDrafter(server.address) as remote:
        with (
            LocalDrafter.open(index, outputs_from=server.address, outputs_max_tokens=100_000) as first,
            OutputsMirror(server.address, vocab_size=VOCAB, interval=60) as second,
        ):
            for i, output in enumerate(OUTPUTS):  # each replica serves its share
                (first.add_output if i % 2 else remote.add_output)(output)
            assert second.sync() == len(OUTPUTS)  # the other replicas' outputs, read now
            first.outputs.sync()
            found = 0
            for context in CONTEXTS:
                trees = remote.draft_sources(context, CONFIG)
                assert first.draft_sources(context, CONFIG) == trees  # index in process, outputs copied
                assert second.draft(context, CONFIG) == trees.outputs
                found += len(trees.outputs) > 0
            assert found >= len(CONTEXTS) // 2  # guards against vacuity
            assert len(first.outputs) == len(second) == len(outputs) == len(OUTPUTS)  # none twice


def test_own_output_is_drafted_from_at_once(store):
    outputs, server = served(store)
    with outputs, server, OutputsMirror(server.address, vocab_size=VOCAB, interval=60) as mirror:
        output = OUTPUTS[0]
        assert len(mirror.draft(output[:10], CONFIG)) == 0
        seq = mirror.add(output)
        assert seq == 0 and len(mirror.draft(output[:10], CONFIG)) > 0  # before any read
        assert mirror.sync() == 0 and len(mirror) == 1  # read back, not copied twice


def test_reading_pages_through_replies_the_server_keeps_small(store):
    outputs, server = served(store, max_reply_bytes=MIN_MESSAGE_BYTES)
    many = [RNG.integers(0, VOCAB, int(n)).tolist() for n in RNG.integers(1, 400, 300)]
    with outputs, server:
        for output in many:
            outputs.add(output)
        assert sum(map(len, many)) * 2 > MIN_MESSAGE_BYTES  # more than one reply holds
        with OutputsMirror(server.address, vocab_size=VOCAB) as mirror:
            assert [d.tolist() for d in mirror.store.documents()] == many


def test_evicted_outputs_are_skipped_and_a_large_one_passed_over(store):
    outputs, server = served(store, outputs_max_tokens=300)
    with outputs, server:
        for _ in range(5):
            outputs.add([1] * 100)
        with OutputsMirror(server.address, vocab_size=VOCAB, max_tokens=50, interval=60) as mirror:
            assert len(mirror) == 0  # each output is larger than the copy: passed over, not retried
            outputs.add([2] * 10)
            assert mirror.sync() == 1 and mirror.store.documents()[0].tolist() == [2] * 10


def test_a_restarted_server_is_read_again_and_a_dead_one_leaves_the_copy(store, caplog):
    outputs, server = served(store)
    with outputs, server:
        for output in OUTPUTS[:5]:
            outputs.add(output)
        mirror = OutputsMirror(server.address, vocab_size=VOCAB, interval=0.05, timeout=1)
        port = server.port
    try:
        assert len(mirror) == 5
        tree = mirror.draft(OUTPUTS[0][:10], CONFIG)
        with caplog.at_level(logging.WARNING, "rest_spec.datastore.mirror"):
            with pytest.raises(ConnectionError):
                mirror.sync()
            assert mirror.draft(OUTPUTS[0][:10], CONFIG) == tree  # drafting goes on from the copy
            outputs, server = served(store, port=port)  # a store that counts afresh, on the same port
            with outputs, server:
                outputs.add(OUTPUTS[7])
                for _ in range(200):  # the background thread finds it
                    if len(mirror) == 6:
                        break
                    mirror._stop.wait(0.05)
                assert mirror.store.documents()[-1].tolist() == OUTPUTS[7]
        assert any("cannot read the store of outputs" in r.getMessage() for r in caplog.records)
    finally:
        mirror.close()


def test_a_server_without_outputs_or_of_another_tokenizer_is_refused(store, index):
    with DatastoreServer(store, ServerConfig(port=0, workers=1)) as server:
        with pytest.raises(NoOutputStoreError, match="keeps no outputs"):
            OutputsMirror(server.address, vocab_size=VOCAB)
    outputs, server = served(store)
    with outputs, server:
        with pytest.raises(TokenizerMismatchError):
            OutputsMirror(server.address, vocab_size=VOCAB, expected_fingerprint="sha256:another")


def test_reading_needs_the_token_as_adding_does(store):
    outputs, server = served(store, auth_token="secret")
    with outputs, server:
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            OutputsMirror(server.address, vocab_size=VOCAB)
        with OutputsMirror(server.address, vocab_size=VOCAB, auth_token="secret", interval=60) as mirror:
            mirror.add(OUTPUTS[1])
            assert mirror.sync() == 0 and len(outputs) == 1


def test_open_datastore_refuses_what_does_not_go_together(store, index):
    outputs, server = served(store)
    with outputs, server:
        with pytest.raises(ValueError, match="is a server, which keeps its own outputs"):
            open_datastore(server.address, outputs_from=server.address)
        with pytest.raises(ValueError, match="not a HOST:PORT"):
            open_datastore(str(index), outputs_from="nowhere")
        with pytest.raises(ValueError, match="takes no outputs_dir"):
            open_datastore(str(index), outputs_from=server.address, outputs_dir=str(index / "out"))
        with open_datastore(str(index), outputs_from=server.address) as source:
            assert isinstance(source.outputs, OutputsMirror)
    with pytest.raises(ValueError, match=r"cannot use datastore .*outputs copied from 127\.0\.0\.1:1\b"):
        open_datastore(str(index), outputs_from="127.0.0.1:1")


@pytest.mark.parametrize(
    "reply, message",
    [
        (pb.ReadOutputsReply(outputs=[pb.StoredOutput(seq=4, tokens=[1])], next_seq=5, end_seq=5), "out of order"),
        (
            pb.ReadOutputsReply(
                outputs=[pb.StoredOutput(seq=6, tokens=[1]), pb.StoredOutput(seq=6, tokens=[1])], next_seq=9, end_seq=9
            ),
            "out of order",
        ),
        (pb.ReadOutputsReply(outputs=[pb.StoredOutput(seq=6, tokens=[1])], next_seq=6, end_seq=9), "out of order"),
        (pb.ReadOutputsReply(outputs=[pb.StoredOutput(seq=6, tokens=[])], next_seq=7, end_seq=9), "empty"),
        (pb.ReadOutputsReply(outputs=[pb.StoredOutput(seq=6, tokens=[VOCAB])], next_seq=7, end_seq=9), "outside"),
        (pb.ReadOutputsReply(next_seq=2, end_seq=9), "behind"),
    ],
)
def test_a_hostile_reply_is_refused(reply, message):
    with pytest.raises(ValueError, match=message):
        wire.outputs_from_reply(reply, 5, VOCAB)


@settings(max_examples=examples(200), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), max_size=40),
    max_tokens=st.integers(30, 200),
    budget=st.integers(1, 60),
    start=st.integers(0, 50),
)
def test_reads_from_any_number_gather_exactly_the_live_outputs_from_it(lengths, max_tokens, budget, start):
    with OutputStore(max_tokens) as outputs:
        for i, n in enumerate(lengths):
            outputs.add([i] * n)
        live = {seq: tokens for seq, tokens in enumerate(lengths)}
        live = dict(list(live.items())[len(lengths) - len(outputs) :])
        read, seq = {}, start
        while True:
            documents, next_seq, end_seq = outputs.read(seq, budget)
            assert end_seq == len(lengths) and next_seq >= seq
            for number, tokens in documents:
                assert number >= seq and number not in read and tokens.size <= budget
                read[number] = tokens.size
            if next_seq == seq or next_seq >= end_seq:
                break
            seq = next_seq
        assert read == {k: n for k, n in live.items() if k >= start and n <= budget}


def test_a_server_that_never_stops_paging_holds_a_read_for_a_bounded_number_of_replies(store):
    """A hostile server may answer every read with one more output and an end far ahead: a sync
    returns after ``MAX_PAGES`` replies, keeping what it read, and the next sync goes on from there."""
    from rest_spec.datastore import mirror as mirror_module

    outputs, server = served(store)
    with outputs, server, OutputsMirror(server.address, vocab_size=VOCAB, interval=60) as mirror:

        def endless(from_seq, vocab_size, timeout=None):
            return [(from_seq, np.array([1, 2, 3]))], from_seq + 1, 1 << 62

        mirror.client.read_outputs = endless
        assert mirror.sync() == mirror_module.MAX_PAGES and len(mirror) == mirror_module.MAX_PAGES
        assert mirror.sync() == mirror_module.MAX_PAGES and len(mirror) == 2 * mirror_module.MAX_PAGES
