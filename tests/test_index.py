"""The retrieval engine against the brute-force oracle, on random and real-text corpora."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rest_spec.build_index.writer import IndexWriter
from rest_spec.common.types import DraftConfig
from rest_spec.datastore import format as fmt
from rest_spec.datastore.index import Datastore
from tests.helpers import brute_draft, write_index
from tests.tiers import examples


def assert_matches_oracle(store, docs, context, config):
    tree = store.draft(context, config)
    tokens, parents, counts, match_len, num_matches = brute_draft(
        docs, context, budget=config.budget, max_depth=config.max_depth, n_max=config.n_max, n_min=config.n_min
    )
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    assert tree.counts.tolist() == counts
    assert (tree.match_len, tree.num_matches) == ((match_len, num_matches) if tokens or match_len else (0, 0))
    assert tree.num_sampled == tree.num_matches


docs_strategy = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=40), min_size=1, max_size=12).filter(
    lambda docs: any(docs)
)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=docs_strategy, data=st.data(), shard_tokens=st.sampled_from([7, 50, 1 << 20]))
def test_draft_equals_brute_force_on_random_corpora(tmp_path, docs, data, shard_tokens):
    # small alphabet -> many repeats, ties and deep shared prefixes
    write_index(tmp_path / "idx", docs, vocab_size=6, shard_tokens=shard_tokens)
    # documents longer than a shard are split by the writer; the oracle sees the same pieces
    pieces = [d[i : i + shard_tokens] for d in docs for i in range(0, len(d), shard_tokens)]
    config = DraftConfig(
        budget=data.draw(st.integers(1, 30)),
        max_depth=data.draw(st.integers(1, 6)),
        n_max=data.draw(st.integers(2, 6)),
        n_min=data.draw(st.integers(1, 2)),
    )
    with Datastore.open(tmp_path / "idx") as store:
        assert [d.tolist() for d in store.documents()] == [p for p in pieces if p]
        for _ in range(5):
            context = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=10))
            assert_matches_oracle(store, pieces, context, config)


def test_draft_on_real_text(tmp_path):
    """Byte-level 'tokens' of real prose: realistic repetition structure, vocabulary 256."""
    text = (fmt.__doc__ + Datastore.__doc__ + (Datastore.draft.__doc__ or "")).encode()
    docs = [list(part) for part in text.split(b"\n\n") if part]
    write_index(tmp_path / "idx", docs, vocab_size=256, shard_tokens=300)
    pieces = [d[i : i + 300] for d in docs for i in range(0, len(d), 300)]
    rng = np.random.default_rng(0)
    config = DraftConfig(budget=16, max_depth=8, n_max=8, n_min=2)
    with Datastore.open(tmp_path / "idx") as store:
        nonempty = 0
        for _ in range(60):
            doc = pieces[rng.integers(len(pieces))]
            end = int(rng.integers(1, len(doc) + 1))
            context = doc[max(0, end - 12) : end]
            assert_matches_oracle(store, pieces, context, config)
            nonempty += len(store.draft(context, config)) > 0
        assert nonempty > 30


def test_tree_is_prefix_closed_with_exact_budget(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50, size=200).tolist() for _ in range(20)]
    docs += [[1, 2, 3] + rng.integers(0, 50, size=15).tolist() for _ in range(300)]
    write_index(tmp_path / "idx", docs, vocab_size=50)
    with Datastore.open(tmp_path / "idx") as store:
        for budget in (1, 8, 64, 200):
            tree = store.draft([9, 1, 2, 3], DraftConfig(budget=budget, max_depth=10))
            assert len(tree) == budget
            assert tree.match_len == 3 and tree.num_matches >= 300
            for i, p in enumerate(tree.parents):
                assert p < i and (p == -1 or tree.counts[p] >= tree.counts[i])
            paths = tree.paths()
            assert len(set(paths)) == len(paths)


def test_sampling_above_cap_is_deterministic_and_unbiased(tmp_path):
    # token 7 is followed by 1 in 70% of 5000 matches and by 2 in the rest, interleaved
    rng = np.random.default_rng(2)
    follow = np.where(rng.random(5000) < 0.7, 1, 2)
    docs = [[3, 7, int(f), 4] for f in follow]
    write_index(tmp_path / "idx", docs, vocab_size=10)
    with Datastore.open(tmp_path / "idx", max_candidates=1000) as store:
        config = DraftConfig(budget=4, max_depth=2, n_min=2)
        tree = store.draft([3, 7], config)
        assert tree.num_matches == 5000 and tree.num_sampled == 1000
        assert tree == store.draft([5, 3, 7], config)  # same matched suffix -> same sample
        share = dict(zip(tree.paths(), tree.scores))
        assert abs(share[(1,)] - (follow == 1).mean()) < 0.05  # lexicographic-first sampling would give ~1.0


def test_no_match_and_short_contexts(tmp_path):
    write_index(tmp_path / "idx", [[1, 2, 3, 4]], vocab_size=10)
    with Datastore.open(tmp_path / "idx") as store:
        assert len(store.draft([9, 9], DraftConfig())) == 0
        assert len(store.draft([3], DraftConfig(n_min=2))) == 0  # shorter than n_min
        tree = store.draft([3], DraftConfig(n_min=1))
        assert tree.paths() == [(4,)] and tree.match_len == 1
        assert len(store.draft([4], DraftConfig(n_min=1))) == 0  # document ends after 4


@pytest.mark.parametrize(
    "context, message",
    [([], "non-empty"), ([1, 10], "outside the vocabulary"), ([-1], "outside the vocabulary"), ([1.5], "integer")],
)
def test_bad_context_is_rejected(tmp_path, context, message):
    write_index(tmp_path / "idx", [[1, 2, 3]], vocab_size=10)
    with Datastore.open(tmp_path / "idx") as store, pytest.raises(ValueError, match=message):
        store.draft(context, DraftConfig())


def test_open_rejects_missing_and_corrupt_shards(tmp_path):
    write_index(tmp_path / "idx", [[1, 2, 3, 4]] * 50, vocab_size=10, shard_tokens=60)
    Datastore.open(tmp_path / "idx", verify=True).close()
    sa = tmp_path / "idx" / fmt.shard_file(1, "sa")
    data = bytearray(sa.read_bytes())
    data[-1] ^= 0xFF
    sa.write_bytes(bytes(data))
    with pytest.raises(fmt.IndexFormatError, match="corrupt"):
        Datastore.open(tmp_path / "idx")
    sa.unlink()
    with pytest.raises(fmt.IndexFormatError, match="missing"):
        Datastore.open(tmp_path / "idx")
    with pytest.raises(fmt.IndexFormatError, match="not found"):
        Datastore.open(tmp_path / "nowhere")


def test_writer_is_atomic_and_refuses_existing(tmp_path):
    write_index(tmp_path / "idx", [[1, 2, 3]], vocab_size=10)
    before = (tmp_path / "idx" / fmt.MANIFEST).read_text()
    with pytest.raises(FileExistsError):
        IndexWriter(tmp_path / "idx", tokenizer_name="t", tokenizer_fingerprint="f", vocab_size=10)
    with pytest.raises(RuntimeError):
        with IndexWriter(
            tmp_path / "idx", tokenizer_name="t", tokenizer_fingerprint="f", vocab_size=10, overwrite=True
        ) as writer:
            writer.add_document([4, 5, 6])
            raise RuntimeError("interrupted")
    assert (tmp_path / "idx" / fmt.MANIFEST).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # no temporary directory left behind
    with pytest.raises(ValueError, match="no documents"):
        write_index(tmp_path / "empty", [[], []], vocab_size=10)


def test_uint32_tokens_for_large_vocabularies(tmp_path):
    docs = [[70000, 1, 2, 70000, 1, 3]]
    write_index(tmp_path / "idx", docs, vocab_size=100000)
    with Datastore.open(tmp_path / "idx") as store:
        assert store.manifest.token_dtype == "<u4"
        assert_matches_oracle(store, docs, [70000, 1], DraftConfig(n_min=1))


@settings(max_examples=examples(60), deadline=None)
@given(docs=docs_strategy)
def test_suffix_array_is_sorted_reversed_suffixes_with_a_continuation(docs):
    """The format's ``sa``: exactly the positions followed by a real token, ordered by the
    reversed text ending there (checked by sorting Python tuples)."""
    sep = fmt.separator(np.dtype("<u2"))
    tokens = np.array([sep] + [t for d in docs if d for t in [*d, sep]], dtype="<u2")
    reversed_tokens = tokens[::-1].tolist()
    n = tokens.size
    with_next = [r for r in range(n) if tokens[n - 1 - r] != sep and r > 0 and tokens[n - r] != sep]
    expected = sorted(with_next, key=lambda r: reversed_tokens[r:])
    assert fmt.suffix_array(tokens).tolist() == expected
    assert len(expected) == fmt.sa_length(sum(len(d) for d in docs), sum(1 for d in docs if d))


def test_version_1_index_is_refused_with_a_rebuild_hint(tmp_path):
    write_index(tmp_path / "idx", [[1, 2, 3]], vocab_size=10)
    manifest = tmp_path / "idx" / fmt.MANIFEST
    manifest.write_text(manifest.read_text().replace('"format_version": 2', '"format_version": 1'))
    with pytest.raises(fmt.IndexFormatError, match="version 1 is not supported.*rebuild"):
        Datastore.open(tmp_path / "idx")


@settings(max_examples=examples(300), deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=6), min_size=1, max_size=40),
    budget=st.integers(1, 80),
    match_len=st.integers(1, 16),
)
def test_counted_trees_equal_checked_trees(rows, budget, match_len):
    """``counted_tree`` skips ``DraftTree``'s checks: what it builds must pass them, depths included."""
    from rest_spec.common.types import DraftTree
    from rest_spec.datastore.trie import counted_tree, top_c_tree

    width = max(map(len, rows))
    array = np.array([row + [7] * (width - len(row)) for row in rows], dtype=np.uint16)  # 7: the separator
    tree = counted_tree(array, 7, budget, match_len, 3 * len(rows))
    checked = DraftTree(*top_c_tree(array, 7, budget), match_len, 3 * len(rows), len(rows))
    assert tree == checked and np.array_equal(tree.depths, checked.depths) and tree.depths.dtype == np.int32
    assert not tree.tokens.flags.writeable and not tree.scores.flags.writeable
