"""The router over real shard servers on loopback ports, in process: its trees are the single
index's, tree for tree, whatever the corpus, the shard sizes, the candidate cap, the inline
threshold and the shard-to-server assignment; it refuses servers that do not make up the index,
and a server that is down or answers nonsense is UNAVAILABLE (or, opt-in, left out)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore, RetrieverUnavailable
from rest_spec.datastore.router import Router, RouterConfig
from rest_spec.datastore.rpc import GrpcServer, ServerConfig
from rest_spec.datastore.shards import SERVICE_NAME, ShardServicer, parse_shard_spec
from tests.helpers import TIME_SCALE, contexts_from, synthetic_corpus, write_index
from tests.tiers import examples

SERVER = ServerConfig(port=0, workers=2, grace_seconds=0)


@contextlib.contextmanager
def shard_servers(path, assignment: list[list[int]], servicer=ShardServicer, config: ServerConfig = SERVER):
    """One real shard server on a loopback port per list of shard numbers, answering through
    ``servicer`` (a hostile subclass, or the real one); their addresses."""
    with contextlib.ExitStack() as stack:
        addresses = []
        for shards in assignment:
            store = stack.enter_context(Datastore.open(path, shards=shards))
            store.warm_up()
            server = GrpcServer(SERVICE_NAME, servicer(store, config).handlers(), config, "shard service", "shard")
            addresses.append(stack.enter_context(server).address)
        yield tuple(addresses)


# ---- router == single index -------------------------------------------------------------------


@st.composite
def cases(draw):
    vocab = draw(st.integers(2, 8))  # few ids: long match lists, so caps down to 1 sample
    docs = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), min_size=4, max_size=25))
    shard_tokens = draw(st.integers(3, 40))  # several shards, often
    contexts = draw(
        st.lists(
            st.one_of(
                st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12),
                st.builds(
                    lambda doc, end, n: doc[max(0, end - n) : end],
                    st.sampled_from(docs),
                    st.integers(1, 50),
                    st.integers(1, 12),
                ).filter(len),
            ),
            min_size=1,
            max_size=6,
        )
    )
    n_min = draw(st.integers(1, 3))
    config = DraftConfig(
        budget=draw(st.integers(1, 40)),
        max_depth=draw(st.integers(1, 8)),
        n_min=n_min,
        n_max=draw(st.integers(n_min, 10)),
    )
    cap = draw(st.sampled_from([1, 2, 3, 5, 16, 1024]))
    inline = draw(st.sampled_from([0, 1, cap]))
    return vocab, docs, shard_tokens, contexts, config, cap, inline


@pytest.mark.server
def test_router_trees_equal_the_single_index(tmp_path_factory):
    """Hypothesis over random corpora and 1-5 servers with a random assignment of shards; the
    generated cases must both sample (matches over the cap) and take a second round (Gather)."""
    seen = Counter()

    @settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases(), data=st.data())
    def check(case, data):
        vocab, docs, shard_tokens, contexts, config, cap, inline = case
        path = write_index(tmp_path_factory.mktemp("idx") / "idx", docs, vocab, shard_tokens=shard_tokens)
        with Datastore.open(path, max_candidates=cap) as store:
            expected = store.draft_batch(contexts, config)
            num_shards = len(store.manifest.shards)
        order = data.draw(st.permutations(range(num_shards)))
        num_servers = data.draw(st.integers(1, min(5, num_shards)))
        assignment = [[s] for s in order[:num_servers]]
        for shard in order[num_servers:]:
            assignment[data.draw(st.integers(0, num_servers - 1))].append(shard)
        with (
            shard_servers(path, assignment) as addresses,
            Router.connect(
                path / "manifest.json", RouterConfig(addresses, max_candidates=cap, inline_rows=inline)
            ) as router,
        ):
            got = list(router.drafts(contexts, config))
            assert got == expected
            assert router.calls["Match"] == 1 and router.calls["Gather"] <= 1  # a batch: one round each at most
        seen["sampled"] += any(t.num_sampled < t.num_matches for t in expected)
        seen["gathered"] += router.calls["Gather"]
        seen["one round"] += router.calls["Gather"] == 0 and any(t.num_matches for t in expected)
        seen["several servers"] += num_servers > 1

    check()
    # (a second round across several servers, rarer in random cases, has its own test below)
    assert all(seen[k] >= 2 for k in ("sampled", "gathered", "one round", "several servers")), seen


@pytest.mark.server
@pytest.mark.parametrize("inline", [0, 2])
def test_a_second_round_across_several_servers_equals_the_single_index(tmp_path, inline):
    """Four shards of one repeated text on two servers, a cap of one candidate: every row samples
    over the cap, so the router gathers the sampled continuations from both servers in a second
    round; the trees are the single index's."""
    docs = [[0, 1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 0]] * 4
    contexts, config = [[0, 1], [1, 0, 1]], DraftConfig(budget=8, max_depth=4, n_min=1, n_max=4)
    path = write_index(tmp_path / "idx", docs, 2, shard_tokens=15)
    with Datastore.open(path, max_candidates=1) as store:
        expected = store.draft_batch(contexts, config)
        assert len(store.manifest.shards) == 4 and all(t.num_sampled < t.num_matches for t in expected)
    with (
        shard_servers(path, [[0, 1], [2, 3]]) as addresses,
        Router.connect(path / "manifest.json", RouterConfig(addresses, max_candidates=1, inline_rows=inline)) as router,
    ):
        assert list(router.drafts(contexts, config)) == expected
        assert (router.calls["Match"], router.calls["Gather"]) == (1, 1)


# ---- what the router refuses at start -----------------------------------------------------------


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    docs = synthetic_corpus()
    path = write_index(tmp_path_factory.mktemp("router") / "idx", docs, 500, shard_tokens=3000)
    with Datastore.open(path) as store:
        assert len(store.manifest.shards) >= 4
        return path, docs, len(store.manifest.shards)


@pytest.fixture(scope="module")
def other_index(tmp_path_factory, index):
    """Another index of as many shards, the same vocabulary and tokenizer, other documents."""
    docs = [doc[::-1] for doc in synthetic_corpus()]
    return write_index(tmp_path_factory.mktemp("router") / "other", docs, 500, shard_tokens=3000)


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("0-1;3-{last}", r"no shard server serves shard\(s\) 2 of the index"),
        ("0-2;2-{last}", r"shard 2 is served twice"),
    ],
)
def test_servers_that_do_not_cover_every_shard_once_are_refused(index, assignment, message):
    path, _, num_shards = index
    spec = assignment.format(last=num_shards - 1)
    with shard_servers(path, [parse_shard_spec(p) for p in spec.split(";")]) as addresses:
        with pytest.raises(ValueError, match=message):
            Router.connect(path / "manifest.json", RouterConfig(addresses))


def test_a_server_of_another_index_is_refused(index, other_index):
    path, _, num_shards = index
    with (
        shard_servers(path, [[0]]) as ours,
        shard_servers(other_index, [list(range(1, num_shards))]) as theirs,
    ):
        with pytest.raises(ValueError, match=r"serves another index: its index_id is"):
            Router.connect(path / "manifest.json", RouterConfig(ours + theirs))


def test_an_unreachable_server_is_refused_after_the_connect_timeout(index):
    path, _, _ = index
    with shard_servers(path, [[0]]) as addresses:
        dead = addresses[0]
    with pytest.raises(ConnectionError, match=dead):
        Router.connect(path / "manifest.json", RouterConfig((dead,), connect_timeout=0.5))


# ---- a server down, or answering nonsense ------------------------------------------------------


def test_a_server_down_is_unavailable_or_left_out_when_partial_answers_are_allowed(index):
    path, docs, num_shards = index
    contexts, config, rest = contexts_from(docs, 40, seed=11), DraftConfig(), list(range(1, num_shards))
    manifest = path / "manifest.json"
    with shard_servers(path, [rest]) as second:
        with shard_servers(path, [[0]]) as first:
            strict = Router.connect(manifest, RouterConfig(first + second))
            partial = Router.connect(manifest, RouterConfig(first + second, allow_partial=True))
        # the server of shard 0 is gone
        with strict, partial, Datastore.open(path, shards=rest) as survivors:
            with pytest.raises(
                RetrieverUnavailable, match=rf"shard server {first[0]} \(shards 0\) failed Match: UNAVAILABLE"
            ):
                list(strict.drafts(contexts, config))
            assert list(partial.drafts(contexts, config)) == survivors.draft_batch(contexts, config)


class _CorruptRows(ShardServicer):
    """Inlines rows whose first token is outside the vocabulary."""

    def Match(self, request, context):
        reply = super().Match(request, context)
        for answer in reply.contexts:
            for hit in answer.hits:
                if hit.rows:
                    hit.rows = np.full(len(hit.rows) // 2, 499 + 7, "<u2").tobytes()
        return reply


def test_a_server_answering_nonsense_is_unavailable_or_left_out(index):
    path, docs, num_shards = index
    contexts = contexts_from(docs, 20, seed=2)
    with (
        shard_servers(path, [[0]]) as good,
        shard_servers(path, [list(range(1, num_shards))], servicer=_CorruptRows) as bad,
    ):
        with Router.connect(path / "manifest.json", RouterConfig(good + bad)) as router:
            with pytest.raises(RetrieverUnavailable, match="neither a token id below 500 nor the separator"):
                list(router.drafts(contexts, DraftConfig()))
        with (
            Router.connect(path / "manifest.json", RouterConfig(good + bad, allow_partial=True)) as router,
            Datastore.open(path, shards=[0]) as survivor,
        ):
            assert list(router.drafts(contexts, DraftConfig())) == survivor.draft_batch(contexts, DraftConfig())


class _Slow(ShardServicer):
    """Answers Match after a second."""

    def Match(self, request, context):
        time.sleep(1.0)
        return super().Match(request, context)


def test_the_callers_deadline_bounds_the_wait_for_a_late_server(index):
    """A router allowed 30 s per shard call gives up on a late server when its own caller's
    deadline passes, not 30 s later (a client that left does not keep router threads busy)."""
    path, docs, num_shards = index
    contexts = contexts_from(docs, 4, seed=3)
    with shard_servers(path, [list(range(num_shards))], servicer=_Slow) as slow:
        with Router.connect(path / "manifest.json", RouterConfig(slow, timeout=30.0)) as router:
            start = time.monotonic()
            with pytest.raises(RetrieverUnavailable, match="DEADLINE_EXCEEDED"):
                list(router.drafts(contexts, DraftConfig(), timeout=0.2))
            assert time.monotonic() - start < 0.2 + 0.7 * TIME_SCALE  # the 0.2 s deadline, not the 30 s timeout
            with Datastore.open(path) as single:  # no deadline: the late answer is waited for
                assert list(router.drafts(contexts, DraftConfig())) == single.draft_batch(contexts, DraftConfig())


def test_shard_servers_with_a_token_need_the_router_to_send_it(index):
    path, docs, num_shards = index
    config = ServerConfig(port=0, workers=2, grace_seconds=0, auth_token="s3cr3t")
    contexts = contexts_from(docs, 10, seed=5)
    with shard_servers(path, [list(range(num_shards))], config=config) as addresses:
        with pytest.raises(ConnectionError, match="UNAUTHENTICATED"):
            Router.connect(path / "manifest.json", RouterConfig(addresses))
        with (
            Router.connect(path / "manifest.json", RouterConfig(addresses, auth_token="s3cr3t")) as router,
            Datastore.open(path) as store,
        ):
            assert list(router.drafts(contexts, DraftConfig())) == store.draft_batch(contexts, DraftConfig())
