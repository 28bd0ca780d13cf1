"""The request matcher (``drafter.core.request_matcher``: one request, and a step's rows at once) and
the output store (``datastore.outputs``) against brute-force oracles and the real index; the store's
eviction, persistence (reopen, torn and corrupt records, a killed writer) and threads."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.outputs import OutputStore, OutputStoreError
from rest_spec.drafter.core.request_matcher import RequestMatcher, draft_requests, extend_requests
from tests.helpers import brute_draft, request_oracle, synthetic_corpus, write_index
from tests.tiers import examples

configs = st.tuples(st.integers(1, 3), st.integers(0, 3)).flatmap(
    lambda n: st.builds(
        DraftConfig,
        budget=st.integers(1, 30),
        max_depth=st.integers(1, 6),
        n_min=st.just(n[0]),
        n_max=st.just(n[0] + n[1]),
    )
)


@settings(max_examples=examples(200), deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8),
    config=configs,
    max_candidates=st.sampled_from([1, 3, 4096]),
)
def test_request_matcher_equals_brute_force_at_every_step(chunks, config, max_candidates):
    matcher = RequestMatcher(max_candidates=max_candidates)
    context: list[int] = []
    for chunk in chunks:  # the decoding loop: the context grows, the matcher sees it every step
        context.extend(chunk)
        assert matcher.draft(context, config) == request_oracle(context, config, max_candidates)
    assert len(matcher) == len(context)


def test_request_matcher_on_a_long_request():
    """Past a few thousand tokens (the matcher's buffer regrown several times, the scan long)
    drafts stay equal to the oracle."""
    rng = np.random.default_rng(3)
    phrases = [rng.integers(0, 40, size=rng.integers(3, 12)).tolist() for _ in range(20)]
    matcher, context = RequestMatcher(max_candidates=64), []
    config = DraftConfig(budget=24, max_depth=6, n_max=8, n_min=2)
    for step in range(2000):
        context.extend(phrases[rng.integers(len(phrases))][: rng.integers(1, 12)])
        tree = matcher.draft(context, config)
        if step % 250 == 249:
            assert tree == request_oracle(context, config, 64)
    assert len(context) > 2 * 4096  # the buffer, 256 tokens at first, doubled at least five times


def test_request_matcher_copies_the_prompt():
    """What the static index cannot do: continue an identifier seen only in this prompt."""
    prompt = [5, 6, 100, 101, 102, 103, 104, 7, 8, 9, 100, 101]
    tree = RequestMatcher().draft(prompt, DraftConfig(budget=4, max_depth=4))
    assert tree.paths() == [(102,), (102, 103), (102, 103, 104), (102, 103, 104, 7)]
    assert (tree.match_len, tree.num_matches, tree.scores.tolist()) == (2, 1, [1.0] * 4)


def test_request_matcher_refuses_a_context_it_has_not_seen_grow():
    matcher = RequestMatcher()
    matcher.draft([1, 2, 3], DraftConfig())
    with pytest.raises(ValueError, match="one RequestMatcher per request"):
        matcher.draft([1, 2, 4, 5], DraftConfig())
    with pytest.raises(ValueError, match=r"context\[1\] = -1 is outside"):
        RequestMatcher().draft([1, -1], DraftConfig())
    with pytest.raises(ValueError, match="non-empty"):
        RequestMatcher().draft([], DraftConfig())


@settings(max_examples=examples(200), deadline=None)
@given(
    steps=st.lists(
        st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=8)), min_size=1, max_size=6),
        min_size=1,
        max_size=6,
    ),
    config=configs,
    max_candidates=st.sampled_from([1, 3, 4096]),
)
def test_a_steps_rows_drafted_at_once_equal_each_request_drafted_alone(steps, config, max_candidates):
    """``extend_requests`` and ``draft_requests``, as the adaptive drafter calls them each step:
    rows that start (a new matcher) or grow (as numpy views or lists, by nothing or several
    tokens) drafted in one pass, each equal to its own brute force."""
    matchers, contexts = [], []
    for step in steps:
        for i, (restart, tokens) in enumerate(step):
            if i == len(matchers):
                matchers.append(RequestMatcher(max_candidates))
                contexts.append([])
            elif restart:  # another request in this row
                matchers[i], contexts[i] = RequestMatcher(max_candidates), []
            contexts[i] = contexts[i] + tokens
        rows = [(np.array(c, np.int32) if i % 2 else c) for i, c in enumerate(contexts[: len(step)])]
        if any(len(row) == 0 for row in rows):
            continue
        extend_requests(matchers[: len(step)], rows)
        trees = draft_requests(matchers[: len(step)], config)
        assert trees == [request_oracle(c, config, max_candidates) for c in contexts[: len(step)]]


def test_a_bad_id_in_one_row_fails_as_that_rows_check_and_keeps_nothing():
    matchers = [RequestMatcher(), RequestMatcher()]
    extend_requests(matchers, [[1, 2], np.array([3, 4], np.int64)])
    with pytest.raises(ValueError, match=r"context\[3\] = -5 is outside"):
        extend_requests(matchers, [[1, 2, 7], np.array([3, 4, 8, -5], np.int64)])
    assert [m.tokens.tolist() for m in matchers] == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="must hold integer token ids"):
        extend_requests(matchers, [[1, 2, 7], np.array([3, 4, 8.5])])
    assert draft_requests([], DraftConfig()) == []


# ---- output store: drafting ------------------------------------------------------------------


def assert_drafts_like_oracle(store: OutputStore, docs: list[list[int]], context: list[int], config: DraftConfig):
    tree = store.draft(context, config)
    tokens, parents, counts, match_len, num_matches = brute_draft(
        docs, context, budget=config.budget, max_depth=config.max_depth, n_max=config.n_max, n_min=max(2, config.n_min)
    )
    assert (tree.tokens.tolist(), tree.parents.tolist(), tree.counts.tolist()) == (tokens, parents, counts)
    assert (tree.match_len, tree.num_matches, tree.num_sampled) == (match_len, num_matches, num_matches)


@settings(max_examples=examples(150), deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=25),
    max_tokens=st.integers(30, 200),
    config=configs,
    data=st.data(),
)
def test_output_store_drafts_like_brute_force_over_its_live_documents(docs, max_tokens, config, data):
    """Eviction keeps the newest documents within max_tokens, and drafts see exactly those (the
    small limit forces evictions and in-memory compactions along the way)."""
    store = OutputStore(max_tokens)
    for doc in docs:
        store.add(doc)
    live, total = [], 0
    for doc in reversed(docs):
        if total + len(doc) > max_tokens:
            break
        live.insert(0, doc)
        total += len(doc)
    assert [d.tolist() for d in store.documents()] == live
    assert store.num_tokens == total
    for _ in range(4):
        context = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=8))
        assert_drafts_like_oracle(store, live, context, config)


def test_output_store_drafts_like_the_real_index(tmp_path):
    docs = synthetic_corpus()
    write_index(tmp_path / "idx", docs, vocab_size=500)
    store = OutputStore(max_tokens=10**6)
    for doc in docs:
        store.add(doc)
    rng = np.random.default_rng(1)
    config = DraftConfig(budget=32, max_depth=8, n_max=8, n_min=2)
    with Datastore.open(tmp_path / "idx") as index:
        nonempty = 0
        for _ in range(100):
            doc = docs[rng.integers(len(docs))]
            end = int(rng.integers(2, len(doc) + 1))
            context = doc[max(0, end - 12) : end]
            tree = store.draft(context, config)
            assert tree == index.draft(context, config)
            nonempty += len(tree) > 0
    assert nonempty > 50


def test_output_store_counts_the_most_recent_matches_above_the_cap():
    store = OutputStore(max_tokens=1000, max_candidates=3)
    docs = [[1, 2, 10 + i, 20 + i] for i in range(10)]
    for doc in docs:
        store.add(doc)
    tree = store.draft([7, 1, 2], DraftConfig(budget=50, max_depth=3))
    assert (tree.num_matches, tree.num_sampled) == (10, 3)
    recent = brute_draft(docs[-3:], [7, 1, 2], budget=50, max_depth=3, n_max=16, n_min=2)
    assert (tree.tokens.tolist(), tree.parents.tolist(), tree.counts.tolist()) == recent[:3]


def test_output_store_refuses_bad_documents():
    store = OutputStore(max_tokens=5)
    with pytest.raises(ValueError, match="exceeds the store's max_tokens=5"):
        store.add(list(range(6)))
    with pytest.raises(ValueError, match="empty"):
        store.add([])
    with pytest.raises(ValueError, match="integer token ids"):
        store.add([1.5, 2.0])
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        OutputStore(0)


def test_a_bad_token_is_named_by_its_position_in_the_whole_context():
    """Drafting checks only the context's tail (or what a matcher has not seen), yet names the
    position in the context the caller passed."""
    context = list(range(1, 40)) + [-3]
    with pytest.raises(ValueError, match=r"context\[39\] = -3 is outside the vocabulary"):
        OutputStore(max_tokens=5).draft(context, DraftConfig(n_max=4))
    matcher = RequestMatcher()
    matcher.draft(context[:30])
    with pytest.raises(ValueError, match=r"context\[39\] = -3 is outside the vocabulary"):
        matcher.draft(context)


# ---- output store: persistence ---------------------------------------------------------------


def log_file(directory: Path) -> Path:
    return directory / "outputs.log"


def test_reopened_store_has_every_acknowledged_document(tmp_path):
    docs = [list(range(i, i + 5 + i % 7)) for i in range(40)]
    with OutputStore(10**6, tmp_path) as store:
        seqs = [store.add(doc) for doc in docs]
    assert seqs == list(range(40))
    config = DraftConfig(budget=16, max_depth=4)
    with OutputStore(10**6, tmp_path) as store:
        assert [d.tolist() for d in store.documents()] == docs
        assert_drafts_like_oracle(store, docs, [3, 4, 5], config)
        assert store.add([1, 2, 3]) == 40  # sequence numbers continue


def test_eviction_survives_reopen_and_the_log_is_compacted(tmp_path):
    docs = [[i % 50, (i * 7) % 50, (i * 13) % 50, i % 3] for i in range(500)]
    with OutputStore(100, tmp_path) as store:
        for doc in docs:
            store.add(doc)
        live = [d.tolist() for d in store.documents()]
    assert live == docs[-25:]
    # evicted data never outweighs live data for long: the log stays near 2 x 25 records
    assert log_file(tmp_path).stat().st_size < 8 + 2 * 26 * (16 + 4 * 4)
    with OutputStore(100, tmp_path) as store:
        assert [d.tolist() for d in store.documents()] == live
    with OutputStore(40, tmp_path) as store:  # a smaller limit applies on replay
        assert [d.tolist() for d in store.documents()] == docs[-10:]


def test_every_torn_last_record_is_dropped_and_nothing_acknowledged_is_lost(tmp_path, caplog):
    source = tmp_path / "source"
    with OutputStore(1000, source) as store:
        for doc in ([1, 2, 3], [4, 5, 6, 7]):
            store.add(doc)
    full = log_file(source).read_bytes()
    last_record = len(full) - (16 + 4 * 4)
    for cut in range(last_record + 1, len(full)):  # a crash anywhere inside the last write
        directory = tmp_path / f"cut{cut}"
        directory.mkdir()
        log_file(directory).write_bytes(full[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING), OutputStore(1000, directory) as store:
            assert [d.tolist() for d in store.documents()] == [[1, 2, 3]]
            assert "torn last record" in caplog.text
            assert store.add([8, 9]) == 1
        with OutputStore(1000, directory) as store:
            assert [d.tolist() for d in store.documents()] == [[1, 2, 3], [8, 9]]


def test_a_zero_filled_tail_is_torn_but_a_damaged_middle_record_is_refused(tmp_path, caplog):
    with OutputStore(1000, tmp_path) as store:
        for doc in ([1, 2, 3], [4, 5, 6, 7], [8]):
            store.add(doc)
    good = log_file(tmp_path).read_bytes()
    log_file(tmp_path).write_bytes(good + bytes(300))  # file size grew, data never written
    with caplog.at_level(logging.WARNING), OutputStore(1000, tmp_path) as store:
        assert len(store) == 3 and "torn" in caplog.text
    damaged = bytearray(good)
    damaged[8 + 16] ^= 0xFF  # first token of the first record
    log_file(tmp_path).write_bytes(bytes(damaged))
    with pytest.raises(OutputStoreError, match="corrupt record at byte 8"):
        OutputStore(1000, tmp_path)
    log_file(tmp_path).write_bytes(b"NOTALOG!" + good[8:])
    with pytest.raises(OutputStoreError, match="bad magic"):
        OutputStore(1000, tmp_path)


def test_a_second_process_cannot_open_an_open_store(tmp_path):
    with OutputStore(100, tmp_path):
        with pytest.raises(OutputStoreError, match="open in another process"):
            OutputStore(100, tmp_path)
    store = OutputStore(100, tmp_path)  # released on close
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.add([1, 2])  # never acknowledged without the log


def test_a_killed_writer_loses_no_acknowledged_document(tmp_path):
    """A real crash: a child process adds documents, printing each acknowledgement, and is
    killed with SIGKILL mid-stream; every acknowledged document must be there on reopen."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from rest_spec.datastore.outputs import OutputStore\n"
            f"store = OutputStore(10**7, {str(tmp_path)!r})\n"
            "for i in range(10**6):\n"
            "    print(store.add([i % 1000, 7, 8, i % 13]), flush=True)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert child.stdout is not None
    acked = [int(child.stdout.readline()) for _ in range(200)]
    child.kill()
    child.wait()
    with OutputStore(10**7, tmp_path) as store:
        docs = [d.tolist() for d in store.documents()]
    assert acked == list(range(200))
    assert len(docs) >= 200
    assert docs == [[i % 1000, 7, 8, i % 13] for i in range(len(docs))]


def test_concurrent_adds_and_drafts_from_threads(tmp_path):
    threads, per_thread = 6, 40
    config = DraftConfig(budget=8, max_depth=3)
    errors: list[BaseException] = []
    acks: list[list[int]] = [[] for _ in range(threads)]
    with OutputStore(10**6, tmp_path) as store:

        def work(t: int) -> None:
            try:
                for i in range(per_thread):
                    acks[t].append(store.add([t, i, t, i + 1]))
                    tree = store.draft([t, i], config)
                    assert (t,) in tree.paths()  # its own document is visible once acknowledged
            except BaseException as exc:  # surfaced in the main thread
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not errors
        in_memory = [d.tolist() for d in store.documents()]
    assert sorted(seq for a in acks for seq in a) == list(range(threads * per_thread))
    by_seq = {seq: [t, i, t, i + 1] for t in range(threads) for i, seq in enumerate(acks[t])}
    assert in_memory == [by_seq[seq] for seq in range(threads * per_thread)]
    with OutputStore(10**6, tmp_path) as store:
        assert [d.tolist() for d in store.documents()] == in_memory
