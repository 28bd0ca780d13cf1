"""The model's own corpus as an index, and several indexes answering as one.

``build_index --corpus outputs:DIR`` runs on a real durable output store (written through
``OutputStore.add``) and a real tokenizer: where it fails or warns, as a process of its own, whose
stderr is checked; a build that must succeed through its ``main`` in this process. Its oracle is
the store's records, in order.
The union's oracle is one index built from the documents of all its parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rest_spec.common.tokenizer import tokenizer_fingerprint
from rest_spec.common.types import DraftConfig
from rest_spec.datastore import format as fmt
from rest_spec.datastore.__main__ import main as datastore_main
from rest_spec.datastore.index import Datastore, IncompatibleIndexesError, index_paths
from rest_spec.datastore.outputs import OutputStore, OutputStoreError, open_output_store, read_outputs
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.sources import open_datastore
from tests.helpers import write_index
from tests.test_build_cli import built, leftovers, run_cli
from tests.tiers import examples

VOCAB = 64  # the word-level tokenizer's ids: "[UNK]" = 0, "t1" .. "t63"
OUTPUTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [20, 21, 5, 6, 22, 23, 24, 25], [30, 31, 32], [40, 41], [50, 51, 52]]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer of exactly ``VOCAB`` ids, saved the way models ship tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "words"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def fill_store(directory: Path, outputs: list[list[int]], vocab_size: int | None = VOCAB) -> list[int]:
    """Add ``outputs`` to the durable store in ``directory`` as a server would; their seqs."""
    store = open_output_store(10**6, directory, vocab_size=vocab_size)
    with store:
        return [store.add(output) for output in outputs]


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def error_line(result) -> str:
    """The one stderr line of a failed build (status 1)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("build_index: error: "), result.stderr
    return lines[0]


def documents(path) -> list[list[int]]:
    with Datastore.open(path) as store:
        return [d.tolist() for d in store.documents()]


def path_in_tree(tree, path: list[int]) -> bool:
    """Whether ``path`` runs from the root down ``tree`` (explicit parent walk)."""
    parent = -1
    for token in path:
        children = [i for i in range(len(tree)) if tree.parents[i] == parent and tree.tokens[i] == token]
        if not children:
            return False
        parent = children[0]
    return True


# --------------------------------------------------------------------------- the reader


def test_read_outputs_is_the_records_in_order_without_a_lock_or_a_write(tmp_path):
    store = OutputStore(10**6, tmp_path / "store")  # open: it holds the lock, as a serving process does
    try:
        seqs = [store.add(output) for output in OUTPUTS]
        before = files_of(tmp_path / "store")
        read = read_outputs(tmp_path / "store")
        assert [seq for seq, _ in read] == seqs and [t.tolist() for _, t in read] == OUTPUTS
        assert files_of(tmp_path / "store") == before
        assert store.add([1, 2]) == seqs[-1] + 1  # the server goes on appending
    finally:
        store.close()
    with pytest.raises(OutputStoreError, match="holds no output store"):
        read_outputs(tmp_path / "nothing")


# --------------------------------------------------------------------------- build_index outputs:DIR


@pytest.mark.build
def test_outputs_index_holds_the_records_in_order_and_drafts_their_continuation(tmp_path, word_tokenizer):
    from transformers import AutoTokenizer

    directory = tmp_path / "store"
    fill_store(directory, OUTPUTS)
    before = files_of(directory)
    with OutputStore(10**6, directory):  # a server still holds the store: the build reads beside it
        summary = built("--corpus", f"outputs:{directory}", "--tokenizer", word_tokenizer, "--skip-last", 2,
                        "--out", tmp_path / "idx", cwd=tmp_path)  # fmt: skip
    assert files_of(directory) == before

    assert documents(tmp_path / "idx") == OUTPUTS[:-2]
    assert (summary["records"], summary["held_out"], summary["documents"]) == (4, 2, 4)
    indexed_tokens = sum(map(len, OUTPUTS[:-2]))
    manifest = fmt.read_manifest(tmp_path / "idx")
    corpus = manifest.corpus
    assert (corpus["kind"], corpus["path"], corpus["records"], corpus["tokens"]) == (
        "outputs", str(directory.resolve()), 4, indexed_tokens
    )  # fmt: skip
    assert manifest.num_tokens == summary["tokens"] == indexed_tokens
    assert manifest.tokenizer.name == str(word_tokenizer) and manifest.tokenizer.vocab_size == VOCAB
    assert manifest.tokenizer.fingerprint == tokenizer_fingerprint(AutoTokenizer.from_pretrained(word_tokenizer))

    with Datastore.open(tmp_path / "idx") as store:  # a stored output's start drafts its continuation
        tree = store.draft([20, 21, 5, 6], DraftConfig(budget=16, max_depth=4, n_min=2))
    assert tree.match_len == 4 and path_in_tree(tree, [22, 23, 24, 25])

    built("--corpus", f"outputs:{directory}", "--tokenizer", word_tokenizer, "--max-docs", 2,
          "--out", tmp_path / "first", cwd=tmp_path)  # fmt: skip
    assert documents(tmp_path / "first") == OUTPUTS[:2]


@pytest.mark.build
@pytest.mark.cli
def test_a_damaged_log_is_refused_and_left_byte_identical_until_salvage_skips_the_damage(tmp_path, word_tokenizer):
    directory = tmp_path / "store"
    fill_store(directory, OUTPUTS)
    log_path = directory / "outputs.log"
    data = bytearray(log_path.read_bytes())
    second = 8 + 16 + 4 * len(OUTPUTS[0])  # magic, then the first record (header + payload)
    data[second + 16] ^= 0xFF  # the second record's first token
    log_path.write_bytes(bytes(data))
    before = files_of(directory)
    common = ("--corpus", f"outputs:{directory}", "--tokenizer", word_tokenizer, "--out", tmp_path / "idx")

    line = error_line(run_cli(*common, cwd=tmp_path))
    assert f"corrupt record at byte {second}, followed by {len(OUTPUTS) - 2} valid records" in line
    assert "--outputs-salvage" in line
    assert files_of(directory) == before and not (tmp_path / "idx").exists() and leftovers(tmp_path) == []

    salvaged = run_cli(*common, "--outputs-salvage", cwd=tmp_path, quiet=False)
    assert salvaged.returncode == 0, salvaged.stderr
    assert "skipped" in salvaged.stderr and "the log is unchanged" in salvaged.stderr
    assert documents(tmp_path / "idx") == [OUTPUTS[0], *OUTPUTS[2:]]
    assert files_of(directory) == before

    # A torn last record (a crash mid-write, or a write under way) was never acknowledged: left out,
    # as the server's replay does, and the log is not cut back.
    fill_store(tmp_path / "torn", OUTPUTS)
    torn_log = tmp_path / "torn" / "outputs.log"
    torn_log.write_bytes(torn_log.read_bytes() + bytes(10))
    before = files_of(tmp_path / "torn")
    torn = run_cli("--corpus", f"outputs:{tmp_path / 'torn'}", "--tokenizer", word_tokenizer,
                   "--out", tmp_path / "torn-idx", cwd=tmp_path, quiet=False)  # fmt: skip
    assert torn.returncode == 0, torn.stderr
    assert "torn last record" in torn.stderr
    assert documents(tmp_path / "torn-idx") == OUTPUTS and files_of(tmp_path / "torn") == before


@pytest.mark.build
@pytest.mark.cli
def test_an_id_outside_the_tokenizers_vocabulary_is_refused_naming_the_store_and_the_tokenizer(
    tmp_path, word_tokenizer
):
    directory = tmp_path / "store"
    fill_store(directory, [[1, 2, 3], [4, VOCAB + 6, 5]], vocab_size=None)  # another model's ids
    line = error_line(
        run_cli(
            "--corpus", f"outputs:{directory}", "--tokenizer", word_tokenizer, "--out", tmp_path / "idx", cwd=tmp_path
        )
    )
    assert f"corpus 'outputs:{directory}': record seq 1 holds token id {VOCAB + 6}" in line
    assert f"vocabulary of tokenizer {word_tokenizer} ({VOCAB} ids)" in line
    assert not (tmp_path / "idx").exists() and leftovers(tmp_path) == []

    for args, message in (
        (["--corpus", f"outputs:{tmp_path / 'none'}"], "holds no output store"),
        (["--corpus", f"outputs:{directory}", "--field", "text"], "--field does not apply"),
        (["--corpus", str(word_tokenizer), "--outputs-salvage"], "--outputs-salvage applies to an outputs:DIR"),
    ):
        assert message in error_line(
            run_cli(*args, "--tokenizer", word_tokenizer, "--out", tmp_path / "x", cwd=tmp_path)
        )


# --------------------------------------------------------------------------- several indexes as one


def tree_tuple(tree) -> tuple:
    return (tree.tokens.tolist(), tree.parents.tolist(), tree.counts.tolist(), tree.match_len, tree.num_matches,
            tree.num_sampled)  # fmt: skip


docs_strategy = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=8)  # none split


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=docs_strategy, b=docs_strategy, data=st.data(), shard_tokens=st.sampled_from([8, 40, 1 << 20]))
def test_two_indexes_draft_the_trees_of_one_index_of_all_their_documents(tmp_path, a, b, data, shard_tokens):
    """Every match counted (the default cap is far above these corpora): the union answers what one
    index of A's documents then B's answers, however either is cut into shards."""
    write_index(tmp_path / "a", a, vocab_size=6, shard_tokens=shard_tokens)
    write_index(tmp_path / "b", b, vocab_size=6, shard_tokens=max(8, shard_tokens // 2))
    write_index(tmp_path / "ab", a + b, vocab_size=6)
    config = DraftConfig(budget=data.draw(st.integers(1, 20)), max_depth=data.draw(st.integers(1, 6)),
                         n_max=data.draw(st.integers(2, 6)), n_min=data.draw(st.integers(1, 2)))  # fmt: skip
    with Datastore.open([tmp_path / "a", tmp_path / "b"]) as union, Datastore.open(tmp_path / "ab") as one:
        assert [d.tolist() for d in union.documents()] == [d.tolist() for d in one.documents()]
        for _ in range(5):
            context = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=10))
            assert tree_tuple(union.draft(context, config)) == tree_tuple(one.draft(context, config))


def test_above_the_cap_the_union_samples_as_one_index_of_the_same_shards(tmp_path):
    """Documents of one shard each (length = shard_tokens) make the same shards either way, so even
    the seeded sample over the concatenated match ranges is the same."""
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, 3, size=(n, 12)).tolist() for n in (30, 20))
    write_index(tmp_path / "a", a, vocab_size=3, shard_tokens=12)
    write_index(tmp_path / "b", b, vocab_size=3, shard_tokens=12)
    write_index(tmp_path / "ab", a + b, vocab_size=3, shard_tokens=12)
    config = DraftConfig(budget=10, max_depth=4, n_max=3, n_min=1)
    with (
        Datastore.open([tmp_path / "a", tmp_path / "b"], max_candidates=7) as union,
        Datastore.open(tmp_path / "ab", max_candidates=7) as one,
    ):
        sampled = 0
        for context in ([0], [1, 2], [2, 2, 0], [0, 1], [1]):
            tree = union.draft(context, config)
            assert tree_tuple(tree) == tree_tuple(one.draft(context, config))
            sampled += tree.num_sampled < tree.num_matches
        assert sampled >= 3
        info, whole = union.info(), one.info()
    assert dataclasses.replace(info, shards=()) == dataclasses.replace(whole, shards=())
    assert [s.name for s in info.shards] == [f"{tmp_path / p}/{fmt.shard_name(i)}" for p, n in (("a", 30), ("b", 20))
                                             for i in range(n)]  # fmt: skip
    assert [(s.num_tokens, s.num_documents) for s in info.shards] == [(12, 1)] * 50


def test_indexes_that_cannot_answer_as_one_are_refused_in_one_line_naming_both(tmp_path):
    write_index(tmp_path / "a", [[1, 2, 3]], vocab_size=10, fingerprint="sha256:aaaa")
    write_index(tmp_path / "b", [[1, 2, 4]], vocab_size=10, fingerprint="sha256:bbbb")
    write_index(tmp_path / "big", [[1, 2, 4]], vocab_size=70_000, fingerprint="sha256:aaaa")
    for other, what in (("b", "tokenizer fingerprints differ"), ("big", "vocabulary sizes differ")):
        with pytest.raises(IncompatibleIndexesError) as refused:
            Datastore.open([tmp_path / "a", tmp_path / other])
        message = str(refused.value)
        assert "\n" not in message and what in message
        assert f"cannot open {tmp_path / 'a'} and {tmp_path / other} as one datastore" in message
    with pytest.raises(ValueError, match="is given twice"):
        Datastore.open([tmp_path / "a", tmp_path / "." / "a"])


def test_several_indexes_wherever_a_datastore_is_named(tmp_path, monkeypatch, capsys):
    a = write_index(tmp_path / "a", [[1, 2, 3, 4], [7, 8]], vocab_size=10)
    b = write_index(tmp_path / "b", [[1, 2, 3, 5]], vocab_size=10)
    assert index_paths([f"{a},{b}"]) == index_paths([str(a), str(b)]) == [a, b]
    assert index_paths(str(a)) == [a]

    with LocalDrafter.open([a, b], outputs_max_tokens=0) as drafter:
        expected = tree_tuple(drafter.draft([1, 2, 3], DraftConfig(n_min=1)))
        assert drafter.info().num_documents == 3
    assert expected[0] == [4, 5] and expected[2] == [1, 1]
    drafter = open_datastore(f"{a},{b}", outputs_max_tokens=0)
    with drafter:
        assert tree_tuple(drafter.draft([1, 2, 3], DraftConfig(n_min=1))) == expected
    with pytest.raises(ValueError, match=f"cannot use datastore '{a},{tmp_path / 'c'}' \\(2 indexes\\)"):
        open_datastore(f"{a},{tmp_path / 'c'}")

    def run(*argv) -> tuple[int, str]:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            status = datastore_main(list(argv))
        return status, out.getvalue()

    status, text = run("info", "--index", str(a), "--index", str(b))
    info = json.loads(text)
    assert status == 0 and (info["num_documents"], info["num_tokens"], len(info["shards"])) == (3, 10, 2)
    assert json.loads(run("info", "--index", f"{a},{b}")[1]) == info
    monkeypatch.setenv("REST_INDEX", f"{a},{b}")
    assert json.loads(run("info")[1]) == info
    status, text = run("draft", "--tokens", "1,2,3", "--n-min", "1")
    assert status == 0 and "num_matches=2" in text
    assert run("serve", "--shards", "0")[0] == 2
    assert "--shards serves shards of one index" in capsys.readouterr().err
