"""``build_index --ray``: the flag, the missing-Ray error, and (slow) byte-identical shards from
one local Ray cluster against the plain build of the same corpora, and a stop signal mid-build."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from rest_spec.build_index.__main__ import main
from rest_spec.build_index.ray_build import RayTarget
from rest_spec.datastore import format as fmt
from tests.test_build_cli import CONVERSATIONS, leftovers

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text, target",
    [
        ("local", RayTarget("local", "local")),
        ("local:2", RayTarget("local", "local", 2)),
        ("auto", RayTarget("auto", "auto")),
        ("ray://head.example:10001", RayTarget("client", "ray://head.example:10001")),
        ("ray://[::1]:10001", RayTarget("client", "ray://[::1]:10001")),
    ],
)
def test_ray_flag_forms(text, target):
    assert RayTarget.parse(text) == target


@pytest.mark.parametrize("text", ["", "local:0", "local:-1", "local:x", "ray://host", "ray://host:0",
                                  "ray://host:70000", "http://host:1", "auto:2", "LOCAL"])  # fmt: skip
def test_a_bad_ray_flag_is_a_usage_error(tmp_path, capsys, text):
    assert main(["--corpus", str(tmp_path), "--out", str(tmp_path / "out"), "--ray", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: build_index") and "--ray" in err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_ray_not_installed_says_how_to_install(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("some text")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the extra
    monkeypatch.setitem(sys.modules, "ray.data", None)
    assert main(["--corpus", str(tmp_path), "--out", str(tmp_path / "out"), "--ray", "local:2"]) == 1
    assert capsys.readouterr().err == (
        "build_index: error: --ray needs Ray, which is not installed: pip install 'rest-spec[ray]'\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", [None, "relative/out"])
def test_ray_client_builds_need_an_absolute_out(tmp_path, capsys, out):
    """Through Ray Client the build runs on the cluster, where a relative path means nothing."""
    pytest.importorskip("ray")
    (tmp_path / "a.txt").write_text("some text")
    args = ["--corpus", str(tmp_path), "--ray", "ray://127.0.0.1:10001", *(["--out", out] if out else [])]
    assert main(args) == 1
    assert capsys.readouterr().err == (
        "build_index: error: --ray ray://127.0.0.1:10001 builds on the cluster: give --out as an absolute path there\n"
    )


# --------------------------------------------------------------------------- on a local cluster


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster of 2 CPUs, started the way ``--ray local:2`` starts one; the builds in
    this process use it (``ray_session`` keeps a session the process already has)."""
    pytest.importorskip("ray")
    from rest_spec.build_index.ray_build import ray_session

    with ray_session(RayTarget.parse("local:2")):
        yield


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, list[str]]:
    """Corpus flags: ~300 KB of this repository's sources in two directories, and chat records."""
    root = tmp_path_factory.mktemp("corpora")
    for package in ("build_index", "datastore"):
        (root / "code" / package).mkdir(parents=True)
        for source in sorted((REPO / package).glob("*.py")):
            (root / "code" / package / source.name).write_bytes(source.read_bytes())
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS * 20))
    return {
        "code": ["--corpus", str(root / "code")],
        "chat": ["--corpus", str(chats), "--field", "conversations", "--skip-last", "7", "--turns", "all"],
    }


def _build(*args: str | Path) -> None:
    assert main(["--quiet", *map(str, args)]) == 0


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _without_build(out: Path) -> dict:
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    build = manifest.pop("build")
    assert set(build) == {"args", "tokenize_seconds", "suffix_array_seconds"}
    return manifest


@pytest.mark.build
@pytest.mark.parametrize(
    "corpus, shard_tokens, shards",
    # the code corpus is this repository's sources: it grows, and with it the number of shards
    [("code", None, range(1, 2)), ("code", 20000, range(3, 100)), ("chat", 2000, range(3, 4))],
    ids=["code-one-shard", "code-several-shards", "chat-held-out"],
)
def test_ray_build_is_byte_identical_to_the_plain_build(tmp_path, ray_cluster, corpora, corpus, shard_tokens, shards):
    common = [*corpora[corpus], *(["--shard-tokens", str(shard_tokens)] if shard_tokens else [])]
    _build(*common, "--workers", "1", "--out", tmp_path / "plain")
    _build(*common, "--ray", "local:2", "--out", tmp_path / "ray")

    plain, ray = _files(tmp_path / "plain"), _files(tmp_path / "ray")
    count = len(fmt.read_manifest(tmp_path / "plain").shards)
    assert count in shards and len(plain) == 2 * count + 1  # each shard's tokens and suffix array, the manifest
    assert plain.keys() == ray.keys()
    for name in plain.keys() - {fmt.MANIFEST}:
        assert plain[name] == ray[name], name
    # the manifest: every field but the build's arguments and timings (shard hashes, corpus counts)
    assert _without_build(tmp_path / "plain") == _without_build(tmp_path / "ray")
    manifest = fmt.read_manifest(tmp_path / "ray")
    assert manifest.build["args"]["ray"] == "local:2"
    for shard in manifest.shards:
        fmt.open_shard(tmp_path / "ray", shard, manifest, full_check=True, check=True)
    if corpus == "chat":
        assert manifest.corpus["records"] == len(CONVERSATIONS) * 20 - 7 and manifest.corpus["held_out"] == 7
    assert leftovers(tmp_path) == []


@pytest.mark.build
def test_a_stop_signal_during_a_ray_build_leaves_the_previous_index(tmp_path, ray_cluster, corpora):
    """SIGTERM while shard tasks run: exit 143, the temporary directory gone, the old index intact,
    and the cluster still builds."""
    common = [*corpora["code"], "--shard-tokens", "300", "--out", tmp_path / "out", "--ray", "local:2"]
    _build(*corpora["chat"], "--out", tmp_path / "out")
    before = _files(tmp_path / "out")

    def signal_at_the_first_shard() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(tmp.glob("shard-*.npy") for tmp in tmp_path.glob(".out.tmp-*")):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=signal_at_the_first_shard, daemon=True)
    watcher.start()
    assert main(["--quiet", "--overwrite", *map(str, common)]) == 128 + signal.SIGTERM
    watcher.join()
    assert _files(tmp_path / "out") == before
    assert leftovers(tmp_path) == []

    _build(*common, "--overwrite")  # the session survived the interruption
    assert fmt.read_manifest(tmp_path / "out").build["args"]["ray"] == "local:2"


@pytest.mark.build
def test_a_corpus_error_in_the_read_task_is_the_plain_builds_one_line(tmp_path, ray_cluster, capsys):
    rows = [{"conversations": [{"from": "gpt", "value": f"answer {i}"}]} for i in range(50)]
    rows[30] = {"conversations": 5}  # found only mid-stream, by the read task
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    errors = []
    for ray in ([], ["--ray", "local:2"]):
        assert (
            main(["--quiet", "--corpus", str(chats), "--field", "conversations", "--out", str(tmp_path / "out"), *ray])
            == 1
        )
        errors.append(capsys.readouterr().err)
    if int(importlib.metadata.version("datasets").split(".")[0]) >= 5:  # it reads the row; the build's check names it
        expected = (
            f"{chats}: field 'conversations' holds int; "
            "expected a string, a list of strings or a list of role/content messages"
        )
    else:  # its JSON reader refuses the file at that row
        expected = (
            f"cannot read {chats}: JSON parse error: Column(/conversations) changed from array to number in row 30"
        )
    assert errors[0] == errors[1] == f"build_index: error: {expected}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]
