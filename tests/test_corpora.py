"""Corpus readers on small real files: which records and documents each source yields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_spec.build_index.corpora import (
    Corpus,
    CorpusError,
    CorpusSpec,
    ReadStats,
    Record,
    TolerantJsonArray,
    Turn,
    held_out_records,
    iter_records,
    open_corpus,
)
from tests.tiers import examples


def docs(spec: CorpusSpec) -> list[str]:
    return [d for r in iter_records(spec) for d in r.documents(spec.turns)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------- files


def test_a_file_over_the_size_limit_is_skipped_without_being_opened(tmp_path):
    """--max-file-mib is checked on the stat: a file over it is counted as skipped and never opened
    (the audit hook sees every open in this process)."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.py").write_text("small = 1\n")
    with open(root / "b.py", "wb") as big:
        big.truncate((1 << 20) + 1)  # sparse: 1 MiB and one byte
    opened: list[str] = []
    watching = [True]
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if watching[0] and event == "open" else None)
    try:
        corpus = open_corpus(CorpusSpec(corpus=str(root), max_file_mib=1))
        texts = [turn.text for record in corpus.records() for turn in record.turns]
    finally:
        watching[0] = False  # audit hooks cannot be removed
    assert texts == ["small = 1\n"] and corpus.stats.skipped == 1
    assert str(root / "a.py") in opened and str(root / "b.py") not in opened


def test_directory_sorted_filtered_and_skips_unreadable(tmp_path, caplog):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "b.py").write_text("print('b')\n")
    (tmp_path / "a.md").write_text("# a\n")
    (tmp_path / "sub" / "c.py").write_text("c = 1\n")
    (tmp_path / "notes.txt").write_text("not selected\n")
    (tmp_path / ".hidden.py").write_text("hidden\n")
    (tmp_path / ".git" / "x.py").write_text("git\n")
    (tmp_path / "__pycache__" / "y.py").write_text("cache\n")
    (tmp_path / "blob.py").write_bytes(b"\x00\x01binary")
    (tmp_path / "latin1.py").write_bytes("caf\xe9\n".encode("latin-1"))

    corpus = open_corpus(CorpusSpec(str(tmp_path), extensions=("py", ".MD")))
    records = list(corpus.records())
    assert [r.id for r in records] == ["a.md", "b.py", "sub/c.py"]
    assert [r.documents() for r in records] == [["# a\n"], ["print('b')\n"], ["c = 1\n"]]
    assert corpus.stats.skipped == 2
    assert "skipped 2 binary or non-UTF-8 files" in caplog.text
    assert corpus.provenance()["kind"] == "directory" and corpus.slug == tmp_path.name


def test_txt_file_is_one_document(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("line one\nline two\n")
    assert docs(CorpusSpec(str(path))) == ["line one\nline two\n"]


def test_jsonl_field_and_wrong_field_names_the_available_ones(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"id": i, "body": f"text {i}", "meta": 0} for i in range(3)])
    assert docs(CorpusSpec(path, field="body")) == ["text 0", "text 1", "text 2"]
    with pytest.raises(CorpusError, match=r"no field 'text'; available fields: id, body, meta"):
        open_corpus(CorpusSpec(path))


def test_parquet_column(tmp_path):
    import datasets

    path = str(tmp_path / "code.parquet")
    datasets.Dataset.from_list([{"code": "x = 1"}, {"code": "y = 2"}, {"code": ""}]).to_parquet(path)
    assert docs(CorpusSpec(path, field="code")) == ["x = 1", "y = 2"]  # empty texts are no documents
    assert open_corpus(CorpusSpec(path, field="code")).slug == "code"


# --------------------------------------------------------------------------- Hub corpora from local copies

ULTRACHAT = [
    {"id": "0", "data": ["q0", "a0", "q0b", "a0b"]},
    {"id": "1", "data": ["q1", "a1"]},
]
ULTRACHAT_200K = [
    {"prompt": "q0", "prompt_id": "p0", "messages": [
        {"role": "system", "content": "s0"}, {"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]},
    {"prompt": "q1", "prompt_id": "p1", "messages": [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]},
]  # fmt: skip


@pytest.mark.parametrize(
    "rows, assistant, every",
    [
        (ULTRACHAT, ["a0", "a0b", "a1"], ["q0", "a0", "q0b", "a0b", "q1", "a1"]),
        (ULTRACHAT_200K, ["a0", "a1"], ["s0", "q0", "a0", "q1", "a1"]),
    ],
    ids=["data", "messages"],
)
def test_ultrachat_local_both_forms_and_turn_policy(tmp_path, rows, assistant, every):
    path = write_jsonl(tmp_path / "ultrachat.jsonl", rows)
    assert docs(CorpusSpec("ultrachat", data_files=(path,))) == assistant
    assert docs(CorpusSpec("ultrachat", data_files=(path,), turns="all")) == every
    # A local copy of ultrachat_200k keeps its split names.
    assert docs(CorpusSpec("ultrachat", data_files=(path,), split="train_sft")) == assistant


def test_the_stack_local_parquet_glob(tmp_path):
    import datasets

    for part, files in enumerate([["a = 1", "b = 2"], ["c = 3"]]):
        rows = [{"content": c, "lang": "Python", "size": len(c)} for c in files]
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / f"data-{part:05d}.parquet"))
    corpus = open_corpus(CorpusSpec("the-stack", data_files=(str(tmp_path / "data-*.parquet"),)))
    assert [d for r in corpus.records() for d in r.documents()] == ["a = 1", "b = 2", "c = 3"]
    prov = corpus.provenance()
    assert prov["hub"] == "bigcode/the-stack-dedup" and len(prov["data_files"]) == 2 and prov["records"] == 3


@pytest.mark.cli
@pytest.mark.parametrize("name, repo", [("ultrachat", "stingning/ultrachat"), ("the-stack", "bigcode/the-stack-dedup"),
                                        ("hf:someone/data", "someone/data")])  # fmt: skip
@pytest.mark.parametrize(
    "offline",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
    ids=["offline-mode", "unreachable-endpoint"],
)
def test_offline_hub_fails_with_one_line_pointing_to_a_local_copy(name, repo, offline):
    script = textwrap.dedent(f"""
        from rest_spec.build_index.corpora import CorpusError, CorpusSpec, open_corpus
        try:
            open_corpus(CorpusSpec({name!r}))
        except CorpusError as exc:
            print(exc)
    """)
    env = {**os.environ, **offline}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 1, out.stderr
    assert "thrown while requesting" not in out.stderr  # answered before any round of Hub retries
    assert repo in lines[0] and "--data-files" in lines[0]


# --------------------------------------------------------------------------- ShareGPT

CONVERSATIONS = [
    {"id": f"c{i}", "conversations": [
        {"from": "system", "value": f"sys {i}"}, {"from": "human", "value": f"q{i} \u00e9\u2603"},
        {"from": "gpt", "value": f"a{i} with \"quotes\", [brackets] and {{braces}}"}]}
    for i in range(5)
]  # fmt: skip


def sharegpt_text() -> tuple[str, list[int]]:
    """A pretty-printed ShareGPT array and the offset just past each element."""
    text = json.dumps(CONVERSATIONS, indent=2, ensure_ascii=False)
    ends, decoder, pos = [], json.JSONDecoder(), text.index("{")
    for _ in CONVERSATIONS:
        _, pos = decoder.raw_decode(text, pos)
        ends.append(pos)
        pos = text.find("{", pos)
    return text, ends


def test_sharegpt_truncated_file_recovers_exactly_the_complete_conversations(tmp_path):
    text, ends = sharegpt_text()
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: ends[3] + 20], encoding="utf-8")  # cut inside the fifth conversation
    corpus = open_corpus(CorpusSpec("sharegpt", data_files=(str(path),)))
    records = list(corpus.records())
    assert [r.id for r in records] == ["c0", "c1", "c2", "c3"]
    assert records[0].turns == (Turn("system", "sys 0"), Turn("user", "q0 \u00e9\u2603"),
                                Turn("assistant", 'a0 with "quotes", [brackets] and {braces}'))  # fmt: skip
    assert corpus.stats.recovered == 4 and corpus.stats.truncated is True
    assert {"recovered": 4, "truncated": True}.items() <= corpus.provenance().items()


@settings(max_examples=examples(60), deadline=None)
@given(cut=st.integers(min_value=1, max_value=len(sharegpt_text()[0])), chunk=st.integers(min_value=1, max_value=64))
def test_tolerant_reader_at_every_cut_and_chunk_size(tmp_path_factory, cut, chunk):
    text, ends = sharegpt_text()
    path = tmp_path_factory.mktemp("cut") / "a.json"
    path.write_text(text[:cut], encoding="utf-8")
    array = TolerantJsonArray(path, chunk_chars=chunk)
    items = list(array)
    complete = sum(end <= cut for end in ends)
    assert items == CONVERSATIONS[:complete]
    assert array.recovered == complete
    assert array.truncated is (cut < len(text))


def test_tolerant_reader_rejects_a_non_array(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"a": 1}')
    with pytest.raises(CorpusError, match="not a JSON array"):
        list(TolerantJsonArray(path))


def test_packaged_sharegpt_reads_from_the_start():
    corpus = open_corpus(CorpusSpec("sharegpt", max_docs=3))
    records = list(corpus.records())
    assert len(records) == 3 and all(r.documents() for r in records)
    assert all(t.role in ("user", "assistant", "system") for r in records for t in r.turns)


# --------------------------------------------------------------------------- stdlib


def test_python_stdlib_sorted_python_sources():
    records = list(iter_records(CorpusSpec("python-stdlib", max_docs=40)))
    ids = [r.id for r in records]
    assert len(ids) == 40 and all(i.endswith(".py") for i in ids)
    assert not any(part in ("site-packages", "dist-packages", "__pycache__") for i in ids for part in i.split("/"))
    top = [i for i in ids if "/" not in i]
    assert top == sorted(top)


def test_python_package_reads_an_installed_package_in_a_hashed_order():
    import importlib.metadata
    import importlib.util
    from pathlib import Path

    spec = CorpusSpec("python-package:tqdm", skip_last=4)
    corpus = open_corpus(spec)
    root = Path(importlib.util.find_spec("tqdm").submodule_search_locations[0])
    sources = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    indexed, held = [r.id for r in corpus.records()], [r.id for r in held_out_records(spec)]
    assert set(indexed) | set(held) == sources and len(held) == 4 and not set(indexed) & set(held)
    assert indexed + held != sorted(sources)  # not the sorted walk: the held-out files are one corner of that
    assert [r.id for r in open_corpus(spec).records()] == indexed  # the same order on every read
    assert (root / indexed[0]).read_text() == next(iter_records(spec)).turns[0].text
    provenance = corpus.provenance()
    assert provenance["kind"] == "python-package" and provenance["package"] == "tqdm"
    assert provenance["version"] == importlib.metadata.version("tqdm") and provenance["path"] == str(root)


# --------------------------------------------------------------------------- max_docs / skip_last


def list_corpus(n: int, max_docs: int | None, skip_last: int) -> Corpus:
    def read(stats: ReadStats):
        for i in range(n):  # a generator: nothing knows the length in advance
            yield Record(str(i), (Turn("text", f"doc {i}"),))

    return Corpus(CorpusSpec("stream", max_docs=max_docs, skip_last=skip_last), "test", {}, read, "stream")


@given(n=st.integers(0, 30), max_docs=st.none() | st.integers(1, 40), skip_last=st.integers(0, 40))
def test_window_and_held_out_tail_partition_the_stream(n, max_docs, skip_last):
    corpus = list_corpus(n, max_docs, skip_last)
    window = [str(i) for i in range(n)][:max_docs]
    kept = window[: max(0, len(window) - skip_last)]
    assert [r.id for r in corpus.records()] == kept
    assert [r.id for r in corpus.held_out()] == window[len(kept) :]
    assert (corpus.stats.records, corpus.stats.held_out) == (len(kept), len(window) - len(kept))


def test_skip_last_holds_out_whole_conversations_of_a_dataset_stream(tmp_path):
    rows = [{"id": str(i), "data": [f"q{i}", f"a{i}", f"q{i}b", f"a{i}b"]} for i in range(10)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    spec = CorpusSpec("ultrachat", data_files=(path,), max_docs=8, skip_last=3, turns="all")
    indexed = docs(spec)
    held = held_out_records(spec)
    assert [r.id for r in held] == ["5", "6", "7"]
    assert indexed == [t for i in range(5) for t in (f"q{i}", f"a{i}", f"q{i}b", f"a{i}b")]
    assert not {t.text for r in held for t in r.turns} & set(indexed)
    # The manifest's spec rebuilds the same held-out set.
    roundtrip = CorpusSpec.from_dict(json.loads(json.dumps(open_corpus(spec).provenance()["spec"])))
    assert roundtrip == spec and held_out_records(roundtrip) == held


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "spec, message",
    [
        (CorpusSpec("sharegtp"), "unknown corpus 'sharegtp'"),
        (CorpusSpec("no/such/dir"), "corpus path not found: no/such/dir"),
        (CorpusSpec("ultrachat", data_files=("/nowhere/*.jsonl",)), "no data file matches"),
        (CorpusSpec("python-stdlib", field="text"), "--field does not apply"),
        (CorpusSpec("sharegpt", extensions=(".py",)), "--extensions does not apply"),
        (CorpusSpec("python-package:no_such_package"), "'no_such_package' is not an installed package"),
        (CorpusSpec("python-package:tqdm.auto"), "'tqdm.auto' is not an installed package"),
        (CorpusSpec("python-package:"), "'' is not an installed package"),
        (CorpusSpec("python-package:tqdm", extensions=(".md",)), "--extensions does not apply"),
    ],
)
def test_bad_specs_raise_one_line_errors(spec, message):
    with pytest.raises(CorpusError, match=message) as info:
        open_corpus(spec)
    assert "\n" not in str(info.value)


def test_spec_validation():
    with pytest.raises(CorpusError, match="turns"):
        CorpusSpec("sharegpt", turns="user")
    with pytest.raises(CorpusError, match="max_docs"):
        CorpusSpec("sharegpt", max_docs=0)
