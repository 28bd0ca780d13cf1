"""The build_index CLI end to end on small real corpora and real tokenizers: the builds, and the
target directory's refusals, through its ``main`` in this process (``run_main``: what is tested is
what the command writes, not a new interpreter importing torch and transformers, 5 s a build);
its exit statuses for bad input as a process of its own (``run_cli``), whose whole stderr must be
one line.

The oracle for an index: every document, tokenized on its own by the tokenizer through
``transformers`` and followed by the separator, in corpus order, across all shards.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rest_spec.build_index.__main__ import main
from rest_spec.common.tokenizer import tokenizer_fingerprint
from rest_spec.datastore import format as fmt
from tests.helpers import tiny_bpe_tokenizer

pytestmark = pytest.mark.build

CONVERSATIONS = [
    {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: how do I sort a list in Python?"},
        {"from": "gpt", "value": f"Answer {i}: use sorted(xs) or xs.sort(); both are stable."},
        {"from": "human", "value": f"Follow-up {i}?"},
        {"from": "gpt", "value": f"Reply {i}: pass key=len to sort by length."}]}
    for i in range(6)
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE (any text encodes) saved the way models ship tokenizers."""
    return tiny_bpe_tokenizer(
        tmp_path_factory.mktemp("tok") / "tiny",
        ["def sort(xs):\n    return sorted(xs)\n", "How do I sort a list in Python? Use sorted."] * 20,
    )


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer)


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory) -> tuple[Path, list[str]]:
    """A directory corpus and its documents in the order the index must hold them."""
    root = tmp_path_factory.mktemp("code")
    files = {
        "a.py": "import os\n\ndef main():\n    print(os.getcwd())\n",
        "b.md": "# Notes\n\nSorting is stable: équal keys keep their order. ☃\n",
        "pkg/__init__.py": "",
        "pkg/util.py": "def sort(xs):\n    return sorted(xs)\n" * 3,
        "z.txt": "not selected",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root, [files["a.py"], files["b.md"], files["pkg/util.py"]]  # empty __init__.py: no document


def cli_command(*args, quiet: bool = True) -> list[str]:
    return [sys.executable, "-m", "rest_spec.build_index", *(["--quiet"] if quiet else []), *map(str, args)]


CLI_ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_cli(*args, cwd: Path, timeout: float = 300, quiet: bool = True, **popen) -> subprocess.CompletedProcess:
    """``build_index ARGS`` in a subprocess; ``popen``: more ``subprocess.run`` arguments."""
    return subprocess.run(
        cli_command(*args, quiet=quiet), cwd=cwd, env=CLI_ENV, capture_output=True, text=True, timeout=timeout, **popen
    )


def run_main(*args, cwd: Path) -> tuple[int, str, str]:
    """``build_index --quiet ARGS`` through its ``main`` in this process, in ``cwd``: (exit status,
    stdout, stderr)."""
    with (
        contextlib.chdir(cwd),
        contextlib.redirect_stdout(io.StringIO()) as out,
        contextlib.redirect_stderr(io.StringIO()) as err,
    ):
        status = main(["--quiet", *map(str, args)])
    return status, out.getvalue(), err.getvalue()


def built(*args, cwd: Path) -> dict:
    """Run a build that must succeed (``run_main``); its --json summary."""
    status, out, err = run_main(*args, "--json", cwd=cwd)
    assert status == 0, err
    return json.loads(out)


def index_tokens(out: Path) -> tuple[fmt.Manifest, np.ndarray]:
    """The manifest and every shard's tokens after its leading separator, concatenated."""
    manifest = fmt.read_manifest(out)
    shards = [fmt.open_shard(out, s, manifest, full_check=True) for s in manifest.shards]
    for (tokens, _), entry in zip(shards, manifest.shards):  # SEP doc_0 SEP doc_1 ... SEP
        assert tokens[0] == tokens[-1] == manifest.separator
        assert np.count_nonzero(tokens == manifest.separator) == entry.num_documents + 1
    return manifest, np.concatenate([tokens[1:] for tokens, _ in shards])


def assert_holds(out: Path, documents: list[str], tokenizer) -> fmt.Manifest:
    manifest, tokens = index_tokens(out)
    expected = [t for doc in documents for t in [*tokenizer.encode(doc, add_special_tokens=False), manifest.separator]]
    assert tokens.tolist() == expected
    assert manifest.num_documents == len(documents)
    return manifest


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# --------------------------------------------------------------------------- contents


def test_directory_index_in_order_across_shards_and_workers(tmp_path, tiny_tokenizer, tiny, code_dir):
    root, documents = code_dir
    longest = max(len(tiny.encode(d, add_special_tokens=False)) for d in documents)  # no document is split
    common = (
        "--corpus",
        root,
        "--extensions",
        ".py,.md",
        "--tokenizer",
        tiny_tokenizer,
        "--shard-tokens",
        longest,
        "--batch-size",
        1,
    )
    one = built(*common, "--workers", 1, "--out", tmp_path / "w1", cwd=tmp_path)
    two = built(*common, "--workers", 2, "--out", tmp_path / "w2", cwd=tmp_path)

    manifest = assert_holds(tmp_path / "w1", documents, tiny)
    assert_holds(tmp_path / "w2", documents, tiny)
    assert len(manifest.shards) == one["shards"] > 1
    # Parallel tokenization writes the same bytes.
    assert fmt.read_manifest(tmp_path / "w2").shards == manifest.shards

    assert manifest.tokenizer.name == str(tiny_tokenizer)
    assert manifest.tokenizer.fingerprint == tokenizer_fingerprint(tiny)
    assert manifest.corpus["kind"] == "directory" and manifest.corpus["records"] == 4
    assert manifest.corpus["spec"]["extensions"] == [".py", ".md"]
    assert manifest.build["args"]["tokenize"] == {"workers": 1, "batch_size": 1}
    assert manifest.build["tokenize_seconds"] >= 0
    assert one["tokens"] == two["tokens"] == manifest.num_tokens
    assert (one["records"], one["documents"], two["documents"]) == (4, 3, 3)
    assert one["bytes_on_disk"] == manifest.num_bytes
    assert one["bytes_per_token"] == pytest.approx(manifest.num_bytes / manifest.num_tokens)


def test_truncated_sharegpt_with_skip_last_and_all_turns(tmp_path, tiny_tokenizer, tiny):
    text = json.dumps(CONVERSATIONS, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index('"c5"') + 30])  # cut inside the last conversation
    summary = built("--corpus", "sharegpt", "--data-files", path, "--skip-last", 2, "--turns", "all",
                    "--tokenizer", tiny_tokenizer, "--out", tmp_path / "idx", cwd=tmp_path)  # fmt: skip

    # 5 complete conversations recovered, the last 2 of them held out whole.
    indexed = [turn["value"] for conv in CONVERSATIONS[:3] for turn in conv["conversations"]]
    manifest = assert_holds(tmp_path / "idx", indexed, tiny)
    assert (summary["recovered_conversations"], summary["truncated"]) == (5, True)
    assert (summary["records"], summary["held_out"], summary["documents"]) == (3, 2, 12)
    corpus = manifest.corpus
    assert (corpus["recovered"], corpus["truncated"], corpus["records"], corpus["held_out"]) == (5, True, 3, 2)
    assert corpus["spec"]["skip_last"] == 2 and corpus["spec"]["turns"] == "all"


def test_default_smollm2_tokenizer_on_stdlib_files(tmp_path):
    from rest_spec.build_index.corpora import CorpusSpec, iter_records
    from rest_spec.common.tokenizer import load_tokenizer

    summary = built(
        "--corpus", "python-stdlib", "--max-docs", 3, "--workers", 2, "--out", tmp_path / "idx", cwd=tmp_path
    )
    smollm2 = load_tokenizer(None)
    documents = [d for r in iter_records(CorpusSpec("python-stdlib", max_docs=3)) for d in r.documents()]
    manifest = assert_holds(tmp_path / "idx", documents, smollm2)
    assert manifest.tokenizer.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert manifest.tokenizer.fingerprint == tokenizer_fingerprint(smollm2)
    assert manifest.token_dtype == "<u2" and summary["records"] == 3


# --------------------------------------------------------------------------- the target directory


def test_overwrite_and_failed_builds_leave_the_target_untouched(tmp_path, tiny_tokenizer):
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("the first corpus")
    second.write_text("the second corpus, longer")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "x"}) + "\n")
    out = tmp_path / "indexes" / "idx"
    built("--corpus", first, "--tokenizer", tiny_tokenizer, "--out", out, cwd=tmp_path)
    before = (out / fmt.MANIFEST).read_bytes()

    status, _, err = run_main("--corpus", second, "--tokenizer", tiny_tokenizer, "--out", out, cwd=tmp_path)
    assert status == 1 and "already exists; pass --overwrite" in err
    status, _, err = run_main(
        "--corpus", rows, "--tokenizer", tiny_tokenizer, "--out", out, "--overwrite", cwd=tmp_path
    )
    assert status == 1 and "no field 'text'" in err
    assert (out / fmt.MANIFEST).read_bytes() == before
    assert leftovers(out.parent) == []

    built("--corpus", second, "--tokenizer", tiny_tokenizer, "--out", out, "--overwrite", cwd=tmp_path)
    assert fmt.read_manifest(out).corpus["path"] == str(second)
    assert leftovers(out.parent) == []


def test_default_out_is_indexes_slash_corpus(tmp_path, tiny_tokenizer):
    (tmp_path / "notes.txt").write_text("hello")
    built("--corpus", "notes.txt", "--tokenizer", tiny_tokenizer, cwd=tmp_path)
    assert fmt.read_manifest(tmp_path / "indexes" / "notes").num_documents == 1


# --------------------------------------------------------------------------- bad input


@pytest.mark.cli
@pytest.mark.parametrize(
    "args, message",
    [
        (["--corpus", "missing/dir"], "corpus path not found: missing/dir"),
        (["--corpus", "sharegtp"], "unknown corpus 'sharegtp'"),
        (["--corpus", "rows.jsonl", "--field", "txt"], "rows.jsonl has no field 'txt'; available fields: id, body"),
        (["--corpus", "notes.txt", "--tokenizer", "empty_dir"], "cannot load tokenizer empty_dir"),
        (["--corpus", "the-stack"], "--data-files"),
    ],
    ids=["missing-path", "unknown-name", "wrong-field", "bad-tokenizer", "offline-hub"],
)
def test_bad_input_is_one_error_line_with_status_1(tmp_path, tiny_tokenizer, args, message):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"id": 1, "body": "x"}) + "\n")
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty_dir").mkdir()
    tokenizer = [] if "--tokenizer" in args else ["--tokenizer", tiny_tokenizer]
    out = run_cli(*args, *tokenizer, "--out", tmp_path / "idx", cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_index: error: "), out.stderr
    assert message in lines[0]
    assert not (tmp_path / "idx").exists() and leftovers(tmp_path) == []


@pytest.mark.cli
@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "0"], "workers and batch_size must be positive"),
        (["--shard-tokens", "0"], "shard_tokens must be positive"),
        (["--max-docs", "0"], "max_docs must be positive"),
        (["--workers", "two"], "argument --workers: invalid int value: 'two'"),
    ],
    ids=["workers", "shard-tokens", "max-docs", "not-a-number"],
)
def test_a_flag_value_out_of_range_is_a_usage_error_with_status_2(tmp_path, args, message):
    out = run_cli("--corpus", "notes.txt", *args, "--out", tmp_path / "idx", cwd=tmp_path)
    assert out.returncode == 2
    usage, error = out.stderr.strip().split("\nbuild_index: error: ")
    assert usage.startswith("usage: build_index ") and message in error, out.stderr
    assert not (tmp_path / "idx").exists() and leftovers(tmp_path) == []
