"""Fault injection for index files: every file of an index is hostile input.

Corrupt bytes anywhere in a shard, crafted suffix-array entries and token ids, damaged or
hand-edited manifests, special files and symlinks: opening refuses with one line naming the file
and the problem, drafting answers ``IndexCorruptError`` or a well-formed tree whose tokens are all
in the vocabulary, and no process ever crashes. Drafts from damaged indexes run in a subprocess, so
a segmentation fault fails the test instead of killing the test run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rest_spec.common.types import DraftConfig
from rest_spec.datastore import format as fmt
from rest_spec.datastore import index as engine
from rest_spec.datastore import trie
from rest_spec.datastore.index import Datastore
from tests.tiers import examples

REPO = Path(__file__).resolve().parents[1]
SPOT = 1 << 16  # bytes at each end of a file that the spot digest covers
CONFIG = DraftConfig(budget=64, max_depth=10, n_max=16, n_min=1)


# ---- indexes ---------------------------------------------------------------------------------


def phrase_corpus(vocab_size: int, num_docs: int, seed: int) -> list[list[int]]:
    """Documents of recurring phrases and noise: deep, branching matches, so drafts read many
    suffix-array entries and long continuations."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, vocab_size, size=rng.integers(4, 16)).tolist() for _ in range(200)]
    docs = []
    for _ in range(num_docs):
        doc: list[int] = []
        while len(doc) < rng.integers(20, 180):
            noise = rng.integers(0, vocab_size, 3).tolist()
            doc += phrases[rng.integers(len(phrases))] if rng.random() < 0.7 else noise
        docs.append(doc)
    return docs


@dataclasses.dataclass(frozen=True)
class CleanIndex:
    """A real index large enough (every file > 2 x 64 KiB) that corruption can land where the
    spot digests do not look, with its arrays read into memory for choosing contexts."""

    path: Path
    vocab_size: int
    docs: list[list[int]] = dataclasses.field(repr=False)  # hypothesis prints the fixture on failure
    shards: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(repr=False)  # (tokens, sa) per shard


@pytest.fixture(scope="module")
def clean_indexes(tmp_path_factory) -> dict[str, CleanIndex]:
    # imported here: tests.helpers imports torch, and the drafting subprocess imports this module
    from tests.helpers import write_index

    out = {}
    for name, vocab_size, shard_tokens in (("u2", 1000, 100_000), ("u4", 70_000, 1 << 20)):
        docs = phrase_corpus(vocab_size, 3000 if name == "u2" else 800, seed=vocab_size)
        path = write_index(tmp_path_factory.mktemp("clean") / name, docs, vocab_size, shard_tokens=shard_tokens)
        manifest = fmt.read_manifest(path)
        shards = [tuple(np.array(a) for a in fmt.open_shard(path, s, manifest)) for s in manifest.shards]
        assert all(f.bytes > 2 * SPOT for s in manifest.shards for f in s.files.values())
        out[name] = CleanIndex(path, vocab_size, docs, shards)
    return out


def copy_index(clean: CleanIndex, into: Path) -> Path:
    return Path(shutil.copytree(clean.path, into))


def reseal(path: Path) -> None:
    """Rewrite the manifest's sizes and digests for the files as they are now: a hostile index
    whose damage the open-time checks cannot see."""
    manifest = fmt.read_manifest(path)
    shards = tuple(
        dataclasses.replace(s, files={role: fmt.FileEntry.of(path / f.name) for role, f in s.files.items()})
        for s in manifest.shards
    )
    fmt.write_manifest(path, dataclasses.replace(manifest, shards=shards))


def set_entry(path: Path, role: str, shard: int, index: int, value: int) -> None:
    """Overwrite element ``index`` of a shard's tokens or sa file with ``value`` (wrapped to the dtype)."""
    file = path / fmt.shard_file(shard, role)
    array = np.load(file, mmap_mode="r+")
    array[index] = np.array(value).astype(np.int64).astype(array.dtype)
    array.flush()
    del array


def contexts_at_tokens(clean: CleanIndex, shard: int, positions) -> list[list[int]]:
    """Contexts that end right before each token position, so their continuations read it."""
    tokens = clean.shards[shard][0]
    sep = fmt.separator(tokens.dtype)
    out = []
    for p in positions:
        window = tokens[max(0, p - 6) : p].tolist()
        while sep in window:
            window = window[window.index(sep) + 1 :]
        if window:
            out.append(window)
    return out


def contexts_at_ranks(clean: CleanIndex, shard: int, ranks) -> list[list[int]]:
    """Contexts that match the suffix at each suffix-array rank, so drafting reads that entry."""
    tokens, sa = clean.shards[shard]
    return contexts_at_tokens(clean, shard, [tokens.shape[0] - int(sa[k]) for k in ranks])


# ---- drafting in a subprocess -----------------------------------------------------------------


def draft_each(spec_file: str) -> None:
    """Subprocess side: open every case's index and draft its contexts, then open it with the
    structural check, printing one JSON line per case: the open, draft and check errors (type,
    message) and the largest token id in any tree."""
    spec = json.loads(Path(spec_file).read_text())
    for i, case in enumerate(spec["cases"]):
        result = {"case": i, "open_error": None, "draft_errors": [], "trees": 0, "max_token": -1, "check_error": None}
        try:
            store = Datastore.open(case["path"])
        except fmt.IndexFormatError as exc:
            result["open_error"] = [type(exc).__name__, str(exc)]
        else:
            for context in case["contexts"]:
                try:
                    tree = store.draft(context, CONFIG)
                except fmt.IndexFormatError as exc:
                    result["draft_errors"].append([type(exc).__name__, str(exc)])
                    continue
                result["trees"] += 1
                if len(tree):
                    result["max_token"] = max(result["max_token"], int(tree.tokens.max()))
                    assert tree.tokens.min() >= 0
        try:
            Datastore.open(case["path"], check=True).close()
        except fmt.IndexFormatError as exc:
            result["check_error"] = [type(exc).__name__, str(exc)]
        print(json.dumps(result), flush=True)


def run_drafts(cases: list[dict], workdir: Path) -> list[dict]:
    """Run ``draft_each`` on ``cases`` ({"path", "contexts"}) in a fresh interpreter; a crash or
    a traceback fails the test, naming the case it happened in."""
    spec = workdir / "cases.json"
    spec.write_text(json.dumps({"cases": cases}))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.test_index_faults import draft_each; draft_each(sys.argv[1])",
            str(spec),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    if proc.returncode < 0:
        pytest.fail(
            f"drafting crashed with {signal.Signals(-proc.returncode).name} on case {len(results)}: "
            f"{cases[len(results)]['path']}"
        )
    assert proc.returncode == 0, f"drafting failed on case {len(results)}:\n{proc.stderr[-3000:]}"
    return results


def assert_one_line_about(message: str, directory: Path) -> None:
    assert "\n" not in message and str(directory) in message, message


def assert_safe_outcome(result: dict, case: dict, vocab_size: int) -> None:
    """A clear error at open, ``IndexCorruptError`` at draft, or trees of in-vocabulary tokens."""
    directory = Path(case["path"])
    if result["open_error"]:
        assert result["open_error"][0] in ("IndexFormatError", "IndexCorruptError"), result
        assert_one_line_about(result["open_error"][1], directory)
    for kind, message in result["draft_errors"]:
        assert kind == "IndexCorruptError", message
        assert_one_line_about(message, directory)
        assert "is corrupt" in message and "rest-datastore verify" in message
    assert result["max_token"] < vocab_size, f"token {result['max_token']} >= vocab {vocab_size} reached a draft tree"
    if result["check_error"]:
        assert result["check_error"][0] in ("IndexFormatError", "IndexCorruptError"), result
        assert_one_line_about(result["check_error"][1], directory)
    if any("outside the vocabulary" in message for _, message in result["draft_errors"]):
        assert result["check_error"], "the structural check missed a token that drafting found outside the vocabulary"


# ---- random corruption: the property test -----------------------------------------------------


def draw_spans(data, clean: CleanIndex, sealed: bool) -> list[tuple[int, str, int, np.ndarray]]:
    """One damaged copy's recipe: (shard, role, first byte, xor mask bytes) for 1-3 spans, inside
    the spot-digest blind spot unless the manifest is ``sealed`` again afterwards."""
    spans = []
    for _ in range(data.draw(st.integers(1, 3))):
        shard = data.draw(st.integers(0, len(clean.shards) - 1))
        role = data.draw(st.sampled_from(fmt.ROLES))
        size = (clean.path / fmt.shard_file(shard, role)).stat().st_size
        lo, hi = (0, size) if sealed else (SPOT, size - SPOT)
        length = data.draw(st.sampled_from([n for n in (1, 2, 4, 8, 64, 4096, 40_000) if n <= hi - lo]))
        anywhere = st.integers(lo, hi - length)
        start = data.draw(st.one_of(st.integers(0, 127), anywhere) if sealed else anywhere)  # .npy header too
        mask = np.random.default_rng(data.draw(st.integers(0, 2**32))).integers(1, 256, length, dtype=np.uint8)
        spans.append((shard, role, start, mask))
    return spans


def damaged_case(clean: CleanIndex, spans, into: Path, sealed: bool) -> dict:
    """Copy ``clean``, xor the spans into it (every byte changes), and list contexts that read
    the damaged bytes besides random ones."""
    path = copy_index(clean, into)
    contexts = []
    for shard, role, start, mask in spans:
        file = path / fmt.shard_file(shard, role)
        data = np.fromfile(file, dtype=np.uint8)
        data[start : start + mask.size] ^= mask
        data.tofile(file)
        itemsize = clean.shards[shard][fmt.ROLES.index(role)].itemsize
        first = max(0, (start - np.load(clean.path / fmt.shard_file(shard, role), mmap_mode="r").offset) // itemsize)
        touched = range(first, first + mask.size // itemsize + 1, max(1, mask.size // itemsize // 8))
        contexts += (contexts_at_tokens if role == "tokens" else contexts_at_ranks)(
            clean, shard, [k for k in touched if k < clean.shards[shard][fmt.ROLES.index(role)].shape[0]]
        )
    if sealed:
        reseal(path)
    rng = np.random.default_rng(spans[0][2])
    for _ in range(20):
        doc = clean.docs[rng.integers(len(clean.docs))]
        end = int(rng.integers(1, len(doc) + 1))
        contexts.append(doc[max(0, end - 12) : end])
    return {"path": str(path), "contexts": contexts}


@pytest.mark.parametrize("sealed", [False, True], ids=["passes-spot-digests", "hostile-resealed"])
# no shrinking: every step would rerun the subprocess, and the failing cases are printed as they are
@pytest.mark.cli
@settings(
    max_examples=examples(4),
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_corruption_never_crashes(clean_indexes, sealed, data):
    """Six damaged copies per example, drafted in one subprocess: never a crash, never a
    traceback, never a token outside the vocabulary. Unsealed damage passes the open-time
    checks (it lies between the spot digests) but ``verify`` finds every one."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        cases, vocab = [], []
        for i in range(6):
            clean = clean_indexes[data.draw(st.sampled_from(sorted(clean_indexes)))]
            spans = draw_spans(data, clean, sealed)
            cases.append(damaged_case(clean, spans, workdir / f"case{i}", sealed))
            vocab.append(clean.vocab_size)
            if not sealed:
                with pytest.raises(fmt.IndexFormatError, match="corrupt"):
                    Datastore.open(workdir / f"case{i}", verify=True)
        for result, case, vocab_size in zip(run_drafts(cases, workdir), cases, vocab):
            assert_safe_outcome(result, case, vocab_size)


# ---- crafted hostile values -------------------------------------------------------------------

# (name, role, value given the shard's token-array length n and the index's vocabulary,
#  what drafting the context that reads it answers, what the structural check says)
HOSTILE_VALUES = [
    ("sa-negative", "sa", lambda n, v: -7, "suffix-array entry .* = -7 is outside", "not a position"),
    ("sa-huge", "sa", lambda n, v: 2**31 - 1, "suffix-array entry .* = 2147483647 is outside", "not a position"),
    ("sa-zero", "sa", lambda n, v: 0, None, "not a position"),
    ("sa-separator-position", "sa", lambda n, v: 1, None, "not a position"),
    ("token-past-vocab", "tokens", lambda n, v: v, "token .* is outside the vocabulary", "outside the vocabulary"),
    (
        "token-below-separator",
        "tokens",
        lambda n, v: 0xFFFE,
        "token .* is outside the vocabulary",
        "outside the vocabulary",
    ),
]


def crafted(clean: CleanIndex, into: Path, role: str, value) -> tuple[Path, list[list[int]]]:
    """A copy of ``clean`` with ``value`` (given the token-array length and the vocabulary) at the
    middle rank of shard 1's suffix array, or in the token that rank's match reads next, resealed;
    and the contexts whose drafts read it."""
    tokens, sa = clean.shards[1]
    rank = sa.shape[0] // 2
    position = tokens.shape[0] - int(sa[rank])  # the token after the match at ``rank``
    path = copy_index(clean, into)
    set_entry(path, role, 1, rank if role == "sa" else position, value(tokens.shape[0], clean.vocab_size))
    reseal(path)
    return path, contexts_at_ranks(clean, 1, [rank])


@pytest.fixture(scope="module")
def crafted_drafts(clean_indexes, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Every ``HOSTILE_VALUES`` case's index and ``draft_each``'s result for it, the cases drafted
    in one subprocess (as the random corruption's six copies are: a fresh interpreter each cost 2 s)."""
    tmp = tmp_path_factory.mktemp("crafted")
    cases = {name: crafted(clean_indexes["u2"], tmp / name, role, value) for name, role, value, *_ in HOSTILE_VALUES}
    results = run_drafts([{"path": str(path), "contexts": contexts} for path, contexts in cases.values()], tmp)
    return {name: (path, result) for (name, (path, _)), result in zip(cases.items(), results, strict=True)}


@pytest.mark.cli
@pytest.mark.parametrize("name, role, value, at_draft, at_check", HOSTILE_VALUES, ids=[h[0] for h in HOSTILE_VALUES])
def test_crafted_hostile_values(clean_indexes, crafted_drafts, name, role, value, at_draft, at_check):
    """One crafted value in a resealed index (open-time checks pass): the draft that reads it
    answers ``IndexCorruptError`` naming the file (or, for a value in range, a well-formed tree),
    and ``check=True`` / ``verify=True`` refuse the index at open (``crafted``, ``crafted_drafts``)."""
    clean = clean_indexes["u2"]
    path, result = crafted_drafts[name]
    assert_safe_outcome(result, {"path": str(path)}, clean.vocab_size)
    assert result["open_error"] is None
    if at_draft:
        assert result["draft_errors"], result
        assert fmt.shard_file(1, role) in result["draft_errors"][0][1]
        assert re.search(at_draft, result["draft_errors"][0][1]), result["draft_errors"][0][1]
    for flags in ({"check": True}, {"verify": True}):
        with pytest.raises(fmt.IndexCorruptError, match=f"{fmt.shard_file(1, role)} is corrupt: .*{at_check}"):
            Datastore.open(path, **flags)


IN_RANGE_DAMAGE = [
    ("swap", "out of order"),
    ("duplicate", "repeats an earlier entry"),
    ("separator-lost", "separators, expected"),
    ("first-not-separator", "token 0 = 5 is not the separator"),
]


def damaged_in_range(clean: CleanIndex, into: Path, damage: str) -> tuple[Path, list[list[int]]]:
    """A copy of ``clean`` with ``damage`` made of valid-looking values in shard 0, resealed; and
    contexts that read it, with others."""
    tokens, sa = clean.shards[0]
    path = copy_index(clean, into)
    ranks = [int(np.searchsorted(tokens[tokens.shape[0] - 1 - sa], t)) for t in (3, 700)]  # far apart in order
    if damage == "swap":
        set_entry(path, "sa", 0, ranks[0], int(sa[ranks[1]]))
        set_entry(path, "sa", 0, ranks[1], int(sa[ranks[0]]))
    elif damage == "duplicate":
        set_entry(path, "sa", 0, ranks[0], int(sa[ranks[0] + 1]))
    elif damage == "separator-lost":
        set_entry(path, "tokens", 0, int(np.flatnonzero(tokens == fmt.separator(tokens.dtype))[5]), 5)
    else:
        set_entry(path, "tokens", 0, 0, 5)
    reseal(path)
    return path, contexts_at_ranks(clean, 0, ranks) + clean.docs[:20]


@pytest.fixture(scope="module")
def in_range_drafts(clean_indexes, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Every ``IN_RANGE_DAMAGE`` case's index and ``draft_each``'s result for it, drafted in one
    subprocess."""
    tmp = tmp_path_factory.mktemp("in-range")
    cases = {damage: damaged_in_range(clean_indexes["u2"], tmp / damage, damage) for damage, _ in IN_RANGE_DAMAGE}
    results = run_drafts([{"path": str(path), "contexts": contexts} for path, contexts in cases.values()], tmp)
    return {damage: (path, result) for (damage, (path, _)), result in zip(cases.items(), results, strict=True)}


@pytest.mark.cli
@pytest.mark.parametrize("damage, message", IN_RANGE_DAMAGE)
def test_structural_check_finds_in_range_damage(clean_indexes, in_range_drafts, damage, message):
    """Damage made of valid-looking values: drafting stays safe (well-formed trees or a clear
    error), and the structural check at open names it (``damaged_in_range``, ``in_range_drafts``)."""
    path, result = in_range_drafts[damage]
    assert_safe_outcome(result, {"path": str(path)}, clean_indexes["u2"].vocab_size)
    with pytest.raises(fmt.IndexCorruptError, match=message):
        Datastore.open(path, check=True)


def test_write_shard_checks_the_files_it_wrote(tmp_path):
    """The build-time check: arrays that do not form a sound shard are refused before they
    could be published."""
    tokens = np.array([65535, 1, 2, 3, 65535, 4, 5, 65535], dtype="<u2")
    sa = fmt.suffix_array(tokens)
    fmt.write_shard(tmp_path, 0, tokens, sa, vocab_size=10)
    with pytest.raises(fmt.IndexCorruptError, match="sa.npy is corrupt: suffix-array entry 1 = .* out of order after"):
        fmt.write_shard(tmp_path, 1, tokens, sa[::-1].copy(), vocab_size=10)
    with pytest.raises(fmt.IndexCorruptError, match="tokens.npy is corrupt: token 5 = 4 is outside the vocabulary"):
        fmt.write_shard(tmp_path, 2, tokens, sa, vocab_size=4)


# ---- .npy headers and special files -----------------------------------------------------------


def small_index(tmp_path: Path) -> Path:
    from tests.helpers import write_index  # see clean_indexes

    return write_index(tmp_path / "idx", [[1, 2, 3, 4], [5, 6, 7], [1, 2, 9]], vocab_size=10)


def rewrite_header(file: Path, old: bytes, new: bytes) -> None:
    data = file.read_bytes()
    assert old in data[:128] and len(old) == len(new)
    file.write_bytes(data.replace(old, new, 1))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("trailing-bytes", "has 160 bytes, its header describes 156"),
        ("big-endian", r"holds '>u2' \(14,\) \(fortran_order=False\), the manifest describes '<u2' \(14,\)"),
        ("float-dtype", "holds '<f2'"),
        ("fortran", "fortran_order=True"),
        ("longer-shape", r"holds '<u2' \(5,\)"),
        ("bad-magic", "not a valid .npy array: not a .npy file of format 1.0 or 2.0"),
        ("garbage-header", "not a valid .npy array: the header is not a Python literal"),
        ("unterminated-string", "not a valid .npy array: the header is not a Python literal"),  # numpy: TokenError
        ("escape", "not a valid .npy array: the header holds a backslash"),  # Python: a DeprecationWarning first
        ("long-header", "not a valid .npy array: a header of 65535 bytes is longer than np.save writes"),
    ],
)
@pytest.mark.filterwarnings("error")
def test_npy_header_must_describe_exactly_the_file(tmp_path, damage, message):
    """Resealed so the digests agree: the header itself is checked, and the file must be that
    header plus exactly that data; parsing it warns of nothing."""
    path = small_index(tmp_path)
    file = path / fmt.shard_file(0, "tokens")
    if damage == "trailing-bytes":
        file.write_bytes(file.read_bytes() + b"\0\0\0\0")
    elif damage == "big-endian":
        rewrite_header(file, b"'<u2'", b"'>u2'")
    elif damage == "float-dtype":
        rewrite_header(file, b"'<u2'", b"'<f2'")
    elif damage == "fortran":
        rewrite_header(file, b"False", b"True ")
    elif damage == "longer-shape":
        rewrite_header(file, b"(14,)", b"(5,) ")
    elif damage == "bad-magic":
        rewrite_header(file, b"\x93NUMPY", b"\x93NUMPX")
    elif damage == "garbage-header":
        rewrite_header(file, b"'descr'", b"'descr(")
    elif damage == "unterminated-string":
        rewrite_header(file, b"'<u2'", b"'<u2 ")
    elif damage == "escape":
        rewrite_header(file, b"'<u2'", b"'\\o2'")
    else:
        rewrite_header(file, b"NUMPY\x01\x00v\x00", b"NUMPY\x01\x00\xff\xff")
    reseal(path)
    with pytest.raises(fmt.IndexFormatError, match=message) as raised:
        Datastore.open(path)
    assert_one_line_about(str(raised.value), path)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    role=st.sampled_from(fmt.ROLES),
    edits=st.lists(st.tuples(st.integers(0, 127), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_damaged_npy_header_is_one_clear_line(tmp_path_factory, role, edits):
    """Bytes of a resealed file's header set at random: a one-line error at open, or (damage in
    the padding) the index drafts as before."""
    path = small_index(tmp_path_factory.mktemp("header"))
    with Datastore.open(path) as store:
        expected = store.draft([1, 2], CONFIG)
    file = path / fmt.shard_file(0, role)
    data = bytearray(file.read_bytes())
    for offset, value in edits:
        data[offset] = value
    file.write_bytes(bytes(data))
    reseal(path)
    try:
        store = Datastore.open(path)
    except fmt.IndexFormatError as exc:
        assert_one_line_about(str(exc), path)
    else:
        with store:
            assert store.draft([1, 2], CONFIG) == expected


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "symlink-outside", "symlink-loop"])
def test_shard_files_must_be_regular_files_inside_the_index(tmp_path, kind):
    """A FIFO would block the open, a device never ends, a link may point anywhere: each is
    refused before it is opened."""
    path = small_index(tmp_path)
    file = path / fmt.shard_file(0, "sa")
    outside = tmp_path / "elsewhere.npy"
    shutil.move(file, outside)
    if kind == "fifo":
        os.mkfifo(file)
    elif kind == "device":
        file.symlink_to("/dev/zero")
    elif kind == "directory":
        file.mkdir()
    elif kind == "symlink-outside":
        file.symlink_to(outside)  # the same bytes: only where they live is wrong
    else:
        file.symlink_to(file)
    message = {"symlink-outside": "outside the index directory", "symlink-loop": "cannot be read"}.get(
        kind, "not a regular file"
    )
    with pytest.raises(fmt.IndexFormatError, match=message) as raised:
        Datastore.open(path)
    assert_one_line_about(str(raised.value), path)


def test_symlink_inside_the_index_is_followed(tmp_path):
    path = small_index(tmp_path)
    file = path / fmt.shard_file(0, "sa")
    shutil.move(file, path / "kept.npy")
    file.symlink_to("kept.npy")
    with Datastore.open(path) as store:
        assert store.draft([1, 2], CONFIG).paths()[0] == (3,)


# ---- the manifest -----------------------------------------------------------------------------


def edit(path: Path, change) -> None:
    """Apply ``change`` to the manifest's decoded JSON (it returns the new document or edits in place)."""
    manifest = path / fmt.MANIFEST
    data = json.loads(manifest.read_text())
    data = change(data) or data
    manifest.write_text(json.dumps(data))


def whole(data):
    return data


def tokenizer(data):
    return data["tokenizer"]


def shard0(data):
    return data["shards"][0]


def sa_file(data):
    return shard0(data)["files"]["sa"]


def set_in(getter, key, value):
    return lambda data: getter(data).__setitem__(key, value)


MANIFEST_DAMAGE = [
    ("list-not-object", lambda d: [d], "manifest: expected an object, got a list"),
    ("tokenizer-list", set_in(whole, "tokenizer", ["t", "f", 10]), "tokenizer: expected an object, got a list"),
    ("shard-list", lambda d: d.__setitem__("shards", [[1, 2]]), r"shards\[0\]: expected an object"),
    ("files-list", set_in(shard0, "files", []), r"shards\[0\].files: expected an object"),
    ("unknown-dtype", set_in(whole, "token_dtype", "<f8"), "token_dtype: '<f8' is not '<u2'"),
    ("wider-dtype", set_in(whole, "token_dtype", "<u4"), "token_dtype: '<u4' is not '<u2'"),
    (
        "absurd-vocab",
        set_in(tokenizer, "vocab_size", 2**40),
        r"tokenizer.vocab_size: 1099511627776 is outside \[1, 16777216\]",
    ),
    ("zero-vocab", set_in(tokenizer, "vocab_size", 0), "tokenizer.vocab_size: 0 is outside"),
    ("float-vocab", set_in(tokenizer, "vocab_size", 10.0), "tokenizer.vocab_size: expected an integer, got a number"),
    ("separator-in-vocab", set_in(whole, "separator", 5), "separator: 5 is not 65535"),
    ("bool-separator", set_in(whole, "separator", True), "separator: True is not 65535"),
    ("bool-vocab", set_in(tokenizer, "vocab_size", True), "tokenizer.vocab_size: expected an integer, got a boolean"),
    ("bool-version", set_in(whole, "format_version", True), "format_version: index format version True is not"),
    ("bool-bytes", set_in(sa_file, "bytes", False), r"shards\[0\].files.sa.bytes: expected an integer, got a bool"),
    ("negative-tokens", set_in(shard0, "num_tokens", -5), r"shards\[0\].num_tokens: -5 is outside"),
    ("negative-documents", set_in(shard0, "num_documents", -1), r"shards\[0\].num_documents: -1 is outside"),
    ("negative-bytes", set_in(sa_file, "bytes", -1), r"files.sa.bytes: -1 is outside"),
    ("string-count", set_in(shard0, "num_tokens", "10"), r"shards\[0\].num_tokens: expected an integer, got a string"),
    ("fewer-tokens-than-documents", set_in(shard0, "num_tokens", 2), r"shards\[0\].num_tokens: 2 is outside \[3, "),
    ("total-disagrees", set_in(whole, "num_tokens", 11), "num_tokens: 11 is not 10 .the sum over the shards"),
    ("no-shards", set_in(whole, "shards", []), "shards: empty"),
    ("missing-field", lambda d: d.pop("separator") and None, "separator: missing"),
    ("unknown-field", set_in(whole, "extra", 1), "manifest: unknown field 'extra'"),
    ("unknown-role", set_in(lambda d: shard0(d)["files"], "docs", {}), r"shards\[0\].files: unknown field 'docs'"),
    (
        "parent-dir-name",
        set_in(sa_file, "name", "../shard-00000.sa.npy"),
        r"files.sa.name: '../shard-00000.sa.npy' is not 'shard-00000.sa.npy'",
    ),
    ("absolute-name", set_in(sa_file, "name", "/etc/passwd"), r"files.sa.name: '/etc/passwd' is not"),
    ("subdirectory-name", set_in(sa_file, "name", "x/shard-00000.sa.npy"), r"files.sa.name: .* is not"),
    ("other-role-name", set_in(sa_file, "name", "shard-00000.tokens.npy"), r"files.sa.name: .* is not"),
    ("shard-name", set_in(shard0, "name", "shard-00007"), r"shards\[0\].name: 'shard-00007' is not 'shard-00000'"),
    ("short-digest", set_in(sa_file, "sha256", "abc"), r"files.sa.sha256: not a sha256 hex digest"),
    ("digest-number", set_in(sa_file, "spot_sha256", 7), r"files.sa.spot_sha256: expected a string"),
    ("tokenizer-name-number", set_in(tokenizer, "name", 3), "tokenizer.name: expected a string, got an integer"),
    ("corpus-list", set_in(whole, "corpus", []), "corpus: expected an object, got a list"),
    ("other-format", set_in(whole, "format", "infini-gram"), "format: 'infini-gram': not a rest-index manifest"),
]


@pytest.mark.parametrize("name, change, message", MANIFEST_DAMAGE, ids=[m[0] for m in MANIFEST_DAMAGE])
def test_damaged_manifest_is_one_clear_line(tmp_path, name, change, message):
    """Every field is type- and range-checked; the error names the manifest, the field and the
    problem, in one line."""
    path = small_index(tmp_path)
    edit(path, change)
    with pytest.raises(fmt.IndexFormatError, match=message) as raised:
        Datastore.open(path)
    text = str(raised.value)
    assert "\n" not in text and text.startswith(f"{path / fmt.MANIFEST}: "), text


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"format": "rest-index", ', "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8 text"),
        (b"1" * 5000, "not valid JSON"),
    ],
)
def test_undecodable_manifest_is_one_clear_line(tmp_path, content, message):
    path = small_index(tmp_path)
    (path / fmt.MANIFEST).write_bytes(content)
    with pytest.raises(fmt.IndexFormatError, match=message) as raised:
        Datastore.open(path)
    assert "\n" not in str(raised.value)


def test_huge_manifest_is_not_read_whole(tmp_path):
    path = small_index(tmp_path)
    with open(path / fmt.MANIFEST, "r+b") as f:
        f.truncate(fmt.MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(fmt.IndexFormatError, match=f"larger than {fmt.MAX_MANIFEST_BYTES} bytes"):
        Datastore.open(path)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_manifest_must_be_a_regular_file(tmp_path, kind):
    path = small_index(tmp_path)
    (path / fmt.MANIFEST).unlink()
    if kind == "fifo":
        os.mkfifo(path / fmt.MANIFEST)
    else:
        (path / fmt.MANIFEST).symlink_to("/dev/zero")
    with pytest.raises(fmt.IndexFormatError, match="manifest.json is not a regular file"):
        Datastore.open(path)


def test_largest_vocabulary_costs_no_memory_until_used(tmp_path):
    """A vocabulary at the cap opens: the per-shard memo of first-token ranges is zeroed pages."""
    from tests.helpers import write_index  # see clean_indexes

    path = write_index(tmp_path / "idx", [[fmt.MAX_VOCAB_SIZE - 1, 1, 2]], vocab_size=fmt.MAX_VOCAB_SIZE)
    with Datastore.open(path, check=True) as store:
        assert store.draft([fmt.MAX_VOCAB_SIZE - 1], CONFIG).paths() == [(1,), (1, 2)]


# ---- ready means ready ------------------------------------------------------------------------

DRAFT_KERNELS = ("_match_ranges", "_continuations", "_top_c_tree")


def compiled() -> dict[str, int]:
    """How many specializations each kernel that Python calls has compiled or loaded so far
    (``trie._group_children`` is compiled into ``_top_c_tree``)."""
    kernels = (engine._match_ranges, engine._continuations, trie._top_c_tree, fmt._scan_tokens, fmt._scan_sa)
    return {kernel.__name__: len(kernel.signatures) for kernel in kernels}


def test_warm_up_compiles_every_kernel_a_draft_uses(clean_indexes):
    """After ``warm_up`` the drafts and the output store's trees compile nothing: the first
    request after a server starts is as fast as any other."""
    for clean in clean_indexes.values():
        with Datastore.open(clean.path) as store:
            assert store.warm_up() >= 0
            before = compiled()
            assert all(before[name] for name in DRAFT_KERNELS)
            for context in clean.docs[:50]:
                store.draft(context[:8], CONFIG)
            rows = np.full((3, 4), 0xFFFFFFFF, dtype=np.uint32)  # the output store's rows
            rows[:, 0] = [5, 5, 6]
            trie.top_c_tree(rows, 0xFFFFFFFF, 8)
            assert compiled() == before


@pytest.mark.cli
def test_compile_kernels_covers_every_index_a_fresh_process_opens(clean_indexes, tmp_path):
    """``compile_kernels`` (what setup.sh runs to fill numba's cache) leaves nothing for opening,
    checking and drafting from real indexes of both token dtypes to compile."""
    script = """
import json, sys
from rest_spec.datastore.index import Datastore, compile_kernels
from tests.test_index_faults import CONFIG, compiled
compile_kernels()
before = compiled()
for path in sys.argv[1:]:
    with Datastore.open(path, check=True) as store:
        store.warm_up()
        store.draft([1, 2, 3], CONFIG)
print(json.dumps([before, compiled()]))
"""
    paths = [str(c.path) for c in clean_indexes.values()]
    proc = subprocess.run([sys.executable, "-c", script, *paths], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = json.loads(proc.stdout)
    assert all(before.values()) and after == before
